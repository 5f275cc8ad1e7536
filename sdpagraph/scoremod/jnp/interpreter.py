"""The jaxpr interpreter behind `scoremod.jnp.convert`: it walks a jax.numpy mod's jaxpr equation by
equation into a DAG of score_mod IR ops (`scoremod.jnp.dag`), inlining calls, folding what is
concrete with JAX, and evaluating what reads only positions over its index grid into captured
arrays. The values it interprets into are in `scoremod.jnp.values`, the IR nodes of operands and
comparisons in `scoremod.jnp.operands`, the rule for each primitive in `scoremod.jnp.rules`; what
each jax.numpy construct becomes is listed in `scoremod.jnp.convert`.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from sdpagraph.errors import Unsupported
from sdpagraph.scoremod.ir import BOOL, FLOAT, INT
from sdpagraph.scoremod.recording import RecordingGraph
from sdpagraph.scoremod.ir_eval import evaluate
from sdpagraph.scoremod.jnp.dag import Dag, formula_nodes, replay
from sdpagraph.scoremod.jnp.operands import OperandBuilder
from sdpagraph.scoremod.jnp.rules import PrimitiveRules
from sdpagraph.scoremod.jnp.values import Grid, Pred, Sym, is_symbolic, kind_of
from sdpagraph.scoremod.masks import KEY_AXIS, QUERY_AXIS
from sdpagraph.scoremod.trace import TensorInfo

try:  # jax >= 0.4.36
    from jax.extend.core import ClosedJaxpr, DropVar, Jaxpr, Literal
except ImportError:  # pragma: no cover - older jax
    from jax.core import ClosedJaxpr, DropVar, Jaxpr, Literal  # type: ignore

RUNS_ON_XLA = "which cuDNN cannot express; it runs on XLA"


class JnpModUnsupported(Unsupported):
    """A jnp score_mod / mask_mod uses something the score_mod IR (and so cuDNN) cannot express.

    The message names the primitive in one sentence; the mod can still run on XLA by calling the
    Python function itself (`scoremod.jnp.apply`).
    """


_INLINE = ("pjit", "jit", "closed_call", "core_call", "custom_jvp_call", "checkpoint", "remat", "remat2")
_CONTROL_FLOW = ("cond", "while", "scan", "switch", "fori_loop")
_LOOKUPS = ("gather", "dynamic_slice", "dynamic_index_in_dim", "take", "take_along_axis")


class JaxprInterpreter(OperandBuilder, PrimitiveRules):
    """Interprets a jaxpr into a DAG of IR ops: inlining, folding and materialized grids here;
    operands in `OperandBuilder`, one rule per primitive in `PrimitiveRules`."""

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
                f"uses `{name}` {what} both q_idx and kv_idx: a dense (T, S) table, which belongs in `bias=` "
                "or `mask=`)")
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
