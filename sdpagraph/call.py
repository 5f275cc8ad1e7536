"""A validated `attention` call: normalized arguments, the recorded score_mod, the runtime inputs.

`prepare_call` is the one argument path of the runtime (`api`) and of the
spec-file reader (`deploy.specfile`), so the two can never disagree about what a call means.

Layers above the runtime (deployment's spec recording) hear of every call traced for a graph through
`add_trace_listener`, so the runtime never imports them; under SPMD each call's per-device spec is
reported too (`backends.cudnn.sharding`, when XLA partitions the call).
"""
from __future__ import annotations

import dataclasses
import functools
import linecache
import numbers
import os
import re
import threading
import traceback
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from sdpagraph.errors import SdpagraphError
from sdpagraph.scoremod.ir import FLOAT, INT, ScoreModError, ScoreModIR, array_api_error
from sdpagraph.scoremod.native_masks import NativeMask, native_mask
from sdpagraph.scoremod.trace import TensorInfo, trace_score_mod
from sdpagraph.memo import BoundedMemo
from sdpagraph.meshes import whole_along_sequence
from sdpagraph.scoremod import forms as flex_mods
from sdpagraph.scoremod.forms import PythonMods
from sdpagraph.segments.metadata import (check_segment_bound, check_segment_lengths, rows_over_segment_bound,
                                         rows_over_segment_length, segment_check_mode)
from sdpagraph.segments.rules import seqlen_hint_checks
from sdpagraph.arguments import normalize_arguments
from sdpagraph.spec import AttentionSpec


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
    python_mods: PythonMods | None = None  # jax.numpy mods the IR cannot express (XLA runs them)
    page_table: Any = None  # (B, max_pages) int32 with paged K/V (`sdpagraph.paged`)
    dropout_seeds: Any = None  # (B, N) int32 with dropout (`sdpagraph.dropout.seeds`)
    fp8_scales: Mapping[str, Any] | None = None  # an FP8 call's descale_q/k/v and scale_o, float32 (`sdpagraph.fp8`)


@dataclass(frozen=True)
class PreparedCall:
    """A validated call: the static spec, the recorded score_mod, and the runtime inputs."""

    spec: AttentionSpec
    score_mod: ScoreModIR | None
    inputs: RuntimeInputs
    unbatched: bool
    # (B,) bool, traced: rows whose packed ids break a static bound; their output is NaN (`poison`).
    invalid_rows: Any = None
    # The same rows from any (traced) segment ids given as the call's are: a context-parallel call
    # asks with the whole sequence's ids inside its shard_map, where no sequence-split scan runs.
    row_check: Callable[[Any], Any] | None = None

    def poison(self, out: Any, lse: Any, rows: Any = None) -> tuple[Any, Any]:
        """`out` (B, T, N, H_v) and `lse` (B, N, T) or None with the invalid rows' (`rows`, else
        `invalid_rows`) values NaN."""
        rows = self.invalid_rows if rows is None else rows
        if rows is None:
            return out, lse
        out = jnp.where(rows[:, None, None, None], jnp.nan, out).astype(out.dtype)
        if lse is not None:  # an inference graph keeps no softmax stats
            lse = jnp.where(rows[:, None, None], jnp.nan, lse).astype(lse.dtype)
        return out, lse


class MissingTensorError(SdpagraphError, KeyError, ValueError):
    """A score_mod read a tensor name that neither score_mod_tensors nor the mod carries."""

    def __str__(self) -> str:  # KeyError would print the message quoted
        return str(self.args[0])


def _mod_tensor_info(name: str, value: Any, full: tuple[int, int, int, int]) -> tuple[TensorInfo, Any]:
    """Classify one score_mod_tensors entry: Python/NumPy scalar -> bound scalar, else an operand.

    A jax scalar (a traced one under `jit`, or a concrete 0-d array) is a (1, 1, 1, 1) array
    operand: its value never enters a graph key, and cuDNN reads it from device memory.
    Operands are stored as float32 or int32, the types the graph declares for them."""
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
    if not (np.issubdtype(kind, np.integer) or np.issubdtype(kind, np.floating) or kind.name == "bfloat16"):
        raise TypeError(f"score_mod_tensors[{name!r}] must hold real numbers, got dtype {kind.name}")
    dtype = INT if np.issubdtype(kind, np.integer) else FLOAT
    storage = np.int32 if dtype == INT else np.float32
    if isinstance(value, np.ndarray):  # NumPy stays on the host
        return TensorInfo("array", dtype, shape4), np.reshape(value, shape4).astype(storage, copy=False)
    return TensorInfo("array", dtype, shape4), jnp.reshape(value, shape4).astype(storage)


def _record_mod(score_mod, mask_mod, score_mod_tensors, score_mod_bprop, spec: AttentionSpec):
    """(IR or None, bound scalars, operand arrays, mods left to Python or None)."""
    if score_mod is None and mask_mod is None:
        if score_mod_tensors or score_mod_bprop is not None:
            raise ValueError("score_mod_tensors / score_mod_bprop need a score_mod")
        return None, {}, {}, None
    if score_mod is not None and not callable(score_mod):
        raise TypeError(f"score_mod must be callable: {flex_mods.FORMS_TEXT}; got {type(score_mod).__name__}")
    if score_mod_tensors is not None and not isinstance(score_mod_tensors, Mapping):
        raise TypeError("score_mod_tensors must be a mapping of names to values, e.g. {'cap': 30.0}, "
                        f"got {type(score_mod_tensors).__name__}")
    full = (spec.batch, spec.num_heads, spec.q_len, spec.kv_len)
    flex = None
    if mask_mod is not None or flex_mods.score_mod_form(score_mod) == flex_mods.JNP_FORM:
        if mask_mod is not None and score_mod_bprop is not None:
            raise ValueError("score_mod_bprop cannot be combined with mask_mod: leave it out and the gradient "
                             "of both is derived")
        flex = flex_mods.resolve(score_mod, mask_mod, full)
    carried = getattr(score_mod, "tensors", {}) if score_mod is not None else {}
    values = dict(carried)
    for name, value in {**(score_mod_tensors or {}), **(flex.tensors if flex else {})}.items():
        if not isinstance(name, str):
            raise TypeError(f"score_mod_tensors keys must be str names, got {name!r}")
        if name in values:
            raise ValueError(f"score_mod_tensors[{name!r}] clashes with a tensor the score_mod carries")
        values[name] = value
    bprop = score_mod_bprop if score_mod_bprop is not None else getattr(score_mod, "bprop", None)
    infos, scalars, arrays = {}, {}, {}
    for name, value in values.items():
        info, bound = _mod_tensor_info(name, value, full)
        infos[name] = info
        (scalars if info.kind == "scalar" else arrays)[name] = bound
    if flex is None:
        return _traced(score_mod, infos, bprop), scalars, arrays, None
    ir = None if flex.callback is None else _trace(flex.callback, infos, bprop)
    return ir, scalars, arrays, flex.python


# Recorded IRs per score_mod function object and tensor signature (scalar values are not part of
# it), so a repeated call or support query does not trace again. Like jax.jit's trace cache, this
# assumes a callback's ops depend only on its arguments, not on mutable state it closes over.
# Weak in the function (a dropped mod takes its traces with it), bounded per function, locked.
_traces: "weakref.WeakKeyDictionary[Callable, BoundedMemo]" = weakref.WeakKeyDictionary()
_traces_lock = threading.Lock()
_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep  # sdpagraph/
TRACES_PER_FUNCTION = 64


def _traced(score_mod: Callable, infos: dict[str, TensorInfo], bprop: Callable | None) -> ScoreModIR:
    signature = (tuple(sorted(infos.items())), bprop)
    try:
        with _traces_lock:
            per_function = _traces.setdefault(score_mod, BoundedMemo(TRACES_PER_FUNCTION))
    except TypeError:  # not weak-referenceable: trace every time
        return _trace(score_mod, infos, bprop)
    return per_function.get_or_compute(signature, lambda: _trace(score_mod, infos, bprop))


_ARRAY_CALL = re.compile(r"\b(?:jnp|np|numpy|jax\.numpy|jax\.nn|nn|lax|jax\.lax)\.(\w+)\s*\(")
_LIBRARY_DIRS = tuple(os.path.dirname(m.__file__) + os.sep for m in (jax, np))


def _array_function_called(err: BaseException) -> str | None:
    """The jax.numpy/NumPy function a score_mod's failing line calls (its innermost own frame)."""
    line = None
    for frame, lineno in traceback.walk_tb(err.__traceback__):
        filename = frame.f_code.co_filename
        if not filename.startswith(_LIBRARY_DIRS) and not filename.startswith(_PACKAGE_DIR):
            line = linecache.getline(filename, lineno)
    match = _ARRAY_CALL.search(line or "")
    return match.group(1) if match else None


def _trace(score_mod: Callable, infos: dict[str, TensorInfo], bprop: Callable | None) -> ScoreModIR:
    """`trace_score_mod`, with clear errors when the mod reads a tensor name it was not given or
    hands a graph tensor to jax.numpy / NumPy."""
    try:
        return trace_score_mod(score_mod, infos, bprop)
    except ScoreModError:
        raise
    except (TypeError, ValueError) as err:
        if "ModTensor" not in str(err):
            raise
        raise array_api_error(_array_function_called(err), f"{type(err).__name__}: {err}") from err
    except KeyError as err:
        name = err.args[0] if len(err.args) == 1 else None
        if not isinstance(name, str) or name in infos:
            raise
        given = ", ".join(repr(n) for n in sorted(infos)) or "none"
        raise MissingTensorError(
            f"score_mod read tensors[{name!r}] (KeyError), a tensor it was not given (tensors given: {given}); "
            f"pass score_mod_tensors={{{name!r}: value}}") from err


def as_4d(x: Any, unbatched: bool) -> Any:
    return None if x is None else (jnp.asarray(x)[None] if unbatched else jnp.asarray(x))


def _array_like(x: Any) -> Any:
    """A bias or mask given as a Python number or (nested) list, as jax accepts: a jax array."""
    return x if x is None or hasattr(x, "shape") else jnp.asarray(x)


def _check_segments_at_run_time(segment_ids: Any, max_segments_per_seq: Any, max_seqlen_q: Any,
                                max_seqlen_kv: Any, spec: AttentionSpec) -> Callable[[Any], Any] | None:
    """Traced ids cannot be checked when the call is made (`normalize_arguments` checks concrete
    ones): the segment count bound and the segment length hints are checked when the call runs, as
    `segments.segment_check_mode` says. Returns the function from segment ids (given as
    `segment_ids` is) to the (B,) bool rows whose output must be NaN, or None (nothing traced to
    check, or the check raises itself, or is off)."""
    if segment_ids is None:
        return None
    mode = segment_check_mode()
    if mode == "off":
        return None

    def checks_of(given):  # (rows over -> (B,) bool, raise when the call runs) per traced check
        q_ids = given[0] if isinstance(given, (tuple, list)) else given
        checks = []
        if max_segments_per_seq is not None and isinstance(q_ids, jax.core.Tracer):
            argname = "segment_ids" if spec.segments == "self" else "segment_ids[0]"
            checks.append((functools.partial(rows_over_segment_bound, q_ids, spec.max_segments),
                           functools.partial(check_segment_bound, q_ids, spec.max_segments, argname)))
        for argname, ids, hint_name, bound in seqlen_hint_checks(given, max_seqlen_q, max_seqlen_kv):
            if isinstance(ids, jax.core.Tracer):
                checks.append((functools.partial(rows_over_segment_length, ids, bound),
                               functools.partial(check_segment_lengths, ids, bound, argname, hint_name)))
        return checks

    checks = checks_of(segment_ids)
    if mode == "raise" or not checks or spec.empty_axes:
        for _, raise_when_run in checks:
            raise_when_run()
        return None
    return lambda given: functools.reduce(jnp.logical_or, (rows_over() for rows_over, _ in checks_of(given)))


def _native_mask_mod(ir: ScoreModIR | None, score_mod: Any, mask_mod: Any, spec: AttentionSpec) -> NativeMask | None:
    """The native flags a lone mask_mod equals (`scoremod.native_masks`), when the call sets no
    position mask of its own to combine with."""
    if mask_mod is None or score_mod is not None or spec.has_position_mask or spec.causal_alignment != "top_left":
        return None
    return native_mask(ir)


def prepare_call(query, key, value, bias=None, mask=None, *, scale=None, is_causal=False,
                 query_seq_lengths=None, key_value_seq_lengths=None, local_window_size=None,
                 causal_alignment="top_left", segment_ids=None,
                 max_segments_per_seq=None, chunk_size=None, score_mod=None, score_mod_tensors=None,
                 score_mod_bprop=None, mask_mod=None, max_seqlen_q=None, max_seqlen_kv=None) -> PreparedCall:
    """Validate everything and record the score_mod; arrays may be ShapeDtypeStructs.

    The bias and mask come back 4-D (`spec.bias_shape` / `spec.mask_shape`: lower ranks
    left-padded with 1s, as jax.nn.dot_product_attention reads them), so no backend sees
    another rank."""
    bias, mask = _array_like(bias), _array_like(mask)
    call = normalize_arguments(
        query, key, value, bias, mask, scale=scale, is_causal=is_causal,
        query_seq_lengths=query_seq_lengths, key_value_seq_lengths=key_value_seq_lengths,
        local_window_size=local_window_size, causal_alignment=causal_alignment, segment_ids=segment_ids,
        max_segments_per_seq=max_segments_per_seq, chunk_size=chunk_size,
        max_seqlen_q=max_seqlen_q, max_seqlen_kv=max_seqlen_kv,
    )
    ir, scalars, arrays, python_mods = _record_mod(score_mod, mask_mod, score_mod_tensors, score_mod_bprop,
                                                   call.spec)
    native = _native_mask_mod(ir, score_mod, mask_mod, call.spec)
    if native is not None:  # the flags cuDNN skips tiles for, in place of an equal mask mod
        spec = dataclasses.replace(call.spec, is_causal=native.is_causal, window=native.window)
        call, ir = dataclasses.replace(call, spec=spec), None
    is_array = not isinstance(query, jax.ShapeDtypeStruct)
    q_ids = kv_ids = None
    if segment_ids is not None:
        if isinstance(segment_ids, (tuple, list)):
            segment_ids = type(segment_ids)(whole_along_sequence(ids) if is_array else ids for ids in segment_ids)
        elif is_array:
            segment_ids = whole_along_sequence(segment_ids)
        q_ids, kv_ids = segment_ids if isinstance(segment_ids, (tuple, list)) else (segment_ids, segment_ids)
    row_check = _check_segments_at_run_time(segment_ids, max_segments_per_seq, max_seqlen_q, max_seqlen_kv, call.spec)
    invalid_rows = None if row_check is None else row_check(segment_ids)
    wrap = (lambda x, shape: None if x is None else jnp.reshape(jnp.asarray(x), shape)) if is_array else (lambda x, _: x)
    inputs = RuntimeInputs(
        bias=wrap(bias, call.spec.bias_shape), mask=wrap(mask, call.spec.mask_shape),
        q_lengths=query_seq_lengths, kv_lengths=key_value_seq_lengths,
        q_segment_ids=q_ids, kv_segment_ids=kv_ids,
        mod_scalars=scalars, mod_arrays=arrays, python_mods=python_mods,
    )
    return PreparedCall(call.spec, ir, inputs, call.unbatched, invalid_rows, row_check)


# ----------------------------------------------------------------------------- trace listeners

TraceListener = Callable[[AttentionSpec, "ScoreModIR | None", bool], None]
_trace_listeners: list[TraceListener] = []
_listeners_lock = threading.Lock()


def add_trace_listener(listener: TraceListener) -> None:
    """Call `listener(spec, score_mod_ir, training)` for every attention call traced for a graph
    (not for `implementation="xla"`). Listeners must return fast when they have nothing to do."""
    with _listeners_lock:
        if listener not in _trace_listeners:
            _trace_listeners.append(listener)


def notify_trace_listeners(spec: AttentionSpec, ir: ScoreModIR | None, training: bool) -> None:
    """Report one spec to every listener."""
    with _listeners_lock:
        listeners = list(_trace_listeners)
    for listener in listeners:
        listener(spec, ir, training)
