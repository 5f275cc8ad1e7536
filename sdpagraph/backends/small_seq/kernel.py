"""The small-sequence inference forward as one Pallas (Triton) kernel, for calls with nothing to mask
or modify.

    usable(q, k, v) -> bool
    reason_not_used(q_shape, k_shape, v_shape) -> str | None
    forward(q, k, v, scale) -> (o, lse)

One program per batch row and block of heads reads q (NB, H) at the one query position, K and V
(S, NB, H) once, computes the S scores, their softmax and the weighted sum of values in fp32
registers, and writes o and the logsumexp. XLA's formulation (`small_seq_core`) runs the same arithmetic as two fused kernels and
writes the scores between them.

Measured on an H100 80GB HBM3 (2026-11-24, jax 0.11.2, B30720 N16 H128 bf16):
- `bench/probe_small_seq_pallas.py`, T1: 2.98-3.00 TB/s at S 2, 4, 8 and 16, 89-90% of the
  3.35 TB/s datasheet peak. The XLA formulation reached 2.78-2.89 TB/s and XLA's own attention
  2.86-2.89 TB/s in the same run.
- `bench/dispatch.py`, with the kernel in the forward of training calls too:
  - at T2 and T4, and at S32, it was up to 36% slower than the XLA formulation: K and V of a block
    stay in registers across the query rows;
  - in `jax.grad`, XLA drops the forward's unused output from its own fused kernels, but a kernel
    that writes o cannot skip it, so forward+backward lost 13-15%.

So it runs the inference forward only (a call whose gradient is taken keeps the XLA formulation
that its backward reads the probabilities of), at T = 1 and S <= 16.

Where: a GPU backend with one device (XLA cannot partition a Pallas call: under a sharded `jit` it
would gather the inputs, so with several devices the XLA formulation, which XLA partitions, runs);
no score_mod, bias, mask, padding or causal/window mask (those keep the XLA formulation); as many
key/value heads as query heads; S and H powers of two (Triton's block shapes); a jax whose Pallas
Triton backend lowers kernels (`backends.pallas_triton`: jax 0.11 deprecates it, and once it is gone
the XLA formulation runs). `SDPAGRAPH_SMALL_SEQ_KERNEL=0` switches it off.
"""
from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

from sdpagraph.backends import pallas_triton
from sdpagraph.config import SMALL_SEQ_KERNEL
from sdpagraph.meshes import struct_like

MAX_KV_LEN = 16  # above it (S32 at T1) the XLA formulation was as fast
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


def reason_not_used(q_shape: tuple[int, ...], k_shape: tuple[int, ...], v_shape: tuple[int, ...]) -> str | None:
    """None when `forward` runs q, k, v of these shapes here, else why the XLA formulation runs
    instead (the call's other inputs are the caller's to check). Triton's availability is asked last:
    only where the kernel would otherwise run."""
    if not SMALL_SEQ_KERNEL.enabled():
        return f"{SMALL_SEQ_KERNEL.name}=0 switches the Pallas kernel off"
    if jax.default_backend() != "gpu":
        return "the Pallas kernel runs on a GPU only"
    if jax.device_count() != 1:
        return f"{jax.device_count()} devices: XLA partitions the XLA formulation, not a Pallas call"
    _, t, n, h = q_shape
    _, s, kv_heads, h_k = k_shape
    if t != 1:
        return f"T={t}: the Pallas kernel takes one query position"
    if s > MAX_KV_LEN or not _power_of_two(s):
        return f"S={s}: the Pallas kernel takes a power of two up to {MAX_KV_LEN}"
    if kv_heads != n:
        return "grouped key/value heads: the Pallas kernel takes as many as query heads"
    if h_k != h or tuple(v_shape) != tuple(k_shape):
        return "q, k and v differ in head dim: the Pallas kernel takes one"
    if not _power_of_two(h) or heads_per_block(n, s, h) == 0:
        return f"head dim {h}: the Pallas kernel takes a power of two whose K and V blocks fit its registers"
    triton = pallas_triton.status()
    return None if triton.available else triton.reason


def usable(q: Any, k: Any, v: Any) -> bool:
    """Whether `forward` runs these shapes here (`reason_not_used`)."""
    return reason_not_used(q.shape, k.shape, v.shape) is None


def forward(q: Any, k: Any, v: Any, scale: float, interpret: bool = False) -> tuple[Any, Any]:
    """(o (B, 1, N, H) in v's dtype, lse (B, 1, N) fp32) of q (B, 1, N, H) over k, v (B, S, N, H).
    `interpret` runs the kernel in Pallas' interpreter (tests on a CPU)."""
    from jax.experimental import pallas as pl

    b, t, n, h = q.shape
    if t != 1:
        raise ValueError(f"q must have one query position, got shape {q.shape}")
    s = k.shape[1]
    heads = heads_per_block(n, s, h)
    rows = pl.BlockSpec((1, t, heads, h), lambda i, j: (i, 0, j, 0))
    tokens = pl.BlockSpec((1, s, heads, h), lambda i, j: (i, 0, j, 0))
    out_shape = [struct_like(q.shape, v.dtype, [q, k, v]), struct_like((b, t, n), jnp.float32, [q, k, v])]
    out_specs = [rows, pl.BlockSpec((1, t, heads), lambda i, j: (i, 0, j))]
    params = pallas_triton.compiler_params(NUM_WARPS, interpret)
    out, lse = pl.pallas_call(functools.partial(_kernel, scale=float(scale)), out_shape=out_shape,
                              grid=(b, n // heads), in_specs=[rows, tokens, tokens], out_specs=out_specs,
                              compiler_params=params, interpret=interpret)(q, k, v)
    return out, lse


def _kernel(q_ref, k_ref, v_ref, o_ref, lse_ref, *, scale: float) -> None:
    """Blocks: q, o (1, 1, NB, H); k, v (1, S, NB, H); lse (1, 1, NB)."""
    k = k_ref[0].astype(jnp.float32)  # (S, NB, H)
    v = v_ref[0].astype(jnp.float32)
    q = q_ref[0, 0].astype(jnp.float32)  # (NB, H)
    scores = jnp.sum(q[None] * k, axis=-1) * scale  # (S, NB)
    peak = jnp.max(scores, axis=0)
    weights = jnp.exp(scores - peak[None])
    total = jnp.sum(weights, axis=0)
    o_ref[0, 0] = (jnp.sum(weights[:, :, None] * v, axis=0) / total[:, None]).astype(o_ref.dtype)
    lse_ref[0, 0] = peak + jnp.log(total)
