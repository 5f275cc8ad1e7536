"""FlexAttention-style mods through `sdpagraph.attention`: jax.numpy score_mods and mask_mods,
against jax.nn.dot_product_attention (XLA) and a float64 NumPy reference, forward and gradients."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import sdpagraph
from sdpagraph import mods
from sdpagraph.call import prepare_call
from tests.reference import Mod, allowed, attention_fwd_bwd


def qkv(rng, B=2, T=48, S=48, N=8, K=2, H=16, dtype=jnp.float32):
    q = jnp.asarray(rng.standard_normal((B, T, N, H)), dtype)
    k, v = (jnp.asarray(rng.standard_normal((B, S, K, H)), dtype) for _ in range(2))
    return q, k, v


def jax_ref(q, k, v, **kwargs):
    return jax.nn.dot_product_attention(q, k, v, implementation="xla", **kwargs)


def rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def test_jnp_softcap_and_causal_mask_mod_match_the_graph_forms(rng):
    q, k, v = qkv(rng)
    softcap = lambda s, b, h, i, j: 20.0 * jnp.tanh(s / 20.0)  # noqa: E731
    causal = lambda b, h, i, j: i >= j  # noqa: E731

    def loss(fn):
        return jax.value_and_grad(lambda q, k, v: jnp.sum(fn(q, k, v) ** 2), argnums=(0, 1, 2))(q, k, v)

    flex = loss(lambda q, k, v: sdpagraph.attention(q, k, v, score_mod=softcap, mask_mod=causal))
    graph = loss(lambda q, k, v: sdpagraph.attention(q, k, v, score_mod=mods.softcap(20.0), is_causal=True))
    for a, b in zip(jax.tree_util.tree_leaves(flex), jax.tree_util.tree_leaves(graph)):
        assert rel(a, b) < 1e-5


def symmetric_alibi(slopes):
    slopes = np.asarray(slopes, np.float64)[None, :, None, None]
    return Mod(lambda s, b, h, q, k: s - slopes * np.abs(q - k), lambda s, *_: np.ones_like(s))


def test_captured_arrays_become_operands_and_match_a_bias(rng):
    q, k, v = qkv(rng, K=8)
    slopes = jnp.asarray(rng.random(8) * 0.3, jnp.float32)
    alibi = lambda s, b, h, i, j: s - slopes[h] * jnp.abs(i - j)  # noqa: E731
    call = prepare_call(q, k, v, score_mod=alibi)
    assert call.score_mod is not None and call.inputs.python_mods is None
    assert [a.shape for a in call.inputs.mod_arrays.values()] == [(1, 8, 1, 1)]
    positions = np.arange(48)
    bias = -(np.asarray(slopes)[:, None, None] * np.abs(positions[:, None] - positions[None, :]))[None]
    out = sdpagraph.attention(q, k, v, score_mod=alibi)
    assert rel(out, jax_ref(q, k, v, bias=jnp.asarray(bias, jnp.float32))) < 1e-5
    ok, q_pos, k_pos = allowed(2, 48, 48)
    dout = rng.standard_normal(out.shape)
    expected, (dq, _, _, _) = attention_fwd_bwd(q, k, v, dout, scale=16 ** -0.5, ok=ok, q_pos=q_pos, k_pos=k_pos,
                                                mod=symmetric_alibi(slopes))
    assert rel(out, expected) < 1e-5
    grad = jax.grad(lambda q: jnp.sum(sdpagraph.attention(q, k, v, score_mod=alibi) * dout))(q)
    assert rel(grad, dq) < 1e-4


def test_a_document_mask_mod_with_captured_ids_matches_a_boolean_mask(rng):
    q, k, v = qkv(rng, T=32, S=32)
    doc = jnp.asarray(np.sort(rng.integers(0, 3, (2, 32)), axis=1), jnp.int32)
    same_doc = lambda b, h, i, j: doc[b, i] == doc[b, j]  # noqa: E731
    out = sdpagraph.attention(q, k, v, mask_mod=same_doc, is_causal=True)
    mask = (doc[:, None, :, None] == doc[:, None, None, :]) & jnp.tril(jnp.ones((32, 32), bool))
    assert rel(out, jax_ref(q, k, v, mask=mask)) < 1e-5


def test_rows_a_mask_mod_empties_give_zeros(rng):
    q, k, v = qkv(rng)
    out = sdpagraph.attention(q, k, v, mask_mod=lambda b, h, i, j: (i >= 8) & (j <= i))
    assert np.all(np.asarray(out[:, :8]) == 0.0) and np.all(np.isfinite(np.asarray(out)))
    grad = jax.grad(lambda q: sdpagraph.attention(q, k, v, mask_mod=lambda b, h, i, j: (i >= 8) & (j <= i)).sum())(q)
    assert np.all(np.asarray(grad[:, :8]) == 0.0) and np.all(np.isfinite(np.asarray(grad)))


def test_bf16_and_gqa(rng):
    q, k, v = qkv(rng, dtype=jnp.bfloat16)
    out = sdpagraph.attention(q, k, v, score_mod=lambda s, b, h, i, j: s * 0.5, mask_mod=lambda b, h, i, j: i >= j)
    expected = jax_ref(q.astype(jnp.float32) * 0.5 ** 0.5, k.astype(jnp.float32) * 0.5 ** 0.5,
                       v.astype(jnp.float32), is_causal=True, scale=16 ** -0.5)
    assert out.dtype == jnp.bfloat16 and rel(out, expected) < 2e-2


def test_what_the_graph_cannot_express_runs_on_xla_and_says_why(rng):
    q, k, v = qkv(rng, T=32, S=32)
    table = jnp.asarray(rng.standard_normal(64), jnp.float32)
    relative = lambda s, b, h, i, j: s + table[i - j + 32]  # noqa: E731 - a gather at a computed index
    answer = sdpagraph.check_support(q, k, v, score_mod=relative)
    assert not answer.supported and answer.backend == "xla" and "computed index" in answer.reason
    bias = np.asarray(table)[np.arange(32)[:, None] - np.arange(32)[None, :] + 32][None, None]
    assert rel(sdpagraph.attention(q, k, v, score_mod=relative), jax_ref(q, k, v, bias=jnp.asarray(bias))) < 1e-5
    with pytest.raises(ValueError, match="implementation='cudnn' cannot run"):
        sdpagraph.attention(q, k, v, score_mod=relative, implementation="cudnn")


def test_a_jnp_mod_under_jit_with_a_traced_closure(rng):
    q, k, v = qkv(rng)

    @jax.jit
    def run(q, k, v, cap):
        return sdpagraph.attention(q, k, v, score_mod=lambda s, b, h, i, j: cap * jnp.tanh(s / cap))

    assert rel(run(q, k, v, 7.0), sdpagraph.attention(q, k, v, score_mod=mods.softcap(7.0))) < 1e-5


def test_forms_and_returns_are_checked_with_the_argument_named(rng):
    q, k, v = qkv(rng, T=16, S=16)
    with pytest.raises(TypeError, match=r"score_mod takes 2 positional arguments.*score_mod\(score, b, h, q_idx"):
        sdpagraph.attention(q, k, v, score_mod=lambda s, b: s)
    with pytest.raises(TypeError, match="mask_mod takes 3 positional arguments"):
        sdpagraph.attention(q, k, v, mask_mod=lambda b, h, i: i > 0)
    with pytest.raises(TypeError, match="mask_mod must return one boolean"):
        sdpagraph.attention(q, k, v, mask_mod=lambda b, h, i, j: i * 1.0)
    with pytest.raises(ValueError, match="score_mod_bprop cannot be combined with mask_mod"):
        sdpagraph.attention(q, k, v, score_mod=mods.softcap(5.0), mask_mod=lambda b, h, i, j: i >= j,
                            score_mod_bprop=lambda g, d, t: d)
