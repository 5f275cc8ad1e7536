"""Which gradient types cuDNN's FP8 backward (sdpa_fp8_backward) takes on this GPU, and how fast each
runs, next to the bf16 backward; with --forward-plans, every plan of the FP8 inference graph (heuristics
A, B and FALLBACK) and of the bf16 one, timed. Needs a GPU and torch.

    python bench/probe_fp8_backward.py [B,T,N,H] [causal] [--forward-plans] [K]

The FP8 graphs are lowered by `graphs.lowering` as the runtime does (q, k, v, o e4m3; dO e5m2), with
dq, dk, dv declared as e5m2 (the runtime's), bfloat16 or float32; each is built with heuristics A and
FALLBACK and, where it builds, timed (CUDA events) on random buffers (scales 1).
"""
from __future__ import annotations

import dataclasses
import sys

import numpy as np

from sdpagraph.graphs import lowering, operands
from sdpagraph.graphs.lowering import lower, new_graph
from sdpagraph.graphs.operands import describe
from sdpagraph.spec import AttentionSpec

from cuda_timing import cuda_event_ms  # bench/ is on sys.path when a script here runs


def forward_plans(cudnn, torch, handle, spec: AttentionSpec) -> None:
    """Every plan of the inference graph of `spec` (FP8 or bf16), timed on random buffers (scales 1)."""
    graph = new_graph(spec, "inference", cudnn)
    lowered = lower(graph, spec, None, "inference", cudnn)
    graph.validate()
    graph.build_operation_graph()
    graph.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.B, cudnn.heur_mode.FALLBACK])
    graph.check_support()
    descs = describe(spec, None, "inference")
    io = torch.float8_e4m3fn if spec.is_fp8 else torch.bfloat16
    types = {"io": io, "float32": torch.float32, "int32": torch.int32}
    buffers = {}
    for role in lowered.operand_roles + lowered.result_roles:
        d = descs[role]
        x = torch.empty_strided(d.dims, d.strides, dtype=types[d.dtype], device="cuda")
        if d.dtype == "float32":
            x.fill_(1.0)
        else:
            x.copy_(torch.from_numpy(np.random.default_rng(0).standard_normal(d.dims).astype(np.float32)))
        buffers[role] = x
    pack = {lowered.uids[role]: buffers[role] for role in buffers}
    for index in range(graph.get_execution_plan_count()):
        name = graph.get_plan_name_at_index(index)
        try:
            graph.build_plan_at_index(index)
            if graph.selected_engine is not None:
                print(f"| {spec.dtype} | {index} | {name} | python engine |", flush=True)
                continue
            size = graph.get_workspace_size_plan_at_index(index)
            workspace = torch.empty(max(size, 1), dtype=torch.uint8, device="cuda")
            ms = cuda_event_ms(lambda: graph.execute_plan_at_index(pack, workspace, index=index, handle=handle))
            print(f"| {spec.dtype} | {index} | {name} | {ms:.3f} ms |", flush=True)
        except Exception as error:  # noqa: BLE001 - a plan that does not build is a finding
            print(f"| {spec.dtype} | {index} | {name} | declined: {' '.join(str(error).split())[:100]} |", flush=True)


def main() -> int:
    import cudnn
    import torch

    b, t, n, h = (int(x) for x in (sys.argv[1] if len(sys.argv) > 1 else "1,8192,16,128").split(","))
    causal = len(sys.argv) > 2 and sys.argv[2] == "causal"
    handle = cudnn.create_handle()
    if "--forward-plans" in sys.argv:
        kv_heads = int(sys.argv[-1]) if sys.argv[-1].isdigit() else n
        for dtype in ("float8_e4m3fn", "bfloat16"):
            forward_plans(cudnn, torch, handle, AttentionSpec(b, t, t, n, kv_heads, h, h, dtype, h ** -0.5,
                                                             is_causal=causal))
        return 0
    torch_types = {"io": torch.float8_e4m3fn, "fp8_gradient": torch.float8_e5m2, "float32": torch.float32,
                   "int32": torch.int32, "bf16": torch.bfloat16}
    original_describe = operands._describe_role
    original_types = lowering._storage_types
    print(f"B{b} T{t} N{n} H{h} {'causal' if causal else 'not causal'}; {torch.cuda.get_device_name()}, "
          f"cuDNN {cudnn.backend_version()}, frontend {cudnn.__version__}")
    for gradient in ("fp8_gradient", "bf16", "float32"):
        def describe_role(spec, ir, role, gradient=gradient):
            desc = original_describe(spec, ir, role)
            return dataclasses.replace(desc, dtype=gradient) if role in ("dq", "dk", "dv") else desc

        operands._describe_role = describe_role
        lowering._storage_types = lambda spec, cudnn: {**original_types(spec, cudnn), "bf16": cudnn.data_type.BFLOAT16}
        for precision in ("fp8", "bf16"):
            spec = AttentionSpec(b, t, t, n, n, h, h, "float8_e4m3fn" if precision == "fp8" else "bfloat16",
                                 h ** -0.5, is_causal=causal)
            if precision == "bf16" and gradient != "fp8_gradient":
                continue  # one bf16 row
            label = f"{precision} backward" + (f", gradients {gradient}" if precision == "fp8" else "")
            try:
                graph = new_graph(spec, "backward", cudnn)
                lowered = lower(graph, spec, None, "backward", cudnn)
                graph.build([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
                descs = describe(spec, None, "backward")
                types = dict(torch_types, io=torch_types["io"] if precision == "fp8" else torch.bfloat16)
                buffers = {}
                for role in lowered.operand_roles + lowered.result_roles:
                    d = descs[role]
                    x = torch.empty_strided(d.dims, d.strides, dtype=types[d.dtype], device="cuda")
                    if d.dtype == "float32" and d.dims == (1, 1, 1, 1):
                        x.fill_(1.0)
                    elif x.dtype.is_floating_point:
                        x.copy_(torch.from_numpy(np.random.default_rng(0).standard_normal(d.dims).astype(np.float32)))
                    buffers[role] = x
                pack = {lowered.uids[role]: buffers[role] for role in buffers}
                workspace = torch.empty(max(graph.get_workspace_size(), 1), dtype=torch.uint8, device="cuda")
                ms = cuda_event_ms(lambda: graph.execute(pack, workspace, handle=handle))
                print(f"| {label} | builds | {ms:.3f} ms |", flush=True)
            except Exception as error:  # noqa: BLE001 - a graph cuDNN declines is the finding
                print(f"| {label} | declined: {' '.join(str(error).split())[:200]} | |", flush=True)
            torch.cuda.empty_cache()
    operands._describe_role = original_describe
    lowering._storage_types = original_types
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
