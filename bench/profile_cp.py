"""Where a context-parallel step spends its time: one `bench/multi_gpu.py --part cp-long` row (or its
one-GPU baseline) timed, then traced with the JAX profiler, and the trace summarized per device
stream (busy time, the largest kernels, the gaps between them) and per host thread (the longest
host events: synchronizations, conditionals, launches).

    python3 bench/profile_cp.py OUT_DIR ROW STRATEGY[:balanced] [ROW STRATEGY ...]

ROW indexes `multi_gpu.LONG_CALLS`; STRATEGY is ring, all_to_all, halo, auto or one (one GPU);
`:balanced` load-balances. Each pair is traced into OUT_DIR/<row>-<strategy>/ and summarized there
(summary.txt) and on stdout.
"""
from __future__ import annotations

import collections
import contextlib
import gzip
import json
import pathlib
import sys

import jax

import multi_gpu  # bench/ is on sys.path when a script here runs
from jax_timing import time_ms

STEPS_TRACED = 3


def _events(trace_dir: pathlib.Path) -> tuple[list[dict], dict[int, str], dict[tuple[int, int], str]]:
    """(complete events, process names, thread names) of the newest Chrome trace under trace_dir."""
    files = sorted(trace_dir.rglob("*.trace.json.gz"), key=lambda p: p.stat().st_mtime)
    with gzip.open(files[-1], "rt") as handle:
        trace = json.load(handle)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    processes, threads, complete = {}, {}, []
    for event in events:
        if event.get("ph") == "M" and event.get("name") == "process_name":
            processes[event["pid"]] = event["args"]["name"]
        elif event.get("ph") == "M" and event.get("name") == "thread_name":
            threads[(event["pid"], event["tid"])] = event["args"]["name"]
        elif event.get("ph") == "X" and "dur" in event:
            complete.append(event)
    return complete, processes, threads


def summarize(trace_dir: pathlib.Path, steps: int) -> str:
    """Per device stream: busy time per step, the span, the largest kernels and gaps; per host thread:
    the longest event kinds."""
    events, processes, threads = _events(trace_dir)
    by_thread = collections.defaultdict(list)
    for event in events:
        by_thread[(event["pid"], event["tid"])].append(event)
    lines = []
    for key in sorted(by_thread, key=lambda k: (processes.get(k[0], ""), threads.get(k, ""))):
        group = sorted(by_thread[key], key=lambda e: e["ts"])
        process, thread = processes.get(key[0], str(key[0])), threads.get(key, str(key[1]))
        busy = sum(e["dur"] for e in group)
        span = max(e["ts"] + e["dur"] for e in group) - group[0]["ts"]
        if busy < 100:  # microseconds: threads that did nothing worth reading
            continue
        lines.append(f"\n## {process} / {thread}: {len(group)} events, busy {busy / 1e3 / steps:.3f} ms a step, "
                     f"span {span / 1e3:.3f} ms over {steps} steps")
        totals, counts = collections.Counter(), collections.Counter()
        for event in group:
            name = event["name"][:110]
            totals[name] += event["dur"]
            counts[name] += 1
        for name, total in totals.most_common(14):
            lines.append(f"  {total / 1e3 / steps:9.3f} ms/step  x{counts[name] / steps:6.1f}  {name}")
        if "GPU" in process or "stream" in thread.lower():
            gaps = [(b["ts"] - (a["ts"] + a["dur"]), a["name"][:60], b["name"][:60]) for a, b in zip(group, group[1:])]
            gaps = [g for g in gaps if g[0] > 0]
            lines.append(f"  idle between events {sum(g[0] for g in gaps) / 1e3 / steps:.3f} ms/step; longest gaps:")
            for gap, before, after in sorted(gaps, reverse=True)[:8]:
                lines.append(f"    {gap / 1e3:8.3f} ms  after {before}  before {after}")
    return "\n".join(lines)


def profile(out: pathlib.Path, index: int, strategy_arg: str) -> None:
    name, _, balanced = strategy_arg.partition(":")
    strategy = None if name == "one" else name
    cpu = jax.default_backend() == "cpu"  # a trial run of this script: the rows scaled down, on XLA
    label, length, kwargs, docs = multi_gpu.long_call(index, cpu=cpu)
    heads, head_dim = (4, 16) if cpu else (multi_gpu.N, multi_gpu.H)
    args, mesh = multi_gpu.cp_inputs(length, heads, head_dim, docs, strategy, bool(balanced))
    where = out / f"{index}-{strategy_arg.replace(':', '-')}"
    with jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext():
        step = multi_gpu.cp_step(kwargs, strategy, bool(balanced), "xla" if cpu else None).lower(*args).compile()
        ms = time_ms(step, *args, repeats=5, rounds=3)
        header = f"# {label} T{length}, {strategy_arg}: {ms:.3f} ms a step"
        print(header, flush=True)
        jax.block_until_ready(step(*args))
        with jax.profiler.trace(str(where)):
            for _ in range(STEPS_TRACED):
                result = step(*args)
            jax.block_until_ready(result)
    text = header + "\n" + summarize(where, STEPS_TRACED)
    (where / "summary.txt").write_text(text + "\n")
    (where / "hlo.txt").write_text(step.as_text())
    print(text, flush=True)


def main() -> None:
    out = pathlib.Path(sys.argv[1])
    pairs = sys.argv[2:]
    for index, strategy in zip(pairs[::2], pairs[1::2]):
        try:
            profile(out, int(index), strategy)
        except Exception as err:  # one row's failure must not lose the others' traces
            print(f"# row {index} {strategy} failed: {type(err).__name__}: {err}", flush=True)


if __name__ == "__main__":
    main()
