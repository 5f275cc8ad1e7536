"""Loads the C++ executor (``_sdpagraph_executor.so``) and registers its XLA FFI target.

The executor runs serialized cuDNN frontend graphs on XLA's stream. It is a plain shared library
built by the package build when the cuDNN, cudnn-frontend, CUDA and XLA FFI headers and a C++
compiler are present (see CMakeLists.txt; pip's isolated build brings the headers on Linux). The
build also installs ``_build_status.json`` next to it, saying whether it built the library and
if not, why. Without the library, ``load()`` returns None and ``unavailable_reason()`` says why
and how to fix it, in one sentence.

Call contract of the FFI target ``sdpagraph_execute`` (platform "CUDA", typed FFI, api_version 1)
---------------------------------------------------------------------------------------------------
::

    jax.ffi.ffi_call("sdpagraph_execute", result_shapes)(*operands, **attributes)

operands
    The graph's input tensors (device arrays, any dtype), each laid out as the graph's tensor
    with that uid expects (the dims and strides it was built with).
result_shapes
    The graph's output tensors (a result may hold several, one after another: ``result_parts``),
    then exactly one more: the workspace,
    ``jax.ShapeDtypeStruct((workspace_size,), jnp.uint8)``. XLA allocates it (it may be 0 bytes
    long); the caller drops it from the results.
attributes
    Exactly these eight, with these numpy types (jax turns numpy arrays into array attributes; a
    Python list would become something else):

    ================  ==========================  ===============================================
    graph_key         str                         64-digit lowercase hex sha256 digest the graph
                                                  is registered or cached under
    entry_path        str                         absolute path of the disk-cache entry file for
                                                  graph_key, or "" when there is none
    uids              np.ndarray[np.int64]        one uid per operand, then one per tensor the
                                                  results hold (the workspace excepted), in the
                                                  same order
    result_parts      np.ndarray[np.int64]        per result (the workspace excepted): how many of
                                                  the graph's tensors it holds, equal in size and
                                                  one after another (1 for most; 2 for dK and dV
                                                  stacked into one array)
    zeroed_results    np.ndarray[np.int64]        per result: 1 to zero it before the graph runs
                                                  (a packed graph leaves rows outside its
                                                  sequences unwritten), else 0
    scalar_uids       np.ndarray[np.int64]        uids of the graph's pass-by-value scalars
                                                  (np.zeros(0, np.int64) when none)
    scalar_values     np.ndarray[np.float32]      their 4-byte host values, same order and length:
                      or np.ndarray[np.int32]     float32 values, or int32 values / bit patterns
                                                  (cuDNN reads each as its tensor's data type)
    workspace_size    np.int64                    bytes the workspace result was sized for
    ================  ==========================  ===============================================

Every tensor the graph takes must be given exactly once (operand, result or scalar), and no
other uid. The executor looks ``graph_key`` up in its registry (``register_graph``); on a miss it
reads ``entry_path`` (verifying magic, version, CRC-32 and key_hash) so that an executable
restored from JAX's compilation cache runs without a trace. It deserializes a graph once per
process and device. Failures come back as XLA errors naming the graph key and carrying cuDNN's
message: a broken contract as INVALID_ARGUMENT, anything else as INTERNAL.

The handler carries XLA's command-buffer-compatible trait unless the library was built with
``-DSDPAGRAPH_COMMAND_BUFFER_COMPATIBLE=OFF`` (``ExecutorLib.command_buffer_compatible``).
"""
from __future__ import annotations

import ctypes
import json
import os
import threading
from pathlib import Path
from typing import Any, NamedTuple, Sequence

from sdpagraph.config import EXECUTOR_LIBRARY

EXECUTOR_TARGET = "sdpagraph_execute"
LIBRARY_FILE = "_sdpagraph_executor.so"
# Written by the build (CMakeLists.txt) next to the library: {"built": bool, "reason": str | None, ...}.
BUILD_STATUS_FILE = "_build_status.json"
# The executor's C++ sources (*.h, *.cc): a folder next to this file in a source checkout only (the
# wheel leaves it out).
SOURCE_DIR = "csrc"
SOURCE_SUFFIXES = (".h", ".cc")
DISTRIBUTION = "sdpagraph"

# How to get a library, for each way of not having one.
_REINSTALL_HINT = (
    "to build it, reinstall on Linux x86_64 or aarch64 with a C++ compiler (the build fetches the "
    "headers it needs): `SDPAGRAPH_REQUIRE_FFI=1 pip install --force-reinstall --no-deps --no-cache-dir "
    "sdpagraph` (`.` instead of `sdpagraph` in a checkout), which stops with the build's error if it "
    "still cannot"
)
_CHECKOUT_HINT = "`pip install .` from the checkout builds and installs it"

# Status codes of the library's C entry points (csrc/entry_points.cc).
_STATUS_MESSAGES = {
    1: "graph key is not a 64-digit lowercase hex digest",
    2: "blob is empty",
    3: "cache entry file cannot be used",
    4: "internal error in the executor",
}
_ERROR_BUFFER_SIZE = 1024


class HostTiming(NamedTuple):
    """Host time spent in ``sdpagraph_execute`` over ``calls`` timed calls: the whole handler, and
    the part inside the frontend's execute (cuDNN's own per-call work, kernel launch included).
    ``handler_ns - cudnn_execute_ns`` is what sdpagraph itself adds on the host. ``was_enabled``:
    whether timing was on over the window these totals cover."""

    was_enabled: bool
    calls: int
    handler_ns: int
    cudnn_execute_ns: int


class ExecutorLib:
    """The loaded executor library; one per process, from ``load()``."""

    def __init__(self, library: ctypes.CDLL, path: Path) -> None:
        self.path = path
        self._library = library
        self._declare_signatures()
        self.version: str = library.sdpagraph_version().decode()
        self.command_buffer_compatible = bool(library.sdpagraph_command_buffer_compatible())

    def _declare_signatures(self) -> None:
        library = self._library
        library.sdpagraph_register_graph.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_size_t]
        library.sdpagraph_register_graph.restype = ctypes.c_int
        library.sdpagraph_register_entry_file.argtypes = [
            ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_size_t]
        library.sdpagraph_register_entry_file.restype = ctypes.c_int
        library.sdpagraph_deserialize_count.argtypes = []
        library.sdpagraph_deserialize_count.restype = ctypes.c_int64
        library.sdpagraph_command_buffer_compatible.argtypes = []
        library.sdpagraph_command_buffer_compatible.restype = ctypes.c_int
        library.sdpagraph_host_timing.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_int64)]
        library.sdpagraph_host_timing.restype = ctypes.c_int
        library.sdpagraph_version.argtypes = []
        library.sdpagraph_version.restype = ctypes.c_char_p
        error = [ctypes.c_char_p, ctypes.c_size_t]
        library.sdpagraph_device_alloc.argtypes = [
            ctypes.c_int, ctypes.c_size_t, ctypes.POINTER(ctypes.c_void_p), *error]
        library.sdpagraph_device_free.argtypes = [ctypes.c_int, ctypes.c_void_p, *error]
        library.sdpagraph_device_copy.argtypes = [
            ctypes.c_int, ctypes.c_size_t, ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_void_p),
            ctypes.POINTER(ctypes.c_size_t), ctypes.c_int, *error]
        library.sdpagraph_run_graph.argtypes = [
            ctypes.c_char_p, ctypes.c_int, ctypes.c_size_t, ctypes.POINTER(ctypes.c_int64),
            ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t, ctypes.POINTER(ctypes.c_int64),
            ctypes.POINTER(ctypes.c_uint32), *error]
        library.sdpagraph_prepare_graph.argtypes = [ctypes.c_char_p, ctypes.c_int, *error]
        for name in ("sdpagraph_device_alloc", "sdpagraph_device_free", "sdpagraph_device_copy",
                     "sdpagraph_run_graph", "sdpagraph_prepare_graph"):
            getattr(library, name).restype = ctypes.c_int

    def handler_capsule(self) -> object:
        """The ``sdpagraph_execute`` handler wrapped for ``jax.ffi.register_ffi_target``."""
        import jax

        return jax.ffi.pycapsule(self._library.sdpagraph_execute)

    def register_graph(self, digest: str, blob: bytes) -> None:
        """Makes ``blob`` (a serialized cuDNN graph) available under ``digest``; a digest keeps its
        first blob, so registering again is a no-op."""
        status = self._library.sdpagraph_register_graph(digest.encode(), bytes(blob), len(blob))
        if status != 0:
            raise ValueError(f"register_graph({digest!r}): {_STATUS_MESSAGES.get(status, status)}")

    def register_entry_file(self, digest: str, path: str | os.PathLike) -> None:
        """Verifies the disk-cache entry at ``path`` the way the handler does on a registry miss
        and registers its graph under ``digest``; raises ValueError with the reason."""
        reason = self._failure("sdpagraph_register_entry_file", digest.encode(), os.fsencode(path))
        if reason is not None:
            raise ValueError(f"cache entry {os.fspath(path)}: {reason}")

    # Direct runs (csrc/direct.h; `ffi.direct` wraps them): raw device addresses as ints.

    def device_alloc(self, device: int, size: int) -> int:
        """Allocates `size` zero-filled bytes on `device` (CUDA ordinal); the address (0 for 0 bytes)."""
        pointer = ctypes.c_void_p()
        self._direct("sdpagraph_device_alloc", device, size, ctypes.byref(pointer))
        return pointer.value or 0

    def device_free(self, device: int, address: int) -> None:
        self._direct("sdpagraph_device_free", device, ctypes.c_void_p(address))

    COPY_KINDS = ("to_host", "to_device", "within_device")

    def device_copy(self, device: int, copies: Sequence[tuple[int, int, int]], kind: str) -> None:
        """Makes every (destination, source, size in bytes) copy of `copies` (`kind`: one of
        COPY_KINDS) on one stream and waits for them."""
        count = len(copies)
        destinations, sources, sizes = zip(*copies) if count else ((), (), ())
        self._direct("sdpagraph_device_copy", device, count, (ctypes.c_void_p * max(1, count))(*destinations),
                     (ctypes.c_void_p * max(1, count))(*sources), (ctypes.c_size_t * max(1, count))(*sizes),
                     self.COPY_KINDS.index(kind))

    def run_graph(self, digest: str, device: int, tensors: dict[int, int], scalar_uids: Any,
                  scalar_words: Any) -> None:
        """Runs the registered graph `digest` once on `device` and waits for it: `tensors` maps each
        tensor's uid to its device address; `scalar_uids` / `scalar_words` (int64 / 4-byte arrays)
        are the pass-by-value scalars, as the FFI call's attributes give them."""
        import numpy as np

        uids = np.ascontiguousarray(list(tensors), np.int64)
        addresses = (ctypes.c_void_p * max(1, len(tensors)))(*tensors.values())
        scalar_uids = np.ascontiguousarray(scalar_uids, np.int64)
        words = np.ascontiguousarray(scalar_words).view(np.uint32)
        self._direct(
            "sdpagraph_run_graph", digest.encode(), device, len(uids), uids.ctypes.data_as(ctypes.POINTER(ctypes.c_int64)),
            addresses, len(scalar_uids), scalar_uids.ctypes.data_as(ctypes.POINTER(ctypes.c_int64)),
            words.ctypes.data_as(ctypes.POINTER(ctypes.c_uint32)))

    def prepare_graph(self, digest: str, device: int) -> None:
        """Deserializes the registered graph `digest` on `device` (CUDA ordinal) now, so that its
        first call finds it ready (its kernels load on their first launch); a no-op when it already
        is."""
        self._direct("sdpagraph_prepare_graph", digest.encode(), device)

    def _direct(self, name: str, *arguments: Any) -> None:
        reason = self._failure(name, *arguments)
        if reason is not None:
            raise RuntimeError(f"{name}: {reason}")

    def _failure(self, name: str, *arguments: Any) -> str | None:
        """Calls the entry point `name`, which takes an error buffer last: None, or why it failed."""
        error = ctypes.create_string_buffer(_ERROR_BUFFER_SIZE)
        status = getattr(self._library, name)(*arguments, error, _ERROR_BUFFER_SIZE)
        if status == 0:
            return None
        return error.value.decode(errors="replace") or _STATUS_MESSAGES.get(status, str(status))

    def deserialize_count(self) -> int:
        """Graph deserializations so far in this process, over all graphs and devices."""
        return int(self._library.sdpagraph_deserialize_count())

    def host_timing(self, enable: bool) -> HostTiming:
        """The handler's host time since the previous call (then reset), and timing switched on or
        off for what follows. Off by default: an untimed call costs one atomic load. Counts
        successful calls only, timed from the handler's entry (after XLA decodes the call)."""
        totals = (ctypes.c_int64 * 3)()
        was_enabled = bool(self._library.sdpagraph_host_timing(int(enable), totals))
        return HostTiming(was_enabled, calls=totals[0], handler_ns=totals[1], cudnn_execute_ns=totals[2])


class _LoadState:
    """What the first ``load()`` found; later calls return it unchanged."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.attempted = False
        self.library: ExecutorLib | None = None
        self.reason: str | None = None


_state = _LoadState()


def library_path() -> Path:
    """Where ``load()`` looks for the executor library (``locate()``'s path)."""
    return locate()[0]


def locate() -> tuple[Path, str | None]:
    """(the executor library to load, None) or (where it would be, the one sentence that says why
    there is none and how to get one).

    The library is ``$SDPAGRAPH_EXECUTOR_LIBRARY`` when set, else the one next to this file. In a
    source checkout without one (this directory has the csrc folder and no build status: `python -m
    sdpagraph` or `pytest` run from the repository root after `pip install .`), it is the library of
    the installed sdpagraph distribution, provided that was built from this checkout's csrc sources
    (``source_digest``).
    """
    override = EXECUTOR_LIBRARY.get()
    if override:
        path = Path(override)
        if path.is_file():
            return path, None
        return path, (f"FFI extension not built: {EXECUTOR_LIBRARY.name} points at {path}, which does not exist; "
                      f"unset it to use the installed executor")
    here = Path(__file__).resolve().parent
    local = here / LIBRARY_FILE
    if local.is_file():
        return local, None
    status = build_status(here)
    if status is None and (here / SOURCE_DIR).is_dir():
        return _installed_library(here, local)
    return local, missing_reason(local, status)


def _installed_library(checkout: Path, local: Path) -> tuple[Path, str | None]:
    """The installed distribution's library for a source checkout that has none (see ``locate``)."""
    import importlib.metadata

    try:
        installed = Path(importlib.metadata.distribution(DISTRIBUTION).locate_file("sdpagraph/ffi")).resolve()
    except importlib.metadata.PackageNotFoundError:
        return local, (f"FFI extension not built (this checkout has no {local.name} and sdpagraph is not "
                       f"installed): {_CHECKOUT_HINT}")
    library = installed / LIBRARY_FILE
    if installed == checkout:
        return local, f"FFI extension not built ({local} does not exist): {_CHECKOUT_HINT}"
    status = build_status(installed)
    if not library.is_file():
        return local, missing_reason(library, status)
    if status is None or status.get("source_sha256") != source_digest(checkout / SOURCE_DIR):
        return local, (f"FFI extension not used: this checkout has no {local.name}, and the installed one "
                       f"({library}) was built from another version of the executor's sources "
                       f"({SOURCE_DIR}/); {_CHECKOUT_HINT}")
    return library, None


def source_digest(directory: str | os.PathLike) -> str:
    """The digest the build records as ``source_sha256`` for the executor's sources in ``directory``
    (CMakeLists.txt computes the same): the sha256 of one ``"<name> <sha256 of the file>\\n"`` line
    per ``*.h`` and ``*.cc`` file in it, in name order."""
    import hashlib

    files = sorted((path for path in Path(directory).iterdir()
                    if path.suffix in SOURCE_SUFFIXES and path.is_file()), key=lambda path: path.name)
    manifest = "".join(f"{path.name} {hashlib.sha256(path.read_bytes()).hexdigest()}\n" for path in files)
    return hashlib.sha256(manifest.encode()).hexdigest()


def load() -> ExecutorLib | None:
    """Loads the executor and registers ``sdpagraph_execute`` for CUDA, once per process
    (thread-safe). Returns None when the library is missing or fails to load."""
    with _state.lock:
        if not _state.attempted:
            _state.attempted = True
            _state.library, _state.reason = _load_and_register()
        return _state.library


def build_status(directory: str | os.PathLike | None = None) -> dict[str, Any] | None:
    """What the package build said about the executor (``_build_status.json`` in ``directory``,
    default this package's directory): ``{"built": bool, "reason": str | None, ...}``, or None when
    there is no readable status file (a source checkout, or a build from before the file existed)."""
    path = Path(directory if directory is not None else Path(__file__).parent) / BUILD_STATUS_FILE
    try:
        status = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return status if isinstance(status, dict) and "built" in status else None


def missing_reason(path: Path, status: dict[str, Any] | None) -> str:
    """The one sentence that says why there is no library at ``path`` (an installed package's) and
    how to get one, from the build's status (``build_status()``) when there is one."""
    if status is None:
        return f"FFI extension not built ({path} does not exist); {_REINSTALL_HINT}"
    if status.get("built"):
        return (f"FFI extension missing: the build made it, but {path} does not exist; "
                f"{_REINSTALL_HINT}")
    reason = str(status.get("reason") or "no reason recorded").rstrip(".")
    return f"FFI extension not built when sdpagraph was installed ({reason}); {_REINSTALL_HINT}"


def _load_and_register() -> tuple[ExecutorLib | None, str | None]:
    path, reason = locate()
    if reason is not None:
        return None, reason
    try:
        library = ExecutorLib(ctypes.CDLL(str(path)), path)
    except (OSError, AttributeError) as error:  # AttributeError: an entry point is missing
        return None, f"FFI extension at {path} failed to load: {error}"
    try:
        import jax

        # Registering for CUDA works before, or without, a CUDA backend: jax keeps the
        # registration until the CUDA plugin loads.
        jax.ffi.register_ffi_target(EXECUTOR_TARGET, library.handler_capsule(), platform="CUDA")
    except Exception as error:  # noqa: BLE001 - any failure means the target is unusable
        return None, f"FFI extension at {path} loaded but registering {EXECUTOR_TARGET} failed: {error}"
    return library, None


def unavailable_reason() -> str | None:
    """None when the executor is loaded and registered, else why not (loads it first)."""
    load()
    return _state.reason


def _loaded() -> ExecutorLib:
    library = load()
    if library is None:
        raise RuntimeError(_state.reason)
    return library


def register_graph(digest: str, blob: bytes) -> None:
    """``ExecutorLib.register_graph`` on the loaded executor; RuntimeError when there is none."""
    _loaded().register_graph(digest, blob)


def deserialize_count() -> int:
    """``ExecutorLib.deserialize_count`` on the loaded executor; RuntimeError when there is none."""
    return _loaded().deserialize_count()
