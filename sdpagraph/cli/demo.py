"""`sdpagraph demo`: flex attention end to end on whatever this machine has.

In order, it shows:

1. where each call runs and why: `check_support` for plain causal attention and for a
   softcap+causal score_mod (cuDNN where it supports them, else sdpagraph's XLA backend,
   with the reason);
2. the drop-in check: `sdpagraph.attention(q, k, v, is_causal=True)` against
   `jax.nn.dot_product_attention`, output and gradients (on a GPU both may run the same
   cuDNN kernel, so the same call is also checked against the reference below);
3. accuracy: plain causal and softcap+causal against an independent float64 NumPy
   reference (forward and a hand-written backward), and, where cuDNN runs the score_mod,
   against sdpagraph's XLA backend;
4. forward+backward timings, each labelled with the implementation that ran;
5. the graph cache: its directory and mode, and what this run built or loaded.

Exit 0 when every check is within tolerance ("demo OK"), 1 when one is not, 2 on bad
flags or a bad cache setting.
"""
from __future__ import annotations

import argparse
import time
from typing import Any, Callable

from sdpagraph.deploy.formatting import format_bytes
from sdpagraph.cli.check import add_command_parser, fail
from sdpagraph.config import CACHE_DIR, CACHE_MODE

GPU_DEFAULT_SEQ = 1024
CPU_DEFAULT_SEQ = 256  # the XLA backend materializes B*N*T*T scores: keep the default CPU run short
CPU_WARN_SCORE_BYTES = 256 * 1024**2  # above this (one fp32 scores array), say the CPU run may be slow
SOFTCAP = 30.0
TOLERANCE = {"float32": 1e-4, "bfloat16": 5e-2}


def add_demo_command(subparsers: argparse._SubParsersAction) -> None:
    demo = add_command_parser(
        subparsers, "demo", help="run flex attention end to end (cuDNN on a GPU, else XLA)",
        description="Run flex attention end to end on this machine and say what ran where: which backend "
                    "runs plain causal attention and a softcap+causal score_mod here and why (cuDNN on a GPU "
                    "that supports them, else sdpagraph's XLA backend); check sdpagraph.attention against "
                    "jax.nn.dot_product_attention (the drop-in check) and the score_mod against a float64 NumPy "
                    "reference, output and gradients; time forward+backward; show the graph cache. Exit 0 when "
                    "every check passes (\"demo OK\"), 1 when one fails, 2 on bad flags.")
    demo.add_argument("--seq", type=_positive("--seq"), default=None, metavar="T",
                      help=f"sequence length (default {GPU_DEFAULT_SEQ} on a GPU, {CPU_DEFAULT_SEQ} on CPU, where "
                           "the XLA backend materializes the B*N*T*T scores; any length given is run)")
    demo.add_argument("--batch", type=_positive("--batch"), default=2, metavar="B", help="batch size (default 2)")
    demo.add_argument("--heads", type=_positive("--heads"), default=8, metavar="N", help="attention heads (default 8)")
    demo.add_argument("--head-dim", type=_positive("--head-dim"), default=64, metavar="H",
                      help="head dimension (default 64)")
    demo.add_argument("--repeats", type=_positive("--repeats"), default=5, metavar="R",
                      help="timed runs per measurement, after one untimed run (default 5)")
    demo.set_defaults(handler=lambda args: run_demo(batch=args.batch, seq=args.seq, heads=args.heads,
                                                    head_dim=args.head_dim, repeats=args.repeats))


def _positive(flag: str) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = 0
        if value < 1:
            raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
        return value

    return parse


def run_demo(batch: int = 2, seq: int | None = None, heads: int = 8, head_dim: int = 64, repeats: int = 5) -> int:
    """The demo; `seq=None` picks GPU_DEFAULT_SEQ on a GPU and CPU_DEFAULT_SEQ otherwise."""
    try:
        mode = CACHE_MODE.get()
    except ValueError as error:
        return fail("sdpagraph demo", str(error), as_json=False)
    # Imported here: jax is slow to import, and `sdpagraph cache ...` should start fast.
    import jax
    import jax.numpy as jnp
    import numpy as np

    import sdpagraph
    from sdpagraph import mods

    on_gpu = any(device.platform == "gpu" for device in jax.devices())
    default_note = ""
    if seq is None:
        seq = GPU_DEFAULT_SEQ if on_gpu else CPU_DEFAULT_SEQ
        default_note = f" (the default on {'a GPU' if on_gpu else 'CPU'}; --seq changes it)"
    dtype = jnp.bfloat16 if on_gpu else jnp.float32
    dtype_name = jnp.dtype(dtype).name
    tolerance = TOLERANCE[dtype_name]
    devices = jax.devices()
    print(f"sdpagraph {sdpagraph.__version__} | jax {jax.__version__} | {len(devices)} {devices[0].platform} "
          f"device(s): {devices[0].device_kind}")
    print(f"config: B{batch} T{seq} N{heads} H{head_dim} {dtype_name}{default_note}; gradients of sum(out**2)")
    scores_bytes = batch * heads * seq * seq * 4
    if not on_gpu and scores_bytes > CPU_WARN_SCORE_BYTES:
        print(f"note: T{seq} on CPU is slow: the XLA backend materializes the B*N*T*T scores "
              f"({format_bytes(scores_bytes)} per fp32 array, several in forward+backward), and so does "
              "jax.nn.dot_product_attention")

    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.standard_normal((batch, seq, heads, head_dim)), dtype) for _ in range(3))
    causal = dict(is_causal=True)
    flex = dict(is_causal=True, score_mod=mods.softcap(SOFTCAP))
    flex_label = f"softcap({SOFTCAP:g}) + causal"

    print("\nwhere it runs (sdpagraph.check_support):")
    supports = {}
    for label, kwargs in (("causal", causal), (flex_label, flex)):
        support = supports[label] = sdpagraph.check_support(q, k, v, **kwargs)
        where = "cuDNN" if support.supported else "sdpagraph's XLA backend"
        print(f"  {label:<22} {where}: {support.reason}")
    if not any(support.supported for support in supports.values()):
        print("  (the XLA backend is sdpagraph's own jax.numpy implementation of the same semantics, score_mod "
              "included; on a GPU, cuDNN runs what it supports)")

    def ours(label: str, kwargs: dict, implementation: str | None = None) -> tuple[str, Callable]:
        backend = "xla" if implementation == "xla" else supports[label].backend
        name = f"sdpagraph ({'cuDNN' if backend == 'cudnn' else 'XLA backend'})"
        return name, _loss_and_grads(lambda q, k, v: sdpagraph.attention(q, k, v, implementation=implementation,
                                                                          **kwargs))

    checks: list[tuple[str, list[float]]] = []
    timings: list[tuple[str, list[tuple[str, Callable]]]] = []
    print(f"\nchecks: relative L2 error of out, dq, dk, dv (tolerance {tolerance:g} in {dtype_name}):")

    inputs64 = [np.asarray(x, np.float64) for x in (q, k, v)]
    name, fn = ours("causal", causal)
    jax_name, jax_fn = _jax_reference(q, k, v, on_gpu)
    checks.append((f"drop-in, causal: {name} vs {jax_name}", _compare(fn(q, k, v), jax_fn(q, k, v))))
    checks.append((f"causal: {name} vs float64 NumPy reference",
                   _compare(fn(q, k, v), _numpy_causal_attention(*inputs64, cap=None))))
    timings.append(("causal", [(name, fn), (jax_name, jax_fn)]))

    flex_name, flex_fn = ours(flex_label, flex)
    checks.append((f"{flex_label}: {flex_name} vs float64 NumPy reference",
                   _compare(flex_fn(q, k, v), _numpy_causal_attention(*inputs64, cap=SOFTCAP))))
    flex_timings = [(flex_name, flex_fn)]
    if supports[flex_label].supported:  # cuDNN ran it: also against the XLA backend on the same device
        xla_name, xla_fn = ours(flex_label, flex, implementation="xla")
        checks.append((f"{flex_label}: {flex_name} vs {xla_name}", _compare(flex_fn(q, k, v), xla_fn(q, k, v))))
        flex_timings.append((xla_name, xla_fn))
    timings.append((flex_label, flex_timings))
    for label, errors in checks:
        print(f"  {label}: " + " ".join(f"{error:.2e}" for error in errors))

    runs_text = "1 run" if repeats == 1 else f"{repeats} runs"
    print(f"\nforward+backward (jit, mean of {runs_text} after one untimed run):")
    for label, runs in timings:
        print(f"  {label}: " + " | ".join(f"{name} {_time(fn, q, k, v, repeats=repeats):.2f} ms" for name, fn in runs))

    print()
    _print_cache(mode, used=any(support.supported for support in supports.values()))
    worst = max(max(errors) for _, errors in checks)
    if worst < tolerance:
        print("demo OK")
        return 0
    failed = [label for label, errors in checks if max(errors) >= tolerance]
    print(f"demo FAILED: error {worst:.2e} above the tolerance {tolerance:g} in: {'; '.join(failed)}")
    return 1


def _loss_and_grads(attention: Callable) -> Callable:
    """jit(q, k, v -> (out, (dq, dk, dv))) with the loss sum(out**2) in float32."""
    import jax
    import jax.numpy as jnp

    def loss(q: Any, k: Any, v: Any) -> Any:
        out = attention(q, k, v)
        return jnp.sum(out.astype(jnp.float32) ** 2), out

    grad = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)

    def run(q: Any, k: Any, v: Any) -> Any:
        (_, out), grads = grad(q, k, v)
        return out, grads

    return jax.jit(run)


def _jax_reference(q: Any, k: Any, v: Any, on_gpu: bool) -> tuple[str, Callable]:
    """jax.nn.dot_product_attention with an explicit implementation, so its label says what ran:
    cuDNN on a GPU when JAX's own cuDNN attention takes the call, else XLA."""
    import jax

    for implementation in (("cudnn", "xla") if on_gpu else ("xla",)):
        fn = _loss_and_grads(lambda q, k, v, implementation=implementation: jax.nn.dot_product_attention(
            q, k, v, is_causal=True, implementation=implementation))
        try:
            jax.block_until_ready(fn(q, k, v))
        except Exception:  # noqa: BLE001 - JAX's cuDNN attention declines some shapes and dtypes
            continue
        return f"jax.nn.dot_product_attention (implementation={implementation!r})", fn
    raise RuntimeError("jax.nn.dot_product_attention ran with no implementation")


def _compare(got: Any, want: Any) -> list[float]:
    """Relative L2 errors of (out, (dq, dk, dv)) against the same structure."""
    import numpy as np

    (out, grads), (ref_out, ref_grads) = got, want
    errors = []
    for a, b in zip((out, *grads), (ref_out, *ref_grads)):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        errors.append(float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30)))
    return errors


def _numpy_causal_attention(q: Any, k: Any, v: Any, cap: float | None) -> tuple[Any, tuple[Any, Any, Any]]:
    """float64 reference, written from the definitions: out = softmax(mask(cap * tanh(s / cap))) v
    (without `cap`: softmax(mask(s)) v) with s = q k^T / sqrt(H) and a top-left causal mask;
    gradients of sum(out**2), derived by hand. One (batch, head) at a time: memory stays O(T*S)."""
    import numpy as np

    batch, q_len, heads, head_dim = q.shape
    scale = 1.0 / np.sqrt(head_dim)
    allowed = np.tril(np.ones((q_len, k.shape[1]), bool))
    out, dq, dk, dv = np.zeros_like(q), np.zeros_like(q), np.zeros_like(k), np.zeros_like(v)
    for b in range(batch):
        for n in range(heads):
            qh, kh, vh = q[b, :, n], k[b, :, n], v[b, :, n]
            scores = scale * qh @ kh.T
            t = np.tanh(scores / cap) if cap is not None else None
            logits = np.where(allowed, scores if t is None else cap * t, -np.inf)
            p = np.exp(logits - logits.max(axis=-1, keepdims=True))
            p /= p.sum(axis=-1, keepdims=True)
            o = p @ vh
            do = 2.0 * o  # d sum(out**2) / d out
            dp = do @ vh.T
            ds = p * (dp - np.sum(dp * p, axis=-1, keepdims=True))  # through the softmax
            if t is not None:
                ds *= 1.0 - t**2  # and the softcap
            out[b, :, n], dv[b, :, n] = o, p.T @ do
            dq[b, :, n], dk[b, :, n] = scale * ds @ kh, scale * ds.T @ qh
    return out, (dq, dk, dv)


def _time(fn: Callable, *args: Any, repeats: int = 5) -> float:
    import jax

    jax.block_until_ready(fn(*args))  # compile (and build any cuDNN graph) once
    start = time.perf_counter()
    for _ in range(repeats):
        jax.block_until_ready(fn(*args))
    return (time.perf_counter() - start) / repeats * 1e3


def _print_cache(mode: str, used: bool) -> None:
    directory = CACHE_DIR.get()
    origin = f"from {CACHE_DIR.name}" if CACHE_DIR.raw() else f"the default; {CACHE_DIR.name} changes it"
    mode_origin = f"from {CACHE_MODE.name}" if CACHE_MODE.raw() else f"the default; {CACHE_MODE.name} changes it"
    print(f"graph cache: {directory} ({origin}), mode {mode} ({mode_origin})")
    if not used:
        # Nothing above touched it: cuDNN graphs are built (and cached) only where cuDNN runs.
        print("  not used on this machine: cuDNN graphs are built and cached only where cuDNN runs the call")
        return
    from sdpagraph.cache import default_cache

    stats = default_cache().stats()
    print(f"  this run: {stats['builds']:.0f} graphs built ({stats['build_seconds']:.1f} s), "
          f"{stats['disk_hits']:.0f} loaded from the directory, {stats['memory_entries']} in memory; "
          f"{format_bytes(stats['bytes_on_disk'])} on disk")
    if stats["builds"] and mode == "readwrite":
        print("  run the demo again: its graphs now load from the directory instead of being built")
