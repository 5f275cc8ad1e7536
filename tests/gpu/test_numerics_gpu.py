"""The numerical check of cuDNN graphs on the GPU: correct graphs pass and record their
errors, graphs with cuDNN's attention sinks and paged K/V graphs too; a tampered entry (another
config's plan under this config's key) is caught, and the call runs on XLA. Skipped without a GPU
(conftest.py).
"""
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import sdpagraph
from sdpagraph import ffi, mods, paged
from sdpagraph.cache import GraphCache, set_default_cache
from sdpagraph import graph_store as cached_graphs
from sdpagraph.numerics import check as numerics
from sdpagraph.numerics import gate as numerics_gate
from sdpagraph.numerics.record import NUMERICS_FIELD
from sdpagraph.call import prepare_call
from sdpagraph.spec import directions_for


@pytest.fixture
def private_cache(tmp_path):
    cache = GraphCache(str(tmp_path / "graphs"))
    set_default_cache(cache)
    yield cache
    set_default_cache(None)


@pytest.fixture(autouse=True)
def needs_executor():
    reason = ffi.unavailable_reason()
    if reason is not None:
        pytest.skip(f"no executor: {reason}")


def inputs(shape, kv_heads=None, dtype=jnp.bfloat16, seed=0):
    b, t, n, h = shape
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.standard_normal((b, t, n, h)), dtype)
    k, v = (jnp.asarray(rng.standard_normal((b, t, kv_heads or n, h)), dtype) for _ in range(2))
    return q, k, v


def records(cache, call, training=True):
    return [record for _, record in numerics_gate.numerics_records(call.spec, call.score_mod, training, cache)]


CONFIGS = {
    "causal_softcap": ((2, 256, 8, 64), 8, dict(is_causal=True, score_mod=mods.softcap(30.0)), True),
    "gqa_padding": ((3, 384, 8, 128), 2, dict(is_causal=True, query_seq_lengths=np.array([384, 100, 7], np.int32),
                                              key_value_seq_lengths=np.array([384, 300, 1], np.int32)), True),
    "bias_mask": ((2, 256, 4, 64), 4, dict(bias=np.zeros((1, 4, 256, 256), np.float32),
                                           mask=np.ones((2, 1, 256, 256), bool)), True),
    "segments_softcap": ((2, 512, 8, 64), 8, dict(is_causal=True, score_mod=mods.softcap(30.0),
                                                  segment_ids=np.repeat([[1] * 200 + [2] * 300 + [0] * 12], 2, 0),
                                                  max_segments_per_seq=3), True),
    "packed_gqa": ((2, 512, 8, 64), 2, dict(is_causal=True, segment_ids=np.repeat([[1] * 100 + [2] * 250 + [3] * 150
                                                                                + [0] * 12], 2, 0),
                                            max_segments_per_seq=4), True),
    "bottom_right_window": ((2, 256, 8, 64), 8, dict(is_causal=True, causal_alignment="bottom_right",
                                                     local_window_size=(64, 0)), True),
    "sliced_large": ((4, 2048, 8, 128), 2, dict(is_causal=True, score_mod=mods.softcap(30.0)), True),
    "inference": ((2, 256, 8, 64), 8, dict(is_causal=True, score_mod=mods.softcap(30.0)), False),
}


@pytest.mark.parametrize("name", CONFIGS)
def test_a_correct_graph_passes_and_records_its_errors(name, private_cache, report):
    shape, kv_heads, kwargs, training = CONFIGS[name]
    q, k, v = inputs(shape, kv_heads)
    support = sdpagraph.check_support(q, k, v, training=training, **kwargs)
    if not support.supported and "numerical check" not in support.reason and "computed wrong values" not in support.reason:
        pytest.skip(f"cuDNN does not run {name} here: {support.reason}")
    assert support.supported, support.reason
    call = prepare_call(q, k, v, **{key: value for key, value in kwargs.items()})
    found = records(private_cache, call, training)
    assert all(record is not None and record == found[0] for record in found)
    record = found[0]
    report(f"numerics {name:<20} {record['slice']:<45} {record['seconds']:.2f} s  "
           + " ".join(f"{key} {value:.1e}" for key, value in record["errors"].items()))
    assert record["passed"] is True
    assert "compile_s" not in record["timings"] and record["timings"]["device_mib"] > 0  # the direct run
    for output, error in record["errors"].items():
        assert error <= record["tolerances"][output], (output, error)
    if name == "sliced_large":
        assert record["slice"] != "whole"
    # Recorded on disk: a new process does not check again.
    fresh = GraphCache(private_cache.directory)
    assert records(fresh, call, training) == found


def sinks_spec():
    """cuDNN's own attention sinks (`sink_token`), causal GQA: forward and inference graphs (a call
    with sinks runs the backward graph of its spec without sinks)."""
    q, k, v = inputs((2, 256, 8, 64), 2)
    call = prepare_call(q, k, v, is_causal=True)
    return dataclasses.replace(call.spec, sinks=True)


def paged_spec(t):
    """Paged K/V, GQA N16/K2, pages of 64 in a pool of 64 (the tables name 32), up to 512 keys;
    `t` new tokens at the end of each sequence (bottom-right causal)."""
    rng = np.random.default_rng(t)
    q = jnp.asarray(rng.standard_normal((4, t, 16, 128)), jnp.bfloat16)
    pool = jnp.asarray(rng.standard_normal((64, 64, 2, 128)), jnp.bfloat16)
    table = jnp.asarray(rng.permutation(64)[:32].reshape(4, 8), jnp.int32)
    lengths = jnp.asarray(rng.integers(t, 513, 4), jnp.int32)
    return paged.prepare_paged_call(q, pool, pool, table, key_value_seq_lengths=lengths, is_causal=True,
                                    causal_alignment="bottom_right").spec


NEW_SPECS = {"sinks": sinks_spec, "paged_decode": lambda: paged_spec(1), "paged_multi_token": lambda: paged_spec(4)}


@pytest.mark.parametrize("name", NEW_SPECS)
@pytest.mark.parametrize("training", [True, False], ids=["training", "inference"])
def test_sinks_and_paged_graphs_pass_the_check_and_record_exactly_their_graphs(name, training, private_cache,
                                                                                report):
    """Through the gate: the one graph the spec has (neither a paged spec nor one with sinks has a
    backward: the training graph is the forward one with stats) is checked on the executor, and
    records o's error and, for the forward graph, the logsumexp's."""
    spec = NEW_SPECS[name]()
    built = cached_graphs.check_graphs(spec, None, training, private_cache)
    if not built.supported:
        pytest.skip(f"cuDNN does not build {name} here: {built.reason}")
    answer = cached_graphs.check_graphs(spec, None, training, private_cache, verify=numerics_gate.checked)
    [(key, record)] = numerics_gate.numerics_records(spec, None, training, private_cache)
    assert (key.direction,) == directions_for(training, spec) == (("forward",) if training else ("inference",))
    report(f"numerics {name:<18} {'training' if training else 'inference':<9} {record['slice']:<40} "
           f"{record['seconds']:.2f} s  " + " ".join(f"{key} {value:.1e}" for key, value in record["errors"].items()))
    assert answer.supported and record["passed"] is True, (answer.reason, record["errors"])
    assert set(record["errors"]) == ({"o", "lse", "empty_rows"} if training else {"o", "empty_rows"})
    assert "compile_s" not in record["timings"] and record["timings"]["device_mib"] > 0  # the direct run


def test_a_tampered_entry_is_caught_and_the_call_runs_on_xla(private_cache, caplog, report):
    """The plan built for scale s stored under the key of the same config with scale 2s: the
    check must catch it, check_support must say why, and attention must give XLA's values."""
    q, k, v = inputs((2, 320, 4, 64), seed=1)
    kwargs = dict(is_causal=True, score_mod=mods.softcap(25.0))
    scale = 0.0917
    assert sdpagraph.check_support(q, k, v, scale=scale, **kwargs).supported
    right = prepare_call(q, k, v, scale=scale, **kwargs)
    tampered = prepare_call(q, k, v, scale=2 * scale, **kwargs)
    for direction in ("forward", "backward"):
        blob, meta = private_cache.get(cached_graphs.graph_key(right.spec, right.score_mod, direction))
        meta = {name: value for name, value in meta.items() if name != NUMERICS_FIELD}
        private_cache.put(cached_graphs.graph_key(tampered.spec, tampered.score_mod, direction), blob, meta)

    support = sdpagraph.check_support(q, k, v, scale=2 * scale, **kwargs)
    report(f"numerics tampered entry: {support.reason}")
    assert not support.supported and "computed wrong values on this GPU" in support.reason
    assert "o error" in support.reason
    found = records(private_cache, tampered)
    assert all(record["passed"] is False for record in found)
    assert found[0]["errors"]["o"] > numerics.FORWARD_TOLERANCE

    def loss(impl, q):
        out = sdpagraph.attention(q, k, v, scale=2 * scale, implementation=impl, **kwargs)
        return jnp.sum(out.astype(jnp.float32) ** 2), out

    step = lambda impl: jax.jit(jax.value_and_grad(functools.partial(loss, impl), has_aux=True))  # noqa: E731
    (_, out), dq = step(None)(q)
    (_, expected), expected_dq = step("xla")(q)
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(expected, np.float32))
    np.testing.assert_array_equal(np.asarray(dq, np.float32), np.asarray(expected_dq, np.float32))
