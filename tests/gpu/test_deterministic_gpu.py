"""cuDNN's deterministic backward on the GPU: with `deterministic=True` two runs of the same step give
bitwise-equal gradients, which match the XLA backend. Skipped without a GPU (conftest.py)."""
import jax
import jax.numpy as jnp
import numpy as np

import sdpagraph

from tests.reference import rel_err


def test_deterministic_gradients_are_bitwise_reproducible():
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.standard_normal((2, 2048, 16, 128)), jnp.bfloat16) for _ in range(3))

    def grads(implementation, deterministic=None):
        loss = lambda q, k, v: jnp.sum(sdpagraph.attention(  # noqa: E731
            q, k, v, is_causal=True, implementation=implementation, deterministic=deterministic).astype(jnp.float32))
        return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))

    step = grads("cudnn", True)
    first, second = step(q, k, v), step(q, k, v)
    for a, b in zip(first, second):
        assert np.array_equal(np.asarray(a), np.asarray(b))
    want = grads("xla")(*(x.astype(jnp.float32) for x in (q, k, v)))
    assert all(rel_err(a, b) < 2e-2 for a, b in zip(first, want))
