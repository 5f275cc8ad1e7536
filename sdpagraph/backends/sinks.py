"""Attention sinks (gpt-oss): one learned logit s_h per query head that joins every row's softmax
denominator and adds no value,

    p_ij = exp(l_ij) / (exp(s_h) + sum_j' exp(l_ij'))        out_i = sum_j p_ij v_j

(l: the logits after score_mod and bias; the sink passes through neither). It is composed from the
logsumexp L every backend returns, with no kernel of its own:

    L' = logaddexp(L, s_h)        out' = out * exp(L - L')

exact in float32, and differentiable by autodiff through the backend's output and logsumexp:
d s_h = -sum_i exp(s_h - L'_i) <dO_i, out'_i>, and the logits' gradient takes the logsumexp's
cotangent, so the backend's backward must honour one. A row with nothing to attend (L = -inf) gives
0 and L' = s_h.
"""
from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

from sdpagraph.backends.base import Backend
from sdpagraph.errors import SdpagraphError

_RING = "the context-parallel ring's backward takes dO alone (its logsumexp is returned without a gradient)"

COMPOSED = "sinks: composed from the logsumexp (exact, no extra kernel)"


class SinksGradientError(SdpagraphError, NotImplementedError):
    """A call with sinks is differentiated where its backward ignores the logsumexp's cotangent."""


def check(sinks: Any, num_heads: int) -> Any:
    """`sinks` validated: shape (N,) (one logit per query head), a floating dtype; an array or a
    `jax.ShapeDtypeStruct` (check_support) is returned as given, anything else as a jax array."""
    if not (hasattr(sinks, "shape") and hasattr(sinks, "dtype")):
        sinks = jnp.asarray(sinks)
    if not jnp.issubdtype(sinks.dtype, jnp.floating):
        raise TypeError(f"sinks must be a floating array (float32 recommended), got dtype {sinks.dtype}")
    if tuple(sinks.shape) != (num_heads,):
        raise ValueError(f"sinks must have shape (N,) = ({num_heads},), one logit per query head; "
                         f"got shape {tuple(sinks.shape)}")
    return sinks


def backend_reason(backend: Backend) -> str | None:
    """Why `backend` cannot differentiate a call with sinks, or None when it can (its
    `lse_without_gradient`): calls that may be differentiated (`training=True`) leave it; an inference
    call keeps it, and a gradient through it raises `SinksGradientError`."""
    why = backend.lse_without_gradient
    return None if why is None else f"sinks need the logsumexp's gradient, and {why}"


def inference_only(backend: Backend) -> str | None:
    """What a gradient through an inference call with sinks on `backend` raises (None: it is exact)."""
    why = backend_reason(backend)
    return None if why is None else f"{why}; pass training=True to differentiate a call with sinks"


def context_parallel_reason(strategy: str, backend: Backend) -> str | None:
    """What a gradient through a context-parallel call with sinks (its `strategy`, its blocks'
    `backend`) raises, or None where it is exact."""
    why = f"sinks need the logsumexp's gradient, and {_RING}" if strategy == "ring" else backend_reason(backend)
    if why is None:
        return None
    return (f"{why}; to differentiate a context-parallel call with sinks use context_parallel_strategy="
            "'all_to_all' or 'halo' with implementation='xla'")


def compose(out: Any, lse: Any, sinks: Any, no_gradient: str | None = None) -> tuple[Any, Any]:
    """(out', L') of the backend's `out` (B, T, N, H_v) and `lse` (B, N, T) with `sinks` (N,).
    `no_gradient`: why the backend's logsumexp has no gradient, and what to do; differentiating
    through it then raises `SinksGradientError` with it (the gradient would be silently wrong)."""
    if no_gradient is not None:
        lse = _without_gradient(no_gradient, lse)
    acc = jnp.promote_types(lse.dtype, jnp.float32)
    lse = lse.astype(acc)
    sink = jnp.broadcast_to(sinks.astype(acc)[None, :, None], lse.shape)
    # A row with nothing to attend under a -inf sink has L' = -inf: guarded so that neither the value
    # (exp(-inf - -inf)) nor logaddexp's gradient at (-inf, -inf) is NaN.
    both = jnp.isneginf(lse) & jnp.isneginf(sink)
    with_sink = jnp.where(both, -jnp.inf, jnp.logaddexp(jnp.where(both, 0.0, lse), sink))
    # each row's share left to the keys: 0 where nothing is attended
    kept = jnp.where(jnp.isneginf(lse), 0.0, jnp.exp(lse - jnp.where(both, 0.0, with_sink)))
    out = (out.astype(acc) * jnp.swapaxes(kept, 1, 2)[..., None]).astype(out.dtype)
    return out, with_sink


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _without_gradient(reason: str, lse: Any) -> Any:
    return lse


def _without_gradient_fwd(reason: str, lse: Any) -> tuple[Any, None]:
    return lse, None


def _without_gradient_bwd(reason: str, _: None, d_lse: Any) -> Any:
    raise SinksGradientError(reason)


_without_gradient.defvjp(_without_gradient_fwd, _without_gradient_bwd)
