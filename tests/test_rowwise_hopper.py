"""The shared-memory row softmax for Hopper GPUs (`jaxsoftmax.rowwise_hopper`): against
the float64 truth under the 2x rule (docs/testing.md), run by Pallas' Mosaic GPU
interpreter on a CPU and compiled on a Hopper GPU; its CUDA lowering; what it refuses."""

import jax
import jax.numpy as jnp
import pytest

from jaxsoftmax import _backend, rowwise_hopper
from jaxsoftmax._backend import mosaic_gpu as mosaic_device
from tolerance import assert_2x, truth

ON_GPU = jax.default_backend() == "gpu"


def _softmax_in(dtype):
  return lambda x: jax.nn.softmax(x.astype(jnp.float32), axis=-1).astype(dtype)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=["bfloat16", "float16"])
@pytest.mark.parametrize("kind", ["normal", "large", "minus-inf"])
def test_matches_truth(key, monkeypatch, dtype, kind):
  # 7 rows on two "SMs": the CTAs walk 4 and 3 rows through 3 slots, so slots are reused
  # after their stores; two blocks a row.
  if ON_GPU and not mosaic_device.hopper_device():
    pytest.skip("needs a Hopper GPU")
  if not ON_GPU:
    monkeypatch.setattr(_backend, "num_cores", lambda: 2)
  x = 4 * jax.random.normal(key, (7, 2 * rowwise_hopper.BLOCK_COLS))
  if kind == "large":  # near float16's largest value, and huge bfloat16 ones: exp's
    # argument must stay exact (0) at the row's max
    x = x + 6e4 if dtype == jnp.float16 else x * 1e30
  if kind == "minus-inf":
    x = x.at[:, ::3].set(-jnp.inf)
  x = x.astype(dtype)
  got = rowwise_hopper.softmax(x, interpret=not ON_GPU)
  assert got.dtype == dtype
  assert_2x(got, _softmax_in(dtype)(x), truth(lambda x: jax.nn.softmax(x, axis=-1), x),
            what="softmax")


@pytest.mark.parametrize("shape", [(4096, 32768), (300, 16384)])
def test_lowers_for_cuda(shape):
  # Runs only on a Hopper GPU, but lowers for CUDA anywhere: catches Mosaic GPU API drift.
  lowered = jax.jit(rowwise_hopper.softmax).trace(
      jax.ShapeDtypeStruct(shape, jnp.bfloat16)).lower(lowering_platforms=("cuda",))
  assert "softmax_rows_smem_mosaic_gpu" in lowered.as_text()


def test_refuses_what_it_cannot_take():
  with pytest.raises(ValueError, match="stages 16-bit rows, not float32"):
    rowwise_hopper.softmax(jnp.zeros((2, 4096)))
  with pytest.raises(ValueError, match="must be a multiple of 2048"):
    rowwise_hopper.softmax(jnp.zeros((2, 5000), jnp.bfloat16))
  with pytest.raises(ValueError, match="more than"):
    rowwise_hopper.softmax(jnp.zeros((2, 65536), jnp.bfloat16))
