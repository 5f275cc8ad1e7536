"""Context parallelism (`attention(..., context_parallel_axis=...)`) on 8 CPU devices.

As in tests/test_sharding.py, the first test runs this file again in a subprocess with
`--xla_force_host_platform_device_count=8`, where the other device tests run.

The XLA backend runs as it is. The cuDNN path runs its own ring code (`parallel.ring`, the cuDNN
block graphs of `backends.cudnn.backend`, the partitioning around them) with test_sharding's stand-ins for
the graph builder and the FFI executor, except that the backward stand-in here computes what
cuDNN's backward graph computes from the o and stats operands it is given (P = exp(S - stats),
dS = P * (dP - rowsum(dO * o))): the ring feeds each block the final o and logsumexp, and only a
stand-in that reads them checks that this is exact.
"""
import logging
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import sdpagraph
from sdpagraph import mods
from sdpagraph.deploy.specfile import load_specs
from sdpagraph.scoremod.ir_eval import evaluate
from sdpagraph.scoremod.masks import SEGMENT_ARRAYS, segment_ir
from sdpagraph.graphs.operands import ARRAY_PREFIX, KV_GRADS
from sdpagraph.graphs.support import Support
from sdpagraph.backends.cudnn import execute as cudnn_execute
from sdpagraph.backends.cudnn.graph_on_xla import packed_ids
from sdpagraph.segments.metadata import segment_positions
from tests.devices import AXIS_TYPES, has_cpu_devices, make_mesh, on_axis_types, rerun_with_cpu_devices
from tests.test_sharding import cudnn_on_cpu, fake_executor, random_ids  # noqa: F401 (a fixture)

DEVICES = 8
HERE_WITH_DEVICES = has_cpu_devices(DEVICES)
needs_devices = pytest.mark.skipif(not HERE_WITH_DEVICES, reason=f"runs in the {DEVICES}-device subprocess")
CP = 4
B, T, N, H = 2, 32, 8, 8


def test_in_a_process_with_eight_cpu_devices():
    if HERE_WITH_DEVICES:
        pytest.skip("this process has the devices: the tests below run here")
    rerun_with_cpu_devices(__file__, DEVICES, timeout=1200)


# ----------------------------------------------------------------------------- load balancing

def test_load_balance_round_trip_and_order():
    x = np.arange(8)[None, :, None]
    assert sdpagraph.load_balance(x, 2)[0, :, 0].tolist() == [0, 1, 6, 7, 2, 3, 4, 5]
    y = np.random.default_rng(0).standard_normal((2, 48, 3, 5)).astype(np.float32)
    for cp in (1, 2, 3, 4):
        balanced = sdpagraph.load_balance(y, cp)
        assert not cp > 1 or not np.array_equal(balanced, y)
        np.testing.assert_array_equal(sdpagraph.unload_balance(balanced, cp), y)
    lse = np.random.default_rng(1).standard_normal((2, 3, 48)).astype(np.float32)
    np.testing.assert_array_equal(sdpagraph.unload_balance(sdpagraph.load_balance(lse, 4, seq_axis=-1), 4, -1), lse)


@needs_devices
@pytest.mark.parametrize("axis_type", AXIS_TYPES)
def test_load_balance_of_sharded_arrays_keeps_their_sharding(axis_type):
    m = mesh((2, CP), ("data", "cp"), axis_type)
    y = np.random.default_rng(2).standard_normal((2, 32, 3, 5)).astype(np.float32)
    lse = np.random.default_rng(3).standard_normal((2, 3, 32)).astype(np.float32)
    ys, = place(m, y, spec=P("data", "cp"))
    lses, = place(m, lse, spec=P("data", None, "cp"))
    balance = jax.jit(lambda x: sdpagraph.load_balance(x, CP))
    for balanced in (sdpagraph.load_balance(ys, CP), balance(ys)):  # eager and jitted
        np.testing.assert_array_equal(balanced, sdpagraph.load_balance(y, CP))
        back = sdpagraph.unload_balance(balanced, CP)
        np.testing.assert_array_equal(back, y)
        assert balanced.sharding.is_equivalent_to(ys.sharding, 4) and back.sharding.is_equivalent_to(ys.sharding, 4)
    back = sdpagraph.unload_balance(sdpagraph.load_balance(lses, CP, seq_axis=-1), CP, seq_axis=-1)
    np.testing.assert_array_equal(back, lse)
    assert back.sharding.is_equivalent_to(lses.sharding, 3)


def test_load_balance_per_document_cuts_each_document_over_the_devices():
    """`load_balance(x, cp, segment_ids=ids)`: device i holds pieces i and 2cp-1-i of every document
    (padding runs too), every device T/cp tokens, and the documents' causal work even across the
    devices where whole chunks leave it uneven."""
    ids = np.array([[1, 1, 1, 1, 2, 2, 2, 2]])
    x = np.arange(8)[None]
    assert sdpagraph.load_balance(x, 2, segment_ids=ids).tolist() == [[0, 3, 4, 7, 1, 2, 5, 6]]
    rng = np.random.default_rng()
    for cp in (2, 4, 8):
        t = 256 * cp
        ids = np.zeros((3, t), np.int32)
        for row in ids:
            at, doc = 0, 1
            while at < t:
                size = int(rng.integers(1, t // 3))
                row[at:at + size], at, doc = doc if rng.random() < 0.9 else 0, at + size, doc + 1
        y = rng.standard_normal((3, t, 2)).astype(np.float32)
        balanced = sdpagraph.load_balance(y, cp, segment_ids=ids)
        np.testing.assert_array_equal(sdpagraph.unload_balance(balanced, cp, segment_ids=ids), y)
        lse = rng.standard_normal((3, 2, t)).astype(np.float32)
        back = sdpagraph.unload_balance(sdpagraph.load_balance(lse, cp, 2, ids), cp, 2, ids)
        np.testing.assert_array_equal(back, lse)
        # a document's causal work: each token attends the tokens of its document up to itself. Every
        # device holds 1/cp of it up to a few tokens' work, at most 2 * its length (whole chunks: up to
        # all of it on one device)
        work = np.asarray(segment_positions(jnp.asarray(ids))) + 1
        run = np.cumsum(np.concatenate([np.ones((3, 1), bool), ids[:, 1:] != ids[:, :-1]], 1), 1)
        device = np.broadcast_to(np.arange(t) // (t // cp), (3, t))
        for row_work, row_run in zip(*(np.asarray(sdpagraph.load_balance(a, cp, segment_ids=ids)) for a in (work, run))):
            per_device = np.zeros((row_run.max() + 1, cp))
            np.add.at(per_device, (row_run, device[0]), row_work)
            length = np.bincount(row_run, minlength=len(per_device))[:, None]
            excess = np.abs(per_device - per_device.sum(1, keepdims=True) / cp)
            assert np.all(excess <= 2 * length), (cp, (excess / np.maximum(length, 1)).max())
    with pytest.raises(ValueError, match=r"load_balance: segment_ids \(1, 16\) must match"):
        sdpagraph.load_balance(np.zeros((1, 32, 2)), 4, segment_ids=np.ones((1, 16), np.int32))


def test_load_balance_errors_name_the_numbers():
    with pytest.raises(ValueError, match=r"load_balance: the sequence length 30 .* 2 \* cp_size = 8"):
        sdpagraph.load_balance(np.zeros((1, 30, 2, 2)), 4)
    with pytest.raises(ValueError, match="cp_size must be a positive int"):
        sdpagraph.unload_balance(np.zeros((1, 32)), 0)


# ----------------------------------------------------------------------------- cases

def mesh(shape=(CP,), names=("cp",), axis_type="auto"):
    return make_mesh(shape, names, axis_type)


def case(name, rng):
    """(attention kwargs, K) of one case; fresh random inputs come from `inputs`."""
    K = {"gqa": 4, "mqa": 1}.get(name.split("_")[0], N)
    slopes = rng.random(N).astype(np.float32)
    return {
        "causal": dict(is_causal=True),
        "plain": dict(),
        "gqa_causal": dict(is_causal=True),
        "mqa_causal": dict(is_causal=True),
        "softcap_causal": dict(is_causal=True, score_mod=mods.softcap(3.0)),
        "alibi_causal": dict(is_causal=True, score_mod=mods.alibi(slopes)),
        "relative_jnp": dict(score_mod=lambda s, b, h, q, kv: s - 0.05 * jnp.abs(q - kv).astype(s.dtype)),
        "window": dict(local_window_size=(6, 3)),
        "causal_window": dict(is_causal=True, local_window_size=(9, 0)),
        "packed_causal": dict(is_causal=True, segment_ids=random_ids(rng, B, T, 4), max_segments_per_seq=4),
        # not a diagonal band (the first key is a sink), so it stays a mod and selects by position
        "near_mask_mod": dict(mask_mod=lambda b, h, q, kv: (jnp.abs(q - kv) < 10) | (kv == 0)),
    }[name], K


def inputs(rng, K, dtype=np.float32):
    q = rng.standard_normal((B, T, N, H)).astype(dtype)
    k, v = (rng.standard_normal((B, T, K, H)).astype(dtype) for _ in range(2))
    cotangent = rng.standard_normal((B, T, N, H)).astype(np.float32)
    return q, k, v, cotangent


def value_and_grads(attn):
    def loss(q, k, v, cotangent):
        out = attn(q, k, v)
        return jnp.sum(out.astype(jnp.float32) * cotangent), out

    return jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)


def cp_step(kwargs, strategy, load_balanced, impl):
    """The context-parallel call; with load balancing its q, k, v, segment ids and output are in
    `load_balance` order (`run` reorders them on the host, as a data loader would)."""
    kwargs = dict(kwargs)
    if load_balanced and "segment_ids" in kwargs:
        kwargs["segment_ids"] = sdpagraph.load_balance(kwargs["segment_ids"], CP)
    return value_and_grads(lambda q, k, v: sdpagraph.attention(
        q, k, v, implementation=impl, context_parallel_axis="cp", load_balanced=load_balanced,
        context_parallel_strategy=strategy, **kwargs))


def reference(kwargs):
    return value_and_grads(lambda q, k, v: sdpagraph.attention(q, k, v, implementation="xla", **kwargs))


def assert_same(ours, ref, tol=2e-5):
    """Every array within `tol`; the loss (a scalar: a sum over every output element, added up in
    another order on several devices) within `tol` times the square root of its number of terms, the
    size rounding errors of a sum grow by."""
    leaves = [(np.asarray(a, np.float32), np.asarray(b, np.float32)) for a, b in zip(jax.tree.leaves(ours),
                                                                                      jax.tree.leaves(ref))]
    terms = max(a.size for a, _ in leaves)
    for a, b in leaves:
        atol = tol * np.sqrt(terms) if a.ndim == 0 else tol
        np.testing.assert_allclose(a, b, rtol=tol, atol=atol)


def place(m, *xs, spec=P(None, "cp")):
    return tuple(jax.device_put(jnp.asarray(x), NamedSharding(m, spec)) for x in xs)


def run(name, strategy, load_balanced, impl, seed, ref=reference, axis_type="auto"):
    """(the context-parallel step's value and gradients in natural order, the one-device reference's,
    the compiled HLO); the output and gradients keep the sharding of q, k and v."""
    rng = np.random.default_rng(seed)
    kwargs, K = case(name, rng)
    q, k, v, cot = inputs(rng, K)
    m = mesh(axis_type=axis_type)
    order = (lambda x: sdpagraph.load_balance(x, CP)) if load_balanced else (lambda x: x)  # noqa: E731
    back = (lambda x: sdpagraph.unload_balance(x, CP)) if load_balanced else (lambda x: x)  # noqa: E731
    with jax.set_mesh(m):
        step = jax.jit(cp_step(kwargs, strategy, load_balanced, impl))
        args = place(m, *(order(x) for x in (q, k, v, cot)))
        compiled = step.lower(*args).compile()
        (loss, out), grads = compiled(*args)
        for x, like in zip((out, *grads), (args[0], *args[:3])):
            assert x.sharding.is_equivalent_to(like.sharding, 4), (x.sharding, like.sharding)
        ours = (loss, back(out)), tuple(back(g) for g in grads)  # (B, T, ...): natural order
    return ours, ref(kwargs)(q, k, v, cot), compiled.as_text()


XLA_CASES = ["causal", "plain", "gqa_causal", "mqa_causal", "softcap_causal", "alibi_causal", "relative_jnp", "window",
             "causal_window", "packed_causal", "near_mask_mod"]


@needs_devices
@pytest.mark.parametrize("name, load_balanced, axis_type", on_axis_types(
    [(name, lb) for name in XLA_CASES for lb in (False, True)],
    explicit=[("causal", True), ("alibi_causal", True), ("packed_causal", True), ("near_mask_mod", False)]))
def test_ring_on_xla_equals_one_device(name, load_balanced, axis_type):
    ours, ref, hlo = run(name, "ring", load_balanced, "xla", seed=XLA_CASES.index(name), axis_type=axis_type)
    assert_same(ours, ref)
    assert "collective-permute" in hlo


@needs_devices
@pytest.mark.parametrize("name, load_balanced, axis_type", on_axis_types(
    [(name, lb) for name in ("causal", "gqa_causal", "alibi_causal", "window", "packed_causal") for lb in (False, True)],
    explicit=[("gqa_causal", True), ("packed_causal", True)]))
def test_all_to_all_on_xla_equals_one_device(name, load_balanced, axis_type):
    ours, ref, hlo = run(name, "all_to_all", load_balanced, "xla", seed=100 + len(name), axis_type=axis_type)
    assert_same(ours, ref)
    assert "all-to-all" in hlo


@needs_devices
@pytest.mark.parametrize("axis_type", AXIS_TYPES)
@pytest.mark.parametrize("load_balanced", [True, False])
def test_segment_ids_split_along_the_sequence(axis_type, load_balanced):
    """Segment ids as jit arguments, split along the sequence over "cp" as q is (`cp_step`
    load-balances them under jit); and a call that is not context-parallel given such ids."""
    rng = np.random.default_rng(16)
    kwargs, K = case("packed_causal", rng)
    q, k, v, cot = inputs(rng, K)
    m = mesh(axis_type=axis_type)
    ids = kwargs.pop("segment_ids")
    order = (lambda x: sdpagraph.load_balance(x, CP)) if load_balanced else (lambda x: x)  # noqa: E731
    restore = (lambda x: sdpagraph.unload_balance(x, CP)) if load_balanced else (lambda x: x)  # noqa: E731
    expected = reference(dict(kwargs, segment_ids=ids))(q, k, v, cot)
    with jax.set_mesh(m):
        args = place(m, *(order(x) for x in (q, k, v, cot)), ids)
        step = jax.jit(lambda q, k, v, cot, ids: cp_step(dict(kwargs, segment_ids=ids), "ring", load_balanced,
                                                         None)(q, k, v, cot))
        (loss, out), grads = step(*args)
        ours = (loss, restore(out)), tuple(restore(g) for g in grads)
        # Not context-parallel: q, k, v whole along the sequence, the ids still split along it.
        plain = jax.jit(lambda q, k, v, cot, ids: reference(dict(kwargs, segment_ids=ids))(q, k, v, cot))
        alone = plain(*place(m, q, k, v, cot, spec=P()), *place(m, ids))
    assert_same(ours, expected)
    assert_same(alone, expected)


@needs_devices
@pytest.mark.parametrize("name", ["causal", "plain", "gqa_causal", "window"])
def test_equal_to_jax_dot_product_attention(name):
    jax_ref = lambda kwargs: value_and_grads(  # noqa: E731
        lambda q, k, v: jax.nn.dot_product_attention(q, k, v, implementation="xla", **kwargs))
    ours, ref, _ = run(name, "ring", True, None, 7, ref=jax_ref)
    assert_same(ours, ref, tol=5e-5)


# ----------------------------------------------------------------------------- the cuDNN path's ring

def packed_rows(static, operands):
    """A packed graph's (B, T) query and (B, S) key slot ids (1..M, 0 for rows it does not cover),
    decoded from its sequence lengths and ragged offsets as cuDNN reads them; (None, None) when dense."""
    spec = static.graph_spec
    if not spec.segments:
        return None, None
    decode = lambda side, length, heads: packed_ids(  # noqa: E731
        operands[f"seq_len_{side}"], operands[f"ragged_offset_{side}"], spec.batch, length, spec.max_segments,
        heads * spec.head_dim)
    ids_q, ids_kv = decode("q", spec.q_len, spec.num_heads), decode("kv", spec.kv_len, spec.num_kv_heads)
    stats_ids = packed_ids(operands["seq_len_q"], operands["ragged_offset_stats"], spec.batch, spec.q_len,
                           spec.max_segments, spec.num_heads)
    assert ids_q.shape == stats_ids.shape
    return jnp.where(stats_ids == ids_q, ids_q, -1), ids_kv  # the stats' offsets must agree with q's


def unwritten(x, rows, fill=jnp.nan):
    """`x` (B, L, ...) with NaN in the rows a packed graph does not cover (rows: (B, L) slot ids, 0
    there): what cuDNN leaves in them is undefined, so the caller must mask them; `fill` 0 in a
    result the executor zeroes before the graph writes it."""
    if rows is None:
        return x
    return jnp.where((rows > 0).reshape(rows.shape + (1,) * (x.ndim - 2)), x, fill)


def logits_on_xla(static, operands):
    """(q, k) -> the masked scores of the graph (what cuDNN computes before the softmax): a packed
    graph's within each slot's sequence, its causal mask top-left from each sequence's start; a dense
    twin's within each query's segment bounds."""
    spec = static.graph_spec
    arrays = {name[len(ARRAY_PREFIX):]: x for name, x in operands.items() if name.startswith(ARRAY_PREFIX)}
    ids_q, ids_kv = packed_rows(static, operands)

    def logits(q, k):
        b, t, n, h = q.shape
        s, kh = k.shape[1], k.shape[2]
        x = jnp.einsum("btkgh,bskh->bkgts", q.reshape(b, t, kh, n // kh, h), k).reshape(b, n, t, s) * spec.scale
        index = (None, jnp.arange(n)[None, :, None, None], jnp.arange(t)[None, None, :, None],
                 jnp.arange(s)[None, None, None, :])
        if static.ir is not None:
            x = evaluate(static.ir, x, scalars=dict(static.scalars), arrays=arrays, index=index)[0]
        if spec.segment_mask:  # the dense twin's segment bounds
            bounds = {name: value for name, value in operands.items() if name in SEGMENT_ARRAYS}
            x = evaluate(segment_ir(spec), x, scalars={}, arrays=bounds, index=index)[0]
        if ids_q is not None:
            same = (ids_q[:, None, :, None] == ids_kv[:, None, None, :]) & (ids_q[:, None, :, None] > 0)
            x = jnp.where(same, x, -jnp.inf)
            positions = segment_positions(ids_q), segment_positions(ids_kv)
            index = (None, None, positions[0][:, None, :, None], positions[1][:, None, None, :])
        if spec.is_causal:
            x = jnp.where(index[3] <= index[2], x, -jnp.inf)
        return x

    return logits


def cudnn_like_executor(static, graph, operands, results):
    """Forward: test_sharding's stand-in. Backward: from the o and stats operands, as cuDNN does.
    Rows a packed graph does not cover come back NaN (`unwritten`), or 0 in the results the executor
    zeroes first (dk and dv stacked, `graphs.operands.KV_GRADS`; every token result where the caller
    asks, `execute.Static.unwritten_zeroed`: the halo's blocks)."""
    ids_q, ids_kv = packed_rows(static, operands)
    fill = 0.0 if static.unwritten_zeroed else jnp.nan
    if "dq" not in results:
        out = fake_executor(static, graph, operands, results)
        return {role: unwritten(x, ids_q, fill if role == "o" else jnp.nan) for role, x in out.items()}
    q, k, v, o, d_o, stats = (operands[r] for r in ("q", "k", "v", "o", "dO", "stats"))
    if ids_q is not None:  # a packed graph's stats are (B, T, N); its uncovered rows read none
        stats = jnp.where(ids_q[:, None, :] > 0, jnp.swapaxes(stats, 1, 2), jnp.inf)
    scores, pullback = jax.vjp(logits_on_xla(static, operands), q, k)
    p = jnp.exp(scores - stats[..., None])  # stats: (B, N, T)
    g = q.shape[2] // k.shape[2]
    v_heads = jnp.repeat(v, g, axis=2)
    dv = jnp.einsum("bnts,btnh->bsnh", p, d_o.astype(jnp.float32))
    dv = dv.reshape(*dv.shape[:2], k.shape[2], g, -1).sum(axis=3)
    d_p = jnp.einsum("btnh,bsnh->bnts", d_o.astype(jnp.float32), v_heads)
    d_rows = jnp.swapaxes(jnp.sum(d_o.astype(jnp.float32) * o.astype(jnp.float32), axis=-1), 1, 2)[..., None]
    dq, dk = pullback(p * (d_p - d_rows))
    kv_fill = 0.0 if KV_GRADS in results else fill
    grads = {"dq": unwritten(dq, ids_q, fill).astype(q.dtype), "dk": unwritten(dk, ids_kv, kv_fill).astype(k.dtype),
             "dv": unwritten(dv, ids_kv, kv_fill).astype(v.dtype)}
    return cudnn_execute.restacked(grads, results)


@pytest.fixture
def cudnn_ring(cudnn_on_cpu, monkeypatch):
    monkeypatch.setattr(cudnn_execute, "call_executor", cudnn_like_executor)
    return cudnn_on_cpu[0]


@needs_devices
@pytest.mark.parametrize("name, load_balanced, axis_type", on_axis_types(
    [(name, lb) for name in ("causal", "plain", "gqa_causal", "mqa_causal", "softcap_causal", "alibi_causal",
                             "relative_jnp") for lb in (False, True)],
    explicit=[("causal", True), ("mqa_causal", False), ("alibi_causal", True)]))
def test_ring_on_the_cudnn_path(name, load_balanced, axis_type, cudnn_ring):
    built = cudnn_ring
    seed = int(np.random.default_rng().integers(2**31))
    ours, ref, hlo = run(name, "ring", load_balanced, "cudnn", seed, axis_type=axis_type)
    assert_same(ours, ref, tol=3e-5)
    assert "collective-permute" in hlo, f"seed {seed}"
    assert not re.search(r"\ball-gather(?:-start)?\(", hlo), f"the ring gathers nothing (seed {seed})"
    if name in ("causal", "plain", "gqa_causal", "mqa_causal"):
        # No documents, no score_mod: one document over the whole sequence (context_parallel._ring_spec),
        # so the packed graphs' one call a step over the device's whole block, and no branch.
        assert {(s.segments, s.max_segments) for s, _, _ in built} == {("self", 1)}, built
        assert not re.search(r"\bconditional\(", hlo), f"seed {seed}"
    else:
        # With a score_mod, the pairs of chunks: one graph per block kind, whatever the step: (T / chunks)
        # blocks, unmasked and (causal) diagonal.
        chunk = T // (CP * (2 if load_balanced else 1))
        specs = {(s.q_len, s.kv_len, s.is_causal, d) for s, _, d in built}
        want = {(chunk, chunk, c, d) for c in {False, "causal" in name} for d in ("forward", "backward")}
        assert specs == want, specs
        if load_balanced and "causal" in name:  # RingPlan.static_status: 2 pairs a step >= 1 branch, fwd and bwd
            assert len(re.findall(r"\bconditional\(", hlo)) == 4 * (CP - 1), f"seed {seed}"
    # Keys and values travel as one transfer: forward CP - 1; backward at most CP - 2 (the first visitor
    # is the forward's; XLA may merge the others with the forward's) and CP - 1 for the dk/dv
    # accumulators (ring._visits, ring._ring_backward). Keys and values apart, with dk/dv brought
    # home after the last step, made 4 * CP - 2 after that merging.
    permutes = len(re.findall(r"\bcollective-permute(?:-start)?\(", hlo))
    assert 2 * (CP - 1) <= permutes <= 3 * CP - 4, f"{permutes} transfers (seed {seed})"
    if name in ("alibi_causal", "relative_jnp"):  # global positions: the pair's offsets are operands
        assert all({"__cp_q_offset", "__cp_kv_offset"} <= set(ir.array_names) for _, ir, _ in built)
        assert len({ir.digest for _, ir, _ in built}) == 1


@needs_devices
def test_ring_takes_the_pairs_where_one_document_does_not_build(cudnn_ring, monkeypatch):
    """A dense call whose one-document packed graphs cuDNN refuses still runs its blocks on cuDNN,
    as pairs of chunks, rather than falling to the XLA backend."""
    def support(spec, ir, training, verify=None):
        packed = spec.segments == "self"
        return Support(not packed, "cudnn", "no packed engine (stand-in)" if packed else "stand-in")

    monkeypatch.setattr(cudnn_execute, "support", support)
    seed = int(np.random.default_rng().integers(2**31))
    ours, ref, hlo = run("causal", "ring", True, "cudnn", seed)
    assert_same(ours, ref, tol=3e-5)
    assert cudnn_ring and {s.segments for s, _, _ in cudnn_ring} == {None}, cudnn_ring
    assert re.search(r"\bconditional\(", hlo), f"the pairs branch per step (seed {seed})"


@needs_devices
@pytest.mark.parametrize("axis_type", AXIS_TYPES)
def test_all_to_all_on_the_cudnn_path(axis_type, cudnn_ring):
    built = cudnn_ring
    ours, ref, hlo = run("gqa_causal", "all_to_all", True, "cudnn", 5, axis_type=axis_type)
    assert_same(ours, ref, tol=3e-5)
    assert "all-to-all" in hlo
    assert {(s.q_len, s.num_heads, s.num_kv_heads) for s, _, _ in built} == {(T, N // CP, 4 // CP)}


@needs_devices
def test_position_selecting_mod_runs_xla_blocks_and_says_why(cudnn_ring, caplog):
    caplog.set_level(logging.INFO, logger="sdpagraph")
    ours, ref, _ = run("near_mask_mod", "ring", True, None, 11)
    assert_same(ours, ref)
    assert any("select by position" in r.getMessage() for r in caplog.records)
    with pytest.raises(ValueError, match="implementation='cudnn' cannot run .*context parallel.*select by position"):
        run("near_mask_mod", "ring", True, "cudnn", 11)
    q, k, v, _ = inputs(np.random.default_rng(11), N)
    with jax.set_mesh(mesh()):
        near = case("near_mask_mod", np.random.default_rng(0))[0]["mask_mod"]
        answer = sdpagraph.check_support(q, k, v, mask_mod=near, context_parallel_axis="cp", load_balanced=True)
        assert (answer.supported, answer.backend) == (False, "xla") and "select by position" in answer.reason
        answer = sdpagraph.check_support(q, k, v, is_causal=True, score_mod=mods.alibi(np.ones(N, np.float32)),
                                         context_parallel_axis="cp", context_parallel_strategy="auto")
        assert (answer.supported, answer.backend) == (True, "cudnn") and "all_to_all over 'cp', cp=4" in answer.reason


@needs_devices
@pytest.mark.parametrize("axis_type", AXIS_TYPES)
def test_mesh_argument_batch_axis_and_shard_map(axis_type, cudnn_ring):
    rng = np.random.default_rng(12)
    q, k, v, cot = inputs(rng, N)
    ref = reference(dict(is_causal=True))(q, k, v, cot)
    m = mesh((2, CP), ("data", "cp"), axis_type)  # the batch over "data", the sequence over "cp"; mesh= without set_mesh
    args = place(m, q, k, v, cot, spec=P("data", "cp"))

    def attn(q, k, v):
        return sdpagraph.attention(q, k, v, is_causal=True, context_parallel_axis="cp", mesh=m)

    assert_same(jax.jit(value_and_grads(attn))(*args), ref, tol=3e-5)
    assert {s.batch for s, _, _ in cudnn_ring} == {B // 2}

    # q, k, v split along the sequence only: the batch still splits over "data" inside, and on
    # Explicit axes the output and gradients keep q's sharding type.
    seq_only = place(m, q, k, v, cot, spec=P(None, "cp"))
    (_, out), grads = ours = jax.jit(value_and_grads(attn))(*seq_only)
    assert_same(ours, ref, tol=3e-5)
    if axis_type == "explicit":
        assert all(x.sharding.is_equivalent_to(seq_only[0].sharding, 4) for x in (out, *grads))

    # Inside a user's shard_map over the axis, q, k, v are the local blocks: over every mesh axis,
    # or over "cp" alone.
    for axes in ({"data", "cp"}, {"cp"}):
        spec = P("data" if "data" in axes else None, "cp")
        inner = jax.shard_map(lambda q, k, v: sdpagraph.attention(q, k, v, is_causal=True, context_parallel_axis="cp"),
                              mesh=m, in_specs=spec, out_specs=spec, axis_names=axes)
        assert_same(jax.jit(value_and_grads(inner))(*args), ref, tol=3e-5)


# ----------------------------------------------------------------------------- errors

@needs_devices
def test_errors_name_the_argument_and_the_numbers():
    rng = np.random.default_rng(13)
    q, k, v, _ = inputs(rng, 4)
    m = mesh()
    cp = dict(context_parallel_axis="cp")
    with pytest.raises(ValueError, match=r"context_parallel_axis='cp': needs a mesh.*jax.set_mesh.*mesh="):
        sdpagraph.attention(q, k, v, **cp)
    with pytest.raises(ValueError, match=r"context_parallel_axis='sp': is not an axis of the mesh.*\('cp',\)"):
        sdpagraph.attention(q, k, v, context_parallel_axis="sp", mesh=m)
    with pytest.raises(ValueError, match=r"context_parallel_axis='cp': the query sequence length 30 must be "
                                         r"divisible by 4 .*cp=4"):
        sdpagraph.attention(q[:, :30], k, v, mesh=m, **cp)
    with pytest.raises(ValueError, match=r"key/value sequence length 36 must be divisible by 8 \(2 \* cp"):
        sdpagraph.attention(q, jnp.concatenate([k, k[:, :4]], 1), jnp.concatenate([v, v[:, :4]], 1), mesh=m,
                            load_balanced=True, **cp)
    with pytest.raises(ValueError, match=r"'all_to_all' needs .* N=8 and key/value heads K=2 divisible by cp=4"):
        sdpagraph.attention(q, k[:, :, :2], v[:, :, :2], mesh=m, context_parallel_strategy="all_to_all", **cp)
    with pytest.raises(ValueError, match="context_parallel_axis='cp': context parallelism does not take bias"):
        sdpagraph.attention(q, k, v, jnp.ones((T, T)), mesh=m, **cp)
    with pytest.raises(ValueError, match="context_parallel_strategy must be one of"):
        sdpagraph.attention(q, k, v, mesh=m, context_parallel_strategy="ulysses", **cp)
    with pytest.raises(ValueError, match="pass context_parallel_axis="):
        sdpagraph.attention(q, k, v, load_balanced=True)
    with pytest.raises(TypeError, match="load_balanced must be a bool"):
        sdpagraph.attention(q, k, v, mesh=m, load_balanced="yes", **cp)


def test_auto_rule():
    from sdpagraph.parallel.strategy import choose_strategy
    from sdpagraph.spec import AttentionSpec

    spec = lambda t, n, k: AttentionSpec(1, t, t, n, k, 128, 128, "bfloat16", 0.1)  # noqa: E731
    assert choose_strategy(spec(16384, 16, 16), 2, "auto") == "all_to_all"
    assert choose_strategy(spec(65536, 16, 16), 2, "auto") == "all_to_all"  # measured faster on 2 H200s
    assert choose_strategy(spec(131072, 16, 16), 2, "auto") == "ring"  # beyond the longest length measured
    assert choose_strategy(spec(4096, 16, 1), 2, "auto") == "ring"  # one key/value head does not split
    assert choose_strategy(spec(4096, 16, 16), 2, "ring") == "ring"
    assert choose_strategy(spec(131072, 16, 16), 2, "auto", ring_on_xla=True) == "all_to_all"
    assert choose_strategy(spec(65536, 16, 1), 2, "auto", ring_on_xla=True) == "ring"


def test_position_offsets_shift_what_the_mod_sees():
    from sdpagraph.scoremod.ir import with_position_offsets
    from sdpagraph.call import prepare_call

    rng = np.random.default_rng(14)
    q = jax.ShapeDtypeStruct((1, 8, 2, 4), jnp.float32)
    slopes = rng.random(2).astype(np.float32)
    ir = prepare_call(q, q, q, score_mod=mods.alibi(slopes)).score_mod
    shifted = with_position_offsets(ir, {2: "qo", 3: "ko"})
    assert shifted.array_names == ir.array_names + ("qo", "ko") and shifted.grad_derived == ir.grad_derived
    score = jnp.asarray(rng.standard_normal((1, 2, 8, 8)), jnp.float32)
    local = (None, jnp.arange(2)[None, :, None, None], jnp.arange(8)[None, None, :, None],
             jnp.arange(8)[None, None, None, :])
    at = lambda qo, ko: (local[0], local[1], local[2] + qo, local[3] + ko)  # noqa: E731
    arrays = {"slopes": slopes.reshape(1, 2, 1, 1)}
    offsets = {"qo": np.full((1, 1, 1, 1), 24, np.int32), "ko": np.full((1, 1, 1, 1), 8, np.int32)}
    ours = evaluate(shifted, score, scalars={}, arrays={**arrays, **offsets}, index=local)[0]
    np.testing.assert_allclose(ours, evaluate(ir, score, scalars={}, arrays=arrays, index=at(24, 8))[0], rtol=1e-6)


@needs_devices
def test_logsumexp_and_recorded_block_specs(cudnn_ring, tmp_path):
    rng = np.random.default_rng(15)
    q, k, v, _ = inputs(rng, N)
    ref_out, ref_lse = sdpagraph.attention(q, k, v, is_causal=True, return_residual=True, implementation="xla")
    m = mesh()
    path = tmp_path / "specs.json"
    with jax.set_mesh(m), sdpagraph.record(str(path)):
        out, lse = jax.jit(lambda q, k, v: sdpagraph.attention(
            q, k, v, is_causal=True, return_residual=True, context_parallel_axis="cp"))(*place(m, q, k, v))
    assert_same((out, lse), (ref_out, ref_lse), tol=3e-5)
    recorded = {(e.spec.q_len, e.spec.is_causal) for e in load_specs(path)}
    assert recorded == {(T // CP, False), (T // CP, True)}  # the block graphs, not the global call's


@pytest.mark.parametrize("cp", [2, 4, 8])
@pytest.mark.parametrize("load_balanced", [True, False])
def test_a_pairs_status_is_static_where_every_device_has_the_same(cp, load_balanced):
    """`RingPlan.static_status`: the pair's traced status (`pair_status`) where it is the same on
    every device at that step, else None. Load-balanced causal: at step 0 every pair is known (the
    diagonals MASKED, first-chunk queries against second-chunk keys SKIP, the other way FULL); later,
    only like-numbered chunk pairs differ between devices, and those that attend form a rectangle."""
    import jax.numpy as jnp

    from sdpagraph.call import prepare_call
    from sdpagraph.parallel import ring_plan

    q = jax.ShapeDtypeStruct((1, 16 * cp, 2, 8), jnp.float32)
    plan = ring_plan.RingPlan(prepare_call(q, q, q, is_causal=True).spec, "cp", cp, load_balanced, "xla", None, ())
    chunks = plan.chunks
    status = lambda me, step, a, j: int(ring_plan.pair_status(  # noqa: E731
        plan, plan.offsets(me, plan.q_chunk)[a], plan.offsets((me - step) % cp, plan.kv_chunk)[j]))
    for step in range(cp):
        for a in range(chunks):
            for j in range(chunks):
                traced = {status(me, step, a, j) for me in range(cp)}
                known = plan.static_status(step, a, j)
                assert known == (traced.pop() if len(traced) == 1 else None), (step, a, j)
    # After the first step, the pairs that attend on a device are every pair of some query chunks with
    # some key chunks: per-token masks of each side express them (the documents ring's `whole_steps`).
    for step in range(1, cp):
        for me in range(cp):
            attends = np.array([[status(me, step, a, j) != ring_plan.SKIP for j in range(chunks)]
                                for a in range(chunks)])
            assert np.array_equal(attends, np.outer(attends.any(axis=1), attends.any(axis=0))), (step, me)
    if load_balanced:
        assert [plan.static_status(0, a, j) for a, j in ((0, 0), (0, 1), (1, 0), (1, 1))] == [
            ring_plan.MASKED, ring_plan.SKIP, ring_plan.FULL, ring_plan.MASKED]
        assert [plan.static_status(1, a, j) for a, j in ((0, 0), (0, 1), (1, 0), (1, 1))] == [
            None, ring_plan.SKIP, ring_plan.FULL, None]
