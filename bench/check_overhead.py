"""What the numerical check adds to a cold build, as a user meets it (target: <= 20%).

    python bench/check_overhead.py [--repeat N] [--out DIR]      on a GPU

For each config (bf16, causal + softcap(30), training), fresh processes alternate between
SDPAGRAPH_VERIFY=off and =build, each with an empty cache directory of its own. Each process times
`sdpagraph.check_support(..., implementation="cudnn")` after JAX is up: the cold build of the
forward and backward graphs, plus, with `build`, their numerical check (including whatever the
check's first run in a process costs) and its record. It also reports the cache's own build time
(`build_seconds`), the check's time from its record, and the garbage collector's time.

The headline measure is within each process: check_support's time outside the graph builds, less
the median of the same with the check off, over that process's builds. Builds alone vary 0.6-1.4 s
between processes, so the difference of whole medians (also shown) needs many more processes to
settle. Each process then runs one jitted training step (forward and backward) and waits for its
result: the graphs' first run (their deserialization on the device) happens in the check with
`build` and in that step with `off`; the table shows the difference up to that result too.

Prints the table and writes check_overhead.json (and .md) to --out.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile

from child import run_child  # bench/ is on sys.path when a script here runs

CONFIGS = {"small": (2, 256, 8, 64), "medium": (4, 1024, 16, 128), "large": (4, 4096, 16, 128)}  # B, T, N(=K), H
TARGET = 0.2

CHILD = r"""
import gc, json, sys, time
import jax, jax.numpy as jnp, numpy as np
import sdpagraph
from sdpagraph import mods
from sdpagraph.cache import default_cache
from sdpagraph.numerics.gate import numerics_records
from sdpagraph.call import prepare_call
b, t, n, h = json.loads(sys.argv[1])
jnp.ones(8).block_until_ready()  # the backend is up before anything is timed
kwargs = dict(is_causal=True, score_mod=mods.softcap(30.0), implementation="cudnn")
q = jax.ShapeDtypeStruct((b, t, n, h), jnp.bfloat16)
collecting = [0.0, 0.0]  # the garbage collector's seconds while check_support ran
def on_gc(phase, info):
    if phase == "start":
        collecting[1] = time.perf_counter()
    else:
        collecting[0] += time.perf_counter() - collecting[1]
gc.callbacks.append(on_gc)
started = time.perf_counter()
answer = sdpagraph.check_support(q, q, q, **kwargs)
supported = time.perf_counter()
gc.callbacks.remove(on_gc)
call = prepare_call(q, q, q, is_causal=True, score_mod=mods.softcap(30.0))
records = [record for _, record in numerics_records(call.spec, call.score_mod, True, default_cache())]
x = [jnp.asarray(np.random.default_rng(i).standard_normal((b, t, n, h)), jnp.bfloat16) for i in range(3)]
step = jax.jit(jax.value_and_grad(lambda q, k, v: jnp.sum(sdpagraph.attention(q, k, v, **kwargs).astype(jnp.float32)),
                                  argnums=(0, 1, 2)))
jax.block_until_ready(step(*x))  # traced, compiled and run: the graphs built above run for the first time
print("RESULT " + json.dumps({"seconds": supported - started, "first_step_s": time.perf_counter() - supported,
                              "build_s": default_cache().stats()["build_seconds"], "gc_s": collecting[0],
                              "check_s": records[0]["seconds"] if records[0] else None,
                              "supported": answer.supported, "reason": answer.reason}))
"""


def run_process(shape: tuple[int, ...], verify: str) -> dict:
    with tempfile.TemporaryDirectory() as cache_dir:
        result = run_child(CHILD, [json.dumps(shape)], timeout=600, label=f"{shape} verify={verify}",
                           env={"SDPAGRAPH_VERIFY": verify, "SDPAGRAPH_CACHE_DIR": cache_dir,
                                "SDPAGRAPH_CACHE_MODE": "readwrite"})
    if not result["supported"]:
        raise RuntimeError(f"{shape} verify={verify}: cuDNN does not run it here: {result['reason']}")
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3, help="processes per config and mode")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    rows = []
    for name, shape in CONFIGS.items():
        runs = {"off": [], "build": []}
        for _ in range(args.repeat):
            for verify in runs:  # alternating, so drift on the machine hits both alike
                result = run_process(shape, verify)
                runs[verify].append(result)
                print(f"{name} verify={verify}: {result['seconds']:.3f} s (builds {result['build_s']:.3f} s, "
                      f"check {result['check_s'] or 0:.3f} s, gc {result['gc_s']:.3f} s), with the first step "
                      f"{result['seconds'] + result['first_step_s']:.3f} s", flush=True)
        rows.append(_row(name, shape, runs))
    text = _table(rows)
    print(text)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "check_overhead.json"), "w") as handle:
            json.dump(rows, handle, indent=1)
        with open(os.path.join(args.out, "check_overhead.md"), "w") as handle:
            handle.write(text + "\n")


def _row(name: str, shape: tuple[int, ...], runs: dict[str, list[dict]]) -> dict:
    """Two measures of what the check adds. Between processes: the difference of the medians of
    check_support's time (noisy: builds alone vary 0.6-1.4 s between processes). Within each process:
    check_support's time outside the graph builds (the cache's build_seconds), against the median of
    the same with the check off, over that process's own builds."""
    median = statistics.median
    seconds = {mode: [r["seconds"] for r in found] for mode, found in runs.items()}
    outside = {mode: [r["seconds"] - r["build_s"] for r in found] for mode, found in runs.items()}
    to_step = {mode: [r["seconds"] + r["first_step_s"] for r in found] for mode, found in runs.items()}
    builds = [r["build_s"] for found in runs.values() for r in found]
    baseline = median(outside["off"])
    paired = [(out - baseline) / r["build_s"] for out, r in zip(outside["build"], runs["build"])]
    off = median(seconds["off"])
    return {"name": name, "shape": shape, "runs": runs, "build_s": median(builds),
            "added_s": median(seconds["build"]) - off, "added_fraction": (median(seconds["build"]) - off) / off,
            "outside_builds_off_s": baseline, "outside_builds_build_s": median(outside["build"]),
            "paired_fractions": paired, "paired_fraction": median(paired),
            "check_fraction": median(r["check_s"] / r["build_s"] for r in runs["build"]),
            "added_to_first_step_fraction": (median(to_step["build"]) - median(to_step["off"])) / off}


def _table(rows: list[dict]) -> str:
    lines = ["| config | graph builds (median) | check_support outside the builds: off / build | the check adds, "
             "of the process's builds (median; each) | the check's own time / builds | between processes: "
             "check_support off / build, added | to the first step's result, added | GC: off / build |",
             "|---|---|---|---|---|---|---|---|"]
    for row in rows:
        b, t, n, h = row["shape"]
        runs, median = row["runs"], statistics.median
        each = ", ".join(f"{x:.0%}" for x in row["paired_fractions"])
        gc = " / ".join(f"{median(r['gc_s'] for r in runs[mode]):.3f} s" for mode in ("off", "build"))
        lines.append(
            f"| B{b} T{t} N{n} H{h} bf16 causal softcap | {row['build_s']:.2f} s | {row['outside_builds_off_s']:.3f} / "
            f"{row['outside_builds_build_s']:.3f} s | **{row['paired_fraction']:.0%}** ({each}) | "
            f"{row['check_fraction']:.0%} | {median(r['seconds'] for r in runs['off']):.2f} / "
            f"{median(r['seconds'] for r in runs['build']):.2f} s, {row['added_fraction']:.0%} | "
            f"{row['added_to_first_step_fraction']:.0%} | {gc} |")
    verdicts = ", ".join(f"{row['name']} {'met' if row['paired_fraction'] <= TARGET else 'NOT met'}" for row in rows)
    lines.append(f"\ntarget, the check adds <= {TARGET:.0%} to the cold build (within each process): {verdicts}")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
