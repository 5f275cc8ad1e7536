"""Ready-made, composable score_mods.

Each function returns a `ScoreMod`: a callable `(graph, score, tensors) -> tensor`
that also carries the values it needs (`tensors`), so
`attention(q, k, v, score_mod=mods.softcap(30.0))` needs no `score_mod_tensors`.
Scalar values (a softcap, a prefix length) are bound at execution time: changing
them reuses the compiled cuDNN graph. Array values (ALiBi slopes, a relative-bias
table) become graph operands; they are constants for differentiation.

Values may be traced (`mods.softcap(cap)` inside `jax.jit` with `cap` an argument):
a traced scalar becomes a `(1, 1, 1, 1)` device operand, so its value never enters a
graph key. Traced values are constants for differentiation too, and their values
cannot be checked (`cap > 0`) when the mod is made. Sizes that shape the mask
(`sliding_window`, `chunked`, `relative_position_bias`'s `max_distance`) must be
Python ints.

    >>> mod = mods.compose(mods.softcap(30.0), mods.alibi(slopes), mods.causal())

Masking mods replace disallowed scores with `MASKED_SCORE`, a large finite
negative number: such a key gets zero weight.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from sdpagraph.scoremod.ir import FLOAT, INT, BOOL
from sdpagraph.scoremod.masks import position_conditions, select_each
from sdpagraph.spec import UNBOUNDED

MASKED_SCORE = -1e30
QUERY_AXIS, KEY_AXIS = 2, 3


@dataclass(frozen=True, eq=False)
class ScoreMod:
    """A score_mod callback bundled with its own tensors (and optionally its bprop)."""

    fn: Callable
    tensors: Mapping[str, Any] = field(default_factory=dict)
    bprop: Callable | None = None
    name: str = "score_mod"

    def __call__(self, graph: Any, score: Any, tensors: Mapping[str, Any]) -> Any:
        return self.fn(graph, score, tensors)

    def __repr__(self) -> str:
        return f"<ScoreMod {self.name}>"


def _is_traced(value: Any) -> bool:
    """Whether `value` is (or holds) a jax tracer: its values are unknown while jit traces."""
    return any(isinstance(leaf, jax.core.Tracer) for leaf in jax.tree_util.tree_leaves(value))


def _static_size(value: Any, what: str) -> int:
    """A size that shapes the mask: a Python int, never a traced value."""
    if _is_traced(value):
        raise TypeError(f"{what} must be a Python int, got a traced value: it shapes the mask, which is "
                        "part of the graph; pass it as a static argument of jax.jit (static_argnums)")
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{what} must be a Python int, got {type(value).__name__}") from None


def _finite_floats(value: Any, what: str, fix: str) -> np.ndarray:
    """A concrete parameter as float32 NumPy values, each a finite real number: an infinite or
    NaN parameter turns every score it touches into NaN (`inf * 0`, `inf / inf`) with no error."""
    given = np.asarray(value)
    if given.dtype.kind not in "iuf":
        if given.ndim == 0:
            raise TypeError(f"{what} must be a real number (int or float), got {type(value).__name__}")
        kind = {"U": "str", "S": "bytes", "b": "bool", "c": "complex"}.get(given.dtype.kind, str(given.dtype))
        raise TypeError(f"{what} must be real numbers (int or float), got an array of {kind}")
    with np.errstate(over="ignore"):
        values = given.astype(np.float32)
    bad = np.flatnonzero(~np.isfinite(values))
    if bad.size:
        index = tuple(int(i) for i in np.unravel_index(bad[0], given.shape))
        where = "" if given.ndim == 0 else f" at index {index if len(index) > 1 else index[0]}"
        beyond = " (beyond float32)" if np.isfinite(given.flat[bad[0]]) else ""
        raise ValueError(f"{what} must be finite, got {given.flat[bad[0]]}{where}{beyond}: it would make the "
                         f"scores NaN; {fix}")
    return values


def _typed(tensor: Any, dtype: str) -> Any:
    """Explicit types on every intermediate: cuDNN declines backward graphs without them."""
    return tensor.set_data_type({FLOAT: "FLOAT", INT: "INT32", BOOL: "BOOLEAN"}[dtype])


def positions(graph: Any, score: Any) -> tuple[Any, Any]:
    """(query position, key position) as int32 tensors."""
    q = _typed(graph.gen_index(input=score, axis=QUERY_AXIS), INT)
    k = _typed(graph.gen_index(input=score, axis=KEY_AXIS), INT)
    return q, k


def mask_where(graph: Any, score: Any, keep: Any) -> Any:
    """score where `keep`, else MASKED_SCORE."""
    return _typed(graph.binary_select(input0=score, input1=MASKED_SCORE, mask=keep), FLOAT)


def softcap(cap: float) -> ScoreMod:
    """`cap * tanh(score / cap)` (Gemma-2 logit soft-capping).

    `cap` is a number (bound at execution) or a traced jax scalar (a device operand; not
    checked for > 0)."""
    traced = _is_traced(cap)
    if traced:
        if jnp.ndim(cap) != 0:
            raise ValueError(f"softcap cap must be a scalar, got shape {jnp.shape(cap)}")
    else:
        value = _finite_floats(cap, "softcap cap", "pass a finite cap such as 30.0, or leave mods.softcap out "
                                                   "for no capping")
        if value.ndim != 0:
            raise ValueError(f"softcap cap must be a scalar, got shape {value.shape}")
        if not value > 0:
            raise ValueError(f"softcap cap must be > 0, got {cap}")

    def fn(graph, score, tensors):
        pre = _typed(graph.div(a=score, b=tensors["cap"]), FLOAT)
        return _typed(graph.mul(a=_typed(graph.tanh(input=pre), FLOAT), b=tensors["cap"]), FLOAT)

    if traced:
        return ScoreMod(fn, {"cap": jnp.asarray(cap, jnp.float32)}, name="softcap(traced)")
    return ScoreMod(fn, {"cap": float(cap)}, name=f"softcap({cap})")


def alibi(slopes: Any) -> ScoreMod:
    """ALiBi: `score + slope[h] * (key_pos - query_pos)`; slopes of shape (N,) (may be traced)."""
    if _is_traced(slopes):
        slopes = jnp.asarray(slopes, dtype=np.float32)
    else:
        slopes = _finite_floats(slopes, "alibi slopes", "the usual slopes are 2 ** (-8 * (h + 1) / N) for head h")
    if slopes.ndim != 1:
        raise ValueError(f"alibi slopes must have shape (N,), got {slopes.shape}")

    def fn(graph, score, tensors):
        q, k = positions(graph, score)
        distance = _typed(graph.sub(a=k, b=q), INT)
        bias = _typed(graph.mul(a=distance, b=tensors["slopes"]), FLOAT)
        return _typed(graph.add(a=score, b=bias), FLOAT)

    return ScoreMod(fn, {"slopes": slopes.reshape(1, -1, 1, 1)}, name="alibi")


def relative_position_bias(table: Any, max_distance: int) -> ScoreMod:
    """`score + table[h, clip(key_pos - query_pos, -D, D) + D]`, table of shape (N, 2D+1).

    Pointwise integer arithmetic only (no gather, no select between arrays: cuDNN 9.19 has no
    engine for those), so it fuses into the attention kernel: the bias is the first column
    plus one step per distance d in (-D, D], `table[:, d] - table[:, d-1]`, taken where
    `key_pos - query_pos >= d`, that is `min(max(distance - d + 1, 0), 1)` times the step.
    Distances beyond ±D keep the end columns. It costs 5 ops per column: keep D modest.
    """
    max_distance = _static_size(max_distance, "relative_position_bias max_distance")
    traced = _is_traced(table)
    if traced:
        table = jnp.asarray(table, dtype=np.float32)
    else:
        table = _finite_floats(table, "relative_position_bias table", "pass a table of finite biases")
    if max_distance < 0 or table.ndim != 2 or table.shape[1] != 2 * max_distance + 1:
        raise ValueError(f"table must have shape (N, 2*max_distance+1)=(N, {2 * max_distance + 1}), got {table.shape}")
    per_head = lambda column: column.reshape(1, -1, 1, 1)  # noqa: E731
    tensors = {"first": per_head(table[:, 0])}
    with np.errstate(over="ignore"):
        tensors.update({f"step{d}": per_head(table[:, d + max_distance] - table[:, d + max_distance - 1])
                        for d in range(-max_distance + 1, max_distance + 1)})
    if not traced and not all(np.isfinite(step).all() for step in tensors.values()):
        raise ValueError("relative_position_bias table: neighbouring columns differ by more than float32 holds "
                         "(the bias is built from those differences): keep the biases within about ±1e38")

    def fn(graph, score, tensors):
        q, k = positions(graph, score)
        distance = _typed(graph.sub(a=k, b=q), INT)
        score = _typed(graph.add(a=score, b=tensors["first"]), FLOAT)
        for d in range(-max_distance + 1, max_distance + 1):
            above = _typed(graph.max(input0=_typed(graph.sub(a=distance, b=d - 1), INT), input1=0), INT)
            reached = _typed(graph.min(input0=above, input1=1), INT)
            score = _typed(graph.add(a=score, b=_typed(graph.mul(a=reached, b=tensors[f"step{d}"]), FLOAT)), FLOAT)
        return score

    return ScoreMod(fn, tensors, name=f"relative_position_bias(D={max_distance})")


def causal() -> ScoreMod:
    """Keys at or before the query position (top-left aligned)."""

    def fn(graph, score, tensors):
        q, k = positions(graph, score)  # query >= key: the order in which cuDNN skips masked tiles
        return mask_where(graph, score, _typed(graph.cmp_ge(input=q, comparison=k), BOOL))

    return ScoreMod(fn, name="causal")


def sliding_window(left: int, right: int = 0) -> ScoreMod:
    """Keys with `q - left <= k <= q + right` (-1 leaves a side open)."""
    left = _static_size(left, "sliding_window left")
    right = _static_size(right, "sliding_window right")
    for side, value in (("left", left), ("right", right)):
        if value < UNBOUNDED:
            raise ValueError(f"sliding_window {side} must be >= 0 (or -1 for unbounded), got {value}")

    def fn(graph, score, tensors):
        keep = position_conditions(graph, score, window=(left, right))
        return select_each(graph, score, MASKED_SCORE, keep)

    return ScoreMod(fn, name=f"sliding_window({left},{right})")


def chunked(size: int) -> ScoreMod:
    """Llama-4 chunked attention: keys in the same block of `size` positions as the query."""
    size = _static_size(size, "chunked size")
    if size <= 0:
        raise ValueError(f"chunked size must be > 0, got {size}")

    def fn(graph, score, tensors):
        return select_each(graph, score, MASKED_SCORE, position_conditions(graph, score, chunk_size=size))

    return ScoreMod(fn, name=f"chunked({size})")


def prefix_lm(prefix_len: Any) -> ScoreMod:
    """Prefix-LM: keys before `prefix_len` are visible to every query; causal after.

    `prefix_len` is an int or a (B,) array of per-row lengths. Written as one integer
    comparison, `key_pos <= max(query_pos, prefix_len - 1)`, with the length as an int32
    operand (cuDNN 9.19 runs no engine for comparisons against pass-by-value scalars).
    A traced length (or array of them) works too; its values are not checked.
    """
    traced = _is_traced(prefix_len)
    if not traced and np.asarray(prefix_len).dtype.kind not in "iu":
        raise TypeError(f"prefix_lm prefix_len must be an int or a (B,) array of ints, got {prefix_len!r}")
    lengths = (jnp if traced else np).asarray(prefix_len, dtype=np.int32)
    if lengths.ndim > 1 or (not traced and np.any(lengths < 0)):
        raise ValueError(f"prefix_lm prefix_len must be an int >= 0 or a (B,) array of them, got {prefix_len!r}")

    def fn(graph, score, tensors):
        q, k = positions(graph, score)
        last_visible = _typed(graph.max(input0=q, input1=tensors["last_prefix"]), INT)
        return mask_where(graph, score, _typed(graph.cmp_ge(input=last_visible, comparison=k), BOOL))

    name = "prefix_lm(traced)" if traced else f"prefix_lm({prefix_len})"
    return ScoreMod(fn, {"last_prefix": (lengths - 1).reshape(-1, 1, 1, 1)}, name=name)


def compose(*mods: Callable) -> ScoreMod:
    """Apply mods left to right. Each `ScoreMod` keeps its own tensors (namespaced, so two
    softcaps do not clash); a plain callable sees the call's `score_mod_tensors`."""
    parts = [m if isinstance(m, ScoreMod) else ScoreMod(m, name=getattr(m, "__name__", "score_mod")) for m in mods]
    prefixes = [f"{i}." for i in range(len(parts))]
    tensors = {p + name: value for p, m in zip(prefixes, parts) for name, value in m.tensors.items()}

    def fn(graph, score, all_tensors):
        user = {n: t for n, t in all_tensors.items() if not n.startswith(tuple(prefixes))}
        for prefix, m in zip(prefixes, parts):
            own = {n[len(prefix):]: t for n, t in all_tensors.items() if n.startswith(prefix)}
            score = m(graph, score, own if m.tensors else user)
        return score

    return ScoreMod(fn, tensors, name="compose(" + ", ".join(m.name for m in parts) + ")")
