"""Two partial softmax results of the same queries over disjoint keys, merged by their logsumexps."""
from __future__ import annotations

from typing import Any

import jax.numpy as jnp


def merge(a: tuple[Any, Any], c: tuple[Any, Any]) -> tuple[Any, Any]:
    """(out fp32 (B, T, N, Hv), lse (B, N, T)) of two (normalized output, logsumexp) results of the same
    queries over disjoint keys; rows with nothing to attend in both stay 0 / -inf."""
    (out_a, lse_a), (out_c, lse_c) = a, c
    lse = jnp.logaddexp(lse_a, lse_c)
    safe = jnp.where(jnp.isneginf(lse), 0.0, lse)
    share = lambda x: jnp.swapaxes(jnp.where(jnp.isneginf(x), 0.0, jnp.exp(x - safe)), 1, 2)[..., None]  # noqa: E731
    return out_a.astype(jnp.float32) * share(lse_a) + out_c.astype(jnp.float32) * share(lse_c), lse
