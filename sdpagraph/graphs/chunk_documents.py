"""Chunked attention (Llama 4's `chunk_size`) as packed documents: a query attends only the keys of
its own chunk, which is packed self-attention over segments cut at the chunk boundaries. cuDNN has
no chunk flag, so a chunk mask rides in a score_mod (`scoremod.masks`), which makes cuDNN compute
every tile of the (T, S) scores; the packed (THD) graph computes the chunks' tiles only.

    chunk_documents(spec, ir) -> the packed spec, or None when the call stays as it is
    chunk_ids(spec) -> the segment ids (B, T) the packed spec reads: position // chunk_size + 1
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax.numpy as jnp

from sdpagraph.scoremod.ir import ScoreModIR
from sdpagraph.spec import AttentionSpec


def chunk_documents(spec: AttentionSpec, ir: ScoreModIR | None) -> AttentionSpec | None:
    """The call as packed self-attention over its chunks, for a chunked self-attention call (T = S)
    with nothing the packed graph cannot take (a score_mod, a bias or mask, sequence lengths, packed
    ids of its own, paged keys); else None. Windows and causal masks count from each chunk's start
    in both, since they are relative; T = S makes both causal alignments the same."""
    if (spec.chunk_size is None or spec.q_len != spec.kv_len or ir is not None or spec.segments
            or spec.segment_mask or spec.bias_shape is not None or spec.mask_shape is not None
            or spec.has_padding or spec.paged is not None or spec.q_len <= spec.chunk_size):
        return None
    return dataclasses.replace(spec, chunk_size=None, segments="self", causal_alignment="top_left",
                               max_segments=math.ceil(spec.q_len / spec.chunk_size))


def chunk_ids(spec: AttentionSpec) -> Any:
    """Segment ids (B, T) int32 of a chunked call's chunks: 1, 2, ... by chunk."""
    ids = jnp.arange(spec.q_len, dtype=jnp.int32) // spec.chunk_size + 1
    return jnp.broadcast_to(ids, (spec.batch, spec.q_len))
