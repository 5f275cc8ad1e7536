"""Which device buffers a compiled graph takes and returns, in which order, and how cuDNN sees them.

This is the contract between the graph builder and whoever executes a graph (the FFI
executor, the JAX wrapper, the GPU tests); `sdpagraph/graphs/builder.py` documents it
for callers. Everything here is a pure function of `(spec, ir, direction)`, so the JAX
side can compute the operand order without cuDNN or a GPU.

Roles name the buffers: "q", "k", "v", "o", "dO", "stats", "bias",
"seq_len_q", "seq_len_kv", "ragged_offset_q", "ragged_offset_kv",
"ragged_offset_stats", "segment_start", "segment_end" (`masks.segment_ir`), "sink_token"
(attention sinks, (1, N, 1, 1) float32), "page_table_k", "page_table_v" (paged K/V: the same
(B, 1, max_pages, 1) int32 table, once per pool; k and v are then the pools), "dropout_seed",
"dropout_offset" (dropout's Philox seed and offset, int32 scalars cuDNN reads from device memory: the
JAX side passes the (B, N) seeds, whose first element is the block's seed, and a zero offset),
"descale_q", "descale_k", "descale_v", "descale_s", "scale_s", "scale_o" (an FP8 graph's per-tensor
scales, float32 (1, 1, 1, 1)), "array:<name>"
(score_mod aux arrays), and the results
"o", "stats", "dq", "dk", "dv", "dbias", "amax_s", "amax_o" (an FP8 graph's absolute maxima of the
softmax and of the output before its scale). Pass-by-value scalars are named
"scalar:<name>" and "const:<i>"; they are not device operands.

UIDs are positions in one fixed list (operands, then results, then pass-by-value
roles), plus one: deterministic, never random, so a serialized graph's variant pack
can be rebuilt from the roles alone.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from sdpagraph.scoremod.ir import FLOAT, INT, ScoreModIR
from sdpagraph.scoremod.masks import SEGMENT_ARRAYS, needs_mod, segment_arrays
from sdpagraph.spec import DIRECTIONS, AttentionSpec

ARRAY_PREFIX = "array:"
SCALAR_PREFIX = "scalar:"
CONST_PREFIX = "const:"
ATTN_SCALE = "attn_scale"  # cuDNN's attention scale as a pass-by-value tensor (a folded mod's, `scoremod.scale_folding`)
# dK and dV as one (2, *dk.shape) result of a backward call, both written by the graph into it
# (`backends.cudnn.execute.Static.kv_grads_stacked`); not a graph role: the executor binds the two
# tensors at its two halves.
KV_GRADS = "dkv"
BACKWARD_INPUTS = ("o", "dO", "stats")
SINK_TOKEN = "sink_token"  # attention sinks' logits (forward and inference graphs)
PAGE_TABLES = ("page_table_k", "page_table_v")  # paged K/V: each sequence's pages, for k and for v
DROPOUT = ("dropout_seed", "dropout_offset")  # dropout's Philox seed and offset (every direction)
FP8_SCALES = ("descale_q", "descale_k", "descale_v", "descale_s", "scale_s", "scale_o")  # an FP8 forward's scales
FP8_AMAX = ("amax_s", "amax_o")  # an FP8 forward's results besides o (and stats)
# An FP8 backward's scales and its results besides dq, dk, dv. Its dO, dq, dk and dv are e5m2 (FP8_GRADIENT),
# whose range takes gradient scales chosen before the gradients are known (`backends.cudnn.fp8`).
FP8_BACKWARD_SCALES = ("descale_q", "descale_k", "descale_v", "descale_o", "descale_dO", "descale_s", "descale_dP",
                       "scale_s", "scale_dQ", "scale_dK", "scale_dV", "scale_dP")
FP8_BACKWARD_AMAX = ("amax_dq", "amax_dk", "amax_dv", "amax_dp")
FP8_GRADIENT = "float8_e5m2"
ARRAY_TYPES = {FLOAT: "float32", INT: "int32"}  # IR array dtype -> storage


@dataclass(frozen=True)
class TensorDesc:
    """How cuDNN sees one buffer: logical dims and element strides, storage type, ragged offsets.

    `dtype` is "io" (the spec's bfloat16/float16/FP8), "fp8_gradient" (an FP8 backward's dO and gradients:
    FP8_GRADIENT), "float32" or "int32".
    `ragged_offset` names the role holding this tensor's per-sequence start offsets (THD).
    """

    dims: tuple[int, ...]
    strides: tuple[int, ...]
    dtype: str
    ragged_offset: str | None = None


def folds_padding(spec: AttentionSpec, ir: ScoreModIR | None) -> bool:
    """Whether padding travels in the bias operand instead of sequence lengths.

    A mod turns cuDNN's padding mask off, so with one the key lengths become a (B, 1, 1, S)
    additive bias and padded query rows are zeroed on the JAX side.
    """
    return spec.has_padding and not spec.segments and needs_mod(spec, ir)


def folds_segments(spec: AttentionSpec, ir: ScoreModIR | None) -> bool:
    """Whether packed self-attention segments run on the dense layout with a segment mask in the
    score_mod (`graph_spec`), because the packed (THD) layout cannot take this call.

    THD needs cuDNN's padding mask, which a score_mod turns off, has no place for a (T, S) bias
    or mask, and shares one ragged offset between the q/k and the v head dims. In self-attention a
    segment starts at the same token for queries and keys, so the spec's causal and window masks
    give the same answer from absolute positions as from positions within segments. Chunks and
    mods that read positions count from each segment's start, which the dense layout cannot see:
    those calls keep declining. The price: cuDNN computes the tiles between segments (and masks
    them) instead of skipping them; memory stays O(T) (one or two int32 arrays of segment bounds).
    """
    if spec.segments != "self" or spec.chunk_size is not None or (ir is not None and ir.reads_positions):
        return False
    return (ir is not None or spec.bias_shape is not None or spec.mask_shape is not None
            or spec.head_dim_v != spec.head_dim)


def graph_spec(spec: AttentionSpec, ir: ScoreModIR | None) -> AttentionSpec:
    """The spec the cuDNN graph is built for: `spec`, or with `folds_segments` its dense twin
    (`segment_mask`). The graph does not depend on max_segments (the JAX side applies it to the
    bounds it passes), so the twin drops it and one graph serves every bound. Self-attention
    has T == S, where both causal alignments agree, so the twin takes top-left (cuDNN declines
    bottom-right with a bias). The small-sequence backend's segment length hints (`max_seqlen_q`,
    `max_seqlen_kv`) do not change a cuDNN graph either: they are dropped too."""
    if spec.max_seqlen_q is not None or spec.max_seqlen_kv is not None:
        spec = dataclasses.replace(spec, max_seqlen_q=None, max_seqlen_kv=None)
    if not folds_segments(spec, ir):
        return spec
    return dataclasses.replace(spec, segments=None, max_segments=0, causal_alignment="top_left",
                               segment_mask=True)


def bias_operand_shape(spec: AttentionSpec, ir: ScoreModIR | None) -> tuple[int, int, int, int] | None:
    """The graph's additive bias: the user's bias, the boolean mask, and folded key padding
    (a large negative value where they say no), broadcast together; None without any.

    Batch and heads may stay broadcast (size 1); the query and key axes are always full:
    with a bias broadcast over queries, (B, 1, 1, S), cuDNN 9.19's backward returned wrong
    dq (relative error 0.2-0.8; dk, dv and the output were right; H100, 2026-11-22).
    """
    shapes = [shape for shape in (spec.bias_shape, spec.mask_shape) if shape is not None]
    if folds_padding(spec, ir) and spec.has_kv_lengths:
        shapes.append((spec.batch, 1, 1, spec.kv_len))
    if not shapes:
        return None
    batch, heads = (max(sizes) for sizes in list(zip(*shapes))[:2])
    return (batch, heads, spec.q_len, spec.kv_len)


@dataclass(frozen=True)
class LayoutPlan:
    """How one call runs on cuDNN, decided once per call: the graph's spec and what the
    JAX side fills in around it."""

    call_spec: AttentionSpec  # the call as the user made it
    graph_spec: AttentionSpec  # what the graph is built for (`graph_spec`)
    bias_shape: tuple[int, int, int, int] | None  # the bias operand (`bias_operand_shape`), or None
    folds_padding: bool  # key padding rides in the bias operand (`folds_padding`)
    folds_segments: bool  # packed segments run on the dense twin (`folds_segments`)

    @property
    def bias_carries_masks(self) -> bool:
        """Whether the bias operand holds a boolean mask or folded padding: rows with no key left
        to attend to must then be zeroed on the JAX side (cuDNN averages over masked keys)."""
        return self.call_spec.mask_shape is not None or self.folds_padding


def plan_layout(spec: AttentionSpec, ir: ScoreModIR | None) -> LayoutPlan:
    """The one layout decision for a call of `spec` with the score_mod `ir`."""
    graph = graph_spec(spec, ir)
    return LayoutPlan(call_spec=spec, graph_spec=graph, bias_shape=bias_operand_shape(graph, ir),
                      folds_padding=folds_padding(graph, ir), folds_segments=folds_segments(spec, ir))


def graph_io(spec: AttentionSpec, ir: ScoreModIR | None, direction: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(operand roles in FFI order, result roles in FFI order) for one graph."""
    _check_direction(direction)
    if spec.is_fp8:
        return _fp8_io(spec, direction)
    operands = ["q", "k", "v"]
    if direction == "backward":
        operands += BACKWARD_INPUTS
    if bias_operand_shape(spec, ir) is not None:
        operands.append("bias")
    if (spec.has_padding and not folds_padding(spec, ir)) or spec.segments or spec.paged:
        operands += ["seq_len_q", "seq_len_kv"]
    if spec.paged:
        operands += list(PAGE_TABLES)
    if spec.segments:
        operands += ["ragged_offset_q", "ragged_offset_kv"]
        if direction != "inference":
            operands.append("ragged_offset_stats")
    if spec.segment_mask:
        operands += list(segment_arrays(spec))
    if spec.sinks:
        operands.append(SINK_TOKEN)
    if spec.dropout:
        operands += list(DROPOUT)
    operands += [ARRAY_PREFIX + name for name in used_names(ir, "array", direction)]

    if direction == "backward":
        results = ["dq", "dk", "dv"] + (["dbias"] if spec.bias_shape is not None else [])
    else:
        results = ["o", "stats"] if direction == "forward" else ["o"]
    return tuple(operands), tuple(results)


def _fp8_io(spec: AttentionSpec, direction: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """An FP8 (sdpa_fp8 / sdpa_fp8_backward) graph's operands and results: no bias, mask or score_mod."""
    lengths = ["seq_len_q", "seq_len_kv"] if spec.has_padding else []
    if direction == "backward":
        operands = ["q", "k", "v", *BACKWARD_INPUTS, *FP8_BACKWARD_SCALES, *lengths]
        return tuple(operands), ("dq", "dk", "dv") + FP8_BACKWARD_AMAX
    results = ["o", "stats"] if direction == "forward" else ["o"]
    return ("q", "k", "v", *FP8_SCALES, *lengths), tuple(results) + FP8_AMAX


def used_names(ir: ScoreModIR | None, kind: str, direction: str) -> tuple[str, ...]:
    """The scalar or array names the graph reads, in slot order.

    Forward and inference graphs run only the forward part of the mod, so a tensor
    that only the bprop reads is not one of their operands.
    """
    if ir is None:
        return ()
    names = ir.scalar_names if kind == "scalar" else ir.array_names
    if direction == "backward":
        return names
    live = ir.forward_nodes()
    used = {ir.nodes[i].attr("slot") for i in live if ir.nodes[i].op == kind}
    return tuple(name for slot, name in enumerate(names) if slot in used)


def uid_map(roles: tuple[str, ...]) -> dict[str, int]:
    """Role -> UID: its position in `roles` plus one."""
    if len(set(roles)) != len(roles):
        raise ValueError(f"duplicate roles in {roles}")
    return {role: index + 1 for index, role in enumerate(roles)}


def page_count(spec: AttentionSpec) -> int:
    """Pages per sequence of a paged spec: its page table's max_pages (S = max_pages * page_size)."""
    return spec.kv_len // spec.paged[1]


def num_sequences(spec: AttentionSpec) -> int:
    """Sequences cuDNN sees: B dense, B * max_segments when packed (THD)."""
    return spec.batch * spec.max_segments if spec.segments else spec.batch


def describe(spec: AttentionSpec, ir: ScoreModIR | None, direction: str) -> dict[str, TensorDesc]:
    """TensorDesc of every operand and result role of the graph."""
    operands, results = graph_io(spec, ir, direction)
    return {role: _describe_role(spec, ir, role) for role in operands + results}


def _describe_role(spec: AttentionSpec, ir: ScoreModIR | None, role: str) -> TensorDesc:
    b, t, s = num_sequences(spec), spec.q_len, spec.kv_len
    n, k, h, hv = spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.head_dim_v
    packed = bool(spec.segments)
    token_major = {  # role -> (heads, length, head dim, ragged offset role)
        "q": (n, t, h, "ragged_offset_q"), "dq": (n, t, h, "ragged_offset_q"),
        "o": (n, t, hv, "ragged_offset_q"), "dO": (n, t, hv, "ragged_offset_q"),
        "k": (k, s, h, "ragged_offset_kv"), "dk": (k, s, h, "ragged_offset_kv"),
        "v": (k, s, hv, "ragged_offset_kv"), "dv": (k, s, hv, "ragged_offset_kv"),
    }
    if spec.paged and role in ("k", "v"):  # a pool (num_pages, page_size, K, H), as [pages, K, page, H]
        num_pages, page = spec.paged
        dim = h if role == "k" else hv
        return TensorDesc((num_pages, k, page, dim), (page * k * dim, dim, k * dim, 1), "io")
    if role in PAGE_TABLES:
        return _row_major((b, 1, page_count(spec), 1), "int32")
    if role in token_major:
        heads, length, dim, offset = token_major[role]
        dtype = "fp8_gradient" if spec.is_fp8 and role in ("dO", "dq", "dk", "dv") else "io"
        # BSHD memory described as [B, heads, length, dim]: no transposes.
        return TensorDesc((b, heads, length, dim), (length * heads * dim, dim, heads * dim, 1), dtype,
                          offset if packed else None)
    if role == "stats":
        if packed:  # one fp32 per (token, head), tokens major, like q's rows
            return TensorDesc((b, n, t, 1), (t * n, 1, n, 1), "float32", "ragged_offset_stats")
        return TensorDesc((b, n, t, 1), (n * t, t, 1, 1), "float32")
    if role in ("bias", "dbias"):
        return _row_major(bias_operand_shape(spec, ir), "io")
    if role == SINK_TOKEN:
        return _row_major((1, n, 1, 1), "float32")
    if role in DROPOUT:
        return _row_major((1, 1, 1, 1), "int32")
    if role in FP8_SCALES or role in FP8_AMAX or role in FP8_BACKWARD_SCALES or role in FP8_BACKWARD_AMAX:
        return _row_major((1, 1, 1, 1), "float32")
    if role in ("seq_len_q", "seq_len_kv"):
        return _row_major((b, 1, 1, 1), "int32")
    if role.startswith("ragged_offset_"):
        return _row_major((b + 1, 1, 1, 1), "int32")
    if role in SEGMENT_ARRAYS:
        return _row_major((b, 1, t, 1), "int32")
    if role.startswith(ARRAY_PREFIX):
        return array_desc(ir, role[len(ARRAY_PREFIX):])
    raise ValueError(f"unknown operand role {role!r}")


def array_desc(ir: ScoreModIR | None, name: str) -> TensorDesc:
    """A score_mod aux array: its 4-D broadcast shape, row-major, float32 or int32."""
    if ir is None or name not in ir.array_names:
        raise ValueError(f"score_mod has no array {name!r}")
    slot = ir.array_names.index(name)
    node = next(n for _, n in ir.slots("array") if n.attr("slot") == slot)
    return _row_major(tuple(node.attr("shape")), ARRAY_TYPES[node.dtype])


def _row_major(shape: tuple[int, ...], dtype: str) -> TensorDesc:
    strides = []
    step = 1
    for size in reversed(shape):
        strides.append(step)
        step *= size
    return TensorDesc(tuple(shape), tuple(reversed(strides)), dtype)


def _check_direction(direction: str) -> None:
    if direction not in DIRECTIONS:
        raise ValueError(f"direction must be one of {DIRECTIONS}, got {direction!r}")


# Where a boolean mask or folded key padding says no, the bias operand holds this: finite (a row
# with no allowed key must not turn into NaN inside cuDNN; sdpagraph zeroes such rows itself), and
# small enough that cuDNN's fp32 exp2 scaling (x log2 e) of it does not overflow.
MASKED_BIAS = {"bfloat16": -1e30, "float16": float(np.finfo(np.float16).min)}


def stats_shape(spec: AttentionSpec) -> tuple[int, ...]:
    # Packed graphs keep one fp32 stat per (token, head), token major; dense ones (B, N, T).
    b, n, t = spec.batch, spec.num_heads, spec.q_len
    return (b, t, n) if spec.segments else (b, n, t)
