"""FP8 attention (`sdpagraph.fp8`): the sdpa_fp8 lowering, the cuDNN path on the CPU stand-in (the
graph's computation on XLA: dequantize, attend, scale, saturate), the dequantized bfloat16 fallback,
`quantized_attention`'s current scaling and its FP8-or-bf16 choice, the numerical check of FP8
graphs, and argument errors. References are float64 NumPy on the dequantized inputs."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import sdpagraph
from sdpagraph import fp8
from sdpagraph.errors import Unsupported
from sdpagraph.graphs.lowering import lower
from sdpagraph.graphs.operands import FP8_AMAX, FP8_SCALES, graph_io
from sdpagraph.numerics.check import check_numerics
from sdpagraph.spec import AttentionSpec
from tests.reference import allowed, attention_fwd_bwd, rel_err
from tests.test_builder_cpu import FakeGraph, FakeTensor, cudnn
from tests.test_sharding import cudnn_on_cpu  # noqa: F401 (a fixture)

E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2
ROUNDING = {E4M3: 4e-2, E5M2: 8e-2}  # relative L2 of an output rounded to 3 / 2 mantissa bits


def _reference(q, k, v, causal, kv_lengths=None, q_lengths=None, d_o=None):
    """float64 (out, (dq, dk, dv)) of attention (B, T, N, H) of real-valued q, k, v, scale H ** -0.5, by
    tests/reference.py: padded query rows give 0, the gradients are of sum(out * d_o) (0 without d_o)."""
    (B, T, N, H), S = q.shape, k.shape[1]
    ok, q_pos, k_pos = allowed(B, T, S, is_causal=causal, q_lengths=q_lengths, kv_lengths=kv_lengths)
    d_o = np.zeros((B, T, N, v.shape[-1])) if d_o is None else d_o
    out, (dq, dk, dv, _) = attention_fwd_bwd(q, k, v, d_o, scale=H ** -0.5, ok=ok, q_pos=q_pos, k_pos=k_pos)
    return out, (dq, dk, dv)


def _quantized(rng, shape, dtype, spread):
    """(x in `dtype`, its descale, its real value float64): values of magnitude ~spread."""
    real = rng.standard_normal(shape) * spread
    descale = float(np.max(np.abs(real)) / float(jnp.finfo(dtype).max))
    x = jnp.asarray(real / descale, jnp.float32).astype(dtype)
    return x, descale, np.asarray(x.astype(jnp.float32), np.float64) * descale


@pytest.fixture
def built(cudnn_on_cpu):
    return cudnn_on_cpu[0]


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("kv_heads", [2, 4])
def test_the_cudnn_path_computes_scaled_fp8_attention(rng, built, dtype, causal, kv_heads):
    (q, dq, q64), (k, dk, k64), (v, dv, v64) = (_quantized(rng, shape, dtype, spread) for shape, spread in
                                                (((2, 32, 4, 16), 2.0), ((2, 48, 4 // (4 // kv_heads), 16), 0.5),
                                                 ((2, 48, kv_heads, 16), 3.0)))
    want, _ = _reference(q64, k64, v64, causal)
    scale_o = 100.0 / np.max(np.abs(want))
    run = jax.jit(lambda q, k, v, dq, dk, dv, so: fp8.attention(q, k, v, descale_q=dq, descale_k=dk, descale_v=dv,
                                                                scale_o=so, is_causal=causal))
    out8, amax = run(q, k, v, dq, dk, dv, scale_o)
    assert out8.dtype == dtype and out8.shape == (2, 32, 4, 16)
    assert rel_err(np.asarray(out8.astype(jnp.float32), np.float64) / scale_o, want) < ROUNDING[dtype]
    np.testing.assert_allclose(float(amax), np.max(np.abs(want)), rtol=1e-4)
    run(q, k, v, dq * 2, dk, dv, scale_o * 3)  # new scales are traced values: no new graph
    assert [(spec.dtype, direction) for spec, _, direction in built] == [(np.dtype(dtype).name, "inference")]


def test_padding_lengths_and_saturation(rng, built):
    (q, dq, q64), (k, dk, k64), (v, dv, v64) = (_quantized(rng, (2, 16, 2, 32), E4M3, 1.0) for _ in range(3))
    q_len, kv_len = np.array([16, 9], np.int32), np.array([5, 16], np.int32)
    want, _ = _reference(q64, k64, v64, False, kv_len, q_len)
    out8, _ = fp8.attention(q, k, v, descale_q=dq, descale_k=dk, descale_v=dv, query_seq_lengths=jnp.asarray(q_len),
                            key_value_seq_lengths=jnp.asarray(kv_len))
    assert rel_err(out8.astype(jnp.float32), want) < ROUNDING[E4M3]
    assert not np.any(np.asarray(out8.astype(jnp.float32))[1, 9:])  # padded query rows give 0
    huge, _ = fp8.attention(q, k, v, descale_q=dq, descale_k=dk, descale_v=dv, scale_o=1e6)
    assert np.all(np.isfinite(huge.astype(jnp.float32)))  # saturated at 448, never NaN
    assert float(jnp.max(jnp.abs(huge.astype(jnp.float32)))) == 448.0


def test_calls_the_fp8_graph_cannot_run_are_dequantized(rng):
    q, dq, q64 = _quantized(rng, (1, 16, 2, 8), E4M3, 1.0)
    answer = fp8.check_support(q, q, q)  # no GPU here: cuDNN says why
    assert not answer.supported and answer.backend == "bf16" and "dequantized in bfloat16" in answer.reason
    for implementation in (None, "bf16"):
        out8, amax = fp8.attention(q, q, q, descale_q=dq, descale_k=dq, descale_v=dq, implementation=implementation)
        want, _ = _reference(q64, q64, q64, False)
        assert out8.dtype == E4M3 and rel_err(out8.astype(jnp.float32), want) < ROUNDING[E4M3]
        np.testing.assert_allclose(float(amax), np.max(np.abs(want)), rtol=2e-2)  # from the bfloat16 output
    with pytest.raises(ValueError, match="implementation='cudnn' cannot run FP8 attention"):
        fp8.attention(q, q, q, implementation="cudnn")


def test_the_lowering_emits_sdpa_fp8_with_its_scales():
    class FP8Graph(FakeGraph):
        def sdpa_fp8(self, **kwargs):
            stats = FakeTensor("stats") if kwargs["generate_stats"] else None
            return self._record("sdpa_fp8", kwargs, [FakeTensor("o"), stats, FakeTensor("amax_s"), FakeTensor("amax_o")])

    spec = AttentionSpec(2, 64, 64, 8, 2, 128, 128, "float8_e4m3fn", 0.1, is_causal=True, has_kv_lengths=True)
    operands, results = graph_io(spec, None, "inference")
    assert operands == ("q", "k", "v", *FP8_SCALES, "seq_len_q", "seq_len_kv") and results == ("o", *FP8_AMAX)
    graph = FP8Graph()
    lowering = lower(graph, spec, None, "inference", cudnn)
    (op, options), = graph.nodes
    assert op == "sdpa_fp8" and options["use_causal_mask"] and options["use_padding_mask"]
    assert options["attn_scale"] == 0.1 and options["generate_stats"] is False
    assert all(options[role] is graph.tensors[role] for role in FP8_SCALES)
    assert graph.tensors["q"].attrs["data_type"] == cudnn.data_type.FP8_E4M3
    assert lowering.result_roles == ("o", *FP8_AMAX)
    for change, words in ((dict(bias_shape=(1, 1, 64, 64)), "bias"), (dict(causal_alignment="bottom_right"),
                                                                        "bottom-right"),
                          (dict(window=(16, 0)), "window"), (dict(head_dim=72, head_dim_v=72), "multiple of 16")):
        with pytest.raises(Unsupported, match=words):
            lower(FP8Graph(), dataclasses.replace(spec, **change), None, "inference", cudnn)


def test_quantized_attention_scales_by_the_current_amax_and_picks_fp8_by_size(rng, built, monkeypatch):
    q, k, v = (jnp.asarray(rng.standard_normal((1, 32, 2, 16)) * s, jnp.bfloat16) for s in (1.0, 0.3, 5.0))
    want, _ = _reference(*(np.asarray(x.astype(jnp.float32), np.float64) for x in (q, k, v)), True)
    small = fp8.quantized_attention(q, k, v, is_causal=True)  # 2048 scores: the bf16 call
    assert not any(spec.is_fp8 for spec, _, _ in built) and rel_err(small.astype(jnp.float32), want) < 1e-2
    monkeypatch.setattr(fp8, "FP8_MIN_SCORES", 1024)
    assert fp8.quantized_attention(q, k, v).dtype == jnp.bfloat16 and not built[-1][0].is_fp8  # S < FP8_MIN_KV_LEN
    monkeypatch.setattr(fp8, "FP8_MIN_KV_LEN", 32)
    out = fp8.quantized_attention(q, k, v, is_causal=True)
    assert out.dtype == jnp.bfloat16 and built[-1][0].is_fp8
    assert rel_err(out.astype(jnp.float32), want) < 5e-2
    zeros = fp8.quantized_attention(jnp.zeros_like(q), k, jnp.zeros_like(v), implementation="cudnn")
    assert not np.any(np.asarray(zeros.astype(jnp.float32)))  # all-zero tensors: descale 1, no NaN


def test_the_numerical_check_passes_the_stand_in_and_fails_a_wrong_graph(built):
    from sdpagraph.backends.cudnn import backend as cudnn_backend
    spec = AttentionSpec(1, 64, 64, 4, 2, 16, 16, "float8_e4m3fn", 0.25, is_causal=True)
    good = check_numerics(spec, None, False, candidate=cudnn_backend.attention)
    assert good.passed and set(good.errors) == {"o", "empty_rows"}, good.summary()

    def wrong(spec, q, k, v, inputs, ir, training):  # a graph that forgets the scale
        return cudnn_backend.attention(dataclasses.replace(spec, scale=1.0), q, k, v, inputs, ir, training=training)

    assert not check_numerics(spec, None, False, candidate=wrong).passed


def test_bad_arguments_name_themselves(rng):
    x = jnp.asarray(rng.standard_normal((1, 8, 2, 16)), jnp.float32)
    x8 = x.astype(E4M3)
    with pytest.raises(TypeError, match="one FP8 dtype"):
        fp8.attention(x, x, x)
    with pytest.raises(TypeError, match="one FP8 dtype"):
        fp8.attention(x8, x8, x8.astype(E5M2))
    with pytest.raises(TypeError, match="use sdpagraph.fp8.attention"):
        sdpagraph.attention(x8, x8, x8)
    with pytest.raises(ValueError, match="descale_q must be a scalar"):
        fp8.attention(x8, x8, x8, descale_q=jnp.ones(2))
    with pytest.raises(TypeError, match="scale_o must be a float"):
        fp8.attention(x8, x8, x8, scale_o="1")
    with pytest.raises(ValueError, match="implementation must be one of"):
        fp8.attention(x8, x8, x8, implementation="xla")
    with pytest.raises(TypeError, match="fp8_dtype must be one of"):
        fp8.quantized_attention(x, x, x, fp8_dtype=jnp.bfloat16)
    with pytest.raises(fp8.FP8GradientError, match="has no gradient"):
        jax.grad(lambda q: fp8.attention(q.astype(E4M3), x8, x8)[0].astype(jnp.float32).sum())(x)
    with pytest.raises(fp8.FP8GradientError, match="training=True"):  # the bf16 branch of a small call too
        jax.grad(lambda q: fp8.quantized_attention(q, x, x).astype(jnp.float32).sum())(x)


def test_the_cudnn_fp8_call_is_never_differentiated(rng, built):
    x8 = jnp.asarray(rng.standard_normal((1, 16, 2, 16)), jnp.float32).astype(E4M3)
    with pytest.raises(fp8.FP8GradientError, match="has no gradient"):
        jax.grad(lambda q: fp8.attention(q.astype(E4M3), x8, x8)[0].astype(jnp.float32).sum())(
            x8.astype(jnp.float32))


# ----------------------------------------------------------------------------- FP8 training

@pytest.mark.parametrize("causal", [False, True])
def test_fp8_training_gives_gradients_through_e5m2(rng, built, causal):
    q, k, v = (jnp.asarray(rng.standard_normal((2, 32, 4, 128)) * s, jnp.bfloat16) for s in (1.0, 0.5, 2.0))
    d_o = rng.standard_normal((2, 32, 4, 128))
    out, pullback = jax.vjp(lambda q, k, v: fp8.quantized_attention(q, k, v, is_causal=causal, training=True,
                                                                   implementation="cudnn"), q, k, v)
    grads = pullback(jnp.asarray(d_o, jnp.bfloat16))
    want, want_grads = _reference(*(np.asarray(x.astype(jnp.float32), np.float64) for x in (q, k, v)), causal,
                                  d_o=d_o)
    assert rel_err(out.astype(jnp.float32), want) < 8e-2
    for got, expected in zip(grads, want_grads):
        assert got.dtype == jnp.bfloat16 and rel_err(got.astype(jnp.float32), expected) < 0.2
    assert {(spec.dtype, direction) for spec, _, direction in built} == {("float8_e4m3fn", "forward"),
                                                                       ("float8_e4m3fn", "backward")}


def test_fp8_training_runs_where_it_pays_and_bf16_elsewhere(rng, built, monkeypatch):
    q = jnp.asarray(rng.standard_normal((1, 64, 2, 128)), jnp.bfloat16)
    loss = lambda q, **kw: fp8.quantized_attention(q, q, q, training=True, **kw).astype(jnp.float32).sum()  # noqa: E731
    jax.grad(loss)(q)  # 64 keys: bf16
    assert not any(spec.is_fp8 for spec, _, _ in built)
    monkeypatch.setattr(fp8, "FP8_TRAIN_MIN_KV_LEN", 64)
    jax.grad(loss)(q)
    assert any(spec.is_fp8 and direction == "backward" for spec, _, direction in built)
    assert not fp8.fp8_training_pays(8192, 64) and fp8.fp8_training_pays(8192, 128)
    jax.grad(lambda q: loss(q, implementation="bf16"))(q)  # never FP8


def test_the_backward_lowering_takes_e5m2_gradients():
    class FP8Graph(FakeGraph):
        def sdpa_fp8_backward(self, **kwargs):
            return self._record("sdpa_fp8_backward", kwargs, [FakeTensor(n) for n in
                                                             ("dq", "dk", "dv", "adq", "adk", "adv", "adp")])

    from sdpagraph.graphs.operands import FP8_BACKWARD_AMAX, FP8_BACKWARD_SCALES
    spec = AttentionSpec(1, 64, 64, 4, 2, 128, 128, "float8_e4m3fn", 0.1)
    operands, results = graph_io(spec, None, "backward")
    assert operands == ("q", "k", "v", "o", "dO", "stats", *FP8_BACKWARD_SCALES)
    assert results == ("dq", "dk", "dv", *FP8_BACKWARD_AMAX)
    graph = FP8Graph()
    lower(graph, spec, None, "backward", cudnn)
    (op, options), = graph.nodes
    assert op == "sdpa_fp8_backward" and all(options[role] is graph.tensors[role] for role in FP8_BACKWARD_SCALES)
    assert graph.tensors["dO"].attrs["data_type"] == cudnn.data_type.FP8_E5M2
    assert graph.tensors["q"].attrs["data_type"] == cudnn.data_type.FP8_E4M3
    with pytest.raises(Unsupported, match="head dim 128 only"):
        lower(FP8Graph(), dataclasses.replace(spec, head_dim=64, head_dim_v=64), None, "backward", cudnn)


def test_the_numerical_check_covers_the_fp8_backward(built):
    from sdpagraph.backends.cudnn import backend as cudnn_backend
    spec = AttentionSpec(1, 64, 64, 4, 2, 128, 128, "float8_e4m3fn", 128 ** -0.5)
    result = check_numerics(spec, None, True, candidate=cudnn_backend.attention)
    assert result.passed and {"o", "lse", "dq", "dk", "dv"} <= set(result.errors), result.summary()


@pytest.mark.parametrize("guess", [1e-30, 1e30])
def test_a_gradient_scale_guessed_wrong_runs_the_backward_again_with_exact_scales(rng, built, monkeypatch, guess):
    from sdpagraph.backends.cudnn import fp8 as cudnn_fp8
    monkeypatch.setattr(cudnn_fp8, "_gradient_scales", lambda *args: {n: jnp.float32(guess) for n in ("dP", "dQ", "dK", "dV")})
    q, k, v = (jnp.asarray(rng.standard_normal((1, 32, 2, 128)), jnp.bfloat16) for _ in range(3))
    d_o = rng.standard_normal((1, 32, 2, 128))
    _, pullback = jax.vjp(lambda q, k, v: fp8.quantized_attention(q, k, v, training=True, implementation="cudnn"),
                          q, k, v)
    grads = pullback(jnp.asarray(d_o, jnp.bfloat16))
    _, want_grads = _reference(*(np.asarray(x.astype(jnp.float32), np.float64) for x in (q, k, v)), False, d_o=d_o)
    for got, expected in zip(grads, want_grads):  # underflowed (1e-30) or saturated (1e30) without the rerun
        assert rel_err(got.astype(jnp.float32), expected) < 0.2
