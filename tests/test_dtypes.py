"""Dtypes as jax.nn.dot_product_attention takes them.

- NumPy float64 (and Python-made float64 arrays) are converted as jax converts them: float32 when
  x64 is off, so the call runs and returns float32;
- with `jax_enable_x64`, float64 inputs compute in float64 on the XLA backend and return float64,
  forward and backward, against the float64 NumPy reference; cuDNN says why it does not run them;
- float32 inputs stay float32 under x64.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import sdpagraph
from sdpagraph import mods
from tests.reference import allowed, attention_fwd_bwd, rel_err, softcap_mod


@pytest.fixture
def x64():
    previous = jax.config.jax_enable_x64
    jax.config.update("jax_enable_x64", True)
    try:
        yield
    finally:
        jax.config.update("jax_enable_x64", previous)


def _qkv(rng, b=2, t=24, s=40, n=4, k=2, h=16):
    return tuple(rng.standard_normal(shape) for shape in ((b, t, n, h), (b, s, k, h), (b, s, k, h)))


def test_numpy_float64_without_x64_runs_as_float32_like_jax(rng):
    q, k, v = _qkv(rng)
    assert q.dtype == np.float64 and not jax.config.jax_enable_x64
    out = sdpagraph.attention(q, k, v, is_causal=True)
    expected = jax.nn.dot_product_attention(q, k, v, is_causal=True)
    assert out.dtype == expected.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(out), np.asarray(expected), atol=2e-6, rtol=0)
    answer = sdpagraph.check_support(jax.ShapeDtypeStruct(q.shape, np.float64), k, v)
    assert answer.backend in sdpagraph.backends.registry.names()


def test_float64_under_x64_computes_in_float64(rng, x64):
    q, k, v = _qkv(rng)
    dout = rng.standard_normal(q.shape)
    scale = 0.3
    out, vjp = jax.vjp(lambda q, k, v: sdpagraph.attention(q, k, v, is_causal=True, scale=scale,
                                                           score_mod=mods.softcap(4.0)), q, k, v)
    grads = vjp(jnp.asarray(dout))
    assert out.dtype == jnp.float64 and all(g.dtype == jnp.float64 for g in grads)
    b, t, _, _ = q.shape
    s = k.shape[1]
    ok, q_pos, k_pos = allowed(b, t, s, is_causal=True)
    ref_out, ref_grads = attention_fwd_bwd(q, k, v, dout, scale=scale, ok=ok, q_pos=q_pos, k_pos=k_pos,
                                           mod=softcap_mod(4.0))
    # float32 arithmetic would leave ~1e-7; float64 leaves rounding at 1e-15.
    assert rel_err(out, ref_out) < 1e-12
    for got, want in zip(grads, ref_grads[:3]):
        assert rel_err(got, want) < 1e-12


def test_float64_under_x64_is_not_cudnn(rng, x64):
    q, k, v = _qkv(rng)
    answer = sdpagraph.check_support(q, k, v)
    assert not answer.supported and answer.backend == "xla"
    with pytest.raises(ValueError, match="implementation='cudnn'"):
        sdpagraph.attention(q, k, v, implementation="cudnn")


def test_float32_stays_float32_under_x64(rng, x64):
    q, k, v = (x.astype(np.float32) for x in _qkv(rng))
    out = sdpagraph.attention(q, k, v, is_causal=True, score_mod=mods.softcap(5.0))
    grad = jax.grad(lambda q: sdpagraph.attention(q, k, v, is_causal=True).sum())(jnp.asarray(q))
    assert out.dtype == grad.dtype == jnp.float32
    expected = jax.nn.dot_product_attention(q, k, v, is_causal=True)
    np.testing.assert_allclose(np.asarray(sdpagraph.attention(q, k, v, is_causal=True)), np.asarray(expected),
                               atol=2e-6, rtol=0)


def test_mixed_dtypes_name_the_arrays(rng):
    q, k, v = _qkv(rng)
    with pytest.raises(TypeError, match="query, key and value must share one dtype"):
        sdpagraph.attention(q.astype(np.float16), k, v)


@pytest.mark.parametrize("scale", [float("inf"), float("nan"), -float("inf")])
def test_a_non_finite_scale_is_refused(rng, scale):
    q, k, v = _qkv(rng)
    with pytest.raises(ValueError, match="scale must be a finite number"):
        sdpagraph.attention(q, k, v, scale=scale)
