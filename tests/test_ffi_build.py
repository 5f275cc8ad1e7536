"""The C++ executor on the CPU: the build skips cleanly without headers, the library exports its
entry points and links no CUDA library, the loader reports a missing or broken library, and the
library's cache entry reader agrees with the Python writer and rejects every kind of bad file.

Tests that need the library skip when the loader finds none: in this checkout's sdpagraph/ffi/, or
the installed package's when it was built from this checkout's sdpagraph/ffi/csrc (`loader.locate`);
CI installs the package first (.ci/run runs `pip install ".[test]"`, which builds it).
"""
from __future__ import annotations

import shutil
import struct
import subprocess
import sys
import zlib
from pathlib import Path

import msgpack
import pytest

from sdpagraph.cache.entry import Entry, encode_entry
from sdpagraph.cache.keys import key_digest
from sdpagraph.ffi import loader
from sdpagraph.config import EXECUTOR_LIBRARY

REPO = Path(__file__).resolve().parents[1]
LIBRARY = loader.library_path()
ENTRY_POINTS = (
    "sdpagraph_execute",
    "sdpagraph_register_graph",
    "sdpagraph_register_entry_file",
    "sdpagraph_deserialize_count",
    "sdpagraph_command_buffer_compatible",
    "sdpagraph_host_timing",
    "sdpagraph_version",
    "sdpagraph_device_alloc",
    "sdpagraph_device_free",
    "sdpagraph_device_copy",
    "sdpagraph_run_graph",
    "sdpagraph_prepare_graph",
)

needs_library = pytest.mark.skipif(not LIBRARY.is_file(), reason="FFI extension not built (`pip install .` builds it)")
needs_cmake = pytest.mark.skipif(shutil.which("cmake") is None, reason="cmake is not installed")


def run_python(code: str, **env: str) -> str:
    """Runs `code` in a fresh interpreter (the loader loads once per process) from the repo root."""
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=_environment(env),
                            capture_output=True, text=True, timeout=120, check=True)
    return result.stdout.strip()


def _environment(extra: dict[str, str]) -> dict[str, str]:
    import os

    # .ci/run exports SDPAGRAPH_REQUIRE_FFI=1 for its install; these builds decide it themselves.
    environment = {name: value for name, value in os.environ.items()
                   if name not in (EXECUTOR_LIBRARY.name, "SDPAGRAPH_REQUIRE_FFI")}
    environment.update(extra)
    return environment


# --- build ------------------------------------------------------------------------------------


def configure_without_headers(tmp_path: Path, *options: str) -> subprocess.CompletedProcess:
    """Configures the project with an interpreter that cannot answer the header probe, so the XLA
    FFI headers (which have no system fallback) are missing whatever this machine has."""
    return subprocess.run(
        ["cmake", "-S", str(REPO), "-B", str(tmp_path / "build"), "-DPython_EXECUTABLE=/bin/false", *options],
        env=_environment({}), capture_output=True, text=True, timeout=120)


@needs_cmake
def test_cmake_skips_the_extension_without_headers(tmp_path):
    result = configure_without_headers(tmp_path)
    assert result.returncode == 0, result.stderr
    message = " ".join(result.stderr.split())  # cmake wraps long messages
    assert "FFI extension not built: headers not found: XLA_FFI (xla/ffi/api/ffi.h)" in message
    assert "sdpagraph_executor" not in (tmp_path / "build" / "Makefile").read_text()


@needs_cmake
def test_cmake_fails_without_headers_when_the_extension_is_required(tmp_path):
    result = configure_without_headers(tmp_path, "-DSDPAGRAPH_REQUIRE_FFI=ON")
    assert result.returncode != 0
    assert "FFI extension not built" in result.stderr


def configure_with_stand_in_headers(tmp_path: Path, build: str, reuse: Path, **env: str) -> str:
    """Configures the project against empty stand-ins of every header set (enough to configure, not
    to compile) with `reuse` as the executor reuse folder; returns cmake's messages."""
    headers = tmp_path / "headers"
    for marker in ("xla/ffi/api/ffi.h", "cudnn.h", "cudnn_graph.h", "cudnn_version.h", "cudnn_frontend.h",
                   "cuda.h", "cuda_runtime_api.h", "crt/host_defines.h", "nvrtc.h", "nv/target"):
        if not (headers / marker).exists():
            (headers / marker).parent.mkdir(parents=True, exist_ok=True)
            (headers / marker).write_text(f"// stand-in {marker}\n")
    sets = [f"-DSDPAGRAPH_{name}_INCLUDE={headers}" for name in ("XLA_FFI", "CUDNN", "CUDNN_FRONTEND", "CUDA")]
    result = subprocess.run(
        ["cmake", "-S", str(REPO), "-B", str(tmp_path / build), "-DPython_EXECUTABLE=/bin/false",
         f"-DSDPAGRAPH_EXECUTOR_REUSE_DIR={reuse}", *sets],
        env=_environment(env), capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return result.stdout + result.stderr


@needs_cmake
@pytest.mark.skipif(shutil.which("c++") is None and shutil.which("g++") is None, reason="no C++ compiler")
def test_a_build_reuses_the_executor_built_from_the_same_inputs(tmp_path):
    reuse = tmp_path / "reuse"
    first = configure_with_stand_in_headers(tmp_path, "first", reuse)
    key = first.split("executor build key ")[1].split()[0]
    assert "reusing" not in first and "sdpagraph_executor" in (tmp_path / "first" / "Makefile").read_text()
    (reuse / key).mkdir(parents=True)
    (reuse / key / "_sdpagraph_executor.so").write_bytes(b"built before")
    second = configure_with_stand_in_headers(tmp_path, "second", reuse)
    assert f"executor build key {key}" in second and "reusing the executor" in second
    assert "sdpagraph_executor" not in (tmp_path / "second" / "Makefile").read_text()  # nothing to compile
    subprocess.run(["cmake", "--install", str(tmp_path / "second"), "--prefix", str(tmp_path / "installed")],
                   check=True, capture_output=True, timeout=60)
    assert (tmp_path / "installed/sdpagraph/ffi/_sdpagraph_executor.so").read_bytes() == b"built before"
    # A changed header is another key; SDPAGRAPH_REBUILD_EXECUTOR=1 compiles whatever is kept.
    (tmp_path / "headers/cudnn_version.h").write_text("#define CUDNN_MAJOR 10\n")
    assert key not in configure_with_stand_in_headers(tmp_path, "third", reuse)
    (tmp_path / "headers/cudnn_version.h").write_text("// stand-in cudnn_version.h\n")
    forced = configure_with_stand_in_headers(tmp_path, "fourth", reuse, SDPAGRAPH_REBUILD_EXECUTOR="1")
    assert f"executor build key {key}" in forced and "reusing" not in forced


@needs_library
def test_library_exports_only_its_entry_points():
    nm = shutil.which("nm")
    if nm is None:
        pytest.skip("nm is not installed")
    listing = subprocess.run([nm, "-D", "--defined-only", str(LIBRARY)], capture_output=True, text=True,
                             check=True).stdout
    exported = sorted(line.split()[-1] for line in listing.splitlines() if line.strip())
    assert exported == sorted(ENTRY_POINTS)


@needs_library
def test_library_links_no_cuda_library():
    """cuDNN, the CUDA runtime and the driver are dlopen'ed at run time, never linked."""
    readelf = shutil.which("readelf")
    if readelf is None:
        pytest.skip("readelf is not installed")
    dynamic = subprocess.run([readelf, "-d", str(LIBRARY)], capture_output=True, text=True, check=True).stdout
    needed = [line for line in dynamic.splitlines() if "(NEEDED)" in line]
    assert needed
    assert not [line for line in needed if "cud" in line or "nvrtc" in line], needed


# --- loader -----------------------------------------------------------------------------------


def test_loader_reports_a_missing_extension(tmp_path):
    missing = tmp_path / "absent.so"
    output = run_python(
        "from sdpagraph import ffi; print(ffi.load()); print(ffi.unavailable_reason())",
        **{EXECUTOR_LIBRARY.name: str(missing)})
    loaded, reason = output.splitlines()
    assert loaded == "None"
    assert reason.startswith("FFI extension not built")
    assert str(missing) in reason and EXECUTOR_LIBRARY.name in reason


def test_loader_reports_a_library_that_does_not_load(tmp_path):
    broken = tmp_path / "broken.so"
    broken.write_bytes(b"not an ELF file")
    output = run_python("from sdpagraph import ffi; print(ffi.unavailable_reason())",
                        **{EXECUTOR_LIBRARY.name: str(broken)})
    assert output.startswith(f"FFI extension at {broken} failed to load")


def test_loader_functions_raise_when_the_extension_is_missing(tmp_path):
    output = run_python(
        "from sdpagraph import ffi\n"
        "try:\n    ffi.register_graph('0' * 64, b'x')\nexcept RuntimeError as error:\n    print(error)",
        **{EXECUTOR_LIBRARY.name: str(tmp_path / "absent.so")})
    assert output.startswith("FFI extension not built")


@needs_library
def test_loader_loads_and_registers_the_cuda_target_on_a_cpu_machine():
    output = run_python(
        "from sdpagraph import ffi\n"
        "library = ffi.load()\n"
        "print(ffi.unavailable_reason()); print(library is ffi.load()); print(library.version)\n"
        "print(library.command_buffer_compatible); print(ffi.deserialize_count())")
    reason, same, version, _, count = output.splitlines()
    assert reason == "None"
    assert same == "True"
    assert version.startswith("sdpagraph-executor ") and "cudnn-frontend" in version
    assert count == "0"


@pytest.fixture(scope="module")
def executor():
    if not LIBRARY.is_file():
        pytest.skip("FFI extension not built (`pip install .` builds it)")
    library = loader.load()
    assert library is not None, loader.unavailable_reason()
    return library


def test_register_graph_is_idempotent_and_checks_its_arguments(executor):
    digest = key_digest("test_ffi_build: register")
    executor.register_graph(digest, b"first blob")
    executor.register_graph(digest, b"another blob for the same key")
    with pytest.raises(ValueError, match="not a 64-digit lowercase hex digest"):
        executor.register_graph(digest.upper(), b"blob")
    with pytest.raises(ValueError, match="not a 64-digit lowercase hex digest"):
        executor.register_graph(digest[:-1], b"blob")
    with pytest.raises(ValueError, match="blob is empty"):
        executor.register_graph(digest, b"")
    assert executor.deserialize_count() == 0  # registering never deserializes


@needs_library
def test_host_timing_switches_on_and_off():
    # A fresh interpreter: timing and its totals are process-wide.
    out = run_python(
        "from sdpagraph.ffi import loader; lib = loader.load()\n"
        "for enable in (True, True, False, False): print(tuple(lib.host_timing(enable)))")
    # Off at start, then on, on, off. Nothing ran the handler here, so the totals stay zero; on the
    # GPU, tests/gpu checks that timed calls are counted and untimed ones are not.
    assert out.splitlines() == ["(False, 0, 0, 0)", "(True, 0, 0, 0)", "(True, 0, 0, 0)", "(False, 0, 0, 0)"]


# --- cache entry files ------------------------------------------------------------------------


def python_entry(key: str, blob: bytes = b"serialized graph") -> bytes:
    return encode_entry(Entry(key=key, key_hash=key_digest(key), blob=blob, meta={"created": 1.0}))


def raw_entry(payload: bytes, *, version: int = 1, crc: int | None = None, magic: bytes = b"SDPAGRPH") -> bytes:
    return struct.pack("<8sII", magic, version, zlib.crc32(payload) if crc is None else crc) + payload


def register_file(executor, tmp_path: Path, key: str, content: bytes) -> None:
    path = tmp_path / "entry.sdpg"
    path.write_bytes(content)
    executor.register_entry_file(key_digest(key), path)


def test_reader_accepts_what_the_python_cache_writes(executor, tmp_path):
    register_file(executor, tmp_path, "test_ffi_build: python entry", python_entry("test_ffi_build: python entry"))


def test_reader_skips_every_msgpack_type_it_does_not_need(executor, tmp_path):
    key = "test_ffi_build: every type"
    fields = {
        "fixint": 5, "negative": -3, "uint8": 200, "uint16": 60000, "uint32": 4_000_000_000,
        "uint64": 2**63, "int8": -100, "int16": -30000, "int32": -2_000_000_000, "int64": -(2**62),
        "nil": None, "booleans": [True, False], "float64": 1.5,
        "key_hash": key_digest(key), "blob": b"graph bytes",  # in the middle: skipping goes on after
        "str8": "s" * 40, "str16": "s" * 300, "str32": "s" * 70_000, "bin16": b"b" * 300, "bin32": b"b" * 70_000,
        "fixext": [msgpack.ExtType(2, b"a" * n) for n in (1, 2, 4, 8, 16)],
        "ext": [msgpack.ExtType(3, b"e" * n) for n in (3, 300, 70_000)],
        "array16": list(range(20)), "array32": [0] * 70_000,
        "map16": {str(i): {"nested": [i, {"deep": None}]} for i in range(20)},
        "map32": {i: None for i in range(70_000)},
    }
    pairs = [msgpack.packb(name) + msgpack.packb(value, use_bin_type=True) for name, value in fields.items()]
    pairs.append(msgpack.packb("float32") + msgpack.packb(1.5, use_single_float=True))
    pairs.append(msgpack.packb(7) + msgpack.packb([1, {"x": 2}]))  # a key that is not a string
    payload = b"\xde" + struct.pack(">H", len(pairs)) + b"".join(pairs)  # map16 of the pairs
    register_file(executor, tmp_path, key, raw_entry(payload))


@pytest.mark.parametrize(
    ("content", "reason"),
    [
        (b"SDPAGRPH", "too short"),
        (raw_entry(msgpack.packb({}), magic=b"NOTSDPAG"), "bad magic"),
        (raw_entry(msgpack.packb({}), version=2), "unsupported format version 2"),
        (raw_entry(msgpack.packb({}), crc=1), "checksum mismatch"),
        (raw_entry(msgpack.packb([1, 2])), "not a msgpack map"),
        (raw_entry(msgpack.packb({"blob": b"x"})), "no key_hash"),
        (raw_entry(b"\xdf\xff\xff\xff\xff"), "truncated"),  # map32 claiming 4 billion entries
        (raw_entry(b"\x81\xa4blob\xc6\xff\xff\xff\xff"), "truncated"),  # bin32 longer than the file
        (raw_entry(b"\x81\xa1x\xc1"), "invalid msgpack byte 0xc1"),
        (raw_entry(b"\x81\xa8key_hash\x05"), "not a string"),
    ],
)
def test_reader_rejects_a_bad_entry_with_its_reason(executor, tmp_path, content, reason):
    with pytest.raises(ValueError, match=reason):
        register_file(executor, tmp_path, "test_ffi_build: bad", content)


def test_reader_rejects_an_entry_of_another_key_or_without_blob(executor, tmp_path):
    with pytest.raises(ValueError, match="entry is for graph " + key_digest("other")):
        register_file(executor, tmp_path, "test_ffi_build: mine", python_entry("other"))
    key = "test_ffi_build: no blob"
    with pytest.raises(ValueError, match="no blob"):
        register_file(executor, tmp_path, key, raw_entry(msgpack.packb({"key_hash": key_digest(key)})))
    with pytest.raises(ValueError, match="not binary data"):
        register_file(executor, tmp_path, key,
                      raw_entry(msgpack.packb({"key_hash": key_digest(key), "blob": "text"})))


def test_reader_names_the_file_it_cannot_open(executor, tmp_path):
    missing = tmp_path / "missing.sdpg"
    with pytest.raises(ValueError, match=f"cache entry {missing}: cannot open"):
        executor.register_entry_file(key_digest("test_ffi_build: missing"), missing)


def test_reader_agrees_with_zlib_crc32(executor, tmp_path):
    """Payloads of many lengths (the table-driven CRC has no alignment special cases to hide)."""
    for length in (0, 1, 7, 8, 255, 4096, 65_537):
        key = f"test_ffi_build: crc {length}"
        blob = bytes(range(256)) * (length // 256) + bytes(length % 256) or b"\x00"
        register_file(executor, tmp_path, key, python_entry(key, blob))
