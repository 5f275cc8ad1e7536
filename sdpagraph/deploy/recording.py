"""Recording the specs a process traces into a spec file (`record`, SDPAGRAPH_RECORD).

`record_call` listens to the runtime (`call.add_trace_listener`): it is
called once per traced attention call and returns at once when nothing is recording. Entries are merged into the file under a lock and written
atomically, so processes recording into one file merge instead of clobbering.
"""
from __future__ import annotations

import os
import threading
from contextlib import contextmanager
from typing import Iterator

from sdpagraph.config import RECORD
from sdpagraph.deploy.spec_entry import SpecEntry
from sdpagraph.deploy.specfile import add_to_spec_file
from sdpagraph.scoremod.ir import ScoreModIR
from sdpagraph.call import add_trace_listener
from sdpagraph.spec import AttentionSpec, directions_for


class Recorder:
    """Adds each distinct entry it is given to one spec file, once per process."""

    def __init__(self, path: str | os.PathLike[str]):
        self.path = os.path.abspath(os.fspath(path))
        self._written: set[tuple] = set()
        self._lock = threading.Lock()

    def add(self, entry: SpecEntry) -> None:
        with self._lock:
            if entry.identity not in self._written:
                add_to_spec_file(self.path, [entry])
                self._written.add(entry.identity)


# Process-wide recording state: a `record` block records every call the process traces,
# from any thread, as SDPAGRAPH_RECORD does.
_active: list[Recorder] = []
_environment_recorders: dict[str, Recorder] = {}  # by path: the variable may change
_recording_lock = threading.Lock()


@contextmanager
def record(path: str | os.PathLike[str]) -> Iterator[None]:
    """Record every attention call traced inside the block into the spec file `path`.

    Entries are merged into an existing file. The file is written when the block starts
    (so a bad path or a broken file fails here, not in the middle of tracing) and
    rewritten whenever a new entry appears, so a killed process loses nothing.
    """
    recorder = Recorder(path)
    add_to_spec_file(recorder.path, [])
    with _recording_lock:
        _active.append(recorder)
    try:
        yield
    finally:
        with _recording_lock:
            _active.remove(recorder)


def record_call(spec: AttentionSpec, ir: ScoreModIR | None, training: bool) -> None:
    """The runtime's trace listener: one traced attention call. Cheap when nothing is recording."""
    environment_path = RECORD.get()
    if not _active and not environment_path:
        return
    with _recording_lock:
        recorders = list(_active)
        if environment_path:
            recorders.append(_environment_recorder(environment_path))
    entry = SpecEntry(spec, ir, directions_for(training, spec))
    for recorder in recorders:
        recorder.add(entry)


def _environment_recorder(path: str) -> Recorder:
    absolute = os.path.abspath(path)
    if absolute not in _environment_recorders:
        _environment_recorders[absolute] = Recorder(absolute)
    return _environment_recorders[absolute]


add_trace_listener(record_call)
