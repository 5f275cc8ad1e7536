"""The cuDNN path's JAX plumbing, traced on the CPU with a stand-in builder and executor.

No GPU: the graph build and the executor registration are replaced, and the functions
are only traced (make_jaxpr), so operand order, attributes and the custom_vjp wiring are
checked without running a kernel.
"""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sdpagraph import ffi, mods
from sdpagraph.cache import GraphCache
from sdpagraph.graphs.builder import BuildEnvironment
from sdpagraph.graphs.compiled import CompiledGraph
from sdpagraph.graph_store import CachedGraph, graph_key
from sdpagraph.graphs.operands import graph_io, graph_spec, uid_map
from sdpagraph.backends.cudnn import backend as cudnn_backend
from sdpagraph.backends.cudnn import execute as cudnn_execute
from sdpagraph.call import prepare_call


@pytest.fixture
def fake_gpu(monkeypatch, tmp_path):
    built, registered = [], {}
    cache = GraphCache(str(tmp_path))

    def fake_cached_graph(spec, ir, direction, cache_arg=None):
        built.append(direction)
        operands, results = graph_io(graph_spec(spec, ir), ir, direction)
        scalars = () if ir is None else tuple(("scalar", n) for n in ir.scalar_names)
        roles = operands + results + tuple(f"scalar:{n}" for _, n in scalars)
        uids = uid_map(roles)
        pass_by_value = tuple((uids[f"scalar:{n}"], ("scalar", n), "float32") for _, n in scalars)
        compiled = CompiledGraph(b"blob-" + direction.encode(), 1024, operands, results, uids, pass_by_value,
                                 direction, {}, 0.0)
        key = graph_key(spec, ir, direction, BuildEnvironment("9.19.0", "1.32.0", "sm90 fake"))
        return CachedGraph(key, compiled, cache.entry_path(key))

    monkeypatch.setattr(cudnn_execute, "cached_graph", fake_cached_graph)
    monkeypatch.setattr(ffi, "register_graph", lambda digest, blob: registered.__setitem__(digest, blob))
    return built, registered


def custom_calls(jaxpr):
    text = str(jaxpr)
    return text.count("sdpagraph_execute")


@pytest.mark.parametrize("kwargs", [
    dict(is_causal=True),
    dict(is_causal=True, score_mod=mods.softcap(30.0)),
    dict(query_seq_lengths=np.array([5, 16], np.int32)),
    dict(segment_ids=np.array([[1] * 6 + [2] * 8 + [0] * 2] * 2, np.int32), max_segments_per_seq=2),
])
def test_forward_and_grad_trace_to_the_executor(fake_gpu, kwargs):
    built, registered = fake_gpu
    rng = np.random.default_rng()
    q, k, v = (jnp.asarray(rng.standard_normal((2, 16, 4, 8)), jnp.bfloat16) for _ in range(3))
    bias = jnp.asarray(rng.standard_normal((1, 4, 16, 16)), jnp.float32) if "segment_ids" not in kwargs else None
    call = prepare_call(q, k, v, bias, **kwargs)

    def forward(q, k, v, bias):
        inputs = prepare_call(q, k, v, bias, **kwargs).inputs
        out, lse = cudnn_backend.attention(call.spec, q, k, v, inputs, call.score_mod, training=False)
        return out

    jaxpr = jax.make_jaxpr(forward)(q, k, v, bias)
    assert custom_calls(jaxpr) == 1 and built == ["inference"]
    grad = jax.make_jaxpr(jax.grad(lambda *a: jnp.sum(forward(*a).astype(jnp.float32)), argnums=(0, 1, 2, 3)))
    grad_jaxpr = grad(q, k, v, bias)
    assert custom_calls(grad_jaxpr) == 2 and built[1:] == ["forward", "backward"]
    assert len(registered) == 3 and all(len(d) == 64 for d in registered)
    assert "scalar_values" in str(grad_jaxpr) and "entry_path" in str(grad_jaxpr)


def test_remat_and_value_and_grad_trace_through_the_custom_vjp(fake_gpu):
    built, _ = fake_gpu
    rng = np.random.default_rng()
    q, k, v = (jnp.asarray(rng.standard_normal((2, 16, 4, 8)), jnp.bfloat16) for _ in range(3))
    call = prepare_call(q, k, v, is_causal=True, score_mod=mods.softcap(10.0))

    @jax.checkpoint
    def layer(q, k, v):
        out, _ = cudnn_backend.attention(call.spec, q, k, v, call.inputs, call.score_mod)
        return out

    step = jax.value_and_grad(lambda q, k, v: jnp.sum(layer(q, k, v).astype(jnp.float32)), argnums=(0, 1, 2))
    jaxpr = jax.make_jaxpr(step)(q, k, v)
    assert custom_calls(jaxpr) >= 2 and {"forward", "backward"} <= set(built)


def test_ffi_results_vary_over_the_manual_axes_their_operands_vary_over():
    """Inside a shard_map an FFI call's results come back invariant; the cuDNN path marks them
    varying as its operands are, or a custom_vjp's gradient fails JAX's manual-axis type check
    (seen on an H100 with context parallelism's all_to_all strategy, jax 0.11.2)."""
    from jax.sharding import Mesh, PartitionSpec as P

    from sdpagraph.meshes import varying_axes as _varying_axes, varying_like

    mesh = Mesh(np.array(jax.devices()[:1]), ("cp",))
    seen = {}

    def body(x):
        fresh = jnp.ones(x.shape, x.dtype)  # what an FFI call returns: no manual axes
        seen["fresh"] = _varying_axes(fresh)
        marked = varying_like(fresh, [x, np.ones(3), None])
        seen["marked"] = _varying_axes(marked)
        return marked + x

    out = jax.shard_map(body, mesh=mesh, in_specs=P("cp"), out_specs=P("cp"))(jnp.arange(4.0))
    assert seen == {"fresh": frozenset(), "marked": frozenset({"cp"})}
    np.testing.assert_array_equal(out, 1 + np.arange(4.0))
    outside = jnp.ones(3)
    assert varying_like(outside, [jnp.zeros(3)]) is outside


def _int_attribute(jaxpr, name):
    """The int array attribute `name` of each executor call in `jaxpr` (nested calls included)."""
    found = re.findall(rf"\('{name}', HashableArray\(array\(\[([-0-9,\s]*)\]", str(jaxpr))
    return [[int(x) for x in values.replace(",", " ").split()] for values in found]


@pytest.mark.parametrize("packed", [False, True])
def test_a_stacked_block_backward_asks_the_executor_for_dk_and_dv_as_one_result(fake_gpu, packed):
    """`block_backward_stacked`: one FFI result holds dk then dv (result_parts 2, their uids in that
    order after dq's), zeroed first by the executor where the graph is packed (it writes only its
    documents' rows); every other result holds one tensor and is not zeroed."""
    rng = np.random.default_rng()
    q, k, v, o, d_o = (jnp.asarray(rng.standard_normal((2, 16, 4, 8)), jnp.bfloat16) for _ in range(5))
    kwargs = dict(is_causal=True)
    if packed:
        ids = np.sort(rng.integers(1, 4, (2, 16)), axis=1).astype(np.int32)
        kwargs.update(segment_ids=ids, max_segments_per_seq=3)
    call = prepare_call(q, k, v, None, **kwargs)
    static = cudnn_backend.block_static(call.spec, call.score_mod, {})
    lse = jnp.asarray(rng.standard_normal((2, 4, 16)), jnp.float32)

    def backward(q, k, v, o, d_o, lse):
        operands = cudnn_backend.block_operands(static, prepare_call(q, k, v, None, **kwargs).inputs)
        return cudnn_backend.block_backward_stacked(static, q, k, v, operands, o, lse, d_o)

    jaxpr = jax.make_jaxpr(backward)(q, k, v, o, d_o, lse)
    assert custom_calls(jaxpr) == 1
    (parts,), (zeroed,), (uids,) = (_int_attribute(jaxpr, name) for name in ("result_parts", "zeroed_results", "uids"))
    dq, dkv = jax.eval_shape(backward, q, k, v, o, d_o, lse)
    assert dq.shape == q.shape and dkv.shape == (2, *k.shape) and dkv.dtype == k.dtype
    graph = cudnn_execute.cached_graph(static.spec, static.ir, "backward")
    compiled = graph.compiled
    assert list(compiled.result_roles[:3]) == ["dq", "dk", "dv"]
    assert parts == [1, 2] and zeroed == [0, int(packed)]
    tail = [compiled.uids[role] for role in ("dq", "dk", "dv")]
    assert uids[-3:] == tail and len(uids) == len(compiled.operand_roles) + 3


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("zero_unwritten", [False, True])
def test_packed_block_calls_can_have_the_executor_zero_their_unwritten_rows(fake_gpu, packed, zero_unwritten):
    """`block_forward` / `block_backward` of a packed graph with `zero_unwritten`: the executor zeroes
    o (not the stats), and dq, dk and dv, before the graph writes its documents' rows, and no
    masking pass follows (a select over a whole result); without it, a masking pass; a dense
    graph's results are neither zeroed nor masked."""
    rng = np.random.default_rng()
    q, k, v, o, d_o = (jnp.asarray(rng.standard_normal((2, 16, 4, 8)), jnp.bfloat16) for _ in range(5))
    kwargs = dict(is_causal=True)
    if packed:
        ids = np.sort(rng.integers(0, 4, (2, 16)), axis=1).astype(np.int32)  # padding (0) first
        kwargs.update(segment_ids=ids, max_segments_per_seq=3)
    call = prepare_call(q, k, v, None, **kwargs)
    static = cudnn_backend.block_static(call.spec, call.score_mod, {})
    lse = jnp.asarray(rng.standard_normal((2, 4, 16)), jnp.float32)

    def operands(q, k, v):
        return cudnn_backend.block_operands(static, prepare_call(q, k, v, None, **kwargs).inputs)

    forward = lambda q, k, v: cudnn_backend.block_forward(  # noqa: E731
        static, q, k, v, operands(q, k, v), zero_unwritten)
    backward = lambda q, k, v, o, d_o, lse: cudnn_backend.block_backward(  # noqa: E731
        static, q, k, v, operands(q, k, v), o, lse, d_o, zero_unwritten)
    zeroing = int(packed and zero_unwritten)
    for fn, args, want in ((forward, (q, k, v), [zeroing, 0]), (backward, (q, k, v, o, d_o, lse), [zeroing] * 3)):
        jaxpr = jax.make_jaxpr(fn)(*args)
        (zeroed,) = _int_attribute(jaxpr, "zeroed_results")
        assert zeroed == want, (fn, zeroed)
        masked = re.findall(r"bf16\[2,16,4,8\] = select_n", str(jaxpr))  # a pass masking a result's rows
        assert bool(masked) == (packed and not zero_unwritten), masked


def test_results_of_refuses_dk_and_dv_that_do_not_stack():
    static = cudnn_execute.Static(*(None,) * 5, kv_grads_stacked=True)
    results = {"dq": jax.ShapeDtypeStruct((2, 16, 4, 8), jnp.bfloat16),
               "dk": jax.ShapeDtypeStruct((2, 16, 4, 8), jnp.bfloat16),
               "dv": jax.ShapeDtypeStruct((2, 16, 4, 16), jnp.bfloat16)}
    with pytest.raises(ValueError, match="cannot stack"):
        cudnn_execute.results_of(static, ("dq", "dk", "dv"), results)
    unstacked = cudnn_execute.results_of(static, ("dq", "dk"), results)  # no pair to stack: as asked
    assert set(unstacked) == {"dq", "dk"}


def test_the_executor_binds_exactly_the_attributes_every_call_passes(fake_gpu):
    """sdpagraph_execute's FFI binding (execute.cc) names its attributes; XLA refuses a call that
    passes another set, so `call_executor` must pass exactly those (loader.py documents them)."""
    from tests.test_entry_format_contract import cpp_source

    bound = set(re.findall(r'\.Attr<[^>]*>+\("(\w+)"\)', cpp_source()))
    rng = np.random.default_rng()
    q, k, v = (jnp.asarray(rng.standard_normal((2, 16, 4, 8)), jnp.bfloat16) for _ in range(3))
    call = prepare_call(q, k, v, None, is_causal=True, score_mod=mods.softcap(30.0))
    jaxpr = jax.make_jaxpr(lambda q, k, v: cudnn_backend.attention(
        call.spec, q, k, v, call.inputs, call.score_mod, training=False)[0])(q, k, v)
    (line,) = [x for x in str(jaxpr).splitlines() if "attributes=(" in x]
    passed = set(re.findall(r"\('(\w+)', ", line))
    assert bound == {"graph_key", "entry_path", "uids", "result_parts", "zeroed_results", "scalar_uids",
                     "scalar_values", "workspace_size"}
    assert passed == bound, (passed, bound)
