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
- ``vmap`` folds the mapped axes into the rows (every map here is row by row), so the
  batched map is still a `LinearMap` and stays differentiable.

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

__all__ = ["LinearMap"]

# A map's functions take (residuals, linear inputs, **static parameters) and return a
# tuple of outputs; every array has the rows first.
MapFn = Callable[..., tuple]


class LinearMap:
  """t ↦ f(res, t), linear in the inputs ``t`` (a tuple), with residuals ``res``.

  Attributes:
    kernel: evaluates f (e.g. a Pallas kernel); it need not be differentiable.
    twin: f in plain jnp: its derivatives in ``res`` are f's.
    transpose: the map of the same residuals that is f's transpose in ``t`` (set by
      `pair`; a self-adjoint map is its own).
  """

  def __init__(self, name: str, *, kernel: MapFn, twin: MapFn):
    self.name, self.kernel, self.twin = name, kernel, twin
    self.transpose: LinearMap | None = None
    self.p = Primitive(name)
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
    return tuple(self.p.bind(*res, *t, n_res=len(res), **params))

  @staticmethod
  def _split(args, n_res: int):
    return tuple(args[:n_res]), tuple(args[n_res:])

  def _impl(self, *args, n_res, **params):
    return list(self.kernel(*self._split(args, n_res), **params))

  def _abstract_eval(self, *avals, n_res, **params):
    shapes = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in avals]
    out = jax.eval_shape(lambda *a: self.twin(*self._split(a, n_res), **params), *shapes)
    return [jax.core.ShapedArray(o.shape, o.dtype) for o in out]

  def _jvp(self, primals, tangents, *, n_res, **params):
    res, t = self._split(primals, n_res)
    res_dot, t_dot = self._split(tangents, n_res)
    out = self(res, t, **params)
    # Linear in t: the t part is the map itself (its kernel).
    out_dot = [jnp.zeros(o.shape, o.dtype) for o in out]
    if not all(type(d) is ad.Zero for d in t_dot):
      out_dot = self(res, tuple(ad.instantiate_zeros(d) for d in t_dot), **params)
    # The residuals' part through the twin (floating residuals only: masks, labels and
    # other integer residuals have no tangent).
    moving = [i for i, d in enumerate(res_dot)
              if type(d) is not ad.Zero and jnp.issubdtype(res[i].dtype, jnp.inexact)]
    if moving:
      def of_moving(*values):
        full = list(res)
        for i, value in zip(moving, values):
          full[i] = value
        return self.twin(tuple(full), t, **params)

      _, res_part = jax.jvp(of_moving, tuple(res[i] for i in moving),
                            tuple(res_dot[i] for i in moving))
      out_dot = [a + b for a, b in zip(out_dot, res_part)]
    return out, list(out_dot)

  def _transpose(self, cts, *args, n_res, **params):
    res, t = self._split(args, n_res)
    if any(ad.is_undefined_primal(r) for r in res):
      raise ValueError(f"{self.name}: a LinearMap is linear in its inputs t only, not in "
                       "its residuals")
    # An input of t that is known (a constant, e.g. a zero cotangent made concrete) adds a
    # constant to the output: it takes no part in the transpose.
    linear = [ad.is_undefined_primal(x) for x in t]
    if all(type(ct) is ad.Zero for ct in cts):
      return [None] * len(res) + [ad.Zero(x.aval.to_tangent_aval()) if lin else None
                                  for x, lin in zip(t, linear)]
    cts = tuple(ad.instantiate_zeros(ct) for ct in cts)
    t_cts = self.transpose(res, cts, **params)
    return [None] * len(res) + [ct if lin else None for ct, lin in zip(t_cts, linear)]

  def _batch(self, args, dims, *, n_res, **params):
    # Every map is row by row: the mapped axis folds into the rows.
    size = next(a.shape[d] for a, d in zip(args, dims) if d is not None)
    flat = []
    for a, d in zip(args, dims):
      a = (jnp.broadcast_to(a, (size,) + a.shape) if d is None
           else jnp.moveaxis(a, d, 0))
      flat.append(a.reshape((size * a.shape[1],) + a.shape[2:]))
    outs = self(*self._split(flat, n_res), **params)
    return [o.reshape((size, -1) + o.shape[1:]) for o in outs], [0] * len(outs)

