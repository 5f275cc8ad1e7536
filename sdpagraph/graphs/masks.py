"""The spec's masks written as a score_mod, for graphs where cuDNN's native mask flags are off.

With a `score_mod`, cuDNN refuses its causal, padding and sliding-window flags
("Attention score mod enabled and hence other subgraphs are disabled"), and it has no
flag for chunked attention or a boolean mask at all. Such graphs run the user's mod
and then this one: one `select(score, -inf, keep_i)` per condition, whose bprop is
`select(dS, 0, keep_i)` per condition. Conditions are chained selects rather than one
`logical_and`, as cuDNN's own composite masks are: on cuDNN 9.19 (H100) graphs whose
mod combined conditions with logical_and/or found no engine or crashed while planning.
Literals are float, compared with int positions (exact below 2**24), as cuDNN's own
left-bound mask does.

It is recorded with the same recorder as user mods, so it goes through the same
emitter, and `graphs.ir_eval` can check it against the XLA backend's `allowed_mask`
on a CPU. The semantics follow `jax_api/xla.py`:

    diag = q + (seq_len_kv - seq_len_q)   bottom-right with lengths (padding, THD)
         = q + (S - T)                    bottom-right, dense, no lengths
         = q                              top-left
    keep = q < seq_len_q, k < seq_len_kv           (padding / THD)
           k <= diag                               (causal)
           diag - left <= k, k <= diag + right     (window sides that are bounded)
           floor(diag / c) == floor(k / c)         (chunk c)
           mask                                    (boolean mask)

`-inf` (not a large finite number) is what cuDNN's own masks use on 9.10+, so a fully
masked row behaves as it does with the native flags.
"""
from __future__ import annotations

from sdpagraph.graphs.ir import BOOL, INT, ScoreModIR, TensorInfo, trace_score_mod
from sdpagraph.graphs.operands import num_sequences
from sdpagraph.spec import UNBOUNDED, AttentionSpec

MASKED = float("-inf")
QUERY_AXIS, KEY_AXIS = 2, 3
# Array names of the mask mod; each is also the operand role that feeds it.
SEQ_LEN_Q, SEQ_LEN_KV, MASK = "seq_len_q", "seq_len_kv", "mask"


def needs_mod(spec: AttentionSpec, ir: ScoreModIR | None) -> bool:
    """Whether the graph needs a score_mod: a user mod, or a mask with no native cuDNN flag."""
    return ir is not None or spec.chunk_size is not None or spec.mask_shape is not None


def mask_ir(spec: AttentionSpec) -> ScoreModIR | None:
    """The spec's masks as a ScoreModIR (forward and bprop), or None when nothing is masked."""
    inputs: dict[str, TensorInfo] = {}
    if spec.has_padding or spec.segments:
        lengths = TensorInfo("array", INT, (num_sequences(spec), 1, 1, 1))
        inputs.update({SEQ_LEN_Q: lengths, SEQ_LEN_KV: lengths})
    if spec.mask_shape is not None:
        inputs[MASK] = TensorInfo("array", BOOL, spec.mask_shape)
    if not inputs and not spec.has_position_mask:
        return None
    conditions: list = []  # the bprop reuses the forward's condition tensors

    def forward(graph, score, tensors):
        conditions[:] = _conditions(spec, graph, score, tensors)
        return _select_each(graph, score, MASKED, conditions)

    def bprop(graph, dscore, tensors):
        return _select_each(graph, dscore, 0.0, conditions)

    return trace_score_mod(forward, inputs, bprop)


def _select_each(graph, value, masked, conditions):
    for keep in conditions:
        value = graph.binary_select(input0=value, input1=masked, mask=keep)
    return value


def _conditions(spec: AttentionSpec, graph, score, tensors) -> list:
    q = graph.gen_index(input=score, axis=QUERY_AXIS)
    k = graph.gen_index(input=score, axis=KEY_AXIS)
    conditions = []
    if SEQ_LEN_Q in tensors:
        conditions += [graph.cmp_lt(input=q, comparison=tensors[SEQ_LEN_Q]),
                       graph.cmp_lt(input=k, comparison=tensors[SEQ_LEN_KV])]
    diag = _aligned_diagonal(spec, graph, q, tensors)
    left, right = spec.window
    if spec.is_causal:
        conditions.append(graph.cmp_le(input=k, comparison=diag))
    if left != UNBOUNDED:
        conditions.append(graph.cmp_ge(input=k, comparison=graph.sub(a=diag, b=float(left))))
    if right != UNBOUNDED:
        conditions.append(graph.cmp_le(input=k, comparison=graph.add(a=diag, b=float(right))))
    if spec.chunk_size is not None:
        # floor division in float: exact for positions below 2**24, and it floors
        # negative bottom-right diagonals the way jnp.floor_divide does.
        size = float(spec.chunk_size)
        conditions.append(graph.cmp_eq(input=graph.floor(input=graph.div(a=diag, b=size)),
                                       comparison=graph.floor(input=graph.div(a=k, b=size))))
    if MASK in tensors:
        conditions.append(tensors[MASK])
    return conditions


def _aligned_diagonal(spec: AttentionSpec, graph, q, tensors):
    if spec.causal_alignment != "bottom_right":
        return q
    if SEQ_LEN_Q in tensors:
        return graph.add(a=q, b=graph.sub(a=tensors[SEQ_LEN_KV], b=tensors[SEQ_LEN_Q]))
    shift = spec.kv_len - spec.q_len
    return graph.add(a=q, b=float(shift)) if shift else q
