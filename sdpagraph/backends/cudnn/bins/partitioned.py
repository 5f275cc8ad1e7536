"""Packed documents on bins under jit's automatic partitioning: each device packs and runs its own rows.

    attention(spec, q, k, v, inputs, ir, blocks) -> (out (B, T, N, H_v), logsumexp (B, N, T))

Bins (`packed`) need the call on one device: the packer is a Pallas call, which XLA cannot
partition, and the moves gather across all B*T tokens. Under a sharded `jax.jit` (batch or heads
split, the usual way to train) the call instead goes through the cuDNN path's partitioning
(`sharding.call_per_shard`) as one op whose per-device function is the whole binned call on that
device's shard, as `packed.attention` runs it on one device: the documents laid out, q, k and v moved
into the bins, the graph call there (or on the rows, where the documents do not fit: `lax.cond`), the
results moved back. Each device's bins are planned for its own rows (`graphs.binning.bin_plan` of the
local spec).

A `jax.custom_vjp` with global-shaped residuals only (per-device bins would give them shapes that
depend on the split): the forward keeps q, k, v, the ids, the output and the logsumexp; the backward
lays the bins out again and moves q, k, v, the output, its cotangent and the logsumexp into them, then
runs the backward graph given the final output and logsumexp, as the context-parallel blocks do
(`blocks.block_backward`). `blocks`: the cuDNN backend's block functions (`block_static`,
`block_operands`, `block_forward`, `block_backward`).

The per-device graphs are built when XLA partitions the program, as every per-device graph of a
sharded call (`sharding`), keyed by the local specs, and checked with the call's numerical check (a
device whose graphs fail it runs their computation on XLA). A call that is not differentiated runs
the inference graphs where it does not train, as the unbinned call does.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp

from sdpagraph.config import PARTITION
from sdpagraph.backends.cudnn import sharding
from sdpagraph.backends.cudnn.bins import packed
from sdpagraph.backends.cudnn.execute import Static
from sdpagraph.call import RuntimeInputs
from sdpagraph.graphs.binning import bin_plan
from sdpagraph.graphs.operands import ARRAY_PREFIX
from sdpagraph.scoremod.ir import ScoreModIR
from sdpagraph.segments.metadata import segment_run_ids
from sdpagraph.spec import AttentionSpec

SEGMENT_IDS = "segment_ids"  # the operand role of the (B, T) ids: split with the batch (`sharding.labels`)


def usable(inputs: RuntimeInputs, sinks: Any) -> bool:
    """Whether a call that bins would take, and that cannot run them on one device (`packed.usable`),
    runs them per device here: on a GPU, in a process with several devices, with the cuDNN path's
    partitioning on (SDPAGRAPH_PARTITION), without attention sinks or dropout."""
    return (jax.default_backend() == "gpu" and jax.device_count() > 1 and PARTITION.enabled() and sinks is None
            and inputs.dropout_seeds is None)


def attention(spec: AttentionSpec, q: Any, k: Any, v: Any, inputs: RuntimeInputs, ir: ScoreModIR | None,
              blocks: Any, *, training: bool = True,
              verify: Callable[..., Any] | None = None) -> tuple[Any, Any]:
    """(out, logsumexp or None for the inference graph) of the packed self-attention call `spec`
    (which `bin_plan` bins), each device running its own rows on bins (module docstring). `verify`:
    the numerical check the call's graphs passed; each device's graphs are checked with it, and a
    device whose graphs fail it runs their computation on XLA (`execute`)."""
    static = Static(spec, spec, ir, tuple(sorted((inputs.mod_scalars or {}).items())), training, verify)
    arrays = {ARRAY_PREFIX + name: x for name, x in (inputs.mod_arrays or {}).items()}
    out, stats = _binned(_executor(blocks), static, q, k, v, inputs.q_segment_ids, arrays)
    return out, None if stats is None else jnp.swapaxes(stats, 1, 2)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _binned(execute: Callable[..., Any], static: Static, q, k, v, ids, arrays: Mapping[str, Any]):
    # Not differentiated: the forward graph where the call trains (its softmax stats are asked for),
    # the inference graph otherwise.
    return _forward(execute, static, q, k, v, ids, arrays, "forward" if static.training else "inference")


def _forward(execute, static, q, k, v, ids, arrays, direction: str) -> tuple[Any, Any]:
    spec = static.spec
    results = {"o": jax.ShapeDtypeStruct(q.shape[:3] + (spec.head_dim_v,), q.dtype)}
    if direction == "forward":
        results["stats"] = jax.ShapeDtypeStruct((spec.batch, spec.q_len, spec.num_heads), jnp.float32)
    out = sharding.call_per_shard(execute, static, direction, {"q": q, "k": k, "v": v, SEGMENT_IDS: ids, **arrays},
                                  results)
    return out["o"], out.get("stats")


def _binned_fwd(execute, static, q, k, v, ids, arrays):
    o, stats = _forward(execute, static, q, k, v, ids, arrays, "forward")
    return (o, stats), (q, k, v, ids, arrays, o, stats)


def _binned_bwd(execute, static, residuals, cotangents):
    q, k, v, ids, arrays, o, stats = residuals
    d_o, _ = cotangents  # the logsumexp gets no gradient, as jax's attention gives it none
    operands = {"q": q, "k": k, "v": v, "o": o, "dO": d_o.astype(o.dtype), "stats": stats, SEGMENT_IDS: ids,
                **arrays}
    results = {role: jax.ShapeDtypeStruct(x.shape, x.dtype) for role, x in (("dq", q), ("dk", k), ("dv", v))}
    grads = sharding.call_per_shard(execute, static, "backward", operands, results)
    return grads["dq"], grads["dk"], grads["dv"], None, jax.tree.map(jnp.zeros_like, arrays)


_binned.defvjp(_binned_fwd, _binned_bwd)


@functools.lru_cache(maxsize=None)
def _executor(blocks: Any) -> Callable[..., dict[str, Any]]:
    """The per-device function `call_per_shard` runs: one object per `blocks`, so that the op's
    static part (and jit's caches keyed by it) stays the same from one call to the next."""
    return functools.partial(_execute, blocks)


def _execute(blocks: Any, static: Static, direction: str, operands: Mapping[str, Any],
             results: Mapping[str, jax.ShapeDtypeStruct]) -> dict[str, Any]:
    """One device's binned call, `direction` "forward" (o, stats (B, T, N)), "inference" (o) or
    "backward" (dq, dk, dv), on its own shard (`static`: the local spec)."""
    spec, ir, scalars = static.spec, static.ir, dict(static.scalars)
    ids = operands[SEGMENT_IDS]
    ids = jnp.where(segment_run_ids(ids) <= spec.max_segments, ids, 0)  # segments past the slots are padding
    arrays = {role[len(ARRAY_PREFIX):]: x for role, x in operands.items() if role.startswith(ARRAY_PREFIX)}
    inputs = RuntimeInputs(q_segment_ids=ids, kv_segment_ids=ids, mod_arrays=arrays or None,
                           mod_scalars=scalars or None)
    backward = direction == "backward"
    tokens = tuple(operands[role] for role in ("q", "k", "v"))
    if backward:
        tokens += (operands["o"], operands["dO"])
    lse = jnp.swapaxes(operands["stats"], 1, 2) if backward else None

    def call(call_spec, call_inputs, q, k, v, o=None, d_o=None, lse=None):
        # the call's own graphs' numerical check and direction, for the block's graphs
        block = dataclasses.replace(blocks.block_static(call_spec, ir, scalars), training=static.training,
                                    verify=static.verify)
        block_operands = blocks.block_operands(block, call_inputs)
        if not backward:
            return blocks.block_forward(block, q, k, v, block_operands, inference=direction == "inference")
        return blocks.block_backward(block, q, k, v, block_operands, o, lse, d_o)

    def unbinned(tokens, lse):
        return call(spec, inputs, *tokens, lse=lse)

    plan = bin_plan(spec, ir)
    if plan is None:  # the device's rows are too few for bins to pay
        values = unbinned(tokens, lse)
    else:
        layout = packed.lay_out(ids, plan, spec.max_segments, interpret=False)

        def binned(tokens, lse):
            bin_inputs = dataclasses.replace(inputs, q_segment_ids=layout.bin_ids, kv_segment_ids=layout.bin_ids)
            into = tuple(packed.to_bins(x, layout, plan) for x in tokens)
            if not backward:
                return packed.from_bins(*call(plan.spec, bin_inputs, *into), layout, spec)
            # the logsumexp moves as the tokens do, (B, T, N) rows; empty slots get 0: rows that attend
            # nothing, which `block_backward` gives no gradient
            lse_bins = jnp.swapaxes(packed.to_bins(jnp.swapaxes(lse, 1, 2), layout, plan), 1, 2)
            grads = call(plan.spec, bin_inputs, *into, lse=lse_bins)
            return tuple(packed.from_bins(g, None, layout, spec)[0] for g in grads)

        values = jax.lax.cond(layout.fits, binned, unbinned, tokens, lse)
    if backward:
        return dict(zip(("dq", "dk", "dv"), values))
    out, lse = values
    return {"o": out.astype(results["o"].dtype), **({} if lse is None else {"stats": jnp.swapaxes(lse, 1, 2)})}

