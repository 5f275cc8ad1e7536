"""Loads the C++ executor (``_sdpagraph_executor.so``) and registers its XLA FFI target.

The executor runs serialized cuDNN frontend graphs on XLA's stream. It is a plain shared library
built by the package build when the cuDNN, cudnn-frontend, CUDA and XLA FFI headers are present
(see CMakeLists.txt); without it, ``load()`` returns None and ``unavailable_reason()`` says why.

Call contract of the FFI target ``sdpagraph_execute`` (platform "CUDA", typed FFI, api_version 1)
---------------------------------------------------------------------------------------------------
::

    jax.ffi.ffi_call("sdpagraph_execute", result_shapes)(*operands, **attributes)

operands
    The graph's input tensors (device arrays, any dtype), each laid out as the graph's tensor
    with that uid expects (the dims and strides it was built with).
result_shapes
    The graph's output tensors, then exactly one more: the workspace,
    ``jax.ShapeDtypeStruct((workspace_size,), jnp.uint8)``. XLA allocates it (it may be 0 bytes
    long); the caller drops it from the results.
attributes
    Exactly these six, with these numpy types (jax turns numpy arrays into array attributes; a
    Python list would become something else):

    ================  ==========================  ===============================================
    graph_key         str                         64-digit lowercase hex sha256 digest the graph
                                                  is registered or cached under
    entry_path        str                         absolute path of the disk-cache entry file for
                                                  graph_key, or "" when there is none
    uids              np.ndarray[np.int64]        one uid per operand, then one per result except
                                                  the workspace, in the same order
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
import os
import threading
from pathlib import Path
from typing import NamedTuple

EXECUTOR_TARGET = "sdpagraph_execute"
LIBRARY_FILE = "_sdpagraph_executor.so"
# Points at a library somewhere else (a build directory) instead of the one next to this file.
LIBRARY_ENV = "SDPAGRAPH_EXECUTOR_LIBRARY"

_BUILD_HINT = (
    "build it with `pip install --no-build-isolation .` in an environment that has jax, "
    "nvidia-cudnn-cu13 (or -cu12), nvidia-cudnn-frontend and the CUDA headers "
    "(see CMakeLists.txt), or run .ci/build-ffi"
)

# Status codes of the library's C entry points (executor.cc, section 8).
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
        error = ctypes.create_string_buffer(_ERROR_BUFFER_SIZE)
        status = self._library.sdpagraph_register_entry_file(
            digest.encode(), os.fsencode(path), error, _ERROR_BUFFER_SIZE)
        if status != 0:
            reason = error.value.decode(errors="replace") or _STATUS_MESSAGES.get(status, str(status))
            raise ValueError(f"cache entry {os.fspath(path)}: {reason}")

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
    """Where ``load()`` looks for the executor library."""
    override = os.environ.get(LIBRARY_ENV)
    return Path(override) if override else Path(__file__).with_name(LIBRARY_FILE)


def load() -> ExecutorLib | None:
    """Loads the executor and registers ``sdpagraph_execute`` for CUDA, once per process
    (thread-safe). Returns None when the library is missing or fails to load."""
    with _state.lock:
        if not _state.attempted:
            _state.attempted = True
            _state.library, _state.reason = _load_and_register()
        return _state.library


def _load_and_register() -> tuple[ExecutorLib | None, str | None]:
    path = library_path()
    if not path.is_file():
        return None, f"FFI extension not built ({path} does not exist): {_BUILD_HINT}"
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
