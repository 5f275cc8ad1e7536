"""Which in-place form XLA compiles and runs fastest on GPUs for adding the halos' gradients into dk,
dv where they came from (`halo_exchange.add_rows`). Each variant patches that helper, then compiles and
times `bench/multi_gpu.py --part cp-long` halo rows (2 GPUs), beside the same call on one.

    python3 bench/probe_halo_in_place.py [ROW ...]    (LONG_CALLS indexes; default 3 2 5 4)
"""
from __future__ import annotations

import sys

import cp_rows  # first (bench/ is on sys.path when a script here runs): with --cpu it sets up CPU devices
import jax
import jax.numpy as jnp
from jax_timing import time_ms
from sdpagraph.parallel import halo_exchange


split_add = halo_exchange.add_rows  # the code's form, kept before the variants replace it


def dus_add(x, rows, start):
    piece = jax.lax.dynamic_slice_in_dim(x, start, rows.shape[1], axis=1)
    return jax.lax.dynamic_update_slice_in_dim(x, piece + rows.astype(x.dtype), start, axis=1)


def barrier_scatter_add(x, rows, start):  # the form before split_add: copied the whole block
    x, rows = jax.lax.optimization_barrier((x, rows))
    index = jnp.reshape(jnp.asarray(start, jnp.int32), (1,))
    numbers = jax.lax.ScatterDimensionNumbers(update_window_dims=tuple(range(x.ndim)), inserted_window_dims=(),
                                              scatter_dims_to_operand_dims=(1,))
    return jax.lax.scatter_add(x, index, rows.astype(x.dtype), numbers, indices_are_sorted=True,
                               unique_indices=True, mode="promise_in_bounds")


VARIANTS = {  # name: add_rows
    "the code: split add": split_add,
    "barrier scatter-add (the code before)": barrier_scatter_add,
    "DUS-add without barriers": dus_add,
}


def main() -> None:
    cpu = "--cpu" in sys.argv  # a smoke run of the script on 2 CPU devices (XLA blocks: nothing to compare)
    rows = [int(t) for t in sys.argv[1:] if t != "--cpu"] or [3, 2, 5, 4]
    heads, head_dim, impl = (4, 16, "xla") if cpu else (cp_rows.N, cp_rows.H, None)
    print("| call | T | variant | ms | speedup over 1 GPU | compiled |\n|---|---|---|---:|---:|---|")
    for row in rows:
        label, scaled, kwargs, docs = cp_rows.long_call(row, cpu)
        args, _ = cp_rows.cp_inputs(scaled, heads, head_dim, docs, None, False)
        one = time_ms(cp_rows.cp_step(kwargs, None, False, impl), *args, repeats=5, rounds=3)
        print(f"| {label} | {scaled} | 1 GPU | {one:.3f} | | |", flush=True)
        args, mesh = cp_rows.cp_inputs(scaled, heads, head_dim, docs, "halo", False)
        for name, variant in VARIANTS.items():
            halo_exchange.add_rows = variant
            with jax.set_mesh(mesh):
                try:
                    step = cp_rows.cp_step(kwargs, "halo", False, impl).lower(*args).compile()
                except Exception as err:  # noqa: BLE001 (a variant XLA cannot compile is a finding)
                    print(f"| {label} | {scaled} | {name} | | | no: {str(err).splitlines()[0][:160]} |", flush=True)
                    continue
                ms = time_ms(step, *args, repeats=5, rounds=3)
            print(f"| {label} | {scaled} | {name} | {ms:.3f} | {one / ms:.3f} | yes |", flush=True)


if __name__ == "__main__":
    main()
