"""Attention sinks on cuDNN: each call with sinks against the same call without, side by side in one
run, cuDNN's own sinks (`sink_token`) and the composition from the logsumexp (SDPAGRAPH_NATIVE_SINKS=0),
their accuracy against the XLA backend in float32, and the JAX alternative a user writes today (the
scores with a sink column concatenated, softmax, the column dropped). Needs a GPU.

    python bench/sinks.py [--out DIR] [--quick]

Rows (bf16, fwd+bwd of sum(out * dO) unless noted; every array, ids included, a jit argument):
gpt-oss layer B2 T8192 N64/K8 H64 causal with the window (128, 0), causal alone, causal + softcap 30,
the first two also as inference (forward, training=False); decode B64 T1 S8192 N64/K8 H64 forward
(inference); packed documents B4 T4096 N16 H128 causal.
Accuracy: the same calls at B1 and T (S) 2048 against `implementation="xla"` on the same inputs in
float32: relative L2 error of out, dq, dk, dv and d sinks. Writes sinks.md / sinks.json to --out.
"""
from __future__ import annotations

import argparse
import os

import jax
import jax.numpy as jnp
import numpy as np

import sdpagraph
from sdpagraph import mods
from sdpagraph.config import NATIVE_SINKS

from jax_timing import time_ms  # bench/ is on sys.path when a script here runs
import report
from report import markdown_table
from packed import random_docs

GPT_OSS = dict(n=64, k=8, h=64)
ROWS = {  # name -> (B, T, S, N, K, H, attention kwargs, forward only)
    "gpt-oss window (128, 0)": (2, 8192, 8192, 64, 8, 64, dict(is_causal=True, local_window_size=(128, 0)), False),
    "gpt-oss causal": (2, 8192, 8192, 64, 8, 64, dict(is_causal=True), False),
    "gpt-oss causal + softcap 30": (2, 8192, 8192, 64, 8, 64, dict(is_causal=True, score_mod=mods.softcap(30.0)),
                                    False),
    "gpt-oss window (128, 0), inference": (2, 8192, 8192, 64, 8, 64, dict(is_causal=True, local_window_size=(128, 0)),
                                          True),
    "gpt-oss causal, inference": (2, 8192, 8192, 64, 8, 64, dict(is_causal=True), True),
    "decode B64 S8192 (forward)": (64, 1, 8192, 64, 8, 64, {}, True),
    "packed documents B4 T4096": (4, 4096, 4096, 16, 16, 128, dict(is_causal=True), False),
}


def arrays(b, t, s, n, k, h, seed=0):
    rng = np.random.default_rng(seed)
    bf16 = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.bfloat16)  # noqa: E731
    return {"q": bf16(b, t, n, h), "k": bf16(b, s, k, h), "v": bf16(b, s, k, h), "d_out": bf16(b, t, n, h),
            "sinks": jnp.asarray(rng.normal(1.0, 1.5, n), jnp.float32)}


def step(kwargs, forward_only, with_sinks, implementation="cudnn", training=None):
    """jit of the call (forward only: inference, or with `training=True` the training forward) or of
    its gradients (q, k, v and the sinks)."""
    def attend(x, ids):
        extra = dict(kwargs, segment_ids=ids) if ids is not None else kwargs
        return sdpagraph.attention(x["q"], x["k"], x["v"], sinks=x["sinks"] if with_sinks else None,
                                   implementation=implementation,
                                   training=not forward_only if training is None else training, **extra)

    if forward_only:
        return jax.jit(attend)

    def loss(x, ids):
        return jnp.sum(attend(x, ids).astype(jnp.float32) * x["d_out"].astype(jnp.float32))

    return jax.jit(jax.grad(loss))


def with_native(native, build):
    """`build()` (a jitted function, traced now) with SDPAGRAPH_NATIVE_SINKS set, read at trace time."""
    previous = os.environ.get(NATIVE_SINKS.name)
    os.environ[NATIVE_SINKS.name] = "1" if native else "0"
    try:
        return build()
    finally:
        if previous is None:
            del os.environ[NATIVE_SINKS.name]
        else:
            os.environ[NATIVE_SINKS.name] = previous


def path_of(x, kwargs, ids, forward_only):
    extra = dict(kwargs, segment_ids=ids) if ids is not None else kwargs
    return sdpagraph.check_support(x["q"], x["k"], x["v"], sinks=x["sinks"], training=not forward_only,
                                   **extra).reason.split("; ")[-1]


def timed_row(name, quick):
    b, t, s, n, k, h, kwargs, forward_only = ROWS[name]
    x = arrays(b, t, s, n, k, h)
    ids = jnp.asarray(random_docs(b, t, 256, 2048)) if "packed" in name else None
    repeats, rounds = (5, 3) if quick else (20, 5)
    row = {"row": name}
    row["without sinks ms"] = time_ms(step(kwargs, forward_only, False), x, ids, repeats=repeats, rounds=rounds)
    if not forward_only:  # the training forward alone (the forward graph, with its stats)
        row["fwd without ms"] = time_ms(step(kwargs, True, False, training=True), x, ids, repeats=repeats,
                                        rounds=rounds)
    for label, native in (("native", True), ("composed", False)):
        def run():
            fn = step(kwargs, forward_only, True)
            return time_ms(fn, x, ids, repeats=repeats, rounds=rounds), path_of(x, kwargs, ids, forward_only)
        ms, how = with_native(native, run)
        row[f"{label} ms"], row[f"{label} path"] = ms, how.removeprefix("sinks: ").split(" (")[0]
        row[f"{label} / without"] = ms / row["without sinks ms"]
        if not forward_only:
            fwd = with_native(native, lambda: time_ms(step(kwargs, True, True, training=True), x, ids,
                                                      repeats=repeats, rounds=rounds))
            row[f"fwd {label} / without"] = fwd / row["fwd without ms"]
    return row


def concatenated_sink_column(x, window):
    """What a JAX user writes today: float32 scores, a sink column, softmax, the column dropped."""
    q, k, v, sinks = x["q"], x["k"], x["v"], x["sinks"]
    b, t, n, h = q.shape
    group = n // k.shape[2]
    kk, vv = jnp.repeat(k, group, axis=2), jnp.repeat(v, group, axis=2)
    scores = jnp.einsum("btnh,bsnh->bnts", q, kk, preferred_element_type=jnp.float32) / np.sqrt(h)
    i, j = jnp.arange(t)[:, None], jnp.arange(t)[None, :]
    allowed = (j <= i) & (j >= i - window)
    scores = jnp.where(allowed, scores, -jnp.inf)
    column = jnp.broadcast_to(sinks[None, :, None, None], (b, n, t, 1))
    p = jax.nn.softmax(jnp.concatenate([scores, column], axis=-1), axis=-1)[..., :-1]
    return jnp.einsum("bnts,bsnh->btnh", p.astype(v.dtype), vv)


def alternative_row(quick):
    """The JAX alternative against sdpagraph on the gpt-oss windowed layer at B1 T4096 (at B1 T8192
    its float32 scores and their gradient ran out of an H100's memory: a 48 GiB buffer)."""
    _, _, _, n, k, h, kwargs, _ = ROWS["gpt-oss window (128, 0)"]
    t = s = 4096
    x = arrays(1, t, s, n, k, h)
    repeats, rounds = (3, 3) if quick else (10, 5)
    loss = lambda x: jnp.sum(concatenated_sink_column(x, 128).astype(jnp.float32) * x["d_out"])  # noqa: E731
    row = {"row": "gpt-oss window (128, 0), B1 T4096: JAX with a sink column vs sdpagraph"}
    try:
        row["jax sink column ms"] = time_ms(jax.jit(jax.grad(loss)), x, repeats=repeats, rounds=rounds)
    except Exception as err:  # noqa: BLE001 (an out-of-memory is a result)
        row["jax sink column ms"] = f"failed: {type(err).__name__}: {str(err).splitlines()[0][:160]}"
    ours = step(kwargs, False, True)
    row["sdpagraph ms"] = time_ms(ours, x, None, repeats=repeats, rounds=rounds)
    if isinstance(row["jax sink column ms"], float):
        row["speedup"] = row["jax sink column ms"] / row["sdpagraph ms"]
    return row


def relative(got, want):
    got, want = (np.asarray(a, np.float64) for a in (got, want))
    return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))


def accuracy_row(name):
    """Relative L2 errors against the XLA backend in float32 at B1, T (S) 2048."""
    _, t, s, n, k, h, kwargs, forward_only = ROWS[name]
    t, s = (1, 2048) if t == 1 else (2048, 2048)
    x = arrays(1, t, s, n, k, h, seed=1)
    ids = jnp.asarray(random_docs(1, t, 256, 1024, seed=1)) if "packed" in name else None
    f32 = {key: a.astype(jnp.float32) for key, a in x.items()}
    want = step(kwargs, forward_only, True, "xla")(f32, ids)
    row = {"row": name}
    for label, native in (("native", True), ("composed", False)):
        got = with_native(native, lambda: step(kwargs, forward_only, True)(x, ids))
        if forward_only:
            row[f"{label} out"] = relative(got, want)
        else:
            for key in ("q", "k", "v", "sinks"):
                row[f"{label} d{key}"] = relative(got[key], want[key])
    if not forward_only:  # the forward too
        out = lambda impl, a: sdpagraph.attention(a["q"], a["k"], a["v"], sinks=a["sinks"],  # noqa: E731
                                                  implementation=impl, segment_ids=ids, **kwargs)
        reference = jax.jit(lambda a: out("xla", a))(f32)
        for label, native in (("native", True), ("composed", False)):
            row[f"{label} out"] = relative(with_native(native, lambda: jax.jit(lambda a: out("cudnn", a))(x)), reference)
    return row


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    device = jax.devices()[0]
    header = (f"device: {device.device_kind}; jax {jax.__version__}; sdpagraph {sdpagraph.__version__}; "
              f"{'quick' if args.quick else 'full'} run")
    print(header, flush=True)
    results = {"header": header, "times": [], "alternative": [], "accuracy": []}

    def save():
        report.save(args.out, "sinks",
                    f"{header}\n\n" + report.markdown_tables(results, ("times", "alternative", "accuracy")), results)

    for name in ROWS:
        results["times"].append(timed_row(name, args.quick))
        print(markdown_table(results["times"][-1:]), flush=True)
        save()
    results["alternative"].append(alternative_row(args.quick))
    print(markdown_table(results["alternative"]), flush=True)
    save()
    for name in ROWS:
        results["accuracy"].append(accuracy_row(name))
        print(markdown_table(results["accuracy"][-1:]), flush=True)
        save()


if __name__ == "__main__":
    main()
