"""The backend conformance suite's machinery: where it runs, and the cuDNN stand-in of a GPU-less machine.

With a GPU (`jax.devices("gpu")` non-empty) every backend runs for real, cuDNN included. Without one,
the cuDNN backend runs its own code (support answer, graph specs and keys, operands, layouts, bias
folding, packed offsets, custom_vjp, row zeroing) around two stand-ins:
- the graph builder (`graphs.builder.compile_graph`): it applies sdpagraph's own lowering checks
  (`graphs.lowering._check_lowerable`, the declines that come before cuDNN is asked), lays out the
  graph's operands (`graphs.operands.describe`) and returns a plan-less graph; cuDNN's own declines
  (a dtype, an engine) are a GPU's to give;
- the FFI executor (`execute.call_executor`): `backends.cudnn.graph_on_xla.run_on_xla`, what the graph
  computes, evaluated on XLA from the graph's own operands (packed sequences decoded from the ragged
  offsets, padding from sequence lengths, masks from the bias operand), as in tests/test_sharding.py.
Floating point 32 runs through it too (cuDNN itself takes bf16/fp16 only), so the CPU cases are tight.
"""
from __future__ import annotations

import functools
import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # cuDNN's tests share the GPU with JAX

import pytest  # noqa: E402


@functools.lru_cache(maxsize=None)
def on_gpu() -> bool:
    """Whether JAX sees a GPU (asked on first use, not at import: JAX's backends start then)."""
    import jax

    try:
        return bool(jax.devices("gpu"))
    except RuntimeError:
        return False


def _stand_in_compile(spec, ir, direction, env):
    """`builder.compile_graph` without cuDNN: sdpagraph's own declines, the graph's roles, no plan."""
    from sdpagraph.graphs import lowering
    from sdpagraph.graphs.compiled import CompiledGraph
    from sdpagraph.graphs.operands import describe, graph_io, graph_spec, uid_map

    graph = graph_spec(spec, ir)
    lowering._check_lowerable(graph, ir, direction)
    operands, results = graph_io(graph, ir, direction)
    describe(graph, ir, direction)  # every role has a layout
    compiled = CompiledGraph(b"stand-in", 0, operands, results, uid_map(operands + results), (), direction,
                             {"cudnn": env.cudnn_version, "frontend": env.frontend_version, "gpu": env.gpu}, 0.0)
    return compiled.blob, {**compiled.to_meta(), "summary": f"{graph.summary()} {direction} (stand-in)"}


def _stand_in_executor(static, graph, operands, results):
    """The executor call, on XLA: what the graph computes from its own operands. First, what cuDNN
    would read: every operand the graph names, each (packed ones aside) as large as the graph's
    tensor description says, and the results asked for on the operands' shapes."""
    import numpy as np

    from sdpagraph.backends.cudnn.graph_on_xla import run_on_xla
    from sdpagraph.graphs.operands import describe

    from sdpagraph.backends.cudnn.execute import restacked, unstacked

    wanted, results = results, unstacked(results)  # dk and dv stacked where the call asks for it
    compiled = graph.compiled
    assert set(compiled.operand_roles) <= set(operands), (compiled.operand_roles, sorted(operands))
    assert list(compiled.result_roles) == [r for r in compiled.result_roles if r in results], (compiled.result_roles,
                                                                                                 sorted(results))
    if not static.graph_spec.segments:
        descs = describe(static.graph_spec, static.ir, compiled.direction)
        for role in compiled.operand_roles + compiled.result_roles:
            x = operands[role] if role in operands else results[role]
            assert int(np.prod(x.shape)) == int(np.prod(descs[role].dims)), (role, x.shape, descs[role])
            if role in ("bias", "dbias"):
                assert tuple(x.shape) == tuple(descs[role].dims), (role, x.shape, descs[role])
    q, k = operands["q"], operands["k"]
    for role in ("o", "dq", "dk"):
        if role in results:
            assert results[role].shape[:3] == (k if role == "dk" else q).shape[:3], (role, results[role], q.shape)
    return restacked(run_on_xla(static, operands, results), wanted)


def jit(fn):
    """jax.jit; on the CPU without XLA's backend optimizations, which take half of a case's compile
    time (values differ in the last bit at most)."""
    import jax

    return jax.jit(fn, compiler_options=None if on_gpu() else {"xla_backend_optimization_level": 0})


@pytest.fixture(autouse=True)
def cudnn_stand_in(monkeypatch):
    """Without a GPU, the cuDNN backend's builder and executor are the stand-ins above (module doc);
    with one, nothing is replaced. Yields the directions of the graphs the stand-in executor ran
    (a list), or None with a GPU."""
    if on_gpu():
        yield None
        return
    from sdpagraph import ffi
    from sdpagraph.backends.cudnn import execute as cudnn_execute
    from sdpagraph.graphs import operands as operands_module
    from sdpagraph.cache import GraphCache
    from sdpagraph.graph_store import using_cache
    from sdpagraph.graphs import builder
    from sdpagraph.graphs import support as graph_support

    env = builder.BuildEnvironment("9.19.0", "1.32.0", "sm90 stand-in")
    monkeypatch.setattr(graph_support, "environment_reason", lambda: None)
    monkeypatch.setattr(cudnn_execute, "environment_reason", lambda: None)
    monkeypatch.setattr(ffi, "unavailable_reason", lambda: None)
    monkeypatch.setattr(ffi, "register_graph", lambda digest, blob: None)
    monkeypatch.setattr(builder, "build_environment", lambda: env)
    monkeypatch.setattr(builder, "compile_graph", _stand_in_compile)
    executed = []

    def executor(static, graph, operands, results):
        executed.append(graph.compiled.direction)
        return _stand_in_executor(static, graph, operands, results)

    monkeypatch.setattr(cudnn_execute, "call_executor", executor)
    # cuDNN's masked-bias value per io type has no float32 entry (cuDNN takes no float32).
    monkeypatch.setitem(operands_module.MASKED_BIAS, "float32", -1e30)
    monkeypatch.setenv("SDPAGRAPH_VERIFY", "off")  # the numerical check would run the (plan-less) graphs
    with using_cache(GraphCache()):  # in memory, one per test: answers and graphs start fresh
        yield executed
