"""jax.numpy score_mods and mask_mods against their graph-mod / native-flag twins, side by side in
one run (target: the jnp form within 3% of the twin's time, fwd and fwd+bwd). Needs a GPU.

    python bench/jnp_mods.py [--out DIR] [--shape B,T,N,H]

Each pair is timed alternately, round after round, so that clock drift hits both alike; the
table gives the backend `check_support` chose for the jnp form, both times, their ratio, and the
relative difference of the two outputs. Writes jnp_mods.md / jnp_mods.json to --out.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

import sdpagraph
from sdpagraph import mods

import report  # bench/ is on sys.path when a script here runs

WINDOW = 255


def pairs(N):
    """(name, jnp-form kwargs, twin kwargs): the same attention written both ways."""
    slopes = np.asarray(np.random.default_rng(7).random(N) * 0.1, np.float32)
    slopes_j = jnp.asarray(slopes)
    return [
        ("softcap30+causal",
         dict(score_mod=lambda s, b, h, i, j: 30.0 * jnp.tanh(s / 30.0), is_causal=True),
         dict(score_mod=mods.softcap(30.0), is_causal=True)),
        ("ALiBi+causal",
         dict(score_mod=lambda s, b, h, i, j: s + slopes_j[h] * (j - i), mask_mod=lambda b, h, i, j: i >= j),
         dict(score_mod=mods.compose(mods.alibi(slopes), mods.causal()))),
        ("causal mask_mod",
         dict(mask_mod=lambda b, h, i, j: i >= j),
         dict(is_causal=True)),
        (f"window({WINDOW},0) mask_mod",
         dict(mask_mod=lambda b, h, i, j: (i >= j) & (i - j <= WINDOW)),
         dict(local_window_size=(WINDOW, 0))),
    ]


def jitted(kwargs, backward):
    def forward(q, k, v):
        return sdpagraph.attention(q, k, v, implementation="cudnn", training=backward, **kwargs)

    if not backward:
        return jax.jit(forward)
    loss = lambda q, k, v: jnp.sum(forward(q, k, v).astype(jnp.float32))  # noqa: E731
    return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))


def alternate_ms(fns, args, repeats=20, rounds=9):
    """Median per-call ms of each fn, timing them in turn each round (after two warm-up calls each)."""
    for fn in fns:
        jax.block_until_ready(fn(*args))
        jax.block_until_ready(fn(*args))
    samples = [[] for _ in fns]
    for _ in range(rounds):
        for fn, times in zip(fns, samples):
            start = time.perf_counter()
            for _ in range(repeats):
                out = fn(*args)
            jax.block_until_ready(out)
            times.append((time.perf_counter() - start) / repeats * 1e3)
    return [statistics.median(times) for times in samples]


def rel_diff(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def run(B, T, N, H):
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.standard_normal((B, T, N, H)), jnp.bfloat16) for _ in range(3))
    rows = []
    for name, jnp_kwargs, twin_kwargs in pairs(N):
        support = sdpagraph.check_support(q, k, v, **jnp_kwargs)
        diff = rel_diff(jitted(jnp_kwargs, False)(q, k, v), jitted(twin_kwargs, False)(q, k, v)) \
            if support.backend == "cudnn" else None
        for backward in (False, True):
            row = {"case": name, "pass": "fwd+bwd" if backward else "fwd", "jnp backend": support.backend,
                   "reason": support.reason, "out rel diff": diff}
            if support.backend == "cudnn":
                row["jnp ms"], row["twin ms"] = alternate_ms([jitted(jnp_kwargs, backward),
                                                              jitted(twin_kwargs, backward)], (q, k, v))
                row["ratio"] = row["jnp ms"] / row["twin ms"]
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def table(rows):
    fmt = lambda x, spec: format(x, spec) if x is not None else "n/a"  # noqa: E731
    lines = ["| case | pass | jnp form on | jnp ms | twin ms | jnp/twin | out rel diff |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['case']} | {r['pass']} | {r['jnp backend']} | {fmt(r.get('jnp ms'), '.3f')} | "
                     f"{fmt(r.get('twin ms'), '.3f')} | {fmt(r.get('ratio'), '.3f')} | {fmt(r.get('out rel diff'), '.1e')} |")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default=".")
    parser.add_argument("--shape", default="4,4096,16,128", help="B,T,N,H (bf16, self-attention)")
    args = parser.parse_args()
    if report.gpu_missing("bench/jnp_mods.py"):
        return 2
    B, T, N, H = (int(x) for x in args.shape.split(","))
    rows = run(B, T, N, H)
    report.write(args.out, "jnp_mods", f"B{B} T{T} N{N} H{H} bf16; twin = graph mod (mods.*) or native flag",
                 table(rows), rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
