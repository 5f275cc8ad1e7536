"""Getting a graph ready on its device while XLA compiles the program that calls it.

    prepare_soon(digest, device)    start deserializing a registered graph in a background thread

A graph's first run deserializes it (and warms its plan up) on the device it runs on: about 30 ms
for a softcap forward and 10 ms for its backward on an H100 (bench/probe_compile.py), paid inside the
first call, after XLA's compile. The backend calls `prepare_soon` when a call is traced, once the
graph is registered, so that this work overlaps XLA's compile instead. `SDPAGRAPH_PREPARE` says how
far it goes (`load`: deserialize; `warmup`: also load the kernels with one throwaway run, which
synchronizes the device; `off`). It is safe to race: a call that needs the graph meanwhile waits for
the deserialization, and a failure here only leaves the work to the first call (logged at debug).
"""
from __future__ import annotations

import atexit
import logging
import queue
import threading

from sdpagraph.config import PREPARE
from sdpagraph.ffi.loader import _loaded
from sdpagraph.logs import logger
from sdpagraph.memo import BoundedMemo

# (digest, device) pairs already queued: a graph is traced again for each new program that calls
# it, and one deserialization per device serves them all.
_started = BoundedMemo(4096)
# One worker thread: the executor keeps a cuDNN handle per (device, thread) for the life of the
# process, so a thread per graph would leave a handle behind for each.
_queue: queue.Queue = queue.Queue()
_worker: threading.Thread | None = None
_lock = threading.Lock()
# At exit, how long to wait for preparations still queued (their CUDA work must not race teardown).
EXIT_WAIT_S = 5.0


def prepare_soon(digest: str, device: int) -> None:
    """Deserialize the registered graph `digest` on `device` (CUDA ordinal) in the background,
    unless `SDPAGRAPH_PREPARE` is `off` or this pair was queued before."""
    global _worker
    mode = PREPARE.get()
    if mode == "off":
        return
    with _lock:
        if not _started.add((digest, device)):
            return
        _queue.put((digest, device, mode == "warmup"))
        if _worker is None:
            _worker = threading.Thread(target=_work, name="sdpagraph-prepare", daemon=True)
            _worker.start()


def pending() -> int:
    """Preparations queued or running (for tests)."""
    return _queue.unfinished_tasks


def _work() -> None:
    while True:
        item = _queue.get()
        try:
            if item is None:
                return
            digest, device, warmup = item
            try:
                _loaded().prepare_graph(digest, device, warmup)
            except Exception as error:  # noqa: BLE001 - the graph's first call deserializes it instead
                logger.log(logging.DEBUG, "preparing graph %s on device %d failed: %s", digest, device, error)
        finally:
            _queue.task_done()


@atexit.register
def _wait_at_exit() -> None:
    with _lock:
        worker = _worker
    if worker is not None:
        _queue.put(None)
        worker.join(EXIT_WAIT_S)
