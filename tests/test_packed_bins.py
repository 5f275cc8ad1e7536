"""Packed documents on bins (`graphs.binning`, `backends.cudnn.bins.packer`, `backends.cudnn.bins.packed`), on a CPU:
the packer (Pallas' interpreter) against a first-fit-decreasing reference in NumPy, and the binned
call, with the XLA backend standing in for cuDNN's, against the same call unbinned: outputs,
logsumexp and gradients, documents that do not fit, padding and dropped segments."""
import dataclasses
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sdpagraph.config import BINS
from sdpagraph.graphs.binning import BIN_SLACK, BinPlan, bin_plan, bin_reason
from sdpagraph.backends.cudnn.bins import packer as bin_packer
from sdpagraph.backends.cudnn.bins import packed as packed_bins
from sdpagraph.call import prepare_call
from sdpagraph.backends.xla import xla_attention
from tests.test_sharding import cudnn_on_cpu  # noqa: F401 (a fixture)


def softcap(score, b, h, q_idx, kv_idx):
    return 20.0 * jnp.tanh(score / 20.0)


def random_documents(rng, batch, length, low, high, padding=0):
    """(B, T) ids: documents of lengths in [low, high] (the last one of a row cut), ids reused across
    rows, and `padding` zero tokens at each row's end."""
    ids = np.zeros((batch, length), np.int32)
    for b in range(batch):
        start, doc = 0, 1
        while start < length - padding:
            size = min(int(rng.integers(low, high + 1)), length - padding - start)
            ids[b, start:start + size] = doc
            start, doc = start + size, doc + 1
    return ids


def first_fit_decreasing(lengths, rows, bins):
    """What `bin_packer.pack` computes, one document at a time (its short-document rule included)."""
    placed, fill = [], []
    for length in lengths:
        if length == 0 or length <= rows // bin_packer.SMALL_SHARE:
            break
        for index, used in enumerate(fill):
            if used + length <= rows:
                placed.append((index, used))
                fill[index] += length
                break
        else:
            placed.append((len(fill), 0) if len(fill) < bins else (None, None))
            if len(fill) < bins:
                fill.append(length)
    margin = rows // bin_packer.SMALL_SHARE
    rooms = [max(rows - used - margin, 0) for used in fill]  # what the long documents left, less a margin
    room_starts = [sum(rooms[:index]) for index in range(len(rooms))]
    start = 0
    for length in lengths[len(placed):]:
        if start < sum(rooms):
            index = max(i for i, room_start in enumerate(room_starts) if room_start <= start)
            placed.append((index, fill[index] + start - room_starts[index]))
        else:
            beyond = start - sum(rooms)
            placed.append((len(fill) + beyond // (rows - margin), beyond % (rows - margin)))
        start += length
    return placed


def document_lengths(ids: np.ndarray) -> list[int]:
    """The lengths of the documents (maximal runs of one nonzero id) of every row, longest first."""
    lengths = []
    for row in ids:
        starts = np.flatnonzero(np.diff(np.concatenate([[0], row])) != 0)
        ends = np.concatenate([starts[1:], [len(row)]])
        lengths += [int(end - start) for start, end in zip(starts, ends) if row[start] != 0]
    return sorted(lengths, reverse=True)


def reference_fits(ids: np.ndarray, plan) -> bool:
    """Whether first-fit decreasing places every document of `ids` in the plan's bins."""
    placed = first_fit_decreasing(document_lengths(ids), plan.rows, plan.bins)
    return all(bin_ is not None and bin_ < plan.bins for bin_, _ in placed)


@pytest.mark.parametrize("low,high,rows,bins", [(8, 64, 64, 40), (1, 40, 64, 40), (30, 60, 64, 12), (5, 6, 64, 1),
                                                (1, 48, 128, 40)])
def test_the_packer_places_documents_as_first_fit_decreasing_does(low, high, rows, bins):
    rng = np.random.default_rng()
    lengths = np.sort(rng.integers(low, high + 1, size=int(rng.integers(20, 40))))[::-1]
    lengths = np.concatenate([lengths, np.zeros(13, np.int64)])
    got_bin, got_offset = (np.asarray(x) for x in bin_packer.pack(jnp.asarray(lengths, jnp.int32), rows, bins,
                                                                   interpret=True))
    want = first_fit_decreasing(list(lengths), rows, bins)
    if any(want_bin is None for want_bin, _ in want):  # a long document found no bin: the call runs unbinned
        assert all(got_bin[d] >= bins for d, (want_bin, _) in enumerate(want) if want_bin is None)
        return
    for d, (want_bin, want_offset) in enumerate(want):
        if lengths[d]:
            assert (got_bin[d], got_offset[d]) == (want_bin, want_offset)
    # Every placed document lies inside its bin, and no two overlap.
    used = np.zeros((int(got_bin.max()) + 1, rows), np.int32)
    for d, length in enumerate(lengths):
        if length and got_bin[d] < bins:
            assert got_offset[d] + length <= rows
            used[got_bin[d], got_offset[d]:got_offset[d] + length] += 1
    assert used.max() <= 1


def prepared(rng, ids, hint, score_mod=softcap, is_causal=True, n=2, kv_heads=None, h=16, dtype=jnp.float32,
             **kwargs):
    b, t = ids.shape
    q = jnp.asarray(rng.standard_normal((b, t, n, h)), dtype)
    k, v = (jnp.asarray(rng.standard_normal((b, t, kv_heads or n, h)), dtype) for _ in range(2))
    call = prepare_call(q, k, v, is_causal=is_causal, segment_ids=jnp.asarray(ids), score_mod=score_mod,
                        max_seqlen_kv=hint, **kwargs)
    return call, q, k, v


def xla_in_place_of_cudnn(score_mod):
    return lambda spec, q, k, v, inputs: xla_attention(spec, q, k, v, inputs, score_mod)


def binned_and_unbinned(call, plan, q, k, v):
    """(value, lse, grads) of the call through packed_bins.attention and through the XLA backend alone."""
    run = xla_in_place_of_cudnn(call.score_mod)

    def through(fn):
        def loss(q, k, v):
            out, lse = fn(q, k, v)
            return jnp.sum(out * jnp.cos(jnp.arange(out.size).reshape(out.shape))), (out, lse)
        (_, (out, lse)), grads = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(q, k, v)
        return out, lse, grads

    binned = through(lambda q, k, v: packed_bins.attention(plan, call.spec, q, k, v, call.inputs, run,
                                                           interpret=True))
    unbinned = through(lambda q, k, v: run(call.spec, q, k, v, call.inputs))
    return binned, unbinned


def assert_same(binned, unbinned):
    (out, lse, grads), (want_out, want_lse, want_grads) = binned, unbinned
    # float32 on both sides, summed in another order: a misplaced token is off by O(1).
    np.testing.assert_allclose(out, want_out, rtol=1e-4, atol=1e-4)
    np.testing.assert_array_equal(np.isinf(lse), np.isinf(want_lse))
    finite = np.isfinite(want_lse)
    np.testing.assert_allclose(np.asarray(lse)[finite], np.asarray(want_lse)[finite], rtol=1e-4, atol=1e-4)
    for got, want in zip(grads, want_grads):
        np.testing.assert_allclose(got, want, rtol=1e-3, atol=1e-4)


@pytest.mark.parametrize("is_causal,padding,kv_heads", [(True, 0, None), (False, 0, None), (True, 37, None),
                                                        (True, 5, 1)])
def test_a_call_on_bins_gives_what_it_gives_unbinned(is_causal, padding, kv_heads):
    rng = np.random.default_rng()
    # About one draw in twenty needs a bin more than the plan holds (first-fit decreasing, the
    # reference, says so too) and runs unbinned, which other tests cover: draw until they fit.
    for _ in range(50):
        ids = random_documents(rng, 2, 1024, 9, 120, padding)
        call, q, k, v = prepared(rng, ids, 128, is_causal=is_causal, n=4 if kv_heads else 2, kv_heads=kv_heads)
        plan = bin_plan(call.spec, call.score_mod)
        if reference_fits(ids, plan):
            break
    assert plan is not None and plan.rows == 128 and plan.spec.batch == plan.bins
    layout = packed_bins.lay_out(call.inputs.q_segment_ids, plan, call.spec.max_segments, True)
    assert bool(layout.fits)
    assert_same(*binned_and_unbinned(call, plan, q, k, v))


def test_documents_that_need_more_bins_run_unbinned():
    rng = np.random.default_rng()
    ids = random_documents(rng, 2, 1024, 65, 70)  # just over half a bin each: one per bin
    call, q, k, v = prepared(rng, ids, 128)
    plan = bin_plan(call.spec, call.score_mod)
    assert not bool(packed_bins.lay_out(call.inputs.q_segment_ids, plan, call.spec.max_segments, True).fits)
    assert_same(*binned_and_unbinned(call, plan, q, k, v))


def test_a_document_longer_than_the_bins_runs_unbinned(monkeypatch):
    """Only reachable with the run-time length check off: the call must not lose the document's tail."""
    monkeypatch.setenv("SDPAGRAPH_CHECK_SEGMENTS", "0")
    rng = np.random.default_rng()
    ids = random_documents(rng, 2, 1024, 9, 100)
    ids[1, 100:400] = 99  # a document of 300 tokens
    call, q, k, v = prepared(rng, ids, 128)
    plan = bin_plan(call.spec, call.score_mod)
    assert not bool(packed_bins.lay_out(call.inputs.q_segment_ids, plan, call.spec.max_segments, True).fits)
    assert_same(*binned_and_unbinned(call, plan, q, k, v))


def test_segments_past_max_segments_are_padding_on_bins_too():
    rng = np.random.default_rng()
    ids = random_documents(rng, 2, 1024, 9, 40)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("SDPAGRAPH_CHECK_SEGMENTS", "0")
        call, q, k, v = prepared(rng, ids, 128, max_segments_per_seq=12)
    plan = bin_plan(call.spec, call.score_mod)
    binned, unbinned = binned_and_unbinned(call, plan, q, k, v)
    assert_same(binned, unbinned)
    assert np.all(np.asarray(binned[0])[:, -100:] == 0)  # rows past the 12th segment give 0


def test_which_calls_are_binned():
    rng = np.random.default_rng()
    ids = random_documents(rng, 2, 1024, 9, 120)
    call, *_ = prepared(rng, ids, 128)
    plan = bin_plan(call.spec, call.score_mod)
    assert plan.bins == int(np.ceil(BIN_SLACK * 2 * 1024 / 128)) + 1
    assert plan.spec.segments == "self" and plan.spec.max_seqlen_kv == plan.rows
    assert bin_plan(plan.spec, call.score_mod) is None  # bins are not binned again
    unhinted = prepared(rng, ids, None)[0]  # no max_seqlen_kv: bins of a quarter of a row
    assert bin_reason(unhinted.spec, unhinted.score_mod) is None
    plan = bin_plan(unhinted.spec, unhinted.score_mod)
    assert (plan.rows, plan.bins) == (256, int(np.ceil(BIN_SLACK * 2 * 1024 / 256)) + 1)
    few = dataclasses.replace(unhinted.spec, max_segments=4)  # at most 4 documents a row: not without a hint
    assert bin_plan(few, unhinted.score_mod) is None
    assert bin_plan(dataclasses.replace(few, max_seqlen_kv=128), unhinted.score_mod) is not None
    assert bin_plan(prepared(rng, ids, 128, score_mod=None)[0].spec, None) is None  # cuDNN's packed layout
    assert bin_plan(prepared(rng, ids, 512)[0].spec, call.score_mod) is None  # bins as long as half a row
    position_mod = prepared(rng, ids, 128, score_mod=lambda s, b, h, q, k: s + (q - k) * 0.1)[0]
    assert bin_plan(position_mod.spec, position_mod.score_mod) is None
    batch_mod = prepared(rng, ids, 128, score_mod=lambda s, b, h, q, k: s * (b + 1))[0]
    assert "batch" in bin_reason(batch_mod.spec, batch_mod.score_mod)


def test_a_per_row_array_keeps_a_call_unbinned():
    rng = np.random.default_rng()
    ids = random_documents(rng, 2, 1024, 9, 120)
    weights = jnp.asarray(rng.standard_normal((2, 1, 1, 1)), jnp.float32)
    call, *_ = prepared(rng, ids, 128, score_mod=lambda s, b, h, q, k: s * weights[b, 0, 0, 0])
    assert "array" in bin_reason(call.spec, call.score_mod)


def test_the_switch_and_the_device_count_decide(monkeypatch):
    assert not packed_bins.usable()  # a CPU
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(jax, "device_count", lambda: 1)
    assert packed_bins.usable()
    monkeypatch.setattr(jax, "device_count", lambda: 2)
    assert not packed_bins.usable()  # XLA partitions the call: the packer cannot be
    # inside a shard_map manual over every mesh axis, each device runs its own rows: bins again
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",))
    seen = []
    jax.shard_map(lambda x: seen.append(packed_bins.usable()) or x, mesh=mesh, in_specs=jax.P("data"),
                  out_specs=jax.P("data"))(jnp.zeros((1,)))
    assert seen == [True]
    two = jax.sharding.Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("data", "model"))
    partial = jax.shard_map(lambda x: seen.append(packed_bins.usable()) or x, mesh=two, in_specs=jax.P("data"),
                            out_specs=jax.P("data"), axis_names={"data"})  # "model" stays automatic
    jax.jit(partial)(jnp.zeros((1,)))
    assert seen == [True, False]
    rng = np.random.default_rng()
    call, *_ = prepared(rng, random_documents(rng, 2, 1024, 9, 120), 128)
    assert bin_plan(call.spec, call.score_mod) is not None
    monkeypatch.setenv(BINS.name, "0")
    assert bin_plan(call.spec, call.score_mod) is None


def test_a_plan_with_rows_of_64_works_too():
    """Rows smaller than cuDNN's tile multiple (a plan made by hand): the moves do not assume 128."""
    rng = np.random.default_rng()
    ids = random_documents(rng, 2, 512, 5, 60)
    call, q, k, v = prepared(rng, ids, 64)
    spec = dataclasses.replace(call.spec, batch=24, q_len=64, kv_len=64, max_segments=64, max_seqlen_q=None,
                               max_seqlen_kv=None)
    assert_same(*binned_and_unbinned(call, BinPlan(64, 24, spec), q, k, v))


@pytest.mark.parametrize("bins_answer", ["supported", "unsupported", "strict miss"])
def test_the_cudnn_backend_runs_bins_only_where_their_graphs_are_supported(bins_answer, monkeypatch):
    """cudnn.attention takes the bins where graphs.binning plans them, packed_bins is usable and the
    bins' own graphs pass; otherwise (a declined build, or strict mode with a cache made without
    them) the call runs unbinned rather than failing."""
    from sdpagraph.cache.graph_cache import CacheMissError
    from sdpagraph.graphs.support import Support
    from sdpagraph.backends.cudnn import backend as cudnn, execute as cudnn_execute

    rng = np.random.default_rng()
    call, q, k, v = prepared(rng, random_documents(rng, 2, 1024, 9, 120), 128)
    taken = []

    def support(spec, ir, *, training, verify=None):
        assert spec.batch == bin_plan(call.spec, call.score_mod).bins
        if bins_answer == "strict miss":
            raise CacheMissError("not precompiled")
        return Support(bins_answer == "supported", "cudnn", "")

    monkeypatch.setattr(packed_bins, "usable", lambda: True)
    monkeypatch.setattr(cudnn_execute, "support", support)
    monkeypatch.setattr(packed_bins, "attention", lambda plan, *a: taken.append("bins") or (q, None))
    monkeypatch.setattr(cudnn, "_attention", lambda spec, *a, **kw: taken.append(spec.batch) or (q, None))
    cudnn.attention(call.spec, q, k, v, call.inputs, call.score_mod, training=False)
    assert taken == (["bins"] if bins_answer == "supported" else [2])


def test_a_process_with_several_gpus_says_once_why_its_documents_run_unbinned(monkeypatch, caplog):
    from sdpagraph import logs

    monkeypatch.setattr(logs, "_logged", type(logs._logged)(8))  # a fresh "said once" record
    assert packed_bins.say_why_not() is None and not caplog.records  # a CPU: bins are not for it
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(jax, "device_count", lambda: 4)
    caplog.set_level(logging.WARNING, logger="sdpagraph")
    packed_bins.say_why_not()
    packed_bins.say_why_not()
    said = [r.getMessage() for r in caplog.records if "bins run on one device, or per device" in r.getMessage()]
    assert len(said) == 1 and "this process has 4 devices" in said[0] and "shard_map" in said[0]
    assert "SDPAGRAPH_PARTITION=0" in said[0]


def test_a_binned_call_keeps_one_set_of_residuals_for_its_gradient(cudnn_on_cpu, monkeypatch):
    """Under autodiff a `lax.cond` keeps a slot for each residual of either branch (one slot for those
    of the same shape and dtype): the unbinned fallback keeps q, k and v laid flat in the bins' shapes
    and recomputes its forward, so a binned call keeps about what the unbinned call alone keeps (more
    by the bins' slack), not both sets; the gradients stay the unbinned call's."""
    import sdpagraph
    from sdpagraph.backends.cudnn import execute as cudnn_execute
    from tests.cudnn_standin import stats_backward_executor

    monkeypatch.setattr(cudnn_execute, "call_executor", stats_backward_executor)
    monkeypatch.setattr(packed_bins, "usable", lambda: True)
    rng = np.random.default_rng()
    ids = random_documents(rng, 2, 1024, 9, 120)
    call, q, k, v = prepared(rng, ids, 128, n=4, h=32)
    plan = bin_plan(call.spec, call.score_mod)
    weights = jnp.asarray(rng.standard_normal(q.shape), jnp.float32)

    def residuals_and_grads():
        def loss(q, k, v):
            return jnp.sum(weights * sdpagraph.attention(q, k, v, is_causal=True, segment_ids=ids, score_mod=softcap,
                                                         max_seqlen_kv=128, implementation="cudnn"))
        _, pullback = jax.vjp(loss, q, k, v)
        kept = sum(x.nbytes for x in jax.tree.leaves(pullback) if isinstance(x, jax.Array))
        return kept, pullback(jnp.ones((), jnp.float32))

    built = cudnn_on_cpu[0]
    binned, binned_grads = residuals_and_grads()
    assert {spec.batch for spec, _, _ in built} == {plan.bins, call.spec.batch}  # the bins' graphs, the fallback's
    monkeypatch.setenv(BINS.name, "0")
    unbinned, grads = residuals_and_grads()
    slack = plan.bins * plan.rows / ids.size
    assert unbinned < binned <= 1.05 * slack * unbinned, (binned / unbinned, slack)  # both branches': ~2.2x
    for got, want in zip(binned_grads, grads):
        np.testing.assert_allclose(got, want, rtol=1e-3, atol=1e-4)
