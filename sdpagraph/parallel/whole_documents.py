"""Packed documents kept whole, in an order that evens their causal work over context-parallel devices.

A row of packed documents split into `cp` contiguous shards gives each device the causal work of the
documents (and parts) that fall in its shard, which depends on where the long documents happen to
lie: on a draw of documents of 512-8192 tokens at T32768 the first of two devices had 60.7% of it.
The documents' order in a row is free (each attends only to itself), so `whole_document_order`
reorders them, whole, until every shard's work is close to 1/cp of the row's. The row stays an
ordinary packed row, so every strategy runs it as such (in natural order, `load_balanced=False`),
the halo included, which a row whose documents are cut over the devices cannot take.

The search runs on the host, in NumPy, on concrete segment ids (a data pipeline's): start from the
better of the natural order and a greedy one (each next document the one that keeps the running work
closest to its even share), then swap pairs of documents (a seeded generator, so that the same ids
always give the same order) while the busiest device's work does not grow, until it is within
EVEN_ENOUGH of an even share or STALL tries in a row have not lowered it. Two runs of the same
nonzero id never end up side by side, where they would become one document. The model of a
document's work is causal: its token at position p attends to p + 1 keys; padding (id 0) does none.
The answer is remembered by the ids' content, so reordering q, k, v, the ids and then the output
back searches once.
"""
from __future__ import annotations

import hashlib

import numpy as np

from sdpagraph.memo import BoundedMemo

SWAPS_PER_DOCUMENT = 64  # the local search's tries: this many per document of the row,
MAX_SWAPS = 4096  # and at most this many,
EVEN_ENOUGH = 1.005  # or until the busiest device does at most this times 1/cp of the row's work,
STALL = 512  # or after this many tries in a row that did not lower it


# Orders already searched, by the ids' bytes: a batch's q, k, v, ids and output all ask for one, and
# a data pipeline moves on to new ids each step (a (B, T) order is 4 MiB at B8 T131072).
_ORDERS = BoundedMemo(4)


def whole_document_order(segment_ids: np.ndarray, cp_size: int) -> np.ndarray:
    """(B, T) int32: `order[b, i]` is the natural index of the token at position i of row b with its
    documents (maximal runs of one id, padding runs too) reordered whole (module docstring)."""
    ids = np.ascontiguousarray(segment_ids)
    question = (hashlib.blake2b(ids.tobytes(), digest_size=16).digest(), ids.shape, ids.dtype.str, cp_size)
    order = _ORDERS.get_or_compute(question, lambda: _search(ids, cp_size))
    return order.copy()


def _search(ids: np.ndarray, cp_size: int) -> np.ndarray:
    rows = [_row_order(row, cp_size) for row in ids]
    return np.stack(rows).astype(np.int32) if rows else np.zeros(ids.shape, np.int32)


def device_work(lengths: np.ndarray, working: np.ndarray, length: int, cp_size: int) -> np.ndarray:
    """(cp,) the causal work each of `cp_size` contiguous shards of a row of `length` tokens holds,
    for runs of `lengths` laid in that order (`working`: whether a run is a document, not padding)."""
    ends = np.cumsum(lengths)
    done = np.concatenate([[0.0], np.cumsum(_run_work(lengths, working))])
    bounds = np.arange(1, cp_size) * (length // cp_size)
    run = np.searchsorted(ends, bounds, side="right")  # the run each inner boundary falls in
    at = np.minimum(run, len(lengths) - 1)
    partial = _run_work(bounds - (ends - lengths)[at], working[at])  # its tokens before the boundary
    cumulative = np.concatenate([[0.0], done[run] + np.where(run < len(lengths), partial, 0.0), [done[-1]]])
    return np.diff(cumulative)


def _run_work(lengths: np.ndarray, working: np.ndarray) -> np.ndarray:
    """The causal work of runs of `lengths` tokens: a document's token at position p attends to p + 1
    keys; padding (`working` False) does none."""
    return np.where(working, lengths * (lengths + 1) / 2, 0.0)


def _row_order(row: np.ndarray, cp_size: int) -> np.ndarray:
    starts = np.flatnonzero(np.concatenate([[True], row[1:] != row[:-1]]))
    lengths = np.diff(np.append(starts, row.size))
    run_ids = row[starts]
    order = _balanced_runs(lengths, run_ids, row.size, cp_size)
    return np.concatenate([np.arange(starts[r], starts[r] + lengths[r]) for r in order])


def _balanced_runs(lengths: np.ndarray, run_ids: np.ndarray, length: int, cp_size: int) -> np.ndarray:
    """The order of a row's runs (indices into `lengths`) whose busiest shard does the least work found."""
    natural = np.arange(len(lengths))
    if cp_size == 1 or len(lengths) == 1:
        return natural
    working = run_ids != 0

    def busiest(order):
        return device_work(lengths[order], working[order], length, cp_size).max()

    def allowed(order):  # no two runs of one document id side by side
        ids = run_ids[order]
        return not np.any((ids[1:] == ids[:-1]) & (ids[1:] != 0))

    best = min((o for o in (natural, _greedy(lengths, working, length)) if allowed(o)), key=busiest)
    best_work = busiest(best)
    even = EVEN_ENOUGH * _run_work(lengths, working).sum() / cp_size
    rng = np.random.default_rng(0)
    stalled = 0
    for _ in range(min(SWAPS_PER_DOCUMENT * len(lengths), MAX_SWAPS)):
        if best_work <= even or stalled >= STALL:
            break
        stalled += 1
        i, j = rng.integers(len(lengths), size=2)
        if i == j:
            continue
        candidate = best.copy()
        candidate[[i, j]] = candidate[[j, i]]
        work = busiest(candidate)
        if work <= best_work and allowed(candidate):
            stalled = 0 if work < best_work else stalled
            best, best_work = candidate, work
    return best


def _greedy(lengths: np.ndarray, working: np.ndarray, length: int) -> np.ndarray:
    """Runs in the order that keeps the running causal work closest to the even line (its share of the
    row's work at each position): each next run the one that ends nearest to it."""
    work = _run_work(lengths, working)
    per_token = work.sum() / length
    left = np.ones(len(lengths), bool)
    order, at, done = [], 0, 0.0
    for _ in range(len(lengths)):
        miss = np.where(left, np.abs(done + work - per_token * (at + lengths)), np.inf)
        r = int(np.argmin(miss))  # ties: the lowest index
        left[r] = False
        order.append(r)
        at, done = at + lengths[r], done + work[r]
    return np.asarray(order, np.int64)
