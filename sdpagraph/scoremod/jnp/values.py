"""The values a jax.numpy mod's jaxpr is interpreted into (`scoremod.jnp.convert`): a number as a node
of the IR DAG (`Sym`), a boolean as a formula of comparisons (`Pred`), and a non-scalar value
computed from positions only, held over its index grid (`Grid`). Concrete values stay Python /
NumPy / JAX values.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax.numpy as jnp

from sdpagraph.scoremod.ir import BOOL, FLOAT, INT


@dataclass(frozen=True)
class Sym:
    """A number computed from the score or the positions: a node of the DAG.

    `int_source`: when this float is a cast of an integer node, that node (an op whose result is
    float anyway can read the integer directly, as mods.alibi does)."""

    node: int
    int_source: int | None = None


@dataclass(frozen=True)
class Pred:
    """A boolean: a formula over comparisons (`scoremod.jnp.dag`'s and_, or_, not_, xor_)."""

    formula: tuple


@dataclass(frozen=True, eq=False)
class Grid:
    """A non-scalar value computed from positions only (a row of a captured array picked by b, ...),
    held by its values over the grid of the axes it reads: shape (sizes of sorted axes) + inner."""

    values: Any
    axes: frozenset


def is_symbolic(x: Any) -> bool:
    return isinstance(x, (Sym, Pred, Grid))


def kind_of(dtype: Any) -> str:
    if dtype == jnp.bool_:
        return BOOL
    if jnp.issubdtype(dtype, jnp.integer):
        return INT
    if jnp.issubdtype(dtype, jnp.floating):
        return FLOAT
    raise TypeError(f"unsupported dtype {dtype} in a jnp mod")
