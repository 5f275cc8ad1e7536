"""The small-sequence backend: attention over a handful of keys per query, for very large batches.

Regime: query length T <= MAX_Q_LEN, key/value length S <= MAX_KV_LEN (static shapes of the spec),
BSHD inputs, GQA, padding, boolean masks, causal/window/chunk masks (either alignment), a bias, and
score_mods (evaluated by `graphs.ir_eval.evaluate`). Packed segments are declined
(`small_seq_reason` says so). Same contract as `jax_api.xla.xla_attention`:

    logits = score_mod(scale * q . k) + bias      (fp32)
    out    = softmax(logits masked) . v           (fp32; rows with nothing to attend give 0, lse -inf)

Why a backend of its own: here the score matrix of a row holds only S values, while each row reads
S key and S value vectors of H elements, so attention is a pure memory stream over K and V.
cuDNN's tiled kernels pad T and S up to their tiles (3-11x slower than XLA on an H100 at
B30720 T1 S4..16), and the XLA backend's autodiff backward runs 22 kernels where 15 do, among them
transposed copies of dK and dV. This module writes every contraction as a broadcast multiply and a sum over one axis
(XLA fuses each into one kernel that reads its big operand once) and keeps every per-score array in
one "score layout" `(B, T, S, K, G)`: token-major like K and V, so no big operand is transposed
(N = K * G query heads; head n is (n // G, n % G)).

The gradient is a `jax.custom_vjp` that saves the probabilities `p` (B, T, S, K, G) in fp32 (and,
with a score_mod, the raw scaled scores, to differentiate the mod at them) instead of recomputing
them from q and K in the backward, and never saves or re-reads the output:

    dV = p^T dO            dP = dO V^T             dS = p * (dP - sum_s p dP)      (+ p * dlse)
    dlogits -> d(raw score) through the score_mod's vjp (jax autodiff of its jnp evaluation,
    as the XLA backend does); dbias = dS summed to the bias's shape
    dQ = scale * dS K      dK = scale * dS^T Q

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

import functools
from dataclasses import dataclass
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from sdpagraph.graphs.ir import ScoreModIR
from sdpagraph.graphs.ir_eval import evaluate
from sdpagraph.jax_api.call import RuntimeInputs
from sdpagraph.spec import UNBOUNDED, AttentionSpec

MAX_Q_LEN = 4  # query positions per sequence
MAX_KV_LEN = 32  # key/value positions per sequence

_F32 = jnp.float32


def small_seq_reason(spec: AttentionSpec) -> str | None:
    """None when the small-sequence backend runs `spec`, else why it does not (one sentence)."""
    empty = [axis for axis, size in (("B", spec.batch), ("T", spec.q_len), ("S", spec.kv_len), ("N", spec.num_heads))
             if size == 0]
    if empty:
        return f"axis {', '.join(empty)} has size 0: nothing to compute"
    if spec.segments or spec.segment_mask:
        return "the small-sequence backend does not take packed segments (segment_ids) yet"
    if spec.q_len > MAX_Q_LEN:
        return f"query length T={spec.q_len} is above the small-sequence backend's limit of {MAX_Q_LEN}"
    if spec.kv_len > MAX_KV_LEN:
        return f"key/value length S={spec.kv_len} is above the small-sequence backend's limit of {MAX_KV_LEN}"
    return None


# ----------------------------------------------------------------------------- score layout

def to_score_layout(x: Any, num_kv_heads: int) -> Any:
    """A 4-D (B|1, N|1, T|1, S|1) array (a bias, a mask, a score_mod array) in the score layout
    (B|1, T|1, S|1, K|1, G|1)."""
    b, n, t, s = x.shape
    x = jnp.transpose(x, (0, 2, 3, 1))
    if n == 1:
        return x.reshape(b, t, s, 1, 1)
    return x.reshape(b, t, s, num_kv_heads, n // num_kv_heads)


def from_score_layout(x: Any) -> Any:
    """Inverse of `to_score_layout`: (B|1, T|1, S|1, K|1, G|1) -> (B|1, N|1, T|1, S|1)."""
    b, t, s, k, g = x.shape
    return jnp.transpose(x.reshape(b, t, s, k * g), (0, 3, 1, 2))


def _allowed(spec: AttentionSpec, inputs: RuntimeInputs) -> Any:
    """Boolean, broadcastable to the score layout: where a query may attend to a key; None when
    every pair may. The same masks as the XLA backend's dense layout (`xla.allowed_mask`)."""
    b, t, s = spec.batch, spec.q_len, spec.kv_len
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
    left, right = spec.window
    if spec.is_causal:
        allowed = both(allowed, kv_pos <= diag)
    if left != UNBOUNDED:
        allowed = both(allowed, kv_pos >= diag - left)
    if right != UNBOUNDED:
        allowed = both(allowed, kv_pos <= diag + right)
    if spec.chunk_size is not None:
        allowed = both(allowed, jnp.floor_divide(diag, spec.chunk_size) == jnp.floor_divide(kv_pos, spec.chunk_size))
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


# ----------------------------------------------------------------------------- the computation

@dataclass(frozen=True)
class _Static:
    """Everything static about one call (hashable: custom_vjp's non-differentiable argument)."""

    spec: AttentionSpec
    ir: ScoreModIR | None
    scalars: tuple[tuple[str, Any], ...]


class _Aux(NamedTuple):
    """Non-differentiable runtime arrays (a pytree, so it passes through custom_vjp)."""

    allowed: Any  # bool, broadcastable to the score layout, or None
    mod_arrays: Any  # dict name -> array in the score layout (constants for differentiation)


def _split_heads(q: Any, num_kv_heads: int) -> Any:
    b, t, n, h = q.shape
    return q.reshape(b, t, num_kv_heads, n // num_kv_heads, h)


# The three contractions, each a broadcast multiply and a sum that XLA fuses into one kernel
# reading its (B, S, K, H) operand once. Shapes: rows (B, T, K, G, H), scores (B, T, S, K, G),
# tokens (B, S, K, H); all products and sums in fp32.

def _over_features(rows: Any, tokens: Any) -> Any:
    """scores[b, t, s, k, g] = sum_h rows[b, t, k, g, h] tokens[b, s, k, h] (q.K, dO.V)."""
    return jnp.sum(rows[:, :, None].astype(_F32) * tokens[:, None, :, :, None, :].astype(_F32), axis=-1)


def _over_keys(scores: Any, tokens: Any) -> Any:
    """rows[b, t, k, g, h] = sum_s scores[b, t, s, k, g] tokens[b, s, k, h] (p.V, dS.K)."""
    return jnp.sum(scores[..., None] * tokens[:, None, :, :, None, :].astype(_F32), axis=2)


def _over_queries(scores: Any, rows: Any) -> Any:
    """tokens[b, s, k, h] = sum_{t, g} scores[b, t, s, k, g] rows[b, t, k, g, h] (p^T dO, dS^T q)."""
    return jnp.sum(scores[..., None] * rows[:, :, None].astype(_F32), axis=(1, 4))


def _raw_scores(q5: Any, k: Any, scale: float) -> Any:
    """scale * q . k in the score layout (B, T, S, K, G), fp32."""
    return _over_features(q5, k) * _F32(scale)


def _apply_mod(static: _Static, raw: Any, aux: _Aux) -> Any:
    if static.ir is None:
        return raw
    out, _ = evaluate(static.ir, raw, scalars=dict(static.scalars), arrays=aux.mod_arrays, index=_index(static.spec))
    return jnp.broadcast_to(out.astype(_F32), raw.shape)


class _Softmax(NamedTuple):
    """The softmax over keys (axis 2) in parts: `weights / total` are the probabilities."""

    weights: Any  # exp(logit - row max), 0 where masked: (B, T, S, K, G) fp32
    total: Any  # sum over keys, 1 for rows with nothing to attend to: (B, T, 1, K, G)
    lse: Any  # logsumexp, -inf for rows with nothing to attend to: (B, T, K, G)

    @property
    def probs(self) -> Any:
        return self.weights / self.total


def _softmax(logits: Any, allowed: Any) -> _Softmax:
    """fp32 softmax over keys; rows with no allowed key give p = 0 and lse = -inf."""
    masked = logits if allowed is None else jnp.where(allowed, logits, -jnp.inf)
    row_max = jnp.max(masked, axis=2, keepdims=True)
    row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
    weights = jnp.exp(masked - row_max)
    total = jnp.sum(weights, axis=2, keepdims=True)
    has_any = total > 0
    total = jnp.where(has_any, total, 1.0)
    lse = jnp.where(has_any, row_max + jnp.log(total), -jnp.inf)
    return _Softmax(weights, total, lse[:, :, 0])


def _softmax_of(static: _Static, q, k, bias, aux: _Aux) -> tuple[_Softmax, Any]:
    """(the softmax, the raw scores) from q, K and the small per-score inputs."""
    spec = static.spec
    raw = _raw_scores(_split_heads(q, spec.num_kv_heads), k, spec.scale)
    logits = _apply_mod(static, raw, aux)
    if bias is not None:
        logits = logits + to_score_layout(bias, spec.num_kv_heads).astype(_F32)
    return _softmax(logits, aux.allowed), raw


def _output(probs: Any, v: Any) -> Any:
    """sum_s p V, (B, T, N, H_v) in V's dtype."""
    b, t, _, k, g = probs.shape
    return _over_keys(probs, v).reshape(b, t, k * g, v.shape[-1]).astype(v.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _core(static: _Static, q, k, v, bias, aux: _Aux):
    softmax, _ = _softmax_of(static, q, k, bias, aux)
    return _output(softmax.probs, v), softmax.lse


def _core_fwd(static: _Static, q, k, v, bias, aux: _Aux):
    softmax, raw = _softmax_of(static, q, k, bias, aux)
    # The residuals: the inputs and p (T*S fp32 values per head), and with a score_mod the raw
    # scores it is differentiated at. Not the output: dS needs only sum_s p dP (= dO . O).
    probs = softmax.probs
    saved_raw = raw if static.ir is not None else None
    return (_output(probs, v), softmax.lse), (q, k, v, bias, aux, probs, saved_raw)


def _sum_to_shape(x: Any, shape: tuple[int, ...]) -> Any:
    axes = tuple(i for i, (have, want) in enumerate(zip(x.shape, shape)) if want == 1 and have != 1)
    return jnp.sum(x, axis=axes, keepdims=True) if axes else x


def _core_bwd(static: _Static, residuals, cotangents):
    q, k, v, bias, aux, probs, raw = residuals
    d_out, d_lse = cotangents
    spec = static.spec
    b, t, n, _ = q.shape
    kh, g = spec.num_kv_heads, n // spec.num_kv_heads
    d_o = _split_heads(d_out, kh)  # (B, T, K, G, H_v)
    # dV[b, s, k] = sum_{t, g} p dO ; dP = dO . V (one multiply-and-sum over H_v reading V once)
    d_v = _over_queries(probs, d_o)
    d_p = _over_features(d_o, v)
    d_logits = probs * (d_p - jnp.sum(probs * d_p, axis=2, keepdims=True))
    if d_lse is not None:  # lse = logsumexp(logits): its gradient is p
        d_logits = d_logits + probs * d_lse.astype(_F32)[:, :, None]
    d_bias = None
    if bias is not None:
        bias_layout = to_score_layout(bias, kh)
        d_bias = from_score_layout(_sum_to_shape(d_logits, bias_layout.shape)).astype(bias.dtype)
    d_raw = d_logits
    if static.ir is not None:
        _, mod_vjp = jax.vjp(lambda r: _apply_mod(static, r, aux), raw)
        (d_raw,) = mod_vjp(d_logits)
    d_raw = d_raw * _F32(spec.scale)
    q5 = _split_heads(q, kh)
    # dQ = dS . K (sum over keys, reading K once); dK[b, s, k] = sum_{t, g} dS q
    d_q = _over_keys(d_raw, k)
    d_k = _over_queries(d_raw, q5)
    return (d_q.reshape(q.shape).astype(q.dtype), d_k.astype(k.dtype), d_v.astype(v.dtype), d_bias, None)


_core.defvjp(_core_fwd, _core_bwd)


def _aux(spec: AttentionSpec, inputs: RuntimeInputs) -> _Aux:
    arrays = {name: jax.lax.stop_gradient(to_score_layout(jnp.asarray(value), spec.num_kv_heads))
              for name, value in (inputs.mod_arrays or {}).items()}
    return _Aux(_allowed(spec, inputs), arrays)


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
    static = _Static(spec, score_mod, tuple(sorted((inputs.mod_scalars or {}).items())))
    bias = None if inputs.bias is None else jnp.reshape(inputs.bias, spec.bias_shape)  # 4-D, as the spec reads it
    out, lse = _core(static, query, key, value, bias, _aux(spec, inputs))
    b, t, k, g = lse.shape
    return out, jnp.transpose(lse.reshape(b, t, k * g), (0, 2, 1))


def residual_probabilities(spec: AttentionSpec, query: Any, key: Any, value: Any, inputs: RuntimeInputs,
                           score_mod: ScoreModIR | None = None) -> Any:
    """The probabilities the gradient saves, as (B, N, T, S) fp32 (for tests and inspection)."""
    static = _Static(spec, score_mod, tuple(sorted((inputs.mod_scalars or {}).items())))
    bias = None if inputs.bias is None else jnp.reshape(inputs.bias, spec.bias_shape)  # 4-D, as the spec reads it
    _, residuals = _core_fwd(static, query, key, value, bias, _aux(spec, inputs))
    return from_score_layout(residuals[5])


