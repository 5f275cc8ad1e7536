"""The numerical check of cuDNN graphs, on the CPU with a stand-in graph executor.

No GPU: the build is faked (`builder.compile_graph` returns a plan-shaped entry), the cuDNN
availability checks are forced to "available", and the graph core of the cuDNN path
(`backends.cudnn.backend._core`) is replaced by an XLA computation: the right one, or a deliberately
wrong one (a wrong scale, a wrong dq). The runtime must then run the call on XLA, check_support
must say why with the errors, and the cache must record what was measured.
"""
import dataclasses
import io
import json
import logging
import math
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import sdpagraph
from sdpagraph import ffi, logs, mods
from sdpagraph.cache import CacheMissError, GraphCache, set_default_cache
from sdpagraph import graph_store as cached_graphs
from sdpagraph.cache.disk import DiskStore
from sdpagraph.memo import BoundedMemo
from sdpagraph.deploy.numerics import verify_numerics
from sdpagraph.deploy.spec_entry import SpecEntry
from sdpagraph.graphs import builder, support as support_module
from sdpagraph.graphs.compiled import CompiledGraph
from sdpagraph.graphs.operands import graph_io, graph_spec, uid_map
from sdpagraph.numerics.reference import reference
from sdpagraph.backends.cudnn import backend as cudnn_backend
from sdpagraph.backends.cudnn import execute as cudnn_execute
from sdpagraph.numerics import check as numerics
from sdpagraph.numerics import draw as numerics_draw
from sdpagraph.numerics import gate as numerics_gate
from sdpagraph.numerics import record as numerics_record
from sdpagraph.call import prepare_call
from sdpagraph.backends.cudnn.graph_on_xla import graph_forward
from sdpagraph.backends.xla import xla_attention
from sdpagraph.backends import sinks as sinks_mod

ENV = builder.BuildEnvironment("9.19.0", "1.32.0", "sm90 fake GPU")
B, T, N, K, H = 2, 16, 4, 2, 8
KWARGS = dict(is_causal=True, score_mod=mods.softcap(20.0))


# ----------------------------------------------------------------------------- stand-ins

def fake_compile(spec, ir, direction, env):
    """A plan-shaped entry (roles and UIDs as the lowering gives them), built instantly."""
    operands, results = graph_io(graph_spec(spec, ir), ir, direction)
    names = () if ir is None else ir.scalar_names
    uids = uid_map(operands + results + tuple(f"scalar:{name}" for name in names))
    compiled = CompiledGraph(b"plan-" + direction.encode(), 1024, operands, results, uids,
                             tuple((uids[f"scalar:{name}"], ("scalar", name), "float32") for name in names),
                             direction, {"cudnn": env.cudnn_version, "frontend": env.frontend_version,
                                         "gpu": env.gpu}, 0.0)
    return compiled.blob, compiled.to_meta()


def xla_core(static, q, k, v, bias, aux, validity, sinks=None, scale=1.0):
    """What a correct graph computes (dense specs without packed segments), on XLA
    (`graph_on_xla.graph_forward`), with the sinks joined as the cuDNN path joins them: by a graph
    with sinks, else composed from its stats; `scale` multiplies the graph's attention scale."""
    if scale != 1.0:
        static = dataclasses.replace(static, graph_spec=dataclasses.replace(
            static.graph_spec, scale=static.graph_spec.scale * scale))
    sink_token = None if sinks is None else sinks.astype(jnp.float32).reshape(1, -1, 1, 1)
    out, stats = graph_forward(static, aux)(q, k, v, bias, sink_token)
    if sinks is not None and not static.graph_spec.sinks:
        out, stats = sinks_mod.apply(out, stats, sinks)
    return out, stats


@jax.custom_vjp
def _wrong_gradient(x):
    return x


_wrong_gradient.defvjp(lambda x: (x, None), lambda _, g: (g * 1.5,))


def wrong_scale_core(static, q, k, v, bias, aux, validity, sinks=None):
    return xla_core(static, q, k, v, bias, aux, validity, scale=1.5)


def wrong_dq_core(static, q, k, v, bias, aux, validity, sinks=None):
    """Right forward, dq off by 50%."""
    return xla_core(static, _wrong_gradient(q), k, v, bias, aux, validity)


@pytest.fixture
def fake_gpu(monkeypatch, tmp_path):
    """cuDNN 'available', instant fake builds, the right XLA stand-in for the graph core, a private
    default cache, and fresh process-wide memos (warnings already given, support answers)."""
    monkeypatch.setattr(builder, "build_environment", lambda: ENV)
    monkeypatch.setattr(builder, "compile_graph", fake_compile)
    monkeypatch.setattr(support_module, "environment_reason", lambda: None)
    monkeypatch.setattr(cudnn_execute, "environment_reason", lambda: None)
    monkeypatch.setattr(ffi, "unavailable_reason", lambda: None)
    monkeypatch.setattr(cudnn_backend, "_core", xla_core)
    monkeypatch.setattr(logs, "_logged", BoundedMemo(64))
    monkeypatch.delenv("SDPAGRAPH_VERIFY", raising=False)
    cache = GraphCache(str(tmp_path / "graphs"))
    set_default_cache(cache)
    yield cache
    set_default_cache(None)


def arrays(seed=0, batch=B, dtype=jnp.bfloat16):
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.standard_normal((batch, T, N, H)), dtype)
    k, v = (jnp.asarray(rng.standard_normal((batch, T, K, H)), dtype) for _ in range(2))
    return q, k, v


def call_of(q, k, v, **kwargs):
    return prepare_call(q, k, v, **kwargs)


def entry_metas(cache, spec, ir, training=True):
    """The numerics record of each graph the config needs, as this cache sees it."""
    return [record for _, record in numerics_gate.numerics_records(spec, ir, training, cache)]


def count_checks(monkeypatch):
    """Wrap the check the runtime passes to the cache layer; returns the list of its calls."""
    calls = []
    real = numerics.check_numerics

    def counting(*args, **kwargs):
        calls.append(args[:3])
        return real(*args, **kwargs)

    monkeypatch.setattr(numerics, "check_numerics", counting)
    return calls


# ----------------------------------------------------------------------------- the runtime path

def test_a_correct_graph_passes_and_its_entries_record_the_errors(fake_gpu, monkeypatch):
    calls = count_checks(monkeypatch)
    q, k, v = arrays()
    answer = sdpagraph.check_support(q, k, v, **KWARGS)
    assert answer.supported and answer.backend == "cudnn", answer.reason
    assert len(calls) == 1
    call = call_of(q, k, v, **KWARGS)
    records = entry_metas(fake_gpu, call.spec, call.score_mod)
    assert len(records) == 2 and records[0] == records[1]  # forward and backward: one check of the pair
    record = records[0]
    assert record["passed"] is True and set(record["errors"]) == {"o", "lse", "dq", "dk", "dv", "empty_rows"}
    assert all(record["errors"][name] <= record["tolerances"][name] for name in record["errors"])
    assert 0 < record["errors"]["o"] < 1e-2 and record["tolerances"]["dq"] == numerics.BACKWARD_TOLERANCE
    assert isinstance(record["seed"], int) and abs(record["checked"] - time.time()) < 600
    # On disk too: a new process reads the record and checks nothing.
    fresh = GraphCache(fake_gpu.directory)
    assert entry_metas(fresh, call.spec, call.score_mod) == records
    assert cached_graphs.check_graphs(call.spec, call.score_mod, True, fresh,
                                      verify=numerics_gate.checked).supported
    assert len(calls) == 1
    # The call runs on the (stand-in) cuDNN path, and the compiled graph ignores the extra field.
    out = sdpagraph.attention(q, k, v, **KWARGS)
    np.testing.assert_allclose(np.asarray(out, np.float32),
                               np.asarray(sdpagraph.attention(q, k, v, implementation="xla", **KWARGS), np.float32),
                               atol=2e-2)
    blob, meta = fresh.get(cached_graphs.graph_key(call.spec, call.score_mod, "forward"))
    assert CompiledGraph.from_meta(blob, meta).direction == "forward" and "numerics" in meta


def test_the_check_runs_with_the_call_s_scalars(fake_gpu, monkeypatch):
    """A jax.numpy mod's float constants are bound scalars: checked with random values instead,
    `exp(s * 0.25)` would be checked as `exp(s * 40)`, which overflows."""
    seen = []
    real = numerics.check_numerics

    def recording(*args, scalars=None, **kwargs):
        seen.append(dict(scalars))
        return real(*args, scalars=scalars, **kwargs)

    monkeypatch.setattr(numerics, "check_numerics", recording)
    q, k, v = arrays()
    kwargs = dict(is_causal=True, score_mod=lambda s, b, h, i, j: jnp.exp(s * 0.25))
    answer = sdpagraph.check_support(q, k, v, **kwargs)
    assert answer.supported, answer.reason
    assert seen == [{"captured_literal0": 0.25}]
    call = call_of(q, k, v, **kwargs)
    given = numerics_draw.host_inputs(call.spec, call.score_mod, 0, {"captured_literal0": 0.25})["scalars"]
    assert given == {"captured_literal0": 0.25} and numerics_draw.host_inputs(call.spec, call.score_mod, 0)["scalars"] != given


@pytest.mark.parametrize("core,output", [(wrong_scale_core, "o"), (wrong_dq_core, "dq")])
def test_a_wrong_graph_runs_on_xla_and_check_support_says_why(fake_gpu, monkeypatch, caplog, core, output):
    monkeypatch.setattr(cudnn_backend, "_core", core)
    q, k, v = arrays(1)
    caplog.set_level(logging.WARNING, logger="sdpagraph")
    answer = sdpagraph.check_support(q, k, v, **KWARGS)
    assert not answer.supported and answer.backend == "xla"
    assert "computed wrong values on this GPU" in answer.reason and f"{output} error " in answer.reason
    assert "the call runs on XLA" in answer.reason
    error = float(answer.reason.split(f"{output} error ")[1].split(" ")[0])
    assert error > (1e-2 if output == "o" else 2e-2)

    def loss(impl, q, k, v):
        out = sdpagraph.attention(q, k, v, implementation=impl, **KWARGS)
        return jnp.sum(out.astype(jnp.float32) * jnp.linspace(-1, 1, out.size).reshape(out.shape)), out

    grad = lambda impl: jax.jit(jax.value_and_grad(lambda *a: loss(impl, *a), argnums=(0, 1, 2), has_aux=True))  # noqa: E731
    (_, out), grads = grad(None)(q, k, v)  # traced under jit: the support query runs inside the trace
    (_, expected), expected_grads = grad("xla")(q, k, v)
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(expected, np.float32))
    for got, want in zip(grads, expected_grads):
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
    with pytest.raises(ValueError, match="computed wrong values"):
        sdpagraph.attention(q, k, v, implementation="cudnn", **KWARGS)
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING and "computed wrong values" in r.getMessage()]
    assert len(warnings) == 1, [r.getMessage() for r in warnings]

    # The failure is recorded: a new process answers the same without checking again.
    calls = count_checks(monkeypatch)
    call = call_of(q, k, v, **KWARGS)
    assert all(record["passed"] is False for record in entry_metas(fake_gpu, call.spec, call.score_mod))
    fresh = GraphCache(fake_gpu.directory)
    again = cached_graphs.check_graphs(call.spec, call.score_mod, True, fresh, verify=numerics_gate.checked)
    assert not again.supported and f"{output} error " in again.reason and calls == []


def test_a_check_that_cannot_run_leaves_the_call_on_xla(fake_gpu, caplog, monkeypatch):
    q, k, v = arrays(2)
    call = call_of(q, k, v, **KWARGS)

    def broken(*args, **kwargs):
        raise RuntimeError("out of memory\nwhile checking")

    monkeypatch.setattr(numerics, "check_numerics", broken)
    caplog.set_level(logging.WARNING, logger="sdpagraph")
    answer = cached_graphs.check_graphs(call.spec, call.score_mod, True, fake_gpu, verify=numerics_gate.checked)
    assert not answer.supported and "could not run (RuntimeError: out of memory while checking)" in answer.reason
    assert entry_metas(fake_gpu, call.spec, call.score_mod) == [None, None]  # nothing recorded
    assert sum("could not run" in r.getMessage() for r in caplog.records) == 1


def test_verify_off_skips_the_check(fake_gpu, monkeypatch):
    monkeypatch.setattr(cudnn_backend, "_core", wrong_scale_core)
    monkeypatch.setenv("SDPAGRAPH_VERIFY", "off")
    calls = count_checks(monkeypatch)
    q, k, v = arrays(3)
    assert sdpagraph.check_support(q, k, v, **KWARGS).supported
    call = call_of(q, k, v, **KWARGS)
    assert calls == [] and entry_metas(fake_gpu, call.spec, call.score_mod) == [None, None]
    monkeypatch.setenv("SDPAGRAPH_VERIFY", "sometimes")
    with pytest.raises(ValueError, match="SDPAGRAPH_VERIFY must be one of build, off"):
        sdpagraph.check_support(q, k, v, is_causal=True)


def test_strict_mode_refuses_entries_that_were_never_checked(fake_gpu, monkeypatch):
    q, k, v = arrays(4)
    monkeypatch.setenv("SDPAGRAPH_VERIFY", "off")
    assert sdpagraph.check_support(q, k, v, **KWARGS).supported  # precompiled without a check
    monkeypatch.setenv("SDPAGRAPH_VERIFY", "build")
    strict = GraphCache(fake_gpu.directory, mode="strict")
    set_default_cache(strict)
    answer = sdpagraph.check_support(q, k, v, **KWARGS)
    assert not answer.supported and "never checked numerically" in answer.reason
    assert "sdpagraph verify --numerics --specs FILE --cache-dir DIR" in answer.reason
    with pytest.raises(CacheMissError, match="never checked numerically.*sdpagraph verify --numerics"):
        sdpagraph.attention(q, k, v, **KWARGS)
    # Checked (here by a readwrite process), the same directory serves strictly.
    call = call_of(q, k, v, **KWARGS)
    assert cached_graphs.check_graphs(call.spec, call.score_mod, True, GraphCache(fake_gpu.directory),
                                      verify=numerics_gate.checked).supported
    set_default_cache(GraphCache(fake_gpu.directory, mode="strict"))
    assert sdpagraph.check_support(q, k, v, **KWARGS).supported


def test_an_entry_without_a_record_is_checked_on_its_next_load_and_updated_on_disk(fake_gpu, monkeypatch):
    q, k, v = arrays(5)
    call = call_of(q, k, v, **KWARGS)
    monkeypatch.setenv("SDPAGRAPH_VERIFY", "off")
    assert sdpagraph.check_support(q, k, v, **KWARGS).supported
    store = DiskStore(fake_gpu.directory, writable=False, lock_timeout_s=1)
    keys = [cached_graphs.graph_key(call.spec, call.score_mod, d) for d in ("forward", "backward")]
    before = {key.digest(): store.read(key.digest(), key.canonical()) for key in keys}
    assert all("numerics" not in entry.meta for entry in before.values())
    monkeypatch.setenv("SDPAGRAPH_VERIFY", "build")
    calls = count_checks(monkeypatch)
    next_process = GraphCache(fake_gpu.directory)
    assert cached_graphs.check_graphs(call.spec, call.score_mod, True, next_process,
                                      verify=numerics_gate.checked).supported
    assert len(calls) == 1 and next_process.stats()["builds"] == 0
    for key in keys:
        after = store.read(key.digest(), key.canonical())  # read back from the file
        old = before[key.digest()]
        assert after.meta["numerics"]["passed"] is True
        assert (after.key, after.key_hash, after.blob, after.versions) == (old.key, old.key_hash, old.blob,
                                                                             old.versions)
        assert {name: value for name, value in after.meta.items() if name != "numerics"} == old.meta


# ----------------------------------------------------------------------------- GraphCache.update_meta

def test_update_meta_keeps_the_key_the_blob_and_the_other_fields(tmp_path):
    cache = GraphCache(str(tmp_path))
    cache.put("some key", b"\x00blob", {"a": 1, "nested": {"b": [1, 2]}})
    _, meta = cache.get("some key")
    files = sorted(os.listdir(tmp_path / os.listdir(tmp_path)[0]))
    assert cache.update_meta("some key", {"numerics": {"passed": True, "errors": {"o": 0.003}}})
    assert cache.update_meta("some key", {"other": 2})
    for reader in (cache, GraphCache(str(tmp_path))):
        blob, updated = reader.get("some key")
        assert blob == b"\x00blob"
        assert updated == {**meta, "numerics": {"passed": True, "errors": {"o": 0.003}}, "other": 2}
    assert sorted(os.listdir(tmp_path / os.listdir(tmp_path)[0])) == files  # same file name, no temp left
    assert not cache.update_meta("another key", {"numerics": {}})
    assert cache.get("another key") is None  # nothing built or stored


def test_update_meta_in_readonly_mode_changes_memory_only(tmp_path):
    GraphCache(str(tmp_path)).put("k", b"blob", {"a": 1})
    readonly = GraphCache(str(tmp_path), mode="readonly")
    assert readonly.update_meta("k", {"numerics": {"passed": False}})
    assert readonly.get("k")[1]["numerics"] == {"passed": False}
    assert "numerics" not in GraphCache(str(tmp_path)).get("k")[1]
    memory_only = GraphCache()
    memory_only.put("k", b"blob", {})
    assert memory_only.update_meta("k", {"x": 1}) and memory_only.get("k")[1]["x"] == 1


# ----------------------------------------------------------------------------- the check itself

def xla_candidate(spec, q, k, v, inputs, ir, training=True):
    return xla_attention(spec, q, k, v, inputs, ir)


def spec_and_ir(batch=4, heads=(4, 2), length=24, dtype=jnp.bfloat16, **kwargs):
    n, kv = heads
    q = jax.ShapeDtypeStruct((batch, length, n, 8), dtype)
    k = jax.ShapeDtypeStruct((batch, length, kv, 8), dtype)
    call = prepare_call(q, k, k, kwargs.pop("bias", None), kwargs.pop("mask", None), **kwargs)
    return call.spec, call.score_mod


def test_a_slice_of_a_large_config_compares_exactly():
    """Sliced (the first, the last and a random batch row, a few query rows per row and head; zero
    cotangent elsewhere), the float32 reference agrees with a full-size run of the XLA backend to
    bf16 rounding, gradients and a broadcast bias's gradient included."""
    bias = jax.ShapeDtypeStruct((1, 4, 24, 24), jnp.bfloat16)
    mask = jax.ShapeDtypeStruct((4, 1, 24, 24), jnp.bool_)
    spec, ir = spec_and_ir(bias=bias, mask=mask, is_causal=True, score_mod=mods.compose(
        mods.softcap(10.0), mods.alibi(np.linspace(0.1, 0.4, 4).astype(np.float32))))
    chosen = numerics_draw.plan_slice(spec, slice_elements=1, rng=np.random.default_rng(7))
    assert len(chosen.rows) == numerics_draw.MAX_ROWS and {0, 3} <= set(chosen.rows) and chosen.heads == (0, 1, 2, 3)
    assert np.shape(chosen.queries) == (3, 4, 1) and chosen.queries[0][0] == (12,)  # the masked-out row
    keys = chosen.keys  # dk and dv at blocks of adjacent keys: the first, the last, one per stratum between
    assert len(keys) == numerics_draw.MIN_KEY_ROWS and (keys[0], keys[-1]) == (0, 23) and keys == tuple(sorted(set(keys)))
    result = numerics.check_numerics(spec, ir, True, candidate=xla_candidate, slice_elements=1, seed=7)
    assert result.passed, result.summary()
    assert result.slice.startswith("batch rows [0, ") and result.slice.endswith(
        "1 of 24 query rows each, dk and dv at 8 of 24 keys")
    assert set(result.errors) == {"o", "lse", "dq", "dk", "dv", "dbias", "empty_rows"}
    assert result.errors["empty_rows"] == 0.0  # the masked-out query row: 0 on both sides
    assert all(0 < result.errors[name] < 1e-2 for name in ("o", "dq", "dk", "dv", "dbias"))


# Configs the float32 reference must compute exactly as the XLA backend does (float32 inputs).
REFERENCE_CONFIGS = {
    "softcap_alibi_bias_mask": dict(bias=jax.ShapeDtypeStruct((1, 4, 24, 24), jnp.float32),
                                    mask=jax.ShapeDtypeStruct((4, 1, 24, 24), jnp.bool_), is_causal=True,
                                    score_mod=mods.compose(mods.softcap(10.0), mods.alibi(
                                        np.linspace(0.1, 0.4, 4).astype(np.float32)))),
    "padding_bottom_right_window": dict(query_seq_lengths=jax.ShapeDtypeStruct((4,), jnp.int32),
                                        key_value_seq_lengths=jax.ShapeDtypeStruct((4,), jnp.int32),
                                        is_causal=True, causal_alignment="bottom_right", local_window_size=(5, 0)),
    "segments_relative_bias": dict(segment_ids=jax.ShapeDtypeStruct((4, 24), jnp.int32), max_segments_per_seq=3,
                                   is_causal=True, score_mod=mods.relative_position_bias(
                                       np.linspace(-1, 1, 4 * 9).reshape(4, 9).astype(np.float32), 4)),
    "bias_per_row_and_query": dict(bias=jax.ShapeDtypeStruct((4, 1, 24, 24), jnp.float32)),
}


@pytest.mark.parametrize("name", REFERENCE_CONFIGS)
def test_the_float32_reference_matches_the_xla_backend(name):
    """In float32 the XLA backend's errors against the reference are float32 rounding (1e-6), on
    slices of every shape: masks, padding, segments, score_mod arrays and a broadcast bias agree."""
    spec, ir = spec_and_ir(dtype=jnp.float32, **dict(REFERENCE_CONFIGS[name]))
    for elements in (numerics_draw.SLICE_ELEMENTS, 3000):
        result = numerics.check_numerics(spec, ir, True, candidate=xla_candidate, slice_elements=elements, seed=3)
        assert (result.slice == "whole") == (elements == numerics_draw.SLICE_ELEMENTS), result.slice
        assert all(error < 2e-5 for error in result.errors.values()), (name, result.slice, result.errors)


def test_the_float32_reference_agrees_with_jax_dot_product_attention():
    """Fresh random inputs: forward and gradients (q, k, v, bias) of jax's own XLA attention, GQA,
    causal, with a bias."""
    rng = np.random.default_rng(11)
    b, t, n, kv, h = 2, 20, 4, 2, 8
    q, cotangent = rng.standard_normal((b, t, n, h)), rng.standard_normal((b, t, n, h))
    k, v = rng.standard_normal((b, t, kv, h)), rng.standard_normal((b, t, kv, h))
    bias = rng.standard_normal((1, n, t, t))
    call = prepare_call(*(jax.ShapeDtypeStruct(x.shape, jnp.float32) for x in (q, k, v, bias)), is_causal=True)
    chosen = numerics_draw.plan_slice(call.spec)
    assert chosen.whole(call.spec)
    data = {"q": q.transpose(0, 2, 1, 3), "k": k, "v": v, "cotangent": cotangent.transpose(0, 2, 1, 3),
            "bias": bias, "arrays": {}, "allowed": np.tril(np.ones((t, t), bool))[None, None],
            "q_pos": np.broadcast_to(np.arange(t), (b, n, t)), "kv_pos": np.broadcast_to(np.arange(t), (b, t))}
    ours = reference(call.spec, None, True, chosen.indices(), data, {})

    def jax_attention(q, k, v, bias):
        return jax.nn.dot_product_attention(q, k, v, bias, is_causal=True, implementation="xla")

    with jax.default_matmul_precision("highest"):
        args = [jnp.asarray(x, jnp.float32) for x in (q, k, v, bias)]
        out, pullback = jax.vjp(jax_attention, *args)
        dq, dk, dv, dbias = pullback(jnp.asarray(cotangent, jnp.float32))
    np.testing.assert_allclose(ours["o"].transpose(0, 2, 1, 3), out, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(ours["dq"].transpose(0, 2, 1, 3), dq, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(ours["dk"], dk, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(ours["dv"], dv, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(ours["dbias"][0], np.asarray(dbias)[0][..., None].squeeze(-1), rtol=1e-4, atol=1e-5)
    assert np.isfinite(ours["lse"]).all()


def test_padding_segments_and_inference_draw_valid_inputs():
    for kwargs, training in [
        (dict(query_seq_lengths=jax.ShapeDtypeStruct((4,), jnp.int32),
              key_value_seq_lengths=jax.ShapeDtypeStruct((4,), jnp.int32), is_causal=True), True),
        (dict(segment_ids=jax.ShapeDtypeStruct((4, 24), jnp.int32), max_segments_per_seq=3), True),
        (dict(is_causal=True, score_mod=mods.softcap(20.0)), False),
    ]:
        spec, ir = spec_and_ir(**kwargs)
        result = numerics.check_numerics(spec, ir, training, candidate=xla_candidate, slice_elements=1)
        assert result.passed, (kwargs, result.summary())
        assert ("dq" in result.errors) == training
    ids = numerics_draw.random_segment_ids(np.random.default_rng(0), 64, 24, 3)
    for row in ids:
        used = row[row > 0]
        assert 1 <= len(set(used)) <= 3 and (np.diff(used) >= 0).all() and (row[len(used):] == 0).all()


@jax.custom_vjp
def _wrong_head_gradient(x):
    return x


def _wrong_head_gradient_bwd(_, g):
    return (g.at[:, :, 2].multiply(1.5),)  # head (or kv head) 2 only


_wrong_head_gradient.defvjp(lambda x: (x, None), _wrong_head_gradient_bwd)


def _scaled(out, where):
    return out.at[where].multiply(1.2)


# Wrong values a slice of the first rows and heads, or of the first query rows, would not see. Config:
# B5 N8/K4 T64; the budget keeps batch rows and heads whole with 16 of 64 query rows each.
WRONG_CANDIDATES = {
    "last head": (lambda out, q, k, v: (_scaled(out, (slice(None), slice(None), -1)), q, k, v), ["o", "dq", "dk", "dv"]),
    "middle batch row": (lambda out, q, k, v: (_scaled(out, 2), q, k, v), ["o", "dq", "dk", "dv"]),
    "last quarter of query rows": (lambda out, q, k, v: (_scaled(out, (slice(None), slice(48, None))), q, k, v),
                                   ["o", "dq", "dk", "dv"]),
    "dq of one head, backward only": (lambda out, q, k, v: (out, _wrong_head_gradient(q), k, v), ["dq"]),
    "dv of one kv head, backward only": (lambda out, q, k, v: (out, q, k, _wrong_head_gradient(v)), ["dv"]),
}


@pytest.mark.parametrize("name", WRONG_CANDIDATES)
def test_wrong_values_confined_to_a_head_a_row_or_the_backward_are_caught(name):
    tamper, failing = WRONG_CANDIDATES[name]
    spec, ir = spec_and_ir(batch=5, heads=(8, 4), length=64, **KWARGS)

    def wrong(spec, q, k, v, inputs, ir, training=True):
        out, lse = xla_attention(spec, q, k, v, inputs, ir)
        _, q, k, v = tamper(out, q, k, v)  # a wrong gradient reaches q, k, v through the tampered inputs
        out, _ = xla_attention(spec, q, k, v, inputs, ir)
        return tamper(out, q, k, v)[0], lse

    for seed in range(3):
        result = numerics.check_numerics(spec, ir, True, candidate=wrong, slice_elements=5 * 8 * 16 * 64, seed=seed)
        assert result.slice.endswith("16 of 64 query rows each"), result.slice
        assert not result.passed and result.failures() == failing, (seed, result.summary())


def test_a_wrong_candidate_fails_with_the_errors_over_tolerance():
    spec, ir = spec_and_ir(batch=2, **KWARGS)

    def wrong_last_row(spec, q, k, v, inputs, ir, training=True):
        out, lse = xla_attention(spec, q, k, v, inputs, ir)
        return out.at[-1].multiply(1.2), lse  # only batch row B-1

    result = numerics.check_numerics(spec, ir, True, candidate=wrong_last_row, slice_elements=1)
    assert not result.passed and result.failures() == ["o", "dq", "dk", "dv"]
    record = result.to_record()
    assert record["passed"] is False and record["errors"]["o"] > 1e-2
    reason = numerics_record.failure_reason(record, ("forward", "backward"))
    assert reason.startswith("cuDNN's graphs for this config computed wrong values on this GPU (o error ")
    assert f"seed {result.seed}" in reason

    def nan_output(spec, q, k, v, inputs, ir, training=True):
        out, lse = xla_attention(spec, q, k, v, inputs, ir)
        return out.at[0, 0, 0, 0].set(jnp.nan), lse

    result = numerics.check_numerics(spec, ir, False, candidate=nan_output)
    assert not result.passed and result.errors["o"] == math.inf
    assert "o error inf > 0.01" in numerics_record.failure_reason(result.to_record())


def test_the_check_compiles_one_program_and_no_reference(monkeypatch):
    """XLA compiling a float32 reference was nearly all of the check's time: the reference is NumPy
    now. The one program compiled is the candidate's (inputs, the graphs, the slice)."""
    compiles = []

    def listen(event, duration, **_):
        if event == "/jax/core/compile/backend_compile_duration":
            compiles.append(duration)

    def no_xla_reference(*args, **kwargs):
        raise AssertionError("the check ran the XLA backend")

    spec, ir = spec_and_ir(**KWARGS)
    numerics.check_numerics(spec, ir, True, candidate=xla_candidate, seed=0)  # one-time eager ops (keys)
    other, other_ir = spec_and_ir(batch=3, **KWARGS)
    monkeypatch.setattr(sys.modules["sdpagraph.backends.xla"], "xla_attention", no_xla_reference)
    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        result = numerics.check_numerics(other, other_ir, True, candidate=xla_candidate, seed=1)
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)
    assert result.passed, result.summary()
    assert len(compiles) == 1, compiles
    assert set(result.timings) == {"trace_s", "compile_s", "run_s", "reference_s"}


# ----------------------------------------------------------------------------- sdpagraph verify --numerics

def test_verify_numerics_checks_every_entry_and_records_it(fake_gpu, monkeypatch):
    q, k, v = arrays(6)
    monkeypatch.setenv("SDPAGRAPH_VERIFY", "off")  # precompiled, never checked
    good = call_of(q, k, v, **KWARGS)
    assert sdpagraph.check_support(q, k, v, **KWARGS).supported
    missing = call_of(q, k, v, is_causal=True, local_window_size=(4, 0))
    entries = [SpecEntry(good.spec, good.score_mod, ("forward", "backward")),
               SpecEntry(missing.spec, missing.score_mod, ("inference",))]
    stream = io.StringIO()
    report = verify_numerics(entries, fake_gpu.directory, progress=stream)
    assert [check.status for check in report.checks] == ["passed", "missing"] and report.exit_code == 1
    lines = stream.getvalue().splitlines()
    assert len(lines) == 2 and lines[0].startswith("numerics [1/2] B2 T16") and "passed (o " in lines[0]
    text = report.text()
    assert "STATUS" in text and "DQ" in text and "1 passed, 0 failed, 0 error, 1 missing" in text
    data = json.loads(report.to_json())
    assert data["exit_code"] == 1 and data["entries"][0]["errors"]["o"] < 1e-2
    assert data["entries"][0]["recorded"] is True
    # Recorded in the directory: strict serving now runs the entry.
    assert all(r["passed"] for r in entry_metas(GraphCache(fake_gpu.directory), good.spec, good.score_mod))

    monkeypatch.setattr(cudnn_backend, "_core", wrong_dq_core)
    report = verify_numerics(entries[:1], fake_gpu.directory, progress=False)
    assert report.checks[0].status == "failed" and report.exit_code == 1
    assert "over tolerance: dq" in report.checks[0].detail and "FAILED" in report.text()
    assert all(not r["passed"] for r in entry_metas(GraphCache(fake_gpu.directory), good.spec, good.score_mod))


def test_verify_numerics_says_when_this_machine_cannot_run_graphs(tmp_path, monkeypatch):
    monkeypatch.setattr(support_module, "environment_reason", lambda: "no GPU visible to JAX")
    spec, ir = spec_and_ir(**KWARGS)
    report = verify_numerics([SpecEntry(spec, ir, ("inference",))], tmp_path, progress=False)
    assert report.exit_code == 2 and not report.ok
    assert report.text().startswith("cannot check graphs numerically on this machine: no GPU visible to JAX")
    assert json.loads(report.to_json())["unavailable"] == "no GPU visible to JAX"


@pytest.mark.parametrize("longest", [None, 1, 5, 16])
def test_drawn_segments_keep_to_the_length_hint(longest):
    """The check's random segments never exceed the call's `max_seqlen_*` hint (as the call's own
    never do), number 1, 2, ... per row, and stay within the segment count."""
    rng = np.random.default_rng()
    for _ in range(50):
        ids = numerics_draw.random_segment_ids(rng, 3, 64, 8, longest)
        for row in ids:
            labels, sizes = np.unique(row[row > 0], return_counts=True)
            assert list(labels) == list(range(1, len(labels) + 1)) and len(labels) <= 8
            assert sizes.max() <= (longest or 64)
            assert np.all(np.diff(np.flatnonzero(row)) == 1)  # segments first, then padding
