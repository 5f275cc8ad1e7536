"""Wall-clock timing of jitted JAX calls, shared by the benchmarks."""
import math
import statistics
import time

import jax


def time_ms(fn, *args, repeats=30, rounds=5, min_round_ms=0.0):
    """Median over rounds of the mean time of `repeats` back-to-back calls (dispatch included),
    after two untimed calls (compile, warm-up). `min_round_ms`: more calls a round where `repeats`
    would take less (sized from an untimed round of `repeats` calls), so that what a round pays once
    (the first call's launch, the final synchronization) weighs on each call as little as in a long
    run of steps."""
    jax.block_until_ready(fn(*args))
    jax.block_until_ready(fn(*args))
    if min_round_ms:
        start = time.perf_counter()
        for _ in range(repeats):
            out = fn(*args)
        jax.block_until_ready(out)
        per_call_ms = (time.perf_counter() - start) * 1e3 / repeats
        repeats = max(repeats, math.ceil(min_round_ms / max(per_call_ms, 1e-3)))
    samples = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(repeats):
            out = fn(*args)
        jax.block_until_ready(out)
        samples.append((time.perf_counter() - start) / repeats * 1e3)
    return statistics.median(samples)
