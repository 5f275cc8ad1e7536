"""Attention dropout and the deterministic backward on cuDNN against the same calls without them.

Side by side in one run. Needs a GPU.

    python bench/training_options.py [--out DIR] [--quick]

Shape: B4 T4096 N16 H128 causal, bf16, one GPU; every array (and the dropout rng) a jit argument.
Times:
- dropout p=0.1, fwd+bwd (jax.grad of sum(out * dO)) against no dropout (issue target: <= 1.10x);
- the deterministic backward (deterministic=True) against the default one (deterministic=False), the
  backward alone: a jit of the pullback that jax.vjp returns, its residuals made once by the forward
  (target: <= 1.15x);
- dropout p=0.1 in the inference forward (training=False) against no dropout, for information.
Reproducibility: dq, dk, dv of the backward run 100 times on the same residuals, deterministic and not:
how many distinct results (compared by checksums of their bits, computed on the GPU).
Prints the tables and writes training_options.md / training_options.json to --out.
"""
from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

import sdpagraph

from jax_timing import time_ms  # bench/ is on sys.path when a script here runs
import report
from report import markdown_table

B, T, N, H = 4, 4096, 16, 128
RATE = 0.1
RUNS = 100  # backward runs counted for reproducibility


def arrays(seed=0):
    """q, k, v and the output cotangent dO, bf16, made on the device."""
    keys = jax.random.split(jax.random.key(seed), 4)
    return [jax.random.normal(key, (B, T, N, H), jnp.bfloat16) for key in keys]


def attend(rate, deterministic=False, training=True):
    return lambda q, k, v, rng: sdpagraph.attention(q, k, v, is_causal=True, implementation="cudnn",
                                                    dropout_rate=rate, dropout_rng=rng, deterministic=deterministic,
                                                    training=training)


def training_step(rate):
    """jit of (dq, dk, dv) of sum(out * dO): the forward and the backward."""
    def loss(q, k, v, d_out, rng):
        return jnp.sum(attend(rate)(q, k, v, rng).astype(jnp.float32) * d_out.astype(jnp.float32))
    return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))


def forward_with_pullback(deterministic):
    """jit of (out, pullback): the pullback holds the forward's residuals and is a pytree, so a jitted
    backward can take it as an argument."""
    return jax.jit(lambda q, k, v, rng: jax.vjp(lambda q, k, v: attend(0.0, deterministic)(q, k, v, rng), q, k, v))


backward = jax.jit(lambda pullback, d_out: pullback(d_out))


def checksums(grads):
    """Two 32-bit checksums of the bits of each gradient, (3, 2) uint32. Integer sums wrap, so they are
    exact and independent of the summation order: equal bits give equal checksums, and different bits
    equal ones only by an unlikely coincidence."""
    sums = []
    for grad in grads:
        bits = jax.lax.bitcast_convert_type(grad, jnp.uint16).astype(jnp.uint32).ravel()
        index = jnp.arange(bits.size, dtype=jnp.uint32)
        sums.append(jnp.stack([jnp.sum(bits * (index * np.uint32(0x9E3779B1) + np.uint32(1))),
                               jnp.sum(bits * (index * np.uint32(0x85EBCA77) + np.uint32(0x165667B1)))]))
    return jnp.stack(sums)


backward_checksums = jax.jit(lambda pullback, d_out: checksums(pullback(d_out)))


def ratio_row(name, baseline, baseline_ms, ms, target):
    ratio = ms / baseline_ms
    return {"row": name, "baseline": baseline, "baseline ms": baseline_ms, "ms": ms, "ratio": ratio,
            "target": f"<= {target:.2f}" if target else "(information)",
            "met": ("yes" if ratio <= target else "no") if target else ""}


def time_rows(x, rng, quick):
    q, k, v, d_out = x
    timing = dict(repeats=5, rounds=3) if quick else dict(repeats=20, rounds=5)
    yield ratio_row(f"dropout p={RATE}, fwd+bwd", "no dropout",
                    time_ms(training_step(0.0), q, k, v, d_out, rng, **timing),
                    time_ms(training_step(RATE), q, k, v, d_out, rng, **timing), 1.10)
    backward_ms = {}
    for deterministic in (False, True):
        _, pullback = forward_with_pullback(deterministic)(q, k, v, rng)
        backward_ms[deterministic] = time_ms(backward, pullback, d_out, **timing)
    yield ratio_row("deterministic=True, backward alone (pullback on the forward's residuals)",
                    "deterministic=False", backward_ms[False], backward_ms[True], 1.15)
    inference = lambda rate: jax.jit(attend(rate, training=False))  # noqa: E731
    yield ratio_row(f"dropout p={RATE}, inference forward (training=False)", "no dropout",
                    time_ms(inference(0.0), q, k, v, rng, **timing), time_ms(inference(RATE), q, k, v, rng, **timing),
                    None)


def reproducibility_row(x, rng, deterministic):
    """Distinct (dq, dk, dv) over RUNS backward runs on the same residuals and cotangent."""
    q, k, v, d_out = x
    _, pullback = forward_with_pullback(deterministic)(q, k, v, rng)
    distinct = {np.asarray(backward_checksums(pullback, d_out)).tobytes() for _ in range(RUNS)}
    return {"row": f"backward deterministic={deterministic}", "runs": RUNS, "distinct dq, dk, dv": len(distinct),
            f"identical over {RUNS} runs": "yes" if len(distinct) == 1 else "no"}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="directory for training_options.md / .json")
    parser.add_argument("--quick", action="store_true", help="fewer timing repeats (the 100 runs stay)")
    args = parser.parse_args()
    device = jax.devices()[0]
    header = (f"device: {device.device_kind}; jax {jax.__version__}; sdpagraph {sdpagraph.__version__}; "
              f"B{B} T{T} N{N} H{H} causal bf16; {'quick' if args.quick else 'full'} run")
    print(header, flush=True)
    results = {"header": header, "times": [], "reproducibility": []}

    def save():
        report.save(args.out, "training_options",
                    f"{header}\n\n" + report.markdown_tables(results, ("times", "reproducibility")), results)

    x, rng = arrays(), jax.random.key(1)
    for row in time_rows(x, rng, args.quick):
        results["times"].append(row)
        print(markdown_table([row]), flush=True)
        save()
    for deterministic in (True, False):
        results["reproducibility"].append(reproducibility_row(x, rng, deterministic))
        print(markdown_table(results["reproducibility"][-1:]), flush=True)
        save()
    print("\n" + "\n\n".join(markdown_table(results[part]) for part in ("times", "reproducibility")), flush=True)


if __name__ == "__main__":
    main()
