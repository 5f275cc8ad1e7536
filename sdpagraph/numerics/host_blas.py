"""NumPy's BLAS held to a few threads while the numerical check's reference multiplies.

    with few_blas_threads():
        ...

The reference (`numerics.reference`) multiplies small matrices: 10 to 128 query rows against up to
4096 keys, a dozen (batch row, head) pairs per product. OpenBLAS spreads each product over every
core. On an H100 host with 16 cores, waking those threads made one such product take 1 to 66 ms,
the most in a process's first check; on 4 threads it took 1.4 to 2.8 ms. One thread removed that
cost but read the large keys and values too slowly: the check's reference at B4 T4096 took 0.07 s
on one thread, 0.035 s on 16 (docs/results/h100-2026-11-24-check-cost.md).

The thread count is process-wide, so it is set for the block and restored when the last block
open in any thread ends. Where NumPy's BLAS is not a loaded OpenBLAS, or its controls cannot be
found, this does nothing.
"""
from __future__ import annotations

import contextlib
import ctypes
import functools
import importlib
import itertools
import os
import threading
from typing import Any, Iterator

# OpenBLAS's thread controls under the names its builds export: scipy-openblas (NumPy 2 wheels,
# 64-bit ints), NumPy 1 wheels' openblas64_, and plain builds.
_PREFIXES = ("scipy_openblas", "openblas")
_SUFFIXES = ("64_", "")

_lock = threading.Lock()
_open = 0  # blocks open now, in any thread
_restore: list[tuple[Any, int]] = []  # (set function, thread count) to put back when the last one ends
FEW_THREADS = 4  # OpenBLAS's count inside a block, when it was higher


@contextlib.contextmanager
def few_blas_threads() -> Iterator[None]:
    """Within the block (and any other open in another thread), OpenBLAS runs on at most FEW_THREADS."""
    global _open
    with _lock:
        if _open == 0:
            _restore[:] = [(setter, getter()) for getter, setter in _controls()]
            for setter, threads in _restore:
                setter(min(threads, FEW_THREADS))
        _open += 1
    try:
        yield
    finally:
        with _lock:
            _open -= 1
            if _open == 0:
                for setter, threads in _restore:
                    setter(threads)
                _restore.clear()


@functools.cache
def _controls() -> tuple[tuple[Any, Any], ...]:
    """(get_num_threads, set_num_threads) of each OpenBLAS loaded in this process."""
    importlib.import_module("numpy")  # NumPy's BLAS is loaded before the process's maps are read

    try:
        with open(f"/proc/{os.getpid()}/maps") as maps:
            paths = sorted({line.split()[-1] for line in maps if "openblas" in line.lower()})
    except OSError:  # not Linux: nothing to control
        return ()
    return tuple(pair for pair in map(_thread_controls, paths) if pair is not None)


def _thread_controls(path: str) -> tuple[Any, Any] | None:
    try:
        library = ctypes.CDLL(path)  # already loaded: the same library, not a second copy
    except OSError:
        return None
    for prefix, suffix in itertools.product(_PREFIXES, _SUFFIXES):
        getter = getattr(library, f"{prefix}_get_num_threads{suffix}", None)
        setter = getattr(library, f"{prefix}_set_num_threads{suffix}", None)
        if getter is not None and setter is not None:
            getter.restype, setter.argtypes = ctypes.c_int, [ctypes.c_int]
            return getter, setter
    return None
