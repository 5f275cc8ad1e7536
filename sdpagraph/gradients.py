"""A guard for calls that have no gradient (paged K/V, FP8 attention): the arrays pass through, and
differentiating through them raises the call's own error instead of a silent zero or a cryptic trace."""
from __future__ import annotations

import functools
from typing import Any

import jax


def without_gradient(error: Exception, *arrays: Any) -> tuple[Any, ...]:
    """`arrays` as given; a gradient through any of them raises `error`."""
    return _guard(error, *arrays)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _guard(error: Exception, *arrays: Any) -> tuple[Any, ...]:
    return arrays


def _guard_fwd(error, *arrays):
    return arrays, None


def _guard_bwd(error, _, cotangents):
    raise error


_guard.defvjp(_guard_fwd, _guard_bwd)
