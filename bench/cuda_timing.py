"""CUDA-event timing for the benchmarks that drive the GPU through torch."""
from __future__ import annotations

import statistics
from typing import Callable


def cuda_event_ms(step: Callable[[], object], *, warmup: int = 3, repeats: int = 20, rounds: int = 1) -> float:
    """Median over `rounds` of the mean milliseconds of `repeats` back-to-back `step()` calls."""
    import torch

    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    samples = []
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(repeats):
            step()
        end.record()
        torch.cuda.synchronize()
        samples.append(start.elapsed_time(end) / repeats)
    return statistics.median(samples)
