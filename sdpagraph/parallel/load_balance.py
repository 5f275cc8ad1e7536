"""Load balancing for causal context parallelism: which chunks of the sequence each device holds.

Under a causal mask the last tokens attend to the most keys, so splitting a sequence into `cp`
contiguous pieces gives the last device `2cp - 1` times the work of the first. Cut it into `2cp`
chunks instead and give device i chunks i and 2cp - 1 - i: every device then holds one early and
one late chunk, and the same amount of causal work.

`load_balance` reorders a (global) array so that the plain contiguous split over `cp` devices is
that assignment; `unload_balance` undoes it. Both are one static permutation of chunks, slices
and one concatenation, which XLA partitions into collective permutes and all-to-alls of the
chunks that change device. A sharded array keeps its sharding (with Explicit mesh axes, its type).
"""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from sdpagraph.meshes import explicit_axes


def device_chunks(cp_size: int, load_balanced: bool) -> tuple[tuple[int, ...], ...]:
    """The chunks of the sequence each device holds, in order: ((i,), ...) contiguous, or
    ((i, 2cp - 1 - i), ...) load-balanced (the sequence in `2 * cp_size` chunks)."""
    if not load_balanced:
        return tuple((i,) for i in range(cp_size))
    return tuple((i, 2 * cp_size - 1 - i) for i in range(cp_size))


def balanced_order(cp_size: int) -> np.ndarray:
    """The chunk order of a load-balanced sequence: [0, 2cp-1, 1, 2cp-2, ...]."""
    return np.array([c for pair in device_chunks(cp_size, True) for c in pair], np.int32)


def _check(x: Any, cp_size: Any, seq_axis: int, who: str) -> int:
    if isinstance(cp_size, bool) or not isinstance(cp_size, (int, np.integer)) or cp_size < 1:
        raise ValueError(f"{who}: cp_size must be a positive int (the size of the context-parallel mesh axis), "
                         f"got {cp_size!r}")
    ndim = len(x.shape)
    if not -ndim <= seq_axis < ndim:
        raise ValueError(f"{who}: seq_axis={seq_axis} is out of range for an array of shape {tuple(x.shape)}")
    length = x.shape[seq_axis]
    if length % (2 * cp_size):
        raise ValueError(f"{who}: the sequence length {length} (axis {seq_axis}) must be divisible by "
                         f"2 * cp_size = {2 * cp_size}: it is cut into 2 * cp_size equal chunks")
    return seq_axis % ndim


def _permute_chunks(x: Any, cp_size: int, seq_axis: int, order: np.ndarray) -> Any:
    x = jnp.asarray(x)
    explicit = explicit_axes(x)
    if explicit:  # slices of an Explicit-sharded axis have no type: permute on Auto axes, typed as x
        permute = lambda x: _permute_chunks(x, cp_size, seq_axis, order)  # noqa: E731
        return jax.sharding.auto_axes(permute, axes=explicit, out_sharding=jax.typeof(x).sharding)(x)
    shape = x.shape
    chunks = x.reshape(shape[:seq_axis] + (2 * cp_size, shape[seq_axis] // (2 * cp_size)) + shape[seq_axis + 1:])
    out = jnp.concatenate([jax.lax.slice_in_dim(chunks, c, c + 1, axis=seq_axis) for c in order], axis=seq_axis)
    out = out.reshape(shape)
    if isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer):  # eager: the sharding it came with
        out = jax.device_put(out, x.sharding)
    return out


def load_balance(x: Any, cp_size: int, seq_axis: int = 1) -> Any:
    """Reorder the sequence of `x` for load-balanced causal context parallelism.

    The sequence (axis `seq_axis`, length divisible by `2 * cp_size`) is cut into `2 * cp_size`
    equal chunks and reordered so that device i of a contiguous split over `cp_size` devices holds
    chunks i and `2 * cp_size - 1 - i`. Apply it to q, k, v and segment ids (`seq_axis=1`) before
    `attention(..., context_parallel_axis=..., load_balanced=True)`, and `unload_balance` to the
    output. Example, `cp_size=2`, 8 tokens: `[0 1 2 3 4 5 6 7] -> [0 1 6 7 2 3 4 5]`.
    """
    axis = _check(x, cp_size, seq_axis, "load_balance")
    return _permute_chunks(x, cp_size, axis, balanced_order(cp_size))


def unload_balance(x: Any, cp_size: int, seq_axis: int = 1) -> Any:
    """The inverse of `load_balance`: the sequence back in its natural order."""
    axis = _check(x, cp_size, seq_axis, "unload_balance")
    return _permute_chunks(x, cp_size, axis, np.argsort(balanced_order(cp_size)).astype(np.int32))
