"""AttentionSpec + ScoreModIR -> the tensors and the sdpa / sdpa_backward node of a cuDNN pygraph.

`lower(graph, spec, ir, direction, cudnn)` describes one graph on a fresh pygraph; it
does not build it. Tensors are created from `operands.describe` (BSHD memory through
strides, no transposes), with the UIDs of `operands.uid_map`, so the executor can bind
buffers by role.

Masks: without a mod, the spec's masks become cuDNN's native flags (padding and packed
segments through sequence lengths, causal and windows as a diagonal band around the
aligned diagonal). With a mod (a user score_mod, or a chunk size, which has no flag),
cuDNN switches those flags off, so causal, window and chunk masks are lowered into the
mod (`scoremod.masks`) and emitted after the user's IR (`graphs.mod_lowering`).

A user mod that starts by scaling the score by a scalar or literal (softcap's `score / cap`)
starts from the score instead, its factor moved into cuDNN's attention scale
(`scoremod.scale_folding`): a float for a literal, a pass-by-value tensor for a scalar.

A boolean mask has no flag: it reaches the graph as (part of) the additive bias operand
(`operands.bias_operand_shape`; the JAX side fills in a large negative value where the
mask says no). cuDNN adds the bias after the score_mod, so a mod cannot undo the mask.
Key padding takes the same road when a mod is present (`operands.folds_padding`): the
mod switches cuDNN's padding mask off, and cuDNN 9.19 crashed the process (segfault,
H100, 2026-11-22) planning sequence lengths written into the mod itself.

Packed self-attention segments that the packed layout cannot take (with a mod, a bias, a
mask or differing head dims) are built as a dense graph whose mod compares each key's position
with its query's segment bounds (`operands.graph_spec`, `masks.segment_ir`).

Declined before building (`Unsupported`): packed segments with chunks, a mod that reads
positions, or cross-attention ids together with a mod (they need the padding mask),
bottom-right alignment with lengths and a mod, and packed buffers whose element offsets
do not fit cuDNN's int32 ragged offsets.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from sdpagraph.errors import Unsupported
from sdpagraph.scoremod.ir import ScoreModIR
from sdpagraph.scoremod.masks import mask_ir, needs_mod, segment_arrays, segment_ir
from sdpagraph.scoremod.scale_folding import fold_leading_scale
from sdpagraph.graphs.mod_lowering import (
    ModEmitter,
    ModStage,
    attention_scale,
    cudnn_type_map,
    pass_by_value_plan,
)
from sdpagraph.graphs.operands import (
    ARRAY_PREFIX,
    ATTN_SCALE,
    DROPOUT,
    FP8_AMAX,
    FP8_BACKWARD_AMAX,
    FP8_BACKWARD_SCALES,
    FP8_GRADIENT,
    FP8_SCALES,
    PAGE_TABLES,
    SINK_TOKEN,
    TensorDesc,
    bias_operand_shape,
    describe,
    folds_padding,
    graph_io,
    uid_map,
)
from sdpagraph.spec import UNBOUNDED, AttentionSpec

IO_TYPES = {"bfloat16": "BFLOAT16", "float16": "HALF", "float8_e4m3fn": "FP8_E4M3", "float8_e5m2": "FP8_E5M2"}
SCALAR_DIMS = [1, 1, 1, 1]
INT32_LIMIT = 2**31 - 1  # cuDNN ragged offsets are int32 element counts


@dataclass(frozen=True)
class Lowering:
    """What the executor needs to know about a described graph, besides its plan."""

    operand_roles: tuple[str, ...]
    result_roles: tuple[str, ...]
    uids: dict[str, int]
    pass_by_value: tuple[tuple[int, tuple[str, Any], str], ...]  # as CompiledGraph.pass_by_value
    emitter: ModEmitter | None = field(default=None, compare=False, repr=False)  # the graph's callbacks

    def release(self) -> None:
        """Free the frontend objects the graph holds through its callbacks (`ModEmitter.release`)."""
        if self.emitter is not None:
            self.emitter.release()


def new_graph(spec: AttentionSpec, direction: str, cudnn: Any) -> Any:
    """An empty pygraph with the spec's io type and fp32 intermediates and compute."""
    return cudnn.pygraph(name=f"sdpagraph_{direction}", io_data_type=_io_type(spec, cudnn),
                         intermediate_data_type=cudnn.data_type.FLOAT, compute_data_type=cudnn.data_type.FLOAT)


def lower(graph: Any, spec: AttentionSpec, ir: ScoreModIR | None, direction: str, cudnn: Any) -> Lowering:
    """Describe the `direction` graph of (spec, ir) on `graph`, a fresh pygraph from `new_graph`.

    Raises `Unsupported` for configs this lowering cannot express.
    """
    _check_lowerable(spec, ir, direction)
    operands, results = graph_io(spec, ir, direction)
    descs = describe(spec, ir, direction)
    fold = fold_leading_scale(ir, direction) if ir is not None else None
    stages = mod_stages(spec, fold.ir if fold is not None else ir)
    plan = pass_by_value_plan(stages, direction)
    scale, scale_tensor = attention_scale(spec.scale, fold)
    if scale_tensor is not None:
        plan.append(scale_tensor)
    uids = uid_map(operands + results + tuple(entry.role for entry in plan))
    types = _storage_types(spec, cudnn)

    tensors: dict[str, Any] = {}
    for role in sorted(operands, key=lambda r: not r.startswith("ragged_offset_")):  # offsets first: q, k, v use them
        desc = descs[role]
        tensors[role] = graph.tensor(name=role, dim=list(desc.dims), stride=list(desc.strides),
                                     data_type=types[desc.dtype], uid=uids[role],
                                     ragged_offset=tensors[desc.ragged_offset] if desc.ragged_offset else None)
    for entry in plan:
        tensors[entry.role] = graph.tensor(name=entry.role, dim=SCALAR_DIMS, stride=SCALAR_DIMS,
                                           data_type=types[entry.dtype], is_pass_by_value=True,
                                           uid=uids[entry.role])
    emitter = ModEmitter(stages, plan, tensors, cudnn_type_map(cudnn)) if stages else None
    options = _sdpa_options(spec, tensors, emitter, direction, cudnn, tensors.get(ATTN_SCALE, scale))

    if spec.is_fp8 and direction == "backward":
        scales = {role: tensors[role] for role in FP8_BACKWARD_SCALES}
        dq, dk, dv, *amax = graph.sdpa_fp8_backward(
            name="sdpa_fp8_backward", q=tensors["q"], k=tensors["k"], v=tensors["v"], o=tensors["o"],
            dO=tensors["dO"], stats=tensors["stats"], **scales, **_fp8_options(spec, tensors))
        outputs = {"dq": dq, "dk": dk, "dv": dv, **dict(zip(FP8_BACKWARD_AMAX, amax))}
    elif spec.is_fp8:
        scales = {role: tensors[role] for role in FP8_SCALES}
        o, stats, *amax = graph.sdpa_fp8(name="sdpa_fp8", q=tensors["q"], k=tensors["k"], v=tensors["v"], **scales,
                                         generate_stats=direction == "forward", **_fp8_options(spec, tensors))
        outputs = {"o": o, "stats": stats, **dict(zip(FP8_AMAX, amax))}
    elif direction == "backward":
        if spec.bias_shape is not None:
            options["dBias"] = graph.tensor(name="dbias", dim=list(descs["dbias"].dims),
                                            stride=list(descs["dbias"].strides), data_type=types["io"])
        if spec.deterministic:
            options["use_deterministic_algorithm"] = True
        dq, dk, dv = graph.sdpa_backward(name="sdpa_backward", q=tensors["q"], k=tensors["k"], v=tensors["v"],
                                         o=tensors["o"], dO=tensors["dO"], stats=tensors["stats"], **options)
        outputs = {"dq": dq, "dk": dk, "dv": dv, "dbias": options.get("dBias")}
    else:
        o, stats = graph.sdpa(name="sdpa", q=tensors["q"], k=tensors["k"], v=tensors["v"],
                              generate_stats=direction == "forward", **options)
        outputs = {"o": o, "stats": stats}
    for role in results:
        _mark_output(outputs[role], descs[role], uids[role], types, tensors)

    pass_by_value = tuple((uids[entry.role], entry.source, entry.dtype) for entry in plan)
    return Lowering(operands, results, uids, pass_by_value, emitter)


def mod_stages(spec: AttentionSpec, ir: ScoreModIR | None) -> list[ModStage]:
    """The mod's stages: the user's IR, then the masks; none when native flags suffice."""
    if not needs_mod(spec, ir):
        return []
    stages = []
    if ir is not None:
        stages.append(ModStage(ir, {name: ARRAY_PREFIX + name for name in ir.array_names}))
    if spec.segment_mask:
        stages.append(ModStage(segment_ir(spec), {name: name for name in segment_arrays(spec)}))
    masks = mask_ir(spec)
    if masks is not None:
        stages.append(ModStage(masks, {}))
    return stages


def _sdpa_options(spec: AttentionSpec, tensors: dict[str, Any], emitter: ModEmitter | None, direction: str,
                  cudnn: Any, attn_scale: Any) -> dict[str, Any]:
    options: dict[str, Any] = {"attn_scale": attn_scale}
    if "bias" in tensors:
        options["bias"] = tensors["bias"]
    if SINK_TOKEN in tensors:
        options["sink_token"] = tensors[SINK_TOKEN]
    if spec.dropout:  # the forward and the backward draw the same mask from the same seed and offset
        options["dropout"] = (spec.dropout, *(tensors[role] for role in DROPOUT))
    if emitter is not None:
        options["score_mod"] = emitter.forward
        if direction == "backward":
            options["score_mod_bprop"] = emitter.bprop
        return options
    if spec.has_padding or spec.segments or spec.paged:
        options.update(use_padding_mask=True, seq_len_q=tensors["seq_len_q"], seq_len_kv=tensors["seq_len_kv"])
    if spec.paged:
        options.update(paged_attention_k_table=tensors[PAGE_TABLES[0]], paged_attention_v_table=tensors[PAGE_TABLES[1]],
                       paged_attention_max_seq_len_kv=spec.kv_len)
    if spec.segments:
        # The totals bound the packed token axes (and the backward's workspace) by B*T, not B*M*T.
        options.update(max_total_seq_len_q=spec.batch * spec.q_len, max_total_seq_len_kv=spec.batch * spec.kv_len)
    left, right = native_band(spec)
    if left is not None or right is not None:
        alignment = cudnn.diagonal_alignment
        options["diagonal_alignment"] = (alignment.BOTTOM_RIGHT if spec.causal_alignment == "bottom_right"
                                         else alignment.TOP_LEFT)
        if left is not None:
            options["diagonal_band_left_bound"] = left
        if right is not None:
            options["diagonal_band_right_bound"] = right
    return options


def _fp8_options(spec: AttentionSpec, tensors: dict[str, Any]) -> dict[str, Any]:
    """sdpa_fp8's options: the scale, top-left causal, padding (`_check_fp8` declines the rest)."""
    options: dict[str, Any] = {"attn_scale": spec.scale, "use_causal_mask": spec.is_causal}
    if spec.has_padding:
        options.update(use_padding_mask=True, seq_len_q=tensors["seq_len_q"], seq_len_kv=tensors["seq_len_kv"])
    return options


def native_band(spec: AttentionSpec) -> tuple[int | None, int | None]:
    """(diagonal_band_left_bound, diagonal_band_right_bound) for the spec's causal mask and window.

    cuDNN keeps key k of query q when `k + left_bound > diag` (so `left_bound = left + 1`)
    and `k <= diag + right_bound`; None leaves a side open.
    """
    left, right = spec.window
    left_bound = left + 1 if left != UNBOUNDED else None
    right_bound = right if right != UNBOUNDED else None
    if spec.is_causal:
        right_bound = 0
    return left_bound, right_bound


def _mark_output(tensor: Any, desc: TensorDesc, uid: int, types: dict[str, Any], tensors: dict[str, Any]) -> None:
    tensor.set_output(True).set_dim(list(desc.dims)).set_stride(list(desc.strides))
    tensor.set_data_type(types[desc.dtype]).set_uid(uid)
    if desc.ragged_offset:
        tensor.set_ragged_offset(tensors[desc.ragged_offset])


def _io_type(spec: AttentionSpec, cudnn: Any) -> Any:
    if spec.dtype not in IO_TYPES:
        raise Unsupported(f"cuDNN SDPA takes bfloat16 or float16 inputs, not {spec.dtype}")
    return getattr(cudnn.data_type, IO_TYPES[spec.dtype])


def _storage_types(spec: AttentionSpec, cudnn: Any) -> dict[str, Any]:
    data_type = cudnn.data_type
    return {"io": _io_type(spec, cudnn), "fp8_gradient": getattr(data_type, IO_TYPES[FP8_GRADIENT]),
            "float32": data_type.FLOAT, "int32": data_type.INT32}


# Why a packed call with a mod is declined, by whether the segments are self-attention's.
_PACKED_WITH_MOD = {
    True: "packed segments cannot be combined with chunk_size or a score_mod that reads positions on cuDNN: "
          "positions count from each segment's start, which only the packed layout sees, and a score_mod "
          "turns off cuDNN's padding mask, which packed sequences need",
    False: "packed cross-attention segments (a pair of ids) cannot be combined with a score_mod or "
           "chunk_size on cuDNN: a score_mod turns off cuDNN's padding mask, which packed sequences need",
}


# What cuDNN 9.19's FP8 forward takes on Hopper (and what sdpagraph lowers of it), by spec feature.
_FP8_DECLINES = (
    (lambda spec, ir: ir is not None, "a score_mod"),
    (lambda spec, ir: spec.bias_shape is not None or spec.mask_shape is not None,
     "a bias or mask (cuDNN's FP8 forward takes no bias on Hopper)"),
    (lambda spec, ir: spec.is_causal and spec.causal_alignment == "bottom_right",
     "bottom-right causal alignment (Hopper's FP8 forward is top-left only)"),
    (lambda spec, ir: spec.has_window or spec.chunk_size is not None, "a sliding window or chunks"),
    (lambda spec, ir: spec.segments is not None, "packed segments"),
    (lambda spec, ir: spec.sinks or spec.dropout or spec.paged is not None, "sinks, dropout or paged K/V"),
    (lambda spec, ir: spec.head_dim != spec.head_dim_v, "differing query/key and value head dims"),
    (lambda spec, ir: spec.head_dim % 16 or spec.head_dim > 256, "a head dim that is not a multiple of 16 up to 256"),
)


def _check_fp8(spec: AttentionSpec, ir: ScoreModIR | None, direction: str) -> None:
    if direction == "backward" and (spec.head_dim != 128 or spec.head_dim_v != 128):
        raise Unsupported(f"cuDNN's FP8 backward on Hopper takes head dim 128 only, not {spec.head_dim}")
    for declines, what in _FP8_DECLINES:
        if declines(spec, ir):
            raise Unsupported(f"cuDNN's FP8 attention (sdpa_fp8) is not lowered with {what}: it runs dequantized "
                              "in bfloat16 instead")


def _check_lowerable(spec: AttentionSpec, ir: ScoreModIR | None, direction: str) -> None:
    if spec.is_fp8:
        _check_fp8(spec, ir, direction)
        return
    if spec.paged and direction == "backward":
        raise Unsupported("paged K/V is inference-only: there is no backward graph")
    if spec.paged and (needs_mod(spec, ir) or bias_operand_shape(spec, ir) is not None):
        raise Unsupported("paged K/V needs cuDNN's padding mask, which a score_mod, chunk_size, bias or mask turns "
                          "off (cuDNN's score_mod excludes it): the XLA backend gathers the pages instead")
    if spec.sinks and direction == "backward":
        raise Unsupported("cuDNN's own sinks run in forward graphs only (its sink backward measured 2x slower): "
                          "a call with sinks runs the backward graph of its spec without sinks")
    if spec.sinks and spec.segments:
        raise Unsupported("attention sinks inside a packed graph need cuDNN 9.26 (its THD backward with sinks); "
                          "they are composed from the logsumexp instead")
    if direction == "backward" and ir is not None and ir.grad_output is None:
        raise Unsupported("the score_mod has no bprop: pass score_mod_bprop or use differentiable ops")
    if needs_mod(spec, ir) and spec.segments:
        raise Unsupported(_PACKED_WITH_MOD[spec.segments == "self"])
    if folds_padding(spec, ir) and spec.causal_alignment == "bottom_right" and spec.has_position_mask:
        raise Unsupported("bottom-right alignment with sequence lengths cannot be combined with a score_mod or "
                          "chunk_size on cuDNN: the diagonal then moves with each row's lengths, which a mod's "
                          "masks cannot read")
    if not spec.segments:
        return
    if spec.head_dim_v != spec.head_dim:
        raise Unsupported(f"packed segments need the value head dim ({spec.head_dim_v}) to equal the "
                          f"query/key head dim ({spec.head_dim}): both share one ragged offset per side")
    if bias_operand_shape(spec, ir) is not None:
        raise Unsupported("a bias or boolean mask cannot be combined with packed segments: its (T, S) axes do "
                          "not map onto packed sequences")
    largest = max(spec.batch * spec.q_len * spec.num_heads, spec.batch * spec.kv_len * spec.num_kv_heads)
    if largest * max(spec.head_dim, spec.head_dim_v) > INT32_LIMIT:
        raise Unsupported(f"packed segments address q/k/v through int32 element offsets, and a buffer here has "
                          f"{largest * max(spec.head_dim, spec.head_dim_v)} elements (> 2**31 - 1): split the batch")
