"""Mods whose leading scaling runs as cuDNN's attention scale (scoremod.scale_folding) on cuDNN, against the XLA
backend, forward and gradients: negative factors too (a negative attention scale), as a literal and as a scalar
bound at run time, and the softcap with a cap that changes between calls of one graph.

Skipped without a GPU (conftest.py).
"""
import jax.numpy as jnp
import numpy as np
import pytest

from sdpagraph import mods

from tests.gpu.test_jnp_mods_gpu import assert_cudnn_matches_xla, random_qkvdo

pytestmark = pytest.mark.usefixtures("private_cache")


def graph_scalar_mod(graph, score, tensors):
    return graph.tanh(input=score * tensors["k"]) * 3.0


CASES = {
    "negative scalar": dict(score_mod=graph_scalar_mod, score_mod_tensors={"k": -0.7}, is_causal=True),
    "negative literal": dict(score_mod=lambda g, s, t: g.tanh(input=s / -8.0) * 8.0, is_causal=True),
    "jnp negative literal": dict(score_mod=lambda s, b, h, i, j: 4.0 * jnp.tanh(s * -0.5)),
    "softcap 7": dict(score_mod=mods.softcap(7.0), is_causal=True),
    "softcap 50": dict(score_mod=mods.softcap(50.0), is_causal=True),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_folded_mod_matches_xla(name, report):
    rng = np.random.default_rng()
    q, k, v, do = random_qkvdo(rng, 2, 384, 8, 2, 128)
    q = q * 4  # scores past the tanh's linear part
    assert_cudnn_matches_xla(q, k, v, do, CASES[name], f"folded {name:<22}", report)
