"""Where the numerical check's time goes: cProfile of `check_numerics` after a cold build.

    python bench/profile_numerics.py [B T N H] [--out DIR]      on a GPU

Builds the forward and backward graphs of a bf16 causal + softcap(30) call (memory-only cache), then
runs the check three times, profiling each, and prints the functions with the most time of their own
(the first check and the last) and the executor's entry points (allocations, frees, copies, runs)
with their counts and times. Writes profile-B..-T..txt to --out (default: the working directory).
"""
from __future__ import annotations

import argparse
import cProfile
import gc
import io
import os
import pstats
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("shape", nargs="*", type=int, default=[4, 4096, 16, 128])
    parser.add_argument("--out", default=".")
    args = parser.parse_args()
    b, t, n, h = args.shape
    import jax
    import jax.numpy as jnp

    from sdpagraph import mods
    from sdpagraph.cache import GraphCache, set_default_cache
    from sdpagraph.graph_store import cached_graph
    from sdpagraph.call import prepare_call
    from sdpagraph.numerics.check import check_numerics

    jnp.ones(8).block_until_ready()
    set_default_cache(GraphCache())
    q = jax.ShapeDtypeStruct((b, t, n, h), jnp.bfloat16)
    call = prepare_call(q, q, q, is_causal=True, score_mod=mods.softcap(30.0))
    started = time.perf_counter()
    for direction in ("forward", "backward"):
        cached_graph(call.spec, call.score_mod, direction)
    calls = _time_executor_calls()
    report = io.StringIO()
    print(f"B{b} T{t} N{n} H{h}: build fwd+bwd {time.perf_counter() - started:.3f} s", file=report)
    collecting = [0.0, 0.0, 0]  # seconds in the garbage collector, when the current one started, collections

    def on_gc(phase, info):
        if phase == "start":
            collecting[1] = time.perf_counter()
        else:
            collecting[0] += time.perf_counter() - collecting[1]
            collecting[2] += 1
    gc.callbacks.append(on_gc)
    for index in range(3):
        collecting[0], collecting[2] = 0.0, 0
        profile = cProfile.Profile()
        profile.enable()
        result = check_numerics(call.spec, call.score_mod, True, seed=index)
        profile.disable()
        print(f"\ncheck {index + 1}: {result.seconds:.3f} s, timings {result.timings}, {result.summary()}; "
              f"garbage collector {collecting[2]} x, {collecting[0] * 1e3:.1f} ms", file=report)
        print("executor calls: " + ", ".join(f"{name} {count} x, {seconds * 1e3:.1f} ms"
                                             for name, (count, seconds) in sorted(calls.items())), file=report)
        calls.clear()
        if index != 1:
            pstats.Stats(profile, stream=report).sort_stats("tottime").print_stats(25)
    text = report.getvalue()
    print(text)
    with open(os.path.join(args.out, f"profile-B{b}-T{t}.txt"), "w") as handle:
        handle.write(text)


def _time_executor_calls() -> dict[str, list]:
    """Count and time the executor's direct-run entry points (name -> [calls, seconds])."""
    from sdpagraph.ffi.loader import _loaded

    library, calls = _loaded(), {}
    for name in ("device_alloc", "device_free", "device_copy", "run_graph"):
        def timed(*args, _name=name, _real=getattr(library, name)):
            started = time.perf_counter()
            try:
                return _real(*args)
            finally:
                entry = calls.setdefault(_name, [0, 0.0])
                entry[0] += 1
                entry[1] += time.perf_counter() - started
        setattr(library, name, timed)
    return calls


if __name__ == "__main__":
    main()
