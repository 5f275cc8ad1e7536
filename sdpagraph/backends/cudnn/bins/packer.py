"""First-fit decreasing packing of documents into bins, on the device, for `backends.cudnn.bins.packed`.

    pack(lengths, rows, bins, interpret=False) -> (bin, offset)
    formulation() -> str

`lengths` (D,) int32 are the documents' lengths in decreasing order (0 past the last document).
Each document goes whole into a bin of `rows` tokens: `bin[d]` (>= `bins` when it fits in none,
the caller's sign to run unbinned) at token `offset[d]`.

- Documents longer than `rows // SMALL_SHARE` are placed one after another by one Pallas (Triton)
  program, each into the first bin it fits in: a loop over those documents (at most
  `SMALL_SHARE` per bin) over vectors in registers (the lengths, the bins' fill, the answers).
- The shorter ones, laid end to end by a prefix sum, fill the room the long ones left, then new
  bins: a bin takes the documents that start in its room less `rows // SMALL_SHARE` tokens, so
  none crosses its end.

Why a kernel: the loop is sequential, and XLA runs a `lax.fori_loop` outside a kernel as a few
kernel launches per step. Why the short documents apart: a step per document however short would
make many short documents cost as much as many long ones.

Where jax no longer lowers Pallas with Triton (`backends.pallas_triton`: jax 0.11 deprecates it),
the same loop runs as XLA's `lax.fori_loop` instead: the same integers, slower.
"""
from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

from sdpagraph.backends import pallas_triton
from sdpagraph.meshes import struct_like, varying_like

SMALL_SHARE = 16


def _power_of_two_at_least(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def pack(lengths: Any, rows: int, bins: int, interpret: bool = False) -> tuple[Any, Any]:
    """(bin (D,), offset (D,)) int32 of documents whose lengths (D,) decrease (module docstring)."""
    count = lengths.shape[0]
    long = lengths > rows // SMALL_SHARE
    # At most SMALL_SHARE long documents per bin's worth of tokens fit the bins: the kernel sees only
    # the first `head` lengths (the longest), and one longer than that cannot fit anyway.
    head = min(count, SMALL_SHARE * bins + 1)
    size = _power_of_two_at_least(head)  # Triton's block shapes are powers of two
    first = jnp.zeros((size,), jnp.int32).at[:head].set(lengths[:head].astype(jnp.int32))
    first = jnp.where(first > rows // SMALL_SHARE, first, 0)  # the kernel places the long ones only
    slots = _power_of_two_at_least(bins)  # the kernel's bins vector; also its "no room" answer
    bin_head, offset_head, fill = _first_fit(first, rows, bins, slots, interpret)
    bin_long = jnp.full((count,), slots, jnp.int32).at[:head].set(bin_head[:head])
    offset_long = jnp.zeros((count,), jnp.int32).at[:head].set(offset_head[:head])
    used = jnp.max(jnp.where(long, bin_long, -1)) + 1  # bins the long documents opened
    bin_short, offset_short = _short_documents(jnp.where(long, 0, lengths), fill, used, rows)
    return (jnp.where(long, bin_long, bin_short).astype(jnp.int32),
            jnp.where(long, offset_long, offset_short).astype(jnp.int32))


def _short_documents(short: Any, fill: Any, used: Any, rows: int) -> tuple[Any, Any]:
    """(bin, offset) of the short documents (`short`: their lengths, 0 for the others), laid end to
    end: first over the room the long documents left in their bins, then over new bins after
    `used`. A bin takes the documents that start in its room less `rows // SMALL_SHARE` tokens, so
    none crosses its end."""
    margin = rows // SMALL_SHARE
    room = jnp.where(jnp.arange(fill.shape[0]) < used, jnp.maximum(rows - fill - margin, 0), 0)
    room_start = jnp.cumsum(room) - room
    total = jnp.sum(room)
    start = jnp.cumsum(short) - short
    # The last bin whose room starts at or before each document: one compare per (document, bin),
    # fused, where jnp.searchsorted's binary search is a loop of kernels on a GPU.
    gap = jnp.clip(jnp.sum(room_start[None, :] <= start[:, None], axis=1) - 1, 0, fill.shape[0] - 1)
    beyond = start - total
    stride = rows - margin
    in_gaps = start < total
    return (jnp.where(in_gaps, gap, used + beyond // stride),
            jnp.where(in_gaps, fill[gap] + start - room_start[gap], beyond % stride))


def formulation() -> str:
    """How the long documents are placed in this process (`pack`), as a clause for support answers."""
    triton = pallas_triton.status()
    if triton.available:
        return "the bin packer runs as one Pallas Triton kernel"
    return f"{triton.reason}; the bin packer runs its XLA formulation (a loop of kernels)"


def _first_fit(lengths: Any, rows: int, bins: int, slots: int, interpret: bool) -> tuple[Any, Any, Any]:
    """`_place` as one Pallas (Triton) program, in Pallas' interpreter with `interpret` (tests on a
    CPU), or as XLA's loop off GPUs and where this jax lowers no Triton kernels."""
    placement = functools.partial(_place, rows=rows, bins=bins, slots=slots)
    if not interpret and (jax.default_backend() != "gpu" or not pallas_triton.status().available):
        return placement(lengths)
    from jax.experimental import pallas as pl

    def kernel(length_ref, bin_ref, offset_ref, fill_ref):
        bin_of, offset_of, fill = placement(length_ref[...])
        bin_ref[...] = bin_of
        offset_ref[...] = offset_of
        fill_ref[...] = fill

    size = lengths.shape[0]
    out_shape = [struct_like((size,), jnp.int32, [lengths])] * 2 + [struct_like((slots,), jnp.int32, [lengths])]
    params = pallas_triton.compiler_params(1, interpret)
    return pl.pallas_call(kernel, out_shape=out_shape, compiler_params=params, interpret=interpret)(lengths)


def _place(lengths: Any, *, rows: int, bins: int, slots: int) -> tuple[Any, Any, Any]:
    """(bin, offset, fill): the documents with a nonzero length (a prefix of `lengths`), each into
    the first of `bins` bins with room for it (`slots` >= bins, a power of two; a document with no
    room gets `slots`); `fill`: the tokens each bin then holds. In a kernel, everything stays in
    registers."""
    size = lengths.shape[0]
    doc = jnp.arange(size, dtype=jnp.int32)
    slot = jnp.arange(slots, dtype=jnp.int32)
    count = jnp.sum((lengths > 0).astype(jnp.int32))

    def place(d, carry):
        fill, bin_of, offset_of = carry
        length = jnp.sum(jnp.where(doc == d, lengths, 0))
        room = (fill + length <= rows) & (slot < bins)
        chosen = jnp.min(jnp.where(room, slot, slots))
        here = slot == chosen
        offset = jnp.sum(jnp.where(here, fill, 0))
        return (jnp.where(here, fill + length, fill), jnp.where(doc == d, chosen, bin_of),
                jnp.where(doc == d, offset, offset_of))

    # The loop's carry varies over the manual mesh axes the lengths vary over (inside a shard_map).
    start = (jnp.zeros((slots,), jnp.int32), jnp.full((size,), slots, jnp.int32), jnp.zeros((size,), jnp.int32))
    fill, bin_of, offset_of = jax.lax.fori_loop(0, count, place, tuple(varying_like(x, [lengths]) for x in start))
    return bin_of, offset_of, fill
