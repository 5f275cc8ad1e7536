"""Paged K/V for serving: `attention(q, k_pages, v_pages, page_table=pt, key_value_seq_lengths=lens)`.

    k_pages, v_pages: (num_pages, page_size, K, H)      a pool of pages, in attention's BSHD order
    page_table:       (B, max_pages) int32                 sequence b's pages, in order
    key_value_seq_lengths: (B,) int32                       sequence b's keys: its first lens[b] tokens

Sequence b's keys are the pages pt[b, 0], pt[b, 1], ... concatenated. A paged call is the same call
on the logical keys (B, S = max_pages * page_size, K, H): `prepare_paged_call` validates the pool and
the table, then prepares that call (every other argument means what it means without pages), with
`spec.paged = (num_pages, page_size)` and the table in `RuntimeInputs.page_table`. Under `jit` the
table and the lengths are traced: new tables and lengths reuse the graph. Inference only: a gradient
through a paged call raises `PagedGradientError`.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from sdpagraph.call import PreparedCall, prepare_call
from sdpagraph.errors import SdpagraphError
from sdpagraph.gradients import without_gradient


class PagedGradientError(SdpagraphError, NotImplementedError):
    """A paged call was differentiated: paged attention is inference-only (serving)."""


def _shape(x: Any, argname: str) -> tuple[int, ...]:
    if not (hasattr(x, "shape") and hasattr(x, "dtype")):
        raise TypeError(f"{argname} must be an array or jax.ShapeDtypeStruct, got {type(x).__name__}")
    return tuple(int(d) for d in x.shape)


def _concrete(x: Any) -> np.ndarray | None:
    """`x`'s values when known now (not traced), else None."""
    if isinstance(x, (jax.core.Tracer, jax.ShapeDtypeStruct)):
        return None
    try:
        return np.asarray(x)
    except (TypeError, jax.errors.ConcretizationTypeError):
        return None


def check_pages(k_pages: Any, v_pages: Any, page_table: Any, batch: int) -> tuple[int, int, int]:
    """Validate the pools and the table against a query batch `batch`; (num_pages, page_size, max_pages)."""
    k_shape, v_shape = _shape(k_pages, "key"), _shape(v_pages, "value")
    if len(k_shape) != 4 or len(v_shape) != 4:
        raise ValueError("with page_table, key and value are page pools of shape (num_pages, page_size, K, H); got "
                         f"key {k_shape}, value {v_shape}")
    if k_shape[:3] != v_shape[:3]:
        raise ValueError(f"key and value pools must share (num_pages, page_size, K): key {k_shape}, value {v_shape}")
    num_pages, page_size = k_shape[:2]
    if num_pages == 0 or page_size == 0:
        raise ValueError(f"the page pools are empty: key shape {k_shape} (num_pages, page_size, K, H)")
    table_shape = _shape(page_table, "page_table")
    if len(table_shape) != 2 or table_shape[0] != batch or table_shape[1] == 0:
        raise ValueError(f"page_table must have shape (B, max_pages) = ({batch}, max_pages >= 1), got {table_shape}")
    if not np.issubdtype(np.dtype(page_table.dtype), np.integer):
        raise TypeError(f"page_table must be an int32 array, got dtype {page_table.dtype}")
    values = _concrete(page_table)
    if values is not None and (values.min() < 0 or values.max() >= num_pages):
        raise ValueError(f"page_table entries must lie in [0, num_pages) = [0, {num_pages}), got values in "
                         f"[{values.min()}, {values.max()}]")
    return num_pages, page_size, table_shape[1]


def prepare_paged_call(query: Any, k_pages: Any, v_pages: Any, page_table: Any, bias: Any = None, mask: Any = None,
                       **kwargs: Any) -> PreparedCall:
    """`call.prepare_call` of a paged call (module docstring): validated, its spec paged."""
    q_shape = _shape(query, "query")
    if len(q_shape) != 4:
        raise ValueError(f"a paged call takes a 4-D query (B, T, N, H), got shape {q_shape}")
    num_pages, page_size, max_pages = check_pages(k_pages, v_pages, page_table, q_shape[0])
    if kwargs.get("segment_ids") is not None:
        raise ValueError("segment_ids cannot be combined with page_table: each sequence's keys are its pages; pass "
                         "query_seq_lengths / key_value_seq_lengths")
    logical = lambda pool: jax.ShapeDtypeStruct((q_shape[0], max_pages * page_size) + tuple(pool.shape[2:]),  # noqa: E731
                                                pool.dtype)
    if kwargs.get("is_causal") and q_shape[1] == 1 and kwargs.get("causal_alignment") == "bottom_right":
        kwargs["is_causal"] = False  # one query at the end of its sequence: no key lies in its future
    call = prepare_call(query, logical(k_pages), logical(v_pages), bias, mask, **kwargs)
    spec = dataclasses.replace(call.spec, paged=(num_pages, page_size))
    table = jnp.clip(jnp.asarray(page_table, jnp.int32), 0, num_pages - 1)  # traced entries too: never out of the pool
    return dataclasses.replace(call, spec=spec, inputs=dataclasses.replace(call.inputs, page_table=table))


def gather(pages: Any, page_table: Any) -> Any:
    """The logical keys (or values) (B, max_pages * page_size, K, H) of a pool and its table."""
    gathered = jnp.take(pages, page_table, axis=0)  # (B, max_pages, page_size, K, H)
    b, m, p = gathered.shape[:3]
    return gathered.reshape((b, m * p) + gathered.shape[3:])


def inference_only(q: Any, k: Any, v: Any) -> tuple[Any, Any, Any]:
    """q, k, v as given; differentiating through them raises `PagedGradientError`."""
    return without_gradient(PagedGradientError(
        "paged attention (page_table=) is inference-only: it has no gradient. Train on the dense K/V (key/value "
        "of shape (B, S, K, H), without page_table)"), q, k, v)
