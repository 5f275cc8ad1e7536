"""Precompile every graph of a spec file into a cache directory.

    precompile(specs, cache_dir=DIR, jobs=N)   build what DIR lacks; a report per graph

It asks the builder for the runtime's own cache keys, so what it builds is what the
runtime finds (`sdpagraph.verify` checks a directory the same way). Entries are
published atomically by the cache, so an interrupted precompile leaves whole entries
only, and running it again builds just the rest.
"""
from __future__ import annotations

import multiprocessing
import os
import signal
import sys
import threading
import time
from collections import Counter
from concurrent.futures import Future, ProcessPoolExecutor, as_completed
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from typing import Any, Callable, Iterable, TextIO

from sdpagraph.cache import GraphCache
from sdpagraph.deploy.formatting import format_age, format_table
from sdpagraph.graph_store import cached_graph, check_graphs, graph_key
from sdpagraph.config import VERIFY
from sdpagraph.deploy.numerics import check_entry
from sdpagraph.deploy.derived_entries import with_derived
from sdpagraph.deploy.spec_entry import SpecEntry
from sdpagraph.deploy.specfile import load_entries
from sdpagraph.errors import SdpagraphError, Unsupported
from sdpagraph.graphs.builder import GraphBuildError
from sdpagraph.graphs.support import environment_reason

STATUSES = ("built", "cached", "unsupported", "failed")
STATUS_LABELS = {"built": "built", "cached": "already there", "unsupported": "unsupported", "failed": "failed"}
# Precompile fills a directory that is meant to be shipped whole: evicting least recently
# used entries (the runtime's disk budget) would drop graphs it has just built.
NO_EVICTION = sys.maxsize
# Without a terminal, a status line this often (a CI log wants a heartbeat, not a flood).
PLAIN_PROGRESS_INTERVAL_S = 10.0
PARENT_POLL_INTERVAL_S = 0.5


class BuilderUnavailable(SdpagraphError, RuntimeError):
    """This process cannot build or key cuDNN graphs (no GPU, no cuDNN frontend)."""


@dataclass(frozen=True)
class Builder:
    """What precompile and verify need from the graph builder; tests pass fakes.

    Its functions must be picklable (module-level), since `--jobs` workers receive it.
    """

    build: Callable[..., Any]  # (spec, ir, direction, cache=GraphCache) -> graph, through `cache`
    graph_key: Callable[..., Any]  # (spec, ir, direction) -> the runtime's CacheKey on this machine
    check_graphs: Callable[..., Any]  # (spec, ir, training, cache) -> Support
    declines: tuple[type[BaseException], ...]  # what `build` raises for a config it does not support
    unavailable: Callable[[], str | None]  # why this process cannot build at all, or None
    # (entry, cache) -> deploy.numerics.EntryCheck: the numerical check of an entry's built graphs,
    # recorded in their cache entries; None skips it
    check_numerics: Callable[..., Any] | None = None


def cudnn_builder() -> Builder:
    """The real builder (the runtime's `graph_store`), for the GPU and cuDNN of this process."""
    return Builder(build=cached_graph, graph_key=graph_key, check_graphs=check_graphs,
                   declines=(Unsupported, GraphBuildError), unavailable=environment_reason,
                   check_numerics=check_entry)


def usable_builder(builder: Builder | None, task: str) -> Builder:
    builder = cudnn_builder() if builder is None else builder
    reason = builder.unavailable()
    if reason is not None:
        raise BuilderUnavailable(f"cannot {task} on this machine: {reason}. Graphs are built and keyed for the "
                                 "GPU, cuDNN and cudnn-frontend of the machine that runs this: use one like "
                                 "the serving machines.")
    return builder


# -- precompile ----------------------------------------------------------------------------


@dataclass(frozen=True)
class GraphResult:
    """What precompile did for one graph of one entry."""

    entry: int  # index in the merged entry list
    direction: str
    status: str  # one of STATUSES
    detail: str = ""  # unsupported: the check_support reason; failed: the error
    seconds: float = 0.0


class ExitCode:
    """The command's exit status from a report's `ok`."""

    ok: bool

    @property
    def exit_code(self) -> int:
        return 0 if self.ok else 1


@dataclass(frozen=True)
class PrecompileReport(ExitCode):
    cache_dir: str
    entries: tuple[SpecEntry, ...]
    graphs: tuple[GraphResult, ...]  # by entry, then in the entry's direction order
    elapsed_s: float
    strict: bool = False

    def counts(self) -> dict[str, int]:
        found = Counter(graph.status for graph in self.graphs)
        return {status: found[status] for status in STATUSES}

    @property
    def ok(self) -> bool:
        """No graph failed (and, when strict, none is unsupported)."""
        counts = self.counts()
        return counts["failed"] == 0 and not (self.strict and counts["unsupported"])

    def to_dict(self) -> dict[str, Any]:
        return {
            "cache_dir": self.cache_dir,
            "elapsed_s": self.elapsed_s,
            "strict": self.strict,
            "ok": self.ok,
            "counts": self.counts(),
            "graphs": [{"entry": graph.entry, "direction": graph.direction, "status": graph.status,
                        "detail": graph.detail, "seconds": graph.seconds,
                        "spec": self.entries[graph.entry].describe()} for graph in self.graphs],
        }

    def text(self) -> str:
        rows = [[str(graph.entry), graph.direction, STATUS_LABELS[graph.status],
                 f"{graph.seconds:.1f} s" if graph.status == "built" else "",
                 self.entries[graph.entry].describe(), graph.detail] for graph in self.graphs]
        lines = [format_table(["#", "GRAPH", "STATUS", "TIME", "SPEC", "NOTE"], rows)] if rows else []
        lines.append(f"{len(self.graphs)} graphs in {self.cache_dir}: {_count_line(self.counts())}; "
                     f"{format_age(self.elapsed_s)}")
        if self.counts()["failed"]:
            lines.append("failed graphs are not in the cache: run the same command again to retry them")
        if self.strict and self.counts()["unsupported"]:
            lines.append("--strict: unsupported graphs count as failures")
        return "\n".join(lines)


def precompile(specs: Any, cache_dir: str | os.PathLike[str], *, jobs: int = 1, strict: bool = False,
               progress: bool | TextIO = True, builder: Builder | None = None) -> PrecompileReport:
    """Build every graph of every entry of `specs` into the cache directory `cache_dir`.

    `specs`: a spec file path, several, or SpecEntry objects (merged, duplicates dropped).
    `jobs`: build processes (cuDNN builds are CPU-bound). `progress`: a live status line on
    stderr (True), on the given stream, or none (False). `strict`: unsupported graphs make
    the report not ok. Graphs already in the directory are not built again.
    Raises SpecFileError for an invalid spec file (checked first, on any machine), then
    BuilderUnavailable where graphs cannot be built (no GPU, no cuDNN frontend).

    With jobs > 1, workers are spawned processes, which re-import the main module: a
    script calling this needs the `if __name__ == "__main__":` guard.
    """
    if jobs < 1:
        raise ValueError(f"jobs must be >= 1, got {jobs}")
    entries = with_derived(load_entries(specs))  # and the calls they run as (bins, documents, folds)
    builder = usable_builder(builder, "precompile")
    directory = os.path.abspath(os.fspath(cache_dir))
    stream = sys.stderr if progress is True else (progress or None)
    meter = Progress(sum(len(entry.directions) for entry in entries), stream) if stream else None
    started = time.monotonic()
    results: list[GraphResult] = []

    def collect(entry_results: list[GraphResult]) -> None:
        results.extend(entry_results)
        if meter is not None:
            meter.add(entry_results)

    tasks = [(index, entry, directory, builder) for index, entry in enumerate(entries)]
    try:
        _run_tasks(tasks, jobs, collect)
    finally:
        if meter is not None:
            meter.close()
    results.sort(key=lambda result: result.entry)  # stable: keeps each entry's direction order
    return PrecompileReport(directory, entries, tuple(results), time.monotonic() - started, strict)


def _run_tasks(tasks: list[tuple], jobs: int, collect: Callable[[list[GraphResult]], None]) -> None:
    if jobs == 1 or len(tasks) <= 1:
        for task in tasks:
            collect(_precompile_entry(task))
        return
    # spawn, not fork: a forked child would inherit a parent's CUDA context, which CUDA forbids.
    executor = ProcessPoolExecutor(min(jobs, len(tasks)), mp_context=multiprocessing.get_context("spawn"),
                                   initializer=_start_worker, initargs=(os.getpid(),))
    futures = {executor.submit(_precompile_entry, task): task for task in tasks}
    try:
        for future in as_completed(futures):
            collect(_entry_results(future, futures[future]))
    finally:
        # Interrupted: queued entries are dropped, builds in flight finish and publish whole.
        executor.shutdown(wait=True, cancel_futures=True)


def _entry_results(future: Future, task: tuple[int, SpecEntry, str, Builder]) -> list[GraphResult]:
    try:
        return future.result()
    except BrokenProcessPool:  # a worker died (a crash in native code, the OOM killer): no hang, a failure
        index, entry = task[0], task[1]
        return [GraphResult(index, direction, "failed", "a build process died (crashed or was killed) while "
                            "this precompile ran") for direction in entry.directions]


def _start_worker(parent_pid: int) -> None:
    without_gpu_preallocation()
    # Ctrl-C reaches the whole process group; the parent alone decides (it stops the workers).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    threading.Thread(target=_exit_with_parent, args=(parent_pid,), daemon=True).start()


def _exit_with_parent(parent_pid: int) -> None:
    # A parent killed outright (SIGKILL) cannot stop its workers, and they would wait for work
    # forever: they leave by themselves when they become orphans.
    while os.getppid() == parent_pid:
        time.sleep(PARENT_POLL_INTERVAL_S)
    os._exit(1)


def _precompile_entry(task: tuple[int, SpecEntry, str, Builder]) -> list[GraphResult]:
    """Build the graphs of one entry into the cache directory (runs in a worker with --jobs)."""
    index, entry, cache_dir, builder = task
    cache = GraphCache(cache_dir, mode="readwrite", max_bytes=NO_EVICTION)
    results: list[GraphResult] = []
    for direction in entry.directions:
        if results and results[-1].status == "unsupported":
            # attention() runs the whole call on XLA then: the other graph would never run.
            results.append(GraphResult(index, direction, "unsupported", results[-1].detail))
        else:
            results.append(_precompile_graph(index, entry, direction, cache, builder))
    if builder.check_numerics is not None and VERIFY.get() != "off" and \
            all(result.status in ("built", "cached") for result in results):
        results = _checked_numerics(index, entry, cache, builder, results)
    return results


def _checked_numerics(index: int, entry: SpecEntry, cache: GraphCache, builder: Builder,
                      results: list[GraphResult]) -> list[GraphResult]:
    """Run the entry's graphs once against the float32 NumPy reference (recorded in their cache entries, so
    a strict server accepts them); graphs that compute wrong values are unsupported here."""
    check = builder.check_numerics(entry, cache, index=index)
    if check.status == "failed":
        return [GraphResult(index, r.direction, "unsupported",
                            f"cuDNN's graph computed wrong values on this GPU ({check.detail}); the call runs on XLA",
                            r.seconds) for r in results]
    if check.status != "passed":
        return [GraphResult(index, r.direction, "failed", f"numerical check: {check.status}: {check.detail}",
                            r.seconds) for r in results]
    return results


def _precompile_graph(index: int, entry: SpecEntry, direction: str, cache: GraphCache,
                      builder: Builder) -> GraphResult:
    started = time.perf_counter()
    try:
        key = builder.graph_key(entry.spec, entry.score_mod, direction)
        if cache.get(key) is not None:
            return GraphResult(index, direction, "cached")
        builder.build(entry.spec, entry.score_mod, direction, cache=cache)
    except builder.declines as error:
        status, detail = _classify_decline(error, entry, cache, builder)
    except Exception as error:  # noqa: BLE001 - one broken graph must not stop the others
        status, detail = "failed", _one_line(error)
    else:
        written = cache.entry_path(key) is not None
        status, detail = ("built", "") if written else ("failed", f"built, but not written to {cache.directory}")
    return GraphResult(index, direction, status, detail, time.perf_counter() - started)


def _classify_decline(error: BaseException, entry: SpecEntry, cache: GraphCache, builder: Builder) -> tuple[str, str]:
    # check_graphs words the reason exactly as check_support tells users; it costs one more
    # attempt, on declined graphs only.
    support = builder.check_graphs(entry.spec, entry.score_mod, entry.training, cache)
    return ("failed", _one_line(error)) if support.supported else ("unsupported", support.reason)


def _one_line(error: BaseException) -> str:
    return f"{type(error).__name__}: {' '.join(str(error).split())}"


def _count_line(counts: dict[str, int]) -> str:
    return ", ".join(f"{counts[status]} {STATUS_LABELS[status]}" for status in STATUSES)


class Progress:
    """The status line: graphs done, per status, elapsed time and ETA.

    On a terminal it is rewritten in place; otherwise (a log) a plain line is written
    every PLAIN_PROGRESS_INTERVAL_S and at the end.
    """

    def __init__(self, total: int, stream: TextIO, clock: Callable[[], float] = time.monotonic):
        self.total = total
        self.stream = stream
        self.clock = clock
        self.interactive = stream.isatty()
        self.counts = dict.fromkeys(STATUSES, 0)
        self.started = self.last_shown = clock()
        self._show()

    def add(self, results: Iterable[GraphResult]) -> None:
        for result in results:
            self.counts[result.status] += 1
        if self.interactive or self.clock() - self.last_shown >= PLAIN_PROGRESS_INTERVAL_S:
            self._show()

    def close(self) -> None:
        if self.interactive:
            self.stream.write("\n")
        else:
            self._show()
        self.stream.flush()

    def line(self) -> str:
        done = sum(self.counts.values())
        elapsed = self.clock() - self.started
        eta = format_age(elapsed / done * (self.total - done)) if done else "?"
        return (f"precompile: {done}/{self.total} graphs: {_count_line(self.counts)}; "
                f"elapsed {format_age(elapsed)}, ETA {eta}")

    def _show(self) -> None:
        self.last_shown = self.clock()
        # \r and "erase to end of line" redraw the line in place on a terminal.
        self.stream.write(f"\r{self.line()}\x1b[K" if self.interactive else self.line() + "\n")
        self.stream.flush()


def without_gpu_preallocation() -> None:
    # JAX takes 75% of GPU memory when it first touches the GPU. These processes only build
    # plans and read the GPU's name: taking memory would starve the other build workers, or
    # a server running on the GPU that `verify` checks. Read by JAX when it starts the GPU.
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
