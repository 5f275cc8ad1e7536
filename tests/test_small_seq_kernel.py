"""The small-sequence inference kernel (`backends.small_seq.kernel`), in Pallas' interpreter on a CPU:
its output and logsumexp against the XLA formulation and the XLA backend, and where it is used."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sdpagraph.backends.small_seq import core as small_seq_core

from sdpagraph.backends.small_seq import kernel as small_seq_kernel
from sdpagraph.config import SMALL_SEQ_KERNEL
from sdpagraph.call import prepare_call
from sdpagraph.backends.small_seq.backend import small_seq_attention
from sdpagraph.backends.xla import xla_attention
from tests.test_small_seq import rel_err, values_and_grads


def draw(rng, shape, dtype):
    return jnp.asarray(rng.standard_normal(shape), dtype)


@pytest.mark.parametrize("s,n,h,dtype", [(2, 4, 16, "float32"), (8, 8, 32, "float32"), (16, 4, 16, "bfloat16"),
                                         (4, 2, 64, "float16")])
def test_the_kernel_computes_what_the_xla_formulation_does(s, n, h, dtype):
    rng = np.random.default_rng()
    q, k, v = draw(rng, (3, 1, n, h), dtype), draw(rng, (3, s, n, h), dtype), draw(rng, (3, s, n, h), dtype)
    scale = 1.0 / np.sqrt(h)
    out, lse = small_seq_kernel.forward(q, k, v, scale, interpret=True)
    static = small_seq_core.Static(n, scale, None, ())
    want_out, want_lse = small_seq_core.attend(static, q, k, v, None, small_seq_core.Aux(None, {}, None))
    tolerance = 2e-5 if dtype == "float32" else 1e-2
    assert out.dtype == v.dtype and rel_err(out, want_out) < tolerance
    np.testing.assert_allclose(np.transpose(lse, (0, 2, 1)), want_lse, rtol=1e-5, atol=1e-5)


def test_the_backend_runs_the_kernel_without_a_gradient_only(monkeypatch):
    """Inference: the kernel's output and logsumexp, against the XLA backend. With a gradient the
    backend keeps its XLA formulation, whose probabilities its backward reads."""
    calls = []
    real = small_seq_kernel.forward
    monkeypatch.setattr(small_seq_kernel, "usable", lambda q, k, v: True)
    monkeypatch.setattr(small_seq_kernel, "forward", lambda *a: calls.append(1) or real(*a, interpret=True))
    rng = np.random.default_rng()
    q, k, v = draw(rng, (5, 1, 4, 16), "float32"), draw(rng, (5, 8, 4, 16), "float32"), draw(rng, (5, 8, 4, 16), "float32")

    def through(backend):
        def run(q, k, v):
            call = prepare_call(q, k, v)
            return backend(call.spec, q, k, v, call.inputs, call.score_mod)
        return run

    (out, lse), (want_out, want_lse) = through(small_seq_attention)(q, k, v), through(xla_attention)(q, k, v)
    assert calls == [1]
    assert rel_err(out, want_out) < 2e-5 and rel_err(lse, want_lse) < 2e-5
    dout = draw(rng, q.shape, "float32")
    ours, theirs = (values_and_grads(through(backend), (q, k, v), dout) for backend in (small_seq_attention, xla_attention))
    assert calls == [1]  # the gradient's forward did not run the kernel
    for got, want in [(ours[0], theirs[0]), *zip(ours[2], theirs[2])]:
        assert rel_err(got, want) < 2e-5


def test_where_the_kernel_runs(monkeypatch):
    q, k = jnp.zeros((2, 1, 16, 128), jnp.bfloat16), jnp.zeros((2, 16, 16, 128), jnp.bfloat16)
    assert not small_seq_kernel.usable(q, k, k)  # a CPU backend
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(jax, "device_count", lambda: 1)
    assert small_seq_kernel.usable(q, k, k)
    with monkeypatch.context() as several:  # XLA cannot partition the kernel: several devices keep XLA's
        several.setattr(jax, "device_count", lambda: 2)
        assert not small_seq_kernel.usable(q, k, k)
    assert not small_seq_kernel.usable(q, k[:, :, :4], k[:, :, :4])  # GQA: the XLA formulation
    assert not small_seq_kernel.usable(q, k[:, :12], k[:, :12])  # S not a power of two
    assert not small_seq_kernel.usable(jnp.concatenate([q, q], 1), k, k)  # T 2: the XLA formulation was faster
    long = jnp.zeros((2, 32, 16, 128), jnp.bfloat16)
    assert not small_seq_kernel.usable(q, long, long)  # S 32: likewise
    assert not small_seq_kernel.usable(q[:, :, :, :96], k[..., :96], k[..., :96])  # nor H
    monkeypatch.setenv(SMALL_SEQ_KERNEL.name, "0")
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
