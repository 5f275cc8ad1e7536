"""Halo pieces between the devices of a halo call: where each device's piece comes from (`Route`),
the pieces received (`receive`), and their gradients sent back and added where the pieces came from
(`send_back`).

`send_back` adds each gradient into the `length` tokens it belongs to, in place. Autodiff's transpose
of `receive` gives the whole block's gradient instead (the piece padded with zeros), which the caller
then adds to its own: two passes over every token of k and v a step for a piece of a few of them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp

from sdpagraph.parallel.transfer import permute_pair


@dataclass(frozen=True)
class Route:
    """How each device gets the `length` tokens from `offset` of a block of `block` tokens (static).
    `sources`: the candidate pieces, each (slots, pairs): `slots[d]` the slot of the block device d
    takes (or sends) its piece from, `pairs` the (sender, receiver) transfers, empty for a slice of
    the device's own other block. `choice[d]`: the candidate device d keeps."""

    block: int
    offset: int
    length: int
    sources: tuple[tuple[tuple[int, ...], tuple[tuple[int, int], ...]], ...]
    choice: tuple[int, ...]


def route(block: int, wanted: list, offset: int, length: int) -> Route:
    """The route of a piece: `wanted[d]` = (device, slot) of the block device d reads it from, or None
    (it takes anything there: its case never reads it). Pieces of another device's block travel in
    as many rounds as one device has pieces to send; a piece of the device's own block is a slice."""
    sources, choice = [], [0] * len(wanted)
    own = {d: w[1] for d, w in enumerate(wanted) if w is not None and w[0] == d}
    if own:
        sources.append((tuple(own.get(d, 0) for d in range(len(wanted))), ()))
    remote = {d: w for d, w in enumerate(wanted) if w is not None and w[0] != d}
    while remote:
        round_, senders = {}, set()
        for d, (source, slot) in remote.items():
            if source not in senders:
                round_[d], senders = (source, slot), senders | {source}
        slots = [0] * len(wanted)
        for source, slot in round_.values():
            slots[source] = slot
        sources.append((tuple(slots), tuple((source, d) for d, (source, _) in round_.items())))
        for d in round_:
            choice[d] = len(sources) - 1
            del remote[d]
    return Route(block, offset, length, tuple(sources), tuple(choice))


def _start(r: Route, slots: tuple[int, ...], me: Any) -> Any:
    """Where this device's piece of `slots` starts in its tokens (a Python int where every device's
    is the same)."""
    if len(set(slots)) == 1:
        return slots[0] * r.block + r.offset
    return jnp.asarray(slots, jnp.int32)[me] * r.block + r.offset


def receive(r: Route, axis: Any, kv: tuple[Any, Any]) -> tuple[Any, Any]:
    """This device's piece of k and v (B, length, ...), from `kv` (its tokens, (B, slots·block, ...))."""
    me = jax.lax.axis_index(axis)
    candidates = []
    for slots, pairs in r.sources:
        start = _start(r, slots, me)
        piece = tuple(jax.lax.dynamic_slice_in_dim(x, start, r.length, axis=1) for x in kv)
        candidates.append(permute_pair(piece, axis, list(pairs)) if pairs else piece)
    if len(candidates) == 1:
        return candidates[0]
    which = jnp.asarray(r.choice, jnp.int32)[me]
    return tuple(jax.lax.select_n(which, *(c[i] for c in candidates)) for i in range(len(kv)))


def send_back(r: Route, axis: Any, grads: tuple[Any, Any], kv_grads: tuple[Any, Any]) -> tuple[Any, Any]:
    """`kv_grads` (this device's dk, dv) with the gradients of the pieces `receive` gave (`grads`, on the
    devices that read them) added where those pieces came from: the transpose of `receive`, in place."""
    me = jax.lax.axis_index(axis)
    which = jnp.asarray(r.choice, jnp.int32)[me] if len(r.sources) > 1 else None
    for index, (slots, pairs) in enumerate(r.sources):
        mine = grads if which is None else tuple(jnp.where(which == index, g, jnp.zeros_like(g)) for g in grads)
        if pairs:  # devices that sent nothing this round receive zeros and add them
            mine = permute_pair(mine, axis, [(receiver, sender) for sender, receiver in pairs])
        start = _start(r, slots, me)
        kv_grads = tuple(add_rows(x, g, start) for x, g in zip(kv_grads, mine))
    return kv_grads


def add_rows(x: Any, rows: Any, start: Any) -> Any:
    """`x` with `rows` added to its tokens from `start` (axis 1), in place. The optimization barrier
    keeps XLA 0.11 on GPUs from fusing the update with the graph call that produced `x`, which it
    then failed to compile ("DynamicSliceFusion: DUS target must be a fusion parameter"); of the
    forms that compile, a scatter-add was the fastest on 2 H100s (bench/probe_halo_in_place.py)."""
    x, rows = jax.lax.optimization_barrier((x, rows))
    index = jnp.reshape(jnp.asarray(start, jnp.int32), (1,))
    numbers = jax.lax.ScatterDimensionNumbers(update_window_dims=tuple(range(x.ndim)), inserted_window_dims=(),
                                              scatter_dims_to_operand_dims=(1,))
    return jax.lax.scatter_add(x, index, rows.astype(x.dtype), numbers, indices_are_sorted=True,
                               unique_indices=True, mode="promise_in_bounds")
