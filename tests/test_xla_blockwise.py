"""The XLA backend's blockwise path (`backends.xla_blocks`) against its direct path and jax: same
values and gradients for every feature, and memory O(B·N·T·block) instead of O(B·N·T·S)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sdpagraph import mods
from sdpagraph.backends.xla import KEY_BLOCK, xla_attention
from sdpagraph.call import prepare_call
from tests.reference import rel_err

DIRECT = 1 << 30  # a block holding every key: the direct path


def draw(rng, shape, dtype="float32"):
    return jnp.asarray(rng.standard_normal(shape), dtype)


def run(q, k, v, bias=None, block=DIRECT, **kwargs):
    """(out, lse) of xla_attention with the given key block, arguments as sdpagraph.attention's."""
    call = prepare_call(q, k, v, bias, kwargs.pop("mask", None), **kwargs)
    return xla_attention(call.spec, q, k, v, call.inputs, call.score_mod, block=block)


def fwd_bwd(block, q, k, v, bias, dout, dlse, **kwargs):
    """(out, lse) and the gradients for q, k, v (and bias) of <out, dout> + <lse, dlse>."""
    def loss(q, k, v, bias):
        out, lse = run(q, k, v, bias, block=block, **kwargs)
        lse = jnp.where(jnp.isfinite(lse), lse, 0.0)
        return jnp.sum(out.astype(jnp.float32) * dout) + jnp.sum(lse * dlse), (out, lse)
    argnums = (0, 1, 2) if bias is None else (0, 1, 2, 3)
    (_, res), grads = jax.jit(jax.value_and_grad(loss, argnums=argnums, has_aux=True))(q, k, v, bias)
    return res, grads


TABLE_SHIFT = 512


def relative_table(rng, n):
    return draw(rng, (n, 2 * TABLE_SHIFT))


CASES = {  # name: (T, S, N, K, H, Hv, call arguments (a function of the random generator))
    "plain_gqa": (40, 200, 4, 2, 16, 16, lambda rng: {}),
    "causal_bottom_right_hv": (56, 200, 4, 1, 16, 8, lambda rng: dict(is_causal=True, causal_alignment="bottom_right")),
    "window_chunk": (64, 192, 2, 2, 8, 8, lambda rng: dict(local_window_size=(40, 9), chunk_size=64)),
    "softcap_bias": (48, 150, 4, 2, 16, 16, lambda rng: dict(score_mod=mods.softcap(3.0),
                                                           bias=draw(rng, (2, 1, 48, 150)))),
    "bias_broadcast_keys": (48, 150, 4, 4, 16, 16, lambda rng: dict(bias=draw(rng, (1, 4, 48, 1)))),
    "padding_empty_rows": (40, 170, 2, 1, 16, 16, lambda rng: dict(
        is_causal=True, causal_alignment="bottom_right",
        query_seq_lengths=jnp.array([40, 13]), key_value_seq_lengths=jnp.array([0, 150]))),
    "segments": (160, 160, 2, 2, 8, 8, lambda rng: dict(
        segment_ids=jnp.asarray(np.repeat([[1, 2, 3, 0], [1, 1, 2, 2]], 40, axis=1), jnp.int32),
        is_causal=True)),
    "mask_and_mask_mod": (40, 130, 2, 2, 8, 8, lambda rng: dict(
        mask=jnp.asarray(rng.random((2, 1, 40, 130)) > 0.3),
        mask_mod=lambda b, h, i, j: (j % 7 != 3) & (i > 2))),
    "python_mod_closure": (32, 140, 2, 1, 8, 8, lambda rng: dict(
        score_mod=(lambda table: lambda s, b, h, i, j: s + table[h, i - j + TABLE_SHIFT])(relative_table(rng, 2)))),
    "user_bprop": (32, 140, 2, 2, 8, 8, lambda rng: dict(
        score_mod=mods.softcap(2.0), score_mod_bprop=lambda graph, dscore, score: dscore * 0.5)),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_blockwise_matches_direct_values_and_gradients(rng, name):
    t, s, n, kh, h, hv, make = CASES[name]
    kwargs = make(rng)
    bias = kwargs.pop("bias", None)
    q, k, v = draw(rng, (2, t, n, h)), draw(rng, (2, s, kh, h)), draw(rng, (2, s, kh, hv))
    dout, dlse = draw(rng, (2, t, n, hv)), draw(rng, (2, n, t))
    (out_d, lse_d), grads_d = fwd_bwd(DIRECT, q, k, v, bias, dout, dlse, **kwargs)
    (out_b, lse_b), grads_b = fwd_bwd(64, q, k, v, bias, dout, dlse, **kwargs)
    assert rel_err(out_b, out_d) < 2e-6 and rel_err(lse_b, lse_d) < 2e-6
    for got, want in zip(grads_b, grads_d):
        assert got.shape == want.shape and rel_err(got, want) < 2e-5


def test_rows_with_nothing_allowed_give_zero_and_minus_inf(rng):
    q, k, v = draw(rng, (2, 24, 2, 8)), draw(rng, (2, 150, 2, 8)), draw(rng, (2, 150, 2, 8))
    kwargs = dict(query_seq_lengths=jnp.array([24, 24]), key_value_seq_lengths=jnp.array([0, 150]),
                  mask_mod=lambda b, h, i, j: i != 5)
    out, lse = run(q, k, v, block=64, **kwargs)
    assert np.all(np.asarray(out[0]) == 0) and np.all(np.isneginf(np.asarray(lse[0])))
    assert np.all(np.asarray(out[1, 5]) == 0) and np.all(np.isneginf(np.asarray(lse[1, :, 5])))
    grads = jax.grad(lambda q, k, v: jnp.sum(run(q, k, v, block=64, **kwargs)[0] ** 2), argnums=(0, 1, 2))(q, k, v)
    assert all(np.all(np.isfinite(np.asarray(g))) for g in grads)


def test_a_closed_over_array_of_a_python_mod_gets_its_gradient(rng):
    q, k, v = draw(rng, (1, 32, 2, 8)), draw(rng, (1, 140, 1, 8)), draw(rng, (1, 140, 1, 8))
    table = relative_table(rng, 2)

    def loss(table, block):
        mod = lambda s, b, h, i, j: s + table[h, i - j + TABLE_SHIFT]  # noqa: E731
        return jnp.sum(run(q, k, v, block=block, score_mod=mod)[0] ** 2)

    got, want = (jax.jit(jax.grad(loss), static_argnums=1)(table, block) for block in (64, DIRECT))
    assert rel_err(got, want) < 2e-5 and np.any(np.asarray(want) != 0)


def test_bf16_accumulates_in_fp32(rng):
    q, k, v = (draw(rng, (1, 64, 4, 16), "bfloat16"), draw(rng, (1, 300, 2, 16), "bfloat16"),
               draw(rng, (1, 300, 2, 16), "bfloat16"))
    (out_b, _), (out_d, _) = run(q, k, v, block=64, is_causal=True), run(q, k, v, is_causal=True)
    assert out_b.dtype == jnp.bfloat16 and rel_err(out_b, out_d) < 1e-2
    grad = lambda block: jax.grad(lambda q: jnp.sum(run(q, k, v, block=block)[0].astype(jnp.float32) ** 2))(q)  # noqa: E731
    assert rel_err(grad(64), grad(DIRECT)) < 3e-2


# ----------------------------------------------------------------------------- against jax, at T2048

JAX_CASES = ["plain", "causal", "bias", "padding"]


@pytest.mark.parametrize("name", JAX_CASES)
def test_default_blocks_match_jax_at_2048(rng, name):
    """T = 2048 queries, S = 2000 keys (not a multiple of the block), GQA, blocks of KEY_BLOCK."""
    q, k, v = draw(rng, (2, 2048, 4, 32)), draw(rng, (2, 2000, 2, 32)), draw(rng, (2, 2000, 2, 32))
    assert k.shape[1] > KEY_BLOCK and k.shape[1] % KEY_BLOCK
    arrays = dict(bias=draw(rng, (2, 1, 2048, 2000))) if name == "bias" else {}
    if name == "padding":
        arrays = dict(query_seq_lengths=jnp.array([2048, 700]), key_value_seq_lengths=jnp.array([1500, 333]))
    causal = name == "causal"
    ours = jax.jit(lambda q, k, v, a: run(q, k, v, a.pop("bias", None), block=KEY_BLOCK, is_causal=causal, **a)[0])
    theirs = jax.jit(lambda q, k, v, a: jax.nn.dot_product_attention(q, k, v, implementation="xla",
                                                                     is_causal=causal, **a))
    ours, theirs = ours(q, k, v, dict(arrays)), theirs(q, k, v, arrays)
    if name == "padding":  # jax leaves padded query rows undefined; ours are 0
        rows = np.arange(2048)[None, :] < np.array([2048, 700])[:, None]
        ours, theirs = (jnp.where(rows[:, :, None, None], x, 0.0) for x in (ours, theirs))
    assert float(jnp.max(jnp.abs(ours - theirs))) < 2e-5


def test_float64_accumulates_in_float64(rng):
    with jax.enable_x64(True):
        q, k, v = (jnp.asarray(rng.standard_normal(shape)) for shape in ((1, 24, 2, 8), (1, 150, 1, 8), (1, 150, 1, 8)))
        kwargs = dict(is_causal=True, causal_alignment="bottom_right", score_mod=mods.softcap(4.0))
        (out_b, lse_b), (out_d, lse_d) = run(q, k, v, block=64, **kwargs), run(q, k, v, **kwargs)
        grads = [jax.grad(lambda q: jnp.sum(run(q, k, v, block=block, **kwargs)[0] ** 2))(q) for block in (64, DIRECT)]
        assert out_b.dtype == lse_b.dtype == grads[0].dtype == jnp.float64
        assert rel_err(out_b, out_d) < 1e-13 and rel_err(lse_b, lse_d) < 1e-13 and rel_err(*grads) < 1e-12


# ----------------------------------------------------------------------------- memory

def temp_bytes(block, t, n=4, h=64, grad=True):
    spec = jax.ShapeDtypeStruct((1, t, n, h), jnp.float32)

    def f(q, k, v):
        return run(q, k, v, block=block, is_causal=True)[0]

    fn = jax.grad(lambda q, k, v: jnp.sum(f(q, k, v) ** 2), argnums=(0, 1, 2)) if grad else f
    return jax.jit(fn).lower(spec, spec, spec).compile().memory_analysis().temp_size_in_bytes


def test_fwd_bwd_temporaries_stay_o_of_a_block():
    """T = S = 16384, N4 H64 fp32: the direct path needs 16 GiB of temporaries forward and backward,
    blocks of KEY_BLOCK keys 1.3 GiB (about five (B, N, T, block) fp32 arrays), forward 0.5 GiB."""
    blockwise, direct = temp_bytes(KEY_BLOCK, 16384), temp_bytes(DIRECT, 16384)
    assert blockwise < 1.5 * 2**30 and blockwise * 10 < direct, (blockwise, direct)
    assert temp_bytes(KEY_BLOCK, 16384, grad=False) < 0.75 * 2**30


def test_an_accelerator_runs_direct_while_the_scores_fit_its_memory(monkeypatch):
    """Off CPU the one-block path (faster there) runs while its temporaries take at most a quarter of
    the device's memory; past that, and always on CPU past one block of keys, blocks run."""
    from sdpagraph.backends import xla

    class Device:
        def __init__(self, limit):
            self.limit = limit

        def memory_stats(self):
            return None if self.limit is None else {"bytes_limit": self.limit}

    q = lambda b, t, n: jax.ShapeDtypeStruct((b, t, n, 128), jnp.bfloat16)  # noqa: E731
    k = lambda s: jax.ShapeDtypeStruct((1, s, 16, 128), jnp.bfloat16)  # noqa: E731
    assert not xla._runs_direct(q(4, 4096, 16), k(4096), None)  # CPU: blocks past KEY_BLOCK keys
    assert xla._runs_direct(q(4, 1024, 16), k(1024), None)
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(jax, "devices", lambda: [Device(60 * 2**30)])  # an H100's default allocator limit
    assert xla._runs_direct(q(4, 4096, 16), k(4096), None)  # 8 GiB of temporaries: fits, as before
    assert not xla._runs_direct(q(1, 16384, 16), k(16384), None)  # 32 GiB: blocks
    monkeypatch.setattr(jax, "devices", lambda: [Device(None)])  # no limit reported: 2**28 scores
    assert xla._runs_direct(q(1, 4096, 16), k(4096), None) and not xla._runs_direct(q(2, 4096, 16), k(4096), None)
