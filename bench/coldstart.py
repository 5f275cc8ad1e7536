"""Cold start: the first jitted forward+backward call in a fresh process. Needs a GPU.

    python bench/coldstart.py [--out DIR]

bf16 B4 T4096 N16 H128. sdpagraph runs softcap(30)+causal through score_mod with
(a) an empty graph cache and (b) a warm on-disk cache (precompiled by (a)), counting
cuDNN builds; (c) jax.nn.dot_product_attention(implementation="cudnn"), plain causal,
without and with JAX's persistent compilation cache. Each number is a new process; the first call
starts after the imports (`from sdpagraph import attention, mods`, timed as imports_s), as jax's does.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

CHILD = r"""
import time
process_start = time.perf_counter()
import json, sys
import jax, jax.numpy as jnp, numpy as np
which, jax_cache, phases = sys.argv[1], sys.argv[2], sys.argv[3] == "phases"
if jax_cache:
    jax.config.update("jax_compilation_cache_dir", jax_cache)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
from sdpagraph import attention, mods  # as a model module imports it (imports_s counts it)
from sdpagraph.cache import default_cache
rng = np.random.default_rng(0)
q, k, v = (jnp.asarray(rng.standard_normal((4, 4096, 16, 128)), jnp.bfloat16) for _ in range(3))
jax.block_until_ready((q, k, v))
if which == "sdpagraph":
    attn = lambda q, k, v: attention(q, k, v, is_causal=True, score_mod=mods.softcap(30.0), implementation="cudnn")
else:
    attn = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")
step = jax.jit(jax.value_and_grad(lambda q, k, v: jnp.sum(attn(q, k, v).astype(jnp.float32)), argnums=(0, 1, 2)))
row = {"imports_s": time.perf_counter() - process_start}
start = time.perf_counter()
if phases:  # the same first call, split into trace+lower, XLA compile and the first run (with a profile)
    import cProfile, io, pstats
    profile = cProfile.Profile()
    profile.enable()
    lowered = step.lower(q, k, v)
    row["trace_lower_s"] = time.perf_counter() - start
    compiled = lowered.compile()
    row["compile_s"] = time.perf_counter() - start - row["trace_lower_s"]
    jax.block_until_ready(compiled(q, k, v))
    row["run_s"] = time.perf_counter() - start - row["trace_lower_s"] - row["compile_s"]
    profile.disable()
    text = io.StringIO()
    pstats.Stats(profile, stream=text).sort_stats("cumulative").print_stats(40)
    row["profile"] = text.getvalue()
else:
    jax.block_until_ready(step(q, k, v))
row["first_call_s"] = time.perf_counter() - start
row["cudnn_builds"] = default_cache().stats()["builds"]
row["frontend_imported"] = "cudnn" in sys.modules
print(json.dumps(row))
"""


def child(which: str, graph_dir: str, jax_cache: str = "", mode: str = "readwrite", phases: bool = False) -> dict:
    env = dict(os.environ, SDPAGRAPH_CACHE_DIR=graph_dir, SDPAGRAPH_CACHE_MODE=mode)
    started = time.perf_counter()
    result = subprocess.run([sys.executable, "-c", CHILD, which, jax_cache, "phases" if phases else "call"], env=env, capture_output=True,
                            text=True, timeout=300)
    if result.returncode != 0:
        errors = [line for line in result.stderr.splitlines() if "Error" in line] or ["failed"]
        return {"error": errors[-1][:300]}
    row = json.loads(result.stdout.strip().splitlines()[-1])
    row["process_s"] = time.perf_counter() - started
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default=".")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        graphs, jax_cache = os.path.join(tmp, "graphs"), os.path.join(tmp, "jax-cache")
        rows = [
            ("(a) sdpagraph softcap+causal, empty graph cache", child("sdpagraph", graphs)),
            ("(b) sdpagraph softcap+causal, warm graph cache (strict)", child("sdpagraph", graphs, mode="strict")),
            ("(c) jax cudnn causal, no JAX compilation cache", child("jax", graphs)),
            ("(c) jax cudnn causal, JAX compilation cache (filling)", child("jax", graphs, jax_cache)),
            ("(c) jax cudnn causal, JAX compilation cache (warm)", child("jax", graphs, jax_cache)),
            ("(d) sdpagraph, warm graph cache + JAX compilation cache (filling)", child("sdpagraph", graphs, jax_cache, "strict")),
            ("(d) sdpagraph, warm graph cache + JAX compilation cache (warm)", child("sdpagraph", graphs, jax_cache, "strict")),
        ]
        phases = {which: child(which, graphs, mode="strict", phases=True) for which in ("sdpagraph", "jax")}
    lines = ["| scenario | first fwd+bwd call s | cuDNN builds | cudnn frontend imported | whole process s |",
             "|---|---|---|---|---|"]
    for name, row in rows:
        if "error" in row:
            lines.append(f"| {name} | error: {row['error']} | | | |")
        else:
            lines.append(f"| {name} | {row['first_call_s']:.3f} | {row['cudnn_builds']} | "
                         f"{'yes' if row['frontend_imported'] else 'no'} | {row['process_s']:.1f} |")
    lines += ["", "The same first call split into phases (AOT: `lower`, `compile`, first run; fresh process, "
              "no JAX compilation cache; graph cache warm):", "",
              "| which | imports s | trace+lower s | XLA compile s | first run s | total s |", "|---|---|---|---|---|---|"]
    for which, row in phases.items():
        if "error" in row:
            lines.append(f"| {which} | error: {row['error']} | | | | |")
            continue
        lines.append(f"| {which} | {row['imports_s']:.3f} | {row['trace_lower_s']:.3f} | {row['compile_s']:.3f} "
                     f"| {row['run_s']:.3f} | {row['first_call_s']:.3f} |")
        with open(os.path.join(args.out, f"coldstart-profile-{which}.txt"), "w") as f:
            f.write(row["profile"])
    text = "\n".join(lines)
    print(text)
    with open(os.path.join(args.out, "coldstart.md"), "w") as f:
        f.write(f"bf16 B4 T4096 N16 H128, first jitted value_and_grad call per fresh process, {time.strftime('%Y-%m-%d')}\n\n"
                + text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
