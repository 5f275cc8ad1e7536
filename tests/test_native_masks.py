"""A lone mask_mod that is a diagonal band becomes the native flags (is_causal, local_window_size),
so cuDNN skips the masked tiles; anything else stays a mod. Values always match the mod itself."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import sdpagraph
from sdpagraph import mods
from sdpagraph.scoremod.native_masks import NativeMask, native_mask
from sdpagraph.call import prepare_call

SHAPE = (2, 96, 4, 32)
STRUCT = jax.ShapeDtypeStruct(SHAPE, jnp.float32)

NATIVE = [  # (mask_mod, the flags it equals)
    (lambda b, h, i, j: i >= j, NativeMask(True, (-1, -1))),
    (lambda b, h, i, j: j <= i, NativeMask(True, (-1, -1))),
    (lambda b, h, i, j: (i >= j) & (i - j <= 17), NativeMask(True, (17, 0))),
    (lambda b, h, i, j: (i - j < 18) & (j <= i), NativeMask(True, (17, 0))),
    (lambda b, h, i, j: jnp.abs(i - j) <= 9, NativeMask(False, (9, 9))),
    (lambda b, h, i, j: (j - i <= 5) & (i - j <= 20), NativeMask(False, (20, 5))),
    (lambda b, h, i, j: j - i <= 5, NativeMask(False, (-1, 5))),
    (lambda b, h, i, j: 2 * i + 1 >= 2 * j, NativeMask(True, (-1, -1))),  # d >= -1/2: d >= 0 in integers
    (lambda b, h, i, j: 2 * i + 3 >= 2 * j + 1, NativeMask(False, (-1, 1))),
]
NOT_NATIVE = [
    lambda b, h, i, j: i > j,  # the diagonal masked
    lambda b, h, i, j: i // 16 == j // 16,  # chunks: not a band
    lambda b, h, i, j: (i >= j) | (j < 4),  # an or
    lambda b, h, i, j: (i >= j) & (h > 0),  # reads the head
    lambda b, h, i, j: 2 * i >= j,  # not a function of i - j
    lambda b, h, i, j: j >= 3,
]


def spec_and_ir(**kwargs):
    call = prepare_call(STRUCT, STRUCT, STRUCT, **kwargs)
    return call.spec, call.score_mod


@pytest.mark.parametrize("index", range(len(NATIVE)))
def test_band_mask_mods_become_native_flags(index):
    mask_mod, expected = NATIVE[index]
    spec, ir = spec_and_ir(mask_mod=mask_mod)
    assert ir is None
    assert spec.is_causal == expected.is_causal
    assert spec.window == expected.window
    flags, _ = spec_and_ir(is_causal=expected.is_causal, local_window_size=expected.window)
    assert spec == flags  # the same spec, so the same graph key as the flags


@pytest.mark.parametrize("index", range(len(NOT_NATIVE)))
def test_other_masks_stay_mods(index):
    spec, ir = spec_and_ir(mask_mod=NOT_NATIVE[index])
    assert ir is not None and native_mask(ir) is None
    assert not spec.is_causal and not spec.has_window


def test_not_replaced_beside_a_score_mod_or_another_position_mask():
    causal = lambda b, h, i, j: i >= j  # noqa: E731
    _, ir = spec_and_ir(mask_mod=causal, score_mod=lambda s, b, h, i, j: jnp.tanh(s))
    assert ir is not None
    spec, ir = spec_and_ir(mask_mod=causal, local_window_size=(8, 8))
    assert ir is not None and spec.window == (8, 8) and not spec.is_causal
    _, ir = spec_and_ir(mask_mod=causal, causal_alignment="bottom_right")
    assert ir is not None


def test_graph_mods_are_left_alone():
    assert native_mask(spec_and_ir(score_mod=mods.causal())[1]) is None  # masked value is not -inf
    assert native_mask(None) is None


@pytest.mark.parametrize("index", range(len(NATIVE)))
def test_values_and_gradients_match_the_mask_mod_evaluated_as_python(index):
    """Against an independent reference: jax.nn.dot_product_attention with the mask_mod evaluated
    into a boolean mask (rows left empty by the mask give 0 in sdpagraph; none here lacks the diagonal)."""
    mask_mod, _ = NATIVE[index]
    rng = np.random.default_rng()
    q, k, v = (jnp.asarray(rng.standard_normal(SHAPE), jnp.float32) for _ in range(3))
    i = jnp.arange(SHAPE[1])[:, None]
    j = jnp.arange(SHAPE[1])[None, :]
    dense = jnp.broadcast_to(mask_mod(0, 0, i, j), (SHAPE[1], SHAPE[1]))[None, None]

    def ours(q, k, v):
        return sdpagraph.attention(q, k, v, mask_mod=mask_mod, implementation="xla")

    def ref(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, mask=dense, implementation="xla")

    np.testing.assert_allclose(ours(q, k, v), ref(q, k, v), rtol=2e-5, atol=2e-5)
    loss = lambda f: lambda q, k, v: jnp.sum(f(q, k, v) * v[:, :, :1, :1])  # noqa: E731
    for g, r in zip(jax.grad(loss(ours), (0, 1, 2))(q, k, v), jax.grad(loss(ref), (0, 1, 2))(q, k, v)):
        np.testing.assert_allclose(g, r, rtol=2e-4, atol=2e-5)
