"""What the numerical check costs next to the cold build it follows (target: <= 20%).

    python bench/numerics.py [--out DIR] [--repeat N]      on a GPU
    python bench/numerics.py --quick                       on a CPU, with a stand-in for the graphs

Per config (bf16, causal + softcap(30), training: forward and backward graphs), in a fresh
process each: the cold build of both graphs (memory-only cache), then the check
(`numerics.check.check_numerics`) N times, both ways side by side:
- direct (what runs on a GPU): random inputs made on the host, the graphs run by the executor
  outside XLA (`numerics.direct`), the NumPy float64 reference on a slice;
- compiled (before): random inputs and the cuDNN path forward + vjp in one XLA program compiled
  per config, the same reference.
Its time split into trace, XLA compile, run and reference; the GPU memory it took (direct: what
its arena allocated; compiled: peak bytes in use above what was in use before) and the process's
peak host memory (max RSS). A second process measures one jitted forward+backward training step
of `sdpagraph.attention` on the same shapes, for scale.

--quick: no GPU needed: the XLA backend stands in for the cuDNN path (as in tests/test_numerics.py),
nothing is built (no build column), smaller shapes, no training-step process.

Prints a table with check / build side by side and writes numerics.json (and numerics.md) to --out.
"""
from __future__ import annotations

import argparse
import json
import os

from child import run_child  # bench/ is on sys.path when a script here runs

CONFIGS = {"small": (2, 256, 8, 64), "medium": (4, 1024, 16, 128), "large": (4, 4096, 16, 128)}  # B, T, N(=K), H
TARGET = 0.2  # the check must stay under 20% of the build it follows
QUICK_CONFIGS = {"small": (2, 256, 8, 64), "large": (2, 1024, 8, 64)}  # on a CPU: the stand-in runs whole shapes

CHILD = r"""
import json, resource, sys, time
import jax, jax.numpy as jnp, numpy as np
import sdpagraph
from sdpagraph import mods
from sdpagraph.cache import GraphCache, set_default_cache
from sdpagraph.graph_store import cached_graph
from sdpagraph.call import prepare_call
from sdpagraph.backends.cudnn import backend as cudnn
from sdpagraph.numerics.check import check_numerics
from sdpagraph.backends.xla import xla_attention

mode, (b, t, n, h), repeat = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
if sys.argv[4] != "{}":  # --compile-options: try other XLA options for the check's program
    from sdpagraph.numerics import check as numerics
    numerics.COMPILE_OPTIONS["gpu"] = {**numerics.COMPILE_OPTIONS["gpu"], **json.loads(sys.argv[4])}
quick = mode == "quick"
compiled = mode == "compiled"
device = jax.devices("cpu" if quick else "gpu")[0]
jnp.ones(8).block_until_ready()  # the backend and the allocator are up before anything is timed
cache = GraphCache()  # memory only: every build is cold
set_default_cache(cache)
q = jax.ShapeDtypeStruct((b, t, n, h), jnp.bfloat16)
kwargs = dict(is_causal=True, score_mod=mods.softcap(30.0))
call = prepare_call(q, q, q, **kwargs)
row = {"config": f"B{b} T{t} N{n} H{h} bf16 causal softcap", "mode": mode}

def in_use():
    return (device.memory_stats() or {}).get("bytes_in_use", 0)  # None on a CPU

def peak():
    return (device.memory_stats() or {}).get("peak_bytes_in_use", 0)

def stand_in(spec, q, k, v, inputs, ir, training=True):  # --quick: the XLA backend plays the graphs
    return xla_attention(spec, q, k, v, inputs, ir)

if mode in ("check", "compiled", "quick"):
    builds = {}
    for direction in () if quick else ("forward", "backward"):
        started = time.perf_counter()
        cached_graph(call.spec, call.score_mod, direction, cache)
        builds[direction] = time.perf_counter() - started
    row["build_s"] = builds
    before = in_use()
    row["peak_before_bytes"] = peak()
    row["rss_before_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    checks = []
    for _ in range(repeat):
        candidate = stand_in if quick else cudnn.attention if compiled else None  # None: the direct run
        result = check_numerics(call.spec, call.score_mod, True, cache, candidate=candidate)
        checks.append({"seconds": result.seconds, **result.timings, "passed": result.passed,
                       "errors": result.errors, "slice": result.slice})
    row["checks"] = checks
    row["check_peak_bytes"] = max(peak() - before, max(c.get("device_mib", 0) for c in checks) * 2**20)
    row["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
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


def run_mode(mode: str, shape: tuple[int, ...], repeat: int, options: str = "{}") -> dict:
    return run_child(CHILD, [mode, json.dumps(shape), str(repeat), options], label=f"{mode} {shape}")


def table(rows: list[dict]) -> str:
    lines = ["| config | check | build fwd+bwd | check (1st) | trace / compile / run (of it executor) / reference | check (later) | "
             "check / build | check GPU memory | peak host RSS | train step memory | errors (1st) | reference on |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        build = sum(row["build_s"].values())
        first, later = row["checks"][0], row["checks"][1:] or row["checks"]
        later_s = sorted(c["seconds"] for c in later)[len(later) // 2]
        errors = ", ".join(f"{k} {v:.1e}" for k, v in first["errors"].items() if k != "empty_rows")
        parts = " / ".join(f"{first[name]:.2f}" if name in first else "-"
                           for name in ("trace_s", "compile_s", "run_s", "device_s", "reference_s"))
        ratio = f"{first['seconds'] / build:.0%} (later {later_s / build:.0%})" if build else "n/a (nothing built)"
        lines.append(
            f"| {row['config']} | {row['mode']} | {f'{build:.2f} s' if build else 'n/a'} | {first['seconds']:.2f} s | {parts} s | "
            f"{later_s:.2f} s | {ratio} | {row['check_peak_bytes'] / 2**20:.0f} MiB | "
            f"{row['peak_rss_bytes'] / 2**20:.0f} MiB | {row.get('step_peak_bytes', 0) / 2**20:.0f} MiB | {errors} | "
            f"{first['slice']} |")
    built = [row for row in rows if sum(row["build_s"].values())]
    if built:
        verdicts = [f"{row['name']} {row['mode']} {'met' if row['checks'][0]['seconds'] <= TARGET * sum(row['build_s'].values()) else 'NOT met'}"
                    for row in built]
        lines.append(f"\ntarget, first check <= {TARGET:.0%} of the cold build: " + ", ".join(verdicts))
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="write numerics.json and numerics.md here")
    parser.add_argument("--repeat", type=int, default=3, help="checks per config (the first pays one-time costs)")
    parser.add_argument("--only", choices=sorted(CONFIGS), default=None)
    parser.add_argument("--compile-options", default="{}",
                        help="JSON of XLA options added to numerics.COMPILE_OPTIONS['gpu'] for the check")
    parser.add_argument("--no-step", action="store_true", help="skip the training-step process")
    parser.add_argument("--direct-only", action="store_true", help="skip the compiled check (the 'before' rows)")
    parser.add_argument("--quick", action="store_true",
                        help="on a CPU: the XLA backend stands in for the graphs, nothing is built, smaller shapes")
    args = parser.parse_args()
    rows = []
    for name, shape in (QUICK_CONFIGS if args.quick else CONFIGS).items():
        if args.only and name != args.only:
            continue
        step = {} if args.no_step or args.quick else {
            k: v for k, v in run_mode("step", shape, 1).items() if k.startswith("step")}
        for mode in ["quick"] if args.quick else ["check"] + ([] if args.direct_only else ["compiled"]):
            row = run_mode(mode, shape, args.repeat, args.compile_options)
            row.update(step, compile_options=json.loads(args.compile_options), name=name)
            if mode == "check":
                row["mode"] = "direct"
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
