"""Whether the halo part's small cuDNN calls gain from running on a second stream, beside the block's
own (local) call: each variant patches `halo_split.run_halo_call` (and `halo_first`, the barrier that
orders the backward's halo part before the local part), then compiles and times
`bench/multi_gpu.py --part cp-long` halo rows on 2 GPUs, beside the same call on one.

The second stream is XLA's stream annotation (`jax.experimental.compute_on.compute_on("gpu_stream:1")`
around a jitted call): XLA runs the call asynchronously on that stream and its scheduler may overlap
it with the local call.

    python3 bench/probe_halo_stream.py [ROW ...]    (LONG_CALLS indexes; default 4 5 2)
"""
from __future__ import annotations

import inspect
import sys

import jax
from jax._src import core as jax_core

import multi_gpu  # bench/ is on sys.path when a script here runs
from jax_timing import time_ms
from sdpagraph.parallel import halo_split

code_call, code_first = halo_split.run_halo_call, halo_split.halo_first  # the code's forms


def stream_call(call, *arrays):
    """`call` on XLA's stream 1: jax 0.10's `compute_on` is a context manager around a jitted call;
    later ones wrap the function (`compute_on(f, compute_type=..., out_memory_spaces=...)`)."""
    from jax.experimental import compute_on as module

    if "compute_type" in inspect.signature(module.compute_on).parameters and \
            inspect.signature(module.compute_on).parameters["compute_type"].kind is inspect.Parameter.KEYWORD_ONLY:
        space = getattr(getattr(jax, "memory", None), "Space", None) or jax_core.MemorySpace
        return module.compute_on(call, compute_type="gpu_stream:1", out_memory_spaces=space.Device)(*arrays)
    with module.compute_on("gpu_stream:1"):
        return jax.jit(call)(*arrays)


def no_barrier(halo_grads, local_inputs):
    return halo_grads, local_inputs


VARIANTS = {  # name: (run_halo_call, halo_first)
    "the code: one stream, halo part first": (code_call, code_first),
    "halo calls on stream 1, halo part first": (stream_call, code_first),
    "halo calls on stream 1, no barrier": (stream_call, no_barrier),
    "one stream, no barrier": (code_call, no_barrier),
}


def main() -> None:
    cpu = "--cpu" in sys.argv  # a smoke run of the script on 2 CPU devices (XLA blocks: nothing to compare)
    rows = [int(t) for t in sys.argv[1:] if t != "--cpu"] or [4, 5, 2]
    heads, head_dim, impl = (4, 16, "xla") if cpu else (multi_gpu.N, multi_gpu.H, None)
    repeats, rounds, round_ms = (2, 2, 0.0) if cpu else (5, 3, multi_gpu.LONG_ROUND_MS)
    print("| call | T | variant | ms | speedup over 1 GPU | compiled | async starts (stream annotations) |\n"
          "|---|---|---|---:|---:|---|---|")
    for row in rows:
        label, scaled, kwargs, docs = multi_gpu.long_call(row, cpu)
        args, _ = multi_gpu.cp_inputs(scaled, heads, head_dim, docs, None, False)
        one = time_ms(multi_gpu.cp_step(kwargs, None, False, impl), *args, repeats=repeats, rounds=rounds,
                      min_round_ms=round_ms)
        print(f"| {label} | {scaled} | 1 GPU | {one:.3f} | | | |", flush=True)
        args, mesh = multi_gpu.cp_inputs(scaled, heads, head_dim, docs, "halo", multi_gpu.WHOLE if docs else False)
        for name, (call, first) in VARIANTS.items():
            halo_split.run_halo_call, halo_split.halo_first = call, first
            with jax.set_mesh(mesh):
                try:
                    step = multi_gpu.cp_step(kwargs, "halo", multi_gpu.WHOLE if docs else False, impl)
                    step = step.lower(*args).compile()
                except Exception as err:  # noqa: BLE001 (a variant XLA cannot compile is a finding)
                    print(f"| {label} | {scaled} | {name} | | | no: {str(err).splitlines()[0][:160]} | |", flush=True)
                    continue
                text = step.as_text()
                ms = time_ms(step, *args, repeats=repeats, rounds=rounds, min_round_ms=round_ms)
            placed = f"{text.count('async-start')} ({text.count('_xla_stream_annotation')})"
            print(f"| {label} | {scaled} | {name} | {ms:.3f} | {one / ms:.3f} | yes | {placed} |", flush=True)
        halo_split.run_halo_call, halo_split.halo_first = code_call, code_first


if __name__ == "__main__":
    main()
