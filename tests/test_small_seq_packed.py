"""The small-sequence backend on packed segment_ids with the max_seqlen_q / max_seqlen_kv hints, and a
user score_mod_bprop: values and gradients (q, k, v, bias) against the XLA backend and a float64 NumPy
reference on fresh random inputs; the hints' validation, errors and place in the spec."""
import dataclasses

import jax
import jax.extend.core
import jax.numpy as jnp
import numpy as np
import pytest

import sdpagraph
from sdpagraph import mods
from sdpagraph.graphs.operands import graph_spec
from sdpagraph.call import prepare_call
from sdpagraph.backends.small_seq.backend import small_seq_reason
from sdpagraph.spec import AttentionSpec
from tests import reference as ref

from tests.test_small_seq import TOL, rel_err


def packed_ids(rng, B, T, longest, count=None):
    """(B, T) int32: segments of 1..longest tokens (ids 1, 2, ...; some padding 0 between and after)
    and, with `count`, exactly that many segments per row (the rest padding)."""
    ids = np.zeros((B, T), np.int32)
    for b in range(B):
        t, n = 0, 0
        while t < T and (count is None or n < count):
            if rng.random() < 0.15:
                t += 1  # padding
                continue
            length = int(rng.integers(1, longest + 1))
            n += 1
            ids[b, t:t + length] = n
            t += length
    ids[0, :min(longest, T)] = 1  # one segment of the longest length
    if longest < T and ids[0, longest] == 1:
        ids[0, longest] = 0  # (it may have run on: end it)
    return ids


def draw(rng, shape, dtype):
    return jnp.asarray(rng.standard_normal(shape), dtype)


def check(rng, dtype, q_ids, kv_ids=None, *, N=4, K=2, H=16, ref_mod=ref.IDENTITY, with_bias=False, mask=None,
          ref_kwargs=None, **kwargs):
    """small_seq (through `attention`) against the XLA backend and the float64 reference: the
    output and the gradients of <out, dO> with respect to q, k, v (and the bias)."""
    B, T = q_ids.shape
    S = T if kv_ids is None else kv_ids.shape[1]
    q, k, v, d_out = (draw(rng, shape, dtype) for shape in ((B, T, N, H), (B, S, K, H), (B, S, K, H), (B, T, N, H)))
    bias = draw(rng, (1, N, T, S), dtype) if with_bias else None
    ids = jnp.asarray(q_ids) if kv_ids is None else (jnp.asarray(q_ids), jnp.asarray(kv_ids))
    args = (q, k, v) + ((bias,) if with_bias else ())

    def loss(implementation):
        def f(q, k, v, bias=None):
            out = sdpagraph.attention(q, k, v, bias, mask, segment_ids=ids, implementation=implementation, **kwargs)
            return jnp.sum(out.astype(jnp.float32) * d_out.astype(jnp.float32)), out
        return jax.value_and_grad(f, argnums=tuple(range(len(args))), has_aux=True)

    ((_, out), grads), ((_, out_xla), grads_xla) = jax.jit(lambda *a: (loss("small_seq")(*a), loss("xla")(*a)))(*args)
    assert out.dtype == q.dtype
    assert rel_err(out, out_xla) < TOL[dtype]
    for name, a, b in zip("qkvb", grads, grads_xla):
        assert a.dtype == b.dtype and a.shape == b.shape, name
        assert rel_err(a, b) < 2 * TOL[dtype], name

    ok, q_pos, k_pos = ref.allowed(B, T, S, q_ids=q_ids, kv_ids=q_ids if kv_ids is None else kv_ids,
                                   max_segments=T, **(ref_kwargs or {}))
    ok = ok[:, None] if mask is None else ok[:, None] & np.asarray(mask)
    out_ref, grads_ref = ref.attention_fwd_bwd(q, k, v, d_out, scale=1 / np.sqrt(H), ok=ok, q_pos=q_pos, k_pos=k_pos,
                                               mod=ref_mod, bias=bias)
    assert rel_err(out, out_ref) < TOL[dtype]
    for name, a, b in zip("qkvb", grads, grads_ref):
        assert rel_err(a, b) < 2 * TOL[dtype], name


# ----------------------------------------------------------------------------- values and gradients

SELF_CASES = {
    "plain": ({}, {}, ref.IDENTITY),
    "causal": (dict(is_causal=True), dict(is_causal=True), ref.IDENTITY),
    "window": (dict(local_window_size=(1, 0)), dict(window=(1, 0)), ref.IDENTITY),
    "softcap_causal": (dict(is_causal=True, score_mod=mods.softcap(2.0)), dict(is_causal=True), ref.softcap_mod(2.0)),
    "alibi": (dict(score_mod=mods.alibi(np.linspace(0.2, 0.8, 4))), {}, ref.alibi_mod(np.linspace(0.2, 0.8, 4))),
}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("case", sorted(SELF_CASES))
def test_packed_self_attention(rng, dtype, case):
    kwargs, ref_kwargs, ref_mod = SELF_CASES[case]
    longest = int(rng.integers(2, 5))
    q_ids = packed_ids(rng, 3, 29, longest)
    check(rng, dtype, q_ids, ref_mod=ref_mod, ref_kwargs=ref_kwargs, max_seqlen_q=longest, **kwargs)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_packed_cross_attention_bottom_right(rng, dtype):
    """Queries of 1-3 tokens per segment over keys of up to 11: the k-th query segment reads the k-th key
    segment, bottom-right causal within each pair; GQA N8/K2."""
    q_ids, kv_ids = packed_ids(rng, 3, 20, 3, count=5), packed_ids(rng, 3, 48, 11, count=5)
    check(rng, dtype, q_ids, kv_ids, N=8, K=2, max_seqlen_q=3, max_seqlen_kv=11, is_causal=True,
          causal_alignment="bottom_right", ref_kwargs=dict(is_causal=True, alignment="bottom_right"))


def test_packed_bias_and_mask(rng):
    q_ids = packed_ids(rng, 2, 24, 4)
    mask = jnp.asarray(rng.random((2, 1, 24, 24)) < 0.8)
    check(rng, "float32", q_ids, with_bias=True, mask=mask, max_seqlen_kv=4)


def test_packed_past_max_segments_and_padding_rows(rng):
    """Segments past max_segments_per_seq are dropped as on XLA (checks off); rows of padding give 0."""
    q_ids = packed_ids(rng, 3, 16, 3)
    q_ids[2] = 0
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("SDPAGRAPH_CHECK_SEGMENTS", "0")
        q, k, v = (draw(rng, (3, 16, 2, 8), "float32") for _ in range(3))
        run = lambda impl: sdpagraph.attention(q, k, v, segment_ids=jnp.asarray(q_ids), max_segments_per_seq=2,  # noqa: E731
                                               max_seqlen_q=3, implementation=impl)
        out = run("small_seq")
        np.testing.assert_allclose(out, run("xla"), rtol=1e-5, atol=1e-6)
        assert np.all(np.asarray(out)[2] == 0)


def test_key_and_value_gradients_gather_and_never_scatter(rng):
    """dK and dV sum each key's window slots with a gather: no scatter-add (atomic on a GPU, and
    nondeterministic), for self- and cross-attention."""
    q_ids, kv_ids = packed_ids(rng, 2, 12, 2, count=4), packed_ids(rng, 2, 40, 8, count=4)
    for ids, s, hints in ((jnp.asarray(q_ids), 12, dict(max_seqlen_q=2)),
                          ((jnp.asarray(q_ids), jnp.asarray(kv_ids)), 40, dict(max_seqlen_q=2, max_seqlen_kv=8))):
        q, k, v = draw(rng, (2, 12, 4, 8), "float32"), draw(rng, (2, s, 2, 8), "float32"), draw(rng, (2, s, 2, 8), "float32")
        loss = lambda q, k, v: jnp.sum(sdpagraph.attention(q, k, v, segment_ids=ids, implementation="small_seq",  # noqa: E731
                                                           is_causal=True, **hints) ** 2)
        jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
        float_scatters = [e for e in _equations(jaxpr.jaxpr) if e.primitive.name.startswith("scatter")
                          and jnp.issubdtype(e.outvars[0].aval.dtype, jnp.floating)]
        assert not float_scatters  # (the segment metadata may scatter int32 positions)


def _equations(jaxpr):
    for eqn in jaxpr.eqns:
        yield eqn
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            yield from _equations(sub)


USER_BPROP = dict(score_mod=lambda graph, score, tensors: score * 2.0,
                  score_mod_bprop=lambda graph, dscore, tensors: dscore * 3.0)
TRIPLED = ref.Mod(lambda s, *_: 2.0 * s, lambda s, *_: np.full_like(s, 3.0))


def test_user_score_mod_bprop_packed(rng):
    """The mod's gradient is the user's bprop (3x), not the derivative of the forward (2x)."""
    q_ids = packed_ids(rng, 2, 24, 4)
    check(rng, "float32", q_ids, ref_mod=TRIPLED, max_seqlen_q=4, **USER_BPROP)


def test_user_score_mod_bprop_bshd(rng):
    q, k, v, d_out = (draw(rng, (3, 2, 4, 8), "float32") for _ in range(4))

    def grads(implementation, **kwargs):
        f = lambda q, k, v: jnp.sum(sdpagraph.attention(q, k, v, implementation=implementation, **kwargs) * d_out)  # noqa: E731
        return jax.jit(jax.grad(f, argnums=(0, 1, 2)))(q, k, v)

    ours, xla = grads("small_seq", **USER_BPROP), grads("xla", **USER_BPROP)
    ok, q_pos, k_pos = ref.allowed(3, 2, 2)
    _, expected = ref.attention_fwd_bwd(q, k, v, d_out, scale=1 / np.sqrt(8), ok=ok, q_pos=q_pos, k_pos=k_pos,
                                        mod=TRIPLED)
    derived = grads("small_seq", score_mod=USER_BPROP["score_mod"])
    for a, b, c in zip(ours, xla, expected):
        assert rel_err(a, b) < 1e-5 and rel_err(a, c) < 1e-5
    assert rel_err(ours[0], derived[0]) > 0.1  # the bprop is not the derived one


# ----------------------------------------------------------------------------- the hints

def structs(B=2, T=16, S=16, N=4, K=4, H=8):
    return [jax.ShapeDtypeStruct(s, jnp.bfloat16) for s in ((B, T, N, H), (B, S, K, H), (B, S, K, H))]


def test_hint_errors_name_the_argument_and_the_numbers():
    q, k, v = structs()
    ids = jax.ShapeDtypeStruct((2, 16), jnp.int32)
    with pytest.raises(ValueError, match="max_seqlen_q must be a positive int, got 0"):
        prepare_call(q, k, v, segment_ids=ids, max_seqlen_q=0)
    with pytest.raises(ValueError, match="max_seqlen_kv must be a positive int, got -3"):
        prepare_call(q, k, v, segment_ids=ids, max_seqlen_kv=-3)
    with pytest.raises(TypeError, match="max_seqlen_q must be a Python int, got float"):
        prepare_call(q, k, v, segment_ids=ids, max_seqlen_q=2.0)
    with pytest.raises(ValueError, match="max_seqlen_kv=8 needs segment_ids"):
        prepare_call(q, k, v, max_seqlen_kv=8)


def test_a_concrete_segment_longer_than_the_hint_raises():
    q, k, v = (jnp.zeros((2, 8, 2, 4)) for _ in range(3))
    ids = jnp.asarray([[1, 1, 2, 2, 2, 0, 3, 3], [1, 2, 2, 2, 2, 2, 0, 0]], jnp.int32)
    with pytest.raises(ValueError, match=r"segment_ids: row 1 has a segment of 5 tokens, longer than "
                                         r"max_seqlen_q=4; .*pass max_seqlen_q >= 5"):
        sdpagraph.attention(q, k, v, segment_ids=ids, max_seqlen_q=4)
    with pytest.raises(ValueError, match="longer than max_seqlen_kv=3"):  # self: the smaller hint is named
        sdpagraph.attention(q, k, v, segment_ids=ids, max_seqlen_q=6, max_seqlen_kv=3)
    kv_ids = jnp.asarray([[1, 1, 1, 1, 2, 2, 0, 0]] * 2, jnp.int32)
    with pytest.raises(ValueError, match=r"segment_ids\[1\]: row 0 has a segment of 4 tokens, longer than max_seqlen_kv=3"):
        sdpagraph.attention(q, k, v, segment_ids=(ids, kv_ids), max_seqlen_q=5, max_seqlen_kv=3)
    assert sdpagraph.attention(q, k, v, segment_ids=ids, max_seqlen_q=5).shape == q.shape


def test_traced_ids_are_checked_when_the_call_runs(monkeypatch):
    q, k, v = (jnp.zeros((2, 8, 2, 4)) for _ in range(3))
    ids = jnp.asarray([[1, 1, 2, 2, 2, 0, 3, 3], [1, 2, 2, 2, 2, 2, 0, 0]], jnp.int32)
    run = jax.jit(lambda ids: sdpagraph.attention(q, k, v, segment_ids=ids, max_seqlen_q=4, implementation="xla"))
    out = np.asarray(run(ids))  # by default the row past the hint gives NaN, checked on the device
    assert np.all(np.isnan(out[1])) and not np.any(np.isnan(out[0]))
    assert not np.any(np.isnan(np.asarray(run(jnp.asarray([[1, 1, 2, 2, 2, 0, 3, 3]] * 2, jnp.int32)))))
    monkeypatch.setenv("SDPAGRAPH_CHECK_SEGMENTS", "raise")
    run = jax.jit(lambda ids: sdpagraph.attention(q, k, v, segment_ids=ids, max_seqlen_q=4, implementation="xla"))
    with pytest.raises(Exception, match="row 1 has a segment of 5 tokens, longer than max_seqlen_q=4") as caught:
        jax.block_until_ready(run(ids))
    assert isinstance(caught.value, (ValueError, jax.errors.JaxRuntimeError))
    jax.block_until_ready(run(jnp.asarray([[1, 1, 2, 2, 2, 0, 3, 3]] * 2, jnp.int32)))  # within the hint
    monkeypatch.setenv("SDPAGRAPH_CHECK_SEGMENTS", "off")
    run = jax.jit(lambda ids: sdpagraph.attention(q, k, v, segment_ids=ids, max_seqlen_q=4, implementation="xla"))
    jax.block_until_ready(run(ids))  # switched off: no check


def test_hints_in_the_spec():
    q, k, v = structs(T=16, S=64)
    q_ids, kv_ids = jax.ShapeDtypeStruct((2, 16), jnp.int32), jax.ShapeDtypeStruct((2, 64), jnp.int32)
    cross = prepare_call(q, k, v, segment_ids=(q_ids, kv_ids), max_seqlen_q=2, max_seqlen_kv=100).spec
    assert (cross.max_seqlen_q, cross.max_seqlen_kv) == (2, 64)  # clipped to S: a longer bound says no more
    assert "segments(cross,16,q<=2,kv<=64)" in cross.summary()
    assert cross.to_dict()["max_seqlen_q"] == 2 and AttentionSpec.from_dict(cross.to_dict()) == cross
    q, k, v = structs()
    ids = jax.ShapeDtypeStruct((2, 16), jnp.int32)
    self_ = prepare_call(q, k, v, segment_ids=ids, max_seqlen_q=4, max_seqlen_kv=8).spec
    assert (self_.max_seqlen_q, self_.max_seqlen_kv) == (4, 4)  # a segment has as many keys as queries
    assert prepare_call(q, k, v, segment_ids=ids, max_seqlen_kv=3).spec.max_seqlen_q == 3
    plain = prepare_call(q, k, v, segment_ids=ids).spec
    assert "max_seqlen_q" not in plain.to_dict() and "max_seqlen_kv" not in plain.to_dict()  # old keys stay
    assert graph_spec(self_, None) == plain  # cuDNN's graphs do not depend on the hints
    assert hash(self_) != hash(plain)


def test_regime_of_packed_calls():
    q, k, v = structs(T=64, S=64)
    ids = jax.ShapeDtypeStruct((2, 64), jnp.int32)
    assert "need the static hints" in small_seq_reason(prepare_call(q, k, v, segment_ids=ids).spec)
    assert small_seq_reason(prepare_call(q, k, v, segment_ids=ids, max_seqlen_q=4).spec) is None
    assert "max_seqlen_q=5 is above" in small_seq_reason(prepare_call(q, k, v, segment_ids=ids, max_seqlen_q=5).spec)
    q, k, v = structs(T=8, S=64)
    cross_ids = (jax.ShapeDtypeStruct((2, 8), jnp.int32), jax.ShapeDtypeStruct((2, 64), jnp.int32))
    only_q = prepare_call(q, k, v, segment_ids=cross_ids, max_seqlen_q=1).spec
    assert "key segments up to S=64 (no max_seqlen_kv)" in small_seq_reason(only_q)
    assert small_seq_reason(dataclasses.replace(only_q, max_seqlen_kv=32)) is None
    with pytest.raises(ValueError, match="implementation='small_seq' cannot run .*no max_seqlen_kv"):
        sdpagraph.attention(*(jnp.zeros(s.shape, s.dtype) for s in (q, k, v)),
                            segment_ids=(jnp.tile(jnp.arange(1, 9, dtype=jnp.int32), (2, 1)), jnp.ones((2, 64), jnp.int32)),
                            max_seqlen_q=1,
                            implementation="small_seq")


def test_spec_files_carry_the_hints():
    from sdpagraph.deploy.entry_parser import parse_entry

    q, k, v = structs(T=16, S=64)
    ids = (jax.ShapeDtypeStruct((2, 16), jnp.int32), jax.ShapeDtypeStruct((2, 64), jnp.int32))
    spec = prepare_call(q, k, v, segment_ids=ids, max_seqlen_q=2, max_seqlen_kv=16, is_causal=True).spec
    recorded = parse_entry(0, {"spec": spec.to_dict(), "directions": ["forward", "backward"]})
    assert recorded.spec == spec
    written = parse_entry(0, {"shapes": {"query": [2, 16, 4, 8], "key": [2, 64, 4, 8], "value": [2, 64, 4, 8]},
                              "dtype": "bfloat16", "is_causal": True,
                              "segment_ids": {"q_shape": [2, 16], "kv_shape": [2, 64]},
                              "max_seqlen_q": 2, "max_seqlen_kv": 16})
    assert written.spec == spec
    edited = dict(spec.to_dict(), max_seqlen_kv=100)  # not what the runtime makes (it clips to S)
    with pytest.raises(ValueError, match="max_seqlen_kv is 100, the runtime has 64"):
        parse_entry(0, {"spec": edited, "directions": ["forward", "backward"]})
