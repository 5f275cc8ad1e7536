"""The small-sequence forward kernel (`jax_api.small_seq_kernel`), in Pallas' interpreter on a CPU:
its output, logsumexp and probabilities against the XLA formulation and the XLA backend, the
backend's gradients when the kernel runs its forward, and where it is used."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sdpagraph.jax_api import small_seq_core, small_seq_kernel
from sdpagraph.jax_api.call import prepare_call
from sdpagraph.jax_api.small_seq import small_seq_attention
from sdpagraph.jax_api.xla import xla_attention
from tests.test_small_seq import rel_err, values_and_grads


def draw(rng, shape, dtype):
    return jnp.asarray(rng.standard_normal(shape), dtype)


@pytest.mark.parametrize("t,s,n,h,dtype", [(1, 2, 4, 16, "float32"), (2, 8, 8, 32, "float32"),
                                           (4, 32, 4, 16, "bfloat16"), (1, 16, 2, 64, "float16")])
def test_the_kernel_computes_what_the_xla_formulation_does(t, s, n, h, dtype):
    rng = np.random.default_rng()
    q, k, v = draw(rng, (3, t, n, h), dtype), draw(rng, (3, s, n, h), dtype), draw(rng, (3, s, n, h), dtype)
    scale = 1.0 / np.sqrt(h)
    out, lse, probs = small_seq_kernel.forward(q, k, v, scale, True, interpret=True)
    static = small_seq_core.Static(n, scale, None, ())
    aux = small_seq_core.Aux(None, {}, None)
    want_out, want_lse = small_seq_core.attend(static, q, k, v, None, aux)  # the XLA formulation on a CPU
    want_probs = small_seq_core.probabilities(static, q, k, v, None, aux)  # (B, N, T, S)
    tolerance = 2e-5 if dtype == "float32" else 1e-2
    assert out.dtype == v.dtype and rel_err(out, want_out) < tolerance
    np.testing.assert_allclose(np.transpose(lse, (0, 2, 1)), want_lse, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.transpose(probs, (0, 3, 1, 2)), want_probs, rtol=1e-5, atol=1e-6)
    assert np.allclose(np.sum(probs, axis=2), 1.0, atol=1e-5)
    _, none_saved, nothing = small_seq_kernel.forward(q, k, v, scale, False, interpret=True)
    assert nothing is None and np.allclose(none_saved, lse)


def test_the_backend_with_the_kernel_forward_matches_xla_values_and_gradients(monkeypatch):
    """The backend's custom_vjp takes the kernel's probabilities as its residual: values and
    gradients of q, k, v against the XLA backend."""
    calls = []
    real = small_seq_kernel.forward

    def interpreted(*args, **kwargs):
        calls.append(args[4])  # with_probs
        return real(*args, **kwargs, interpret=True)

    monkeypatch.setattr(small_seq_kernel, "usable", lambda q, k, v: True)
    monkeypatch.setattr(small_seq_kernel, "forward", interpreted)
    rng = np.random.default_rng()
    q, k, v = draw(rng, (5, 2, 4, 16), "float32"), draw(rng, (5, 8, 4, 16), "float32"), draw(rng, (5, 8, 4, 16), "float32")
    dout, dlse = draw(rng, q.shape, "float32"), draw(rng, (5, 4, 2), "float32")

    def through(backend):
        def run(q, k, v):
            call = prepare_call(q, k, v)
            return backend(call.spec, q, k, v, call.inputs, call.score_mod)
        return run

    ours = values_and_grads(through(small_seq_attention), (q, k, v), dout, dlse)
    assert calls == [True]  # the training forward, with the probabilities the backward reads
    theirs = values_and_grads(through(xla_attention), (q, k, v), dout, dlse)
    for got, want in [(ours[0], theirs[0]), (ours[1], theirs[1]), *zip(ours[2], theirs[2])]:
        assert rel_err(got, want) < 2e-5
    through(small_seq_attention)(q, k, v)
    assert calls == [True, False]  # without a gradient, no probabilities are written


def test_where_the_kernel_runs(monkeypatch):
    q, k = jnp.zeros((2, 1, 16, 128), jnp.bfloat16), jnp.zeros((2, 16, 16, 128), jnp.bfloat16)
    assert not small_seq_kernel.usable(q, k, k)  # a CPU backend
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert small_seq_kernel.usable(q, k, k)
    assert not small_seq_kernel.usable(q, k[:, :, :4], k[:, :, :4])  # GQA: the XLA formulation
    assert not small_seq_kernel.usable(q, k[:, :12], k[:, :12])  # S not a power of two
    assert not small_seq_kernel.usable(q[:, :, :, :96], k[..., :96], k[..., :96])  # nor H
    monkeypatch.setenv(small_seq_kernel.ENV_SWITCH, "0")
    assert not small_seq_kernel.usable(q, k, k)
    # Heads per block: K and V of the block within MAX_BLOCK_ELEMENTS, a power of two dividing N.
    assert [small_seq_kernel.heads_per_block(16, s, 128) for s in (2, 16, 32)] == [16, 16, 8]
    assert small_seq_kernel.heads_per_block(12, 2, 128) == 4 and small_seq_kernel.heads_per_block(16, 512, 128) == 0


def test_calls_with_something_to_mask_or_modify_keep_the_xla_formulation(monkeypatch):
    used = []
    monkeypatch.setattr(small_seq_kernel, "usable", lambda q, k, v: used.append(1) or False)
    static = small_seq_core.Static(4, 0.25, None, ())
    q = jnp.ones((2, 1, 4, 16), jnp.float32)
    k = jnp.ones((2, 8, 4, 16), jnp.float32)
    masked = small_seq_core.Aux(jnp.ones((2, 1, 8, 4, 1), bool), {}, None)
    small_seq_core.attend(static, q, k, k, None, masked)
    small_seq_core.attend(static, q, k, k, jnp.zeros((1, 1, 1, 8)), small_seq_core.Aux(None, {}, None))
    assert not used  # decided before asking about shapes
    small_seq_core.attend(static, q, k, k, None, small_seq_core.Aux(None, {}, None))
    assert used == [1]
