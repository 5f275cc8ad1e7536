"""Which in-place forms XLA compiles and runs fastest for the halo's joins on GPUs: the halo rows'
results into the block's (`halo_split._in_place`) and the halos' gradients into dk, dv where they
came from (`halo_exchange.add_rows`). Each variant patches those two helpers, then compiles and times
the `bench/multi_gpu.py --part cp-long` window rows on the halo (2 GPUs), beside the same call on one.

    python3 bench/probe_halo_in_place.py [T ...]      (default 32768 131072)
"""
from __future__ import annotations

import sys

import jax
import jax.numpy as jnp

import multi_gpu  # bench/ is on sys.path when a script here runs
from jax_timing import time_ms
from sdpagraph.parallel import halo_exchange, halo_split


barrier_dus = halo_split._in_place  # the code's forms, kept before the variants replace them
barrier_scatter_add = halo_exchange.add_rows


def concat(x, head, axis):
    rest = jax.lax.slice_in_dim(x, head.shape[axis], x.shape[axis], axis=axis)
    return jnp.concatenate([head.astype(x.dtype), rest], axis=axis)


def dus_add(x, rows, start):
    piece = jax.lax.dynamic_slice_in_dim(x, start, rows.shape[1], axis=1)
    return jax.lax.dynamic_update_slice_in_dim(x, piece + rows.astype(x.dtype), start, axis=1)


def barrier_dus_add(x, rows, start):
    x, rows = jax.lax.optimization_barrier((x, rows))
    return dus_add(x, rows, start)


def pad_add(x, rows, start):  # what autodiff's transpose did: the whole block
    return x + jax.lax.dynamic_update_slice_in_dim(jnp.zeros_like(x), rows.astype(x.dtype), start, axis=1)


def scatter_add(x, rows, start):
    index = jnp.reshape(jnp.asarray(start, jnp.int32), (1,))
    numbers = jax.lax.ScatterDimensionNumbers(update_window_dims=tuple(range(x.ndim)), inserted_window_dims=(),
                                              scatter_dims_to_operand_dims=(1,))
    return jax.lax.scatter_add(x, index, rows.astype(x.dtype), numbers, indices_are_sorted=True,
                               unique_indices=True, mode="promise_in_bounds")


VARIANTS = {
    "concat + pad-add (the old passes)": (concat, pad_add),
    "barrier-DUS + scatter-add": (barrier_dus, scatter_add),
    "barrier-DUS + barrier-scatter-add (the code)": (barrier_dus, barrier_scatter_add),
    "barrier-DUS + barrier-DUS-add": (barrier_dus, barrier_dus_add),
    "barrier-DUS + DUS-add": (barrier_dus, dus_add),
    "concat + scatter-add": (concat, scatter_add),
}


def main() -> None:
    cpu = "--cpu" in sys.argv  # a smoke run of the script on 2 CPU devices (XLA blocks: nothing to compare)
    lengths = [int(t) for t in sys.argv[1:] if t != "--cpu"] or [32768, 131072]
    index = {call[1]: i for i, call in enumerate(multi_gpu.LONG_CALLS) if call[0].startswith("window")}
    heads, head_dim, impl = (4, 16, "xla") if cpu else (multi_gpu.N, multi_gpu.H, None)
    print("| T | variant | ms | speedup over 1 GPU | compiled |\n|---|---|---:|---:|---|")
    for length in lengths:
        label, scaled, kwargs, docs = multi_gpu.long_call(index[length], cpu)
        args, _ = multi_gpu.cp_inputs(scaled, heads, head_dim, docs, None, False)
        one = time_ms(multi_gpu.cp_step(kwargs, None, False, impl), *args, repeats=5, rounds=3)
        print(f"| {length} | 1 GPU | {one:.3f} | | |", flush=True)
        args, mesh = multi_gpu.cp_inputs(scaled, heads, head_dim, docs, "halo", False)
        for name, (in_place, add_rows) in VARIANTS.items():
            halo_split._in_place, halo_exchange.add_rows = in_place, add_rows
            with jax.set_mesh(mesh):
                try:
                    step = multi_gpu.cp_step(kwargs, "halo", False, impl).lower(*args).compile()
                except Exception as err:  # noqa: BLE001 (a variant XLA cannot compile is a finding)
                    print(f"| {length} | {name} | | | no: {str(err).splitlines()[0][:160]} |", flush=True)
                    continue
                ms = time_ms(step, *args, repeats=5, rounds=3)
            print(f"| {length} | {name} | {ms:.3f} | {one / ms:.3f} | yes |", flush=True)


if __name__ == "__main__":
    main()
