"""Verify that a cache directory holds every graph of a spec file, for this GPU and cuDNN.

    verify(specs, cache_dir=DIR)               does DIR hold every graph, under the runtime's keys?

It asks the builder for the runtime's own cache keys (see `sdpagraph.deploy`), so "in DIR"
means "the runtime finds it": a graph built for another GPU, cuDNN or frontend version has
another key and counts as missing, and the report says what else the directory holds.
"""
from __future__ import annotations

import os
import shlex
from collections import Counter
from dataclasses import dataclass
from typing import Any

from sdpagraph.deploy.formatting import format_table
from sdpagraph.cache.disk import DiskStore, Miss
from sdpagraph.cache.graph_cache import DEFAULT_LOCK_TIMEOUT_S
from sdpagraph.cache.keys import key_digest, key_text, key_versions
from sdpagraph.deploy.precompile import Builder, ExitCode, usable_builder
from sdpagraph.deploy.derived_entries import with_derived
from sdpagraph.deploy.spec_entry import SpecEntry
from sdpagraph.deploy.specfile import load_entries


@dataclass(frozen=True)
class GraphCheck:
    entry: int
    direction: str
    status: str  # "present", "missing" or "invalid"
    reason: str = ""


@dataclass(frozen=True)
class VerifyReport(ExitCode):
    cache_dir: str
    entries: tuple[SpecEntry, ...]
    checks: tuple[GraphCheck, ...]
    environment: dict[str, Any] | None  # this machine's key versions (None: no entries to key)
    other_environments: tuple[tuple[str, int], ...]  # ("built for <versions>" or "it cannot read (why)", graphs)
    fix_command: str

    @property
    def problems(self) -> list[GraphCheck]:
        return [check for check in self.checks if check.status != "present"]

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_dict(self) -> dict[str, Any]:
        return {
            "cache_dir": self.cache_dir,
            "ok": self.ok,
            "environment": self.environment,
            "graphs": [{"entry": check.entry, "direction": check.direction, "status": check.status,
                        "reason": check.reason, "spec": self.entries[check.entry].describe()}
                       for check in self.checks],
            "other_environments": [{"environment": label, "graphs": count}
                                   for label, count in self.other_environments],
            "fix_command": None if self.ok else self.fix_command,
        }

    def text(self) -> str:
        rows = [[str(check.entry), check.direction, check.status, self.entries[check.entry].describe(), check.reason]
                for check in self.problems]
        lines = [format_table(["#", "GRAPH", "STATUS", "SPEC", "REASON"], rows)] if rows else []
        present = len(self.checks) - len(self.problems)
        lines.append(f"{present} of {len(self.checks)} graphs present and valid in {self.cache_dir}"
                     + (f" for {describe_environment(self.environment)}" if self.environment else ""))
        lines += [f"it also holds {count} graphs {label}" for label, count in self.other_environments]
        if not self.ok:
            lines.append(f"to build the missing graphs, run on this machine: {self.fix_command}")
        return "\n".join(lines)


def verify(specs: Any, cache_dir: str | os.PathLike[str], *, builder: Builder | None = None) -> VerifyReport:
    """Check that `cache_dir` holds a valid graph for every graph of every entry of `specs`,
    under the key the runtime computes on this machine (its GPU, cuDNN and frontend).

    Reads only: nothing in the directory is created, changed or touched.
    Raises SpecFileError for an invalid spec file (checked first, on any machine), then
    BuilderUnavailable where keys cannot be computed (no GPU, no cuDNN frontend).
    """
    entries = with_derived(load_entries(specs))  # and the calls they run as (bins, documents, folds)
    builder = usable_builder(builder, "verify a cache")
    directory = os.path.abspath(os.fspath(cache_dir))
    store = DiskStore(directory, writable=False, lock_timeout_s=DEFAULT_LOCK_TIMEOUT_S)
    checks, environment = [], None
    for index, entry in enumerate(entries):
        for direction in entry.directions:
            key = builder.graph_key(entry.spec, entry.score_mod, direction)
            environment = key_versions(key)
            found = store.read(key_digest(key), key_text(key))
            if not isinstance(found, Miss):
                checks.append(GraphCheck(index, direction, "present"))
            else:
                checks.append(GraphCheck(index, direction, "invalid" if found.invalid else "missing", found.reason))
    return VerifyReport(directory, entries, tuple(checks), environment, _other_environments(store, environment),
                        precompile_command(specs, directory))


def _other_environments(store: DiskStore, here: dict[str, Any] | None) -> tuple[tuple[str, int], ...]:
    """What the directory holds besides graphs for this machine: the usual cause of misses."""
    found: Counter[str] = Counter()
    for stored in store.scan():
        entry = store.read(stored.digest)
        if isinstance(entry, Miss):
            found[f"it cannot read ({entry.reason})"] += 1
        elif entry.versions != here:
            found[f"built for {describe_environment(entry.versions)}"] += 1
    return tuple(sorted(found.items()))


def describe_environment(versions: dict[str, Any] | None) -> str:
    if not versions:
        return "an unknown environment (entry without versions)"
    return ", ".join(f"{name} {value}" for name, value in sorted(versions.items()))


def precompile_command(specs: Any, directory: str) -> str:
    """The `sdpagraph precompile` command that fills `directory` with the graphs of `specs`'s files."""
    paths = [specs] if isinstance(specs, (str, os.PathLike)) else [
        item for item in specs if isinstance(item, (str, os.PathLike))]
    files = " ".join(shlex.quote(os.fspath(path)) for path in paths) or "SPECS.json"
    return f"sdpagraph precompile {files} --cache-dir {shlex.quote(directory)}"
