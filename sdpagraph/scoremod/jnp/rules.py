"""The jaxpr primitives a jax.numpy mod may use, each turned into score_mod IR ops (`scoremod.jnp.convert`).

One method per primitive, `rule_<name>(eqn, inputs)`, plus three families (float unary functions,
sign-keeping unary ops, shape-only ops); each returns the value(s) the equation computes, or
NotImplemented when its inputs are of a kind it cannot take (the converter then evaluates the
equation over its index grid, or says why the mod runs on XLA). Rules build on the converter's
operand helpers (`dag`, `num`, `pred`, `kinds`, `arith`, `select`, `comparison`,
`float_operand`, `deps`), which `PrimitiveRules` expects of the class that mixes it in.
"""
from __future__ import annotations

import math
from typing import Any, Callable

import numpy as np

from sdpagraph.scoremod.ir import BOOL, FLOAT, INT
from sdpagraph.scoremod.jnp.dag import and_, not_, or_, xor_
from sdpagraph.scoremod.jnp.values import Pred, Sym, kind_of

JAX_CMP = {"eq": "cmp_eq", "ne": "cmp_neq", "lt": "cmp_lt", "le": "cmp_le", "gt": "cmp_gt", "ge": "cmp_ge"}
FLOAT_UNARY = {"exp": "exp", "log": "log", "tanh": "tanh", "logistic": "sigmoid", "sqrt": "sqrt",
               "rsqrt": "rsqrt", "erf": "erf", "sin": "sin", "cos": "cos", "tan": "tan"}
KEEP_TYPE_UNARY = ("abs", "neg", "floor", "ceil")
PASS_THROUGH = ("copy", "copy_p", "reduce_precision", "squeeze", "reshape", "broadcast_in_dim",
                "expand_dims", "optimization_barrier")


class PrimitiveRules:
    """The rules (module docstring); mixed into the converter."""

    def rule_for(self, name: str) -> Callable[[Any, list[Any]], Any] | None:
        """The rule for primitive `name`, or None when there is none."""
        rule = getattr(self, "rule_" + name, None)
        if rule is None and name in FLOAT_UNARY:
            return self.float_unary
        if rule is None and name in KEEP_TYPE_UNARY:
            return self.keep_type_unary
        if rule is None and name in PASS_THROUGH:
            return self.pass_through
        return rule

    def float_unary(self, eqn: Any, ins: list[Any]) -> Any:
        (x,) = ins
        if not isinstance(x, Sym):
            return NotImplemented
        return Sym(self.dag.op(FLOAT_UNARY[eqn.primitive.name], (self.float_operand(x),)))

    def keep_type_unary(self, eqn: Any, ins: list[Any]) -> Any:
        (x,) = ins
        if not isinstance(x, Sym):
            return NotImplemented
        return Sym(self.dag.op(eqn.primitive.name, (x.node,)))

    def pass_through(self, eqn: Any, ins: list[Any]) -> Any:
        return list(ins) if eqn.primitive.multiple_results else ins[0]

    def rule_stop_gradient(self, eqn: Any, ins: list[Any]) -> Any:
        if self.deps(ins[0])[1]:
            return NotImplemented  # -> describe(): the derived gradient would flow through it
        return ins[0]

    def rule_convert_element_type(self, eqn: Any, ins: list[Any]) -> Any:
        (x,) = ins
        src, dst = kind_of(eqn.invars[0].aval.dtype), kind_of(eqn.params["new_dtype"])
        if src == dst:
            return x
        if dst == BOOL:
            return Pred(self.pred(x))
        if src == BOOL:
            return Sym(self.num(x, dst))
        if dst == FLOAT:  # int -> float: an identity retyped, skipped by float consumers
            return Sym(self.dag.op("identity", (x.node,), dtype=FLOAT), int_source=x.node)
        if x.int_source is not None:  # float -> int of a cast int: the int itself
            return Sym(x.int_source)
        return Sym(self.dag.op("identity", (x.node,), dtype=INT))  # truncates, as XLA's convert

    def _binary(self, eqn: Any, ins: list[Any], op: str) -> Any:
        kinds = self.kinds(eqn)
        out = kind_of(eqn.outvars[0].aval.dtype)
        if BOOL in kinds or out == BOOL:
            return NotImplemented
        return self.arith(op, ins, kinds, out)

    def rule_add(self, eqn, ins):
        return self._binary(eqn, ins, "add")

    def rule_sub(self, eqn, ins):
        return self._binary(eqn, ins, "sub")

    def rule_mul(self, eqn, ins):
        return self._binary(eqn, ins, "mul")

    def rule_rem(self, eqn, ins):
        return self._binary(eqn, ins, "mod")  # C's fmod / %, as the IR's mod

    def rule_pow(self, eqn, ins):
        return self._binary(eqn, ins, "pow")

    def rule_max(self, eqn, ins):
        if kind_of(eqn.outvars[0].aval.dtype) == BOOL:
            return Pred(or_(self.pred(ins[0]), self.pred(ins[1])))
        return self._binary(eqn, ins, "max")

    def rule_min(self, eqn, ins):
        if kind_of(eqn.outvars[0].aval.dtype) == BOOL:
            return Pred(and_(self.pred(ins[0]), self.pred(ins[1])))
        return self._binary(eqn, ins, "min")

    def rule_div(self, eqn, ins):
        kinds = self.kinds(eqn)
        if kind_of(eqn.outvars[0].aval.dtype) == FLOAT:
            return self._binary(eqn, ins, "div")
        if BOOL in kinds:
            return NotImplemented
        # integer division rounds toward zero: (a - a % b) / b divides an exact multiple
        a, b = (self.num(x, k) for x, k in zip(ins, kinds))
        exact = self.dag.op("sub", (a, self.dag.op("mod", (a, b))))
        return Sym(self.dag.op("identity", (self.dag.op("div", (exact, b)),), dtype=INT))

    def rule_square(self, eqn, ins):
        x = self.num(ins[0], self.kinds(eqn)[0])
        return Sym(self.dag.op("mul", (x, x)))

    def rule_integer_pow(self, eqn, ins):
        kind = self.kinds(eqn)[0]
        x, y = self.num(ins[0], kind), int(eqn.params["y"])
        if y == 0:
            return Sym(self.dag.const(1, kind))
        result, base, n = None, x, abs(y)
        while n:
            if n & 1:
                result = base if result is None else self.dag.op("mul", (result, base))
            n >>= 1
            if n:
                base = self.dag.op("mul", (base, base))
        if y < 0:
            result = self.dag.op("div", (self.dag.const(1.0, FLOAT), result))
        return Sym(result)

    def rule_exp2(self, eqn, ins):
        x = self.float_operand(ins[0])
        return Sym(self.dag.op("exp", (self.dag.op("mul", (x, self.dag.const(math.log(2.0), FLOAT))),)))

    def rule_log1p(self, eqn, ins):
        x = self.float_operand(ins[0])
        return Sym(self.dag.op("log", (self.dag.op("add", (x, self.dag.const(1.0, FLOAT))),)))

    def rule_expm1(self, eqn, ins):
        x = self.float_operand(ins[0])
        return Sym(self.dag.op("sub", (self.dag.op("exp", (x,)), self.dag.const(1.0, FLOAT))))

    def rule_erfc(self, eqn, ins):
        x = self.float_operand(ins[0])
        return Sym(self.dag.op("sub", (self.dag.const(1.0, FLOAT), self.dag.op("erf", (x,)))))

    def rule_sign(self, eqn, ins):
        kind = self.kinds(eqn)[0]
        x, zero = ins[0].node, self.dag.const(0, kind)
        positive = ("cmp", "cmp_gt", x, zero, kind == INT)
        negative = ("cmp", "cmp_lt", x, zero, kind == INT)
        inner = self.select(negative, self.dag.const(-1, kind), zero)
        return Sym(self.select(positive, self.dag.const(1, kind), inner))

    def rule_is_finite(self, eqn, ins):
        x = ins[0].node
        return Pred(("cmp", "cmp_lt", self.dag.op("abs", (x,)), self.dag.const(math.inf, FLOAT), False))

    def rule_clamp(self, eqn, ins):
        lo, x, hi = ins
        klo, kx, khi = self.kinds(eqn)
        if BOOL in (klo, kx, khi):
            return NotImplemented
        inner = self.arith("max", (x, lo), (kx, klo), kx)
        return self.arith("min", (inner, hi), (kx, khi), kx)

    def _compare_rule(self, eqn, ins):
        op = JAX_CMP[eqn.primitive.name]
        kx, ky = self.kinds(eqn)
        x, y = ins
        if kx == BOOL or ky == BOOL:
            if op == "cmp_eq":
                return Pred(not_(xor_(self.pred(x), self.pred(y))))
            if op == "cmp_neq":
                return Pred(xor_(self.pred(x), self.pred(y)))
            return NotImplemented
        return Pred(self.comparison(op, x, y, kx, ky))

    rule_eq = rule_ne = rule_lt = rule_le = rule_gt = rule_ge = _compare_rule

    def _logical(self, eqn, ins, combine):
        if any(k != BOOL for k in self.kinds(eqn)):
            return NotImplemented  # bitwise ops on integers: no IR op
        return Pred(combine(*(self.pred(x) for x in ins)))

    def rule_and(self, eqn, ins):
        return self._logical(eqn, ins, and_)

    def rule_or(self, eqn, ins):
        return self._logical(eqn, ins, or_)

    def rule_xor(self, eqn, ins):
        return self._logical(eqn, ins, xor_)

    def rule_not(self, eqn, ins):
        return self._logical(eqn, ins, not_)

    def rule_select_n(self, eqn, ins):
        which, *cases = ins
        kinds = self.kinds(eqn)
        out = kind_of(eqn.outvars[0].aval.dtype)
        if kinds[0] == BOOL:
            conditions = [self.pred(which)]
        else:  # an integer index picks cases[index]
            conditions = [self.comparison("cmp_eq", which, np.int32(i), kinds[0], INT) for i in range(1, len(cases))]
        if out == BOOL:
            result = self.pred(cases[0])
            for cond, case in zip(conditions, cases[1:]):
                result = or_(and_(cond, self.pred(case)), and_(not_(cond), result))
            return Pred(result)
        result = self.num(cases[0], out)
        for cond, case in zip(conditions, cases[1:]):
            result = self.select(cond, self.num(case, out), result)
        return Sym(result)
