"""The XLA backend's blockwise path against its direct path (all (B, N, T, S) scores at once).

    python bench/xla_fallback.py [--shape B,N,H] [--dtype float32] [--ts 1024,2048,...] [--causal]
                                 [--block 512] [--max-gib G] [--out DIR]

Per T (= S): jitted forward and forward+backward of each path, every array a jit argument; ms,
ratio blockwise / direct, and the compiled temporaries (memory_analysis().temp_size_in_bytes). The
direct path is timed only where its temporaries fit --max-gib (default: 80% of the device's memory,
or 8 GiB on a host without a memory limit). Runs on CPU (small shapes) and on GPU. Writes
xla_fallback.md / .json to --out.
"""
from __future__ import annotations

import argparse
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from sdpagraph.backends.xla import KEY_BLOCK, xla_attention
from sdpagraph.call import prepare_call

import report  # bench/ is on sys.path when a script here runs
from jax_timing import time_ms

DIRECT = 1 << 30  # a block holding every key: the direct path
GIB = 2**30


def attention_fn(block: int, causal: bool, backward: bool):
    def forward(q, k, v):
        call = prepare_call(q, k, v, is_causal=causal)
        return xla_attention(call.spec, q, k, v, call.inputs, call.score_mod, block=block)[0]

    if not backward:
        return jax.jit(forward)
    loss = lambda q, k, v: jnp.sum(forward(q, k, v).astype(jnp.float32))  # noqa: E731
    return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))


def temp_bytes(fn, args) -> int:
    return fn.lower(*args).compile().memory_analysis().temp_size_in_bytes


def timed_ms(fn, args) -> float:
    """time_ms with repeats sized so that one round takes about half a second."""
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    once = time.perf_counter() - start
    repeats = max(1, min(30, int(0.5 / max(once, 1e-6))))
    return time_ms(fn, *args, repeats=repeats, rounds=3 if once > 0.5 else 5)


def memory_limit_gib() -> float:
    stats = jax.devices()[0].memory_stats() or {}
    return 0.8 * stats["bytes_limit"] / GIB if "bytes_limit" in stats else 8.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="1,4,64", help="B,N,H (K = N)")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--ts", default="1024,2048,4096,8192,16384")
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--block", type=int, default=KEY_BLOCK)
    parser.add_argument("--max-gib", type=float, default=None)
    parser.add_argument("--out", default="bench-results")
    args = parser.parse_args()
    b, n, h = (int(x) for x in args.shape.split(","))
    limit = (args.max_gib if args.max_gib is not None else memory_limit_gib()) * GIB
    rng = np.random.default_rng(0)
    rows, data = [], []
    for t in (int(x) for x in args.ts.split(",")):
        qkv = [jnp.asarray(rng.standard_normal((b, t, n, h)), args.dtype) for _ in range(3)]
        for backward in (False, True):
            entry = {"T": t, "pass": "fwd+bwd" if backward else "fwd"}
            for name, block in (("direct", DIRECT), ("blockwise", args.block)):
                fn = attention_fn(block, args.causal, backward)
                # Compiling a direct path far past the device's memory fails (its autotuning allocates).
                too_big = name == "direct" and b * n * t * t * 4 > limit
                entry[f"{name}_temp"] = None if too_big else temp_bytes(fn, qkv)
                fits = entry[f"{name}_temp"] is not None and entry[f"{name}_temp"] <= limit
                entry[f"{name}_ms"] = None
                try:
                    entry[f"{name}_ms"] = timed_ms(fn, qkv) if fits else None
                except jax.errors.JaxRuntimeError as error:  # temporaries fit, the allocator did not
                    entry[f"{name}_error"] = str(error).splitlines()[0][:200]
            data.append(entry)
            direct, blocks = entry["direct_ms"], entry["blockwise_ms"]
            ratio = f"{blocks / direct:.2f}" if direct and blocks else "-"
            ms = lambda x: "-" if x is None else f"{x:.2f}"  # noqa: E731
            if entry.get("direct_error"):
                direct_text = "out of memory" if "RESOURCE_EXHAUSTED" in entry["direct_error"] else "failed"
            else:
                direct_text = ms(direct)
            gib = lambda x: "-" if x is None else f"{x / GIB:.3f}"  # noqa: E731
            rows.append(f"| {t} | {entry['pass']} | {direct_text} | {ms(blocks)} | {ratio} | "
                        f"{gib(entry['direct_temp'])} | {gib(entry['blockwise_temp'])} |")
            print(rows[-1], file=sys.stderr, flush=True)  # progress; the table follows at the end
    header = ("| T = S | pass | direct ms | blockwise ms | ratio | direct temp GiB | blockwise temp GiB |\n"
              "|---|---|---|---|---|---|---|\n")
    setup = (f"B{b} N{n} H{h} {args.dtype} {'causal' if args.causal else 'non-causal'}, block {args.block}, "
             f"direct timed where temporaries <= {limit / GIB:.1f} GiB")
    report.write(args.out, "xla_fallback", setup, header + "\n".join(rows), data)


if __name__ == "__main__":
    main()
