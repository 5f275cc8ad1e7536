"""Probe: does host work on another thread progress while cuDNN builds a graph?

    python bench/probe_build_overlap.py            on a GPU

The numerical check's host part (drawing inputs, the float64 reference) needs no graph, so it could
run while the graphs build, if the build lets go of the GIL. This times a fixed NumPy workload
(float64 matmuls the size of the check's reference) alone, then on a thread while the forward and
backward graphs of a config build cold (memory-only cache), and prints both and the build time.
"""
from __future__ import annotations

import threading
import time

import jax
import jax.numpy as jnp
import numpy as np

from sdpagraph import mods
from sdpagraph.cache import GraphCache
from sdpagraph.graph_store import cached_graph
from sdpagraph.call import prepare_call


def workload() -> float:
    """Seconds for a fixed amount of float64 NumPy work."""
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((12, 40, 128)), rng.standard_normal((12, 128, 4096))
    started = time.perf_counter()
    for _ in range(60):
        np.exp(np.tanh(a @ b / 30.0)).sum()
    return time.perf_counter() - started


def main() -> None:
    alone = workload()
    rows = []
    for softcap in (30.0, 31.0):  # two configs: each builds cold
        q = jax.ShapeDtypeStruct((4, 1024, 16, 128), jnp.bfloat16)
        call = prepare_call(q, q, q, is_causal=True, score_mod=mods.softcap(softcap))
        cache = GraphCache()
        started, during = time.perf_counter(), {}
        thread = threading.Thread(target=lambda: during.update(seconds=workload(), ended=time.perf_counter()))
        thread.start()
        for direction in ("forward", "backward"):
            cached_graph(call.spec, call.score_mod, direction, cache)
        built = time.perf_counter()
        thread.join()
        rows.append((built - started, during["seconds"], during["ended"] - started))
    print(f"workload alone: {alone:.2f} s")
    print("| build fwd+bwd | workload on a thread meanwhile | both done after |")
    print("|---|---|---|")
    for build, seconds, ended in rows:
        print(f"| {build:.2f} s | {seconds:.2f} s | {ended:.2f} s |")


if __name__ == "__main__":
    main()
