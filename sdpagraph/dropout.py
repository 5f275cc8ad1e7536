"""Attention dropout: `attention(..., dropout_rate=p, dropout_rng=key)`.

Each attention weight (after the softmax) is kept with probability 1 - p and scaled by 1 / (1 - p):

    out_i = sum_j p_ij * m_ij / (1 - p) * v_j        m_ij ~ Bernoulli(1 - p), one per (b, h, i, j)

The logsumexp (the residual) is the softmax's, before dropout, as cuDNN's stats are. A call draws
one int32 seed per (batch row, query head) from `dropout_rng` (`seeds`); the mask is a function of
those seeds and the element's position, so the forward and the backward, and every block of a
blockwise computation, see the same mask without storing it:
- cuDNN (graphs with `spec.dropout`): its Philox generator, seeded with the first seed of the
  (batch, head) block it runs (a partitioned call's devices each read their own block's), offset 0;
- the XLA backend (and `graph_on_xla`): `keep_mask`, a counter-based hash of (seed[b, h], i, j).
The two draw different masks from the same seeds; both are Bernoulli(1 - p) per element.
`dropout_rate` is static (it is part of the graph); 0 means no dropout and needs no rng.
"""
from __future__ import annotations

import dataclasses
import numbers
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from sdpagraph.call import PreparedCall


def check_rate(dropout_rate: Any) -> float:
    """`dropout_rate` as a float in [0, 1), or ValueError/TypeError naming it."""
    if isinstance(dropout_rate, bool) or not isinstance(dropout_rate, numbers.Real):
        raise TypeError(f"dropout_rate must be a Python float in [0, 1), got {type(dropout_rate).__name__} "
                        "(it is static: part of the cuDNN graph)")
    rate = float(dropout_rate)
    if not 0.0 <= rate < 1.0:
        raise ValueError(f"dropout_rate must be in [0, 1), got {dropout_rate}")
    return rate


def seeds(dropout_rng: Any, batch: int, heads: int) -> Any:
    """One int32 seed per (batch row, query head), (B, N), drawn from `dropout_rng` (a jax PRNG key:
    `jax.random.key(...)` or a legacy uint32 `jax.random.PRNGKey(...)`)."""
    if not isinstance(dropout_rng, jax.Array) or not (
            jnp.issubdtype(dropout_rng.dtype, jax.dtypes.prng_key)
            or (dropout_rng.dtype == jnp.uint32 and dropout_rng.shape == (2,))):
        raise TypeError("dropout_rng must be a jax PRNG key (jax.random.key(seed) or jax.random.PRNGKey(seed)), got "
                        f"{type(dropout_rng).__name__}{getattr(dropout_rng, 'shape', '')}")
    if jnp.issubdtype(dropout_rng.dtype, jax.dtypes.prng_key) and dropout_rng.shape != ():
        raise ValueError(f"dropout_rng must be a single key (shape ()), got shape {dropout_rng.shape}")
    bits = jax.random.bits(dropout_rng, (batch, heads), jnp.uint32)
    return jax.lax.bitcast_convert_type(bits, jnp.int32)


def with_dropout(call: PreparedCall, dropout_rate: Any, dropout_rng: Any, *, draw: bool = True) -> PreparedCall:
    """`call` with dropout: `spec.dropout` and the seeds in `inputs.dropout_seeds`; as given for rate 0.
    `draw=False` (a support query) sets the spec only: the key is then optional."""
    rate = check_rate(dropout_rate)
    if rate == 0.0:
        return call
    if not draw:
        return dataclasses.replace(call, spec=dataclasses.replace(call.spec, dropout=rate))
    if dropout_rng is None:
        raise ValueError(f"dropout_rate={dropout_rate} needs dropout_rng= (a jax PRNG key, e.g. jax.random.key(0)); "
                         "pass a new key each step")
    spec = call.spec
    inputs = dataclasses.replace(call.inputs, dropout_seeds=seeds(dropout_rng, spec.batch, spec.num_heads))
    return dataclasses.replace(call, spec=dataclasses.replace(spec, dropout=rate), inputs=inputs)


def _mix(x: Any) -> Any:
    """MurmurHash3's 32-bit finalizer: every input bit changes each output bit with probability ~1/2."""
    x = x ^ (x >> 16)
    x = x * np.uint32(0x85EBCA6B)
    x = x ^ (x >> 13)
    x = x * np.uint32(0xC2B2AE35)
    return x ^ (x >> 16)


def keep_mask(dropout_seeds: Any, rate: float, q_index: Any, kv_index: Any) -> Any:
    """Which attention weights dropout keeps: bool (B, N, T', S'), True with probability 1 - rate.

    `dropout_seeds` (B, N) int32 (`seeds`; one seed broadcast to (B, N) still draws a different mask for
    each (b, h)); `q_index` (T',) and `kv_index` (S',) the query and key positions in the call (any
    slice of them: a block's mask is the whole mask's block)."""
    batch, heads = dropout_seeds.shape
    block = (jnp.arange(batch, dtype=jnp.uint32)[:, None] * np.uint32(heads) + jnp.arange(heads, dtype=jnp.uint32))
    seed = _mix(jax.lax.bitcast_convert_type(dropout_seeds, jnp.uint32) ^ _mix(block))[:, :, None, None]
    row = _mix(q_index.astype(jnp.uint32) * np.uint32(0x9E3779B9) + np.uint32(0x7F4A7C15))[None, None, :, None]
    column = (kv_index.astype(jnp.uint32) * np.uint32(0x85EBCA77) + np.uint32(0x165667B1))[None, None, None, :]
    bits = _mix(_mix(seed ^ row) ^ column)
    threshold = np.uint32(min(round(rate * 2.0**32), 2**32 - 1))
    return bits >= threshold


def apply(weights: Any, rate: float, dropout_seeds: Any, key_start: Any = 0) -> Any:
    """`weights` (B, N, T, S') of the keys from `key_start` on (a block, or all of them), each times
    keep / (1 - rate) of the call's mask (`keep_mask`); as given for rate 0."""
    if not rate:
        return weights
    queries, keys = weights.shape[2], weights.shape[3]
    keep = keep_mask(dropout_seeds, rate, jnp.arange(queries), key_start + jnp.arange(keys))
    return weights * jnp.where(keep, jnp.asarray(1.0 / (1.0 - rate), weights.dtype), jnp.zeros((), weights.dtype))
