"""Softmax attention over blocks of keys: the XLA backend's path when the keys do not fit one block.

It never holds the (B, N, T, S) scores: the forward runs an online softmax over key blocks (running
row max, row sum and output accumulator), the backward is a custom VJP as in flash attention: each
block's probabilities are recomputed from q, k and the saved logsumexp, dq is accumulated, dk, dv
and the bias gradient are written block by block. Memory is O(B·N·T·block) both ways.

What a block's logits are is the caller's `scores(raw, bias, start, params) -> (logits, allowed)`:
`raw` is scale·q·k for the keys [start, start + size) ((B, N, T, size), accumulation dtype), `bias`
the bias's slice for those keys, `params` the floats the mods read (a pytree of inexact arrays,
differentiated here); what `scores` closes over is a constant for differentiation.

When the block does not divide the key length, the last block starts at S - block and skips the
keys the one before it already took, so every block has one static shape.

Dropout (`sdpagraph.dropout`, `rate` > 0 with the call's seeds) multiplies each block's probabilities
by its slice of the mask, which `dropout.apply` computes from positions: the backward regenerates
the forward's mask block by block. The row sums (and the logsumexp) are the softmax's, before dropout.
"""
from __future__ import annotations

import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp

from sdpagraph import dropout
from sdpagraph.backends.masking import key_slice

Scores = Callable[[Any, Any, Any, Any], tuple[Any, Any]]


def accumulation_dtype(dtype: Any) -> Any:
    """float64 for float64 inputs (under jax_enable_x64), float32 for every other dtype."""
    return jnp.float64 if jnp.dtype(dtype) == jnp.float64 else jnp.float32


def dot_precision(dtype: Any) -> Any:
    # As jax.nn.dot_product_attention: bf16/fp16 inputs, fp32 accumulation. XLA:CPU rejects the
    # fp16 preset in the gradient's dots; there the default precision already accumulates in fp32.
    if jax.default_backend() == "cpu":
        return None
    return {jnp.bfloat16: jax.lax.DotAlgorithmPreset.BF16_BF16_F32,
            jnp.float16: jax.lax.DotAlgorithmPreset.F16_F16_F32}.get(jnp.dtype(dtype).type)


def raw_scores(query: Any, key: Any, scale: float) -> Any:
    """scale · q·k: (B, N, T, S) in the accumulation dtype, for query (B, T, N, H), key (B, S, K, H)."""
    b, t, n, h = query.shape
    s, k = key.shape[1], key.shape[2]
    acc = accumulation_dtype(query.dtype)
    logits = jnp.einsum("btkgh,bskh->bkgts", query.reshape(b, t, k, n // k, h), key,
                        precision=dot_precision(query.dtype), preferred_element_type=acc)
    return logits.reshape(b, n, t, s) * jnp.asarray(scale, acc)


def weighted_values(probs: Any, value: Any) -> Any:
    """probs (B, N, T, S) · value (B, S, K, Hv): (B, T, N, Hv) in the accumulation dtype."""
    b, n, t, s = probs.shape
    k, hv = value.shape[2], value.shape[3]
    acc = accumulation_dtype(value.dtype)
    out = jnp.einsum("bkgts,bskh->btkgh", probs.astype(value.dtype).reshape(b, k, n // k, t, s), value,
                     precision=dot_precision(value.dtype), preferred_element_type=acc)
    return out.reshape(b, t, n, hv)


def _rows(x: Any) -> Any:
    """A per-row (B, N, T) value laid out against (B, T, N, Hv)."""
    return jnp.swapaxes(x, 1, 2)[..., None]


def _add_at(total: Any, part: Any, start: Any, axis: int) -> Any:
    """`total` plus `part`, placed at `start` along `axis` when `part` covers one block there."""
    if total.shape[axis] == part.shape[axis]:
        return total + part
    here = jax.lax.dynamic_slice_in_dim(total, start, part.shape[axis], axis)
    return jax.lax.dynamic_update_slice_in_dim(total, here + part, start, axis)


def _block(scores: Scores, scale: float, block: int, q, k, v, bias, params, i) -> tuple:
    """Block `i`'s start, keys, values, raw scores, and its logits function of (raw, bias, params)
    with its allowed mask (the last block's keys taken already are masked out)."""
    s = k.shape[1]
    start = jnp.minimum(i * block, s - block)
    k_blk = jax.lax.dynamic_slice_in_dim(k, start, block, 1)
    v_blk = jax.lax.dynamic_slice_in_dim(v, start, block, 1)
    bias_blk = key_slice(bias, start, block, s)

    def logits(raw, bias_blk, params):
        out, allowed = scores(raw, bias_blk, start, params)
        if s % block:
            allowed = allowed & (start + jnp.arange(block) >= i * block)
        return out, allowed

    return start, k_blk, v_blk, bias_blk, raw_scores(q, k_blk, scale), logits


def _forward(scores: Scores, scale: float, block: int, rate: float, q, k, v, bias, params,
             seeds) -> tuple[Any, Any]:
    b, t, n, _ = q.shape
    acc = accumulation_dtype(q.dtype)

    def step(carry, i):
        row_max, row_sum, out = carry
        start, _, v_blk, bias_blk, raw, logits_of = _block(scores, scale, block, q, k, v, bias, params, i)
        logits, allowed = logits_of(raw, bias_blk, params)
        masked = jnp.where(allowed, logits, -jnp.inf)
        new_max = jnp.maximum(row_max, jnp.max(masked, axis=-1))
        shift = jnp.where(jnp.isfinite(new_max), new_max, 0.0)  # rows with nothing allowed yet: 0
        probs = jnp.exp(masked - shift[..., None])
        rescale = jnp.exp(row_max - shift)
        row_sum = row_sum * rescale + jnp.sum(probs, axis=-1)
        out = out * _rows(rescale) + weighted_values(dropout.apply(probs, rate, seeds, start), v_blk)
        return (new_max, row_sum, out), None

    start = (jnp.full((b, n, t), -jnp.inf, acc), jnp.zeros((b, n, t), acc),
             jnp.zeros((b, t, n, v.shape[-1]), acc))
    (row_max, row_sum, out), _ = jax.lax.scan(step, start, jnp.arange(-(-k.shape[1] // block)))
    some = row_sum > 0
    out = out / _rows(jnp.where(some, row_sum, 1.0))
    lse = jnp.where(some, row_max + jnp.log(jnp.where(some, row_sum, 1.0)), -jnp.inf)
    return out.astype(v.dtype), lse


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3))
def _attention(scores: Scores, scale: float, block: int, rate: float, q, k, v, bias, params, seeds) -> tuple[Any, Any]:
    return _forward(scores, scale, block, rate, q, k, v, bias, params, seeds)


def _attention_fwd(scores, scale, block, rate, q, k, v, bias, params, seeds):
    out, lse = _forward(scores, scale, block, rate, q, k, v, bias, params, seeds)
    return (out, lse), (q, k, v, bias, params, seeds, out, lse)


def _attention_bwd(scores, scale, block, rate, residuals, cotangents):
    q, k, v, bias, params, seeds, out, lse = residuals
    d_out, d_lse = cotangents
    acc = accumulation_dtype(q.dtype)
    b, t, n, h = q.shape
    groups = n // k.shape[2]
    precision = dot_precision(q.dtype)
    d_out_io = d_out.astype(v.dtype)
    # d logits = p · (dP - <dO, O> + d lse) per row, with dP = dO · v (times the mask with dropout).
    row_term = d_lse.astype(acc) - jnp.swapaxes(jnp.sum(d_out.astype(acc) * out.astype(acc), axis=-1), 1, 2)
    lse_safe = jnp.where(jnp.isneginf(lse), 0.0, lse)  # such rows allow nothing: p = 0
    q_grouped = q.reshape(b, t, k.shape[2], groups, h)
    d_out_grouped = d_out_io.reshape(b, t, k.shape[2], groups, v.shape[-1])

    def step(carry, i):
        dq, dk, dv, d_bias, d_params = carry
        start, k_blk, v_blk, bias_blk, raw, logits_of = _block(scores, scale, block, q, k, v, bias, params, i)
        logits, pullback, allowed = jax.vjp(logits_of, raw, bias_blk, params, has_aux=True)
        probs = jnp.where(allowed, jnp.exp(logits - lse_safe[..., None]), 0.0)
        shape = (b, k.shape[2], groups, t, block)
        d_probs = jnp.einsum("btkgh,bskh->bkgts", d_out_grouped, v_blk, precision=precision,
                             preferred_element_type=acc).reshape(probs.shape)
        d_logits = probs * (dropout.apply(d_probs, rate, seeds, start) + row_term[..., None])
        d_raw, d_bias_blk, d_params_blk = pullback(d_logits)
        d_raw = (d_raw * jnp.asarray(scale, acc)).astype(q.dtype).reshape(shape)
        dq = dq + jnp.einsum("bkgts,bskh->btkgh", d_raw, k_blk, precision=precision, preferred_element_type=acc)
        dk = _add_at(dk, jnp.einsum("bkgts,btkgh->bskh", d_raw, q_grouped, precision=precision,
                                    preferred_element_type=acc), start, 1)
        kept = dropout.apply(probs, rate, seeds, start)
        dv = _add_at(dv, jnp.einsum("bkgts,btkgh->bskh", kept.astype(v.dtype).reshape(shape), d_out_grouped,
                                    precision=precision, preferred_element_type=acc), start, 1)
        if bias is not None:
            d_bias = _add_at(d_bias, d_bias_blk.astype(acc), start, -1)
        d_params = jax.tree.map(jnp.add, d_params, d_params_blk)
        return (dq, dk, dv, d_bias, d_params), None

    zeros = lambda x, dtype=acc: jnp.zeros(x.shape, dtype)  # noqa: E731
    start = (zeros(q_grouped), zeros(k), zeros(v), None if bias is None else zeros(bias),
             jax.tree.map(lambda p: zeros(p, p.dtype), params))
    (dq, dk, dv, d_bias, d_params), _ = jax.lax.scan(step, start, jnp.arange(-(-k.shape[1] // block)))
    return (dq.reshape(q.shape).astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype),
            None if bias is None else d_bias.astype(bias.dtype), d_params, None)


_attention.defvjp(_attention_fwd, _attention_bwd)


def blockwise_attention(scores: Scores, query: Any, key: Any, value: Any, bias: Any, params: Any, *,
                        scale: float, block: int, dropout_rate: float = 0.0, dropout_seeds: Any = None
                        ) -> tuple[Any, Any]:
    """(output (B, T, N, Hv) in the input dtype, logsumexp (B, N, T) in the accumulation dtype) over
    key blocks of `block` keys (block <= S). `bias`: None or broadcastable to (B, N, T, S); with
    `dropout_rate` > 0, `dropout_seeds` (B, N) int32 (`dropout.seeds`)."""
    return _attention(scores, scale, block, dropout_rate, query, key, value, bias, params, dropout_seeds)
