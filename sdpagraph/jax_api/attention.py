"""`sdpagraph.attention` and `sdpagraph.check_support`: one argument path, two questions.

Both normalize arguments with `prepare_call` (the same code), so the support query
and the runtime can never disagree about what a call means.
"""
from __future__ import annotations

import logging
import numbers
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from sdpagraph import recording
from sdpagraph.cache import CacheMissError
from sdpagraph.graphs.ir import FLOAT, INT, ScoreModIR, TensorInfo, trace_score_mod
from sdpagraph.graphs.support import Support
from sdpagraph.jax_api import cudnn as cudnn_backend
from sdpagraph.jax_api.xla import RuntimeInputs, xla_attention
from sdpagraph.spec import AttentionSpec, normalize_arguments

logger = logging.getLogger("sdpagraph")
_logged_reasons: set[str] = set()


@dataclass(frozen=True)
class PreparedCall:
    """A validated call: the static spec, the recorded score_mod, and the runtime inputs."""

    spec: AttentionSpec
    score_mod: ScoreModIR | None
    inputs: RuntimeInputs
    unbatched: bool


def _mod_tensor_info(name: str, value: Any, full: tuple[int, int, int, int]) -> tuple[TensorInfo, Any]:
    """Classify one score_mod_tensors entry: Python/NumPy scalar -> bound scalar, else an operand."""
    if isinstance(value, (numbers.Number, np.generic)) or (isinstance(value, np.ndarray) and value.ndim == 0):
        scalar = value.item() if hasattr(value, "item") else value
        if isinstance(scalar, (bool, complex)):
            raise TypeError(f"score_mod_tensors[{name!r}] must be a real number, got {type(scalar).__name__}")
        kind = INT if isinstance(scalar, numbers.Integral) else FLOAT
        return TensorInfo("scalar", kind), scalar
    if not hasattr(value, "shape") or not hasattr(value, "dtype"):
        raise TypeError(f"score_mod_tensors[{name!r}] must be a number or an array, got {type(value).__name__}")
    shape = tuple(value.shape)
    if len(shape) > 4:
        raise ValueError(f"score_mod_tensors[{name!r}] has rank {len(shape)}; it must broadcast to (B, N, T, S)={full}")
    shape4 = (1,) * (4 - len(shape)) + shape
    if any(d not in (1, f) for d, f in zip(shape4, full)):
        raise ValueError(f"score_mod_tensors[{name!r}] shape {shape} is not broadcastable to (B, N, T, S)={full}")
    kind = np.dtype(value.dtype)
    if kind == np.bool_:
        raise TypeError(f"score_mod_tensors[{name!r}] is boolean; pass boolean masks as mask= or as 0/1 int32")
    dtype = INT if np.issubdtype(kind, np.integer) else FLOAT
    reshape = np.reshape if isinstance(value, np.ndarray) else jnp.reshape  # NumPy stays on the host
    return TensorInfo("array", dtype, shape4), reshape(value, shape4)


def _record_mod(score_mod, score_mod_tensors, score_mod_bprop, spec: AttentionSpec):
    if score_mod is None:
        if score_mod_tensors or score_mod_bprop is not None:
            raise ValueError("score_mod_tensors / score_mod_bprop need a score_mod")
        return None, {}, {}
    if not callable(score_mod):
        raise TypeError(f"score_mod must be callable (graph, score, tensors) -> tensor, got {type(score_mod).__name__}")
    values = dict(getattr(score_mod, "tensors", {}))
    for name, value in (score_mod_tensors or {}).items():
        if name in values:
            raise ValueError(f"score_mod_tensors[{name!r}] clashes with a tensor the score_mod carries")
        values[name] = value
    bprop = score_mod_bprop if score_mod_bprop is not None else getattr(score_mod, "bprop", None)
    full = (spec.batch, spec.num_heads, spec.q_len, spec.kv_len)
    infos, scalars, arrays = {}, {}, {}
    for name, value in values.items():
        info, bound = _mod_tensor_info(name, value, full)
        infos[name] = info
        (scalars if info.kind == "scalar" else arrays)[name] = bound
    return _traced(score_mod, infos, bprop), scalars, arrays


# Recorded IRs per score_mod function object and tensor signature (scalar values are not part of
# it), so a repeated call or support query does not trace again. Like jax.jit's trace cache, this
# assumes a callback's ops depend only on its arguments, not on mutable state it closes over.
_traces: "weakref.WeakKeyDictionary[Callable, dict]" = weakref.WeakKeyDictionary()


def _traced(score_mod: Callable, infos: dict[str, TensorInfo], bprop: Callable | None) -> ScoreModIR:
    signature = (tuple(sorted(infos.items())), bprop)
    try:
        per_function = _traces.setdefault(score_mod, {})
    except TypeError:  # not weak-referenceable: trace every time
        return trace_score_mod(score_mod, infos, bprop)
    if signature not in per_function:
        per_function[signature] = trace_score_mod(score_mod, infos, bprop)
    return per_function[signature]


def _as_4d(x: Any, unbatched: bool) -> Any:
    return None if x is None else (jnp.asarray(x)[None] if unbatched else jnp.asarray(x))


def prepare_call(query, key, value, bias=None, mask=None, *, scale=None, is_causal=False,
                 query_seq_lengths=None, key_value_seq_lengths=None, local_window_size=None,
                 implementation=None, causal_alignment="top_left", segment_ids=None,
                 max_segments_per_seq=None, chunk_size=None, score_mod=None, score_mod_tensors=None,
                 score_mod_bprop=None) -> PreparedCall:
    """Validate everything and record the score_mod; arrays may be ShapeDtypeStructs."""
    call = normalize_arguments(
        query, key, value, bias, mask, scale=scale, is_causal=is_causal,
        query_seq_lengths=query_seq_lengths, key_value_seq_lengths=key_value_seq_lengths,
        local_window_size=local_window_size, causal_alignment=causal_alignment, segment_ids=segment_ids,
        max_segments_per_seq=max_segments_per_seq, chunk_size=chunk_size, implementation=implementation,
    )
    ir, scalars, arrays = _record_mod(score_mod, score_mod_tensors, score_mod_bprop, call.spec)
    q_ids = kv_ids = None
    if segment_ids is not None:
        q_ids, kv_ids = segment_ids if isinstance(segment_ids, (tuple, list)) else (segment_ids, segment_ids)
    is_array = not isinstance(query, jax.ShapeDtypeStruct)
    wrap = (lambda x: _as_4d(x, call.unbatched)) if is_array else (lambda x: x)
    inputs = RuntimeInputs(
        bias=wrap(bias), mask=wrap(mask),
        q_lengths=query_seq_lengths, kv_lengths=key_value_seq_lengths,
        q_segment_ids=q_ids, kv_segment_ids=kv_ids,
        mod_scalars=scalars, mod_arrays=arrays,
    )
    return PreparedCall(call.spec, ir, inputs, call.unbatched)


def _log_once(message: str) -> None:
    if message not in _logged_reasons:
        _logged_reasons.add(message)
        logger.info(message)


def _strict_miss_message(call: PreparedCall, miss: CacheMissError) -> str:
    return (f"{miss} Spec: {call.spec.summary()}. Record it with SDPAGRAPH_RECORD=specs.json (or "
            "`with sdpagraph.record('specs.json')`), then on this GPU type run `sdpagraph precompile specs.json "
            "--cache-dir $SDPAGRAPH_CACHE_DIR`; `sdpagraph verify --specs specs.json --cache-dir DIR` checks a cache.")


def _cudnn_support(call: PreparedCall, training: bool, *, raise_on_miss: bool) -> Support:
    try:
        return cudnn_backend.support(call.spec, call.score_mod, training=training)
    except CacheMissError as miss:
        if raise_on_miss:
            raise CacheMissError(_strict_miss_message(call, miss)) from None
        return Support(False, "xla", _strict_miss_message(call, miss))


def _choose_backend(call: PreparedCall, implementation: str | None, training: bool) -> str:
    if implementation == "xla":
        return "xla"
    support = _cudnn_support(call, training, raise_on_miss=True)
    if support.supported:
        return "cudnn"
    if implementation == "cudnn":
        raise ValueError(f"implementation='cudnn' cannot run {call.spec.summary()}: {support.reason}")
    _log_once(f"sdpagraph: using the XLA backend for {call.spec.summary()}: {support.reason}")
    return "xla"


def attention(
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
    local_window_size: int | tuple[int, int] | None = None,
    implementation: str | None = None,
    return_residual: bool = False,
    causal_alignment: str = "top_left",
    segment_ids: Any = None,
    max_segments_per_seq: int | None = None,
    chunk_size: int | None = None,
    score_mod: Callable | None = None,
    score_mod_tensors: Mapping[str, Any] | None = None,
    score_mod_bprop: Callable | None = None,
    training: bool = True,
) -> Any:
    r"""Scaled dot-product attention with flex-attention extensions; a drop-in for
    `jax.nn.dot_product_attention`.

    Computes, per batch b and head n (query head n reads key/value head n // (N // K)):

        logits = score_mod(scale * q . k^T) + bias
        out    = softmax(logits masked by every mask below) . v

    Args:
      query: `(B, T, N, H)` (or `(T, N, H)`), float32 / bfloat16 / float16.
      key: `(B, S, K, H)`; N must be a multiple of K (GQA / MQA).
      value: `(B, S, K, H_v)`.
      bias: additive bias broadcastable to `(B, N, T, S)`; differentiable.
      mask: boolean, broadcastable to `(B, N, T, S)`; True means attend.
      scale: logit scale, default `1 / sqrt(H)`.
      is_causal: causal mask, aligned by `causal_alignment`.
      query_seq_lengths / key_value_seq_lengths: `(B,)` int32 valid lengths (padding).
        Padded query rows give zero output.
      local_window_size: `w` or `(left, right)`: query i sees keys in
        `[i - left, i + right]` around the aligned diagonal; -1 leaves a side open.
      implementation: None (cuDNN when it supports the call, else XLA, with the reason
        logged once at INFO), "xla", or "cudnn" (raises with the reason if unsupported).
      return_residual: also return the logsumexp, shape `(B, T, N)`, as jax does.
      causal_alignment: "top_left" (jax's default) or "bottom_right": the diagonal ends
        at the last query/key pair, for T != S.
      segment_ids: packed sequences: `(B, T)` int32 (self-attention) or a pair
        `(q_segment_ids (B, T), kv_segment_ids (B, S))`. 0 marks padding; a segment is
        a contiguous run of one id; the k-th query segment attends to the k-th key
        segment only. Causal, windows, chunks and score_mod positions count from each
        segment's start.
      max_segments_per_seq: static bound on segments per row (default: T). Segments
        past it are treated as padding.
      chunk_size: Llama-4 chunked attention: only keys in the same chunk of
        `chunk_size` positions (per segment when packed); combines with `is_causal`.
      score_mod: `score_mod(graph, score, tensors) -> tensor`, an elementwise change of
        the scaled scores `score[b, h, q, kv]`, written with cudnn-frontend pygraph
        pointwise ops (`graph.tanh(input=...)`, `graph.gen_index(input=score, axis=2)`,
        ...) or Python operators; see `sdpagraph.mods` for ready-made ones.
      score_mod_tensors: names -> values the mod receives as graph tensors. Python or
        NumPy scalars are bound at execution (a new value does not rebuild a cuDNN
        graph); arrays broadcastable to `(B, N, T, S)` become operands and are
        constants for differentiation (use `bias` for a differentiable additive term).
      score_mod_bprop: `score_mod_bprop(graph, dscore, tensors) -> tensor`, the gradient
        through the mod. Derived automatically when omitted.
      training: False selects cuDNN's inference graph (no softmax stats) when no
        gradient is needed.

    Returns:
      `(B, T, N, H_v)` in the input dtype (and the logsumexp if `return_residual`).
    """
    call = prepare_call(
        query, key, value, bias, mask, scale=scale, is_causal=is_causal,
        query_seq_lengths=query_seq_lengths, key_value_seq_lengths=key_value_seq_lengths,
        local_window_size=local_window_size, implementation=implementation,
        causal_alignment=causal_alignment, segment_ids=segment_ids,
        max_segments_per_seq=max_segments_per_seq, chunk_size=chunk_size, score_mod=score_mod,
        score_mod_tensors=score_mod_tensors, score_mod_bprop=score_mod_bprop,
    )
    if implementation != "xla":
        recording.record_call(call.spec, call.score_mod, training)
    q, k, v = (_as_4d(x, call.unbatched) for x in (query, key, value))
    backend = _choose_backend(call, implementation, training)
    if backend == "xla":
        out, lse = xla_attention(call.spec, q, k, v, call.inputs, call.score_mod)
    else:  # the inference graph has no softmax stats: a residual needs the training graph
        out, lse = cudnn_backend.attention(call.spec, q, k, v, call.inputs, call.score_mod,
                                           training=training or return_residual)
    if call.unbatched:
        out, lse = out[0], lse[0]
    if return_residual:
        return out, jnp.swapaxes(lse, -1, -2).astype(out.dtype)
    return out


def check_support(query: Any, key: Any, value: Any, bias: Any = None, mask: Any = None, *,
                  training: bool = True, **kwargs: Any) -> Support:
    """Will `attention(query, key, value, bias, mask, **kwargs)` run on cuDNN here, and if not, why?

    Takes the same arguments as `attention` (arrays or `jax.ShapeDtypeStruct`s) and
    normalizes them with the same code. Invalid arguments raise the same errors
    `attention` raises. `training=True` checks the backward graph too. A supported
    answer leaves the graphs in the cache, so the later call builds nothing.
    """
    kwargs.pop("return_residual", None)
    implementation = kwargs.get("implementation")
    call = prepare_call(query, key, value, bias, mask, **kwargs)
    if implementation == "xla":
        return Support(False, "xla", "implementation='xla' was requested")
    support = _cudnn_support(call, training, raise_on_miss=False)
    if not support.supported and implementation != "cudnn":
        return Support(False, "xla", support.reason)
    return support
