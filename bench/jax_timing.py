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
        repeats = max(repeats, math.ceil(min_round_ms / max(_round_ms(fn, args, repeats), 1e-3)))
    return statistics.median([_round_ms(fn, args, repeats) for _ in range(rounds)])


def _round_ms(fn, args, repeats):
    """The mean time of `repeats` back-to-back calls, synchronized once at the end."""
    start = time.perf_counter()
    for _ in range(repeats):
        out = fn(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - start) / repeats * 1e3


def alternating_ms(steps, *args, turns=3, repeats=5, min_round_ms=0.0):
    """{name: [ms of each turn]} of the compiled `steps` ({name: step}) timed in turn, one round each
    a turn (`time_ms`), so that a drift of the machine weighs on every step alike."""
    times = {name: [] for name in steps}
    for _ in range(turns):
        for name, step in steps.items():
            times[name].append(time_ms(step, *args, repeats=repeats, rounds=1, min_round_ms=min_round_ms))
    return times

