"""`load_balance(x, cp, segment_ids=ids, whole_documents=True)`: packed documents kept whole and
reordered in their row (`parallel.whole_documents`) so that each contiguous shard holds an even share
of their causal work. Checked against direct counts in NumPy: the reordered row holds every document
whole and in order, no two documents merge, the busiest shard's work is never above the natural
order's and close to even where the documents allow it; the row round-trips, and attention over it
(an ordinary packed row) gives the natural row's output once moved back."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import sdpagraph
from sdpagraph.parallel import whole_documents
from sdpagraph.parallel.whole_documents import device_work, whole_document_order


def random_rows(rng, batch, length, low, high, padding=0, padding_runs=0.1):
    """(B, T) ids: documents of [low, high] tokens with fresh ids, this share of them padding runs (0)
    instead, and `padding` zero tokens at each row's end."""
    ids = np.zeros((batch, length), np.int32)
    for row in ids:
        at, doc = 0, 1
        while at < length - padding:
            size = min(int(rng.integers(low, high + 1)), length - padding - at)
            row[at:at + size] = doc if rng.random() >= padding_runs else 0
            at, doc = at + size, doc + 1
    return ids


def runs(row):
    """(start, length, id) of each maximal run of one id."""
    starts = np.flatnonzero(np.concatenate([[True], row[1:] != row[:-1]]))
    lengths = np.diff(np.append(starts, row.size))
    return starts, lengths, row[starts]


def busiest_share(row, cp):
    """The busiest of cp contiguous shards' causal work over the mean, counted token by token."""
    starts, lengths, ids = runs(row)
    work = np.concatenate([np.arange(1, n + 1) * (i != 0) for n, i in zip(lengths, ids)])
    per_shard = work.reshape(cp, -1).sum(1)
    return per_shard.max() / per_shard.mean()


@pytest.mark.parametrize("cp", [2, 4, 8])
def test_documents_stay_whole_and_their_work_evens_out(cp):
    rng = np.random.default_rng()
    t = 512 * cp
    ids = random_rows(rng, 3, t, 4, t // 12, padding=int(rng.integers(0, 40)))
    ids[0] = random_rows(rng, 1, t, 4, 128, padding=int(rng.integers(0, 40)), padding_runs=0)[0]
    order = whole_document_order(ids, cp)
    x = rng.standard_normal((3, t, 2)).astype(np.float32)
    balanced = np.asarray(sdpagraph.load_balance(x, cp, segment_ids=ids, whole_documents=True))
    np.testing.assert_array_equal(balanced, np.take_along_axis(x, order[..., None], 1))
    back = sdpagraph.unload_balance(balanced, cp, segment_ids=ids, whole_documents=True)
    np.testing.assert_array_equal(back, x)
    for row, row_order in zip(ids, order):
        assert sorted(row_order) == list(range(t))
        reordered = row[row_order]
        natural_runs, new_runs = runs(row), runs(reordered)
        documents = natural_runs[2] != 0
        # every document is one run of the new row, its tokens in their order; only padding runs merge
        assert np.count_nonzero(new_runs[2]) == np.count_nonzero(documents)
        for start, length, doc in zip(*natural_runs):
            if doc:
                at = int(np.flatnonzero(row_order == start)[0])
                np.testing.assert_array_equal(row_order[at:at + length], np.arange(start, start + length))
        # the search's own count agrees with a count token by token
        starts, lengths, run_ids = new_runs
        counted = device_work(lengths, run_ids != 0, t, cp)
        assert np.isclose(counted.max() / counted.mean(), busiest_share(reordered, cp))
        assert busiest_share(reordered, cp) <= busiest_share(row, cp) + 1e-9
    # documents of at most a quarter of a shard and no padding inside the row: even to a few percent
    # (200 draws each: at most 1.0082). Documents as long as a shard, or padding runs longer than one,
    # can leave it uneven whatever the order.
    assert busiest_share(ids[0][order[0]], cp) <= 1.03, (cp, busiest_share(ids[0], cp))


def test_the_same_ids_give_the_same_order_and_documents_with_one_id_never_merge():
    rng = np.random.default_rng()
    ids = random_rows(rng, 2, 2048, 8, 200) % 3  # ids 1 and 2 reused along the row (0: padding)
    first = whole_document_order(ids, 4)
    # the search itself (not the memo of its answers) gives the same order again: load and unload agree
    np.testing.assert_array_equal(whole_documents._search(ids.copy(), 4), first)
    for row, order in zip(ids, first):
        _, lengths, run_ids = runs(row)
        _, new_lengths, new_ids = runs(row[order])
        assert sorted(new_lengths[new_ids != 0]) == sorted(lengths[run_ids != 0])


def test_attention_over_the_reordered_row_is_the_natural_rows_once_moved_back():
    rng = np.random.default_rng()
    cp, t = 4, 512
    ids = random_rows(rng, 2, t, 8, 90, padding=13)
    q, k, v = (jnp.asarray(rng.standard_normal((2, t, 2, 16)), jnp.float32) for _ in range(3))
    order = dict(segment_ids=ids, whole_documents=True)
    attend = lambda q, k, v, ids: sdpagraph.attention(q, k, v, is_causal=True, segment_ids=ids,  # noqa: E731
                                                      implementation="xla")
    moved = [sdpagraph.load_balance(x, cp, **order) for x in (q, k, v, ids)]
    out = sdpagraph.unload_balance(attend(*moved), cp, **order)
    np.testing.assert_allclose(out, attend(q, k, v, ids), rtol=1e-5, atol=1e-5)


def test_whole_documents_need_concrete_natural_order_ids():
    x = np.zeros((1, 64, 2), np.float32)
    with pytest.raises(ValueError, match="whole_documents=True reorders a row's documents: pass the row's"):
        sdpagraph.load_balance(x, 2, whole_documents=True)
    with pytest.raises(ValueError, match="unload_balance: whole_documents=True"):
        sdpagraph.unload_balance(x, 2, whole_documents=True)
    ids = np.ones((1, 64), np.int32)
    with pytest.raises(TypeError, match=r"load_balance\(whole_documents=True\) orders the documents on the host"):
        jax.jit(lambda x, ids: sdpagraph.load_balance(x, 2, segment_ids=ids, whole_documents=True))(x, ids)
    with pytest.raises(ValueError, match=r"length 63 \(axis 1\) must be divisible by cp_size = 2: each device"):
        sdpagraph.load_balance(x[:, :63], 2, segment_ids=ids[:, :63], whole_documents=True)
    # only cp need divide the length (no 2cp chunks): 3 devices of 2 tokens, documents of 3 and 3
    six = np.array([[1, 1, 1, 2, 2, 2]])
    back = sdpagraph.unload_balance(sdpagraph.load_balance(six, 3, segment_ids=six, whole_documents=True), 3,
                                    segment_ids=six, whole_documents=True)
    np.testing.assert_array_equal(back, six)
