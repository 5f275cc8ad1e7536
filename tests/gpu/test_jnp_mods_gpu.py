"""jax.numpy score_mods and mask_mods on cuDNN: they must run there (check_support says so) and
match the XLA backend forward and backward; what cuDNN cannot run falls back with a reason.

Skipped without a GPU (conftest.py). The speed side (within 3% of the graph mod / native flag)
is bench/jnp_mods.py.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import sdpagraph

from tests.reference import rel_err

pytestmark = pytest.mark.usefixtures("private_cache")


def jnp_case(name, rng, N):
    slopes = jnp.asarray(rng.random(N) * 0.2, jnp.float32)
    return {
        "softcap": dict(score_mod=lambda s, b, h, i, j: 30.0 * jnp.tanh(s / 30.0), is_causal=True),
        "alibi": dict(score_mod=lambda s, b, h, i, j: s + slopes[h] * (j - i),
                      mask_mod=lambda b, h, i, j: i >= j),
        "causal_mask_mod": dict(mask_mod=lambda b, h, i, j: i >= j),
        "window_mask_mod": dict(mask_mod=lambda b, h, i, j: (i >= j) & (i - j <= 64)),
        "softcap_window": dict(score_mod=lambda s, b, h, i, j: 20.0 * jnp.tanh(s / 20.0),
                               mask_mod=lambda b, h, i, j: (i >= j) & (i - j <= 100)),
    }[name]


def loss_and_grads(impl, q, k, v, do, kwargs):
    def loss(q, k, v):
        out = sdpagraph.attention(q, k, v, implementation=impl, **kwargs)
        return jnp.sum(out.astype(jnp.float32) * do.astype(jnp.float32)), out

    (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)
    return out, grads


def assert_cudnn_matches_xla(q, k, v, do, kwargs, label, report):
    """The call runs on cuDNN (check_support says so), and its output and gradients match the XLA backend's."""
    support = sdpagraph.check_support(q, k, v, **kwargs)
    assert support.supported and support.backend == "cudnn", support.reason
    out, grads = loss_and_grads("cudnn", q, k, v, do, kwargs)
    out_ref, grads_ref = loss_and_grads("xla", q, k, v, do, kwargs)
    errors = [rel_err(out, out_ref)] + [rel_err(a, b) for a, b in zip(grads, grads_ref)]
    report(f"{label}: rel err out {errors[0]:.1e} dq {errors[1]:.1e} dk {errors[2]:.1e} dv {errors[3]:.1e}")
    assert all(np.isfinite(errors)) and max(errors) < 2e-2, errors


def random_qkvdo(rng, B, T, N, K, H, dtype=jnp.bfloat16):
    return tuple(jnp.asarray(rng.standard_normal(shape), dtype)
                 for shape in ((B, T, N, H), (B, T, K, H), (B, T, K, H), (B, T, N, H)))


@pytest.mark.parametrize("heads", [(8, 8), (8, 2)], ids=["mha", "gqa"])
@pytest.mark.parametrize("name", ["softcap", "alibi", "causal_mask_mod", "window_mask_mod", "softcap_window"])
def test_jnp_mod_runs_on_cudnn_and_matches_xla(name, heads, report):
    rng = np.random.default_rng()
    B, T, H = 2, 384, 128
    N, K = heads
    q, k, v, do = random_qkvdo(rng, B, T, N, K, H)
    assert_cudnn_matches_xla(q, k, v, do, jnp_case(name, rng, N), f"jnp {name:<16} {heads}", report)


def test_causal_mask_mod_builds_the_native_causal_graph(private_cache):
    """`i >= j` lowers to the native causal mask: the same graph as is_causal=True (one key)."""
    rng = np.random.default_rng()
    q, k, v, _ = random_qkvdo(rng, 1, 256, 4, 4, 64)
    sdpagraph.check_support(q, k, v, is_causal=True)
    before = private_cache.stats()["builds"]
    support = sdpagraph.check_support(q, k, v, mask_mod=lambda b, h, i, j: i >= j)
    assert support.backend == "cudnn", support.reason
    assert private_cache.stats()["builds"] == before, "the causal mask_mod built a graph of its own"
    ref = sdpagraph.attention(q, k, v, is_causal=True, implementation="cudnn")
    out = sdpagraph.attention(q, k, v, mask_mod=lambda b, h, i, j: i >= j, implementation="cudnn")
    assert rel_err(out, ref) == 0


def test_rows_a_mask_mod_empties_give_zeros(report):
    """Queries 0..15 see no key at all: XLA gives 0 there; whatever backend runs must too."""
    rng = np.random.default_rng()
    B, T, N, H = 2, 256, 4, 64
    q, k, v, do = random_qkvdo(rng, B, T, N, N, H)
    kwargs = dict(mask_mod=lambda b, h, i, j: (i >= 16) & (j <= i - 16))
    support = sdpagraph.check_support(q, k, v, **kwargs)
    report(f"empty rows mask_mod: backend {support.backend}: {support.reason}")
    out, grads = loss_and_grads(None, q, k, v, do, kwargs)
    out_ref, grads_ref = loss_and_grads("xla", q, k, v, do, kwargs)
    assert float(jnp.max(jnp.abs(out[:, :16].astype(jnp.float32)))) == 0.0
    assert float(jnp.max(jnp.abs(grads[0][:, :16].astype(jnp.float32)))) == 0.0
    errors = [rel_err(out, out_ref)] + [rel_err(a, b) for a, b in zip(grads, grads_ref)]
    assert all(np.isfinite(errors)) and max(errors) < 2e-2, errors


def test_document_mask_over_captured_ids_is_right_on_whichever_backend_runs_it(report):
    """An equality of two id arrays may have no cuDNN engine on 9.19: then it must fall back with a
    reason; either way the default call matches the XLA backend."""
    rng = np.random.default_rng()
    B, T, N, H = 2, 256, 4, 64
    q, k, v, do = random_qkvdo(rng, B, T, N, N, H)
    doc = jnp.asarray(np.sort(rng.integers(0, 4, (B, T)), axis=1), jnp.int32)
    kwargs = dict(mask_mod=lambda b, h, i, j: (doc[b, i] == doc[b, j]) & (i >= j))
    support = sdpagraph.check_support(q, k, v, **kwargs)
    report(f"document mask_mod over captured ids: supported={support.supported} backend {support.backend}: "
           f"{support.reason}")
    assert support.supported or support.reason
    out, grads = loss_and_grads(None, q, k, v, do, kwargs)
    out_ref, grads_ref = loss_and_grads("xla", q, k, v, do, kwargs)
    errors = [rel_err(out, out_ref)] + [rel_err(a, b) for a, b in zip(grads, grads_ref)]
    assert all(np.isfinite(errors)) and max(errors) < 2e-2, errors

