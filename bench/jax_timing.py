"""Wall-clock timing of jitted JAX calls, shared by the benchmarks."""
import statistics
import time

import jax


def time_ms(fn, *args, repeats=30, rounds=5):
    """Median over rounds of the mean time of `repeats` back-to-back calls (dispatch included),
    after two untimed calls (compile, warm-up)."""
    jax.block_until_ready(fn(*args))
    jax.block_until_ready(fn(*args))
    samples = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(repeats):
            out = fn(*args)
        jax.block_until_ready(out)
        samples.append((time.perf_counter() - start) / repeats * 1e3)
    return statistics.median(samples)
