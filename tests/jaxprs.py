"""What a traced program runs: the Pallas kernels in a jaxpr, those inside its sub-jaxprs
(jit, custom derivatives, shard_map) and inside the `LinearMap`s that the ops'
derivatives bind (`jaxsoftmax.linear_map.kernel_jaxpr`) included."""

from jax.extend import core

from jaxsoftmax._core.linear_map import kernel_jaxpr


def pallas_calls(jaxpr) -> list[tuple[str, int]]:
  """(kernel name, number of outputs) of every pallas_call that ``jaxpr`` runs."""
  found = []
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "pallas_call":
      # The kernel's name is param "name" in newer JAX, "name_and_src_info" in 0.11.
      name = eqn.params.get("name", eqn.params.get("name_and_src_info"))
      found.append((getattr(name, "name", name), len(eqn.outvars)))
    inner = kernel_jaxpr(eqn)
    for sub in [*core.jaxprs_in_params(eqn.params), *([inner.jaxpr] if inner else [])]:
      found += pallas_calls(sub)
  return found


def kernel_names(jaxpr) -> list[str]:
  """The names of the pallas_calls that ``jaxpr`` runs."""
  return [name for name, _ in pallas_calls(jaxpr)]


def array_shapes(jaxpr) -> list[tuple[int, ...]]:
  """The shapes of every array that ``jaxpr``'s operations make, those of its sub-jaxprs
  and of the pallas_calls' outputs included (not the arrays inside a kernel)."""
  found = []
  for eqn in jaxpr.eqns:
    found += [out.aval.shape for out in eqn.outvars if hasattr(out.aval, "shape")]
    if eqn.primitive.name == "pallas_call":
      continue
    inner = kernel_jaxpr(eqn)
    for sub in [*core.jaxprs_in_params(eqn.params), *([inner.jaxpr] if inner else [])]:
      found += array_shapes(sub)
  return found
