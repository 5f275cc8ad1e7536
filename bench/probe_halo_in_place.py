"""The halo's row updates in place (`parallel.row_updates`: the merge of the halo part into the
block's output and logsumexp, dq's sum, dk/dv added where they came from): its Pallas kernels
against XLA's formulation (`SDPAGRAPH_PALLAS_TRITON=0`), on `bench/multi_gpu.py --part cp-long`'s halo
rows (2 GPUs), beside the same call on one GPU, all in one process. Both forms are compiled first,
then timed in turn, rounds of at least `cp_rows.LONG_ROUND_MS`, alternating, so a drift of the
machine weighs on both alike; each form's figure is the median of its rounds.

    python3 bench/probe_halo_in_place.py [ROW ...]    (LONG_CALLS indexes; default 4 5 2 3)
"""
from __future__ import annotations

import os
import re
import statistics
import sys

import cp_rows  # first (bench/ is on sys.path when a script here runs): with --cpu it sets up CPU devices
import jax
from jax_timing import alternating_ms, time_ms
from sdpagraph.config import PALLAS_TRITON

FORMS = {"Pallas row kernels (the code)": None, "XLA's formulation": "0"}  # name: SDPAGRAPH_PALLAS_TRITON
TURNS = 3  # timed turns of each form, alternating


def compiled(step, args, mesh, setting):
    """`step` traced and compiled with SDPAGRAPH_PALLAS_TRITON at `setting` (None: unset), which the
    row updates read when the step is traced."""
    saved = os.environ.pop(PALLAS_TRITON.name, None)
    if setting is not None:
        os.environ[PALLAS_TRITON.name] = setting
    try:
        with jax.set_mesh(mesh):
            return step.lower(*args).compile()
    finally:
        os.environ.pop(PALLAS_TRITON.name, None)
        if saved is not None:
            os.environ[PALLAS_TRITON.name] = saved


OP = re.compile(r"^\s*(?:ROOT )?%?([\w.-]+) = .*? ([\w-]+)\(")
TARGET = re.compile(r'custom_call_target="([^"]+)"')
KINDS = ("custom-call", "collective-permute", "collective-permute-start", "collective-permute-done", "fusion", "copy",
         "copy-start", "copy-done")


def schedule(text: str) -> list[str]:
    """The compiled step's entry computation in its scheduled order: its kernels' names (fusions and
    copies), custom calls (with their targets) and the collectives' starts and ends."""
    entry = text[text.index("\nENTRY"):]
    entry = entry[:entry.index("\n}")]
    order = []
    for line in entry.splitlines()[1:]:
        found = OP.match(line)
        if found and found.group(2) in KINDS:
            target = TARGET.search(line)
            order.append(f"{found.group(2)} {found.group(1)}" + (f" [{target.group(1)}]" if target else ""))
    return order


def main() -> None:
    cpu = "--cpu" in sys.argv  # a smoke run of the script on 2 CPU devices (XLA blocks: nothing to compare)
    rows = [int(t) for t in sys.argv[1:] if t != "--cpu"] or [4, 5, 2, 3]
    heads, head_dim, impl = (4, 16, "xla") if cpu else (cp_rows.N, cp_rows.H, None)
    repeats, round_ms = (2, 0.0) if cpu else (5, cp_rows.LONG_ROUND_MS)
    print("| call | T | form | ms | speedup over 1 GPU | rounds' ms | HLO lines naming Triton |\n|---|---|---|---:|---:|---|---:|")
    for row in rows:
        label, scaled, kwargs, docs = cp_rows.long_call(row, cpu)
        args, _ = cp_rows.cp_inputs(scaled, heads, head_dim, docs, None, False)
        one = time_ms(cp_rows.cp_step(kwargs, None, False, impl), *args, repeats=repeats, rounds=3,
                      min_round_ms=round_ms)
        print(f"| {label} | {scaled} | 1 GPU | {one:.3f} | | | |", flush=True)
        args, mesh = cp_rows.cp_inputs(scaled, heads, head_dim, docs, "halo", False)
        steps = {name: compiled(cp_rows.cp_step(kwargs, "halo", False, impl), args, mesh, setting)
                 for name, setting in FORMS.items()}
        if os.environ.get("OUT"):  # where the transfers sit among the kernels, per form
            for index, (name, step) in enumerate(steps.items()):
                with open(os.path.join(os.environ["OUT"], f"halo_schedule_{row}_{index}.txt"), "w") as f:
                    f.write(f"# {label} T{scaled}, {name}\n" + "\n".join(schedule(step.as_text())) + "\n")
        times = alternating_ms(steps, *args, turns=TURNS, repeats=repeats, min_round_ms=round_ms)
        for name, got in times.items():
            ms = statistics.median(got)
            kernels = sum("triton" in line.lower() for line in steps[name].as_text().splitlines())
            print(f"| {label} | {scaled} | {name} | {ms:.3f} | {one / ms:.3f} | "
                  f"{', '.join(f'{t:.3f}' for t in got)} | {kernels} |", flush=True)


if __name__ == "__main__":
    main()
