"""Data, head and context parallelism on two GPUs: a jitted causal fwd+bwd step (B8 T4096 N16 H128 bf16)
sharded over 2 GPUs, against the per-device shape on one GPU, for sdpagraph (with its SPMD
partitioning, and without it: the 'before' row) and jax's cuDNN attention, side by side in one run;
and context parallelism (`--part cp`): B1 T65536 N16 H128 causal fwd+bwd (and with a softcap
score_mod), ring with load balancing over 2 GPUs against 1 GPU, and ring against all-to-all at T 16k
and 64k, the table behind `context_parallel_strategy="auto"`; and long context (`--part cp-long`,
LONG_CALLS): packed documents, sliding windows, softcap with documents, chunked attention and dense
causal at T 32k-128k, B1 N16 H128, on one GPU and on 2 GPUs with each strategy (ring, all_to_all,
halo, auto), with peak device memory per GPU for the packed T131072 rows (a child process per row).

    python3 bench/multi_gpu.py --out DIR [--quick] [--part dp|cp|all|cp-long] [--only TEXT ...]
    python3 bench/multi_gpu.py --cpu --part cp     # the rows' code on 2 CPU devices, tiny shapes
    python3 bench/multi_gpu.py --cpu --part cp-long --out DIR

Prints a markdown table (step time, ratio to the per-device shape on one GPU, all-gathers in the
compiled HLO, output sharding) and writes multi_gpu.md and multi_gpu.json to DIR, after every row
(a run cut short keeps its rows). Times: median over rounds of the mean of back-to-back steps,
synchronised with block_until_ready.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import re
import sys
from datetime import date

if "--cpu" in sys.argv:  # before jax starts: two CPU devices stand in for the GPUs
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2"
    os.environ["JAX_PLATFORMS"] = "cpu"

import jax
import jax_timing  # bench/ is on sys.path when a script here runs
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import sdpagraph
from sdpagraph.config import PARTITION

B, T, N, H = 8, 4096, 16, 128
CP_T, CP_SHORT_T = 65536, 16384  # context parallelism: B1 N16 H128
# GPUs the context-parallel rows of `--part cp-long` split the sequence over (CP_DEVICES=4 on a 4-GPU machine).
CP_DEVICES = int(os.environ.get("CP_DEVICES", "2"))
GATHER = re.compile(r"\ball-gather(?:-start)?\(")
ALL_TO_ALL = re.compile(r"\ball-to-all(?:-start)?\(")
PERMUTE = re.compile(r"\bcollective-permute(?:-start)?\(")


def step_fn(impl):
    """jit(grad) of sum(attention(q, k, v)): one causal forward and backward."""
    def attn(q, k, v):
        if impl == "jax-cudnn":
            return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")
        return sdpagraph.attention(q, k, v, is_causal=True, implementation="cudnn")

    return jax.jit(jax.grad(lambda q, k, v: jnp.sum(attn(q, k, v).astype(jnp.float32)), argnums=(0, 1, 2)))


def inputs(batch, heads, placement):
    rng = np.random.default_rng(0)
    host = [rng.standard_normal((batch, T, heads, H)).astype(np.float32) for _ in range(3)]
    return [jax.device_put(jnp.asarray(x, jnp.bfloat16), placement) for x in host]


def time_ms(fn, args, repeats, rounds, min_round_ms=0.0):
    return jax_timing.time_ms(fn, *args, repeats=repeats, rounds=rounds, min_round_ms=min_round_ms)


def measure(impl, batch, heads, placement, repeats, rounds, partition=True):
    """(ms per step, all-gathers, all-to-alls, the output's sharding) of one row. The step is traced
    and compiled here, under SDPAGRAPH_PARTITION=0 for the 'before' row (read at trace time)."""
    args = inputs(batch, heads, placement)
    previous = os.environ.get(PARTITION.name)
    os.environ[PARTITION.name] = "1" if partition else "0"
    try:
        compiled = step_fn(impl).lower(*args).compile()
    finally:
        if previous is None:
            del os.environ[PARTITION.name]
        else:
            os.environ[PARTITION.name] = previous
    text = compiled.as_text()
    grads = compiled(*args)
    out_spec = getattr(grads[0].sharding, "spec", None)
    return {"ms": time_ms(compiled, args, repeats, rounds), "all_gathers": len(GATHER.findall(text)),
            "all_to_alls": len(ALL_TO_ALL.findall(text)), "dq_sharding": str(out_spec) if out_spec is not None
            else type(grads[0].sharding).__name__}


def environment():
    from sdpagraph.graphs import builder

    devices = jax.devices()
    try:
        env = builder.build_environment()
        cudnn, frontend = env.cudnn_version, env.frontend_version
    except Exception as err:  # --cpu: no cuDNN here
        cudnn = frontend = f"none ({type(err).__name__})"
    return {"date": date.today().isoformat(), "devices": f"{len(devices)} x {devices[0].device_kind}",
            "jax": jax.__version__, "cudnn": cudnn, "cudnn_frontend": frontend,
            "python": platform.python_version()}


def run_dp(quick, record):
    repeats, rounds = (10, 3) if quick else (30, 7)
    devices = jax.devices()
    one = devices[0]
    mesh = Mesh(np.array(devices[:2]), ("x",))
    on_one = jax.sharding.SingleDeviceSharding(one)
    batch_split, head_split = NamedSharding(mesh, P("x")), NamedSharding(mesh, P(None, None, "x"))
    rows = []

    def row(name, impl, batch, heads, placement, reference=None, **kw):
        result = measure(impl, batch, heads, placement, repeats, rounds, **kw)
        result.update(name=name, impl=impl, shape=f"B{batch} T{T} N{heads} H{H}")
        if reference is not None:
            result["ratio"] = result["ms"] / reference["ms"]
        rows.append(record(result))
        return result

    for impl, label in (("sdpagraph", "sdpagraph"), ("jax-cudnn", "jax cuDNN")):
        single = row(f"{label}, 1 GPU", impl, B // 2, N, on_one)
        row(f"{label}, batch-sharded over 2 GPUs", impl, B, N, batch_split, single)
        if impl == "sdpagraph":
            row(f"{label}, batch-sharded, SDPAGRAPH_PARTITION=0 (before)", impl, B, N, batch_split, single,
                partition=False)
        local_heads = row(f"{label}, 1 GPU (per-device shape of the head split)", impl, B, N // 2, on_one)
        row(f"{label}, head-sharded over 2 GPUs", impl, B, N, head_split, local_heads)
    by_name = {r["name"]: r for r in rows}
    summary = {
        "batch ratio sdpagraph (target <= 1.03)": by_name["sdpagraph, batch-sharded over 2 GPUs"]["ratio"],
        "batch ratio jax cuDNN": by_name["jax cuDNN, batch-sharded over 2 GPUs"]["ratio"],
        "batch ratio before": by_name["sdpagraph, batch-sharded, SDPAGRAPH_PARTITION=0 (before)"]["ratio"],
        "sdpagraph / jax cuDNN, batch-sharded": (by_name["sdpagraph, batch-sharded over 2 GPUs"]["ms"]
                                                 / by_name["jax cuDNN, batch-sharded over 2 GPUs"]["ms"]),
        "head ratio sdpagraph": by_name["sdpagraph, head-sharded over 2 GPUs"]["ratio"],
        "head ratio jax cuDNN": by_name["jax cuDNN, head-sharded over 2 GPUs"]["ratio"],
    }
    return summary


def cp_step(attn_kwargs, strategy, load_balanced, impl):
    """jit(grad) of sum(attention) over (q, k, v, segment ids or None), every array an argument,
    under context parallelism over the mesh axis "cp" (strategy None: one device, no context
    parallelism)."""
    def attn(q, k, v, ids):
        kw = {} if strategy is None else dict(context_parallel_axis="cp", load_balanced=call_balance(load_balanced),
                                              context_parallel_strategy=strategy)
        if ids is not None:
            kw["segment_ids"] = ids
        return sdpagraph.attention(q, k, v, is_causal=True, implementation=impl, **attn_kwargs, **kw)

    loss = lambda q, k, v, ids: jnp.sum(attn(q, k, v, ids).astype(jnp.float32))  # noqa: E731
    return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))


def cp_inputs(length, heads, head_dim, docs, strategy, load_balanced):
    """(q, k, v, segment ids or None) placed for one row, and the mesh (None on one device). The
    values are random, so their (load-balanced or not) order does not matter for timing; the ids
    are in the order the row's call reads them."""
    devices = jax.devices()
    mesh = None if strategy is None else Mesh(np.array(devices[:CP_DEVICES]), ("cp",))
    placement = jax.sharding.SingleDeviceSharding(devices[0]) if mesh is None else NamedSharding(mesh, P(None, "cp"))
    rng = np.random.default_rng(0)
    qkv = [jax.device_put(jnp.asarray(rng.standard_normal((1, length, heads, head_dim)), jnp.bfloat16), placement)
           for _ in range(3)]
    ids = None
    if docs is not None:
        from packed import random_docs  # here, not at the top: importing it sets XLA_PYTHON_CLIENT_PREALLOCATE

        ids = random_docs(1, length, *docs)
        if strategy is not None and load_balanced is True:  # load_balanced="documents" takes them as they are
            ids = sdpagraph.load_balance(ids, CP_DEVICES)
        elif strategy is not None and load_balanced == WHOLE:  # the documents whole, reordered to even their work
            ids = sdpagraph.load_balance(ids, CP_DEVICES, segment_ids=ids, whole_documents=True)
        ids = jax.device_put(jnp.asarray(ids), placement)
    return qkv + [ids], mesh


def cp_plan(args, mesh, attn_kwargs, strategy, load_balanced, impl):
    """check_support's reason for a context-parallel row: the strategy it runs and its blocks' backend."""
    q, k, v, ids = args
    extra = {} if ids is None else {"segment_ids": ids}
    with jax.set_mesh(mesh):
        return sdpagraph.check_support(q, k, v, is_causal=True, implementation=impl, context_parallel_axis="cp",
                                       context_parallel_strategy=strategy,
                                       load_balanced=call_balance(load_balanced), **attn_kwargs, **extra).reason


def call_balance(load_balanced):
    """The call's `load_balanced` for a row's order: rows of whole documents reordered are ordinary
    packed rows (False)."""
    return False if load_balanced == WHOLE else load_balanced


def device_peaks(devices, stat="peak_bytes_in_use"):
    """Each device's peak of allocated device memory so far, or another of its `memory_stats` (None
    where not reported: CPU)."""
    return [(d.memory_stats() or {}).get(stat) for d in devices]


def largest(peaks):
    """The largest of the devices' peaks (None where one is not reported: CPU)."""
    return None if None in peaks else max(peaks)


def peak_bytes(devices):
    """The largest peak of allocated device memory over `devices` (None where not reported: CPU)."""
    return largest(device_peaks(devices))


def stage_text(stages):
    """'inputs 1.50/0.75; compiled ...' : each device's peak in GiB after each stage of a row."""
    return "; ".join(f"{name} " + "/".join("-" if b is None else f"{b / 2**30:.2f}" for b in peaks)
                     for name, peaks in stages.items())


def xla_memory(compiled):
    """XLA's own account of a compiled step's device memory per device (`memory_analysis`): its
    arguments, outputs and temporaries, in bytes (none where the backend does not report them)."""
    stats = compiled.memory_analysis()
    if stats is None:
        return {}
    return {"xla_argument_bytes": stats.argument_size_in_bytes, "xla_output_bytes": stats.output_size_in_bytes,
            "xla_temp_bytes": stats.temp_size_in_bytes, "xla_peak_bytes": getattr(stats, "peak_memory_in_bytes", None)}


# The long-context rows' rounds (not --quick) run about this long, 5 steps at least: a round of 5 steps
# of 1.5 ms (window (1024, 0), T32768, 2 GPUs) counted a gap before its first kernels (0.28 ms in a
# trace) at up to 4% of each step; a training loop pays it once.
LONG_ROUND_MS = 100.0


def measure_cp(length, heads, head_dim, attn_kwargs, strategy, load_balanced, impl, repeats, rounds, docs=None,
               min_round_ms=0.0):
    """(ms per step, collective-permutes, all-gathers, all-to-alls, the plan's reason, the peak device
    memory since the process started, after one step and after the timed ones) of one context-parallel
    row. The timed steps run back to back, so a step's results are still held while the next one
    allocates its own; the peak after one step is the step's alone (and the compile's)."""
    args, mesh = cp_inputs(length, heads, head_dim, docs, strategy, load_balanced)
    devices = jax.devices()[:1 if mesh is None else CP_DEVICES]
    stages = {"inputs": device_peaks(devices), "in use": device_peaks(devices, "bytes_in_use")}
    with jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext():
        compiled = cp_step(attn_kwargs, strategy, load_balanced, impl).lower(*args).compile()
        stages["compiled"] = device_peaks(devices)
        text = compiled.as_text()
        outputs = jax.block_until_ready(compiled(*args))
        stages["one step"] = device_peaks(devices)
        del outputs  # what stays allocated past a step besides the inputs: the runtime's own
        stages["live after it"] = device_peaks(devices, "bytes_in_use")
        ms = time_ms(compiled, args, repeats, rounds, min_round_ms)
    result = {"ms": ms, "permutes": len(PERMUTE.findall(text)), "all_gathers": len(GATHER.findall(text)),
              "all_to_alls": len(ALL_TO_ALL.findall(text)), "peak_bytes": peak_bytes(devices),
              "peak_step_bytes": largest(stages["one step"]), "peak_stages": stage_text(stages), **xla_memory(compiled)}
    if mesh is not None:
        result["plan"] = cp_plan(args, mesh, attn_kwargs, strategy, load_balanced, impl)
    return result


def run_cp(quick, cpu, record):
    """Context parallelism rows: 2 GPUs against 1, and ring against all-to-all."""
    from sdpagraph import mods

    repeats, rounds = (3, 2) if quick or cpu else (10, 5)
    long_t, short_t, heads, head_dim = (CP_T, CP_SHORT_T, N, H) if not cpu else (256, 64, 4, 16)
    impl = "xla" if cpu else "cudnn"
    rows = []

    def row(name, length, score_mod, strategy, load_balanced, reference=None):
        result = measure_cp(length, heads, head_dim, {"score_mod": score_mod}, strategy, load_balanced, impl,
                            repeats, rounds)
        result.update(name=name, shape=f"B1 T{length} N{heads} H{head_dim}", strategy=strategy or "1 GPU")
        if reference is not None:
            result["speedup"] = reference["ms"] / result["ms"]
        rows.append(record(result))
        return result

    for label, mod in (("causal", None), ("softcap+causal", mods.softcap(30.0))):
        one = row(f"{label}, 1 GPU", long_t, mod, None, False)
        row(f"{label}, ring, load-balanced, 2 GPUs", long_t, mod, "ring", True, one)
    for length in (short_t, long_t):
        ring = row(f"causal T{length}, ring, load-balanced, 2 GPUs", length, None, "ring", True)
        row(f"causal T{length}, all-to-all, load-balanced, 2 GPUs", length, None, "all_to_all", True, ring)
    by_name = {r["name"]: r for r in rows}
    summary = {
        "cp speedup causal (target >= 1.7)": by_name["causal, ring, load-balanced, 2 GPUs"]["speedup"],
        "cp speedup softcap+causal (target >= 1.7)": by_name["softcap+causal, ring, load-balanced, 2 GPUs"]["speedup"],
    }
    for length in (short_t, long_t):  # > 1: all-to-all is faster at this length
        summary[f"ring / all-to-all time, T{length}"] = by_name[f"causal T{length}, all-to-all, load-balanced, 2 GPUs"][
            "speedup"]
    return summary


# The calls of `--part cp-long`: (label, T, attention kwargs, documents (shortest, longest) or None,
# whether to measure peak memory, strategies (name, load_balanced), target speedup on 2 GPUs).
ALL_STRATEGIES = (("ring", True), ("all_to_all", True), ("halo", False), ("auto", True))
# Windows and chunks: auto on the halo's natural order too, so it meets the halo on the same inputs.
HALO_STRATEGIES = ALL_STRATEGIES + (("auto", False),)
# Documents: also each document cut over the devices (load_balanced="documents", `load_balance`'s segment_ids).
DOCUMENT_STRATEGIES = ALL_STRATEGIES + (("ring", "documents"), ("all_to_all", "documents"), ("auto", "documents"))
# Documents with their longest length given (`max_seqlen_kv`): the halo takes them, in either order,
# and with the documents kept whole but reordered to even their causal work over the devices (WHOLE:
# `load_balance(..., whole_documents=True)` on the host, as a data pipeline does, before the step; the
# call sees an ordinary packed row). The one-GPU row runs the same documents in their natural order.
WHOLE = "whole documents"
HINTED_STRATEGIES = (("halo", False), ("halo", True), ("ring", True), ("auto", False), ("auto", True),
                     ("halo", WHOLE), ("auto", WHOLE))
LONG_CALLS = (
    ("packed documents 512-8192", 32768, {}, (512, 8192), False, DOCUMENT_STRATEGIES, 1.5),
    ("packed documents 512-8192", 131072, {}, (512, 8192), True, DOCUMENT_STRATEGIES, 1.8),
    ("packed documents 512-8192, max_seqlen_kv=8192", 32768, {"max_seqlen_kv": 8192}, (512, 8192), False,
     HINTED_STRATEGIES, 1.5),
    ("packed documents 512-8192, max_seqlen_kv=8192", 131072, {"max_seqlen_kv": 8192}, (512, 8192), True,
     HINTED_STRATEGIES, 1.8),
    ("window (1024, 0)", 32768, {"local_window_size": (1024, 0)}, None, False, HALO_STRATEGIES, 1.8),
    ("window (1024, 0)", 131072, {"local_window_size": (1024, 0)}, None, False, HALO_STRATEGIES, 1.9),
    ("softcap 30 + packed documents 512-8192", 65536, {"softcap": 30.0}, (512, 8192), False, ALL_STRATEGIES, 1.6),
    ("chunked attention (chunk 8192)", 65536, {"chunk_size": 8192}, None, False, HALO_STRATEGIES, 1.9),
    ("dense causal", 32768, {}, None, True, (("ring", True), ("all_to_all", True), ("auto", True)), 1.7),
)
BALANCE_LABELS = {False: "", True: ", load-balanced", "documents": ", documents balanced",
                  WHOLE: ", whole documents reordered"}
ORDERS = {False: "natural order", True: "load-balanced", "documents": "documents balanced",
          WHOLE: "whole documents reordered"}
CPU_SCALE = 128  # --cpu: lengths, documents, windows and chunks divided by this
# Longer rings on XLA blocks are skipped on GPUs: 0.02-0.03x of one GPU at T16384-32768 already
# (docs/results/h100x2-2026-11-26-context-parallel.md), seconds per step beyond.
RING_ON_XLA_MAX_LEN = 16384


def long_call(index, cpu):
    """(label, T, attention kwargs, documents) of LONG_CALLS[index], scaled down for --cpu."""
    label, length, kwargs, docs = LONG_CALLS[index][:4]
    kwargs = dict(kwargs)
    if cpu:
        length, docs = length // CPU_SCALE, docs and tuple(d // CPU_SCALE for d in docs)
        if "local_window_size" in kwargs:
            kwargs["local_window_size"] = tuple(w // CPU_SCALE for w in kwargs["local_window_size"])
        for name in ("chunk_size", "max_seqlen_kv"):
            if name in kwargs:
                kwargs[name] //= CPU_SCALE
    if docs is not None:  # as a user bounds them: documents of at least docs[0] tokens, the last one cut
        kwargs["max_segments_per_seq"] = length // docs[0] + 1
    if "softcap" in kwargs:
        from sdpagraph import mods

        kwargs["score_mod"] = mods.softcap(kwargs.pop("softcap"))
    return label, length, kwargs, docs


def measure_long(index, strategy, load_balanced, quick, cpu):
    """One row of LONG_CALLS[index]: one GPU (strategy None) or 2 GPUs with `strategy`; a row that
    does not apply ({"skipped": why}): the halo where it does not take the call, the ring on XLA
    blocks beyond RING_ON_XLA_MAX_LEN on GPUs."""
    label, length, kwargs, docs = long_call(index, cpu)
    heads, head_dim = (4, 16) if cpu else (N, H)
    impl = "xla" if cpu else None
    if strategy is not None:
        args, mesh = cp_inputs(length, heads, head_dim, docs, strategy, load_balanced)
        try:
            plan = cp_plan(args, mesh, kwargs, strategy, load_balanced, impl)
        except ValueError as err:
            return {"skipped": str(err)}
        if not cpu and "blocks run on the XLA backend" in plan and length > RING_ON_XLA_MAX_LEN:
            return {"skipped": plan}
        del args  # measure_cp makes its own: these would stay allocated beside them, in its peaks
    repeats, rounds, round_ms = (2, 2, 0.0) if quick or cpu else (5, 3, LONG_ROUND_MS)
    return measure_cp(length, heads, head_dim, kwargs, strategy, load_balanced, impl, repeats, rounds, docs, round_ms)


CHILD = "import sys; sys.path.insert(0, sys.argv[1]); import multi_gpu; multi_gpu.child_row(sys.argv[-1])"


def child_row(request):
    """A child process's row (`measure_long`'s arguments as JSON): printed as `RESULT {json}`, its
    peak memory its own."""
    result = measure_long(**json.loads(request))
    print("RESULT " + json.dumps(result), flush=True)


def run_cp_long(quick, cpu, record, only, wanted=None):
    """LONG_CALLS: each on one GPU, and on 2 GPUs with each strategy (`wanted`: only the strategy rows
    named so, as in the table), speedup over one GPU. Rows that measure peak memory run in a child
    process each (bench/child.py): a peak covers one row only; the others report none."""
    from child import run_child

    summary = {}
    for index, (label, length, _, _, memory, strategies, target) in enumerate(LONG_CALLS):
        length = length // CPU_SCALE if cpu else length
        if only and not any(part in f"{label} T{length}" for part in only):
            continue
        one = None
        chosen = [(name, lb) for name, lb in strategies if wanted is None or f"{name}{BALANCE_LABELS[lb]}" in wanted]
        for strategy, load_balanced in ((None, False), *chosen):
            request = dict(index=index, strategy=strategy, load_balanced=load_balanced, quick=quick, cpu=cpu)
            # The one-GPU row runs in a process that sees one GPU, as a one-GPU user's does: some paths
            # (bins for documents with a score_mod) need a process with one device.
            one_gpu_process = strategy is None and not cpu
            if memory or one_gpu_process:
                bench_dir = os.path.dirname(os.path.abspath(__file__))
                env = {"CUDA_VISIBLE_DEVICES": "0"} if one_gpu_process else None
                result = run_child(CHILD, [bench_dir] + (["--cpu"] if cpu else []) + [json.dumps(request)],
                                   env=env, timeout=600, label=f"{label} T{length} {strategy}")
            else:  # this process's peak also covers the rows measured before: not this row's
                result = {k: x for k, x in measure_long(**request).items()
                          if k not in ("peak_bytes", "peak_step_bytes", "peak_stages")}
            name = f"{label} T{length}, " + ("1 GPU" if strategy is None else
                                             f"{strategy}{BALANCE_LABELS[load_balanced]}, "
                                             f"{CP_DEVICES} GPUs")
            heads, head_dim = (4, 16) if cpu else (N, H)
            result.update(name=name, shape=f"B1 T{length} N{heads} H{head_dim}", strategy=strategy or "1 GPU",
                          part="cp-long", load_balanced=load_balanced)
            if strategy is None:
                one = result
            elif "ms" in result:
                result["speedup"] = one["ms"] / result["ms"]
                if memory and one.get("peak_bytes") and result.get("peak_bytes"):  # peaks of a process each
                    result["memory_ratio"] = result["peak_bytes"] / one["peak_bytes"]
                    result["step_memory_ratio"] = result["peak_step_bytes"] / one["peak_step_bytes"]
            record(result)
            key = f"{label} T{length}"
            order = ORDERS[load_balanced]
            if strategy == "auto" and "speedup" in result:
                summary[f"{key}: auto speedup, {order} (target >= {target})"] = result["speedup"]
            if "memory_ratio" in result:
                summary[f"{key}: peak memory per GPU / 1 GPU, {strategy} (target <= 0.6)"] = result["memory_ratio"]
                summary[f"{key}: peak memory per GPU / 1 GPU after one step, {strategy}"] = result["step_memory_ratio"]
        best = [r for r in record.rows if r["name"].startswith(f"{label} T{length},") and "speedup" in r]
        if best:
            top = max(best, key=lambda r: r["speedup"])
            summary[f"{label} T{length}: best speedup ({top['strategy']}, target >= {target})"] = top["speedup"]
        for auto in (r for r in best if r["strategy"] == "auto"):  # against the best on the same inputs
            same = max(r["speedup"] for r in best if r["load_balanced"] == auto["load_balanced"])
            order = ORDERS[auto["load_balanced"]]
            summary[f"{label} T{length}: auto / best strategy, {order} (target >= 0.95)"] = auto["speedup"] / same
    return summary


class Recorder:
    """The rows measured so far; after every row the tables are written to `out` (a run cut short
    keeps what it measured)."""

    def __init__(self, out, quick, cpu):
        self.out, self.rows, self.summary = out, [], {}
        self.results = {"environment": environment(), "rows": self.rows, "summary": self.summary, "quick": quick,
                        "cpu": cpu}

    def __call__(self, result):
        self.rows.append(result)
        ms = f"{result['ms']:.3f} ms" if "ms" in result else f"skipped: {result.get('skipped')}"
        print(f"  {result['name']}: {ms}", file=sys.stderr, flush=True)
        self.save()
        return result

    def save(self):
        if not self.out:
            return
        os.makedirs(self.out, exist_ok=True)
        with open(os.path.join(self.out, "multi_gpu.md"), "w") as f:
            f.write(markdown(self.results))
        with open(os.path.join(self.out, "multi_gpu.json"), "w") as f:
            json.dump(self.results, f, indent=1)


def run(quick, part, cpu, out=None, only=None, strategies=None):
    record = Recorder(out, quick, cpu)
    if part in ("dp", "all"):
        record.summary.update(run_dp(quick, record))
    if part in ("cp", "all"):
        record.summary.update(run_cp(quick, cpu, record))
    if part == "cp-long":
        record.summary.update(run_cp_long(quick, cpu, record, only, strategies))
    record.save()
    return record.results


def _table(rows, caption, columns):
    """Markdown lines of one table (none without rows): row name, shape, then `columns` (header, cell)."""
    if not rows:
        return []
    lines = ["", caption, "", "| row | shape | " + " | ".join(h for h, _ in columns) + " |",
             "|---|---|" + "".join("---:|" for _ in columns)]
    return lines + [f"| {r['name']} | {r['shape']} | " + " | ".join(cell(r) for _, cell in columns) + " |"
                    for r in rows]


def markdown(results):
    env = results["environment"]
    lines = [f"# Multi-GPU: causal fwd+bwd bf16 ({env['date']})", "",
             f"{env['devices']}; jax {env['jax']}, cuDNN {env['cudnn']}, frontend {env['cudnn_frontend']}. "
             "Median of rounds of back-to-back jitted steps (jax.grad of sum(attention)), block_until_ready"
             + (" (quick)" if results["quick"] else "") + (" (CPU devices: checks the code, times mean nothing)"
                                                           if results["cpu"] else "") + ". Collectives: "
             "instructions in the compiled HLO (async starts counted once)."]
    number = lambda key: lambda r: f"{r[key]:.3f}" if key in r else ""  # noqa: E731
    count = lambda key: lambda r: str(r.get(key, ""))  # noqa: E731
    gib = lambda key: lambda r: f"{r[key] / 2**30:.2f}" if r.get(key) else ""  # noqa: E731
    lines += _table(
        [r for r in results["rows"] if "impl" in r],
        "Data and head parallelism, B8 T4096 N16 H128. Ratio: step time over the per-device shape on one GPU "
        "(the row above it of the same implementation).",
        [("ms", number("ms")), ("ratio", number("ratio")), ("all-gathers", count("all_gathers")),
         ("all-to-alls", count("all_to_alls")), ("dq sharding", count("dq_sharding"))])
    lines += _table(
        [r for r in results["rows"] if "permutes" in r and r.get("part") != "cp-long"],
        "Context parallelism. Speedup: the reference row's time over this row's (1 GPU for the ring rows, the "
        "ring at the same T for the all-to-all rows).",
        [("ms", number("ms")), ("speedup", number("speedup")), ("collective-permutes", count("permutes")),
         ("all-gathers", count("all_gathers")), ("all-to-alls", count("all_to_alls"))])
    lines += _table(
        [r for r in results["rows"] if r.get("part") == "cp-long"],
        "Long context (`--part cp-long`), jitted fwd+bwd with q, k, v and segment ids as arguments. Speedup: "
        "the 1 GPU row's time over this row's. Peak: device memory per GPU (each row in its own process), "
        "after the timed steps (back to back: a step's results are held while the next allocates) and after "
        "one step, and their ratios to one GPU's; XLA's account of the compiled step per device "
        "(`memory_analysis`): its arguments, outputs, temporaries and peak; each device's peak after the inputs "
        "are made, after the compile and after one step. Plan: `check_support`'s strategy and "
        "block backend.",
        [("ms", number("ms")), ("speedup", number("speedup")), ("peak GiB", gib("peak_bytes")),
         ("memory ratio", number("memory_ratio")), ("peak GiB, one step", gib("peak_step_bytes")),
         ("one-step ratio", number("step_memory_ratio")), ("XLA args GiB", gib("xla_argument_bytes")),
         ("XLA outputs GiB", gib("xla_output_bytes")), ("XLA temp GiB", gib("xla_temp_bytes")),
         ("XLA peak GiB", gib("xla_peak_bytes")),
         ("peak GiB per device after inputs (in use then); compile; one step; in use after it, results freed",
                                                   lambda r: r.get("peak_stages", "")),
         ("collective-permutes", count("permutes")),
         ("all-gathers", count("all_gathers")), ("all-to-alls", count("all_to_alls")),
         ("plan / skipped", lambda r: r.get("plan") or r.get("skipped", ""))])
    lines += [""] + [f"- {name}: {value:.3f}" for name, value in results["summary"].items()]
    return "\n".join(lines) + "\n"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="directory for multi_gpu.md and multi_gpu.json")
    parser.add_argument("--quick", action="store_true", help="fewer repeats (a smoke run)")
    parser.add_argument("--part", choices=("dp", "cp", "all", "cp-long"), default="all",
                        help="data/head parallelism rows, context parallelism rows, both (all), or the long-context "
                        "rows (packed documents, windows, chunks: LONG_CALLS)")
    parser.add_argument("--only", action="append", help="cp-long: only the calls whose 'label T<length>' holds "
                        "this (repeatable: any of them)")
    parser.add_argument("--strategy", action="append", help="cp-long: only these strategy rows (besides one GPU), "
                        "named as in the table: 'ring, load-balanced', 'ring, documents balanced', 'halo', ... "
                        "(repeatable)")
    parser.add_argument("--cpu", action="store_true", help="the context-parallel rows on 2 CPU devices, tiny "
                        "shapes, XLA backend: checks the bench's code (needs --part cp or cp-long)")
    args = parser.parse_args()
    if args.cpu and args.part not in ("cp", "cp-long"):
        sys.exit("--cpu runs the context-parallel rows only: pass --part cp or --part cp-long")
    gpus = [d for d in jax.devices() if d.platform == "gpu"]
    if len(gpus) < 2 and not args.cpu:
        sys.exit(f"bench/multi_gpu.py needs 2 GPUs; JAX sees {len(gpus)} ({jax.devices()})")
    print(markdown(run(args.quick, args.part, args.cpu, args.out, args.only, args.strategy)))


if __name__ == "__main__":
    main()
