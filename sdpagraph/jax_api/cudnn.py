"""The cuDNN backend of `attention`: support query and execution through the FFI executor."""
from __future__ import annotations

from typing import Any

from sdpagraph.graphs.ir import ScoreModIR
from sdpagraph.graphs.support import Support, environment_reason
from sdpagraph.spec import AttentionSpec


def support(spec: AttentionSpec, score_mod: ScoreModIR | None, *, training: bool) -> Support:
    """Whether the cuDNN graphs this call needs build here (forward, and backward when training)."""
    reason = environment_reason()
    if reason is None:
        reason = "the cuDNN execution path is not available in this build"
    return Support(False, "xla", reason)


def attention(spec: AttentionSpec, query: Any, key: Any, value: Any, inputs: Any, score_mod: ScoreModIR | None):
    raise NotImplementedError("the cuDNN execution path is not available in this build")
