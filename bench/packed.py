"""Packed sequences (segment_ids) against the dense rate, side by side in one run. Needs a GPU.

    python bench/packed.py [--out DIR] [--no-flex] [--only "B4 T4096, 4 docs;softcap"] [--batch-sharded]

Per case (bf16, N16 H128, causal): sdpagraph's packed call (cuDNN; the ids are a jit argument, as
in a training step, so the segment check runs: on the device by default, "check raise" with its
host callback, "check off" without any check), the same documents as rows of
their own (dense causal at B*docs x doc length: what the packed call could at best cost), dense
causal over the whole rows (the rate the issue compares with), the packed call's segment
metadata alone (the XLA ops before cuDNN), and FlexAttention with a document block mask. Cases
with a score_mod run on bins (`graphs.binning`); they also time the same call unbinned (the dense
twin over whole rows), without the `max_seqlen_kv` hint (bins of a quarter of a row), and the bins'
layout alone. `--batch-sharded` (2 GPUs): those cases with the batch split over both (a shard_map,
with and without the hint; jit's partitioning, with and without it, and with bins off) against
FlexAttention on half the batch on one GPU.
FlexAttention is compiled anew for each case (`attention.torch_flex_ms`). Prints ms,
real-token TFLOP/s and ratios; writes packed.md / packed.json to --out.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import re

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # leave room for torch

import jax
import jax.numpy as jnp
import numpy as np

import sdpagraph
from sdpagraph.config import BINS, CHECK_SEGMENTS
from sdpagraph.graphs.binning import bin_plan
from sdpagraph.backends.cudnn.bins import packed as packed_bins
from sdpagraph.call import prepare_call
from sdpagraph.segments.metadata import segment_metadata, segment_run_ids

import report  # bench/ is on sys.path when a script here runs
from attention import FLEX_SETUP, torch_flex_ms
from jax_timing import time_ms

N, H = 16, 128


def equal_docs(B, T, docs):
    return np.repeat(np.arange(1, docs + 1, dtype=np.int32), T // docs)[None].repeat(B, axis=0)


def random_docs(B, T, low, high, seed=0):
    """Rows of documents with lengths drawn from [low, high], the last one cut at T."""
    rng = np.random.default_rng(seed)
    ids = np.zeros((B, T), np.int32)
    for b in range(B):
        start, doc = 0, 1
        while start < T:
            length = min(int(rng.integers(low, high + 1)), T - start)
            ids[b, start:start + length] = doc
            start, doc = start + length, doc + 1
    return ids


CASES = [  # (name, ids, score_mod name, max_seqlen_kv hint)
    ("B4 T4096, 4 docs of 1024", lambda: equal_docs(4, 4096, 4), None, None),
    ("B4 T4096, 16 docs of 256", lambda: equal_docs(4, 4096, 16), None, None),
    ("B8 T8192, docs 64-2048", lambda: random_docs(8, 8192, 64, 2048), None, None),
    ("B8 T8192, docs 64-2048, softcap30", lambda: random_docs(8, 8192, 64, 2048), "softcap", 2048),
    ("B4 T8192, docs 64-512, softcap30", lambda: random_docs(4, 8192, 64, 512, seed=1), "softcap", 512),
]


def doc_lengths(ids):
    run = np.asarray(segment_run_ids(jnp.asarray(ids)))
    return [int(np.sum(run[b] == r)) for b in range(run.shape[0]) for r in range(1, run[b].max() + 1)]


def causal_flops(lengths, backward):
    forward = sum(4.0 * N * H * L * L * 0.5 for L in lengths)
    return forward * (3.5 if backward else 1.0)


def softcap(s, b, h, i, j):
    return 30.0 * jnp.tanh(s / 30.0)


def jitted(fn, backward):
    """`fn(q, k, v, *rest)` jitted, or its gradient in q, k, v; every array is an argument (ids too,
    traced as in a training step)."""
    if not backward:
        return jax.jit(fn)
    return jax.jit(jax.grad(lambda q, k, v, *rest: jnp.sum(fn(q, k, v, *rest).astype(jnp.float32)),
                            argnums=(0, 1, 2)))


def with_env(fn, name, value):
    """`fn` traced with the variable `name` set to `value` (binning and the segment check read theirs
    when a call is traced)."""
    def call(*args):
        before = os.environ.get(name)
        os.environ[name] = value
        try:
            return fn(*args)
        finally:
            if before is None:
                del os.environ[name]
            else:
                os.environ[name] = before
    return call


def packing_ms(q, seg, max_segments, hint, score_mod):
    """The bins' layout alone: numbering, sorting and packing the documents, and the index arrays."""
    call = prepare_call(q, q, q, is_causal=True, segment_ids=seg, max_segments_per_seq=max_segments,
                        score_mod=score_mod, max_seqlen_kv=hint)
    plan = bin_plan(call.spec, call.score_mod)
    if plan is None:
        return None
    layout = jax.jit(lambda ids: dataclasses.astuple(packed_bins.lay_out(ids, plan, max_segments, False)))
    return time_ms(layout, seg)


SHARDED = {  # label: (inside a shard_map, with the hint, (variable, value) set while tracing, or None)
    "2 GPUs shard_map": (True, True, None),
    "2 GPUs shard_map no hint": (True, False, None),
    "2 GPUs shard_map check off": (True, True, (CHECK_SEGMENTS.name, "off")),
    "2 GPUs jit": (False, True, None),  # jit's partitioning: bins per device (`bins.partitioned`)
    "2 GPUs jit no hint": (False, False, None),
    "2 GPUs jit bins off": (False, True, (BINS.name, "0")),  # the dense twin per device
}
CHILD = "import sys; sys.path.insert(0, sys.argv[1]); import packed; packed.child_sharded(sys.argv[-1])"


def case_inputs(index):
    """(ids (numpy), q, k, v, ids (jax), most documents in a row) of CASES[index], fresh random inputs
    drawn the same way every time."""
    ids = CASES[index][1]()
    B, T = ids.shape
    rng = np.random.default_rng(1)
    q, k, v = (jnp.asarray(rng.standard_normal((B, T, N, H)), jnp.bfloat16) for _ in range(3))
    return ids, q, k, v, jnp.asarray(ids), int(np.asarray(segment_run_ids(jnp.asarray(ids))).max())


def packed_call(index, max_segments, hinted, training):
    """The case's packed call, with its `max_seqlen_kv` hint or without."""
    _, _, mod, hint = CASES[index]
    return lambda q, k, v, seg: sdpagraph.attention(
        q, k, v, is_causal=True, segment_ids=seg, max_segments_per_seq=max_segments,
        score_mod=softcap if mod else None, max_seqlen_kv=hint if hinted else None, implementation="cudnn",
        training=training)


def child_sharded(request):
    """One batch-sharded variant (`SHARDED`) of one case, timed in this (child) process: the batch
    split over 2 GPUs, the way training shards it (training=True in both passes). Prints `RESULT`."""
    request = json.loads(request)
    index, backward = request["index"], request["backward"]
    inside, hinted, env = SHARDED[request["label"]]
    _, q, k, v, seg, max_segments = case_inputs(index)
    fn = packed_call(index, max_segments, hinted, True)
    if env is not None:
        fn = with_env(fn, *env)
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("batch",))
    split = jax.sharding.PartitionSpec("batch")
    if inside:
        fn = jax.shard_map(fn, mesh=mesh, in_specs=(split,) * 4, out_specs=split)
    placed = [jax.device_put(x, jax.sharding.NamedSharding(mesh, split)) for x in (q, k, v, seg)]
    print("RESULT " + json.dumps({"ms": time_ms(jitted(fn, backward), *placed)}), flush=True)


def batch_sharded(row, index, backward):
    """Every `SHARDED` variant of the case, each in a process of its own (a crash loses one variant)."""
    from child import run_child

    bench_dir = os.path.dirname(os.path.abspath(__file__))
    for label in SHARDED:
        request = json.dumps({"index": index, "backward": backward, "label": label})
        try:
            row[label + " ms"] = run_child(CHILD, [bench_dir, request], timeout=600, label=label)["ms"]
        except Exception as error:  # record and go on: the child's last line that names an error
            lines = [line for line in str(error).splitlines() if re.search(r"Error|error|Fatal|fault", line)
                     and not line.startswith("For simplicity")]
            row[label + " ms"], row[label + " error"] = None, (lines or [repr(error)])[-1][:400]
        print(label, row[label + " ms"], row.get(label + " error", ""), flush=True)


def run(with_flex, only=None, sharded=False):
    rows = []
    for index, (name, _, mod, hint) in enumerate(CASES):
        if only and not any(part in name for part in only):
            continue
        ids, q, k, v, seg, M = case_inputs(index)
        B, T = ids.shape
        lengths = doc_lengths(ids)
        score_mod = softcap if mod else None
        for backward in (True, False) if sharded else (False, True):  # sharded: the training step first
            row = {"case": name, "pass": "fwd+bwd" if backward else "fwd", "docs": len(lengths), "max per row": M}
            call = functools.partial(packed_call, index, M)
            packed = call(True, backward)
            variants = {  # the ids are a jit argument: the segment check runs on them (on the device)
                "packed": packed,
                "check raise": with_env(packed, CHECK_SEGMENTS.name, "raise"),  # a host callback per call
                "check off": with_env(packed, CHECK_SEGMENTS.name, "off"),
                "dense rows": lambda q, k, v, seg: sdpagraph.attention(
                    q, k, v, is_causal=True, score_mod=score_mod, implementation="cudnn", training=backward),
            }
            if hint is not None:  # on bins by default (graphs.binning): the same call unbinned, side by side,
                variants["unbinned"] = with_env(packed, BINS.name, "0")
                # and without the hint (bins of a quarter of a row; longer documents run unbinned)
                variants["no hint"] = call(False, backward)
            if sharded:  # the batch split over 2 GPUs (the one-GPU table comes from a one-GPU process)
                if hint is None or jax.device_count() < 2 or B % 2:
                    continue
                variants = {}
            for label, fn in variants.items():
                try:
                    row[label + " ms"] = time_ms(jitted(fn, backward), q, k, v, seg)
                except Exception as error:  # record and go on
                    row[label + " ms"], row[label + " error"] = None, f"{type(error).__name__}: {str(error)[:300]}"
            if sharded:
                batch_sharded(row, index, backward)
                if with_flex:  # what each GPU holds, on one GPU
                    row["flex half batch ms"] = torch_flex_ms(B // 2, T, N, H, backward, ids[:B // 2], softcap=bool(mod))
                rows.append(row)
                print(json.dumps(row), flush=True)
                continue
            if len(set(lengths)) == 1:  # equal documents: each as a row of its own, the ideal
                L = lengths[0]
                as_rows = [x.reshape(B * (T // L), L, N, H) for x in (q, k, v)]
                fn = lambda q, k, v: sdpagraph.attention(q, k, v, is_causal=True, score_mod=score_mod,  # noqa: E731
                                                         implementation="cudnn", training=backward)
                row["docs as rows ms"] = time_ms(jitted(fn, backward), *as_rows)
            if not backward:
                meta = jax.jit(lambda ids: (segment_metadata(ids, M), segment_run_ids(ids)))
                row["metadata ms"] = time_ms(meta, seg)
            if not backward and hint is not None:
                row["packing ms"] = packing_ms(q, seg, M, hint, score_mod)
            if with_flex:
                try:
                    row["flex ms"] = torch_flex_ms(B, T, N, H, backward, ids, softcap=bool(mod))
                except Exception as error:
                    row["flex ms"], row["flex error"] = None, f"{type(error).__name__}: {str(error)[:300]}"
            work = causal_flops(lengths, backward)
            row["packed TFLOP/s"] = work / (row["packed ms"] * 1e9) if row.get("packed ms") else None
            dense_work = causal_flops([T] * B, backward)
            row["dense TFLOP/s"] = dense_work / (row["dense rows ms"] * 1e9) if row.get("dense rows ms") else None
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def table(rows):
    fmt = lambda x, spec=".3f": format(x, spec) if isinstance(x, (int, float)) else "n/a"  # noqa: E731
    lines = ["| case | pass | packed ms | check raise ms | check off ms | real-token TFLOP/s | dense TFLOP/s | "
             "packed/dense rate | docs as rows ms | metadata ms | unbinned ms | no hint ms | packing ms | flex ms | "
             "flex/packed | flex/no hint |",
             "|---" * 16 + "|"]
    for r in (r for r in rows if "packed ms" in r):  # the one-GPU rows
        rate = r["packed TFLOP/s"] / r["dense TFLOP/s"] if r.get("packed TFLOP/s") and r.get("dense TFLOP/s") else None
        flex = r["flex ms"] / r["packed ms"] if r.get("flex ms") and r.get("packed ms") else None
        flex_unhinted = r["flex ms"] / r["no hint ms"] if r.get("flex ms") and r.get("no hint ms") else None
        lines.append(f"| {r['case']} | {r['pass']} | {fmt(r.get('packed ms'))} | {fmt(r.get('check raise ms'))} | "
                     f"{fmt(r.get('check off ms'))} | {fmt(r.get('packed TFLOP/s'), '.0f')} | "
                     f"{fmt(r.get('dense TFLOP/s'), '.0f')} | {fmt(rate, '.2f')} | {fmt(r.get('docs as rows ms'))} | "
                     f"{fmt(r.get('metadata ms'))} | {fmt(r.get('unbinned ms'))} | {fmt(r.get('no hint ms'))} | "
                     f"{fmt(r.get('packing ms'))} | {fmt(r.get('flex ms'))} | {fmt(flex, '.2f')} | "
                     f"{fmt(flex_unhinted, '.2f')} |")
    sharded = [r for r in rows if r.get("2 GPUs shard_map ms") or r.get("2 GPUs shard_map error")]
    if sharded:
        lines += ["", "Batch split over 2 GPUs (per device: half the rows; training=True, each variant in a "
                  "process of its own), against FlexAttention on half the batch on one GPU:", "",
                  "| case | pass | shard_map | shard_map no hint | shard_map check off | jit, batch-sharded arguments | "
                  "jit no hint | jit, bins off | flex, half batch | flex/shard_map | flex/no hint | flex/jit | "
                  "flex/jit no hint |", "|---" * 13 + "|"]
        for r in sharded:
            ratio = lambda key: (r["flex half batch ms"] / r[key]  # noqa: E731
                                 if r.get("flex half batch ms") and r.get(key) else None)
            lines.append(f"| {r['case']} | {r['pass']} | " + " | ".join(fmt(r.get(label + " ms")) for label in SHARDED) +
                         f" | {fmt(r.get('flex half batch ms'))} | {fmt(ratio('2 GPUs shard_map ms'), '.2f')} | "
                         f"{fmt(ratio('2 GPUs shard_map no hint ms'), '.2f')} | {fmt(ratio('2 GPUs jit ms'), '.2f')} | "
                         f"{fmt(ratio('2 GPUs jit no hint ms'), '.2f')} |")
            lines += [f"- {r['case']} {r['pass']}, {label}: {r[label + ' error'][-200:]}"
                      for label in SHARDED if r.get(label + " error")]
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default=".")
    parser.add_argument("--no-flex", action="store_true", help="skip FlexAttention (no torch)")
    parser.add_argument("--only", default="", help="cases whose name holds one of these ';'-separated parts")
    parser.add_argument("--batch-sharded", action="store_true",
                        help="2 GPUs: the binned cases with the batch split over both (writes packed_sharded.md)")
    args = parser.parse_args()
    if report.gpu_missing("bench/packed.py"):
        return 2
    rows = run(not args.no_flex, [part for part in args.only.split(";") if part], args.batch_sharded)
    setup = f"bf16 N{N} H{H} causal; dense = causal over whole rows at the same shape; {FLEX_SETUP}"
    report.write(args.out, "packed_sharded" if args.batch_sharded else "packed", setup, table(rows), rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
