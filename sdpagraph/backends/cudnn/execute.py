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
from sdpagraph.graphs.operands import graph_io
from sdpagraph.graphs.support import Support, environment_reason, graph_answer
from sdpagraph.meshes import varying_like
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


# ----------------------------------------------------------------------------- one FFI call

def run_graph(static: Static, direction: str, operands: Mapping[str, Any],
               results: Mapping[str, jax.ShapeDtypeStruct]) -> dict[str, Any]:
    """Run the `direction` graph on `operands` (as `call_operands` gives them: sliceable along batch and
    heads): one op, once per device on its shard when the inputs are sharded (`sharding`)."""
    operand_roles, result_roles = graph_io(static.graph_spec, static.ir, direction)
    needed = {role: x for role, x in operands.items() if role in operand_roles or role.startswith(SEGMENT_OFFSETS)}
    outputs = sharding.call_per_shard(_execute, static, direction, needed, {r: results[r] for r in result_roles})
    return {role: varying_like(x, needed.values()) for role, x in outputs.items()}


def _execute(static: Static, direction: str, operands: Mapping[str, Any],
             results: Mapping[str, jax.ShapeDtypeStruct]) -> dict[str, Any]:
    """Build or fetch the `direction` graph of `static` (the whole call, or one device's shard of
    it), register it with the executor, and call it on operands of those shapes; graphs that
    failed their numerical check are not run: their computation runs on XLA instead."""
    if static.graph_spec.segments:
        operands = ragged_operands(static.graph_spec, operands)
    if not checked(static):
        return run_on_xla(static, operands, results)
    graph = cached_graph(static.spec, static.ir, direction)
    ffi.register_graph(graph.digest, graph.compiled.blob)
    return call_executor(static, graph, operands, results)


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
