"""Building score_mod IR nodes from the values a jax.numpy mod's jaxpr is interpreted into
(`scoremod.jnp.values`): numeric operands, float arithmetic with lifted literals, booleans as nested
selects, and comparisons, integer ones between positions in the canonical forms of `scoremod.masks`
(in which cuDNN skips masked tiles; `scoremod.jnp.convert` lists them).

`OperandBuilder` is mixed into the interpreter (`scoremod.jnp.interpreter`), which provides `dag`
(the `scoremod.jnp.dag.Dag` being built) and `new_array(value, kind, axes)` (a captured array);
the primitive rules (`scoremod.jnp.rules`) build on these helpers.
"""
from __future__ import annotations

import math
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from sdpagraph.scoremod.ir import FLOAT, INT, result_type
from sdpagraph.scoremod.jnp.dag import MIRROR, and_, combine, or_
from sdpagraph.scoremod.jnp.values import Pred, Sym, is_symbolic, kind_of
from sdpagraph.scoremod.masks import KEY_AXIS, QUERY_AXIS


class OperandBuilder:
    """The operand helpers (module docstring)."""

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
        which `scoremod.jnp.literals` may bind as a scalar."""
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
        """The comparison node of an atom, integer ones in the forms of `scoremod.masks`."""
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
            a, b, op = b, a, MIRROR[op]  # the position is the comparison's input, as scoremod.masks has it
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
