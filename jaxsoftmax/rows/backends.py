"""The row ops' seam (`jaxsoftmax._core.backends`): softmax, log_softmax, logsumexp,
cross_entropy, layer_norm and rms_norm run one kernel backend, the row engine in Pallas'
Triton lowering (`engine`), or their XLA path (each op's `reference`). `xla_path` is
where every row op decides, so a second kernel backend goes in `REGISTRY`
(docs/architecture.md, "Add a backend")."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from jaxsoftmax._core import pallas
from jaxsoftmax._core.backends import Registry, check_implementation
from jaxsoftmax.rows import engine

__all__ = ["RowCall", "REGISTRY", "IMPLEMENTATIONS", "xla_path"]


@dataclasses.dataclass(frozen=True)
class RowCall:
  """One row op call's static choices: the op's name and the inputs' dtype."""

  op: str
  dtype: str


# Kernel backends in order of preference; the engine's `unsupported` takes every call.
REGISTRY: Registry = Registry("row ops", (engine,),
                              otherwise="implementation='xla' takes the XLA path")
IMPLEMENTATIONS = REGISTRY.implementations


def xla_path(op: str, x, *, implementation: str | None, interpret: bool | None,
             tiling) -> bool:
  """Whether a row op's call takes its XLA path: asked for (``implementation="xla"``),
  float64 or empty inputs, or by default off a GPU (`pallas.xla_by_default`; naming a
  kernel backend or giving a tiling asks for the kernels). A named backend that cannot
  run the call raises why."""
  check_implementation(op, implementation, IMPLEMENTATIONS)
  if implementation == "xla" or x.dtype == jnp.float64 or x.size == 0:
    return True
  kernel_asked = tiling is not None or implementation is not None
  if pallas.xla_by_default(interpret, kernel_asked=kernel_asked):
    return True
  REGISTRY.select(implementation, RowCall(op, jnp.dtype(x.dtype).name))
  return False
