"""Where a warm start's XLA compile goes: the first jitted fwd+bwd call in a fresh process, split
into trace+lower, XLA compile and first run, with the compiled program's contents and a profiler
trace of the compile's host work. Needs a GPU.

    python bench/probe_compile.py [--out DIR]

bf16 B4 T4096 N16 H128, `jax.value_and_grad` of `sum(attention(...).astype(float32))`, as
bench/coldstart.py. Programs, each in fresh processes with a warm graph cache (strict) and no JAX
compilation cache:
- `sdpagraph`: softcap(30)+causal through sdpagraph, with its graphs deserialized in the background
  while XLA compiles (`SDPAGRAPH_PREPARE`, the default) and without (by the first run);
- `jax`: jax.nn.dot_product_attention(implementation="cudnn"), causal;
- `reduce only`: the same loss over `q * k` in place of attention (a product, a float32 sum and
  their gradients): about what any first compile of a small step pays;
- `sdpagraph after a compile`: the sdpagraph step compiled after another program (the reduce), so
  one-time compiler set-up in the process is paid before it.
For each: the phase times (median of fresh processes), the compiled HLO's fusions and custom calls,
and (one more traced process) the host events of the compile that took longest.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

CHILD = r"""
import time
start_process = time.perf_counter()
import json, re, sys
import jax, jax.numpy as jnp, numpy as np
which, trace_dir = sys.argv[1], sys.argv[2]
from sdpagraph import attention, mods
rng = np.random.default_rng(0)
q, k, v = (jnp.asarray(rng.standard_normal((4, 4096, 16, 128)), jnp.bfloat16) for _ in range(3))
jax.block_until_ready((q, k, v))
if which == "jax":
    attn = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")
elif which == "reduce only":
    attn = lambda q, k, v: q * k
else:
    attn = lambda q, k, v: attention(q, k, v, is_causal=True, score_mod=mods.softcap(30.0), implementation="cudnn")
loss = lambda q, k, v: jnp.sum(attn(q, k, v).astype(jnp.float32))
step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
row = {"imports_s": time.perf_counter() - start_process}
if which == "sdpagraph after a compile":
    jax.jit(jax.value_and_grad(lambda q: jnp.sum(q.astype(jnp.float32))))(q)[0].block_until_ready()
if trace_dir:
    jax.profiler.start_trace(trace_dir)
start = time.perf_counter()
lowered = step.lower(q, k, v)
row["trace_lower_s"] = time.perf_counter() - start
compiled = lowered.compile()
row["compile_s"] = time.perf_counter() - start - row["trace_lower_s"]
jax.block_until_ready(compiled(q, k, v))
row["first_call_s"] = time.perf_counter() - start
row["run_s"] = row["first_call_s"] - row["trace_lower_s"] - row["compile_s"]
if trace_dir:
    jax.profiler.stop_trace()
text = compiled.as_text()
entry = text[text.find("ENTRY"):]
row["fusions"] = len(re.findall(r"= [^=]*\bfusion\(", entry))
row["custom_calls"] = len(re.findall(r"custom-call\(", entry))
row["hlo"] = text
print(json.dumps(row))
"""


# (label, program, SDPAGRAPH_PREPARE)
PROGRAMS = (("sdpagraph, prepare off", "sdpagraph", "0"), ("sdpagraph, prepared", "sdpagraph", "1"),
            ("jax", "jax", "0"), ("reduce only", "reduce only", "0"),
            ("sdpagraph after a compile, prepare off", "sdpagraph after a compile", "0"),
            ("sdpagraph after a compile, prepared", "sdpagraph after a compile", "1"))


def child(which: str, graph_dir: str, trace_dir: str = "", prepare: str = "0") -> dict:
    env = dict(os.environ, SDPAGRAPH_CACHE_DIR=graph_dir, SDPAGRAPH_PREPARE=prepare,
               SDPAGRAPH_CACHE_MODE="strict" if trace_dir != "fill" else "readwrite")
    result = subprocess.run([sys.executable, "-c", CHILD, which, "" if trace_dir == "fill" else trace_dir], env=env,
                            capture_output=True, text=True, timeout=300)
    if result.returncode != 0:
        errors = [line for line in result.stderr.splitlines() if "Error" in line] or ["failed"]
        return {"error": errors[-1][:300]}
    return json.loads(result.stdout.strip().splitlines()[-1])


def host_events(trace_dir: pathlib.Path, count: int = 30) -> list[str]:
    """The host events of XLA and the runtime (not Python's) with the most time in the trace (total
    ms, calls), longest first."""
    from trace_summary import _events  # bench/ is on sys.path when a script here runs

    events, processes, _ = _events(trace_dir)
    totals: dict[str, list[float]] = {}
    for event in events:
        if "/device:GPU" in processes.get(event["pid"], "") or event["name"].startswith("$"):
            continue
        total = totals.setdefault(event["name"], [0.0, 0])
        total[0] += event["dur"] / 1000
        total[1] += 1
    ranked = sorted(totals.items(), key=lambda item: -item[1][0])[:count]
    return [f"| {name[:90]} | {ms:.1f} | {calls} |" for name, (ms, calls) in ranked]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=".")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    lines = [f"bf16 B4 T4096 N16 H128, first jitted value_and_grad call, fresh processes, warm graph cache, no JAX "
             f"compilation cache, median of {args.repeats}; {time.strftime('%Y-%m-%d')}", "",
             "| program | trace+lower s | XLA compile s | first run s | first call s | fusions | custom calls |",
             "|---|---|---|---|---|---|---|"]
    traces = []
    with tempfile.TemporaryDirectory() as tmp:
        graphs = os.path.join(tmp, "graphs")
        filled = child("sdpagraph", graphs, "fill")
        if "error" in filled:
            print("filling the graph cache failed:", filled["error"])
            return 1
        for label, which, prepare in PROGRAMS:
            rows = [child(which, graphs, prepare=prepare) for _ in range(args.repeats)]
            good = [r for r in rows if "error" not in r]
            if not good:
                lines.append(f"| {label} | error: {rows[-1]['error']} | | | | | |")
                continue
            med = {key: statistics.median(r[key] for r in good)
                   for key in ("trace_lower_s", "compile_s", "run_s", "first_call_s")}
            lines.append(f"| {label} | {med['trace_lower_s']:.3f} | {med['compile_s']:.3f} | {med['run_s']:.3f} | "
                         f"{med['first_call_s']:.3f} | {good[0]['fusions']} | {good[0]['custom_calls']} |")
            print(lines[-1], flush=True)
            name = label.replace(" ", "-").replace(",", "")
            (out / f"compile-hlo-{name}.txt").write_text(good[0]["hlo"])
            trace_dir = pathlib.Path(tmp) / name
            traced = child(which, graphs, str(trace_dir), prepare)
            if "error" not in traced:
                traces += ["", f"### {label}: host events of the traced first call (compile "
                           f"{traced['compile_s']:.3f} s, traced)", "", "| event | total ms | calls |", "|---|---|---|"]
                traces += host_events(trace_dir)
    text = "\n".join(lines + traces)
    print(text)
    (out / "probe_compile.md").write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(pathlib.Path(__file__).parent))
    raise SystemExit(main())
