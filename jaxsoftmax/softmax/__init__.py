"""softmax, log_softmax and logsumexp: `api` (the public functions, their derivatives
and their row ops) and `reference` (the plain-JAX truth, also their XLA path)."""

from jaxsoftmax.softmax.api import log_softmax, logsumexp, softmax

__all__ = ["softmax", "log_softmax", "logsumexp"]
