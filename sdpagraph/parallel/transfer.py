"""Transfers between the devices of a context-parallel call."""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from sdpagraph.meshes import explicit_axes


def stackable(a: Any, b: Any) -> bool:
    """Whether two arrays stack into one (same shape and dtype)."""
    return a.shape == b.shape and a.dtype == b.dtype


def paired(a: Any, b: Any) -> Any:
    """Two arrays as one for a transfer (stacked where their shapes and dtypes match, else the pair;
    either way `x[0]`, `x[1]` give them back): XLA overlaps one transfer at a time with compute, so
    a second one of its own would wait on the compute stream (seen on 2 H100s: the ring's keys went
    while its values waited)."""
    if not stackable(a, b):
        return a, b
    if explicit_axes(a):  # a flat reshape would move a typed batch split onto the stacking dim
        return jnp.stack([a, b])
    # Concatenated flat, then shaped: XLA's GPU emitter runs this near a copy's speed (2.8 TB/s on an
    # H100), where jnp.stack's concatenation along a new leading dim ran at 1.6 TB/s
    # (bench/probe_stack.py).
    return jnp.concatenate([a.reshape(-1), b.reshape(-1)]).reshape((2, *a.shape))


def grads_to_send(backend: Any, static: Any, q, k, v, operands, o, lse, d_o,
                  zero_unwritten: bool = False) -> tuple[Any, Any]:
    """(dq, dk and dv as one transfer takes them) of a block's backward on `backend`: the graph writes
    dk and dv stacked (2, B, S, K, H) where they stack (`block_backward_stacked`), so sending them on
    needs no stacking pass; else the pair (dk, dv), `paired` at the transfer."""
    if not stackable(k, v):
        dq, dk, dv = backend.block_backward(static, q, k, v, operands, o, lse, d_o, zero_unwritten)
        return dq, (dk, dv)
    return backend.block_backward_stacked(static, q, k, v, operands, o, lse, d_o)


def permute_stacked(pair: Any, axis: Any, pairs: list[tuple[int, int]]) -> Any:
    """`jax.lax.ppermute` of two arrays as one transfer: a pair (`paired`), or both already stacked
    (one array); what arrives as it travelled (`x[0]`, `x[1]` give the two)."""
    return jax.lax.ppermute(pair if hasattr(pair, "shape") else paired(*pair), axis, pairs)


def permute_pair(pair: Any, axis: Any, pairs: list[tuple[int, int]]) -> tuple[Any, Any]:
    """`permute_stacked`, the two arrays apart."""
    moved = permute_stacked(pair, axis, pairs)
    return moved[0], moved[1]
