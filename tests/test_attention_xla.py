"""sdpagraph.attention on the XLA backend against jax.nn.dot_product_attention and a float64 reference."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import sdpagraph
from sdpagraph import mods
from tests import reference as ref

TOL = {"float32": 2e-5, "bfloat16": 3e-2}


def rel_err(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30)


def draw(rng, shape, dtype):
    return jnp.asarray(rng.standard_normal(shape), dtype)


def qkv(rng, B=2, T=24, S=24, N=4, K=2, H=16, Hv=None, dtype="float32"):
    return (draw(rng, (B, T, N, H), dtype), draw(rng, (B, S, K, H), dtype), draw(rng, (B, S, K, Hv or H), dtype))


# ---------------------------------------------------------------- against jax.nn.dot_product_attention

JAX_CASES = {
    "plain": dict(),
    "causal": dict(is_causal=True),
    "window_int": dict(local_window_size=3),
    "window_pair": dict(local_window_size=(5, 2)),
    "causal_window": dict(is_causal=True, local_window_size=(4, 0)),
    "padding": dict(query_seq_lengths=[20, 9], key_value_seq_lengths=[13, 24]),
    "padding_causal": dict(is_causal=True, query_seq_lengths=[24, 7], key_value_seq_lengths=[24, 19]),
    "scale": dict(scale=0.37),
}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("case", sorted(JAX_CASES))
@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (4, 1)], ids=["mha", "gqa", "mqa"])
def test_matches_jax_forward_and_grads(rng, case, dtype, heads):
    kwargs = dict(JAX_CASES[case])
    for name in ("query_seq_lengths", "key_value_seq_lengths"):
        if name in kwargs:
            kwargs[name] = jnp.asarray(kwargs[name], jnp.int32)
    q, k, v = qkv(rng, N=heads[0], K=heads[1], dtype=dtype)
    dout = draw(rng, q.shape, dtype)

    def loss(fn, q, k, v):
        return jnp.sum(fn(q, k, v, **kwargs).astype(jnp.float32) * dout.astype(jnp.float32))

    ours = functools.partial(sdpagraph.attention, implementation="xla")
    theirs = functools.partial(jax.nn.dot_product_attention, implementation="xla")
    assert rel_err(ours(q, k, v, **kwargs), theirs(q, k, v, **kwargs)) < TOL[dtype]
    g_ours = jax.grad(functools.partial(loss, ours), argnums=(0, 1, 2))(q, k, v)
    g_theirs = jax.grad(functools.partial(loss, theirs), argnums=(0, 1, 2))(q, k, v)
    for a, b in zip(g_ours, g_theirs):
        assert rel_err(a, b) < 2 * TOL[dtype]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_bias_and_mask_match_jax_with_bias_grad(rng, dtype):
    q, k, v = qkv(rng, dtype=dtype)
    bias = draw(rng, (1, 4, 24, 24), dtype)
    mask = jnp.asarray(rng.random((2, 1, 24, 24)) < 0.8)
    f = lambda fn, q, b: jnp.sum(fn(q, k, v, bias=b, mask=mask, implementation="xla").astype(jnp.float32) ** 2)
    assert rel_err(sdpagraph.attention(q, k, v, bias, mask), jax.nn.dot_product_attention(q, k, v, bias, mask)) < TOL[dtype]
    ours = jax.grad(functools.partial(f, sdpagraph.attention), argnums=(0, 1))(q, bias)
    theirs = jax.grad(functools.partial(f, jax.nn.dot_product_attention), argnums=(0, 1))(q, bias)
    for a, b in zip(ours, theirs):
        assert rel_err(a, b) < 2 * TOL[dtype]


def test_unbatched_and_residual_match_jax(rng):
    q, k, v = (x[0] for x in qkv(rng))
    out, lse = sdpagraph.attention(q, k, v, is_causal=True, return_residual=True)
    out_j, lse_j = jax.nn.dot_product_attention(q, k, v, is_causal=True, return_residual=True)
    assert out.shape == q.shape and lse.shape == lse_j.shape == q.shape[:-1]
    assert rel_err(out, out_j) < 1e-5 and rel_err(lse, lse_j) < 1e-5


# ---------------------------------------------------------------- against the float64 reference

def check_against_reference(rng, dtype, *, B=2, T=24, S=24, N=4, K=2, H=16, Hv=None, mod=ref.IDENTITY,
                            ref_mask=None, bias=None, **kwargs):
    q, k, v = qkv(rng, B, T, S, N, K, H, Hv, dtype)
    dout = draw(rng, (B, T, N, Hv or H), dtype)
    ok, q_pos, k_pos = ref_mask
    scale = kwargs.get("scale", 1 / np.sqrt(H))
    out_ref, grads_ref = ref.attention_fwd_bwd(q, k, v, dout, scale=scale, ok=ok, q_pos=q_pos, k_pos=k_pos,
                                               mod=mod, bias=bias)

    def loss(q, k, v):
        out = sdpagraph.attention(q, k, v, bias, implementation="xla", **kwargs)
        return jnp.sum(out.astype(jnp.float32) * dout.astype(jnp.float32)), out

    (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)
    assert rel_err(out, out_ref) < TOL[dtype]
    for got, want in zip(grads, grads_ref[:3]):
        assert np.all(np.isfinite(np.asarray(got, np.float32)))
        assert rel_err(got, want) < 2 * TOL[dtype]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("T,S", [(16, 32), (32, 16)])
def test_bottom_right_causal(rng, dtype, T, S):
    mask = ref.allowed(2, T, S, is_causal=True, alignment="bottom_right")
    check_against_reference(rng, dtype, T=T, S=S, ref_mask=mask, is_causal=True, causal_alignment="bottom_right")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_bottom_right_with_padding_and_window(rng, dtype):
    lens_q, lens_kv = [10, 16], [30, 21]
    mask = ref.allowed(2, 16, 32, is_causal=True, alignment="bottom_right", window=(6, -1),
                       q_lengths=lens_q, kv_lengths=lens_kv)
    check_against_reference(rng, dtype, T=16, S=32, ref_mask=mask, is_causal=True, causal_alignment="bottom_right",
                            local_window_size=(6, -1), query_seq_lengths=jnp.asarray(lens_q, jnp.int32),
                            key_value_seq_lengths=jnp.asarray(lens_kv, jnp.int32))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_two_sided_window_and_chunks(rng, dtype):
    mask = ref.allowed(2, 24, 24, window=(4, 3), chunk=8)
    check_against_reference(rng, dtype, ref_mask=mask, local_window_size=(4, 3), chunk_size=8)
    mask = ref.allowed(2, 24, 24, is_causal=True, chunk=5)
    check_against_reference(rng, dtype, ref_mask=mask, is_causal=True, chunk_size=5)


def random_segments(rng, B, T, max_len=9):
    ids = np.zeros((B, T), np.int32)
    for b in range(B):
        t, seg = 0, 0
        while t < T - 3:
            n = int(rng.integers(1, max_len))
            seg += int(rng.integers(1, 3))  # ids need not be consecutive
            ids[b, t:t + n] = seg
            t += n
        ids[b, T - int(rng.integers(0, 3)):] = 0  # padding tail
    return ids


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("extra", [{}, dict(is_causal=True), dict(is_causal=True, local_window_size=(3, 0)),
                                   dict(chunk_size=3, is_causal=True)], ids=["plain", "causal", "window", "chunk"])
def test_packed_self_attention(rng, dtype, extra):
    ids = random_segments(rng, 2, 24)
    mask = ref.allowed(2, 24, 24, is_causal=extra.get("is_causal", False), window=extra.get("local_window_size", (-1, -1)),
                       chunk=extra.get("chunk_size"), q_ids=ids, kv_ids=ids, max_segments=24)
    check_against_reference(rng, dtype, ref_mask=mask, segment_ids=jnp.asarray(ids), **extra)


def test_packed_cross_attention_bottom_right_and_overflow(rng, monkeypatch):
    monkeypatch.setenv("SDPAGRAPH_CHECK_SEGMENTS", "0")  # the query's third segment is dropped, not an error
    q_ids = np.array([[1, 1, 1, 2, 2, 3, 3, 3, 0, 0, 0, 0]] * 2, np.int32)
    kv_ids = np.array([[1, 1, 1, 1, 2, 2, 2, 2, 2, 3, 3, 0, 0, 0, 0, 0]] * 2, np.int32)
    mask = ref.allowed(2, 12, 16, is_causal=True, alignment="bottom_right", q_ids=q_ids, kv_ids=kv_ids, max_segments=2)
    check_against_reference(rng, "float32", T=12, S=16, ref_mask=mask, is_causal=True, causal_alignment="bottom_right",
                            segment_ids=(jnp.asarray(q_ids), jnp.asarray(kv_ids)), max_segments_per_seq=2)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_score_mods_against_reference(rng, dtype):
    slopes = rng.random(4) * 0.5
    plain = ref.allowed(2, 24, 24)
    check_against_reference(rng, dtype, ref_mask=plain, mod=ref.softcap_mod(3.0), score_mod=mods.softcap(3.0))
    check_against_reference(rng, dtype, ref_mask=plain, mod=ref.alibi_mod(slopes), score_mod=mods.alibi(slopes))
    causal = ref.allowed(2, 24, 24, is_causal=True)
    check_against_reference(rng, dtype, ref_mask=causal, mod=ref.softcap_mod(2.0),
                            score_mod=mods.compose(mods.softcap(2.0), mods.causal()))
    check_against_reference(rng, dtype, ref_mask=causal, mod=ref.softcap_mod(2.0), score_mod=mods.softcap(2.0),
                            is_causal=True)


def test_relative_bias_and_prefix_lm_against_reference(rng):
    D = 3
    table = rng.standard_normal((4, 2 * D + 1))
    rel = ref.Mod(lambda s, b, h, q, k: s + table[np.arange(4)[None, :, None, None], np.clip(k - q, -D, D) + D],
                  lambda s, *_: np.ones_like(s))
    check_against_reference(rng, "float32", ref_mask=ref.allowed(2, 24, 24), mod=rel,
                            score_mod=mods.relative_position_bias(table, D))
    ok, qp, kp = ref.allowed(2, 24, 24)
    prefix = ok & ((kp[:, None, :] < 5) | (kp[:, None, :] <= qp[:, :, None]))
    check_against_reference(rng, "float32", ref_mask=(prefix, qp, kp), score_mod=mods.prefix_lm(5))


def test_user_callback_with_scalars_arrays_and_bias(rng):
    bias = draw(rng, (2, 1, 24, 24), "float32")
    scale_per_head = rng.random((1, 4, 1, 1)).astype(np.float32) + 0.5

    def my_mod(graph, score, tensors):  # written against the cuDNN pygraph API
        x = graph.mul(a=score, b=tensors["w"], compute_data_type="FLOAT")
        x.set_data_type("FLOAT")
        return graph.add(a=x, b=tensors["shift"]) * 0.5

    mod = ref.Mod(lambda s, *_: (s * scale_per_head + 0.25) * 0.5, lambda s, *_: np.broadcast_to(scale_per_head * 0.5, s.shape))
    check_against_reference(rng, "float32", ref_mask=ref.allowed(2, 24, 24), mod=mod, bias=np.asarray(bias),
                            score_mod=my_mod, score_mod_tensors={"w": scale_per_head, "shift": 0.25})


# ---------------------------------------------------------------- transformations and edge cases

def test_vmap_over_a_leading_axis(rng):
    q, k, v = qkv(rng)
    stacked = [jnp.stack([x, 2 * x]) for x in (q, k, v)]
    f = functools.partial(sdpagraph.attention, is_causal=True, score_mod=mods.softcap(4.0))
    out = jax.vmap(f)(*stacked)
    assert rel_err(out[1], f(2 * q, 2 * k, 2 * v)) < 1e-5


def test_fully_masked_rows_give_zero_and_finite_grads(rng):
    q, k, v = qkv(rng, T=8, S=8)
    lengths = jnp.asarray([0, 8], jnp.int32)
    f = lambda q, k, v: sdpagraph.attention(q, k, v, key_value_seq_lengths=lengths, local_window_size=(1, 0))
    out = f(q, k, v)
    assert np.all(np.asarray(out[0]) == 0)
    grads = jax.grad(lambda *a: jnp.sum(f(*a) ** 2), argnums=(0, 1, 2))(q, k, v)
    assert all(np.all(np.isfinite(np.asarray(g))) for g in grads)


def test_distinct_head_dim_for_value(rng):
    check_against_reference(rng, "float32", H=16, Hv=8, ref_mask=ref.allowed(2, 24, 24, is_causal=True), is_causal=True)


def test_implementation_none_falls_back_to_xla_with_reason(rng, caplog):
    q, k, v = qkv(rng)
    caplog.set_level("INFO", logger="sdpagraph")
    out = sdpagraph.attention(q, k, v, is_causal=True, query_seq_lengths=jnp.asarray([3, 5], jnp.int32))
    assert out.shape == q.shape
    support = sdpagraph.check_support(jax.ShapeDtypeStruct(q.shape, q.dtype), k, v, is_causal=True)
    assert not support.supported and support.backend == "xla" and support.reason
    with pytest.raises(ValueError, match="implementation='cudnn'"):
        sdpagraph.attention(q, k, v, implementation="cudnn")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_mask_mods_match_the_mask_arguments(rng, dtype):
    check_against_reference(rng, dtype, ref_mask=ref.allowed(2, 24, 24, window=(4, 3)),
                            score_mod=mods.sliding_window(4, 3))
    check_against_reference(rng, dtype, ref_mask=ref.allowed(2, 24, 24, chunk=5), score_mod=mods.chunked(5))
    check_against_reference(rng, dtype, ref_mask=ref.allowed(2, 24, 24, is_causal=True, window=(6, -1), chunk=8),
                            score_mod=mods.compose(mods.causal(), mods.sliding_window(6, -1), mods.chunked(8)))


def test_the_xla_backend_honours_a_user_score_mod_bprop():
    """cuDNN runs the user's bprop; so must the XLA backend (it used to differentiate the forward)."""
    rng = np.random.default_rng()
    q, k, v = (jnp.asarray(rng.standard_normal((2, 16, 4, 8)), jnp.float32) for _ in range(3))
    double = lambda g, s, t: s * 2.0  # noqa: E731

    def loss(q, k, v, **kwargs):
        return jnp.sum(sdpagraph.attention(q, k, v, score_mod=double, implementation="xla", **kwargs) ** 2)

    derived = jax.grad(loss, argnums=(0, 1, 2))(q, k, v)
    tripled = jax.jit(jax.grad(lambda q, k, v: loss(q, k, v, score_mod_bprop=lambda g, d, t: d * 3.0),
                               argnums=(0, 1, 2)))(q, k, v)
    for custom, auto in zip(tripled, derived[:2]):  # dq and dk flow through the mod: 3/2 of the derived
        np.testing.assert_allclose(custom, 1.5 * auto, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(tripled[2], derived[2], rtol=1e-5, atol=1e-6)  # dv does not
