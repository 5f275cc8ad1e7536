"""SPMD partitioning of the cuDNN path: under `jax.jit` with sharded inputs, each graph call runs
once per device, on that device's shard, with a graph built for the local shapes.

Built on JAX's own machinery (`jax.experimental.custom_partitioning`, with a Shardy sharding
rule, and the GSPMD callback for processes that turn Shardy off); no runtime of our own:

    execute.run_graph(static, direction, operands, results)
       └─ call_per_shard ─ custom_partitioning(_graph_call)      one op in the global program
            ├─ sharding rule (_rule)      how each operand dim maps to batch / heads / sequence / head dim
            └─ partition (_partition)     at XLA compile time: read q's sharding, split batch and heads,
                                          build + register the graph for the LOCAL spec, return the
                                          per-device function and the shardings it takes and gives

What is split: the batch (dim 0 of q, k, v and of every operand with a full batch dim) and the
query heads (dim 2 of q; key/value heads split the same way when the shard count divides K, or
stay whole when K == 1). Sequence and head-dim axes are not split: an operand sharded along one is
all-gathered there by XLA, logged once at WARNING (context parallelism, `parallel.context_parallel`, is
what splits sequences).
Broadcast (size-1) dims of the bias and score_mod arrays are replicated. Gradients of operands that
are whole on every device while the call is split are summed over the split axes (`psum`): the bias
gradient of a bias broadcast over a split axis, and dk / dv with one key/value head (MQA).

Everything the graph reads arrives in a form that slices along the batch: the packed layout's
ragged offsets are absolute element offsets into the whole (B*T, N*H) buffer, so the cuDNN path
passes per-row segment offsets and turns them into ragged offsets per shard (`execute._execute`).

Graphs are keyed by the local spec (`shard_spec.local_spec`, `local_ir`): a precompiled cache of the specs a
sharded run records covers that run (the partition callback reports the local spec to the trace
listeners, so `sdpagraph.record` sees it next to the global one the trace-time support check uses).

Inside a `jax.shard_map` over every mesh axis the arrays are already local: custom_partitioning
then just runs the call on them. On Explicit mesh axes the call runs with them Auto, its results
typed as `_result_types` says. `SDPAGRAPH_PARTITION=0` (read at trace time) turns all of this off:
one call over the global shapes, which XLA gathers onto every device (the behaviour before
partitioning existed; kept for benchmarks and debugging).
"""
from __future__ import annotations

import contextvars
import dataclasses
import functools
import itertools
import logging
import math
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.custom_partitioning import ArrayMapping, CompoundFactor, SdyShardingRule, custom_partitioning
from jax.sharding import NamedSharding, PartitionSpec

from sdpagraph.cache import CacheMissError
from sdpagraph.config import PARTITION
from sdpagraph.fp8_values import saturate
from sdpagraph.graphs.operands import DROPOUT, FP8_AMAX, FP8_BACKWARD_AMAX, KV_GRADS, PAGE_TABLES
from sdpagraph.meshes import explicit_axes
from sdpagraph.logs import log_once, logger
from sdpagraph.call import notify_trace_listeners
from sdpagraph.shard_spec import (BATCH, HEAD_DIM, HEAD_DIM_V, HEADS, KV_HEADS, KV_LEN, Q_LEN, SPLIT_LABELS, Split,
                                  local_ir, local_spec)
from sdpagraph.spec import FP8_DTYPES, AttentionSpec


# ----------------------------------------------------------------------------- one shard's call

def localize(static: Any, split: Split) -> Any:
    """A cuDNN-path `execute.Static` (spec, graph_spec, ir, ...) for one shard."""
    if split.trivial:
        return static
    return dataclasses.replace(static, spec=local_spec(static.spec, split),
                               graph_spec=local_spec(static.graph_spec, split),
                               ir=local_ir(static.ir, static.graph_spec, split))


# ----------------------------------------------------------------------------- dims of each operand

def labels(role: str, shape: tuple[int, ...], spec: AttentionSpec) -> tuple[str | None, ...]:
    """What each dim of an operand or result of a graph call of `spec` (global shapes) is."""
    if spec.paged and role in ("k", "v"):  # a pool of pages every sequence of the batch may read
        return (None, None, KV_HEADS, HEAD_DIM if role == "k" else HEAD_DIM_V)
    if role in PAGE_TABLES:
        return (BATCH, None, None, None)
    if role == DROPOUT[0]:  # one seed per (batch row, head): each shard's graph reads its first
        return (BATCH, HEADS)
    if role == DROPOUT[1]:
        return (None,)
    if role == KV_GRADS:  # dk and dv stacked
        return (None, *labels("dk", shape[1:], spec))
    if role in ("q", "dq"):
        return (BATCH, Q_LEN, HEADS, HEAD_DIM)
    if role in ("k", "dk"):
        return (BATCH, KV_LEN, KV_HEADS, HEAD_DIM)
    if role in ("v", "dv"):
        return (BATCH, KV_LEN, KV_HEADS, HEAD_DIM_V)
    if role in ("o", "dO"):
        return (BATCH, Q_LEN, HEADS, HEAD_DIM_V)
    if role == "stats":  # packed graphs keep (B, T, N), dense ones (B, N, T)
        return (BATCH, Q_LEN, HEADS) if spec.segments else (BATCH, HEADS, Q_LEN)
    if len(shape) == 4 and role not in ("segment_start", "segment_end"):  # bias, dbias, score_mod arrays
        full = (spec.batch, spec.num_heads, spec.q_len, spec.kv_len)
        return tuple(label if size == want and size > 1 else None
                     for label, size, want in zip((BATCH, HEADS, Q_LEN, KV_LEN), shape, full))
    # seq_len_* (B,) or (B, M), segment_offsets_* (B, M + 1), segment_start/end (B, 1, T, 1)
    return (BATCH,) + tuple(Q_LEN if len(shape) == 4 and i == 2 else None for i in range(1, len(shape)))


def _factors(spec: AttentionSpec) -> tuple[dict[str, Any], dict[str, int]]:
    """Label -> Shardy factor, and the sizes of factors used only inside compound factors.

    Query heads are (key/value head, group member), major to minor: splitting them in blocks
    splits key/value heads the same way (GQA); with one key/value head only the group splits."""
    k, group = spec.num_kv_heads, spec.num_heads // spec.num_kv_heads
    heads: Any = CompoundFactor("kh", "g") if k > 1 and group > 1 else ("g" if k == 1 else "kh")
    factors = {BATCH: "b", HEADS: heads, KV_HEADS: "kh" if k > 1 else None, Q_LEN: "t", KV_LEN: "s",
               HEAD_DIM: "h", HEAD_DIM_V: "hv"}
    return factors, ({"g": group} if isinstance(heads, CompoundFactor) else {})


@dataclass(frozen=True)
class _GraphCall:
    """One graph call, static: what runs (`execute(static, direction, operands, results)`), on which
    roles, with which results (global shapes)."""

    execute: Callable[..., Mapping[str, Any]]
    static: Any  # backends.cudnn.execute.Static
    direction: str
    roles: tuple[str, ...]
    results: tuple[tuple[str, tuple[int, ...], str], ...]  # (role, shape, dtype)

    def result_structs(self, split: Split | None = None) -> dict[str, jax.ShapeDtypeStruct]:
        structs = {}
        for role, shape, dtype in self.results:
            if split is not None:
                shape = tuple(size // split.count(label)
                              for size, label in zip(shape, labels(role, shape, self.static.graph_spec)))
            structs[role] = jax.ShapeDtypeStruct(shape, np.dtype(dtype))
        return structs

    def run(self, static: Any, arrays: tuple[Any, ...], split: Split | None = None) -> tuple[Any, ...]:
        results = self.execute(static, self.direction, dict(zip(self.roles, arrays)), self.result_structs(split))
        return tuple(results[role] for role, _, _ in self.results)


def _graph_call(call: _GraphCall, *arrays: Any) -> tuple[Any, ...]:
    """The call over the shapes it is traced with (a single device, or the inside of a shard_map)."""
    return call.run(call.static, arrays)


def _rule(call: _GraphCall, mesh: Any, value_types: Any, result_types: Any) -> SdyShardingRule:
    spec = call.static.graph_spec
    factors, sizes = _factors(spec)
    unique = (f"u{i}" for i in itertools.count())  # a factor of its own for each dim that never splits

    def mapping(role: str, shape: tuple[int, ...]) -> ArrayMapping:
        return ArrayMapping(*(factors.get(label) or next(unique) for label in labels(role, shape, spec)))

    operands = tuple(mapping(role, tuple(t.shape)) for role, t in zip(call.roles, value_types))
    results = tuple(mapping(role, shape) for role, shape, _ in call.results)
    return SdyShardingRule(operands, results, **sizes)


# ----------------------------------------------------------------------------- the partition callback

def _axes(entry: Any) -> tuple[str, ...]:
    if entry is None:
        return ()
    return tuple(entry) if isinstance(entry, (tuple, list)) else (entry,)


def _padded(sharding: Any, ndim: int) -> tuple[Any, ...]:
    spec = tuple(sharding.spec)
    return spec + (None,) * (ndim - len(spec))


def _decide(call: _GraphCall, mesh: Any, arg_shapes: tuple[Any, ...]) -> Split:
    """The split of this call from q's sharding (batch on dim 0, heads on dim 2), checked against
    the shapes; warns once about anything that has to be gathered."""
    spec = call.static.graph_spec
    q = arg_shapes[call.roles.index("q")]
    q_spec = _padded(q.sharding, 4)
    size = lambda axes: math.prod(mesh.shape[a] for a in axes)  # noqa: E731
    batch_axes, head_axes = _axes(q_spec[0]), _axes(q_spec[2])
    notes = []
    if batch_axes and spec.batch % size(batch_axes):
        notes.append(f"the batch B={spec.batch} does not split evenly over {batch_axes}: it is gathered")
        batch_axes = ()
    kv_split = True
    if head_axes:
        d = size(head_axes)
        if spec.num_heads % d == 0 and spec.num_kv_heads % d == 0:
            pass
        elif spec.num_heads % d == 0 and spec.num_kv_heads == 1:
            kv_split = False  # MQA: each device takes its query heads and the one key/value head
        else:
            notes.append(f"query heads N={spec.num_heads} with K={spec.num_kv_heads} key/value heads do not split "
                         f"over {head_axes} ({d} shards must divide K, or K must be 1): heads are gathered")
            head_axes = ()
    gathered = {}  # what the user passed, sharded where it is not split (the same in forward and backward)
    for role, shape in zip(call.roles, arg_shapes):
        if role in _RESIDUALS or not isinstance(shape.sharding, NamedSharding):
            continue
        for dim, (label, entry) in enumerate(zip(labels(role, shape.shape, spec),
                                                 _padded(shape.sharding, len(shape.shape)))):
            if _axes(entry) and label not in SPLIT_LABELS:
                gathered[f"{role} dim {dim} ({_DIM_NAMES.get(label, 'a broadcast dim')}) over {_axes(entry)}"] = None
    if gathered:
        notes.append("sharded along axes sdpagraph does not split, so XLA all-gathers them on every device: "
                     + ", ".join(gathered) + ". Shard batch or heads instead; splitting sequences without a "
                     "gather is context parallelism (`attention(..., context_parallel_axis=...)`, docs/multi-gpu.md)")
    if notes:
        log_once(logger, logging.WARNING,
                 f"sdpagraph: attention {call.static.spec.summary()} under SPMD: " + "; ".join(notes) + ".")
    batch, heads = size(batch_axes), size(head_axes)
    return Split(batch_axes, head_axes, batch, heads, heads if kv_split else 1)


_RESIDUALS = ("o", "dO", "stats")  # backward inputs: sharded like q, reported through q
_DIM_NAMES = {Q_LEN: "query sequence", KV_LEN: "key sequence", HEAD_DIM: "head dim", HEAD_DIM_V: "value head dim"}


def _shardings(call: _GraphCall, mesh: Any, split: Split, shapes: Any, roles: tuple[str, ...]) -> tuple[Any, ...]:
    spec = call.static.graph_spec
    out = []
    for role, shape in zip(roles, shapes):
        entries = [split.axes(label) or None for label in labels(role, tuple(shape), spec)]
        out.append(NamedSharding(mesh, PartitionSpec(*(e[0] if e and len(e) == 1 else e for e in entries))))
    return tuple(out)


def _replicated(arg_shapes: tuple[Any, ...], result_shape: tuple[Any, ...]) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
    """Every operand and result whole on every device, for shardings the partitioner gives without a
    mesh (GSPMDShardings: `get_replicated` over their own devices)."""
    given = arg_shapes[0].sharding
    replicated = type(given).get_replicated(given._device_assignment)
    return tuple(replicated for _ in arg_shapes), tuple(replicated for _ in result_shape)


def _notify_listeners(static: Any, direction: str) -> None:
    notify_trace_listeners(static.spec, static.ir, direction != "inference")


# The local devices of the mesh whose per-device call is being lowered (`_partition`), so that the
# backend gets that call's graphs ready on them (`execute._prepare`); None outside a partitioning.
_shard_devices: contextvars.ContextVar = contextvars.ContextVar("sdpagraph_shard_devices", default=None)


def shard_devices() -> tuple[Any, ...] | None:
    """The local devices a per-device call being lowered now runs on (None when not partitioning)."""
    return _shard_devices.get()


def _local_devices(mesh: Any) -> tuple[Any, ...] | None:
    devices = getattr(mesh, "devices", None)
    if devices is None:  # an abstract mesh names no devices
        return None
    return tuple(d for d in np.asarray(devices).flat if d.process_index == jax.process_index())


def _partition(call: _GraphCall, mesh: Any, arg_shapes: tuple[Any, ...], result_shape: tuple[Any, ...]):
    q_sharding = arg_shapes[call.roles.index("q")].sharding
    if not isinstance(q_sharding, NamedSharding):  # e.g. inside a shard_map that leaves some axes automatic
        log_once(logger, logging.WARNING,
                 f"sdpagraph: attention {call.static.spec.summary()}: the partitioner gave shardings without a "
                 "mesh (a shard_map over only some mesh axes?); every device runs the whole call on gathered inputs. "
                 "Put the attention inside a shard_map over every mesh axis, or outside shard_map.")
        args, results = _replicated(arg_shapes, result_shape)
        return mesh, functools.partial(_graph_call, call), results, args
    split = _decide(call, mesh, arg_shapes)
    static = localize(call.static, split)
    if not split.trivial:
        _notify_listeners(static, call.direction)
    result_roles = tuple(role for role, _, _ in call.results)
    result_shardings = _shardings(call, mesh, split, (s for _, s, _ in call.results), result_roles)
    arg_shardings = _shardings(call, mesh, split, (s.shape for s in arg_shapes), call.roles)

    def per_device(*arrays):
        devices = _shard_devices.set(_local_devices(mesh))
        try:
            results = call.run(static, arrays, split)
        except CacheMissError as miss:
            raise CacheMissError(
                f"{miss} It is the per-device graph of a sharded call ({static.spec.summary()} on each device). "
                "Record the sharded run (SDPAGRAPH_RECORD=specs.json records per-device specs too) and run "
                "`sdpagraph precompile specs.json` on this GPU type.") from None
        finally:
            _shard_devices.reset(devices)
        return tuple(_sum_broadcast_grad(role, shape, x, call, split)
                     for (role, shape, _), x in zip(call.results, results))

    return mesh, per_device, result_shardings, arg_shardings


def _sum_broadcast_grad(role: str, shape: tuple[int, ...], x: Any, call: _GraphCall, split: Split) -> Any:
    """Gradients of an operand that is whole on every device while the call is split: each device
    holds the sum over its shard only, the gradient is the sum over every shard. The bias (and its
    gradient) broadcast over a split batch or heads, and key/value with one head (MQA) under split
    query heads (FP8 gradients summed in float32, saturated back). An FP8 graph's amax results are the
    maximum over the shards. `shape`: the global shape of `x`."""
    spec = call.static.graph_spec
    axes: tuple[str, ...] = ()
    if role == "dbias":
        if shape[0] == 1 and spec.batch > 1:
            axes += split.batch_axes
        if shape[1] == 1 and spec.num_heads > 1:
            axes += split.head_axes
    elif role in ("dk", "dv", KV_GRADS) and split.heads > 1 and split.kv_heads == 1:
        axes = split.head_axes
    elif role in FP8_AMAX or role in FP8_BACKWARD_AMAX:  # an FP8 graph's amax: the largest over every shard
        axes = split.batch_axes + split.head_axes
        return jax.lax.pmax(x, axes) if axes else x
    if not axes:
        return x
    if jnp.dtype(x.dtype).name in FP8_DTYPES:  # FP8 gradients: sum in float32
        return saturate(jax.lax.psum(x.astype(jnp.float32), axes), x.dtype)
    return jax.lax.psum(x, axes)


def _infer(call: _GraphCall, mesh: Any, arg_shapes: tuple[Any, ...], result_shape: tuple[Any, ...]):
    """GSPMD (Shardy off): the result shardings `_partition` will give."""
    if not isinstance(arg_shapes[call.roles.index("q")].sharding, NamedSharding):
        return _replicated(arg_shapes, result_shape)[1]
    split = _decide(call, mesh, arg_shapes)
    return _shardings(call, mesh, split, (s for _, s, _ in call.results), tuple(r for r, _, _ in call.results))


_partitioned = custom_partitioning(_graph_call, static_argnums=(0,))
_partitioned.def_partition(partition=_partition, infer_sharding_from_operands=_infer, sharding_rule=_rule)


@functools.lru_cache(maxsize=256)
def _eager(call: _GraphCall) -> Callable[..., Any]:
    # Outside jit, custom_partitioning would run its body op by op, and XLA would gather sharded
    # arrays for the FFI call: run the call as a jitted computation instead.
    return jax.jit(_per_call(call))


def _per_call(call: _GraphCall) -> Callable[..., Any]:
    # Under vmap the call runs once per example (custom_partitioning has no batching rule; the FFI
    # call's own vmap_method is "sequential" too).
    return jax.custom_batching.sequential_vmap(functools.partial(_partitioned, call))


def call_per_shard(execute: Callable[..., Mapping[str, Any]], static: Any, direction: str,
                   operands: Mapping[str, Any], results: Mapping[str, jax.ShapeDtypeStruct]) -> dict[str, Any]:
    """`execute(static, direction, operands, results)` (global shapes) as one SPMD op: once per
    device on local shapes under a sharded jit, as it is otherwise. `operands` must slice along the
    batch and heads as `labels` says; None operands are left out."""
    if not PARTITION.enabled():
        return dict(execute(static, direction, operands, results))
    roles = tuple(role for role, x in operands.items() if x is not None)
    call = _GraphCall(execute, static, direction, roles,
                      tuple((role, tuple(s.shape), np.dtype(s.dtype).name) for role, s in results.items()))
    arrays = tuple(operands[role] for role in roles)
    tracing = any(isinstance(x, jax.core.Tracer) for x in arrays)
    run = _per_call(call) if tracing else _eager(call)
    explicit = explicit_axes(arrays[0])
    if explicit:
        run = jax.sharding.auto_axes(run, axes=explicit, out_sharding=_result_types(call, arrays))
    outputs = run(*arrays)
    return dict(zip((role for role, _, _ in call.results), outputs))


# ----------------------------------------------------------------------------- Explicit mesh axes

_GRADIENT_OF = {"dq": "q", "dk": "k", "dv": "v", "dbias": "bias"}


def _result_types(call: _GraphCall, arrays: tuple[Any, ...]) -> tuple[NamedSharding, ...]:
    """The results' sharding types on Explicit axes: a gradient has its operand's (jax.custom_vjp
    requires it), the output q's, the logsumexp q's batch, heads and sequence. Inside `auto_axes`
    the FFI call's results have no type, and custom_partitioning splits the call as on Auto axes."""
    types = {role: jax.typeof(x).sharding for role, x in zip(call.roles, arrays)}
    q = types["q"]
    b, t, n, _ = _padded(q, 4)
    stats = (b, t, n) if call.static.graph_spec.segments else (b, n, t)
    own = {"o": q.spec, "stats": PartitionSpec(*stats)}
    if "k" in types:  # dk and dv stacked (KV_GRADS): k's, after the stacking dim
        own[KV_GRADS] = PartitionSpec(None, *_padded(types["k"], 4))
    return tuple(types[_GRADIENT_OF[role]] if role in _GRADIENT_OF else NamedSharding(q.mesh, own[role])
                 for role, _, _ in call.results)
