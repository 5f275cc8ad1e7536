"""Guards for calls that have no gradient (paged K/V, FP8 attention): differentiating through them raises
the call's own error instead of a silent zero or a cryptic trace.

    without_gradient(error, *arrays) -> arrays            the arrays as given; a gradient through them raises
    call_without_gradient(error, fn, arrays) -> fn(arrays) fn's result; differentiating it raises, and JAX
                                                           never differentiates fn (an FFI call without a rule)
"""
from __future__ import annotations

import functools
from typing import Any, Callable

import jax


def without_gradient(error: Exception, *arrays: Any) -> tuple[Any, ...]:
    """`arrays` as given; a gradient through any of them raises `error`."""
    return call_without_gradient(error, lambda given: given, arrays)


def call_without_gradient(error: Exception, fn: Callable[[Any], Any], arrays: Any) -> Any:
    """fn(arrays) (`arrays` a pytree of every traced value fn reads); a gradient through it raises `error`."""
    return _guard(error, fn, arrays)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _guard(error: Exception, fn: Callable[[Any], Any], arrays: Any) -> Any:
    return fn(arrays)


def _guard_fwd(error, fn, arrays):
    return fn(arrays), None


def _guard_bwd(error, fn, _, cotangents):
    raise error


_guard.defvjp(_guard_fwd, _guard_bwd)
