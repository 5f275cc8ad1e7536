"""Symbolic reverse-mode differentiation of a recorded score_mod.

The derived bprop maps dscore (the gradient w.r.t. the mod's output) to the gradient
w.r.t. the mod's input score, using only ops of the recorder's set, so the cuDNN
backward graph can run it as `score_mod_bprop`. It may reuse forward tensors (cuDNN
allows that inside one backward graph). Aux tensors are constants: no gradient flows
to them. Index, comparison, logical, floor and ceil ops pass zero gradient; a
`binary_select` passes the gradient to the branch it selected, so masked scores get 0.
"""
from __future__ import annotations

import math
from typing import Callable

from sdpagraph.scoremod.ir import FLOAT, ScoreModError
from sdpagraph.scoremod.recording import RecordingGraph

ZERO_GRAD_OPS = frozenset({
    "gen_index", "floor", "ceil", "logical_not", "logical_and", "logical_or",
    "cmp_eq", "cmp_neq", "cmp_gt", "cmp_ge", "cmp_lt", "cmp_le",
})


def derive_bprop(graph: RecordingGraph, output: int, score: int) -> int:
    """Append the bprop of `output` w.r.t. `score` to `graph`; return the gradient node."""
    dscore = graph.leaf("dscore").index
    depends = _depends_on(graph, output, score)
    if output not in depends:
        return graph.emit("mul", (dscore, graph.const(0.0)))

    grads: dict[int, int] = {output: dscore}
    for index in sorted(depends, reverse=True):  # nodes are topologically ordered
        if index == score or index not in grads:
            continue
        node = graph.node(index)
        if node.op in ZERO_GRAD_OPS or node.dtype != FLOAT:
            continue
        rule = _RULES.get(node.op)
        if rule is None:
            raise ScoreModError(f"cannot differentiate op {node.op!r}; pass score_mod_bprop explicitly")
        for arg, contribution in zip(node.args, rule(_Emitter(graph), grads[index], index, node.args)):
            if contribution is None or arg not in depends or graph.node(arg).dtype != FLOAT:
                continue
            grads[arg] = contribution if arg not in grads else graph.emit("add", (grads[arg], contribution))
    return grads.get(score, graph.emit("mul", (dscore, graph.const(0.0))))


def _depends_on(graph: RecordingGraph, output: int, score: int) -> set[int]:
    """Nodes on a path from `score` to `output` (only they can carry gradient)."""
    depends: set[int] = set()
    for index in range(score, output + 1):
        node = graph.node(index)
        if index == score or any(a in depends for a in node.args):
            depends.add(index)
    ancestors = set()
    stack = [output]
    while stack:
        i = stack.pop()
        if i not in ancestors:
            ancestors.add(i)
            stack.extend(graph.node(i).args)
    return depends & ancestors


class _Emitter:
    """Short names for emitting ops while writing derivative rules."""

    def __init__(self, graph: RecordingGraph):
        self.graph = graph

    def __getattr__(self, op: str) -> Callable[..., int]:
        return lambda *args: self.graph.emit(op, tuple(self._index(a) for a in args))

    def _index(self, value: int | float) -> int:
        return self.graph.const(value) if isinstance(value, float) else value

    def select(self, value: int, mask: int, when_true: bool = True) -> int:
        """`value` where mask (or where not mask), else 0."""
        zero = self.graph.const(0.0)
        pair = (value, zero) if when_true else (zero, value)
        return self.graph.emit("binary_select", (*pair, mask))


def _mod_rule(e: _Emitter, g: int, y: int, args: tuple) -> tuple:
    a, b = args
    return (g, e.neg(e.mul(g, e.floor(e.div(a, b)))))


def _pow_rule(e: _Emitter, g: int, y: int, args: tuple) -> tuple:
    a, b = args
    return (e.mul(g, e.mul(b, e.pow(a, e.sub(b, 1.0)))), e.mul(g, e.mul(y, e.log(a))))


# Each rule: (emitter, upstream grad g, this node y, its args) -> one contribution per arg.
_RULES: dict[str, Callable[[_Emitter, int, int, tuple], tuple]] = {
    "identity": lambda e, g, y, x: (g,),
    "neg": lambda e, g, y, x: (e.neg(g),),
    "add": lambda e, g, y, x: (g, g),
    "sub": lambda e, g, y, x: (g, e.neg(g)),
    "mul": lambda e, g, y, x: (e.mul(g, x[1]), e.mul(g, x[0])),
    "div": lambda e, g, y, x: (e.div(g, x[1]), e.neg(e.div(e.mul(g, y), x[1]))),
    "abs": lambda e, g, y, x: (e.binary_select(g, e.neg(g), e.cmp_ge(x[0], 0.0)),),
    "exp": lambda e, g, y, x: (e.mul(g, y),),
    "log": lambda e, g, y, x: (e.div(g, x[0]),),
    "sqrt": lambda e, g, y, x: (e.div(g, e.mul(y, 2.0)),),
    "rsqrt": lambda e, g, y, x: (e.neg(e.mul(g, e.div(e.mul(y, 0.5), x[0]))),),
    "reciprocal": lambda e, g, y, x: (e.neg(e.mul(g, e.mul(y, y))),),
    "sin": lambda e, g, y, x: (e.mul(g, e.cos(x[0])),),
    "cos": lambda e, g, y, x: (e.neg(e.mul(g, e.sin(x[0]))),),
    "tan": lambda e, g, y, x: (e.mul(g, e.add(e.mul(y, y), 1.0)),),
    "tanh": lambda e, g, y, x: (e.tanh_backward(g, x[0]),),
    "sigmoid": lambda e, g, y, x: (e.sigmoid_backward(g, x[0]),),
    "softplus": lambda e, g, y, x: (e.mul(g, e.sigmoid(x[0])),),
    "erf": lambda e, g, y, x: (e.mul(g, e.mul(e.exp(e.neg(e.mul(x[0], x[0]))), 2.0 / math.sqrt(math.pi))),),
    "max": lambda e, g, y, x: (e.select(g, e.cmp_ge(x[0], x[1])), e.select(g, e.cmp_ge(x[0], x[1]), False)),
    "min": lambda e, g, y, x: (e.select(g, e.cmp_le(x[0], x[1])), e.select(g, e.cmp_le(x[0], x[1]), False)),
    "mod": _mod_rule,
    "pow": _pow_rule,
    "binary_select": lambda e, g, y, x: (e.select(g, x[2]), e.select(g, x[2], False), None),
}
