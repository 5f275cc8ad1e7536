"""Argument normalization: `normalize_arguments` is the ONE place where the public arguments of
`attention` / `check_support` are validated and turned into an `AttentionSpec`, so that the support
query and the runtime can never disagree on what a call means."""
from __future__ import annotations

import math
import operator
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np

from sdpagraph.segments.rules import check_segment_count, check_segment_lengths, seqlen_hint_checks
from sdpagraph.spec import CAUSAL_ALIGNMENTS, DTYPES, FP8_DTYPES, UNBOUNDED, AttentionSpec


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
