"""Cache keys: everything that changes a compiled graph, and nothing else.

A key names one compiled graph. It holds the static inputs of the build (the canonical
spec, the score_mod IR hash, the direction) and the environment the plan was built for
(cuDNN backend and frontend versions, the GPU), plus the on-disk format version. Values
that only exist at run time (scalar score_mod values, sequence lengths, offsets, batch
contents) must never enter a key: they would turn one graph into thousands of entries
and rebuild on every new value.

A plain ``str`` is accepted wherever a key is expected (tests and tools use strings);
its canonical text is the string itself.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, fields
from typing import Union

from sdpagraph.spec import DIRECTIONS

# Bump when the entry file layout or the meaning of a key field changes: old entries then
# stop matching (different digest) and fail the header check, so they are rebuilt.
FORMAT_VERSION = 1

# Compact, sorted, UTF-8 JSON. One shared encoder: json.dumps with options builds a new
# one per call, which is a noticeable part of making a key.
_CANONICAL_JSON = json.JSONEncoder(sort_keys=True, separators=(",", ":"), ensure_ascii=False)


@dataclass(frozen=True)
class CacheKey:
    """The identity of one compiled graph (see the module docstring for what belongs here)."""

    spec: str  # canonical AttentionSpec text
    ir_hash: str  # content hash of the ScoreModIR ("" when there is no score_mod)
    direction: str  # one of DIRECTIONS
    cudnn_version: str
    frontend_version: str
    gpu: str  # compute capability and name, e.g. "sm90 NVIDIA H200"

    def __post_init__(self) -> None:
        values = {field.name: getattr(self, field.name) for field in fields(self)}
        for name, value in values.items():
            if not isinstance(value, str):
                raise TypeError(f"CacheKey.{name} must be a str, got {type(value).__name__}")
        if self.direction not in DIRECTIONS:
            raise ValueError(f"CacheKey.direction must be one of {DIRECTIONS}, got {self.direction!r}")
        # Computed once, here: every lookup needs both, and JSON + sha256 on each call would
        # take a third of a memory hit's budget. Not fields, so not part of eq/hash/repr.
        canonical = _CANONICAL_JSON.encode({**values, "format_version": FORMAT_VERSION})
        object.__setattr__(self, "_canonical", canonical)
        object.__setattr__(self, "_digest", _sha256_hex(canonical))

    def canonical(self) -> str:
        """Deterministic text of the key: compact JSON with sorted keys."""
        return self._canonical

    def digest(self) -> str:
        """sha256 hex of the canonical text; names the entry file."""
        return self._digest

    def versions(self) -> dict[str, object]:
        """The environment part of the key, stored in the entry for `cache ls`/`info`."""
        return {
            "cudnn": self.cudnn_version,
            "frontend": self.frontend_version,
            "gpu": self.gpu,
            "format": FORMAT_VERSION,
        }


Key = Union[CacheKey, str]


def key_text(key: Key) -> str:
    """The full canonical text of a key; stored in the entry and compared on load."""
    if isinstance(key, CacheKey):
        return key.canonical()
    if isinstance(key, str):
        return key
    raise TypeError(f"cache key must be a CacheKey or str, got {type(key).__name__}")


def key_digest(key: Key) -> str:
    """sha256 hex of the key's canonical text (a CacheKey's, computed when it was made)."""
    if isinstance(key, CacheKey):
        return key.digest()
    return _sha256_hex(key_text(key))


def key_versions(key: Key) -> dict[str, object] | None:
    """The versions to record in an entry; plain string keys carry none."""
    return key.versions() if isinstance(key, CacheKey) else None


def spec_of(text: str) -> str:
    """The spec part of a key's canonical text, for messages and listings.

    Works on the stored text so tools can describe entries without the original key:
    a CacheKey's JSON yields its spec field, any other text is its own spec.
    """
    try:
        document = json.loads(text)
    except ValueError:
        return text
    if isinstance(document, dict) and isinstance(document.get("spec"), str):
        return document["spec"]
    return text


def _sha256_hex(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()
