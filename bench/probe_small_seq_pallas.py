"""Probe: can a Pallas (Triton) kernel run the small-sequence forward closer to HBM bandwidth than
the XLA formulation (target: >= 85% of the datasheet's 3.35 TB/s at B30720 T1 S2-16 N16 H128)?

    python bench/probe_small_seq_pallas.py [--quick] [--backend-only]
                                    on a GPU (--quick: a CPU, interpret mode; --backend-only: no sweep
                                    of kernel settings, just sdpagraph's small_seq beside XLA)

One program per block of batch rows and heads reads q, K and V once and writes o: scores over the
S keys, softmax, the weighted sum of values, all in fp32 registers. Prints, per S and kernel
setting, ms and TB/s (q + K + V + o bytes) beside sdpagraph's small_seq backend and XLA, and the
kernel's error against XLA.
"""
from __future__ import annotations

import argparse
import functools
import itertools
import json

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from sdpagraph.backends.pallas_triton import compiler_params

PEAK_TBS = 3.35  # H100 SXM datasheet HBM3


def kernel(q_ref, k_ref, v_ref, o_ref, *, scale):
    """Blocks: q, o (RB, T, NB, H); k, v (RB, S, NB, H)."""
    k = k_ref[...].astype(jnp.float32)
    v = v_ref[...].astype(jnp.float32)
    for t in range(q_ref.shape[1]):
        q = q_ref[:, t, :, :].astype(jnp.float32)  # (RB, NB, H)
        s = jnp.sum(q[:, None, :, :] * k, axis=-1) * scale  # (RB, S, NB)
        p = jnp.exp(s - jnp.max(s, axis=1, keepdims=True))
        o = jnp.sum(p[:, :, :, None] * v, axis=1) / jnp.sum(p, axis=1)[:, :, None]  # (RB, NB, H)
        o_ref[:, t, :, :] = o.astype(o_ref.dtype)


def pallas_attention(q, k, v, *, rows, heads, warps, interpret=False):
    b, t, n, h = q.shape
    s = k.shape[1]
    params = compiler_params(warps, interpret)
    return pl.pallas_call(
        functools.partial(kernel, scale=1.0 / np.sqrt(h)),
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        grid=(b // rows, n // heads),
        in_specs=[pl.BlockSpec((rows, t, heads, h), lambda i, j: (i, 0, j, 0)),
                  pl.BlockSpec((rows, s, heads, h), lambda i, j: (i, 0, j, 0)),
                  pl.BlockSpec((rows, s, heads, h), lambda i, j: (i, 0, j, 0))],
        out_specs=pl.BlockSpec((rows, t, heads, h), lambda i, j: (i, 0, j, 0)),
        compiler_params=params, interpret=interpret)(q, k, v)


def xla_attention(q, k, v):
    return jax.nn.dot_product_attention(q, k, v, implementation="xla")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--backend-only", action="store_true")
    args = parser.parse_args()
    import sdpagraph
    if args.quick:
        shapes, settings = [(4, 1, 2, 4, 16)], [(2, 4, 4)]
    else:
        shapes = [(30720, 1, s, 16, 128) for s in (2, 4, 8, 16)]
        settings = [] if args.backend_only else list(itertools.product((1, 2, 4, 8), (4, 8, 16), (4, 8)))
    from jax_timing import time_ms
    rows_out = []
    for b, t, s, n, h in shapes:
        rng = np.random.default_rng(0)
        q = jnp.asarray(rng.standard_normal((b, t, n, h)), jnp.bfloat16)
        k, v = (jnp.asarray(rng.standard_normal((b, s, n, h)), jnp.bfloat16) for _ in range(2))
        nbytes = 2 * (2 * q.size + k.size + v.size)
        want = np.asarray(jax.jit(xla_attention)(q, k, v), np.float32)
        base = {}
        if not args.quick:
            base["xla"] = time_ms(jax.jit(xla_attention), q, k, v)
            base["small_seq"] = time_ms(jax.jit(functools.partial(sdpagraph.attention, implementation="small_seq")),
                                        q, k, v)
            print(json.dumps({"S": s, **base, **{f"{name} TB/s": nbytes / value / 1e9 for name, value in base.items()},
                              **{f"{name} % peak": 100 * nbytes / value / 1e9 / PEAK_TBS
                                 for name, value in base.items()}}), flush=True)
        for rows, heads, warps in settings:
            if b % rows or n % heads or rows * s * heads * h > 32768:
                continue
            fn = jax.jit(functools.partial(pallas_attention, rows=rows, heads=heads, warps=warps,
                                           interpret=args.quick))
            try:
                got = np.asarray(fn(q, k, v), np.float32)
                error = float(np.linalg.norm(got - want) / np.linalg.norm(want))
                ms = None if args.quick else time_ms(fn, q, k, v)
            except Exception as failure:  # record and go on
                rows_out.append({"S": s, "rows": rows, "heads": heads, "warps": warps,
                                 "error": f"{type(failure).__name__}: {str(failure)[:200]}"})
                print(json.dumps(rows_out[-1]), flush=True)
                continue
            row = {"S": s, "rows": rows, "heads": heads, "warps": warps, "rel err vs xla": error, "ms": ms, **base}
            if ms:
                row["TB/s"] = nbytes / ms / 1e9
                row["% peak"] = 100 * row["TB/s"] / PEAK_TBS
                for name, value in base.items():
                    row[f"{name} TB/s"] = nbytes / value / 1e9
            rows_out.append(row)
            print(json.dumps(row), flush=True)
    best = {}
    for row in rows_out:
        if row.get("ms") and (row["S"] not in best or row["ms"] < best[row["S"]]["ms"]):
            best[row["S"]] = row
    for s, row in sorted(best.items()):
        print(f"S{s}: best pallas {row['ms']:.3f} ms {row['TB/s']:.2f} TB/s ({row['% peak']:.1f}% of peak) "
              f"rows {row['rows']} heads {row['heads']} warps {row['warps']} | small_seq {row['small_seq']:.3f} ms "
              f"({row['small_seq TB/s']:.2f} TB/s) | xla {row['xla']:.3f} ms ({row['xla TB/s']:.2f} TB/s) | "
              f"err {row['rel err vs xla']:.1e}")


if __name__ == "__main__":
    main()
