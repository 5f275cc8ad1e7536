"""Packed self-attention segments that cuDNN's packed layout cannot take run as a dense graph
whose score_mod compares key positions with segment bounds (`graphs.operands.graph_spec`,
`masks.segment_ir`).

The dense twin must mean the same as the packed call. These tests check that on the XLA
backend (the two formulations side by side, on fresh random segment ids), check which calls
fold and which keep declining, and check that the cuDNN path builds and keys the dense graph.
"""
import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sdpagraph import mods
from sdpagraph.graphs import builder
from sdpagraph.graphs.ir_eval import evaluate
from sdpagraph.graphs.lowering import lower
from sdpagraph.graphs.masks import segment_ir
from sdpagraph.graphs.mod_lowering import Unsupported
from sdpagraph.graphs.operands import folds_segments, graph_io, graph_spec
from sdpagraph.jax_api import cudnn as cudnn_backend
from sdpagraph.jax_api.attention import prepare_call
from sdpagraph.jax_api.xla import xla_attention


def random_segment_ids(rng, batch, length, segments):
    """Contiguous runs with padding between and after them; one id repeats after another run."""
    ids = np.zeros((batch, length), np.int32)
    for row in ids:
        position = int(rng.integers(0, 4))
        labels = list(rng.permutation(np.arange(1, 9))[:segments - 1])
        labels.append(labels[0])  # a reappearing id starts a new segment
        for label in labels:
            size = int(rng.integers(3, length // segments))
            row[position:position + size] = label
            position += size + int(rng.integers(0, 3))
    return ids


def call_for(rng, *, B=2, T=48, N=4, K=2, H=16, segments=4, max_segments=None, dtype=jnp.float32, **kwargs):
    q = jnp.asarray(rng.standard_normal((B, T, N, H)), dtype)
    k, v = (jnp.asarray(rng.standard_normal((B, T, K, H)), dtype) for _ in range(2))
    ids = jnp.asarray(random_segment_ids(rng, B, T, segments))
    call = prepare_call(q, k, v, kwargs.pop("bias", None), kwargs.pop("mask", None), segment_ids=ids,
                        max_segments_per_seq=max_segments or segments, **kwargs)
    return (q, k, v), call


FOLDED = {
    "softcap_causal": dict(is_causal=True, score_mod=mods.softcap(5.0)),
    "softcap_window": dict(local_window_size=(6, 2), score_mod=mods.softcap(5.0)),
    "softcap_bottom_right": dict(is_causal=True, causal_alignment="bottom_right", score_mod=mods.softcap(5.0)),
    "mask_causal": dict(is_causal=True),  # the mask is drawn in the test
    "bias": dict(),  # the bias is drawn in the test
    "dropped_segments": dict(is_causal=True, score_mod=mods.softcap(5.0), max_segments=2),
}


def dense_twin_on_xla(call, dense):
    """The dense twin, run on the XLA backend the way cuDNN runs it: the operands the cuDNN path
    builds (`_operands`), `masks.segment_ir` evaluated into a boolean mask next to the user's, and
    the rows the cuDNN path zeroes."""
    aux, validity = cudnn_backend._operands(dense, call.inputs)
    b, t = dense.batch, dense.q_len
    scores = jnp.zeros((b, 1, t, t), jnp.float32)
    index = [None, None, None, jnp.arange(t, dtype=jnp.int32)[None, None, None, :]]  # segment_ir reads key positions
    masked, _ = evaluate(segment_ir(dense), scores, scalars={}, arrays=aux, index=index)
    keep = jnp.isfinite(masked)
    mask = keep if call.inputs.mask is None else keep & call.inputs.mask
    plain = dataclasses.replace(dense, segment_mask=False, max_segments=0, mask_shape=(b, 1, t, t)
                                if dense.mask_shape is None else (b, dense.mask_shape[1], t, t))
    inputs = dataclasses.replace(call.inputs, mask=mask, q_segment_ids=None, kv_segment_ids=None)

    def run(q, k, v):
        out, lse = xla_attention(plain, q, k, v, inputs, call.score_mod)
        valid = validity.q
        return (jnp.where(valid[:, :, None, None], out, 0.0),
                jnp.where(valid[:, None, :], lse, -jnp.inf))

    return run


@pytest.mark.parametrize("name", FOLDED)
def test_dense_twin_matches_the_packed_call_on_xla(name):
    rng = np.random.default_rng()
    kwargs = dict(FOLDED[name])
    if name.startswith("mask"):
        kwargs["mask"] = jnp.asarray(rng.random((2, 1, 48, 48)) < 0.7)
    if name == "bias":
        kwargs["bias"] = jnp.asarray(rng.standard_normal((1, 4, 48, 48)), jnp.float32)
    (q, k, v), call = call_for(rng, **kwargs)
    dense = graph_spec(call.spec, call.score_mod)
    assert dense.segment_mask and dense.segments is None and dense.causal_alignment == "top_left"
    assert dense.max_segments == call.spec.max_segments

    twin = dense_twin_on_xla(call, dense)
    packed = lambda q, k, v: xla_attention(call.spec, q, k, v, call.inputs, call.score_mod)  # noqa: E731
    (out, lse), (out_twin, lse_twin) = packed(q, k, v), twin(q, k, v)
    np.testing.assert_allclose(out_twin, out, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(np.isinf(lse_twin), np.isinf(lse))  # the same rows attend to nothing
    finite = np.isfinite(np.asarray(lse))
    assert finite.any() and (~finite).any()  # padding rows exist, and real ones
    np.testing.assert_allclose(np.asarray(lse_twin)[finite], np.asarray(lse)[finite], rtol=1e-5, atol=1e-5)

    cotangent = jnp.asarray(rng.standard_normal(out.shape), jnp.float32)
    grads = [jax.grad(lambda q, k, v, f=f: jnp.sum(f(q, k, v)[0] * cotangent), argnums=(0, 1, 2))(q, k, v)
             for f in (packed, twin)]
    for grad, grad_twin in zip(*grads):
        np.testing.assert_allclose(grad_twin, grad, rtol=1e-4, atol=1e-5)


def folded(**kwargs):
    call = call_for(np.random.default_rng(), **kwargs)[1]
    return folds_segments(call.spec, call.score_mod)


def test_which_packed_calls_fold():
    assert folded(score_mod=mods.softcap(5.0))
    assert folded(is_causal=True, score_mod=mods.softcap(5.0), local_window_size=(4, 0))
    assert not folded(is_causal=True)  # the packed layout takes it: O(T) metadata, no bias
    assert not folded(score_mod=mods.softcap(5.0), chunk_size=8)  # chunks count from each segment's start
    assert not folded(score_mod=mods.alibi(np.ones(4, np.float32)))  # reads positions
    assert not folded(score_mod=mods.compose(mods.softcap(5.0), mods.causal()))  # reads positions


def test_cross_attention_and_position_mods_keep_declining_with_a_reason():
    rng = np.random.default_rng()
    q = jnp.asarray(rng.standard_normal((1, 32, 2, 16)), jnp.float32)
    ids = jnp.asarray(random_segment_ids(rng, 1, 32, 2))
    cross = prepare_call(q, q, q, segment_ids=(ids, ids), max_segments_per_seq=2, score_mod=mods.softcap(5.0))
    assert graph_spec(cross.spec, cross.score_mod) is cross.spec
    # The lowering declines before it touches the graph or cuDNN, so neither is needed here.
    with pytest.raises(Unsupported, match="packed cross-attention segments"):
        lower(None, cross.spec, cross.score_mod, "forward", None)
    alibi = prepare_call(q, q, q, segment_ids=ids, max_segments_per_seq=2, score_mod=mods.alibi(np.ones(2)))
    with pytest.raises(Unsupported, match="a score_mod that reads positions"):
        lower(None, alibi.spec, alibi.score_mod, "forward", None)


def test_the_cudnn_path_builds_and_keys_the_dense_graph(monkeypatch):
    rng = np.random.default_rng()
    (q, k, v), call = call_for(rng, is_causal=True, score_mod=mods.softcap(5.0), dtype=jnp.bfloat16)
    built_specs = []

    def fake_build(spec, ir, direction, cache=None):
        built_specs.append(spec)
        raise RuntimeError("stop after the spec")  # only the spec handed to the builder matters here

    monkeypatch.setattr(cudnn_backend, "build", fake_build)
    with pytest.raises(RuntimeError, match="stop after the spec"):
        cudnn_backend.attention(call.spec, q, k, v, call.inputs, call.score_mod)
    dense = graph_spec(call.spec, call.score_mod)
    assert built_specs == [dense]
    operands, _ = graph_io(dense, call.score_mod, "forward")
    assert "segment_start" in operands and "segment_end" not in operands and "bias" not in operands  # causal
    assert not any(role.startswith("ragged") for role in operands)
    # A recorded (packed) spec and the runtime's dense one name the same cached graph, so a
    # precompiled cache serves the runtime.
    env = builder.BuildEnvironment("9.19.0", "1.32.0", "sm90 test")
    assert (builder.graph_key(call.spec, call.score_mod, "forward", env)
            == builder.graph_key(dense, call.score_mod, "forward", env))


def test_the_twin_field_leaves_earlier_cache_keys_unchanged():
    _, call = call_for(np.random.default_rng(), is_causal=True, score_mod=mods.softcap(5.0))
    fields = json.loads(call.spec.canonical())
    assert "segment_mask" not in fields  # as keys made before the field existed
    assert fields == {k: v for k, v in json.loads(json.dumps(dataclasses.asdict(call.spec))).items()
                      if k != "segment_mask"}
    assert json.loads(graph_spec(call.spec, call.score_mod).canonical())["segment_mask"] is True
