"""The small-sequence backend: attention over a handful of keys per query, for very large batches.

Regime: query length T <= MAX_Q_LEN, key/value length S <= MAX_KV_LEN (static shapes of the spec),
or, for packed `segment_ids`, the static hints `max_seqlen_q` <= MAX_Q_LEN and `max_seqlen_kv` <=
MAX_KV_LEN (the longest query / key segment; without a hint a packed call is outside the regime);
GQA, padding, boolean masks, causal/window/chunk masks (either alignment), a bias, and score_mods
(evaluated by `scoremod.ir_eval.evaluate`, with the user's `score_mod_bprop` as their gradient when
given). Packed calls run in `small_seq_packed`. Same contract as `backends.xla.xla_attention`:

    logits = score_mod(scale * q . k) + bias      (fp32)
    out    = softmax(logits masked) . v           (fp32; rows with nothing to attend give 0, lse -inf)

Why a backend of its own: here the score matrix of a row holds only S values, while each row reads
S key and S value vectors of H elements, so attention is a pure memory stream over K and V.
cuDNN's tiled kernels pad T and S up to their tiles (3-11x slower than XLA on an H100 at
B30720 T1 S4..16), and the XLA backend's autodiff backward runs 22 kernels where 15 do, among them
transposed copies of dK and dV. `small_seq_core` computes it as memory streams over K and V, with a
gradient of its own (the formulas are there).

Bytes, forward: Q, K, V read once, O written once. Forward + backward (a `jax.grad`, where the
primal output is dead and XLA drops it): K read by the forward, K and V read and dK, dV written by
the backward, plus Q/dQ/dO and the per-score arrays (T*S/H of K's size).

Measured on an H100 80GB HBM3 (2026-11-23, jax 0.11.2, bf16, B30720 N16 H128, wall-clock medians
of jitted calls; forward+backward is jax.grad of sum(out * dO), gradients of q, k, v), against the
XLA backend in the same run: forward+backward 0.66 / 1.20 / 2.24 / 4.33 ms at T1 S2 / S4 / S8 / S16
(XLA 3.16 / 3.80 / 5.48 / 7.36: 4.8x / 3.2x / 2.4x / 1.7x faster), 9.45 vs 12.8 at S32, 6.10 vs
13.0 at T4 S16, 2.54 vs 2.94 for GQA N16/K4 S16. Forward at T1: level with XLA (within 3% either
way: XLA lowers a one-row dot to the same multiply-and-sum), 2.74-2.81 TB/s for S2..S16, which is
82-84% of the 3.35 TB/s datasheet peak and 95-97% of what a jitted elementwise copy reached (2.89
TB/s); at T2 S8 0.96 vs 4.40 ms and T4 S16 2.46 vs 6.34 ms (XLA's batched matrix products). GQA's
forward streams at only 1.1 TB/s (XLA: 1.0). `bench/dispatch.py` repeats these measurements.
"""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from sdpagraph.backends.base import Backend, Verify
from sdpagraph.graphs.support import Support
from sdpagraph.scoremod.ir import ScoreModIR
from sdpagraph.call import RuntimeInputs
from sdpagraph.backends.small_seq import kernel as small_seq_kernel
from sdpagraph.backends.small_seq.core import Aux, Static, attend, probabilities, to_score_layout
from sdpagraph.backends.small_seq.packed import packed_attention
from sdpagraph.backends.masking import position_allowed
from sdpagraph.spec import AttentionSpec

MAX_Q_LEN = 4  # query positions per sequence (per packed segment)
MAX_KV_LEN = 32  # key/value positions per sequence (per packed segment)


def _lengths_in_regime(spec: AttentionSpec) -> tuple[tuple[str, int], tuple[str, int]] | str:
    """((what bounds the query length, the bound), (the same for keys)), or why there is none."""
    if not spec.segments:
        return (f"query length T={spec.q_len}", spec.q_len), (f"key/value length S={spec.kv_len}", spec.kv_len)
    if spec.max_seqlen_q is None and spec.max_seqlen_kv is None:
        return ("packed segment_ids need the static hints max_seqlen_q / max_seqlen_kv (the longest query / key "
                "segment) to run on the small-sequence backend")
    q = ((f"max_seqlen_q={spec.max_seqlen_q}", spec.max_seqlen_q) if spec.max_seqlen_q is not None
         else (f"query segments up to T={spec.q_len} (no max_seqlen_q)", spec.q_len))
    kv = ((f"max_seqlen_kv={spec.max_seqlen_kv}", spec.max_seqlen_kv) if spec.max_seqlen_kv is not None
          else (f"key segments up to S={spec.kv_len} (no max_seqlen_kv)", spec.kv_len))
    return q, kv


def small_seq_reason(spec: AttentionSpec) -> str | None:
    """None when the small-sequence backend runs `spec`, else why it does not (one sentence)."""
    if spec.empty_axes:
        return f"axis {', '.join(spec.empty_axes)} has size 0: nothing to compute"
    if spec.segment_mask:  # only cuDNN's dense twin of a packed call (graphs.operands) has it
        return "segment_mask specs are cuDNN graph specs, not calls"
    if spec.dtype == "float64":
        return "the small-sequence backend computes in float32; float64 runs on the XLA backend"
    if spec.paged is not None:
        return "the small-sequence backend takes dense keys, not paged ones"
    if spec.dropout:
        return "the small-sequence backend has no dropout; cuDNN and XLA have"
    lengths = _lengths_in_regime(spec)
    if isinstance(lengths, str):
        return lengths
    (q_what, q_bound), (kv_what, kv_bound) = lengths
    if q_bound > MAX_Q_LEN:
        return f"{q_what} is above the small-sequence backend's limit of {MAX_Q_LEN}"
    if kv_bound > MAX_KV_LEN:
        return f"{kv_what} is above the small-sequence backend's limit of {MAX_KV_LEN}"
    return None


# ----------------------------------------------------------------------------- BSHD masks and positions

def _allowed(spec: AttentionSpec, inputs: RuntimeInputs) -> Any:
    """Boolean, broadcastable to the score layout: where a query may attend to a key; None when
    every pair may. The same masks as the XLA backend's dense layout (`masking.allowed_mask`)."""
    t, s = spec.q_len, spec.kv_len
    q_pos = jnp.arange(t, dtype=jnp.int32)[None, :, None]  # (1, T, 1)
    kv_pos = jnp.arange(s, dtype=jnp.int32)[None, None, :]  # (1, 1, S)
    allowed = None

    def both(a, c):
        return c if a is None else a & c

    q_len = kv_len = None
    if inputs.q_lengths is not None:
        q_len = jnp.asarray(inputs.q_lengths, jnp.int32)[:, None, None]
        allowed = both(allowed, q_pos < q_len)
    if inputs.kv_lengths is not None:
        kv_len = jnp.asarray(inputs.kv_lengths, jnp.int32)[:, None, None]
        allowed = both(allowed, kv_pos < kv_len)
    diag = q_pos
    if spec.causal_alignment == "bottom_right":
        full_q = jnp.int32(t) if q_len is None else q_len
        full_kv = jnp.int32(s) if kv_len is None else kv_len
        diag = q_pos + (full_kv - full_q)
    positions = position_allowed(spec, diag, kv_pos)
    if positions is not None:
        allowed = both(allowed, positions)
    if allowed is not None:
        allowed = allowed[:, :, :, None, None]  # (B|1, T, S, 1, 1)
    if inputs.mask is not None:  # a lower-rank mask is left-padded with 1s to spec.mask_shape
        mask = to_score_layout(jnp.reshape(jnp.asarray(inputs.mask, jnp.bool_), spec.mask_shape), spec.num_kv_heads)
        allowed = mask if allowed is None else allowed & mask
    return allowed


def _index(spec: AttentionSpec) -> tuple[Any, ...]:
    """What `gen_index(axis)` yields, in the score layout: batch, query head, query and key position."""
    k, g = spec.num_kv_heads, spec.num_heads // spec.num_kv_heads
    return (
        jnp.arange(spec.batch, dtype=jnp.int32).reshape(-1, 1, 1, 1, 1),
        jnp.arange(k * g, dtype=jnp.int32).reshape(1, 1, 1, k, g),
        jnp.arange(spec.q_len, dtype=jnp.int32).reshape(1, -1, 1, 1, 1),
        jnp.arange(spec.kv_len, dtype=jnp.int32).reshape(1, 1, -1, 1, 1),
    )



# ----------------------------------------------------------------------------- the entry

def _static(spec: AttentionSpec, score_mod: ScoreModIR | None, inputs: RuntimeInputs) -> Static:
    return Static(spec.num_kv_heads, spec.scale, score_mod, tuple(sorted((inputs.mod_scalars or {}).items())))


def _bshd(spec: AttentionSpec, inputs: RuntimeInputs) -> tuple[Any, Aux]:
    """(the 4-D bias or None, the aux arrays) of a BSHD call."""
    arrays = {name: jax.lax.stop_gradient(to_score_layout(jnp.asarray(value), spec.num_kv_heads))
              for name, value in (inputs.mod_arrays or {}).items()}
    bias = None if inputs.bias is None else jnp.reshape(inputs.bias, spec.bias_shape)  # 4-D, as the spec reads it
    return bias, Aux(_allowed(spec, inputs), arrays, _index(spec))


def small_seq_attention(
    spec: AttentionSpec,
    query: Any,
    key: Any,
    value: Any,
    inputs: RuntimeInputs,
    score_mod: ScoreModIR | None = None,
) -> tuple[Any, Any]:
    """Return (output (B, T, N, H_v) in the input dtype, logsumexp (B, N, T) fp32), as
    `xla_attention` does. Raises ValueError for a spec outside the regime (`small_seq_reason`)."""
    reason = small_seq_reason(spec)
    if reason is not None:
        raise ValueError(f"the small-sequence backend cannot run {spec.summary()}: {reason}")
    static = _static(spec, score_mod, inputs)
    if spec.segments:
        return packed_attention(spec, static, query, key, value, inputs)
    bias, aux = _bshd(spec, inputs)
    return attend(static, query, key, value, bias, aux)


def residual_probabilities(spec: AttentionSpec, query: Any, key: Any, value: Any, inputs: RuntimeInputs,
                           score_mod: ScoreModIR | None = None) -> Any:
    """The probabilities the gradient saves for a BSHD call, as (B, N, T, S) fp32 (for tests and
    inspection)."""
    bias, aux = _bshd(spec, inputs)
    return probabilities(_static(spec, score_mod, inputs), query, key, value, bias, aux)


def formulation(spec: AttentionSpec, score_mod: ScoreModIR | None) -> str:
    """Which computation runs a call in the regime, and why: the Pallas kernel's conditions
    (`small_seq_kernel.reason_not_used`, and nothing to mask or modify, as `core` decides at run time)
    read from the spec."""
    if (score_mod is not None or spec.bias_shape is not None or spec.mask_shape is not None or spec.segments
            or spec.has_q_lengths or spec.has_kv_lengths or spec.has_position_mask):
        return "small_seq runs its XLA formulation: the Pallas kernel takes calls with nothing to mask or modify"
    why = small_seq_kernel.reason_not_used((spec.batch, spec.q_len, spec.num_heads, spec.head_dim),
                                           (spec.batch, spec.kv_len, spec.num_kv_heads, spec.head_dim),
                                           (spec.batch, spec.kv_len, spec.num_kv_heads, spec.head_dim_v))
    if why is not None:
        return f"{why}; small_seq runs its XLA formulation"
    return ("small_seq runs the forward as one Pallas Triton kernel where no gradient is taken (under a "
            "gradient, its XLA formulation)")


class SmallSeqBackend(Backend):
    """Attention as memory streams over a handful of keys per query (T <= 4, S <= 32, or packed with
    such hints), for very large batches."""

    name = "small_seq"
    packs_by_hints = True

    def support(self, spec: AttentionSpec, score_mod: ScoreModIR | None, *, training: bool,
                verify: Verify | None = None) -> Support:
        reason = small_seq_reason(spec)
        if reason is not None:
            return Support(False, self.name, reason)
        return Support(True, self.name, formulation(spec, score_mod))

    def attention(self, spec: AttentionSpec, query: Any, key: Any, value: Any, inputs: RuntimeInputs,
                  score_mod: ScoreModIR | None, *, training: bool = True,
                  verify: Verify | None = None) -> tuple[Any, Any]:
        return small_seq_attention(spec, query, key, value, inputs, score_mod)


BACKEND = SmallSeqBackend()
