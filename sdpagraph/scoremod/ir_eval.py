"""Evaluate a ScoreModIR with jax.numpy (the XLA backend, the tests) or NumPy (the numerical
check's reference, `numerics.reference`), both in float32.

Values broadcast against the score `(B, N, T, S)`; `gen_index` reads the position
arrays the caller supplies (per-segment positions when sequences are packed), so the
XLA backend and the cuDNN lowering see the same indices. `mod` follows C's fmod (the
result has the dividend's sign), as cuDNN's pointwise MOD does.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import jax.numpy as jnp
import numpy as np

from sdpagraph.scoremod.ir import BOOL, FLOAT, INT, Node, ScoreModIR


def _jax_erf(x):
    from jax.scipy.special import erf
    return erf(x)


def _jax_sigmoid(x):
    from jax.nn import sigmoid
    return sigmoid(x)


def _numpy_erf(x):
    from scipy.special import erf  # scipy comes with jax
    return erf(x)


def _numpy_sigmoid(x):
    from scipy.special import expit
    return expit(x)


@dataclass(frozen=True)
class ArrayModule:
    """Which array library evaluates, and in which float type FLOAT nodes compute."""

    xp: Any  # jax.numpy or numpy: the functions both have
    float_dtype: Any
    erf: Callable
    sigmoid: Callable

    def dtype(self, ir_dtype: str) -> Any:
        return {FLOAT: self.float_dtype, INT: np.int32, BOOL: np.bool_}[ir_dtype]

    def fl(self, x: Any) -> Any:
        return x.astype(self.float_dtype) if x.dtype != self.float_dtype else x


JAX = ArrayModule(jnp, jnp.float32, _jax_erf, _jax_sigmoid)
NUMPY_FLOAT32 = ArrayModule(np, np.float32, _numpy_erf, _numpy_sigmoid)

# Each op: (array module, *args) -> value.
_UNARY: dict[str, Callable] = {
    "abs": lambda m, x: m.xp.abs(x), "ceil": lambda m, x: m.xp.ceil(x), "floor": lambda m, x: m.xp.floor(x),
    "neg": lambda m, x: m.xp.negative(x), "identity": lambda m, x: x,
    "cos": lambda m, x: m.xp.cos(m.fl(x)), "erf": lambda m, x: m.erf(m.fl(x)), "exp": lambda m, x: m.xp.exp(m.fl(x)),
    "log": lambda m, x: m.xp.log(m.fl(x)), "reciprocal": lambda m, x: 1.0 / m.fl(x),
    "rsqrt": lambda m, x: 1.0 / m.xp.sqrt(m.fl(x)), "sigmoid": lambda m, x: m.sigmoid(m.fl(x)),
    "sin": lambda m, x: m.xp.sin(m.fl(x)), "softplus": lambda m, x: m.xp.logaddexp(m.fl(x), 0.0),
    "sqrt": lambda m, x: m.xp.sqrt(m.fl(x)), "tan": lambda m, x: m.xp.tan(m.fl(x)),
    "tanh": lambda m, x: m.xp.tanh(m.fl(x)), "logical_not": lambda m, x: m.xp.logical_not(x),
}
_BINARY: dict[str, Callable] = {
    "add": lambda m, a, b: m.xp.add(a, b), "sub": lambda m, a, b: m.xp.subtract(a, b),
    "mul": lambda m, a, b: m.xp.multiply(a, b), "div": lambda m, a, b: m.fl(a) / m.fl(b),
    "max": lambda m, a, b: m.xp.maximum(a, b), "min": lambda m, a, b: m.xp.minimum(a, b),
    "mod": lambda m, a, b: m.xp.fmod(a, b), "pow": lambda m, a, b: m.xp.power(m.fl(a), m.fl(b)),
    "logical_and": lambda m, a, b: m.xp.logical_and(a, b), "logical_or": lambda m, a, b: m.xp.logical_or(a, b),
    "cmp_eq": lambda m, a, b: m.xp.equal(a, b), "cmp_neq": lambda m, a, b: m.xp.not_equal(a, b),
    "cmp_gt": lambda m, a, b: m.xp.greater(a, b), "cmp_ge": lambda m, a, b: m.xp.greater_equal(a, b),
    "cmp_lt": lambda m, a, b: m.xp.less(a, b), "cmp_le": lambda m, a, b: m.xp.less_equal(a, b),
    "tanh_backward": lambda m, loss, x: m.fl(loss) * (1.0 - m.xp.tanh(m.fl(x)) ** 2),
    "sigmoid_backward": lambda m, loss, x: m.fl(loss) * m.sigmoid(m.fl(x)) * (1.0 - m.sigmoid(m.fl(x))),
}


def evaluate(
    ir: ScoreModIR,
    score: Any,
    *,
    scalars: Mapping[str, Any],
    arrays: Mapping[str, Any],
    index: Sequence[Any],
    dscore: Any = None,
    module: ArrayModule = JAX,
    memo: list | None = None,
) -> tuple[Any, Any]:
    """Return (modified score, bprop(dscore) or None).

    `index[axis]` is the array `gen_index(axis)` yields, broadcastable to the score.
    `scalars`/`arrays` map the names in `ir.scalar_names`/`ir.array_names` to values.
    `module`: JAX (traceable) or NUMPY_FLOAT32. `memo`: a list the nodes' values are kept
    in; given again (same score and inputs) with dscore, the forward's values are not recomputed.
    """
    # Without dscore only the forward's nodes are evaluated: the bprop's would cost as much again.
    wanted = ir.output if dscore is None or ir.grad_output is None else None
    needed = None if wanted is None else _ancestors(ir, wanted)
    known = memo if memo is not None else []
    values: list[Any] = []
    for position, node in enumerate(ir.nodes):
        if position < len(known) and known[position] is not None:
            values.append(known[position])
            continue
        skip = needed is not None and position not in needed
        values.append(None if skip else _node_value(ir, node, values, score, dscore, scalars, arrays, index, module))
    if memo is not None:
        memo[:] = values
    grad = None if ir.grad_output is None or dscore is None else values[ir.grad_output]
    return values[ir.output], grad


def _ancestors(ir: ScoreModIR, root: int) -> set[int]:
    """The nodes `root` reads, directly or not, and itself."""
    found, stack = set(), [root]
    while stack:
        position = stack.pop()
        if position not in found:
            found.add(position)
            stack.extend(ir.nodes[position].args)
    return found


def _node_value(ir: ScoreModIR, node: Node, values: list, score, dscore, scalars, arrays, index, m: ArrayModule):
    op, xp = node.op, m.xp
    if op == "score":
        return score
    if op == "dscore":
        if dscore is None:
            return xp.zeros((), m.float_dtype)  # bprop nodes are computed only when asked for
        return dscore
    if op == "const":
        return xp.asarray(node.attr("value"), m.dtype(node.dtype))
    if op == "scalar":
        return xp.asarray(scalars[ir.scalar_names[node.attr("slot")]], m.dtype(node.dtype))
    if op == "array":
        return xp.asarray(arrays[ir.array_names[node.attr("slot")]], m.dtype(node.dtype))
    if op == "gen_index":
        return xp.asarray(index[node.attr("axis")], np.int32)
    args = [values[a] for a in node.args]
    if op == "binary_select":
        out = xp.where(args[2], args[0], args[1])
    elif op in _UNARY:
        out = _UNARY[op](m, args[0])
    else:
        out = _BINARY[op](m, *args)
    dtype = m.dtype(node.dtype)
    return out if out.dtype == dtype else out.astype(dtype)  # astype copies even to its own dtype
