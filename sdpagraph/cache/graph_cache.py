"""GraphCache: memory LRU, then disk, then one build, for blobs keyed by CacheKey or str.

Lookup order for `get_or_build(key, build)`:

1. memory (no I/O, no per-key lock);
2. under the key's in-process lock (threads asking for one key queue here): memory
   again, then the entry file;
3. under the key's cross-process file lock: the entry file again (another process may
   have published it while we waited), then `build()`, publish, and insert in memory.

So `build()` runs only when the graph is nowhere, and at most once at a time per key
across all threads and processes that share the directory.
"""
from __future__ import annotations

import os
import threading
import time
from contextlib import contextmanager
from typing import Any, Callable, Iterator

from sdpagraph.cache.disk import NOT_FOUND, DiskStore, Miss
from sdpagraph.cache.entry import Entry, decode_entry, encode_entry
from sdpagraph.cache.keys import Key, key_digest, key_text, key_versions, spec_of
from sdpagraph.cache.memory import KeyedLocks, MemoryLRU
from sdpagraph.config import CACHE_MAX_BYTES, CACHE_MODE, parse_size
from sdpagraph.errors import SdpagraphError

# A cache's mode and budget default to what unset SDPAGRAPH_CACHE_MODE / _MAX_BYTES mean.
DEFAULT_DISK_MAX_BYTES = parse_size(CACHE_MAX_BYTES.default)
# Long enough for any honest build (0.5-1.3 s each) queued behind a slow GPU; a holder
# that exceeds it is hung, and waiting forever would hide that.
DEFAULT_LOCK_TIMEOUT_S = 300.0

# What stats() counts; the *_seconds ones are totals. `invalid_entries` counts bad entry files,
# each once however often lookups find it (a file replaced by a new entry is a new file).
_COUNTERS = ("memory_hits", "disk_hits", "builds", "misses", "invalid_entries", "write_errors",
             "disk_load_seconds", "build_seconds", "lock_wait_seconds")

Build = Callable[[], tuple[bytes, dict[str, Any]]]


class CacheMissError(SdpagraphError, LookupError):
    """Raised in strict mode when a graph is not in the cache (strict never builds)."""


def check_mode(mode: str, source: str = "mode") -> str:
    if mode not in CACHE_MODE.choices:
        raise ValueError(f"{source} must be one of {', '.join(CACHE_MODE.choices)}; got {mode!r}")
    return mode


class GraphCache:
    """Compiled graphs (bytes + metadata dict) in memory and, optionally, on disk.

    `directory=None` or `mode="off"` keeps everything in memory. `max_bytes` bounds the
    directory (least recently used entries are evicted; default 2 GiB). Returned `meta`
    dicts are shared between callers: treat them as read-only.
    """

    def __init__(self, directory: str | os.PathLike[str] | None = None, *, mode: str | None = None,
                 max_bytes: int | None = None, lock_timeout_s: float = DEFAULT_LOCK_TIMEOUT_S) -> None:
        self.mode = check_mode(CACHE_MODE.default if mode is None else mode)
        self.max_bytes = DEFAULT_DISK_MAX_BYTES if max_bytes is None else max_bytes
        if self.max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {self.max_bytes}")
        uses_disk = directory is not None and self.mode != "off"
        self._disk = (DiskStore(directory, writable=self.mode == "readwrite", lock_timeout_s=lock_timeout_s)
                      if uses_disk else None)
        self._memory = MemoryLRU()
        self._building = KeyedLocks()
        self._counts: dict[str, float] = dict.fromkeys(_COUNTERS, 0)
        self._invalid_digests: set[str] = set()  # the bad files counted so far, by digest
        self._counts_lock = threading.Lock()

    @property
    def directory(self) -> str | None:
        return self._disk.directory if self._disk else None

    # -- public API ----------------------------------------------------------------------

    def get_or_build(self, key: Key, build: Build) -> tuple[bytes, dict[str, Any]]:
        """The cached (blob, meta) for `key`; calls `build()` only on a miss everywhere.

        Raises CacheMissError instead of building in strict mode.
        """
        text, digest = key_text(key), key_digest(key)
        entry = self._memory.get(digest)
        if entry is None:
            with self._building.hold(digest):
                entry = self._find_or_build(key, text, digest, build)
        else:
            self._count("memory_hits")
        return entry.blob, entry.meta

    def get(self, key: Key) -> tuple[bytes, dict[str, Any]] | None:
        """The cached (blob, meta) for `key`, or None; never builds."""
        text, digest = key_text(key), key_digest(key)
        found = self._find(text, digest)
        if isinstance(found, Miss):
            self._count("misses")
            return None
        return found.blob, found.meta

    def put(self, key: Key, blob: bytes, meta: dict[str, Any]) -> None:
        """Store a graph built elsewhere (memory always; disk in readwrite mode)."""
        text, digest = key_text(key), key_digest(key)
        with self._building.hold(digest), self._cross_process_lock(digest):
            self._store(key, text, digest, blob, meta)
        self._evict(keep=digest)

    def update_meta(self, key: Key, updates: dict[str, Any]) -> bool:
        """Merge `updates` into the metadata of the entry under `key`, in memory and (readwrite
        mode) on disk, atomically: a reader sees the old entry or the new one. The key, the blob,
        the versions and every other meta field (`created`, `build_time_s`, ...) are kept.

        Returns False when there is no such entry (nothing is built). In readonly and strict
        mode, and when the directory cannot be written, only this process sees the update.
        """
        text, digest = key_text(key), key_digest(key)
        with self._building.hold(digest), self._cross_process_lock(digest):
            found = self._memory.get(digest)
            on_disk = self._disk.read(digest, text) if self._disk is not None else NOT_FOUND
            if isinstance(on_disk, Entry):  # the file holds what other processes published last
                found = on_disk
            if found is None:
                return False
            data = encode_entry(Entry(found.key, found.key_hash, found.blob, {**found.meta, **updates},
                                      found.versions))
            entry = decode_entry(data, digest, text)
            if self._disk is not None and self._disk.writable and not self._disk.publish(digest, data):
                self._count("write_errors")
            self._memory.put(digest, entry)
        return True

    def entry_path(self, key: Key) -> str | None:
        """The entry file the C++ executor should read, or None when the graph is not on disk
        (no disk layer, or its write failed): then pass the blob from memory instead."""
        if self._disk is None:
            return None
        path = self._disk.entry_path(key_digest(key))
        return path if os.path.isfile(path) else None

    def stats(self) -> dict[str, Any]:
        """Counters since creation, plus what each layer holds now."""
        with self._counts_lock:
            counts = dict(self._counts)
        memory_entries, memory_bytes = self._memory.sizes()
        return {
            **counts,
            "memory_entries": memory_entries,
            "memory_bytes": memory_bytes,
            "bytes_on_disk": self._disk.total_bytes() if self._disk else 0,
            "directory": self.directory,
            "mode": self.mode,
        }

    # -- lookup --------------------------------------------------------------------------

    def _find_or_build(self, key: Key, text: str, digest: str, build: Build) -> Entry:
        found = self._find(text, digest)
        if isinstance(found, Entry):
            return found
        if self.mode == "strict":
            self._count("misses")
            raise CacheMissError(self._miss_message(text, digest, found))
        with self._cross_process_lock(digest):
            found = self._find_on_disk(text, digest)  # published by another process while we waited?
            if isinstance(found, Entry):
                return found
            self._count("misses")
            built = self._store(key, text, digest, *self._run_build(build))
        self._evict(keep=digest)
        return built

    def _find(self, text: str, digest: str) -> Entry | Miss:
        entry = self._memory.get(digest)
        if entry is not None:
            self._count("memory_hits")
            return entry
        return self._find_on_disk(text, digest)

    def _find_on_disk(self, text: str, digest: str) -> Entry | Miss:
        if self._disk is None:
            return NOT_FOUND
        started = time.perf_counter()
        found = self._disk.load(digest, text)
        if isinstance(found, Miss):
            if found.invalid:
                self._count_invalid(digest)
            return found
        self._disk.touch(digest)
        self._memory.put(digest, found)
        self._count("disk_hits")
        self._count("disk_load_seconds", time.perf_counter() - started)
        return found

    # -- building and storing ------------------------------------------------------------

    def _run_build(self, build: Build) -> tuple[bytes, dict[str, Any]]:
        started = time.perf_counter()
        blob, meta = build()
        elapsed = time.perf_counter() - started
        if not isinstance(blob, (bytes, bytearray, memoryview)):
            raise TypeError(f"build() must return (bytes, dict), got a {type(blob).__name__} blob")
        if not isinstance(meta, dict):
            raise TypeError(f"build() must return (bytes, dict), got a {type(meta).__name__} meta")
        self._count("builds")
        self._count("build_seconds", elapsed)
        return blob, {**meta, "build_time_s": elapsed}

    def _store(self, key: Key, text: str, digest: str, blob: bytes, meta: dict[str, Any]) -> Entry:
        data = encode_entry(Entry(text, digest, bytes(blob), {**meta, "created": time.time()}, key_versions(key)))
        # Keep the decoded form, so this process sees exactly what a later load sees
        # (msgpack turns tuples into lists, for one).
        entry = decode_entry(data, digest, text)
        if self._disk is not None and self._disk.writable:
            if self._disk.publish(digest, data):
                with self._counts_lock:
                    self._invalid_digests.discard(digest)  # replaced: a later bad file there is another file
            else:
                self._count("write_errors")
        self._memory.put(digest, entry)
        return entry

    @contextmanager
    def _cross_process_lock(self, digest: str) -> Iterator[None]:
        if self._disk is None:
            yield
            return
        started = time.perf_counter()
        with self._disk.key_lock(digest):
            self._count("lock_wait_seconds", time.perf_counter() - started)
            yield

    def _evict(self, keep: str) -> None:
        if self._disk is not None and self._disk.writable:
            self._disk.evict(self.max_bytes, keep=keep)

    # -- bookkeeping ---------------------------------------------------------------------

    def _count(self, name: str, amount: float = 1) -> None:
        with self._counts_lock:
            self._counts[name] += amount

    def _count_invalid(self, digest: str) -> None:
        with self._counts_lock:
            if digest not in self._invalid_digests:
                self._invalid_digests.add(digest)
                self._counts["invalid_entries"] += 1

    def _miss_message(self, text: str, digest: str, miss: Miss) -> str:
        where = f"cache directory {self.directory}" if self._disk else "memory (no cache directory)"
        return (f"no cached graph for spec {spec_of(text)!r} (key {digest[:16]}) in {where}: {miss.reason}. "
                f"Cache mode is 'strict', so graphs are never built here.")

