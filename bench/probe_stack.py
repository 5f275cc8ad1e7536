"""How fast XLA stacks a key and a value block for the ring's one transfer (`parallel.transfer.paired`),
by formulation, against a plain copy of the same bytes. The ring stacks k and v once a forward; on 2
H100s the stack (`input_concatenate_fusion`) took 0.16 ms at T32768 (256 MB moved: 1.6 TB/s), where a
jitted copy reaches about 2.8 TB/s.

    python3 bench/probe_stack.py [--ts 16384,65536] [--out DIR]

Each formulation is jitted with k and v (B1 T N16 H128 bf16, T tokens: one device's block) as
arguments and returns the stacked (2, ...) array; ms are `jax_timing.time_ms`, GB/s counts the bytes
read and written.
"""
from __future__ import annotations

import argparse
import json
import os

import jax
import jax.numpy as jnp

from jax_timing import time_ms  # bench/ is on sys.path when a script here runs


def formulations() -> dict:
    def flat(k, v):
        return jnp.concatenate([k.reshape(-1), v.reshape(-1)]).reshape((2, *k.shape))

    def updates(k, v):
        out = jnp.empty((2, *k.shape), k.dtype)
        return out.at[0].set(k).at[1].set(v)

    def copy(k, v):  # the same bytes moved, into two arrays: the practical peak
        return k + jnp.zeros((), k.dtype), v + jnp.zeros((), v.dtype)

    return {"jnp.stack": lambda k, v: jnp.stack([k, v]), "flat concatenate": flat, "two updates": updates,
            "copy of both (reference)": copy}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ts", default="16384,65536")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    rows = []
    for t in (int(x) for x in args.ts.split(",")):
        keys = jax.random.split(jax.random.key(0), 2)
        k, v = (jax.random.normal(key, (1, t, 16, 128), jnp.bfloat16) for key in keys)
        moved = 2 * 2 * k.size * k.dtype.itemsize  # read k and v, write both
        for name, fn in formulations().items():
            ms = time_ms(jax.jit(fn), k, v, repeats=50, rounds=5)
            rows.append({"t": t, "form": name, "ms": ms, "gb_s": moved / ms / 1e6})
            print(json.dumps(rows[-1]), flush=True)
    lines = [f"# Stacking k and v: {jax.devices()[0].device_kind}, jax {jax.__version__}", "",
             "| T (one block) | form | ms | GB/s (read + write) |", "|---|---|---:|---:|"]
    lines += [f"| {r['t']} | {r['form']} | {r['ms']:.4f} | {r['gb_s']:.0f} |" for r in rows]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "probe_stack.md"), "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
