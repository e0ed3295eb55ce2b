"""The row engine every row op runs on: ops declared as `RowOp`s (`engine`), cut into
programs by a `RowTiling` (`tiling`)."""

from jaxsoftmax.rows.engine import RowOp, RowResult, Tile, exp_for, row_call
from jaxsoftmax.rows.tiling import RowTiling, default_tiling

__all__ = ["RowOp", "RowResult", "RowTiling", "Tile", "default_tiling", "exp_for", "row_call"]
