"""sdpagraph attention inside Flax's attention layers.

    import sdpagraph.flax
    layer = flax.nnx.MultiHeadAttention(num_heads=8, in_features=512, decode=False, rngs=rngs,
                                        attention_fn=sdpagraph.flax.attention_fn(score_mod=mods.softcap(30.0)))
    layer = flax.linen.MultiHeadDotProductAttention(num_heads=8,
                                                    attention_fn=sdpagraph.flax.attention_fn(is_causal=True))

Flax needs not be installed to import this module (`pip install sdpagraph[flax]` brings it).
"""
from __future__ import annotations

import math
from typing import Any, Callable

import jax.numpy as jnp

import sdpagraph
from sdpagraph.arguments import normalize_arguments

# Flax's own arguments to an attention_fn; the rest of `attention_kwargs` goes to sdpagraph.attention.
_FLAX_ARGUMENTS = ("bias", "mask", "broadcast_dropout", "dropout_rng", "dropout_rate", "deterministic",
                   "dtype", "precision", "module")


def attention_fn(**attention_kwargs: Any) -> Callable[..., Any]:
    """An `attention_fn=` for `flax.nnx.MultiHeadAttention` and `flax.linen.MultiHeadDotProductAttention`.

    The returned function takes Flax's arguments (query, key, value: `(batch..., length, heads,
    head_dim)`; `bias` and `mask` broadcastable to `(batch..., heads, q_length, kv_length)`, mask True
    = attend, float 0/1 masks accepted) and calls
    `sdpagraph.attention(query, key, value, bias=bias, mask=mask, **attention_kwargs)` (score_mod,
    is_causal, local_window_size, implementation, ...). Several leading batch dims are folded into
    one and unfolded after; inputs without a batch dim are passed as unbatched.

    How Flax's other arguments are taken:
    - dropout: with `dropout_rate > 0` and `deterministic=False`, Flax's `dropout_rng` and
      `dropout_rate` go to `sdpagraph.attention` (docs/dropout.md); `broadcast_dropout` is not honoured:
      every (batch row, head) draws its own mask, as cuDNN does (Flax's default shares one mask over
      the batch and heads; the expectation is the same);
    - `module` (Flax's `sow_weights=True`) raises ValueError: the attention weights are never
      materialized, so they cannot be sown;
    - `dtype` casts query, key and value to it (as Flax's promote_dtype does); `precision` is ignored
      (cuDNN and XLA's attention choose their own precision).
    nnx's `is_causal=True` (from `MultiHeadAttention.__call__`) is or-ed with `attention_kwargs`'.
    """
    clash = sorted(set(attention_kwargs) & set(_FLAX_ARGUMENTS))
    if clash:
        raise TypeError(f"attention_fn() got {clash}: Flax passes these to the attention function itself")

    def sdpagraph_attention(query: Any, key: Any, value: Any, bias: Any = None, mask: Any = None,
                            broadcast_dropout: bool = True, dropout_rng: Any = None, dropout_rate: float = 0.0,
                            deterministic: bool = False, dtype: Any = None, precision: Any = None,
                            module: Any = None, is_causal: bool = False) -> Any:
        del broadcast_dropout, precision
        if dtype is not None:
            query, key, value = (jnp.asarray(x, dtype) for x in (query, key, value))
        kwargs = dict(attention_kwargs)
        if is_causal:
            kwargs["is_causal"] = True
        if mask is not None:
            mask = jnp.asarray(mask).astype(jnp.bool_)
        query, key, value, bias, mask, batch = _fold_batch(query, key, value, bias, mask)
        # Shapes and dtypes first: a wrong array is the error to read, before what the adapter lacks.
        normalize_arguments(query, key, value, bias, mask)
        if dropout_rate > 0.0 and not deterministic:
            kwargs.update(dropout_rate=dropout_rate, dropout_rng=dropout_rng)
        if module is not None:
            raise ValueError("sdpagraph.flax.attention_fn cannot sow attention weights (sow_weights=True): "
                             "sdpagraph never materializes them")
        out = sdpagraph.attention(query, key, value, bias=bias, mask=mask, **kwargs)
        return out if batch is None else jnp.reshape(out, batch + out.shape[1:])

    sdpagraph_attention.attention_kwargs = dict(attention_kwargs)  # type: ignore[attr-defined]
    return sdpagraph_attention


def _fold_batch(query: Any, key: Any, value: Any, bias: Any, mask: Any) -> tuple[Any, ...]:
    """Several leading batch dims folded into one: (query, key, value, bias, mask, the batch dims to
    unfold the output into, or None when there was at most one)."""
    ndim = query.ndim
    if key.ndim != ndim or value.ndim != ndim or ndim < 3:
        raise ValueError(f"query, key and value must be (batch..., length, heads, head_dim) with the same "
                         f"batch dims, got shapes {query.shape}, {key.shape}, {value.shape}")
    if ndim <= 4:
        return query, key, value, bias, mask, None
    batch = query.shape[:-3]
    if key.shape[:-3] != batch or value.shape[:-3] != batch:
        raise ValueError(f"query, key and value must share their batch dims, got shapes {query.shape}, "
                         f"{key.shape}, {value.shape}")
    flat = math.prod(batch)
    fold = lambda x: jnp.reshape(x, (flat,) + x.shape[-3:])  # noqa: E731
    return (fold(query), fold(key), fold(value), _fold_logits(bias, batch, "bias"), _fold_logits(mask, batch, "mask"),
            batch)


def _fold_logits(x: Any, batch: tuple[int, ...], name: str) -> Any:
    """A bias or mask broadcastable to (batch..., N, T, S) as (prod(batch) or 1, N|1, T|1, S|1)."""
    if x is None:
        return None
    x = jnp.asarray(x)
    if x.ndim > len(batch) + 3:
        raise ValueError(f"{name} shape {x.shape} has more dims than (batch..., heads, q_length, kv_length)")
    x = jnp.reshape(x, (1,) * (len(batch) + 3 - x.ndim) + x.shape)
    lead = x.shape[:len(batch)]
    if all(d == 1 for d in lead):
        return jnp.reshape(x, (1,) + x.shape[len(batch):])
    x = jnp.broadcast_to(x, batch + x.shape[len(batch):])
    return jnp.reshape(x, (math.prod(batch),) + x.shape[len(batch):])
