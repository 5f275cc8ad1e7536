"""Evaluate a ScoreModIR with jax.numpy (the XLA backend and the tests use this).

Values broadcast against the score `(B, N, T, S)`; `gen_index` reads the position
arrays the caller supplies (per-segment positions when sequences are packed), so the
XLA backend and the cuDNN lowering see the same indices. `mod` follows C's fmod (the
result has the dividend's sign), as cuDNN's pointwise MOD does.
"""
from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

import jax.numpy as jnp

from sdpagraph.graphs.ir import BOOL, FLOAT, INT, Node, ScoreModIR

_JNP_DTYPES = {FLOAT: jnp.float32, INT: jnp.int32, BOOL: jnp.bool_}


def _fl(x):
    return x.astype(jnp.float32) if x.dtype != jnp.float32 else x


_UNARY: dict[str, Callable] = {
    "abs": jnp.abs, "ceil": jnp.ceil, "floor": jnp.floor, "neg": jnp.negative, "identity": lambda x: x,
    "cos": lambda x: jnp.cos(_fl(x)), "erf": lambda x: jax_erf(_fl(x)), "exp": lambda x: jnp.exp(_fl(x)),
    "log": lambda x: jnp.log(_fl(x)), "reciprocal": lambda x: 1.0 / _fl(x),
    "rsqrt": lambda x: 1.0 / jnp.sqrt(_fl(x)), "sigmoid": lambda x: jax_sigmoid(_fl(x)),
    "sin": lambda x: jnp.sin(_fl(x)), "softplus": lambda x: jnp.logaddexp(_fl(x), 0.0),
    "sqrt": lambda x: jnp.sqrt(_fl(x)), "tan": lambda x: jnp.tan(_fl(x)), "tanh": lambda x: jnp.tanh(_fl(x)),
    "logical_not": jnp.logical_not,
}
_BINARY: dict[str, Callable] = {
    "add": jnp.add, "sub": jnp.subtract, "mul": jnp.multiply, "div": lambda a, b: _fl(a) / _fl(b),
    "max": jnp.maximum, "min": jnp.minimum, "mod": jnp.fmod, "pow": lambda a, b: jnp.power(_fl(a), _fl(b)),
    "logical_and": jnp.logical_and, "logical_or": jnp.logical_or,
    "cmp_eq": jnp.equal, "cmp_neq": jnp.not_equal, "cmp_gt": jnp.greater, "cmp_ge": jnp.greater_equal,
    "cmp_lt": jnp.less, "cmp_le": jnp.less_equal,
    "tanh_backward": lambda loss, x: _fl(loss) * (1.0 - jnp.tanh(_fl(x)) ** 2),
    "sigmoid_backward": lambda loss, x: _fl(loss) * jax_sigmoid(_fl(x)) * (1.0 - jax_sigmoid(_fl(x))),
}


def jax_erf(x):
    from jax.scipy.special import erf
    return erf(x)


def jax_sigmoid(x):
    from jax.nn import sigmoid
    return sigmoid(x)


def evaluate(
    ir: ScoreModIR,
    score: Any,
    *,
    scalars: Mapping[str, Any],
    arrays: Mapping[str, Any],
    index: Sequence[Any],
    dscore: Any = None,
) -> tuple[Any, Any]:
    """Return (modified score, bprop(dscore) or None).

    `index[axis]` is the array `gen_index(axis)` yields, broadcastable to the score.
    `scalars`/`arrays` map the names in `ir.scalar_names`/`ir.array_names` to values.
    """
    values: list[Any] = []
    for node in ir.nodes:
        values.append(_node_value(ir, node, values, score, dscore, scalars, arrays, index))
    grad = None if ir.grad_output is None or dscore is None else values[ir.grad_output]
    return values[ir.output], grad


def _node_value(ir: ScoreModIR, node: Node, values: list, score, dscore, scalars, arrays, index):
    op = node.op
    if op == "score":
        return score
    if op == "dscore":
        if dscore is None:
            return jnp.zeros((), jnp.float32)  # bprop nodes are computed only when asked for
        return dscore
    if op == "const":
        return jnp.asarray(node.attr("value"), _JNP_DTYPES[node.dtype])
    if op == "scalar":
        return jnp.asarray(scalars[ir.scalar_names[node.attr("slot")]], _JNP_DTYPES[node.dtype])
    if op == "array":
        return jnp.asarray(arrays[ir.array_names[node.attr("slot")]], _JNP_DTYPES[node.dtype])
    if op == "gen_index":
        return jnp.asarray(index[node.attr("axis")], jnp.int32)
    args = [values[a] for a in node.args]
    if op == "binary_select":
        out = jnp.where(args[2], args[0], args[1])
    elif op in _UNARY:
        out = _UNARY[op](args[0])
    else:
        out = _BINARY[op](*args)
    return out.astype(_JNP_DTYPES[node.dtype])
