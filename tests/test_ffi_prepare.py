"""`ffi.prepare_soon`: a registered graph deserialized in a background thread while XLA compiles,
as `SDPAGRAPH_PREPARE` says, once per (graph, device), and never an error for the call. The executor
is a recording stand-in here; tests/gpu/test_attention_gpu.py runs the real one."""
from __future__ import annotations

import logging
import threading
import time

import pytest

from sdpagraph.backends.cudnn import execute
from sdpagraph.ffi import prepare


class RecordingExecutor:
    def __init__(self, fail: bool = False) -> None:
        self.calls: list[tuple[str, int, bool]] = []
        self.fail = fail
        self.done = threading.Event()

    def prepare_graph(self, digest: str, device: int, warmup: bool) -> None:
        self.calls.append((digest, device, warmup))
        self.done.set()
        if self.fail:
            raise RuntimeError("sdpagraph_prepare_graph: no such graph")


@pytest.fixture
def executor(monkeypatch):
    recording = RecordingExecutor()
    monkeypatch.setattr(prepare, "_loaded", lambda: recording)
    monkeypatch.setattr(prepare, "_started", prepare.BoundedMemo(16))
    return recording


def _wait_for_threads() -> None:
    deadline = time.monotonic() + 5
    while prepare.pending() and time.monotonic() < deadline:
        time.sleep(0.001)
    assert prepare.pending() == 0


@pytest.mark.parametrize("mode, warmup", [("load", False), ("warmup", True), ("WARMUP", True), ("", False)])
def test_prepares_in_a_background_thread_as_the_variable_says(executor, monkeypatch, mode, warmup):
    monkeypatch.setenv("SDPAGRAPH_PREPARE", mode)
    digest = "ab" * 32
    prepare.prepare_soon(digest, 3)
    assert executor.done.wait(5)
    _wait_for_threads()
    assert executor.calls == [(digest, 3, warmup)]


def test_off_prepares_nothing(executor, monkeypatch):
    monkeypatch.setenv("SDPAGRAPH_PREPARE", "off")
    prepare.prepare_soon("cd" * 32, 0)
    _wait_for_threads()
    assert executor.calls == []


def test_one_worker_thread_serves_every_graph(executor, monkeypatch):
    """The executor keeps a cuDNN handle per (device, thread): every preparation runs on one thread."""
    monkeypatch.setenv("SDPAGRAPH_PREPARE", "load")
    threads = set()
    monkeypatch.setattr(executor, "prepare_graph", lambda *args: threads.add(threading.current_thread()))
    for i in range(5):
        prepare.prepare_soon(f"{i:02d}" * 32, 0)
    _wait_for_threads()
    assert len(threads) == 1 and threading.current_thread() not in threads


def test_each_graph_and_device_is_prepared_once(executor, monkeypatch):
    monkeypatch.setenv("SDPAGRAPH_PREPARE", "load")
    first, second = "01" * 32, "02" * 32
    for digest, device in ((first, 0), (first, 0), (first, 1), (second, 0), (first, 0)):
        prepare.prepare_soon(digest, device)
        _wait_for_threads()
    assert sorted(executor.calls) == sorted([(first, 0, False), (first, 1, False), (second, 0, False)])


def test_a_failure_is_logged_at_debug_and_left_to_the_first_call(monkeypatch, caplog):
    failing = RecordingExecutor(fail=True)
    monkeypatch.setattr(prepare, "_loaded", lambda: failing)
    monkeypatch.setattr(prepare, "_started", prepare.BoundedMemo(16))
    monkeypatch.setenv("SDPAGRAPH_PREPARE", "load")
    with caplog.at_level(logging.DEBUG, logger="sdpagraph"):
        prepare.prepare_soon("ef" * 32, 0)
        assert failing.done.wait(5)
        _wait_for_threads()
    assert any("preparing graph" in r.getMessage() and "no such graph" in r.getMessage() for r in caplog.records)


def test_a_bad_value_names_the_variable(executor, monkeypatch):
    monkeypatch.setenv("SDPAGRAPH_PREPARE", "eager")
    with pytest.raises(ValueError, match="SDPAGRAPH_PREPARE must be one of load, warmup, off"):
        prepare.prepare_soon("ab" * 32, 0)


def test_the_backend_prepares_on_gpus_only(monkeypatch):
    asked = []
    monkeypatch.setattr(execute.ffi, "prepare_soon", lambda digest, device: asked.append((digest, device)))
    execute._prepare_on_default_device("ab" * 32)  # the CPU tests' default device is a CPU
    assert asked == []
