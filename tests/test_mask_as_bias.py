"""The cuDNN path passes a boolean mask as an additive bias and zeroes rows with no key to attend to.

On the CPU, run that recipe through the XLA backend (same bias operand, same zeroing) and
check it against the XLA backend given the mask itself, and against a float64 NumPy
reference: outputs, logsumexp and gradients, with fully masked rows and a user bias.
"""
import numpy as np
import pytest

import jax
import jax.numpy as jnp

from sdpagraph.jax_api import cudnn as cudnn_path
from sdpagraph.jax_api.xla import RuntimeInputs, xla_attention
from sdpagraph.spec import normalize_arguments

B, T, S, N, H = 2, 24, 32, 4, 16


def numpy_reference(q, k, v, bias, mask, scale):
    logits = np.einsum("btnh,bsnh->bnts", q, k) * scale + bias
    logits = np.where(mask, logits, -np.inf)
    peak = np.max(logits, axis=-1, keepdims=True)
    peak = np.where(np.isfinite(peak), peak, 0.0)
    weights = np.where(mask, np.exp(logits - peak), 0.0)
    total = weights.sum(-1, keepdims=True)
    probs = weights / np.where(total > 0, total, 1.0)
    return np.einsum("bnts,bsnh->btnh", probs, v)


@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_mask_folded_into_the_bias_matches_the_mask(with_bias, dtype):
    rng = np.random.default_rng()
    q, k, v = (rng.standard_normal(shape).astype(np.float32) for shape in ((B, T, N, H), (B, S, N, H), (B, S, N, H)))
    mask = rng.random((B, 1, T, S)) < 0.6
    mask[0, 0, 3] = False  # a fully masked row in every head
    bias = (rng.standard_normal((1, N, T, S)) if with_bias else np.zeros((1, N, T, S))).astype(np.float32)
    q_, k_, v_ = (jnp.asarray(x, dtype) for x in (q, k, v))
    user_bias = jnp.asarray(bias) if with_bias else None
    call = normalize_arguments(q_, k_, v_, user_bias, jnp.asarray(mask), is_causal=False)
    spec = call.spec
    assert spec.graph_bias_shape == (B, N if with_bias else 1, T, S)
    inputs = RuntimeInputs(bias=user_bias, mask=jnp.asarray(mask))

    def folded(q, k, v, user_bias):
        inputs_ = RuntimeInputs(bias=user_bias, mask=jnp.asarray(mask))
        operand = cudnn_path._bias_operand(normalize_arguments(q, k, v, user_bias, jnp.asarray(mask)).spec,
                                           inputs_, q.dtype)
        bias_spec = normalize_arguments(q, k, v, operand).spec
        out, lse = xla_attention(bias_spec, q, k, v, RuntimeInputs(bias=operand))
        attended = cudnn_path._attended(spec, inputs_)
        out = jnp.where(attended, out, 0)
        lse = jnp.where(jnp.swapaxes(attended[..., 0], 1, 2), lse, -jnp.inf)
        return out, lse

    out, lse = folded(q_, k_, v_, user_bias)
    out_ref, lse_ref = xla_attention(spec, q_, k_, v_, inputs)
    expected = numpy_reference(*(np.asarray(x, np.float64) for x in (q_, k_, v_)),
                               bias.astype(np.float64), mask, spec.scale)
    tol = 2e-2
    np.testing.assert_allclose(np.asarray(out, np.float64), expected, atol=tol, rtol=tol)
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(out_ref, np.float32), atol=tol, rtol=tol)
    assert np.all(np.asarray(out)[0, 3] == 0) and np.all(np.isneginf(np.asarray(lse)[0, :, 3]))
    finite = np.isfinite(np.asarray(lse_ref))
    np.testing.assert_allclose(np.asarray(lse)[finite], np.asarray(lse_ref)[finite], atol=tol, rtol=tol)

    do = jnp.asarray(rng.standard_normal((B, T, N, H)), jnp.float32)
    loss = lambda fn: lambda *a: jnp.sum(fn(*a)[0].astype(jnp.float32) * do)  # noqa: E731
    reference = lambda q, k, v, b: xla_attention(spec, q, k, v, RuntimeInputs(bias=b, mask=jnp.asarray(mask)))  # noqa: E731
    argnums = (0, 1, 2, 3) if with_bias else (0, 1, 2)
    grads = jax.grad(loss(folded), argnums)(q_, k_, v_, user_bias)
    grads_ref = jax.grad(loss(reference), argnums)(q_, k_, v_, user_bias)
    for got, want in zip(grads, grads_ref):
        got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
        assert np.all(np.isfinite(got))
        assert np.linalg.norm(got - want) <= 3e-2 * np.linalg.norm(want)
