"""Context-parallel rows of the multi-GPU benchmarks (`bench/multi_gpu.py --part cp|cp-long`, and the
probes and profiles that run its rows: `bench/profile_cp.py`, `bench/probe_halo_in_place.py`): the
jitted step, its inputs and plan, its memory, and the long-context calls (LONG_CALLS) with their
strategies. Importing this module with `--cpu` in the command line sets up two CPU devices before jax
starts (`multi_gpu.py --cpu`, and its child processes, which import this module first).
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import sys

if "--cpu" in sys.argv:  # before jax starts: two CPU devices stand in for the GPUs
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2"
    os.environ["JAX_PLATFORMS"] = "cpu"

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import jax_timing  # bench/ is on sys.path when a script here runs
import sdpagraph

N, H = 16, 128  # heads and head dim of every row on GPUs
# GPUs the context-parallel rows of `--part cp-long` split the sequence over (CP_DEVICES=4 on a 4-GPU machine).
CP_DEVICES = int(os.environ.get("CP_DEVICES", "2"))
GATHER = re.compile(r"\ball-gather(?:-start)?\(")
ALL_TO_ALL = re.compile(r"\ball-to-all(?:-start)?\(")
PERMUTE = re.compile(r"\bcollective-permute(?:-start)?\(")


def time_ms(fn, args, repeats, rounds, min_round_ms=0.0):
    return jax_timing.time_ms(fn, *args, repeats=repeats, rounds=rounds, min_round_ms=min_round_ms)


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


CHILD = "import sys; sys.path.insert(0, sys.argv[1]); import cp_rows; cp_rows.child_row(sys.argv[-1])"


def child_row(request):
    """A child process's row (`measure_long`'s arguments as JSON): printed as `RESULT {json}`, its
    peak memory its own."""
    result = measure_long(**json.loads(request))
    print("RESULT " + json.dumps(result), flush=True)
