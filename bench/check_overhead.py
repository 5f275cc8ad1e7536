"""What the numerical check adds to a cold build, as a user meets it (issue 15: <= 20%).

    python bench/check_overhead.py [--repeat N] [--out DIR]      on a GPU

For each config (bf16, causal + softcap(30), training), fresh processes alternate between
SDPAGRAPH_VERIFY=off and =build, each with an empty cache directory of its own. Each process times
`sdpagraph.check_support(..., implementation="cudnn")` after JAX is up: the cold build of the
forward and backward graphs, plus, with `build`, their numerical check (including whatever the
check's first run in a process costs). The difference of the medians is the check's cost in the
cold path; the table gives it against the build alone (`off`). Each process then runs one jitted
training step (forward and backward) and waits for its result: the graphs' first run (their
deserialization on the device) happens in the check with `build` and in that step with `off`, so
the difference up to the step's result is what the check costs a user on the way to a first result.

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
import json, sys, time
import jax, jax.numpy as jnp, numpy as np
import sdpagraph
from sdpagraph import mods
b, t, n, h = json.loads(sys.argv[1])
jnp.ones(8).block_until_ready()  # the backend is up before anything is timed
kwargs = dict(is_causal=True, score_mod=mods.softcap(30.0), implementation="cudnn")
q = jax.ShapeDtypeStruct((b, t, n, h), jnp.bfloat16)
started = time.perf_counter()
answer = sdpagraph.check_support(q, q, q, **kwargs)
supported = time.perf_counter()
x = [jnp.asarray(np.random.default_rng(i).standard_normal((b, t, n, h)), jnp.bfloat16) for i in range(3)]
step = jax.jit(jax.value_and_grad(lambda q, k, v: jnp.sum(sdpagraph.attention(q, k, v, **kwargs).astype(jnp.float32)),
                                  argnums=(0, 1, 2)))
jax.block_until_ready(step(*x))  # traced, compiled and run: the graphs built above run for the first time
print("RESULT " + json.dumps({"seconds": supported - started, "first_step_s": time.perf_counter() - supported,
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
        times, totals = {"off": [], "build": []}, {"off": [], "build": []}
        for _ in range(args.repeat):
            for verify in times:  # alternating, so drift on the machine hits both alike
                result = run_process(shape, verify)
                times[verify].append(result["seconds"])
                totals[verify].append(result["seconds"] + result["first_step_s"])
                print(f"{name} verify={verify}: {times[verify][-1]:.3f} s, with the first step "
                      f"{totals[verify][-1]:.3f} s", flush=True)
        off, on = statistics.median(times["off"]), statistics.median(times["build"])
        first = statistics.median(totals["build"]) - statistics.median(totals["off"])
        rows.append({"name": name, "shape": shape, "off_s": times["off"], "build_s": times["build"],
                     "added_s": on - off, "added_fraction": (on - off) / off, "to_first_step_off_s": totals["off"],
                     "to_first_step_build_s": totals["build"], "added_to_first_step_s": first,
                     "added_to_first_step_fraction": first / off})
    lines = ["| config | cold build, check off (median) | cold build + check (median) | the check adds | of the build | "
             "to the first step's result, the check adds | of the build | runs (off / build) |",
             "|---|---|---|---|---|---|---|---|"]
    for row in rows:
        b, t, n, h = row["shape"]
        runs = " / ".join(", ".join(f"{x:.2f}" for x in row[key]) for key in ("off_s", "build_s"))
        lines.append(f"| B{b} T{t} N{n} H{h} bf16 causal softcap | {statistics.median(row['off_s']):.2f} s | "
                     f"{statistics.median(row['build_s']):.2f} s | {row['added_s']:.2f} s | {row['added_fraction']:.0%} | "
                     f"{row['added_to_first_step_s']:.2f} s | {row['added_to_first_step_fraction']:.0%} | {runs} |")
    verdicts = ", ".join(f"{row['name']} {'met' if row['added_fraction'] <= TARGET else 'NOT met'}" for row in rows)
    lines.append(f"\ntarget, the check adds <= {TARGET:.0%} to the cold build: {verdicts}")
    verdicts = ", ".join(f"{row['name']} {'met' if row['added_to_first_step_fraction'] <= TARGET else 'NOT met'}"
                         for row in rows)
    lines.append(f"to the first training step's result (the graphs' first run moves into the check): {verdicts}")
    text = "\n".join(lines)
    print(text)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "check_overhead.json"), "w") as handle:
            json.dump(rows, handle, indent=1)
        with open(os.path.join(args.out, "check_overhead.md"), "w") as handle:
            handle.write(text + "\n")


if __name__ == "__main__":
    main()
