"""The cuDNN backend's graph calls: whether a call's graphs build here (`support`), and one graph run
through the FFI executor (`run_graph`): the graph built or fetched from the cache at trace time,
registered with the executor, and called with `jax.ffi.ffi_call`, once per device on its shard
when the inputs are sharded. `backend` composes these into attention with its custom_vjp.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from sdpagraph import ffi
from sdpagraph.backends.cudnn import sharding
from sdpagraph.backends.cudnn.bins import packer as bin_packer
from sdpagraph.backends.cudnn.call_operands import SEGMENT_OFFSETS, ragged_operands
from sdpagraph.backends.cudnn.graph_on_xla import run_on_xla
from sdpagraph.graph_store import CachedGraph, cached_graph, check_graphs
from sdpagraph.graphs.binning import bin_plan
from sdpagraph.graphs.compiled import scalar_bits
from sdpagraph.graphs.operands import KV_GRADS, graph_io
from sdpagraph.graphs.support import Support, environment_reason, graph_answer
from sdpagraph.meshes import inside_full_shard_map, varying_like
from sdpagraph.scoremod.ir import ScoreModIR
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
class Static:
    """Everything static about one call (hashable: custom_vjp's non-differentiable argument)."""

    spec: AttentionSpec  # the call's own spec: graphs are keyed and built from it
    graph_spec: AttentionSpec  # the spec the graph runs (`LayoutPlan.graph_spec`): shapes of results
    ir: ScoreModIR | None
    scalars: tuple[tuple[str, Any], ...]
    training: bool
    # The numerical check's gate dispatch chose cuDNN with (`numerics.gate.checked`), or None: the
    # graphs of a per-device spec, built at XLA compile time, are checked with it (`_execute`).
    verify: Callable[..., Any] | None = None
    # The backward graph's dK and dV come back as one (2, *k.shape) result, KV_GRADS (`results_of`).
    kv_grads_stacked: bool = False
    # A packed graph's token results (o, dq, dk, dv) zeroed by the executor before the graph writes
    # its sequences' rows, so the rows it leaves unwritten read 0 with no masking pass after it
    # (`block_forward`'s `zero_unwritten`).
    zero_unwritten: bool = False

    @property
    def unwritten_zeroed(self) -> bool:
        """Whether the executor zeroes the rows of o, dq, dk and dv the graph leaves unwritten."""
        return self.zero_unwritten and bool(self.graph_spec.segments)


# dK and dV in one array (KV_GRADS), the graph writing both into it: the ring sends them on as one
# transfer without a stacking pass. A packed graph writes only its sequences' rows, so the executor
# zeroes this result before the graph runs.
_STACKED_ROLES = ("dk", "dv")
# A graph's results with a row per token, which a packed graph writes only for its sequences' rows.
TOKEN_RESULTS = ("o", "dq", "dk", "dv")


def results_of(static: Static, result_roles: tuple[str, ...],
               results: Mapping[str, jax.ShapeDtypeStruct]) -> dict[str, jax.ShapeDtypeStruct]:
    """The results a graph call returns, by name: its result roles, dk and dv as one KV_GRADS
    (2, *dk.shape) where `static` stacks them."""
    if not (static.kv_grads_stacked and set(_STACKED_ROLES) <= set(result_roles)):
        return {role: results[role] for role in result_roles}
    out = {role: results[role] for role in result_roles if role not in _STACKED_ROLES}
    dk, dv = (results[role] for role in _STACKED_ROLES)
    if (dk.shape, dk.dtype) != (dv.shape, dv.dtype):
        raise ValueError(f"dk {dk.shape} {dk.dtype} and dv {dv.shape} {dv.dtype} cannot stack: "
                         "kv_grads_stacked needs a value head dim and dtype equal to the key's")
    out[KV_GRADS] = jax.ShapeDtypeStruct((2, *dk.shape), dk.dtype)
    return out


def _result_layout(static: Static, result_roles: tuple[str, ...],
                   results: Mapping[str, Any]) -> list[tuple[str, tuple[str, ...], bool]]:
    """(result name, the graph roles it holds in order, whether the executor zeroes it first), in
    the executor's result order, for `results` as `results_of` names them."""
    stacked = KV_GRADS in results
    layout = []
    for role in result_roles:
        if stacked and role in _STACKED_ROLES:
            if role == _STACKED_ROLES[0]:
                layout.append((KV_GRADS, _STACKED_ROLES, bool(static.graph_spec.segments)))
        else:
            layout.append((role, (role,), static.unwritten_zeroed and role in TOKEN_RESULTS))
    return layout


def unstacked(results: Mapping[str, jax.ShapeDtypeStruct]) -> dict[str, jax.ShapeDtypeStruct]:
    """The result shapes `results` names, with a KV_GRADS entry split back into dk and dv."""
    out = {role: x for role, x in results.items() if role != KV_GRADS}
    if KV_GRADS in results:
        both = results[KV_GRADS]
        out.update((role, jax.ShapeDtypeStruct(both.shape[1:], both.dtype)) for role in _STACKED_ROLES)
    return out


def restacked(results: Mapping[str, Any], wanted: Mapping[str, Any]) -> dict[str, Any]:
    """Per-role `results` as `wanted` names them (dk and dv stacked where it asks for KV_GRADS)."""
    out = {role: x for role, x in results.items() if role in wanted}
    if KV_GRADS in wanted:
        out[KV_GRADS] = jnp.stack([results[role] for role in _STACKED_ROLES])
    return out


# ----------------------------------------------------------------------------- one FFI call

def run_graph(static: Static, direction: str, operands: Mapping[str, Any],
               results: Mapping[str, jax.ShapeDtypeStruct]) -> dict[str, Any]:
    """Run the `direction` graph on `operands` (as `call_operands` gives them: sliceable along batch and
    heads): one op, once per device on its shard when the inputs are sharded (`sharding`)."""
    operand_roles, result_roles = graph_io(static.graph_spec, static.ir, direction)
    needed = {role: x for role, x in operands.items() if role in operand_roles or role.startswith(SEGMENT_OFFSETS)}
    outputs = sharding.call_per_shard(_execute, static, direction, needed, results_of(static, result_roles, results))
    return {role: varying_like(x, needed.values()) for role, x in outputs.items()}


def _execute(static: Static, direction: str, operands: Mapping[str, Any],
             results: Mapping[str, jax.ShapeDtypeStruct]) -> dict[str, Any]:
    """Build or fetch the `direction` graph of `static` (the whole call, or one device's shard of
    it), register it with the executor, and call it on operands of those shapes; graphs that
    failed their numerical check are not run: their computation runs on XLA instead."""
    if static.graph_spec.segments:
        operands = ragged_operands(static.graph_spec, operands)
    if not checked(static):
        return restacked(run_on_xla(static, operands, unstacked(results)), results)
    graph = cached_graph(static.spec, static.ir, direction)
    ffi.register_graph(graph.digest, graph.compiled.blob)
    _prepare(graph.digest)
    return call_executor(static, graph, operands, results)


def _prepare(digest: str) -> None:
    """Get the graph ready on the GPUs it will run on while XLA compiles (`ffi.prepare_soon`)."""
    for device in preparation_devices():
        if device.platform == "gpu":
            ffi.prepare_soon(digest, device.local_hardware_id)


def preparation_devices() -> tuple[jax.Device, ...]:
    """The devices a graph traced now will run on: a per-device call's mesh's local devices, every
    local device inside a `shard_map` manual over every mesh axis, else jax's default device. A
    graph that runs elsewhere is deserialized by its first run. (A sharded call's global-shape graph,
    traced before the partitioning, goes to the default device although only its per-device graphs
    run.)"""
    devices = sharding.shard_devices()
    if devices is not None:
        return devices
    return tuple(jax.local_devices()) if inside_full_shard_map() else _default_device()


def _default_device() -> tuple[jax.Device, ...]:
    """jax's default device (`jax.default_device`, `jax_default_device`): a device, a platform's
    first, or the first local device when none is set."""
    device = jax.config.jax_default_device
    if isinstance(device, jax.Device):
        return (device,)
    try:
        return tuple(jax.local_devices(backend=device)[:1])  # a platform name, or None: the default backend
    except RuntimeError:  # a platform this process has no backend for
        return ()


def checked(static: Static) -> bool:
    """Whether the graphs of `static` passed the numerical check it carries (True without one).
    For the call's own spec this is the answer dispatch already got (remembered per cache). A
    sharded call's per-device spec (`sharding.localize`) is first seen here, at XLA compile time:
    its graphs are built and checked now, once, and a failure (logged once) runs the shard on XLA."""
    if static.verify is None:
        return True
    verify = functools.partial(static.verify, scalars=dict(static.scalars))
    return support(static.spec, static.ir, training=static.training, verify=verify).supported


def call_executor(static: Static, graph: CachedGraph, operands: Mapping[str, Any],
                   results: Mapping[str, jax.ShapeDtypeStruct]) -> dict[str, Any]:
    """The FFI call (CPU tests put an XLA stand-in here). `results` as `results_of` names them."""
    compiled, digest = graph.compiled, graph.digest
    scalar_uids, scalar_values = scalar_bits(compiled, dict(static.scalars))
    layout = _result_layout(static, compiled.result_roles, results)
    result_shapes = [results[name] for name, _, _ in layout]
    result_shapes.append(jax.ShapeDtypeStruct((compiled.workspace_size,), jnp.uint8))
    call = jax.ffi.ffi_call(ffi.EXECUTOR_TARGET, result_shapes, vmap_method="sequential")
    tensor_roles = list(compiled.operand_roles) + [role for _, roles, _ in layout for role in roles]
    outputs = call(
        *(operands[role] for role in compiled.operand_roles),
        graph_key=digest,
        entry_path=graph.entry_path or "",
        uids=np.array([compiled.uids[r] for r in tensor_roles], np.int64),
        result_parts=np.array([len(roles) for _, roles, _ in layout], np.int64),
        zeroed_results=np.array([int(zeroed) for _, _, zeroed in layout], np.int64),
        scalar_uids=scalar_uids,
        scalar_values=scalar_values,
        workspace_size=np.int64(compiled.workspace_size),
    )
    return dict(zip((name for name, _, _ in layout), outputs[:-1]))
