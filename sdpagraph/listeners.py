"""Trace listeners: who hears about each attention spec the runtime traces.

Layers above the runtime (deployment's spec recording) register here, so the runtime never
imports them. The runtime reports every call it traces for a graph, and under SPMD each
call's per-device spec (`backends.cudnn.sharding`, when XLA partitions the call).
"""
from __future__ import annotations

import threading
from typing import Callable

from sdpagraph.scoremod.ir import ScoreModIR
from sdpagraph.spec import AttentionSpec

TraceListener = Callable[[AttentionSpec, "ScoreModIR | None", bool], None]
_trace_listeners: list[TraceListener] = []
_listeners_lock = threading.Lock()


def add_trace_listener(listener: TraceListener) -> None:
    """Call `listener(spec, score_mod_ir, training)` for every attention call traced for a graph
    (not for `implementation="xla"`). Listeners must return fast when they have nothing to do."""
    with _listeners_lock:
        if listener not in _trace_listeners:
            _trace_listeners.append(listener)


def notify_trace_listeners(spec: AttentionSpec, ir: ScoreModIR | None, training: bool) -> None:
    """Report one spec to every listener."""
    with _listeners_lock:
        listeners = list(_trace_listeners)
    for listener in listeners:
        listener(spec, ir, training)
