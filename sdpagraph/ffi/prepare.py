"""Getting a graph ready on its device while XLA compiles the program that calls it.

    prepare_soon(digest, device)    queue a registered graph's deserialization on a background thread
    pending()                       preparations queued or running

A graph's first run deserializes it on the device it runs on: about 30 ms for a softcap forward and
10 ms for its backward on an H100 (docs/results/h100-2026-11-27-warm-start-softcap.md), paid inside
the first call, after XLA's compile. The backend calls `prepare_soon` when a call is traced, once
the graph is registered, so that this work overlaps XLA's compile instead (`SDPAGRAPH_PREPARE=0`
turns it off). Only the deserialization runs here: the plan's kernels load on its first launch, since
the warmup run that would load them synchronizes the device, which would break a command buffer XLA
may be recording meanwhile. A call that needs the graph meanwhile waits for its deserialization (the
executor's per-device lock), and a failure here only leaves the work to the first run (logged at
debug).
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
# At exit, how long to wait for the preparation in progress (its CUDA work must not race teardown).
EXIT_WAIT_S = 5.0


def prepare_soon(digest: str, device: int) -> None:
    """Deserialize the registered graph `digest` on `device` (CUDA ordinal) in the background,
    unless `SDPAGRAPH_PREPARE` is off or this pair was queued before."""
    global _worker
    if not PREPARE.enabled():
        return
    with _lock:
        if not _started.add((digest, device)):
            return
        if _worker is None:
            worker = threading.Thread(target=_work, name="sdpagraph-prepare", daemon=True)
            try:
                worker.start()
            except RuntimeError:  # the interpreter is shutting down: the first run deserializes it
                return
            _worker = worker
            # Registered now, after jax (which the caller traced with) registered its own teardown:
            # handlers run last-in first-out, so this one waits for the worker before jax tears down.
            atexit.register(_stop)
        _queue.put((digest, device))


def pending() -> int:
    """Preparations queued or running (for tests)."""
    return _queue.unfinished_tasks


def _work() -> None:
    while True:
        item = _queue.get()
        try:
            if item is None:
                return
            digest, device = item
            try:
                _loaded().prepare_graph(digest, device)
            except Exception as error:  # noqa: BLE001 - the graph's first run deserializes it instead
                logger.log(logging.DEBUG, "preparing graph %s on device %d failed: %s", digest, device, error)
        finally:
            _queue.task_done()


def _stop() -> None:
    """At exit: drop what is still queued, and wait (a while) for the preparation in progress."""
    while True:
        try:
            _queue.get_nowait()
        except queue.Empty:
            break
        _queue.task_done()
    _queue.put(None)
    if _worker is not None:
        _worker.join(EXIT_WAIT_S)
