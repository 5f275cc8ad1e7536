"""SPMD: `attention` under jax.jit with inputs sharded over batch and heads, on 8 CPU devices.

The rest of the suite runs in one process with one CPU device, so the first test here runs this
file again in a subprocess with `--xla_force_host_platform_device_count=8`, where the other tests
run (and that first one skips).

Both backends run: the XLA backend as it is, and the cuDNN path's own code (operands, custom_vjp,
the partitioning in `backends.cudnn.sharding`) around an XLA stand-in for the FFI executor
(`execute.call_executor`) and for the graph builder (`execute.cached_graph`). The stand-in computes
what the graph computes from the graph's own operands, on the shapes it is given (one device's
shard when partitioned): packed sequences from the ragged offsets, padding from the sequence
lengths, masks and folded padding from the bias operand, segment bounds, score_mod arrays.
"""
import contextlib
import json
import logging
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import sdpagraph
from sdpagraph import logs, mods
from sdpagraph.cache import GraphCache
from sdpagraph.graph_store import CachedGraph, graph_key
from sdpagraph.deploy.specfile import load_specs
from sdpagraph.graphs.builder import BuildEnvironment
from sdpagraph.graphs.compiled import CompiledGraph
from sdpagraph.graphs.operands import graph_io, graph_spec, uid_map
from sdpagraph.graphs.support import Support
from sdpagraph.memo import BoundedMemo
from sdpagraph.backends.cudnn import execute as cudnn_execute
from sdpagraph.graphs import operands as operands_module
from sdpagraph.numerics import gate as numerics_gate
from sdpagraph.config import PARTITION
from sdpagraph.backends.cudnn.graph_on_xla import run_on_xla
from sdpagraph.meshes import explicit_axes
from tests.devices import AXIS_TYPES, has_cpu_devices, make_mesh, rerun_with_cpu_devices

DEVICES = 8
HERE_WITH_DEVICES = has_cpu_devices(DEVICES)
needs_devices = pytest.mark.skipif(not HERE_WITH_DEVICES, reason=f"runs in the {DEVICES}-device subprocess")
COLLECTIVE_GATHERS = re.compile(r"\b(all-gather(?:-start)?|all-to-all)\(")


def test_in_a_process_with_eight_cpu_devices():
    if HERE_WITH_DEVICES:
        pytest.skip("this process has the devices: the tests below run here")
    rerun_with_cpu_devices(__file__, DEVICES)


# ----------------------------------------------------------------------------- the stand-in graph

def fake_executor(static, graph, operands, results):
    """The graph's computation on XLA (`backends.cudnn.graph_on_xla`, what a shard whose graphs failed
    their check runs), asked for on the operands' shapes."""
    q, k = operands["q"], operands["k"]
    assert not explicit_axes(q), "the executor runs on Auto axes, as the FFI call needs"
    wanted, results = results, cudnn_execute.unstacked(results)  # dk and dv stacked where the call asks
    for role in ("o", "dq", "dk"):  # the results must be asked for on the operands' shapes
        if role in results:
            assert results[role].shape[:3] == (q if role != "dk" else k).shape[:3], (role, results[role], q.shape)
    return cudnn_execute.restacked(run_on_xla(static, operands, results), wanted)


@pytest.fixture
def cudnn_on_cpu(monkeypatch, tmp_path):
    """The cuDNN path, chosen and run with the stand-ins; yields the (spec, ir, direction) built."""
    built = []
    cache = GraphCache(str(tmp_path / "graphs"))
    env = BuildEnvironment("9.19.0", "1.32.0", "sm90 fake")

    def fake_cached_graph(spec, ir, direction, cache_arg=None):
        built.append((spec, ir, direction))
        operands, results = graph_io(graph_spec(spec, ir), ir, direction)
        roles = operands + results + tuple(f"scalar:{n}" for n in (ir.scalar_names if ir else ()))
        uids = uid_map(roles)
        compiled = CompiledGraph(b"blob", 0, operands, results, uids, (), direction, {}, 0.0)
        key = graph_key(spec, ir, direction, env)
        return CachedGraph(key, compiled, cache.entry_path(key))

    monkeypatch.setattr(cudnn_execute, "support", lambda spec, ir, training, verify=None: Support(True, "cudnn", "stand-in"))
    monkeypatch.setattr(cudnn_execute, "cached_graph", fake_cached_graph)
    monkeypatch.setattr(cudnn_execute.ffi, "register_graph", lambda digest, blob: None)
    monkeypatch.setattr(cudnn_execute, "call_executor", fake_executor)
    monkeypatch.setitem(operands_module.MASKED_BIAS, "float32", -1e30)
    monkeypatch.delenv(PARTITION.name, raising=False)
    yield built, env


# ----------------------------------------------------------------------------- cases

B, T, N, H = 4, 16, 4, 8


def mesh(axis_type="auto"):
    return make_mesh((4, 2), ("data", "model"), axis_type)


def random_ids(rng, batch, length, segments):
    ids = np.zeros((batch, length), np.int32)
    for row in ids:
        cuts = np.sort(rng.choice(np.arange(2, length - 2), segments - 1, replace=False))
        bounds = [0, *cuts, length - int(rng.integers(0, 3))]
        for m in range(segments):
            row[bounds[m]:bounds[m + 1]] = m + 1
    return ids


def case(name, rng):
    """(kwargs, K, S, bias or None, differentiate the bias)"""
    lengths = lambda n: np.asarray(rng.integers(n // 2, n + 1, B), np.int32)  # noqa: E731
    K, S, bias = 4, T, None
    kwargs = {
        "causal": dict(is_causal=True),
        "gqa_window": dict(local_window_size=(5, 2)),
        "mqa_softcap": dict(is_causal=True, score_mod=mods.softcap(5.0)),
        "bias_per_head_softcap": dict(score_mod=mods.softcap(5.0)),
        "bias_per_row": dict(is_causal=True),
        "padding": dict(is_causal=True, query_seq_lengths=lengths(T), key_value_seq_lengths=lengths(T)),
        "padding_softcap": dict(score_mod=mods.softcap(5.0), query_seq_lengths=lengths(T),
                                key_value_seq_lengths=lengths(T)),
        "mask": dict(mask=rng.random((B, 1, T, T)) < 0.8),
        "alibi_heads": dict(is_causal=True, score_mod=mods.alibi(rng.random(N).astype(np.float32))),
        "packed": dict(is_causal=True, segment_ids=random_ids(rng, B, T, 3), max_segments_per_seq=3),
        "packed_cross_bottom_right": dict(is_causal=True, causal_alignment="bottom_right", max_segments_per_seq=2,
                                          segment_ids=(random_ids(rng, B, T, 2), random_ids(rng, B, 24, 2))),
        "packed_twin_softcap": dict(is_causal=True, score_mod=mods.softcap(5.0),
                                    segment_ids=random_ids(rng, B, T, 3), max_segments_per_seq=3),
        "row_array_mod": dict(score_mod=lambda graph, score, tensors: score + tensors["w"],
                              score_mod_tensors={"w": rng.standard_normal((B, 1, T, T)).astype(np.float32)}),
    }[name]
    if name.startswith("gqa"):
        K = 2
    if name.startswith("mqa"):
        K = 1
    if name == "packed_cross_bottom_right":
        S = 24
    if name == "bias_per_head_softcap":
        bias = rng.standard_normal((1, N, T, S)).astype(np.float32)  # broadcast over the split batch
    if name == "bias_per_row":
        bias = rng.standard_normal((B, 1, T, S)).astype(np.float32)  # broadcast over the split heads
    return kwargs, K, S, bias


CASES = ["causal", "gqa_window", "mqa_softcap", "bias_per_head_softcap", "bias_per_row", "padding", "padding_softcap",
         "mask", "alibi_heads", "packed", "packed_cross_bottom_right", "packed_twin_softcap", "row_array_mod"]


def place(x, m, spec):
    return None if x is None else jax.device_put(jnp.asarray(x), NamedSharding(m, spec))


def sharded_args(m, q, k, v, bias, kwargs, qkv_spec=P("data", None, "model")):
    """Every array sharded as a user would: batch dims over 'data', head dims over 'model'."""
    kwargs = dict(kwargs)
    for name in ("query_seq_lengths", "key_value_seq_lengths"):
        if name in kwargs:
            kwargs[name] = place(kwargs[name], m, P("data"))
    if "segment_ids" in kwargs:
        ids = kwargs["segment_ids"]
        kwargs["segment_ids"] = (tuple(place(x, m, P("data")) for x in ids) if isinstance(ids, tuple)
                                 else place(ids, m, P("data")))
    if "mask" in kwargs:
        kwargs["mask"] = place(kwargs["mask"], m, P())  # replicated: the partitioner slices it
    bias_spec = None if bias is None else P("data" if bias.shape[0] > 1 else None,
                                            "model" if bias.shape[1] > 1 else None)
    kv_spec = qkv_spec if k.shape[2] > 1 else P(*qkv_spec[:2])  # MQA: the one key/value head stays whole
    return (place(q, m, qkv_spec), place(k, m, kv_spec), place(v, m, kv_spec), place(bias, m, bias_spec)), kwargs


def qkv_bias(rng, K, S, bias):
    q = rng.standard_normal((B, T, N, H)).astype(np.float32)
    k, v = (rng.standard_normal((B, S, K, H)).astype(np.float32) for _ in range(2))
    return q, k, v, bias


def step(impl, kwargs, with_bias):
    """Output, logsumexp and the gradients of q, k, v (and bias) of a weighted sum of the output."""
    def loss(q, k, v, bias, cotangent):
        out, lse = sdpagraph.attention(q, k, v, bias, return_residual=True, implementation=impl, **kwargs)
        return jnp.sum(out * cotangent), (out, lse)

    argnums = (0, 1, 2, 3) if with_bias else (0, 1, 2)
    return jax.value_and_grad(loss, argnums=argnums, has_aux=True)


def gathers(compiled_text):
    return COLLECTIVE_GATHERS.findall(compiled_text)


def assert_same(ours, reference, tol=2e-5):
    """Every leaf within `tol`; the loss (the one scalar) within 10 `tol`: a sum of thousands of products,
    whose float32 rounding follows the summation order, which a sharded run changes (4e-5 seen)."""
    for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(reference)):
        bound = tol * 10 if np.ndim(a) == 0 else tol
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=bound, atol=bound)


def run_case(name, impl, rng, qkv_spec=P("data", None, "model"), axis_type="auto"):
    """(the sharded step's value and gradients, the unsharded one's, its compiled HLO, sharded q).
    Explicit axes run under `jax.set_mesh`, as sharding in types is used."""
    kwargs, K, S, bias = case(name, rng)
    q, k, v, bias = qkv_bias(rng, K, S, bias)
    cotangent = rng.standard_normal((B, T, N, H)).astype(np.float32)
    with_bias = bias is not None
    reference = step("xla", kwargs, with_bias)(q, k, v, bias, cotangent)  # one device, unsharded
    m = mesh(axis_type)
    (qs, ks, vs, bs), kw = sharded_args(m, q, k, v, bias, kwargs, qkv_spec)
    cot = place(cotangent, m, qkv_spec)
    with jax.set_mesh(m) if axis_type == "explicit" else contextlib.nullcontext():
        compiled = jax.jit(step(impl, kw, with_bias)).lower(qs, ks, vs, bs, cot).compile()
        result = compiled(qs, ks, vs, bs, cot)
    if axis_type == "explicit":  # the gradients have their operands' sharding types
        for grad, x in zip(result[1], (qs, ks, vs, bs)):
            assert grad.sharding.is_equivalent_to(x.sharding, x.ndim), (grad.sharding, x.sharding)
    return result, reference, compiled.as_text(), qs


@needs_devices
@pytest.mark.parametrize("name", ["gqa_window", "bias_per_head_softcap", "packed"])
@pytest.mark.parametrize("axis_type", AXIS_TYPES)
def test_xla_backend_sharded_equals_one_device(name, axis_type):
    (value, grads), reference, _, qs = run_case(name, "xla", np.random.default_rng(0), axis_type=axis_type)
    assert_same((value, grads), reference)
    assert value[1][0].sharding.is_equivalent_to(qs.sharding, 4)


@needs_devices
@pytest.mark.parametrize("name", CASES)
@pytest.mark.parametrize("axis_type", AXIS_TYPES)
def test_cudnn_path_runs_per_device_on_local_shapes(name, axis_type, cudnn_on_cpu):
    built, _ = cudnn_on_cpu
    seed = int(np.random.default_rng().integers(2**31))
    (value, grads), reference, hlo, qs = run_case(name, "cudnn", np.random.default_rng(seed), axis_type=axis_type)
    assert_same((value, grads), reference)
    assert gathers(hlo) == [], f"seed {seed}"  # no all-gather / all-to-all anywhere in the step
    out = value[1][0]
    assert out.sharding.is_equivalent_to(qs.sharding, 4), out.sharding  # the output stays sharded like q
    kv_split = 1 if name.startswith("mqa") else 2
    local = {(s.batch, s.num_heads, s.num_kv_heads, d) for s, _, d in built}
    k = {"gqa": 2, "mqa": 1}.get(name.split("_")[0], N)
    assert (B // 4, N // 2, k // kv_split, "forward") in local and (B // 4, N // 2, k // kv_split, "backward") in local


@needs_devices
def test_bias_and_array_shapes_of_the_local_graph(cudnn_on_cpu):
    built, _ = cudnn_on_cpu
    run_case("bias_per_head_softcap", "cudnn", np.random.default_rng(1))
    assert {s.bias_shape for s, _, _ in built if s.batch == 1} == {(1, N // 2, T, T)}
    built.clear()
    run_case("alibi_heads", "cudnn", np.random.default_rng(1))
    local = [ir for s, ir, _ in built if s.batch == 1]
    shapes = {dict(n.attrs)["shape"] for ir in local for n in ir.nodes if n.op == "array"}
    assert local and shapes == {(1, N // 2, 1, 1)}


@needs_devices
@pytest.mark.parametrize("axis_type", AXIS_TYPES)
def test_inference_graph_and_shard_map(axis_type, cudnn_on_cpu):
    built, _ = cudnn_on_cpu
    rng = np.random.default_rng(2)
    q, k, v, _ = qkv_bias(rng, 2, T, None)
    m = mesh(axis_type)
    reference = sdpagraph.attention(q, k, v, is_causal=True, implementation="xla")
    serve = jax.jit(lambda q, k, v: sdpagraph.attention(q, k, v, is_causal=True, training=False))
    qs, ks, vs = (place(x, m, P("data", None, "model")) for x in (q, k, v))
    assert_same(serve(qs, ks, vs), reference)
    assert any(s.batch == 1 and d == "inference" for s, _, d in built)
    assert gathers(serve.lower(qs, ks, vs).compile().as_text()) == []

    # Inside a user's shard_map over every axis the arrays are already local.
    built.clear()
    spec = P("data", None, "model")
    local_fn = jax.shard_map(lambda q, k, v: sdpagraph.attention(q, k, v, is_causal=True), mesh=m,
                             in_specs=(spec, spec, spec), out_specs=spec)
    assert_same(jax.jit(local_fn)(qs, ks, vs), reference)
    assert {(s.batch, s.num_heads, s.num_kv_heads) for s, _, _ in built} == {(1, N // 2, 1)}
    grads = jax.jit(jax.grad(lambda q, k, v: jnp.sum(local_fn(q, k, v) ** 2), argnums=(0, 1, 2)))(qs, ks, vs)
    ref_grads = jax.grad(lambda q, k, v: jnp.sum(sdpagraph.attention(q, k, v, is_causal=True, implementation="xla")
                                                 ** 2), argnums=(0, 1, 2))(q, k, v)
    assert_same(grads, ref_grads)


@needs_devices
@pytest.mark.parametrize("axis_type", AXIS_TYPES)
def test_eager_call_on_sharded_arrays_stays_sharded(axis_type, cudnn_on_cpu):
    rng = np.random.default_rng(3)
    q, k, v, _ = qkv_bias(rng, 4, T, None)
    m = mesh(axis_type)  # no jax.set_mesh: the arrays' shardings say everything
    qs, ks, vs = (place(x, m, P("data", None, "model")) for x in (q, k, v))
    out = sdpagraph.attention(qs, ks, vs, is_causal=True)
    assert_same(out, sdpagraph.attention(q, k, v, is_causal=True, implementation="xla"))
    assert out.sharding.is_equivalent_to(qs.sharding, 4)


@needs_devices
def test_vmap_over_the_cudnn_path(cudnn_on_cpu):
    rng = np.random.default_rng(4)
    q, k, v = (rng.standard_normal((3, 2, T, N, H)).astype(np.float32) for _ in range(3))
    def f(impl):
        return jax.vmap(lambda q, k, v: sdpagraph.attention(q, k, v, is_causal=True, implementation=impl))

    assert_same(jax.jit(f("cudnn"))(q, k, v), f("xla")(q, k, v))


@needs_devices
@pytest.mark.parametrize("axis_type", AXIS_TYPES)
def test_sequence_sharding_is_gathered_with_one_warning(axis_type, cudnn_on_cpu, caplog, monkeypatch):
    monkeypatch.setattr(logs, "_logged", BoundedMemo(64))  # logged once per process: once per axis type here
    caplog.set_level(logging.WARNING, logger="sdpagraph")
    (value, grads), reference, hlo, qs = run_case("causal", "cudnn", np.random.default_rng(5),
                                                  qkv_spec=P(None, "data", "model"), axis_type=axis_type)
    assert_same((value, grads), reference)
    assert value[1][0].sharding.is_equivalent_to(qs.sharding, 4) or axis_type == "auto"  # typed: q's sharding
    assert gathers(hlo)  # the sequence axis is gathered: that is what the warning is about
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, warnings
    assert "q dim 1 (query sequence) over ('data',)" in warnings[0] and "context_parallel_axis" in warnings[0]
    caplog.clear()
    run_case("causal", "cudnn", np.random.default_rng(6), qkv_spec=P(None, "data", "model"), axis_type=axis_type)
    assert not [r for r in caplog.records if r.levelno == logging.WARNING]  # once per process


@needs_devices
@pytest.mark.parametrize("axis_type", AXIS_TYPES)
def test_heads_that_do_not_split_over_kv_heads_are_gathered_with_a_warning(axis_type, cudnn_on_cpu, caplog,
                                                                          monkeypatch):
    monkeypatch.setattr(logs, "_logged", BoundedMemo(64))  # logged once per process: once per axis type here
    caplog.set_level(logging.WARNING, logger="sdpagraph")
    rng = np.random.default_rng(7)
    q = rng.standard_normal((B, T, 8, H)).astype(np.float32)
    k, v = (rng.standard_normal((B, T, 2, H)).astype(np.float32) for _ in range(2))
    m = make_mesh((2, 4), ("data", "model"), axis_type)  # 4 head shards, K = 2
    qs = place(q, m, P("data", None, "model"))
    ks, vs = (place(x, m, P("data")) for x in (k, v))
    out = jax.jit(lambda q, k, v: sdpagraph.attention(q, k, v, is_causal=True))(qs, ks, vs)
    assert_same(out, sdpagraph.attention(q, k, v, is_causal=True, implementation="xla"))
    assert out.sharding.is_equivalent_to(qs.sharding, 4)
    assert any("do not split" in r.getMessage() for r in caplog.records)


@needs_devices
def test_recorded_specs_cover_the_graphs_a_sharded_run_builds(cudnn_on_cpu, tmp_path):
    built, env = cudnn_on_cpu
    path = tmp_path / "specs.json"
    with sdpagraph.record(str(path)):
        run_case("alibi_heads", "cudnn", np.random.default_rng(8))
        run_case("packed", "cudnn", np.random.default_rng(8))
    entries = load_specs(path)  # a valid spec file: local specs with their local score_mod IR
    recorded = {graph_key(e.spec, e.score_mod, d, env) for e in entries for d in e.directions}
    used = {graph_key(s, ir, d, env) for s, ir, d in built}
    assert used <= recorded, "precompiling the recorded file must build every graph the run used"
    assert {e.spec.batch for e in entries} == {B, B // 4}  # the traced (global) and per-device specs
    assert all(json.loads(path.read_text())["entries"])


@needs_devices
@pytest.mark.parametrize("axis_type", AXIS_TYPES)
def test_gspmd_partitioner_without_shardy(axis_type, cudnn_on_cpu):
    previous = jax.config.jax_use_shardy_partitioner
    jax.config.update("jax_use_shardy_partitioner", False)
    try:
        (value, grads), reference, hlo, qs = run_case("bias_per_row", "cudnn", np.random.default_rng(9),
                                                      axis_type=axis_type)
    finally:
        jax.config.update("jax_use_shardy_partitioner", previous)
    assert_same((value, grads), reference)
    assert gathers(hlo) == []
    assert value[1][0].sharding.is_equivalent_to(qs.sharding, 4)


@needs_devices
def test_partitioning_switched_off_is_one_call_over_global_shapes(cudnn_on_cpu, monkeypatch):
    """SDPAGRAPH_PARTITION=0: the behaviour before partitioning (bench/multi_gpu.py's 'before' row). On a GPU
    XLA gathers every operand of that opaque FFI call; here the stand-in is plain XLA ops, so only the
    absent partitioning op and the global-only graphs show it."""
    built, _ = cudnn_on_cpu
    rng = np.random.default_rng(10)
    q, k, v, _ = qkv_bias(rng, 4, T, None)
    qs, ks, vs = (place(x, mesh(), P("data", None, "model")) for x in (q, k, v))
    f = jax.jit(lambda q, k, v: sdpagraph.attention(q, k, v, is_causal=True))
    assert "CustomSPMDPartitioning" in f.lower(qs, ks, vs).as_text()
    monkeypatch.setenv(PARTITION.name, "0")
    built.clear()
    g = jax.jit(lambda q, k, v: sdpagraph.attention(q, k, v, is_causal=True))
    assert "CustomSPMDPartitioning" not in g.lower(qs, ks, vs).as_text()
    assert_same(g(qs, ks, vs), sdpagraph.attention(q, k, v, is_causal=True, implementation="xla"))
    assert {s.batch for s, _, _ in built} == {B}


@needs_devices
def test_strict_mode_miss_of_a_per_device_graph_says_how_to_fix_it(cudnn_on_cpu, monkeypatch):
    from sdpagraph.cache import CacheMissError

    fake = cudnn_execute.cached_graph

    def strict(spec, ir, direction, cache_arg=None):
        if spec.batch < B:  # the global graphs are there; the per-device ones were never precompiled
            raise CacheMissError("no cached graph for this spec in the cache directory.")
        return fake(spec, ir, direction)

    monkeypatch.setattr(cudnn_execute, "cached_graph", strict)
    with pytest.raises(Exception, match="per-device graph of a sharded call.*SDPAGRAPH_RECORD"):
        run_case("causal", "cudnn", np.random.default_rng(11))


@needs_devices
@pytest.mark.parametrize("name", ["causal", "packed", "bias_per_head_softcap"])
def test_per_device_graphs_that_fail_their_check_run_on_xla(name, cudnn_on_cpu, monkeypatch):
    """The per-device graphs are checked at XLA compile time with the check dispatch used; when the
    check fails there, each shard runs the graphs' computation on XLA: the executor never runs
    them, and the step still gives XLA's values and gradients."""
    asked, executed = [], []
    stand_in = cudnn_execute.call_executor

    def support(spec, ir, training, verify=None):
        asked.append((spec.batch, verify))
        if spec.batch < B and verify is not None:  # the local graphs computed wrong values
            return Support(False, "xla", "cuDNN's graphs for this config computed wrong values")
        return Support(True, "cudnn", "stand-in")

    def executor(static, graph, operands, results):
        executed.append(static.spec.batch)
        return stand_in(static, graph, operands, results)

    monkeypatch.setattr(cudnn_execute, "support", support)
    monkeypatch.setattr(cudnn_execute, "call_executor", executor)
    (value, grads), reference, _, _ = run_case(name, "cudnn", np.random.default_rng(5))
    assert_same((value, grads), reference)
    # No per-device graph reached the executor. (The global call is traced too, as the op's body that
    # custom_partitioning replaces by the per-device function: it never runs.)
    assert executed and all(batch == B for batch in executed)
    local = [verify for batch, verify in asked if batch < B]
    assert local and all(verify.func is numerics_gate.checked for verify in local)  # with the call's check


@needs_devices
def test_per_device_graphs_that_pass_their_check_run_on_the_executor(cudnn_on_cpu, monkeypatch):
    executed = []
    stand_in = cudnn_execute.call_executor

    def executor(static, graph, operands, results):
        executed.append(static.spec.batch)
        return stand_in(static, graph, operands, results)

    monkeypatch.setattr(cudnn_execute, "call_executor", executor)
    (value, grads), reference, _, _ = run_case("causal", "cudnn", np.random.default_rng(6))
    assert_same((value, grads), reference)
    assert B // 4 in executed  # the per-device graphs reached the executor


@needs_devices
@pytest.mark.parametrize("guess", [None, 1e30])
def test_fp8_training_split_over_the_query_heads_of_one_kv_head(cudnn_on_cpu, monkeypatch, guess):
    """MQA split over query heads: each device's dk, dv are partial sums, added in float32 and the
    amaxes the rerun decision reads are the largest over the devices (a forced rerun too)."""
    from sdpagraph import fp8
    from sdpagraph.backends.cudnn import fp8 as cudnn_fp8
    if guess is not None:
        monkeypatch.setattr(cudnn_fp8, "_gradient_scales",
                            lambda *args: {name: jnp.float32(guess) for name in ("dP", "dQ", "dK", "dV")})
    rng = np.random.default_rng(0)
    scale = np.array([1, 1, 8, 8])[None, None, :, None]  # shards of unlike magnitudes
    q = jnp.asarray(rng.standard_normal((2, 32, 4, 128)) * scale, jnp.bfloat16)
    k, v = (jnp.asarray(rng.standard_normal((2, 32, 1, 128)), jnp.bfloat16) for _ in range(2))
    d_o = jnp.asarray(rng.standard_normal((2, 32, 4, 128)) * scale, jnp.bfloat16)

    def grads(q, k, v, d_o):
        f = lambda q, k, v: fp8.quantized_attention(q, k, v, training=True, implementation="cudnn")  # noqa: E731
        return jax.vjp(f, q, k, v)[1](d_o)

    whole = jax.jit(grads)(q, k, v, d_o)
    mesh = make_mesh((2,), ("model",), "auto")
    heads, kv = NamedSharding(mesh, P(None, None, "model", None)), NamedSharding(mesh, P())
    split = jax.jit(grads)(*(jax.device_put(x, s) for x, s in ((q, heads), (k, kv), (v, kv), (d_o, heads))))
    for a, b in zip(whole, split):  # each within e5m2's rounding (~10%) of the truth: 0.15 of each other
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        assert np.all(np.isfinite(b)) and np.linalg.norm(a - b) <= 0.15 * np.linalg.norm(a)


@needs_devices
def test_per_device_graphs_are_prepared_on_the_mesh_devices(cudnn_on_cpu, monkeypatch):
    """The per-device graphs, built while XLA partitions the call, are handed to the background
    preparation with the mesh's devices (`sharding.shard_devices`); the global trace's with none (the
    default device)."""
    from sdpagraph.backends.cudnn import sharding

    seen = []
    monkeypatch.setattr(cudnn_execute, "_prepare", lambda digest: seen.append(sharding.shard_devices()))
    run_case("causal", "cudnn", np.random.default_rng(2))
    assert None in seen
    meshes = [devices for devices in seen if devices is not None]
    assert meshes and all(set(devices) == set(jax.devices()) for devices in meshes)
    assert sharding.shard_devices() is None  # reset once the lowering is done
    assert cudnn_execute.preparation_devices() == (jax.devices()[0],)  # outside any partitioning


@needs_devices
def test_graphs_traced_inside_a_full_shard_map_are_prepared_on_every_local_device(cudnn_on_cpu, monkeypatch):
    """Inside a `shard_map` manual over every mesh axis each device runs the graph on its own shard:
    it is prepared on all of them, not on the default device alone."""
    seen = []
    monkeypatch.setattr(cudnn_execute, "_prepare", lambda digest: seen.append(cudnn_execute.preparation_devices()))
    m = mesh()
    rng = np.random.default_rng()
    q, k, v = (jnp.asarray(rng.standard_normal((B, T, N, H)), jnp.float32) for _ in range(3))
    attend = jax.shard_map(lambda q, k, v: sdpagraph.attention(q, k, v, is_causal=True, implementation="cudnn"),
                           mesh=m, in_specs=P("data", None, "model"), out_specs=P("data", None, "model"))
    jax.jit(attend)(q, k, v)
    assert seen and all(devices == tuple(jax.local_devices()) for devices in seen)
