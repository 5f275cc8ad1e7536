"""FlexAttention-style mods written in jax.numpy, converted into a `ScoreModIR`.

    score_mod(score, b, h, q_idx, kv_idx) -> score        mask_mod(b, h, q_idx, kv_idx) -> bool

(True = attend). The function is traced once with `jax.make_jaxpr` on scalar abstract values
(score float32; b, h, q_idx, kv_idx int32) and its jaxpr is interpreted equation by equation into
the ops of the score_mod IR (`graphs.ir`), so the result goes through the same machinery as a
pygraph callback: a content hash, the derived backward (`graphs.ir_grad`), the XLA evaluator
(`graphs.ir_eval`) and the cuDNN lowering (`graphs.mod_lowering`). `b, h, q_idx, kv_idx` become
`gen_index` on axes 0..3.

How jnp maps onto the IR:

- Equations whose inputs are all concrete (literals, closed-over arrays, values computed from
  them) are folded with JAX itself. Calls (`jit`, `custom_jvp_call`, `closed_call`, `checkpoint`)
  are inlined; a `custom_jvp` function contributes its primal, whose derivative is what the IR
  derives (`jax.nn` functions' custom rules are the primal's derivative, only stabler).
  `jax.nn.softplus` becomes the IR's `softplus` op.
- Booleans are never IR values: cuDNN 9.19 finds no engine for logical ops (`graphs.masks`). A
  boolean is kept as a formula of comparisons (and / or / xor / not) and expanded into nested
  `binary_select`s where it is consumed (`where`, a cast to a number, a mask_mod's result), with
  `and` nesting its first condition innermost, as `masks.select_each` does.
- Integer comparisons between positions are canonicalized into the forms `graphs.masks` uses, in
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
  is `graphs.jnp_literals`'.

Anything else raises `JnpModUnsupported` (a `graphs.mod_lowering.Unsupported`) naming the
primitive: an index computed from the score, control flow or random numbers on the score,
`custom_vjp`, `stop_gradient` of a value that depends on the score, vector-valued intermediates,
ops the IR lacks (`atan2`, `round`, bitwise ops on the score's path, ...). The runtime then runs
the mod on XLA by calling the Python function itself (`apply_jnp_score_mod` /
`apply_jnp_mask_mod`).

The interpreter is here; the values it interprets into are in `graphs.jnp_values`, the rule for
each primitive in `graphs.jnp_rules`.

The IR depends only on what the function computes: no object ids or tracer names enter it, so
the same function gives the same IR and digest in every process; captured values and lifted literals
enter only the returned tensors, never the IR (captured arrays' shapes and dtypes do).
"""
from __future__ import annotations

import inspect
import math
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from sdpagraph.graphs.ir import BOOL, FLOAT, INT, RecordingGraph, ScoreModIR, reachable, result_type
from sdpagraph.graphs.ir_eval import evaluate
from sdpagraph.graphs.jnp_dag import MIRROR, Dag, and_, combine, formula_nodes, or_, replay
from sdpagraph.graphs.jnp_literals import lifted_literals, literal_name
from sdpagraph.graphs.jnp_rules import PrimitiveRules
from sdpagraph.graphs.jnp_values import Grid, Pred, Sym, is_symbolic, kind_of
from sdpagraph.graphs.mod_lowering import Unsupported
from sdpagraph.graphs.trace import TensorInfo, trace_score_mod

try:  # jax >= 0.4.36
    from jax.extend.core import ClosedJaxpr, DropVar, Jaxpr, Literal
except ImportError:  # pragma: no cover - older jax
    from jax.core import ClosedJaxpr, DropVar, Jaxpr, Literal  # type: ignore

SCORE_MOD_ARGS = ("score", "b", "h", "q_idx", "kv_idx")
MASK_MOD_ARGS = ("b", "h", "q_idx", "kv_idx")
MASKED = float("-inf")  # what a mask_mod puts in masked scores, as `graphs.masks` does
QUERY_AXIS, KEY_AXIS = 2, 3
CAPTURED_PREFIX = "captured"

RUNS_ON_XLA = "which cuDNN cannot express; it runs on XLA"


class JnpModUnsupported(Unsupported):
    """A jnp score_mod / mask_mod uses something the score_mod IR (and so cuDNN) cannot express.

    The message names the primitive in one sentence; the mod can still run on XLA by calling the
    Python function itself (`apply_jnp_score_mod` / `apply_jnp_mask_mod`).
    """


@dataclass(frozen=True)
class JnpMod:
    """A converted jnp mod.

    `ir`: the ScoreModIR (forward and derived bprop). `arrays`: name -> 4-D array
    (B|1, N|1, T|1, S|1) of each captured-array lookup (they may be tracers when the mod closes
    over traced values). `scalars`: name -> value of each float literal bound as a scalar
    (`graphs.jnp_literals`). `tensors` holds both: pass them as score_mod_tensors. `infos`: name ->
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

    `masked_value` defaults to -inf, as `graphs.masks` uses (rows with nothing to attend give 0);
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


def apply_jnp_score_mod(fn: Callable, score: Any, index: Sequence[Any]) -> Any:
    """The XLA way to run a jnp score_mod: `fn` applied to every element of `score`.

    `index` holds the b, h, q_idx, kv_idx arrays, broadcastable to `score`'s (B, N, T, S) shape
    (per-segment positions when sequences are packed). Works for any mod, converted or not.
    """
    score = jnp.asarray(score)
    flat = [jnp.broadcast_to(jnp.asarray(i, jnp.int32), score.shape).reshape(-1) for i in index]
    out = jax.vmap(fn)(score.reshape(-1), *flat)
    return jnp.reshape(out, score.shape)


def apply_jnp_mask_mod(fn: Callable, index: Sequence[Any], shape: Sequence[int]) -> Any:
    """The XLA way to run a jnp mask_mod: a boolean array of `shape` (True = attend)."""
    flat = [jnp.broadcast_to(jnp.asarray(i, jnp.int32), tuple(shape)).reshape(-1) for i in index]
    return jnp.reshape(jax.vmap(fn)(*flat), tuple(shape))


# ----------------------------------------------------------------------------- the converter

_INLINE = ("pjit", "jit", "closed_call", "core_call", "custom_jvp_call", "checkpoint", "remat", "remat2")
_CONTROL_FLOW = ("cond", "while", "scan", "switch", "fori_loop")
_LOOKUPS = ("gather", "dynamic_slice", "dynamic_index_in_dim", "take", "take_along_axis")


class _Converter(PrimitiveRules):
    """Interprets a jaxpr into a DAG of IR ops: inlining, folding, operands and materialized
    grids here; one rule per primitive in `PrimitiveRules`."""

    def __init__(self, what: str, shape: tuple[int, ...] | None, prefix: str):
        self.what = what
        self.shape = shape
        self.prefix = prefix
        self.dag = Dag()
        self.arrays: dict[str, Any] = {}
        self.infos: dict[str, TensorInfo] = {}
        self._materialized: dict[Any, tuple[list, list]] = {}

    # -- errors ----------------------------------------------------------------------------
    def unsupported(self, text: str) -> JnpModUnsupported:
        return JnpModUnsupported(f"{self.what} {text}, {RUNS_ON_XLA}")

    # -- interpretation ----------------------------------------------------------------------
    def run(self, jaxpr: Jaxpr, consts: Sequence[Any], args: Sequence[Any]) -> list[Any]:
        env: dict[Any, Any] = {}

        def read(v: Any) -> Any:
            return v.val if isinstance(v, Literal) else env[v]

        for var, val in zip(jaxpr.constvars, consts):
            env[var] = val
        for var, val in zip(jaxpr.invars, args):
            env[var] = val
        for eqn in jaxpr.eqns:
            outs = self.equation(eqn, [read(v) for v in eqn.invars])
            for var, val in zip(eqn.outvars, outs):
                if not isinstance(var, DropVar):
                    env[var] = val
        return [read(v) for v in jaxpr.outvars]

    def equation(self, eqn: Any, ins: list[Any]) -> list[Any]:
        prim = eqn.primitive
        name = prim.name
        if name in ("jit", "pjit") and eqn.params.get("name") in _KNOWN_CALLS:
            result = self.known_call(eqn, ins)
            if result is not NotImplemented:
                return [result]
        sub = _inline_jaxpr(eqn) if name in _INLINE else None
        if sub is not None:
            return self.run(sub[0], sub[1], ins)
        if not any(is_symbolic(x) for x in ins):
            return _bind(eqn, ins)
        scalar = not any(isinstance(x, Grid) for x in ins) and all(
            _size(v.aval.shape) == 1 for v in list(eqn.invars) + list(eqn.outvars))
        if scalar:
            rule = self.rule_for(name)
            if rule is not None:
                result = rule(eqn, ins)
                if result is not NotImplemented:
                    return result if isinstance(result, list) else [result]
        return self.materialize(eqn, ins)

    def known_call(self, eqn: Any, ins: list[Any]) -> Any:
        """jax.nn.softplus as the IR's softplus op; jnp's integer floor_divide / remainder in 3 / 5 ops
        (their inlined bodies take ~15 each)."""
        name = eqn.params["name"]
        symbolic = [x for x in ins if is_symbolic(x)]
        if not symbolic or not all(isinstance(x, Sym) for x in symbolic) or not _matches_reference(eqn):
            return NotImplemented  # all concrete (folded when inlined), or booleans / grids: inline the body
        if name == "softplus":
            return Sym(self.dag.op("softplus", (self.float_operand(ins[0]),)))
        a, b = (self.num(x, INT) for x in ins)
        floor = self.dag.op("identity", (self.dag.op("floor", (self.dag.op("div", (a, b)),)),), dtype=INT)
        if name == "floor_divide":  # exact for |a| < 2**24
            return Sym(floor)
        return Sym(self.dag.op("sub", (a, self.dag.op("mul", (b, floor)))))

    # -- operands ------------------------------------------------------------------------------
    def kinds(self, eqn: Any) -> list[str]:
        return [kind_of(v.aval.dtype) for v in eqn.invars]

    def num(self, x: Any, kind: str) -> int:
        """The node of a numeric scalar (its own jax kind)."""
        if isinstance(x, Sym):
            return x.node
        if isinstance(x, Pred):
            one, zero = (1.0, 0.0) if kind == FLOAT else (1, 0)
            return self.select(x.formula, self.dag.const(one, kind), self.dag.const(zero, kind))
        return self.constant(x, kind)

    def constant(self, value: Any, kind: str) -> int:
        if isinstance(value, jax.core.Tracer):  # closed over a traced value: a (1,1,1,1) operand
            dtype = jnp.float32 if kind == FLOAT else jnp.int32
            return self.new_array(jnp.reshape(value, (1, 1, 1, 1)).astype(dtype), kind, frozenset())
        scalar = np.asarray(value).reshape(()).item()
        return self.dag.const(scalar, kind)

    def pred(self, x: Any) -> tuple:
        if isinstance(x, Pred):
            return x.formula
        if isinstance(x, Sym):
            return ("cmp", "cmp_neq", x.node, self.dag.const(0, self.dag.dtype(x.node)), self.dag.dtype(x.node) == INT)
        if isinstance(x, jax.core.Tracer):
            node = self.constant(jnp.asarray(x, jnp.int32), INT)
            return ("cmp", "cmp_neq", node, self.dag.const(0, INT), True)
        return ("const", bool(np.asarray(x).reshape(()).item()))

    def float_operand(self, x: Sym) -> int:
        """For ops whose result is float whatever their input: the integer before a cast, if any."""
        return x.int_source if x.int_source is not None else x.node

    def arith(self, op: str, xs: Sequence[Any], kinds: Sequence[str], out_kind: str) -> Sym:
        """`op` over numbers; a concrete float operand of float arithmetic is a literal of its own,
        which `graphs.jnp_literals` may bind as a scalar."""
        nodes = [self.dag.literal(np.asarray(x).reshape(()).item())
                 if k == out_kind == FLOAT and not is_symbolic(x) and not isinstance(x, jax.core.Tracer)
                 else self.num(x, k) for x, k in zip(xs, kinds)]
        for i, x in enumerate(xs):
            if isinstance(x, Sym) and x.int_source is not None:
                trial = nodes[:i] + [x.int_source] + nodes[i + 1:]
                if result_type(op, tuple(self.dag.dtype(n) for n in trial)) == out_kind:
                    nodes = trial
        node = self.dag.op(op, nodes)
        if self.dag.dtype(node) != out_kind:
            node = self.dag.op(op, nodes, dtype=out_kind)
        return Sym(node)

    def int_valued(self, x: Any, kind: str) -> int | None:
        """The INT node of a value that is an integer (an int, a cast int, an integral float literal)."""
        if isinstance(x, Sym):
            if kind == INT:
                return x.node
            return x.int_source
        if kind == INT:
            return self.constant(x, INT)
        if isinstance(x, jax.core.Tracer) or kind != FLOAT:
            return None
        value = float(np.asarray(x).reshape(()).item())
        if math.isfinite(value) and value == int(value) and abs(value) < 2 ** 31:
            return self.dag.const(int(value), INT)
        return None

    # -- selects and comparisons ----------------------------------------------------------------
    def select(self, f: tuple, x: int, y: int) -> int:
        """`x` where formula `f` holds, else `y`, as nested binary_selects."""
        tag = f[0]
        if tag == "const":
            return x if f[1] else y
        if tag == "cmp":
            return self.dag.op("binary_select", (x, y, self.compare(*f[1:])))
        if tag == "ncmp":
            return self.dag.op("binary_select", (y, x, self.compare(*f[1:])))
        if tag == "and":
            return self.select(f[2], self.select(f[1], x, y), y)
        if tag == "or":
            return self.select(f[2], x, self.select(f[1], x, y))
        return self.select(f[2], self.select(f[1], y, x), self.select(f[1], x, y))  # xor

    def compare(self, op: str, a: int, b: int, is_int: bool) -> int:
        """The comparison node of an atom, integer ones in the forms of `graphs.masks`."""
        dag = self.dag
        if not is_int:
            return dag.op(op, (a, b))
        (fa, ca), (fb, cb) = dag.linear(a), dag.linear(b)
        terms, c = combine(fa, fb, -1), ca - cb  # a - b = terms + c, compared with 0
        q, k = dag.gen(QUERY_AXIS), dag.gen(KEY_AXIS)
        if set(terms) == {q, k} and terms[q] == -terms[k] and abs(terms[q]) == 1:
            shift = lambda node, s: node if s == 0 else dag.op("add", (node, dag.const(s, INT)))  # noqa: E731
            if op in ("cmp_eq", "cmp_neq"):  # q - k + c' == 0  <=>  q + c' == k
                c_q = c if terms[q] == 1 else -c
                return dag.op(op, (shift(q, c_q), k))
            # as E >= 0 with E = ±(a - b) (- 1 for strict comparisons)
            sign = 1 if op in ("cmp_ge", "cmp_gt") else -1
            e_const = sign * c - (1 if op in ("cmp_gt", "cmp_lt") else 0)
            if sign * terms[q] == 1:  # q - k + s >= 0  <=>  q + s >= k   (causal side)
                return dag.op("cmp_ge", (shift(q, e_const), k))
            # k - q + s >= 0  <=>  k + (s + 1) > q   (left side of a window)
            return dag.op("cmp_gt", (shift(k, e_const + 1), q))
        if dag.nodes[b].op == "gen_index" and dag.nodes[a].op != "gen_index":
            a, b, op = b, a, MIRROR[op]  # the position is the comparison's input, as graphs.masks has it
        return dag.op(op, (a, b))

    def comparison(self, op: str, x: Any, y: Any, kx: str, ky: str) -> tuple:
        """The formula of `x op y` for two numbers."""
        ix, iy = self.int_valued(x, kx), self.int_valued(y, ky)
        if ix is not None and iy is not None:  # two integers (casts or not): an exact integer comparison
            for node, other, cmp in ((ix, iy, op), (iy, ix, MIRROR[op])):
                bound = self.dag.int_const(other)
                if self.dag.nodes[node].op == "abs" and bound is not None:
                    return self.abs_bound(cmp, self.dag.nodes[node].args[0], bound)
            return ("cmp", op, ix, iy, True)
        return ("cmp", op, self.num(x, kx), self.num(y, ky), False)

    def abs_bound(self, op: str, x: int, c: int) -> tuple:
        """`abs(x) op c` as two comparisons of x (a symmetric window becomes two band conditions)."""
        lo, hi = self.dag.const(-c, INT), self.dag.const(c, INT)
        if op == "cmp_le":
            return and_(("cmp", "cmp_le", x, hi, True), ("cmp", "cmp_ge", x, lo, True))
        if op == "cmp_lt":
            return and_(("cmp", "cmp_lt", x, hi, True), ("cmp", "cmp_gt", x, lo, True))
        if op == "cmp_ge":
            return or_(("cmp", "cmp_ge", x, hi, True), ("cmp", "cmp_le", x, lo, True))
        if op == "cmp_gt":
            return or_(("cmp", "cmp_gt", x, hi, True), ("cmp", "cmp_lt", x, lo, True))
        return ("cmp", op, self.dag.op("abs", (x,)), hi, True)

    # -- captured arrays -------------------------------------------------------------------------
    def new_array(self, value: Any, kind: str, axes: frozenset) -> int:
        name = f"{self.prefix}{len(self.arrays)}"
        shape4 = tuple(int(d) for d in value.shape)
        self.arrays[name] = value
        self.infos[name] = TensorInfo("array", kind, shape4)
        return self.dag.array(name, shape4, kind, axes)

    def deps(self, x: Any) -> tuple[frozenset, bool]:
        if isinstance(x, Grid):
            return x.axes, False
        nodes = [x.node] if isinstance(x, Sym) else formula_nodes(x.formula) if isinstance(x, Pred) else []
        axes = frozenset().union(*(self.dag.axes[n] for n in nodes))
        return axes, any(self.dag.score_dep[n] for n in nodes)

    def grid_shape(self, axes: frozenset) -> tuple[int, ...]:
        assert self.shape is not None
        return tuple(self.shape[a] if a in axes else 1 for a in range(4))

    def numeric(self, x: Any) -> Any:
        """The values of a score-independent scalar over its axes' grid: shape (sizes of sorted axes)."""
        axes, _ = self.deps(x)
        node = x.node if isinstance(x, Sym) else self.select(x.formula, self.dag.const(1, INT), self.dag.const(0, INT))
        graph = RecordingGraph()
        score = graph.leaf("score")
        leaves = {i: graph.leaf("array", (("shape", self.infos[n].shape),), self.infos[n].dtype, name=n)
                  for i, n in self.dag.names.items()}
        out = replay(self.dag.nodes, node, graph, score, leaves)
        ir = graph.to_ir(out.index, None)
        index = [jnp.arange(n, dtype=jnp.int32).reshape(tuple(n if a == axis else 1 for a in range(4)))
                 for axis, n in enumerate(self.shape)]
        value, _ = evaluate(ir, jnp.zeros((), jnp.float32), scalars={}, arrays=self.arrays, index=index)
        value = jnp.broadcast_to(value, self.grid_shape(axes))
        if isinstance(x, Pred):
            value = value != 0
        return value.reshape(tuple(self.shape[a] for a in sorted(axes)))

    def materialize(self, eqn: Any, ins: list[Any]) -> list[Any]:
        """Evaluate an equation that reads only positions (and captured values) over its grid."""
        name = eqn.primitive.name
        deps = [self.deps(x) for x in ins]
        if any(dep for _, dep in deps) or _is_random(name):
            raise self.unsupported(self.describe(eqn))
        axes = frozenset().union(*(a for a, _ in deps))
        if {QUERY_AXIS, KEY_AXIS} <= axes:
            what = "at a computed index (one that reads" if name in _LOOKUPS else "on values (that read"
            raise self.unsupported(
                f"uses `{name}` {what} both q_idx and kv_idx: a dense (T, S) table, which belongs in `bias=` or `mask=`)")
        if self.shape is None:
            raise ValueError(
                f"{self.what} uses `{name}` on positions (e.g. indexes a captured array by b, h, q_idx or "
                "kv_idx); converting it needs the call's shape=(B, N, T, S)")
        key = (name, repr(eqn.params), tuple(_value_key(x) for x in ins))
        if key in self._materialized:
            return self._materialized[key][0]
        order = sorted(axes)
        batched, in_axes_per = [], []
        for x, (x_axes, _) in zip(ins, deps):
            if is_symbolic(x) and x_axes:
                batched.append(x.values if isinstance(x, Grid) else self.numeric(x))
                in_axes_per.append(x_axes)
            else:
                batched.append(None)
                in_axes_per.append(frozenset())
        static = [None if b is not None else x.values if isinstance(x, Grid) else self.numeric(x)
                  if is_symbolic(x) else x for x, b in zip(ins, batched)]
        positions = [i for i, b in enumerate(batched) if b is not None]

        def point(*values: Any) -> list[Any]:
            args = list(static)
            for i, v in zip(positions, values):
                args[i] = v
            outs = _bind(eqn, args)
            return list(outs)

        f = point
        for axis in reversed(order):
            f = jax.vmap(f, in_axes=tuple(0 if axis in in_axes_per[i] else None for i in positions))
        outs = f(*(batched[i] for i in positions))
        results = []
        for value, var in zip(outs, eqn.outvars):
            if _size(var.aval.shape) != 1:
                results.append(Grid(value, axes))
                continue
            value = jnp.reshape(value, self.grid_shape(axes))
            kind = kind_of(var.aval.dtype)
            if kind == BOOL:
                node = self.new_array(value.astype(jnp.int32), INT, axes)
                results.append(Pred(("cmp", "cmp_neq", node, self.dag.const(0, INT), True)))
            else:
                value = value.astype(jnp.float32 if kind == FLOAT else jnp.int32)
                results.append(Sym(self.new_array(value, kind, axes)))
        self._materialized[key] = (results, ins)  # ins keeps the keyed objects alive
        return results

    def describe(self, eqn: Any) -> str:
        name = eqn.primitive.name
        shapes = [tuple(v.aval.shape) for v in list(eqn.invars) + list(eqn.outvars)]
        if name in _CONTROL_FLOW:
            return f"uses control flow (`{name}`) on the score"
        if _is_random(name):
            return f"uses random numbers (`{name}`)"
        if name in _LOOKUPS:
            return f"uses `{name}` at an index computed from the score"
        if name in ("custom_vjp_call", "custom_vjp_call_jaxpr"):
            return "uses a custom_vjp function (`custom_vjp_call`): its gradient rule cannot go into the cuDNN graph"
        if name == "stop_gradient":
            return "uses `stop_gradient` on a value computed from the score (the derived gradient would ignore it)"
        if any(_size(s) != 1 for s in shapes):
            big = next(s for s in shapes if _size(s) != 1)
            return f"computes a non-scalar value with `{name}` (shape {big}); a mod computes one score at a time"
        return f"uses `{name}`"



def _is_random(name: str) -> bool:
    return name.startswith("random_") or "threefry" in name


def _size(shape: Sequence[int]) -> int:
    return int(np.prod(shape)) if len(shape) else 1


def _value_key(x: Any) -> Any:
    if isinstance(x, Sym):
        return ("node", x.node)
    if isinstance(x, Pred):
        return ("pred", x.formula)
    return ("object", id(x))


def _bind(eqn: Any, args: Sequence[Any]) -> list[Any]:
    params = eqn.primitive.get_bind_params(eqn.params)
    subfuns: tuple = ()
    if isinstance(params, tuple):  # older jax: (subfuns, params)
        subfuns, params = params
    out = eqn.primitive.bind(*subfuns, *args, **params)
    return list(out) if eqn.primitive.multiple_results else [out]


def _inline_jaxpr(eqn: Any) -> tuple[Jaxpr, Sequence[Any]] | None:
    for key in ("jaxpr", "call_jaxpr"):
        sub = eqn.params.get(key)
        if isinstance(sub, ClosedJaxpr):
            return sub.jaxpr, sub.consts
        if isinstance(sub, Jaxpr):
            return sub, ()
    return None


# jnp functions recognized by their jit name and exact body: name -> (function, input dtypes)
_KNOWN_CALLS: dict[str, tuple[Callable, tuple]] = {
    "softplus": (jax.nn.softplus, (jnp.float32,)),
    "floor_divide": (jnp.floor_divide, (jnp.int32, jnp.int32)),
    "remainder": (jnp.remainder, (jnp.int32, jnp.int32)),
}
_REFERENCE_BODIES: dict[Any, str] = {}


def _matches_reference(eqn: Any) -> bool:
    """Whether a `jit[name=...]` call is the jax function of that name on these scalar types (and
    not a user function that happens to share its name): its body prints the same."""
    name = eqn.params["name"]
    fn, dtypes = _KNOWN_CALLS[name]
    avals = [v.aval for v in eqn.invars]
    if len(avals) != len(dtypes) or any(a.shape != () or a.dtype != d for a, d in zip(avals, dtypes)):
        return False
    key = (name, tuple(bool(getattr(a, "weak_type", False)) for a in avals))
    if key not in _REFERENCE_BODIES:
        args = [jax.ShapeDtypeStruct((), d, weak_type=bool(getattr(a, "weak_type", False)))
                for a, d in zip(avals, dtypes)]
        ref = jax.make_jaxpr(fn)(*args).jaxpr
        body = ref.eqns[0].params.get("jaxpr") if len(ref.eqns) == 1 else None
        _REFERENCE_BODIES[key] = "" if body is None else str(body)
    return str(eqn.params.get("jaxpr")) == _REFERENCE_BODIES[key]


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

    conv = _Converter(what, shape, prefix)
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
