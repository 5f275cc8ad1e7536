"""A jax.numpy softcap's literals are bound scalars (`scoremod.jnp.literals`) through `attention`: every
cap value records one IR, has one graph key and runs one cached graph, and each call computes with its
own value on the XLA backend, the small-seq backend and the cuDNN path (the CPU stand-in of
tests/test_sharding.py, fed the scalars exactly as the executor receives them), against a float64
NumPy reference and a jax.nn.dot_product_attention one, forward and gradients."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

import sdpagraph
from sdpagraph.graph_store import CachedGraph, graph_key
from sdpagraph.graphs.builder import BuildEnvironment
from sdpagraph.graphs.compiled import CompiledGraph
from sdpagraph.graphs.lowering import mod_stages
from sdpagraph.graphs.mod_lowering import pass_by_value_plan
from sdpagraph.graphs.operands import graph_io, graph_spec, uid_map
from sdpagraph.backends.cudnn import execute as cudnn_execute
from sdpagraph.call import prepare_call
from sdpagraph.spec import DIRECTIONS
from tests.reference import allowed, attention_fwd_bwd, softcap_mod
from tests.test_jnp_mods import conditions
from tests.test_sharding import cudnn_on_cpu, fake_executor  # noqa: F401  (a fixture, and the stand-in graph)

CAPS = (2.0, 30.0)
B, N, K, H = 2, 4, 2, 16
SCALE = H ** -0.5


def softcap(cap):
    """A fresh function per value, as user code makes them."""
    return lambda s, b, h, i, j: cap * jnp.tanh(s / cap)


def causal(b, h, i, j):
    return i >= j


def qkv(rng, T, S):
    q = jnp.asarray(rng.standard_normal((B, T, N, H)) * 3, jnp.float32)  # scores of a few units: the caps differ
    k, v = (jnp.asarray(rng.standard_normal((B, S, K, H)), jnp.float32) for _ in range(2))
    return q, k, v


def rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def out_and_grads(attend, q, k, v, dout):
    out, pullback = jax.vjp(attend, q, k, v)
    return (out, *pullback(dout))


def jax_reference(q, k, v, cap):
    """jax.nn.dot_product_attention on softcapped scores: zero queries and the scores as the bias
    (differentiable, so the gradients of q, k, v flow through it)."""
    scores = jnp.einsum("btnh,bsnh->bnts", q, jnp.repeat(k, N // K, axis=2)) * SCALE
    return jax.nn.dot_product_attention(jnp.zeros_like(q), k, v, bias=cap * jnp.tanh(scores / cap), is_causal=True,
                                        implementation="xla")


def check_each_cap(rng, implementation, T, S, tol=1e-5):
    """Forward and gradients of each cap against both references; returns the outputs per cap."""
    q, k, v = qkv(rng, T, S)
    dout = jnp.asarray(rng.standard_normal((B, T, N, H)), jnp.float32)
    ok, q_pos, k_pos = allowed(B, T, S, is_causal=True)
    outs = {}
    for cap in CAPS:
        ours = out_and_grads(lambda q, k, v: sdpagraph.attention(q, k, v, score_mod=softcap(cap), mask_mod=causal,
                                                                 implementation=implementation), q, k, v, dout)
        out64, (dq, dk, dv, _) = attention_fwd_bwd(q, k, v, dout, scale=SCALE, ok=ok, q_pos=q_pos, k_pos=k_pos,
                                                    mod=softcap_mod(cap))
        theirs = out_and_grads(lambda q, k, v: jax_reference(q, k, v, cap), q, k, v, dout)
        for name, a, b, c in zip(("out", "dq", "dk", "dv"), ours, (out64, dq, dk, dv), theirs):
            assert rel(a, b) < tol * 10, (cap, name, rel(a, b))
            assert rel(a, c) < tol * 10, (cap, name, rel(a, c))
        outs[cap] = ours[0]
    assert rel(outs[CAPS[0]], outs[CAPS[1]]) > 1e-2  # the two values really compute different things
    return outs


def test_softcap_values_share_one_ir_and_one_graph_key(rng):
    env = BuildEnvironment("9.19.0", "1.32.0", "sm90 fake")
    q, k, v = qkv(rng, 16, 16)
    calls = [prepare_call(q, k, v, score_mod=softcap(cap), mask_mod=causal) for cap in CAPS]
    calls.append(prepare_call(q, k, v, score_mod=lambda s, b, h, i, j: 30 * jnp.tanh(s / 30), mask_mod=causal))
    assert len({call.score_mod.digest for call in calls}) == 1
    for direction in DIRECTIONS:
        assert len({graph_key(call.spec, call.score_mod, direction, env).digest() for call in calls}) == 1
    assert [sorted(call.inputs.mod_scalars.values()) for call in calls] == [[2.0, 2.0], [30.0, 30.0], [30.0, 30.0]]


def test_a_mask_mod_next_to_a_lifted_softcap_keeps_the_forms_cuDNN_skips_tiles_for(rng):
    q, k, v = qkv(rng, 16, 16)
    window = lambda b, h, i, j: (i >= j) & (i - j <= 8)  # noqa: E731
    ir = prepare_call(q, k, v, score_mod=softcap(30.0), mask_mod=window).score_mod
    assert conditions(ir) == {"cmp_ge(gen2,gen3)", "cmp_gt(add(gen3,9),gen2)"}  # scoremod.masks' forms, int literals
    assert {n.dtype for n in ir.nodes if n.op == "const" and n.attr("value") == 9} == {"int32"}
    assert len(ir.scalar_names) == 2


def test_each_value_computes_with_its_own_on_the_xla_backend(rng):
    check_each_cap(rng, "xla", T=24, S=24)


def test_each_value_computes_with_its_own_on_the_small_seq_backend(rng):
    check_each_cap(rng, "small_seq", T=4, S=16)


def test_the_cudnn_path_binds_each_value_into_one_graph(rng, cudnn_on_cpu, monkeypatch):
    _, env = cudnn_on_cpu
    keys, bound = {}, []

    def cached_graph(spec, ir, direction, cache_arg=None):
        """The stand-in's graph, with the pass-by-value tensors the real lowering plans."""
        planned = graph_spec(spec, ir)
        operands, results = graph_io(planned, ir, direction)
        plan = pass_by_value_plan(mod_stages(planned, ir), direction)
        uids = uid_map(operands + results + tuple(entry.role for entry in plan))
        pass_by_value = tuple((uids[entry.role], entry.source, entry.dtype) for entry in plan)
        compiled = CompiledGraph(b"blob", 0, operands, results, uids, pass_by_value, direction, {}, 0.0)
        key = graph_key(spec, ir, direction, env)
        keys.setdefault(direction, set()).add(key.digest())
        return CachedGraph(key, compiled, None)

    def executor(static, graph, operands, results):
        """The stand-in computes with the scalars as the executor gets them: bits bound to uids."""
        uids, bits = cudnn_execute.scalar_bits(graph.compiled, dict(static.scalars))
        by_uid = dict(zip(uids.tolist(), bits.view(np.float32).tolist()))
        scalars = {source: by_uid[uid] for uid, (kind, source), _ in graph.compiled.pass_by_value if kind == "scalar"}
        bound.append(scalars)
        return fake_executor(dataclasses.replace(static, scalars=tuple(sorted(scalars.items()))), graph, operands,
                             results)

    monkeypatch.setattr(cudnn_execute, "cached_graph", cached_graph)
    monkeypatch.setattr(cudnn_execute, "call_executor", executor)
    check_each_cap(rng, "cudnn", T=24, S=24)
    assert set(keys) == {"forward", "backward"} and all(len(digests) == 1 for digests in keys.values())
    assert {tuple(sorted(set(scalars.values()))) for scalars in bound} == {(cap,) for cap in CAPS}
