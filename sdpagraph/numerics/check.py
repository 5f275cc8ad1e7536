"""The numerical check of a config's cuDNN graphs against a float32 NumPy reference.

    check_numerics(spec, ir, training, cache=None) -> NumericsResult    (`numerics.record`: pass/fail, text)

Fused-attention stacks ship silent wrong results; sdpagraph uses a graph only once it has
computed the right answer on this GPU. The check draws fresh random inputs of the spec's shapes
(q, k, v in the spec's dtype, a bias and a boolean mask of the spec's shapes with one query row
masked out, random valid lengths for padding, random packed segments, the call's score_mod scalars
(random positive ones where it has none), random arrays of the IR's shapes, for a spec with
attention sinks sink logits that take sizable shares of the rows, and for paged K/V pools and a
scattered page table (`numerics.draw`)), runs the config's graphs (`spec.directions_for`: forward
and, when training, backward with a random cotangent; a paged spec (inference only) and a spec with
cuDNN's own sinks (whose call runs the backward graph of its spec without sinks, checked as that
spec) have no backward: their "training" graph is the forward one, checked with its softmax stats),
and compares a slice of the results (`numerics_draw.plan_slice`) with a NumPy float32 reference
(`numerics.reference`) on the host. The reference evaluates the spec's attention and the score_mod
IR (`scoremod.ir_eval` on NumPy, backward through the IR's bprop, as the cuDNN backward graph does)
for the slice only.

The graphs run one of two ways:
- on a GPU with the executor, directly (`numerics_direct`): inputs made in NumPy, each graph run
  once by the executor outside XLA, nothing compiled. Compiling an XLA program per config cost
  more than the graph build it followed (docs/results/h100-2026-11-24-direct-check.md);
- for a `candidate` (the CPU tests' stand-ins), in one jitted program: inputs drawn on the
  device, the candidate forward and `jax.vjp`, which keys each query may attend to and the
  positions `gen_index` reads from the shared mask code (`backends.masking.positions_and_mask`), all
  cut to the slice there. Without a candidate where the direct run is not available (the CPU
  tests' faked GPU), the program runs the runtime's cuDNN path, which runs what the call runs: a multi-token paged decode as its folded prefix graph and a
  packed call on its bins, in place of the spec's own graphs (the direct run runs those).
The graph always runs on its whole shape; the cotangent is zero outside the slice, so dk, dv and a
broadcast dbias of the whole run hold the slice's contributions only and compare exactly.

Errors are relative Frobenius errors per output (`o`, `lse`, `dq`, `dk`, `dv`, `dbias`) against
tolerances per dtype (`TOLERANCES`, the bounds the GPU tests hold the backends to), plus
`empty_rows`: the largest |value| cuDNN gives in rows that attend to no key (must be 0).

The check runs in a worker thread, so it executes eagerly even when asked from inside a `jit`
trace (the support query runs at trace time), and inside `graph_store.using_cache(cache)`, so
it runs the graphs of the cache being checked.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import math
import os
import time
from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from sdpagraph.cache.graph_cache import GraphCache
from sdpagraph.graph_store import using_cache
from sdpagraph.scoremod.ir import INT, ScoreModIR
from sdpagraph.numerics.reference import reference
from sdpagraph.numerics import direct as numerics_direct
from sdpagraph.call import RuntimeInputs
from sdpagraph.numerics.draw import MASK_KEEP, SLICE_ELEMENTS, Slice, host_inputs, kv_shapes, plan_slice, slicers
from sdpagraph.numerics.record import NumericsResult
from sdpagraph.backends.masking import positions_and_mask
from sdpagraph.spec import AttentionSpec, directions_for

# Relative Frobenius error bounds, bf16/fp16 inputs with fp32 accumulation against a reference
# of higher precision: tests/gpu/test_builder_gpu.py's FORWARD_TOLERANCE / BACKWARD_TOLERANCE.
# Measured errors of correct graphs are 2e-3 to 5e-3 (docs/results/); wrong graphs (a wrong scale,
# mask or gradient) give 1e-1 and more.
FORWARD_TOLERANCE = 1e-2
BACKWARD_TOLERANCE = 2e-2
TOLERANCES = {dtype: {"forward": FORWARD_TOLERANCE, "backward": BACKWARD_TOLERANCE}
              for dtype in ("bfloat16", "float16", "float32")}
# FP8 graphs round their output to 3 (e4m3) or 2 (e5m2) mantissa bits: a raw sdpa_fp8 on an H100 gave
# 3.3e-2 (e4m3); a wrong graph (a wrong scale, mask or gradient) gives far more.
# FP8 training's forward measured 6e-2 (e4m3, the graph with stats), its e5m2 gradients ~1e-1 (2 mantissa
# bits); a wrong gradient gives 1 and more (H100, docs/results/h100-2026-11-26-fp8.md).
TOLERANCES.update({"float8_e4m3fn": {"forward": 8e-2, "backward": 2.5e-1},
                   "float8_e5m2": {"forward": 1.2e-1, "backward": 2.5e-1}})
# (spec, q, k, v, inputs, ir, training=..., sinks=... for a spec with sinks) -> (out, lse or None); a
# paged spec's k and v are the pools, its table `inputs.page_table` (as `attention` calls a backend)
Candidate = Callable[..., tuple[Any, Any]]


def tolerances_for(spec: AttentionSpec, training: bool, has_bias: bool) -> dict[str, float]:
    """The bound of each output the graphs of (spec, training) give: o; the logsumexp with the
    forward graph's stats; the gradients with a backward graph."""
    bounds = TOLERANCES.get(spec.dtype, TOLERANCES["bfloat16"])
    names = {"o": bounds["forward"], "empty_rows": 0.0}
    directions = directions_for(training, spec)
    if "forward" in directions:
        names["lse"] = bounds["forward"]
    if "backward" in directions:
        names.update(dq=bounds["backward"], dk=bounds["backward"], dv=bounds["backward"])
        if has_bias:
            names["dbias"] = bounds["backward"]
    return names


# ----------------------------------------------------------------------------- the check

def check_numerics(spec: AttentionSpec, ir: ScoreModIR | None, training: bool, cache: GraphCache | None = None,
                   *, seed: int | None = None, slice_elements: int = SLICE_ELEMENTS,
                   candidate: Candidate | None = None, scalars: Mapping[str, Any] | None = None) -> NumericsResult:
    """Run the cuDNN path of (spec, ir) once on random inputs and compare a slice of its results
    with the float32 reference (the graphs `spec.directions_for(training, spec)` names).

    `cache`: the graph cache whose graphs run (default: the runtime's). `slice_elements`: the
    reference's budget of score elements. `candidate` replaces the cuDNN path (tests). `scalars`:
    values of the IR's scalars to check with (the call's: a jax.numpy mod's constants are scalars,
    and `exp(s * 0.1)` must not be checked as `exp(s * 40)`); the others are drawn at random. Raises
    whatever the runs raise (the caller decides what that means).

    A spec with dropout is checked as its graphs without dropout: no reference can know the mask
    cuDNN's Philox draws (the GPU tests recover it and check the dropout graphs themselves). An FP8
    spec's graphs run in the jitted program with unit input scales, on inputs drawn on its FP8 grid."""
    spec = dataclasses.replace(spec, dropout=0.0)
    seed = int.from_bytes(os.urandom(4), "little") if seed is None else int(seed)
    started = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="sdpagraph-numerics") as pool:
        errors, where, timings = pool.submit(_check_in_thread, spec, ir, training, cache, seed, slice_elements,
                                             candidate, scalars or {}).result()
    tolerances = tolerances_for(spec, training, spec.bias_shape is not None)
    errors = {name: errors[name] for name in tolerances if name in errors}
    return NumericsResult(errors, {name: tolerances[name] for name in errors},
                          time.perf_counter() - started, seed, where, training, timings=timings)


def _check_in_thread(spec, ir, training, cache, seed, slice_elements, candidate, scalars):
    # A fresh thread has no JAX trace in progress (the support query may run inside a user's jit trace).
    with using_cache(cache):
        started = time.perf_counter()
        chosen = plan_slice(spec, slice_elements, np.random.default_rng([seed, 1]))
        host = host_inputs(spec, ir, seed, scalars)
        if candidate is None and numerics_direct.available() and not spec.is_fp8:  # FP8: the jitted path
            data, costs = numerics_direct.run_direct(spec, ir, training, chosen, host, seed)
            timings = {"run_s": time.perf_counter() - started, **costs}
        else:
            data, timings = _run_compiled(spec, ir, training, chosen, host, seed, candidate)
        ran = time.perf_counter()
        errors = compare(spec, ir, training, chosen, data, host["scalars"])
        timings["reference_s"] = time.perf_counter() - ran
    return errors, chosen.describe(spec, "backward" in directions_for(training, spec)), timings


def _run_compiled(spec, ir, training, chosen, host, seed, candidate):
    """The candidate's slice data from one jitted program (inputs drawn on the device)."""
    if candidate is None:
        from sdpagraph.backends.cudnn import backend as cudnn  # the runtime's cuDNN path (imports this module lazily)
        candidate = cudnn.attention
    started = time.perf_counter()
    key = jax.random.key(seed, impl="rbg")  # compiles in a fraction of threefry's time
    picks = chosen.indices()
    lowered = jax.jit(_candidate_program(spec, ir, training, host["scalars"], candidate)).lower(
        key, host["arrays"], picks)
    traced = time.perf_counter()
    compiled = _compile(lowered)
    built = time.perf_counter()
    data = jax.device_get(compiled(key, host["arrays"], picks))
    timings = {"trace_s": traced - started, "compile_s": built - traced, "run_s": time.perf_counter() - built}
    return data, timings


# The candidate's program runs once: compile it fast. On an H100, XLA's default GEMM autotuning made
# the check's program (then with a float32 XLA reference) 12-21 s, without autotuning 1.8-2.4 s, with
# cuBLAS instead of Triton GEMMs 1.1-1.3 s (docs/results/numerics-h100-2026-11-23.md).
COMPILE_OPTIONS = {"gpu": {"xla_gpu_autotune_level": 0, "xla_gpu_enable_triton_gemm": False},
                   "cpu": {"xla_backend_optimization_level": 0}}


def _compile(lowered: Any) -> Any:
    options = COMPILE_OPTIONS.get(jax.default_backend())
    if options:
        try:
            return lowered.compile(compiler_options=options)
        except Exception:  # noqa: BLE001 - an XLA that does not know an option: compile as usual
            pass
    return lowered.compile()


# ----------------------------------------------------------------------------- random inputs on the device

def _device_inputs(spec: AttentionSpec, ir: ScoreModIR | None, key: Any, host: Mapping[str, Any],
                   scalars: Mapping[str, Any], training: bool) -> tuple[Any, Any, Any, RuntimeInputs, Any]:
    """q, k, v (paged: the pools), the runtime inputs and a cotangent for o, drawn on the device
    (inside the jit). An FP8 spec's inputs are FP8 (its inference graph) or, when training, bfloat16
    holding values of the FP8 grid (its differentiable path quantizes them exactly)."""
    dtype = jnp.dtype(spec.dtype)
    b, t, s, n = spec.batch, spec.q_len, spec.kv_len, spec.num_heads
    keys = iter(jax.random.split(key, 8 + (0 if ir is None else len(ir.array_names))))

    def normal(shape, kind=dtype):
        drawn = jax.random.normal(next(keys), shape, jnp.float32)
        if spec.is_fp8 and training and kind == dtype:  # FP8 training takes bf16: values on the FP8 grid
            return drawn.astype(dtype).astype(jnp.bfloat16)
        return drawn.astype(kind)

    k_shape, v_shape = kv_shapes(spec)
    q, k, v = normal((b, t, n, spec.head_dim)), normal(k_shape), normal(v_shape)
    cotangent = normal((b, t, n, spec.head_dim_v))
    bias = None if spec.bias_shape is None else normal(spec.bias_shape)
    mask = None
    if spec.mask_shape is not None:
        mask = jax.random.bernoulli(next(keys), MASK_KEEP, spec.mask_shape)
        if spec.mask_shape[2] == t and t > 1:
            mask = mask.at[:, :, t // 2, :].set(False)  # a row with nothing to attend to: 0 on both
    arrays = {}
    if ir is not None:
        for _, node in ir.slots("array"):
            name, shape = ir.array_names[node.attr("slot")], tuple(node.attr("shape"))
            if node.dtype == INT:
                arrays[name] = jax.random.randint(next(keys), shape, 1, max(t, s) + 1, jnp.int32)
            else:
                arrays[name] = normal(shape, jnp.float32)
    ids_q = host.get("q_segment_ids")
    ids_kv = host.get("kv_segment_ids", ids_q)
    inputs = RuntimeInputs(bias=bias, mask=mask, q_lengths=host.get("q_lengths"), kv_lengths=host.get("kv_lengths"),
                           q_segment_ids=ids_q, kv_segment_ids=ids_kv, mod_scalars=dict(scalars),
                           mod_arrays=arrays, page_table=host.get("page_table"))
    return q, k, v, inputs, cotangent


# ----------------------------------------------------------------------------- the candidate's run

def _run(fn: Callable, q, k, v, inputs: RuntimeInputs, backward: bool, cotangent) -> dict:
    """Outputs (and, with a `backward` graph, gradients of q, k, v and the bias) of the candidate."""
    has_bias = inputs.bias is not None

    def forward(q, k, v, bias):
        out, lse = fn(dataclasses.replace(inputs, bias=bias) if has_bias else inputs, q, k, v)
        return out, lse

    if not backward:
        out, lse = forward(q, k, v, inputs.bias)
        return {"o": out, "lse": lse}
    out, pullback, lse = jax.vjp(forward, q, k, v, inputs.bias, has_aux=True)
    dq, dk, dv, dbias = pullback(cotangent.astype(out.dtype))
    return {"o": out, "lse": lse, "dq": dq, "dk": dk, "dv": dv, "dbias": dbias if has_bias else None}


def _candidate_program(spec: AttentionSpec, ir: ScoreModIR | None, training: bool, scalars: Mapping[str, Any],
                       candidate: Candidate) -> Callable:
    """(key, host arrays, slice indices) -> the slice of the inputs, of what may attend where, and of
    the candidate's results: all the reference needs, small enough to copy to the host. Query-side
    arrays come as (B', N', T', ...), one row of T' per (batch row, head) pair."""
    directions = directions_for(training, spec)

    def program(key, host, picks):
        rows, heads, queries = picks["rows"][:, None, None], picks["heads"][None, :, None], picks["queries"]
        q, k, v, inputs, cotangent = _device_inputs(spec, ir, key, host, scalars, training)
        # Only the slice sends gradients back (see the module docstring).
        cotangent = jnp.zeros_like(cotangent).at[rows, queries, heads].set(cotangent[rows, queries, heads])
        sinks = host.get("sinks")
        with_sinks = {} if sinks is None else {"sinks": sinks}
        ours = _run(lambda inp, q, k, v: candidate(spec, q, k, v, inp, ir, training=training, **with_sinks),
                    q, k, v, inputs, "backward" in directions, cotangent)
        q_pos, kv_pos, allowed = positions_and_mask(spec, inputs)
        on_q, on_kv, on_kv_grad, on_score = slicers(spec, picks, jnp, inputs.page_table)
        data = {"q": on_q(q), "k": on_kv(k), "v": on_kv(v), "cotangent": on_q(cotangent),
                "allowed": on_score(allowed), "q_pos": q_pos[rows, queries],
                "kv_pos": jnp.take(kv_pos, picks["rows"], axis=0), "bias": on_score(inputs.bias),
                "arrays": {name: on_score(x) for name, x in (inputs.mod_arrays or {}).items()},
                "o": on_q(ours["o"])}
        if sinks is not None:
            data["sinks"] = sinks[picks["heads"]]
        if "forward" in directions:
            data["lse"] = ours["lse"][rows, heads, queries]
        if "backward" in directions:
            data.update(dq=on_q(ours["dq"]), dk=on_kv_grad(ours["dk"]), dv=on_kv_grad(ours["dv"]),
                        dbias=on_score(ours["dbias"]))
        return data

    return program


# ----------------------------------------------------------------------------- comparison

def relative_error(actual: Any, expected: Any) -> float:
    """||actual - expected||_F / ||expected||_F (inf when not finite): differences in float32, where
    bf16 and fp16 values are exact, squares summed in float64."""
    actual, expected = np.asarray(actual, np.float32), np.asarray(expected, np.float32)
    error = _norm(actual - expected) / max(_norm(expected), 1e-30)
    return error if math.isfinite(error) else math.inf


def _norm(x: np.ndarray) -> float:
    return math.sqrt(float(np.sum(np.square(x), dtype=np.float64)))


def compare(spec: AttentionSpec, ir: ScoreModIR | None, training: bool, chosen: Slice, data: Mapping[str, Any],
            scalars: Mapping[str, Any]) -> dict[str, float]:
    """The errors of the candidate's slice (`data`) against the float32 reference: o, the
    logsumexp of a forward graph, the gradients of a backward graph (`spec.directions_for`)."""
    directions = directions_for(training, spec)
    backward = "backward" in directions
    with np.errstate(all="ignore"):  # inf/NaN from a wrong candidate become inf errors, not warnings
        theirs = reference(spec, ir, backward, chosen.indices(), data, scalars)
        errors = {"o": relative_error(data["o"], theirs["o"])}
        attends = theirs["attends"]  # (B', N', T')
        empty = ~attends[..., None]
        largest = [np.max(np.where(empty, np.abs(np.asarray(data["o"], np.float32)), 0.0))]
        if "forward" in directions:
            errors["lse"] = relative_error(np.where(attends, np.asarray(data["lse"], np.float32), 0.0),
                                           np.where(attends, theirs["lse"], 0.0))
        if backward:
            for name in ("dq", "dk", "dv"):
                errors[name] = relative_error(data[name], theirs[name])
            largest.append(np.max(np.where(empty, np.abs(np.asarray(data["dq"], np.float32)), 0.0)))
            if data["dbias"] is not None:
                errors["dbias"] = relative_error(np.broadcast_to(data["dbias"], theirs["dbias"].shape),
                                                 theirs["dbias"])
        value = float(np.max(largest))  # NaN stays NaN
    errors["empty_rows"] = value if math.isfinite(value) else math.inf
    return errors
