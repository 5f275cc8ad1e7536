"""FlexAttention-style mods written in jax.numpy, converted into a `ScoreModIR`.

    score_mod(score, b, h, q_idx, kv_idx) -> score        mask_mod(b, h, q_idx, kv_idx) -> bool

(True = attend). The function is traced once with `jax.make_jaxpr` on scalar abstract values
(score float32; b, h, q_idx, kv_idx int32) and its jaxpr is interpreted equation by equation into
the ops of the score_mod IR (`scoremod.ir`), so the result goes through the same machinery as a
pygraph callback: a content hash, the derived backward (`scoremod.ir_grad`), the XLA evaluator
(`scoremod.ir_eval`) and the cuDNN lowering (`graphs.mod_lowering`). `b, h, q_idx, kv_idx` become
`gen_index` on axes 0..3.

How jnp maps onto the IR:

- Equations whose inputs are all concrete (literals, closed-over arrays, values computed from
  them) are folded with JAX itself. Calls (`jit`, `custom_jvp_call`, `closed_call`, `checkpoint`)
  are inlined; a `custom_jvp` function contributes its primal, whose derivative is what the IR
  derives (`jax.nn` functions' custom rules are the primal's derivative, only stabler).
  `jax.nn.softplus` becomes the IR's `softplus` op.
- Booleans are never IR values: cuDNN 9.19 finds no engine for logical ops (`scoremod.masks`). A
  boolean is kept as a formula of comparisons (and / or / xor / not) and expanded into nested
  `binary_select`s where it is consumed (`where`, a cast to a number, a mask_mod's result), with
  `and` nesting its first condition innermost, as `masks.select_each` does.
- Integer comparisons between positions are canonicalized into the forms `scoremod.masks` uses, in
  which cuDNN skips masked tiles: anything equivalent to `q - kv >= c` becomes `q (+ s) >= kv`,
  anything equivalent to `q - kv <= c` becomes `kv + (c + 1) > q`, and `abs(q - kv) <= w` becomes
  both. So `lambda b, h, i, j: i >= j` records the IR of `mods.causal()` (same digest when given
  its masked value), `i - j <= w` that of `mods.sliding_window(w, -1)`, `abs(i - j) <= w` that of
  `mods.sliding_window(w, w)`. Other integer comparisons keep the position as the first operand.
- Casts int -> float are dropped where the consuming op is float anyway (`score + slopes[h] *
  (kv - q)` records the IR of `mods.alibi`); elsewhere they are `identity` nodes retyped. A cast
  float -> int truncates (as XLA's convert does); float -> narrower float is ignored (the IR
  computes in float32). Integer `div` / `//` go through float division of an exact multiple, and
  are exact for |values| < 2**24.
- Closed-over arrays indexed by values computed only from b, h, q_idx, kv_idx (`slopes[h]`,
  `doc[b, q_idx]`, `perm[h] // 2`, ...) are evaluated once with JAX over the index grid of the
  axes they read and become aux arrays of shape (B|1, N|1, T|1, S|1): IR `array` leaves named
  `captured0, captured1, ...` whose values the converter returns (pass them as
  score_mod_tensors). This needs the call's (B, N, T, S) (`shape=`). A lookup that reads both
  q_idx and kv_idx (`table[h, q_idx - kv_idx]`) would be a dense (T, S) table and is refused.
  The same goes for any other equation the IR has no op for, when it does not read the score
  (`q_idx >> 4`): it is evaluated over its grid and becomes an aux array.
- Float literals that float arithmetic reads on the way to the score (`cap` in `cap * jnp.tanh(s /
  cap)`, an ALiBi slope scale, a bias constant) become pass-by-value scalars named
  `captured_literal0, ...`, whose values the converter returns next to the captured arrays: a new
  value reuses the graph. Integers, booleans and whatever decides a mask stay literals; the rule
  is `scoremod.jnp.literals`'.

Anything else raises `JnpModUnsupported` (`scoremod.jnp.interpreter`) naming the
primitive: an index computed from the score, control flow or random numbers on the score,
`custom_vjp`, `stop_gradient` of a value that depends on the score, vector-valued intermediates,
ops the IR lacks (`atan2`, `round`, bitwise ops on the score's path, ...). The runtime then runs
the mod on XLA by calling the Python function itself (`scoremod.jnp.apply`).

The interpreter is `scoremod.jnp.interpreter` (the IR nodes of operands and comparisons in
`scoremod.jnp.operands`); the values it interprets into are in `scoremod.jnp.values`, the rule for
each primitive in `scoremod.jnp.rules`.

The IR depends only on what the function computes: no object ids or tracer names enter it, so
the same function gives the same IR and digest in every process; captured values and lifted literals
enter only the returned tensors, never the IR (captured arrays' shapes and dtypes do).
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import jax
import jax.numpy as jnp

from sdpagraph.scoremod.ir import FLOAT, ScoreModIR, reachable
from sdpagraph.scoremod.jnp.dag import replay
from sdpagraph.scoremod.jnp.interpreter import JaxprInterpreter
from sdpagraph.scoremod.jnp.literals import lifted_literals, literal_name
from sdpagraph.scoremod.jnp.values import Sym
from sdpagraph.scoremod.masks import MASKED
from sdpagraph.scoremod.trace import TensorInfo, trace_score_mod

SCORE_MOD_ARGS = ("score", "b", "h", "q_idx", "kv_idx")
MASK_MOD_ARGS = ("b", "h", "q_idx", "kv_idx")
CAPTURED_PREFIX = "captured"


@dataclass(frozen=True)
class JnpMod:
    """A converted jnp mod.

    `ir`: the ScoreModIR (forward and derived bprop). `arrays`: name -> 4-D array
    (B|1, N|1, T|1, S|1) of each captured-array lookup (they may be tracers when the mod closes
    over traced values). `scalars`: name -> value of each float literal bound as a scalar
    (`scoremod.jnp.literals`). `tensors` holds both: pass them as score_mod_tensors. `infos`: name ->
    TensorInfo of each (what `trace_score_mod` takes). `callback`: an equivalent pygraph-style
    `score_mod(graph, score, tensors)` that records exactly this IR, for code paths that take
    callbacks (`mods.compose`, `attention(score_mod=...)`). `kind`: "score_mod" or "mask_mod".
    """

    ir: ScoreModIR
    arrays: Mapping[str, Any]
    scalars: Mapping[str, float]
    infos: Mapping[str, TensorInfo]
    callback: Callable[[Any, Any, Mapping[str, Any]], Any]
    kind: str

    @property
    def tensors(self) -> dict[str, Any]:
        return {**self.arrays, **self.scalars}


# ----------------------------------------------------------------------------- public API

def convert_jnp_score_mod(fn: Callable, shape: Sequence[int] | None = None, *,
                          name_prefix: str = CAPTURED_PREFIX) -> JnpMod:
    """Convert `fn(score, b, h, q_idx, kv_idx) -> score` (jax.numpy) into a JnpMod.

    `shape` is the call's (B, N, T, S) (N: query heads); it is needed only when `fn` indexes
    closed-over arrays. Raises TypeError when `fn` does not take five arguments or does not
    return one float scalar, JnpModUnsupported when it uses something the IR cannot express,
    ValueError when it indexes a captured array and `shape` is missing.
    """
    return _convert(fn, "score_mod", shape, name_prefix, None)


def convert_jnp_mask_mod(fn: Callable, shape: Sequence[int] | None = None, *, masked_value: float = MASKED,
                         name_prefix: str = CAPTURED_PREFIX) -> JnpMod:
    """Convert `fn(b, h, q_idx, kv_idx) -> bool` (True = attend) into a JnpMod whose IR is
    `where(fn(...), score, masked_value)`, written as nested selects over comparisons.

    `masked_value` defaults to -inf, as `scoremod.masks` uses (rows with nothing to attend give 0);
    pass `mods.MASKED_SCORE` to get exactly the IR (and digest) of `mods.causal()` for `i >= j`.
    Errors as `convert_jnp_score_mod` (TypeError names `mask_mod` when it does not return one
    boolean).
    """
    return _convert(fn, "mask_mod", shape, name_prefix, float(masked_value))


def trace_jnp_score_mod(fn: Callable, shape: Sequence[int] | None = None, **kwargs: Any
                        ) -> tuple[ScoreModIR, dict[str, Any]]:
    """(IR, score_mod_tensors: captured arrays and lifted literals) of a jnp score_mod; see
    `convert_jnp_score_mod`."""
    mod = convert_jnp_score_mod(fn, shape, **kwargs)
    return mod.ir, mod.tensors


def trace_jnp_mask_mod(fn: Callable, shape: Sequence[int] | None = None, **kwargs: Any
                       ) -> tuple[ScoreModIR, dict[str, Any]]:
    """(IR, score_mod_tensors: captured arrays and lifted literals) of a jnp mask_mod; see
    `convert_jnp_mask_mod`."""
    mod = convert_jnp_mask_mod(fn, shape, **kwargs)
    return mod.ir, mod.tensors


# ----------------------------------------------------------------------------- conversion

def _convert(fn: Callable, what: str, shape: Sequence[int] | None, prefix: str, masked: float | None) -> JnpMod:
    if not callable(fn):
        raise TypeError(f"{what} must be callable, got {type(fn).__name__}")
    names = SCORE_MOD_ARGS if what == "score_mod" else MASK_MOD_ARGS
    try:
        inspect.signature(fn).bind(*names)
    except TypeError as error:
        raise TypeError(f"{what} must take ({', '.join(names)}): {error}") from None
    except ValueError:  # no signature (a builtin): let tracing find out
        pass
    if shape is not None:
        shape = tuple(int(d) for d in shape)
        if len(shape) != 4 or any(d < 1 for d in shape):
            raise ValueError(f"shape must be the call's (B, N, T, S), got {shape}")

    index = jax.ShapeDtypeStruct((), jnp.int32)
    args = ((jax.ShapeDtypeStruct((), jnp.float32),) if what == "score_mod" else ()) + (index,) * 4
    closed = jax.make_jaxpr(fn)(*args)
    _check_result(closed.out_avals, what)

    conv = JaxprInterpreter(what, shape, prefix)
    dag = conv.dag
    inputs = ([Sym(dag.score)] if what == "score_mod" else []) + [Sym(dag.gen(axis)) for axis in range(4)]
    (out,) = conv.run(closed.jaxpr, closed.consts, inputs)
    if what == "score_mod":
        root = out.node if isinstance(out, Sym) else conv.constant(out, FLOAT)
    else:
        root = conv.select(conv.pred(out), dag.score, dag.const(masked, FLOAT))
    nodes = tuple(dag.nodes)
    lifted = lifted_literals(nodes, root, dag.literals)
    scalars = {literal_name(prefix, n): nodes[i].attr("value") for n, i in enumerate(lifted)}
    names = {**dag.names, **dict(zip(lifted, scalars))}

    def callback(graph: Any, score: Any, tensors: Mapping[str, Any]) -> Any:
        return replay(nodes, root, graph, score, {i: tensors[name] for i, name in names.items() if name in tensors})

    callback.__name__ = f"jnp_{what}"
    used = {dag.names[i] for i in reachable(nodes, (root,)) if i in dag.names}
    infos = {name: info for name, info in conv.infos.items() if name in used}
    arrays = {name: conv.arrays[name] for name in infos}
    infos.update((name, TensorInfo("scalar", FLOAT)) for name in scalars)
    ir = trace_score_mod(callback, infos)
    return JnpMod(ir, arrays, scalars, infos, callback, what)


def _check_result(avals: Sequence[Any], what: str) -> None:
    got = ", ".join(f"{a.dtype}{list(a.shape)}" for a in avals) or "nothing"
    if what == "score_mod":
        if len(avals) != 1 or avals[0].shape != () or not jnp.issubdtype(avals[0].dtype, jnp.floating):
            hint = " (a boolean: write it as a mask_mod)" if len(avals) == 1 and avals[0].dtype == jnp.bool_ else ""
            raise TypeError(f"score_mod must return one float score (a scalar), got {got}{hint}")
    elif len(avals) != 1 or avals[0].shape != () or avals[0].dtype != jnp.bool_:
        raise TypeError(f"mask_mod must return one boolean (True = attend), got {got}")
