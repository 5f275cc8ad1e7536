"""Tracing a `score_mod(graph, score, tensors)` callback into a `ScoreModIR`.

The callback is called once on a `RecordingGraph` (`scoremod.recording`); its bprop is the user's
`score_mod_bprop` traced the same way, or derived by `scoremod.ir_grad`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping

from sdpagraph.scoremod.ir import BOOL, ScoreModError, ScoreModIR
from sdpagraph.scoremod.recording import ModTensor, RecordingGraph
from sdpagraph.scoremod.ir_grad import derive_bprop


@dataclass(frozen=True)
class TensorInfo:
    """Static facts of one `score_mod_tensors` entry: a scalar, or an array's 4-D shape."""

    kind: str  # "scalar" or "array"
    dtype: str
    shape: tuple[int, ...] = ()


def trace_score_mod(
    score_mod: Callable,
    tensors: Mapping[str, TensorInfo],
    score_mod_bprop: Callable | None = None,
) -> ScoreModIR:
    """Record `score_mod` (and `score_mod_bprop`, else a derived one) into a ScoreModIR."""
    graph = RecordingGraph()
    score = graph.leaf("score")
    proxies = {
        name: graph.leaf(info.kind, (("shape", info.shape),) if info.kind == "array" else (), info.dtype, name=name)
        for name, info in tensors.items()
    }
    out = _call(score_mod, graph, score, proxies, "score_mod")
    if out.dtype == BOOL:
        raise ScoreModError("score_mod returned a boolean tensor; it must return the modified score")
    if score_mod_bprop is not None:
        dscore = graph.leaf("dscore")
        grad = _call(score_mod_bprop, graph, dscore, proxies, "score_mod_bprop").index
        derived = False
    else:
        grad = derive_bprop(graph, out.index, score.index)
        derived = True
    ir = graph.to_ir(out.index, grad)
    return ScoreModIR(ir.nodes, ir.output, ir.grad_output, ir.scalar_names, ir.array_names, grad_derived=derived)


def _call(fn: Callable, graph: RecordingGraph, first: ModTensor, proxies: dict, what: str) -> ModTensor:
    result = fn(graph, first, dict(proxies))
    if not isinstance(result, ModTensor) or result.graph is not graph:
        raise ScoreModError(f"{what} must return a graph tensor, got {type(result).__name__}")
    return result
