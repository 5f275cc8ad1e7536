"""Where a context-parallel step spends its time: one `bench/multi_gpu.py --part cp-long` row (or its
one-GPU baseline) timed, then traced with the JAX profiler, and the trace summarized per device
stream (busy time, the largest kernels, the gaps between them) and per host thread (the longest
host events: synchronizations, conditionals, launches).

    python3 bench/profile_cp.py OUT_DIR ROW STRATEGY[:balanced] [ROW STRATEGY ...]

ROW indexes `cp_rows.LONG_CALLS`; STRATEGY is ring, all_to_all, halo, auto or one (one GPU);
`:balanced` load-balances. Each pair is traced into OUT_DIR/<row>-<strategy>/ and summarized
there (summary.txt) and on stdout.
"""
from __future__ import annotations

import contextlib
import pathlib
import sys

import jax

import cp_rows  # bench/ is on sys.path when a script here runs
from jax_timing import time_ms
from trace_summary import traced

STEPS_TRACED = 6


def profile(out: pathlib.Path, index: int, strategy_arg: str) -> None:
    name, _, balanced = strategy_arg.partition(":")
    strategy, balanced = None if name == "one" else name, balanced == "balanced"
    cpu = jax.default_backend() == "cpu"  # a trial run of this script: the rows scaled down, on XLA
    label, length, kwargs, docs = cp_rows.long_call(index, cpu=cpu)
    heads, head_dim = (4, 16) if cpu else (cp_rows.N, cp_rows.H)
    args, mesh = cp_rows.cp_inputs(length, heads, head_dim, docs, strategy, balanced)
    where = out / f"{index}-{strategy_arg.replace(':', '-')}"
    with jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext():
        step = cp_rows.cp_step(kwargs, strategy, balanced, "xla" if cpu else None).lower(*args).compile()
        ms = time_ms(step, *args, repeats=5, rounds=3)
        header = f"# {label} T{length}, {strategy_arg}: {ms:.3f} ms a step"
        print(header, flush=True)
        text = header + "\n" + traced(where, step, args, STEPS_TRACED)
    (where / "summary.txt").write_text(text + "\n")
    (where / "hlo.txt").write_text(step.as_text())
    print(text, flush=True)


def main() -> None:
    out = pathlib.Path(sys.argv[1])
    pairs = sys.argv[2:]
    for index, strategy in zip(pairs[::2], pairs[1::2]):
        try:
            profile(out, int(index), strategy)
        except Exception as err:  # one row's failure must not lose the others' traces
            print(f"# row {index} {strategy} failed: {type(err).__name__}: {err}", flush=True)


if __name__ == "__main__":
    main()
