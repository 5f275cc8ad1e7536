"""Packed-sequence (THD) metadata from ``segment_ids``, in O(T) memory.

Input convention
----------------
``segment_ids`` is an integer array of shape ``(B, T)``.  ``0`` marks padding;
any other value labels a segment.  Ids need not be consecutive or sorted
(``[3, 3, 7, 7, 7, 0, 0]`` holds two segments).

**A segment is a maximal contiguous run of equal nonzero ids.**  An id that
reappears after a different id or after padding starts a *new* segment:
``[1, 1, 2, 1]`` holds three segments of lengths 2, 1, 1, and ``[5, 0, 5]``
holds two.  This is what a packed-sequence kernel (cuDNN THD) can represent
-- each segment is one ``(offset, length)`` pair -- so the helpers never
merge non-adjacent tokens into one sequence.  Padding may appear between
segments and at the tail.

Segments are numbered ``0, 1, 2, ...`` in order of appearance within their
row.  The functions here do no value checks (values are traced); negative
ids are treated like any other nonzero id.  Validating ids is the job of the
caller's input checks.

Output conventions (chosen to match cuDNN's THD inputs)
-------------------------------------------------------
cuDNN takes per-sequence lengths (``seq_len_q``/``seq_len_kv``) and ragged
start offsets.  Flattening ``[B, M]`` into ``B * M`` sequences must give
valid cuDNN inputs without a compaction step, so unused slots are *empty
sequences*, not sentinels:

* ``seq_lens[b, k]`` -- length of segment ``k`` of row ``b``; **0** for
  ``k >= num_segments[b]``.  Never negative.
* ``offsets[b, k]`` -- token index (within the row) where segment ``k``
  starts.  For ``k >= min(num_segments[b], M)`` (including the extra last
  column) it holds the **end** of the last kept segment (its start plus its
  length), or 0 for a row of only padding.  Offsets are therefore
  non-decreasing, and an unused slot has ``offsets[k + 1] - offsets[k] == 0``.
  ``seq_lens`` is authoritative: with padding *between* segments the
  offset difference of a used slot also spans that gap.

Rows with more than ``max_segments`` segments
---------------------------------------------
Only the first ``max_segments`` segments are described; later segments are
**dropped** (absent from ``seq_lens`` and ``offsets``, as if they were
padding).  They are never merged into the last kept segment, which would let
tokens of different sequences attend to each other.  ``num_segments`` holds
the true, unclipped count so callers can validate without ``checkify``::

    meta = segment_metadata(ids, max_segments)
    overflow = jnp.any(meta.num_segments > max_segments)

``sdpagraph.attention`` does not let that happen silently: concrete ids with
too many segments raise a ``ValueError`` when the call is made; for traced
ids (under ``jit``) ``rows_over_segment_bound`` flags the rows on the device
and their output becomes NaN, or, with ``SDPAGRAPH_CHECK_SEGMENTS=raise``,
``check_segment_bound`` raises when the call runs (a host callback).
Segments longer than the ``max_seqlen_q`` / ``max_seqlen_kv`` hints likewise
(``rows_over_segment_length``, ``check_segment_lengths``).  Nothing is
checked with ``SDPAGRAPH_CHECK_SEGMENTS=off``.

Memory
------
Everything is built from elementwise ops, cumulative sums/maxima along T
and one scatter into ``M`` slots per row: no ``(T, T)``, ``(T, M)`` or
``(B, T, M)`` intermediate.  ``bench/segments_memory.py`` measures it.
"""

from __future__ import annotations

import functools
import operator
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from sdpagraph.logs import logger
from sdpagraph.segments.rules import (segment_check_mode, segment_checks_enabled, segment_length_message,
                                       segment_overflow_message)

__all__ = [
    "at_runs",
    "SegmentMetadata",
    "check_segment_bound",
    "check_segment_lengths",
    "rows_over_segment_bound",
    "rows_over_segment_length",
    "segment_check_mode",
    "segment_checks_enabled",
    "segment_metadata",
    "segment_positions",
    "segment_run_ids",
]


class SegmentMetadata(NamedTuple):
    """Per-row THD metadata; see the module docstring for conventions.

    Attributes:
      seq_lens: ``[B, M]`` int32, length of each segment, 0-padded.
      offsets: ``[B, M + 1]`` int32, start token of each segment; unused
        entries (and the last column) hold the end of the last kept segment.
      num_segments: ``[B]`` int32, the true segment count of each row, which
        may exceed ``M``; segments past ``M`` are dropped.
    """

    seq_lens: jax.Array
    offsets: jax.Array
    num_segments: jax.Array


def _check_segment_ids(segment_ids) -> None:
    """Static (shape/dtype) checks only; values are traced."""
    if segment_ids.ndim != 2:
        raise ValueError(
            f"segment_ids must have shape (B, T); got shape {segment_ids.shape}"
        )
    if not jnp.issubdtype(segment_ids.dtype, jnp.integer):
        raise TypeError(
            f"segment_ids must be an integer array; got dtype {segment_ids.dtype}"
        )


def _static_count(max_segments) -> int:
    """``max_segments`` as a Python int; a traced value cannot size arrays."""
    if isinstance(max_segments, bool):
        raise TypeError("max_segments must be a static int; got a bool")
    try:
        return operator.index(max_segments)
    except TypeError:
        raise TypeError(
            "max_segments must be a static int (mark it static under jax.jit); "
            f"got {type(max_segments).__name__}"
        ) from None


def _run_edges(segment_ids: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(B, T)`` bools: (token begins a segment, token ends a segment).

    A token begins (ends) a segment when it is not padding and differs from
    the token before (after) it; the row's edges compare against padding.
    """
    valid = segment_ids != 0
    # Pad then slice (rather than slice then pad) so that T == 0 works.
    previous = jnp.pad(segment_ids, ((0, 0), (1, 0)))[:, :-1]
    following = jnp.pad(segment_ids, ((0, 0), (0, 1)))[:, 1:]
    return valid & (segment_ids != previous), valid & (segment_ids != following)


def segment_run_ids(segment_ids: jax.Array) -> jax.Array:
    """``(B, T)`` int32: 1-based index of each token's segment, 0 for padding.

    Unlike the raw ids, these are unique per contiguous run, so
    ``run[q] == run[k] != 0`` is the exact "same segment" test for
    self-attention even when an id reappears later in the row.
    """
    _check_segment_ids(segment_ids)
    # The running count of starts numbers the runs; padding tokens inherit
    # the count of the run before them, so they are zeroed explicitly.
    run = jnp.cumsum(_run_edges(segment_ids)[0], axis=1, dtype=jnp.int32)
    return jnp.where(segment_ids != 0, run, 0)


def segment_positions(segment_ids: jax.Array) -> jax.Array:
    """``(B, T)`` int32: each token's position from its segment's start.

    Padding tokens get 0.  Use these in place of absolute positions for
    per-segment causal, window and chunk masks and for ``gen_index`` in
    packed mode.
    """
    _check_segment_ids(segment_ids)
    t = jnp.arange(segment_ids.shape[1], dtype=jnp.int32)
    # Carry the index of the most recent segment start forward along T:
    # start indices increase, so a running maximum finds it in O(T).
    start_index = jnp.where(_run_edges(segment_ids)[0], t, 0)
    run_start = jax.lax.cummax(start_index, axis=1)
    return jnp.where(segment_ids != 0, t - run_start, 0)


def at_runs(per_segment: jax.Array, run_ids: jax.Array) -> jax.Array:
    """``per_segment[b, r - 1]`` at each token of run number ``r`` (``segment_run_ids``): e.g. the
    length (``SegmentMetadata.seq_lens``) or start (``offsets``) of each token's segment.  Padding
    (``r = 0``) gets 0; a run past the table's ``M`` columns gets column ``M``'s value.  O(T)."""
    m = per_segment.shape[1]
    table = jnp.concatenate([jnp.zeros_like(per_segment[:, :1]), per_segment], axis=1)
    return jnp.take_along_axis(table, jnp.minimum(run_ids, m), axis=1)


def _nth_true(flags: jax.Array, count: int) -> jax.Array:
    """``[B, count]`` int32: index of the 1st, 2nd, ... True in each row.

    The running count of ``flags`` ranks each True, so one scatter puts each
    True's index into its rank's slot (ranks past ``count`` are dropped):
    O(T) work in two kernels, no ``(T, count)`` comparison.  (A binary
    search per slot, ``searchsorted(method="scan")``, was a loop of small
    kernels: 0.7 ms on an H100 at B4 T4096, more than the attention itself.)
    Missing entries come back as ``T``.
    """
    length = flags.shape[1]
    index = jnp.arange(length, dtype=jnp.int32)

    def row(flags_row: jax.Array) -> jax.Array:
        slot = jnp.where(flags_row, jnp.cumsum(flags_row, dtype=jnp.int32) - 1, count)  # not a True: dropped
        return jnp.full((count,), length, jnp.int32).at[slot].set(index, mode="drop")

    # vmap, not one scatter over (row, slot) pairs: a batched scatter keeps the batch axis a batch
    # axis, so SPMD partitioning over the batch needs no all-gather.
    return jax.vmap(row)(flags)


def segment_metadata(segment_ids: jax.Array, max_segments: int) -> SegmentMetadata:
    """Per-row segment lengths and start offsets for THD attention.

    Args:
      segment_ids: ``(B, T)`` integer array, 0 = padding.
      max_segments: static int ``M >= 1``, the number of segment slots per
        row.  Under ``jax.jit`` pass it as a static argument
        (``static_argnums=1``) or close over it.

    Returns:
      ``SegmentMetadata(seq_lens [B, M], offsets [B, M + 1], num_segments
      [B])``, all int32, with the padding conventions of the module
      docstring: ``seq_lens`` 0-padded, unused ``offsets`` equal to the end
      of the last kept segment, segments past ``M`` dropped and counted in
      ``num_segments``.
    """
    _check_segment_ids(segment_ids)
    max_segments = _static_count(max_segments)
    if max_segments < 1:
        raise ValueError(f"max_segments must be >= 1; got {max_segments}")

    starts, ends = _run_edges(segment_ids)
    num_segments = jnp.sum(starts, axis=1, dtype=jnp.int32)
    seg_start = _nth_true(starts, max_segments)
    seg_end = _nth_true(ends, max_segments) + 1  # exclusive end

    slot = jnp.arange(max_segments, dtype=jnp.int32)
    used = slot[None, :] < num_segments[:, None]
    seq_lens = jnp.where(used, seg_end - seg_start, 0)
    # Segments appear in increasing order, so the largest end is the last
    # kept segment's end; it is 0 for a row of only padding.
    end = jnp.max(jnp.where(used, seg_end, 0), axis=1, keepdims=True)
    offsets = jnp.concatenate([jnp.where(used, seg_start, end), end], axis=1)
    return SegmentMetadata(seq_lens, offsets, num_segments)


# ----------------------------------------------------------------------------- run-time checks

def _raise_if_over(message: Callable[[int, int], str], row: jax.Array, value: jax.Array) -> None:
    row, value = np.asarray(row), np.asarray(value)  # (), or a leading batch axis under vmap
    over = np.flatnonzero(np.ravel(row) >= 0)
    if over.size:
        first = over[0]
        text = message(int(np.ravel(row)[first]), int(np.ravel(value)[first]))
        # Under jit XLA wraps a callback's exception in its own text: say it first, where it is read.
        logger.error("sdpagraph: %s", text)
        raise ValueError(text)


def _raise_rows_over(per_row: jax.Array, bound: int, message: Callable[[int, int], str]) -> None:
    """When the call runs: `ValueError(message(row, value))` for the first row whose value is over
    `bound`, through one host callback with two int32."""
    first = jnp.argmax(per_row > bound).astype(jnp.int32)  # the first row over the bound, if any
    value = per_row[first]
    row = jnp.where(value > bound, first, -1)
    jax.debug.callback(functools.partial(_raise_if_over, message), row, value)


def _segment_counts(segment_ids: jax.Array) -> jax.Array:
    return jnp.sum(_run_edges(segment_ids)[0], axis=1, dtype=jnp.int32)


def _longest_segments(segment_ids: jax.Array) -> jax.Array:
    return jnp.max(jnp.where(segment_ids != 0, segment_positions(segment_ids) + 1, 0), axis=1)


def rows_over_segment_bound(segment_ids: jax.Array, max_segments: int) -> jax.Array:
    """(B,) bool, on the device: rows of (traced) `segment_ids` with more than `max_segments`
    segments, which the THD layout would drop. O(B * T), no host round trip."""
    _check_segment_ids(segment_ids)
    return _segment_counts(segment_ids) > _static_count(max_segments)


def rows_over_segment_length(segment_ids: jax.Array, bound: int) -> jax.Array:
    """(B,) bool, on the device: rows of (traced) `segment_ids` with a segment longer than `bound`
    (a `max_seqlen_q` / `max_seqlen_kv` hint)."""
    _check_segment_ids(segment_ids)
    return _longest_segments(segment_ids) > bound


def check_segment_bound(segment_ids: jax.Array, max_segments: int, argname: str = "segment_ids") -> None:
    """Raise `ValueError` when the call runs if a row of (traced) `segment_ids` has more than
    `max_segments` segments (SDPAGRAPH_CHECK_SEGMENTS=raise).

    Costs O(B * T) on the device and one host callback (`jax.debug.callback`) with two int32 per
    run, which syncs the stream and ends a CUDA-graph (command buffer) segment of XLA's. Under `jit`
    the error surfaces as a `jax.errors.JaxRuntimeError` holding this message, when the result is
    computed; the message is also logged at ERROR when the callback raises.
    """
    _check_segment_ids(segment_ids)
    bound = _static_count(max_segments)
    if 0 in segment_ids.shape:
        return
    _raise_rows_over(_segment_counts(segment_ids), bound,
                     functools.partial(segment_overflow_message, argname, bound=bound))


def check_segment_lengths(segment_ids: jax.Array, bound: int, argname: str, hint_name: str) -> None:
    """Raise `ValueError` when the call runs if a segment of (traced) `segment_ids` is longer than
    `bound` (the `max_seqlen_q` / `max_seqlen_kv` hint `hint_name`): as `check_segment_bound`."""
    _check_segment_ids(segment_ids)
    if 0 in segment_ids.shape:
        return
    _raise_rows_over(_longest_segments(segment_ids), bound,
                     functools.partial(segment_length_message, argname, hint_name, bound=bound))
