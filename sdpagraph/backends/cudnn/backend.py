"""The cuDNN backend of `attention`: its calls composed from graph runs (`execute`: the support query,
and one graph through the FFI executor).

Graphs are built (or loaded from the cache) at trace time, registered with the C++
executor, and called with `jax.ffi.ffi_call` (`execute`). A `jax.custom_vjp` runs the forward
graph (O and softmax stats) when differentiating and the backward graph for the
gradients of query, key, value and bias; a call that is not differentiated runs the
forward graph when `training=True` and the smaller inference graph otherwise.
Attention sinks (`backends.sinks`) join inside the custom_vjp: in the forward graph as cuDNN's own
`sink_token` (a spec with `sinks`) where it builds, else composed from the stats; the backward graph of
the spec without sinks is given the output and stats with the sink, and the sinks' gradient is composed
(cuDNN's sink backward measured 2x slower).
"""
from __future__ import annotations

import functools
import dataclasses
from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp

from sdpagraph.config import NATIVE_SINKS
from sdpagraph.backends import registry, sinks as sinks_mod
from sdpagraph.backends.base import Backend, Verify
from sdpagraph.backends.cudnn import fp8, paged_decode
from sdpagraph.backends.cudnn.bins import packed as packed_bins, partitioned as partitioned_bins
from sdpagraph.backends.cudnn.call_operands import Validity, attended, bias_operand, call_operands, zero_rows
from sdpagraph.backends.cudnn import execute
from sdpagraph.backends.cudnn.execute import Static, run_graph
from sdpagraph.cache.graph_cache import CacheMissError
from sdpagraph.call import RuntimeInputs
from sdpagraph.graphs.alternatives import alternatives
from sdpagraph.graphs.chunk_documents import chunk_documents, chunk_ids
from sdpagraph.graphs.binning import bin_plan
from sdpagraph.graphs.decode_fold import decode_fold
from sdpagraph.graphs.operands import ARRAY_PREFIX, KV_GRADS, SINK_TOKEN, plan_layout, stats_shape
from sdpagraph.graphs.support import Support
from sdpagraph.scoremod.ir import ScoreModIR
from sdpagraph.scoremod.masks import SEGMENT_ARRAYS
from sdpagraph.segments.metadata import at_runs, segment_metadata, segment_run_ids
from sdpagraph.spec import AttentionSpec


# ----------------------------------------------------------------------------- custom_vjp

def _forward(static: Static, q, k, v, bias, aux, direction: str):
    spec = static.graph_spec
    results = {"o": jax.ShapeDtypeStruct((spec.batch, spec.q_len, spec.num_heads, spec.head_dim_v), q.dtype),
               "stats": jax.ShapeDtypeStruct(stats_shape(spec), jnp.float32)}
    operands = {"q": q, "k": k, "v": v, "bias": bias, **aux}
    out = run_graph(static, direction, operands, results)
    return out["o"], out.get("stats")


def _stats_as_lse(spec: AttentionSpec, stats: Any) -> Any:
    """The graph's softmax stats as the (B, N, T) logsumexp (a packed graph's are (B, T, N)); and back."""
    return jnp.swapaxes(stats, 1, 2) if spec.segments else stats


def _with_sinks(static: Static, o, stats, sinks) -> tuple[Any, Any]:
    """(o, stats) with the sinks joined (`sinks.apply`), in the graph's layouts; as given without
    sinks or when the graph joined them itself (`spec.sinks`)."""
    if sinks is None or static.graph_spec.sinks:
        return o, stats
    o, lse = sinks_mod.apply(o, _stats_as_lse(static.graph_spec, stats), sinks)
    return o, _stats_as_lse(static.graph_spec, lse)


def _without_sinks(static: Static) -> Static:
    """`static` of the call's spec without cuDNN's own sinks (whose graphs are forward only)."""
    return dataclasses.replace(static, spec=dataclasses.replace(static.spec, sinks=False),
                               graph_spec=dataclasses.replace(static.graph_spec, sinks=False))


def _sink_operand(static: Static, aux: Mapping[str, Any], sinks: Any) -> dict[str, Any]:
    """`aux` and, for a graph with cuDNN's sinks, their logits as its (1, N, 1, 1) float32 operand."""
    if not static.graph_spec.sinks:
        return aux
    return {**aux, SINK_TOKEN: sinks.astype(jnp.float32).reshape(1, -1, 1, 1)}


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _core(static: Static, q, k, v, bias, aux, validity, sinks):
    # Composed sinks read the stats; cuDNN's own need none (`_with_sinks`).
    keep_stats = static.training or (sinks is not None and not static.graph_spec.sinks)
    direction = "forward" if keep_stats else "inference"
    return _with_sinks(static, *_forward(static, q, k, v, bias, _sink_operand(static, aux, sinks), direction), sinks)


def _core_fwd(static: Static, q, k, v, bias, aux, validity, sinks):
    aux = _sink_operand(static, aux, sinks)
    o, stats = _with_sinks(static, *_forward(static, q, k, v, bias, aux, "forward"), sinks)
    return (o, stats), (q, k, v, bias, aux, validity, o, stats, sinks)


def _backward(static: Static, q, k, v, bias, aux, o, stats, d_o) -> dict[str, Any]:
    """The backward graph: dq, dk, dv (and dbias) from the softmax stats and the output they belong to."""
    results = {"dq": jax.ShapeDtypeStruct(q.shape, q.dtype), "dk": jax.ShapeDtypeStruct(k.shape, k.dtype),
               "dv": jax.ShapeDtypeStruct(v.shape, v.dtype)}
    if static.graph_spec.bias_shape is not None:
        results["dbias"] = jax.ShapeDtypeStruct(bias.shape, bias.dtype)
    operands = {"q": q, "k": k, "v": v, "o": o, "dO": d_o.astype(o.dtype), "stats": stats, "bias": bias, **aux}
    return run_graph(static, "backward", operands, results)


def _core_bwd(static: Static, residuals, cotangents):
    q, k, v, bias, aux, validity, o, stats, sinks = residuals
    # The stats (logsumexp) are returned without a gradient, as jax does. Rows that `attention`
    # zeroes after this core (padding, nothing to attend to) already arrive with a zero d_o.
    # With sinks, o and stats are the sink's (out', L'), joined by cuDNN's forward graph or composed:
    # the backward graph of the spec without sinks is then exact, and the sinks' gradient is composed.
    d_o, _ = cotangents
    if static.graph_spec.sinks:
        static = _without_sinks(static)
    grads = _backward(static, q, k, v, bias, aux, o, stats, d_o)
    d_sinks = None if sinks is None else sinks_mod.gradient(d_o, o, _stats_as_lse(static.graph_spec, stats), sinks,
                                                            rows=validity.q)
    dq = zero_rows(grads["dq"], validity.q)
    dk, dv = (zero_rows(grads[role], validity.kv) for role in ("dk", "dv"))
    dbias = grads.get("dbias")
    if dbias is None and bias is not None:  # a mask-only bias: a constant
        dbias = jnp.zeros_like(bias)
    return dq, dk, dv, dbias, None, None, d_sinks


_core.defvjp(_core_fwd, _core_bwd)


def attention(spec: AttentionSpec, query: Any, key: Any, value: Any, inputs: RuntimeInputs,
              score_mod: ScoreModIR | None, *, training: bool = True,
              verify: Callable[..., Any] | None = None, sinks: Any = None) -> tuple[Any, Any]:
    """Return (output (B, T, N, H_v), logsumexp (B, N, T) or None for the inference graph), with the
    attention `sinks` (N,) joined when given. `verify`: the numerical
    check the call's graphs passed (`support`); per-device graphs of a sharded call are checked with
    it too. Where their own graphs build and pass their check here, some calls run as others: packed
    documents on bins (`graphs.binning`), chunked attention as packed documents
    (`graphs.chunk_documents`), a multi-token decode as a folded prefix and a tail
    (`graphs.decode_fold`)."""
    if spec.is_fp8:  # FP8 inputs: the inference graph; others: quantized, differentiable (`backends.cudnn.fp8`)
        if jnp.dtype(query.dtype).name == spec.dtype:
            return fp8_attention(spec, query, key, value, inputs, verify=verify)[0], None
        return fp8.training(spec, query, key, value, inputs, _graph_run(spec, True, verify))
    run = functools.partial(_attention, score_mod=score_mod, training=training, verify=verify, sinks=sinks)
    scalars = inputs.mod_scalars
    folded = decode_fold(spec, score_mod)
    if folded is not None and _runs_here(folded, None, True, verify, scalars):
        with_stats = functools.partial(_attention, score_mod=None, training=True, verify=verify)
        out, lse = paged_decode.attention(spec, folded, query, key, value, inputs, with_stats)
        # inference only (paged): the sinks join the merged result, no gradient to keep exact
        return (out, lse) if sinks is None else sinks_mod.apply(out, lse, sinks)
    documents = chunk_documents(spec, score_mod)
    if documents is not None and _runs_here(documents, None, training, verify, scalars):
        ids = chunk_ids(spec)
        return run(documents, query, key, value, dataclasses.replace(inputs, q_segment_ids=ids, kv_segment_ids=ids))
    bins = bin_plan(spec, score_mod)
    if bins is not None:
        one_device, per_device = packed_bins.usable(), partitioned_bins.usable(inputs, sinks)
        if not (one_device or per_device):
            packed_bins.say_why_not()
        elif _runs_here(bins.spec, score_mod, training, verify, scalars):
            if one_device:
                return packed_bins.attention(bins, spec, query, key, value, inputs, run)
            return partitioned_bins.attention(spec, query, key, value, inputs, score_mod, CudnnBackend,
                                              training=training, verify=verify)
    return run(spec, query, key, value, inputs)


def fp8_attention(spec: AttentionSpec, query: Any, key: Any, value: Any, inputs: RuntimeInputs, *,
                  verify: Callable[..., Any] | None = None) -> tuple[Any, Any]:
    """(o in the inputs' FP8 dtype, amax of o before scale_o) of an FP8 spec: cuDNN's sdpa_fp8 inference
    graph with the scales of `inputs.fp8_scales` (`backends.cudnn.fp8.inference`)."""
    return fp8.inference(spec, query, key, value, inputs, _graph_run(spec, False, verify))


def _graph_run(spec: AttentionSpec, training: bool, verify: Callable[..., Any] | None) -> fp8.Run:
    """run(direction, operands, results): one graph call of `spec` (no score_mod), as `execute.run_graph`."""
    return functools.partial(run_graph, Static(spec, spec, None, (), training, verify))


def _runs_here(spec: AttentionSpec, score_mod: ScoreModIR | None, training: bool,
               verify: Callable[..., Any] | None, scalars: Mapping[str, Any] | None) -> bool:
    """Whether the graphs of a call run in place of another's build here and pass their check; in
    strict mode, a cache without them (precompiled before they existed) runs the call as it is."""
    if verify is not None:
        verify = functools.partial(verify, scalars=scalars)
    try:
        return execute.support(spec, score_mod, training=training, verify=verify).supported
    except CacheMissError:
        return False


def native_sinks_spec(spec: AttentionSpec, score_mod: ScoreModIR | None, training: bool,
                      verify: Callable[..., Any] | None, inputs: RuntimeInputs) -> AttentionSpec | None:
    """The spec of the call with cuDNN's own sinks in its forward graph (`SDPAGRAPH_NATIVE_SINKS`, on
    by default) when that graph builds here and passes its check, else None (the sinks are then
    composed). A call that runs as another (`graphs.alternatives`: bins, chunks as documents, a decode
    fold) composes them there, where cuDNN's own sinks would take it off its faster form. With dropout they
    are composed too: a forward with cuDNN's sinks and a backward without them need not draw one mask."""
    if not NATIVE_SINKS.enabled() or alternatives(spec, score_mod, training) or spec.dropout:
        return None
    native = dataclasses.replace(spec, sinks=True)
    return native if _runs_here(native, score_mod, training, verify, inputs.mod_scalars) else None


def _attention(spec: AttentionSpec, query: Any, key: Any, value: Any, inputs: RuntimeInputs, *,
               score_mod: ScoreModIR | None, training: bool, verify: Callable[..., Any] | None,
               sinks: Any = None) -> tuple[Any, Any]:
    plan = plan_layout(spec, score_mod)
    static = Static(spec, plan.graph_spec, score_mod, tuple(sorted((inputs.mod_scalars or {}).items())), training,
                     verify)
    aux, validity = call_operands(plan.graph_spec, inputs, spec.max_segments)
    validity = validity._replace(attended=attended(plan, inputs))
    bias = bias_operand(plan, inputs, validity, query.dtype)
    spec = plan.graph_spec
    out, stats = _core(static, query, key, value, bias, aux, validity, sinks)
    out = zero_rows(out, validity.q)
    if validity.attended is not None:
        out = jnp.where(validity.attended, out, jnp.zeros((), out.dtype))
    if stats is None:
        return out, None
    lse = _stats_as_lse(spec, stats)
    # A row with nothing to attend: logsumexp -inf, or the sink's logit
    nothing = -jnp.inf if sinks is None else sinks.astype(lse.dtype)[None, :, None]
    if validity.q is not None:
        lse = jnp.where(validity.q[:, None, :], lse, nothing)
    if validity.attended is not None:
        lse = jnp.where(jnp.swapaxes(validity.attended[..., 0], 1, 2), lse, nothing)
    return out, lse


# ----------------------------------------------------------------------------- context-parallel blocks
# A block of a context-parallel ring (`parallel.ring`) is a call without padding, bias or mask: dense,
# or over the documents a (query chunk, key chunk) pair shares, given as pair-local segment ids
# (`parallel.ring_documents`): packed (THD), or on the dense twin (`operands.graph_spec`: a score_mod)
# with each query's document bounds in the key chunk. Its backward is fed the FINAL merged output and
# logsumexp of every block, so each block's dq, dk, dv is exact. Rows outside the pair's documents (no
# key of the pair is theirs, or padding) are left unwritten by a packed graph and attend no key on the
# twin: they are masked here (output 0, logsumexp -inf, gradients 0), whatever cuDNN does with
# zero-length sequences or rows with every key masked.

def block_static(spec: AttentionSpec, score_mod: ScoreModIR | None, scalars: Mapping[str, Any]) -> Static:
    return Static(spec, plan_layout(spec, score_mod).graph_spec, score_mod, tuple(sorted(scalars.items())), True)


def block_operands(static: Static, inputs: RuntimeInputs) -> tuple[dict[str, Any], Validity]:
    """(the block graph's operands by role, the rows that hold results): the score_mod's arrays, and
    from `inputs`' pair-local segment ids a packed block's per-slot lengths and token offsets, or the
    dense twin's segment bounds (`_pair_segment_bounds`)."""
    if static.graph_spec.segment_mask:
        return _pair_segment_bounds(static, inputs)
    return call_operands(static.graph_spec, inputs, static.spec.max_segments)


def _pair_segment_bounds(static: Static, inputs: RuntimeInputs) -> tuple[dict[str, Any], Validity]:
    """A dense-twin block's operands: per query row, the first and last key of its document in the
    key chunk (`masks.segment_ir`, key-chunk indices). A row outside the pair's documents gets bounds
    no key meets: it attends nothing, so it gives no key a gradient."""
    operands = {ARRAY_PREFIX + name: x for name, x in (inputs.mod_arrays or {}).items()}
    q_slot, kv_slot = segment_run_ids(inputs.q_segment_ids), segment_run_ids(inputs.kv_segment_ids)
    keys = segment_metadata(inputs.kv_segment_ids, static.spec.max_segments)
    start = at_runs(keys.offsets[:, :-1], q_slot)
    end = start + at_runs(keys.seq_lens, q_slot) - 1
    covered = q_slot > 0
    bounds = (jnp.where(covered, start, static.graph_spec.kv_len), jnp.where(covered, end, -1))
    for role, bound in zip(SEGMENT_ARRAYS, bounds):
        operands[role] = bound.astype(jnp.int32)[:, None, :, None]
    return operands, Validity(covered, kv_slot > 0)


def block_forward(static: Static, q, k, v, operands: tuple[Mapping[str, Any], Validity],
                  zero_unwritten: bool = False, inference: bool = False) -> tuple[Any, Any]:
    """(o (B, T, N, H_v), logsumexp (B, N, T) fp32) of one block. `zero_unwritten`: the executor
    zeroes the rows a packed graph leaves unwritten (a memset) instead of a masking pass after the
    call; for callers that do not fuse that mask into a pass of their own (the ring's merges do).
    `inference`: the inference graph, which keeps no softmax stats (the logsumexp is then None)."""
    aux, validity = operands
    static = dataclasses.replace(static, zero_unwritten=zero_unwritten)
    o, stats = _forward(static, q, k, v, None, dict(aux), "inference" if inference else "forward")
    if validity.q is None:
        return o, stats
    o = o if static.unwritten_zeroed else zero_rows(o, validity.q)
    if stats is None:
        return o, None
    return o, jnp.where(validity.q[:, None, :], _stats_as_lse(static.graph_spec, stats), -jnp.inf)


def _block_grads(static: Static, q, k, v, operands: tuple[Mapping[str, Any], Validity], o, lse, d_o) -> dict[str, Any]:
    aux, validity = operands
    if validity.q is not None:  # a finite stat keeps a row that attends no key here at 0 (padding's lse is -inf)
        lse = jnp.where(validity.q[:, None, :], lse, 0.0)
    return _backward(static, q, k, v, None, dict(aux), o, _stats_as_lse(static.graph_spec, lse), d_o)


def block_backward(static: Static, q, k, v, operands: tuple[Mapping[str, Any], Validity], o, lse,
                   d_o, zero_unwritten: bool = False) -> tuple[Any, Any, Any]:
    """(dq, dk, dv) of one block, given the whole attention's output `o` and logsumexp `lse` (B, N, T);
    `zero_unwritten` as `block_forward`'s."""
    validity, static = operands[1], dataclasses.replace(static, zero_unwritten=zero_unwritten)
    grads = _block_grads(static, q, k, v, operands, o, lse, d_o)
    if static.unwritten_zeroed:
        return grads["dq"], grads["dk"], grads["dv"]
    dk, dv = (zero_rows(grads[role], validity.kv) for role in ("dk", "dv"))
    return zero_rows(grads["dq"], validity.q), dk, dv


def block_backward_stacked(static: Static, q, k, v, operands: tuple[Mapping[str, Any], Validity], o, lse,
                           d_o) -> tuple[Any, Any]:
    """(dq, dk and dv stacked (2, B, S, K, H)) of one block, as `block_backward` gives them: the
    graph writes dk and dv into one array (`graphs.operands.KV_GRADS`), which the executor zeroes
    first for a packed graph, so a caller that sends them on as one transfer makes no stacking pass."""
    validity = operands[1]
    grads = _block_grads(dataclasses.replace(static, kv_grads_stacked=True), q, k, v, operands, o, lse, d_o)
    dkv = grads[KV_GRADS]
    if validity.kv is not None and not static.graph_spec.segments:
        dkv = jnp.where(validity.kv[None, :, :, None, None], dkv, jnp.zeros((), dkv.dtype))
    return zero_rows(grads["dq"], validity.q), dkv


class CudnnBackend(Backend):
    """cuDNN SDPA graphs, built (or loaded from the cache) at trace time and run by the FFI executor.
    The ring's blocks (`parallel.ring`) run its forward and backward graphs one pair at a time."""

    name = "cudnn"
    packs_by_hints = True
    block_static = staticmethod(block_static)
    block_operands = staticmethod(block_operands)
    block_forward = staticmethod(block_forward)
    block_backward = staticmethod(block_backward)
    block_backward_stacked = staticmethod(block_backward_stacked)

    def support(self, spec: AttentionSpec, score_mod: ScoreModIR | None, *, training: bool,
                verify: Verify | None = None) -> Support:
        answer = execute.support(spec, score_mod, training=training, verify=verify)
        runs_on = self if answer.supported else registry.reference()
        return Support(answer.supported, runs_on.name, answer.reason)

    def attention(self, spec: AttentionSpec, query: Any, key: Any, value: Any, inputs: RuntimeInputs,
                  score_mod: ScoreModIR | None, *, training: bool = True,
                  verify: Verify | None = None) -> tuple[Any, Any]:
        return attention(spec, query, key, value, inputs, score_mod, training=training, verify=verify)

    def attention_with_sinks(self, spec: AttentionSpec, query: Any, key: Any, value: Any, inputs: RuntimeInputs,
                             score_mod: ScoreModIR | None, sinks: Any, *, training: bool = True,
                             verify: Verify | None = None) -> tuple[Any, Any]:
        # cuDNN's own sinks where their graphs build (and pass the check); else composed inside the
        # custom_vjp, whose backward graph takes dO alone (`_core`).
        native = native_sinks_spec(spec, score_mod, training, verify, inputs)
        if native is not None:
            return attention(native, query, key, value, inputs, score_mod, training=training, verify=verify,
                             sinks=sinks)
        return attention(spec, query, key, value, inputs, score_mod, training=True, verify=verify, sinks=sinks)

    def fp8_attention(self, spec: AttentionSpec, query: Any, key: Any, value: Any, inputs: RuntimeInputs, *,
                      verify: Verify | None = None) -> tuple[Any, Any]:
        return fp8_attention(spec, query, key, value, inputs, verify=verify)

    def sinks_path(self, spec: AttentionSpec, score_mod: ScoreModIR | None, inputs: RuntimeInputs, *,
                   training: bool, verify: Verify | None = None) -> str:
        if native_sinks_spec(spec, score_mod, training, verify, inputs) is not None:
            return sinks_mod.NATIVE
        return sinks_mod.COMPOSED


BACKEND = CudnnBackend()
