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
from sdpagraph import graph_store as graphs_cache
from sdpagraph.graphs import builder
from sdpagraph.graphs.lowering import lower
from sdpagraph.errors import Unsupported
from sdpagraph.graphs.operands import folds_segments, graph_io, graph_spec
from sdpagraph.backends.cudnn import backend as cudnn_backend
from sdpagraph.graphs import operands as operands_module
from sdpagraph.call import prepare_call
from sdpagraph.backends.cudnn.graph_on_xla import graph_forward
from sdpagraph.backends.xla import xla_attention


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


def fake_graph_core(static, q, k, v, bias, aux, validity, sinks=None):
    """The dense twin's cuDNN graph, on XLA, as cuDNN computes it from its own operands
    (`graph_on_xla.graph_forward`): the user's mod, the spec's position masks and `masks.segment_ir`
    on the graph's bound operands, then the bias operand, in which the user's mask is a large finite
    negative value, so a row it empties is averaged over its masked keys, as cuDNN does."""
    return graph_forward(static, aux)(q, k, v, bias)


@pytest.mark.parametrize("name", FOLDED)
def test_dense_twin_matches_the_packed_call_on_xla(name, monkeypatch):
    """The cuDNN path (`backends.cudnn.backend.attention`: operands, bias, row zeroing, logsumexp) around
    a stand-in for the graph, against the packed call on the XLA backend."""
    monkeypatch.setattr(cudnn_backend, "_core", fake_graph_core)
    monkeypatch.setitem(operands_module.MASKED_BIAS, "float32", -1e30)
    seed = int(np.random.default_rng().integers(2**31))
    rng = np.random.default_rng(seed)
    kwargs = dict(FOLDED[name])
    if name.startswith("mask"):
        kwargs["mask"] = jnp.asarray(rng.random((2, 1, 48, 48)) < 0.7)
    if name == "bias":
        kwargs["bias"] = jnp.asarray(rng.standard_normal((1, 4, 48, 48)), jnp.float32)
    if name == "dropped_segments":
        monkeypatch.setenv("SDPAGRAPH_CHECK_SEGMENTS", "0")  # dropping them is what this case tests
    (q, k, v), call = call_for(rng, **kwargs)
    dense = graph_spec(call.spec, call.score_mod)
    assert dense.segment_mask and dense.segments is None and dense.causal_alignment == "top_left"

    packed = lambda q, k, v: xla_attention(call.spec, q, k, v, call.inputs, call.score_mod)  # noqa: E731
    twin = lambda q, k, v: cudnn_backend.attention(call.spec, q, k, v, call.inputs, call.score_mod)  # noqa: E731
    (out, lse), (out_twin, lse_twin) = packed(q, k, v), twin(q, k, v)
    np.testing.assert_allclose(out_twin, out, rtol=1e-5, atol=1e-5, err_msg=f"seed {seed}")
    np.testing.assert_array_equal(np.isinf(lse_twin), np.isinf(lse), err_msg=f"seed {seed}")  # same empty rows
    finite = np.isfinite(np.asarray(lse))
    assert finite.any() and (~finite).any()  # padding rows exist, and real ones
    np.testing.assert_allclose(np.asarray(lse_twin)[finite], np.asarray(lse)[finite], rtol=1e-5, atol=1e-5)

    cotangent = jnp.asarray(rng.standard_normal(out.shape), jnp.float32)
    grads = [jax.grad(lambda q, k, v, f=f: jnp.sum(f(q, k, v)[0] * cotangent), argnums=(0, 1, 2))(q, k, v)
             for f in (packed, twin)]
    for grad, grad_twin in zip(*grads):
        np.testing.assert_allclose(grad_twin, grad, rtol=1e-4, atol=1e-5, err_msg=f"seed {seed}")


def folded(**kwargs):
    call = call_for(np.random.default_rng(), **kwargs)[1]
    return folds_segments(call.spec, call.score_mod)


def test_which_packed_calls_fold(monkeypatch):
    monkeypatch.setenv("SDPAGRAPH_CHECK_SEGMENTS", "0")  # max_segments=2 below drops segments
    assert folded(score_mod=mods.softcap(5.0))
    assert folded(is_causal=True, score_mod=mods.softcap(5.0), local_window_size=(4, 0))
    assert not folded(is_causal=True)  # the packed layout takes it: O(T) metadata, no bias
    plain = call_for(np.random.default_rng(), is_causal=True)[1].spec
    assert folds_segments(dataclasses.replace(plain, head_dim_v=8), None)  # THD shares one offset per side
    # One graph serves every max_segments: the JAX side applies it to the bounds.
    twins = [graph_spec(call.spec, call.score_mod) for call in
             (call_for(np.random.default_rng(), score_mod=mods.softcap(5.0), max_segments=m)[1] for m in (2, 4))]
    assert twins[0] == twins[1] and twins[0].max_segments == 0
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

    def fake_compile(spec, ir, direction, env):
        built_specs.append(graph_spec(spec, ir))  # what compile_graph builds
        raise RuntimeError("stop after the spec")  # only the spec handed to the builder matters here

    env = builder.BuildEnvironment("9.19.0", "1.32.0", "sm90 test")
    monkeypatch.setattr(builder, "compile_graph", fake_compile)
    monkeypatch.setattr(builder, "build_environment", lambda: env)
    with pytest.raises(RuntimeError, match="stop after the spec"):
        cudnn_backend.attention(call.spec, q, k, v, call.inputs, call.score_mod)
    dense = graph_spec(call.spec, call.score_mod)
    assert built_specs == [dense]
    operands, _ = graph_io(dense, call.score_mod, "forward")
    assert "segment_start" in operands and "segment_end" not in operands and "bias" not in operands  # causal
    assert not any(role.startswith("ragged") for role in operands)
    # A recorded (packed) spec and the runtime's dense one name the same cached graph, so a
    # precompiled cache serves the runtime.
    assert (graphs_cache.graph_key(call.spec, call.score_mod, "forward", env)
            == graphs_cache.graph_key(dense, call.score_mod, "forward", env))


def test_the_twin_field_leaves_earlier_cache_keys_unchanged():
    _, call = call_for(np.random.default_rng(), is_causal=True, score_mod=mods.softcap(5.0))
    fields = json.loads(call.spec.canonical())
    later = ("segment_mask", "max_seqlen_q", "max_seqlen_kv", "sinks", "paged", "deterministic",
             "dropout")  # fields added after keys were first made
    assert not set(later) & set(fields)  # as keys made before those fields existed
    assert fields == {k: v for k, v in json.loads(json.dumps(dataclasses.asdict(call.spec))).items()
                      if k not in later}
    assert json.loads(graph_spec(call.spec, call.score_mod).canonical())["segment_mask"] is True
    assert json.loads(dataclasses.replace(call.spec, sinks=True).canonical())["sinks"] is True
