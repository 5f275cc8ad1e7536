"""The device operands of one cuDNN call, by graph role, made from the call's runtime inputs: sequence
lengths, packed segments' lengths and ragged offsets, the dense twin's segment bounds, paged K/V's
page tables, dropout's seeds, the bias operand (the user's bias with masks and folded padding in it), and which rows
hold results (`Validity`: rows cuDNN leaves unwritten are zeroed after the call)."""
from __future__ import annotations

from typing import Any, Mapping, NamedTuple

import jax.numpy as jnp

from sdpagraph.backends.masking import attended_rows
from sdpagraph.call import RuntimeInputs
from sdpagraph.graphs.operands import ARRAY_PREFIX, DROPOUT, MASKED_BIAS, PAGE_TABLES, LayoutPlan
from sdpagraph.scoremod.masks import SEGMENT_ARRAYS
from sdpagraph.segments.metadata import segment_metadata, segment_positions, segment_run_ids
from sdpagraph.spec import AttentionSpec

SEGMENT_OFFSETS = "segment_offsets_"  # + side: per-row token offsets of packed segments (B, M + 1)


class Validity(NamedTuple):
    """Which rows hold results (a pytree, so it can pass through custom_vjp)."""

    q: Any  # (B, T) bool: token rows that hold results, or None when all do
    kv: Any  # (B, S) bool, or None
    attended: Any = None  # (B|1, T, N|1, 1) bool when the bias carries masks: rows with a key to attend to


def packed_operands(spec: AttentionSpec, inputs: RuntimeInputs) -> dict[str, Any]:
    """Per row: the lengths (B, M) and token offsets (B, M + 1) of its packed segments, in O(T).

    They slice along the batch; the graph's ragged offsets, absolute element offsets into the whole
    packed buffer, are made from them on the shapes the graph runs on (`ragged_operands`)."""
    operands = {}
    for side, ids in (("q", inputs.q_segment_ids), ("kv", inputs.kv_segment_ids)):
        meta = segment_metadata(ids, spec.max_segments)
        operands[f"seq_len_{side}"] = meta.seq_lens.astype(jnp.int32)
        operands[SEGMENT_OFFSETS + side] = meta.offsets.astype(jnp.int32)
    return operands


def ragged_operands(spec: AttentionSpec, operands: Mapping[str, Any]) -> dict[str, Any]:
    """The packed graph's seq lens and ragged element offsets of its B*M sequences (THD), from the
    per-row ones of `packed_operands`, for the batch and heads of `spec` (one shard's, when split)."""
    operands = dict(operands)
    sides = (("q", spec.q_len, spec.num_heads * spec.head_dim), ("kv", spec.kv_len, spec.num_kv_heads * spec.head_dim))
    for side, length, row_elements in sides:
        offsets = operands.pop(SEGMENT_OFFSETS + side)
        starts = offsets[:, :-1] + (jnp.arange(spec.batch, dtype=jnp.int32) * length)[:, None]
        starts = jnp.concatenate([starts.reshape(-1), jnp.full((1,), spec.batch * length, jnp.int32)])
        operands[f"seq_len_{side}"] = operands[f"seq_len_{side}"].reshape(-1)
        operands[f"ragged_offset_{side}"] = starts * row_elements
        if side == "q":
            operands["ragged_offset_stats"] = starts * spec.num_heads
    return operands


def call_operands(spec: AttentionSpec, inputs: RuntimeInputs, max_segments: int) -> tuple[dict[str, Any], Validity]:
    """Every non-differentiable device operand by role, and which rows cuDNN writes.

    `max_segments` is the call's own: segments past it count as padding (a dense twin drops it
    from its spec)."""
    operands: dict[str, Any] = {}
    b, t, s = spec.batch, spec.q_len, spec.kv_len
    for name, value in (inputs.mod_arrays or {}).items():
        operands[ARRAY_PREFIX + name] = value
    if spec.dropout:  # (B, N) seeds: a shard of a partitioned call reads its own first one
        operands.update(zip(DROPOUT, (inputs.dropout_seeds, jnp.zeros((1,), jnp.int32))))
    if spec.segments:
        operands.update(packed_operands(spec, inputs))
        q_run, kv_run = segment_run_ids(inputs.q_segment_ids), segment_run_ids(inputs.kv_segment_ids)
        validity = Validity((q_run > 0) & (q_run <= max_segments), (kv_run > 0) & (kv_run <= max_segments))
    elif spec.segment_mask:  # a dense twin (operands.graph_spec): self-attention, one ids array
        ids = inputs.q_segment_ids
        run = segment_run_ids(ids)
        valid = (run > 0) & (run <= max_segments)  # as in the packed layout
        token = jnp.arange(t, dtype=jnp.int32)[None, :]
        start = token - segment_positions(ids)
        end = token + segment_positions(ids[:, ::-1])[:, ::-1]  # positions from the segment's end
        for role, bound in zip(SEGMENT_ARRAYS, (start, end)):  # masks.segment_ir; padding: itself
            operands[role] = jnp.where(valid, bound, token).astype(jnp.int32)[:, None, :, None]
        validity = Validity(valid, valid)
    else:
        q_len = jnp.full((b,), t, jnp.int32) if inputs.q_lengths is None else jnp.asarray(inputs.q_lengths, jnp.int32)
        kv_len = jnp.full((b,), s, jnp.int32) if inputs.kv_lengths is None else jnp.asarray(inputs.kv_lengths, jnp.int32)
        validity = Validity(None, None)
        if spec.has_padding or spec.paged:
            operands["seq_len_q"], operands["seq_len_kv"] = q_len, kv_len
        if spec.has_padding:
            validity = Validity(jnp.arange(t)[None, :] < q_len[:, None], jnp.arange(s)[None, :] < kv_len[:, None])
        if spec.paged:  # one table, read once per pool
            table = inputs.page_table.reshape(b, 1, -1, 1)
            operands.update({role: table for role in PAGE_TABLES})
    return operands, validity


def bias_operand(plan: LayoutPlan, inputs: RuntimeInputs, validity: Validity, dtype: Any) -> Any:
    """The graph's bias (`LayoutPlan.bias_shape`): the user's bias, with the boolean mask
    and folded key padding (`validity.kv`) as MASKED_BIAS where they say no."""
    if plan.bias_shape is None:
        return None
    keep = inputs.mask
    if plan.folds_padding and inputs.kv_lengths is not None:
        kv_valid = validity.kv[:, None, None, :]
        keep = kv_valid if keep is None else keep & kv_valid
    bias = inputs.bias
    if keep is not None:
        kept = jnp.zeros((), jnp.float32) if bias is None else bias.astype(jnp.float32)
        bias = jnp.where(keep, kept, jnp.float32(MASKED_BIAS[plan.graph_spec.dtype]))
    return jnp.broadcast_to(bias, plan.bias_shape).astype(dtype)


def attended(plan: LayoutPlan, inputs: RuntimeInputs) -> Any:
    """When the bias carries masks, which (B|1, T, N|1, 1) rows attend to some key (cuDNN
    averages over the others, where sdpagraph gives 0); None when cuDNN masks everything itself.

    Which rows attend follows the call's own spec: with a dense twin (packed segments the THD
    layout cannot take), a row the user's mask empties within its segment must give 0."""
    if not plan.bias_carries_masks:
        return None
    return jnp.swapaxes(attended_rows(plan.call_spec, inputs), 1, 2)[..., None]


def zero_rows(x: Any, valid: Any) -> Any:
    """Zero the token rows that hold no result (x: (B, L, heads, dim), valid: (B, L)): rows cuDNN
    leaves unwritten, or a dense twin's padding rows, which attend to themselves.

    `valid` is None when every row is computed (no padding, no segments): no extra pass.
    """
    if valid is None:
        return x
    return jnp.where(valid[:, :, None, None], x, jnp.zeros((), x.dtype))
