"""The small-sequence backend on packed inputs (`segment_ids`): each query token attends over a
window of W = `max_seqlen_kv` keys, those of its own segment.

A segment's keys are contiguous in its row, so query token t of segment r reads the W keys that
start at the r-th key segment's first token (self-attention: t's own segment's first token). The
call becomes the small-sequence core's BSHD problem with B*T rows of one query each over W keys,
masked by segment number (keys past the segment's end belong to another segment or to padding)
and by position inside the segment (causal, window, chunk, either alignment, counted from each
segment's start as everywhere in sdpagraph):

    K_win[b, t, w] = K[b, start(b, t) + w]          w < W, (B*T, W, K, H), the same for V
    out[b, t]      = softmax over w of (score_mod(scale * q[b, t] . K_win[b, t, w]) + bias) . V_win

Memory and bytes are O(B * T * W) (K and V windows, per-score arrays), never O(T * S) as the dense
XLA backend's: the stream is bandwidth-bound as the BSHD one. The gradient of K and V is a gather
too, not jax's transpose of a gather (a scatter-add, atomic on a GPU): key s of segment r sums the
window slots that hold it, slot `position of s in r` of the L = `max_seqlen_q` query tokens of
the query segment that reads r. (A bias's gradient is jax's scatter-add.)

A segment longer than its hint (possible only with `SDPAGRAPH_CHECK_SEGMENTS=0`, which lets such
ids through unchecked) has its keys past the W-th dropped, and the gradient of K and V misses the
queries past the L-th.

Not yet measured on a GPU: `bench/dispatch.py`'s packed cases time it against XLA and cuDNN.
"""
from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from sdpagraph.call import RuntimeInputs
from sdpagraph.segments.metadata import at_runs, segment_metadata, segment_positions, segment_run_ids
from sdpagraph.backends.small_seq.core import Aux, Static, attend, to_score_layout
from sdpagraph.backends.masking import position_allowed
from sdpagraph.spec import AttentionSpec


class _Windows(NamedTuple):
    """Which keys each query token's window holds, and the way back (int arrays, no gradient)."""

    index: Any  # (B, T, W): the key in slot w of query t's window (clipped to S - 1)
    queries: Any  # (B, S, L): the query tokens whose windows hold key s (clipped to T - 1)
    slot: Any  # (B, S): key s's slot in those windows (its position in its segment)
    reach: Any  # (B, S, L) bool: queries[b, s, i] is one of them


def _key_windows(spec: AttentionSpec, inputs: RuntimeInputs, width: int, q_bound: int) -> tuple[_Windows, Any]:
    """(the windows, allowed (B, T, W) bool) for queries in segments of at most `q_bound` tokens."""
    q_ids = inputs.q_segment_ids
    kv_ids = q_ids if spec.segments == "self" else inputs.kv_segment_ids
    t, s = spec.q_len, spec.kv_len
    q_run, kv_run = segment_run_ids(q_ids), segment_run_ids(kv_ids)
    q_pos, kv_pos = segment_positions(q_ids), segment_positions(kv_ids)  # (B, T), (B, S)
    offset = 0  # bottom-right alignment: key segment length - query segment length
    if spec.segments == "self":
        start = jnp.arange(t, dtype=jnp.int32)[None, :] - q_pos
        first_query = jnp.arange(s, dtype=jnp.int32)[None, :] - kv_pos
    else:  # the r-th query segment reads the r-th key segment
        kv_meta, q_meta = segment_metadata(kv_ids, spec.max_segments), segment_metadata(q_ids, spec.max_segments)
        start = at_runs(kv_meta.offsets[:, :-1], q_run)
        first_query = at_runs(q_meta.offsets[:, :-1], kv_run)
        if spec.causal_alignment == "bottom_right":
            offset = at_runs(kv_meta.seq_lens, q_run) - at_runs(q_meta.seq_lens, q_run)
    slot = jnp.arange(width, dtype=jnp.int32)
    index = start[:, :, None] + slot  # (B, T, W)
    inside = index < s
    index = jnp.minimum(index, s - 1)
    same = _rows_at(kv_run, index) == q_run[:, :, None]
    valid = (q_run > 0) & (q_run <= spec.max_segments)  # segments past max_segments are dropped, as on XLA
    allowed = valid[:, :, None] & inside & same
    positions = position_allowed(spec, (q_pos + offset)[:, :, None], slot)  # a key's position is its slot
    allowed = allowed if positions is None else allowed & positions
    queries = first_query[:, :, None] + jnp.arange(q_bound, dtype=jnp.int32)  # (B, S, L)
    reach = (queries < t) & (kv_run > 0)[:, :, None] & (kv_pos < width)[:, :, None]
    queries = jnp.minimum(queries, t - 1)
    reach &= _rows_at(q_run, queries) == kv_run[:, :, None]
    return _Windows(index, queries, jnp.minimum(kv_pos, width - 1), reach), allowed


def _rows_at(x: Any, index: Any) -> Any:
    """x[b, index[b, ...]] for x (B, L) and index (B, ...)."""
    b = x.shape[0]
    return jnp.take_along_axis(x, index.reshape(b, -1), axis=1).reshape(index.shape)


@jax.custom_vjp
def _gather(x: Any, windows: _Windows) -> Any:
    """x (B, S, ...) at each query token's window: (B, T, W, ...). Its transpose gathers too (each key
    sums the slots that hold it), where jax's would scatter-add: no atomics, deterministic."""
    return x[jnp.arange(x.shape[0])[:, None, None], windows.index]


def _gather_fwd(x: Any, windows: _Windows) -> tuple[Any, Any]:
    return _gather(x, windows), windows


def _gather_bwd(windows: _Windows, d_windows: Any) -> tuple[Any, None]:
    rows = jnp.arange(d_windows.shape[0])[:, None, None]
    picked = d_windows[rows, windows.queries, windows.slot[:, :, None]]  # (B, S, L, ...)
    reach = windows.reach.reshape(windows.reach.shape + (1,) * (picked.ndim - 3))
    d_x = jnp.sum(jnp.where(reach, picked.astype(jnp.float32), 0.0), axis=2)
    return d_x.astype(d_windows.dtype), None


_gather.defvjp(_gather_fwd, _gather_bwd)


def _windowed(x: Any, index: Any) -> Any:
    """A 4-D (B|1, N|1, T|1, S|1) array (bias, mask, score_mod array) at each query token's key
    window, in the core's frame: (B*T, N|1, 1, W|1); one of (1, N|1, 1, 1) stays as it is."""
    xb, n, xt, xs = x.shape
    b, t, width = index.shape
    if xb == xt == xs == 1:
        return x
    rows = jnp.arange(b)[:, None, None] if xb > 1 else 0
    queries = jnp.arange(t)[None, :, None] if xt > 1 else 0
    keys = index if xs > 1 else 0
    picked = jnp.moveaxis(x, 1, -1)[rows, queries, keys]  # (B|1, T|1, W|1, N|1)
    picked = jnp.broadcast_to(picked, (b, t) + picked.shape[2:])
    return jnp.moveaxis(picked.reshape(b * t, picked.shape[2], n), -1, 1)[:, :, None, :]


def packed_attention(spec: AttentionSpec, static: Static, query: Any, key: Any, value: Any,
                     inputs: RuntimeInputs) -> tuple[Any, Any]:
    """(output (B, T, N, H_v), logsumexp (B, N, T) fp32) of a packed call in the regime."""
    b, t, n, h = query.shape
    kh = spec.num_kv_heads
    width = spec.max_seqlen_kv if spec.max_seqlen_kv is not None else spec.kv_len
    windows, allowed = _key_windows(spec, inputs, width, spec.max_seqlen_q or spec.q_len)
    index = windows.index
    k_win = _gather(key, windows).reshape(b * t, width, kh, h)  # (B*T, W, K, H)
    v_win = _gather(value, windows).reshape(b * t, width, kh, value.shape[-1])
    g = n // kh
    allowed = allowed.reshape(b * t, 1, width, 1, 1)  # the score layout
    if inputs.mask is not None:
        mask = jnp.reshape(jnp.asarray(inputs.mask, jnp.bool_), spec.mask_shape)
        allowed = allowed & to_score_layout(_windowed(mask, index), kh)
    aux = Aux(
        allowed=allowed,
        mod_arrays={name: jax.lax.stop_gradient(to_score_layout(_windowed(jnp.asarray(array), index), kh))
                    for name, array in (inputs.mod_arrays or {}).items()},
        index=(jnp.repeat(jnp.arange(b, dtype=jnp.int32), t).reshape(-1, 1, 1, 1, 1),
               jnp.arange(n, dtype=jnp.int32).reshape(1, 1, 1, kh, g),
               segment_positions(inputs.q_segment_ids).reshape(-1, 1, 1, 1, 1),
               jnp.arange(width, dtype=jnp.int32).reshape(1, 1, -1, 1, 1)),
    )
    bias = None if inputs.bias is None else _windowed(jnp.reshape(inputs.bias, spec.bias_shape), index)
    out, lse = attend(static, query.reshape(b * t, 1, n, h), k_win, v_win, bias, aux)
    return out.reshape(b, t, n, value.shape[-1]), jnp.transpose(lse.reshape(b, t, n), (0, 2, 1))
