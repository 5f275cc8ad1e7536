"""Temp memory and time of the O(T) segment helpers vs the old O(T^2) approach.

Usage:
    python bench/segments_memory.py [--lengths 4096 16384 65536 131072]
        [--max-segments 16] [--repeats 5] [--run-limit-mib 4096]

For every length T it compiles each function under ``jax.jit`` for a
``(1, T)`` int32 input and reads ``compiled.memory_analysis()`` (XLA's
static buffer plan, available without running).  It then runs each
function on a random packing of about ``max_segments`` segments and reports
the median wall time.  The quadratic version is only *run* while its planned
temp buffer is under ``--run-limit-mib``; larger rows show the planned bytes
and "not run".

``segment_metadata_quadratic`` lives here, not in the package: it is the
approach the package replaced, kept only to measure against.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from sdpagraph.segments.metadata import segment_metadata, segment_positions  # noqa: E402


def segment_metadata_quadratic(segment_ids, max_segments):
    """The old way: a pairwise same-segment mask, then a (T, M) one-hot.

    Like the mask-based THD path it replaces, it treats equal ids as one
    segment, so it is only correct when every id labels one contiguous run
    (the inputs generated below).  Output follows the package's conventions.
    """
    valid = segment_ids != 0
    # (B, T, T): the attention-style mask the old path materialised.
    same = (segment_ids[:, :, None] == segment_ids[:, None, :]) & valid[:, :, None]
    lengths = jnp.sum(same, axis=2, dtype=jnp.int32)
    earlier = jnp.tril(jnp.ones(same.shape[1:], bool), k=-1)
    is_start = valid & ~jnp.any(same & earlier, axis=2)
    slot = jnp.cumsum(is_start, axis=1, dtype=jnp.int32) - 1
    # (B, T, M): one-hot of each start token's slot.
    one_hot = is_start[:, :, None] & (slot[:, :, None] == jnp.arange(max_segments))
    t = jnp.arange(segment_ids.shape[1], dtype=jnp.int32)
    seq_lens = jnp.sum(jnp.where(one_hot, lengths[:, :, None], 0), axis=1)
    starts = jnp.sum(jnp.where(one_hot, t[None, :, None], 0), axis=1)
    num_segments = jnp.sum(is_start, axis=1, dtype=jnp.int32)
    used = jnp.arange(max_segments)[None, :] < num_segments[:, None]
    end = jnp.max(jnp.where(used, starts + seq_lens, 0), axis=1, keepdims=True)
    offsets = jnp.concatenate([jnp.where(used, starts, end), end], axis=1)
    return seq_lens, offsets, num_segments


def packed_ids(length, count, rng):
    """A (1, T) packing of ``count`` contiguous runs with unique ids, a few
    padding gaps and a padding tail (about 10% padding in all)."""
    row = np.zeros(length, np.int32)
    used = int(length * 0.9)
    bounds = np.linspace(0, used, count + 1).astype(int)
    for k, (start, stop) in enumerate(zip(bounds[:-1], bounds[1:])):
        gap = int(rng.integers(0, 4))
        row[start + gap : stop] = 1 + 7 * k  # non-consecutive ids
    return jnp.asarray(row[None, :])


def compile_for(fn, ids):
    """(compiled, planned temp bytes or None, compile seconds)."""
    begin = time.perf_counter()
    compiled = jax.jit(fn).lower(jax.ShapeDtypeStruct(ids.shape, ids.dtype)).compile()
    compile_s = time.perf_counter() - begin
    analysis = compiled.memory_analysis()
    temp = None if analysis is None else analysis.temp_size_in_bytes
    return compiled, temp, compile_s


def median_run(compiled, ids, repeats):
    """(median seconds per call, output); the first call is a warm-up."""
    out = jax.block_until_ready(compiled(ids))
    times = []
    for _ in range(repeats):
        begin = time.perf_counter()
        jax.block_until_ready(compiled(ids))
        times.append(time.perf_counter() - begin)
    return statistics.median(times), out


def fmt_bytes(n):
    if n is None:
        return "n/a"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024


def fmt_ms(s):
    return "not run" if s is None else f"{s * 1e3:.2f}"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[4096, 16384, 65536, 131072])
    parser.add_argument("--max-segments", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--run-limit-mib", type=float, default=4096)
    args = parser.parse_args(argv)

    m = args.max_segments
    rng = np.random.default_rng(0)
    functions = {
        "segment_metadata (O(T))": lambda x: segment_metadata(x, m),
        "segment_positions (O(T))": segment_positions,
        "quadratic (O(T^2))": lambda x: segment_metadata_quadratic(x, m),
    }
    print(f"jax {jax.__version__}, backend {jax.default_backend()}, "
          f"{os.cpu_count()} CPUs, {platform.platform()}")
    print(f"B=1, max_segments={m}, {m} segments per row, median of {args.repeats} runs\n")
    print("| T | function | temp bytes | compile s | run ms |")
    print("|---:|---|---:|---:|---:|")
    for length in args.lengths:
        ids = packed_ids(length, m, rng)
        results = {}
        for name, fn in functions.items():
            compiled, temp, compile_s = compile_for(fn, ids)
            # Run only what fits: the quadratic plan reaches GiBs at large T.
            fits = temp is not None and temp <= args.run_limit_mib * 2**20
            run_s, out = median_run(compiled, ids, args.repeats) if fits else (None, None)
            results[name] = out
            print(f"| {length} | {name} | {fmt_bytes(temp)} | {compile_s:.2f} | {fmt_ms(run_s)} |",
                  flush=True)
        # The two metadata implementations must agree wherever both ran.
        fast, slow = results["segment_metadata (O(T))"], results["quadratic (O(T^2))"]
        if slow is not None:
            for a, b in zip(fast, slow):
                np.testing.assert_array_equal(a, b)


if __name__ == "__main__":
    main()
