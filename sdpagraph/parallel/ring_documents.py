"""Packed documents (self-attention `segment_ids`) on the ring's cuDNN blocks: which documents a
(query chunk, key chunk) pair shares, as the pair-local segment ids its packed (THD) block graph takes.

A chunk is a contiguous range of the natural sequence (load balancing moves whole chunks), and a
document, a run of equal segment ids (`segments.metadata`), is contiguous too. So the documents of a
chunk are the runs from the first to the last of its valid tokens, and two chunks share the runs
max(firsts) .. min(lasts). Two different chunks share at most one document (it must hold the last
token of the earlier chunk); a chunk shares each of its documents, at most min(max_segments, chunk
length), with itself. Numbering the shared runs 1, 2, ... on both sides gives each side's ids, from
which the block graph's operands follow (per-slot lengths and token offsets, `segment_metadata`):
slot m is the same document on both sides. Padding, segments past max_segments and documents the
other side does not hold get id 0: rows that hold no result of this pair, which the block masks.

How a pair runs (traced, per device), from the chunks' global starts:
- SKIP: no document shared (in any batch row), or, causal, keys after the queries;
- OFF_DIAGONAL: different chunks, one shared document, non-causal: under a causal mask every key of
  an earlier chunk precedes every query of a later one;
- DIAGONAL: the chunk with itself, causal per document when the call is (both sides are the same
  tokens, so top-left causal within each document is global causal).
"""
from __future__ import annotations

from typing import Any

import jax.numpy as jnp

SKIP, OFF_DIAGONAL, DIAGONAL = 0, 1, 2  # the branches of the ring's lax.switch


def slots(max_segments: int, chunk: int, diagonal: bool) -> int:
    """Document slots of a block graph: every document of a chunk on the diagonal, else one."""
    return min(max_segments, chunk) if diagonal else 1


def pair_ids(q_facts: tuple[Any, Any, Any], kv_facts: tuple[Any, Any, Any]) -> tuple[Any, Any]:
    """(query ids, key ids), (B, chunk) int32 each: 1 + the shared document's slot, 0 elsewhere.

    `*_facts`: (position in segment, valid, segment number) per token of each chunk
    (`context_parallel._token_facts`, from the whole sequence)."""
    (_, q_valid, q_run), (_, kv_valid, kv_run) = q_facts, kv_facts
    first = lambda run, valid: jnp.min(jnp.where(valid, run, jnp.iinfo(jnp.int32).max), axis=1)  # noqa: E731
    last = lambda run, valid: jnp.max(jnp.where(valid, run, 0), axis=1)  # noqa: E731
    lo = jnp.maximum(first(q_run, q_valid), first(kv_run, kv_valid))[:, None]
    hi = jnp.minimum(last(q_run, q_valid), last(kv_run, kv_valid))[:, None]

    def local(run, valid):
        shared = valid & (run >= lo) & (run <= hi)
        return jnp.where(shared, run - lo + 1, 0).astype(jnp.int32)

    return local(q_run, q_valid), local(kv_run, kv_valid)


def pair_status(causal: bool, q_start: Any, kv_start: Any, q_ids: Any) -> Any:
    """SKIP, OFF_DIAGONAL or DIAGONAL (module docstring) for chunks starting at these global offsets."""
    skip = ~jnp.any(q_ids > 0)
    if causal:
        skip = skip | (kv_start > q_start)
    return jnp.where(skip, SKIP, jnp.where(kv_start == q_start, DIAGONAL, OFF_DIAGONAL)).astype(jnp.int32)
