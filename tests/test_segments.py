"""O(T) packed-sequence helpers against a plain NumPy loop reference."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sdpagraph.segments.metadata import (
    SegmentMetadata,
    segment_metadata,
    segment_positions,
    segment_run_ids,
)

MAX_SEGMENTS = 4
TEMP_LIMIT_BYTES = 4 * 2**20


# --- reference --------------------------------------------------------------


def _runs(row):
    """[(start, length), ...] of the maximal runs of equal nonzero ids."""
    runs = []
    for t, sid in enumerate(row):
        if sid == 0:
            continue
        if t > 0 and row[t - 1] == sid:
            start, length = runs[-1]
            runs[-1] = (start, length + 1)
        else:
            runs.append((t, 1))
    return runs


def reference_metadata(ids, max_segments):
    """The documented conventions, written as the obvious loops."""
    batch = ids.shape[0]
    seq_lens = np.zeros((batch, max_segments), np.int32)
    offsets = np.zeros((batch, max_segments + 1), np.int32)
    counts = np.zeros((batch,), np.int32)
    for b, row in enumerate(ids):
        runs = _runs(row)
        counts[b] = len(runs)
        kept = runs[:max_segments]  # segments past M are dropped
        end = kept[-1][0] + kept[-1][1] if kept else 0
        offsets[b, :] = end
        for k, (start, length) in enumerate(kept):
            seq_lens[b, k] = length
            offsets[b, k] = start
    return seq_lens, offsets, counts


def reference_positions_and_runs(ids):
    positions = np.zeros(ids.shape, np.int32)
    run_ids = np.zeros(ids.shape, np.int32)
    for b, row in enumerate(ids):
        for k, (start, length) in enumerate(_runs(row)):
            positions[b, start : start + length] = np.arange(length)
            run_ids[b, start : start + length] = k + 1
    return positions, run_ids


# --- random segmentations ----------------------------------------------------


def random_row(rng, length, num_segments, gaps, reuse_ids):
    """A row of ``num_segments`` runs with random lengths, optional padding
    gaps between runs and a padding tail; ids are random (non-consecutive),
    and with ``reuse_ids`` an id may reappear in a later, separate run."""
    row = np.zeros(length, np.int32)
    if num_segments == 0:
        return row
    # Random cut points give random run lengths >= 1 covering a prefix.
    used = rng.integers(num_segments, length + 1)
    cuts = np.sort(rng.choice(np.arange(1, used), num_segments - 1, replace=False))
    bounds = np.concatenate([[0], cuts, [used]])
    pool = np.arange(1, 6) if reuse_ids else np.arange(1, 10_000)
    previous = 0
    for start, stop in zip(bounds[:-1], bounds[1:]):
        sid = previous
        while sid == previous:  # adjacent runs need distinct ids to stay apart
            sid = int(rng.choice(pool))
        row[start:stop] = sid
        previous = sid
        if gaps and stop - start > 1 and rng.random() < 0.3:
            row[start] = 0  # a gap before this run (it stays non-empty)
            previous = 0
    return row


def random_batch(rng, batch, length, max_count):
    rows = []
    for _ in range(batch):
        count = int(rng.integers(0, min(max_count, length) + 1))
        rows.append(
            random_row(rng, length, count, gaps=rng.random() < 0.5, reuse_ids=rng.random() < 0.5)
        )
    return np.stack(rows)


@functools.lru_cache(maxsize=None)
def jitted(max_segments):
    return jax.jit(lambda ids: segment_metadata(ids, max_segments))


jit_positions = jax.jit(segment_positions)
jit_run_ids = jax.jit(segment_run_ids)


def check_all(ids, max_segments=MAX_SEGMENTS):
    meta = jitted(max_segments)(jnp.asarray(ids))
    assert isinstance(meta, SegmentMetadata)
    seq_lens, offsets, counts = reference_metadata(ids, max_segments)
    np.testing.assert_array_equal(meta.seq_lens, seq_lens)
    np.testing.assert_array_equal(meta.offsets, offsets)
    np.testing.assert_array_equal(meta.num_segments, counts)
    for array in meta:
        assert array.dtype == jnp.int32
    positions, run_ids = reference_positions_and_runs(ids)
    np.testing.assert_array_equal(jit_positions(jnp.asarray(ids)), positions)
    np.testing.assert_array_equal(jit_run_ids(jnp.asarray(ids)), run_ids)


# --- tests -------------------------------------------------------------------


@pytest.mark.parametrize("length", [1, 7, 64, 333])
def test_random_segmentations_match_reference(length):
    rng = np.random.default_rng()  # fresh inputs every run
    seed = rng.integers(2**32)
    rng = np.random.default_rng(seed)
    for _ in range(25):
        ids = random_batch(rng, batch=3, length=length, max_count=2 * MAX_SEGMENTS)
        try:
            check_all(ids)
        except AssertionError as error:
            raise AssertionError(f"seed {seed}, ids:\n{ids}") from error


@pytest.mark.parametrize(
    "row, seq_lens, offsets, count",
    [
        # Non-consecutive ids with a padding tail.
        ([3, 3, 7, 7, 7, 0, 0], [2, 3, 0, 0], [0, 2, 5, 5, 5], 2),
        # One segment filling the row.
        ([9] * 7, [7, 0, 0, 0], [0, 7, 7, 7, 7], 1),
        # All padding.
        ([0] * 7, [0, 0, 0, 0], [0, 0, 0, 0, 0], 0),
        # Exactly max_segments, with padding gaps between segments.
        ([1, 0, 2, 2, 0, 3, 4], [1, 2, 1, 1], [0, 2, 5, 6, 7], 4),
        # An id that reappears later is a new segment.
        ([1, 1, 2, 1, 0, 1, 0], [2, 1, 1, 1], [0, 2, 3, 5, 6], 4),
        # More than max_segments: the extra segments are dropped, counted.
        ([1, 2, 3, 4, 5, 6, 0], [1, 1, 1, 1], [0, 1, 2, 3, 4], 6),
        # Leading padding.
        ([0, 0, 5, 5, 0, 0, 0], [2, 0, 0, 0], [2, 4, 4, 4, 4], 1),
    ],
)
def test_documented_conventions(row, seq_lens, offsets, count):
    ids = np.asarray([row], np.int32)
    meta = jitted(MAX_SEGMENTS)(jnp.asarray(ids))
    np.testing.assert_array_equal(meta.seq_lens, [seq_lens])
    np.testing.assert_array_equal(meta.offsets, [offsets])
    np.testing.assert_array_equal(meta.num_segments, [count])
    check_all(ids)


def test_unused_slots_are_empty_sequences():
    """Offsets never decrease, and unused slots have zero offset width, so a
    flattened [B * M] view is valid THD input without compaction."""
    rng = np.random.default_rng()
    ids = random_batch(rng, batch=8, length=50, max_count=2 * MAX_SEGMENTS)
    meta = jitted(MAX_SEGMENTS)(jnp.asarray(ids))
    widths = np.diff(np.asarray(meta.offsets), axis=1)
    assert (widths >= 0).all()
    assert (np.asarray(meta.seq_lens) <= widths).all()
    unused = np.arange(MAX_SEGMENTS)[None, :] >= np.asarray(meta.num_segments)[:, None]
    assert (widths[unused] == 0).all()


def test_max_segments_is_static_and_checked():
    ids = jnp.ones((1, 4), jnp.int32)
    meta = jax.jit(segment_metadata, static_argnums=1)(ids, np.int64(2))
    assert meta.seq_lens.shape == (1, 2) and meta.offsets.shape == (1, 3)
    with pytest.raises(ValueError, match="max_segments"):
        segment_metadata(ids, 0)
    with pytest.raises(TypeError, match="max_segments"):
        jax.jit(segment_metadata)(ids, 2)  # traced, not static
    with pytest.raises(TypeError, match="segment_ids"):
        segment_metadata(jnp.ones((1, 4), jnp.float32), 2)
    with pytest.raises(ValueError, match="segment_ids"):
        segment_positions(jnp.ones((4,), jnp.int32))


@pytest.mark.parametrize(
    "name, fn",
    [
        ("segment_metadata", lambda ids: segment_metadata(ids, 64)),
        ("segment_positions", segment_positions),
        ("segment_run_ids", segment_run_ids),
    ],
)
def test_temp_memory_is_linear_at_128k(name, fn):
    """The issue's bound: temp bytes <= 4 MiB at T = 131072 (a (T, T) bool
    mask alone would be 16 GiB, a (T, 64) int32 one-hot 32 MiB)."""
    spec = jax.ShapeDtypeStruct((1, 131072), jnp.int32)
    analysis = jax.jit(fn).lower(spec).compile().memory_analysis()
    if analysis is None:
        pytest.skip(f"memory_analysis() unavailable on {jax.default_backend()}")
    assert analysis.temp_size_in_bytes <= TEMP_LIMIT_BYTES, (
        f"{name}: {analysis.temp_size_in_bytes} temp bytes"
    )
