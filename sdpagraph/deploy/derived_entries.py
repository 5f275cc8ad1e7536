"""The calls a spec file's entries make beyond their own (`graphs.alternatives`): packed documents on
bins, chunked attention as packed documents, a multi-token decode's folded prefix.

    with_derived(entries) -> tuple[SpecEntry, ...]

Each runs with graphs of its own. Precompile builds them, verify looks for them and the numerical
check runs them, as entries next to the one that makes them, so a shipped cache serves that call
with zero builds in strict mode too.
"""
from __future__ import annotations

from typing import Iterable

from sdpagraph.deploy.spec_entry import SpecEntry
from sdpagraph.deploy.specfile import merge
from sdpagraph.graphs.alternatives import alternatives
from sdpagraph.spec import directions_for


def with_derived(entries: Iterable[SpecEntry]) -> tuple[SpecEntry, ...]:
    """`entries`, then an entry for each call one of them runs as, duplicates dropped."""
    entries = list(entries)
    derived = [SpecEntry(spec, ir, directions_for(training, spec))
               for entry in entries for spec, ir, training in alternatives(entry.spec, entry.score_mod, entry.training)]
    return tuple(merge(entries, derived))
