"""Probe: does cuDNN (this machine's version) run packed (THD, ragged) attention with a score_mod,
and how fast, against the dense layout? Needs a GPU, torch and the cudnn frontend.

    python bench/probe_thd_mod.py

Packed documents of random lengths in rows of T tokens; each document is one ragged sequence of
at most LMAX tokens (the graph is built for LMAX, not T). Variants, forward only:
  native T    no mod: causal flag + padding mask, graph length T (sdpagraph's packed path today)
  native      the same, graph length LMAX (a max_seqlen hint)
  mod+pad     softcap and causal in the mod, padding mask flag on as well
  mod         softcap and causal in the mod; padding as `kv_idx < len[seq]` in the mod
  dense twin  the whole rows, softcap and causal in the mod, documents by segment bounds (today's
              path for a packed call with a softcap)
Prints, per variant: build ok or the error, the relative error of the real tokens against a
float32 torch reference, and the time.
"""
import time

import cudnn
import numpy as np
import torch

from cuda_timing import cuda_event_ms  # bench/ is on sys.path when a script here runs

BF, F, I32, BOOL = cudnn.data_type.BFLOAT16, cudnn.data_type.FLOAT, cudnn.data_type.INT32, cudnn.data_type.BOOLEAN
B, T, N, H, LMAX, CAP = 4, 8192, 16, 128, 2048, 30.0
SCALE = H ** -0.5
handle = cudnn.create_handle()


def docs(rng):
    lengths = []
    for _ in range(B):
        row, left = [], T
        while left > 0:
            length = min(int(rng.integers(64, LMAX + 1)), left)
            row.append(length)
            left -= length
        lengths.append(row)
    return lengths


def typed(t, dtype):
    t.set_data_type(dtype)
    return t


def positions(g, score):
    q = typed(g.gen_index(input=score, axis=2, compute_data_type=I32), I32)
    k = typed(g.gen_index(input=score, axis=3, compute_data_type=I32), I32)
    return q, k


def softcap_causal(g, score, tensors, kv_len=None):
    pre = typed(g.div(a=score, b=tensors["cap"], compute_data_type=F), F)
    x = typed(g.mul(a=typed(g.tanh(input=pre), F), b=tensors["cap"], compute_data_type=F), F)
    q, k = positions(g, score)
    keep = typed(g.cmp_ge(input=q, comparison=k, compute_data_type=BOOL), BOOL)
    x = g.binary_select(input0=x, input1=tensors["neg"], mask=keep)
    if kv_len is not None:
        inside = typed(g.cmp_lt(input=k, comparison=kv_len, compute_data_type=BOOL), BOOL)
        x = g.binary_select(input0=x, input1=tensors["neg"], mask=inside)
    return x


def scalar(g, name):
    return g.tensor(name=name, dim=[1, 1, 1, 1], stride=[1, 1, 1, 1], data_type=F, is_pass_by_value=True)


def run_thd(variant, q, k, v, lengths, length=LMAX):
    seqs = sum(len(r) for r in lengths)
    flat = [length for row in lengths for length in row]
    starts = np.concatenate([[0], np.cumsum(flat)]).astype(np.int32)
    offsets = torch.from_numpy(starts * N * H).reshape(-1, 1, 1, 1).cuda()
    seq_len = torch.tensor(flat, dtype=torch.int32).reshape(-1, 1, 1, 1).cuda()
    g = cudnn.pygraph(io_data_type=BF, intermediate_data_type=F, compute_data_type=F, handle=handle)
    off = g.tensor(name="off", dim=[seqs + 1, 1, 1, 1], stride=[1, 1, 1, 1], data_type=I32)
    dims, strides = [seqs, N, length, H], [length * N * H, H, N * H, 1]
    tq, tk, tv = (g.tensor(name=n, dim=dims, stride=strides, data_type=BF) for n in "qkv")
    for t in (tq, tk, tv):
        t.set_ragged_offset(off)
    lens = g.tensor(name="lens", dim=[seqs, 1, 1, 1], stride=[1, 1, 1, 1], data_type=I32)
    tensors = {"cap": scalar(g, "cap"), "neg": scalar(g, "neg")}
    options = dict(attn_scale=SCALE, generate_stats=False)
    if variant.startswith("native"):
        options.update(use_padding_mask=True, seq_len_q=lens, seq_len_kv=lens,
                       diagonal_alignment=cudnn.diagonal_alignment.TOP_LEFT, diagonal_band_right_bound=0)
    elif variant == "mod+pad":
        options.update(use_padding_mask=True, seq_len_q=lens, seq_len_kv=lens,
                       score_mod=lambda gg, s: softcap_causal(gg, s, tensors))
    else:
        options.update(score_mod=lambda gg, s: softcap_causal(gg, s, tensors, kv_len=lens))
    options.update(max_total_seq_len_q=B * T, max_total_seq_len_kv=B * T)
    o, _ = g.sdpa(name="sdpa", q=tq, k=tk, v=tv, **options)
    o.set_output(True).set_dim(dims).set_stride(strides).set_ragged_offset(off)
    g.build([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
    out = torch.zeros_like(q)
    ws = torch.empty(g.get_workspace_size(), device="cuda", dtype=torch.uint8)
    pack = {tq: q, tk: k, tv: v, o: out, off: offsets, lens: seq_len,
            tensors["cap"]: torch.full((1, 1, 1, 1), CAP), tensors["neg"]: torch.full((1, 1, 1, 1), -1e30)}
    pack = {t: x for t, x in pack.items() if t is not None}

    def step():
        g.execute(pack, ws, handle=handle)

    return out, step


def run_dense_twin(q, k, v, lengths):
    start = np.zeros((B, T), np.int32)
    for b, row in enumerate(lengths):
        at = 0
        for length in row:
            start[b, at:at + length] = at
            at += length
    g = cudnn.pygraph(io_data_type=BF, intermediate_data_type=F, compute_data_type=F, handle=handle)
    dims, strides = [B, N, T, H], [T * N * H, H, N * H, 1]
    tq, tk, tv = (g.tensor(name=n, dim=dims, stride=strides, data_type=BF) for n in "qkv")
    tstart = g.tensor(name="start", dim=[B, 1, T, 1], stride=[T, T, 1, 1], data_type=I32)
    tensors = {"cap": scalar(g, "cap"), "neg": scalar(g, "neg")}

    def mod(gg, s):
        x = softcap_causal(gg, s, tensors)
        _, kpos = positions(gg, s)
        inside = typed(gg.cmp_ge(input=kpos, comparison=tstart, compute_data_type=BOOL), BOOL)
        return gg.binary_select(input0=x, input1=tensors["neg"], mask=inside)

    o, _ = g.sdpa(name="sdpa", q=tq, k=tk, v=tv, attn_scale=SCALE, generate_stats=False, score_mod=mod)
    o.set_output(True).set_dim(dims).set_stride(strides)
    g.build([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
    out = torch.zeros_like(q)
    ws = torch.empty(g.get_workspace_size(), device="cuda", dtype=torch.uint8)
    pack = {tq: q, tk: k, tv: v, o: out, tstart: torch.from_numpy(start).reshape(B, 1, T, 1).cuda(),
            tensors["cap"]: torch.full((1, 1, 1, 1), CAP), tensors["neg"]: torch.full((1, 1, 1, 1), -1e30)}

    def step():
        g.execute(pack, ws, handle=handle)

    return out, step


def reference(q, k, v, lengths):
    out = torch.zeros((B, *q.shape[1:]), dtype=torch.float32, device="cuda")
    for b, row in enumerate(lengths):
        at = 0
        for length in row:
            sl = slice(at, at + length)
            qs, ks, vs = (x[b, sl].float().transpose(0, 1) for x in (q, k, v))
            s = CAP * torch.tanh((qs @ ks.transpose(-1, -2)) * SCALE / CAP)
            s = s.masked_fill(~torch.ones(length, length, dtype=torch.bool, device="cuda").tril(), float("-inf"))
            out[b, sl] = (torch.softmax(s, -1) @ vs).transpose(0, 1)
            at += length
    return out


def main():
    rng = np.random.default_rng(0)
    lengths = docs(rng)
    # One spare row: a ragged sequence read past its length (no padding mask) stays in bounds.
    q, k, v = (torch.randn(B + 1, T, N, H, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    ref = reference(q, k, v, lengths)
    print(f"B{B} T{T} N{N} H{H} bf16, {sum(len(r) for r in lengths)} documents of 64..{LMAX}, graph length {LMAX}",
          flush=True)
    for variant in ("dense twin", "native T", "native", "mod+pad", "mod"):
        try:
            started = time.perf_counter()
            if variant == "dense twin":
                out, step = run_dense_twin(*(x[:B].contiguous() for x in (q, k, v)), lengths)
            else:
                out, step = run_thd(variant, q, k, v, lengths, T if variant == "native T" else LMAX)
            build_s = time.perf_counter() - started
            ms = cuda_event_ms(step)
            if variant.startswith("native"):  # no softcap there: compare against a softcap-free reference
                err = "n/a (no softcap)"
            else:
                err = f"{float((out[:B].float() - ref[:B]).norm() / ref[:B].norm()):.2e}"
            print(f"{variant:<10} built in {build_s:.1f} s  rel err {err}  {ms:.3f} ms", flush=True)
        except Exception as error:
            print(f"{variant:<10} FAILED: {type(error).__name__}: {str(error)[:300]}", flush=True)


if __name__ == "__main__":
    main()
