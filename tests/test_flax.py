"""sdpagraph.flax.attention_fn inside Flax's attention layers, against Flax's default attention."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

flax = pytest.importorskip("flax")
from flax import linen, nnx  # noqa: E402

import sdpagraph.flax  # noqa: E402
from sdpagraph import mods  # noqa: E402

B, L, F, HEADS = 2, 6, 16, 4


def inputs(seed=0, batch=(B,)):
    rng = np.random.default_rng(seed)
    return jnp.asarray(rng.standard_normal(batch + (L, F)), jnp.float32)


def assert_trees_close(a, b, tol=2e-5):
    jax.tree.map(lambda x, y: np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=tol, atol=tol), a, b)


def nnx_layer(**kwargs):
    return nnx.MultiHeadAttention(num_heads=HEADS, in_features=F, decode=False, rngs=nnx.Rngs(0), **kwargs)


@pytest.mark.parametrize("masked", [False, True])
def test_nnx_matches_default_attention(masked):
    x = inputs()
    mask = nnx.make_causal_mask(jnp.ones((B, L))) if masked else None  # float 0/1, (B, 1, L, L)
    default = nnx_layer()
    ours = nnx_layer(attention_fn=sdpagraph.flax.attention_fn())  # the default implementation choice
    assert_trees_close(nnx.state(default, nnx.Param), nnx.state(ours, nnx.Param), tol=0)  # same weights

    def loss(layer, x):
        return jnp.sum(layer(x, mask=mask) ** 2)

    np.testing.assert_allclose(np.asarray(ours(x, mask=mask)), np.asarray(default(x, mask=mask)), rtol=2e-5, atol=2e-5)
    (l0, (g0, gx0)), (l1, (g1, gx1)) = (nnx.value_and_grad(loss, argnums=(0, 1))(m, x) for m in (default, ours))
    np.testing.assert_allclose(l1, l0, rtol=2e-5)
    assert_trees_close(g1, g0)
    assert_trees_close(gx1, gx0)


def test_nnx_is_causal_argument_and_score_mod():
    x = inputs(1)
    default = nnx_layer()
    causal = nnx_layer(attention_fn=sdpagraph.flax.attention_fn(implementation="xla"))
    mask = nnx.make_causal_mask(jnp.ones((B, L)))
    np.testing.assert_allclose(np.asarray(causal(x, is_causal=True)), np.asarray(default(x, mask=mask)),
                               rtol=2e-5, atol=2e-5)
    via_mod = nnx_layer(attention_fn=sdpagraph.flax.attention_fn(score_mod=mods.causal(), implementation="xla"))
    np.testing.assert_allclose(np.asarray(via_mod(x)), np.asarray(default(x, mask=mask)), rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("batch", [(B,), (2, 3)])
def test_linen_matches_default_attention(batch):
    x = inputs(2, batch)
    mask = linen.make_causal_mask(jnp.ones(batch + (L,)))
    default = linen.MultiHeadDotProductAttention(num_heads=HEADS)
    ours = linen.MultiHeadDotProductAttention(num_heads=HEADS,
                                              attention_fn=sdpagraph.flax.attention_fn(implementation="xla"))
    params = default.init(jax.random.key(0), x, x, mask=mask)
    assert jax.tree.structure(params) == jax.tree.structure(ours.init(jax.random.key(0), x, x, mask=mask))

    def loss(module, params, x):
        return jnp.sum(module.apply(params, x, x, mask=mask) ** 2)

    np.testing.assert_allclose(np.asarray(ours.apply(params, x, x, mask=mask)),
                               np.asarray(default.apply(params, x, x, mask=mask)), rtol=2e-5, atol=2e-5)
    g0 = jax.grad(loss, argnums=(1, 2))(default, params, x)
    g1 = jax.grad(loss, argnums=(1, 2))(ours, params, x)
    assert_trees_close(g1, g0)


def test_extra_batch_dims_with_bias_and_mask_broadcast():
    rng = np.random.default_rng(3)
    q, k, v = (jnp.asarray(rng.standard_normal((2, 3, L, HEADS, 8)), jnp.float32) for _ in range(3))
    bias = jnp.asarray(rng.standard_normal((3, HEADS, L, L)), jnp.float32)  # broadcast over the first batch dim
    mask = jnp.asarray(rng.random((2, 1, 1, L, L)) > 0.3)
    fn = sdpagraph.flax.attention_fn(implementation="xla")
    ref = linen.dot_product_attention(q, k, v, bias=bias, mask=mask)
    np.testing.assert_allclose(np.asarray(fn(q, k, v, bias=bias, mask=mask)), np.asarray(ref), rtol=2e-5, atol=2e-5)


def test_dropout_runs_and_sow_weights_are_refused():
    fn = sdpagraph.flax.attention_fn(implementation="xla")
    rng = np.random.default_rng(5)
    q = jnp.asarray(rng.standard_normal((1, L, HEADS, 8)), jnp.float32)
    dropped = fn(q, q, q, dropout_rate=0.3, deterministic=False, dropout_rng=jax.random.key(0))
    want = sdpagraph.attention(q, q, q, dropout_rate=0.3, dropout_rng=jax.random.key(0), implementation="xla")
    np.testing.assert_array_equal(np.asarray(dropped), np.asarray(want))
    assert not np.allclose(dropped, fn(q, q, q))
    # deterministic: no dropout to apply
    np.testing.assert_array_equal(np.asarray(fn(q, q, q, dropout_rate=0.1, deterministic=True)), np.asarray(fn(q, q, q)))
    with pytest.raises(ValueError, match="sow"):
        fn(q, q, q, module=object())
    # A wrong array is reported before what the adapter lacks.
    bad_key = jnp.ones((1, L, HEADS, 4))
    with pytest.raises(ValueError, match="head dim"):
        fn(q, bad_key, q, dropout_rate=0.1, deterministic=False, dropout_rng=jax.random.key(0))
    with pytest.raises(ValueError, match="batch dims"):
        fn(q, jnp.ones((2, 1, L, HEADS, 8)), q, module=object())
    with pytest.raises(ValueError, match="bias"):
        fn(q, q, q, bias=jnp.ones((3, HEADS, L, L)), dropout_rate=0.1, deterministic=False)
    with pytest.raises(ValueError, match="needs dropout_rng"):
        fn(q, q, q, dropout_rate=0.1, deterministic=False)
    with pytest.raises(TypeError, match="Flax passes"):
        sdpagraph.flax.attention_fn(mask=None)
    layer = nnx.MultiHeadAttention(num_heads=HEADS, in_features=F, decode=False, dropout_rate=0.5,
                                   rngs=nnx.Rngs(0, dropout=1), attention_fn=fn)
    x = inputs()
    first, second = layer(x, deterministic=False), layer(x, deterministic=False)  # a new key each call
    assert not np.allclose(first, second) and not np.allclose(first, layer(x, deterministic=True))
