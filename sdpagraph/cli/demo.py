"""`sdpagraph demo`: flex attention end to end on whatever this machine has.

It asks `check_support` whether a softcap+causal score_mod runs on cuDNN here (and
why not, if it does not), runs forward and backward through `attention`, checks the
result against the XLA reference backend, and times both.
"""
from __future__ import annotations

import argparse
import time


def add_demo_command(subparsers: argparse._SubParsersAction) -> None:
    demo = subparsers.add_parser("demo", help="run flex attention end to end (cuDNN on a GPU, else XLA)")
    demo.add_argument("--seq", type=int, default=1024, help="sequence length (capped at 256 without a GPU)")
    demo.set_defaults(handler=lambda args: run_demo(seq=args.seq))


def _time(fn, *args, repeats: int = 5) -> float:
    import jax

    jax.block_until_ready(fn(*args))  # compile (and build the cuDNN graph) once
    start = time.perf_counter()
    for _ in range(repeats):
        jax.block_until_ready(fn(*args))
    return (time.perf_counter() - start) / repeats * 1e3


def run_demo(batch: int = 2, seq: int = 1024, heads: int = 8, head_dim: int = 64) -> int:
    # Imported here: jax is slow to import, and `sdpagraph cache ...` should start fast.
    import jax
    import jax.numpy as jnp
    import numpy as np

    import sdpagraph
    from sdpagraph import mods

    on_gpu = bool([d for d in jax.devices() if d.platform == "gpu"])
    if not on_gpu:
        seq = min(seq, 256)  # keep the CPU run short
    dtype = jnp.bfloat16 if on_gpu else jnp.float32
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.standard_normal((batch, seq, heads, head_dim)), dtype) for _ in range(3))
    kwargs = dict(score_mod=mods.softcap(30.0), is_causal=True)
    print(f"sdpagraph {sdpagraph.__version__} | jax {jax.__version__} | devices: {jax.devices()}")
    print(f"config: B{batch} T{seq} N{heads} H{head_dim} {jnp.dtype(dtype).name}, softcap(30) + causal")

    support = sdpagraph.check_support(q, k, v, **kwargs)
    print(f"check_support: supported={support.supported} backend={support.backend}")
    print(f"  reason: {support.reason}")

    def loss(impl):
        return jax.jit(jax.value_and_grad(
            lambda q, k, v: jnp.sum(sdpagraph.attention(q, k, v, implementation=impl, **kwargs).astype(jnp.float32) ** 2),
            argnums=(0, 1, 2)))

    chosen, reference = loss(None), loss("xla")
    (value, grads), (value_ref, grads_ref) = chosen(q, k, v), reference(q, k, v)
    errors = [float(jnp.linalg.norm((a - b).astype(jnp.float32)) / jnp.linalg.norm(b.astype(jnp.float32)))
              for a, b in zip((value, *grads), (value_ref, *grads_ref))]
    print(f"{support.backend} vs XLA reference: relative error loss {errors[0]:.2e}, "
          f"dq {errors[1]:.2e}, dk {errors[2]:.2e}, dv {errors[3]:.2e}")
    if not support.supported:
        print("  (both ran on XLA here; as a drop-in check, plain causal attention against "
              "jax.nn.dot_product_attention:)")
        ours = sdpagraph.attention(q, k, v, is_causal=True)
        theirs = jax.nn.dot_product_attention(q, k, v, is_causal=True)
        errors.append(float(jnp.linalg.norm((ours - theirs).astype(jnp.float32)) /
                            jnp.linalg.norm(theirs.astype(jnp.float32))))
        print(f"  relative error {errors[-1]:.2e}")
    print(f"forward+backward: {support.backend} {_time(chosen, q, k, v):.2f} ms, xla {_time(reference, q, k, v):.2f} ms")
    tolerance = 5e-2 if dtype == jnp.bfloat16 else 1e-4
    ok = max(errors) < tolerance
    print("demo OK" if ok else f"demo FAILED: error above {tolerance}")
    return 0 if ok else 1
