"""The seam between an op's public function and its kernel backends.

A backend is an object, usually a module (`jaxsoftmax.attention.triton`), with a
``NAME`` and ``unsupported(call)``: the reason it cannot run ``call``, or None when it
can; ``call`` is the op's own description of one call, every static choice and no
arrays (attention's `Call`). Each op adds the kernel entry points its backends share
(`jaxsoftmax.attention.call.AttentionBackend`). A `Registry` lists an op's backends in
order of preference, fastest first, and applies the one dispatch rule (docs/architecture.md,
"Add an attention backend"): a backend named by the caller runs the call or raises why
it cannot; no name takes the first backend that can, unless it defers the call to a
later one that can too (an optional ``defers(call)``: why a later backend is the faster
for what the call holds, measured; None where it is not).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Generic, Protocol, TypeVar, runtime_checkable

__all__ = ["Backend", "Registry", "check_implementation"]


def check_implementation(op: str, implementation, allowed: tuple) -> None:
  """A ValueError naming the argument when ``implementation`` is none of ``allowed``."""
  if implementation not in allowed:
    raise ValueError(f"{op}: implementation must be one of {allowed}, got "
                     f"{implementation!r}")


@runtime_checkable
class Backend(Protocol):
  """What every kernel backend of every op provides."""

  NAME: str

  def unsupported(self, call: Any) -> str | None:
    """Why this backend cannot run ``call``, or None when it can."""


B = TypeVar("B", bound=Backend)


@dataclasses.dataclass(frozen=True)
class Registry(Generic[B]):
  """An op's kernel backends, in order of preference.

  Attributes:
    op: the public function's name, which starts every error.
    backends: the backends, fastest first where each can run a call.
    otherwise: what the error says to do when no backend can run a call.
  """

  op: str
  backends: tuple[B, ...]
  otherwise: str = ""

  def __post_init__(self):
    names = [backend.NAME for backend in self.backends]
    if len(set(names)) != len(names):
      raise ValueError(f"{self.op}: two backends share a name: {names}")

  @property
  def names(self) -> tuple[str, ...]:
    return tuple(backend.NAME for backend in self.backends)

  @property
  def implementations(self) -> tuple:
    """What ``implementation=`` takes: None (the first that can run the call), each
    backend's name, and "xla" (the op's XLA path)."""
    return (None, *self.names, "xla")

  def __getitem__(self, name: str) -> B:
    for backend in self.backends:
      if backend.NAME == name:
        return backend
    raise KeyError(f"{self.op}: no backend named {name!r} (the backends: {self.names})")

  def select(self, implementation: str | None, call: Any) -> B:
    """The backend that runs ``call``: the one named ``implementation``, or with None
    the first that can and does not defer it (else the first that can); a ValueError
    says why when it cannot (or none can)."""
    if implementation is not None:
      backend = self[implementation]
      why = backend.unsupported(call)
      if why is not None:
        raise ValueError(f"{self.op}: implementation={implementation!r} cannot run this "
                         f"call: {why}")
      return backend
    reasons, deferring = [], None
    for backend in self.backends:
      why = backend.unsupported(call)
      if why is not None:
        reasons.append(f"{backend.NAME}: {why}")
      elif getattr(backend, "defers", lambda call: None)(call) is None:
        return backend
      elif deferring is None:
        deferring = backend
    if deferring is not None:
      return deferring
    raise ValueError(f"{self.op}: no kernel backend can run this call ("
                     + "; ".join(reasons) + ")" + (f"; {self.otherwise}" if self.otherwise
                                                   else ""))
