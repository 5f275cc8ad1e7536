"""The small-sequence forward as one Pallas (Triton) kernel, for calls with nothing to mask or modify.

    usable(q, k, v) -> bool
    forward(q, k, v, scale, with_probs) -> (o, lse, p or None)

One program per batch row and block of heads reads q (T, NB, H), K and V (S, NB, H) once, computes
the S scores, their softmax and the weighted sum of values in fp32 registers, and writes o; with
`with_probs` also the probabilities the gradient saves, and always the logsumexp. XLA's
formulation (`small_seq_core`) runs the same arithmetic as two fused kernels, and writes the
scores between them.

Measured on an H100 80GB HBM3 (2026-11-24, `bench/probe_small_seq_pallas.py`, B30720 T1 N16 H128
bf16): 2.98-3.00 TB/s at S 2, 4, 8 and 16, 89-90% of the 3.35 TB/s datasheet peak. The XLA
formulation reached 2.78-2.89 TB/s and XLA's own attention 2.86-2.89 TB/s in the same run.

Where: a GPU backend; no score_mod, bias, mask, padding or causal/window mask (those run on the XLA
formulation); as many key/value heads as query heads; T, S, H and the head block powers of two
(Triton's block shapes), S * heads * H <= MAX_BLOCK_ELEMENTS. `SDPAGRAPH_SMALL_SEQ_KERNEL=0`
switches it off.
"""
from __future__ import annotations

import functools
import os
from typing import Any

import jax
import jax.numpy as jnp

ENV_SWITCH = "SDPAGRAPH_SMALL_SEQ_KERNEL"
# K and V elements one program holds in registers (fp32) for a block: above it, fewer heads per block.
MAX_BLOCK_ELEMENTS = 32768
NUM_WARPS = 8  # the best setting at S 2, 4 and 16 (S 8: within 1% of the best)


def _power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def heads_per_block(num_heads: int, kv_len: int, head_dim: int) -> int:
    """The most heads (a power of two dividing N) whose K and V blocks fit MAX_BLOCK_ELEMENTS; 0: none."""
    heads = num_heads & -num_heads  # the largest power of two dividing N
    while heads and kv_len * heads * head_dim > MAX_BLOCK_ELEMENTS:
        heads //= 2
    return heads


def usable(q: Any, k: Any, v: Any) -> bool:
    """Whether `forward` runs these shapes here (the call's other inputs are the caller's to check)."""
    if os.environ.get(ENV_SWITCH, "1") == "0" or jax.default_backend() != "gpu":
        return False
    _, t, n, h = q.shape
    _, s, kv_heads, h_k = k.shape
    return (kv_heads == n and h_k == h and v.shape == k.shape and all(map(_power_of_two, (t, s, h)))
            and heads_per_block(n, s, h) > 0)


def forward(q: Any, k: Any, v: Any, scale: float, with_probs: bool, interpret: bool = False) -> tuple[Any, Any, Any]:
    """(o (B, T, N, H) in v's dtype, lse (B, T, N) fp32, p (B, T, S, N) fp32 or None) of q (B, T, N, H)
    over k, v (B, S, N, H). `interpret` runs the kernel in Pallas' interpreter (tests on a CPU)."""
    from jax.experimental import pallas as pl

    b, t, n, h = q.shape
    s = k.shape[1]
    heads = heads_per_block(n, s, h)
    rows = pl.BlockSpec((1, t, heads, h), lambda i, j: (i, 0, j, 0))
    tokens = pl.BlockSpec((1, s, heads, h), lambda i, j: (i, 0, j, 0))
    out_shape = [jax.ShapeDtypeStruct(q.shape, v.dtype), jax.ShapeDtypeStruct((b, t, n), jnp.float32)]
    out_specs = [rows, pl.BlockSpec((1, t, heads), lambda i, j: (i, 0, j))]
    if with_probs:
        out_shape.append(jax.ShapeDtypeStruct((b, t, s, n), jnp.float32))
        out_specs.append(pl.BlockSpec((1, t, s, heads), lambda i, j: (i, 0, 0, j)))
    params = None if interpret else _compiler_params()
    outs = pl.pallas_call(functools.partial(_kernel, scale=float(scale)), out_shape=out_shape,
                          grid=(b, n // heads), in_specs=[rows, tokens, tokens], out_specs=out_specs,
                          compiler_params=params, interpret=interpret)(q, k, v)
    return outs[0], outs[1], outs[2] if with_probs else None


def _compiler_params() -> Any:
    from jax.experimental.pallas import triton as pallas_triton

    return pallas_triton.CompilerParams(num_warps=NUM_WARPS, num_stages=1)


def _kernel(q_ref, k_ref, v_ref, o_ref, lse_ref, *probs_ref, scale: float) -> None:
    """Blocks: q, o (1, T, NB, H); k, v (1, S, NB, H); lse (1, T, NB); probabilities (1, T, S, NB)."""
    k = k_ref[0].astype(jnp.float32)  # (S, NB, H)
    v = v_ref[0].astype(jnp.float32)
    for t in range(q_ref.shape[1]):
        q = q_ref[0, t].astype(jnp.float32)  # (NB, H)
        scores = jnp.sum(q[None] * k, axis=-1) * scale  # (S, NB)
        peak = jnp.max(scores, axis=0)
        weights = jnp.exp(scores - peak[None])
        total = jnp.sum(weights, axis=0)
        o_ref[0, t] = (jnp.sum(weights[:, :, None] * v, axis=0) / total[:, None]).astype(o_ref.dtype)
        lse_ref[0, t] = peak + jnp.log(total)
        if probs_ref:
            probs_ref[0][0, t] = weights / total[None]
