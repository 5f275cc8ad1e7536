"""Re-run the numerical check of every graph of a spec file in a cache directory, and record it.

    verify_numerics(specs, cache_dir=DIR) -> NumericsReport     (`sdpagraph verify --numerics`)
    check_entry(entry, cache) -> EntryCheck                     one entry (precompile, after building it)

For each entry of the spec file, the graphs the runtime would use (its own keys, on this
machine's GPU, cuDNN and frontend) are found in DIR (never built), run once on random inputs
of the entry's shapes and compared with a float32 NumPy reference (`numerics.check`); the
result is written into their entries' metadata (same key, same blob), which is what the runtime
reads (`numerics.gate`): a failed graph is never used, and strict serving runs checked graphs only.
Pass/fail and the errors' wording are `numerics.record`'s.

Exit codes: 0 every entry passed; 1 an entry failed, could not be checked, or is not in DIR;
2 this machine cannot run graphs (no GPU, no cuDNN frontend, no executor).
"""
from __future__ import annotations

import json
import math
import os
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, TextIO

from sdpagraph.cache.graph_cache import GraphCache
from sdpagraph.deploy.formatting import format_age, format_table
from sdpagraph.graph_store import graph_key
from sdpagraph.numerics import check as numerics_check
from sdpagraph.numerics.gate import record_numerics
from sdpagraph.numerics.record import error_text, errors_text, format_error, over_tolerance
from sdpagraph.deploy.derived_entries import with_derived
from sdpagraph.deploy.spec_entry import SpecEntry
from sdpagraph.deploy.specfile import load_entries

STATUSES = ("passed", "failed", "error", "missing")
EXIT_UNAVAILABLE = 2
# Columns of the error table, in order (those no entry has are left out).
ERROR_COLUMNS = ("o", "lse", "dq", "dk", "dv", "dbias", "empty_rows")
# The directory is shipped whole: updating entries must never evict others.
NO_EVICTION = sys.maxsize


@dataclass(frozen=True)
class EntryCheck:
    """The check of one spec file entry."""

    entry: int
    status: str  # one of STATUSES
    errors: dict[str, float] = field(default_factory=dict)
    tolerances: dict[str, float] = field(default_factory=dict)
    seconds: float = 0.0
    detail: str = ""  # failed: the outputs over tolerance; error/missing: why; passed: where it ran
    recorded: bool = False  # the result was written into the entries on disk


@dataclass(frozen=True)
class NumericsReport:
    cache_dir: str
    entries: tuple[SpecEntry, ...]
    checks: tuple[EntryCheck, ...]
    elapsed_s: float
    unavailable: str | None = None  # why this machine cannot run graphs (exit code 2)

    def counts(self) -> dict[str, int]:
        found = Counter(check.status for check in self.checks)
        return {status: found[status] for status in STATUSES}

    @property
    def ok(self) -> bool:
        return self.unavailable is None and all(check.status == "passed" for check in self.checks)

    @property
    def exit_code(self) -> int:
        if self.unavailable is not None:
            return EXIT_UNAVAILABLE
        return 0 if self.ok else 1

    def to_dict(self) -> dict[str, Any]:
        return {
            "cache_dir": self.cache_dir,
            "ok": self.ok,
            "exit_code": self.exit_code,
            "unavailable": self.unavailable,
            "elapsed_s": self.elapsed_s,
            "counts": self.counts(),
            "entries": [{"entry": check.entry, "spec": self.entries[check.entry].describe(),
                         "directions": list(self.entries[check.entry].directions), "status": check.status,
                         "errors": {name: _json_number(value) for name, value in check.errors.items()},
                         "tolerances": check.tolerances, "seconds": check.seconds, "detail": check.detail,
                         "recorded": check.recorded} for check in self.checks],
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    def text(self) -> str:
        if self.unavailable is not None:
            return (f"cannot check graphs numerically on this machine: {self.unavailable}. The check runs each "
                    "graph on the GPU type it was built for: run it on one like the serving machines.")
        columns = [name for name in ERROR_COLUMNS if any(name in check.errors for check in self.checks)]
        rows = [[str(check.entry), check.status.upper() if check.status != "passed" else check.status,
                 *(_cell(check, name) for name in columns),
                 f"{check.seconds:.1f} s" if check.seconds else "", self.entries[check.entry].describe(),
                 check.detail] for check in self.checks]
        headers = ["#", "STATUS", *(name.upper() for name in columns), "TIME", "SPEC", "NOTE"]
        lines = [format_table(headers, rows)] if rows else []
        counts = self.counts()
        lines.append(f"{len(self.checks)} entries in {self.cache_dir}: "
                     + ", ".join(f"{counts[status]} {status}" for status in STATUSES)
                     + f"; {format_age(self.elapsed_s)}")
        bounds = sorted({(name, bound) for check in self.checks for name, bound in check.tolerances.items()})
        if bounds:
            lines.append("relative errors against the float32 NumPy reference; bounds: "
                         + ", ".join(f"{name} {bound:g}" for name, bound in _merge_bounds(bounds)))
        if counts["failed"]:
            lines.append("failed graphs are recorded as failed in their entries: the runtime runs those configs "
                         "on XLA and check_support says why")
        if any(check.status == "passed" and not check.recorded for check in self.checks):
            lines.append(f"some results could not be written to {self.cache_dir} (read-only?): those entries stay "
                         "unchecked there")
        return "\n".join(lines)


def _cell(check: EntryCheck, name: str) -> str:
    if name not in check.errors:
        return ""
    over = name in over_tolerance(check.errors, check.tolerances)
    return format_error(check.errors[name]) + ("!" if over else "")


def _merge_bounds(bounds: list[tuple[str, float]]) -> list[tuple[str, float]]:
    seen: dict[str, float] = {}
    for name, bound in bounds:
        seen[name] = max(bound, seen.get(name, bound))
    return [(name, seen[name]) for name in ERROR_COLUMNS if name in seen]


def _json_number(value: float) -> float | str:
    return value if math.isfinite(value) else str(value)


def unavailable_reason() -> str | None:
    """Why this process cannot run cuDNN graphs (no GPU, no frontend, no executor), or None."""
    from sdpagraph import ffi
    from sdpagraph.graphs import support

    return support.environment_reason() or ffi.unavailable_reason()


def verify_numerics(specs: Any, cache_dir: str | os.PathLike[str], *, progress: bool | TextIO = True,
                    seed: int | None = None, check: Callable[..., Any] | None = None) -> NumericsReport:
    """Check every entry of `specs` numerically against the graphs in `cache_dir`, and record
    each result in the entries (see the module docstring).

    `specs`: a spec file path, several, or SpecEntry objects. `progress`: a line per entry on
    stderr (True), on the given stream, or none (False). `seed`: the random inputs' seed (default:
    fresh per entry). `check`: replaces `numerics.check.check_numerics` (tests).
    Raises SpecFileError for an invalid spec file (checked first, on any machine).
    """
    entries = with_derived(load_entries(specs))  # and the calls they run as (bins, documents, folds)
    directory = os.path.abspath(os.fspath(cache_dir))
    started = time.monotonic()
    reason = unavailable_reason()
    if reason is not None:
        return NumericsReport(directory, entries, (), time.monotonic() - started, unavailable=reason)
    check = numerics_check.check_numerics if check is None else check
    stream = sys.stderr if progress is True else (progress or None)
    cache = GraphCache(directory, mode="readwrite", max_bytes=NO_EVICTION)
    checks = []
    for index, entry in enumerate(entries):
        result = _check_entry(index, entry, cache, check, seed)
        checks.append(result)
        if stream is not None:
            stream.write(f"numerics [{index + 1}/{len(entries)}] {entry.describe()}: {_progress_text(result)}\n")
            stream.flush()
    return NumericsReport(directory, entries, tuple(checks), time.monotonic() - started)


def check_entry(entry: SpecEntry, cache: GraphCache, *, index: int = 0, check: Callable[..., Any] | None = None,
                seed: int | None = None) -> EntryCheck:
    """Check one entry's graphs in `cache` (never built: "missing" when absent) and record the
    result in their entries. For precompile, after it built an entry's graphs into its cache."""
    check = numerics_check.check_numerics if check is None else check
    return _check_entry(index, entry, cache, check, seed)


def _check_entry(index: int, entry: SpecEntry, cache: GraphCache, check: Callable[..., Any],
                 seed: int | None) -> EntryCheck:
    keys = [graph_key(entry.spec, entry.score_mod, direction) for direction in entry.directions]
    absent = [direction for direction, key in zip(entry.directions, keys) if cache.get(key) is None]
    if absent:
        return EntryCheck(index, "missing", detail=f"no {' or '.join(absent)} graph in the cache for this GPU and "
                                                   "cuDNN (`sdpagraph verify` says why; `sdpagraph precompile` builds it)")
    started = time.perf_counter()
    try:
        kwargs = {} if seed is None else {"seed": seed}
        result = check(entry.spec, entry.score_mod, entry.training, cache, **kwargs)
    except Exception as error:  # noqa: BLE001 - one broken entry must not stop the others
        return EntryCheck(index, "error", seconds=time.perf_counter() - started,
                          detail=error_text(error))
    write_errors = cache.stats()["write_errors"]
    record_numerics(cache, keys, result.to_record())
    recorded = cache.stats()["write_errors"] == write_errors
    failures = result.failures()
    detail = ("over tolerance: " + ", ".join(failures)) if failures else (
        "" if result.slice == "whole" else f"reference on {result.slice}")
    return EntryCheck(index, "passed" if result.passed else "failed", dict(result.errors), dict(result.tolerances),
                      result.seconds, detail, recorded)


def _progress_text(check: EntryCheck) -> str:
    if check.status in ("missing", "error"):
        return f"{check.status}: {check.detail}"
    return f"{check.status} ({errors_text(check.errors)}) in {check.seconds:.1f} s"
