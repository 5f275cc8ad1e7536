"""Where the time of a call on bins goes (`graphs.binning`, `backends.cudnn.bins.packed`), and what the bins'
slack costs. Needs a GPU.

    python bench/probe_bins.py [--out DIR]

Per case (bf16, N16 H128, softcap 30 + causal, packed documents, `max_seqlen_kv` hint): the bins the
documents need; the binned call's forward and forward+backward at several bin counts (the plan's
`bins` is BIN_SLACK times the tokens' worth, plus one); and, at the plan's count, the forward's
parts timed alone: the layout (numbering, sorting and packing the documents), the moves of q, k, v
into the bins, cuDNN's dense twin on the bins, and the move of the output back.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math

import jax
import jax.numpy as jnp
import numpy as np

from sdpagraph.graphs.binning import bin_plan
from sdpagraph.backends.cudnn import backend as cudnn
from sdpagraph.backends.cudnn.bins import packed as packed_bins
from sdpagraph.call import prepare_call

import report  # bench/ is on sys.path when a script here runs
from jax_timing import time_ms
from packed import random_docs, softcap

N, H = 16, 128
CASES = [("B8 T8192, docs 64-2048", lambda: random_docs(8, 8192, 64, 2048), 2048),
         ("B4 T8192, docs 64-512", lambda: random_docs(4, 8192, 64, 512, seed=1), 512)]
SLACKS = (1.05, 1.1, 1.2)


def with_bins(plan, bins):
    return dataclasses.replace(plan, bins=bins, spec=dataclasses.replace(plan.spec, batch=bins))


def with_ids(inputs, ids):
    """`inputs` with `ids` as the self-attention segment ids."""
    return dataclasses.replace(inputs, q_segment_ids=ids, kv_segment_ids=ids)


def run(out_dir):
    rows = []
    for name, make_ids, hint in CASES:
        ids = jnp.asarray(make_ids())
        B, T = ids.shape
        rng = np.random.default_rng(1)
        q, k, v = (jnp.asarray(rng.standard_normal((B, T, N, H)), jnp.bfloat16) for _ in range(3))
        call = prepare_call(q, k, v, is_causal=True, segment_ids=ids, score_mod=softcap, max_seqlen_kv=hint)
        plan = bin_plan(call.spec, call.score_mod)
        layout = packed_bins.lay_out(ids, plan, call.spec.max_segments, False)
        needed = int(jnp.max(jnp.where(layout.dest < plan.bins * plan.rows, layout.dest // plan.rows, -1))) + 1
        base = B * T / plan.rows
        row = {"case": name, "rows": plan.rows, "plan bins": plan.bins, "needed bins": needed,
               "needed / tokens' worth": needed / base}
        for backward in (False, True):
            run_call = functools.partial(cudnn._attention, score_mod=call.score_mod, training=backward, verify=None)
            for slack in SLACKS:
                bins = math.ceil(slack * base) + 1
                p = with_bins(plan, bins)
                # the ids are an argument, as in a training step: the layout is computed on the device each call
                fn = lambda q, k, v, ids, p=p: packed_bins.attention(  # noqa: E731
                    p, call.spec, q, k, v, with_ids(call.inputs, ids), run_call)[0]
                if backward:
                    fn = jax.grad(lambda q, k, v, ids, f=fn: jnp.sum(f(q, k, v, ids).astype(jnp.float32)),
                                  argnums=(0, 1, 2))
                label = f"{'fwd+bwd' if backward else 'fwd'} ms at {bins} bins"
                row[label] = time_ms(jax.jit(fn), q, k, v, ids)
        run_call = functools.partial(cudnn._attention, score_mod=call.score_mod, training=False, verify=None)
        # each part timed alone, the layout's arrays passed as arguments (dest, source, bin ids, fits)
        parts = dataclasses.astuple(layout)
        to_bins = jax.jit(lambda q, k, v, parts: tuple(packed_bins.to_bins(x, type(layout)(*parts), plan)
                                                      for x in (q, k, v)))
        binned = to_bins(q, k, v, parts)
        inner = jax.jit(lambda q, k, v, bin_ids: run_call(plan.spec, q, k, v, with_ids(call.inputs, bin_ids))[0])
        out_bins = inner(*binned, layout.bin_ids)
        back = jax.jit(lambda o, dest, source: packed_bins._move(o.reshape((-1,) + o.shape[2:]), dest, source))
        row.update({
            "layout ms": time_ms(jax.jit(lambda ids: dataclasses.astuple(
                packed_bins.lay_out(ids, plan, call.spec.max_segments, False))), ids),
            "q, k, v into bins ms": time_ms(to_bins, q, k, v, parts),
            "cuDNN on bins ms": time_ms(inner, *binned, layout.bin_ids),
            "output back ms": time_ms(back, out_bins, layout.dest, layout.source),
        })
        rows.append(row)
        print(json.dumps(row), flush=True)
    lines = []
    for row in rows:
        lines += [f"### {row['case']}", "", "| measure | value |", "|---|---|"]
        lines += [f"| {key} | {value:.3f} |" if isinstance(value, float) else f"| {key} | {value} |"
                  for key, value in row.items() if key != "case"]
        lines.append("")
    report.write(out_dir, "probe_bins", "bf16 N16 H128 softcap30 + causal, packed documents", "\n".join(lines), rows)


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default=".")
    args = parser.parse_args()
    if report.gpu_missing("bench/probe_bins.py"):
        return 2
    run(args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
