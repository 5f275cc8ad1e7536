"""sdpagraph: flex attention for JAX on cuDNN, with compiled graphs cached and shipped.

Public API: `attention`, `check_support`, `load_balance` / `unload_balance`, `precompile`, `record`, `Support`, `mods`,
`fp8` (FP8 attention with per-tensor scales),
`SdpagraphError` (the base class of sdpagraph's errors), the `sdpagraph` CLI. The names are loaded on
first use, so `import sdpagraph` (and the command line's cache and version commands) does not import jax.
"""
from __future__ import annotations

import importlib
from typing import Any

from sdpagraph.errors import SdpagraphError  # imports nothing, so it is not loaded lazily

__all__ = ["attention", "check_support", "load_balance", "unload_balance", "precompile", "record", "Support",
           "mods", "fp8", "SdpagraphError"]
__version__ = "0.1.0"

# name -> module that defines it. `attention` and `check_support` also load the deployment layer,
# whose spec recording (SDPAGRAPH_RECORD, `record`) listens to every traced call.
_PUBLIC = {
    "attention": "sdpagraph.api",
    "check_support": "sdpagraph.api",
    "load_balance": "sdpagraph.parallel.load_balance",
    "unload_balance": "sdpagraph.parallel.load_balance",
    "precompile": "sdpagraph.deploy",
    "record": "sdpagraph.deploy",
    "Support": "sdpagraph.graphs.support",
    "mods": "sdpagraph.mods",
    "fp8": "sdpagraph.fp8",
}


def __getattr__(name: str) -> Any:
    if name not in _PUBLIC:
        raise AttributeError(f"module 'sdpagraph' has no attribute {name!r}")
    importlib.import_module("sdpagraph.deploy")  # registers the spec recorder with the runtime
    module = importlib.import_module(_PUBLIC[name])
    value = module if name in ("mods", "fp8") else getattr(module, name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
