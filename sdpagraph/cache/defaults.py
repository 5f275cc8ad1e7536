"""The process-wide default cache, configured from the environment.

    SDPAGRAPH_CACHE_DIR        directory (default: $XDG_CACHE_HOME/sdpagraph, else ~/.cache/sdpagraph)
    SDPAGRAPH_CACHE_MODE       readwrite (default) | readonly | off | strict
    SDPAGRAPH_CACHE_MAX_BYTES  disk budget, e.g. 2147483648 or 2G (default 2 GiB)
    SDPAGRAPH_VERIFY           build (default): check each graph's numbers once, against the XLA
                               backend, before it runs user data (docs/cache.md); off: never check
"""
from __future__ import annotations

import os
import re
import threading
from typing import Mapping

from sdpagraph.cache.graph_cache import DEFAULT_DISK_MAX_BYTES, DEFAULT_MODE, GraphCache, check_mode

ENV_DIR = "SDPAGRAPH_CACHE_DIR"
ENV_MODE = "SDPAGRAPH_CACHE_MODE"
ENV_MAX_BYTES = "SDPAGRAPH_CACHE_MAX_BYTES"
ENV_VERIFY = "SDPAGRAPH_VERIFY"
VERIFY_MODES = ("build", "off")
DEFAULT_VERIFY = "build"

_SIZE = re.compile(r"^\s*(\d+)\s*([KMGT]i?B?)?\s*$", re.IGNORECASE)
_SIZE_UNITS = {"K": 1024, "M": 1024**2, "G": 1024**3, "T": 1024**4}

# The process-wide instance (one of the two module-level caches the design allows).
_default: GraphCache | None = None
_default_lock = threading.Lock()


def default_cache() -> GraphCache:
    """The process-wide cache, created from the environment on first use."""
    global _default
    with _default_lock:
        if _default is None:
            _default = cache_from_env(os.environ)
        return _default


def set_default_cache(cache: GraphCache | None) -> None:
    """Replace the process-wide cache; None makes the next default_cache() re-read the environment."""
    global _default
    with _default_lock:
        _default = cache


def cache_from_env(environ: Mapping[str, str]) -> GraphCache:
    mode = check_mode(environ.get(ENV_MODE) or DEFAULT_MODE, source=ENV_MODE)
    max_bytes = parse_size(environ[ENV_MAX_BYTES], source=ENV_MAX_BYTES) if environ.get(ENV_MAX_BYTES) \
        else DEFAULT_DISK_MAX_BYTES
    return GraphCache(default_cache_dir(environ), mode=mode, max_bytes=max_bytes)


def verify_mode(environ: Mapping[str, str] = os.environ) -> str:
    """SDPAGRAPH_VERIFY: "build" (check new graphs' numbers) or "off". Read on every support query,
    so it can change while a process runs (answers given before stay remembered)."""
    mode = (environ.get(ENV_VERIFY) or DEFAULT_VERIFY).strip().lower()
    if mode not in VERIFY_MODES:
        raise ValueError(f"{ENV_VERIFY} must be one of {', '.join(VERIFY_MODES)}; got {environ.get(ENV_VERIFY)!r}")
    return mode


def default_cache_dir(environ: Mapping[str, str] = os.environ) -> str:
    if environ.get(ENV_DIR):
        return os.path.expanduser(environ[ENV_DIR])
    user_cache = environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(user_cache, "sdpagraph")


def parse_size(text: str, source: str = "size") -> int:
    """Bytes from "1048576", "512K", "64MiB", "2G" (units are powers of 1024)."""
    match = _SIZE.match(text)
    if match is None:
        raise ValueError(f"{source} must be a byte count such as 1048576, 512M or 2G; got {text!r}")
    number, unit = match.groups()
    return int(number) * (_SIZE_UNITS[unit[0].upper()] if unit else 1)
