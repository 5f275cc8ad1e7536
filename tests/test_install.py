"""The installed package and its executor: what `pip install .` put in site-packages, the build's
status file, and how the loader finds the library (or says why there is none) from it.

The installed-package tests run when SDPAGRAPH_EXPECT_EXECUTOR=1 (.ci/run sets it, after installing
the way the README says) and skip otherwise; the rest runs everywhere on the CPU.
"""
from __future__ import annotations

import ctypes
import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from sdpagraph.ffi import loader
from sdpagraph.config import EXECUTOR_LIBRARY

REPO = Path(__file__).resolve().parents[1]
LIBRARY_IN_WHEEL = f"sdpagraph/ffi/{loader.LIBRARY_FILE}"
STATUS_IN_WHEEL = f"sdpagraph/ffi/{loader.BUILD_STATUS_FILE}"

expect_executor = pytest.mark.skipif(
    os.environ.get("SDPAGRAPH_EXPECT_EXECUTOR") != "1",
    reason="SDPAGRAPH_EXPECT_EXECUTOR=1 not set (.ci/run sets it after `pip install \".[test]\"`)")
needs_cmake = pytest.mark.skipif(shutil.which("cmake") is None, reason="cmake is not installed")


def _clean_environment(**extra: str) -> dict[str, str]:
    drop = (EXECUTOR_LIBRARY.name, "SDPAGRAPH_REQUIRE_FFI")
    environment = {name: value for name, value in os.environ.items() if name not in drop}
    environment.update(extra)
    return environment


# --- the installed distribution (CI) -----------------------------------------------------------


@pytest.fixture(scope="module")
def installed():
    try:
        distribution = importlib.metadata.distribution(loader.DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        pytest.fail("SDPAGRAPH_EXPECT_EXECUTOR=1 but sdpagraph is not installed")
    return distribution


@expect_executor
def test_installed_distribution_contains_the_built_executor(installed):
    files = {str(path) for path in installed.files or ()}
    assert LIBRARY_IN_WHEEL in files, sorted(f for f in files if f.startswith("sdpagraph/ffi/"))
    library = Path(installed.locate_file(LIBRARY_IN_WHEEL))
    handle = ctypes.CDLL(str(library))
    assert hasattr(handle, loader.EXECUTOR_TARGET)
    handle.sdpagraph_version.restype = ctypes.c_char_p
    assert handle.sdpagraph_version().decode().startswith("sdpagraph-executor ")


@expect_executor
def test_installed_build_status_says_built_from_this_source(installed):
    assert STATUS_IN_WHEEL in {str(path) for path in installed.files or ()}
    status = json.loads(Path(installed.locate_file(STATUS_IN_WHEEL)).read_text())
    assert status["built"] is True and status["reason"] is None
    assert status["source_sha256"] == loader.source_digest(REPO / "sdpagraph" / "ffi" / loader.SOURCE_DIR)


@expect_executor
def test_checkout_loads_the_installed_executor():
    """`python -m ...` from the repository root imports this checkout, which has no library of its
    own unless one was copied in: it must find the installed one (the README's demo command)."""
    result = subprocess.run(
        [sys.executable, "-c", "from sdpagraph import ffi; print(ffi.unavailable_reason()); print(ffi.library_path())"],
        cwd=REPO, env=_clean_environment(), capture_output=True, text=True, timeout=120, check=True)
    reason, path = result.stdout.strip().splitlines()
    assert reason == "None"
    assert Path(path).is_file()


# --- the build's status file -------------------------------------------------------------------


def configure(tmp_path: Path, **environment: str) -> subprocess.CompletedProcess:
    """Configures the project with an interpreter that cannot answer the header probe, so the XLA
    FFI headers (which have no system fallback) are missing whatever this machine has."""
    return subprocess.run(
        ["cmake", "-S", str(REPO), "-B", str(tmp_path / "build"), "-DPython_EXECUTABLE=/bin/false"],
        env=_clean_environment(**environment), capture_output=True, text=True, timeout=120)


@needs_cmake
def test_a_skipped_build_writes_its_reason_for_the_loader(tmp_path):
    result = configure(tmp_path)
    assert result.returncode == 0, result.stderr
    status = loader.build_status(tmp_path / "build")
    assert status is not None and status["built"] is False
    assert status["reason"].startswith("headers not found: XLA_FFI (xla/ffi/api/ffi.h)")
    assert f"FILES \"{tmp_path / 'build' / loader.BUILD_STATUS_FILE}\"" in \
        (tmp_path / "build" / "cmake_install.cmake").read_text()  # installed next to the library
    reason = loader.missing_reason(tmp_path / loader.LIBRARY_FILE, status)
    assert "headers not found: XLA_FFI (xla/ffi/api/ffi.h)" in reason and "SDPAGRAPH_REQUIRE_FFI=1" in reason


@needs_cmake
def test_a_missing_compiler_skips_the_build_with_its_reason(tmp_path):
    result = configure(tmp_path, CXX=str(tmp_path / "no-such-compiler"))
    assert result.returncode == 0, result.stderr
    status = loader.build_status(tmp_path / "build")
    assert status is not None and status["built"] is False
    assert "no C++ compiler found" in status["reason"]


@needs_cmake
def test_a_required_build_fails_instead_of_skipping(tmp_path):
    result = configure(tmp_path, SDPAGRAPH_REQUIRE_FFI="1")
    assert result.returncode != 0
    assert "FFI extension not built: headers not found" in " ".join(result.stderr.split())


# --- the loader's reasons ----------------------------------------------------------------------


def write_status(directory: Path, **status) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / loader.BUILD_STATUS_FILE).write_text(json.dumps(status))


@pytest.fixture
def package(tmp_path, monkeypatch):
    """A fake package directory that the loader takes for its own (no library, no status yet)."""
    directory = tmp_path / "site-packages" / "sdpagraph" / "ffi"
    directory.mkdir(parents=True)
    monkeypatch.setattr(loader, "__file__", str(directory / "loader.py"))
    monkeypatch.delenv(EXECUTOR_LIBRARY.name, raising=False)
    return directory


def test_build_status_reads_only_a_status_object(tmp_path):
    assert loader.build_status(tmp_path) is None
    (tmp_path / loader.BUILD_STATUS_FILE).write_text("not json")
    assert loader.build_status(tmp_path) is None
    (tmp_path / loader.BUILD_STATUS_FILE).write_text("[1, 2]")
    assert loader.build_status(tmp_path) is None
    write_status(tmp_path, built=False, reason="why")
    assert loader.build_status(tmp_path) == {"built": False, "reason": "why"}


def test_an_install_that_skipped_the_build_says_why_and_how_to_fix_it(package):
    write_status(package, built=False, reason="headers not found: XLA_FFI (xla/ffi/api/ffi.h)")
    path, reason = loader.locate()
    assert path == package / loader.LIBRARY_FILE
    assert reason.startswith("FFI extension not built when sdpagraph was installed "
                             "(headers not found: XLA_FFI (xla/ffi/api/ffi.h))")
    assert "pip install --force-reinstall --no-deps --no-cache-dir sdpagraph" in reason
    assert "SDPAGRAPH_REQUIRE_FFI=1" in reason and "C++ compiler" in reason
    assert "\n" not in reason and reason.count(". ") == 0  # one sentence
    assert loader._load_and_register() == (None, reason)


def test_an_install_whose_library_went_missing_says_so(package):
    write_status(package, built=True, reason=None, compiler="GNU 12")
    _, reason = loader.locate()
    assert reason.startswith(f"FFI extension missing: the build made it, but {package / loader.LIBRARY_FILE} does not exist")


def test_an_install_without_status_names_the_path(package):
    _, reason = loader.locate()
    assert reason.startswith(f"FFI extension not built ({package / loader.LIBRARY_FILE} does not exist)")


def test_a_library_next_to_the_loader_wins(package):
    write_status(package, built=False, reason="ignored: a library is there")
    (package / loader.LIBRARY_FILE).write_bytes(b"")
    assert loader.locate() == (package / loader.LIBRARY_FILE, None)


def test_the_environment_variable_overrides(package, tmp_path, monkeypatch):
    monkeypatch.setenv(EXECUTOR_LIBRARY.name, str(tmp_path / "absent.so"))
    path, reason = loader.locate()
    assert path == tmp_path / "absent.so"
    assert reason.startswith(f"FFI extension not built: {EXECUTOR_LIBRARY.name} points at {tmp_path / 'absent.so'}")


class FakeDistribution:
    def __init__(self, root: Path) -> None:
        self.root = root

    def locate_file(self, path: str) -> Path:
        return self.root / path


@pytest.fixture
def checkout(tmp_path, monkeypatch):
    """A fake source checkout (a csrc folder next to the loader, no library) and a fake installed
    distribution in another directory; returns (checkout ffi dir, installed ffi dir)."""
    source = tmp_path / "repo" / "sdpagraph" / "ffi"
    source.mkdir(parents=True)
    (source / loader.SOURCE_DIR).mkdir()
    (source / loader.SOURCE_DIR / "executor.cc").write_text("// executor source\n")
    monkeypatch.setattr(loader, "__file__", str(source / "loader.py"))
    monkeypatch.delenv(EXECUTOR_LIBRARY.name, raising=False)
    site = tmp_path / "site-packages"
    (site / "sdpagraph" / "ffi").mkdir(parents=True)
    monkeypatch.setattr(importlib.metadata, "distribution", lambda name: FakeDistribution(site))
    return source, site / "sdpagraph" / "ffi"


def test_a_checkout_uses_the_installed_library_built_from_its_source(checkout):
    source, installed = checkout
    (installed / loader.LIBRARY_FILE).write_bytes(b"")
    digest = loader.source_digest(source / loader.SOURCE_DIR)
    write_status(installed, built=True, reason=None, source_sha256=digest)
    assert loader.locate() == (installed / loader.LIBRARY_FILE, None)


def test_a_checkout_refuses_an_installed_library_of_other_source(checkout):
    source, installed = checkout
    (installed / loader.LIBRARY_FILE).write_bytes(b"")
    write_status(installed, built=True, reason=None, source_sha256="0" * 64)
    path, reason = loader.locate()
    assert path == source / loader.LIBRARY_FILE
    assert "built from another version of the executor's sources" in reason and "`pip install .`" in reason


def test_a_checkout_reports_why_the_installed_package_has_no_library(checkout):
    _, installed = checkout
    write_status(installed, built=False, reason="no C++ compiler found (install g++ or clang++, or set CXX)")
    _, reason = loader.locate()
    assert "(no C++ compiler found (install g++ or clang++, or set CXX))" in reason
    assert "SDPAGRAPH_REQUIRE_FFI=1" in reason


def test_a_checkout_without_an_installed_package_says_to_install(checkout, monkeypatch):
    def not_installed(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", not_installed)
    _, reason = loader.locate()
    assert reason.startswith("FFI extension not built (this checkout has no _sdpagraph_executor.so and "
                             "sdpagraph is not installed)")
    assert "`pip install .`" in reason
