"""`sdpagraph doctor` and `sdpagraph --version` on the CPU."""
from __future__ import annotations

import json

import pytest

import sdpagraph
from sdpagraph import ffi
from sdpagraph.cli import doctor, main
from sdpagraph.ffi import loader
from sdpagraph.config import EXECUTOR_LIBRARY

LABELS = ["sdpagraph", "python", "jax", "jaxlib", "jax CUDA plugin", "GPU", "CUDA", "cuDNN", "cuDNN frontend",
          "executor", "cache", "verdict"]


@pytest.fixture
def no_executor(tmp_path, monkeypatch):
    """A process whose loader has not run yet and finds no library (loads are once per process)."""
    missing = tmp_path / "absent.so"
    monkeypatch.setattr(loader, "_state", loader._LoadState())
    monkeypatch.setenv(EXECUTOR_LIBRARY.name, str(missing))
    return missing


def test_version_prints_the_package_version(capsys):
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"sdpagraph {sdpagraph.__version__}"


def test_doctor_names_every_item_on_its_own_line(no_executor, capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("SDPAGRAPH_CACHE_DIR", str(tmp_path / "graphs"))
    monkeypatch.setenv("SDPAGRAPH_CACHE_MODE", "readonly")
    assert main(["doctor"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split("  ")[0].strip() for line in lines] == LABELS
    by_label = {label: line[len(label):].strip() for label, line in zip(LABELS, lines)}
    assert by_label["sdpagraph"].startswith(sdpagraph.__version__)
    assert by_label["cache"].startswith(f"{tmp_path / 'graphs'} (mode readonly")
    assert by_label["executor"].startswith("not built: FFI extension not built")
    assert str(no_executor) in by_label["executor"]
    assert by_label["verdict"].startswith("attention runs on XLA here because ")


def test_doctor_json_parses_and_carries_the_executor_reason(no_executor, capsys):
    assert main(["doctor", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert list(report) == [name for name, _, _ in doctor._ITEMS]
    executor = report["executor"]
    assert executor["loads"] is False and executor["exists"] is False
    assert executor["path"] == str(no_executor) and str(no_executor) in executor["reason"]
    assert report["verdict"]["cudnn_ready"] is False and report["verdict"]["reason"]
    assert report["jax"]["version"] and report["python"]["version"]


def test_doctor_reports_the_reason_check_support_gives(no_executor, capsys, monkeypatch):
    """As on a GPU machine without the executor: the verdict is the loader's reason."""
    from sdpagraph.graphs import support

    monkeypatch.setattr(support, "environment_reason", lambda: None)
    assert main(["doctor", "--json"]) == 0
    verdict = json.loads(capsys.readouterr().out)["verdict"]
    assert verdict["reason"] == ffi.unavailable_reason()
    assert verdict["text"] == f"attention runs on XLA here because {ffi.unavailable_reason()}"


def test_doctor_says_ready_when_nothing_is_missing(capsys, monkeypatch):
    from sdpagraph.graphs import support

    monkeypatch.setattr(support, "environment_reason", lambda: None)
    monkeypatch.setattr(ffi, "unavailable_reason", lambda: None)
    assert doctor._verdict()["text"].startswith(doctor.READY)


def test_a_probe_that_fails_is_reported_not_raised(capsys, monkeypatch):
    def broken():
        raise RuntimeError("the probe broke\nsecond line")

    monkeypatch.setattr(doctor, "_ITEMS", [("jax", "jax", broken), ("python", "python", doctor._python)])
    assert main(["doctor"]) == 0
    out = capsys.readouterr().out
    assert "jax     could not tell (RuntimeError: the probe broke second line)" in out
    assert out.splitlines()[1].startswith("python")
