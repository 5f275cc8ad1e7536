"""Halo pieces between the devices of a halo call: where each device's piece comes from (`Route`),
the pieces received (`receive`), and their gradients sent back and added where the pieces came from
(`send_back`).

`send_back` adds each gradient into the `length` tokens it belongs to, in place. Autodiff's transpose
of `receive` gives the whole block's gradient instead (the piece padded with zeros), which the caller
then adds to its own: two passes over every token of k and v a step for a piece of a few of them.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Sequence

import jax
import jax.numpy as jnp

from sdpagraph.parallel.row_updates import add_rows
from sdpagraph.parallel.transfer import permute_pair, permute_stacked


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


@dataclass(frozen=True)
class Transfer:
    """One `ppermute` carrying the remote pieces of several routes (`transfers`): `slots[d]` the slot
    of the block device d sends from, `pairs` the (sender, receiver) pairs, `takes[d]` the (route,
    source) whose piece device d receives, or None."""

    slots: tuple[int, ...]
    pairs: tuple[tuple[int, int], ...]
    takes: tuple[tuple[int, int] | None, ...]


def transfers(routes: Sequence[Route | None]) -> tuple[Transfer, ...]:
    """The remote sources of `routes` (pieces of equal offset and length) packed into as few
    transfers as keep every device sending and receiving at most once in each: XLA overlaps one
    transfer at a time with compute, so a second one of its own waits on the compute stream
    (`transfer.paired`). A load-balanced halo's two slots then take one transfer, not two."""
    groups: list[dict] = []
    devices = len(next(r for r in routes if r is not None).choice)
    for index, r in enumerate(routes):
        for source, (slots, pairs) in enumerate(() if r is None else r.sources):
            if not pairs:
                continue
            senders, receivers = {a for a, _ in pairs}, {b for _, b in pairs}
            group = next((g for g in groups if not g["senders"] & senders and not g["receivers"] & receivers), None)
            if group is None:
                group = {"senders": set(), "receivers": set(), "slots": [0] * devices, "pairs": [],
                         "takes": [None] * devices}
                groups.append(group)
            group["senders"] |= senders
            group["receivers"] |= receivers
            group["pairs"] += pairs
            for sender in senders:
                group["slots"][sender] = slots[sender]
            for receiver in receivers:
                group["takes"][receiver] = (index, source)
    return tuple(Transfer(tuple(g["slots"]), tuple(g["pairs"]), tuple(g["takes"])) for g in groups)


def _piece(r: Route, slots: tuple[int, ...], kv: tuple[Any, ...], me: Any) -> tuple[Any, ...]:
    start = _start(r, slots, me)
    return tuple(jax.lax.dynamic_slice_in_dim(x, start, r.length, axis=1) for x in kv)


def _shape_of(routes: Sequence[Route | None]) -> Route:
    """A route of `routes` (all of one block, offset and length: the transfers mix their pieces)."""
    given = [r for r in routes if r is not None]
    assert len({(r.block, r.offset, r.length) for r in given}) == 1, given
    return given[0]


def receive(routes: Sequence[Route | None], axis: Any, kv: tuple[Any, Any]) -> list[tuple[Any, Any] | None]:
    """Per route, this device's piece of k and v (B, length, ...) from `kv` (its tokens,
    (B, slots·block, ...)); None for a None route."""
    me, shape = jax.lax.axis_index(axis), _shape_of(routes)
    arrived = {}
    for t in transfers(routes):
        moved = permute_pair(_piece(shape, t.slots, kv, me), axis, list(t.pairs))
        arrived.update({take: moved for take in t.takes if take is not None})
    pieces = []
    for index, r in enumerate(routes):
        if r is None:
            pieces.append(None)
            continue
        candidates = [arrived[(index, source)] if pairs else _piece(r, slots, kv, me)
                      for source, (slots, pairs) in enumerate(r.sources)]
        if len(candidates) == 1:
            pieces.append(candidates[0])
            continue
        which = jnp.asarray(r.choice, jnp.int32)[me]
        pieces.append(tuple(jax.lax.select_n(which, *(c[i] for c in candidates)) for i in range(len(kv))))
    return pieces


def send_back(routes: Sequence[Route | None], axis: Any, grads: Sequence[Any],
              kv_grads: tuple[Any, Any]) -> tuple[Any, Any]:
    """`kv_grads` (this device's dk, dv) with the gradients of the pieces `receive` gave (`grads[i]`
    for route i, on the devices that read them: the pair (dk, dv), or both stacked (2, B, length,
    ...) as one transfer takes them) added where those pieces came from: the transpose of
    `receive`, in place, in the same transfers."""
    me, shape = jax.lax.axis_index(axis), _shape_of(routes)

    def kept(index, source):  # route `index`'s gradient where this device read source `source`, else 0
        r, g = routes[index], grads[index]
        if len(r.sources) == 1:
            return g
        chosen = jnp.asarray(r.choice, jnp.int32)[me] == source
        return jax.tree.map(lambda x: jnp.where(chosen, x, jnp.zeros_like(x)), g)

    for index, r in enumerate(routes):
        for source, (slots, pairs) in enumerate(() if r is None else r.sources):
            if not pairs:  # a slice of the device's own other block
                kv_grads = add_rows(kv_grads, kept(index, source), _start(r, slots, me))
    for t in transfers(routes):
        # The piece a transfer brings a device is every one of its routes' candidate (`receive`): the
        # device sends back the sum of their gradients where they chose it (one, where it received;
        # those of routes it does not read are zero in the halo's use, but summed all the same).
        takes = sorted({take for take in t.takes if take is not None})
        back = functools.reduce(lambda a, b: jax.tree.map(jnp.add, a, b), (kept(*take) for take in takes))
        # devices that sent nothing in this transfer receive zeros: their kernel skips them
        moved = permute_stacked(back, axis, [(receiver, sender) for sender, receiver in t.pairs])
        senders = {sender for sender, _ in t.pairs}
        sent = jnp.asarray([d in senders for d in range(len(t.slots))])[me]
        kv_grads = add_rows(kv_grads, moved, _start(shape, t.slots, me), sent)
    return kv_grads
