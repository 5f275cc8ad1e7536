"""sdpagraph's exceptions: the base class of every error it raises on purpose, and the errors
raised in one layer and handled in another.

Each public error class derives from `SdpagraphError` and from the builtin error that says what
went wrong (ValueError, TypeError, LookupError, ...), so `except SdpagraphError` catches all of
sdpagraph's own errors and `except ValueError` still catches the bad-value ones. The errors of
one layer stay next to their code (`cache.CacheMissError`, `graphs.builder.GraphBuildError`, ...).
The ground floor: this module imports nothing from sdpagraph.
"""
from __future__ import annotations


class SdpagraphError(Exception):
    """Base class of the errors sdpagraph raises on purpose."""


class Unsupported(SdpagraphError, ValueError):
    """sdpagraph cannot express this config as a cuDNN graph; the message says why in one sentence.

    Raised while a mod is converted (`scoremod.jnp`) or a graph is lowered (`graphs`), and handled
    where a call's support is decided: the call then runs on another backend, saying why."""
