"""What the `sdpagraph cache` commands do: inspect and maintain a cache directory.

Each operation returns a Report: plain data for `--json` and the same facts as text.
Maintenance goes through DiskStore, so it follows the same locking rules as running
processes: an entry whose lock is held (being published or rebuilt) is never deleted.

A directory that does not exist holds nothing (exit 0: nothing has been cached there).
A path that is not a directory, or one this user may not read (or, to remove what is there,
write), is an error: a Report with `error` set and exit code 2, and nothing is changed.
"""
from __future__ import annotations

import hashlib
import json
import os
import stat
import time
from dataclasses import dataclass
from typing import Any

from sdpagraph.cache.disk import DiskStore, Miss, StoredFile
from sdpagraph.cache.entry import Entry
from sdpagraph.cache.graph_cache import DEFAULT_LOCK_TIMEOUT_S
from sdpagraph.cache.keys import spec_of
from sdpagraph.deploy.formatting import format_age, format_bytes, format_table

SPEC_COLUMN_WIDTH = 60
EXIT_ERROR = 2


@dataclass(frozen=True)
class Report:
    """The outcome of one command: `data` for --json, `text` for people, and the exit code."""

    data: Any  # JSON-able except for bytes, which to_json() summarizes
    text: str
    exit_code: int = 0
    error: str | None = None  # set when the command could not do its job: `text` is then this one line

    def to_json(self) -> str:
        return json.dumps(self.data, indent=2, sort_keys=True, default=_describe_unjsonable)


def list_entries(directory: str) -> Report:
    store, problem = _open(directory, writable=False, data={"directory": directory, "entries": []})
    if store is None:
        return problem
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
    store, problem = _open(directory, writable=False, data={"directory": directory})
    if problem is not None and problem.error is not None:
        return problem
    matches = [stored for stored in store.scan() if stored.digest.startswith(key_prefix.lower())] if store else []
    if len(matches) != 1:
        problem_text = "no entry" if not matches else f"{len(matches)} entries"
        where = directory if store else f"{directory} (no such directory)"
        return Report({"error": f"{problem_text} matches {key_prefix!r}"}, f"{problem_text} matches {key_prefix!r}"
                      f" in {where}", exit_code=1)
    stored = matches[0]
    found = store.read(stored.digest)
    data = {**_file_facts(stored), **_entry_facts(found)}
    if isinstance(found, Entry):
        data.update(key=found.key, meta=found.meta, versions=found.versions,
                    blob_sha256=hashlib.sha256(found.blob).hexdigest())
    return Report(data, _format_fields(data), exit_code=0 if data["valid"] else 1)


def verify_entries(directory: str, remove: bool) -> Report:
    """Check every entry (header, checksum, payload, key hash) and look for temp files left by
    killed writers; with `remove`, delete both. Write access is needed only when there is
    something to delete."""
    data = {"directory": directory, "checked": 0, "bad": [], "stale_temp_files": []}
    store, problem = _open(directory, writable=False, data=data)
    if store is None:
        return problem
    files = store.scan()
    read = {stored: store.read(stored.digest) for stored in files}
    bad = [(stored, found.reason) for stored, found in read.items() if isinstance(found, Miss)]
    stale = store.stale_temps()
    if remove and (bad or stale):
        store, problem = _open(directory, writable=True, data=data)
        if store is None:
            return problem
    bad_items = [{"digest": stored.digest, "path": stored.path, "problem": reason,
                  "removed": remove and store.remove(stored)} for stored, reason in bad]
    temps_removed = store.remove_stale_temps() if remove else 0
    lines = [f"BAD {item['digest'][:12]}  {item['problem']}" + ("  (removed)" if item["removed"] else "")
             for item in bad_items]
    lines.append(f"checked {_count_entries(len(files))} in {store.directory}: "
                 + (f"{len(bad)} bad" if bad else "all valid"))
    if stale:
        temps = f"{len(stale)} stale temp file{'s' if len(stale) != 1 else ''}, left by killed writers"
        lines.append(f"{temps}: {temps_removed} removed" if remove else
                     f"{temps} (never read; `sdpagraph cache verify --remove` deletes them)")
    data = {"directory": store.directory, "checked": len(files), "bad": bad_items, "stale_temp_files": stale,
            "stale_temp_files_removed": temps_removed}
    return Report(data, "\n".join(lines), exit_code=1 if bad else 0)


def prune(directory: str, max_bytes: int) -> Report:
    """Evict least recently used entries until the directory holds at most `max_bytes`."""
    store, problem = _open(directory, writable=True, data={"directory": directory, "removed": [], "bytes_after": 0})
    if store is None:
        return problem
    before = store.total_bytes()
    removed = store.evict(max_bytes)
    after = store.total_bytes()
    data = {"directory": store.directory, "max_bytes": max_bytes, "bytes_before": before, "bytes_after": after,
            "removed": [stored.digest for stored in removed]}
    text = (f"removed {_count_entries(len(removed))}: {format_bytes(before)} -> {format_bytes(after)} "
            f"(limit {format_bytes(max_bytes)}) in {store.directory}")
    if after > max_bytes:
        # The directory is writable (checked above): what stays is locked by another process
        # (being published or rebuilt) or was used since the scan.
        text += "\nstill over the limit: the remaining entries are in use by other processes"
    return Report(data, text)


def clear(directory: str) -> Report:
    """Delete every entry not in use, its lock files and abandoned temp files."""
    store, problem = _open(directory, writable=True, data={"directory": directory, "removed": 0, "in_use": 0})
    if store is None:
        return problem
    files = store.scan()
    removed = sum(store.remove(stored) for stored in files)
    in_use = len(files) - removed
    data = {"directory": store.directory, "removed": removed, "in_use": in_use,
            "lock_files_removed": store.remove_idle_locks(), "temp_files_removed": store.remove_stale_temps()}
    text = f"removed {_count_entries(removed)} from {store.directory}" + (f"; {in_use} in use, kept" if in_use else "")
    return Report(data, text)


# -- helpers ---------------------------------------------------------------------------


def _open(directory: str, writable: bool, data: dict[str, Any]) -> tuple[DiskStore, None] | tuple[None, Report]:
    """The store at `directory`, or (None, the Report to give instead).

    Maintenance never creates a cache directory that is not there (a Report with exit code
    0: it holds nothing). A path that is not a directory, or that this user may not read
    (or, with `writable`, write), is an error Report (exit code 2): DiskStore would see an
    empty directory there, and a removal it cannot make as an entry in use.
    """
    problem = access_problem(directory, writable)
    if problem is None:
        return DiskStore(directory, writable=writable, lock_timeout_s=DEFAULT_LOCK_TIMEOUT_S), None
    if problem == MISSING:
        return None, Report(data, f"no cache directory at {directory}: it does not exist (nothing is cached there)")
    return None, Report({**data, "error": problem, "exit_code": EXIT_ERROR}, problem, EXIT_ERROR, error=problem)


MISSING = "missing"


def access_problem(directory: str, writable: bool) -> str | None:
    """None when `directory` is a cache directory this user may read (and, with `writable`,
    remove entries from); MISSING when it does not exist; else the problem, in one line."""
    try:
        info = os.stat(directory)
    except FileNotFoundError:
        return MISSING
    except NotADirectoryError:
        return f"{directory} is not a directory (a part of the path is a file)"
    except PermissionError:
        return f"permission denied: cannot reach {directory}"
    except OSError as error:
        return f"cannot access {directory}: {error.strerror or error}"
    if not stat.S_ISDIR(info.st_mode):
        return f"{directory} is not a directory"
    try:
        with os.scandir(directory) as items:
            shards = sorted(item.path for item in items if item.is_dir(follow_symlinks=False))
    except PermissionError:
        return f"permission denied: cannot read {directory}"
    except OSError as error:
        return f"cannot read {directory}: {error.strerror or error}"
    for path in (directory, *shards):
        if not os.access(path, os.R_OK | os.X_OK):
            return f"permission denied: cannot read {path}"
    if writable:
        # Entries, their lock files and temp files live in the shard folders.
        for path in shards:
            if not os.access(path, os.W_OK | os.X_OK):
                return f"permission denied: cannot write to {path} (its entries cannot be removed); nothing was removed"
    return None


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


def _count_entries(count: int) -> str:
    return f"{count} entry" if count == 1 else f"{count} entries"


def _clip(text: str, width: int) -> str:
    return text if len(text) <= width else text[:width - 3] + "..."
