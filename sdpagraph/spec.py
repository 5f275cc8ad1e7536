"""AttentionSpec: the static description of one attention call, and the graphs a call needs.

Every layer shares this module. The public arguments of `attention` / `check_support` become an
`AttentionSpec` in one place, `arguments.normalize_arguments`.

An `AttentionSpec` holds static facts only (shapes, dtypes, flags, sizes). Runtime
values (sequence lengths, segment ids, score_mod scalar values) never enter it, so
they never enter a graph cache key.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any

# float64 exists only with jax_enable_x64 (otherwise jax converts it to float32, as here); cuDNN
# computes in bfloat16/float16, so float64 calls run on the XLA backend.
DTYPES = ("float32", "bfloat16", "float16", "float64")
# FP8 inputs with per-tensor scales run through `sdpagraph.fp8` (cuDNN's sdpa_fp8), not `attention`.
FP8_DTYPES = ("float8_e4m3fn", "float8_e5m2")
CAUSAL_ALIGNMENTS = ("top_left", "bottom_right")
UNBOUNDED = -1  # a window side that does not limit attention
# The graphs one spec compiles to: forward (output + softmax stats), backward, and inference
# (output only, for calls that are not differentiated).
DIRECTIONS = ("forward", "backward", "inference")
TRAINING_DIRECTIONS = ("forward", "backward")  # what a differentiated call runs
INFERENCE_DIRECTIONS = ("inference",)
STATS_DIRECTIONS = ("forward",)  # the graph with its softmax stats, where no backward graph exists


def directions_for(training: bool, spec: "AttentionSpec | None" = None) -> tuple[str, ...]:
    """The graphs a call needs: forward and backward when training, else the inference graph. Specs
    without a backward graph "train" with the forward graph alone, which keeps the softmax stats: paged
    K/V (inference only; a multi-token decode merges by its stats) and cuDNN's own sinks (a call with
    them runs the backward graph of its spec without sinks, given the output and stats with the sink)."""
    if spec is not None and (spec.paged is not None or spec.sinks):
        return STATS_DIRECTIONS if training else INFERENCE_DIRECTIONS
    return TRAINING_DIRECTIONS if training else INFERENCE_DIRECTIONS


# name -> default (see AttentionSpec.to_dict)
_FIELDS_ADDED_LATER = {"segment_mask": False, "max_seqlen_q": None, "max_seqlen_kv": None, "sinks": False,
                       "paged": None, "deterministic": False, "dropout": 0.0}


@dataclass(frozen=True)
class AttentionSpec:
    """Static description of one attention call (BSHD layout, as the user passes it).

    Sizes follow `jax.nn.dot_product_attention`: B batch, T query length, S key
    length, N query heads, K key/value heads, H head dim (H_v for value).
    `window` is `(left, right)` around the (aligned) diagonal; `UNBOUNDED` (-1)
    leaves a side open. `bias_shape`/`mask_shape` are the 4-D shapes of the optional
    bias and boolean mask, broadcastable to `(B, N, T, S)`.
    """

    batch: int
    q_len: int
    kv_len: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    head_dim_v: int
    dtype: str
    scale: float
    is_causal: bool = False
    causal_alignment: str = "top_left"
    window: tuple[int, int] = (UNBOUNDED, UNBOUNDED)
    chunk_size: int | None = None
    bias_shape: tuple[int, int, int, int] | None = None
    mask_shape: tuple[int, int, int, int] | None = None
    has_q_lengths: bool = False
    has_kv_lengths: bool = False
    segments: str | None = None  # None, "self" (one ids array) or "cross" (q ids, kv ids)
    max_segments: int = 0
    # Internal (graphs.operands.graph_spec): packed self-attention segments kept apart on the dense
    # layout by comparing each key's position with its query's segment bounds (masks.segment_ir).
    segment_mask: bool = False
    # Static bounds on a packed segment's query / key length (`max_seqlen_q` / `max_seqlen_kv` of
    # `attention`), None when not given. Only the small-sequence backend uses them; cuDNN's graphs
    # do not depend on them (`graphs.operands.graph_spec` drops them).
    max_seqlen_q: int | None = None
    max_seqlen_kv: int | None = None
    # Attention sinks (`attention(..., sinks=)`) inside the graph: cuDNN's sink_token, one float32
    # logit per query head as an operand (their values are not part of the spec). Forward and
    # inference graphs only (`directions_for`).
    sinks: bool = False
    # Paged K/V (`sdpagraph.paged`): (num_pages, page_size) of the key/value pools, whose logical keys
    # are (B, S = max_pages * page_size, K, H); None for dense keys.
    paged: tuple[int, int] | None = None
    # cuDNN's deterministic backward algorithm (`attention(..., deterministic=)`); forward graphs are
    # the same either way (keyed without it: `graphs.builder.graph_identity`).
    deterministic: bool = False
    # Attention dropout's rate (`sdpagraph.dropout`), 0 for none: static, part of the graph; the seeds
    # are runtime inputs.
    dropout: float = 0.0

    @property
    def is_fp8(self) -> bool:
        """FP8 inputs and output with per-tensor scales (`sdpagraph.fp8`): cuDNN's sdpa_fp8 graph."""
        return self.dtype in FP8_DTYPES

    @property
    def has_window(self) -> bool:
        return self.window != (UNBOUNDED, UNBOUNDED)

    @property
    def has_padding(self) -> bool:
        return self.has_q_lengths or self.has_kv_lengths

    @property
    def empty_axes(self) -> tuple[str, ...]:
        """The axes of size 0 among B, T, S, N: such a call has nothing to compute (jax gives an
        empty result, or zeros when S is 0)."""
        sizes = (("B", self.batch), ("T", self.q_len), ("S", self.kv_len), ("N", self.num_heads))
        return tuple(axis for axis, size in sizes if size == 0)

    @property
    def has_position_mask(self) -> bool:
        """Whether any mask depends on query/key positions (causal, window, chunk)."""
        return self.is_causal or self.has_window or self.chunk_size is not None

    def canonical(self) -> str:
        """Deterministic text of every field, the spec's part of a cache key (see `to_dict`)."""
        return json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))

    def summary(self) -> str:
        """One human line, for `cache ls`, logs and error messages."""
        parts = [
            f"B{self.batch} T{self.q_len} S{self.kv_len} N{self.num_heads}/K{self.num_kv_heads}",
            f"H{self.head_dim}" + (f"/{self.head_dim_v}" if self.head_dim_v != self.head_dim else ""),
            self.dtype,
        ]
        if self.is_causal:
            parts.append("causal" + ("(br)" if self.causal_alignment == "bottom_right" else ""))
        if self.has_window:
            parts.append(f"window{self.window}")
        if self.chunk_size is not None:
            parts.append(f"chunk{self.chunk_size}")
        if self.bias_shape is not None:
            parts.append(f"bias{self.bias_shape}")
        if self.mask_shape is not None:
            parts.append(f"mask{self.mask_shape}")
        if self.has_padding:
            parts.append("padding")
        if self.segments:
            hints = "".join(f",{name}<={bound}" for name, bound in (("q", self.max_seqlen_q), ("kv", self.max_seqlen_kv))
                            if bound is not None)
            parts.append(f"segments({self.segments},{self.max_segments}{hints})")
        if self.segment_mask:
            parts.append("segment-mask")
        if self.sinks:
            parts.append("sinks")
        if self.paged is not None:
            parts.append(f"paged({self.paged[0]}x{self.paged[1]})")
        if self.deterministic:
            parts.append("deterministic")
        if self.dropout:
            parts.append(f"dropout{self.dropout:g}")
        return " ".join(parts)

    def to_dict(self) -> dict[str, Any]:
        """Every field, except one added after keys and spec files were first shipped while it
        holds its default: those keys stay valid and those files stay as they were."""
        fields = dataclasses.asdict(self)
        for name, default in _FIELDS_ADDED_LATER.items():
            if fields[name] == default:
                del fields[name]
        return fields

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "AttentionSpec":
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - fields
        if unknown:
            raise ValueError(f"unknown AttentionSpec field(s): {sorted(unknown)}")
        values = dict(data)
        for name in ("window", "bias_shape", "mask_shape", "paged"):
            if values.get(name) is not None:
                values[name] = tuple(values[name])
        return cls(**values)
