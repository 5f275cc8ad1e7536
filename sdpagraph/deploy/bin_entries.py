"""The calls a spec file's entries make beyond their own: the bins packed documents run on (`graphs.binning`).

    with_bins(entries) -> tuple[SpecEntry, ...]

A packed call with a score_mod and a `max_seqlen_kv` hint runs, on one GPU, as a call of shape
(bins, rows) with graphs of its own. Precompile builds them, verify looks for them and the numerical
check runs them, as entries next to the one that makes them, so a shipped cache serves that call
with zero builds in strict mode too.
"""
from __future__ import annotations

from typing import Iterable

from sdpagraph.deploy.spec_entry import SpecEntry
from sdpagraph.deploy.specfile import merge
from sdpagraph.graphs.binning import bin_plan


def with_bins(entries: Iterable[SpecEntry]) -> tuple[SpecEntry, ...]:
    """`entries`, then an entry for the bins of each one that runs on bins (same score_mod and
    directions), duplicates dropped."""
    entries = list(entries)
    plans = [(entry, bin_plan(entry.spec, entry.score_mod)) for entry in entries]
    bins = [SpecEntry(plan.spec, entry.score_mod, entry.directions) for entry, plan in plans if plan is not None]
    return tuple(merge(entries, bins))
