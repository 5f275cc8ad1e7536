"""Recognize a recorded mask that is one of cuDNN's native position masks.

A mask written as a mod (a jax.numpy `mask_mod`, or a graph mod) computes the right values on
cuDNN, but cuDNN turns its native mask subgraphs off once a score_mod is set, and measured on an
H100 (2026-11-24, B4 T4096 N16 H128) a sliding window written as a mod ran 6.8x slower than
`local_window_size`: the mod is applied to every tile, the native window skips the tiles outside
it. So a mod that only masks, with conditions that are bands on the diagonal, is replaced by the
native flags it equals: `is_causal` and `local_window_size` (top-left aligned).

The analysis is exact, not a guess from examples: the IR's output must be the raw score passed
through `binary_select(score, -inf, condition)` steps (and-ed conditions), each condition a
comparison of two integer expressions that are affine in the query and key positions
(`gen_index` axes 2 and 3, integer literals, add / sub / neg / mul by a literal), and each
comparison must depend on the positions only through their difference d = q - k. The mask is
then lo <= d <= hi, which is `local_window_size=(hi, -lo)`, or `is_causal=True` when lo = 0.
Anything else (other ops, arrays, scalars, a band that excludes the diagonal) is not native,
and stays a mod.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from sdpagraph.scoremod.ir import ScoreModIR
from sdpagraph.spec import UNBOUNDED

QUERY_AXIS, KEY_AXIS = 2, 3


@dataclass(frozen=True)
class NativeMask:
    """The flags a mod-only mask equals: `is_causal`, and `window` as the spec holds it: (left,
    right), UNBOUNDED for an open side."""

    is_causal: bool
    window: tuple[int, int]


class _NotNative(Exception):
    pass


def native_mask(ir: ScoreModIR | None) -> NativeMask | None:
    """The native flags `ir` equals, or None when it does more than mask by a diagonal band."""
    if ir is None or ir.scalar_names or ir.array_names:
        return None
    nodes = ir.nodes
    try:
        conditions = []
        index = ir.output
        while nodes[index].op != "score":
            node = nodes[index]
            if node.op != "binary_select" or not _is_minus_inf(nodes[node.args[1]]):
                raise _NotNative
            conditions.extend(_conjuncts(nodes, node.args[2]))
            index = node.args[0]
        lo, hi = -math.inf, math.inf
        for condition in conditions:
            lo, hi = _tighten(nodes, condition, lo, hi)
    except _NotNative:
        return None
    if not conditions or lo > 0 or hi < 0:  # the diagonal masked: no native form keeps it out
        return None
    right = UNBOUNDED if lo == -math.inf else int(-lo)
    left = UNBOUNDED if hi == math.inf else int(hi)
    if right == 0:  # causal; a window (left, 0) adds only the left side
        return NativeMask(True, (left, UNBOUNDED if left == UNBOUNDED else 0))
    return NativeMask(False, (left, right))


def _is_minus_inf(node: Any) -> bool:
    return node.op == "const" and dict(node.attrs).get("value") == -math.inf


def _conjuncts(nodes: Any, index: int) -> list[int]:
    node = nodes[index]
    if node.op == "logical_and":
        return _conjuncts(nodes, node.args[0]) + _conjuncts(nodes, node.args[1])
    return [index]


def _affine(nodes: Any, index: int) -> tuple[int, int, int]:
    """(a, b, c) with the node's value = a*q + b*k + c, for integer position arithmetic."""
    node = nodes[index]
    if node.dtype != "int32":
        raise _NotNative
    if node.op == "gen_index":
        axis = dict(node.attrs).get("axis")
        if axis == QUERY_AXIS:
            return 1, 0, 0
        if axis == KEY_AXIS:
            return 0, 1, 0
        raise _NotNative
    if node.op == "const":
        return 0, 0, int(dict(node.attrs)["value"])
    if node.op == "neg":
        a, b, c = _affine(nodes, node.args[0])
        return -a, -b, -c
    if node.op in ("add", "sub"):
        x, y = _affine(nodes, node.args[0]), _affine(nodes, node.args[1])
        sign = 1 if node.op == "add" else -1
        return tuple(u + sign * v for u, v in zip(x, y))
    if node.op == "mul":
        x, y = _affine(nodes, node.args[0]), _affine(nodes, node.args[1])
        if x[:2] == (0, 0):
            x, y = y, x
        if y[:2] != (0, 0):
            raise _NotNative  # a product of positions is not affine
        return tuple(u * y[2] for u in x)
    raise _NotNative


def _tighten(nodes: Any, index: int, lo: float, hi: float) -> tuple[float, float]:
    """Narrow lo <= d <= hi (d = q - k) by one comparison of affine position expressions."""
    node = nodes[index]
    if node.op not in ("cmp_ge", "cmp_gt", "cmp_le", "cmp_lt"):
        raise _NotNative
    x, y = _affine(nodes, node.args[0]), _affine(nodes, node.args[1])
    a, b, c = (u - v for u, v in zip(x, y))  # the comparison is `a*q + b*k + c  op  0`
    if a == 0 or a != -b:
        raise _NotNative  # not a function of q - k alone (or constant)
    # a*d + c op 0; divide by a (flipping the comparison when a < 0), so that d op' -c/a.
    op = node.op if a > 0 else {"cmp_ge": "cmp_le", "cmp_gt": "cmp_lt", "cmp_le": "cmp_ge", "cmp_lt": "cmp_gt"}[node.op]
    bound = -c / a
    if op == "cmp_ge":
        return max(lo, math.ceil(bound)), hi
    if op == "cmp_gt":
        return max(lo, math.floor(bound) + 1), hi
    if op == "cmp_le":
        return lo, min(hi, math.floor(bound))
    return lo, min(hi, math.ceil(bound) - 1)
