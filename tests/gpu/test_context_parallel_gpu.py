"""Context parallelism's cuDNN blocks on one GPU: a mesh of one device still runs the ring's block
code, and with `load_balanced=True` the sequence is two chunks, so the pairs it computes are the
skipped future one, the causal diagonal ones and an unmasked earlier one, with nonzero global
offsets: the block graphs (and the position-offset operands of mods that read positions) are
built and run by real cuDNN. Two-GPU equality is tests/gpu/test_sharding_gpu.py.

Skipped without a GPU (conftest.py).
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

import sdpagraph
from sdpagraph import mods

from tests.reference import rel_err

pytestmark = pytest.mark.usefixtures("private_cache")


def case(name, rng, N):
    slopes = jnp.asarray(rng.random(N) * 0.1, jnp.float32)
    return {
        "causal": dict(is_causal=True),
        "softcap_causal": dict(is_causal=True, score_mod=mods.softcap(30.0)),
        "jnp_alibi_causal": dict(is_causal=True, score_mod=lambda s, b, h, i, j: s + slopes[h] * (j - i)),
        "plain": dict(),
    }[name]


@pytest.mark.parametrize("strategy", ["ring", "all_to_all"])
@pytest.mark.parametrize("heads", [(8, 8), (8, 2)], ids=["mha", "gqa"])
@pytest.mark.parametrize("name", ["causal", "softcap_causal", "jnp_alibi_causal", "plain"])
def test_one_device_context_parallel_matches_single_device_xla(name, heads, strategy, report):
    rng = np.random.default_rng()
    B, T, H = 2, 512, 128
    N, K = heads
    q, k, v, do = (jnp.asarray(rng.standard_normal(shape), jnp.bfloat16)
                   for shape in ((B, T, N, H), (B, T, K, H), (B, T, K, H), (B, T, N, H)))
    kwargs = case(name, rng, N)
    mesh = Mesh(np.array(jax.devices()[:1]), ("cp",))
    cp = dict(context_parallel_axis="cp", mesh=mesh, load_balanced=True, context_parallel_strategy=strategy)
    balance = lambda x: sdpagraph.load_balance(x, 1)  # noqa: E731
    support = sdpagraph.check_support(*map(balance, (q, k, v)), **cp, **kwargs)
    report(f"cp one GPU {strategy:<10} {name:<17} {heads}: supported={support.supported} {support.reason}")
    assert support.supported, support.reason

    def loss_cp(q, k, v):
        out = sdpagraph.attention(*map(balance, (q, k, v)), implementation="cudnn", **cp, **kwargs)
        out = sdpagraph.unload_balance(out, 1)
        return jnp.sum(out.astype(jnp.float32) * do.astype(jnp.float32)), out

    def loss_ref(q, k, v):
        out = sdpagraph.attention(q, k, v, implementation="xla", **kwargs)
        return jnp.sum(out.astype(jnp.float32) * do.astype(jnp.float32)), out

    grad = lambda f: jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2), has_aux=True))  # noqa: E731
    (_, out), grads = grad(loss_cp)(q, k, v)
    (_, ref), grads_ref = grad(loss_ref)(q, k, v)
    errors = [rel_err(out, ref)] + [rel_err(a, b) for a, b in zip(grads, grads_ref)]
    report(f"cp one GPU {strategy:<10} {name:<17} {heads}: rel err out {errors[0]:.1e} dq {errors[1]:.1e} "
           f"dk {errors[2]:.1e} dv {errors[3]:.1e}")
    assert all(np.isfinite(errors)) and max(errors) < 2e-2, errors
