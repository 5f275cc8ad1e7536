"""Packed documents (self-attention `segment_ids`) on the ring's cuDNN blocks: which documents the
two sides of a call share, as the call-local segment ids its graph takes.

A chunk is a contiguous range of the natural sequence (load balancing moves whole chunks), and a
document, a run of equal segment ids (`segments.metadata`), is contiguous too. Two different chunks
share at most one document (it must hold the last token of the earlier chunk); a chunk shares each
of its documents, at most min(max_segments, chunk length), with itself. Numbering the documents
both sides of a call hold 1, 2, ... in sequence order gives each side's ids (`shared_ids`), from
which the block graph's operands follow (per-slot lengths and token offsets, `segment_metadata`):
slot m is the same document on both sides. Padding, segments past max_segments and documents the
other side does not hold get id 0: rows that hold no result of the call, which the block masks.

Packed graphs (no score_mod) run one call a step over the device's whole query block and the whole
visiting key block (`ring_plan.RingPlan.whole_steps`): the device's chunks lie in sequence
order in its block, so every document keeps its tokens contiguous there; on the first step the call
is the block with itself (causal per document when the call is causal: local order is global order),
and on every later step the pairs that may attend form a rectangle (with load balancing under a
causal mask: both query chunks against the visitor's first chunk, or the second query chunk against
both), so masking tokens outside it per side leaves a call without a causal mask.

The dense twin (with a score_mod) runs per (query chunk, key chunk) pair:
- the diagonal pair (a chunk with itself, which is static: the first step, same chunk index) runs
  causal per document when the call is causal (both sides are the same tokens, so top-left causal
  within each document is global causal);
- every other pair runs non-causal: under a causal mask every key of an earlier chunk precedes every
  query of a later one, and a pair whose keys come after its queries gets ids 0 on both sides
  (`keys_after_queries`). The twin computes every tile whatever the ids, so a pair that shares no
  document skips its call (`ring._cudnn_pair`, `lax.cond`); rows outside the pair's documents are
  masked by the block (output 0, logsumexp -inf).
"""
from __future__ import annotations

from typing import Any

import jax.numpy as jnp


def slots(max_segments: int, chunk: int, diagonal: bool) -> int:
    """Document slots of a block graph: every document of a chunk on the diagonal, else one."""
    return min(max_segments, chunk) if diagonal else 1


def keys_after_queries(causal: bool, q_start: Any, kv_start: Any) -> Any:
    """Whether a pair of chunks at these global offsets has nothing to compute under the call's causal mask."""
    return jnp.bool_(False) if not causal else kv_start > q_start


def step_slots(max_segments: int, local: int, chunks: int, every: bool) -> int:
    """Document slots of a step's one call over the device's whole blocks: every local document
    (`every`: the first step, the device's tokens with themselves, or documents balanced per
    document, which puts pieces of each on every device), else at most one per pair of chunks (two
    different chunks share at most one document)."""
    return min(max_segments, local) if every else min(max_segments, chunks * chunks)


def shared_ids(q_facts: tuple[Any, Any, Any], kv_facts: tuple[Any, Any, Any], q_allowed: Any, kv_allowed: Any,
             max_segments: int, slots: int) -> tuple[Any, Any]:
    """(query ids, key ids), (B, L) int32 each, of a call over some of a device's query tokens and some
    visiting key tokens (a chunk pair, or the whole blocks): 1 + the slot of each document both sides
    hold, numbered in sequence order on both sides (so slot m is the same document on both), 0
    elsewhere and where the side's token is not `*_allowed` (bool, broadcast against (B, L)). A
    device's chunks lie in sequence order and a document is contiguous, so each document's tokens
    are contiguous on each side, as the block graph needs.

    `*_facts`: (position in segment, valid, segment number <= max_segments) per token."""
    (_, q_valid, q_run), (_, kv_valid, kv_run) = q_facts, kv_facts
    q_valid, kv_valid = q_valid & q_allowed, kv_valid & kv_allowed
    rows = jnp.arange(q_run.shape[0])[:, None]

    def holds(run, valid):  # (B, max_segments + 1): which segment numbers the side holds
        # Only the first token of each run of equal numbers writes (the others' index is past the
        # end: dropped): a scatter of every token into a few slots serialized on them, 0.03 ms a call
        # on an H100 at T/cp = 16384. Valid tokens have numbers >= 1 (`_token_facts`), so a run
        # that starts after an invalid token (marked 0) still has its first token write.
        marked = jnp.where(valid, run, 0)
        starts = valid & jnp.concatenate([jnp.ones_like(valid[:, :1]), marked[:, 1:] != marked[:, :-1]], axis=1)
        index = jnp.where(starts, marked, max_segments + 1)
        return jnp.zeros((run.shape[0], max_segments + 1), bool).at[rows, index].set(True, mode="drop")

    shared = holds(q_run, q_valid) & holds(kv_run, kv_valid)
    slot = jnp.where(shared, jnp.cumsum(shared, axis=1), 0).astype(jnp.int32)
    slot = jnp.where(slot <= slots, slot, 0)  # never more than `slots` (`slots`, `step_slots`), kept safe

    def side(run, valid):
        return jnp.where(valid, jnp.take_along_axis(slot, jnp.where(valid, run, 0), axis=1), 0).astype(jnp.int32)

    return side(q_run, q_valid), side(kv_run, kv_valid)
