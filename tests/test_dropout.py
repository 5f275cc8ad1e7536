"""Attention dropout (`attention(..., dropout_rate=, dropout_rng=)`): the mask's statistics, the 1/(1-p)
scaling, gradients against a float64 NumPy reference driven by the same mask, on the XLA backend
(direct and blockwise) and on the cuDNN path's CPU stand-in (whose backward, as cuDNN's, reads only the
output and stats it is given); argument errors; the spec, the operands and the lowering.

The mask is learnt the way the GPU tests learn cuDNN's: with value = identity (S == H_v) the output
is p_ij * m_ij / (1 - p), so `out != 0` is the mask wherever p_ij > 0; the mask depends on the key,
the shapes and the positions only, so a second call with random values draws the same one."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import sdpagraph
from sdpagraph import dropout
from sdpagraph.backends.cudnn import execute as cudnn_execute
from sdpagraph.backends.xla import xla_attention
from sdpagraph.call import prepare_call
from sdpagraph.graphs.operands import DROPOUT, describe, graph_io
from sdpagraph.spec import AttentionSpec
from tests.cudnn_standin import stats_backward_executor
from tests.test_sharding import cudnn_on_cpu  # noqa: F401 (a fixture)

B, T, S, N, K = 2, 24, 16, 4, 2  # S == H == H_v: the identity value reveals the mask


def _inputs(rng, kv_heads=K):
    q = rng.standard_normal((B, T, N, S))
    k = rng.standard_normal((B, S, kv_heads, S))
    v = rng.standard_normal((B, S, kv_heads, S))
    d_o = rng.standard_normal((B, T, N, S))
    return q, k, v, d_o


def _identity_value(kv_heads=K):
    return jnp.broadcast_to(jnp.eye(S, dtype=jnp.float32)[None, :, None, :], (B, S, kv_heads, S))


def _reference(q, k, v, d_o, mask, rate, causal, sinks=None):
    """float64 (out, dq, dk, dv[, dsinks]) of dropout attention with the given keep mask (B, N, T, S);
    with `sinks` (N,), exp(sinks[n]) joins each row's softmax denominator."""
    groups = q.shape[2] // k.shape[2]
    kk, vv = (np.repeat(x, groups, axis=2) for x in (k, v))
    scale = 1 / np.sqrt(q.shape[-1])
    logits = np.einsum("btnh,bsnh->bnts", q, kk) * scale
    if causal:
        logits = np.where(np.tril(np.ones((T, S), bool)), logits, -np.inf)
    top = logits.max(-1, keepdims=True)
    total = np.exp(logits - top).sum(-1, keepdims=True)
    if sinks is not None:
        total = total + np.exp(sinks[None, :, None, None] - top)
    p = np.exp(logits - top) / total
    kept = mask / (1 - rate)
    a = p * kept
    out = np.einsum("bnts,bsnh->btnh", a, vv)
    dv = np.einsum("bnts,btnh->bsnh", a, d_o)
    dp = np.einsum("btnh,bsnh->bnts", d_o, vv) * kept
    row = np.sum(dp * p, -1, keepdims=True)
    dl = p * (dp - row)
    dq = np.einsum("bnts,bsnh->btnh", dl, kk) * scale
    dk = np.einsum("bnts,btnh->bsnh", dl, q) * scale
    fold = lambda x: x.reshape(B, S, k.shape[2], groups, -1).sum(3)  # noqa: E731 - GQA: sum each group
    grads = (out, dq, fold(dk), fold(dv))
    if sinks is None:
        return grads
    sink_share = np.exp(sinks[None, :, None, None] - top) / total  # the sink's softmax weight per row
    return grads + (-np.sum(sink_share * row, axis=(0, 2, 3)),)


def _learn_mask(call, rate, causal, kv_heads=K):
    """(keep mask (B, N, T, S) where the softmax weight is positive, the identity-value output)."""
    q = jnp.asarray(np.random.default_rng(1).standard_normal((B, T, N, S)), jnp.float32)
    k = jnp.asarray(np.random.default_rng(2).standard_normal((B, S, kv_heads, S)), jnp.float32)
    out = np.asarray(call(q, k, _identity_value(kv_heads)))  # (B, T, N, S): p * m / (1 - p)
    mask = np.swapaxes(out, 1, 2) != 0
    if causal:
        mask &= np.tril(np.ones((T, S), bool))
    return mask


def _check_against_reference(rng, call, rate, causal, kv_heads=K, rtol=1e-4):
    mask = _learn_mask(call, rate, causal, kv_heads)
    q, k, v, d_o = _inputs(rng, kv_heads)
    out, pullback = jax.vjp(call, *(jnp.asarray(x, jnp.float32) for x in (q, k, v)))
    grads = pullback(jnp.asarray(d_o, jnp.float32))
    for got, want in zip((out, *grads), _reference(q, k, v, d_o, mask, rate, causal)):
        np.testing.assert_allclose(np.asarray(got), want, rtol=rtol, atol=rtol)
    return mask


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("kv_heads", [K, N])
def test_xla_matches_the_float64_reference_with_its_mask(rng, causal, kv_heads):
    key = jax.random.key(int(rng.integers(2**31)))
    call = jax.jit(lambda q, k, v: sdpagraph.attention(q, k, v, is_causal=causal, dropout_rate=0.25, dropout_rng=key,
                                                       implementation="xla"))
    mask = _check_against_reference(rng, call, 0.25, causal, kv_heads)
    allowed = np.broadcast_to(np.tril(np.ones((T, S), bool)) if causal else np.ones((T, S), bool), mask.shape)
    assert abs(mask[allowed].mean() - 0.75) < 0.05  # 2000-odd draws: 5 sigma is ~0.045


def test_the_identity_value_shows_the_scaling(rng):
    key = jax.random.key(int(rng.integers(2**31)))
    q = jnp.asarray(rng.standard_normal((B, T, N, S)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((B, S, K, S)), jnp.float32)
    out = sdpagraph.attention(q, k, _identity_value(), dropout_rate=0.4, dropout_rng=key, implementation="xla")
    plain = sdpagraph.attention(q, k, _identity_value(), implementation="xla")  # the softmax weights
    kept = np.asarray(out) != 0
    np.testing.assert_allclose(np.asarray(out)[kept], np.asarray(plain)[kept] / 0.6, rtol=1e-5)


def test_the_blockwise_path_draws_the_direct_paths_mask(rng):
    q, k, v, d_o = (jnp.asarray(x, jnp.float32) for x in _inputs(rng))
    call = prepare_call(q, k, v, is_causal=True)
    call = dropout.with_dropout(call, 0.3, jax.random.key(int(rng.integers(2**31))))

    def run(block):
        return jax.vjp(lambda q, k, v: xla_attention(call.spec, q, k, v, call.inputs, block=block), q, k, v)

    (direct, lse_direct), pull_direct = run(None)
    (blocks, lse_blocks), pull_blocks = run(5)  # 5 does not divide 16: the last block overlaps
    np.testing.assert_allclose(blocks, direct, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(lse_blocks, lse_direct, rtol=1e-5, atol=1e-5)
    cotangent = (d_o, jnp.zeros_like(lse_direct))
    for got, want in zip(pull_blocks(cotangent), pull_direct(cotangent)):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_the_mask_follows_the_key_and_the_residual_ignores_it(rng):
    q, k, v, _ = (jnp.asarray(x, jnp.float32) for x in _inputs(rng))
    run = lambda key: sdpagraph.attention(q, k, v, dropout_rate=0.5, dropout_rng=key, return_residual=True)  # noqa: E731
    (a, lse_a), (b, _), (c, _) = run(jax.random.key(1)), run(jax.random.key(1)), run(jax.random.key(2))
    assert np.array_equal(a, b) and not np.array_equal(a, c)
    _, lse_plain = sdpagraph.attention(q, k, v, return_residual=True)
    np.testing.assert_allclose(lse_a, lse_plain, rtol=1e-6)
    legacy = run(jax.random.PRNGKey(1))[0]  # a raw uint32 key works too
    assert legacy.shape == a.shape and np.all(np.isfinite(legacy))


def test_every_batch_row_and_head_draws_its_own_mask():
    one_seed = jnp.full((3, 4), 12345, jnp.int32)  # one seed spread over (B, N), as a cuDNN block's
    mask = np.asarray(dropout.keep_mask(one_seed, 0.5, jnp.arange(64), jnp.arange(64)))
    flat = mask.reshape(12, -1)
    assert len({row.tobytes() for row in flat}) == 12
    assert abs(mask.mean() - 0.5) < 0.02  # 49152 draws
    assert abs(np.corrcoef(flat[:, :-1].ravel(), flat[:, 1:].ravel())[0, 1]) < 0.03  # neighbours independent


@pytest.fixture
def cudnn_standin(cudnn_on_cpu, monkeypatch):
    monkeypatch.setattr(cudnn_execute, "call_executor", stats_backward_executor)
    return cudnn_on_cpu[0]


@pytest.mark.parametrize("causal", [False, True])
def test_the_cudnn_path_passes_one_seed_to_forward_and_backward(rng, cudnn_standin, causal):
    key = jax.random.key(int(rng.integers(2**31)))
    call = jax.jit(lambda q, k, v: sdpagraph.attention(q, k, v, is_causal=causal, dropout_rate=0.2, dropout_rng=key,
                                                       implementation="cudnn"))
    mask = _check_against_reference(rng, call, 0.2, causal)
    assert 0.7 < mask[np.broadcast_to(np.tril(np.ones((T, S), bool)), mask.shape)].mean() < 0.9
    assert {(spec.dropout, direction) for spec, _, direction in cudnn_standin} == {(0.2, "forward"),
                                                                                  (0.2, "backward")}


@pytest.mark.parametrize("implementation", ["xla", "cudnn"])
def test_sinks_join_dropout_exactly(rng, cudnn_standin, implementation):
    key = jax.random.key(int(rng.integers(2**31)))
    sinks = rng.standard_normal(N)

    def call(q, k, v, sinks=jnp.asarray(sinks, jnp.float32)):
        return sdpagraph.attention(q, k, v, sinks=sinks, dropout_rate=0.3, dropout_rng=key,
                                   implementation=implementation)

    mask = _learn_mask(jax.jit(call), 0.3, False)  # p' m / (1 - p): nonzero where kept
    q, k, v, d_o = _inputs(rng)
    out, pullback = jax.vjp(call, *(jnp.asarray(x, jnp.float32) for x in (q, k, v, sinks)))
    got = (out, *pullback(jnp.asarray(d_o, jnp.float32)))
    for have, want in zip(got, _reference(q, k, v, d_o, mask, 0.3, False, sinks)):
        np.testing.assert_allclose(np.asarray(have), want, rtol=1e-4, atol=1e-4)
    assert not any(spec.sinks for spec, _, _ in cudnn_standin)  # composed, never cuDNN's own sinks


def test_bad_arguments_name_themselves(rng):
    q = jnp.asarray(rng.standard_normal((1, 8, 2, 8)), jnp.float32)
    key = jax.random.key(0)
    for rate, error, words in ((1.0, ValueError, "in \\[0, 1\\)"), (-0.1, ValueError, "in \\[0, 1\\)"),
                               ("0.1", TypeError, "dropout_rate must be a Python float"),
                               (True, TypeError, "dropout_rate must be")):
        with pytest.raises(error, match=words):
            sdpagraph.attention(q, q, q, dropout_rate=rate, dropout_rng=key)
    with pytest.raises(ValueError, match="needs dropout_rng"):
        sdpagraph.attention(q, q, q, dropout_rate=0.1)
    with pytest.raises(TypeError, match="dropout_rng must be a jax PRNG key"):
        sdpagraph.attention(q, q, q, dropout_rate=0.1, dropout_rng=7)
    with pytest.raises(ValueError, match="single key"):
        sdpagraph.attention(q, q, q, dropout_rate=0.1, dropout_rng=jax.random.split(key, 2))
    pages = jnp.zeros((4, 4, 2, 8))
    with pytest.raises(ValueError, match="paged K/V .* inference-only"):
        sdpagraph.attention(q[:, :1], pages, pages, page_table=jnp.zeros((1, 2), jnp.int32),
                            key_value_seq_lengths=jnp.full((1,), 8, jnp.int32), dropout_rate=0.1, dropout_rng=key)
    np.testing.assert_array_equal(sdpagraph.attention(q, q, q, dropout_rate=0.0), sdpagraph.attention(q, q, q))


def test_check_support_takes_the_rate_without_a_key(rng):
    q = jnp.asarray(rng.standard_normal((1, 8, 2, 8)), jnp.float32)
    answer = sdpagraph.check_support(q, q, q, dropout_rate=0.1, implementation="small_seq")
    assert not answer.supported and "no dropout" in answer.reason


def test_the_spec_keys_the_rate_and_the_graph_reads_seed_and_offset():
    from tests.test_builder_cpu import lower_fake, make_spec
    spec = AttentionSpec(1, 8, 8, 2, 2, 8, 8, "bfloat16", 0.3)
    assert "dropout" not in spec.to_dict()
    dropped = dataclasses.replace(spec, dropout=0.1)
    assert dropped.to_dict()["dropout"] == 0.1 and "dropout0.1" in dropped.summary()
    assert AttentionSpec.from_dict(dropped.to_dict()) == dropped
    for direction in ("forward", "backward", "inference"):
        operands, _ = graph_io(dropped, None, direction)
        assert operands[-2:] == DROPOUT
        assert describe(dropped, None, direction)[DROPOUT[0]].dims == (1, 1, 1, 1)
        graph_spec = make_spec(is_causal=True, dropout=0.1)
        options = lower_fake(graph_spec, None, direction)[3]
        rate, seed, offset = options["dropout"]
        assert rate == 0.1 and seed is not offset
    assert "dropout" not in lower_fake(make_spec(is_causal=True), None, "backward")[3]


def test_a_recorded_dropout_call_reads_back(rng, tmp_path):
    from sdpagraph.deploy.specfile import load_specs
    q = jnp.asarray(rng.standard_normal((1, 8, 2, 8)), jnp.bfloat16)
    path = tmp_path / "specs.json"
    with sdpagraph.record(str(path)):
        jax.grad(lambda q: sdpagraph.attention(q, q, q, is_causal=True, dropout_rate=0.1, dropout_rng=jax.random.key(0),
                                               ).astype(jnp.float32).sum())(q)
    entries = load_specs(path)
    assert [entry.spec.dropout for entry in entries] == [0.1]
    assert entries[0].directions == ("forward", "backward")
    text = path.read_text().replace('"dropout": 0.1', '"dropout": 1.5')
    path.write_text(text)
    with pytest.raises(Exception, match="dropout must be a rate"):
        load_specs(path)


def test_calls_that_run_as_packed_documents_keep_their_dropout(rng, cudnn_standin):
    """Chunked attention runs as packed documents, packed ids on the THD graph: both graphs carry the
    rate, and the identity-value output shows a mask kept at ~1 - p."""
    key = jax.random.key(int(rng.integers(2**31)))
    q = jnp.asarray(rng.standard_normal((2, 64, 4, 16)), jnp.float32)
    ids = jnp.asarray(np.repeat(np.arange(1, 5), 16)[None].repeat(2, 0), jnp.int32)
    for kwargs in (dict(chunk_size=16), dict(segment_ids=ids)):
        loss = lambda q: sdpagraph.attention(q, q, q, is_causal=True, dropout_rate=0.25, dropout_rng=key,  # noqa: E731
                                             implementation="cudnn", **kwargs).sum()
        assert np.all(np.isfinite(jax.grad(loss)(q)))
    assert {(spec.segments, spec.dropout, direction) for spec, _, direction in cudnn_standin} == {
        ("self", 0.25, "forward"), ("self", 0.25, "backward")}
    value = jnp.broadcast_to(jnp.eye(16, dtype=jnp.float32)[None, :, None, :], (2, 16, 4, 16))
    out = sdpagraph.attention(q[:, :16], q[:, :16], value, chunk_size=8, dropout_rate=0.25, dropout_rng=key,
                              implementation="cudnn")
    allowed = np.kron(np.eye(2, dtype=bool), np.ones((8, 8), bool))  # (T, S): the chunks
    kept = (np.swapaxes(np.asarray(out), 1, 2) != 0)[:, :, allowed]
    assert 0.6 < kept.mean() < 0.9
