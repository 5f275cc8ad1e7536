"""The small-sequence backend on a GPU: its one-kernel inference forward (`small_seq_kernel`, Pallas
on Triton) where the call has nothing to mask or modify at T 1, S <= 16, the XLA formulation
elsewhere and whenever a gradient is taken; values and gradients against the XLA backend on fresh
random inputs."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import sdpagraph
from sdpagraph import mods
from sdpagraph.backends.small_seq import kernel as small_seq_kernel

from tests.reference import rel_err

CASES = {  # name: (B, T, S, N, K, H, attention kwargs, whether the kernel runs the forward)
    "T1_S2": (512, 1, 2, 16, 16, 128, {}, True),
    "T1_S16": (512, 1, 16, 16, 16, 128, {}, True),
    "T1_S8_H64": (256, 1, 8, 8, 8, 64, {}, True),
    "T4_S16": (256, 4, 16, 16, 16, 128, {}, False),
    "gqa": (256, 1, 16, 16, 4, 128, {}, False),
    "softcap": (256, 1, 16, 16, 16, 128, dict(score_mod=mods.softcap(20.0)), False),
    "S12": (256, 1, 12, 16, 16, 128, {}, False),
}


@pytest.mark.parametrize("name", CASES)
def test_small_seq_matches_xla_forward_and_grads(name, monkeypatch):
    b, t, s, n, kv, h, kwargs, by_kernel = CASES[name]
    calls = []
    real = small_seq_kernel.forward
    monkeypatch.setattr(small_seq_kernel, "forward", lambda *a, **k: calls.append(1) or real(*a, **k))
    rng = np.random.default_rng()
    q, do = (jnp.asarray(rng.standard_normal((b, t, n, h)), jnp.bfloat16) for _ in range(2))
    k, v = (jnp.asarray(rng.standard_normal((b, s, kv, h)), jnp.bfloat16) for _ in range(2))

    def loss(impl, q, k, v):
        out = sdpagraph.attention(q, k, v, implementation=impl, **kwargs)
        return jnp.sum(out.astype(jnp.float32) * do.astype(jnp.float32)), out

    def run(impl):
        return jax.jit(jax.value_and_grad(lambda *a: loss(impl, *a), argnums=(0, 1, 2), has_aux=True))(q, k, v)

    (_, out), grads = run("small_seq")
    assert calls == []  # with a gradient: the XLA formulation
    (_, want), want_grads = run("xla")
    errors = [rel_err(out, want)] + [rel_err(a, b) for a, b in zip(grads, want_grads)]
    assert all(np.isfinite(errors)) and max(errors) < 2e-2, errors
    inference = jax.jit(lambda q, k, v: sdpagraph.attention(q, k, v, implementation="small_seq", **kwargs))(q, k, v)
    assert calls == ([1] if by_kernel else [])
    assert rel_err(inference, want) < 2e-2
