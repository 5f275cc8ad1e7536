"""Data, head and context parallelism on two GPUs: a jitted causal fwd+bwd step (B8 T4096 N16 H128 bf16)
sharded over 2 GPUs, against the per-device shape on one GPU, for sdpagraph (with its SPMD
partitioning, and without it: the 'before' row) and jax's cuDNN attention, side by side in one run;
and context parallelism (`--part cp`): B1 T65536 N16 H128 causal fwd+bwd (and with a softcap
score_mod), ring with load balancing over 2 GPUs against 1 GPU, and ring against all-to-all at T 16k
and 64k, the table behind `context_parallel_strategy="auto"`.

    python3 bench/multi_gpu.py --out DIR [--quick] [--part dp|cp|all]
    python3 bench/multi_gpu.py --cpu --part cp     # the rows' code on 2 CPU devices, tiny shapes

Prints a markdown table (step time, ratio to the per-device shape on one GPU, all-gathers in the
compiled HLO, output sharding) and writes multi_gpu.md and multi_gpu.json to DIR. Times: median
over rounds of the mean of back-to-back steps, synchronised with block_until_ready.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import re
import sys
from datetime import date

if "--cpu" in sys.argv:  # before jax starts: two CPU devices stand in for the GPUs
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2"
    os.environ["JAX_PLATFORMS"] = "cpu"

import jax
import jax_timing  # bench/ is on sys.path when a script here runs
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import sdpagraph
from sdpagraph.config import PARTITION

B, T, N, H = 8, 4096, 16, 128
CP_T, CP_SHORT_T = 65536, 16384  # context parallelism: B1 N16 H128
GATHER = re.compile(r"\ball-gather(?:-start)?\(")
ALL_TO_ALL = re.compile(r"\ball-to-all(?:-start)?\(")
PERMUTE = re.compile(r"\bcollective-permute(?:-start)?\(")


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


def time_ms(fn, args, repeats, rounds):
    return jax_timing.time_ms(fn, *args, repeats=repeats, rounds=rounds)


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


def run_dp(quick):
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
        rows.append(result)
        print(f"  {name}: {result['ms']:.3f} ms, {result['all_gathers']} all-gathers", file=sys.stderr, flush=True)
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
    return rows, summary


def cp_step(score_mod, strategy, load_balanced, impl):
    """jit(grad) of sum(attention) under context parallelism over the mesh axis "cp" (strategy
    None: one device, no context parallelism)."""
    def attn(q, k, v):
        kw = {} if strategy is None else dict(context_parallel_axis="cp", load_balanced=load_balanced,
                                              context_parallel_strategy=strategy)
        return sdpagraph.attention(q, k, v, is_causal=True, score_mod=score_mod, implementation=impl, **kw)

    return jax.jit(jax.grad(lambda q, k, v: jnp.sum(attn(q, k, v).astype(jnp.float32)), argnums=(0, 1, 2)))


def measure_cp(length, heads, head_dim, score_mod, strategy, load_balanced, impl, repeats, rounds):
    """(ms per step, collective-permutes, all-gathers, all-to-alls) of one context-parallel row; the
    inputs are random, so their (load-balanced or not) order does not matter for timing."""
    devices = jax.devices()
    if strategy is None:
        placement = jax.sharding.SingleDeviceSharding(devices[0])
    else:
        placement = NamedSharding(Mesh(np.array(devices[:2]), ("cp",)), P(None, "cp"))
    rng = np.random.default_rng(0)
    args = [jax.device_put(jnp.asarray(rng.standard_normal((1, length, heads, head_dim)), jnp.bfloat16), placement)
            for _ in range(3)]
    with jax.set_mesh(placement.mesh) if strategy is not None else contextlib.nullcontext():
        compiled = cp_step(score_mod, strategy, load_balanced, impl).lower(*args).compile()
        text = compiled.as_text()
        ms = time_ms(compiled, args, repeats, rounds)
    return {"ms": ms, "permutes": len(PERMUTE.findall(text)), "all_gathers": len(GATHER.findall(text)),
            "all_to_alls": len(ALL_TO_ALL.findall(text))}


def run_cp(quick, cpu):
    """Context parallelism rows: 2 GPUs against 1, and ring against all-to-all."""
    from sdpagraph import mods

    repeats, rounds = (3, 2) if quick or cpu else (10, 5)
    long_t, short_t, heads, head_dim = (CP_T, CP_SHORT_T, N, H) if not cpu else (256, 64, 4, 16)
    impl = "xla" if cpu else "cudnn"
    rows = []

    def row(name, length, score_mod, strategy, load_balanced, reference=None):
        result = measure_cp(length, heads, head_dim, score_mod, strategy, load_balanced, impl, repeats, rounds)
        result.update(name=name, shape=f"B1 T{length} N{heads} H{head_dim}", strategy=strategy or "1 GPU")
        if reference is not None:
            result["speedup"] = reference["ms"] / result["ms"]
        rows.append(result)
        print(f"  {name}: {result['ms']:.3f} ms, {result['permutes']} collective-permutes", file=sys.stderr,
              flush=True)
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
    return rows, summary


def run(quick, part, cpu):
    rows, summary = [], {}
    if part in ("dp", "all"):
        dp_rows, dp_summary = run_dp(quick)
        rows += dp_rows
        summary.update(dp_summary)
    if part in ("cp", "all"):
        cp_rows, cp_summary = run_cp(quick, cpu)
        rows += cp_rows
        summary.update(cp_summary)
    return {"environment": environment(), "rows": rows, "summary": summary, "quick": quick, "cpu": cpu}


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
    count = lambda key: lambda r: str(r[key])  # noqa: E731
    lines += _table(
        [r for r in results["rows"] if "impl" in r],
        "Data and head parallelism, B8 T4096 N16 H128. Ratio: step time over the per-device shape on one GPU "
        "(the row above it of the same implementation).",
        [("ms", number("ms")), ("ratio", number("ratio")), ("all-gathers", count("all_gathers")),
         ("all-to-alls", count("all_to_alls")), ("dq sharding", count("dq_sharding"))])
    lines += _table(
        [r for r in results["rows"] if "permutes" in r],
        "Context parallelism. Speedup: the reference row's time over this row's (1 GPU for the ring rows, the "
        "ring at the same T for the all-to-all rows).",
        [("ms", number("ms")), ("speedup", number("speedup")), ("collective-permutes", count("permutes")),
         ("all-gathers", count("all_gathers")), ("all-to-alls", count("all_to_alls"))])
    lines += [""] + [f"- {name}: {value:.3f}" for name, value in results["summary"].items()]
    return "\n".join(lines) + "\n"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="directory for multi_gpu.md and multi_gpu.json")
    parser.add_argument("--quick", action="store_true", help="fewer repeats (a smoke run)")
    parser.add_argument("--part", choices=("dp", "cp", "all"), default="all",
                        help="data/head parallelism rows, context parallelism rows, or both")
    parser.add_argument("--cpu", action="store_true", help="the context-parallel rows on 2 CPU devices, tiny "
                        "shapes, XLA backend: checks the bench's code (needs --part cp)")
    args = parser.parse_args()
    if args.cpu and args.part != "cp":
        sys.exit("--cpu runs the context-parallel rows only: pass --part cp")
    gpus = [d for d in jax.devices() if d.platform == "gpu"]
    if len(gpus) < 2 and not args.cpu:
        sys.exit(f"bench/multi_gpu.py needs 2 GPUs; JAX sees {len(gpus)} ({jax.devices()})")
    results = run(args.quick, args.part, args.cpu)
    table = markdown(results)
    print(table)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "multi_gpu.md"), "w") as f:
            f.write(table)
        with open(os.path.join(args.out, "multi_gpu.json"), "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
