"""NVIDIA's published cuDNN SDPA training figures (H200), reproduced, beside sdpagraph and jax's cuDNN
attention at the same shapes, in one run (issue 30 item 1). Needs a GPU (`--cpu`: a smoke run).

    python bench/published_cudnn.py [--out DIR] [--ts 16384,32768] [--masks full,causal]
                                    [--nvidia-dir .whl/cudnn_frontend_bench] [--budget 230] [--cpu]

The published figures: cudnn-frontend's `benchmark/sdpa_benchmark_training` (README charts
"H200 - Llama 3.1", CSV `results/h200_919_only_cudnn/llama3.1_20260227_034703.csv`, added in commit
df73764adb98b7445b77662ce07b1ea434c8f3ee, cudnn-frontend 1.19.0 on cuDNN 9.19.1): B1, 64 query heads,
8 key/value heads, head dim 128, bf16, T = S, top-left causal and no mask, the training forward (with
softmax stats) and the backward timed separately. See docs/published-cudnn.md.

Rows per config (what each measures; TFLOP/s always by NVIDIA's formula, `nvidia_flops`):
- nvidia-script: their own `benchmark_single_sdpa.py`, run as their runner runs it, when a copy is in
  --nvidia-dir (an ignored folder: third-party code is not committed here). Each file there named
  benchmark_single_sdpa*.py runs, under its own name.
- cudnn-fe: the same cuDNN graphs built here with the cudnn-frontend Python API, as their script builds
  them (torch tensors, heuristics A then FALLBACK, the first plan that builds, their layouts:
  `measure_cudnn_fe`); --fe-sdpagraph-layouts adds a row with sdpagraph's dO and stats layouts.
- sdpagraph: `sdpagraph.attention(..., implementation="cudnn")`.
- jax-cudnn: `jax.nn.dot_product_attention(..., implementation="cudnn")`.
Forward: the jitted `jax.vjp` (the training forward, which writes the softmax stats, as NVIDIA's does;
jax's plain primal runs its inference graph: `fwd_primal_loop_ms` in the JSON). Backward alone: the
jitted pullback of that `jax.vjp` (residuals are its arguments).

Timing modes:
- isolated: NVIDIA's method: before each call a 256 MiB L2 flush and an idle gap (10x the last call's
  time, at most 1 s, as their published script slept), the call under torch.profiler (CUPTI), its time
  the sum of the device times of the kernels their name filter keeps ("all kernels" in the JSON);
  median after one warm call. Without torch the call's wall time.
- loop: back-to-back steady state: JAX wall clock (bench/jax_timing.py), cuDNN-FE CUDA events
  (bench/cuda_timing.py).
The SM clock and power are sampled (nvidia-smi, every 100 ms) during each row's timed calls, the loop's
and the isolated calls' apart; `nvidia-smi -q -d CLOCK,POWER` before and after is in the JSON. Writes published.md / published.json to --out after every row.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # leave room for torch in the same run

import jax
import jax.numpy as jnp
import numpy as np

import sdpagraph

from cuda_timing import cuda_event_ms  # bench/ is on sys.path when a script here runs
from isolated_timing import ClockSampler, KernelTimer, smi_clock_power, smi_key_lines
from jax_timing import time_ms
import report
from report import markdown_table

B, N, K, H = 1, 64, 8, 128  # the published Llama 3.1 shape (T = S varies)
SOURCE = ("github.com/NVIDIA/cudnn-frontend, benchmark/sdpa_benchmark_training/results/h200_919_only_cudnn/"
          "llama3.1_20260227_034703.csv @ df73764 (frontend 1.19.0, cuDNN 9.19.1, NVIDIA H200)")
# (T, causal) -> (fwd ms, fwd TFLOP/s, bwd ms, bwd TFLOP/s), bf16 rows of that CSV.
PUBLISHED = {
    (32768, True): (25.566, 688, 75.688, 581), (32768, False): (50.769, 693, 153.841, 572),
    (16384, True): (6.531, 673, 19.002, 579), (16384, False): (12.524, 702, 35.947, 612),
    (8192, True): (1.708, 644, 5.083, 541), (8192, False): (3.182, 691, 9.262, 594),
    (4096, True): (0.465, 591, 1.450, 474), (4096, False): (0.819, 671, 2.453, 560),
    (2048, True): (0.142, 484, 0.464, 370), (2048, False): (0.217, 633, 0.681, 504),
}
NVIDIA_ITERATIONS = 10  # their runner's num_iterations (warm-up 0); their median skips the first 5
CPU_SHAPE = (1, 4, 2, 32)  # --cpu: B, N, K, H


def nvidia_flops(b, tq, tkv, n, d_qk, d_vo, causal, backward):
    """NVIDIA's count: 2 * b * n * (unmasked scores) * (d_qk + d_vo) forward, * (3 d_qk + 2 d_vo)
    backward; causal counts the top-left lower triangle, diagonal included (not exactly half)."""
    if causal:  # row i sees min(i + 1, tkv) keys
        scores = tq * (tq + 1) // 2 if tq <= tkv else tkv * (tkv + 1) // 2 + (tq - tkv) * tkv
    else:
        scores = tq * tkv
    return 2 * b * n * scores * ((3 * d_qk + 2 * d_vo) if backward else (d_qk + d_vo))


def tflops(flop, ms):
    return flop / ms / 1e9 if ms else None


# ------------------------------------------------------------------------------------- measurements
def config_name(t, causal):
    return f"B{B} T{t} N{N}/K{K} H{H} {'causal' if causal else 'full'}"


def jax_impls(causal, cpu):
    how = "xla" if cpu else "cudnn"
    return {
        "sdpagraph": lambda q, k, v: sdpagraph.attention(q, k, v, is_causal=causal, implementation=how, training=True),
        "jax-cudnn": lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation=how),
    }


def repeats_for(ms_estimate, target_ms=300.0):
    return max(2, min(30, int(target_ms / max(ms_estimate, 1e-3))))


def measure_jax(attn, t, timer, cpu, iterations, mark=lambda timing: None):
    """Forward and backward-alone times of one JAX implementation, loop and isolated; `mark(timing)`
    says which timing ("loop", "isolated") runs now (the clock sampler's phase)."""
    n, k, h = (CPU_SHAPE[1:] if cpu else (N, K, H))
    rng = np.random.default_rng(0)
    q, kk, v, do = (jnp.asarray(rng.standard_normal((B, t, heads, h)), jnp.bfloat16) for heads in (n, k, k, n))
    primal = jax.jit(attn)  # jax's primal runs its inference graph (no stats)
    with_pullback = jax.jit(lambda q, k, v: jax.vjp(attn, q, k, v))  # the training forward, as NVIDIA's fwd
    backward = jax.jit(lambda pullback, do: pullback(do))
    out = {}
    start = time.perf_counter()
    jax.block_until_ready(primal(q, kk, v))
    out["fwd_first_call_s"] = time.perf_counter() - start
    out["fwd_primal_loop_ms"] = time_ms(primal, q, kk, v, repeats=3, rounds=3)
    try:
        _, pullback = with_pullback(q, kk, v)
        bwd_args = (pullback, do)
        jax.block_until_ready(backward(*bwd_args))
        forward = with_pullback
    except Exception as error:  # noqa: BLE001 - fall back to the primal and fwd+bwd minus fwd
        out["pullback_error"] = f"{type(error).__name__}: {str(error)[:200]}"
        bwd_args, forward = None, primal
    for name, fn, args in (("fwd", forward, (q, kk, v)), ("bwd", backward, bwd_args)):
        if args is None:
            continue
        estimate = time_ms(fn, *args, repeats=1, rounds=1)
        mark("loop")
        out[f"{name}_loop_ms"] = time_ms(fn, *args, repeats=repeats_for(estimate), rounds=3)
        mark("isolated")
        out[f"{name}_isolated"] = timer.isolated(lambda: jax.block_until_ready(fn(*args)), name == "bwd", iterations,
                                                 gap=not cpu)
        mark(None)
    if bwd_args is None:  # the backward as the difference of fwd+bwd and fwd (loop only)
        loss = jax.jit(jax.grad(lambda q, k, v, do: jnp.sum(attn(q, k, v).astype(jnp.float32) * do),
                                argnums=(0, 1, 2)))  # dO an argument too, as a training step's
        both = time_ms(loss, q, kk, v, do, repeats=repeats_for(3.5 * out["fwd_loop_ms"]), rounds=3)
        out["bwd_loop_ms"] = both - out["fwd_loop_ms"]
        out["bwd_note"] = "fwd+bwd minus fwd"
    return out


def measure_cudnn_fe(t, causal, timer, iterations, sdpagraph_layouts=False, mark=lambda timing: None):
    """The cuDNN forward and backward graphs, built with the cudnn-frontend Python API the way NVIDIA's
    published script builds them, timed in both modes. Their layouts: q, k, v, o, dQ, dK, dV in (B, T, N, H)
    memory, dO (B, N, T, H) contiguous, stats in (B, T, N, 1) memory (their current script: (B, N, T, 1)).
    `sdpagraph_layouts`: dO in (B, T, N, H) and stats in (B, N, T, 1) memory instead, as sdpagraph's
    dense graphs take them (graphs/operands.py)."""
    import cudnn
    import torch

    bf16 = torch.bfloat16
    q = torch.randn(B, t, N, H, dtype=bf16, device="cuda").transpose(1, 2)  # (B, N, T, H) views of (B, T, N, H)
    k = torch.randn(B, t, K, H, dtype=bf16, device="cuda").transpose(1, 2)
    v = torch.randn(B, t, K, H, dtype=bf16, device="cuda").transpose(1, 2)
    o = torch.empty(B, t, N, H, dtype=bf16, device="cuda").transpose(1, 2)
    if sdpagraph_layouts:
        do = torch.randn(B, t, N, H, dtype=bf16, device="cuda").transpose(1, 2)
        stats = torch.empty(B, N, t, 1, dtype=torch.float32, device="cuda")
    else:
        do = torch.randn(o.shape, dtype=bf16, device="cuda")
        stats = torch.empty(B, t, N, 1, dtype=torch.float32, device="cuda").transpose(1, 2)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    align = cudnn.diagonal_alignment.TOP_LEFT
    bounds = dict(diagonal_alignment=align, diagonal_band_left_bound=None, diagonal_band_right_bound=0 if causal else None)

    def new_graph():
        return cudnn.pygraph(io_data_type=cudnn.data_type.BFLOAT16, intermediate_data_type=cudnn.data_type.FLOAT,
                             compute_data_type=cudnn.data_type.FLOAT)

    def finish(graph):
        graph.validate()
        graph.build_operation_graph()
        graph.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
        graph.check_support()
        graph.build_plans()
        info = {}
        try:
            index = getattr(graph, "_plan_index", 0)
            info = {"plan": graph.get_plan_name_at_index(index), "plan_index": index,
                    "plans": graph.get_execution_plan_count(),
                    "python_engine": getattr(getattr(graph, "selected_engine", None), "name", None)}
        except Exception as error:  # noqa: BLE001 - names are a diagnostic only
            info = {"plan_error": str(error)[:200]}
        return info

    fwd = new_graph()
    t_q, t_k, t_v = fwd.tensor_like(q), fwd.tensor_like(k), fwd.tensor_like(v)
    t_o, t_stats = fwd.sdpa(q=t_q, k=t_k, v=t_v, is_inference=False, attn_scale=H ** -0.5, **bounds)
    t_o.set_output(True).set_dim(o.size()).set_stride(o.stride())
    t_stats.set_output(True).set_dim(stats.size()).set_stride(stats.stride()).set_data_type(cudnn.data_type.FLOAT)
    out = {"fwd_graph": finish(fwd)}

    bwd = new_graph()
    b_q, b_k, b_v, b_o, b_do = (bwd.tensor_like(x) for x in (q, k, v, o, do))
    b_stats = bwd.tensor_like(stats)
    b_dq, b_dk, b_dv = bwd.sdpa_backward(q=b_q, k=b_k, v=b_v, o=b_o, dO=b_do, stats=b_stats, attn_scale=H ** -0.5,
                                         use_deterministic_algorithm=False, **bounds)
    for tensor, like in ((b_dq, dq), (b_dk, dk), (b_dv, dv)):
        tensor.set_output(True).set_dim(like.size()).set_stride(like.stride())
    out["bwd_graph"] = finish(bwd)

    workspace = torch.empty(max(fwd.get_workspace_size(), bwd.get_workspace_size()), dtype=torch.uint8, device="cuda")
    pack_fwd = {t_q: q, t_k: k, t_v: v, t_o: o, t_stats: stats}
    pack_bwd = {b_q: q, b_k: k, b_v: v, b_o: o, b_do: do, b_stats: stats, b_dq: dq, b_dk: dk, b_dv: dv}
    steps = {"fwd": lambda: fwd.execute(pack_fwd, workspace), "bwd": lambda: bwd.execute(pack_bwd, workspace)}
    for name, step in steps.items():  # the forward first: the backward reads its o and stats
        step()
        torch.cuda.synchronize()
        estimate = cuda_event_ms(step, warmup=1, repeats=1)
        mark("loop")
        out[f"{name}_loop_ms"] = cuda_event_ms(step, warmup=1, repeats=repeats_for(estimate), rounds=3)
        mark("isolated")
        out[f"{name}_isolated"] = timer.isolated(lambda: (step(), torch.cuda.synchronize()), name == "bwd", iterations)
        mark(None)
    return out  # its tensors go with this frame; main() empties torch's cache


def run_nvidia_script(path, t, causal, timeout=240):
    """Their script, as their runner calls it for the published CSV (`--fwd_bwd --skip_ref
    --format_output`, 10 iterations, no warm-up); the last line is their CSV row."""
    cmd = [sys.executable, path, "--batch_size", str(B), "--q_seqlen", str(t), "--kv_seqlen", str(t),
           "--num_q_heads", str(N), "--num_kv_heads", str(K), "--data_type", "bfloat16", "--sdpa_backend", "cudnn",
           "--attn_mask", "top_left" if causal else "no_mask", "--num_iterations", str(NVIDIA_ITERATIONS),
           "--num_warmup_iterations", "0", "--format_output", "--head_dim", str(H), "--fwd_bwd", "--skip_ref"]
    start = time.perf_counter()
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout} s", "command": " ".join(cmd)}
    result = {"command": " ".join(cmd), "wall_s": time.perf_counter() - start}
    lines = done.stdout.strip().splitlines()
    parts = lines[-1].split(",") if lines else []
    if done.returncode != 0 or len(parts) < 12:
        result["error"] = f"rc {done.returncode}: {(done.stdout + done.stderr)[-1500:]}"
        return result
    result.update(fwd_ms=float(parts[8]), bwd_ms=float(parts[9]), fwd_tflops_theirs=float(parts[10]),
                  bwd_tflops_theirs=float(parts[11]))
    return result


# -------------------------------------------------------------------------------------------- report
def versions(cpu):
    out = {"jax": jax.__version__, "device": jax.devices()[0].device_kind, "python": sys.version.split()[0]}
    try:
        import cudnn
        out.update(cudnn_frontend=cudnn.__version__, cudnn_backend=cudnn.backend_version())
    except Exception as error:  # noqa: BLE001
        out["cudnn"] = f"unavailable: {error}"
    if not cpu:
        try:
            import torch
            out.update(torch=torch.__version__, torch_cudnn=torch.backends.cudnn.version())
        except Exception as error:  # noqa: BLE001
            out["torch"] = f"unavailable: {error}"
        try:
            from jax._src.lib import cuda_versions
            out["jax_cudnn"] = cuda_versions.cudnn_get_version()
        except Exception:  # noqa: BLE001 - private; a diagnostic only
            pass
    return out


def row_for(config, impl, timing, fwd_ms, bwd_ms, t, causal, clocks=None, note="", cpu=False):
    n, h = (CPU_SHAPE[1], CPU_SHAPE[3]) if cpu else (N, H)
    fwd_tf = tflops(nvidia_flops(B, t, t, n, h, h, causal, False), fwd_ms)
    bwd_tf = tflops(nvidia_flops(B, t, t, n, h, h, causal, True), bwd_ms)
    published = PUBLISHED.get((t, causal))
    row = {"config": config, "impl": impl, "timing": timing, "fwd ms": fwd_ms, "fwd TFLOP/s": fwd_tf,
           "fwd / published": fwd_tf / published[1] if published and fwd_tf else None,
           "bwd ms": bwd_ms, "bwd TFLOP/s": bwd_tf,
           "bwd / published": bwd_tf / published[3] if published and bwd_tf else None}
    if clocks:
        row["SM MHz med/min"] = f"{clocks['sm_mhz_median']:.0f}/{clocks['sm_mhz_min']:.0f}"
        row["W max"] = clocks["power_w_max"]
    if note:
        row["note"] = note
    return {k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items()}


def add_vs_jax(rows):
    """jax-cudnn's time over each row's, per config and timing (the issue's target: >= 1.10 at T >= 16k)."""
    jax_rows = {(r["config"], r["timing"]): r for r in rows if r["impl"] == "jax-cudnn"}
    for r in rows:
        base = jax_rows.get((r["config"], r["timing"]))
        for p in ("fwd", "bwd"):
            if base and base.get(f"{p} ms") and r.get(f"{p} ms"):
                r[f"jax/this {p}"] = round(base[f"{p} ms"] / r[f"{p} ms"], 3)


def markdown(data):
    lines = [f"published: {SOURCE}; shape B{B} N{N}/K{K} H{H} bf16, T = S; TFLOP/s by NVIDIA's formula",
             "(2*B*N*scores*(Dqk+Dvo) fwd, *(3Dqk+2Dvo) bwd; causal scores = T(T+1)/2).",
             "timing: isolated = NVIDIA's method (L2 flush, idle gap, CUPTI kernel time of one call, median); "
             "loop = back-to-back steady state; nvidia-script = their benchmark_single_sdpa.py itself.",
             "", "versions: " + json.dumps(data["versions"]), ""]
    lines += [f"- {line}" for line in data.get("smi_before_key", [])]
    shown = [{k: ("" if v is None else v) for k, v in r.items()} for r in data["rows"]]
    lines += ["", markdown_table(shown), ""]
    published = [{"config": config_name(t, c), "fwd ms": f[0], "fwd TFLOP/s": f[1], "bwd ms": f[2],
                  "bwd TFLOP/s": f[3]} for (t, c), f in sorted(PUBLISHED.items()) if t in data["ts"]]
    if published:
        lines += ["published (H200, cuDNN 9.19.1):", "", markdown_table(published), ""]
    kernels = [{"config": k[0], "impl": k[1], "pass": k[2], "kernels (isolated call)": ", ".join(v)[:400]}
               for k, v in ((tuple(key.split("|")), v) for key, v in data["kernels"].items())]
    if kernels:
        lines += ["kernels:", "", markdown_table(kernels), ""]
    if data.get("skipped"):
        lines += ["skipped (budget or error): " + "; ".join(data["skipped"])]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------- main
def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=None)
    parser.add_argument("--ts", default="16384,32768", help="sequence lengths (T = S), comma-separated")
    parser.add_argument("--masks", default="full,causal")
    parser.add_argument("--nvidia-dir", default=".whl/cudnn_frontend_bench",
                        help="folder holding cudnn-frontend's benchmark_single_sdpa*.py (not in git)")
    parser.add_argument("--impls", default="nvidia-script,cudnn-fe,sdpagraph,jax-cudnn")
    parser.add_argument("--iterations", type=int, default=5, help="isolated calls timed per pass (after one warm call)")
    parser.add_argument("--budget", type=float, default=230.0, help="seconds: no new measurement starts after that")
    parser.add_argument("--fe-sdpagraph-layouts", action="store_true",
                        help="also a cudnn-fe row with sdpagraph's dO and stats layouts")
    parser.add_argument("--cpu", action="store_true", help="smoke run: tiny shapes, XLA attention, no cuDNN pieces")
    args = parser.parse_args()
    started = time.monotonic()
    cpu = args.cpu
    if not cpu and report.gpu_missing("bench/published_cudnn.py"):
        return 2
    ts = [128] if cpu else [int(x) for x in args.ts.split(",") if x]
    masks = [m.strip() == "causal" for m in args.masks.split(",") if m.strip()]
    impls = [i.strip() for i in args.impls.split(",")]
    if cpu:
        impls = [i for i in impls if i in ("sdpagraph", "jax-cudnn")]
    scripts = sorted(glob.glob(os.path.join(args.nvidia_dir, "benchmark_single_sdpa*.py"))) if "nvidia-script" in impls else []
    if "nvidia-script" in impls and not scripts and not cpu:
        print(f"no benchmark_single_sdpa*.py in {args.nvidia_dir}: the nvidia-script rows are skipped", file=sys.stderr)

    sampler = None if cpu else ClockSampler()
    smi_before = "" if cpu else smi_clock_power()
    data = {"versions": versions(cpu), "ts": ts, "rows": [], "raw": {}, "kernels": {}, "skipped": [],
            "smi_before": smi_before, "smi_before_key": smi_key_lines(smi_before),
            "nvidia_scripts": scripts, "published_source": SOURCE}
    timer = KernelTimer(use_torch=not cpu)

    def save():
        rows = data["rows"]
        add_vs_jax(rows)
        report.save(args.out, "published", markdown(data), data)

    def over_budget(what):
        if time.monotonic() - started > args.budget:
            data["skipped"].append(what)
            return True
        return False

    for t in ts:
        for causal in masks:
            config = config_name(t, causal) if not cpu else f"B{B} T{t} N{CPU_SHAPE[1]}/K{CPU_SHAPE[2]} H{CPU_SHAPE[3]} {'causal' if causal else 'full'} (cpu)"
            for script in scripts:
                label = "nvidia-script" + os.path.basename(script)[len("benchmark_single_sdpa"):-3]
                if over_budget(f"{config} {label}"):
                    continue
                phase = f"{config}|{label}"
                if sampler:
                    sampler.phase = phase
                result = run_nvidia_script(script, t, causal)
                if sampler:
                    sampler.phase = None
                data["raw"][phase] = result
                clocks = sampler.summary(phase) if sampler else None
                data["rows"].append(row_for(config, label, "nvidia-script", result.get("fwd_ms"), result.get("bwd_ms"),
                                            t, causal, clocks, result.get("error", "")[:120]))
                print(json.dumps(data["rows"][-1]), flush=True)
                save()
            pieces = []
            if "cudnn-fe" in impls and not cpu:
                pieces.append(("cudnn-fe", lambda mark: measure_cudnn_fe(t, causal, timer, args.iterations, mark=mark)))
                if args.fe_sdpagraph_layouts:
                    pieces.append(("cudnn-fe, sdpagraph layouts",
                                   lambda mark: measure_cudnn_fe(t, causal, timer, args.iterations, True, mark=mark)))
            for name, attn in jax_impls(causal, cpu).items():
                if name in impls:
                    pieces.append((name, lambda mark, attn=attn: measure_jax(attn, t, timer, cpu, args.iterations,
                                                                             mark=mark)))
            for name, measure in pieces:
                if over_budget(f"{config} {name}"):
                    continue
                phase = f"{config}|{name}"

                def mark(timing, phase=phase):  # samples of the loop and of the isolated calls apart
                    if sampler:
                        sampler.phase = None if timing is None else f"{phase}|{timing}"
                try:
                    result = measure(mark)
                except Exception as error:  # noqa: BLE001 - record and go on with the rest
                    result = {"error": f"{type(error).__name__}: {str(error)[:300]}"}
                if name.startswith("cudnn-fe"):
                    import torch
                    torch.cuda.empty_cache()
                mark(None)
                data["raw"][phase] = result
                clocks = {timing: sampler.summary(f"{phase}|{timing}") if sampler else None
                          for timing in ("isolated", "loop")}
                iso = {p: result.get(f"{p}_isolated") or {} for p in ("fwd", "bwd")}
                for p in ("fwd", "bwd"):
                    if iso[p].get("kernels"):
                        data["kernels"][f"{config}|{name}|{p}"] = iso[p]["kernels"]
                method = iso["fwd"].get("method") or iso["fwd"].get("error") or ""
                data["rows"].append(row_for(config, name, "isolated", iso["fwd"].get("ms"), iso["bwd"].get("ms"), t,
                                            causal, clocks["isolated"],
                                            result.get("error", "") or ("" if method == "cupti" else method), cpu))
                data["rows"].append(row_for(config, name, "loop", result.get("fwd_loop_ms"), result.get("bwd_loop_ms"), t,
                                            causal, clocks["loop"], result.get("bwd_note", ""), cpu))
                for r in data["rows"][-2:]:
                    print(json.dumps(r), flush=True)
                save()
    if sampler:
        sampler.stop()
    if not cpu:
        data["smi_after"] = smi_clock_power()
        data["smi_after_key"] = smi_key_lines(data["smi_after"])
    data["wall_s"] = time.monotonic() - started
    save()
    print(markdown(data))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
