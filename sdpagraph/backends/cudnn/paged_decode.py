"""Multi-token decode on paged K/V, run as `graphs.decode_fold` plans it: the shared prefix (keys
[0, len - T] of each sequence, which every new token sees) as one maskless cuDNN paged call of the
folded rows (B, T*G, K, H) with its logsumexp, and the tail (the last T - 1 keys, which token t sees
up to its own position) gathered from its pages and attended on XLA (a (T, T - 1) causal band per
head: tiny), merged by their logsumexps. Sequences must hold at least T keys, as bottom-right
decoding needs (a shorter one's prefix is empty, and its rows see the tail keys that exist).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax.numpy as jnp

from sdpagraph.backends import registry
from sdpagraph.backends.masking import TokenLayout
from sdpagraph.backends.softmax_merge import merge
from sdpagraph.call import RuntimeInputs
from sdpagraph.spec import AttentionSpec


def _tail(spec: AttentionSpec, q: Any, k_pages: Any, v_pages: Any, table: Any, lengths: Any) -> tuple[Any, Any]:
    """(out (B, T, N, Hv), lse (B, N, T)) of the new tokens over the last T - 1 keys, read from their
    pages, on the XLA backend with each token's position in its sequence (token i sees the keys up to
    its own; a key before the sequence's start is none)."""
    b, t = q.shape[:2]
    page = spec.paged[1]
    positions = lengths[:, None] - t + 1 + jnp.arange(t - 1, dtype=jnp.int32)[None, :]  # (B, T-1), < 0: none
    pages = jnp.take_along_axis(table, jnp.clip(positions // page, 0, table.shape[1] - 1), axis=1)
    k, v = (pool[pages, positions % page] for pool in (k_pages, v_pages))  # (B, T-1, K, H)
    q_pos = lengths[:, None] - t + jnp.arange(t, dtype=jnp.int32)[None, :]
    layout = TokenLayout(q_pos, positions, jnp.ones((b, t), bool), positions >= 0, None, None, 0)
    tail = dataclasses.replace(spec, q_len=t, kv_len=t - 1, paged=None, causal_alignment="top_left",
                               has_q_lengths=False, has_kv_lengths=False)
    return registry.reference().block_attention(tail, q, k, v, RuntimeInputs(), None, layout)


def attention(spec: AttentionSpec, folded: AttentionSpec, q: Any, k_pages: Any, v_pages: Any,
              inputs: RuntimeInputs, run: Callable[..., tuple[Any, Any]]) -> tuple[Any, Any]:
    """(out (B, T, N, Hv), lse (B, N, T)) of a multi-token decode whose prefix call is `folded`
    (`graphs.decode_fold`); `run(spec, q, k, v, inputs)` runs one cuDNN call with its softmax stats."""
    b, t, n, h = q.shape
    kh, group = spec.num_kv_heads, n // spec.num_kv_heads
    lengths = jnp.full((b,), spec.kv_len, jnp.int32) if inputs.kv_lengths is None else inputs.kv_lengths
    lengths = jnp.asarray(lengths, jnp.int32)
    # (B, T, K*G, H) -> (B, T*G, K, H): row t*G + g of kv head c is query head c*G + g of token t
    rows = q.reshape(b, t, kh, group, h).transpose(0, 1, 3, 2, 4).reshape(b, t * group, kh, h)
    prefix = dataclasses.replace(inputs, q_lengths=None, kv_lengths=jnp.maximum(lengths - t + 1, 0))
    out, lse = run(folded, rows, k_pages, v_pages, prefix)
    empty = (lengths < t)[:, None, None]  # no prefix key: whatever cuDNN left in those rows is dropped
    lse = jnp.where(empty, -jnp.inf, lse)
    out = jnp.where(empty[..., None], jnp.zeros((), out.dtype), out)
    out = out.reshape(b, t, group, kh, -1).transpose(0, 1, 3, 2, 4).reshape(b, t, n, -1)
    lse = lse.reshape(b, kh, t, group).transpose(0, 1, 3, 2).reshape(b, n, t)
    out, lse = merge((out, lse), _tail(spec, q, k_pages, v_pages, inputs.page_table, lengths))
    return out.astype(q.dtype), lse
