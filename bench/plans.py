"""Time every cuDNN plan of the graphs sdpagraph builds, and a few ways to write the same mod.
Needs a GPU and torch (for buffers and CUDA events).

    python bench/plans.py [--out DIR] [--shape B,T,N,H]

Answers three questions for softcap(30)+causal at bf16 B4 T4096 N16 H128 (and times the plans of a
context-parallel window's two calls at the shapes given): does the heuristic's
first plan (what `graphs.builder` keeps) win, and which formulation of the mod (mask in the
bprop or not, divide or multiply by the cap, -inf or a finite mask value) runs fastest? Does any plan
of a causal graph with dropout come near the plain causal graph? The
baselines are causal with cuDNN's native flag and the causal mask lowered into a mod.
Each graph is lowered by `graphs.lowering` exactly as the runtime does, then every plan
of heuristics A, B and FALLBACK is built and timed (CUDA events, mean of 20 runs).
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

import numpy as np

from sdpagraph import mods
from sdpagraph.graphs import lowering as lowering_module
from sdpagraph.graphs.lowering import lower, new_graph
from sdpagraph.graphs.mod_lowering import ModEmitter
from sdpagraph.graphs.operands import describe
from sdpagraph.call import prepare_call

from cuda_timing import cuda_event_ms  # bench/ is on sys.path when a script here runs

CAP = 30.0
SWEEP_SECONDS = 75  # per graph: building a plan compiles its kernel (seconds each for mods)


def _typed(tensor, name="FLOAT"):
    return tensor.set_data_type(name)


def softcap_mul(with_causal: bool, mask_in_bprop: bool, masked_value: float):
    """softcap by multiplying with 1/cap, optionally with the causal mask inside the user's mod."""
    pre_tensors = []

    def fn(g, s, t):
        pre = _typed(g.mul(a=s, b=t["inv_cap"]))
        pre_tensors[:] = [pre]
        out = _typed(g.mul(a=_typed(g.tanh(input=pre)), b=t["cap"]))
        if with_causal:
            q, k = mods.positions(g, s)
            keep = _typed(g.cmp_le(input=k, comparison=q), "BOOLEAN")
            pre_tensors.append(keep)
            out = _typed(g.binary_select(input0=out, input1=masked_value, mask=keep))
        return out

    def bprop(g, ds, t):
        if with_causal and mask_in_bprop:
            ds = _typed(g.binary_select(input0=ds, input1=0.0, mask=pre_tensors[1]))
        grad = _typed(g.tanh_backward(loss=_typed(g.mul(a=ds, b=t["cap"])), input=pre_tensors[0]))
        return _typed(g.mul(a=grad, b=t["inv_cap"]))

    return fn, bprop, {"cap": CAP, "inv_cap": 1.0 / CAP}


def causal_ge(softcap: bool):
    """The causal mask in the operand order of cuDNN's own (pre-9.21) diagonal band mask:
    `row >= col`, then select(score, -inf)."""

    def fn(g, s, t):
        if softcap:
            s = mods.softcap(CAP)(g, s, {"cap": t["cap"]})
        q, k = mods.positions(g, s)
        keep = _typed(g.cmp_ge(input=q, comparison=k), "BOOLEAN")
        return _typed(g.binary_select(input0=s, input1=float("-inf"), mask=keep))

    return dict(score_mod=fn, score_mod_tensors={"cap": CAP} if softcap else {})


def causal_ge_bprop(softcap: bool, bprop_mask: str):
    """causal_ge with an explicit bprop: `bprop_mask` "none" (masked scores get P = 0, so dS is 0
    there anyway) or "own" (the bprop compares fresh row/col indices itself)."""
    saved = {}

    def fn(g, s, t):
        if softcap:
            saved["pre"] = _typed(g.div(a=s, b=t["cap"]))
            s = _typed(g.mul(a=_typed(g.tanh(input=saved["pre"])), b=t["cap"]))
        q, k = mods.positions(g, s)
        keep = _typed(g.cmp_ge(input=q, comparison=k), "BOOLEAN")
        return _typed(g.binary_select(input0=s, input1=float("-inf"), mask=keep))

    def bprop(g, ds, t):
        if bprop_mask == "own":
            q, k = mods.positions(g, ds)
            ds = _typed(g.binary_select(input0=ds, input1=0.0, mask=_typed(g.cmp_ge(input=q, comparison=k), "BOOLEAN")))
        if softcap:
            ds = _typed(g.tanh_backward(loss=_typed(g.mul(a=ds, b=t["cap"])), input=saved["pre"]))
            ds = _typed(g.div(a=ds, b=t["cap"]))
        return ds

    return dict(score_mod=fn, score_mod_bprop=bprop, score_mod_tensors={"cap": CAP} if softcap else {})


class UntypedIndexEmitter(ModEmitter):
    """gen_index without a compute type, as cuDNN's own masks emit it."""

    def _apply(self, graph, node, operands):
        if node.op != "gen_index":
            return super()._apply(graph, node, operands)
        result = graph.gen_index(input=operands[0], axis=node.attr("axis"))
        result.set_data_type(self._types[node.dtype])
        return result


def cases():
    """name -> keyword arguments of `attention` (score_mod, score_mod_bprop, score_mod_tensors)."""
    identity = lambda g, s, t: s  # noqa: E731 - the spec's causal mask is then lowered into the mod
    table = {
        "causal, native flag": dict(is_causal=True),
        "causal, dropout 0.1": dict(is_causal=True, dropout=0.1),
        "causal in the mod (-inf, scoremod.masks)": dict(is_causal=True, score_mod=identity),
        "mods.causal() (-1e30)": dict(score_mod=mods.causal()),
        "softcap, no mask": dict(score_mod=mods.softcap(CAP)),
        "softcap + causal [runtime form]": dict(is_causal=True, score_mod=mods.softcap(CAP)),
        "compose(softcap, causal) (-1e30)": dict(score_mod=mods.compose(mods.softcap(CAP), mods.causal())),
        # A context-parallel window's halo part (`parallel.halo_split`; --shape 1,1024,16,128 for a window of
        # 1024) and its local part (--shape 1,16384,16,128 at T32768 over 2 devices)
        "halo band (0, unbounded), no causal mask": dict(local_window_size=(0, -1)),
        "causal window (1024, 0)": dict(is_causal=True, local_window_size=(1024, 0)),
    }
    table["causal row>=col"] = causal_ge(False)
    table["causal row>=col, untyped gen_index"] = dict(causal_ge(False), emitter=UntypedIndexEmitter)
    for which in ("none", "own"):
        table[f"causal row>=col, bprop mask {which}"] = causal_ge_bprop(False, which)
        table[f"softcap + causal row>=col, bprop mask {which}"] = causal_ge_bprop(True, which)
    table["softcap + causal row>=col"] = causal_ge(True)
    table["softcap + causal row>=col, untyped gen_index"] = dict(causal_ge(True), emitter=UntypedIndexEmitter)
    for label, with_mask_bprop, masked in (("mask in bprop", True, float("-inf")),
                                           ("no mask in bprop", False, float("-inf")),
                                           ("no mask in bprop, -1e30", False, -1e30)):
        fn, bprop, tensors = softcap_mul(True, with_mask_bprop, masked)
        table[f"softcap*(1/cap) + causal, {label}"] = dict(score_mod=fn, score_mod_bprop=bprop,
                                                          score_mod_tensors=tensors)
    return table


def buffers(torch, descs, roles, rng):
    types = {"io": torch.bfloat16, "float32": torch.float32, "int32": torch.int32}
    out = {}
    for role in roles:
        d = descs[role]
        t = torch.empty_strided(d.dims, d.strides, dtype=types[d.dtype], device="cuda")
        if d.dtype == "io":
            t.copy_(torch.from_numpy(rng.standard_normal(d.dims).astype(np.float32)))
        out[role] = t
    return out


def sweep_knobs(graph, limit):
    """Append to the graph's plans the first plan's engine with each of its knobs set to 0..limit-1 in
    turn (the others as the heuristic chose them): the kernel configurations no heuristic offers."""
    engine, knobs = graph.get_engine_and_knobs_at_index(0)
    for knob, chosen in knobs.items():
        for value in range(limit):
            if value != chosen:
                try:
                    graph.create_execution_plan(engine, {**knobs, knob: value})
                except Exception:  # noqa: BLE001 - a value the engine does not take
                    pass


def time_plans(torch, cudnn, handle, call, direction, pack_extra, rng, only_first=False, emitter=ModEmitter,
               sweep=0):
    """[(index, plan name, workspace MB, ms or error)] for every plan of the graph (and, with `sweep`,
    of the first plan's engine at every value below it of each of its knobs)."""
    spec, ir = call.spec, call.score_mod
    graph = new_graph(spec, direction, cudnn)
    lowering_module.ModEmitter = emitter
    try:
        lowering = lower(graph, spec, ir, direction, cudnn)
    finally:
        lowering_module.ModEmitter = ModEmitter
    descs = describe(spec, ir, direction)
    graph.validate()
    graph.build_operation_graph()
    graph.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.B, cudnn.heur_mode.FALLBACK])
    graph.check_support()
    offered = graph.get_execution_plan_count()
    if sweep:
        sweep_knobs(graph, sweep)
    bufs = buffers(torch, descs, [r for r in lowering.operand_roles if r not in pack_extra], rng)
    bufs.update(pack_extra)
    bufs.update(buffers(torch, descs, lowering.result_roles, rng))
    pack = {lowering.uids[role]: bufs[role] for role in lowering.operand_roles + lowering.result_roles}
    scalars = {**call.inputs.mod_scalars}
    for uid, (kind, source), dtype in lowering.pass_by_value:  # host tensors: pass-by-value
        value = scalars[source] if kind == "scalar" else source
        pack[uid] = torch.full((1, 1, 1, 1), value, dtype=getattr(torch, dtype))
    rows = []
    swept = range(offered, graph.get_execution_plan_count())
    deadline = time.perf_counter() + SWEEP_SECONDS
    for index in [*range(1 if only_first else offered), *swept]:
        name = graph.get_plan_name_at_index(index)
        if index >= offered and time.perf_counter() > deadline:
            rows.append((index, name, None, f"not built: the sweep's {SWEEP_SECONDS} s were spent"))
            continue
        try:
            graph.build_plan_at_index(index)
            if graph.selected_engine is not None:
                rows.append((index, name, None, "python engine (not exportable)"))
                continue
            size = graph.get_workspace_size_plan_at_index(index)
            workspace = torch.empty(max(size, 1), dtype=torch.uint8, device="cuda")
            run = lambda: graph.execute_plan_at_index(pack, workspace, index=index, handle=handle)  # noqa: E731
            rows.append((index, name, size / 2**20, cuda_event_ms(run)))
        except Exception as error:  # noqa: BLE001 - a plan that does not build is a finding
            rows.append((index, name, None, "declined: " + " ".join(str(error).split())[:80]))
    return rows, bufs


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default=".")
    parser.add_argument("--shape", default="4,4096,16,128")
    parser.add_argument("--only", default="", help="formulations to run, separated by ';' (default: all)")
    parser.add_argument("--first-plan", action="store_true", help="time only the heuristic's first plan")
    parser.add_argument("--sweep-knobs", type=int, default=0, metavar="N",
                        help="also time the first plan's engine with each knob at 0..N-1")
    args = parser.parse_args()
    import jax
    import torch
    import cudnn

    B, T, N, H = (int(x) for x in args.shape.split(","))
    shape = jax.ShapeDtypeStruct((B, T, N, H), "bfloat16")
    handle = cudnn.create_handle()
    rng = np.random.default_rng(0)
    lines = [f"bf16 B{B} T{T} N{N} H{H}, every plan of heuristics A+B+FALLBACK, mean of 20 runs, "
             f"{torch.cuda.get_device_name()}, cuDNN {cudnn.backend_version()}, frontend {cudnn.__version__}, "
             f"{time.strftime('%Y-%m-%d')}", "",
             "| formulation | direction | plan | name | workspace MB | ms |", "|---|---|---|---|---|---|"]
    selected = [name.strip() for name in args.only.split(";")] if args.only else None
    for label, kwargs in cases().items():
        if selected and label not in selected:
            continue
        kwargs = dict(kwargs)
        emitter = kwargs.pop("emitter", ModEmitter)
        dropout = kwargs.pop("dropout", 0.0)  # the graph's rate (its seed and offset buffers hold any value)
        call = prepare_call(shape, shape, shape, **kwargs)
        call = dataclasses.replace(call, spec=dataclasses.replace(call.spec, dropout=dropout))
        for direction in ("forward", "backward"):
            extra = {}
            if direction == "backward":  # o and stats from the forward graph's first plan
                _, fwd = time_plans(torch, cudnn, handle, call, "forward", {}, rng, only_first=True, emitter=emitter)
                extra = {"o": fwd["o"], "stats": fwd["stats"]}
            try:
                rows, _ = time_plans(torch, cudnn, handle, call, direction, extra, rng, only_first=args.first_plan,
                                     emitter=emitter, sweep=args.sweep_knobs)
            except Exception as error:  # noqa: BLE001
                rows = [("-", "-", None, "graph declined: " + " ".join(str(error).split())[:100])]
            for index, name, ws, ms in rows:
                ms_text = f"{ms:.3f}" if isinstance(ms, float) else ms
                ws_text = f"{ws:.1f}" if ws is not None else ""
                lines.append(f"| {label} | {direction} | {index} | {name} | {ws_text} | {ms_text} |")
                print(lines[-1], flush=True)
            torch.cuda.empty_cache()
    text = "\n".join(lines)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "plans.md"), "w") as f:
        f.write(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
