"""Input checks and the row view of an array, shared by the ops' public functions.

The ops check their arguments here before any kernel runs (errors name the argument and
its shape), and see an array as (rows, columns) with `RowView`, the layout the row
kernels (`jaxsoftmax.rows`) take.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

__all__ = ["RowView", "check_floating", "check_where"]

@dataclasses.dataclass(frozen=True)
class RowView:
  """An array seen as rows: the reduced axes moved last and flattened into C columns.

  Hashable, so it can be a static argument of a jitted function.
  """

  shape: tuple[int, ...]
  axes: tuple[int, ...]  # the reduced axes, normalized and sorted

  @classmethod
  def of(cls, shape: tuple[int, ...], axis, *, fn: str) -> "RowView":
    """Normalizes ``axis`` (an int, a tuple of ints, or None for all axes)."""
    ndim = len(shape)
    if axis is None:
      axes = tuple(range(ndim))
    else:
      raw = axis if isinstance(axis, (tuple, list)) else (axis,)
      if not all(isinstance(a, int) and not isinstance(a, bool) for a in raw):
        raise TypeError(f"{fn}: axis must be an int, a tuple of ints or None, got {axis!r}")
      if any(not -ndim <= a < ndim for a in raw):
        raise ValueError(f"{fn}: axis {axis!r} is out of range for an input of shape {shape}")
      axes = tuple(sorted({a % ndim for a in raw}))
      if len(axes) != len(raw):
        raise ValueError(f"{fn}: axis {axis!r} repeats an axis")
    if not axes:
      raise ValueError(f"{fn}: needs at least one axis to reduce; input shape {shape}")
    return cls(tuple(shape), axes)

  @property
  def kept_axes(self) -> tuple[int, ...]:
    return tuple(a for a in range(len(self.shape)) if a not in self.axes)

  @property
  def n_rows(self) -> int:
    return math.prod(self.shape[a] for a in self.kept_axes)

  @property
  def n_cols(self) -> int:
    return math.prod(self.shape[a] for a in self.axes)

  def to_rows(self, a: jax.Array) -> jax.Array:
    """(shape) -> (R, C). A copy when the reduced axes are not already last."""
    moved = jnp.moveaxis(a, self.axes, range(-len(self.axes), 0))
    return moved.reshape(self.n_rows, self.n_cols)

  def from_rows(self, a: jax.Array) -> jax.Array:
    """(R, C) -> (shape), the inverse of `to_rows`."""
    moved_shape = tuple(self.shape[i] for i in self.kept_axes + self.axes)
    return jnp.moveaxis(a.reshape(moved_shape), range(-len(self.axes), 0), self.axes)

  def from_row_values(self, v: jax.Array, *, keepdims: bool) -> jax.Array:
    """(R,) -> the reduced shape, with size-1 reduced axes if ``keepdims``."""
    if keepdims:
      return v.reshape(tuple(1 if i in self.axes else d for i, d in enumerate(self.shape)))
    return v.reshape(tuple(self.shape[a] for a in self.kept_axes))

  def to_row_values(self, v: jax.Array) -> jax.Array:
    """The reduced shape (with or without keepdims) -> (R,)."""
    return v.reshape(self.n_rows)


def check_floating(x, name: str, fn: str) -> jax.Array:
  """``x`` as an array of a real floating dtype, or a TypeError naming it."""
  x = jnp.asarray(x)
  if not jnp.issubdtype(x.dtype, jnp.floating):
    raise TypeError(
        f"{fn}: {name} must have a real floating dtype (float32, bfloat16, float16, or "
        f"float64 on the reference path), got {x.dtype} with shape {x.shape}")
  return x


def check_optional_positive_int(value, name: str) -> None:
  """A ValueError naming ``name`` unless ``value`` is None or an int >= 1 (tiling
  fields that default to a heuristic)."""
  if value is not None and not (isinstance(value, int) and value >= 1):
    raise ValueError(f"{name} must be a positive int or None, got {value!r}")


def check_where(where, shape: tuple[int, ...], fn: str) -> jax.Array | None:
  """``where`` broadcast to ``shape`` as a bool array, or a clear error."""
  if where is None:
    return None
  where = jnp.asarray(where)
  if where.dtype != jnp.bool_:
    raise TypeError(f"{fn}: where must be a boolean array, got dtype {where.dtype}")
  try:
    return jnp.broadcast_to(where, shape)
  except ValueError:
    raise ValueError(
        f"{fn}: where of shape {where.shape} does not broadcast to the input shape "
        f"{shape}") from None
