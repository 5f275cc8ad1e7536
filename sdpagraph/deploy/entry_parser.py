"""The entries of a spec file (`deploy.specfile`, whose docstring has their JSON forms), parsed
into `SpecEntry`s: a recorded entry is checked against what the runtime makes of its spec, a
hand-written one (the arguments of `sdpagraph.attention`, as shapes) is resolved by tracing
`call.prepare_call` on `jax.ShapeDtypeStruct`s, field by field, so that an error names the field
whose arguments make the call invalid.
"""
from __future__ import annotations

import dataclasses
import importlib
import json
from contextlib import contextmanager
from typing import Any, Iterator, Mapping, Sequence

import jax
import jax.numpy as jnp

from sdpagraph import mods
from sdpagraph.call import prepare_call
from sdpagraph.deploy.recorded_ir import clip, recorded_score_mod
from sdpagraph.deploy.spec_entry import SpecEntry, SpecFileError
from sdpagraph.spec import DTYPES, AttentionSpec, directions_for

RECORDED_FIELDS = ("spec", "score_mod", "directions", "summary")
# In this order, each field's arguments join the call: an error belongs to the first field
# whose arguments make the call invalid (so a conflict is reported at its second half).
ARGUMENT_FIELDS = ("scale", "is_causal", "causal_alignment", "local_window_size", "chunk_size",
                   "query_seq_lengths", "key_value_seq_lengths", "segment_ids", "max_segments_per_seq",
                   "max_seqlen_q", "max_seqlen_kv", "score_mod")
HAND_WRITTEN_FIELDS = ("shapes", "dtype", "training", *ARGUMENT_FIELDS, "score_mod_tensors")
ARRAY_ARGUMENTS = ("query", "key", "value", "bias", "mask")
# Why sizes are >= 1 in spec files (and in `sdpagraph check --query`), though `attention` takes 0.
EMPTY_CALLS = ("a call with an axis of size 0 computes nothing and builds no graph (attention returns jax's "
               "empty result on XLA), so there is nothing to check or precompile")
# The factories of sdpagraph.mods a spec file may name; `compose` is spelled as a list.
MOD_FACTORIES = ("softcap", "alibi", "relative_position_bias", "causal", "sliding_window", "chunked",
                 "prefix_lm")


def parse_entry(index: int, item: Any) -> SpecEntry:
    """One entry, recorded or hand-written."""
    if not isinstance(item, dict) or ("spec" in item) == ("shapes" in item):
        raise SpecFileError(f"entry {index}: an entry is an object with either 'spec' (recorded) or 'shapes' "
                            f"(hand-written), got {clip(repr(item))}", entry=index)
    try:
        return _parse_recorded(item) if "spec" in item else _parse_hand_written(item)
    except _FieldError as error:
        raise SpecFileError(f"entry {index}: field {error.field!r}: {' '.join(error.message.split())}",
                            entry=index, field=error.field) from error.__cause__


class _FieldError(Exception):
    def __init__(self, field: str, message: str):
        super().__init__(field, message)
        self.field = field
        self.message = message


@contextmanager
def _field(name: str) -> Iterator[None]:
    """Blame errors raised inside on the entry field `name` (user code raises anything)."""
    try:
        yield
    except _FieldError:
        raise
    except Exception as error:  # noqa: BLE001 - imports and user factories may raise anything
        text = str(error) if isinstance(error, (ValueError, TypeError)) else f"{type(error).__name__}: {error}"
        raise _FieldError(name, text) from error


def _check_keys(item: Mapping[str, Any], allowed: Sequence[str], required: Sequence[str]) -> None:
    for name in item:
        if name not in allowed:
            raise _FieldError(name, f"unknown field; an entry of this kind has {', '.join(allowed)}")
    for name in required:
        if name not in item:
            raise _FieldError(name, "missing")


def _parse_recorded(item: Mapping[str, Any]) -> SpecEntry:
    _check_keys(item, RECORDED_FIELDS, required=("spec", "directions"))
    with _field("spec"):
        if not isinstance(item["spec"], dict):
            raise TypeError(f"must be an AttentionSpec object, got {type(item['spec']).__name__}")
        spec = AttentionSpec.from_dict(item["spec"])
        if spec.empty_axes:
            raise ValueError(f"axis {', '.join(spec.empty_axes)} has size 0: {EMPTY_CALLS}")
        _check_runtime_makes(spec)
    with _field("score_mod"):
        raw = item.get("score_mod")
        score_mod = None if raw is None else recorded_score_mod(raw, spec)
    with _field("directions"):
        directions = tuple(item["directions"]) if isinstance(item["directions"], list) else None
        allowed = (directions_for(True, spec), directions_for(False, spec))
        if directions not in allowed:
            raise ValueError(f"must be {list(allowed[0])} or {list(allowed[1])}, got {item['directions']!r}")
    return SpecEntry(spec, score_mod, directions)


def _check_runtime_makes(spec: AttentionSpec) -> None:
    """Reject a spec the runtime never produces (an edited file would build useless graphs)."""
    if spec.paged is not None and (spec.paged[0] < 1 or spec.paged[1] < 1 or spec.kv_len % spec.paged[1]):
        raise ValueError(f"paged={list(spec.paged)} needs [num_pages >= 1, page_size >= 1] with the key length "
                         f"S={spec.kv_len} a multiple of page_size (S = max_pages * page_size)")
    # What the runtime sets on a prepared call's spec: paged K/V (`paged.prepare_paged_call`), cuDNN's
    # own sinks (`backends.cudnn`), the deterministic backward (`attention(..., deterministic=)`), dropout,
    # the FP8 dtype (`sdpagraph.fp8`)
    if not (isinstance(spec.dropout, (int, float)) and 0.0 <= spec.dropout < 1.0):
        raise ValueError(f"dropout must be a rate in [0, 1), got {spec.dropout!r}")
    made = dataclasses.replace(_trace_call(_arguments_of(spec)).spec, paged=spec.paged, sinks=spec.sinks,
                               deterministic=spec.deterministic, dropout=spec.dropout)
    if spec.is_fp8:
        _check_fp8_spec(spec)
        made = dataclasses.replace(made, dtype=spec.dtype)
    if made.canonical() != spec.canonical():
        given, expected = spec.to_dict(), made.to_dict()
        different = [name for name in given if json.dumps(given[name]) != json.dumps(expected.get(name))]
        raise ValueError("not what the runtime makes of these arguments: "
                         + ", ".join(f"{name} is {given[name]!r}, the runtime has {expected[name]!r}"
                                     for name in different))


# What `sdpagraph.fp8` sets on an FP8 spec besides its shapes, dtype and scale: the rest keeps its default.
_FP8_ARGUMENTS = {"is_causal", "has_q_lengths", "has_kv_lengths"}
_SHAPE_FIELDS = {"batch", "q_len", "kv_len", "num_heads", "num_kv_heads", "head_dim", "head_dim_v", "dtype", "scale"}


def _check_fp8_spec(spec: AttentionSpec) -> None:
    """ValueError for an FP8 spec `sdpagraph.fp8` never makes (it takes scale, causal and lengths only)."""
    defaults = AttentionSpec(1, 1, 1, 1, 1, 1, 1, spec.dtype, 1.0)
    others = [field.name for field in dataclasses.fields(AttentionSpec)
              if field.name not in _SHAPE_FIELDS | _FP8_ARGUMENTS
              and getattr(spec, field.name) != getattr(defaults, field.name)]
    if others:
        raise ValueError(f"an FP8 spec ({spec.dtype}) takes causal and sequence lengths only (sdpagraph.fp8 makes no "
                         f"other); this one sets {', '.join(others)}")


def _arguments_of(spec: AttentionSpec) -> dict[str, Any]:
    """`prepare_call` arguments (ShapeDtypeStructs for arrays) that describe `spec` (an FP8 spec's as the
    bfloat16 call `sdpagraph.fp8` validates it as)."""
    dtype = jnp.dtype("bfloat16" if spec.is_fp8 else spec.dtype)
    batch, q_len, kv_len = spec.batch, spec.q_len, spec.kv_len
    arguments: dict[str, Any] = {
        "query": _struct([batch, q_len, spec.num_heads, spec.head_dim], dtype),
        "key": _struct([batch, kv_len, spec.num_kv_heads, spec.head_dim], dtype),
        "value": _struct([batch, kv_len, spec.num_kv_heads, spec.head_dim_v], dtype),
        "scale": spec.scale,
        "is_causal": spec.is_causal,
        "causal_alignment": spec.causal_alignment,
        "local_window_size": spec.window,
        "chunk_size": spec.chunk_size,
    }
    if spec.bias_shape is not None:
        arguments["bias"] = _struct(list(spec.bias_shape), dtype)
    if spec.mask_shape is not None:
        arguments["mask"] = _struct(list(spec.mask_shape), jnp.bool_)
    if spec.has_q_lengths:
        arguments["query_seq_lengths"] = _int_struct([batch])
    if spec.has_kv_lengths:
        arguments["key_value_seq_lengths"] = _int_struct([batch])
    if spec.segments is not None:
        q_ids, kv_ids = _int_struct([batch, q_len]), _int_struct([batch, kv_len])
        arguments["segment_ids"] = q_ids if spec.segments == "self" else (q_ids, kv_ids)
        arguments["max_segments_per_seq"] = spec.max_segments
        for name in ("max_seqlen_q", "max_seqlen_kv"):
            if getattr(spec, name) is not None:
                arguments[name] = getattr(spec, name)
    return arguments


def _parse_hand_written(item: Mapping[str, Any]) -> SpecEntry:
    _check_keys(item, HAND_WRITTEN_FIELDS, required=("shapes", "dtype"))
    with _field("dtype"):
        dtype = _dtype(item["dtype"])
        if dtype.name not in DTYPES:
            raise ValueError(f"must be one of {', '.join(DTYPES)}, got {item['dtype']!r}")
    with _field("shapes"):
        arguments = _array_arguments(item["shapes"], dtype)
        call = _trace_call(arguments)
    with _field("training"):
        training = item.get("training", True)
        if not isinstance(training, bool):
            raise TypeError(f"must be true or false, got {training!r}")
    with _field("score_mod_tensors"):
        if "score_mod_tensors" in item and "score_mod" not in item:
            raise ValueError("needs a score_mod")
        mod_tensors = _mod_tensors(item.get("score_mod_tensors", {}))
    for name in (name for name in ARGUMENT_FIELDS if name in item):
        with _field(name):
            arguments.update(_field_arguments(name, item[name], call.spec.batch))
            if name == "score_mod":
                arguments["score_mod_tensors"] = mod_tensors
            call = _trace_call(arguments)
    return SpecEntry(call.spec, call.score_mod, directions_for(training, call.spec))


def _dtype(name: Any) -> Any:
    if not isinstance(name, str):
        raise TypeError(f"must be a dtype name such as \"bfloat16\", got {name!r}")
    return jnp.dtype(name)


def _shape(value: Any) -> tuple[int, ...]:
    if not isinstance(value, list) or not all(isinstance(d, int) and not isinstance(d, bool) for d in value):
        raise TypeError(f"a shape is a list of sizes (ints >= 1), got {value!r}")
    if not all(d >= 1 for d in value):
        raise ValueError(f"sizes must be >= 1, got {value!r}: {EMPTY_CALLS}")
    return tuple(value)


def _struct(shape: Any, dtype: Any) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(_shape(shape), dtype)


def _int_struct(shape: Any) -> jax.ShapeDtypeStruct:
    return _struct(shape, jnp.int32)


def _array_arguments(shapes: Any, dtype: Any) -> dict[str, Any]:
    if not isinstance(shapes, dict):
        raise TypeError(f'must be an object {{"query": [...], "key": [...], "value": [...]}}, got {shapes!r}')
    for name in shapes:
        if name not in ARRAY_ARGUMENTS:
            raise ValueError(f"unknown array {name!r}; shapes has {', '.join(ARRAY_ARGUMENTS)}")
    for name in ARRAY_ARGUMENTS[:3]:
        if name not in shapes:
            raise ValueError(f"{name!r} is missing")
    return {name: _struct(shape, jnp.bool_ if name == "mask" else dtype) for name, shape in shapes.items()}


def _field_arguments(name: str, value: Any, batch: int) -> dict[str, Any]:
    """The `prepare_call` arguments of one hand-written field (validated by the runtime's code)."""
    if name in ("query_seq_lengths", "key_value_seq_lengths"):
        if not isinstance(value, bool):
            raise TypeError(f"must be true (the call passes (B,) lengths) or false, got {value!r}")
        return {name: _int_struct([batch]) if value else None}
    if name == "segment_ids":
        return {name: _segment_ids(value)}
    if name == "score_mod":
        return {name: resolve_score_mod(value)}
    return {name: value}


def _segment_ids(value: Any) -> Any:
    if isinstance(value, dict) and set(value) == {"shape"}:
        return _int_struct(value["shape"])
    if isinstance(value, dict) and set(value) == {"q_shape", "kv_shape"}:
        return _int_struct(value["q_shape"]), _int_struct(value["kv_shape"])
    raise TypeError(f'must be {{"shape": [B, T]}} or {{"q_shape": [B, T], "kv_shape": [B, S]}}, got {value!r}')


def _mod_tensors(value: Any) -> dict[str, Any]:
    """Scalars stay numbers (their values are bound at run time); arrays become shapes."""
    if not isinstance(value, dict):
        raise TypeError(f"must be an object of names to numbers or {{\"shape\", \"dtype\"}}, got {value!r}")
    tensors = {}
    for name, tensor in value.items():
        if isinstance(tensor, dict) and set(tensor) == {"shape", "dtype"}:
            tensors[name] = _struct(tensor["shape"], _dtype(tensor["dtype"]))
        elif isinstance(tensor, (int, float)) and not isinstance(tensor, bool):
            tensors[name] = tensor
        else:
            raise TypeError(f"{name!r} must be a number or {{\"shape\": [...], \"dtype\": ...}}, got {tensor!r}")
    return tensors


def resolve_score_mod(value: Any) -> Any:
    """A hand-written SCORE_MOD (`deploy.specfile`'s docstring) -> a score_mod callable."""
    if isinstance(value, list) and value:
        return mods.compose(*(resolve_score_mod(part) for part in value))
    if isinstance(value, str):
        return _checked_callable(_import(value), value)
    if isinstance(value, dict) and set(value) - {"args", "kwargs"} in ({"mod"}, {"import"}):
        if "mod" in value:
            if value["mod"] not in MOD_FACTORIES:
                raise ValueError(f"unknown sdpagraph.mods factory {value['mod']!r}; one of {', '.join(MOD_FACTORIES)}")
            factory = getattr(mods, value["mod"])
        else:
            factory = _import(value["import"])
        args, kwargs = value.get("args", []), value.get("kwargs", {})
        if not isinstance(args, list) or not isinstance(kwargs, dict):
            raise TypeError(f"args must be a list and kwargs an object, got {args!r} and {kwargs!r}")
        return _checked_callable(factory(*args, **kwargs), value)
    raise TypeError('must be "package.module:name", {"import": ..., "args": [...], "kwargs": {...}}, '
                    f'{{"mod": NAME, "args": [...]}} or a non-empty list of those; got {value!r}')


def _import(path: Any) -> Any:
    if not isinstance(path, str) or path.count(":") != 1:
        raise ValueError(f"an import path is \"package.module:name\", got {path!r}")
    module_name, attribute = path.split(":")
    target = importlib.import_module(module_name)
    for part in attribute.split("."):
        target = getattr(target, part)
    return target


def _checked_callable(mod: Any, source: Any) -> Any:
    if not callable(mod):
        raise TypeError(f"{source!r} gives a {type(mod).__name__}, not a score_mod callable")
    return mod


def _trace_call(arguments: Mapping[str, Any]) -> Any:
    """`prepare_call(**arguments)` traced as under `jax.jit`: ShapeDtypeStruct leaves become
    abstract arrays (score_mod_tensors arrays too), every other argument stays static."""
    leaves, tree = jax.tree_util.tree_flatten(dict(arguments))
    is_array = [isinstance(leaf, jax.ShapeDtypeStruct) for leaf in leaves]
    prepared = []

    def trace(arrays: list[Any]) -> None:
        supply = iter(arrays)
        filled = [next(supply) if array else leaf for leaf, array in zip(leaves, is_array)]
        prepared.append(prepare_call(**jax.tree_util.tree_unflatten(tree, filled)))

    jax.eval_shape(trace, [leaf for leaf, array in zip(leaves, is_array) if array])
    return prepared[0]
