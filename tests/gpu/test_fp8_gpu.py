"""FP8 attention on the GPU (`sdpagraph.fp8`): cuDNN's sdpa_fp8 forward against a float64 NumPy
reference on the dequantized inputs (e4m3 and e5m2, causal or not, GQA, padding, amax-based scales),
its amax_o, the scales as traced values, `quantized_attention`, and what check_support says of calls
the FP8 graph does not take. Skipped without a GPU (conftest.py)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sdpagraph import fp8
from tests.reference import allowed, attention_fwd_bwd, rel_err

E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2
# relative L2 of the dequantized output: the bound for e4m3 with amax-based scales; e5m2 keeps
# one mantissa bit fewer
BOUND = {E4M3: 4e-2, E5M2: 8e-2}


def _quantize(rng, shape, dtype, spread):
    """(x in `dtype` scaled by its amax, its descale, its real value in float64)."""
    real = rng.standard_normal(shape) * spread
    descale = float(np.max(np.abs(real)) / float(jnp.finfo(dtype).max))
    x = jnp.asarray(real / descale, jnp.float32).astype(dtype)
    return x, descale, np.asarray(x.astype(jnp.float32), np.float64) * descale


def _reference(q, k, v, causal, kv_lengths=None, d_o=None):
    """float64 (out, (dq, dk, dv)) of attention (B, T, N, H) of real-valued q, k, v, scale H ** -0.5, by
    tests/reference.py: the gradients are of sum(out * d_o) (0 without d_o)."""
    (B, T, N, H), S = q.shape, k.shape[1]
    ok, q_pos, k_pos = allowed(B, T, S, is_causal=causal, kv_lengths=kv_lengths)
    d_o = np.zeros((B, T, N, v.shape[-1])) if d_o is None else d_o
    out, (dq, dk, dv, _) = attention_fwd_bwd(q, k, v, d_o, scale=H ** -0.5, ok=ok, q_pos=q_pos, k_pos=k_pos)
    return out, (dq, dk, dv)


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("heads", [(8, 2), (4, 4)])
def test_fp8_attention_matches_float64_on_the_dequantized_inputs(dtype, causal, heads):
    rng = np.random.default_rng(7)
    n, k_heads = heads
    (q, dq, q64), (k, dk, k64), (v, dv, v64) = (_quantize(rng, shape, dtype, spread) for shape, spread in (
        ((2, 256, n, 128), 1.5), ((2, 384, k_heads, 128), 1.0), ((2, 384, k_heads, 128), 4.0)))
    assert fp8.check_support(q, k, v, is_causal=causal).supported
    want, _ = _reference(q64, k64, v64, causal)
    scale_o = float(jnp.finfo(dtype).max) / np.max(np.abs(v64))  # |out| <= max |v|
    run = jax.jit(lambda q, k, v, dq, dk, dv, so: fp8.attention(q, k, v, descale_q=dq, descale_k=dk, descale_v=dv,
                                                                scale_o=so, is_causal=causal, implementation="cudnn"))
    out8, amax = run(q, k, v, dq, dk, dv, scale_o)
    assert out8.dtype == dtype
    error = rel_err(np.asarray(out8.astype(jnp.float32), np.float64) / scale_o, want)
    assert error < BOUND[dtype], error
    np.testing.assert_allclose(float(amax), np.max(np.abs(want)), rtol=3e-2)
    # New scales are traced values: the same graph, a rescaled output.
    out8_half, _ = run(q, k, v, dq, dk, dv, scale_o / 2)
    assert rel_err(np.asarray(out8_half.astype(jnp.float32), np.float64) * 2 / scale_o, want) < BOUND[dtype]


def test_padding_rows_are_zero_and_keys_past_the_length_are_ignored():
    rng = np.random.default_rng(8)
    (q, dq, q64), (k, dk, k64), (v, dv, v64) = (_quantize(rng, (2, 128, 4, 64), E4M3, 1.0) for _ in range(3))
    q_len, kv_len = np.array([128, 70], np.int32), np.array([33, 128], np.int32)
    out8, _ = fp8.attention(q, k, v, descale_q=dq, descale_k=dk, descale_v=dv, scale_o=1 / dv,
                            query_seq_lengths=jnp.asarray(q_len), key_value_seq_lengths=jnp.asarray(kv_len),
                            implementation="cudnn")
    out = np.asarray(out8.astype(jnp.float32), np.float64) * dv
    want, _ = _reference(q64, k64, v64, False, kv_len)
    assert not np.any(out[1, 70:])
    assert rel_err(out[0], want[0]) < BOUND[E4M3] and rel_err(out[1, :70], want[1, :70]) < BOUND[E4M3]


def test_quantized_attention_runs_fp8_and_stays_close_to_bf16():
    rng = np.random.default_rng(9)
    q, k, v = (jnp.asarray(rng.standard_normal((1, 1024, 8, 128)) * s, jnp.bfloat16) for s in (1.0, 0.5, 2.0))
    given = [np.asarray(x.astype(jnp.float32), np.float64) for x in (q, k, v)]
    # the inputs as quantized_attention rounds them: scaled by amax / 448 into e4m3
    rounded = [np.asarray((x / (np.max(np.abs(x)) / 448)).astype(np.float32), np.float32) for x in given]
    dequantized = [np.asarray(jnp.asarray(r).astype(E4M3).astype(jnp.float32), np.float64) * np.max(np.abs(x)) / 448
                   for r, x in zip(rounded, given)]
    out = fp8.quantized_attention(q, k, v, is_causal=True, implementation="cudnn")
    assert out.dtype == jnp.bfloat16
    assert rel_err(out.astype(jnp.float32), _reference(*dequantized, True)[0]) < BOUND[E4M3]
    assert rel_err(out.astype(jnp.float32), _reference(*given, True)[0]) < 0.1  # the inputs' rounding too


def test_check_support_names_what_the_fp8_graph_does_not_take():
    x = jnp.zeros((1, 128, 4, 72), E4M3)  # head dim 72: not a multiple of 16
    answer = fp8.check_support(x, x, x)
    assert not answer.supported and answer.backend == "bf16" and "multiple of 16" in answer.reason
    out8, _ = fp8.attention(x, x, x)  # dequantized in bfloat16, still an FP8 result
    assert out8.dtype == E4M3


@pytest.mark.parametrize("causal", [False, True])
def test_fp8_training_gradients_match_float64(causal):
    rng = np.random.default_rng(10)
    q, k, v = (jnp.asarray(rng.standard_normal(shape) * s, jnp.bfloat16)
               for shape, s in (((2, 512, 8, 128), 1.0), ((2, 512, 2, 128), 0.5), ((2, 512, 2, 128), 2.0)))
    d_o = jnp.asarray(rng.standard_normal((2, 512, 8, 128)), jnp.bfloat16)
    out, pullback = jax.vjp(lambda q, k, v: fp8.quantized_attention(q, k, v, is_causal=causal, training=True,
                                                                   implementation="cudnn"), q, k, v)
    grads = pullback(d_o)
    want, want_grads = _reference(*(np.asarray(x.astype(jnp.float32), np.float64) for x in (q, k, v)), causal,
                                  d_o=np.asarray(d_o.astype(jnp.float32), np.float64))
    assert rel_err(out.astype(jnp.float32), want) < 8e-2
    for got, expected in zip(grads, want_grads):
        assert got.dtype == jnp.bfloat16
        error = rel_err(got.astype(jnp.float32), expected)
        assert error < 0.2, error
