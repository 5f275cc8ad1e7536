"""Paged K/V on cuDNN against the alternatives, side by side in one run. Needs a GPU.

    python bench/paged.py [--out DIR] [--quick]

Rows (bf16, inference; every array, page table and lengths included, a jit argument):
- decode B64 N64/K8 H128, page 64, ~16k keys a sequence, T = 1, 4, 8 (bottom-right causal): ms and
  the effective K/V bandwidth (the keys and values each sequence reads, over the time); against
  gathering the pages then dense attention (jax's cuDNN attention), and at T = 1 jax's Pallas GPU
  paged attention (pools in its own [K, pages, page, H] layout, made once outside the timing);
- chunked prefill B1: 2048 new tokens onto 14336 cached (bottom-right causal), against the same
  call on dense keys (sdpagraph, cuDNN);
- 1000 decode steps with growing lengths and a changing batch of tables: traces and graph builds;
- a fresh process with the graph cache and JAX's compilation cache this run filled: its first decode
  step (trace, compile from the cache, run) and its builds; `sdpagraph.attention` is imported before
  it (timed apart), as a model module's `from sdpagraph import attention` does at import.
Writes paged.md / paged.json to --out.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("SDPAGRAPH_CACHE_DIR", tempfile.mkdtemp(prefix="sdpagraph-paged-bench-"))
# JAX's persistent compilation cache too, as a serving process keeps one: the fresh process reuses both
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", tempfile.mkdtemp(prefix="sdpagraph-paged-bench-xla-"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

import jax
import jax.numpy as jnp
import numpy as np

import sdpagraph
from sdpagraph import paged
from sdpagraph.cache.defaults import default_cache

from jax_timing import time_ms  # bench/ is on sys.path when a script here runs
import report
from report import markdown_table

B, N, K, H, PAGE, MAX_PAGES = 64, 64, 8, 128, 64, 256


def pools(rng, batch=B, max_pages=MAX_PAGES):
    """(k_pages, v_pages, table, lengths ~ (max_pages - 16) * PAGE .. max_pages * PAGE) with the pages of
    the batch shuffled through the pool."""
    pages = batch * max_pages
    keys = jax.random.split(jax.random.key(int(rng.integers(2**31))))
    kp, vp = (jax.random.normal(key, (pages, PAGE, K, H), jnp.bfloat16) for key in keys)  # on the device
    table = jnp.asarray(rng.permutation(pages).reshape(batch, max_pages), jnp.int32)
    lengths = jnp.asarray(rng.integers((max_pages - 16) * PAGE, max_pages * PAGE + 1, batch), jnp.int32)
    return kp, vp, table, lengths


def ours(t):
    return jax.jit(lambda q, kp, vp, table, lengths: sdpagraph.attention(
        q, kp, vp, page_table=table, key_value_seq_lengths=lengths, is_causal=t > 1,
        causal_alignment="bottom_right", implementation="cudnn"))


def gathered(t):
    """Gather each sequence's pages, then jax's cuDNN attention over the dense keys."""
    def run(q, kp, vp, table, lengths):
        k, v = paged.gather(kp, table), paged.gather(vp, table)
        q_lengths = jnp.full((q.shape[0],), q.shape[1], jnp.int32)
        return jax.nn.dot_product_attention(q, k, v, is_causal=False, query_seq_lengths=q_lengths,
                                            key_value_seq_lengths=lengths, implementation="cudnn") if t == 1 else \
            sdpagraph.attention(q, k, v, is_causal=True, causal_alignment="bottom_right",
                                query_seq_lengths=q_lengths, key_value_seq_lengths=lengths, implementation="cudnn",
                                training=False)
    return jax.jit(run)


# jax's Pallas GPU paged attention: its defaults, then smaller compute blocks (its defaults asked for
# more shared memory than an H100 has at head dim 128)
PALLAS_CONFIGS = ({}, {"pages_per_compute_block": 4}, {"pages_per_compute_block": 2, "block_h": 8})


def pallas(config):
    from jax.experimental.pallas.ops.gpu.paged_attention import paged_attention
    return jax.jit(lambda q, kp, vp, table, lengths: paged_attention(q[:, 0], kp, vp, table, lengths, **config))


def kv_bytes(lengths):
    return float(np.sum(np.asarray(lengths, np.int64))) * K * H * 2 * 2  # k and v, bf16


def decode_rows(rng, quick):
    kp, vp, table, lengths = pools(rng)
    repeats, rounds = (10, 3) if quick else (50, 5)
    rows, base = [], None
    for t in (1, 4, 8):
        q = jnp.asarray(rng.standard_normal((B, t, N, H)), jnp.bfloat16)
        args = (q, kp, vp, table, lengths)
        row = {"row": f"decode T={t}", "sdpagraph ms": time_ms(ours(t), *args, repeats=repeats, rounds=rounds)}
        row["K/V TB/s"] = kv_bytes(lengths) / row["sdpagraph ms"] / 1e9
        base = row["sdpagraph ms"] if t == 1 else base
        row["/ T=1"] = row["sdpagraph ms"] / base
        row["path"] = sdpagraph.check_support(q, kp, vp, page_table=table, key_value_seq_lengths=lengths,
                                              is_causal=t > 1, causal_alignment="bottom_right").reason[:90]
        row["gather + dense ms"] = time_ms(gathered(t), *args, repeats=repeats, rounds=rounds)
        row["gather / sdpagraph"] = row["gather + dense ms"] / row["sdpagraph ms"]
        if t == 1:
            own = (jnp.transpose(kp, (2, 0, 1, 3)), jnp.transpose(vp, (2, 0, 1, 3)))  # its layout, made once
            failures = []
            for config in PALLAS_CONFIGS:
                try:
                    row["pallas ms"] = time_ms(pallas(config), q, *own, table, lengths, repeats=repeats, rounds=rounds)
                except Exception as err:  # noqa: BLE001 (a missing or failing competitor is a result)
                    failures.append(f"{config or 'defaults'}: {type(err).__name__}: {str(err).splitlines()[0][:90]}")
                    continue
                row["pallas / sdpagraph"], row["pallas config"] = row["pallas ms"] / row["sdpagraph ms"], config
                break
            if failures:
                row["pallas failures"] = "; ".join(failures)
            del own
        rows.append(row)
        print(row, flush=True)
    return rows


def prefill_row(rng, quick):
    new, cached = 2048, 14336
    max_pages = (new + cached) // PAGE
    kp, vp, table, _ = pools(rng, batch=1, max_pages=max_pages)
    lengths = jnp.asarray([new + cached], jnp.int32)
    q = jnp.asarray(rng.standard_normal((1, new, N, H)), jnp.bfloat16)
    repeats, rounds = (5, 3) if quick else (20, 5)
    row = {"row": f"chunked prefill {new} onto {cached}",
           "sdpagraph ms": time_ms(ours(new), q, kp, vp, table, lengths, repeats=repeats, rounds=rounds)}
    k, v = paged.gather(kp, table), paged.gather(vp, table)
    dense = jax.jit(lambda q, k, v: sdpagraph.attention(q, k, v, is_causal=True, causal_alignment="bottom_right",
                                                        implementation="cudnn", training=False))
    row["dense keys ms"] = time_ms(dense, q, k, v, repeats=repeats, rounds=rounds)
    row["rate vs dense"] = row["dense keys ms"] / row["sdpagraph ms"]
    print(row, flush=True)
    return row


def steps_row(rng, steps):
    """`steps` decode steps, lengths growing by one and the tables reshuffled every 100 steps."""
    kp, vp, table, lengths = pools(rng, max_pages=MAX_PAGES)
    lengths = lengths - steps
    q = jnp.asarray(rng.standard_normal((B, 1, N, H)), jnp.bfloat16)
    traces = []

    @jax.jit
    def step(q, kp, vp, table, lengths):
        traces.append(1)
        return sdpagraph.attention(q, kp, vp, page_table=table, key_value_seq_lengths=lengths,
                                   implementation="cudnn")

    jax.block_until_ready(step(q, kp, vp, table, lengths))
    before = default_cache().stats()["builds"]
    start = time.perf_counter()
    for i in range(steps):
        if i % 100 == 0:
            table = jnp.asarray(rng.permutation(table.size).reshape(table.shape), jnp.int32)
        out = step(q, kp, vp, table, lengths + i)
    jax.block_until_ready(out)
    return {"row": f"{steps} decode steps", "traces": len(traces), "graph builds": default_cache().stats()["builds"]
            - before, "ms per step": (time.perf_counter() - start) / steps * 1e3}


CHILD = """
import time, json, sys
start = time.perf_counter()
import jax, jax.numpy as jnp, numpy as np
sys.path.insert(0, {bench!r})
import sdpagraph
from sdpagraph.cache.defaults import default_cache
from paged import pools, ours, B, N, H
rng = np.random.default_rng(0)
kp, vp, table, lengths = pools(rng)
q = jnp.asarray(rng.standard_normal((B, 1, N, H)), jnp.bfloat16)
jax.block_until_ready((q, kp, vp, table, lengths))
imported = time.perf_counter()
sdpagraph.attention  # what a model module's `from sdpagraph import attention` loads when it is imported
imports = time.perf_counter() - imported
profile_path = {profile_path!r}
if profile_path:
    import cProfile, pstats
    profiler = cProfile.Profile()
    profiler.enable()
ready = time.perf_counter()
lowered = ours(1).lower(q, kp, vp, table, lengths)  # traces attention: the graph found in the cache
traced = time.perf_counter()
compiled = lowered.compile()  # XLA's executable, from JAX's compilation cache
built = time.perf_counter()
jax.block_until_ready(compiled(q, kp, vp, table, lengths))
first = time.perf_counter()
if profile_path:
    profiler.disable()
    with open(profile_path, "w") as f:
        pstats.Stats(profiler, stream=f).sort_stats("cumulative").print_stats(80)
print(json.dumps({{"first decode step s": first - ready, "sdpagraph.attention import s (before)": imports,
                  "trace s": traced - ready, "compile s": built - traced,
                  "first run s": first - built, "process start to first step s": first - start,
                  "graph builds": default_cache().stats()["builds"]}}))
"""


def fresh_process_row(profile_path=None):
    """The first decode step of a fresh process whose caches this run filled; with `profile_path`, a
    second fresh process writes where its first step's time goes (cProfile, cumulative) there."""
    rows = []
    for path in (None, profile_path) if profile_path else (None,):
        code = CHILD.format(bench=os.path.dirname(os.path.abspath(__file__)), profile_path=path)
        child = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                               env=dict(os.environ))
        label = "fresh process, cache filled" + (" (under cProfile)" if path else "")
        if child.returncode:
            rows.append({"row": label, "error": child.stderr.strip().splitlines()[-1][:200]})
        else:
            rows.append({"row": label, **json.loads(child.stdout.strip().splitlines()[-1])})
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    header = (f"device: {jax.devices()[0].device_kind}; jax {jax.__version__}; B{B} N{N}/K{K} H{H} page {PAGE}; "
              f"{'quick' if args.quick else 'full'} run")
    print(header, flush=True)
    rng = np.random.default_rng(0)
    parts = {}

    def save():
        report.save(args.out, "paged", header + "\n\n" + report.markdown_tables(parts, parts),
                    {"header": header, **parts})

    parts["decode"] = decode_rows(rng, args.quick)
    save()
    parts["prefill"] = [prefill_row(rng, args.quick)]
    save()
    parts["steps"] = [steps_row(rng, 200 if args.quick else 1000)]
    save()
    parts["fresh"] = fresh_process_row(os.path.join(args.out, "fresh_profile.txt") if args.out else None)
    save()
    for rows in parts.values():
        print(markdown_table(rows), flush=True)


if __name__ == "__main__":
    main()
