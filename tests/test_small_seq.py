"""The small-sequence backend against the XLA backend and jax.nn.dot_product_attention (values and
gradients), its regime, and its saved probabilities."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sdpagraph import mods
from sdpagraph.backends.small_seq import backend as small_seq
from sdpagraph.backends.small_seq import core as small_seq_core
from sdpagraph.call import prepare_call
from sdpagraph.backends.small_seq.backend import (MAX_KV_LEN, MAX_Q_LEN, residual_probabilities, small_seq_attention,
                                         small_seq_reason)
from sdpagraph.backends.xla import xla_attention

TOL = {"float32": 2e-5, "bfloat16": 3e-2, "float16": 1e-2}


def rel_err(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30)


def draw(rng, shape, dtype):
    return jnp.asarray(rng.standard_normal(shape), dtype)


def qkv(rng, B=3, T=2, S=8, N=8, K=2, H=16, dtype="float32"):
    return draw(rng, (B, T, N, H), dtype), draw(rng, (B, S, K, H), dtype), draw(rng, (B, S, K, H), dtype)


def backend_fn(backend, **kwargs):
    """(q, k, v[, bias]) -> (out, lse) through prepare_call and one backend."""
    def run(q, k, v, bias=None):
        call = prepare_call(q, k, v, bias, kwargs.get("mask"), **{n: x for n, x in kwargs.items() if n != "mask"})
        return backend(call.spec, q, k, v, call.inputs, call.score_mod)
    return run


def values_and_grads(fn, args, dout, dlse=None):
    """(out, lse, gradients of <out, dout> (+ <finite lse, dlse>) w.r.t. every argument)."""
    def loss(*a):
        out, lse = fn(*a)
        value = jnp.sum(out.astype(jnp.float32) * dout.astype(jnp.float32))
        if dlse is not None:
            value = value + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0) * dlse)
        return value, (out, lse)
    (_, (out, lse)), g = jax.value_and_grad(loss, argnums=tuple(range(len(args))), has_aux=True)(*args)
    return out, lse, g


def jax_nn(**kwargs):
    """jax.nn.dot_product_attention(implementation="xla") as (q, k, v[, bias]) -> (out, None)."""
    mask = kwargs.pop("mask", None)

    def run(q, k, v, bias=None):
        return jax.nn.dot_product_attention(q, k, v, bias, mask, implementation="xla", **kwargs), None
    return run


def check_against_xla(rng, args, dtype, dlse=True, with_jax=False, **kwargs):
    """small_seq against the XLA backend (values, lse, gradients, also through lse unless `with_jax`)
    and, with `with_jax`, against jax.nn.dot_product_attention (values, gradients): one jit."""
    q = args[0]
    dout = draw(rng, q.shape, dtype)
    d_lse = draw(rng, (q.shape[0], q.shape[2], q.shape[1]), "float32") if dlse and not with_jax else None

    @jax.jit
    def everything(*a):
        ours = values_and_grads(backend_fn(small_seq_attention, **kwargs), a, dout, d_lse)
        ref = values_and_grads(backend_fn(xla_attention, **kwargs), a, dout, d_lse)
        theirs = values_and_grads(jax_nn(**kwargs), a, dout)[::2] if with_jax else None
        return ours, ref, theirs

    (out, lse, g), (out_ref, lse_ref, g_ref), theirs = everything(*args)
    assert out.dtype == q.dtype and out.shape == out_ref.shape
    assert rel_err(out, out_ref) < TOL[dtype]
    np.testing.assert_array_equal(np.isinf(lse), np.isinf(lse_ref))
    finite = np.isfinite(np.asarray(lse_ref))
    np.testing.assert_allclose(np.asarray(lse)[finite], np.asarray(lse_ref)[finite], rtol=1e-4, atol=1e-4)
    for a, b in zip(g, g_ref):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert np.all(np.isfinite(np.asarray(a, np.float32)))
        assert rel_err(a, b) < 2 * TOL[dtype]
    if with_jax:  # (the same loss: without the lse term, which jax does not return)
        out_jax, g_jax = theirs
        assert rel_err(out, out_jax) < TOL[dtype]
        for a, b in zip(g, g_jax):
            assert rel_err(a, b) < 2 * TOL[dtype]


# ----------------------------------------------------------------------------- the grid

GRID = [(t, s, "float32") for t in (1, 2, 4) for s in (1, 2, 4, 8, 16, 32)]
GRID += [(t, s, "bfloat16") for t in (1, 4) for s in (1, 8, 32)]  # bf16: the corners and the middle


@pytest.mark.parametrize("T, S, dtype", GRID)
def test_grid_matches_xla_backend_and_jax(rng, T, S, dtype):
    q, k, v = qkv(rng, T=T, S=S, dtype=dtype)  # GQA: N=8 query heads over K=2
    check_against_xla(rng, (q, k, v), dtype, with_jax=True)


@pytest.mark.parametrize("S", [1, 16])
def test_lse_gradient(rng, S):
    q, k, v = qkv(rng, T=4, S=S)
    check_against_xla(rng, (q, k, v), "float32", dlse=True)


# ----------------------------------------------------------------------------- features

@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_padding_lengths(rng, dtype):
    q, k, v = qkv(rng, T=4, S=16, dtype=dtype)
    lengths = dict(query_seq_lengths=jnp.array([4, 1, 3], jnp.int32), key_value_seq_lengths=jnp.array([16, 5, 1], jnp.int32))
    check_against_xla(rng, (q, k, v), dtype, with_jax=True, **lengths)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_mask_and_bias_with_bias_gradient(rng, dtype):
    q, k, v = qkv(rng, T=4, S=8, dtype=dtype)
    bias = draw(rng, (1, 8, 4, 8), dtype)
    mask = rng.random((3, 1, 4, 8)) < 0.7
    # every row keeps a key: jax gives a row with none the mean of v, sdpagraph 0 (README, Semantics;
    # such rows have a test of their own below); a random mask empties one about once in 1270 draws
    mask[..., 0] |= ~mask.any(axis=-1)
    check_against_xla(rng, (q, k, v, bias), dtype, with_jax=True, mask=jnp.asarray(mask))


def test_full_bias_per_head_and_batch(rng):
    q, k, v = qkv(rng, T=2, S=4)
    bias = draw(rng, (3, 8, 2, 4), "float32")
    check_against_xla(rng, (q, k, v, bias), "float32")


@pytest.mark.parametrize("kwargs", [
    dict(is_causal=True, causal_alignment="bottom_right"),
    dict(is_causal=True, causal_alignment="bottom_right", key_value_seq_lengths=jnp.array([16, 3, 9], jnp.int32),
         query_seq_lengths=jnp.array([4, 2, 1], jnp.int32)),
    dict(is_causal=True),
    dict(local_window_size=(2, 1), causal_alignment="bottom_right"),
    dict(is_causal=True, chunk_size=4, causal_alignment="bottom_right"),
], ids=["causal_br", "causal_br_padding", "causal_tl", "window_br", "chunk_br"])
def test_position_masks(rng, kwargs):
    q, k, v = qkv(rng, T=4, S=16)
    check_against_xla(rng, (q, k, v), "float32", **kwargs)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_softcap_score_mod(rng, dtype):
    q, k, v = qkv(rng, T=2, S=16, dtype=dtype)
    q = q * 4  # scores large enough for the cap to matter
    check_against_xla(rng, (q, k, v), dtype, score_mod=mods.softcap(2.0), is_causal=True,
                      causal_alignment="bottom_right")


def test_alibi_score_mod_reads_positions_and_heads(rng):
    q, k, v = qkv(rng, T=4, S=8)
    check_against_xla(rng, (q, k, v), "float32", score_mod=mods.alibi(np.linspace(0.1, 0.8, 8)))


def test_fully_masked_rows_give_zero_and_zero_gradients(rng):
    q, k, v = qkv(rng, T=2, S=4)
    mask = jnp.ones((3, 1, 2, 4), bool).at[0, :, 1, :].set(False)  # batch 0, query 1: nothing to attend
    lengths = jnp.array([4, 0, 4], jnp.int32)  # batch 1: no keys at all
    run = backend_fn(small_seq_attention, mask=mask, key_value_seq_lengths=lengths)
    out, lse = jax.jit(run)(q, k, v)
    assert np.all(np.asarray(out)[0, 1] == 0) and np.all(np.asarray(out)[1] == 0)
    assert np.all(np.isneginf(np.asarray(lse)[0, :, 1])) and np.all(np.isneginf(np.asarray(lse)[1]))
    assert np.all(np.isfinite(np.asarray(out)))
    dq, dk, dv = jax.jit(jax.grad(lambda q, k, v: jnp.sum(run(q, k, v)[0] ** 2), argnums=(0, 1, 2)))(q, k, v)
    for g in (dq, dk, dv):
        assert np.all(np.isfinite(np.asarray(g)))
    assert np.all(np.asarray(dq)[0, 1] == 0) and np.all(np.asarray(dq)[1] == 0)
    assert np.all(np.asarray(dk)[1] == 0) and np.all(np.asarray(dv)[1] == 0)
    check_against_xla(rng, (q, k, v), "float32", mask=mask, key_value_seq_lengths=lengths)


def test_lower_rank_mask_and_fp16(rng):
    q, k, v = qkv(rng, T=2, S=4, dtype="float16")
    mask = jnp.asarray(rng.random((2, 4)) < 0.8).at[:, 0].set(True)  # (T, S): left-padded to 4-D
    check_against_xla(rng, (q, k, v), "float16", mask=mask)


# ----------------------------------------------------------------------------- the regime

def spec_of(B=2, T=1, S=8, N=4, K=4, H=16, **kwargs):
    structs = [jax.ShapeDtypeStruct(s, jnp.bfloat16) for s in ((B, T, N, H), (B, S, K, H), (B, S, K, H))]
    return prepare_call(*structs, **kwargs).spec


def test_regime_limits():
    assert small_seq_reason(spec_of(T=MAX_Q_LEN, S=MAX_KV_LEN)) is None
    assert small_seq_reason(spec_of(T=1, S=1)) is None
    assert "T=5" in small_seq_reason(spec_of(T=MAX_Q_LEN + 1))
    assert "S=33" in small_seq_reason(spec_of(S=MAX_KV_LEN + 1))
    ids = jax.ShapeDtypeStruct((2, 4), jnp.int32)
    assert "max_seqlen_q / max_seqlen_kv" in small_seq_reason(spec_of(T=4, S=4, segment_ids=ids))
    q, k, v = qkv(np.random.default_rng(0), T=1, S=40)
    call = prepare_call(q, k, v)
    with pytest.raises(ValueError, match="small-sequence backend cannot run .* S=40"):
        small_seq_attention(call.spec, q, k, v, call.inputs)


# ----------------------------------------------------------------------------- what the gradient saves

def test_residuals_are_the_probabilities_and_the_backward_does_not_recompute_scores(rng):
    B, T, S, N, K, H = 3, 2, 8, 8, 2, 16
    q, k, v = qkv(rng, B=B, T=T, S=S, N=N, K=K, H=H)
    call = prepare_call(q, k, v, is_causal=True, causal_alignment="bottom_right")
    probs = residual_probabilities(call.spec, q, k, v, call.inputs)
    out, lse = xla_attention(call.spec, q, k, v, call.inputs)
    logits = jnp.einsum("btnh,bsnh->bnts", q, jnp.repeat(k, N // K, axis=2)) * call.spec.scale
    allowed = np.tril(np.ones((T, S), bool), S - T)
    expected = np.where(allowed, np.exp(np.asarray(logits) - np.asarray(lse)[..., None]), 0.0)
    assert probs.shape == (B, N, T, S) and probs.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(probs), expected, rtol=1e-5, atol=1e-6)

    # The custom_vjp's residuals hold p in the score layout (B, T, S, K, G), fp32, and not the output.
    static = small_seq._static(call.spec, None, call.inputs)
    _, aux = small_seq._bshd(call.spec, call.inputs)
    (o, _), residuals = small_seq_core._core_fwd(static, q, k, v, None, aux)
    saved_p = residuals[5]
    assert saved_p.shape == (B, T, S, K, N // K) and saved_p.dtype == jnp.float32
    assert not any(r is o for r in jax.tree_util.tree_leaves(residuals))
    # The backward contracts over H once (dP = dO . V): it does not recompute q . K.
    jaxpr = jax.make_jaxpr(lambda res, ct: small_seq_core._core_bwd(static, res, ct))(residuals, (o, lse.reshape(B, K, N // K, T).transpose(0, 3, 1, 2)))
    over_h = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "reduce_sum"
              and e.invars[0].aval.shape[-1] == H and e.outvars[0].aval.shape == saved_p.shape]
    assert len(over_h) == 1
    exps = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "exp"]
    assert not exps  # no softmax recomputation either


def test_jit_of_grad_and_grad_of_jit(rng):
    q, k, v = qkv(rng, T=1, S=4)
    f = lambda q, k, v: jnp.sum(backend_fn(small_seq_attention)(q, k, v)[0] ** 2)  # noqa: E731
    a = jax.jit(jax.grad(f, argnums=(0, 1, 2)))(q, k, v)
    b = jax.grad(jax.jit(f), argnums=(0, 1, 2))(q, k, v)
    for x, y in zip(a, b):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-5, atol=1e-6)


def test_reached_through_attention(rng):
    import sdpagraph

    q, k, v = qkv(rng, T=2, S=8)
    out = sdpagraph.attention(q, k, v, implementation="small_seq")
    assert rel_err(out, sdpagraph.attention(q, k, v, implementation="xla")) < TOL["float32"]
