"""The numerical check of a config's cuDNN graphs against the XLA backend.

    check_numerics(spec, ir, training, cache=None) -> NumericsResult

Fused-attention stacks ship silent wrong results; sdpagraph uses a graph only once it has
computed the right answer on this GPU. The check draws fresh random inputs of the spec's
shapes (q, k, v in the spec's dtype, a bias and a boolean mask of the spec's shapes with one
query row masked out, random valid lengths for padding, random packed segments, the call's
score_mod scalars (random positive ones where it has none) and random arrays of the IR's
shapes), runs the runtime's own cuDNN path (`jax_api.cudnn.attention`: forward and, when
training, the gradients of q, k, v and the bias through `jax.vjp` with a random cotangent), and
compares with `jax_api.xla.xla_attention` run in float32 (highest matmul precision) on the same
inputs, upcast.

Errors are relative Frobenius errors per output (`o`, `lse`, `dq`, `dk`, `dv`, `dbias`) against
tolerances per dtype (`TOLERANCES`, the bounds the GPU tests hold the backends to), plus
`empty_rows`: the largest |value| cuDNN gives in rows that attend to no key (must be 0).

Large shapes are checked on a slice: the cuDNN graph runs on the whole shape (it is built for
it), the XLA reference on batch rows {0, B-1} and two query heads of the last key/value head's
group. The cotangent is zero outside that slice, so dk, dv and a broadcast dbias of the whole
run hold the slice's contributions only and compare exactly. A score_mod that reads the batch
or head index (`gen_index` on axis 0 or 1) keeps that axis whole.

The check runs in a worker thread, so it executes eagerly even when asked from inside a `jit`
trace (the support query runs at trace time), and inside `cache.graphs.using_cache(cache)`, so
it runs the graphs of the cache being checked.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import math
import os
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from sdpagraph.cache.graph_cache import GraphCache
from sdpagraph.cache.graphs import using_cache
from sdpagraph.graphs.ir import INT, ScoreModIR
from sdpagraph.jax_api.call import RuntimeInputs
from sdpagraph.jax_api.xla import xla_attention
from sdpagraph.spec import AttentionSpec

# Relative Frobenius error bounds, bf16/fp16 inputs with fp32 accumulation against an fp32
# reference: tests/gpu/test_builder_gpu.py's FORWARD_TOLERANCE / BACKWARD_TOLERANCE. Measured
# errors of correct graphs are 2e-3 to 5e-3 (docs/results/); wrong graphs (a wrong scale, mask
# or gradient) give 1e-1 and more.
FORWARD_TOLERANCE = 1e-2
BACKWARD_TOLERANCE = 2e-2
TOLERANCES = {dtype: {"forward": FORWARD_TOLERANCE, "backward": BACKWARD_TOLERANCE}
              for dtype in ("bfloat16", "float16", "float32")}
FORWARD_OUTPUTS = ("o", "lse")
BACKWARD_OUTPUTS = ("dq", "dk", "dv", "dbias")
# Above this many score elements (B * N * T * S) the reference runs on a slice.
SLICE_ELEMENTS = 1 << 24
SCALAR_RANGE = (1.0, 50.0)  # score_mod scalars: positive (softcap divides by its cap)
MASK_KEEP = 0.7
MAX_RANDOM_SEGMENTS = 8

Candidate = Callable[..., tuple[Any, Any]]  # (spec, q, k, v, inputs, ir, training=...) -> (out, lse or None)


@dataclass(frozen=True)
class NumericsResult:
    """One check: `passed`, the relative errors per output, their bounds, and how it ran."""

    passed: bool
    errors: dict[str, float]
    tolerances: dict[str, float]
    seconds: float
    seed: int
    slice: str  # "whole" or which batch rows and heads the reference ran on
    training: bool
    timings: dict[str, float] = field(default_factory=dict)  # trace_s, compile_s, run_s of the check
    checked: float = field(default_factory=time.time)

    def failures(self) -> list[str]:
        return [name for name, error in self.errors.items()
                if not math.isfinite(error) or error > self.tolerances.get(name, math.inf)]

    def summary(self) -> str:
        """'passed: o 3.1e-03, dq 4.0e-03, ...' or 'FAILED: o 3.1e-01 > 1e-02, ...'."""
        parts = []
        for name, error in self.errors.items():
            bound = self.tolerances.get(name)
            over = name in self.failures()
            parts.append(f"{name} {_format(error)}" + (f" > {bound:g}" if over and bound is not None else ""))
        return ("passed" if self.passed else "FAILED") + ": " + ", ".join(parts)

    def to_record(self) -> dict[str, Any]:
        """The entry metadata record (`cache.graphs.NUMERICS_FIELD`): msgpack-able plain data."""
        return {
            "passed": self.passed,
            "errors": {name: float(error) for name, error in self.errors.items()},
            "tolerances": dict(self.tolerances),
            "checked": self.checked,
            "seed": self.seed,
            "seconds": self.seconds,
            "slice": self.slice,
            "training": self.training,
            "timings": dict(self.timings),
        }


def _format(error: float) -> str:
    return f"{error:.1e}" if math.isfinite(error) else str(error)


def tolerances_for(spec: AttentionSpec, training: bool, has_bias: bool) -> dict[str, float]:
    bounds = TOLERANCES.get(spec.dtype, TOLERANCES["bfloat16"])
    names = {"o": bounds["forward"], "empty_rows": 0.0}
    if training:
        names["lse"] = bounds["forward"]
        names.update(dq=bounds["backward"], dk=bounds["backward"], dv=bounds["backward"])
        if has_bias:
            names["dbias"] = bounds["backward"]
    return names


# ----------------------------------------------------------------------------- the check

def check_numerics(spec: AttentionSpec, ir: ScoreModIR | None, training: bool, cache: GraphCache | None = None,
                   *, seed: int | None = None, slice_elements: int = SLICE_ELEMENTS,
                   candidate: Candidate | None = None, scalars: Mapping[str, Any] | None = None) -> NumericsResult:
    """Run the cuDNN path of (spec, ir) once on random inputs and compare with the XLA backend
    in float32 (`training`: forward and backward graphs, else the inference graph).

    `cache`: the graph cache whose graphs run (default: the runtime's). `candidate` replaces the
    cuDNN path (tests). `scalars`: values of the IR's scalars to check with (the call's: a jax.numpy
    mod's constants are scalars, and `exp(s * 0.1)` must not be checked as `exp(s * 40)`); the
    others are drawn at random. Raises whatever the runs raise (the caller decides what that means)."""
    seed = int.from_bytes(os.urandom(4), "little") if seed is None else int(seed)
    started = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="sdpagraph-numerics") as pool:
        errors, where, timings = pool.submit(_check_in_thread, spec, ir, training, cache, seed, slice_elements,
                                             candidate, scalars or {}).result()
    tolerances = tolerances_for(spec, training, spec.bias_shape is not None)
    errors = {name: errors[name] for name in tolerances if name in errors}
    passed = all(math.isfinite(error) and error <= tolerances[name] for name, error in errors.items())
    return NumericsResult(passed, errors, {name: tolerances[name] for name in errors},
                          time.perf_counter() - started, seed, where, training, timings=timings)


def _check_in_thread(spec, ir, training, cache, seed, slice_elements, candidate, scalars):
    # A fresh thread has no JAX trace in progress (the support query may run inside a user's jit
    # trace) and default config: float32 matmuls at full precision for the reference.
    if candidate is None:
        from sdpagraph.jax_api import cudnn  # the runtime's cuDNN path (imports this module lazily)
        candidate = cudnn.attention
    with using_cache(cache), jax.default_matmul_precision("highest"):
        started = time.perf_counter()
        chosen = plan_slice(spec, ir, slice_elements)
        host = host_inputs(spec, ir, seed, scalars)
        key = jax.random.key(seed, impl="rbg")  # compiles in a fraction of threefry's time
        lowered = jax.jit(_comparison(spec, ir, training, chosen, host["scalars"], candidate)).lower(
            key, host["arrays"])
        traced = time.perf_counter()
        compiled = _compile(lowered)
        built = time.perf_counter()
        errors = jax.device_get(compiled(key, host["arrays"]))
        ran = time.perf_counter()
    timings = {"trace_s": traced - started, "compile_s": built - traced, "run_s": ran - built}
    return {name: _finite_or_inf(value) for name, value in errors.items()}, chosen.describe(spec), timings


# The check's program runs once: compile it fast. On an H100, XLA's default GEMM autotuning made
# it 12-21 s, without autotuning 1.8-2.4 s, with cuBLAS instead of Triton GEMMs 1.1-1.3 s
# (docs/results/numerics-h100-2026-11-23.md).
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


def _finite_or_inf(value: Any) -> float:
    value = float(value)
    return value if math.isfinite(value) else math.inf


# ----------------------------------------------------------------------------- slices

@dataclass(frozen=True)
class Slice:
    """Which batch rows, query heads and key/value heads the reference computes."""

    rows: tuple[int, ...]
    heads: tuple[int, ...]
    kv_heads: tuple[int, ...]

    def whole(self, spec: AttentionSpec) -> bool:
        return (len(self.rows), len(self.heads), len(self.kv_heads)) == (spec.batch, spec.num_heads,
                                                                          spec.num_kv_heads)

    def describe(self, spec: AttentionSpec) -> str:
        if self.whole(spec):
            return "whole"
        return f"batch rows {list(self.rows)}, heads {list(self.heads)}, kv heads {list(self.kv_heads)}"


def plan_slice(spec: AttentionSpec, ir: ScoreModIR | None, slice_elements: int = SLICE_ELEMENTS) -> Slice:
    b, n, k = spec.batch, spec.num_heads, spec.num_kv_heads
    everything = Slice(tuple(range(b)), tuple(range(n)), tuple(range(k)))
    if b * n * spec.q_len * spec.kv_len <= slice_elements:
        return everything
    read = {node.attr("axis") for node in ir.nodes if node.op == "gen_index"} if ir is not None else set()
    rows = everything.rows if 0 in read else tuple(sorted({0, b - 1}))
    if 1 in read:
        return Slice(rows, everything.heads, everything.kv_heads)
    group = n // k
    last = k - 1
    return Slice(rows, tuple(sorted({last * group, last * group + group - 1})), (last,))


def _take(x: Any, axis: int, index: tuple[int, ...], full: int) -> Any:
    """x sliced along `axis` when that axis is full-size (size-1 broadcast axes are kept)."""
    if x is None or x.shape[axis] != full or len(index) == full:
        return x
    return jnp.take(x, jnp.asarray(index, jnp.int32), axis=axis)


def _slice_bnts(x: Any, spec: AttentionSpec, chosen: Slice) -> Any:
    """A (B|1, N|1, T|1, S|1) array (bias, mask, mod arrays) on the slice."""
    x = _take(x, 0, chosen.rows, spec.batch)
    return _take(x, 1, chosen.heads, spec.num_heads)


def _slice_bthd(x: Any, spec: AttentionSpec, chosen: Slice, heads: tuple[int, ...], full_heads: int) -> Any:
    return _take(_take(x, 0, chosen.rows, spec.batch), 2, heads, full_heads)


def reference_spec(spec: AttentionSpec, chosen: Slice) -> AttentionSpec:
    def sliced(shape):
        if shape is None:
            return None
        b, n, t, s = shape
        return (len(chosen.rows) if b == spec.batch else b, len(chosen.heads) if n == spec.num_heads else n, t, s)

    return dataclasses.replace(spec, batch=len(chosen.rows), num_heads=len(chosen.heads),
                               num_kv_heads=len(chosen.kv_heads), bias_shape=sliced(spec.bias_shape),
                               mask_shape=sliced(spec.mask_shape), dtype="float32")


# ----------------------------------------------------------------------------- random inputs

def host_inputs(spec: AttentionSpec, ir: ScoreModIR | None, seed: int,
                given: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The small random inputs drawn on the host: valid lengths, segment ids, score_mod scalars
    (those not `given`)."""
    rng = np.random.default_rng(seed)
    b, t, s = spec.batch, spec.q_len, spec.kv_len
    arrays: dict[str, Any] = {}
    if spec.has_q_lengths:
        arrays["q_lengths"] = _lengths(rng, b, t)
    if spec.has_kv_lengths:
        arrays["kv_lengths"] = _lengths(rng, b, s)
    if spec.segments:
        count = max(1, min(spec.max_segments or t, MAX_RANDOM_SEGMENTS))
        arrays["q_segment_ids"] = random_segment_ids(rng, b, t, count)
        if spec.segments == "cross":
            arrays["kv_segment_ids"] = random_segment_ids(rng, b, s, count)
    scalars = {}
    if ir is not None:
        for _, node in ir.slots("scalar"):
            name = ir.scalar_names[node.attr("slot")]
            low, high = SCALAR_RANGE
            drawn = int(rng.integers(low, high + 1)) if node.dtype == INT else float(rng.uniform(low, high))
            scalars[name] = (given or {}).get(name, drawn)  # drawn anyway: a seed draws the same inputs
    return {"arrays": arrays, "scalars": scalars}


def _lengths(rng: np.random.Generator, batch: int, length: int) -> np.ndarray:
    lengths = rng.integers(1, length + 1, batch).astype(np.int32)
    lengths[0] = length  # one full row
    return lengths


def random_segment_ids(rng: np.random.Generator, batch: int, length: int, count: int) -> np.ndarray:
    """Per row: 1..count contiguous segments numbered 1, 2, ..., then some padding (0)."""
    ids = np.zeros((batch, length), np.int32)
    for row in range(batch):
        used = length - int(rng.integers(0, max(1, length // 8)))
        segments = int(rng.integers(1, min(count, used) + 1))
        cuts = sorted(rng.choice(np.arange(1, used), segments - 1, replace=False)) if segments > 1 else []
        bounds = [0, *(int(c) for c in cuts), used]
        for number in range(segments):
            ids[row, bounds[number]:bounds[number + 1]] = number + 1
    return ids


def _device_inputs(spec: AttentionSpec, ir: ScoreModIR | None, key: Any, host: Mapping[str, Any],
                   scalars: Mapping[str, Any]) -> tuple[Any, Any, Any, RuntimeInputs, Any]:
    """q, k, v, the runtime inputs and a cotangent for o, drawn on the device (inside the jit)."""
    dtype = jnp.dtype(spec.dtype)
    b, t, s, n, kh = spec.batch, spec.q_len, spec.kv_len, spec.num_heads, spec.num_kv_heads
    keys = iter(jax.random.split(key, 8 + (0 if ir is None else len(ir.array_names))))

    def normal(shape, kind=dtype):
        return jax.random.normal(next(keys), shape, jnp.float32).astype(kind)

    q, k, v = normal((b, t, n, spec.head_dim)), normal((b, s, kh, spec.head_dim)), normal((b, s, kh, spec.head_dim_v))
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
                           mod_arrays=arrays)
    return q, k, v, inputs, cotangent


# ----------------------------------------------------------------------------- comparison

def relative_error(actual: Any, expected: Any, where: Any = None) -> Any:
    """||actual - expected||_F / ||expected||_F in float32 (inf when not finite)."""
    actual, expected = actual.astype(jnp.float32), expected.astype(jnp.float32)
    if where is not None:
        where = jnp.broadcast_to(where, actual.shape)
        actual, expected = jnp.where(where, actual, 0.0), jnp.where(where, expected, 0.0)
    error = jnp.linalg.norm((actual - expected).reshape(-1)) / jnp.maximum(jnp.linalg.norm(expected.reshape(-1)),
                                                                         1e-30)
    return jnp.where(jnp.isfinite(error), error, jnp.inf)


def _run(fn: Callable, spec: AttentionSpec, q, k, v, inputs: RuntimeInputs, training: bool, cotangent) -> dict:
    """Outputs (and, when training, gradients of q, k, v and the bias) of one backend."""
    has_bias = inputs.bias is not None

    def forward(q, k, v, bias):
        out, lse = fn(dataclasses.replace(inputs, bias=bias) if has_bias else inputs, q, k, v)
        return out, lse

    if not training:
        out, lse = forward(q, k, v, inputs.bias)
        return {"o": out, "lse": lse}
    out, pullback, lse = jax.vjp(forward, q, k, v, inputs.bias, has_aux=True)
    dq, dk, dv, dbias = pullback(cotangent.astype(out.dtype))
    return {"o": out, "lse": lse, "dq": dq, "dk": dk, "dv": dv, "dbias": dbias if has_bias else None}


def _comparison(spec: AttentionSpec, ir: ScoreModIR | None, training: bool, chosen: Slice,
                scalars: Mapping[str, Any], candidate: Candidate) -> Callable:
    ref_spec = reference_spec(spec, chosen)
    sliced = not chosen.whole(spec)

    def compare(key, host):
        q, k, v, inputs, cotangent = _device_inputs(spec, ir, key, host, scalars)
        if sliced:  # only the slice's rows and heads send gradients back (see the module docstring)
            keep = jnp.zeros((spec.batch, 1, spec.num_heads, 1), cotangent.dtype)
            keep = keep.at[jnp.asarray(chosen.rows)[:, None], :, jnp.asarray(chosen.heads)[None, :]].set(1)
            cotangent = cotangent * keep
        ours = _run(lambda inp, q, k, v: candidate(spec, q, k, v, inp, ir, training=training),
                    spec, q, k, v, inputs, training, cotangent)

        def up(x):
            return None if x is None else x.astype(jnp.float32)

        def rows(x):
            return None if x is None else _take(x, 0, chosen.rows, spec.batch)

        ref_inputs = RuntimeInputs(
            bias=up(_slice_bnts(inputs.bias, spec, chosen)), mask=_slice_bnts(inputs.mask, spec, chosen),
            q_lengths=rows(inputs.q_lengths), kv_lengths=rows(inputs.kv_lengths),
            q_segment_ids=rows(inputs.q_segment_ids), kv_segment_ids=rows(inputs.kv_segment_ids),
            mod_scalars=inputs.mod_scalars,
            mod_arrays={name: _slice_bnts(x, spec, chosen) for name, x in (inputs.mod_arrays or {}).items()})
        on_q = lambda x: _slice_bthd(x, spec, chosen, chosen.heads, spec.num_heads)  # noqa: E731
        on_kv = lambda x: _slice_bthd(x, spec, chosen, chosen.kv_heads, spec.num_kv_heads)  # noqa: E731
        theirs = _run(lambda inp, q, k, v: xla_attention(ref_spec, q, k, v, inp, ir),
                      ref_spec, up(on_q(q)), up(on_kv(k)), up(on_kv(v)), ref_inputs, training,
                      up(on_q(cotangent)))
        errors = {"o": relative_error(on_q(ours["o"]), theirs["o"])}
        ref_lse = theirs["lse"]  # (B', N', T), -inf where a row attends to no key
        attends = jnp.isfinite(ref_lse)
        empty = jnp.swapaxes(~attends, 1, 2)[..., None]  # (B', T, N', 1)
        largest = jnp.max(jnp.where(empty, jnp.abs(on_q(ours["o"]).astype(jnp.float32)), 0.0))
        if training:
            ours_lse = _take(_take(ours["lse"], 0, chosen.rows, spec.batch), 1, chosen.heads, spec.num_heads)
            errors["lse"] = relative_error(jnp.where(attends, ours_lse, 0.0), jnp.where(attends, ref_lse, 0.0))
            errors["dq"] = relative_error(on_q(ours["dq"]), theirs["dq"])
            errors["dk"] = relative_error(on_kv(ours["dk"]), theirs["dk"])
            errors["dv"] = relative_error(on_kv(ours["dv"]), theirs["dv"])
            largest = jnp.maximum(largest, jnp.max(jnp.where(empty, jnp.abs(on_q(ours["dq"]).astype(jnp.float32)),
                                                             0.0)))
            if ours["dbias"] is not None:
                errors["dbias"] = relative_error(_slice_bnts(ours["dbias"], spec, chosen), theirs["dbias"])
        errors["empty_rows"] = jnp.where(jnp.isnan(largest), jnp.inf, largest)
        return errors

    return compare
