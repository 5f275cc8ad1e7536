"""Packed documents (self-attention `segment_ids`) on the ring's cuDNN blocks (`parallel.ring_documents`),
on 8 CPU devices at cp = 2, 4 and 8, with test_context_parallel's stand-ins for the graph builder and
the executor (`cudnn_ring`: packed graphs decoded from their sequence lengths and ragged offsets, the
rows they do not cover left NaN, so the ring must mask them).

As tests/test_context_parallel.py, the first test runs this file again in a subprocess with
`--xla_force_host_platform_device_count=8`, where the other tests run.
"""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import sdpagraph
from sdpagraph import mods
from sdpagraph.graphs.operands import graph_spec
from tests.devices import make_mesh, on_axis_types, rerun_with_cpu_devices
from tests.test_context_parallel import (DEVICES, HERE_WITH_DEVICES, assert_same, cudnn_on_cpu,  # noqa: F401
                                         cudnn_ring, needs_devices, place, reference, value_and_grads)

B, T, N, H = 2, 64, 8, 8


def test_in_a_process_with_eight_cpu_devices():
    if HERE_WITH_DEVICES:
        pytest.skip("this process has the devices: the tests below run here")
    rerun_with_cpu_devices(__file__, DEVICES, timeout=1200)


def documents(rng, batch, length, longest=24):
    """(segment ids (B, T), their most documents in a row): documents of 1-`longest` tokens, so some
    cross the chunks' boundaries (4-32 tokens) and some lie inside one, with padding (id 0) between
    some of them and at the end; an id may come back after another document (a new document)."""
    ids = np.zeros((batch, length), np.int32)
    counts = []
    for row in ids:
        at, count = int(rng.integers(0, 3)), 0
        while at < length - 2:
            size = int(rng.integers(1, longest + 1))
            row[at:at + size] = rng.integers(1, 4) + 3 * (count % 2)  # neighbours differ
            at, count = at + size + int(rng.random() < 0.3) * int(rng.integers(1, 4)), count + 1
        counts.append(count)
    return ids, max(counts)


def run(cp, load_balanced, causal, kv_heads, axis_type="auto", seed=0, implementation="cudnn", strategy="ring",
        longest=24, length=T, **kwargs):
    """(the cp-device step's value and gradients in natural order, the one-device XLA reference's,
    the compiled HLO) with fresh random float32 inputs of `length` tokens, documents of 1-`longest`
    tokens."""
    rng = np.random.default_rng(seed)
    ids, most = documents(rng, B, length, longest)
    q = rng.standard_normal((B, length, N, H)).astype(np.float32)
    k, v = (rng.standard_normal((B, length, kv_heads, H)).astype(np.float32) for _ in range(2))
    cot = rng.standard_normal((B, length, N, H)).astype(np.float32)
    call = dict(is_causal=causal, max_segments_per_seq=most, **kwargs)
    order = (lambda x: sdpagraph.load_balance(x, cp)) if load_balanced else (lambda x: x)  # noqa: E731
    back = (lambda x: sdpagraph.unload_balance(x, cp)) if load_balanced else (lambda x: x)  # noqa: E731
    ids_order = order
    if load_balanced == "documents":  # each document cut over the devices; its ids in natural order
        order = lambda x: sdpagraph.load_balance(x, cp, segment_ids=ids)  # noqa: E731
        back = lambda x: sdpagraph.unload_balance(x, cp, segment_ids=ids)  # noqa: E731
        ids_order = lambda x: x  # noqa: E731
    m = make_mesh((cp,), ("cp",), axis_type)
    with jax.set_mesh(m):
        step = jax.jit(value_and_grads(lambda q, k, v: sdpagraph.attention(
            q, k, v, segment_ids=ids_order(ids), context_parallel_axis="cp", load_balanced=load_balanced,
            context_parallel_strategy=strategy, implementation=implementation, **call)))
        args = place(m, *(order(x) for x in (q, k, v, cot)))
        compiled = step.lower(*args).compile()
        (loss, out), grads = compiled(*args)
        ours = (loss, back(out)), tuple(back(g) for g in grads)
    return ours, reference(dict(call, segment_ids=ids))(q, k, v, cot), compiled.as_text()


CASES = [(cp, lb, causal, kv) for cp in (2, 4, 8) for lb in (True, False) for causal, kv in ((True, 4), (False, N))]


@needs_devices
@pytest.mark.parametrize("cp, load_balanced, causal, kv_heads, axis_type", on_axis_types(
    CASES, explicit=[(2, True, True, 4), (8, False, False, N)]))
def test_documents_on_cudnn_blocks_equal_one_device(cp, load_balanced, causal, kv_heads, axis_type, cudnn_ring):
    seed = int(np.random.default_rng().integers(2**31))
    ours, ref, hlo = run(cp, load_balanced, causal, kv_heads, axis_type, seed)
    assert_same(ours, ref, tol=3e-5)
    assert "collective-permute" in hlo, f"seed {seed}"
    # every device runs the same packed graphs: no branch, whose index XLA would read on the host
    assert not re.search(r"\bconditional\(", hlo), "the packed block graphs run without a conditional"
    # Segment ids (int32) may be gathered: every device reads the whole sequence's (`natural_order`).
    gathers = re.findall(r"= (?:f32|bf16|f16)\[.*\ball-gather(?:-start)?\(.*", hlo)
    assert not gathers, (f"the ring gathers no keys or values (seed {seed})", gathers[:3])
    # One packed (THD) graph a step over the device's whole blocks, forward and backward: every local
    # document on the first step (causal when the call is), at most one per pair of chunks later.
    local, chunks = T // cp, 2 if load_balanced else 1
    most = max(s.max_segments for s, _, _ in cudnn_ring)
    specs = {(s.segments, s.q_len, s.kv_len, s.max_segments, s.is_causal, d) for s, _, d in cudnn_ring}
    want = {("self", local, local, slots, first and causal, d)
            for slots, first in ((min(most, chunks * chunks), False), (most, True)) for d in ("forward", "backward")}
    assert specs == want and most == min(most, local), (specs, seed)


@needs_devices
@pytest.mark.parametrize("cp, causal, kv_heads, axis_type", on_axis_types(
    [(2, True, 4), (4, True, N), (8, True, 4), (4, False, 4)], explicit=[(2, True, 4)]))
def test_documents_balanced_per_document_on_the_ring_equal_one_device(cp, causal, kv_heads, axis_type, cudnn_ring):
    """load_balanced="documents": each document cut into 2cp pieces over the devices; the ring's
    one packed call a step takes every document each side holds."""
    seed = int(np.random.default_rng().integers(2**31))
    ours, ref, hlo = run(cp, "documents", causal, kv_heads, axis_type, seed)
    assert_same(ours, ref, tol=3e-5)
    assert not re.search(r"\bconditional\(", hlo), seed
    # every step's graph takes every document of the blocks: each device holds pieces of each
    local, most = T // cp, max(s.max_segments for s, _, _ in cudnn_ring)
    assert {(s.segments, s.q_len, s.kv_len, s.max_segments) for s, _, _ in cudnn_ring} == {("self", local, local, most)}
    assert most >= 4, seed


@needs_devices
@pytest.mark.parametrize("cp, score_mod", [(2, None), (4, mods.softcap(3.0)), (8, None)])
def test_documents_balanced_per_document_on_all_to_all_equal_one_device(cp, score_mod):
    seed = int(np.random.default_rng().integers(2**31))
    ours, ref, _ = run(cp, "documents", True, N, seed=seed, implementation="xla", strategy="all_to_all",
                       score_mod=score_mod)
    assert_same(ours, ref)


HALO_CASES = [(cp, lb, kv) for cp in (2, 4, 8) for lb in (False, True) for kv in (4, N)]


@needs_devices
@pytest.mark.parametrize("cp, load_balanced, kv_heads, implementation, axis_type", on_axis_types(
    [case + (impl,) for case in HALO_CASES for impl in ("cudnn", "xla")],
    explicit=[(2, True, 4, "cudnn"), (8, False, N, "cudnn"), (4, True, N, "xla")]))
def test_documents_halo_equals_one_device(cp, load_balanced, kv_heads, implementation, axis_type, cudnn_ring):
    """Causal packed documents of at most `max_seqlen_kv` tokens over the halo (`parallel.halo`): each
    block's own call, causal per document, and one call over the first max_seqlen_kv - 1 queries and
    the last keys of the block before (the one document they can share), documents crossing the
    blocks' boundaries; the longest document one more token than a block."""
    seed = int(np.random.default_rng().integers(2**31))
    block = T // (cp * (2 if load_balanced else 1))
    ours, ref, hlo = run(cp, load_balanced, True, kv_heads, axis_type, seed, implementation=implementation,
                         strategy="halo", longest=block + 1, max_seqlen_kv=block + 1)
    assert_same(ours, ref, tol=3e-5)
    assert "collective-permute" in hlo, f"seed {seed}"
    gathers = re.findall(r"= (?:f32|bf16|f16)\[.*\ball-gather(?:-start)?\(.*", hlo)
    assert not gathers and "all-to-all" not in hlo, (f"the halo gathers no keys or values (seed {seed})", gathers[:3])
    if implementation == "cudnn":
        assert not re.search(r"\bconditional\(", hlo), f"every device runs the same two calls (seed {seed})"
        rows = B * (2 if load_balanced else 1)
        specs = {(s.batch, s.segments, s.q_len, s.kv_len, s.max_segments, s.is_causal) for s, _, _ in cudnn_ring}
        # the block's own call holds every document of the row (`max_segments_per_seq`, at most the block's
        # tokens), its halo call one
        most = max(s.max_segments for s, _, _ in cudnn_ring)
        want = {(rows, "self", block, block, most, True), (rows, "self", block, block, 1, False)}
        assert specs == want and 1 < most <= block, (specs, seed)


@needs_devices
@pytest.mark.parametrize("load_balanced, implementation", [(False, "cudnn"), (True, "cudnn"), (False, "xla")])
def test_documents_halo_rounded_up_equals_one_device(load_balanced, implementation, cudnn_ring):
    """A document reach (max_seqlen_kv - 1 = 39) that is no multiple of the row kernels' blocks: the
    halo takes `halo_layout.DOCUMENT_HALO_MULTIPLE` (64) keys and query rows, at most a block (64
    load-balanced, of 128 in natural order); the keys and rows added lie in other documents, masked."""
    seed = int(np.random.default_rng().integers(2**31))
    ours, ref, _ = run(2, load_balanced, True, 4, seed=seed, strategy="halo", longest=40, length=256,
                       max_seqlen_kv=40, implementation=implementation)
    assert_same(ours, ref, tol=3e-5)
    if implementation == "cudnn":
        halo_calls = {(s.q_len, s.kv_len) for s, _, _ in cudnn_ring if s.max_segments == 1 and not s.is_causal}
        assert halo_calls == {(64, 64)}, (halo_calls, seed)


@needs_devices
@pytest.mark.parametrize("strategy", ["halo", "ring", "all_to_all"])
def test_a_row_whose_document_breaks_max_seqlen_kv_is_nan_under_jit(strategy, cudnn_ring):
    """As on one device: traced ids with a document longer than `max_seqlen_kv` give that row NaN, the
    others their values; the check runs on the whole sequence's ids inside the shard_map."""
    rng = np.random.default_rng(11)
    ids, most = documents(rng, B, T, 9)
    ids[1, 20:40] = 99  # row 1: a document of 20 tokens
    q, k, v = (rng.standard_normal((B, T, N, H)).astype(np.float32) for _ in range(3))
    call = dict(is_causal=True, segment_ids=ids, max_segments_per_seq=int(most) + 2, max_seqlen_kv=9)
    m = make_mesh((4,), ("cp",))
    with jax.set_mesh(m):
        attend = jax.jit(lambda q, k, v, ids: sdpagraph.attention(
            q, k, v, **dict(call, segment_ids=ids), context_parallel_axis="cp", context_parallel_strategy=strategy))
        out = np.asarray(attend(*place(m, q, k, v, ids)))
    assert np.isnan(out[1]).all() and not np.isnan(out[0]).any()
    ref = sdpagraph.attention(q[:1], k[:1], v[:1], implementation="xla", **dict(call, segment_ids=ids[:1]))
    np.testing.assert_allclose(out[0], np.asarray(ref[0]), rtol=3e-5, atol=3e-5)


@needs_devices
def test_documents_halo_refuses_what_it_cannot_run(cudnn_ring):
    ids, most = documents(np.random.default_rng(5), B, T, 9)
    q = np.zeros((B, T, N, H), np.float32)
    ask = lambda **kw: sdpagraph.check_support(  # noqa: E731
        q, q, q, max_segments_per_seq=most, context_parallel_axis="cp", context_parallel_strategy="halo",
        **{"is_causal": True, "segment_ids": ids, **kw})
    with jax.set_mesh(make_mesh((4,), ("cp",))):
        answer = ask(max_seqlen_kv=9)
        assert answer.supported and "halo over 'cp', cp=4" in answer.reason, answer
        for kw, match in ((dict(), r"needs max_seqlen_kv .* <= 17.*given: none"),
                          (dict(max_seqlen_kv=18), r"<= 17.*given: 18"),
                          (dict(max_seqlen_kv=10, load_balanced=True, segment_ids=sdpagraph.load_balance(ids, 4)),
                           r"<= 9, one more than the blocks of 8 .*given: 10"),
                          (dict(max_seqlen_kv=9, is_causal=False), "is_causal=True"),
                          (dict(max_seqlen_kv=9, score_mod=mods.softcap(3.0)), "no score_mod or mask_mod"),
                          # a mod that reads positions folds no segments, yet the halo's graphs take no mod
                          (dict(max_seqlen_kv=9, score_mod=lambda s, b, h, q, kv: s - 0.5 * jnp.abs(q - kv)),
                           "no score_mod or mask_mod"),
                          (dict(max_seqlen_kv=9, score_mod=mods.alibi(np.linspace(0.1, 1, N).astype(np.float32))),
                           "no score_mod or mask_mod")):
            prefix = "context_parallel_axis='cp': context_parallel_strategy='halo' .*"
            with pytest.raises(ValueError, match=prefix + match):
                ask(**kw)
        # auto takes the halo for documents it runs in natural order (no score_mod, max_seqlen_kv within a
        # block), else as before
        assert "halo over 'cp'" in sdpagraph.check_support(
            q, q, q, segment_ids=ids, max_segments_per_seq=most, max_seqlen_kv=9, is_causal=True,
            context_parallel_axis="cp", context_parallel_strategy="auto").reason
        balanced = dict(max_seqlen_kv=9, load_balanced=True, segment_ids=sdpagraph.load_balance(ids, 4))
        relative = dict(max_seqlen_kv=9, score_mod=lambda s, b, h, q, kv: s - 0.5 * jnp.abs(q - kv))
        for kw in (dict(max_seqlen_kv=18), dict(max_seqlen_kv=9, score_mod=mods.softcap(3.0)), dict(), balanced,
                   relative):
            answer = sdpagraph.check_support(q, q, q, max_segments_per_seq=most, is_causal=True,
                                             context_parallel_axis="cp", context_parallel_strategy="auto",
                                             **{"segment_ids": ids, **kw})
            assert "halo over" not in answer.reason, (kw, answer)
            # the answer says which argument would let the halo run them: only where one would
            advised = "with max_seqlen_kv=<the longest document> (at most 17) the halo would run" in answer.reason
            assert advised == (kw.get("max_seqlen_kv") in (None, 18) and kw is not balanced), (kw, answer)


def support_of(seed, **fixed):
    """(segment ids, their most documents in a row, check_support of q with `fixed` and more arguments)."""
    rng = np.random.default_rng(seed)
    ids, most = documents(rng, B, T)
    q = rng.standard_normal((B, T, N, H)).astype(np.float32)
    return ids, most, lambda **kw: sdpagraph.check_support(q, q, q, is_causal=True, context_parallel_axis="cp",
                                                          **fixed, **kw)


@needs_devices
def test_documents_balanced_per_document_refuse_what_they_cannot_run(cudnn_ring):
    ids, most, ask = support_of(9, load_balanced="documents")
    with jax.set_mesh(make_mesh((2,), ("cp",))):
        with pytest.raises(ValueError, match="segment_ids"):
            ask()
        with pytest.raises(ValueError, match="context_parallel_strategy='all_to_all'"):
            ask(segment_ids=ids, max_segments_per_seq=most, score_mod=mods.softcap(3.0),
                context_parallel_strategy="ring")
        answer = ask(segment_ids=ids, max_segments_per_seq=most, score_mod=mods.softcap(3.0),
                     context_parallel_strategy="auto")
        assert "all_to_all over 'cp'" in answer.reason, answer
    with jax.set_mesh(make_mesh((2,), ("cp",))), pytest.raises(TypeError, match="must be a bool or 'documents'"):
        support_of(9, load_balanced="docs")[2](segment_ids=ids)


@needs_devices
def test_support_names_the_ring_on_cudnn(cudnn_ring):
    ids, most, given = support_of(3, context_parallel_strategy="ring", load_balanced=True)
    with jax.set_mesh(make_mesh((4,), ("cp",))):
        balanced = sdpagraph.load_balance(ids, 4)
        ask = lambda **kw: given(segment_ids=balanced, max_segments_per_seq=most, **kw)  # noqa: E731
        for answer in (ask(), ask(score_mod=mods.softcap(3.0))):
            assert (answer.supported, answer.backend) == (True, "cudnn"), answer
            assert "ring over 'cp', cp=4" in answer.reason and "blocks run on cuDNN" in answer.reason
        answer = ask(score_mod=lambda s, b, h, q, kv: s - 0.05 * (q - kv).astype(s.dtype))
        assert (answer.supported, answer.backend) == (False, "xla") and "document's start" in answer.reason, answer


@needs_devices
def test_auto_runs_long_packed_documents_on_the_ring_and_their_dense_twin_on_all_to_all(cudnn_ring):
    """`strategy.choose_strategy`: documents on packed graphs from T32768 (the ring measured
    faster than all_to_all there), with a score_mod (the ring's dense twin) or shorter: all_to_all."""
    from sdpagraph.parallel.strategy import AUTO_DOCUMENTS_RING_MIN_LEN

    with jax.set_mesh(make_mesh((2,), ("cp",))):
        for length, score_mod, want in ((AUTO_DOCUMENTS_RING_MIN_LEN, None, "ring"),
                                        (AUTO_DOCUMENTS_RING_MIN_LEN, mods.softcap(3.0), "all_to_all"),
                                        (AUTO_DOCUMENTS_RING_MIN_LEN // 2, None, "all_to_all")):
            ids = np.repeat(np.arange(1, 9, dtype=np.int32), length // 8)[None]
            q = jax.ShapeDtypeStruct((1, length, 2, 8), np.float32)
            answer = sdpagraph.check_support(q, q, q, segment_ids=ids, max_segments_per_seq=8, is_causal=True,
                                             score_mod=score_mod, context_parallel_axis="cp", load_balanced=True,
                                             context_parallel_strategy="auto")
            assert f"{want} over 'cp'" in answer.reason, (length, score_mod, answer)


@needs_devices
@pytest.mark.parametrize("cp, load_balanced, causal", [(4, True, True), (2, False, False), (8, True, False)])
def test_softcap_with_documents_on_dense_twin_blocks(cp, load_balanced, causal, cudnn_ring):
    """A score_mod with packed documents: the packed graphs do not take one, so each pair runs their
    dense twin with its queries' document bounds in the key chunk."""
    seed = int(np.random.default_rng().integers(2**31))
    ours, ref, _ = run(cp, load_balanced, causal, 4, seed=seed, score_mod=mods.softcap(3.0))
    assert_same(ours, ref, tol=3e-5)
    assert cudnn_ring and all(graph_spec(s, ir).segment_mask for s, ir, _ in cudnn_ring), seed


@needs_devices
@pytest.mark.parametrize("seed", range(6))
def test_shared_ids_number_the_documents_both_sides_hold(seed):
    """`ring_documents.shared_ids` against a per-token NumPy count: runs of segment numbers that may
    repeat apart, invalid tokens, tokens not allowed, and fewer slots than shared documents."""
    from sdpagraph.parallel.ring_documents import shared_ids

    rng = np.random.default_rng(seed)
    batch, length, max_segments, slots = 3, 48, 9, int(rng.integers(2, 8))

    def side():
        run = np.sort(rng.integers(0, max_segments + 3, (batch, length)), axis=1).astype(np.int32)
        run[:, rng.integers(0, length, 5)] = rng.integers(1, max_segments + 1)  # a number back after others
        valid = (run > 0) & (run <= max_segments) & (rng.random((batch, length)) > 0.1)
        return (np.zeros_like(run), valid, run), rng.random((batch, length)) > 0.2

    (q_facts, q_allowed), (kv_facts, kv_allowed) = side(), side()
    got = shared_ids(q_facts, kv_facts, q_allowed, kv_allowed, max_segments, slots)
    for b in range(batch):
        held = [{int(r) for r, ok in zip(f[2][b], f[1][b] & allowed[b]) if ok}
                for f, allowed in ((q_facts, q_allowed), (kv_facts, kv_allowed))]
        slot = {r: i + 1 for i, r in enumerate(sorted(held[0] & held[1])) if i < slots}
        for ids, f, allowed in zip(got, (q_facts, kv_facts), (q_allowed, kv_allowed)):
            want = [slot.get(int(r), 0) if ok else 0 for r, ok in zip(f[2][b], f[1][b] & allowed[b])]
            np.testing.assert_array_equal(np.asarray(ids[b]), want)
