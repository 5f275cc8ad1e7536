"""Drop-in with jax.nn.dot_product_attention, and nothing silently dropped.

- every bias / mask shape jax accepts (lower ranks left-padded to 4-D), with jax's meaning, on the
  XLA backend and on the cuDNN path's JAX side (a stand-in for the graph); the shapes jax rejects
  raise here too;
- empty axes (B, T, S or N of 0) give jax's result;
- rows with more segments than max_segments_per_seq raise (concrete ids) or are checked when
  the call runs (under jit: NaN rows on the device, or a raise on request), unless
  SDPAGRAPH_CHECK_SEGMENTS=off;
- traced scalars (mods.softcap(cap) under jit, traced score_mod_tensors) are device operands.
"""
import dataclasses
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import sdpagraph
from sdpagraph import mods
from sdpagraph.graphs.operands import ARRAY_PREFIX, array_desc, graph_io
from sdpagraph.backends.cudnn import backend as cudnn_backend
from sdpagraph.graphs import operands as operands_module
from sdpagraph.call import prepare_call
from sdpagraph.backends.cudnn.graph_on_xla import graph_forward

B, T, S, N, K, H = 2, 5, 7, 4, 2, 8


def qkv(rng, batch=B, t=T, s=S, unbatched=False):
    shapes = ((batch, t, N, H), (batch, s, K, H), (batch, s, K, H))
    if unbatched:
        shapes = tuple(shape[1:] for shape in shapes)
    return tuple(jnp.asarray(rng.standard_normal(shape), jnp.float32) for shape in shapes)


def jax_shapes(full):
    """Every bias/mask shape jax accepts for logits of shape `full`: any rank up to 4, each axis
    (counted from the right) 1 or full."""
    for rank in range(5):
        for choice in itertools.product((0, 1), repeat=rank):
            yield tuple(full[4 - rank + i] if pick else 1 for i, pick in enumerate(choice))


def random_mask(rng, shape):
    """A random mask in which every row keeps key 0 (jax averages over a fully masked row,
    sdpagraph gives 0: fully masked rows are tested elsewhere)."""
    mask = rng.random(shape) < 0.6
    if mask.ndim:
        mask[..., 0] = True
    else:
        mask = np.bool_(True)
    return jnp.asarray(mask)


def close(a, b, tol=2e-5):
    np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=tol, atol=tol)


# ----------------------------------------------------------------------------- bias and mask shapes

@pytest.mark.parametrize("unbatched", [False, True])
def test_every_bias_and_mask_shape_jax_accepts_is_accepted_as_jax_reads_it(unbatched):
    batch = 1 if unbatched else B
    full = (batch, N, T, S)
    q, k, v = (jax.ShapeDtypeStruct(shape[1:] if unbatched else shape, jnp.float32)
               for shape in ((batch, T, N, H), (batch, S, K, H), (batch, S, K, H)))
    shapes = list(jax_shapes(full))
    assert (S,) in shapes and (1, 1, S) in shapes and (T, S) in shapes and (N, T, S) in shapes and () in shapes
    for shape in shapes:
        padded = (1,) * (4 - len(shape)) + shape  # jax's _ensure_4d
        call = prepare_call(q, k, v, jax.ShapeDtypeStruct(shape, jnp.float32), jax.ShapeDtypeStruct(shape, bool))
        assert call.spec.bias_shape == padded and call.spec.mask_shape == padded


def compare_with_jax(rng, shape, unbatched=False, **kwargs):
    """sdpagraph (its default backend) against jax.nn.dot_product_attention(implementation="xla"),
    with a bias and a mask of `shape`, in one jitted function: outputs, logsumexp and gradients."""
    batch = 1 if unbatched else B
    q, k, v = qkv(rng, batch, unbatched=unbatched)
    bias = jnp.asarray(rng.standard_normal(shape), jnp.float32)
    mask = random_mask(rng, shape)

    @jax.jit
    def results(q, k, v, bias):
        def run(fn, **extra):
            def loss(q, k, v, bias):
                out, lse = fn(q, k, v, bias=bias, mask=mask, return_residual=True, **kwargs, **extra)
                return jnp.sum(out * jnp.cos(out)), (out, lse)
            grads, (out, lse) = jax.grad(loss, argnums=(0, 1, 2, 3), has_aux=True)(q, k, v, bias)
            return out, lse, grads
        # On a machine without a GPU the default backend is XLA too: one run covers both there.
        return [run(sdpagraph.attention), run(jax.nn.dot_product_attention, implementation="xla")]

    *ours, want = results(q, k, v, bias)
    for got in ours:
        close(got[0], want[0])
        close(got[1], want[1])
        for grad, grad_want in zip(got[2], want[2]):
            assert grad.shape == grad_want.shape
            close(grad, grad_want, 1e-4)
    assert want[2][3].shape == shape  # the bias gradient has the bias's own shape


SHAPES = [(), (S,), (1, 1, S), (T, 1), (T, S), (N, 1, S), (N, T, S), (B, 1, 1, S)]


@pytest.mark.parametrize("shape", SHAPES)
def test_lower_rank_bias_and_mask_mean_what_they_mean_in_jax(rng, shape):
    compare_with_jax(rng, shape, is_causal=shape == (T, S))


@pytest.mark.parametrize("shape", [(T, S), (1, N, T, S)])
def test_lower_rank_bias_and_mask_with_unbatched_inputs(rng, shape):
    compare_with_jax(rng, shape, unbatched=True)


def test_python_scalars_and_lists_as_bias_and_mask(rng):
    q, k, v = qkv(rng)
    row = [True] * (S - 2) + [False, False]

    @jax.jit
    def results(q):
        return [(fn(q, k, v, bias=0.5), fn(q, k, v, mask=row))
                for fn in (sdpagraph.attention, jax.nn.dot_product_attention)]

    (bias, mask), (bias_want, mask_want) = results(q)
    close(bias, bias_want)
    close(mask, mask_want)


@pytest.mark.parametrize("shape", [(S + 1,), (T + 1, S), (3, T, S), (B + 1, 1, 1, S), (1, 1, 1, T, S),
                                   (2, 1, T, S)])
@pytest.mark.parametrize("unbatched", [False, True])
def test_shapes_jax_rejects_are_rejected(rng, shape, unbatched):
    if not unbatched and shape == (2, 1, T, S):
        return  # B == 2: a valid batched shape
    batch = 1 if unbatched else B
    q, k, v = qkv(rng, batch, unbatched=unbatched)
    for name, value in (("bias", jnp.zeros(shape, jnp.float32)), ("mask", jnp.ones(shape, bool))):
        with pytest.raises(Exception):
            jax.nn.dot_product_attention(q, k, v, **{name: value}, implementation="xla")
        with pytest.raises(ValueError, match=name):
            sdpagraph.attention(q, k, v, **{name: value})
        with pytest.raises(ValueError, match=name):
            sdpagraph.check_support(q, k, v, **{name: value})


def test_spec_holds_the_4d_shape_and_the_keys_of_4d_calls_do_not_change(rng):
    q, k, v = qkv(rng)
    low = prepare_call(q, k, v, jnp.zeros((T, S)), jnp.ones((S,), bool))
    assert low.spec.bias_shape == (1, 1, T, S) and low.spec.mask_shape == (1, 1, 1, S)
    assert low.inputs.bias.shape == (1, 1, T, S) and low.inputs.mask.shape == (1, 1, 1, S)
    four = prepare_call(q, k, v, jnp.zeros((1, 1, T, S)), jnp.ones((1, 1, 1, S), bool))
    assert four.spec == low.spec and four.spec.canonical() == low.spec.canonical()
    unbatched = prepare_call(q[0], k[0], v[0], jnp.zeros((N, T, S)))
    assert unbatched.spec.bias_shape == (1, N, T, S)  # as before: 3-D bias of an unbatched call


def fake_core(static, q, k, v, bias, aux, validity, sinks=None):
    """The cuDNN graph, on XLA: the graph's bias operand (mask folded into it) and aux arrays
    (`graph_on_xla.graph_forward`), with the sinks joined as the real core joins them."""
    aux = cudnn_backend._sink_operand(static, aux, sinks)
    return cudnn_backend._with_sinks(static, *graph_forward(static, aux)(q, k, v, bias, aux.get("sink_token")), sinks)


def cudnn_path(q, k, v, **kwargs):
    """`backends.cudnn.backend.attention` (operands, bias operand, row zeroing) around `fake_core`."""
    call = prepare_call(q, k, v, **kwargs)
    out, _ = cudnn_backend.attention(call.spec, q, k, v, call.inputs, call.score_mod)
    return out


@pytest.mark.parametrize("shape", [(), (S,), (T, 1), (N, T, S)])
def test_lower_rank_bias_and_mask_on_the_cudnn_path(rng, monkeypatch, shape):
    monkeypatch.setattr(cudnn_backend, "_core", fake_core)
    monkeypatch.setitem(operands_module.MASKED_BIAS, "float32", -1e30)
    q, k, v = qkv(rng)
    bias = jnp.asarray(rng.standard_normal(shape), jnp.float32)
    mask = random_mask(rng, shape)

    @jax.jit
    def results(bias):
        def both(fn):
            loss = lambda b: jnp.sum(fn(q, k, v, bias=b, mask=mask) ** 2)  # noqa: E731
            return fn(q, k, v, bias=bias), fn(q, k, v, mask=mask), jax.grad(loss)(bias)
        return both(cudnn_path), both(jax.nn.dot_product_attention)

    got, want = results(bias)
    assert got[2].shape == shape
    for a, b in zip(got, want):
        close(a, b, 1e-4)


# ----------------------------------------------------------------------------- empty axes

@pytest.mark.parametrize("batch,t,s", [(B, 0, S), (B, T, 0), (0, T, S), (B, 0, 0)])
def test_empty_axes_give_jax_result(rng, batch, t, s):
    q, k, v = qkv(rng, batch, t, s)
    want, want_lse = jax.nn.dot_product_attention(q, k, v, return_residual=True)

    @jax.jit
    def run(q, k, v):
        results = [sdpagraph.attention(q, k, v, return_residual=True, implementation=implementation)
                   for implementation in (None, "xla", "cudnn")]
        grads = jax.grad(lambda q, k, v: jnp.sum(sdpagraph.attention(q, k, v, is_causal=True)),
                         argnums=(0, 1, 2))(q, k, v)
        return results, grads

    results, grads = run(q, k, v)
    for got, lse in results:
        assert got.shape == want.shape and lse.shape == want_lse.shape
        close(got, want)
        np.testing.assert_array_equal(np.asarray(lse), np.asarray(want_lse))  # -inf where S is 0
    for grad, x in zip(grads, (q, k, v)):
        assert grad.shape == x.shape and np.all(np.asarray(grad) == 0)
    support = sdpagraph.check_support(q, k, v)
    assert not support.supported and "size 0" in support.reason


def test_empty_axes_with_padding_segments_and_heads(rng):
    q, k, v = qkv(rng, 0)
    lengths = jnp.zeros((0,), jnp.int32)
    assert sdpagraph.attention(q, k, v, query_seq_lengths=lengths, key_value_seq_lengths=lengths).shape == q.shape
    q, k, v = qkv(rng, B, 0, 0)
    ids = jnp.zeros((B, 0), jnp.int32)
    assert sdpagraph.attention(q, k, v, segment_ids=ids, max_segments_per_seq=2).shape == q.shape
    q = jnp.zeros((B, T, 0, H))
    k = v = jnp.zeros((B, S, 0, H))
    with pytest.raises(Exception):
        jax.nn.dot_product_attention(q, k, v)  # K = 0: no multiple of it
    with pytest.raises(ValueError, match="key/value heads"):
        sdpagraph.attention(q, k, v)


def test_zero_head_dim_names_the_axis(rng):
    q, k, v = (jnp.zeros((B, length, heads, 0)) for length, heads in ((T, N), (S, K), (S, K)))
    with pytest.raises(ValueError, match="head dim H"):
        sdpagraph.attention(q, k, v)


# ----------------------------------------------------------------------------- segments past the bound

def ids_with_segments(counts, length=12):
    """Rows of `length` ids with counts[i] segments of one token each (then padding)."""
    rows = np.zeros((len(counts), length), np.int32)
    for row, count in zip(rows, counts):
        row[:count] = np.arange(1, count + 1)
    return rows


def test_concrete_ids_past_the_bound_raise(rng):
    q, k, v = qkv(rng, 2, 12, 12)
    ids = ids_with_segments([3, 7])
    message = r"segment_ids: row 1 has 7 segments, more than max_segments_per_seq=4"
    for ids_type in (np.asarray, jnp.asarray):
        with pytest.raises(ValueError, match=message):
            sdpagraph.attention(q, k, v, segment_ids=ids_type(ids), max_segments_per_seq=4)
        with pytest.raises(ValueError, match=message):
            sdpagraph.check_support(q, k, v, segment_ids=ids_type(ids), max_segments_per_seq=4)
    # Closed over by a jitted function, device ids are concrete: the call raises when traced.
    device_ids = jnp.asarray(ids)
    with pytest.raises(ValueError, match=message):
        jax.jit(lambda q: sdpagraph.attention(q, k, v, segment_ids=device_ids, max_segments_per_seq=4))(q)
    sdpagraph.check_support(q, k, v, segment_ids=ids, max_segments_per_seq=7)  # at the bound
    sdpagraph.check_support(q, k, v, segment_ids=ids)  # the default bound, T, always fits


def test_cross_attention_checks_the_query_ids(rng):
    q, k, v = qkv(rng, 2, 12, 12)
    few, many = ids_with_segments([2, 2]), ids_with_segments([2, 6])
    # Key segments past the bound pair with no query segment: nothing is dropped.
    sdpagraph.check_support(q, k, v, segment_ids=(few, many), max_segments_per_seq=2)
    with pytest.raises(ValueError, match=r"segment_ids\[0\]: row 1 has 6 segments"):
        sdpagraph.attention(q, k, v, segment_ids=(many, few), max_segments_per_seq=2)


def test_traced_ids_past_the_bound_give_their_rows_nan_without_a_host_callback(rng):
    q, k, v = qkv(rng, 3, 12, 12)
    call = lambda q, ids: sdpagraph.attention(q, k, v, segment_ids=ids, max_segments_per_seq=4)  # noqa: E731
    run = jax.jit(call)
    fine = np.asarray(run(q, jnp.asarray(ids_with_segments([4, 2, 1]))))
    assert np.all(np.isfinite(fine))
    out = np.asarray(run(q, jnp.asarray(ids_with_segments([3, 7, 4]))))
    assert np.all(np.isnan(out[1])) and np.all(np.isfinite(out[[0, 2]]))  # only the row past the bound
    assert "callback" not in str(jax.make_jaxpr(call)(q, jnp.asarray(ids_with_segments([1, 1, 1]))))
    # The residual too, and a loss over the batch cannot pass silently.
    _, lse = jax.jit(lambda q, ids: sdpagraph.attention(q, k, v, segment_ids=ids, max_segments_per_seq=4,
                                                        return_residual=True))(q, jnp.asarray(ids_with_segments([1, 6, 1])))
    assert np.all(np.isnan(np.asarray(lse)[1])) and not np.any(np.isnan(np.asarray(lse)[[0, 2]]))
    # An inference call (no softmax stats kept) too.
    inference = jax.jit(lambda q, ids: sdpagraph.attention(q, k, v, segment_ids=ids, max_segments_per_seq=4,
                                                           training=False))
    out = np.asarray(inference(q, jnp.asarray(ids_with_segments([1, 1, 6]))))
    assert np.all(np.isnan(out[2])) and np.all(np.isfinite(out[:2]))
    loss = jax.jit(jax.value_and_grad(lambda q, ids: jnp.sum(call(q, ids))))
    value, _ = loss(q, jnp.asarray(ids_with_segments([5, 1, 1])))
    assert np.isnan(value)
    # A segment longer than a max_seqlen hint likewise, for the key ids of a cross pair.
    hinted = jax.jit(lambda q, kv_ids: sdpagraph.attention(q, k, v, segment_ids=(jnp.ones((3, 12), jnp.int32), kv_ids),
                                                           max_seqlen_kv=4))
    long_row = np.ones((3, 12), np.int32)
    long_row[0] = np.repeat([1, 2, 3], 4)
    long_row[2] = np.repeat([1, 2, 3, 4], 3)
    out = np.asarray(hinted(q, jnp.asarray(long_row)))
    assert np.all(np.isnan(out[1])) and np.all(np.isfinite(out[[0, 2]]))


def test_poisoning_takes_an_inference_result_without_softmax_stats(rng):
    q, k, v = qkv(rng, 3, 12, 12)
    seen = {}
    jax.jit(lambda q, ids: seen.setdefault("call", prepare_call(q, k, v, segment_ids=ids, max_segments_per_seq=4))
            and q)(q, jnp.asarray(ids_with_segments([1, 1, 1])))
    call = dataclasses.replace(seen["call"], invalid_rows=jnp.asarray([False, True, False]))
    out, lse = call.poison(jnp.ones((3, 12, 4, 8)), None)  # cuDNN's inference graph returns no logsumexp
    assert lse is None and np.all(np.isnan(np.asarray(out)[1])) and np.all(np.asarray(out)[[0, 2]] == 1)


def test_traced_ids_past_the_bound_raise_when_the_call_runs_on_request(rng, monkeypatch, caplog):
    monkeypatch.setenv("SDPAGRAPH_CHECK_SEGMENTS", "raise")
    q, k, v = qkv(rng, 2, 12, 12)
    run = jax.jit(lambda q, ids: sdpagraph.attention(q, k, v, segment_ids=ids, max_segments_per_seq=4))
    run(q, jnp.asarray(ids_with_segments([4, 2]))).block_until_ready()  # within the bound
    with caplog.at_level("ERROR", logger="sdpagraph"):
        with pytest.raises(Exception, match=r"row 1 has 7 segments, more than max_segments_per_seq=4") as error:
            run(q, jnp.asarray(ids_with_segments([3, 7]))).block_until_ready()
    assert isinstance(error.value, (ValueError, jax.errors.JaxRuntimeError))
    # XLA wraps the callback's error in its own text; sdpagraph's message is logged as it happens.
    assert any("row 1 has 7 segments" in record.getMessage() for record in caplog.records)
    # Under grad too, and for the query ids of a cross pair.
    grad = jax.jit(jax.grad(lambda q, ids: jnp.sum(sdpagraph.attention(q, k, v, segment_ids=(ids, ids),
                                                                        max_segments_per_seq=4))))
    grad(q, jnp.asarray(ids_with_segments([4, 4]))).block_until_ready()
    with pytest.raises(Exception, match=r"segment_ids\[0\]: row 0 has 5 segments"):
        grad(q, jnp.asarray(ids_with_segments([5, 1]))).block_until_ready()


@pytest.mark.parametrize("off", ["off", "0"])
def test_the_check_can_be_switched_off(rng, monkeypatch, off):
    monkeypatch.setenv("SDPAGRAPH_CHECK_SEGMENTS", off)
    q, k, v = qkv(rng, 2, 12, 12)
    ids = ids_with_segments([3, 7])
    call = lambda q, ids: sdpagraph.attention(q, k, v, segment_ids=ids, max_segments_per_seq=4)  # noqa: E731
    eager = jax.jit(lambda q: call(q, ids))(q)  # NumPy ids closed over: concrete
    close(jax.jit(call)(q, jnp.asarray(ids)), eager)
    # Off, the segments past the bound are dropped: their query rows give 0.
    assert np.all(np.asarray(eager)[1, 4:7] == 0) and np.any(np.asarray(eager)[1, :4] != 0)
    traced = lambda call: str(jax.make_jaxpr(call)(q, jnp.asarray(ids)))  # noqa: E731
    assert "debug_callback" not in traced(call)
    monkeypatch.setenv("SDPAGRAPH_CHECK_SEGMENTS", "raise")  # read when a call is traced (jax caches traces
    assert "debug_callback" in traced(lambda q, ids: call(q, ids))  # per function: a new one here)


@pytest.mark.parametrize("value, mode", [("1", "nan"), ("true", "nan"), ("false", "off"), ("no", "off"),
                                         ("0", "off"), ("RAISE", "raise"), ("", "nan")])
def test_the_switch_words_still_mean_what_they_meant(monkeypatch, value, mode):
    from sdpagraph.segments.rules import segment_check_mode
    monkeypatch.setenv("SDPAGRAPH_CHECK_SEGMENTS", value)
    assert segment_check_mode() == mode


def test_a_bad_check_mode_names_the_variable(rng, monkeypatch):
    monkeypatch.setenv("SDPAGRAPH_CHECK_SEGMENTS", "sometimes")
    q, k, v = qkv(rng, 2, 12, 12)
    sdpagraph.attention(q, k, v)  # a call without packed ids never reads it
    with pytest.raises(ValueError, match="SDPAGRAPH_CHECK_SEGMENTS must be one of nan, raise, off"):
        jax.jit(lambda q, ids: sdpagraph.attention(q, k, v, segment_ids=ids, max_segments_per_seq=4))(
            q, jnp.asarray(ids_with_segments([1, 1])))


# ----------------------------------------------------------------------------- traced scalars

def test_traced_softcap_is_a_device_operand(rng):
    q, k, v = qkv(rng)
    traces = []

    @jax.jit
    def run(q, cap):
        traces.append(cap)
        return sdpagraph.attention(q, k, v, is_causal=True, score_mod=mods.softcap(cap))

    want = jax.jit(lambda q: [sdpagraph.attention(q, k, v, is_causal=True, score_mod=mods.softcap(cap))
                              for cap in (30.0, 2.0)])(q)  # pass-by-value caps
    for cap, expected in zip((30.0, 2.0), want):
        close(run(q, cap), expected, 1e-5)
    assert len(traces) == 1  # a new value neither retraces nor builds a graph

    seen = {}

    def record(q, cap):
        seen["call"] = prepare_call(q, k, v, score_mod=mods.softcap(cap))
        return q

    jax.jit(record)(q, 3.0)
    ir = seen["call"].score_mod
    assert ir.array_names == ("cap",) and ir.scalar_names == ()
    assert array_desc(ir, "cap").dims == (1, 1, 1, 1) and array_desc(ir, "cap").dtype == "float32"
    assert ARRAY_PREFIX + "cap" in graph_io(seen["call"].spec, ir, "forward")[0]
    concrete = prepare_call(q, k, v, score_mod=mods.softcap(3.0))  # a number stays pass-by-value
    assert concrete.score_mod.scalar_names == ("cap",) and concrete.score_mod.array_names == ()


def test_traced_score_mod_tensors_and_mod_factories(rng):
    q, k, v = qkv(rng)
    slopes = rng.random(N).astype(np.float32)
    table = rng.standard_normal((N, 5)).astype(np.float32)

    def softcap(graph, score, tensors):
        return graph.tanh(input=score / tensors["cap"]) * tensors["cap"]

    cases = [
        (lambda c: dict(score_mod=softcap, score_mod_tensors={"cap": c}), 7.0),
        (lambda c: dict(score_mod=softcap, score_mod_tensors={"cap": c}), jnp.bfloat16(7.0)),
        (lambda c: dict(score_mod=mods.compose(mods.softcap(c), mods.causal())), 4.0),
        (lambda p: dict(score_mod=mods.prefix_lm(p)), jnp.int32(3)),
        (lambda p: dict(score_mod=mods.prefix_lm(p)), jnp.asarray([2, 4], jnp.int32)),
        (lambda s: dict(score_mod=mods.alibi(s)), slopes),
        (lambda t: dict(score_mod=mods.relative_position_bias(t, 2)), table),
    ]
    def concrete(value):  # the same value as a Python number or a NumPy array
        value = np.asarray(value, np.float32 if np.asarray(value).dtype == jnp.bfloat16 else None)
        return value.item() if value.ndim == 0 else value

    values = [value for _, value in cases]
    traced = jax.jit(lambda q, values: [sdpagraph.attention(q, k, v, **make(value))
                                        for (make, _), value in zip(cases, values)])(q, values)
    want = jax.jit(lambda q: [sdpagraph.attention(q, k, v, **make(concrete(value))) for make, value in cases])(q)
    for got, expected in zip(traced, want):
        close(got, expected, 1e-4)


def test_traced_scalars_are_constants_for_differentiation(rng):
    q, k, v = qkv(rng)

    def loss(q, cap):
        return jnp.sum(sdpagraph.attention(q, k, v, score_mod=mods.softcap(cap)) ** 2)

    dq, dcap = jax.jit(jax.grad(loss, argnums=(0, 1)))(q, 3.0)
    assert float(dcap) == 0.0
    want = jax.jit(jax.grad(lambda q: jnp.sum(sdpagraph.attention(q, k, v, score_mod=mods.softcap(3.0)) ** 2)))(q)
    close(dq, want, 1e-4)


def test_sizes_that_shape_the_mask_must_be_static(rng):
    q, k, v = qkv(rng)
    for make in (mods.sliding_window, mods.chunked, lambda x: mods.relative_position_bias(np.ones((N, 5)), x)):
        with pytest.raises(TypeError, match="must be a Python int.*static"):
            jax.jit(lambda x: sdpagraph.attention(q, k, v, score_mod=make(x)))(2)


@pytest.mark.parametrize("direction", ["forward", "backward", "inference"])
def test_a_traced_softcap_lowers_to_a_valid_cudnn_graph(rng, direction):
    """The (1, 1, 1, 1) operand a traced cap becomes, through the real cudnn.pygraph up to its
    IR-level validate() (no cuDNN backend library or GPU needed)."""
    cudnn = pytest.importorskip("cudnn")
    from sdpagraph.graphs import builder
    from sdpagraph.graphs.lowering import lower

    q, k, v = (x.astype(jnp.bfloat16) for x in qkv(rng))
    seen = {}
    jax.jit(lambda c: seen.setdefault("call", prepare_call(q, k, v, is_causal=True, score_mod=mods.softcap(c))) and c)(3.0)
    spec, ir = seen["call"].spec, seen["call"].score_mod
    graph = builder.new_graph(spec, direction, cudnn)
    lowering = lower(graph, spec, ir, direction, cudnn)
    graph.validate()
    assert ARRAY_PREFIX + "cap" in lowering.operand_roles
