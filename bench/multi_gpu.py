"""Data, head and context parallelism on two GPUs: a jitted causal fwd+bwd step (B8 T4096 N16 H128 bf16)
sharded over 2 GPUs, against the per-device shape on one GPU, for sdpagraph (with its SPMD
partitioning, and without it: the 'before' row) and jax's cuDNN attention, side by side in one run;
and context parallelism (`--part cp`): B1 T65536 N16 H128 causal fwd+bwd (and with a softcap
score_mod), ring with load balancing over 2 GPUs against 1 GPU, and ring against all-to-all at T 16k
and 64k, the table behind `context_parallel_strategy="auto"`; and long context (`--part cp-long`,
LONG_CALLS): packed documents, sliding windows, softcap with documents, chunked attention and dense
causal at T 32k-128k, B1 N16 H128, on one GPU and on 2 GPUs with each strategy (ring, all_to_all,
halo, auto), with peak device memory per GPU for the packed T131072 rows (a child process per row).

    python3 bench/multi_gpu.py --out DIR [--quick] [--part dp|cp|all|cp-long] [--only TEXT ...]
    python3 bench/multi_gpu.py --cpu --part cp     # the rows' code on 2 CPU devices, tiny shapes
    python3 bench/multi_gpu.py --cpu --part cp-long --out DIR

Prints a markdown table (step time, ratio to the per-device shape on one GPU, all-gathers in the
compiled HLO, output sharding) and writes multi_gpu.md and multi_gpu.json to DIR, after every row
(a run cut short keeps its rows). Times: median over rounds of the mean of back-to-back steps,
synchronised with block_until_ready.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from datetime import date

# cp_rows first: with --cpu it sets up two CPU devices before jax starts
from cp_rows import (ALL_TO_ALL, BALANCE_LABELS, CHILD, CP_DEVICES, CPU_SCALE, GATHER, LONG_CALLS, ORDERS, N, H,
                     measure_cp, measure_long, time_ms)
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import sdpagraph
from sdpagraph.config import PARTITION

B, T = 8, 4096
CP_T, CP_SHORT_T = 65536, 16384  # context parallelism: B1 N16 H128


def step_fn(impl):
    """jit(grad) of sum(attention(q, k, v)): one causal forward and backward."""
    def attn(q, k, v):
        if impl == "jax-cudnn":
            return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")
        return sdpagraph.attention(q, k, v, is_causal=True, implementation="cudnn")

    return jax.jit(jax.grad(lambda q, k, v: jnp.sum(attn(q, k, v).astype(jnp.float32)), argnums=(0, 1, 2)))


def inputs(batch, heads, placement):
    rng = np.random.default_rng(0)
    host = [rng.standard_normal((batch, T, heads, H)).astype(np.float32) for _ in range(3)]
    return [jax.device_put(jnp.asarray(x, jnp.bfloat16), placement) for x in host]


def measure(impl, batch, heads, placement, repeats, rounds, partition=True):
    """(ms per step, all-gathers, all-to-alls, the output's sharding) of one row. The step is traced
    and compiled here, under SDPAGRAPH_PARTITION=0 for the 'before' row (read at trace time)."""
    args = inputs(batch, heads, placement)
    previous = os.environ.get(PARTITION.name)
    os.environ[PARTITION.name] = "1" if partition else "0"
    try:
        compiled = step_fn(impl).lower(*args).compile()
    finally:
        if previous is None:
            del os.environ[PARTITION.name]
        else:
            os.environ[PARTITION.name] = previous
    text = compiled.as_text()
    grads = compiled(*args)
    out_spec = getattr(grads[0].sharding, "spec", None)
    return {"ms": time_ms(compiled, args, repeats, rounds), "all_gathers": len(GATHER.findall(text)),
            "all_to_alls": len(ALL_TO_ALL.findall(text)), "dq_sharding": str(out_spec) if out_spec is not None
            else type(grads[0].sharding).__name__}


def environment():
    from sdpagraph.graphs import builder

    devices = jax.devices()
    try:
        env = builder.build_environment()
        cudnn, frontend = env.cudnn_version, env.frontend_version
    except Exception as err:  # --cpu: no cuDNN here
        cudnn = frontend = f"none ({type(err).__name__})"
    return {"date": date.today().isoformat(), "devices": f"{len(devices)} x {devices[0].device_kind}",
            "jax": jax.__version__, "cudnn": cudnn, "cudnn_frontend": frontend,
            "python": platform.python_version()}


def run_dp(quick, record):
    repeats, rounds = (10, 3) if quick else (30, 7)
    devices = jax.devices()
    one = devices[0]
    mesh = Mesh(np.array(devices[:2]), ("x",))
    on_one = jax.sharding.SingleDeviceSharding(one)
    batch_split, head_split = NamedSharding(mesh, P("x")), NamedSharding(mesh, P(None, None, "x"))
    rows = []

    def row(name, impl, batch, heads, placement, reference=None, **kw):
        result = measure(impl, batch, heads, placement, repeats, rounds, **kw)
        result.update(name=name, impl=impl, shape=f"B{batch} T{T} N{heads} H{H}")
        if reference is not None:
            result["ratio"] = result["ms"] / reference["ms"]
        rows.append(record(result))
        return result

    for impl, label in (("sdpagraph", "sdpagraph"), ("jax-cudnn", "jax cuDNN")):
        single = row(f"{label}, 1 GPU", impl, B // 2, N, on_one)
        row(f"{label}, batch-sharded over 2 GPUs", impl, B, N, batch_split, single)
        if impl == "sdpagraph":
            row(f"{label}, batch-sharded, SDPAGRAPH_PARTITION=0 (before)", impl, B, N, batch_split, single,
                partition=False)
        local_heads = row(f"{label}, 1 GPU (per-device shape of the head split)", impl, B, N // 2, on_one)
        row(f"{label}, head-sharded over 2 GPUs", impl, B, N, head_split, local_heads)
    by_name = {r["name"]: r for r in rows}
    summary = {
        "batch ratio sdpagraph (target <= 1.03)": by_name["sdpagraph, batch-sharded over 2 GPUs"]["ratio"],
        "batch ratio jax cuDNN": by_name["jax cuDNN, batch-sharded over 2 GPUs"]["ratio"],
        "batch ratio before": by_name["sdpagraph, batch-sharded, SDPAGRAPH_PARTITION=0 (before)"]["ratio"],
        "sdpagraph / jax cuDNN, batch-sharded": (by_name["sdpagraph, batch-sharded over 2 GPUs"]["ms"]
                                                 / by_name["jax cuDNN, batch-sharded over 2 GPUs"]["ms"]),
        "head ratio sdpagraph": by_name["sdpagraph, head-sharded over 2 GPUs"]["ratio"],
        "head ratio jax cuDNN": by_name["jax cuDNN, head-sharded over 2 GPUs"]["ratio"],
    }
    return summary



def run_cp(quick, cpu, record):
    """Context parallelism rows: 2 GPUs against 1, and ring against all-to-all."""
    from sdpagraph import mods

    repeats, rounds = (3, 2) if quick or cpu else (10, 5)
    long_t, short_t, heads, head_dim = (CP_T, CP_SHORT_T, N, H) if not cpu else (256, 64, 4, 16)
    impl = "xla" if cpu else "cudnn"
    rows = []

    def row(name, length, score_mod, strategy, load_balanced, reference=None):
        result = measure_cp(length, heads, head_dim, {"score_mod": score_mod}, strategy, load_balanced, impl,
                            repeats, rounds)
        result.update(name=name, shape=f"B1 T{length} N{heads} H{head_dim}", strategy=strategy or "1 GPU")
        if reference is not None:
            result["speedup"] = reference["ms"] / result["ms"]
        rows.append(record(result))
        return result

    for label, mod in (("causal", None), ("softcap+causal", mods.softcap(30.0))):
        one = row(f"{label}, 1 GPU", long_t, mod, None, False)
        row(f"{label}, ring, load-balanced, 2 GPUs", long_t, mod, "ring", True, one)
    for length in (short_t, long_t):
        ring = row(f"causal T{length}, ring, load-balanced, 2 GPUs", length, None, "ring", True)
        row(f"causal T{length}, all-to-all, load-balanced, 2 GPUs", length, None, "all_to_all", True, ring)
    by_name = {r["name"]: r for r in rows}
    summary = {
        "cp speedup causal (target >= 1.7)": by_name["causal, ring, load-balanced, 2 GPUs"]["speedup"],
        "cp speedup softcap+causal (target >= 1.7)": by_name["softcap+causal, ring, load-balanced, 2 GPUs"]["speedup"],
    }
    for length in (short_t, long_t):  # > 1: all-to-all is faster at this length
        summary[f"ring / all-to-all time, T{length}"] = by_name[f"causal T{length}, all-to-all, load-balanced, 2 GPUs"][
            "speedup"]
    return summary


def run_cp_long(quick, cpu, record, only, wanted=None):
    """LONG_CALLS: each on one GPU, and on 2 GPUs with each strategy (`wanted`: only the strategy rows
    named so, as in the table), speedup over one GPU. Rows that measure peak memory run in a child
    process each (bench/child.py): a peak covers one row only; the others report none."""
    from child import run_child

    summary = {}
    for index, (label, length, _, _, memory, strategies, target) in enumerate(LONG_CALLS):
        length = length // CPU_SCALE if cpu else length
        if only and not any(part in f"{label} T{length}" for part in only):
            continue
        one = None
        chosen = [(name, lb) for name, lb in strategies if wanted is None or f"{name}{BALANCE_LABELS[lb]}" in wanted]
        for strategy, load_balanced in ((None, False), *chosen):
            request = dict(index=index, strategy=strategy, load_balanced=load_balanced, quick=quick, cpu=cpu)
            # The one-GPU row runs in a process that sees one GPU, as a one-GPU user's does: some paths
            # (bins for documents with a score_mod) need a process with one device.
            one_gpu_process = strategy is None and not cpu
            if memory or one_gpu_process:
                bench_dir = os.path.dirname(os.path.abspath(__file__))
                env = {"CUDA_VISIBLE_DEVICES": "0"} if one_gpu_process else None
                result = run_child(CHILD, [bench_dir] + (["--cpu"] if cpu else []) + [json.dumps(request)],
                                   env=env, timeout=600, label=f"{label} T{length} {strategy}")
            else:  # this process's peak also covers the rows measured before: not this row's
                result = {k: x for k, x in measure_long(**request).items()
                          if k not in ("peak_bytes", "peak_step_bytes", "peak_stages")}
            name = f"{label} T{length}, " + ("1 GPU" if strategy is None else
                                             f"{strategy}{BALANCE_LABELS[load_balanced]}, "
                                             f"{CP_DEVICES} GPUs")
            heads, head_dim = (4, 16) if cpu else (N, H)
            result.update(name=name, shape=f"B1 T{length} N{heads} H{head_dim}", strategy=strategy or "1 GPU",
                          part="cp-long", load_balanced=load_balanced)
            if strategy is None:
                one = result
            elif "ms" in result:
                result["speedup"] = one["ms"] / result["ms"]
                if memory and one.get("peak_bytes") and result.get("peak_bytes"):  # peaks of a process each
                    result["memory_ratio"] = result["peak_bytes"] / one["peak_bytes"]
                    result["step_memory_ratio"] = result["peak_step_bytes"] / one["peak_step_bytes"]
            record(result)
            key = f"{label} T{length}"
            order = ORDERS[load_balanced]
            if strategy == "auto" and "speedup" in result:
                summary[f"{key}: auto speedup, {order} (target >= {target})"] = result["speedup"]
            if "memory_ratio" in result:
                summary[f"{key}: peak memory per GPU / 1 GPU, {strategy} (target <= 0.6)"] = result["memory_ratio"]
                summary[f"{key}: peak memory per GPU / 1 GPU after one step, {strategy}"] = result["step_memory_ratio"]
        best = [r for r in record.rows if r["name"].startswith(f"{label} T{length},") and "speedup" in r]
        if best:
            top = max(best, key=lambda r: r["speedup"])
            summary[f"{label} T{length}: best speedup ({top['strategy']}, target >= {target})"] = top["speedup"]
        for auto in (r for r in best if r["strategy"] == "auto"):  # against the best on the same inputs
            same = max(r["speedup"] for r in best if r["load_balanced"] == auto["load_balanced"])
            order = ORDERS[auto["load_balanced"]]
            summary[f"{label} T{length}: auto / best strategy, {order} (target >= 0.95)"] = auto["speedup"] / same
    return summary


class Recorder:
    """The rows measured so far; after every row the tables are written to `out` (a run cut short
    keeps what it measured)."""

    def __init__(self, out, quick, cpu):
        self.out, self.rows, self.summary = out, [], {}
        self.results = {"environment": environment(), "rows": self.rows, "summary": self.summary, "quick": quick,
                        "cpu": cpu}

    def __call__(self, result):
        self.rows.append(result)
        ms = f"{result['ms']:.3f} ms" if "ms" in result else f"skipped: {result.get('skipped')}"
        print(f"  {result['name']}: {ms}", file=sys.stderr, flush=True)
        self.save()
        return result

    def save(self):
        if not self.out:
            return
        os.makedirs(self.out, exist_ok=True)
        with open(os.path.join(self.out, "multi_gpu.md"), "w") as f:
            f.write(markdown(self.results))
        with open(os.path.join(self.out, "multi_gpu.json"), "w") as f:
            json.dump(self.results, f, indent=1)


def run(quick, part, cpu, out=None, only=None, strategies=None):
    record = Recorder(out, quick, cpu)
    if part in ("dp", "all"):
        record.summary.update(run_dp(quick, record))
    if part in ("cp", "all"):
        record.summary.update(run_cp(quick, cpu, record))
    if part == "cp-long":
        record.summary.update(run_cp_long(quick, cpu, record, only, strategies))
    record.save()
    return record.results


def _table(rows, caption, columns):
    """Markdown lines of one table (none without rows): row name, shape, then `columns` (header, cell)."""
    if not rows:
        return []
    lines = ["", caption, "", "| row | shape | " + " | ".join(h for h, _ in columns) + " |",
             "|---|---|" + "".join("---:|" for _ in columns)]
    return lines + [f"| {r['name']} | {r['shape']} | " + " | ".join(cell(r) for _, cell in columns) + " |"
                    for r in rows]


def markdown(results):
    env = results["environment"]
    lines = [f"# Multi-GPU: causal fwd+bwd bf16 ({env['date']})", "",
             f"{env['devices']}; jax {env['jax']}, cuDNN {env['cudnn']}, frontend {env['cudnn_frontend']}. "
             "Median of rounds of back-to-back jitted steps (jax.grad of sum(attention)), block_until_ready"
             + (" (quick)" if results["quick"] else "") + (" (CPU devices: checks the code, times mean nothing)"
                                                           if results["cpu"] else "") + ". Collectives: "
             "instructions in the compiled HLO (async starts counted once)."]
    number = lambda key: lambda r: f"{r[key]:.3f}" if key in r else ""  # noqa: E731
    count = lambda key: lambda r: str(r.get(key, ""))  # noqa: E731
    gib = lambda key: lambda r: f"{r[key] / 2**30:.2f}" if r.get(key) else ""  # noqa: E731
    lines += _table(
        [r for r in results["rows"] if "impl" in r],
        "Data and head parallelism, B8 T4096 N16 H128. Ratio: step time over the per-device shape on one GPU "
        "(the row above it of the same implementation).",
        [("ms", number("ms")), ("ratio", number("ratio")), ("all-gathers", count("all_gathers")),
         ("all-to-alls", count("all_to_alls")), ("dq sharding", count("dq_sharding"))])
    lines += _table(
        [r for r in results["rows"] if "permutes" in r and r.get("part") != "cp-long"],
        "Context parallelism. Speedup: the reference row's time over this row's (1 GPU for the ring rows, the "
        "ring at the same T for the all-to-all rows).",
        [("ms", number("ms")), ("speedup", number("speedup")), ("collective-permutes", count("permutes")),
         ("all-gathers", count("all_gathers")), ("all-to-alls", count("all_to_alls"))])
    lines += _table(
        [r for r in results["rows"] if r.get("part") == "cp-long"],
        "Long context (`--part cp-long`), jitted fwd+bwd with q, k, v and segment ids as arguments. Speedup: "
        "the 1 GPU row's time over this row's. Peak: device memory per GPU (each row in its own process), "
        "after the timed steps (back to back: a step's results are held while the next allocates) and after "
        "one step, and their ratios to one GPU's; XLA's account of the compiled step per device "
        "(`memory_analysis`): its arguments, outputs, temporaries and peak; each device's peak after the inputs "
        "are made, after the compile and after one step. Plan: `check_support`'s strategy and "
        "block backend.",
        [("ms", number("ms")), ("speedup", number("speedup")), ("peak GiB", gib("peak_bytes")),
         ("memory ratio", number("memory_ratio")), ("peak GiB, one step", gib("peak_step_bytes")),
         ("one-step ratio", number("step_memory_ratio")), ("XLA args GiB", gib("xla_argument_bytes")),
         ("XLA outputs GiB", gib("xla_output_bytes")), ("XLA temp GiB", gib("xla_temp_bytes")),
         ("XLA peak GiB", gib("xla_peak_bytes")),
         ("peak GiB per device after inputs (in use then); compile; one step; in use after it, results freed",
                                                   lambda r: r.get("peak_stages", "")),
         ("collective-permutes", count("permutes")),
         ("all-gathers", count("all_gathers")), ("all-to-alls", count("all_to_alls")),
         ("plan / skipped", lambda r: r.get("plan") or r.get("skipped", ""))])
    lines += [""] + [f"- {name}: {value:.3f}" for name, value in results["summary"].items()]
    return "\n".join(lines) + "\n"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="directory for multi_gpu.md and multi_gpu.json")
    parser.add_argument("--quick", action="store_true", help="fewer repeats (a smoke run)")
    parser.add_argument("--part", choices=("dp", "cp", "all", "cp-long"), default="all",
                        help="data/head parallelism rows, context parallelism rows, both (all), or the long-context "
                        "rows (packed documents, windows, chunks: LONG_CALLS)")
    parser.add_argument("--only", action="append", help="cp-long: only the calls whose 'label T<length>' holds "
                        "this (repeatable: any of them)")
    parser.add_argument("--strategy", action="append", help="cp-long: only these strategy rows (besides one GPU), "
                        "named as in the table: 'ring, load-balanced', 'ring, documents balanced', 'halo', ... "
                        "(repeatable)")
    parser.add_argument("--cpu", action="store_true", help="the context-parallel rows on 2 CPU devices, tiny "
                        "shapes, XLA backend: checks the bench's code (needs --part cp or cp-long)")
    args = parser.parse_args()
    if args.cpu and args.part not in ("cp", "cp-long"):
        sys.exit("--cpu runs the context-parallel rows only: pass --part cp or --part cp-long")
    gpus = [d for d in jax.devices() if d.platform == "gpu"]
    if len(gpus) < 2 and not args.cpu:
        sys.exit(f"bench/multi_gpu.py needs 2 GPUs; JAX sees {len(gpus)} ({jax.devices()})")
    print(markdown(run(args.quick, args.part, args.cpu, args.out, args.only, args.strategy)))


if __name__ == "__main__":
    main()
