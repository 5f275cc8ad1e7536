"""The spec's position masks written as a score_mod, for graphs where cuDNN's native mask flags are off.

With a `score_mod`, cuDNN refuses its causal and sliding-window flags ("Attention score
mod enabled and hence other subgraphs are disabled"), and it has no flag for chunked
attention at all. Such graphs run the user's mod and then this one: one
`select(score, -inf, keep_i)` per condition, whose bprop is `select(dS, 0, keep_i)`.

It is recorded with the same recorder as user mods, so it goes through the same
emitter, and `scoremod.ir_eval` can check it against the XLA backend's `allowed_mask`
on a CPU. The semantics follow `backends/masking.py` on the dense layout (on the mod path, key
padding travels in the bias operand and packed self-attention segments in `segment_ir`, the
dense twin's extra stage; see `graphs.operands`):

    diag = q + (S - T)   bottom-right        diag = q   top-left
    keep:  k <= diag                               (causal)
           diag - left <= k,  k <= diag + right    (window sides that are bounded)
           chunk(diag) == chunk(k)                 (chunk c; chunk(x) = x - x mod c)

Why this shape, from cuDNN 9.19 on an H100 (tests/gpu op probes, 2026-11-22): score_mod
graphs build when every comparison has INT32 operands (positions, positions plus or
minus int literals, int literals), and find no engine when a comparison has a float
operand (a float literal, `floor(q / c)`) or when conditions are combined with
logical_and / logical_or / logical_not. So conditions are chained selects, literals are
ints, and chunks use `mod` instead of float division. `-inf` (not a large finite
number) is what cuDNN's own masks use on 9.10+.

The operand order is cuDNN's own (pre-9.21) diagonal band mask: `row (+ shift) >= col`
for the right side, `col + (left + 1) > row` for the left. In that order cuDNN skips the
tiles the mask removes: causal-in-a-mod forward 0.46 ms, like the native flag, against
0.89 ms for the same mask written `col <= row` (bf16 B4 T4096 N16 H128, H100, bench/plans.py).
The backward skips them too when its bprop compares fresh indices rather than reusing the
forward's comparison tensors, which `graphs.mod_lowering` takes care of.
"""
from __future__ import annotations

import math

from sdpagraph.scoremod.ir import INT, ScoreModIR
from sdpagraph.scoremod.trace import TensorInfo, trace_score_mod
from sdpagraph.spec import UNBOUNDED, AttentionSpec

MASKED = float("-inf")
QUERY_AXIS, KEY_AXIS = 2, 3


def needs_mod(spec: AttentionSpec, ir: ScoreModIR | None) -> bool:
    """Whether the graph needs a score_mod: a user mod, chunks (cuDNN has no chunk flag), or the
    segment mask of a dense twin (`operands.graph_spec`)."""
    return ir is not None or spec.chunk_size is not None or spec.segment_mask


# The segment mask's aux arrays, (B, 1, T, 1) int32: the index of the first and of the last token
# of each query's segment (segments are contiguous runs, and in self-attention a query's segment
# is also its keys'). A padding token gets its own index for both, so it attends to itself only:
# no row is left empty, and the JAX side zeroes the padding rows.
SEGMENT_ARRAYS = ("segment_start", "segment_end")


def segment_arrays(spec: AttentionSpec) -> tuple[str, ...]:
    """The bounds `segment_ir` reads: the end only without the causal mask, which already keeps
    keys at or before the query (and so inside its segment's end)."""
    return SEGMENT_ARRAYS[:1] if spec.is_causal else SEGMENT_ARRAYS


def segment_ir(spec: AttentionSpec) -> ScoreModIR:
    """Keep a score only where the key lies in the query's segment: `k >= start[q]` and
    `k <= end[q]` (`segment_arrays`). Each compares the key position (input) with an int32 array
    (comparison), the form cuDNN 9.19 builds; it found no engine for an equality of two aux arrays
    (segment numbers), and none for a non-causal forward that had the array as the input of the end
    comparison (H100, 2026-11-22). The bprop compares afresh, from its own indices, as the position
    masks do."""
    shape = (spec.batch, 1, spec.q_len, 1)
    compare = {"segment_start": "cmp_ge", "segment_end": "cmp_le"}

    def conditions(graph, score, tensors):
        k = graph.gen_index(input=score, axis=KEY_AXIS)
        return [getattr(graph, compare[name])(input=k, comparison=tensors[name]) for name in segment_arrays(spec)]

    return trace_score_mod(
        lambda graph, score, tensors: select_each(graph, score, MASKED, conditions(graph, score, tensors)),
        {name: TensorInfo("array", INT, shape) for name in segment_arrays(spec)},
        lambda graph, dscore, tensors: select_each(graph, dscore, 0.0, conditions(graph, dscore, tensors)))


def mask_ir(spec: AttentionSpec) -> ScoreModIR | None:
    """The spec's position masks as a ScoreModIR (forward and bprop), or None when there are none."""
    if not spec.has_position_mask:
        return None
    conditions: list = []  # the bprop reuses the forward's condition tensors

    def forward(graph, score, tensors):
        conditions[:] = _conditions(spec, graph, score)
        return select_each(graph, score, MASKED, conditions)

    def bprop(graph, dscore, tensors):
        return select_each(graph, dscore, 0.0, conditions)

    return trace_score_mod(forward, {}, bprop)


def select_each(graph, value, masked, conditions):
    """`value` where every condition holds, else `masked`: chained selects (no logical ops)."""
    for keep in conditions:
        value = graph.binary_select(input0=value, input1=masked, mask=keep)
    return value


def _conditions(spec: AttentionSpec, graph, score) -> list:
    shift = spec.kv_len - spec.q_len if spec.causal_alignment == "bottom_right" else 0
    return position_conditions(graph, score, causal=spec.is_causal, window=spec.window,
                               chunk_size=spec.chunk_size, shift=shift)


def position_conditions(graph, score, *, causal: bool = False, window: tuple[int, int] = (UNBOUNDED, UNBOUNDED),
                        chunk_size: int | None = None, shift: int = 0) -> list:
    """The boolean tensors "key k may be seen from query q" for causal, window and chunk masks,
    around the diagonal `q + shift`, in the integer-only form cuDNN 9.19 runs."""
    q = graph.gen_index(input=score, axis=QUERY_AXIS)
    k = graph.gen_index(input=score, axis=KEY_AXIS)
    diag = graph.add(a=q, b=shift) if shift else q
    left, right = window
    conditions = []
    if causal:
        conditions.append(graph.cmp_ge(input=diag, comparison=k))
    if left != UNBOUNDED:
        conditions.append(graph.cmp_gt(input=graph.add(a=k, b=left + 1), comparison=diag))
    if right != UNBOUNDED:
        conditions.append(graph.cmp_ge(input=graph.add(a=diag, b=right), comparison=k))
    if chunk_size is not None:
        size = chunk_size
        # A bottom-right diagonal is negative in the first T - S rows; shifting both sides
        # by a multiple of the chunk keeps `mod` (C fmod) on non-negative values, where
        # x - x mod c is the floor the XLA backend takes.
        lift = size * math.ceil(max(-shift, 0) / size)

        def chunk_start(x):
            x = graph.add(a=x, b=lift) if lift else x
            return graph.sub(a=x, b=graph.mod(input0=x, input1=size))

        conditions.append(graph.cmp_eq(input=chunk_start(diag), comparison=chunk_start(k)))
    return conditions
