"""The calls a call may run as, with graphs of their own, where those build and pass their check:

    alternatives(spec, ir, training) -> [(spec, ir, training), ...]

- packed documents with a score_mod: on bins (`graphs.binning`);
- chunked attention: as packed documents cut at the chunk boundaries (`graphs.chunk_documents`);
- a multi-token decode on paged K/V: a folded prefix call with its softmax stats (`graphs.decode_fold`).

Whoever builds or checks a call's graphs (`graph_store.check_graphs`, `precompile`, `verify`, the
numerical check of a spec file) takes these too, so a shipped cache serves them in strict mode.
"""
from __future__ import annotations

from sdpagraph.graphs.binning import bin_plan
from sdpagraph.graphs.chunk_documents import chunk_documents
from sdpagraph.graphs.decode_fold import decode_fold
from sdpagraph.scoremod.ir import ScoreModIR
from sdpagraph.spec import AttentionSpec


def alternatives(spec: AttentionSpec, ir: ScoreModIR | None,
                 training: bool) -> list[tuple[AttentionSpec, ScoreModIR | None, bool]]:
    found = []
    bins = bin_plan(spec, ir)
    if bins is not None:
        found.append((bins.spec, ir, training))
    documents = chunk_documents(spec, ir)
    if documents is not None:
        found.append((documents, None, training))
    folded = decode_fold(spec, ir)
    if folded is not None:
        found.append((folded, None, True))  # the merge reads its softmax stats
    return found
