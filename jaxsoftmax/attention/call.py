"""`Call`: one attention call as the backends see it, every static choice and no arrays;
`AttentionBackend`: what a backend gives (`jaxsoftmax._core.backends`).

`api.dot_product_attention` builds the call after checking the inputs; each backend
(`attention.decode.backend`, `attention.mosaic_gpu`, `attention.triton`) says from it
whether it can run the call (``unsupported``), and runs it (``fwd``, and ``bwd`` where it
has a backward of its own).
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple, Protocol, runtime_checkable

import jax.numpy as jnp

from jaxsoftmax._core.backends import Backend
from jaxsoftmax.attention.masks import MaskSpec


@dataclasses.dataclass(frozen=True)
class Call:
  """B, T, N, H: the queries' shape (B T N H); S, K: the keys' length and heads.

  Attributes:
    Hv: the values' head dim; None (given) means H, which it then holds.
    has_bias, has_alibi: an additive bias array, ALiBi slopes are given.
    dtype: the inputs' dtype name.
    spec: the static masks (causal, window, whether segment ids or a mask array are
      given).
    scale: the logits' scale; softcap: the soft cap, or None.
    block_sizes: the caller's tiles for a backend, or None for its defaults.
    interpret: run the kernels in Pallas interpret mode.
    deterministic: the gradients must be bit-identical from run to run (no atomic adds).
    packed: the caller's segment ids are given (packed sequences), not a key mask run
      as segment ids; backends may defer such calls (`_core.backends.Registry`).
  """

  B: int
  T: int
  S: int
  N: int
  K: int
  H: int
  dtype: str
  spec: MaskSpec
  scale: float
  softcap: float | None
  block_sizes: Any
  interpret: bool
  deterministic: bool = False
  Hv: int | None = None
  has_bias: bool = False
  has_alibi: bool = False
  packed: bool = False

  def __post_init__(self):
    if self.Hv is None:
      object.__setattr__(self, "Hv", self.H)

  @property
  def itemsize(self) -> int:
    return jnp.dtype(self.dtype).itemsize

  @property
  def score_terms(self) -> tuple[str, ...]:
    """The arguments that change the scores beyond the masks' positions: "bias",
    "mask", "alibi_slopes", those given (the Triton kernels run them)."""
    return tuple(name for name, here in (("bias", self.has_bias),
                                         ("mask", self.spec.has_mask),
                                         ("alibi_slopes", self.has_alibi)) if here)


class AuxArrays(NamedTuple):
  """The optional arrays of one attention call, each None when not given: query and key
  lengths (B,) and query and key segment ids (B, T) and (B, S), all int32; the score
  terms of the Triton kernels: a user ``mask`` (int8, 0 = masked) and an additive
  ``bias`` (its own float dtype), each rank 4 and broadcastable to (B, N, T, S) with
  every axis 1 or full, and ALiBi slopes (N,) float32. The one form every backend uses:
  the arrays, and in every kernel its refs (`split_refs`); the kernels take the present
  ones as inputs in this order."""

  q_lengths: Any = None
  kv_lengths: Any = None
  q_segments: Any = None
  kv_segments: Any = None
  mask: Any = None
  bias: Any = None
  alibi_slopes: Any = None

  @property
  def lengths_and_segments(self) -> tuple:
    """(q_lengths, kv_lengths, q_segments, kv_segments): all the Hopper kernels take."""
    return tuple(self[:4])

  @property
  def present(self) -> tuple[bool, ...]:
    """Which are given: the static part, what a kernel needs to split its refs."""
    return tuple(a is not None for a in self)

  @classmethod
  def split_refs(cls, refs, present) -> tuple["AuxArrays", tuple]:
    """(the kernel's aux refs by name, None where absent; the refs after them), for a
    kernel whose next inputs are the present ones, in this order."""
    refs = tuple(refs)
    given = iter(refs[:sum(present)])
    return cls(*(next(given) if here else None for here in present)), refs[sum(present):]


@runtime_checkable
class AttentionBackend(Backend, Protocol):
  """An attention kernel backend: a module whose ``NAME``, ``unsupported`` and these
  `api` dispatches to. Every forward returns the same residuals, so that one backend's
  backward may differentiate another's forward (`api.select_backward`)."""

  def fwd(self, q, k, v, aux_arrays: AuxArrays, call: Call, *, float32_output: bool,
          sinks=None):
    """(o, m, log2_l[, o in float32 with ``float32_output``]): the output and the row
    statistics (m, log2 l) in float32, (B, N, T). ``sinks``: None, or (B, N) float32
    logits, one per query head, that join each row's softmax (`logits.join_sink`): the
    output and the statistics include them."""

  def backward_unsupported(self, call: Call) -> str | None:
    """Why this backend's backward cannot differentiate ``call`` (which its forward ran),
    or None when it can (then it is a `BackwardBackend`)."""


@runtime_checkable
class BackwardBackend(AttentionBackend, Protocol):
  """A backend with a backward of its own, for the calls ``backward_unsupported``
  allows."""

  def bwd(self, q, k, v, o, m, log2_l, do, aux_arrays: AuxArrays, call: Call, *,
          grad_dtype=None, delta=None):
    """(dq, dk, dv) from the forward's residuals and the output's cotangent ``do``."""
