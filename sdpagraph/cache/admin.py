"""What the `sdpagraph cache` commands do: inspect and maintain a cache directory.

Each operation returns a Report: plain data for `--json` and the same facts as text.
Maintenance goes through DiskStore, so it follows the same locking rules as running
processes: an entry whose lock is held (being published or rebuilt) is never deleted.
"""
from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import dataclass
from typing import Any

from sdpagraph.cache.disk import DiskStore, Miss, StoredFile
from sdpagraph.cache.entry import Entry
from sdpagraph.cache.graph_cache import DEFAULT_LOCK_TIMEOUT_S
from sdpagraph.cache.keys import spec_of

SPEC_COLUMN_WIDTH = 60
_BYTE_UNITS = ("B", "KiB", "MiB", "GiB", "TiB")


@dataclass(frozen=True)
class Report:
    """The outcome of one command: `data` for --json, `text` for people, and the exit code."""

    data: Any  # JSON-able except for bytes, which to_json() summarizes
    text: str
    exit_code: int = 0

    def to_json(self) -> str:
        return json.dumps(self.data, indent=2, sort_keys=True, default=_describe_unjsonable)


def list_entries(directory: str) -> Report:
    store = _open(directory, writable=False)
    if store is None:
        return _no_directory(directory, {"directory": directory, "entries": []})
    rows = sorted((_summarize(store, stored) for stored in store.scan()),
                  key=lambda row: row["last_used"], reverse=True)
    if not rows:
        return Report({"directory": store.directory, "entries": []}, f"no entries in {store.directory}")
    now = time.time()
    table = format_table(
        ["KEY", "SPEC", "SIZE", "AGE", "LAST USE"],
        [[row["digest"][:12],
          _clip(row["spec"] if row["valid"] else f"<invalid: {row['problem']}>", SPEC_COLUMN_WIDTH),
          format_bytes(row["size"]),
          format_age(now - row["created"]) if row["created"] is not None else "?",
          format_age(now - row["last_used"]) + " ago"]
         for row in rows])
    footer = f"{_count_entries(len(rows))}, {format_bytes(sum(row['size'] for row in rows))} in {store.directory}"
    return Report({"directory": store.directory, "entries": rows}, f"{table}\n{footer}")


def entry_info(directory: str, key_prefix: str) -> Report:
    """Everything stored for the entry whose digest starts with `key_prefix`."""
    store = _open(directory, writable=False)
    matches = [stored for stored in store.scan() if stored.digest.startswith(key_prefix.lower())] if store else []
    if len(matches) != 1:
        problem = "no entry" if not matches else f"{len(matches)} entries"
        return Report({"error": f"{problem} matches {key_prefix!r}"}, f"{problem} matches {key_prefix!r}"
                      f" in {directory}", exit_code=1)
    stored = matches[0]
    found = store.read(stored.digest)
    data = {**_file_facts(stored), **_entry_facts(found)}
    if isinstance(found, Entry):
        data.update(key=found.key, meta=found.meta, versions=found.versions,
                    blob_sha256=hashlib.sha256(found.blob).hexdigest())
    return Report(data, _format_fields(data), exit_code=0 if data["valid"] else 1)


def verify_entries(directory: str, remove: bool) -> Report:
    """Check every entry (header, checksum, payload, key hash); optionally delete bad ones."""
    store = _open(directory, writable=remove)
    if store is None:
        return _no_directory(directory, {"directory": directory, "checked": 0, "bad": []})
    files = store.scan()
    bad = []
    for stored in files:
        found = store.read(stored.digest)
        if isinstance(found, Miss):
            bad.append({"digest": stored.digest, "path": stored.path, "problem": found.reason,
                        "removed": remove and store.remove(stored)})
    lines = [f"BAD {item['digest'][:12]}  {item['problem']}" + ("  (removed)" if item["removed"] else "")
             for item in bad]
    lines.append(f"checked {_count_entries(len(files))} in {store.directory}: "
                 + (f"{len(bad)} bad" if bad else "all valid"))
    data = {"directory": store.directory, "checked": len(files), "bad": bad}
    return Report(data, "\n".join(lines), exit_code=1 if bad else 0)


def prune(directory: str, max_bytes: int) -> Report:
    """Evict least recently used entries until the directory holds at most `max_bytes`."""
    store = _open(directory, writable=True)
    if store is None:
        return _no_directory(directory, {"directory": directory, "removed": [], "bytes_after": 0})
    before = store.total_bytes()
    removed = store.evict(max_bytes)
    after = store.total_bytes()
    data = {"directory": store.directory, "max_bytes": max_bytes, "bytes_before": before, "bytes_after": after,
            "removed": [stored.digest for stored in removed]}
    text = (f"removed {_count_entries(len(removed))}: {format_bytes(before)} -> {format_bytes(after)} "
            f"(limit {format_bytes(max_bytes)}) in {store.directory}")
    if after > max_bytes:
        text += "\nstill over the limit: the remaining entries are in use by other processes"
    return Report(data, text)


def clear(directory: str) -> Report:
    """Delete every entry not in use, its lock files and abandoned temp files."""
    store = _open(directory, writable=True)
    if store is None:
        return _no_directory(directory, {"directory": directory, "removed": 0, "in_use": 0})
    files = store.scan()
    removed = sum(store.remove(stored) for stored in files)
    in_use = len(files) - removed
    data = {"directory": store.directory, "removed": removed, "in_use": in_use,
            "lock_files_removed": store.remove_idle_locks(), "temp_files_removed": store.remove_stale_temps()}
    text = f"removed {_count_entries(removed)} from {store.directory}" + (f"; {in_use} in use, kept" if in_use else "")
    return Report(data, text)


# -- helpers ---------------------------------------------------------------------------


def _open(directory: str, writable: bool) -> DiskStore | None:
    # Maintenance never creates a cache directory that is not there.
    if not os.path.isdir(directory):
        return None
    return DiskStore(directory, writable=writable, lock_timeout_s=DEFAULT_LOCK_TIMEOUT_S)


def _no_directory(directory: str, data: dict[str, Any]) -> Report:
    return Report(data, f"no cache directory at {directory}")


def _summarize(store: DiskStore, stored: StoredFile) -> dict[str, Any]:
    return {**_file_facts(stored), **_entry_facts(store.read(stored.digest))}


def _file_facts(stored: StoredFile) -> dict[str, Any]:
    return {"digest": stored.digest, "path": stored.path, "size": stored.size, "last_used": stored.last_used}


def _entry_facts(found: Entry | Miss) -> dict[str, Any]:
    if isinstance(found, Miss):
        return {"valid": False, "problem": found.reason, "spec": None, "created": None}
    return {"valid": True, "problem": None, "spec": _spec_summary(found), "created": found.meta.get("created")}


def _spec_summary(entry: Entry) -> str:
    # Builders may store a short human summary; otherwise show the key's spec text.
    summary = entry.meta.get("summary")
    return summary if isinstance(summary, str) else spec_of(entry.key)


def _describe_unjsonable(value: Any) -> str:
    if isinstance(value, (bytes, bytearray)):
        return f"<{len(value)} bytes>"
    return repr(value)


def _format_fields(data: dict[str, Any]) -> str:
    width = max(map(len, data))
    return "\n".join(f"{name:<{width}}  {_describe_field(value)}" for name, value in data.items())


def _describe_field(value: Any) -> str:
    if isinstance(value, (dict, list)):
        return json.dumps(value, sort_keys=True, default=_describe_unjsonable)
    return str(value)


def format_table(headers: list[str], rows: list[list[str]]) -> str:
    """Left-aligned text columns, as `cache ls` and the precompile report print them."""
    widths = [max(len(cell) for cell in column) for column in zip(headers, *rows)]
    return "\n".join("  ".join(cell.ljust(width) for cell, width in zip(line, widths)).rstrip()
                     for line in [headers, *rows])


def _count_entries(count: int) -> str:
    return f"{count} entry" if count == 1 else f"{count} entries"


def _clip(text: str, width: int) -> str:
    return text if len(text) <= width else text[:width - 3] + "..."


def format_bytes(count: float) -> str:
    exponent = 0
    while count >= 1024 and exponent < len(_BYTE_UNITS) - 1:
        count /= 1024
        exponent += 1
    return f"{count:.0f} B" if exponent == 0 else f"{count:.1f} {_BYTE_UNITS[exponent]}"


def format_age(seconds: float) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= size:
            return f"{seconds / size:.1f} {unit}"
    return f"{max(seconds, 0):.0f} s"
