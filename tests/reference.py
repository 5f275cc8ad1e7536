"""An independent float64 NumPy attention reference (forward and hand-written backward).

Written from the definitions, with per-token loops for positions and segments, so it
shares no code with sdpagraph. Used where jax.nn.dot_product_attention has no
equivalent feature (score_mods, segments, chunks, bottom-right causal, right windows).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np


@dataclass
class Mod:
    """A score modification f(score, b, h, qpos, kpos) and its derivative w.r.t. score."""

    f: Callable
    df: Callable


IDENTITY = Mod(lambda s, *_: s, lambda s, *_: np.ones_like(s))


def softcap_mod(cap: float) -> Mod:
    return Mod(lambda s, *_: cap * np.tanh(s / cap), lambda s, *_: 1.0 - np.tanh(s / cap) ** 2)


def alibi_mod(slopes) -> Mod:
    slopes = np.asarray(slopes, np.float64)[None, :, None, None]
    return Mod(lambda s, b, h, q, k: s + slopes * (k - q), lambda s, *_: np.ones_like(s))


def segment_layout(ids: np.ndarray, max_segments: int):
    """Per-token (run number 1.., position in run, run length); runs past max_segments -> padding."""
    B, T = ids.shape
    run = np.zeros((B, T), np.int64)
    pos = np.zeros((B, T), np.int64)
    length = np.zeros((B, T), np.int64)
    for b in range(B):
        count, start = 0, 0
        for t in range(T):
            if ids[b, t] != 0 and (t == 0 or ids[b, t] != ids[b, t - 1]):
                count, start = count + 1, t
            if ids[b, t] != 0 and count <= max_segments:
                run[b, t], pos[b, t] = count, t - start
        for t in range(T):
            if run[b, t]:
                length[b, t] = np.sum(run[b] == run[b, t])
    return run, pos, length


def allowed(B, T, S, *, is_causal=False, alignment="top_left", window=(-1, -1), chunk=None,
            q_lengths=None, kv_lengths=None, q_ids=None, kv_ids=None, max_segments=None):
    """Boolean (B, T, S) and the (B, T)/(B, S) positions, built cell by cell."""
    ok = np.ones((B, T, S), bool)
    if q_ids is not None:
        q_run, q_pos, q_len = segment_layout(q_ids, max_segments)
        k_run, k_pos, k_len = segment_layout(kv_ids, max_segments)
    else:
        q_pos, k_pos = np.tile(np.arange(T), (B, 1)), np.tile(np.arange(S), (B, 1))
        ql = np.full(B, T) if q_lengths is None else np.asarray(q_lengths)
        kl = np.full(B, S) if kv_lengths is None else np.asarray(kv_lengths)
        q_run = (q_pos < ql[:, None]).astype(int)
        k_run = (k_pos < kl[:, None]).astype(int)
        q_len, k_len = np.tile(ql[:, None], (1, T)), np.tile(kl[:, None], (1, S))
    for b in range(B):
        for i in range(T):
            for j in range(S):
                if q_run[b, i] == 0 or k_run[b, j] == 0 or q_run[b, i] != k_run[b, j]:
                    ok[b, i, j] = False
                    continue
                d = q_pos[b, i] + (k_len[b, j] - q_len[b, i] if alignment == "bottom_right" else 0)
                kp = k_pos[b, j]
                if is_causal and kp > d:
                    ok[b, i, j] = False
                if window[0] >= 0 and kp < d - window[0]:
                    ok[b, i, j] = False
                if window[1] >= 0 and kp > d + window[1]:
                    ok[b, i, j] = False
                if chunk is not None and d // chunk != kp // chunk:
                    ok[b, i, j] = False
    return ok, q_pos, k_pos


def attention_fwd_bwd(q, k, v, dout, *, scale, ok, q_pos, k_pos, mod=IDENTITY, bias=None):
    """float64 forward and backward. ok: (B, T, S) or (B, N, T, S). Returns out, (dq, dk, dv, dbias)."""
    q, k, v, dout = (np.asarray(x, np.float64) for x in (q, k, v, dout))
    B, T, N, H = q.shape
    K = k.shape[2]
    G = N // K
    ke, ve = np.repeat(k, G, axis=2), np.repeat(v, G, axis=2)  # query head n uses kv head n // G
    raw = np.einsum("btnh,bsnh->bnts", q, ke) * scale
    bidx = np.arange(B)[:, None, None, None]
    hidx = np.arange(N)[None, :, None, None]
    qp, kp = q_pos[:, None, :, None], k_pos[:, None, None, :]
    logits = mod.f(raw, bidx, hidx, qp, kp)
    if bias is not None:
        logits = logits + np.asarray(bias, np.float64)
    ok4 = np.broadcast_to(ok[:, None] if ok.ndim == 3 else ok, logits.shape)
    masked = np.where(ok4, logits, -np.inf)
    row_max = np.max(masked, axis=-1, keepdims=True)
    row_max = np.where(np.isfinite(row_max), row_max, 0.0)
    w = np.where(ok4, np.exp(masked - row_max), 0.0)
    tot = w.sum(-1, keepdims=True)
    p = w / np.where(tot > 0, tot, 1.0)
    out = np.einsum("bnts,bsnh->btnh", p, ve)
    do = np.asarray(dout, np.float64)
    dp = np.einsum("btnh,bsnh->bnts", do, ve)
    dlogits = p * (dp - np.sum(dp * p, axis=-1, keepdims=True))
    dbias = None
    if bias is not None:
        dbias = dlogits.copy()
        for axis, size in enumerate(np.shape(bias)):
            if size == 1:
                dbias = dbias.sum(axis=axis, keepdims=True)
    draw = dlogits * mod.df(raw, bidx, hidx, qp, kp) * scale
    dq = np.einsum("bnts,bsnh->btnh", draw, ke)
    dke = np.einsum("bnts,btnh->bsnh", draw, q)
    dve = np.einsum("bnts,btnh->bsnh", p, do)
    dk = dke.reshape(B, -1, K, G, H).sum(3)
    dv = dve.reshape(B, -1, K, G, v.shape[-1]).sum(3)
    return out, (dq, dk, dv, dbias)


def rel_err(actual, expected, where=None) -> float:
    """Relative Frobenius error ||actual - expected|| / ||expected|| in float64 (over `where` only)."""
    a, e = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    if where is not None:
        where = np.broadcast_to(np.asarray(where), a.shape)
        a, e = a[where], e[where]
    return float(np.linalg.norm(a - e) / max(np.linalg.norm(e), 1e-30))
