"""Packed documents re-packed into short rows ("bins") for cuDNN: which calls, and the call on the bins.

A packed self-attention call that cuDNN runs on its dense twin (`operands.folds_segments`: a
score_mod, which cuDNN 9.19 runs on no packed graph) computes every tile of a (T, T) row, also
the tiles between documents, and skips none of them for a mask written in a mod. When every
document is at most `rows` tokens long, the documents can be moved, whole, into rows of `rows`
tokens, several to a row, first-fit by decreasing length
(`backends.cudnn.bins.packed`): the dense twin then runs at (bins, rows) instead of (B, T), with as
many tokens and a fraction of the tiles. The mod sees the same thing in a bin: it reads no
positions (`folds_segments` requires that), no batch index and no per-row array, and causal and
window masks count from each document's start, which moving a whole document keeps.

`rows` is the call's `max_seqlen_kv` hint (the longest document), rounded up to cuDNN's tile; a call
without the hint gets rows of T / UNHINTED_ROW_SHARE tokens (unless `max_segments_per_seq` allows
no more documents a row than that), and where a document is longer, the call runs unbinned (the same
run-time fallback as documents that need more bins than planned).

    bin_plan(spec, ir) -> BinPlan | None

The number of bins is static: `bins` holds `BIN_SLACK` times the tokens' worth of bins plus one.
First-fit needed 1.09x (B8 T8192, documents of 64-2048 tokens, 2048-token bins) and 1.06x (B4
T8192, 64-512, 512) in `bench/probe_bins.py`, where each bin past the need cost the forward ~1.5%
(H100, 2026-11-25). A call whose
documents need more runs unbinned, on the dense twin of its own shape (`backends.cudnn.bins.packed`
chooses at run time), so the answer never depends on it.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from sdpagraph.config import BINS
from sdpagraph.scoremod.ir import ScoreModIR
from sdpagraph.graphs.operands import folds_segments
from sdpagraph.spec import AttentionSpec

BIN_SLACK = 1.1
ROW_MULTIPLE = 128  # cuDNN's tile: a row of bins is a whole number of them
# Bin only where the bins' tiles are at most this share of the dense twin's: below it the gathers
# into and out of the bins cost less than the tiles saved.
MAX_WORK_SHARE = 0.5
BATCH_AXIS = 0
# Without a max_seqlen_kv hint, bins hold a quarter of a row: documents up to T/4 tokens fit, and
# the bins' tiles are about 1.1/4 of the dense twin's (under MAX_WORK_SHARE).
UNHINTED_ROW_SHARE = 4


@dataclass(frozen=True)
class BinPlan:
    """How a call runs on bins: `bins` rows of `rows` tokens, as the call `spec`."""

    rows: int
    bins: int
    spec: AttentionSpec  # the call on the bins: packed self-attention of shape (bins, rows)


def bin_reason(spec: AttentionSpec, ir: ScoreModIR | None) -> str | None:
    """Why the call cannot run on bins, or None when it can (whether it pays is `bin_plan`'s)."""
    if spec.segments != "self" or not folds_segments(spec, ir):
        return "only packed self-attention that cuDNN runs on the dense twin is binned"
    if spec.bias_shape is not None or spec.mask_shape is not None or spec.has_padding:
        return "a bias, mask or lengths hold per-row positions that bins would move"
    if ir is not None and any(n.op == "gen_index" and n.attr("axis") == BATCH_AXIS for n in ir.nodes):
        return "the score_mod reads the batch index"
    if ir is not None and any(n.op == "array" and n.attr("shape") is not None and
                              any(n.attr("shape")[axis] != 1 for axis in (0, 2, 3)) for n in ir.nodes):
        return "a score_mod array varies along batch, queries or keys"
    return None


def longest_document(spec: AttentionSpec) -> int:
    """The document length bins are planned for: the `max_seqlen_kv` hint, else T / UNHINTED_ROW_SHARE."""
    return spec.max_seqlen_kv if spec.max_seqlen_kv is not None else -(-spec.q_len // UNHINTED_ROW_SHARE)


def bin_plan(spec: AttentionSpec, ir: ScoreModIR | None) -> BinPlan | None:
    """The bins a call runs on, or None where it runs unbinned (`bin_reason`, bins that would save
    less than half of the dense twin's tiles, or SDPAGRAPH_BINS=0, read when a call is traced)."""
    if not BINS.enabled() or bin_reason(spec, ir) is not None:
        return None
    if _too_few_documents_unhinted(spec):
        return None
    rows = min(spec.q_len, -(-longest_document(spec) // ROW_MULTIPLE) * ROW_MULTIPLE)
    bins = math.ceil(BIN_SLACK * spec.batch * spec.q_len / rows) + 1
    if bins * rows * rows > MAX_WORK_SHARE * spec.batch * spec.q_len * spec.q_len:
        return None
    # No document in a bin is longer than the bin: the hint says so, and keeps bins from being binned again.
    binned = dataclasses.replace(spec, batch=bins, q_len=rows, kv_len=rows, max_segments=rows,
                                 max_seqlen_q=None, max_seqlen_kv=rows)
    return BinPlan(rows, bins, binned)


def waits_for_hint(spec: AttentionSpec, ir: ScoreModIR | None) -> bool:
    """Whether the call runs unbinned only for want of a `max_seqlen_kv` hint: it allows too few
    documents a row (`max_segments_per_seq`) for quarter-row bins, and the shortest hint a full row of
    them could have (T / max_segments_per_seq) would plan bins."""
    if not _too_few_documents_unhinted(spec):
        return False
    shortest = -(-spec.q_len // max(spec.max_segments, 1))
    return bin_plan(dataclasses.replace(spec, max_seqlen_kv=shortest), ir) is not None


def _too_few_documents_unhinted(spec: AttentionSpec) -> bool:
    """No hint, and at most UNHINTED_ROW_SHARE documents a row: such a row fills quarter-row bins only
    when its documents are cut evenly."""
    return spec.max_seqlen_kv is None and spec.max_segments <= UNHINTED_ROW_SHARE
