"""The in-process layer: a thread-safe LRU of decoded entries, per-key build locks."""
from __future__ import annotations

import threading
from collections import OrderedDict
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator

from sdpagraph.cache.entry import Entry

DEFAULT_MAX_ENTRIES = 512
DEFAULT_MAX_BYTES = 512 * 1024 * 1024


class MemoryLRU:
    """Entries by digest, least recently used dropped first beyond either bound.

    The newest entry is always kept, even when it alone exceeds `max_bytes`: the caller is
    about to use it.
    """

    def __init__(self, max_entries: int = DEFAULT_MAX_ENTRIES, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        if max_entries < 1:
            raise ValueError(f"max_entries must be >= 1, got {max_entries}")
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self._entries: OrderedDict[str, Entry] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def get(self, digest: str) -> Entry | None:
        with self._lock:
            entry = self._entries.get(digest)
            if entry is not None:
                self._entries.move_to_end(digest)
            return entry

    def put(self, digest: str, entry: Entry) -> None:
        with self._lock:
            previous = self._entries.pop(digest, None)
            if previous is not None:
                self._bytes -= len(previous.blob)
            self._entries[digest] = entry
            self._bytes += len(entry.blob)
            while len(self._entries) > 1 and (
                len(self._entries) > self.max_entries or self._bytes > self.max_bytes
            ):
                _, dropped = self._entries.popitem(last=False)
                self._bytes -= len(dropped.blob)

    def sizes(self) -> tuple[int, int]:
        """(entry count, blob bytes) held now."""
        with self._lock:
            return len(self._entries), self._bytes


@dataclass
class _Slot:
    lock: threading.Lock = field(default_factory=threading.Lock)
    users: int = 0


class KeyedLocks:
    """One mutex per key, alive only while some thread holds or waits for it.

    Threads asking for the same key queue on its mutex; other keys proceed in parallel.
    """

    def __init__(self) -> None:
        self._guard = threading.Lock()
        self._slots: dict[str, _Slot] = {}

    @contextmanager
    def hold(self, key: str) -> Iterator[None]:
        with self._guard:
            slot = self._slots.setdefault(key, _Slot())
            slot.users += 1
        try:
            with slot.lock:
                yield
        finally:
            with self._guard:
                slot.users -= 1
                if slot.users == 0:
                    del self._slots[key]

    def __len__(self) -> int:
        with self._guard:
            return len(self._slots)
