"""Two questions about what a score_mod or the sinks add to a cuDNN step, on one GPU.

1. Softcap + causal (B4 T4096 N16 H128 bf16): how the softcap's formulation changes the forward and
   fwd+bwd times against causal alone: `cap * tanh(s / cap)` (a division per score, as
   `mods.softcap` writes it), `cap * tanh(s * (1 / cap))` (a multiplication), and, with
   `--tanh-from-output`, the derived backward reading the forward's tanh (`1 - t * t`) instead of
   cuDNN's tanh backward, which evaluates tanh again. Run each rule in its own process with its own
   graph cache: the backward rule is not part of the cache key.
2. `--sinks`: the gpt-oss window row of bench/sinks.py (B2 T8192 N64/K8 H64, causal, window
   (128, 0)), fwd+bwd with and without sinks, traced (bench/trace_summary.py) to show what the sinks
   add.

    python3 bench/probe_softcap_sinks.py OUT_DIR [--tanh-from-output] [--sinks]
"""
from __future__ import annotations

import argparse
import pathlib

import jax
import jax.numpy as jnp
import numpy as np

import sdpagraph
from sdpagraph import mods
from sdpagraph.scoremod import ir_grad

from jax_timing import time_ms  # bench/ is on sys.path when a script here runs
from trace_summary import traced

CAP = 30.0
SCALE = 1 / np.sqrt(128)
# name -> (score_mod, extra attention arguments). The last forms tell where the cost is: any mod at
# all (a min, a multiply), tanh through a sigmoid, and the attention scale folded into 1/cap.
FORMS = {
    "causal": (None, {}),
    "mods.softcap (s / cap)": (mods.softcap(CAP), {}),
    "jnp cap * tanh(s / cap)": (lambda s, b, h, q, kv: CAP * jnp.tanh(s / CAP), {}),
    "jnp cap * tanh(s * (1 / cap))": (lambda s, b, h, q, kv: CAP * jnp.tanh(s * (1.0 / CAP)), {}),
    "jnp min(s, cap) (one cheap op)": (lambda s, b, h, q, kv: jnp.minimum(s, CAP), {}),
    "jnp s * 0.5 (one multiply)": (lambda s, b, h, q, kv: s * 0.5, {}),
    "jnp 2 cap sigmoid(2 s / cap) - cap": (lambda s, b, h, q, kv: 2 * CAP * jax.nn.sigmoid(s * (2 / CAP)) - CAP, {}),
    "jnp cap * tanh(s), scale / cap": (lambda s, b, h, q, kv: CAP * jnp.tanh(s), {"scale": SCALE / CAP}),
    "jnp tanh(s) only, scale / cap (not softcap)": (lambda s, b, h, q, kv: jnp.tanh(s), {"scale": SCALE / CAP}),
}


def softcap_rows() -> None:
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.standard_normal((4, 4096, 16, 128)), jnp.bfloat16) for _ in range(3))
    for name, (mod, extra) in FORMS.items():
        attend = lambda q, k, v, mod=mod, extra=extra: sdpagraph.attention(  # noqa: E731
            q, k, v, is_causal=True, score_mod=mod, implementation="cudnn", **extra)
        forward = jax.jit(attend)
        both = jax.jit(jax.grad(lambda q, k, v: jnp.sum(attend(q, k, v).astype(jnp.float32)), argnums=(0, 1, 2)))
        try:
            fwd = time_ms(forward, q, k, v, repeats=20, rounds=5)
            fwd_bwd = time_ms(both, q, k, v, repeats=20, rounds=5)
        except ValueError as error:  # a form cuDNN has no engine for is a finding
            print(f"| {name} | {' '.join(str(error).split())[-90:]} | |", flush=True)
            continue
        print(f"| {name} | {fwd:.3f} | {fwd_bwd:.3f} |", flush=True)


def sinks_rows(out: pathlib.Path) -> None:
    import sinks  # bench/sinks.py

    b, t, s, n, k, h, kwargs, _ = sinks.ROWS["gpt-oss window (128, 0)"]
    x = sinks.arrays(b, t, s, n, k, h)
    for with_sinks in (False, True):
        step = sinks.step(kwargs, False, with_sinks)
        ms = time_ms(step, x, None, repeats=20, rounds=5)
        label = "with sinks" if with_sinks else "without sinks"
        print(f"# gpt-oss window (128, 0) fwd+bwd {label}: {ms:.3f} ms", flush=True)
        print(traced(out / label.replace(" ", "-"), step, (x, None), 5), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=pathlib.Path)
    parser.add_argument("--tanh-from-output", action="store_true")
    parser.add_argument("--sinks", action="store_true")
    args = parser.parse_args()
    if args.sinks:
        sinks_rows(args.out)
        return
    if args.tanh_from_output:  # d tanh(x) = dy * (1 - y * y), y the forward's tanh
        ir_grad._RULES["tanh"] = lambda e, g, y, x: (e.mul(g, e.sub(1.0, e.mul(y, y))),)
    print(f"softcap {CAP} + causal, B4 T4096 N16 H128 bf16, tanh backward "
          f"{'from the forward output' if args.tanh_from_output else 'by cuDNN (tanh_backward)'}")
    print("| form | fwd ms | fwd+bwd ms |\n|---|---|---|")
    softcap_rows()


if __name__ == "__main__":
    main()
