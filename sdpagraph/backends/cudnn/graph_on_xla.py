"""What a cuDNN graph computes, evaluated by the XLA backend from the graph's own operands.

    run_on_xla(static, operands, results) -> {role: array}     in place of one executor call

A graph that failed its numerical check is never run on user data. Dispatch sees that for the
call's own spec and picks XLA for the whole call; but under SPMD partitioning the per-device graphs
are built (and checked) only at XLA compile time, when the call is already lowered to the cuDNN
path. A shard whose graphs failed then runs this instead of the executor (`execute._execute`), on
the same operands, so nothing upstream changes:
- packed sequences decoded from the sequence lengths and ragged element offsets (the stats'
  offsets must agree with q's);
- padding from the sequence lengths; masks and folded key padding are already in the bias operand;
- the dense twin's segment bounds through its extra mod stage (`masks.segment_ir`);
- the score_mod's arrays and scalars;
- paged K/V: the pools gathered by the page table into each sequence's keys;
- cuDNN's attention sinks (`sink_token`, composed as `backends.sinks` composes them);
- FP8 (sdpa_fp8, sdpa_fp8_backward): the inputs (and dO) dequantized by their descales, attention
  and its gradients in float32 (the o and stats given to a backward are not read), results scaled and
  saturated into their FP8 dtypes, with their amaxes; the softmax's and dP's amaxes are not computed
  (reported as 1: nothing reads them; the FP8 backward's rerun decision reads dq's, dk's and dv's);
- dropout: the graph's one seed (the first of the seeds operand) spread over (B, N) by
  `dropout.keep_mask`; a different mask from cuDNN's Philox, the same in the forward and the backward.
The forward gives o and the stats in the graph's layout; the backward recomputes the forward and
differentiates it with the cotangent dO (the o and stats it is given are not read).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp

from sdpagraph.scoremod.ir_eval import evaluate
from sdpagraph.scoremod.masks import segment_ir
from sdpagraph import paged
from sdpagraph.fp8_values import saturate
from sdpagraph.graphs.operands import ARRAY_PREFIX, DROPOUT, PAGE_TABLES, SINK_TOKEN
from sdpagraph.call import RuntimeInputs
from sdpagraph.backends import registry, sinks


def run_on_xla(static: Any, operands: Mapping[str, Any], results: Mapping[str, Any]) -> dict[str, Any]:
    """The `results` (role -> shape struct) one graph call of `static` (`execute.Static`) gives for
    `operands` (role -> array, as the executor takes them)."""
    if static.graph_spec.is_fp8:
        return _fp8_on_xla(static.graph_spec, operands, results)
    forward = graph_forward(static, operands)
    q, k, v, bias, sink = (operands.get(role) for role in ("q", "k", "v", "bias", SINK_TOKEN))
    if "dq" not in results:
        out, stats = forward(q, k, v, bias, sink)
        return {"o": out.astype(q.dtype), "stats": stats} if "stats" in results else {"o": out.astype(q.dtype)}
    out, pullback = jax.vjp(lambda q, k, v, bias: forward(q, k, v, bias)[0], q, k, v, bias)
    dq, dk, dv, dbias = pullback(operands["dO"].astype(out.dtype))
    grads = {"dq": dq, "dk": dk, "dv": dv, "dbias": dbias}
    return {role: grads[role].astype(results[role].dtype) for role in results}


def _fp8_on_xla(spec: Any, operands: Mapping[str, Any], results: Mapping[str, Any]) -> dict[str, Any]:
    """What an FP8 graph gives: the forward's o (scaled, saturated into the FP8 dtype), stats, amax_s and
    amax_o; the backward's dq, dk, dv (scaled, saturated into their dtype) and their amaxes."""
    scale = {role: x.reshape(()) for role, x in operands.items() if role.startswith(("descale_", "scale_"))}
    q, k, v = (operands[role].astype(jnp.float32) * scale[f"descale_{role}"] for role in ("q", "k", "v"))
    plain = dataclasses.replace(spec, dtype="float32")
    inputs = RuntimeInputs(q_lengths=operands.get("seq_len_q"), kv_lengths=operands.get("seq_len_kv"))
    attend = lambda q, k, v: registry.reference().attention(plain, q, k, v, inputs, None)  # noqa: E731
    if "dq" not in results:
        out, lse = attend(q, k, v)
        o = saturate(out * scale["scale_o"], operands["q"].dtype)
        found = {"o": o, "stats": lse, "amax_s": jnp.ones((1, 1, 1, 1), jnp.float32),
                 "amax_o": jnp.max(jnp.abs(out)).reshape(1, 1, 1, 1)}
        return {role: found[role] for role in results}
    (out, _), pullback = jax.vjp(attend, q, k, v)
    d_o = operands["dO"].astype(jnp.float32) * scale["descale_dO"]
    grads = dict(zip(("dq", "dk", "dv"), pullback((d_o, jnp.zeros(out.shape[:1] + out.shape[2:3] + out.shape[1:2])))))
    found = {}
    for role, name in (("dq", "dQ"), ("dk", "dK"), ("dv", "dV")):
        found[role] = saturate(grads[role] * scale[f"scale_{name}"], results[role].dtype)
        found[f"amax_{role}"] = jnp.max(jnp.abs(grads[role])).reshape(1, 1, 1, 1)
    found["amax_dp"] = jnp.ones((1, 1, 1, 1), jnp.float32)
    return {role: found[role] for role in results}


def graph_forward(static: Any, operands: Mapping[str, Any]) -> Callable[..., tuple[Any, Any]]:
    """(q, k, v, bias, sink_token) -> (o, stats in the graph's layout), as the graph computes them."""
    spec = static.graph_spec
    plain = graph_forward_without_sinks(static, operands)
    if not spec.sinks:
        return lambda q, k, v, bias, sink=None: plain(q, k, v, bias)

    def forward(q, k, v, bias, sink):
        out, stats = plain(q, k, v, bias)
        as_lse = (lambda x: jnp.swapaxes(x, 1, 2)) if spec.segments else (lambda x: x)  # noqa: E731
        out, lse = sinks.apply(out, as_lse(stats), sink.reshape(spec.num_heads))
        return out, as_lse(lse)

    return forward


def graph_forward_without_sinks(static: Any, operands: Mapping[str, Any]) -> Callable[..., tuple[Any, Any]]:
    """(q, k, v, bias) -> (o, stats in the graph's layout) before any sinks."""
    spec = static.graph_spec
    arrays = {name[len(ARRAY_PREFIX):]: x for name, x in operands.items() if name.startswith(ARRAY_PREFIX)}
    scalars = dict(static.scalars)
    seeds = None
    if spec.dropout:  # as cuDNN: the block's first seed
        seeds = jnp.broadcast_to(operands[DROPOUT[0]].reshape(-1)[0], (spec.batch, spec.num_heads))

    def forward(q, k, v, bias):
        if spec.paged:
            table = operands[PAGE_TABLES[0]].reshape(spec.batch, -1)
            k, v = paged.gather(k, table), paged.gather(v, table)
        if spec.segments:
            ids_q = packed_ids(operands["seq_len_q"], operands["ragged_offset_q"], spec.batch, spec.q_len,
                               spec.max_segments, spec.num_heads * spec.head_dim)
            ids_kv = packed_ids(operands["seq_len_kv"], operands["ragged_offset_kv"], spec.batch, spec.kv_len,
                                spec.max_segments, spec.num_kv_heads * spec.head_dim)
            stats_ids = packed_ids(operands["seq_len_q"], operands["ragged_offset_stats"], spec.batch, spec.q_len,
                                   spec.max_segments, spec.num_heads)
            ids_q = jnp.where(stats_ids == ids_q, ids_q, -1)  # the stats offsets must agree
            inputs = RuntimeInputs(q_segment_ids=ids_q, kv_segment_ids=ids_kv, mod_scalars=scalars, mod_arrays=arrays,
                                   dropout_seeds=seeds)
            out, lse = registry.reference().attention(spec, q, k, v, inputs, static.ir)
            return out, jnp.swapaxes(lse, 1, 2)
        mask = None
        if spec.segment_mask:  # the dense twin: the bounds as the graph's extra mod stage reads them
            b, t = spec.batch, spec.q_len
            index = [None, None, None, jnp.arange(t, dtype=jnp.int32)[None, None, None, :]]
            bounds = {name: x for name, x in operands.items() if name.startswith("segment_")}
            masked, _ = evaluate(segment_ir(spec), jnp.zeros((b, 1, t, t), jnp.float32), scalars={}, arrays=bounds,
                                 index=index)
            mask = jnp.isfinite(masked)
        plain = dataclasses.replace(spec, segment_mask=False, max_segments=0, paged=None,
                                    mask_shape=None if mask is None else mask.shape,
                                    bias_shape=None if bias is None else bias.shape)
        inputs = RuntimeInputs(bias=bias, mask=mask, q_lengths=operands.get("seq_len_q"),
                               kv_lengths=operands.get("seq_len_kv"), mod_scalars=scalars, mod_arrays=arrays,
                               dropout_seeds=seeds)
        return registry.reference().attention(plain, q, k, v, inputs, static.ir)

    return forward


def packed_ids(seq_len: Any, ragged: Any, batch: int, length: int, max_segments: int, row_elements: int) -> Any:
    """Segment ids (B, L), 1..M by slot, decoded from a packed graph's sequence lengths and ragged
    element offsets: offsets that address the wrong tokens give the wrong ids."""
    starts = ragged[:-1] // row_elements - (jnp.arange(batch, dtype=jnp.int32) * length).repeat(max_segments)
    starts, lens = starts.reshape(batch, max_segments, 1), seq_len.reshape(batch, max_segments, 1)
    token = jnp.arange(length, dtype=jnp.int32)[None, None, :]
    inside = (token >= starts) & (token < starts + lens)
    return jnp.sum(inside * jnp.arange(1, max_segments + 1, dtype=jnp.int32)[None, :, None], axis=1)
