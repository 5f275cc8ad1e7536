"""Attention sinks (gpt-oss): one learned logit s_h per query head that joins every row's softmax
denominator and adds no value,

    p_ij = exp(l_ij) / (exp(s_h) + sum_j' exp(l_ij'))        out_i = sum_j p_ij v_j

(l: the logits after score_mod and bias; the sink passes through neither). It is composed from the
logsumexp L every backend returns, with no kernel of its own (`apply`):

    L' = logaddexp(L, s_h)        out' = out * exp(L - L')

exact in float32. Gradients, two ways:
- autodiff through `apply`, where the backend's backward honours the logsumexp's cotangent (XLA,
  small_seq: `Backend.attention_with_sinks`'s default);
- a backward that takes the output and logsumexp it differentiates (cuDNN's graph, the ring's
  blocks) is run with (out', L') in place of (out, L): the probabilities it recomputes,
  exp(l - L'), are the sink's p, and its row term <dO, out'> is the sink softmax's; the sinks'
  own gradient is `gradient`, d s_h = -sum_i exp(s_h - L'_i) <dO_i, out'_i>.
A row with nothing to attend (L = -inf) gives 0 and L' = s_h.
"""
from __future__ import annotations

from typing import Any

import jax.numpy as jnp

COMPOSED = "sinks: composed from the logsumexp (exact, no extra kernel)"
NATIVE = "sinks: cuDNN's own in the forward graph (sink_token), the backward composed"


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


def _rows(sinks: Any, lse: Any) -> Any:
    """`sinks` (N,) as the logsumexp's (B, N, T), in its accumulation dtype."""
    acc = jnp.promote_types(lse.dtype, jnp.float32)
    return jnp.broadcast_to(sinks.astype(acc)[None, :, None], lse.shape)


def apply(out: Any, lse: Any, sinks: Any) -> tuple[Any, Any]:
    """(out', L') of a backend's `out` (B, T, N, H_v) and `lse` (B, N, T) with `sinks` (N,);
    differentiable (through `out`, `lse` and `sinks`)."""
    sink = _rows(sinks, lse)
    lse = lse.astype(sink.dtype)
    # A row with nothing to attend under a -inf sink has L' = -inf: guarded so that neither the value
    # (exp(-inf - -inf)) nor logaddexp's gradient at (-inf, -inf) is NaN.
    both = jnp.isneginf(lse) & jnp.isneginf(sink)
    with_sink = jnp.where(both, -jnp.inf, jnp.logaddexp(jnp.where(both, 0.0, lse), sink))
    # each row's share left to the keys: 0 where nothing is attended
    kept = jnp.where(jnp.isneginf(lse), 0.0, jnp.exp(lse - jnp.where(both, 0.0, with_sink)))
    out = (out.astype(sink.dtype) * jnp.swapaxes(kept, 1, 2)[..., None]).astype(out.dtype)
    return out, with_sink


def gradient(d_out: Any, out: Any, lse: Any, sinks: Any, rows: Any = None) -> Any:
    """d sinks (N,), in the sinks' dtype, from the cotangent `d_out` of the output `out` = out' and
    its logsumexp `lse` = L' (both with the sink, `apply`): -sum over batch and rows of
    exp(s_h - L') <dO, out'>. `rows`: (B, T) bool, the rows that hold results (None: all); the others
    (padding, rows a graph leaves unwritten) add nothing, whatever they hold."""
    sink = _rows(sinks, lse)
    lse = lse.astype(sink.dtype)
    share = jnp.where(jnp.isneginf(sink), 0.0, jnp.exp(sink - jnp.where(jnp.isneginf(lse), 0.0, lse)))
    dot = jnp.swapaxes(jnp.sum(d_out.astype(sink.dtype) * out.astype(sink.dtype), axis=-1), 1, 2)  # (B, N, T)
    terms = share * dot
    if rows is not None:
        terms = jnp.where(rows[:, None, :], terms, 0.0)
    return (-jnp.sum(terms, axis=(0, 2))).astype(sinks.dtype)
