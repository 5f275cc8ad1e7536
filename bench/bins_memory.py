"""Memory of packed documents with a score_mod under `jax.grad`, binned and not. Needs a GPU.

    python bench/bins_memory.py [--out DIR] [--case INDEX] [--cpu] [--layers L]

A binned call (`graphs.binning`) runs its bins' graphs inside a `lax.cond` whose other branch is the
unbinned call (the dense twin over whole rows), for rows whose documents do not fit the bins. Under
`jax.grad` XLA keeps what either branch's backward needs; the unbinned branch keeps its residuals in
the bins' shapes so that the two share them (`packed._in_bin_shapes`). This measures it, for one
case of bench/packed.py (default: B8 T8192, documents of 64-2048 tokens, softcap 30, causal): the jitted gradient of sum(attention) in q, k and v, with the ids as a
jit argument, each variant in a fresh process:
- `bins, hint`: the case's `max_seqlen_kv` hint (bins of that size);
- `bins, no hint`: planned without it;
- `bins off` (`SDPAGRAPH_BINS=0`): the dense twin alone;
- `no documents`: the same shapes, causal softcap over whole rows, no segment ids.
For each: XLA's account of the compiled step (arguments, outputs, temporaries: `memory_analysis`),
the device's peak after one step (inputs included) and the step's time. `--cpu` runs the XLA backend
on the CPU on the first row's first 1024 tokens (the script's own check; no bins there).

`--layers L` measures a model instead: L layers, each projecting the (B, T, N·H) activations to q, k
and v, attending and projecting back with a residual add, differentiated in the activations and the
weights. There q, k and v are made inside the step, as in training: the single call's arguments stay
allocated beside the bins' copies of them, a model's need not.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax
import jax.numpy as jnp

VARIANTS = {  # label: (with the case's ids, with its hint, SDPAGRAPH_BINS)
    "bins, hint": (True, True, "1"),
    "bins, no hint": (True, False, "1"),
    "bins off (dense twin)": (True, True, "0"),
    "no documents": (False, False, "1"),
}
CHILD = "import sys; sys.path.insert(0, sys.argv[1]); import bins_memory; bins_memory.child(sys.argv[-1])"


def child(request: str) -> None:
    """One variant in this (fresh) process; prints `RESULT {json}`."""
    import packed  # bench/packed.py: the cases and their inputs
    from jax_timing import time_ms

    import sdpagraph

    request = json.loads(request)
    with_ids, hinted, _ = VARIANTS[request["label"]]
    index, cpu = request["case"], request["cpu"]
    _, q, k, v, seg, max_segments = packed.case_inputs(index)
    if cpu:  # a small slice: the script's own check, not a measurement
        q, k, v, seg = (x[:1, :1024] for x in (q, k, v, seg))
    _, _, mod, hint = packed.CASES[index]
    kwargs = dict(is_causal=True, score_mod=packed.softcap if mod else None,
                  implementation="xla" if cpu else "cudnn")
    if with_ids:
        kwargs.update(max_segments_per_seq=max_segments, max_seqlen_kv=hint if hinted else None)
        attend = lambda q, k, v, seg: sdpagraph.attention(q, k, v, segment_ids=seg, **kwargs)  # noqa: E731
    else:
        attend = lambda q, k, v, seg: sdpagraph.attention(q, k, v, **kwargs)  # noqa: E731
    layers = request.get("layers", 0)
    if layers:  # the model makes its own q, k and v: these would stay allocated beside them
        shape, dtype = q.shape, q.dtype
        del q, k, v
        step, args = model_step(attend, layers, shape, dtype, seg)
    else:
        step, args = packed.jitted(attend, backward=True), (q, k, v, seg)
    compiled = step.lower(*args).compile()
    stats = compiled.memory_analysis()
    device = jax.devices()[0]
    in_use = (device.memory_stats() or {}).get("bytes_in_use")
    jax.block_until_ready(compiled(*args))
    peak = (device.memory_stats() or {}).get("peak_bytes_in_use")
    result = {"ms": time_ms(compiled, *args, repeats=3 if cpu else 10, rounds=2 if cpu else 5),
              "inputs": in_use, "peak": peak}
    if stats is not None:
        result.update(arguments=stats.argument_size_in_bytes, outputs=stats.output_size_in_bytes,
                      temp=stats.temp_size_in_bytes)
    print("RESULT " + json.dumps(result), flush=True)


def model_step(attend, layers: int, shape, dtype, seg):
    """(the jitted gradient of a `layers`-layer model in its activations and weights, its arguments):
    activations (B, T, N·H) for q's `shape` (B, T, N, H) and `dtype`, weights drawn at 1/sqrt(N·H)."""
    batch, length, heads, dim = shape
    width = heads * dim
    keys = jax.random.split(jax.random.key(0), 2 * layers + 1)
    draw = lambda key, size: (jax.random.normal(key, size) / width ** 0.5).astype(dtype)  # noqa: E731
    weights = [(draw(keys[2 * i], (width, 3 * width)), draw(keys[2 * i + 1], (width, width))) for i in range(layers)]
    x = jax.random.normal(keys[-1], (batch, length, width)).astype(dtype)

    def loss(x, weights, seg):
        for w_in, w_out in weights:
            q, k, v = jnp.split((x @ w_in).reshape(batch, length, 3 * heads, dim), 3, axis=2)
            x = x + attend(q, k, v, seg).reshape(batch, length, width) @ w_out
        return jnp.sum(x.astype(jnp.float32))

    return jax.jit(jax.grad(loss, argnums=(0, 1))), (x, weights, seg)


def gib(value) -> str:
    return "" if value is None else f"{value / 2**30:.3f}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=".")
    parser.add_argument("--case", type=int, default=3, help="the index of bench/packed.py's CASES")
    parser.add_argument("--cpu", action="store_true")
    parser.add_argument("--layers", type=int, default=0, help="measure a model of this many layers (module docstring)")
    args = parser.parse_args()
    from child import run_child
    import packed

    bench = os.path.dirname(os.path.abspath(__file__))
    env = {"JAX_PLATFORMS": "cpu"} if args.cpu else {}
    name = packed.CASES[args.case][0]
    what = (f"a {args.layers}-layer model (projections, attention, residual adds), jitted grad of its sum in the "
            f"activations and weights" if args.layers else "jitted grad of sum(attention) in q, k, v")
    lines = [f"{name}, N{packed.N} H{packed.H} bf16, {what}, ids a jit argument; "
             f"{jax.devices()[0].device_kind if not args.cpu else 'CPU'}, jax {jax.__version__}", "",
             "| variant | ms | XLA args GiB | XLA outputs GiB | XLA temp GiB | in use before the step GiB | "
             "peak after one step GiB |", "|---|---:|---:|---:|---:|---:|---:|"]
    for label, (_, _, bins) in VARIANTS.items():
        request = json.dumps({"label": label, "case": args.case, "cpu": args.cpu, "layers": args.layers})
        try:
            row = run_child(CHILD, [bench, request], env={**env, "SDPAGRAPH_BINS": bins}, timeout=600, label=label)
        except RuntimeError as error:
            lines.append(f"| {label} | failed: {' '.join(str(error).split())[-160:]} | | | | | |")
            continue
        lines.append(f"| {label} | {row['ms']:.3f} | {gib(row.get('arguments'))} | {gib(row.get('outputs'))} | "
                     f"{gib(row.get('temp'))} | {gib(row.get('inputs'))} | {gib(row.get('peak'))} |")
        print(lines[-1], flush=True)
    text = "\n".join(lines)
    print(text)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"bins_memory{'-layers' if args.layers else ''}.md"), "w") as handle:
        handle.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    raise SystemExit(main())
