"""Cost of a cached `check_support` answer (target <= 50 us), on this machine's CPU.

    python bench/support.py

Two environments: this machine as it is (no GPU: the answer is the environment's
reason), and a stand-in GPU whose graph builds are faked, so that the timed calls take the
path a GPU machine takes after its first answer: argument normalization, the score_mod
trace cache, the environment checks and the per-cache memo of answers.
"""
from __future__ import annotations

import statistics
import tempfile
import time
from unittest import mock

import jax
import jax.numpy as jnp

import sdpagraph
from sdpagraph import mods
from sdpagraph.cache import GraphCache, set_default_cache
from sdpagraph import graph_store
from sdpagraph.graphs import support as graphs_support
from sdpagraph.backends.cudnn import execute as cudnn_execute

SHAPE = jax.ShapeDtypeStruct((4, 4096, 16, 128), jnp.bfloat16)
CASES = {
    "causal": dict(is_causal=True),
    "softcap+causal (score_mod)": dict(is_causal=True, score_mod=mods.softcap(30.0)),
    "alibi+window (score_mod)": dict(local_window_size=(256, 0), score_mod=mods.alibi([0.1] * 16)),
}


def per_call_us(kwargs, calls=2000, rounds=7):
    sdpagraph.check_support(SHAPE, SHAPE, SHAPE, **kwargs)  # the first answer is not cached
    samples = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            sdpagraph.check_support(SHAPE, SHAPE, SHAPE, **kwargs)
        samples.append((time.perf_counter() - start) / calls * 1e6)
    return statistics.median(samples), max(samples)


def stand_in_gpu():
    """Patches that make cuDNN look available and every build succeed (builds are not timed)."""
    return [
        mock.patch.object(graphs_support, "environment_reason", lambda: None),
        mock.patch.object(cudnn_execute, "environment_reason", lambda: None),
        mock.patch.object(cudnn_execute.ffi, "unavailable_reason", lambda: None),
        mock.patch.object(graph_store, "cached_graph", lambda spec, ir, direction, cache=None: None),
    ]


def main():
    rows = []
    for name, kwargs in CASES.items():
        rows.append(("this machine (" + jax.default_backend() + ")", name, *per_call_us(kwargs)))
    with tempfile.TemporaryDirectory() as directory:
        set_default_cache(GraphCache(directory))
        patches = stand_in_gpu()
        for patch in patches:
            patch.start()
        try:
            for name, kwargs in CASES.items():
                assert sdpagraph.check_support(SHAPE, SHAPE, SHAPE, **kwargs).supported
                rows.append(("stand-in GPU (memo hit)", name, *per_call_us(kwargs)))
        finally:
            for patch in patches:
                patch.stop()
            set_default_cache(None)
    print("| environment | config | median us/call | worst round us/call | target |")
    print("|---|---|---|---|---|")
    for env, name, median, worst in rows:
        print(f"| {env} | {name} | {median:.1f} | {worst:.1f} | <= 50 |")


if __name__ == "__main__":
    main()
