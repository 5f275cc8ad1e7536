"""Context parallelism: `attention(..., context_parallel_axis="cp")` with q, k, v split along the
sequence over a mesh axis, without gathering k or v.

    attention ── prepare_call ── context_parallel.attention
        ├─ check (ValueError naming context_parallel_axis and the numbers), the mesh, the strategy
        └─ jax.shard_map over every mesh axis: the sequence over `cp`, the batch over the other axes
             ├─ "ring"        ring.ring_attention: K/V blocks pass around the ring (ppermute)
             ├─ "all_to_all"  heads <-> sequence (jax.lax.all_to_all), one whole-sequence call per
             │                device on N/cp heads, and back
             └─ "halo"        halo.halo_attention (sliding windows, chunks): each device receives the
                              keys its windows and chunks reach from its neighbours (ppermute; none
                              for chunks inside its blocks), then one local call per block

Inside a `jax.shard_map` that already maps the axis, q, k, v are the local blocks: the strategy
runs on them directly. Built on JAX's own machinery (shard_map, ppermute, all_to_all); no runtime of
our own. Which backend the blocks run: cuDNN when it can (`ring_plan.cudnn_reason` for the ring, and a
support check of the block graphs), else the XLA backend, with the reason logged once at INFO.
"""
from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

from sdpagraph.cache import CacheMissError
from sdpagraph.logs import log_once, logger
from sdpagraph.graphs.operands import folds_segments
from sdpagraph.graphs.support import Support
from sdpagraph.backends import registry
from sdpagraph.numerics import gate as numerics_gate
from sdpagraph.parallel import halo, halo_layout, ring, ring_plan
from sdpagraph.parallel.strategy import STRATEGIES, choose_strategy, halo_packed_graphs
from sdpagraph.call import PreparedCall, notify_trace_listeners
from sdpagraph.parallel.load_balance import DOCUMENTS, document_order, gather_tokens, load_balance, unload_balance
from sdpagraph.segments.metadata import segment_positions, segment_run_ids
from sdpagraph.shard_spec import Split, local_ir, local_spec
from sdpagraph.meshes import varying_like, whole_along_sequence
from sdpagraph.spec import AttentionSpec

def _fail(axis: Any, message: str) -> ValueError:
    return ValueError(f"context_parallel_axis={axis!r}: {message}")


def _mesh_shape(axis: Any, mesh: Any) -> tuple[dict[str, int], bool]:
    """(axis name -> size of the mesh, whether `axis` is already manual: inside a shard_map)."""
    context = jax.sharding.get_abstract_mesh()
    if axis in getattr(context, "manual_axes", ()):
        return dict(context.shape), True
    if mesh is None:
        mesh = context
    shape = dict(getattr(mesh, "shape", {}) or {})
    if not shape:
        raise _fail(axis, "needs a mesh: call attention under `with jax.set_mesh(mesh):` or pass mesh=")
    if axis not in shape:
        raise _fail(axis, f"is not an axis of the mesh, whose axes are {tuple(shape)} (sizes {tuple(shape.values())})")
    return shape, False


def _global(spec: AttentionSpec, cp: int, manual: bool) -> AttentionSpec:
    """`spec` with the whole sequence's lengths: inside a shard_map over the axis (`manual`) the
    call sees one device's block."""
    return dataclasses.replace(spec, q_len=spec.q_len * cp, kv_len=spec.kv_len * cp) if manual else spec


def check(call: PreparedCall, axis: Any, load_balanced: Any, strategy: Any, mesh: Any) -> tuple[dict[str, int], bool]:
    """Validate a context-parallel call; returns `_mesh_shape`."""
    spec = call.spec
    if not isinstance(axis, str):
        raise TypeError(f"context_parallel_axis must be a mesh axis name (str), got {type(axis).__name__}")
    if not (isinstance(load_balanced, bool) or load_balanced == DOCUMENTS):
        raise TypeError(f"load_balanced must be a bool or {DOCUMENTS!r}, got {load_balanced!r}")
    if load_balanced == DOCUMENTS and spec.segments != "self":
        raise _fail(axis, f"load_balanced={DOCUMENTS!r} cuts each packed document over the devices: pass the "
                          "documents' segment_ids (one array, in their natural order) and q, k, v from "
                          "sdpagraph.load_balance(x, cp, segment_ids=segment_ids); without documents use "
                          "load_balanced=True")
    if strategy not in STRATEGIES:
        raise ValueError(f"context_parallel_strategy must be one of {STRATEGIES}, got {strategy!r}")
    shape, manual = _mesh_shape(axis, mesh)
    cp = shape[axis]
    if manual and spec.segments:
        raise _fail(axis, "packed segment_ids inside a shard_map over the axis need the whole sequence's "
                          "segments: call attention outside the shard_map")
    pieces = 2 * cp if load_balanced else cp
    why = f"2 * cp, load_balanced={load_balanced!r}" if load_balanced else "cp"
    for name, length in (("query", spec.q_len), ("key/value", spec.kv_len)):
        length = length * cp if manual else length  # inside a shard_map the call sees one block
        if length % pieces:
            raise _fail(axis, f"the {name} sequence length {length} must be divisible by {pieces} ({why}; "
                              f"the axis has cp={cp} devices)")
    unsupported = [name for name, present in (
        ("bias", spec.bias_shape is not None), ("mask", spec.mask_shape is not None),
        ("query_seq_lengths / key_value_seq_lengths", spec.has_padding),
        ("a pair of segment_ids (cross-attention)", spec.segments == "cross")) if present]
    unsupported += [f"score_mod_tensors[{name!r}] of shape {tuple(x.shape)} (it varies along T or S)"
                    for name, x in (call.inputs.mod_arrays or {}).items() if x.shape[2] > 1 or x.shape[3] > 1]
    if unsupported:
        raise _fail(axis, f"context parallelism does not take {', '.join(unsupported)}; use segment_ids for "
                          "packed or padded sequences")
    if strategy == "all_to_all" and (spec.num_heads % cp or spec.num_kv_heads % cp):
        raise _fail(axis, f"context_parallel_strategy='all_to_all' needs the query heads N={spec.num_heads} and "
                          f"key/value heads K={spec.num_kv_heads} divisible by cp={cp}; use 'ring'")
    if strategy == "halo" and (why := halo_layout.unsupported(_global(spec, cp, manual), cp, load_balanced,
                                                              halo_packed_graphs(call))) is not None:
        raise _fail(axis, f"context_parallel_strategy='halo' {why}")
    return shape, manual


def _cudnn_reason(graphs: list[tuple[AttentionSpec, Any]], implementation: str | None, reason: str | None,
                  running: bool) -> str | None:
    """Why the (spec, score_mod IR) graphs cannot run on cuDNN (None: they can). Both strategies run
    graphs with softmax stats (the ring merges by them), so the training graphs are asked for. When
    `running` (not a support query), the graphs are reported to the trace listeners (spec recording)
    and a strict cache's miss raises, saying how to precompile them."""
    if implementation == registry.reference().name:
        return f"implementation={implementation!r} was requested"
    if reason is not None:
        return reason
    for spec, ir in graphs:
        if running:
            notify_trace_listeners(spec, ir, True)
        try:
            answer = registry.primary().support(spec, ir, training=True, verify=numerics_gate.checked)
        except CacheMissError as miss:
            message = (f"{miss} It is a block graph of a context-parallel call ({spec.summary()}). Record the run "
                       "(SDPAGRAPH_RECORD=specs.json records block graphs) and run `sdpagraph precompile specs.json` "
                       "on this GPU type.")
            if running:
                raise CacheMissError(message) from None
            return message
        if not answer.supported:
            return answer.reason
    return None


@dataclass(frozen=True)
class Plan:
    """How a context-parallel call runs."""

    axis: str
    cp: int
    strategy: str  # "ring", "all_to_all" or "halo"
    manual: bool  # inside a shard_map over the axis: q, k, v are the local blocks
    batch_axes: tuple[str, ...]  # the other mesh axes, splitting the batch
    local: AttentionSpec  # one device's batch, the global sequence lengths (the ring's: `_ring_spec`)
    backend: str  # the blocks': the primary backend's name (cuDNN) or the reference's (XLA)
    reason: str  # why that backend


def plan(call: PreparedCall, axis: Any, load_balanced: Any, strategy: Any, mesh: Any,
         implementation: str | None, running: bool = True) -> Plan:
    shape, manual = check(call, axis, load_balanced, strategy, mesh)
    spec, cp = call.spec, shape[axis]
    ring_reason = ring_plan.cudnn_reason(spec, call.score_mod, call.inputs.python_mods)
    ring_on_xla = ring_reason is not None and implementation != registry.reference().name
    packed_graphs = not folds_segments(spec, call.score_mod)
    whole, halo_graphs = _global(spec, cp, manual), halo_packed_graphs(call)
    strategy = choose_strategy(whole, cp, strategy, ring_on_xla, load_balanced, packed_graphs, halo_graphs)
    # The batch splits over the other mesh axes when they divide it. Inside a shard_map the prepared
    # spec already holds the local batch and sequence blocks: the global lengths are cp times those.
    others = () if manual else tuple(a for a in shape if a != axis)
    if others and spec.batch % math.prod(shape[a] for a in others):
        others = ()
    if manual:
        local = dataclasses.replace(spec, q_len=spec.q_len * cp, kv_len=spec.kv_len * cp)
    else:
        local = dataclasses.replace(spec, batch=spec.batch // math.prod(shape[a] for a in others))
    ring_spec = local
    if strategy == "ring":  # one document's graphs (`_ring_spec`) where they build, else the pairs'
        for ring_spec in dict.fromkeys((_ring_spec(call, local, ring_reason), local)):
            reason = _cudnn_reason(_ring_graphs(call, ring_spec, axis, cp, load_balanced), implementation,
                                   ring_reason, running)
            if reason is None:
                break
    else:
        if strategy == "halo":
            graphs = halo.HaloPlan(halo_layout.HaloLayout(local, cp, load_balanced), axis, registry.primary().name,
                                   call.score_mod, ()).graphs
        else:
            split = Split(head_axes=(axis,), heads=cp, kv_heads=cp)
            graphs = [(local_spec(local, split), local_ir(call.score_mod, local, split))]
        reason = call.inputs.python_mods.reason if call.inputs.python_mods is not None else None
        reason = _cudnn_reason(graphs, implementation, reason, running)
    backend = (registry.primary() if reason is None else registry.reference()).name
    if load_balanced == DOCUMENTS and strategy == "ring" and (backend != registry.primary().name or not packed_graphs):
        why = reason or "a score_mod needs the dense twin of the packed graphs, which runs per pair of chunks"
        raise _fail(axis, f"load_balanced={DOCUMENTS!r} runs the ring only as one packed cuDNN call a step; this "
                          f"call cannot ({why}): use context_parallel_strategy='all_to_all', or load_balanced=True")
    where = f"context parallel ({strategy} over {axis!r}, cp={cp})"
    reason = f"{where}: blocks run on cuDNN" if reason is None else f"{where}: blocks run on the XLA backend: {reason}"
    bound = whole.q_len // cp + 1  # the longest document the halo takes: one reaching back a block
    if not load_balanced and _halo_with_hint(whole, cp, bound, halo_graphs):
        reason += _HALO_HINT.format(bound=bound)
    if backend == registry.primary().name:  # the ring's cuDNN blocks may take a dense call as one document
        local = ring_spec
    return Plan(axis, cp, strategy, manual, others, local, backend, reason)


# What a plan's reason adds for packed documents the halo would take if their longest were given.
_HALO_HINT = ("; with max_seqlen_kv=<the longest document> (at most {bound}) the halo would run these documents, "
              "moving only the max_seqlen_kv - 1 keys before each device's block instead of whole blocks; "
              "load_balance(..., whole_documents=True) before the step evens their work (then call with "
              "load_balanced=False)")


def _halo_with_hint(whole: AttentionSpec, cp: int, bound: int, packed_graphs: bool) -> bool:
    """Whether packed documents in natural order that the halo refuses would run there with
    `max_seqlen_kv=bound` (`whole`: the global spec; `packed_graphs`: `halo_packed_graphs`)."""
    if not whole.segments:
        return False
    hinted = dataclasses.replace(whole, max_seqlen_kv=bound)
    return (halo_layout.unsupported(whole, cp, False, packed_graphs) is not None
            and halo_layout.unsupported(hinted, cp, False, packed_graphs) is None)


def support(call: PreparedCall, axis: Any, load_balanced: Any, strategy: Any, mesh: Any,
            implementation: str | None) -> Support:
    """`check_support`'s answer for a context-parallel call: which backend its blocks run, and why."""
    how = plan(call, axis, load_balanced, strategy, mesh, implementation, running=False)
    return Support(how.backend == registry.primary().name, how.backend, how.reason)


# ----------------------------------------------------------------------------- the strategies

def natural_order(segment_ids: Any, axis: Any, mesh: Any, load_balanced: bool | str = True) -> Any:
    """The segment ids `attention` prepares a context-parallel call from: in their natural order (a
    segment is a contiguous run of the natural sequence, and `max_segments_per_seq` counts those),
    and, on Explicit mesh axes, whole along the sequence (every device reads the whole sequence's
    segments; the segment metadata shifts along it, which a sharded type does not allow)."""
    if isinstance(segment_ids, (tuple, list)):
        return type(segment_ids)(natural_order(ids, axis, mesh, load_balanced) for ids in segment_ids)
    shape, _ = _mesh_shape(axis, mesh)
    segment_ids = whole_along_sequence(segment_ids)
    if load_balanced == DOCUMENTS:  # given in their natural order: q, k, v's follows from them
        return segment_ids
    return unload_balance(segment_ids, shape[axis]) if load_balanced else segment_ids


def _token_facts(ids: Any, cp: int, load_balanced: Any, max_segments: int) -> tuple[Any, Any]:
    """((position in its segment, valid, segment number), high) per token of the WHOLE sequence
    (natural order: they need every earlier token), then in the order of q, k, v; `high` (documents
    balanced, else None): whether the token lies in the later piece its device holds of its document.
    Segments past `max_segments` are padding, as on one device."""
    run = segment_run_ids(ids)
    facts = (segment_positions(ids), (run > 0) & (run <= max_segments), run)
    if load_balanced == DOCUMENTS:
        order, high = document_order(ids, cp)
        return tuple(gather_tokens(x, order, 1) for x in facts), gather_tokens(high, order, 1)
    return (tuple(load_balance(x, cp) for x in facts) if load_balanced else facts), None


def _ring_spec(call: PreparedCall, local: AttentionSpec, ring_reason: str | None) -> AttentionSpec:
    """The spec the ring runs: `local`, or for a call without packed documents or a score_mod, one
    document over the whole sequence, which the ring's cuDNN blocks run as the packed graphs' one
    call a step (`RingPlan.whole_steps`) with no conditional: on 2 H100s as fast as the pairs of
    chunks, with fewer graphs and no branches (docs/multi-gpu.md)."""
    if local.segments or call.score_mod is not None or ring_reason is not None:
        return local
    one = dataclasses.replace(local, segments="self", max_segments=1)
    return local if folds_segments(one, call.score_mod) else one


def _ring_graphs(call: PreparedCall, spec: AttentionSpec, axis: Any, cp: int, load_balanced: Any) -> list:
    """The (block spec, score_mod IR) graphs the ring runs for `spec`."""
    blocks = ring_plan.RingPlan(spec, axis, cp, load_balanced, registry.primary().name, call.score_mod, ())
    return [(block, blocks.block_ir) for block in blocks.block_specs]


def _ring(call, local: AttentionSpec, axis, cp, load_balanced, backend, q, k, v, arrays, ids, sinks):
    """The ring over this device's blocks; `ids`: the whole sequence's (B, T) natural-order segment
    ids (gathered in `attention`), or None. A dense call the ring runs as one document (`local` from
    `_ring_spec`) gets that document's facts, the same on every device."""
    tok = high = None
    if ids is None and local.segments:  # a dense call as one document: the whole sequence's ids, known here
        ids = jnp.ones((q.shape[0], q.shape[1] * cp), jnp.int32)
    if ids is not None:
        tok, high = _token_facts(ids, cp, load_balanced, local.max_segments)
    plan = ring_plan.RingPlan(local, axis, cp, load_balanced, backend, call.score_mod,
                              tuple(sorted((call.inputs.mod_scalars or {}).items())), call.inputs.python_mods)
    return ring.ring_attention(plan, q, k, v, {"arrays": arrays, "tok": tok, "high": high}, sinks)


def _halo(call, local: AttentionSpec, axis, cp, load_balanced, backend, q, k, v, arrays, ids, sinks):
    """The halo over this device's blocks; `ids`: the whole sequence's (B, T) natural-order segment
    ids (gathered in `attention`), or None; their facts stay in natural order (the halo reads them by each
    block's global position)."""
    plan = halo.HaloPlan(halo_layout.HaloLayout(local, cp, load_balanced), axis, backend, call.score_mod,
                         tuple(sorted((call.inputs.mod_scalars or {}).items())), call.inputs.python_mods)
    tok = None if ids is None else _token_facts(ids, cp, False, local.max_segments)[0]
    return halo.halo_attention(plan, q, k, v, arrays, sinks, tok)


def _all_to_all(call, local: AttentionSpec, axis, cp, load_balanced, backend, q, k, v, arrays, ids, sinks):
    """Heads <-> sequence: each device gets the whole sequence of N/cp heads, runs one call, and
    sends the output (and logsumexp) back to the sequence split. `ids`: the whole sequence's
    natural-order segment ids (gathered in `attention`), or None."""
    me = jax.lax.axis_index(axis)
    to_heads = lambda x: jax.lax.all_to_all(x, axis, 2, 1, tiled=True)  # noqa: E731
    q, k, v = (to_heads(x) for x in (q, k, v))
    order = document_order(ids, cp)[0] if load_balanced == DOCUMENTS else None
    if order is not None:  # the gathered sequence is in the documents' balanced order
        natural = jnp.argsort(order, axis=1)
        q, k, v = (gather_tokens(x, natural, 1) for x in (q, k, v))
    elif load_balanced:  # the gathered sequence is in device order of the balanced chunks
        q, k, v = (unload_balance(x, cp) for x in (q, k, v))
    split = Split(head_axes=(axis,), heads=cp, kv_heads=cp)
    spec, ir = local_spec(local, split), local_ir(call.score_mod, local, split)
    # Score_mod arrays with a head axis (ALiBi slopes): this device's heads.
    arrays = {n: x if x.shape[1] == 1 else jax.lax.dynamic_slice_in_dim(x, me * spec.num_heads, spec.num_heads, 1)
              for n, x in arrays.items()}
    inputs = dataclasses.replace(call.inputs, mod_arrays=arrays)
    if ids is not None:
        inputs = dataclasses.replace(inputs, q_segment_ids=ids, kv_segment_ids=ids)
    # the numerical check, for graphs the call runs in place of the plan's (chunks as documents, sinks)
    verify = numerics_gate.checked
    if sinks is None:
        out, lse = registry.get(backend).attention(spec, q, k, v, inputs, ir, training=True, verify=verify)
    else:  # this device's heads' sinks
        sinks = jax.lax.dynamic_slice_in_dim(sinks, me * spec.num_heads, spec.num_heads)
        out, lse = registry.get(backend).attention_with_sinks(spec, q, k, v, inputs, ir, sinks, verify=verify)
    if order is not None:
        out, lse = gather_tokens(out, order, 1), gather_tokens(lse, order, 2)
    elif load_balanced:
        out, lse = load_balance(out, cp), load_balance(lse, cp, seq_axis=2)
    return jax.lax.all_to_all(out, axis, 1, 2, tiled=True), jax.lax.all_to_all(lse, axis, 2, 1, tiled=True)


# ----------------------------------------------------------------------------- entry

def attention(call: PreparedCall, q: Any, k: Any, v: Any, *, axis: str, load_balanced: bool | str, strategy: str,
              mesh: Any, implementation: str | None, sinks: Any = None) -> tuple[Any, Any]:
    """(output (B, T, N, Hv), logsumexp (B, N, T)) of a context-parallel call, q, k, v 4-D; with the
    attention `sinks` (N,) joined once per row (`backends.sinks`) when given."""
    blocks_on = (registry.primary().name, registry.reference().name)
    if implementation not in (None, *blocks_on):
        raise ValueError(f"implementation={implementation!r} cannot run context-parallel attention "
                         f"(context_parallel_axis={axis!r}): use None, {blocks_on[0]!r} or {blocks_on[1]!r}")
    how = plan(call, axis, load_balanced, strategy, mesh, implementation)
    if how.backend != implementation and implementation is not None:
        raise ValueError(f"implementation={implementation!r} cannot run {call.spec.summary()}: {how.reason}")
    if how.backend != registry.primary().name and implementation is None:
        log_once(logger, logging.INFO, f"sdpagraph: {call.spec.summary()}: {how.reason}", topic=how.reason)
    cp, local, backend, strategy = how.cp, how.local, how.backend, how.strategy
    arrays = dict(call.inputs.mod_arrays or {})
    ids = call.inputs.q_segment_ids

    def body(q, k, v, arrays, ids, sinks):
        if sinks is not None:  # varying as q (inside a user's shard_map, over its other axes too)
            sinks = varying_like(sinks, (q,), (axis, *how.batch_axes))
        if ids is not None:
            # The whole sequence's ids on every device: every strategy numbers the segments from the
            # sequence's start. Over ids split along the sequence, XLA's SPMD partitioner ran that
            # numbering's cumulative sum as a loop of T/cp steps (0.4 s a step on 2 GPUs at T32768).
            ids = jax.lax.all_gather(ids, axis, axis=1, tiled=True)
        run = {"all_to_all": _all_to_all, "halo": _halo}.get(strategy, _ring)
        out, lse = run(call, local, axis, cp, load_balanced, backend, q, k, v, arrays, ids, sinks)
        rows = None if ids is None or call.row_check is None else call.row_check(ids)
        if rows is not None:  # rows whose ids break a bound: NaN, as on one device
            out, lse = call.poison(out, lse, rows)
        return out, lse

    if how.manual:
        return body(q, k, v, arrays, ids, sinks)
    batch = how.batch_axes or None
    qkv = P(batch, axis)
    array_spec = {n: P(batch if x.shape[0] > 1 else None) for n, x in arrays.items()}
    ids_spec = None if ids is None else P(batch, axis)
    in_specs = (qkv, qkv, qkv, array_spec, ids_spec, None if sinks is None else P())
    fn = jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=(qkv, P(batch, None, axis)))
    mesh = jax.sharding.get_abstract_mesh() if mesh is None else mesh
    if not getattr(mesh, "explicit_axes", ()):
        return fn(q, k, v, arrays, ids, sinks)
    # Explicit mesh axes: shard_map takes arguments only of the sharding types its in_specs say
    # (Auto axes move them implicitly), and the results get q's type (replicated for an unsharded
    # q), as on one device.
    typed = lambda spec: NamedSharding(mesh, spec)  # noqa: E731
    args = [x if x is None else jax.sharding.reshard(x, jax.tree.map(typed, spec))
            for x, spec in zip((q, k, v, arrays, ids, sinks), in_specs)]
    out, lse = fn(*args)
    b, t, n = (tuple(jax.typeof(q).sharding.spec) + (None,) * 3)[:3]
    return jax.sharding.reshard(out, typed(P(b, t, n))), jax.sharding.reshard(lse, typed(P(b, n, t)))
