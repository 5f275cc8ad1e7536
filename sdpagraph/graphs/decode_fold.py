"""Multi-token decode on paged K/V (speculative decoding: T = 2..16 new tokens, bottom-right causal):
which calls split, and the spec of their folded prefix call (`backends.cudnn.paged_decode` runs them).

cuDNN's paged graph with the causal band ran 5.2x slower at T = 4 than at T = 1 on an H100, while
the same keys read by a maskless call whose T tokens x G = N/K query heads per key/value head are
folded into T*G query rows ran as fast as T = 1 (issue probe, 2026-11-25). So such a call runs the
shared prefix (the keys every new token sees) as one maskless paged call of folded rows, and its
last T - 1 keys apart.

    decode_fold(spec, ir) -> the folded prefix call's spec, or None when the call does not split
"""
from __future__ import annotations

import dataclasses

from sdpagraph.scoremod.ir import ScoreModIR
from sdpagraph.spec import AttentionSpec

MAX_TOKENS = 16  # new tokens a call folds (speculative / multi-token decode)


def decode_fold(spec: AttentionSpec, ir: ScoreModIR | None) -> AttentionSpec | None:
    """The prefix call's spec (T*G query rows over K heads as MHA, no mask, key lengths, with its
    softmax stats) of a multi-token decode: paged, 2 <= T <= MAX_TOKENS new tokens at the end of each
    sequence (bottom-right causal, no query lengths), nothing else masked or modified; else None."""
    if not (spec.paged is not None and 2 <= spec.q_len <= MAX_TOKENS and spec.is_causal
            and spec.causal_alignment == "bottom_right" and not spec.has_q_lengths and not spec.has_window
            and spec.chunk_size is None and ir is None and spec.bias_shape is None and spec.mask_shape is None
            and not spec.sinks):
        return None
    group = spec.num_heads // spec.num_kv_heads
    return dataclasses.replace(spec, q_len=spec.q_len * group, num_heads=spec.num_kv_heads, is_causal=False,
                               causal_alignment="top_left", has_q_lengths=False, has_kv_lengths=True)
