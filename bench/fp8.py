"""FP8 attention (`sdpagraph.fp8`) on cuDNN against the bfloat16 inference forward: speed, threshold, accuracy.

Side by side in one run: its speed, where FP8 starts to pay (`fp8.FP8_MIN_SCORES`, `fp8.FP8_MIN_KV_LEN`),
and its accuracy.
Needs a GPU.

    python bench/fp8.py [--out DIR] [--quick]

bf16 inputs, causal, one GPU; every array and every scale a jit argument. The bf16 time is
`sdpagraph.attention(q, k, v, is_causal=True, training=False)` (the inference forward graph, on the
backend `implementation=None` picks: the one `quantized_attention`'s bfloat16 branch runs).
1. Target: B1 T16384 N64/K8 H128: `fp8.attention` (e4m3, inputs quantized beforehand by their absolute
   maxima, scale_o = 1 / descale_v) against the bf16 forward, `bf16 ms / fp8 ms` (target >= 1.5); and
   `fp8.quantized_attention(implementation="cudnn")`, the quantization passes included, likewise.
2. Threshold sweep: B1 N16 H128 T 1024..8192, B1 N32/K8 T8192, B4 T4096 N16 and the target shape: the
   three times, B*T*N*S (scores), what `quantized_attention(implementation=None)` picks (FP8 from
   `fp8.FP8_MIN_SCORES` scores and `fp8.FP8_MIN_KV_LEN` keys on) and whether that pick is the faster of quantized FP8 and bf16
   (target: dispatch never picks the slower one), and the smallest scores value where FP8 wins.
3. Accuracy at B1 T4096 N16 H128 (reference: float32 attention, `implementation="xla"` at the highest
   matmul precision, on the dequantized inputs) and at the target shape (reference: the bf16 cuDNN
   forward of the dequantized inputs, in float32): relative L2 (Frobenius) error of the dequantized
   output `out8 / scale_o`, e4m3 (target <= 4e-2) and e5m2, with scale_o = 1 / descale_v and with the
   delayed scale_o = max / amax_o of a first call; |amax_o - max|ref|| / max|ref|; and
   `quantized_attention`'s output against the reference on the bf16 inputs themselves.
4. Training through FP8 (`quantized_attention(training=True, implementation="cudnn")`: cuDNN's FP8 forward
   and backward, gradients in e5m2) against bf16 `sdpagraph.attention`, B1 N16 H128 at T16384 and T8192
   without and with causal, and T4096: fwd+bwd and backward-alone times (the backward runs on the pullback of a
   jitted forward), what `training=True` with implementation=None picks (`fp8.fp8_training_pays`), and
   the target: the FP8 backward >= 1.15x bf16's where it is used.
5. `fp8.check_support` for the target shape, printed under the tables.
Writes fp8.md / fp8.json to --out.
"""
from __future__ import annotations

import argparse
import functools

import jax
import jax.numpy as jnp

import sdpagraph
from sdpagraph import fp8, fp8_values

from jax_timing import time_ms  # bench/ is on sys.path when a script here runs
import report
from report import markdown_table

E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2
TARGET = (1, 16384, 64, 8, 128)  # B, T (= S), N, K, H
SWEEP = [(1, 1024, 16, 16, 128), (1, 2048, 16, 16, 128), (1, 4096, 16, 16, 128), (1, 8192, 16, 16, 128),
         (1, 8192, 32, 8, 128), (4, 4096, 16, 16, 128)]  # the target shape follows, measured once in part 1
SMALL = (1, 4096, 16, 16, 128)  # accuracy against float32 attention
SPEEDUP_TARGET = 1.5
ERROR_TARGET = {"e4m3": 4e-2}
DTYPES = {"e4m3": E4M3, "e5m2": E5M2}


def name_of(shape):
    b, t, n, k, h = shape
    return f"B{b} T{t} N{n}" + (f"/K{k}" if k != n else "") + f" H{h}"


def scores_of(shape):
    """B * T * N * S, as `quantized_attention` counts it."""
    b, t, n, _, _ = shape
    return b * t * n * t


def arrays(shape, seed=0):
    """bf16 q, k, v, normal, made on the device."""
    b, t, n, k, h = shape
    keys = jax.random.split(jax.random.key(seed), 3)
    return [jax.random.normal(key, dims, jnp.bfloat16)
            for key, dims in zip(keys, ((b, t, n, h), (b, t, k, h), (b, t, k, h)))]


@jax.jit
def _amax(x):
    return jnp.max(jnp.abs(x.astype(jnp.float32)))


@functools.partial(jax.jit, static_argnames="dtype")
def quantize(x, dtype):
    """(x in `dtype` scaled by max / amax(x), its descale amax(x) / max), as `quantized_attention` does."""
    descale = fp8_values.amax_descale(x, dtype)
    return fp8_values.quantize(x, descale, dtype), descale


def bf16_forward():
    return jax.jit(lambda q, k, v: sdpagraph.attention(q, k, v, is_causal=True, training=False))


def fp8_forward(implementation="cudnn"):
    return jax.jit(lambda q, k, v, dq, dk, dv, so: fp8.attention(q, k, v, descale_q=dq, descale_k=dk, descale_v=dv,
                                                                 scale_o=so, is_causal=True,
                                                                 implementation=implementation))


def quantized_forward(implementation="cudnn", dtype=E4M3):
    return jax.jit(lambda q, k, v: fp8.quantized_attention(q, k, v, is_causal=True, fp8_dtype=dtype,
                                                           implementation=implementation))


def attempt(measure, *args, **kwargs):
    """measure(*args, **kwargs) or, where it raises (an FP8 graph cuDNN declines, an out-of-memory), the
    failure in words."""
    try:
        return measure(*args, **kwargs)
    except Exception as err:  # noqa: BLE001 (a failure is a result)
        return f"failed: {type(err).__name__}: {(str(err).splitlines() or [''])[0][:200]}"


def bf16_backend(q, k, v):
    answer = attempt(sdpagraph.check_support, q, k, v, is_causal=True, training=False)
    return answer if isinstance(answer, str) else answer.backend


def measure(shape, quick):
    """bf16 forward, pre-quantized fp8.attention and quantized_attention("cudnn") times at `shape`."""
    timing = dict(repeats=5, rounds=3) if quick else dict(repeats=20, rounds=5)
    q, k, v = arrays(shape)
    row = {"shape": name_of(shape), "scores": scores_of(shape), "keys": shape[1],
           "bf16 backend": bf16_backend(q, k, v)}
    row["bf16 ms"] = time_ms(bf16_forward(), q, k, v, **timing)
    (q8, dq), (k8, dk), (v8, dv) = (quantize(x, dtype=jnp.dtype(E4M3)) for x in (q, k, v))
    row["fp8 ms"] = attempt(time_ms, fp8_forward(), q8, k8, v8, dq, dk, dv, 1.0 / dv, **timing)
    del q8, k8, v8
    row["quantized ms"] = attempt(time_ms, quantized_forward(), q, k, v, **timing)
    for label in ("fp8", "quantized"):
        if isinstance(row[f"{label} ms"], float):
            row[f"bf16 / {label}"] = row["bf16 ms"] / row[f"{label} ms"]
    return row


TRAINING = [((1, 16384, 16, 16, 128), False), ((1, 16384, 16, 16, 128), True), ((1, 8192, 16, 16, 128), False),
            ((1, 8192, 16, 16, 128), True), ((1, 4096, 16, 16, 128), False)]
TRAINING_TARGET = 1.15  # the FP8 backward's speedup where it is used (B1 T16384 N16 H128, not causal)


def _steps(causal, fp8_path):
    """(fwd+bwd step, forward returning the pullback, backward from the pullback), jitted; the bf16 call
    (`sdpagraph.attention`) or quantized_attention(training=True, implementation="cudnn")."""
    if fp8_path:
        attend = lambda q, k, v: fp8.quantized_attention(q, k, v, is_causal=causal, training=True,  # noqa: E731
                                                         implementation="cudnn")
    else:
        attend = lambda q, k, v: sdpagraph.attention(q, k, v, is_causal=causal)  # noqa: E731
    step = jax.jit(lambda q, k, v, d_o: jax.vjp(attend, q, k, v)[1](d_o))
    forward = jax.jit(lambda q, k, v: jax.vjp(attend, q, k, v)[1])
    backward = jax.jit(lambda pullback, d_o: pullback(d_o))
    return step, forward, backward


def training_row(shape, causal, quick):
    """FP8 training (forward and backward) against bf16 at `shape`: fwd+bwd and backward-alone times."""
    timing = dict(repeats=5, rounds=3) if quick else dict(repeats=10, rounds=5)
    q, k, v = arrays(shape)
    d_o = jax.random.normal(jax.random.key(5), q.shape, jnp.bfloat16)
    row = {"shape": name_of(shape) + (" causal" if causal else ""),
           "None picks": "fp8" if fp8.fp8_training_pays(shape[1], shape[4]) else "bf16"}
    for label, fp8_path in (("bf16", False), ("fp8", True)):
        step, forward, backward = _steps(causal, fp8_path)
        row[f"{label} fwd+bwd ms"] = attempt(time_ms, step, q, k, v, d_o, **timing)
        pullback = attempt(forward, q, k, v)
        row[f"{label} bwd ms"] = (pullback if isinstance(pullback, str)
                                  else attempt(time_ms, backward, pullback, d_o, **timing))
        del pullback
    for part in ("fwd+bwd", "bwd"):
        bf16_ms, fp8_ms = row[f"bf16 {part} ms"], row[f"fp8 {part} ms"]
        if isinstance(bf16_ms, float) and isinstance(fp8_ms, float):
            row[f"bf16 / fp8 {part}"] = bf16_ms / fp8_ms
    ratio = row.get("bf16 / fp8 bwd")
    if isinstance(ratio, float):
        row["pick is the faster"] = "yes" if (row["None picks"] == "fp8") == (ratio > 1) else "no"
        if (shape, causal) == TRAINING[0]:
            row["target"] = f"bwd >= {TRAINING_TARGET}"
            row["met"] = "yes" if ratio >= TRAINING_TARGET else "no"
    return row


def target_rows(row):
    """Part 1: the target shape's two FP8 calls against bf16."""
    out = []
    for label, call in (("fp8", "fp8.attention (e4m3, pre-quantized inputs)"),
                        ("quantized", 'quantized_attention(implementation="cudnn") (quantization included)')):
        ratio = row.get(f"bf16 / {label}")
        out.append({"row": f"{row['shape']} causal: {call}", "bf16 backend": row["bf16 backend"],
                    "bf16 ms": row["bf16 ms"], "fp8 ms": row[f"{label} ms"], "bf16 ms / fp8 ms": ratio if ratio else "",
                    "target": f">= {SPEEDUP_TARGET}",
                    "met": ("yes" if ratio >= SPEEDUP_TARGET else "no") if ratio else "no (failed)"})
    return out


# Times within this share of each other are a tie: rows of ~0.1 ms moved by 30-60% between runs on one
# H100 (B1 T2048 N16 bf16: 0.077 ms in one run, 0.126 ms in the next).
TIE = 0.10


def sweep_row(row):
    """Part 2: a measured row with quantized_attention(None)'s pick and whether it was the faster."""
    picks_fp8 = row["scores"] >= fp8.FP8_MIN_SCORES and row["keys"] >= fp8.FP8_MIN_KV_LEN  # quantized_attention's rule
    power = row["scores"] & (row["scores"] - 1) == 0
    out = {"shape": row["shape"], "scores": row["scores"],
           "log2 scores": f"{row['scores'].bit_length() - 1}{'' if power else '+'}", **row}
    out["None picks"] = "fp8" if picks_fp8 else "bf16"
    if isinstance(row["quantized ms"], float):
        fp8_faster = row["quantized ms"] < row["bf16 ms"]
        tie = abs(row["quantized ms"] - row["bf16 ms"]) < TIE * min(row["quantized ms"], row["bf16 ms"])
        out["faster"] = "tie" if tie else "fp8" if fp8_faster else "bf16"
        out["pick is the faster"] = "yes (tie)" if tie else "yes" if picks_fp8 == fp8_faster else "no"
    else:
        out["faster"] = "bf16 (fp8 failed)"
        out["pick is the faster"] = "no" if picks_fp8 else "yes"
    return out


def threshold_lines(rows):
    """Where FP8 wins: the smallest winning scores value, the largest losing one, per FP8 call."""
    slower = [r["shape"] for r in rows if not r["pick is the faster"].startswith("yes")]
    verdict = "slower picks: " + ", ".join(slower) if slower else "dispatch never picked the slower one"
    lines = [f"fp8.FP8_MIN_SCORES = {fp8.FP8_MIN_SCORES} (2^{fp8.FP8_MIN_SCORES.bit_length() - 1}), "
             f"fp8.FP8_MIN_KV_LEN = {fp8.FP8_MIN_KV_LEN}: the pick of "
             f"quantized_attention(implementation=None) is the faster one in {len(rows) - len(slower)} of "
             f"{len(rows)} rows ({verdict})"]
    summary = {}
    for label, call in (("quantized", "quantized_attention (what the pick runs)"),
                        ("fp8", "fp8.attention, pre-quantized")):
        won = [isinstance(r[f"{label} ms"], float) and r[f"{label} ms"] < r["bf16 ms"] for r in rows]
        wins = sorted(r["scores"] for r, w in zip(rows, won) if w)
        losses = sorted(r["scores"] for r, w in zip(rows, won) if not w)
        smallest_win = wins[0] if wins else None
        largest_loss = losses[-1] if losses else None
        monotone = smallest_win is None or largest_loss is None or largest_loss < smallest_win
        summary[label] = {"smallest winning scores": smallest_win, "largest losing scores": largest_loss,
                          "one threshold separates them": monotone}
        text = f"{call}: FP8 faster from {smallest_win} scores" if wins else f"{call}: FP8 faster in no row"
        if largest_loss is not None:
            text += f"; bf16 as fast or faster up to {largest_loss}"
        if wins and monotone:
            text += f" (a threshold in ({largest_loss or 0}, {smallest_win}] separates them)"
        elif wins:
            text += " (not separated by one threshold: wins and losses interleave)"
        lines.append(text)
    return lines, summary


@jax.jit
def relative(got, want):
    got, want = got.astype(jnp.float32), want.astype(jnp.float32)
    return jnp.linalg.norm(got - want) / jnp.maximum(jnp.linalg.norm(want), 1e-30)


def reference(shape, q, k, v):
    """(name, float32 reference output) of real-valued q, k, v (float32)."""
    if shape == SMALL:
        with jax.default_matmul_precision("highest"):
            ref = jax.jit(lambda q, k, v: sdpagraph.attention(q, k, v, is_causal=True, training=False,
                                                              implementation="xla"))(q, k, v)
        return "float32 xla", ref
    ref = jax.jit(lambda q, k, v: sdpagraph.attention(q.astype(jnp.bfloat16), k.astype(jnp.bfloat16),
                                                      v.astype(jnp.bfloat16), is_causal=True, training=False,
                                                      implementation="cudnn").astype(jnp.float32))(q, k, v)
    return "bf16 cudnn, in float32", ref


def fp8_errors(row, quantized, ref, dtype):
    """fp8.attention's errors against `ref` with scale_o = 1 / descale_v, then with the delayed
    scale_o = max / amax_o of that first call; its amax_o against max |ref|."""
    (q8, dq), (k8, dk), (v8, dv) = quantized
    call = fp8_forward()
    ref_max = float(_amax(ref))
    out8, amax = call(q8, k8, v8, dq, dk, dv, 1.0 / dv)
    row["rel L2 (scale_o 1/descale_v)"] = float(relative(out8.astype(jnp.float32) * dv, ref))
    row["amax_o vs max|ref|"] = abs(float(amax) - ref_max) / ref_max
    delayed = float(jnp.finfo(dtype).max) / amax  # the next call's scale in delayed scaling
    out8, _ = call(q8, k8, v8, dq, dk, dv, delayed)
    row["rel L2 (scale_o max/amax_o)"] = float(relative(out8.astype(jnp.float32) / delayed, ref))


def accuracy_rows(shape):
    """Part 3 at `shape`: one row per FP8 dtype; at SMALL also the bf16 cuDNN forward's error against
    float32 (how far the target shape's reference is from float32), as a note."""
    q, k, v = arrays(shape, seed=1)
    rows, notes = [], []
    dequantized = jax.jit(lambda x, d: x.astype(jnp.float32) * d)
    for label, dtype in DTYPES.items():
        quantized = [quantize(x, dtype=jnp.dtype(dtype)) for x in (q, k, v)]
        answer = attempt(reference, shape, *(dequantized(x, d) for x, d in quantized))
        if isinstance(answer, str):
            rows.append({"shape": name_of(shape), "dtype": label, "reference": answer})
            continue
        name, ref = answer
        row = {"shape": name_of(shape), "dtype": label, "reference": name}
        failure = attempt(fp8_errors, row, quantized, ref, dtype)
        if failure:
            row["rel L2 (scale_o 1/descale_v)"] = failure
        del quantized, ref
        # quantized_attention, its input rounding included: against the reference on the bf16 inputs.
        name, ref = reference(shape, *(x.astype(jnp.float32) for x in (q, k, v)))  # ran above: it runs
        row["quantized_attention rel L2"] = attempt(lambda call, ref: float(relative(call(q, k, v), ref)),
                                                    quantized_forward("cudnn", dtype), ref)
        if label in ERROR_TARGET:
            row["target"] = f"<= {ERROR_TARGET[label]:g}"
            error = row["rel L2 (scale_o 1/descale_v)"]
            row["met"] = ("yes" if error <= ERROR_TARGET[label] else "no") if isinstance(error, float) else "no"
        rows.append(row)
        if shape == SMALL and label == "e4m3":
            bf16_error = attempt(lambda ref: float(relative(jax.jit(
                lambda q, k, v: sdpagraph.attention(q, k, v, is_causal=True, training=False,
                                                    implementation="cudnn"))(q, k, v), ref)), ref)
            shown = bf16_error if isinstance(bf16_error, str) else f"{bf16_error:.3g}"
            notes.append(f"reference check at {name_of(shape)}: the bf16 cuDNN forward against {name} attention on "
                         f"the same bf16 inputs has rel L2 {shown} (the target shape's reference is the bf16 cuDNN "
                         "forward)")
        del ref
    return rows, notes


def support_lines():
    """Part 4: check_support for the target shape, in each FP8 dtype."""
    b, t, n, k, h = TARGET
    lines, data = [], []
    for label, dtype in DTYPES.items():
        q8, k8, v8 = (jax.ShapeDtypeStruct(dims, dtype) for dims in ((b, t, n, h), (b, t, k, h), (b, t, k, h)))
        answer = attempt(fp8.check_support, q8, k8, v8, is_causal=True)
        if isinstance(answer, str):
            data.append({"dtype": label, "failed": answer})
            lines.append(f"fp8.check_support({name_of(TARGET)} causal, {label}): {answer}")
        else:
            data.append({"dtype": label, "supported": answer.supported, "backend": answer.backend,
                         "reason": answer.reason})
            lines.append(f"fp8.check_support({name_of(TARGET)} causal, {label}): supported={answer.supported}, "
                         f"backend={answer.backend}, reason: {answer.reason}")
    return lines, data


def environment():
    from sdpagraph.graphs import builder

    try:
        env = builder.build_environment()
        return f"cuDNN {env.cudnn_version}, frontend {env.frontend_version}"
    except Exception as err:  # noqa: BLE001 (no cuDNN here)
        return f"cuDNN none ({type(err).__name__})"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="directory for fp8.md / fp8.json")
    parser.add_argument("--quick", action="store_true", help="fewer timing repeats")
    args = parser.parse_args()
    device = jax.devices()[0]
    header = (f"device: {device.device_kind}; jax {jax.__version__}; sdpagraph {sdpagraph.__version__}; "
              f"{environment()}; bf16 inputs, causal, one GPU; fp8.FP8_MIN_SCORES {fp8.FP8_MIN_SCORES}, "
              f"FP8_MIN_KV_LEN {fp8.FP8_MIN_KV_LEN}; "
              f"{'quick' if args.quick else 'full'} run")
    print(header, flush=True)
    results = {"header": header, "target": [], "sweep": [], "threshold": [], "accuracy": [], "training": [],
               "support": [], "notes": []}
    parts = ("target", "sweep", "accuracy", "training")

    def text():
        tables = report.markdown_tables(results, parts)
        notes = results["threshold"] + results["notes"]
        return tables + ("\n\n" + "\n".join(f"- {line}" for line in notes) if notes else "")

    def save():
        report.save(args.out, "fp8", f"{header}\n\n{text()}", results)

    target = measure(TARGET, args.quick)
    results["target"] = target_rows(target)
    print(markdown_table(results["target"]), flush=True)
    save()
    measured = []
    for shape in SWEEP:
        measured.append(sweep_row(measure(shape, args.quick)))
        results["sweep"] = list(measured)
        print(markdown_table(measured[-1:]), flush=True)
        save()
    measured.append(sweep_row(target))
    results["sweep"] = sorted(measured, key=lambda r: r["scores"])
    results["threshold"], results["threshold summary"] = threshold_lines(results["sweep"])
    save()
    for shape in (SMALL, TARGET):
        rows, notes = accuracy_rows(shape)
        results["accuracy"] += rows
        results["notes"] += notes
        print(markdown_table(rows), flush=True)
        save()
    for shape, causal in TRAINING:
        results["training"].append(training_row(shape, causal, args.quick))
        print(markdown_table(results["training"][-1:]), flush=True)
        save()
    lines, results["support"] = support_lines()
    results["notes"] += lines
    save()
    print("\n" + text(), flush=True)


if __name__ == "__main__":
    main()
