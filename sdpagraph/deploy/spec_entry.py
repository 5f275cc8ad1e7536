"""What a spec file holds (`deploy.specfile`): one attention config and the graph directions it
needs, and the error of an invalid file or entry."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sdpagraph.errors import SdpagraphError
from sdpagraph.scoremod.ir import ScoreModIR
from sdpagraph.spec import AttentionSpec


@dataclass(frozen=True)
class SpecEntry:
    """One attention config and the graph directions it needs."""

    spec: AttentionSpec
    score_mod: ScoreModIR | None
    directions: tuple[str, ...]

    @property
    def training(self) -> bool:
        """Whether the entry's graphs keep the softmax stats (`spec.directions_for`)."""
        return "forward" in self.directions

    @property
    def identity(self) -> tuple[str, str, tuple[str, ...]]:
        """What makes two entries the same (for de-duplication and the file's order)."""
        return self.spec.canonical(), "" if self.score_mod is None else self.score_mod.digest, self.directions

    def describe(self) -> str:
        """One human line: the spec summary and the score_mod's hash prefix."""
        mod = "" if self.score_mod is None else f" score_mod {self.score_mod.digest[:12]}"
        return self.spec.summary() + mod

    def to_dict(self) -> dict[str, Any]:
        return {
            "spec": self.spec.to_dict(),
            "score_mod": None if self.score_mod is None else self.score_mod.to_dict(),
            "directions": list(self.directions),
            "summary": self.describe(),
        }


class SpecFileError(SdpagraphError, ValueError):
    """A spec file or entry is invalid; the message (one line) names the file, the entry and
    the field. The same facts as attributes, where known: `path`, `entry` (0-based), `field`."""

    def __init__(self, message: str, path: str | None = None, entry: int | None = None,
                 field: str | None = None) -> None:
        super().__init__(message)
        self.path = path
        self.entry = entry
        self.field = field
