"""What a context-parallel step's transfers cost the compute beside them: the step compiled as XLA
compiles it by default (collective-permutes as NCCL send/recv kernels, which take SMs from the
attention kernels they overlap, and spin on them while the other device catches up) against the same
step compiled with `compiler_options={"xla_gpu_use_memcpy_local_p2p": True}` (XLA copies between the
devices of one process with the copy engines instead). `bench/multi_gpu.py --part cp-long`'s rows on
2 GPUs, beside the same call on one GPU, all in one process; both forms compiled first, then timed in
turn, rounds of at least `cp_rows.LONG_ROUND_MS`, alternating, each form's figure the median of its
rounds.

    python3 bench/probe_p2p_copies.py [ROW:STRATEGY[:balanced] ...]   (LONG_CALLS indexes; default 4:halo 5:halo)
"""
from __future__ import annotations

import statistics
import sys

import cp_rows  # first (bench/ is on sys.path when a script here runs): with --cpu it sets up CPU devices
import jax
from jax_timing import alternating_ms, time_ms

FORMS = {"NCCL send/recv (XLA's default)": {}, "copy engines (xla_gpu_use_memcpy_local_p2p)":
         {"xla_gpu_use_memcpy_local_p2p": True}}
TURNS = 3  # timed turns of each form, alternating


def main() -> None:
    cpu = "--cpu" in sys.argv  # a smoke run of the script on 2 CPU devices (XLA blocks, no copy engines)
    rows = [t for t in sys.argv[1:] if t != "--cpu"] or ["4:halo", "5:halo"]
    heads, head_dim, impl = (4, 16, "xla") if cpu else (cp_rows.N, cp_rows.H, None)
    repeats, round_ms = (2, 0.0) if cpu else (5, cp_rows.LONG_ROUND_MS)
    forms = {"default": {}} if cpu else FORMS
    print("| call | T | strategy | form | ms | speedup over 1 GPU | rounds' ms |\n|---|---|---|---|---:|---:|---|")
    for spec in rows:
        index, strategy, *balanced = spec.split(":")
        balanced = bool(balanced)
        label, scaled, kwargs, docs = cp_rows.long_call(int(index), cpu)
        args, _ = cp_rows.cp_inputs(scaled, heads, head_dim, docs, None, False)
        one = time_ms(cp_rows.cp_step(kwargs, None, False, impl), *args, repeats=repeats, rounds=3,
                      min_round_ms=round_ms)
        print(f"| {label} | {scaled} | one GPU | | {one:.3f} | | |", flush=True)
        args, mesh = cp_rows.cp_inputs(scaled, heads, head_dim, docs, strategy, balanced)
        with jax.set_mesh(mesh):
            lowered = cp_rows.cp_step(kwargs, strategy, balanced, impl).lower(*args)
            steps = {name: lowered.compile(compiler_options=options) for name, options in forms.items()}
        times = alternating_ms(steps, *args, turns=TURNS, repeats=repeats, min_round_ms=round_ms)
        for name, got in times.items():
            ms = statistics.median(got)
            print(f"| {label} | {scaled} | {spec.split(':', 1)[1]} | {name} | {ms:.3f} | {one / ms:.3f} | "
                  f"{', '.join(f'{t:.3f}' for t in got)} |", flush=True)


if __name__ == "__main__":
    main()
