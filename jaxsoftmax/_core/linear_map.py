"""`LinearMap`: a linear map that runs a kernel when evaluated and is differentiated
through its pure-jnp twin, so that our ops support every mode of autodiff and still run
their kernels where training spends its time.

Each op (`softmax`, `cross_entropy`, ...) is a ``jax.custom_jvp`` whose forward is a
kernel and whose tangent is a `LinearMap` t ↦ f(res, t) of the residuals ``res`` (the
forward's outputs or statistics) and the input tangent ``t``:

- forward mode (``jax.jvp``, ``jacfwd``) evaluates f: its kernel;
- reverse mode (``jax.grad``, ``vjp``) linearizes and transposes: JAX evaluates the
  transpose map, whose kernel is the op's backward kernel, from the same residuals a
  ``custom_vjp`` would save, so a training step runs the same kernels as before;
- second order (``hessian``, ``jvp`` of ``grad``) differentiates f or its transpose in
  the residuals: that goes through the twin, the same map written in jnp;
- ``vmap`` folds the mapped axes into the rows where every array of the map is row by
  row, so the batched map is still a `LinearMap` and stays differentiable; a map with
  per-column arrays (a normalization's scale, its gradient summed over the rows) runs
  once per batch element instead (``fold_rows``).

A ``jax.custom_vjp`` cannot be differentiated in forward mode, and
``jax.custom_derivatives.linear_call`` neither batches nor takes tangents of its
residuals (which second order needs), hence a primitive of our own.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

__all__ = ["LinearMap", "kernel_jaxpr", "fold_mapped_axis", "unfold_mapped_axis"]

_BY_PRIMITIVE: dict = {}


def kernel_jaxpr(eqn):
  """The jaxpr of the kernel that a jaxpr equation of a `LinearMap` runs when compiled,
  or None for any other equation: what tests read to count the kernels of a step."""
  linear_map = _BY_PRIMITIVE.get(eqn.primitive)
  if linear_map is None:
    return None
  params = dict(eqn.params)
  return jax.make_jaxpr(lambda *args: linear_map._impl(*args, **params))(
      *(v.aval for v in eqn.invars))


# A map's functions take (residuals, linear inputs, **static parameters) and return a
# tuple of outputs; every array has the rows first. A residual may be None (an optional
# mask, say): the primitive carries only the arrays, and which are present.
MapFn = Callable[..., tuple]


class LinearMap:
  """t ↦ f(res, t), linear in the inputs ``t`` (a tuple), with residuals ``res``.

  Attributes:
    kernel: evaluates f (e.g. a Pallas kernel); it need not be differentiable.
    twin: f in plain jnp: its derivatives in ``res`` are f's. None for a map that is not
      differentiated in its residuals: doing so raises ``NotImplementedError(no_twin)``.
    out_types: ``out_types(res, t, **params)``: f's outputs as ShapeDtypeStructs (or
      arrays) under `jax.eval_shape`; None: the twin's.
    no_twin: without a twin, the message that says so (what is not supported, what to
      do instead). The transpose of a map without a twin runs its kernel inline.
    fold_rows: ``fold_rows(**params)``: whether every array of the map is row by row, so
      that ``vmap`` folds the mapped axis into the rows; where not, the batched map runs
      once per batch element (`lax.map`). True for every call by default.
    transpose: the map of the same residuals that is f's transpose in ``t`` (set by
      `pair`; a self-adjoint map is its own).
  """

  def __init__(self, name: str, *, kernel: MapFn, twin: MapFn | None,
               out_types: MapFn | None = None, no_twin: str = "",
               fold_rows: Callable[..., bool] = lambda **params: True):
    if twin is None and (out_types is None or not no_twin):
      raise ValueError(f"{name}: a map without a twin needs out_types and no_twin")
    self.name, self.kernel, self.twin, self.fold_rows = name, kernel, twin, fold_rows
    self.out_types, self.no_twin = out_types or twin, no_twin
    self.transpose: LinearMap | None = None
    self.p = Primitive(name)
    _BY_PRIMITIVE[self.p] = self
    self.p.multiple_results = True
    self.p.def_impl(self._impl)
    self.p.def_abstract_eval(self._abstract_eval)
    mlir.register_lowering(self.p, mlir.lower_fun(self._impl, multiple_results=True))
    ad.primitive_jvps[self.p] = self._jvp
    ad.primitive_transposes[self.p] = self._transpose
    batching.primitive_batchers[self.p] = self._batch

  def pair(self, transpose: "LinearMap") -> "LinearMap":
    """Makes ``transpose`` this map's transpose, and this map its transpose's."""
    self.transpose, transpose.transpose = transpose, self
    return self

  def __call__(self, res: tuple, t: tuple, **params) -> tuple:
    present = tuple(r is not None for r in res)
    arrays = tuple(r for r in res if r is not None)
    return tuple(self.p.bind(*arrays, *t, present=present, **params))

  @staticmethod
  def _split(args, present: tuple[bool, ...]):
    """(residual arrays, linear inputs) of the primitive's operands."""
    n = sum(present)
    return tuple(args[:n]), tuple(args[n:])

  @staticmethod
  def _restore(arrays, present: tuple[bool, ...]) -> tuple:
    """The residuals as the map's functions take them, None where absent."""
    arrays = iter(arrays)
    return tuple(next(arrays) if here else None for here in present)

  def _apply(self, fn: MapFn, arrays, t, present, params):
    return fn(self._restore(arrays, present), t, **params)

  def _impl(self, *args, present, **params):
    return list(self._apply(self.kernel, *self._split(args, present), present, params))

  def _abstract_eval(self, *avals, present, **params):
    # The output types from the operands' own (their mesh axes included: inside
    # jax.shard_map an output varies over the axes its operands vary over).
    out = jax.eval_shape(
        lambda *a: self._apply(self.out_types, *self._split(a, present), present, params),
        *avals)
    return [_shaped_array(o) for o in out]

  def _jvp(self, primals, tangents, *, present, **params):
    arrays, t = self._split(primals, present)
    arrays_dot, t_dot = self._split(tangents, present)
    res = self._restore(arrays, present)
    out = self(res, t, **params)
    # Linear in t: the t part is the map itself (its kernel).
    out_dot = [jnp.zeros(o.shape, o.dtype) for o in out]
    if not all(type(d) is ad.Zero for d in t_dot):
      out_dot = self(res, tuple(ad.instantiate_zeros(d) for d in t_dot), **params)
    # The residuals' part through the twin (floating residuals only: masks, labels and
    # other integer residuals have no tangent).
    moving = [i for i, d in enumerate(arrays_dot)
              if type(d) is not ad.Zero and jnp.issubdtype(arrays[i].dtype, jnp.inexact)]
    if moving:
      if self.twin is None:
        raise NotImplementedError(self.no_twin)

      def of_moving(*values):
        full = list(arrays)
        for i, value in zip(moving, values):
          full[i] = value
        return self._apply(self.twin, full, t, present, params)

      _, res_part = jax.jvp(of_moving, tuple(arrays[i] for i in moving),
                            tuple(arrays_dot[i] for i in moving))
      out_dot = [a + b for a, b in zip(out_dot, res_part)]
    return out, list(out_dot)

  def _transpose(self, cts, *args, present, **params):
    arrays, t = self._split(args, present)
    if any(ad.is_undefined_primal(r) for r in arrays):
      raise ValueError(f"{self.name}: a LinearMap is linear in its inputs t only, not in "
                       "its residuals")
    # An input of t that is known (a constant, e.g. a zero cotangent made concrete) adds a
    # constant to the output: it takes no part in the transpose.
    linear = [ad.is_undefined_primal(x) for x in t]
    if all(type(ct) is ad.Zero for ct in cts):
      return [None] * len(arrays) + [ad.Zero(x.aval.to_tangent_aval()) if lin else None
                                     for x, lin in zip(t, linear)]
    cts = tuple(ad.instantiate_zeros(ct) for ct in cts)
    res = self._restore(arrays, present)
    if self.transpose.twin is None:
      # Never differentiated: the backward runs inline (its kernels, and any collectives
      # or effects they hold, as the op's own code), its operands behind a guard that
      # turns any derivative of it into the map's message.
      res, cts = _no_derivatives((res, cts), self.transpose.no_twin)
      t_cts = self.transpose.kernel(res, cts, **params)
    else:
      t_cts = self.transpose(res, cts, **params)
    return [None] * len(arrays) + [ct if lin else None for ct, lin in zip(t_cts, linear)]

  def _batch(self, args, dims, *, present, **params):
    size = next(a.shape[d] for a, d in zip(args, dims) if d is not None)
    if not self.fold_rows(**params):
      def one(batched):
        batched = iter(batched)
        operands = [a if d is None else next(batched) for a, d in zip(args, dims)]
        arrays, t = self._split(operands, present)
        return self(self._restore(arrays, present), t, **params)

      outs = jax.lax.map(one, [jnp.moveaxis(a, d, 0) for a, d in zip(args, dims)
                               if d is not None])
      return list(outs), [0] * len(outs)
    # Every array is row by row: the mapped axis folds into the rows.
    flat = [fold_mapped_axis(a, size, d) for a, d in zip(args, dims)]
    arrays, t = self._split(flat, present)
    outs = self(self._restore(arrays, present), t, **params)
    return [unfold_mapped_axis(o, size) for o in outs], [0] * len(outs)



def fold_mapped_axis(a, size: int, axis: int | None):
  """``a`` with vmap's mapped axis (``axis``, of ``size``; None: ``a`` is not mapped, so
  it is broadcast) folded into its leading axis, which a batched map's rows or a
  kernel's batch then hold: (size · a.shape[0 or 1], ...)."""
  a = jnp.broadcast_to(a, (size,) + a.shape) if axis is None else jnp.moveaxis(a, axis, 0)
  return a.reshape((size * a.shape[1],) + a.shape[2:])


def unfold_mapped_axis(x, size: int):
  """The inverse of `fold_mapped_axis` on a result: the mapped axis leading again."""
  return x.reshape((size, -1) + x.shape[1:])


def _shaped_array(o) -> jax.core.ShapedArray:
  """The abstract value of a `jax.eval_shape` result, its varying mesh axes kept."""
  if o.manual_axis_type is None or o.manual_axis_type.empty:
    return jax.core.ShapedArray(o.shape, o.dtype)
  return jax.core.ShapedArray(o.shape, o.dtype, sharding=o.sharding,
                              manual_axis_type=o.manual_axis_type)


# The guard in front of a backward that has no twin: the identity, whose derivative (in
# any mode, and under jax.linearize) raises the map's message.
_guard_p = Primitive("linear_map_no_derivatives")
_guard_p.multiple_results = True
_guard_p.def_impl(lambda *x, message: x)
_guard_p.def_abstract_eval(lambda *avals, message: avals)
mlir.register_lowering(_guard_p, lambda ctx, *x, message: x)
batching.primitive_batchers[_guard_p] = (
    lambda args, dims, *, message: (_guard_p.bind(*args, message=message), dims))


def _refuse_derivatives(primals, tangents, *, message):
  raise NotImplementedError(message)


ad.primitive_jvps[_guard_p] = _refuse_derivatives


def _no_derivatives(tree, message: str):
  leaves, structure = jax.tree.flatten(tree)
  return jax.tree.unflatten(structure, _guard_p.bind(*leaves, message=message))
