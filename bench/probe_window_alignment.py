"""Whether one cuDNN call can run a halo block of a causal sliding window at the one-device graph's
speed: a block's L queries over [its left halo of W keys ++ its own L keys] (T = L, S = W + L).

`halo_split` runs such a block as two square top-left calls (the local part and the halo's band) and
merges them, because the one call with the window relative to the bottom-right diagonal ran 10x
slower on 2 H200s. The same mask is the band (0, W) around the TOP-LEFT diagonal without a causal
mask: query i keeps keys i .. i + W of the concatenation. This probe times, fwd+bwd on one GPU
(B1 N16 H128 bf16, W = 1024), each form's cuDNN calls back to back, and checks that the top-left
band's output matches the bottom-right window's.

    python3 bench/probe_window_alignment.py [L ...]    (default 16384 65536)
"""
from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import numpy as np

from jax_timing import time_ms  # bench/ is on sys.path when a script here runs
from sdpagraph.backends import registry
from sdpagraph.call import RuntimeInputs
from sdpagraph.spec import UNBOUNDED, AttentionSpec

N, H, W = 16, 128, 1024


def spec(q_len, kv_len, causal, alignment, window):
    return AttentionSpec(batch=1, q_len=q_len, kv_len=kv_len, num_heads=N, num_kv_heads=N, head_dim=H, head_dim_v=H,
                         dtype="bfloat16", scale=H ** -0.5, is_causal=causal, causal_alignment=alignment,
                         window=window)


def step(specs):
    """jit of each (spec, q rows, k rows) call's forward then backward, back to back: (q, k, v, dO) ->
    each call's (output, (dq, dk, dv))."""
    primary = registry.primary()

    def run(q, k, v, d_o):
        results = []
        for s, q_rows, kv_rows in specs:
            static = primary.block_static(s, None, {})
            ops = primary.block_operands(static, RuntimeInputs())
            qs, ks, vs, dos = q[:, q_rows], k[:, kv_rows], v[:, kv_rows], d_o[:, q_rows]
            out, lse = primary.block_forward(static, qs, ks, vs, ops, True)
            results.append((out, primary.block_backward(static, qs, ks, vs, ops, out, lse, dos, True)))
        return results

    return jax.jit(run)


def main() -> None:
    lengths = [int(t) for t in sys.argv[1:]] or [16384, 65536]
    print("| L | form | calls | ms fwd+bwd | over the local call |\n|---|---|---|---:|---:|")
    for length in lengths:
        rng = np.random.default_rng(0)
        q, k, v, d_o = (jnp.asarray(rng.standard_normal((1, W + length, N, H)), jnp.bfloat16) for _ in range(4))
        own, halo, every = slice(W, W + length), slice(0, W), slice(0, W + length)
        forms = {
            "local part alone: T = S = L, causal window (W, 0) top-left": [
                (spec(length, length, True, "top_left", (W, 0)), own, own)],
            "split: the local part + the halo's band (0, unbounded) T = S = W": [
                (spec(length, length, True, "top_left", (W, 0)), own, own),
                (spec(W, W, False, "top_left", (0, UNBOUNDED)), slice(W, 2 * W), halo)],
            "one call: band (0, W) top-left, no causal mask, T = L, S = W + L": [
                (spec(length, W + length, False, "top_left", (0, W)), own, every)],
            "one call: causal window (W, 0) bottom-right, T = L, S = W + L": [
                (spec(length, W + length, True, "bottom_right", (W, 0)), own, every)],
        }
        base, outs = None, {}  # base: the local part's time (the first form)
        for name, specs in forms.items():
            try:
                fn = step(specs)
                results = jax.block_until_ready(fn(q, k, v, d_o))
            except Exception as err:  # noqa: BLE001 (a form cuDNN does not build is a finding)
                print(f"| {length} | {name} | {len(specs)} | no: {str(err).splitlines()[0][:160]} | |", flush=True)
                continue
            outs[name] = results[0]
            ms = time_ms(fn, q, k, v, d_o, repeats=20, rounds=5, min_round_ms=100.0)
            if name.startswith("local part"):
                base = ms
            ratio = f"{ms / base:.3f}" if base else ""
            print(f"| {length} | {name} | {len(specs)} | {ms:.3f} | {ratio} |", flush=True)
        one_calls = [n for n in outs if n.startswith("one call")]
        if len(one_calls) == 2:
            (o1, g1), (o2, g2) = outs[one_calls[0]], outs[one_calls[1]]
            diff = max(float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32))))
                       for a, b in zip((o1, *g1), (o2, *g2)))
            print(f"\nL={length}: top-left band against bottom-right window, largest |difference| of out, dq, dk, dv: "
                  f"{diff:.3g}\n", flush=True)


if __name__ == "__main__":
    main()
