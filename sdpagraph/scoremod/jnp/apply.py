"""Running a jax.numpy score_mod / mask_mod on XLA by calling the Python function itself: the way
every mod runs there, converted into the IR (`scoremod.jnp.convert`) or not."""
from __future__ import annotations

from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp


def apply_jnp_score_mod(fn: Callable, score: Any, index: Sequence[Any]) -> Any:
    """The XLA way to run a jnp score_mod: `fn` applied to every element of `score`.

    `index` holds the b, h, q_idx, kv_idx arrays, broadcastable to `score`'s (B, N, T, S) shape
    (per-segment positions when sequences are packed). Works for any mod, converted or not.
    """
    score = jnp.asarray(score)
    flat = [jnp.broadcast_to(jnp.asarray(i, jnp.int32), score.shape).reshape(-1) for i in index]
    out = jax.vmap(fn)(score.reshape(-1), *flat)
    return jnp.reshape(out, score.shape)


def apply_jnp_mask_mod(fn: Callable, index: Sequence[Any], shape: Sequence[int]) -> Any:
    """The XLA way to run a jnp mask_mod: a boolean array of `shape` (True = attend)."""
    flat = [jnp.broadcast_to(jnp.asarray(i, jnp.int32), tuple(shape)).reshape(-1) for i in index]
    return jnp.reshape(jax.vmap(fn)(*flat), tuple(shape))
