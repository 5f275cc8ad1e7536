"""Attention speed, side by side in one run: sdpagraph (cuDNN via FFI) vs jax's cuDNN and XLA
attention, and softcap+causal (alone, and with packed documents) vs PyTorch FlexAttention.
Needs a GPU.

    python bench/attention.py [--out DIR] [--quick]

Prints a table (ms, TFLOP/s, ratios) and writes attention.md / attention.json / attention.png to --out.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # leave room for torch in the same run

import jax
import jax.numpy as jnp
import numpy as np

import sdpagraph
from sdpagraph import mods

from cuda_timing import cuda_event_ms  # bench/ is on sys.path when a script here runs
from jax_timing import time_ms

PLAIN_CASES = [  # (name, B, T, N, K, H, causal)
    ("B4 T4096 N16 H128 causal", 4, 4096, 16, 16, 128, True),
    ("B4 T4096 N16 H128", 4, 4096, 16, 16, 128, False),
    ("B8 T2048 N16 H64 causal", 8, 2048, 16, 16, 64, True),
    ("B1 T8192 N32/K8 H128 causal", 1, 8192, 32, 8, 128, True),
]
SOFTCAP_CASE = ("B4 T4096 N16 H128 softcap30+causal", 4, 4096, 16, 16, 128, True)
# The same with each row packing PACKED_DOCS documents of equal length (segment_ids): the
# document masking of packed training, which cuDNN runs as a dense graph masking by segment bounds.
PACKED_DOCS = 4
PACKED_CASE = (f"B4 T4096 N16 H128 softcap30+causal, {PACKED_DOCS} packed docs", 4, 4096, 16, 16, 128, True)
# The same documents with their length given (max_seqlen_kv): the call runs on bins (`graphs.binning`),
# which it cannot plan for so few documents a row without the hint.
PACKED_HINT = PACKED_CASE[2] // PACKED_DOCS
HINTED_CASE = (PACKED_CASE[0] + f", max_seqlen_kv={PACKED_HINT}",) + PACKED_CASE[1:]


def flops(B, T, N, H, causal, backward, docs=1):
    forward = 4.0 * B * N * T * T * H * (0.5 if causal else 1.0) / docs  # docs: equal packed documents
    return forward * (3.5 if backward else 1.0)  # backward does 2.5x the forward's matmul work




def inputs(B, T, N, K, H, seed=0):
    rng = np.random.default_rng(seed)
    return [jnp.asarray(rng.standard_normal(s), jnp.bfloat16) for s in ((B, T, N, H), (B, T, K, H), (B, T, K, H))]


def jax_fns(attn, backward):
    """`attn(q, k, v, *rest)` jitted, or its gradient in q, k and v; `rest` (segment ids) are jit
    arguments too, as in a training step."""
    if not backward:
        return jax.jit(attn)
    loss = lambda q, k, v, *rest: jnp.sum(attn(q, k, v, *rest).astype(jnp.float32))  # noqa: E731
    return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))


def packed_ids(B, T, docs):
    """(B, T) segment ids: `docs` documents of equal length per row, no padding."""
    return np.repeat(np.arange(1, docs + 1, dtype=np.int32), T // docs)[None].repeat(B, axis=0)


def implementations(causal, score_mod=None, training=True, max_segments=None, max_seqlen_kv=None):
    """Each implementation as fn(q, k, v), or with `max_segments` (packed documents, at most that many a
    row) as fn(q, k, v, segment_ids). training=False for forward-only timing: the inference graph, as
    jax's cuDNN path uses."""
    def packed(ids):
        return {} if max_segments is None else dict(segment_ids=ids[0], max_segments_per_seq=max_segments,
                                                    max_seqlen_kv=max_seqlen_kv)
    impls = {
        "sdpagraph": lambda q, k, v, *ids: sdpagraph.attention(q, k, v, is_causal=causal, implementation="cudnn",
                                                               score_mod=score_mod, training=training, **packed(ids)),
        "xla": lambda q, k, v, *ids: sdpagraph.attention(q, k, v, is_causal=causal, implementation="xla",
                                                         score_mod=score_mod, **packed(ids)),
    }
    if score_mod is None:
        impls["jax-cudnn"] = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=causal,
                                                                          implementation="cudnn")
    return impls


# How FlexAttention runs in these benches, written next to its numbers.
FLEX_SETUP = ("FlexAttention: torch.compile(flex_attention), compiled fresh for each case, block mask built once "
              "per case (create_block_mask), timed with CUDA events")


def torch_flex_ms(B, T, N, H, backward, segment_ids=None, softcap=True, fresh=True):
    """softcap(30)+causal (causal alone with `softcap=False`) through torch.compile(flex_attention),
    timed with CUDA events; with `segment_ids`, also document masking (FlexAttention's block mask
    skips the other documents). `fresh`: compiled anew, as a model of one shape is (torch.compile
    otherwise recompiles a function it has seen at other shapes with dynamic shapes, whose kernels
    are slower: bench/probe_flex_recompile.py)."""
    import torch
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    if fresh:
        torch._dynamo.reset()
    compiled = torch.compile(flex_attention)
    q, k, v = (torch.randn(B, N, T, H, device="cuda", dtype=torch.bfloat16, requires_grad=backward) for _ in range(3))
    if segment_ids is None:
        block_mask = create_block_mask(lambda b, h, qi, ki: qi >= ki, B=None, H=None, Q_LEN=T, KV_LEN=T)
    else:
        docs = torch.from_numpy(segment_ids).to("cuda")
        block_mask = create_block_mask(lambda b, h, qi, ki: (qi >= ki) & (docs[b, qi] == docs[b, ki]),
                                       B=B, H=None, Q_LEN=T, KV_LEN=T)
    score_mod = (lambda s, b, h, qi, ki: 30.0 * torch.tanh(s / 30.0)) if softcap else None

    def step():
        out = compiled(q, k, v, score_mod=score_mod, block_mask=block_mask)
        if backward:
            out.backward(torch.ones_like(out))
        return out

    return cuda_event_ms(step, rounds=5)


COMMAND_BUFFER_FLAGS = "--xla_gpu_enable_command_buffer=CUSTOM_CALL,FUSION --xla_gpu_graph_min_graph_size=1"


def host_overhead_us():
    """Per-call cost at a tiny shape, where the host dominates: back-to-back calls run ahead of the
    GPU, so the time per call is what the host spends. "one-kernel jit" (q + k + v: one fused
    kernel, the same three arguments) is the floor any jitted call pays: JAX dispatch and one
    launch. The executor's own timers split sdpagraph's handler into cuDNN's execute (the
    frontend's variant pack, cuDNN's per-call work and its kernel launch) and the rest, which is
    what sdpagraph itself adds on the host (graph lookup, pointer ordering, stream binding)."""
    from sdpagraph import ffi

    q, k, v = inputs(1, 128, 1, 1, 64)
    repeats, rounds = 200, 5
    result = {"one-kernel jit": time_ms(jax.jit(lambda q, k, v: q + k + v), q, k, v, repeats=repeats, rounds=rounds) * 1e3}
    executor = ffi.load()
    for name, fn in implementations(False, training=False).items():
        if name == "xla":
            continue
        jitted = jax.jit(fn)
        if name != "sdpagraph":
            result[name] = time_ms(jitted, q, k, v, repeats=repeats, rounds=rounds) * 1e3
        else:
            jax.block_until_ready(jitted(q, k, v))  # the graph's one-time deserialization is not timed
            executor.host_timing(True)
            try:
                result[name] = time_ms(jitted, q, k, v, repeats=repeats, rounds=rounds) * 1e3
            finally:
                timing = executor.host_timing(False)
            result["handler runs per call"] = timing.calls / (2 + repeats * rounds)  # time_ms warms up twice
            if result["handler runs per call"] > 0.9:  # under a CUDA graph it only runs to record
                result["cuDNN execute"] = timing.cudnn_execute_ns / timing.calls / 1e3
                result["sdpagraph handler outside cuDNN"] = (timing.handler_ns - timing.cudnn_execute_ns) / timing.calls / 1e3
        result[name + " above the floor"] = result[name] - result["one-kernel jit"]
    result["handler runs per call, 4-layer step"] = handler_runs_in_a_step(executor, q, k, v)
    return result


def handler_runs_in_a_step(executor, q, k, v, layers=4, steps=50):
    """How often the handler runs per attention call inside a jitted step of several layers
    (attention, then a projection): 1 when XLA launches it every time, about 0 when XLA replays the
    step's commands as a CUDA graph (command buffers), where cuDNN's per-call host cost is gone."""
    w = jnp.asarray(np.random.default_rng(1).standard_normal((q.shape[-1], q.shape[-1])) / 8, q.dtype)

    @jax.jit
    def step(x, k, v):
        for _ in range(layers):
            x = sdpagraph.attention(x, k, v, implementation="cudnn", training=False) @ w
        return x

    jax.block_until_ready(step(q, k, v))
    executor.host_timing(True)
    try:
        for _ in range(steps):
            out = step(q, k, v)
        jax.block_until_ready(out)
    finally:
        timing = executor.host_timing(False)
    return timing.calls / (layers * steps)


def host_overhead_rows():
    """host_overhead_us() with XLA's default flags (this process) and with command buffers (CUDA
    graphs) turned on for custom calls and fusions (COMMAND_BUFFER_FLAGS; a fresh process: XLA
    reads its flags once)."""
    rows = [{"XLA flags": "default", **host_overhead_us()}]
    env = dict(os.environ, XLA_FLAGS=(os.environ.get("XLA_FLAGS", "") + " " + COMMAND_BUFFER_FLAGS).strip())
    try:  # a failure here loses this row only, never the run's other results
        child = subprocess.run([sys.executable, __file__, "--host-overhead-only"], env=env, capture_output=True,
                               text=True, timeout=600, check=True)
        rows.append({"XLA flags": COMMAND_BUFFER_FLAGS, **json.loads(child.stdout.strip().splitlines()[-1])})
    except (subprocess.SubprocessError, IndexError, ValueError) as error:
        stderr = getattr(error, "stderr", None) or ""
        print(f"command-buffer host overhead run failed: {error}\n{stderr[-2000:]}", file=sys.stderr)
    return rows


def run(quick):
    rows = []
    cases = PLAIN_CASES[:1] if quick else PLAIN_CASES
    for name, B, T, N, K, H, causal in cases + [SOFTCAP_CASE, PACKED_CASE, HINTED_CASE]:
        score_mod = mods.softcap(30.0) if "softcap" in name else None
        ids = packed_ids(B, T, PACKED_DOCS) if "packed" in name else None
        hint = PACKED_HINT if name == HINTED_CASE[0] else None
        q, k, v = inputs(B, T, N, K, H)
        args = (q, k, v) if ids is None else (q, k, v, jnp.asarray(ids))  # the ids a jit argument
        for backward in (False, True):
            row = {"case": name, "pass": "fwd+bwd" if backward else "fwd"}
            impls = implementations(causal, score_mod, training=backward,
                                    max_segments=None if ids is None else int(ids.max()), max_seqlen_kv=hint)
            for impl, attn in impls.items():
                try:
                    row[impl] = time_ms(jax_fns(attn, backward), *args)
                except Exception as error:  # record and keep measuring the rest
                    row[impl] = None
                    row[impl + "_error"] = f"{type(error).__name__}: {str(error)[:200]}"
            if score_mod is not None:
                try:
                    row["torch-flex"] = torch_flex_ms(B, T, N, H, backward, ids)
                except Exception as error:
                    row["torch-flex"] = None
                    row["torch-flex_error"] = f"{type(error).__name__}: {str(error)[:200]}"
            docs = PACKED_DOCS if ids is not None else 1
            row["tflops"] = flops(B, T, N, H, causal, backward, docs) / (row["sdpagraph"] * 1e9) if row.get("sdpagraph") else None
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows, host_overhead_rows()


def ratio(a, b):
    return f"{a / b:.2f}x" if a and b else "n/a"


def table(rows, overhead):
    lines = ["| case | pass | sdpagraph ms | TFLOP/s | jax-cudnn ms | xla ms | torch-flex ms | jax-cudnn/sdpagraph | xla/sdpagraph | flex/sdpagraph |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    fmt = lambda x: f"{x:.3f}" if x else "n/a"  # noqa: E731
    for r in rows:
        lines.append(f"| {r['case']} | {r['pass']} | {fmt(r.get('sdpagraph'))} | {fmt(r.get('tflops'))} | "
                     f"{fmt(r.get('jax-cudnn'))} | {fmt(r.get('xla'))} | {fmt(r.get('torch-flex'))} | "
                     f"{ratio(r.get('jax-cudnn'), r.get('sdpagraph'))} | {ratio(r.get('xla'), r.get('sdpagraph'))} | "
                     f"{ratio(r.get('torch-flex'), r.get('sdpagraph'))} |")
    lines += ["", "Per-call host cost at B1 T128 N1 H64, us (target: sdpagraph's own host time per call <= 15 us):", ""]
    columns = ["one-kernel jit", "sdpagraph", "jax-cudnn", "sdpagraph above the floor", "jax-cudnn above the floor",
               "cuDNN execute", "sdpagraph handler outside cuDNN", "handler runs per call",
               "handler runs per call, 4-layer step"]
    lines.append("| XLA flags | " + " | ".join(columns) + " |")
    lines.append("|---" * (len(columns) + 1) + "|")
    for r in overhead:
        lines.append(f"| {r['XLA flags']} | " + " | ".join(f"{r[c]:.2f}" if c in r else "n/a" for c in columns) + " |")
    return "\n".join(lines)


def plot(rows, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    impls = ["sdpagraph", "jax-cudnn", "xla", "torch-flex"]
    labels = [f"{r['case']}\n{r['pass']}" for r in rows]
    fig, ax = plt.subplots(figsize=(max(8, 1.4 * len(rows)), 5))
    width = 0.2
    for i, impl in enumerate(impls):
        ax.bar([x + i * width for x in range(len(rows))], [r.get(impl) or 0 for r in rows], width, label=impl)
    ax.set_xticks([x + 1.5 * width for x in range(len(rows))], labels, fontsize=7, rotation=30, ha="right")
    ax.set_ylabel("ms (lower is better)")
    ax.set_yscale("log")
    ax.legend()
    ax.set_title(f"attention, bf16, {jax.devices()[0].device_kind}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default=".")
    parser.add_argument("--quick", action="store_true", help="one plain case + the softcap cases")
    parser.add_argument("--host-overhead-only", action="store_true",
                        help="print host_overhead_us() as one JSON line (run under other XLA_FLAGS)")
    args = parser.parse_args()
    if not [d for d in jax.devices() if d.platform == "gpu"]:
        print("bench/attention.py needs a GPU; none visible", file=sys.stderr)
        return 2
    if args.host_overhead_only:
        print(json.dumps(host_overhead_us()))
        return 0
    rows, overhead = run(args.quick)
    text = table(rows, overhead)
    print(text)
    os.makedirs(args.out, exist_ok=True)
    header = (f"device: {jax.devices()[0].device_kind}; jax {jax.__version__}; date {time.strftime('%Y-%m-%d')}; "
              f"{FLEX_SETUP}\n\n")
    with open(os.path.join(args.out, "attention.md"), "w") as f:
        f.write(header + text + "\n")
    with open(os.path.join(args.out, "attention.json"), "w") as f:
        json.dump({"rows": rows, "host_overhead_us": overhead}, f, indent=1)
    try:
        plot(rows, os.path.join(args.out, "attention.png"))
    except Exception as error:
        print(f"plot skipped: {error}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
