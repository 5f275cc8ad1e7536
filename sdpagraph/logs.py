"""sdpagraph's loggers, and logging a message once per process.

    sdpagraph            which backend runs a call and why, SPMD notes
    sdpagraph.cache      a cache directory that does not work, entry files rejected
    sdpagraph.numerics   graphs that failed (or could not run) their numerical check

A call is traced again for each new shape, and a degraded cache or a declined config would say the
same thing each time; `log_once` says it once. Its memo is bounded (a long-running server tracing
many shapes must not grow it forever), so a message dropped from it may be logged again.
"""
from __future__ import annotations

import logging
from typing import Hashable

from sdpagraph.memo import BoundedMemo

MEMO_ENTRIES = 1024

logger = logging.getLogger("sdpagraph")
cache_logger = logging.getLogger("sdpagraph.cache")
numerics_logger = logging.getLogger("sdpagraph.numerics")

_logged = BoundedMemo(MEMO_ENTRIES)


def log_once(to: logging.Logger, level: int, message: str, *args: object, topic: Hashable = None) -> bool:
    """Log `message % args` at `level` on `to`, unless `to` already logged `topic` (default: the
    message and its args, which must then be hashable) in this process. True when it logged."""
    if not _logged.add((to.name, (message, args) if topic is None else topic)):
        return False
    to.log(level, message, *args)
    return True
