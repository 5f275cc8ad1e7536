"""The cuDNN backend of `attention`: the support query, and execution through the FFI executor.

Graphs are built (or loaded from the cache) at trace time, registered with the C++
executor, and called with `jax.ffi.ffi_call`. A `jax.custom_vjp` runs the forward
graph (O and softmax stats) when differentiating and the backward graph for the
gradients of query, key, value and bias; a call that is not differentiated runs the
forward graph when `training=True` and the smaller inference graph otherwise.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable, Mapping, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from sdpagraph import ffi
from sdpagraph.backends import registry
from sdpagraph.backends.base import Backend, Verify
from sdpagraph.cache.graph_cache import CacheMissError
from sdpagraph.graph_store import CachedGraph, cached_graph, check_graphs
from sdpagraph.graphs.binning import BinPlan, bin_plan
from sdpagraph.scoremod.ir import ScoreModIR
from sdpagraph.scoremod.masks import SEGMENT_ARRAYS
from sdpagraph.graphs.compiled import scalar_bits
from sdpagraph.graphs.operands import ARRAY_PREFIX, MASKED_BIAS, LayoutPlan, graph_io, plan_layout, stats_shape
from sdpagraph.graphs.support import Support, environment_reason, graph_answer
from sdpagraph.backends.cudnn.bins import packed as packed_bins, packer as bin_packer
from sdpagraph.backends.cudnn import sharding
from sdpagraph.call import RuntimeInputs
from sdpagraph.backends.cudnn.graph_on_xla import run_on_xla
from sdpagraph.segments.metadata import segment_metadata, segment_positions, segment_run_ids
from sdpagraph.backends.masking import attended_rows
from sdpagraph.spec import AttentionSpec


def support(spec: AttentionSpec, score_mod: ScoreModIR | None, *, training: bool,
            verify: Callable[..., Any] | None = None) -> Support:
    """Whether the cuDNN graphs this call needs build here (forward, and backward when training),
    and, with `verify` (the numerical check's gate, `numerics.gate.checked`), compute the right values."""
    reason = environment_reason() or ffi.unavailable_reason()
    if reason is not None:
        return graph_answer(False, reason)
    answer = check_graphs(spec, score_mod, training, verify=verify)
    if answer.supported and bin_plan(spec, score_mod) is not None:  # how the documents are placed, too
        return Support(True, answer.backend, f"{answer.reason}; {bin_packer.formulation()}")
    return answer


@dataclass(frozen=True)
class _Static:
    """Everything static about one call (hashable: custom_vjp's non-differentiable argument)."""

    spec: AttentionSpec  # the call's own spec: graphs are keyed and built from it
    graph_spec: AttentionSpec  # the spec the graph runs (`LayoutPlan.graph_spec`): shapes of results
    ir: ScoreModIR | None
    scalars: tuple[tuple[str, Any], ...]
    training: bool
    # The numerical check's gate dispatch chose cuDNN with (`numerics.gate.checked`), or None: the
    # graphs of a per-device spec, built at XLA compile time, are checked with it (`_execute`).
    verify: Callable[..., Any] | None = None


# ----------------------------------------------------------------------------- one FFI call

SEGMENT_OFFSETS = "segment_offsets_"  # + side: per-row token offsets of packed segments (B, M + 1)


def _run_graph(static: _Static, direction: str, operands: Mapping[str, Any],
               results: Mapping[str, jax.ShapeDtypeStruct]) -> dict[str, Any]:
    """Run the `direction` graph on `operands` (as `_operands` gives them: sliceable along batch and
    heads): one op, once per device on its shard when the inputs are sharded (`sharding`)."""
    operand_roles, result_roles = graph_io(static.graph_spec, static.ir, direction)
    needed = {role: x for role, x in operands.items() if role in operand_roles or role.startswith(SEGMENT_OFFSETS)}
    outputs = sharding.call_per_shard(_execute, static, direction, needed, {r: results[r] for r in result_roles})
    return {role: varying_like(x, needed.values()) for role, x in outputs.items()}


def _execute(static: _Static, direction: str, operands: Mapping[str, Any],
             results: Mapping[str, jax.ShapeDtypeStruct]) -> dict[str, Any]:
    """Build or fetch the `direction` graph of `static` (the whole call, or one device's shard of
    it), register it with the executor, and call it on operands of those shapes; graphs that
    failed their numerical check are not run: their computation runs on XLA instead."""
    if static.graph_spec.segments:
        operands = _ragged_operands(static.graph_spec, operands)
    if not _checked(static):
        return run_on_xla(static, operands, results)
    graph = cached_graph(static.spec, static.ir, direction)
    ffi.register_graph(graph.digest, graph.compiled.blob)
    return _call_executor(static, graph, operands, results)


def _checked(static: _Static) -> bool:
    """Whether the graphs of `static` passed the numerical check it carries (True without one).
    For the call's own spec this is the answer dispatch already got (remembered per cache). A
    sharded call's per-device spec (`sharding.localize`) is first seen here, at XLA compile time:
    its graphs are built and checked now, once, and a failure (logged once) runs the shard on XLA."""
    if static.verify is None:
        return True
    verify = functools.partial(static.verify, scalars=dict(static.scalars))
    return support(static.spec, static.ir, training=static.training, verify=verify).supported


def _varying_axes(x: Any) -> frozenset:
    aval = jax.typeof(x)
    manual = getattr(aval, "manual_axis_type", None)
    return frozenset(manual.varying) if manual is not None else frozenset(getattr(aval, "vma", ()))


def varying_like(x: Any, operands: Any) -> Any:
    """`x` marked as varying over every manual mesh axis some operand varies over. Inside a
    `shard_map` (context parallelism), an FFI call's results come back invariant whatever its
    operands are, and a custom_vjp's gradient must carry its primal's manual axes."""
    axes = frozenset().union(*(_varying_axes(op) for op in operands if op is not None and hasattr(op, "shape")))
    missing = tuple(sorted(axes - _varying_axes(x)))
    if not missing:
        return x
    if hasattr(jax.lax, "pcast"):
        return jax.lax.pcast(x, missing, to="varying")
    return jax.lax.pvary(x, missing)  # the older name


def _call_executor(static: _Static, graph: CachedGraph, operands: Mapping[str, Any],
                   results: Mapping[str, jax.ShapeDtypeStruct]) -> dict[str, Any]:
    """The FFI call (CPU tests put an XLA stand-in here)."""
    compiled, digest = graph.compiled, graph.digest
    scalar_uids, scalar_values = scalar_bits(compiled, dict(static.scalars))
    result_shapes = [results[role] for role in compiled.result_roles]
    result_shapes.append(jax.ShapeDtypeStruct((compiled.workspace_size,), jnp.uint8))
    call = jax.ffi.ffi_call(ffi.EXECUTOR_TARGET, result_shapes, vmap_method="sequential")
    outputs = call(
        *(operands[role] for role in compiled.operand_roles),
        graph_key=digest,
        entry_path=graph.entry_path or "",
        uids=np.array([compiled.uids[r] for r in compiled.operand_roles + compiled.result_roles], np.int64),
        scalar_uids=scalar_uids,
        scalar_values=scalar_values,
        workspace_size=np.int64(compiled.workspace_size),
    )
    return dict(zip(compiled.result_roles, outputs[:-1]))


# ----------------------------------------------------------------------------- operands

class _Validity(NamedTuple):
    """Which rows hold results (a pytree, so it can pass through custom_vjp)."""

    q: Any  # (B, T) bool: token rows that hold results, or None when all do
    kv: Any  # (B, S) bool, or None
    attended: Any = None  # (B|1, T, N|1, 1) bool when the bias carries masks: rows with a key to attend to


def _packed_operands(spec: AttentionSpec, inputs: RuntimeInputs) -> dict[str, Any]:
    """Per row: the lengths (B, M) and token offsets (B, M + 1) of its packed segments, in O(T).

    They slice along the batch; the graph's ragged offsets, absolute element offsets into the whole
    packed buffer, are made from them on the shapes the graph runs on (`_ragged_operands`)."""
    operands = {}
    for side, ids in (("q", inputs.q_segment_ids), ("kv", inputs.kv_segment_ids)):
        meta = segment_metadata(ids, spec.max_segments)
        operands[f"seq_len_{side}"] = meta.seq_lens.astype(jnp.int32)
        operands[SEGMENT_OFFSETS + side] = meta.offsets.astype(jnp.int32)
    return operands


def _ragged_operands(spec: AttentionSpec, operands: Mapping[str, Any]) -> dict[str, Any]:
    """The packed graph's seq lens and ragged element offsets of its B*M sequences (THD), from the
    per-row ones of `_packed_operands`, for the batch and heads of `spec` (one shard's, when split)."""
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


def _operands(spec: AttentionSpec, inputs: RuntimeInputs, max_segments: int) -> tuple[dict[str, Any], _Validity]:
    """Every non-differentiable device operand by role, and which rows cuDNN writes.

    `max_segments` is the call's own: segments past it count as padding (a dense twin drops it
    from its spec)."""
    operands: dict[str, Any] = {}
    b, t, s = spec.batch, spec.q_len, spec.kv_len
    for name, value in (inputs.mod_arrays or {}).items():
        operands[ARRAY_PREFIX + name] = value
    if spec.segments:
        operands.update(_packed_operands(spec, inputs))
        q_run, kv_run = segment_run_ids(inputs.q_segment_ids), segment_run_ids(inputs.kv_segment_ids)
        validity = _Validity((q_run > 0) & (q_run <= max_segments), (kv_run > 0) & (kv_run <= max_segments))
    elif spec.segment_mask:  # a dense twin (operands.graph_spec): self-attention, one ids array
        ids = inputs.q_segment_ids
        run = segment_run_ids(ids)
        valid = (run > 0) & (run <= max_segments)  # as in the packed layout
        token = jnp.arange(t, dtype=jnp.int32)[None, :]
        start = token - segment_positions(ids)
        end = token + segment_positions(ids[:, ::-1])[:, ::-1]  # positions from the segment's end
        for role, bound in zip(SEGMENT_ARRAYS, (start, end)):  # masks.segment_ir; padding: itself
            operands[role] = jnp.where(valid, bound, token).astype(jnp.int32)[:, None, :, None]
        validity = _Validity(valid, valid)
    else:
        q_len = jnp.full((b,), t, jnp.int32) if inputs.q_lengths is None else jnp.asarray(inputs.q_lengths, jnp.int32)
        kv_len = jnp.full((b,), s, jnp.int32) if inputs.kv_lengths is None else jnp.asarray(inputs.kv_lengths, jnp.int32)
        validity = _Validity(None, None)
        if spec.has_padding:
            operands["seq_len_q"], operands["seq_len_kv"] = q_len, kv_len
            validity = _Validity(jnp.arange(t)[None, :] < q_len[:, None], jnp.arange(s)[None, :] < kv_len[:, None])
    return operands, validity


def _bias_operand(plan: LayoutPlan, inputs: RuntimeInputs, validity: _Validity, dtype: Any) -> Any:
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


def _attended(plan: LayoutPlan, inputs: RuntimeInputs) -> Any:
    """When the bias carries masks, which (B|1, T, N|1, 1) rows attend to some key (cuDNN
    averages over the others, where sdpagraph gives 0); None when cuDNN masks everything itself.

    Which rows attend follows the call's own spec: with a dense twin (packed segments the THD
    layout cannot take), a row the user's mask empties within its segment must give 0."""
    if not plan.bias_carries_masks:
        return None
    return jnp.swapaxes(attended_rows(plan.call_spec, inputs), 1, 2)[..., None]


def _zero_rows(x: Any, valid: Any) -> Any:
    """Zero the token rows that hold no result (x: (B, L, heads, dim), valid: (B, L)): rows cuDNN
    leaves unwritten, or a dense twin's padding rows, which attend to themselves.

    `valid` is None when every row is computed (no padding, no segments): no extra pass.
    """
    if valid is None:
        return x
    return jnp.where(valid[:, :, None, None], x, jnp.zeros((), x.dtype))


# ----------------------------------------------------------------------------- custom_vjp

def _forward(static: _Static, q, k, v, bias, aux, direction: str):
    spec = static.graph_spec
    results = {"o": jax.ShapeDtypeStruct((spec.batch, spec.q_len, spec.num_heads, spec.head_dim_v), q.dtype),
               "stats": jax.ShapeDtypeStruct(stats_shape(spec), jnp.float32)}
    operands = {"q": q, "k": k, "v": v, "bias": bias, **aux}
    out = _run_graph(static, direction, operands, results)
    return out["o"], out.get("stats")


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _core(static: _Static, q, k, v, bias, aux, validity):
    return _forward(static, q, k, v, bias, aux, "forward" if static.training else "inference")


def _core_fwd(static: _Static, q, k, v, bias, aux, validity):
    o, stats = _forward(static, q, k, v, bias, aux, "forward")
    return (o, stats), (q, k, v, bias, aux, validity, o, stats)


def _backward(static: _Static, q, k, v, bias, aux, o, stats, d_o) -> dict[str, Any]:
    """The backward graph: dq, dk, dv (and dbias) from the softmax stats and the output they belong to."""
    results = {"dq": jax.ShapeDtypeStruct(q.shape, q.dtype), "dk": jax.ShapeDtypeStruct(k.shape, k.dtype),
               "dv": jax.ShapeDtypeStruct(v.shape, v.dtype)}
    if static.graph_spec.bias_shape is not None:
        results["dbias"] = jax.ShapeDtypeStruct(bias.shape, bias.dtype)
    operands = {"q": q, "k": k, "v": v, "o": o, "dO": d_o.astype(o.dtype), "stats": stats, "bias": bias, **aux}
    return _run_graph(static, "backward", operands, results)


def _core_bwd(static: _Static, residuals, cotangents):
    q, k, v, bias, aux, validity, o, stats = residuals
    # The stats (logsumexp) are returned without a gradient, as jax does. Rows that `attention`
    # zeroes after this core (padding, nothing to attend to) already arrive with a zero d_o.
    d_o, _ = cotangents
    grads = _backward(static, q, k, v, bias, aux, o, stats, d_o)
    dq = _zero_rows(grads["dq"], validity.q)
    dk, dv = (_zero_rows(grads[role], validity.kv) for role in ("dk", "dv"))
    dbias = grads.get("dbias")
    if dbias is None and bias is not None:  # a mask-only bias: a constant
        dbias = jnp.zeros_like(bias)
    return dq, dk, dv, dbias, None, None


_core.defvjp(_core_fwd, _core_bwd)


def attention(spec: AttentionSpec, query: Any, key: Any, value: Any, inputs: RuntimeInputs,
              score_mod: ScoreModIR | None, *, training: bool = True,
              verify: Callable[..., Any] | None = None) -> tuple[Any, Any]:
    """Return (output (B, T, N, H_v), logsumexp (B, N, T) or None for the inference graph).
    `verify`: the numerical check the call's graphs passed (`support`); per-device graphs of a
    sharded call are checked with it too. Packed documents run on bins (`backends.cudnn.bins.packed`)
    where `graphs.binning` plans them and the bins' graphs pass their own check here."""
    run = functools.partial(_attention, score_mod=score_mod, training=training, verify=verify)
    bins = bin_plan(spec, score_mod)
    if bins is not None and packed_bins.usable() and _bins_supported(bins, score_mod, training, verify, inputs):
        return packed_bins.attention(bins, spec, query, key, value, inputs, run)
    return run(spec, query, key, value, inputs)


def _bins_supported(bins: BinPlan, score_mod: ScoreModIR | None, training: bool,
                    verify: Callable[..., Any] | None, inputs: RuntimeInputs) -> bool:
    """Whether the bins' graphs build here and pass their check; in strict mode, a cache without them
    (one precompiled before binning) runs the call unbinned rather than failing it."""
    if verify is not None:
        verify = functools.partial(verify, scalars=inputs.mod_scalars)
    try:
        return support(bins.spec, score_mod, training=training, verify=verify).supported
    except CacheMissError:
        return False


def _attention(spec: AttentionSpec, query: Any, key: Any, value: Any, inputs: RuntimeInputs, *,
               score_mod: ScoreModIR | None, training: bool, verify: Callable[..., Any] | None) -> tuple[Any, Any]:
    plan = plan_layout(spec, score_mod)
    static = _Static(spec, plan.graph_spec, score_mod, tuple(sorted((inputs.mod_scalars or {}).items())), training,
                     verify)
    aux, validity = _operands(plan.graph_spec, inputs, spec.max_segments)
    validity = validity._replace(attended=_attended(plan, inputs))
    bias = _bias_operand(plan, inputs, validity, query.dtype)
    spec = plan.graph_spec
    out, stats = _core(static, query, key, value, bias, aux, validity)
    out = _zero_rows(out, validity.q)
    if validity.attended is not None:
        out = jnp.where(validity.attended, out, jnp.zeros((), out.dtype))
    if stats is None:
        return out, None
    lse = jnp.swapaxes(stats, 1, 2) if spec.segments else stats
    if validity.q is not None:
        lse = jnp.where(validity.q[:, None, :], lse, -jnp.inf)
    if validity.attended is not None:
        lse = jnp.where(jnp.swapaxes(validity.attended[..., 0], 1, 2), lse, -jnp.inf)
    return out, lse


# ----------------------------------------------------------------------------- context-parallel blocks
# A block of a context-parallel ring (`parallel.ring`) is a dense call without padding, segments,
# bias or mask; its backward is fed the FINAL merged output and logsumexp of every block, so each
# block's dq, dk, dv is exact. `aux` holds the score_mod's array operands (`block_operands`).

def block_static(spec: AttentionSpec, score_mod: ScoreModIR | None, scalars: Mapping[str, Any]) -> _Static:
    return _Static(spec, plan_layout(spec, score_mod).graph_spec, score_mod, tuple(sorted(scalars.items())), True)


def block_operands(inputs: RuntimeInputs) -> dict[str, Any]:
    return {ARRAY_PREFIX + name: x for name, x in (inputs.mod_arrays or {}).items()}


def block_forward(static: _Static, q, k, v, aux: Mapping[str, Any]) -> tuple[Any, Any]:
    """(o (B, T, N, H_v), logsumexp (B, N, T) fp32) of one block."""
    return _forward(static, q, k, v, None, dict(aux), "forward")


def block_backward(static: _Static, q, k, v, aux: Mapping[str, Any], o, lse, d_o) -> tuple[Any, Any, Any]:
    """(dq, dk, dv) of one block, given the whole attention's output `o` and logsumexp `lse`."""
    grads = _backward(static, q, k, v, None, dict(aux), o, lse, d_o)
    return grads["dq"], grads["dk"], grads["dv"]


class CudnnBackend(Backend):
    """cuDNN SDPA graphs, built (or loaded from the cache) at trace time and run by the FFI executor.
    The ring's blocks (`parallel.ring`) run its forward and backward graphs one pair at a time."""

    name = "cudnn"
    packs_by_hints = True
    lse_without_gradient = ("the cuDNN backward graph takes dO alone (its softmax stats are returned without "
                            "a gradient)")
    block_static = staticmethod(block_static)
    block_operands = staticmethod(block_operands)
    block_forward = staticmethod(block_forward)
    block_backward = staticmethod(block_backward)

    def support(self, spec: AttentionSpec, score_mod: ScoreModIR | None, *, training: bool,
                verify: Verify | None = None) -> Support:
        answer = support(spec, score_mod, training=training, verify=verify)
        runs_on = self if answer.supported else registry.reference()
        return Support(answer.supported, runs_on.name, answer.reason)

    def attention(self, spec: AttentionSpec, query: Any, key: Any, value: Any, inputs: RuntimeInputs,
                  score_mod: ScoreModIR | None, *, training: bool = True,
                  verify: Verify | None = None) -> tuple[Any, Any]:
        return attention(spec, query, key, value, inputs, score_mod, training=training, verify=verify)


BACKEND = CudnnBackend()
