"""Softmax cross-entropy with integer labels: `api` (the public function, its
derivatives and row ops) and `reference` (the plain-JAX truth, also its XLA path)."""

from jaxsoftmax.cross_entropy.api import cross_entropy

__all__ = ["cross_entropy"]
