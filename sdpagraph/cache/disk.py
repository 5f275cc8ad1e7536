"""The on-disk layer: entry files under one directory, shared by every process.

    <directory>/<digest[:2]>/<digest>.sdpg      an entry (format in entry.py)
    <directory>/<digest[:2]>/<digest>.lock      its cross-process lock (flock, left in place)
    <directory>/<digest[:2]>/<digest>.*.tmp     a publication in progress (never read)

Writers publish by writing a temp file in the entry's directory, fsyncing it and renaming
it over the entry, so a reader sees the old entry, the new one, or none; never a part.
Locks are flock(2) locks, which the kernel drops when their holder dies, so a killed
builder cannot leave a lock that blocks others. The last-use time of an entry is its
mtime; eviction removes the least recently used entries and skips any entry whose lock
another process holds (it is being published or rebuilt).

Every OS failure (missing or read-only directory, full disk, permissions) degrades to
"not on disk" with one warning: one per directory for a directory that cannot be read or
written (a path that is a file, a folder without permission), one per file for a bad
entry. The one error raised is TimeoutError, when a lock's holder does not finish in time.
"""
from __future__ import annotations

import logging
import os
import re
import stat
import tempfile
import time
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from typing import Iterator

import filelock

from sdpagraph.cache.entry import ENTRY_SUFFIX, CorruptEntry, Entry, decode_entry
from sdpagraph.logs import cache_logger, log_once

LOCK_SUFFIX = ".lock"
TEMP_SUFFIX = ".tmp"
PRIVATE_DIR_MODE = 0o700
PRIVATE_FILE_MODE = 0o600
# A publication takes milliseconds; a temp file this old was left by a killed writer.
STALE_TEMP_AGE_S = 3600.0
LOCK_POLL_INTERVAL_S = 0.02

_DIGEST_NAME = re.compile(r"^[0-9a-f]{64}$")


@dataclass(frozen=True)
class StoredFile:
    """An entry file as found by a directory scan."""

    digest: str
    path: str
    size: int
    mtime_ns: int

    @property
    def last_used(self) -> float:
        return self.mtime_ns / 1e9


@dataclass(frozen=True)
class Miss:
    """Why a lookup found no usable entry; `invalid` when a file was there but rejected;
    `folder` when a folder on the way to the file cannot be read (every entry in it misses)."""

    reason: str
    invalid: bool = False
    folder: str | None = None


NOT_FOUND = Miss("not in the cache")


class DiskStore:
    """Entry files in `directory`. `writable=False` never creates, touches or locks anything."""

    def __init__(self, directory: str | os.PathLike[str], *, writable: bool, lock_timeout_s: float) -> None:
        self.directory = os.path.abspath(os.path.expanduser(os.fspath(directory)))
        self.writable = writable
        self.lock_timeout_s = lock_timeout_s
        self._prepare_directory()

    # -- paths ---------------------------------------------------------------------------

    def entry_path(self, digest: str) -> str:
        return os.path.join(self.directory, digest[:2], digest + ENTRY_SUFFIX)

    def lock_path(self, digest: str) -> str:
        return os.path.join(self.directory, digest[:2], digest + LOCK_SUFFIX)

    # -- reading -------------------------------------------------------------------------

    def read(self, digest: str, key: str | None = None) -> Entry | Miss:
        """The entry named `digest` (holding `key`, when given), or why there is none."""
        path = self.entry_path(digest)
        try:
            data = _read_file(path)
        except FileNotFoundError:
            return NOT_FOUND
        except OSError as error:
            blocked = _blocking_folder(self.directory, path)
            if blocked is not None:
                folder, why = blocked
                return Miss(f"cannot read cache directory {folder} ({why})", folder=folder)
            return Miss(f"unreadable: {error.strerror or error}", invalid=True)
        try:
            return decode_entry(data, digest, key)
        except CorruptEntry as error:
            return Miss(str(error), invalid=True)

    def load(self, digest: str, key: str) -> Entry | Miss:
        """`read`, with one warning per rejected file (the caller then rebuilds or reports)."""
        found = self.read(digest, key)
        if isinstance(found, Miss) and found.folder is not None:
            self._warn_once("directory", "%s; every lookup there misses", found.reason, about=found.folder)
        elif isinstance(found, Miss) and found.invalid:
            path = self.entry_path(digest)
            self._warn_once("invalid", "ignoring cache entry %s: %s", path, found.reason, about=path)
        return found

    def touch(self, digest: str) -> None:
        """Record a use of the entry (its mtime is the LRU clock for eviction)."""
        if not self.writable:
            return
        try:
            os.utime(self.entry_path(digest))
        except FileNotFoundError:
            pass  # evicted since it was read: nothing left to protect
        except OSError as error:
            self._warn_unwritable("recording a use", error)

    # -- writing -------------------------------------------------------------------------

    def publish(self, digest: str, data: bytes) -> bool:
        """Atomically replace the entry's file with `data`. False (warned once) on failure."""
        if not self.writable:
            return False
        path = self.entry_path(digest)
        try:
            _make_private_dirs(self.directory, os.path.dirname(path))
            write_atomically(path, data, temp_prefix=digest + ".")
        except OSError as error:
            self._warn_unwritable("writing an entry", error)
            return False
        return True

    @contextmanager
    def key_lock(self, digest: str) -> Iterator[None]:
        """Hold the cross-process lock of one key while building and publishing it.

        A read-only store has nothing to coordinate (each process keeps its builds in
        memory), so this does nothing; when lock files cannot be created it does nothing
        either, after one warning.
        """
        if not self.writable:
            yield
            return
        lock = self._file_lock(digest)
        try:
            _make_private_dirs(self.directory, os.path.dirname(lock.lock_file))
            lock.acquire()
            held = True
        except filelock.Timeout:
            raise TimeoutError(
                f"waited {self.lock_timeout_s:g} s for cache lock {lock.lock_file}: another process is "
                "building this graph and has not finished. Locks are released when their holder exits, "
                "so a process holding it is still alive (possibly hung); find it with `fuser` on the lock file."
            ) from None
        except OSError as error:
            self._warn_unwritable("creating a lock file", error)
            held = False
        try:
            yield
        finally:
            if held:
                lock.release()

    # -- scanning and removal ------------------------------------------------------------

    def scan(self) -> list[StoredFile]:
        """Every entry file (not temp or lock files); empty when the directory is missing."""
        found = []
        for item in self._shard_items():
            digest, suffix = os.path.splitext(item.name)
            if suffix == ENTRY_SUFFIX and _DIGEST_NAME.match(digest):
                with suppress(FileNotFoundError):  # removed since listed
                    info = item.stat()
                    found.append(StoredFile(digest, item.path, info.st_size, info.st_mtime_ns))
        return found

    def total_bytes(self) -> int:
        return sum(stored.size for stored in self.scan())

    def remove(self, stored: StoredFile) -> bool:
        """Delete a scanned entry unless another process holds its lock or it changed since the scan."""
        with self._lock_if_free(stored.digest) as held:
            if not held:
                return False  # being published or rebuilt right now, or we may not write here
            try:
                if os.stat(stored.path).st_mtime_ns != stored.mtime_ns:
                    return False  # used or republished since the scan: no longer least recent
                os.unlink(stored.path)
            except OSError:
                return False
            return True

    def evict(self, max_bytes: int, keep: str | None = None) -> list[StoredFile]:
        """Remove least recently used entries until the total is <= max_bytes; never `keep`."""
        self.remove_stale_temps()
        files = sorted(self.scan(), key=lambda stored: stored.mtime_ns)
        total = sum(stored.size for stored in files)
        removed = []
        for stored in files:
            if total <= max_bytes:
                break
            if stored.digest != keep and self.remove(stored):
                total -= stored.size
                removed.append(stored)
        return removed

    def stale_temps(self) -> list[str]:
        """The temp files left by killed writers (old enough that no live writer owns them)."""
        cutoff = time.time() - STALE_TEMP_AGE_S
        stale = []
        for item in self._shard_items():
            if item.name.endswith(TEMP_SUFFIX):
                with suppress(OSError):
                    if item.stat().st_mtime < cutoff:
                        stale.append(item.path)
        return stale

    def remove_stale_temps(self) -> int:
        """Delete the temp files left by killed writers; how many were deleted."""
        if not self.writable:
            return 0
        removed = 0
        for path in self.stale_temps():
            with suppress(OSError):
                os.unlink(path)
                removed += 1
        return removed

    def remove_idle_locks(self) -> int:
        """Delete lock files nobody holds (for `cache clear`).

        A process that opened the old lock file before the unlink and locks it afterwards
        holds a lock on a nameless file, so at worst it builds a graph another process is
        also building; entries stay whole because publication is an atomic rename.
        """
        removed = 0
        for item in self._shard_items():
            digest, suffix = os.path.splitext(item.name)
            if suffix == LOCK_SUFFIX and _DIGEST_NAME.match(digest):
                with self._lock_if_free(digest) as held, suppress(OSError):
                    if held:
                        os.unlink(item.path)
                        removed += 1
        return removed

    # -- internals -----------------------------------------------------------------------

    @contextmanager
    def _lock_if_free(self, digest: str) -> Iterator[bool]:
        """Take the key's lock without waiting; yields whether it is held (never in a read-only store)."""
        lock = self._file_lock(digest)
        held = False
        if self.writable:
            try:
                lock.acquire(blocking=False)
                held = True
            except (filelock.Timeout, OSError):
                pass  # another process holds it, or this directory refuses lock files
        try:
            yield held
        finally:
            if held:
                lock.release()

    def _shard_items(self) -> Iterator[os.DirEntry[str]]:
        for shard in _directory_items(self.directory):
            if shard.is_dir(follow_symlinks=False):
                yield from _directory_items(shard.path)

    def _file_lock(self, digest: str) -> filelock.UnixFileLock:
        # UnixFileLock explicitly: the kernel must release a dead holder's lock, which the
        # marker-file fallback ("soft" locks) cannot do.
        return filelock.UnixFileLock(self.lock_path(digest), timeout=self.lock_timeout_s,
                                     mode=PRIVATE_FILE_MODE, poll_interval=LOCK_POLL_INTERVAL_S)

    def _warn_once(self, problem: str, message: str, *args: object, about: str | None = None) -> None:
        # A degraded cache says so once per process, not per call: once per problem with this
        # directory (`about` it, default the directory itself).
        log_once(cache_logger, logging.WARNING, message, *args, topic=(problem, about or self.directory))

    def _warn_unwritable(self, action: str, error: OSError) -> None:
        # One warning for every way of failing to write (or read, see `load`): the user needs to
        # hear once that this directory does not work, not about each operation that found out.
        self._warn_once("directory", "cannot write to cache directory %s (%s while %s); new graphs are kept in "
                        "memory only", self.directory, error.strerror or error, action)

    def _prepare_directory(self) -> None:
        if self.writable:
            try:
                _make_private_dirs(self.directory)
            except FileExistsError:
                pass  # a file is in the way: reported below, as for a read-only store
            except OSError as error:
                self._warn_unwritable("creating it", error)
                return
        try:
            mode = os.stat(self.directory).st_mode
        except FileNotFoundError:
            self._warn_once("missing", "cache directory %s does not exist; every lookup will miss", self.directory)
            return
        except OSError as error:
            self._warn_once("directory", "cannot access cache directory %s (%s); every lookup there misses",
                            self.directory, error.strerror or error)
            return
        if not stat.S_ISDIR(mode):
            self.writable = False  # nothing can be stored below a file: the store is memory only
            self._warn_once("directory", "cache directory %s is not a directory; every lookup there misses and "
                            "new graphs are kept in memory only", self.directory)
            return
        if mode & (stat.S_IWGRP | stat.S_IWOTH):
            # Entries are executable plans: whoever can write here can choose what runs on the GPU.
            self._warn_once("permissions", "cache directory %s is group/world-writable (mode %s); other users could "
                            "plant graphs that this process runs. Run: chmod 700 %s",
                            self.directory, oct(stat.S_IMODE(mode)), self.directory)


def _read_file(path: str) -> bytes:
    # os.open rather than open(): one code path for every file access, so faults (EACCES,
    # EROFS) can be injected in tests by wrapping os.open.
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    with os.fdopen(fd, "rb") as file:
        return file.read()


def write_atomically(path: str, data: bytes, temp_prefix: str) -> None:
    """Publish `data` at `path` whole or not at all: temp file in the same folder, fsync, os.replace."""
    directory = os.path.dirname(path)
    fd, temp_path = tempfile.mkstemp(prefix=temp_prefix, suffix=TEMP_SUFFIX, dir=directory)
    try:
        try:
            _write_all(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(temp_path, path)
    except BaseException:
        with suppress(OSError):
            os.unlink(temp_path)
        raise
    with suppress(OSError):  # best effort: some filesystems refuse fsync on a directory
        _fsync_directory(directory)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        written = os.write(fd, view)
        view = view[written:]


def _fsync_directory(directory: str) -> None:
    # Makes the rename itself durable across a power loss; the entry is already complete.
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _make_private_dirs(*directories: str) -> None:
    # In order, so the cache directory exists (private) before its shards; os.makedirs
    # gives the mode only to the last component, which is the one that matters.
    for directory in directories:
        os.makedirs(directory, mode=PRIVATE_DIR_MODE, exist_ok=True)


def _blocking_folder(directory: str, path: str) -> tuple[str, str] | None:
    """The folder that keeps the file `path` in `directory` from being opened (not a directory,
    or one this user may not search) and why; None when the file itself is the problem."""
    for folder in (directory, os.path.dirname(path)):
        try:
            os.stat(os.path.join(folder, os.curdir))  # resolving `folder/.` needs a searchable directory
        except OSError as error:
            return folder, error.strerror or str(error)
    return None


def _directory_items(directory: str) -> list[os.DirEntry[str]]:
    try:
        with os.scandir(directory) as items:
            return list(items)
    except OSError:
        return []
