"""The registry of backends: which exist, in which order, and how to reach one.

The built-in backends are listed here once, by module, in preference order: when dispatch has no
measurement to rank two backends that can both run a call, the earlier one runs it. Each module
defines `BACKEND`, an instance of `backends.base.Backend`; it is imported on first use, so naming a
backend costs nothing until it runs. `register` adds a backend from outside the package.
"""
from __future__ import annotations

import importlib
import threading

from sdpagraph.backends.base import Backend

_BUILT_IN = (
    "sdpagraph.backends.cudnn.backend",
    "sdpagraph.backends.xla",
    "sdpagraph.backends.small_seq.backend",
)
# The backend that runs every call: the reference of every test, and where a call goes when the
# others decline it (its module; its name is `reference().name`).
_REFERENCE = "sdpagraph.backends.xla"

_lock = threading.Lock()
_backends: dict[str, Backend] = {}
_loaded = False


def _load() -> dict[str, Backend]:
    global _loaded
    with _lock:
        if not _loaded:
            for module in _BUILT_IN:
                backend = importlib.import_module(module).BACKEND
                _backends[backend.name] = backend
            _loaded = True
    return _backends


def names() -> tuple[str, ...]:
    """Every backend's name, in preference order."""
    return tuple(_load())


def get(name: str) -> Backend:
    """The backend called `name`; ValueError naming the known ones otherwise."""
    backends = _load()
    if name not in backends:
        raise ValueError(f"implementation must be None or one of {', '.join(map(repr, backends))}; got {name!r}")
    return backends[name]


def primary() -> Backend:
    """The first backend in preference order (cuDNN): the one `Support.supported` speaks of."""
    return get(names()[0])


def reference() -> Backend:
    """The backend that runs every call (the fallback and the tests' reference)."""
    return importlib.import_module(_REFERENCE).BACKEND


def register(backend: Backend) -> None:
    """Add `backend` (after the built-in ones in preference order); its name must be new."""
    if not isinstance(backend, Backend):
        raise TypeError(f"backend must be a sdpagraph.backends.base.Backend, got {type(backend).__name__}")
    backends = _load()
    with _lock:
        if backend.name in backends:
            raise ValueError(f"a backend named {backend.name!r} is already registered")
        backends[backend.name] = backend
