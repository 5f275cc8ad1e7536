"""Mask semantics every backend shares: where each token sits, and where a query may attend a key.

    token_layout(spec, inputs) -> TokenLayout        positions, validity and segments of the tokens
    position_allowed(spec, diag, kv)                 causal, window and chunk masks around a diagonal
    positions_and_mask(spec, inputs, layout, keys)   what gen_index reads, and the allowed (B, N, T, S),
                                                     or (B, N, T, size) for the keys [start, start + size)
    key_slice(x, start, size, kv_len)                an array's slice for a block of keys
    attended_rows(spec, inputs)                      the query rows with at least one key to attend

Positions used by masks and by `gen_index` count from the start of each packed segment. With
`causal_alignment="bottom_right"` the diagonal is shifted by `kv_len - q_len` (per row, or per
segment when packed), so the last query sees the last key; windows and chunks are measured from that
shifted diagonal. The XLA backend computes exactly this; the cuDNN lowering, the small-sequence
backend and the numerical check's reference read it from here.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp

from sdpagraph.call import RuntimeInputs
from sdpagraph.segments.metadata import at_runs, segment_metadata, segment_positions, segment_run_ids
from sdpagraph.spec import UNBOUNDED, AttentionSpec


@dataclass(frozen=True)
class TokenLayout:
    """Per-token facts shared by the masks and by score_mod's gen_index. A context-parallel block
    passes its own (`xla_attention(layout=...)`): global positions and segments of its tokens."""

    q_pos: Any  # (B, T) position of each query in its sequence / segment
    kv_pos: Any  # (B, S)
    q_valid: Any  # (B, T) bool: not padding
    kv_valid: Any  # (B, S)
    q_group: Any  # (B, T) segment number (1-based) or None without segments
    kv_group: Any
    diag_offset: Any  # broadcastable to (B, T, S): kv_len - q_len for bottom-right, else 0


def _segment_layout(spec: AttentionSpec, inputs: RuntimeInputs) -> TokenLayout:
    q_ids, kv_ids = inputs.q_segment_ids, inputs.kv_segment_ids
    q_run, kv_run = segment_run_ids(q_ids), segment_run_ids(kv_ids)
    # Segments past max_segments are dropped (treated as padding), as the THD metadata does.
    q_valid = (q_run > 0) & (q_run <= spec.max_segments)
    kv_valid = (kv_run > 0) & (kv_run <= spec.max_segments)
    offset = 0
    if spec.causal_alignment == "bottom_right" and spec.segments == "cross":
        q_len = at_runs(segment_metadata(q_ids, spec.max_segments).seq_lens, q_run)
        kv_len = at_runs(segment_metadata(kv_ids, spec.max_segments).seq_lens, kv_run)
        offset = kv_len[:, None, :] - q_len[:, :, None]
    return TokenLayout(segment_positions(q_ids), segment_positions(kv_ids), q_valid, kv_valid, q_run, kv_run, offset)


def _dense_layout(spec: AttentionSpec, inputs: RuntimeInputs) -> TokenLayout:
    b, t, s = spec.batch, spec.q_len, spec.kv_len
    q_pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    kv_pos = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
    q_len = jnp.full((b,), t, jnp.int32) if inputs.q_lengths is None else inputs.q_lengths.astype(jnp.int32)
    kv_len = jnp.full((b,), s, jnp.int32) if inputs.kv_lengths is None else inputs.kv_lengths.astype(jnp.int32)
    offset = 0
    if spec.causal_alignment == "bottom_right":
        offset = (kv_len - q_len)[:, None, None]
    return TokenLayout(q_pos, kv_pos, q_pos < q_len[:, None], kv_pos < kv_len[:, None], None, None, offset)


def token_layout(spec: AttentionSpec, inputs: RuntimeInputs) -> TokenLayout:
    return _segment_layout(spec, inputs) if spec.segments else _dense_layout(spec, inputs)


def position_allowed(spec: AttentionSpec, diag: Any, kv: Any, xp: Any = jnp) -> Any:
    """Boolean (`diag` and `kv` broadcast together): where the key at position `kv` passes the spec's
    causal, window and chunk masks around the aligned query position `diag`; None without them.
    `xp`: jax.numpy, or numpy for the numerical check's host-side reference."""
    if not spec.has_position_mask:
        return None
    allowed = xp.ones(xp.broadcast_shapes(xp.shape(diag), xp.shape(kv)), xp.bool_)
    left, right = spec.window
    if spec.is_causal:
        allowed &= kv <= diag
    if left != UNBOUNDED:
        allowed &= kv >= diag - left
    if right != UNBOUNDED:
        allowed &= kv <= diag + right
    if spec.chunk_size is not None:
        allowed &= xp.floor_divide(diag, spec.chunk_size) == xp.floor_divide(kv, spec.chunk_size)
    return allowed


def allowed_mask(spec: AttentionSpec, inputs: RuntimeInputs, layout: TokenLayout) -> Any:
    """Boolean (B|1, N|1, T, S): True where a query may attend to a key."""
    allowed = layout.q_valid[:, :, None] & layout.kv_valid[:, None, :]
    if layout.q_group is not None:
        allowed &= layout.q_group[:, :, None] == layout.kv_group[:, None, :]
    diag = layout.q_pos[:, :, None] + layout.diag_offset  # aligned query position, (B, T, 1|S)
    positions = position_allowed(spec, diag, layout.kv_pos[:, None, :])
    if positions is not None:
        allowed &= positions
    allowed = allowed[:, None, :, :]
    if inputs.mask is not None:
        allowed = allowed & inputs.mask
    return allowed


def key_slice(x: Any, start: Any, size: int, kv_len: int) -> Any:
    """`x`'s keys [start, start + size) (`start` may be traced) when its last axis runs over the
    kv_len keys; `x` itself when it broadcasts over them (None, a scalar, a last axis of 1) or
    when the slice is all of them."""
    if x is None or jnp.ndim(x) == 0 or jnp.shape(x)[-1] != kv_len or size == kv_len:
        return x
    return jax.lax.dynamic_slice_in_dim(x, start, size, axis=-1)


def _key_block(layout: TokenLayout, start: Any, size: int) -> TokenLayout:
    cut = lambda x: key_slice(x, start, size, layout.kv_pos.shape[-1])  # noqa: E731
    return dataclasses.replace(layout, kv_pos=cut(layout.kv_pos), kv_valid=cut(layout.kv_valid),
                               kv_group=cut(layout.kv_group), diag_offset=cut(layout.diag_offset))


def positions_and_mask(spec: AttentionSpec, inputs: RuntimeInputs, layout: TokenLayout | None = None,
                       keys: tuple[Any, int] | None = None) -> tuple[Any, Any, Any]:
    """(query positions (B, T), key positions (B, S), allowed (B|1, N|1, T, S)): what `gen_index`
    reads on the sequence axes, and where a query may attend to a key. `layout` (default: from the
    spec and `inputs`) says where each query and key token sits. `keys` = (start, size): the same
    for the keys [start, start + size) only, S read as size (the blockwise XLA path)."""
    layout = token_layout(spec, inputs) if layout is None else layout
    if keys is not None:
        start, size = keys
        inputs = dataclasses.replace(inputs, mask=key_slice(inputs.mask, start, size, layout.kv_pos.shape[-1]))
        layout = _key_block(layout, start, size)
    return layout.q_pos, layout.kv_pos, allowed_mask(spec, inputs, layout)


def attended_rows(spec: AttentionSpec, inputs: RuntimeInputs) -> Any:
    """Boolean (B|1, N|1, T): the query rows that may attend to at least one key."""
    return jnp.any(allowed_mask(spec, inputs, token_layout(spec, inputs)), axis=-1)
