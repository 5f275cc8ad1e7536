"""Compile the cuDNN SDPA graph of (spec, score_mod IR, direction) into a serialized plan.

    compile_graph(spec, ir, direction, env) -> (blob, meta)    direction: forward | inference | backward
    graph_identity(spec, ir, direction) -> (spec text, IR text) what the compiled graph depends on

The builder only compiles: keys and get-or-build live in the cache layer (`graph_store`),
which composes a graph's key from `graph_identity` and the `BuildEnvironment`. The IR text
is "lowering<N>:" + `ir.forward_digest` for forward and inference graphs (they never run the
bprop) and `ir.digest` for backward ("none" without a mod), N being LOWERING_VERSION, then
SCALE_FOLDED where the mod's leading scaling is folded into the attention scale. A
graph is built with heuristics [A, FALLBACK] and only a cuDNN backend plan is kept (a
Python-engine plan cannot run from C++).

Executor contract (what the FFI executor / JAX side passes; `graphs.operands` computes it)
-----------------------------------------------------------------------------------------
Operands, in this order (`graph_io(graph_spec(spec, ir), ir, direction)`); B batch, T/S query/key
length, N/K query/kv heads, H/Hv head dims, M = spec.max_segments:

    q (B,T,N,H), k (B,S,K,H), v (B,S,K,Hv)         io dtype (bf16/fp16), BSHD as the user passes them
    o (B,T,N,Hv), dO (B,T,N,Hv)                    backward only, io dtype
    stats                                          backward only, float32: (B,N,T) dense;
                                                   (B,T,N) packed (one value per token and head)
    bias  operands.bias_operand_shape(spec, ir)    io dtype (cast a float32 bias first); a boolean mask
                                                   and, with a mod, key padding are folded in as a
                                                   large negative value where they say no
    seq_len_q, seq_len_kv                          int32 (not when the padding is folded into the bias);
                                                   dense padding: (B,), the valid lengths
                                                   (pass the full T or S for a side without lengths);
                                                   packed: (B*M,) = segment_metadata(...).seq_lens
                                                   flattened (0 for unused slots)
    ragged_offset_q, ragged_offset_kv,             packed only, int32 (B*M+1,): ELEMENT offsets of
    ragged_offset_stats (not for inference)        each sequence's first token; with
                                                   start[b,m] = b*T + offsets[b,m] (q side, b*S kv side):
                                                   q: start*N*H, kv: start*K*H, stats: start*N; the
                                                   last entry is the end of the buffer (B*T*N*H, ...)
    segment_start, segment_end                     dense twin only (spec.segment_mask), int32 (B,1,T,1):
                                                   first and last token of each query's segment (a
                                                   padding token: its own index); segment_end only
                                                   without the causal mask
    array:<name>                                   score_mod aux arrays in ir.array_names order (only
                                                   those the direction reads), 4-D broadcast shape,
                                                   float32 (FLOAT) or int32 (INT)

Results: forward o (B,T,N,Hv) + stats, inference o, backward dq, dk, dv (+ dbias, shaped
like the bias operand, when spec.bias_shape is set), shaped like their inputs. Rows cuDNN does not compute (padded queries,
tokens between or after packed segments) are not written: zero them on the JAX side.
Pass-by-value tensors (`CompiledGraph.pass_by_value`) are host values bound by UID: float32
for scalars (int scalars too) and float literals, int32 for int literals.
Packed (THD) graphs need H == Hv and take no bias or mask, and no score_mod or chunks
(`graphs.lowering` says why); self-attention ids in such calls run on the dense twin
(`operands.graph_spec`).
"""
from __future__ import annotations

import ctypes
import dataclasses
import functools
import importlib.metadata
import os
import time
from dataclasses import dataclass
from typing import Any

from sdpagraph.errors import SdpagraphError
from sdpagraph.graphs.compiled import CompiledGraph
from sdpagraph.scoremod.ir import ScoreModIR
from sdpagraph.scoremod.scale_folding import folds_leading_scale
from sdpagraph.graphs.lowering import lower, new_graph
from sdpagraph.graphs.operands import graph_spec
from sdpagraph.spec import AttentionSpec

__all__ = ["BuildEnvironment", "GraphBuildError", "build_environment", "compile_graph", "graph_identity"]

NO_MOD = "none"
# Bump when the lowering emits a different graph for the same key inputs, so caches built
# by an older sdpagraph miss instead of serving the old graph. 2: masks in cuDNN's operand
# order, re-emitted in the bprop, int literals as INT32 (2026-11-22).
LOWERING_VERSION = 2
# Marks the IR text of a graph whose mod's leading scaling is cuDNN's attention scale
# (`scoremod.scale_folding`): caches built before that fold miss for those graphs only.
SCALE_FOLDED = "+scale-folded"
CUDNN_SONAME = "libcudnn.so.9"  # the executor binds the same library (ffi/csrc/cudnn_library.cc)
FRONTEND_DISTRIBUTION = "nvidia-cudnn-frontend"


@dataclass(frozen=True)
class BuildEnvironment:
    """What a plan is built for; part of every cache key."""

    cudnn_version: str  # e.g. "9.19.0"
    frontend_version: str  # e.g. "1.32.0"
    gpu: str  # e.g. "sm90 NVIDIA H200"


class GraphBuildError(SdpagraphError, RuntimeError):
    """cuDNN declined or failed to build a graph; `message` is cuDNN's own text."""

    def __init__(self, direction: str, message: str, cudnn_version: str):
        super().__init__(f"cuDNN {cudnn_version} could not build the {direction} graph: {message}")
        self.direction = direction
        self.message = message
        self.cudnn_version = cudnn_version


@functools.cache
def build_environment() -> BuildEnvironment:
    """The cuDNN backend, the frontend and the GPU of this process (the first JAX GPU).

    Fixed for the life of the process, so computed once: every trace and support query needs it.
    It does not import the cudnn frontend module when it can help it (importing it is most of a
    cache hit's cold start): cuDNN's version comes from the libcudnn JAX loaded, the one the
    executor runs graphs with, and the frontend's from its package metadata.
    """
    import jax

    device = jax.devices("gpu")[0]
    capability = str(device.compute_capability).replace(".", "")
    version = _loaded_cudnn_version()
    frontend = _frontend_version()
    if version is None or frontend is None:
        import cudnn

        version, frontend = int(cudnn.backend_version()), cudnn.__version__
    return BuildEnvironment(
        cudnn_version=f"{version // 10000}.{version % 10000 // 100}.{version % 100}",
        frontend_version=frontend,
        gpu=f"sm{capability} {device.device_kind}",
    )


def _loaded_cudnn_version() -> int | None:
    """cudnnGetVersion() of the libcudnn.so.9 already in the process (JAX's), or None."""
    try:
        library = ctypes.CDLL(CUDNN_SONAME, mode=os.RTLD_NOLOAD | os.RTLD_NOW)
    except OSError:
        return None
    library.cudnnGetVersion.restype = ctypes.c_size_t
    return int(library.cudnnGetVersion())


def _frontend_version() -> str | None:
    try:
        return importlib.metadata.version(FRONTEND_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        return None


def graph_identity(spec: AttentionSpec, ir: ScoreModIR | None, direction: str) -> tuple[str, str]:
    """(canonical text of the graph's spec, "lowering<N>:<IR hash>"): everything of the call that
    the compiled `direction` graph depends on. `spec` is the call's: packed segments that the THD
    layout cannot take are keyed as the dense twin they run on (`operands.graph_spec`)."""
    if ir is None:
        ir_hash = NO_MOD
    else:
        ir_hash = ir.digest if direction == "backward" else ir.forward_digest
        if folds_leading_scale(ir, direction):
            ir_hash += SCALE_FOLDED
    spec = graph_spec(spec, ir)
    if direction != "backward":  # the deterministic algorithm is the backward's: one forward graph serves both
        spec = dataclasses.replace(spec, deterministic=False)
    return spec.canonical(), f"lowering{LOWERING_VERSION}:{ir_hash}"


def compile_graph(spec: AttentionSpec, ir: ScoreModIR | None, direction: str,
                  env: BuildEnvironment) -> tuple[bytes, dict[str, Any]]:
    """Describe, build and serialize one graph: the cache's `build` callback.

    `spec` is the call's (mapped to the graph's own with `operands.graph_spec`). Raises
    `Unsupported` (a config sdpagraph cannot lower) or `GraphBuildError` (cuDNN declined).
    """
    import cudnn

    spec = graph_spec(spec, ir)
    started = time.perf_counter()
    graph = new_graph(spec, direction, cudnn)
    lowering = lower(graph, spec, ir, direction, cudnn)
    try:
        graph.build([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
        _keep_backend_plan(graph, direction, env)
        blob = graph.serialize(as_bytes=True)
        workspace_size = int(graph.get_workspace_size())
    except GraphBuildError:
        raise
    except Exception as error:  # noqa: BLE001 - cuDNN reports declines with several exception types
        raise GraphBuildError(direction, _one_line(error), env.cudnn_version) from error
    finally:
        lowering.release()  # the plan is serialized (or declined): free the frontend's graph objects
    compiled = CompiledGraph(
        blob=bytes(blob),
        workspace_size=workspace_size,
        operand_roles=lowering.operand_roles,
        result_roles=lowering.result_roles,
        uids=lowering.uids,
        pass_by_value=lowering.pass_by_value,
        direction=direction,
        versions={"cudnn": env.cudnn_version, "frontend": env.frontend_version, "gpu": env.gpu},
        build_time_s=time.perf_counter() - started,
    )
    summary = f"{spec.summary()} {direction}" + ("" if ir is None else " +score_mod")
    return compiled.blob, {**compiled.to_meta(), "summary": summary}


def _keep_backend_plan(graph: Any, direction: str, env: BuildEnvironment) -> None:
    """Walk past Python (CuTeDSL) engine plans: only backend plans serialize for the C++ executor."""
    while graph.selected_engine is not None:
        graph.deselect_engines([graph.selected_engine.name])
        try:
            graph.build_plans()
        except Exception as error:  # noqa: BLE001 - the walk raises whatever the last plan raised
            raise GraphBuildError(direction, "only Python (CuTeDSL) engines can run this graph, and the C++ "
                                  f"executor runs cuDNN backend engines only ({_one_line(error)})",
                                  env.cudnn_version) from error


def _one_line(error: BaseException) -> str:
    return " ".join(str(error).split()) or type(error).__name__
