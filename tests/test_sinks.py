"""Attention sinks (`attention(..., sinks=s)`): forward, residual and gradients of q, k, v, bias and
the sinks against a float64 NumPy reference written from the formula

    p_ij = exp(l_ij) / (exp(s_h) + sum_j' exp(l_ij'))        out_i = sum_j p_ij v_j

on the XLA and small-sequence backends; ds from its closed form against autodiff; the segment check's
NaN rows; the cuDNN path (whose backward ignores the logsumexp's cotangent: the sinks join inside its
custom_vjp, shown with a stand-in backward that reads only the o and stats it is given); context
parallelism on 2 CPU devices (the first test runs this file again with them); validation; Flax.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import sdpagraph
from sdpagraph.backends import registry, sinks as sinks_mod
from sdpagraph.backends.cudnn import backend as cudnn_backend
from sdpagraph.backends.cudnn import execute as cudnn_execute
from sdpagraph.call import prepare_call
from tests.devices import has_cpu_devices, make_mesh, rerun_with_cpu_devices
from tests.cudnn_standin import stats_backward_executor
from tests.test_sharding import cudnn_on_cpu  # noqa: F401 (a fixture)

DEVICES = 2
HERE_WITH_DEVICES = has_cpu_devices(DEVICES)
needs_devices = pytest.mark.skipif(not HERE_WITH_DEVICES, reason=f"runs in the {DEVICES}-device subprocess")
one_device = pytest.mark.skipif(HERE_WITH_DEVICES, reason="runs in the parent process")
CAP = 4.0


# ----------------------------------------------------------------------------- the reference

def reference(q, k, v, sinks, d_out, *, allowed, bias=None, softcap=None, scale=None):
    """(out, lse (B, T, N), grads {q, k, v, sinks, bias}) in float64 from the formula, the gradients
    written out by hand (dO = `d_out`). `allowed`: (B, N|1, T, S) bool."""
    q, k, v, sinks, d_out = (np.asarray(x, np.float64) for x in (q, k, v, sinks, d_out))
    n, kh = q.shape[2], k.shape[2]
    group = n // kh
    kk, vv = np.repeat(k, group, axis=2), np.repeat(v, group, axis=2)
    scale = 1 / np.sqrt(q.shape[-1]) if scale is None else scale
    raw = scale * np.einsum("btnh,bsnh->bnts", q, kk)
    logits = raw if softcap is None else softcap * np.tanh(raw / softcap)
    if bias is not None:
        logits = logits + np.asarray(bias, np.float64)
    allowed = np.broadcast_to(allowed, logits.shape)
    sink = sinks[None, :, None]
    top = np.maximum(np.max(np.where(allowed, logits, -np.inf), axis=-1), sink)
    weights = np.where(allowed, np.exp(np.where(allowed, logits, 0) - top[..., None]), 0.0)
    denominator = np.exp(sink - top) + weights.sum(-1)
    p = weights / denominator[..., None]
    lse = top + np.log(denominator)
    out = np.einsum("bnts,bsnh->btnh", p, vv)
    # Backward: dP = dO v, dl = p (dP - <dO, out>), ds = -sum p_sink <dO, out>.
    d_p = np.einsum("btnh,bsnh->bnts", d_out, vv)
    rows = np.einsum("btnh,btnh->bnt", d_out, out)
    d_logits = p * (d_p - rows[..., None])
    d_sinks = -np.sum(np.exp(sink - lse) * rows, axis=(0, 2))
    d_raw = d_logits if softcap is None else d_logits * (1 - np.tanh(raw / softcap) ** 2)
    fold = lambda x: x.reshape(x.shape[:2] + (kh, group) + x.shape[3:]).sum(3)  # noqa: E731 (heads -> K)
    grads = {"q": scale * np.einsum("bnts,bsnh->btnh", d_raw, kk),
             "k": fold(scale * np.einsum("bnts,btnh->bsnh", d_raw, q)),
             "v": fold(np.einsum("bnts,btnh->bsnh", p, d_out)),
             "sinks": d_sinks}
    if bias is not None:
        grads["bias"] = d_logits.sum(axis=tuple(i for i, d in enumerate(np.shape(bias)) if d == 1), keepdims=True)
    return out, np.swapaxes(lse, 1, 2), grads


def close(got, want, tol=2e-4):
    np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=tol, atol=tol)


# ----------------------------------------------------------------------------- the cases

def ids(rng, b, t):
    """Self-attention segment ids: runs of 1-3 tokens, padding (0) at the end of row 0."""
    rows = []
    for row in range(b):
        lengths = rng.integers(1, 4, size=t)
        tokens = np.repeat(np.arange(1, t + 1), lengths)[:t]
        if row == 0:
            tokens[-2:] = 0
        rows.append(tokens)
    return np.stack(rows).astype(np.int32)


def case(name, rng):
    """(shapes (B, T, S, N, K, H), attention kwargs, reference kwargs that need the inputs' shapes)."""
    b, t, s, n, kh, h = 2, 4, 7, 4, 4, 8
    if name == "gqa":
        kh = 2
    if name == "decode":
        t, kh = 1, 1
    if name in ("segments", "causal"):
        s = t
    if name == "long_keys":  # the XLA backend's blockwise path (past 1024 keys)
        b, s, n, kh = 1, 1100, 2, 2
    kwargs, allowed = {}, np.ones((b, 1, t, s), bool)
    if name == "causal":
        kwargs["is_causal"] = True
        allowed = np.broadcast_to(np.tril(np.ones((t, s), bool)), allowed.shape)
    if name == "softcap":
        kwargs["score_mod"] = lambda score, b, h, q, kv: CAP * jnp.tanh(score / CAP)
    if name == "segments":
        seg = ids(rng, b, t)
        kwargs.update(segment_ids=jnp.asarray(seg), max_seqlen_q=t, max_seqlen_kv=t)
        allowed = ((seg[:, :, None] == seg[:, None, :]) & (seg[:, :, None] > 0))[:, None]
    if name == "masked_rows":  # a mask that leaves query rows with nothing to attend
        mask = rng.random((b, n, t, s)) < 0.6
        mask[0, 1, 2] = False
        mask[1, :, 0] = False
        kwargs["mask"] = jnp.asarray(mask)
        allowed = mask
    return (b, t, s, n, kh, h), kwargs, allowed


CASES = ["plain", "causal", "gqa", "softcap", "segments", "masked_rows", "decode", "bias", "long_keys"]


def inputs(rng, shapes, bias=False):
    b, t, s, n, kh, h = shapes
    f32 = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)  # noqa: E731
    arrays = {"q": f32(b, t, n, h), "k": f32(b, s, kh, h), "v": f32(b, s, kh, h), "sinks": f32(n)}
    if bias:
        arrays["bias"] = f32(1, n, t, s)
    return arrays


@one_device
@pytest.mark.parametrize("implementation", ["xla", "small_seq"])
@pytest.mark.parametrize("name", CASES)
def test_forward_residual_and_gradients_match_the_formula(rng, name, implementation):
    shapes, kwargs, allowed = case(name, rng)
    if implementation == "small_seq" and shapes[2] > 32:
        pytest.skip("past the small-sequence regime")
    check_the_formula(rng, name, implementation, shapes, kwargs, allowed)


def check_the_formula(rng, name, implementation, shapes, kwargs, allowed):
    """`case(name)`'s output, residual and gradients of q, k, v, bias and the sinks (fresh inputs)
    against the float64 reference, run with `implementation` under jit."""
    x = inputs(rng, shapes, bias=name == "bias")
    d_out = rng.standard_normal(shapes[:2] + (shapes[3], shapes[5]))

    @jax.jit
    def run(x):
        def loss(x):
            out, lse = sdpagraph.attention(x["q"], x["k"], x["v"], x.get("bias"), sinks=x["sinks"],
                                           implementation=implementation, return_residual=True, **kwargs)
            return jnp.sum(out * d_out), (out, lse)
        return jax.grad(loss, has_aux=True)(x)

    grads, (out, lse) = run(x)
    want_out, want_lse, want = reference(x["q"], x["k"], x["v"], x["sinks"], d_out, allowed=allowed,
                                         bias=x.get("bias"), softcap=CAP if name == "softcap" else None)
    close(out, want_out)
    close(lse, want_lse)
    for key in x:
        close(grads[key], want[key])


@one_device
def test_sinks_gradient_has_its_closed_form(rng):
    """ds_h = -sum_i exp(s_h - L'_i) <dO_i, out'_i>, from the output and residual, equals autodiff."""
    x = inputs(rng, (3, 6, 9, 4, 2, 8))
    d_out = jnp.asarray(rng.standard_normal((3, 6, 4, 8)), jnp.float32)
    attend = lambda s: sdpagraph.attention(x["q"], x["k"], x["v"], sinks=s, is_causal=True)  # noqa: E731
    autodiff = jax.grad(lambda s: jnp.sum(attend(s) * d_out))(x["sinks"])
    out, lse = sdpagraph.attention(x["q"], x["k"], x["v"], sinks=x["sinks"], is_causal=True, return_residual=True)
    rows = jnp.sum(d_out * out, axis=-1)  # (B, T, N)
    closed = -jnp.sum(jnp.exp(x["sinks"] - lse) * rows, axis=(0, 1))
    np.testing.assert_allclose(autodiff, closed, rtol=1e-5, atol=1e-5)


@one_device
def test_a_sink_of_minus_infinity_changes_nothing_and_a_large_one_takes_every_row(rng):
    x = inputs(rng, (2, 5, 7, 4, 2, 8))
    plain, plain_lse = sdpagraph.attention(x["q"], x["k"], x["v"], return_residual=True)
    out, lse = sdpagraph.attention(x["q"], x["k"], x["v"], sinks=jnp.full((4,), -jnp.inf), return_residual=True)
    np.testing.assert_allclose(out, plain, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(lse, plain_lse, rtol=1e-6)
    out = sdpagraph.attention(x["q"], x["k"], x["v"], sinks=jnp.full((4,), 80.0))
    assert np.max(np.abs(np.asarray(out))) < 1e-20


@one_device
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_half_inputs_keep_their_dtype_with_float32_sinks(rng, dtype):
    x = inputs(rng, (2, 3, 7, 4, 4, 8))
    q, k, v = (x[n].astype(dtype) for n in "qkv")
    out, lse = sdpagraph.attention(q, k, v, sinks=x["sinks"], return_residual=True)
    assert out.dtype == dtype and lse.dtype == dtype
    want, _, _ = reference(q, k, v, x["sinks"], np.zeros(out.shape), allowed=np.ones((1, 1, 3, 7), bool))
    close(out, want, 2e-2)


@one_device
def test_unbatched_inputs(rng):
    x = inputs(rng, (1, 3, 5, 4, 2, 8))
    out, lse = sdpagraph.attention(x["q"][0], x["k"][0], x["v"][0], sinks=x["sinks"], return_residual=True)
    want_out, want_lse, _ = reference(x["q"], x["k"], x["v"], x["sinks"], np.zeros((1, 3, 4, 8)),
                                      allowed=np.ones((1, 1, 3, 5), bool))
    close(out, want_out[0])
    close(lse, want_lse[0])


@one_device
def test_rows_past_the_segment_bound_stay_nan(rng):
    x = inputs(rng, (3, 12, 12, 4, 4, 8))
    segments = np.repeat(np.arange(1, 13)[None], 3, axis=0).astype(np.int32)  # 12 segments a row
    segments[[0, 2]] = 1  # one segment: rows 0 and 2 are within the bound
    run = jax.jit(lambda q, ids: sdpagraph.attention(q, x["k"], x["v"], segment_ids=ids, max_segments_per_seq=4,
                                                     sinks=x["sinks"], return_residual=True))
    out, lse = (np.asarray(a) for a in run(x["q"], jnp.asarray(segments)))
    assert np.all(np.isnan(out[1])) and np.all(np.isnan(lse[1]))
    assert np.all(np.isfinite(out[[0, 2]])) and np.all(np.isfinite(lse[[0, 2]]))


# ----------------------------------------------------------------------------- the cuDNN path

@pytest.fixture(params=["native", "composed"])
def cudnn_graphs_on_cpu(request, cudnn_on_cpu, monkeypatch):
    """The cuDNN path with `stats_backward_executor`: cuDNN's own sinks (`spec.sinks` graphs), or,
    with SDPAGRAPH_NATIVE_SINKS=0 (as where those graphs do not build), the sinks composed."""
    monkeypatch.setenv("SDPAGRAPH_NATIVE_SINKS", "1" if request.param == "native" else "0")
    monkeypatch.setattr(cudnn_execute, "call_executor", stats_backward_executor)
    return cudnn_on_cpu[0], request.param == "native"


@one_device
def test_the_stand_in_backward_ignores_the_logsumexp_cotangent(rng, cudnn_on_cpu, monkeypatch):
    """As cuDNN's: a loss on the logsumexp alone has no gradient through it (what made a composition
    outside the graph's custom_vjp wrong), while the XLA backend's has one."""
    monkeypatch.setattr(cudnn_execute, "call_executor", stats_backward_executor)
    x = inputs(rng, (2, 3, 7, 4, 2, 8))
    q, k, v = x["q"], x["k"], x["v"]
    call = prepare_call(q, k, v)
    for backend, differentiated in ((cudnn_backend.BACKEND, False), (registry.get("xla"), True)):
        lse_only = lambda q: backend.attention(call.spec, q, k, v, call.inputs, None)[1].sum()  # noqa: E731
        assert np.any(np.asarray(jax.grad(lse_only)(q)) != 0) == differentiated


@one_device
@pytest.mark.parametrize("name", ["plain", "causal", "gqa", "softcap", "segments", "masked_rows", "decode", "bias"])
def test_a_training_call_with_sinks_runs_on_cudnn(rng, name, cudnn_graphs_on_cpu):
    """The graph's backward given the output and logsumexp with the sink gives exact gradients of
    q, k, v, bias and the sinks; the graphs are the call's own (no sinks in them)."""
    shapes, kwargs, allowed = case(name, rng)
    check_the_formula(rng, name, "cudnn", shapes, kwargs, allowed)
    built, native = cudnn_graphs_on_cpu
    # cuDNN's own sinks in the forward graph; the backward graph is the spec's without sinks
    assert {(spec.sinks, d) for spec, _, d in built} >= {(native, "forward"), (False, "backward")}
    assert (True, "backward") not in {(spec.sinks, d) for spec, _, d in built}
    x = inputs(rng, shapes, bias=name == "bias")
    answer = sdpagraph.check_support(x["q"], x["k"], x["v"], x.get("bias"), sinks=x["sinks"], **kwargs)
    assert answer.supported and answer.backend == "cudnn"
    assert answer.reason.endswith(sinks_mod.NATIVE if native else sinks_mod.COMPOSED), answer.reason


@one_device
def test_an_inference_call_with_sinks_on_cudnn_runs_the_forward_graph(rng, cudnn_graphs_on_cpu):
    x = inputs(rng, (2, 3, 7, 4, 2, 8))
    out = sdpagraph.attention(x["q"], x["k"], x["v"], sinks=x["sinks"], is_causal=True, training=False,
                              implementation="cudnn")
    want, _, _ = reference(x["q"], x["k"], x["v"], x["sinks"], np.zeros(out.shape),
                           allowed=np.tril(np.ones((3, 7), bool))[None, None])
    close(out, want)
    built, native = cudnn_graphs_on_cpu
    # cuDNN's own sinks run the inference graph; composed ones read the forward graph's stats
    assert [(spec.sinks, d) for spec, _, d in built] == [(True, "inference") if native else (False, "forward")]


# ----------------------------------------------------------------------------- validation and Flax

@one_device
def test_bad_sinks_name_the_argument(rng):
    x = inputs(rng, (2, 3, 7, 4, 2, 8))
    q, k, v = x["q"], x["k"], x["v"]
    for bad in (jnp.zeros((2,)), jnp.zeros((1, 4)), jnp.zeros(())):
        with pytest.raises(ValueError, match=r"sinks must have shape \(N,\) = \(4,\)"):
            sdpagraph.attention(q, k, v, sinks=bad)
        with pytest.raises(ValueError, match="sinks must have shape"):
            sdpagraph.check_support(q, k, v, sinks=jax.ShapeDtypeStruct(bad.shape, jnp.float32))
    with pytest.raises(TypeError, match="sinks must be a floating array"):
        sdpagraph.attention(q, k, v, sinks=jnp.zeros((4,), jnp.int32))
    out = sdpagraph.attention(q, k, v, sinks=[0.0, 1.0, 2.0, 3.0])  # a list is an array
    close(out, np.asarray(sdpagraph.attention(q, k, v, sinks=jnp.arange(4.0))), 0)


@one_device
def test_flax_attention_fn_passes_sinks_through(rng):
    nnx = pytest.importorskip("flax.nnx")
    import sdpagraph.flax
    x = inputs(rng, (2, 5, 5, 4, 4, 8))
    fn = sdpagraph.flax.attention_fn(sinks=x["sinks"], is_causal=True)
    layer = nnx.MultiHeadAttention(num_heads=4, in_features=16, qkv_features=32, decode=False,
                                   rngs=nnx.Rngs(0), attention_fn=fn)
    inputs_ = jnp.asarray(rng.standard_normal((2, 5, 16)), jnp.float32)
    got = layer(inputs_)
    layer.attention_fn = lambda q, k, v, **kw: sdpagraph.attention(q, k, v, is_causal=True, sinks=x["sinks"])
    close(got, np.asarray(layer(inputs_)), 1e-6)
    out = fn(x["q"], x["k"], x["v"])
    want, _, _ = reference(x["q"], x["k"], x["v"], x["sinks"], np.zeros(out.shape),
                           allowed=np.tril(np.ones((5, 5), bool))[None, None])
    close(out, want)


# ----------------------------------------------------------------------------- context parallelism

def test_in_a_process_with_two_cpu_devices():
    if HERE_WITH_DEVICES:
        pytest.skip("this process has the devices: the tests below run here")
    rerun_with_cpu_devices(__file__, DEVICES, timeout=600)


def split_along_the_sequence(rng):
    """(inputs, the mesh "cp" of the devices, the inputs with q, k, v split along it, a cotangent)."""
    x = inputs(rng, (2, 8, 8, 4, 2, 8))
    mesh = make_mesh((DEVICES,), ("cp",))
    sharded = {n: jax.device_put(a, jax.sharding.NamedSharding(mesh, P(None, "cp"))) if n != "sinks" else a
               for n, a in x.items()}
    return x, mesh, sharded, rng.standard_normal((2, 8, 4, 8))


@needs_devices
@pytest.mark.parametrize("strategy", ["ring", "all_to_all", "halo"])
def test_context_parallel_sinks(rng, strategy):
    x, mesh, sharded, d_out = split_along_the_sequence(rng)
    attend = lambda x: sdpagraph.attention(  # noqa: E731
        x["q"], x["k"], x["v"], sinks=x["sinks"], is_causal=True, local_window_size=(2, 0),
        context_parallel_axis="cp", mesh=mesh,
        context_parallel_strategy=strategy, implementation="xla", return_residual=True)
    out, lse = jax.jit(attend)(sharded)
    band = np.tril(np.ones((8, 8), bool)) & ~np.tril(np.ones((8, 8), bool), -3)  # 0 <= i - j <= 2
    want_out, want_lse, want = reference(x["q"], x["k"], x["v"], x["sinks"], d_out, allowed=band[None, None])
    close(out, want_out)
    close(lse, want_lse)
    grads = jax.jit(jax.grad(lambda x: jnp.sum(attend(x)[0] * d_out)))(sharded)
    for key in x:
        close(grads[key], want[key])


def test_the_composition_is_the_formula_on_known_numbers():
    out, lse = sinks_mod.apply(jnp.ones((1, 2, 1, 1)), jnp.asarray([[[0.0, -jnp.inf]]]), jnp.asarray([0.0]))
    np.testing.assert_allclose(np.asarray(out)[0, :, 0, 0], [0.5, 0.0])
    np.testing.assert_allclose(np.asarray(lse)[0, 0], [np.log(2.0), 0.0])



def test_a_minus_inf_sink_on_a_row_with_nothing_to_attend_gives_zero_and_finite_gradients(rng):
    q = jnp.asarray(rng.standard_normal((1, 8, 2, 8)), jnp.float32)
    sinks = jnp.asarray([-jnp.inf, 0.0])
    lengths = jnp.asarray([5], jnp.int32)
    out = sdpagraph.attention(q, q, q, query_seq_lengths=lengths, key_value_seq_lengths=lengths, sinks=sinks,
                              implementation="xla")
    assert np.all(np.isfinite(np.asarray(out))) and np.all(np.asarray(out)[0, 5:] == 0)
    grads = jax.grad(lambda q, s: jnp.sum(sdpagraph.attention(q, q, q, query_seq_lengths=lengths,
                                                               key_value_seq_lengths=lengths, sinks=s,
                                                               implementation="xla") ** 2), argnums=(0, 1))(q, sinks)
    assert all(np.all(np.isfinite(np.asarray(g))) for g in grads)


@needs_devices
@pytest.mark.parametrize("strategy", ["ring", "all_to_all", "halo"])
def test_context_parallel_sinks_on_cudnn_blocks(rng, strategy, cudnn_graphs_on_cpu):
    """The blocks' backward reads only the o and stats it is given (`stats_backward_executor`): the
    sinks join once per row (the ring's final merge, each device's call) and their gradient is summed
    over the devices."""
    x, mesh, sharded, d_out = split_along_the_sequence(rng)
    window = (2, 0) if strategy == "halo" else None  # the ring runs cuDNN blocks without a window
    attend = lambda x: sdpagraph.attention(  # noqa: E731
        x["q"], x["k"], x["v"], sinks=x["sinks"], is_causal=True, local_window_size=window,
        context_parallel_axis="cp", mesh=mesh, context_parallel_strategy=strategy, implementation="cudnn")
    allowed = np.tril(np.ones((8, 8), bool))
    if window is not None:
        allowed &= ~np.tril(np.ones((8, 8), bool), -3)
    want_out, _, want = reference(x["q"], x["k"], x["v"], x["sinks"], d_out, allowed=allowed[None, None])
    close(jax.jit(attend)(sharded), want_out)
    grads = jax.jit(jax.grad(lambda x: jnp.sum(attend(x) * d_out)))(sharded)
    for key in x:
        close(grads[key], want[key])


@needs_devices
def test_sinks_split_with_the_heads_under_spmd(rng, cudnn_graphs_on_cpu):
    shapes = (2, 6, 6, 4, 2, 8)
    x = inputs(rng, shapes)
    mesh = make_mesh((DEVICES,), ("model",))
    heads = {n: jax.device_put(a, jax.sharding.NamedSharding(mesh, P("model") if n == "sinks" else
                                                             P(None, None, "model"))) for n, a in x.items()}
    d_out = rng.standard_normal((2, 6, 4, 8))
    attend = lambda x: sdpagraph.attention(x["q"], x["k"], x["v"], sinks=x["sinks"], is_causal=True,  # noqa: E731
                                           implementation="cudnn")
    want_out, _, want = reference(x["q"], x["k"], x["v"], x["sinks"], d_out,
                                  allowed=np.tril(np.ones((6, 6), bool))[None, None])
    out = jax.jit(attend)(heads)
    close(out, want_out)
    grads = jax.jit(jax.grad(lambda x: jnp.sum(attend(x) * d_out)))(heads)
    for key in x:
        close(grads[key], want[key])
    built, native = cudnn_graphs_on_cpu
    assert any(spec.num_heads == 2 for spec, _, _ in built), "one graph per device, on its heads"
