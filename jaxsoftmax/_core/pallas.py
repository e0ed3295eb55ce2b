"""The one module that imports a Pallas backend.

Every kernel in jaxsoftmax is written against the names exported here, so moving from
Pallas' Triton lowering (deprecated upstream since JAX 0.11) to another backend is this
file's work alone.

Where a call runs (docs/numerics.md, "What runs where"):

- on a GPU, the Pallas kernels, compiled;
- elsewhere (a CPU), by default each op's XLA path: plain jnp with the same numerics
  contract (float32 accumulation, the same NaN, infinity and masking rules), fast
  where interpreted kernels are 100-1000x slower than XLA (`xla_by_default`);
- the kernels in Pallas interpret mode, on any device, when asked for: by the
  ``interpret=`` argument of a public function, else by the environment variable
  ``JAXSOFTMAX_INTERPRET`` (``1``/``true``; ``0``/``false`` asks for compiled kernels),
  else by naming a kernel (a tiling, a kernel backend) off a GPU. That is how the tests
  check the kernels on a CPU and in CI.

The choice is made when a function is traced; it is a static argument of every jitted
entry point, so changing it later retraces instead of reusing a stale compilation.
"""

from __future__ import annotations

import functools
import os
import warnings

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
from jax.sharding import ManualAxisType

__all__ = ["pl", "load", "store", "dot", "exp2", "pallas_call", "atomic_add",
           "resolve_interpret", "xla_by_default", "resolve_deterministic", "num_cores",
           "varying_axes", "vary_together", "vary_over", "varying_like"]

# The Triton lowering warns on every compilation that it is deprecated. That is a
# message for kernel authors (this file is where the move will happen), not for users
# of jaxsoftmax, so it is filtered by its exact text and nothing else.
warnings.filterwarnings(
    "ignore",
    message="The Pallas Triton backend is deprecated",
    category=DeprecationWarning,
)

store = plgpu.store


def load(ref, *, mask=None, other=None):
  """Masked load; ``other`` fills the masked-off elements and is dropped when there is
  no mask (the Triton lowering rejects ``other`` without a mask)."""
  return plgpu.load(ref, mask=mask, other=None if mask is None else other)

_ENV = "JAXSOFTMAX_INTERPRET"


# XLA's own switches for run-to-run identical results on the GPU.
_DETERMINISTIC_XLA_FLAGS = ("--xla_gpu_deterministic_ops=true",
                            "--xla_gpu_exclude_nondeterministic_ops=true")


def resolve_deterministic(deterministic: bool | None) -> bool:
  """Whether kernels must give bit-identical results from run to run (no atomic adds):
  the argument when not None, else whether XLA_FLAGS asks XLA for the same."""
  if deterministic is not None:
    if not isinstance(deterministic, bool):
      raise TypeError(f"deterministic must be a bool or None, got {deterministic!r}")
    return deterministic
  flags = os.environ.get("XLA_FLAGS", "").lower().split()
  return any(flag in flags for flag in _DETERMINISTIC_XLA_FLAGS)


def _asked_interpret(interpret: bool | None) -> bool | None:
  """The ``interpret=`` argument, else ``JAXSOFTMAX_INTERPRET``; None when neither says."""
  if interpret is not None:
    if not isinstance(interpret, bool):
      raise TypeError(f"interpret must be a bool or None, got {interpret!r}")
    return interpret
  env = os.environ.get(_ENV, "").strip().lower()
  if env in ("1", "true", "yes"):
    return True
  if env in ("0", "false", "no"):
    return False
  if env:
    raise ValueError(f"{_ENV}={env!r}: expected 1/true/yes or 0/false/no")
  return None


def resolve_interpret(interpret: bool | None) -> bool:
  """Whether the kernels, where they run, run interpreted: as asked (the argument, else
  the environment), else exactly when JAX's default backend is not a GPU."""
  asked = _asked_interpret(interpret)
  return jax.default_backend() != "gpu" if asked is None else asked


def xla_by_default(interpret: bool | None, *, kernel_asked: bool = False) -> bool:
  """Whether a call takes its op's XLA path instead of the Pallas kernels: off a GPU,
  unless the kernels are asked for (``interpret=``, ``JAXSOFTMAX_INTERPRET``, or, with
  ``kernel_asked``, an argument that only a kernel takes, such as a tiling)."""
  return (not kernel_asked and _asked_interpret(interpret) is None
          and jax.default_backend() != "gpu")


@functools.cache
def num_cores() -> int:
  """Streaming multiprocessors of the default GPU (132 on an H100/H200 SXM).

  Tiling heuristics size their grids from it. Without a GPU (interpret mode) the
  H100/H200 value is used so that tilings, and hence tests, do not depend on the host.
  """
  device = jax.devices()[0]
  return int(getattr(device, "core_count", 0) or 132)


def even_groups(n: int, wanted: int) -> tuple[int, int]:
  """(groups, items per group) that cut n items into at most ``wanted`` groups of one
  size, each holding an item (the last may be shorter): how grids share out row blocks
  or vocabulary tiles among their programs."""
  per = pl.cdiv(n, max(1, min(wanted, n)))
  return pl.cdiv(n, per), per


def dot(a, b, *, trans_b: bool = False, trans_a: bool = False):
  """A matrix product on the tensor cores, accumulated in float32. float32 operands use
  full float32 precision (Triton would otherwise round them to tf32)."""
  precision = jax.lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
  return plgpu.dot(a, b, trans_a=trans_a, trans_b=trans_b, precision=precision)


def exp2(interpret: bool):
  """2**x for float32 tiles inside kernels.

  Compiled, this is the bare hardware instruction (ex2.approx.ftz: about 2 ulp, results
  below 2**-126 flushed to 0), which libdevice's exp2f wraps in a few more instructions
  for denormals; those instructions bound bfloat16 kernels by issue rate on an H200.
  Interpreted, it is jnp.exp2.
  """
  if interpret:
    return jnp.exp2

  def hardware_exp2(x):
    [y] = plgpu.elementwise_inline_asm(
        "ex2.approx.ftz.f32 $0, $1;", args=[x], constraints="=f,f", pack=1,
        result_shape_dtypes=[jax.ShapeDtypeStruct(x.shape, jnp.float32)])
    return y

  return hardware_exp2


def barrier(interpret: bool):
  """A barrier of the program's threads (bar.sync, which also orders their global memory
  accesses), for a kernel that reads back a tile it stored; interpreted, nothing."""
  return (lambda: None) if interpret else plgpu.debug_barrier


# Inside `jax.shard_map` with its default check_vma=True, every value carries the manual
# mesh axes it varies over, and JAX checks them. Outside a shard_map the sets are empty
# and these helpers change nothing.


def varying_axes(*trees) -> frozenset:
  """The manual mesh axes that some array of ``trees`` varies over."""
  return frozenset().union(*(jax.typeof(a).manual_axis_type.varying
                             for a in jax.tree.leaves(trees)))


def vary_together(*arrays):
  """``arrays`` (None passes), each made to vary over every axis one of them varies over
  (``jax.lax.pcast(..., to="varying")``, free at run time). The ops call it on their
  inputs before their custom derivatives: a gradient computed from varying values
  varies, and JAX wants each cotangent typed as its input, so an invariant weight
  beside sharded activations gets its gradient summed over the axes (the transpose of
  the cast), as XLA's own autodiff does."""
  return vary_over(arrays, varying_axes(arrays))


def vary_over(tree, axes: frozenset):
  """Each array of ``tree`` made to vary over ``axes`` too (see `vary_together`)."""
  def vary(x):
    missing = tuple(a for a in axes if a not in varying_axes(x))
    return jax.lax.pcast(x, missing, to="varying") if missing else x

  return jax.tree.map(vary, tree)


def varying_like(out_shape, args):
  """``out_shape`` (a ShapeDtypeStruct or a pytree of them) declared to vary over every
  manual mesh axis that one of ``args`` varies over: Pallas needs each kernel output's
  axes (``ShapeDtypeStruct.manual_axis_type``), which it cannot infer from a kernel
  body. Every kernel launch here goes through this."""
  axis_type = ManualAxisType(varying=varying_axes(args))
  return jax.tree.map(
      lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, manual_axis_type=axis_type), out_shape)


def pallas_call(kernel, *, name: str, grid, in_specs, out_specs, out_shape,
                num_warps: int, num_stages: int, interpret: bool,
                input_output_aliases=None):
  """``pl.pallas_call`` with the backend's compiler parameters filled in and the
  outputs' varying mesh axes taken from the operands (`varying_like`)."""
  def call(*args):
    return pl.pallas_call(
        kernel,
        name=name,
        grid=grid,
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=varying_like(out_shape, args),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        input_output_aliases=input_output_aliases or {},
    )(*args)
  return call


def atomic_add(ref, idx, val):
  """ref[idx] += val as one atomic read-modify-write per element (float32 sums that
  several programs write into). No mask: interpret mode has none for atomics, so the
  target must hold the whole block."""
  return plgpu.atomic_add(ref, idx, val)
