"""What the numerical check (issue 15) costs next to the cold build it follows. Needs a GPU.

    python bench/numerics.py [--out DIR] [--repeat N]

Per config (bf16, causal + softcap(30), training: forward and backward graphs), in a fresh
process each: the cold build of both graphs (memory-only cache), then the check
(`jax_api.numerics.check_numerics`: random inputs, the cuDNN path forward + vjp, the XLA
reference in float32 on a slice when large, the comparison) N times, each a new program as at
runtime; its time split into trace, XLA compile and run; and the GPU memory it took (peak bytes
in use during the check, above what was in use before). A second process measures one jitted
forward+backward training step of `sdpagraph.attention` on the same shapes, for scale.

Prints a table with check / build and writes numerics.json (and numerics.md) to --out.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

CONFIGS = {"small": (2, 256, 8, 64), "large": (4, 4096, 16, 128)}  # B, T, N(=K), H

CHILD = r"""
import json, sys, time
import jax, jax.numpy as jnp, numpy as np
import sdpagraph
from sdpagraph import mods
from sdpagraph.cache import GraphCache, set_default_cache
from sdpagraph.cache.graphs import cached_graph
from sdpagraph.jax_api.call import prepare_call
from sdpagraph.jax_api.numerics import check_numerics

mode, (b, t, n, h), repeat = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
if sys.argv[4] != "{}":  # --compile-options: try other XLA options for the check's program
    from sdpagraph.jax_api import numerics
    numerics.COMPILE_OPTIONS["gpu"] = {**numerics.COMPILE_OPTIONS["gpu"], **json.loads(sys.argv[4])}
device = jax.devices("gpu")[0]
jnp.ones(8).block_until_ready()  # CUDA and the allocator are up before anything is timed
cache = GraphCache()  # memory only: every build is cold
set_default_cache(cache)
q = jax.ShapeDtypeStruct((b, t, n, h), jnp.bfloat16)
kwargs = dict(is_causal=True, score_mod=mods.softcap(30.0))
call = prepare_call(q, q, q, **kwargs)
row = {"config": f"B{b} T{t} N{n} H{h} bf16 causal softcap", "mode": mode}

def in_use():
    return device.memory_stats()["bytes_in_use"]

def peak():
    return device.memory_stats()["peak_bytes_in_use"]

if mode == "check":
    builds = {}
    for direction in ("forward", "backward"):
        started = time.perf_counter()
        cached_graph(call.spec, call.score_mod, direction, cache)
        builds[direction] = time.perf_counter() - started
    row["build_s"] = builds
    before = in_use()
    row["peak_before_bytes"] = peak()
    checks = []
    for _ in range(repeat):
        result = check_numerics(call.spec, call.score_mod, True, cache)
        checks.append({"seconds": result.seconds, **result.timings, "passed": result.passed,
                       "errors": result.errors, "slice": result.slice})
    row["checks"] = checks
    row["check_peak_bytes"] = peak() - before
else:  # one training step of the call itself, for scale
    rng = np.random.default_rng(0)
    x = [jnp.asarray(rng.standard_normal((b, t, n, h)), jnp.bfloat16) for _ in range(3)]
    step = jax.jit(jax.value_and_grad(lambda q, k, v: jnp.sum(sdpagraph.attention(
        q, k, v, implementation="cudnn", **kwargs).astype(jnp.float32)), argnums=(0, 1, 2)))
    import os
    os.environ["SDPAGRAPH_VERIFY"] = "off"  # the step alone
    before = in_use()
    jax.block_until_ready(step(*x))
    started = time.perf_counter()
    jax.block_until_ready(step(*x))
    row["step_s"] = time.perf_counter() - started
    row["step_peak_bytes"] = peak() - before
print("RESULT " + json.dumps(row))
"""


def run_child(mode: str, shape: tuple[int, ...], repeat: int, options: str = "{}") -> dict:
    env = {**os.environ, "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    done = subprocess.run([sys.executable, "-c", CHILD, mode, json.dumps(shape), str(repeat), options], env=env,
                          capture_output=True, text=True, timeout=900)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"{mode} {shape} failed (rc {done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def table(rows: list[dict]) -> str:
    lines = ["| config | build fwd+bwd | check (1st) | trace / compile / run | check (later) | check / build | "
             "check memory | train step memory | errors (1st) | reference on |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        build = sum(row["build_s"].values())
        first, later = row["checks"][0], row["checks"][1:] or row["checks"]
        later_s = sorted(c["seconds"] for c in later)[len(later) // 2]
        errors = ", ".join(f"{k} {v:.1e}" for k, v in first["errors"].items() if k != "empty_rows")
        lines.append(
            f"| {row['config']} | {build:.2f} s | {first['seconds']:.2f} s | {first['trace_s']:.2f} / "
            f"{first['compile_s']:.2f} / {first['run_s']:.2f} s | {later_s:.2f} s | {first['seconds'] / build:.0%} "
            f"(later {later_s / build:.0%}) | {row['check_peak_bytes'] / 2**20:.0f} MiB | "
            f"{row.get('step_peak_bytes', 0) / 2**20:.0f} MiB | {errors} | {first['slice']} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="write numerics.json and numerics.md here")
    parser.add_argument("--repeat", type=int, default=3, help="checks per config (the first pays one-time costs)")
    parser.add_argument("--only", choices=sorted(CONFIGS), default=None)
    parser.add_argument("--compile-options", default="{}",
                        help="JSON of XLA options added to numerics.COMPILE_OPTIONS['gpu'] for the check")
    parser.add_argument("--no-step", action="store_true", help="skip the training-step process")
    args = parser.parse_args()
    rows = []
    for name, shape in CONFIGS.items():
        if args.only and name != args.only:
            continue
        row = run_child("check", shape, args.repeat, args.compile_options)
        row["compile_options"] = json.loads(args.compile_options)
        if not args.no_step:
            row.update({k: v for k, v in run_child("step", shape, 1).items() if k.startswith("step")})
        row["name"] = name
        rows.append(row)
        print(json.dumps(row), flush=True)
    text = table(rows)
    print(text)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        suffix = "" if args.compile_options == "{}" else "-options"
        with open(os.path.join(args.out, f"numerics{suffix}.json"), "w") as out:
            json.dump(rows, out, indent=1)
        with open(os.path.join(args.out, f"numerics{suffix}.md"), "w") as out:
            out.write(text + "\n")


if __name__ == "__main__":
    main()
