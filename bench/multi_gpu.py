"""Data and head parallelism on two GPUs: a jitted causal fwd+bwd step (B8 T4096 N16 H128 bf16)
sharded over 2 GPUs, against the per-device shape on one GPU, for sdpagraph (with its SPMD
partitioning, and without it: the 'before' row) and jax's cuDNN attention, side by side in one run.

    python3 bench/multi_gpu.py --out DIR [--quick]

Prints a markdown table (step time, ratio to the per-device shape on one GPU, all-gathers in the
compiled HLO, output sharding) and writes multi_gpu.md and multi_gpu.json to DIR. Times: median
over rounds of the mean of back-to-back steps, synchronised with block_until_ready.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import sys
from datetime import date

import jax
import jax_timing  # bench/ is on sys.path when a script here runs
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import sdpagraph
from sdpagraph.jax_api import sharding

B, T, N, H = 8, 4096, 16, 128
GATHER = re.compile(r"\ball-gather(?:-start)?\(")
ALL_TO_ALL = re.compile(r"\ball-to-all(?:-start)?\(")


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
    previous = os.environ.get(sharding.ENV_PARTITION)
    os.environ[sharding.ENV_PARTITION] = "1" if partition else "0"
    try:
        compiled = step_fn(impl).lower(*args).compile()
    finally:
        if previous is None:
            del os.environ[sharding.ENV_PARTITION]
        else:
            os.environ[sharding.ENV_PARTITION] = previous
    text = compiled.as_text()
    grads = compiled(*args)
    out_spec = getattr(grads[0].sharding, "spec", None)
    return {"ms": time_ms(compiled, args, repeats, rounds), "all_gathers": len(GATHER.findall(text)),
            "all_to_alls": len(ALL_TO_ALL.findall(text)), "dq_sharding": str(out_spec) if out_spec is not None
            else type(grads[0].sharding).__name__}


def environment():
    from sdpagraph.graphs import builder

    env = builder.build_environment()
    devices = jax.devices()
    return {"date": date.today().isoformat(), "devices": f"{len(devices)} x {devices[0].device_kind}",
            "jax": jax.__version__, "cudnn": env.cudnn_version, "cudnn_frontend": env.frontend_version,
            "python": platform.python_version()}


def run(quick):
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
    return {"environment": environment(), "repeats": repeats, "rounds": rounds, "rows": rows, "summary": summary}


def markdown(results):
    env = results["environment"]
    lines = [f"# Multi-GPU: causal fwd+bwd, B{B} T{T} N{N} H{H} bf16 ({env['date']})", "",
             f"{env['devices']}; jax {env['jax']}, cuDNN {env['cudnn']}, frontend {env['cudnn_frontend']}. "
             f"Median of {results['rounds']} rounds of {results['repeats']} back-to-back jitted steps "
             "(jax.grad of sum(attention)), block_until_ready. Ratio: step time over the per-device shape on one "
             "GPU (the row above it of the same implementation). All-gathers / all-to-alls: instructions in the "
             "compiled HLO (async starts counted once).", "",
             "| row | shape | ms | ratio | all-gathers | all-to-alls | dq sharding |",
             "|---|---|---:|---:|---:|---:|---|"]
    for r in results["rows"]:
        ratio = f"{r['ratio']:.3f}" if "ratio" in r else ""
        lines.append(f"| {r['name']} | {r['shape']} | {r['ms']:.3f} | {ratio} | {r['all_gathers']} | "
                     f"{r['all_to_alls']} | {r['dq_sharding']} |")
    lines += [""] + [f"- {name}: {value:.3f}" for name, value in results["summary"].items()]
    return "\n".join(lines) + "\n"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="directory for multi_gpu.md and multi_gpu.json")
    parser.add_argument("--quick", action="store_true", help="fewer repeats (a smoke run)")
    args = parser.parse_args()
    gpus = [d for d in jax.devices() if d.platform == "gpu"]
    if len(gpus) < 2:
        sys.exit(f"bench/multi_gpu.py needs 2 GPUs; JAX sees {len(gpus)} ({jax.devices()})")
    results = run(args.quick)
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
