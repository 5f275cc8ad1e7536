"""A validated `attention` call: normalized arguments, the recorded score_mod, the runtime inputs.

`prepare_call` is the one argument path of the runtime (`jax_api.attention`) and of the
spec-file reader (`deploy.specfile`), so the two can never disagree about what a call means.
"""
from __future__ import annotations

import numbers
import threading
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from sdpagraph.graphs.ir import FLOAT, INT, ScoreModIR
from sdpagraph.graphs.trace import TensorInfo, trace_score_mod
from sdpagraph.cache.memory import BoundedMemo
from sdpagraph.spec import AttentionSpec, normalize_arguments


@dataclass(frozen=True)
class RuntimeInputs:
    """The traced (non-static) inputs next to q, k, v: what the spec only flags."""

    bias: Any = None
    mask: Any = None
    q_lengths: Any = None
    kv_lengths: Any = None
    q_segment_ids: Any = None
    kv_segment_ids: Any = None
    mod_scalars: Mapping[str, Any] | None = None
    mod_arrays: Mapping[str, Any] | None = None



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
# Weak in the function (a dropped mod takes its traces with it), bounded per function, locked.
_traces: "weakref.WeakKeyDictionary[Callable, BoundedMemo]" = weakref.WeakKeyDictionary()
_traces_lock = threading.Lock()
TRACES_PER_FUNCTION = 64


def _traced(score_mod: Callable, infos: dict[str, TensorInfo], bprop: Callable | None) -> ScoreModIR:
    signature = (tuple(sorted(infos.items())), bprop)
    try:
        with _traces_lock:
            per_function = _traces.setdefault(score_mod, BoundedMemo(TRACES_PER_FUNCTION))
    except TypeError:  # not weak-referenceable: trace every time
        return trace_score_mod(score_mod, infos, bprop)
    return per_function.get_or_compute(signature, lambda: trace_score_mod(score_mod, infos, bprop))


def as_4d(x: Any, unbatched: bool) -> Any:
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
    wrap = (lambda x: as_4d(x, call.unbatched)) if is_array else (lambda x: x)
    inputs = RuntimeInputs(
        bias=wrap(bias), mask=wrap(mask),
        q_lengths=query_seq_lengths, kv_lengths=key_value_seq_lengths,
        q_segment_ids=q_ids, kv_segment_ids=kv_ids,
        mod_scalars=scalars, mod_arrays=arrays,
    )
    return PreparedCall(call.spec, ir, inputs, call.unbatched)
