"""The process-wide default cache, configured from the environment: SDPAGRAPH_CACHE_DIR,
SDPAGRAPH_CACHE_MODE and SDPAGRAPH_CACHE_MAX_BYTES (`sdpagraph.config`)."""
from __future__ import annotations

import threading
from typing import Mapping

from sdpagraph.cache.graph_cache import GraphCache
from sdpagraph.config import CACHE_DIR, CACHE_MAX_BYTES, CACHE_MODE

# The process-wide instance (one of the two module-level caches the design allows).
_default: GraphCache | None = None
_default_lock = threading.Lock()


def default_cache() -> GraphCache:
    """The process-wide cache, created from the environment on first use."""
    global _default
    with _default_lock:
        if _default is None:
            _default = cache_from_env()
        return _default


def set_default_cache(cache: GraphCache | None) -> None:
    """Replace the process-wide cache; None makes the next default_cache() re-read the environment."""
    global _default
    with _default_lock:
        _default = cache


def cache_from_env(environ: Mapping[str, str] | None = None) -> GraphCache:
    """A cache configured by `environ` (default: the process's environment)."""
    return GraphCache(CACHE_DIR.get(environ), mode=CACHE_MODE.get(environ), max_bytes=CACHE_MAX_BYTES.get(environ))
