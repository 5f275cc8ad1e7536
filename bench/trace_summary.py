"""Summaries of a JAX profiler trace (`jax.profiler.trace`): per device stream, busy time per step,
the largest kernels and the gaps between them; per host thread, the longest event kinds. Shared by
the probes that trace a step (bench/profile_cp.py, bench/probe_softcap_sinks.py)."""
from __future__ import annotations

import collections
import gzip
import json
import pathlib

import jax


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
            lines.extend(_last_step(group, steps))
    return "\n".join(lines)


def _last_step(group: list[dict], steps: int) -> list[str]:
    """The stream's events of the last traced step in order (the steps are assumed to launch the same
    events): the idle time before each, its duration and name, in microseconds."""
    lines = ["  the last step, in order (us idle before, us running, event):"]
    for i in range(len(group) - len(group) // steps, len(group)):
        event = group[i]
        idle = event["ts"] - (group[i - 1]["ts"] + group[i - 1]["dur"]) if i else 0.0
        lines.append(f"    {idle:8.1f} {event['dur']:8.1f}  {event['name'][:80]}")
    return lines


def traced(where: pathlib.Path, fn, args, steps: int) -> str:
    """`steps` calls of `fn(*args)` traced into `where`, summarized (after one untimed call)."""
    jax.block_until_ready(fn(*args))
    with jax.profiler.trace(str(where)):
        for _ in range(steps):
            result = fn(*args)
        jax.block_until_ready(result)
    return summarize(where, steps)

