"""The numerical check's direct run: a call's cuDNN graphs executed once on random inputs made on
the host, outside XLA, cut to the check's slice.

    run_direct(spec, ir, training, chosen, host, seed) -> (the slice data `numerics.compare` takes, costs)

Why not through XLA: a program around the FFI call is compiled per config, and on an H100 that
compile (1.0-1.4 s) took longer than building the graph (docs/results/h100-2026-11-24.md). Here
nothing is compiled: the executor runs each graph on device memory of its own (`ffi.direct`).

What it does is what `backends.cudnn.backend.attention` does around the graphs, in NumPy:
- the graph's operands by role (`graphs.operands.graph_io` of `plan_layout`'s graph spec): q, k, v
  of random values; the bias operand (the user's bias, with the boolean mask and folded key padding
  as `MASKED_BIAS`); sequence lengths; for packed (THD) graphs the per-sequence lengths and ragged
  element offsets; for a dense twin the segment bounds; the mod's arrays; the sinks' logits
  (`sink_token`, a spec with sinks); for paged K/V the pools as k and v, the page table (once per
  pool) and the sequence lengths; for the backward graph the forward's o and stats and a
  cotangent that is zero outside the slice (rows `attention` zeroes get none);
- the results as `attention` returns them, on the slice: rows that hold no result zeroed
  (padding, dropped segments, rows a mask in the bias empties), their logsumexp -inf (with sinks:
  the sink's logit), dk and dv of padded keys zeroed, dbias summed back to the user's bias shape.

The reference's side (which keys each query may attend to, the positions `gen_index` reads) is
derived here from the drawn lengths and segments, not by the runtime's JAX code: the check's
packed segments are contiguous runs numbered 1, 2, ... (`numerics_draw.random_segment_ids`), so
positions and bounds follow from run starts directly.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable, Mapping

import jax
import numpy as np

from sdpagraph import ffi
from sdpagraph.graph_store import CachedGraph, cached_graph
from sdpagraph.ffi.direct import DeviceArena, Result, Sparse, Tiled
from sdpagraph.scoremod.ir import INT, ScoreModIR
from sdpagraph.graphs.compiled import scalar_bits
from sdpagraph.graphs.operands import (ARRAY_PREFIX, MASKED_BIAS, PAGE_TABLES, SINK_TOKEN, LayoutPlan, plan_layout,
                                       stats_shape)
from sdpagraph.numerics.draw import MASK_KEEP, Slice, key_index, kv_shapes, slicers
from sdpagraph.backends.masking import position_allowed
from sdpagraph.spec import AttentionSpec, directions_for

# (graph, operands by role (arrays, `Tiled` or `Sparse`), results by role, the mod's scalars) -> results
Execute = Callable[[CachedGraph, Mapping[str, Any], Mapping[str, Result], Mapping[str, Any]], dict[str, np.ndarray]]

# Random io values from random bits: sign, mantissa and the exponent's two low bits drawn, the rest
# fixed, so |x| lies in [1/8, 2) (bfloat16: 8 exponent bits, float16: 5).
_IO_BITS = {"bfloat16": (0x81FF, 124 << 7), "float16": (0x8FFF, 12 << 10)}
# Drawing every value of a large tensor cost the host 0.4 s at B4 T4096 N16 H128 (three tensors and
# a cotangent), more than the check may take. Larger tensors repeat a random pool of this many
# values: an odd period, so no two rows of a power-of-two head dim hold the same values while the
# tensor has fewer rows than the pool has values (a graph reading the wrong row still reads
# different numbers). The large tensors of one check share a pool, each from a random start.
POOL_VALUES = (1 << 22) + 1


def available() -> bool:
    """Whether graphs can run directly here: a GPU backend and the executor."""
    return jax.default_backend() == "gpu" and ffi.unavailable_reason() is None


def io_dtype(name: str) -> np.dtype:
    return np.dtype(jax.numpy.dtype(name))


def random_io(rng: np.random.Generator, shape: tuple[int, ...], dtype: str,
              pool: np.ndarray | None = None) -> np.ndarray | Tiled:
    """Random values of `shape` in the spec's io dtype (float32: standard normal); beyond
    POOL_VALUES elements, `pool` (drawn here when not given: `random_pool`) repeated from a random
    start (`ffi.direct.Tiled`)."""
    count = int(np.prod(shape))
    if count <= POOL_VALUES:
        return _random_values(rng, count, dtype).reshape(shape)
    pool = random_pool(rng, dtype) if pool is None else pool
    return Tiled(pool, tuple(shape), int(rng.integers(len(pool))))


def random_pool(rng: np.random.Generator, dtype: str) -> np.ndarray:
    """POOL_VALUES random values, which the large tensors of one check share at random starts."""
    return _random_values(rng, POOL_VALUES, dtype)


def _random_values(rng: np.random.Generator, count: int, dtype: str) -> np.ndarray:
    if dtype not in _IO_BITS:
        return rng.standard_normal(count, np.float32).astype(io_dtype(dtype))
    keep, base = _IO_BITS[dtype]
    raw = rng.bit_generator.random_raw(-(-count // 4)).view(np.uint16)[:count]  # 5x faster than rng.bytes
    return ((raw & np.uint16(keep)) | np.uint16(base)).view(io_dtype(dtype))


# ----------------------------------------------------------------------------- token layout

def _runs(ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(position of each token in its run, length of its run) for (B, L) ids of contiguous runs."""
    b, length = ids.shape
    token = np.broadcast_to(np.arange(length), (b, length))
    starts = np.ones((b, length), bool)
    starts[:, 1:] = ids[:, 1:] != ids[:, :-1]
    first = np.maximum.accumulate(np.where(starts, token, 0), axis=1)
    ends = np.ones((b, length), bool)
    ends[:, :-1] = starts[:, 1:]
    last = np.minimum.accumulate(np.where(ends, token, length)[:, ::-1], axis=1)[:, ::-1]
    return token - first, last - first + 1


@dataclasses.dataclass(frozen=True)
class _Layout:
    """Per-token facts of the call (`masking.TokenLayout`'s, from the drawn structure)."""

    q_pos: np.ndarray  # (B, T)
    kv_pos: np.ndarray  # (B, S)
    q_valid: np.ndarray  # (B, T) bool
    kv_valid: np.ndarray  # (B, S)
    q_ids: np.ndarray | None  # (B, T) segment numbers, or None without segments
    kv_ids: np.ndarray | None
    q_run_len: np.ndarray | None  # (B, T) length of each token's segment
    kv_run_len: np.ndarray | None
    q_len: np.ndarray  # (B,) valid query / key lengths (dense)
    kv_len: np.ndarray


def _layout(spec: AttentionSpec, arrays: Mapping[str, np.ndarray]) -> _Layout:
    b, t, s = spec.batch, spec.q_len, spec.kv_len
    q_len = np.asarray(arrays.get("q_lengths", np.full(b, t)), np.int64)
    kv_len = np.asarray(arrays.get("kv_lengths", np.full(b, s)), np.int64)
    if not spec.segments:
        q_pos, kv_pos = np.broadcast_to(np.arange(t), (b, t)), np.broadcast_to(np.arange(s), (b, s))
        return _Layout(q_pos, kv_pos, q_pos < q_len[:, None], kv_pos < kv_len[:, None], None, None, None, None,
                       q_len, kv_len)
    q_ids = arrays["q_segment_ids"]
    kv_ids = arrays.get("kv_segment_ids", q_ids)
    (q_pos, q_run), (kv_pos, kv_run) = _runs(q_ids), _runs(kv_ids)
    bound = spec.max_segments  # segments past it count as padding, as in the packed layout
    return _Layout(q_pos, kv_pos, (q_ids > 0) & (q_ids <= bound), (kv_ids > 0) & (kv_ids <= bound), q_ids, kv_ids,
                   q_run, kv_run, q_len, kv_len)


def _allowed_on_slice(spec: AttentionSpec, layout: _Layout, picks: Mapping[str, np.ndarray], mask: np.ndarray | None,
                      on_score: Callable) -> np.ndarray:
    """(B', N', T', S): where each picked query may attend to each key (`masking.allowed_mask`)."""
    rows, queries = picks["rows"][:, None, None], picks["queries"]
    at_q = lambda x: x[rows, queries][..., None]  # noqa: E731 - (B, T) -> (B', N', T', 1)
    at_kv = lambda x: x[picks["rows"]][:, None, None, :]  # noqa: E731 - (B, S) -> (B', 1, 1, S)
    allowed = at_q(layout.q_valid) & at_kv(layout.kv_valid)
    offset = 0
    if layout.q_ids is not None:
        allowed = allowed & (at_q(layout.q_ids) == at_kv(layout.kv_ids))
        if spec.causal_alignment == "bottom_right" and spec.segments == "cross":
            offset = at_kv(layout.kv_run_len) - at_q(layout.q_run_len)
    elif spec.causal_alignment == "bottom_right":
        offset = (layout.kv_len - layout.q_len)[picks["rows"]][:, None, None, None]
    positions = position_allowed(spec, at_q(layout.q_pos) + offset, at_kv(layout.kv_pos), xp=np)
    if positions is not None:
        allowed = allowed & positions
    if mask is not None:
        allowed = allowed & on_score(mask)
    return np.broadcast_to(allowed, (*queries.shape, spec.kv_len))


# ----------------------------------------------------------------------------- operands

def _packed_operands(spec: AttentionSpec, layout: _Layout) -> dict[str, np.ndarray]:
    """THD operands (`call_operands.packed_operands` + `ragged_operands`): B*M sequence lengths and ragged
    element offsets, segments past M = max_segments dropped, unused slots empty at the row's end."""
    operands = {}
    sides = (("q", layout.q_pos, layout.q_valid, layout.q_run_len, spec.q_len, spec.num_heads * spec.head_dim),
             ("kv", layout.kv_pos, layout.kv_valid, layout.kv_run_len, spec.kv_len,
              spec.num_kv_heads * spec.head_dim))
    m = spec.max_segments
    for side, pos, valid, run_len, length, row_elements in sides:
        lens = np.zeros((spec.batch, m), np.int64)
        starts = np.zeros((spec.batch, m), np.int64)
        for row in range(spec.batch):
            first = np.flatnonzero((pos[row] == 0) & valid[row])  # the kept segments' first tokens
            lens[row, :len(first)] = run_len[row, first]
            end = first[-1] + run_len[row, first[-1]] if len(first) else 0
            starts[row] = end
            starts[row, :len(first)] = first
        starts += (np.arange(spec.batch) * length)[:, None]
        starts = np.r_[starts.reshape(-1), spec.batch * length]
        operands[f"seq_len_{side}"] = lens.reshape(-1).astype(np.int32)
        operands[f"ragged_offset_{side}"] = (starts * row_elements).reshape(-1).astype(np.int32)
        if side == "q":
            operands["ragged_offset_stats"] = (starts * spec.num_heads).reshape(-1).astype(np.int32)
    return operands


def _bias_operand(plan: LayoutPlan, layout: _Layout, bias: np.ndarray | None,
                  mask: np.ndarray | None) -> tuple[np.ndarray, np.ndarray | None]:
    """(the graph's bias operand, where it keeps the user's bias or None): `call_operands.bias_operand`."""
    keep = mask
    if plan.folds_padding and plan.graph_spec.has_kv_lengths:
        kv_valid = layout.kv_valid[:, None, None, :]
        keep = kv_valid if keep is None else keep & kv_valid
    value = np.zeros((), np.float32) if bias is None else np.asarray(bias, np.float32)
    if keep is not None:
        value = np.where(keep, value, np.float32(MASKED_BIAS[plan.graph_spec.dtype]))
    dtype = io_dtype(plan.graph_spec.dtype)
    return np.ascontiguousarray(np.broadcast_to(value, plan.bias_shape)).astype(dtype), keep


def _graph_operands(plan: LayoutPlan, layout: _Layout, inputs: Mapping[str, Any], sinks: np.ndarray | None = None,
                    page_table: np.ndarray | None = None) -> tuple[dict[str, np.ndarray], np.ndarray | None]:
    """(every operand role the forward and backward graphs may take but o, stats and dO; where the
    bias operand keeps the user's bias, or None). `sinks`: the sinks' logits (N,), for a graph with
    sinks; `page_table`: (B, max_pages), for paged K/V."""
    spec = plan.graph_spec
    operands = {role: inputs[role] for role in ("q", "k", "v")}
    operands.update({ARRAY_PREFIX + name: x for name, x in inputs["arrays"].items()})
    if spec.sinks:
        operands[SINK_TOKEN] = np.asarray(sinks, np.float32).reshape(1, spec.num_heads, 1, 1)
    keep = None
    if plan.bias_shape is not None:
        operands["bias"], keep = _bias_operand(plan, layout, inputs["bias"], inputs["mask"])
    if spec.segments:
        operands.update(_packed_operands(spec, layout))
    elif spec.segment_mask:  # the dense twin's segment bounds (`masks.segment_ir`); padding: itself
        token = np.arange(spec.q_len)[None, :]
        start = np.where(layout.q_valid, token - layout.q_pos, token)
        end = np.where(layout.q_valid, token - layout.q_pos + layout.q_run_len - 1, token)
        for role, bound in (("segment_start", start), ("segment_end", end)):
            operands[role] = bound.astype(np.int32)[:, None, :, None]
    elif spec.has_padding or spec.paged:  # a paged graph always takes the lengths (cuDNN's padding mask)
        operands["seq_len_q"] = layout.q_len.astype(np.int32)
        operands["seq_len_kv"] = layout.kv_len.astype(np.int32)
    if spec.paged:
        table = np.asarray(page_table, np.int32).reshape(spec.batch, 1, -1, 1)
        operands.update({role: table for role in PAGE_TABLES})
    return operands, keep


# ----------------------------------------------------------------------------- the run

def draw_inputs(spec: AttentionSpec, ir: ScoreModIR | None, seed: int) -> dict[str, Any]:
    """q, k, v (paged: the pools), the user's bias and boolean mask (one row emptied) and the mod's
    arrays."""
    rng = np.random.default_rng([seed, 2])
    b, t, s = spec.batch, spec.q_len, spec.kv_len
    k_shape, v_shape = kv_shapes(spec)
    shapes = {"q": (b, t, spec.num_heads, spec.head_dim), "k": k_shape, "v": v_shape, "bias": spec.bias_shape}
    large = any(shape is not None and np.prod(shape) > POOL_VALUES for shape in shapes.values())
    pool = random_pool(rng, spec.dtype) if large else None
    inputs = {name: None if shape is None else random_io(rng, shape, spec.dtype, pool)
              for name, shape in shapes.items()}
    inputs.update(mask=None, arrays={})
    if spec.mask_shape is not None:
        mask = rng.random(spec.mask_shape) < MASK_KEEP
        if spec.mask_shape[2] == t and t > 1:
            mask[:, :, t // 2, :] = False  # a row with nothing to attend to: 0 on both
        inputs["mask"] = mask
    if ir is not None:
        for _, node in ir.slots("array"):
            name, shape = ir.array_names[node.attr("slot")], tuple(node.attr("shape"))
            inputs["arrays"][name] = (rng.integers(1, max(t, s) + 1, shape).astype(np.int32) if node.dtype == INT
                                      else rng.standard_normal(shape, np.float32))
    return inputs


def run_direct(spec: AttentionSpec, ir: ScoreModIR | None, training: bool, chosen: Slice,
               host: Mapping[str, Any], seed: int,
               execute: Execute | None = None) -> tuple[dict[str, Any], dict[str, float]]:
    """Run the call's graphs (`spec.directions_for(training, spec)`) once on random inputs:
    (the slice data `numerics.compare` takes, {"device_mib": device memory the run allocated,
    "device_s": seconds in the executor's copies and runs}). `host`:
    `numerics_draw.host_inputs`. `execute` runs one graph and returns its results as
    `DeviceArena.run` does, only the tokens a `Result` names (default: the executor, through a
    `DeviceArena`; tests replace it, and then no device memory is counted)."""
    if execute is not None:
        return _run(spec, ir, training, chosen, host, seed, execute), {}
    device = jax.local_devices()[0]
    ordinal = getattr(device, "local_hardware_id", None)
    on_graphs = [0.0]  # seconds inside the arena's runs: copies in and out, and the graphs
    with DeviceArena(device.id if ordinal is None else ordinal) as arena:
        def on_device(graph, operands, results, scalars):
            started = time.perf_counter()
            ffi.register_graph(graph.digest, graph.compiled.blob)
            uids, words = scalar_bits(graph.compiled, scalars)
            outputs = arena.run(graph.digest, graph.compiled.uids, operands, results, uids, words)
            on_graphs[0] += time.perf_counter() - started
            return outputs

        data = _run(spec, ir, training, chosen, host, seed, on_device)
        return data, {"device_mib": arena.allocated_bytes / 2**20, "device_s": on_graphs[0]}


def _run(spec: AttentionSpec, ir: ScoreModIR | None, training: bool, chosen: Slice, host: Mapping[str, Any],
         seed: int, execute: Execute) -> dict[str, Any]:
    plan = plan_layout(spec, ir)
    g = plan.graph_spec
    picks = chosen.indices()
    rows, heads, queries = picks["rows"][:, None, None], picks["heads"][None, :, None], picks["queries"]
    page_table = host["arrays"].get("page_table")
    on_q, on_kv, _, on_score = slicers(spec, picks, np, page_table)
    inputs = draw_inputs(spec, ir, seed)
    layout = _layout(spec, host["arrays"])
    allowed = _allowed_on_slice(spec, layout, picks, inputs["mask"], on_score)
    # The rows `attention` keeps (`call_operands.Validity`): valid tokens when the graph has padding or
    # segments, and when the bias carries a mask, rows that attend to some key.
    validity = bool(g.segments or g.segment_mask or g.has_padding)
    q_kept = layout.q_valid[rows, queries] if validity else np.ones(queries.shape, bool)  # (B', N', T')
    kept = q_kept & allowed.any(axis=-1) if plan.bias_carries_masks else q_kept
    sinks = host["arrays"].get("sinks")
    operands, keep = _graph_operands(plan, layout, inputs, sinks, page_table)
    dtype = io_dtype(g.dtype)
    zero = np.zeros((), dtype)
    o_shape = (g.batch, g.q_len, g.num_heads, g.head_dim_v)
    # Of the large results, only what the slice reads comes back: the (batch row, query) tokens of o
    # and dq, the (batch row, key) tokens of dk and dv.
    picked_tokens = rows * g.q_len + queries  # (B', N', T')
    query_tokens = np.unique(picked_tokens)
    at_queries = np.searchsorted(query_tokens, picked_tokens)  # each pick's place among the tokens
    on_q_tokens = lambda x: x[at_queries, heads]  # noqa: E731 - (tokens, N, H) -> (B', N', T', H)
    key_tokens = (picks["rows"][:, None] * g.kv_len + picks["keys"][None, :]).reshape(-1)
    on_key_tokens = lambda x: x.reshape(len(picks["rows"]), len(picks["keys"]), *x.shape[1:])[  # noqa: E731
        :, :, picks["kv_heads"]]  # (tokens, K, H) -> (B', S', K', H)

    def run(direction: str, results: Mapping[str, Result]) -> dict[str, np.ndarray]:
        graph = cached_graph(spec, ir, direction)
        roles = graph.compiled
        return execute(graph, {role: operands[role] for role in roles.operand_roles},
                       {role: results[role] for role in roles.result_roles}, host["scalars"])

    directions = directions_for(training, spec)
    forward = run(directions[0], {"o": Result(o_shape, dtype, query_tokens),
                                  "stats": Result(stats_shape(g), np.float32)})
    kv_index = key_index(spec, picks, np, page_table)  # paged: the keys the graph reads from the pools
    data = {"q": _cut(inputs["q"], on_q, rows, queries, heads), "k": _cut(inputs["k"], on_kv, *kv_index),
            "v": _cut(inputs["v"], on_kv, *kv_index), "allowed": allowed,
            "q_pos": layout.q_pos[rows, queries], "kv_pos": layout.kv_pos[picks["rows"]],
            "bias": on_score(None if inputs["bias"] is None else np.asarray(inputs["bias"])),
            "arrays": {name: on_score(x) for name, x in inputs["arrays"].items()},
            "o": np.where(kept[..., None], on_q_tokens(forward["o"]), zero)}
    if sinks is not None:
        data["sinks"] = sinks[picks["heads"]]
    if "forward" not in directions:
        return data
    stats = forward["stats"].swapaxes(1, 2) if g.segments else forward["stats"]  # (B, N, T)
    nothing = -np.inf if sinks is None else data["sinks"][None, :, None]  # a row with nothing to attend
    data["lse"] = np.where(kept, stats[rows, heads, queries], nothing)
    if "backward" not in directions:
        return data
    # Only the slice sends gradients back, so the whole run's dk, dv and dbias are the slice's.
    drawn = random_io(np.random.default_rng([seed, 3]), (*kept.shape, g.head_dim_v), g.dtype)
    data["cotangent"] = np.where(kept[..., None], np.asarray(drawn), zero)
    operands.update(o=forward["o"], stats=forward["stats"],
                    dO=Sparse(o_shape, dtype, np.broadcast_arrays(rows, queries, heads), data["cotangent"]))
    q_shape = (g.batch, g.q_len, g.num_heads, g.head_dim)
    k_shape, v_shape = (g.batch, g.kv_len, g.num_kv_heads, g.head_dim), (g.batch, g.kv_len, g.num_kv_heads, g.head_dim_v)
    results = {"dq": Result(q_shape, dtype, query_tokens), "dk": Result(k_shape, dtype, key_tokens),
               "dv": Result(v_shape, dtype, key_tokens)}
    if plan.bias_shape is not None:
        results["dbias"] = Result(plan.bias_shape, dtype)
    grads = run("backward", results)
    kv_kept = layout.kv_valid[picks["rows"][:, None], picks["keys"]][:, :, None, None] if validity else True
    data["dq"] = np.where(q_kept[..., None], on_q_tokens(grads["dq"]), zero)
    data["dk"], data["dv"] = (np.where(kv_kept, on_key_tokens(grads[role]), zero) for role in ("dk", "dv"))
    data["dbias"] = None
    if spec.bias_shape is not None:
        data["dbias"] = on_score(_user_bias_gradient(grads["dbias"], keep, spec.bias_shape))
    return data


def _cut(x: np.ndarray | Tiled, cut: Callable, *index: np.ndarray) -> np.ndarray:
    """`cut(x)` of an input, which is x[index] (one index array per leading axis, broadcast
    together); a `Tiled` input is read block by block, not materialized."""
    if not isinstance(x, Tiled):
        return cut(x)
    index = np.broadcast_arrays(*index)
    starts = np.ravel_multi_index((*index, np.zeros_like(index[0])), x.shape)
    return x.blocks(starts, x.shape[-1])


def _user_bias_gradient(dbias: np.ndarray, keep: np.ndarray | None, shape: tuple[int, ...]) -> np.ndarray:
    """The gradient of the user's bias from the bias operand's: zero where a mask replaced it, summed
    over the axes the operand broadcast it along (what autodiff of `call_operands.bias_operand` gives)."""
    grad = dbias.astype(np.float32)
    if keep is not None:
        grad = np.where(keep, grad, 0.0)
    axes = tuple(axis for axis, size in enumerate(shape) if size == 1 and grad.shape[axis] != 1)
    return grad.sum(axis=axes, keepdims=True).astype(dbias.dtype)
