"""AttentionSpec: the static description of one attention call, and argument normalization.

Every layer shares this module. `normalize_arguments` is the ONE place where the
public arguments of `attention` / `check_support` are validated and turned into an
`AttentionSpec`, so that the support query and the runtime can never disagree on
what a call means.

An `AttentionSpec` holds static facts only (shapes, dtypes, flags, sizes). Runtime
values (sequence lengths, segment ids, score_mod scalar values) never enter it, so
they never enter a graph cache key.
"""
from __future__ import annotations

import dataclasses
import json
import math
import operator
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np

from sdpagraph.segments.rules import check_segment_count, check_segment_lengths, seqlen_hint_checks

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


@dataclass(frozen=True)
class NormalizedCall:
    """What `normalize_arguments` returns: the spec plus how to reshape back."""

    spec: AttentionSpec
    unbatched: bool  # the caller passed 3-D (T, N, H) arrays, as jax allows


def _dtype_name(x: Any, argname: str) -> str:
    """The dtype jax computes `x` in: NumPy float64/int64 become float32/int32 unless x64 is on."""
    try:
        return np.dtype(jax.dtypes.canonicalize_dtype(x.dtype)).name
    except (AttributeError, TypeError) as err:
        raise TypeError(f"{argname} must be an array or jax.ShapeDtypeStruct, got {type(x).__name__}") from err


def _shape(x: Any, argname: str) -> tuple[int, ...]:
    try:
        return tuple(int(d) for d in x.shape)
    except (AttributeError, TypeError) as err:
        raise TypeError(f"{argname} must be an array or jax.ShapeDtypeStruct, got {type(x).__name__}") from err


def _static_int(value: Any, argname: str) -> int:
    try:
        return operator.index(value)
    except TypeError as err:
        raise TypeError(f"{argname} must be a Python int, got {type(value).__name__}") from err


def normalize_window(local_window_size: Any) -> tuple[int, int]:
    """`None` | int | (left, right) -> (left, right) with UNBOUNDED for an open side."""
    if local_window_size is None:
        return (UNBOUNDED, UNBOUNDED)
    if isinstance(local_window_size, (tuple, list)):
        if len(local_window_size) != 2:
            raise ValueError(f"local_window_size must be an int or a (left, right) pair, got {local_window_size!r}")
        left, right = (_static_int(v, "local_window_size") for v in local_window_size)
    else:
        left = right = _static_int(local_window_size, "local_window_size")
    for side, value in (("left", left), ("right", right)):
        if value < UNBOUNDED:
            raise ValueError(f"local_window_size {side} side must be >= 0 (or -1 for unbounded), got {value}")
    return (left, right)


def _broadcast_4d(shape: tuple[int, ...], target: tuple[int, int, int, int], argname: str) -> tuple[int, int, int, int]:
    """`shape` as jax.nn.dot_product_attention reads a bias or mask: left-padded with 1s to 4-D
    (`(S,)`, `(T, S)`, `(N, T, S)` all work, for 3-D unbatched queries too), then each axis 1 or full."""
    if len(shape) > 4:
        raise ValueError(f"{argname} has rank {len(shape)}, shape {shape}; it must have at most 4 dims and "
                         f"broadcast to (B, N, T, S)={target}")
    shape4 = (1,) * (4 - len(shape)) + tuple(shape)
    for size, want, axis in zip(shape4, target, "BNTS"):
        if size not in (1, want):
            raise ValueError(f"{argname} shape {shape} is not broadcastable to (B, N, T, S)={target}: axis {axis} "
                             f"has size {size}, which must be 1 or {want} (lower ranks are left-padded with 1s, as jax does)")
    return shape4  # type: ignore[return-value]


def _concrete_values(x: Any) -> np.ndarray | None:
    """The values of a concrete array; None for tracers and ShapeDtypeStructs (checked shape-only)."""
    if not hasattr(x, "__array__"):
        return None
    try:
        return np.asarray(x)
    except Exception:  # a jax tracer: values are unknown at trace time
        return None


def _check_lengths(x: Any, batch: int, limit: int, argname: str) -> None:
    if x is None:
        return
    if _shape(x, argname) != (batch,):
        raise ValueError(f"{argname} must have shape (B,)=({batch},), got {_shape(x, argname)}")
    if not np.issubdtype(np.dtype(_dtype_name(x, argname)), np.integer):
        raise TypeError(f"{argname} must be an integer array, got dtype {_dtype_name(x, argname)}")
    values = _concrete_values(x)
    if values is not None and values.size and (values.min() < 0 or values.max() > limit):
        raise ValueError(f"{argname} must lie in [0, {limit}], got values in [{values.min()}, {values.max()}]")


def _seqlen_hints(segment_ids: Any, max_seqlen_q: Any, max_seqlen_kv: Any, q_len: int,
                  kv_len: int) -> tuple[int | None, int | None]:
    """Validate `max_seqlen_q` / `max_seqlen_kv` and return them as the spec holds them: clipped to T
    and S (a longer bound promises nothing more), and in self-attention both the smaller one given."""
    hints = {"max_seqlen_q": max_seqlen_q, "max_seqlen_kv": max_seqlen_kv}
    for name, value in hints.items():
        if value is None:
            continue
        if segment_ids is None:
            raise ValueError(f"{name}={value!r} needs segment_ids: it bounds the length of each packed segment "
                             "(without segments the lengths are T and S, which the shapes give)")
        hints[name] = _static_int(value, name)
        if hints[name] <= 0:
            raise ValueError(f"{name} must be a positive int, got {hints[name]}")
    for argname, ids, hint_name, bound in seqlen_hint_checks(segment_ids, hints["max_seqlen_q"],
                                                             hints["max_seqlen_kv"]):
        check_segment_lengths(argname, _concrete_values(ids), hint_name, bound)
    q_hint, kv_hint = hints["max_seqlen_q"], hints["max_seqlen_kv"]
    if segment_ids is not None and not isinstance(segment_ids, (tuple, list)) and (q_hint or kv_hint):
        q_hint = kv_hint = min(h for h in (q_hint, kv_hint) if h is not None)
    return (None if q_hint is None else min(q_hint, q_len)), (None if kv_hint is None else min(kv_hint, kv_len))


def _segment_mode(segment_ids: Any, batch: int, q_len: int, kv_len: int, bound: int | None = None) -> str | None:
    if segment_ids is None:
        return None
    if isinstance(segment_ids, (tuple, list)):
        if len(segment_ids) != 2:
            raise ValueError("segment_ids must be one (B, T) array or a pair (q_segment_ids, kv_segment_ids)")
        pairs = (("segment_ids[0]", segment_ids[0], q_len), ("segment_ids[1]", segment_ids[1], kv_len))
        mode = "cross"
    else:
        if q_len != kv_len:
            raise ValueError(
                f"segment_ids as one array needs T == S (self-attention), got T={q_len}, S={kv_len}; "
                "pass a pair (q_segment_ids, kv_segment_ids) for cross-attention"
            )
        pairs = (("segment_ids", segment_ids, q_len),)
        mode = "self"
    for argname, ids, length in pairs:
        if _shape(ids, argname) != (batch, length):
            raise ValueError(f"{argname} must have shape ({batch}, {length}), got {_shape(ids, argname)}")
        if not np.issubdtype(np.dtype(_dtype_name(ids, argname)), np.integer):
            raise TypeError(f"{argname} must be an int32 array, got dtype {_dtype_name(ids, argname)}")
        values = _concrete_values(ids)
        if values is not None and values.size and values.min() < 0:
            raise ValueError(f"{argname} must be >= 0 (0 marks padding), got {values.min()}")
        if argname != "segment_ids[1]":
            # Query rows past the bound would give zeros. Key segments past it need no check: the
            # k-th key segment pairs with the k-th query segment, which is then past it too.
            check_segment_count(argname, values, bound)
    return mode


def normalize_arguments(
    query: Any,
    key: Any,
    value: Any,
    bias: Any = None,
    mask: Any = None,
    *,
    scale: float | None = None,
    is_causal: bool = False,
    query_seq_lengths: Any = None,
    key_value_seq_lengths: Any = None,
    local_window_size: Any = None,
    causal_alignment: str = "top_left",
    segment_ids: Any = None,
    max_segments_per_seq: int | None = None,
    chunk_size: int | None = None,
    max_seqlen_q: int | None = None,
    max_seqlen_kv: int | None = None,
) -> NormalizedCall:
    """Validate the public arguments and build the `AttentionSpec` (arrays or ShapeDtypeStructs)."""
    if causal_alignment not in CAUSAL_ALIGNMENTS:
        raise ValueError(f"causal_alignment must be one of {CAUSAL_ALIGNMENTS}, got {causal_alignment!r}")
    if not isinstance(is_causal, (bool, np.bool_)):
        raise TypeError(f"is_causal must be a Python bool, got {type(is_causal).__name__}")

    shapes = {name: _shape(x, name) for name, x in (("query", query), ("key", key), ("value", value))}
    ranks = {len(s) for s in shapes.values()}
    if ranks not in ({4}, {3}):
        raise ValueError(
            "query, key and value must all be 4-D (B, T, N, H) / (B, S, K, H) (or all 3-D, unbatched); "
            f"got shapes query={shapes['query']}, key={shapes['key']}, value={shapes['value']}"
        )
    unbatched = ranks == {3}
    if unbatched:
        shapes = {name: (1,) + s for name, s in shapes.items()}
    (batch, q_len, num_heads, head_dim) = shapes["query"]
    (kb, kv_len, num_kv_heads, kh) = shapes["key"]
    (vb, vs, vk, head_dim_v) = shapes["value"]
    if kb != batch or vb != batch:
        raise ValueError(f"batch sizes differ: query {batch}, key {kb}, value {vb}")
    if kh != head_dim:
        raise ValueError(f"key head dim {kh} must equal query head dim {head_dim}")
    if (vs, vk) != (kv_len, num_kv_heads):
        raise ValueError(f"value shape {shapes['value']} must match key's (B, S, K)=({batch}, {kv_len}, {num_kv_heads})")
    if num_kv_heads == 0 or num_heads % num_kv_heads:
        raise ValueError(f"query heads N={num_heads} must be a multiple of key/value heads K={num_kv_heads}")

    dtypes = {name: _dtype_name(x, name) for name, x in (("query", query), ("key", key), ("value", value))}
    if len(set(dtypes.values())) != 1:
        raise TypeError(f"query, key and value must share one dtype, got {dtypes}")
    dtype = dtypes["query"]
    if dtype in FP8_DTYPES:
        raise TypeError(f"query dtype {dtype} is FP8: FP8 attention takes per-tensor scales, use sdpagraph.fp8.attention "
                        "(or sdpagraph.fp8.quantized_attention for bfloat16 inputs)")
    if dtype not in DTYPES:
        raise TypeError(f"query dtype must be one of {DTYPES}, got {dtype}")

    if head_dim == 0:
        raise ValueError(f"the head dim H of query and key is 0 (query shape {shapes['query']}); it must be >= 1")
    if scale is None:
        scale = 1.0 / math.sqrt(head_dim)
    elif not isinstance(scale, (int, float, np.floating, np.integer)) or isinstance(scale, bool):
        raise TypeError(f"scale must be a Python float, got {type(scale).__name__}")
    scale = float(scale)
    if not math.isfinite(scale):
        raise ValueError(f"scale must be a finite number, got {scale}: it would make every score NaN or infinite")

    full = (batch, num_heads, q_len, kv_len)
    bias_shape = mask_shape = None
    if bias is not None:
        bias_shape = _broadcast_4d(_shape(bias, "bias"), full, "bias")
        if _dtype_name(bias, "bias") not in DTYPES:
            raise TypeError(f"bias dtype must be floating, got {_dtype_name(bias, 'bias')}")
    if mask is not None:
        mask_shape = _broadcast_4d(_shape(mask, "mask"), full, "mask")
        if _dtype_name(mask, "mask") != "bool":
            raise TypeError(f"mask must be a boolean array (True = attend); pass additive masks as bias, got {_dtype_name(mask, 'mask')}")

    _check_lengths(query_seq_lengths, batch, q_len, "query_seq_lengths")
    _check_lengths(key_value_seq_lengths, batch, kv_len, "key_value_seq_lengths")
    window = normalize_window(local_window_size)

    if chunk_size is not None:
        chunk_size = _static_int(chunk_size, "chunk_size")
        if chunk_size <= 0:
            raise ValueError(f"chunk_size must be a positive int, got {chunk_size}")

    bound = None  # the user's max_segments_per_seq; the default, T, is always enough
    if segment_ids is not None and max_segments_per_seq is not None:
        bound = _static_int(max_segments_per_seq, "max_segments_per_seq")
        if bound <= 0:
            raise ValueError(f"max_segments_per_seq must be a positive int, got {bound}")
    segments = _segment_mode(segment_ids, batch, q_len, kv_len, bound)
    max_segments = 0
    if segments is not None:
        # Without a bound: T, always enough for the query ids (a key segment past the T-th has no
        # query segment to attend to it). Pass a bound to keep THD metadata small.
        max_segments = q_len if bound is None else bound
        if query_seq_lengths is not None or key_value_seq_lengths is not None:
            raise ValueError("pass either segment_ids or query_seq_lengths/key_value_seq_lengths, not both: padding is segment id 0")
    elif max_segments_per_seq is not None:
        raise ValueError("max_segments_per_seq needs segment_ids")
    max_seqlen_q, max_seqlen_kv = _seqlen_hints(segment_ids, max_seqlen_q, max_seqlen_kv, q_len, kv_len)

    spec = AttentionSpec(
        batch=batch,
        q_len=q_len,
        kv_len=kv_len,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        head_dim_v=head_dim_v,
        dtype=dtype,
        scale=scale,
        is_causal=bool(is_causal),
        causal_alignment=causal_alignment,
        window=window,
        chunk_size=chunk_size,
        bias_shape=bias_shape,
        mask_shape=mask_shape,
        has_q_lengths=query_seq_lengths is not None,
        has_kv_lengths=key_value_seq_lengths is not None,
        segments=segments,
        max_segments=max_segments,
        max_seqlen_q=max_seqlen_q,
        max_seqlen_kv=max_seqlen_kv,
    )
    return NormalizedCall(spec=spec, unbatched=unbatched)
