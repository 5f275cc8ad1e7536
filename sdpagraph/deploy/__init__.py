"""Deployment: record the specs a program traces, keep them in spec files, precompile every graph
they need into a cache directory, and verify that a directory covers them.

`record` (and the spec recorder it registers with the runtime) loads with this package; `precompile`
and `verify`, which bring the builder and the numerical check, load on first use, so a serving
process that only runs attention does not import them."""
from __future__ import annotations

import importlib
from typing import Any

from sdpagraph.deploy.recording import record

__all__ = ["precompile", "record", "verify"]
_LAZY = {"precompile": "sdpagraph.deploy.precompile", "verify": "sdpagraph.deploy.verify"}


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'sdpagraph.deploy' has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value
    return value
