"""Graphs deserialized in the background while XLA compiles (`ffi.prepare_soon`): once per
(graph, device), on one worker thread, never an error for the call, off with SDPAGRAPH_PREPARE=0;
the backend's choice of devices (`execute._prepare`); the entry point's own argument check. The
executor is a recording stand-in except in the last test; tests/gpu/test_attention_gpu.py runs the
real one."""
from __future__ import annotations

import logging
import threading
import time
from types import SimpleNamespace

import pytest

import jax

from sdpagraph import ffi
from sdpagraph.backends.cudnn import execute, sharding
from sdpagraph.ffi import prepare


class RecordingExecutor:
    def __init__(self, fail: bool = False) -> None:
        self.calls: list[tuple[str, int]] = []
        self.threads: set[threading.Thread] = set()
        self.fail = fail

    def prepare_graph(self, digest: str, device: int) -> None:
        self.calls.append((digest, device))
        self.threads.add(threading.current_thread())
        if self.fail:
            raise RuntimeError("sdpagraph_prepare_graph: no such graph")


@pytest.fixture
def executor(monkeypatch):
    recording = RecordingExecutor()
    monkeypatch.setattr(prepare, "_loaded", lambda: recording)
    monkeypatch.setattr(prepare, "_started", prepare.BoundedMemo(16))
    return recording


def _wait_for_worker() -> None:
    deadline = time.monotonic() + 5
    while prepare.pending() and time.monotonic() < deadline:
        time.sleep(0.001)
    assert prepare.pending() == 0


@pytest.mark.parametrize("value", [None, "1", "yes"])
def test_prepares_on_a_background_thread(executor, monkeypatch, value):
    if value is None:
        monkeypatch.delenv("SDPAGRAPH_PREPARE", raising=False)
    else:
        monkeypatch.setenv("SDPAGRAPH_PREPARE", value)
    digest = "ab" * 32
    prepare.prepare_soon(digest, 3)
    _wait_for_worker()
    assert executor.calls == [(digest, 3)]
    assert threading.current_thread() not in executor.threads


@pytest.mark.parametrize("value", ["0", "off", "False", "no"])
def test_off_prepares_nothing(executor, monkeypatch, value):
    monkeypatch.setenv("SDPAGRAPH_PREPARE", value)
    prepare.prepare_soon("cd" * 32, 0)
    _wait_for_worker()
    assert executor.calls == []


def test_one_worker_thread_serves_every_graph(executor, monkeypatch):
    """The executor keeps a cuDNN handle per (device, thread): every preparation runs on one thread."""
    monkeypatch.delenv("SDPAGRAPH_PREPARE", raising=False)
    for i in range(5):
        prepare.prepare_soon(f"{i:02d}" * 32, 0)
    _wait_for_worker()
    assert len(executor.calls) == 5 and len(executor.threads) == 1


def test_each_graph_and_device_is_prepared_once(executor, monkeypatch):
    monkeypatch.delenv("SDPAGRAPH_PREPARE", raising=False)
    first, second = "01" * 32, "02" * 32
    for digest, device in ((first, 0), (first, 0), (first, 1), (second, 0), (first, 0)):
        prepare.prepare_soon(digest, device)
        _wait_for_worker()
    assert executor.calls == [(first, 0), (first, 1), (second, 0)]


def test_a_failure_is_logged_at_debug_and_left_to_the_first_run(monkeypatch, caplog):
    failing = RecordingExecutor(fail=True)
    monkeypatch.setattr(prepare, "_loaded", lambda: failing)
    monkeypatch.setattr(prepare, "_started", prepare.BoundedMemo(16))
    monkeypatch.delenv("SDPAGRAPH_PREPARE", raising=False)
    with caplog.at_level(logging.DEBUG, logger="sdpagraph"):
        prepare.prepare_soon("ef" * 32, 0)
        _wait_for_worker()
    assert any("preparing graph" in r.getMessage() and "no such graph" in r.getMessage() for r in caplog.records)
    prepare.prepare_soon("fe" * 32, 0)  # the worker goes on after a failure
    _wait_for_worker()
    assert failing.calls[-1] == ("fe" * 32, 0)


def test_at_exit_what_is_queued_is_dropped(monkeypatch):
    """`_stop` empties the queue and stops the worker: only a preparation in progress finishes."""
    queue = prepare.queue.Queue()
    for i in range(3):
        queue.put((f"{i:02d}" * 32, 0))
    monkeypatch.setattr(prepare, "_queue", queue)
    monkeypatch.setattr(prepare, "_worker", None)
    prepare._stop()
    assert queue.get_nowait() is None and queue.empty()


def _fake(platform, hardware_id):
    return SimpleNamespace(platform=platform, local_hardware_id=hardware_id)


def test_the_backend_prepares_on_the_default_gpu(monkeypatch):
    asked = []
    monkeypatch.setattr(execute.ffi, "prepare_soon", lambda digest, device: asked.append((digest, device)))
    monkeypatch.setattr(execute, "_default_device", lambda: (_fake("gpu", 3),))
    execute._prepare("ab" * 32)
    assert asked == [("ab" * 32, 3)]


def test_the_backend_prepares_nothing_on_a_cpu(monkeypatch):
    asked = []
    monkeypatch.setattr(execute.ffi, "prepare_soon", lambda digest, device: asked.append((digest, device)))
    execute._prepare("ab" * 32)  # the CPU tests' default device is a CPU
    assert execute._default_device()[0].platform == "cpu" and asked == []


def test_a_per_device_call_is_prepared_on_its_mesh_devices(monkeypatch):
    asked = []
    monkeypatch.setattr(execute.ffi, "prepare_soon", lambda digest, device: asked.append((digest, device)))
    token = sharding._shard_devices.set((_fake("gpu", 0), _fake("gpu", 1)))
    try:
        execute._prepare("cd" * 32)
    finally:
        sharding._shard_devices.reset(token)
    assert asked == [("cd" * 32, 0), ("cd" * 32, 1)]


def test_the_default_device_follows_jax(monkeypatch):
    cpu = jax.local_devices(backend="cpu")[0]
    with jax.default_device(cpu):
        assert execute._default_device() == (cpu,)
    with jax.default_device("cpu"):  # a platform's name
        assert execute._default_device() == (cpu,)
    monkeypatch.setattr(execute.jax, "local_devices", lambda backend=None: (_ for _ in ()).throw(
        RuntimeError(f"Unknown backend {backend}")))
    assert execute._default_device() == ()  # a platform this process has no backend for


def test_the_entry_point_refuses_a_bad_key():
    library = ffi.load()
    if library is None:
        pytest.skip("FFI extension not built")
    with pytest.raises(RuntimeError, match="sdpagraph_prepare_graph"):
        library.prepare_graph("not a digest", 0)
