"""The small-sequence backend's computation: attention as memory streams over K and V, with its own
gradient. `small_seq` calls it on BSHD inputs, `small_seq_packed` on each query token's window of keys.

Every per-score array is kept in one "score layout" `(B, T, S, K, G)`: token-major like K and V, so
no big operand is transposed (N = K * G query heads; head n is (n // G, n % G)). Every contraction
is a broadcast multiply and a sum over one axis, which XLA fuses into one kernel reading its big
operand once. The gradient is a `jax.custom_vjp` that saves the probabilities `p` (B, T, S, K, G)
in fp32 (and, with a score_mod, the raw scaled scores, to differentiate the mod at them) instead of
recomputing them from q and K, and never saves or re-reads the output:

    dV = p^T dO            dP = dO V^T             dS = p * (dP - sum_s p dP)      (+ p * dlse)
    dlogits -> d(raw score) through the score_mod: the user's `score_mod_bprop` when given (the
    IR's bprop, as on cuDNN), else jax's vjp of its jnp evaluation; dbias = dS summed to its shape
    dQ = scale * dS K      dK = scale * dS^T Q

Without a gradient, a call with nothing to mask or modify at T = 1, S <= 16 runs as one Pallas
kernel when the process has one GPU and jax still lowers Pallas with Triton (`small_seq_kernel`:
85-90% of the H100's HBM bandwidth, where these fused kernels reach 83-86%).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from sdpagraph.scoremod.ir import ScoreModIR
from sdpagraph.scoremod.ir_eval import evaluate
from sdpagraph.backends.small_seq import kernel as small_seq_kernel

_F32 = jnp.float32


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


@dataclass(frozen=True)
class Static:
    """Everything static about one call (hashable: custom_vjp's non-differentiable argument)."""

    num_kv_heads: int
    scale: float
    ir: ScoreModIR | None
    scalars: tuple[tuple[str, Any], ...]


class Aux(NamedTuple):
    """Non-differentiable runtime arrays (a pytree, so it passes through custom_vjp), all
    broadcastable to the score layout."""

    allowed: Any  # bool: where a query may attend to a key, or None when every pair may
    mod_arrays: Any  # dict name -> a score_mod array (constants for differentiation)
    index: Any  # what gen_index(axis) yields: (batch, query head, query position, key position)


def _split_heads(q: Any, num_kv_heads: int) -> Any:
    b, t, n, h = q.shape
    return q.reshape(b, t, num_kv_heads, n // num_kv_heads, h)


# The three contractions. Shapes: rows (B, T, K, G, H), scores (B, T, S, K, G), tokens (B, S, K, H);
# all products and sums in fp32.

def _over_features(rows: Any, tokens: Any) -> Any:
    """scores[b, t, s, k, g] = sum_h rows[b, t, k, g, h] tokens[b, s, k, h] (q.K, dO.V)."""
    return jnp.sum(rows[:, :, None].astype(_F32) * tokens[:, None, :, :, None, :].astype(_F32), axis=-1)


def _over_keys(scores: Any, tokens: Any) -> Any:
    """rows[b, t, k, g, h] = sum_s scores[b, t, s, k, g] tokens[b, s, k, h] (p.V, dS.K)."""
    return jnp.sum(scores[..., None] * tokens[:, None, :, :, None, :].astype(_F32), axis=2)


def _over_queries(scores: Any, rows: Any) -> Any:
    """tokens[b, s, k, h] = sum_{t, g} scores[b, t, s, k, g] rows[b, t, k, g, h] (p^T dO, dS^T q)."""
    return jnp.sum(scores[..., None] * rows[:, :, None].astype(_F32), axis=(1, 4))


def _apply_mod(static: Static, raw: Any, aux: Aux) -> Any:
    if static.ir is None:
        return raw
    out, _ = evaluate(static.ir, raw, scalars=dict(static.scalars), arrays=aux.mod_arrays, index=aux.index)
    return jnp.broadcast_to(out.astype(_F32), raw.shape)


def _mod_gradient(static: Static, raw: Any, aux: Aux, d_logits: Any) -> Any:
    """d(raw score) from d(logits): the user's bprop (the IR's), else jax's vjp of the mod."""
    if static.ir.user_bprop:
        _, grad = evaluate(static.ir, raw, scalars=dict(static.scalars), arrays=aux.mod_arrays, index=aux.index,
                           dscore=d_logits)
        return jnp.broadcast_to(grad.astype(_F32), raw.shape)
    _, mod_vjp = jax.vjp(lambda r: _apply_mod(static, r, aux), raw)
    return mod_vjp(d_logits)[0]


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


def _softmax_of(static: Static, q, k, bias, aux: Aux) -> tuple[_Softmax, Any]:
    """(the softmax, the raw scores) from q, K and the small per-score inputs."""
    raw = _over_features(_split_heads(q, static.num_kv_heads), k) * _F32(static.scale)
    logits = _apply_mod(static, raw, aux)
    if bias is not None:
        logits = logits + to_score_layout(bias, static.num_kv_heads).astype(_F32)
    return _softmax(logits, aux.allowed), raw


def _output(probs: Any, v: Any) -> Any:
    """sum_s p V, (B, T, N, H_v) in V's dtype."""
    b, t, _, k, g = probs.shape
    return _over_keys(probs, v).reshape(b, t, k * g, v.shape[-1]).astype(v.dtype)


def _by_kernel(static: Static, q, k, v, bias, aux: Aux) -> bool:
    """Whether the one-kernel forward (`small_seq_kernel`) runs this call: nothing to mask or modify."""
    return static.ir is None and bias is None and aux.allowed is None and small_seq_kernel.usable(q, k, v)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _core(static: Static, q, k, v, bias, aux: Aux):
    # The primal alone (no gradient taken): the one-kernel forward where it runs.
    if _by_kernel(static, q, k, v, bias, aux):
        out, lse = small_seq_kernel.forward(q, k, v, static.scale)
        return out, lse[..., None]  # (B, T, K, G=1)
    softmax, _ = _softmax_of(static, q, k, bias, aux)
    return _output(softmax.probs, v), softmax.lse


def _core_fwd(static: Static, q, k, v, bias, aux: Aux):
    softmax, raw = _softmax_of(static, q, k, bias, aux)
    # The residuals: the inputs and p (T*S fp32 values per head), and with a score_mod the raw
    # scores it is differentiated at. Not the output: dS needs only sum_s p dP (= dO . O).
    probs = softmax.probs
    saved_raw = raw if static.ir is not None else None
    return (_output(probs, v), softmax.lse), (q, k, v, bias, aux, probs, saved_raw)


def _sum_to_shape(x: Any, shape: tuple[int, ...]) -> Any:
    axes = tuple(i for i, (have, want) in enumerate(zip(x.shape, shape)) if want == 1 and have != 1)
    return jnp.sum(x, axis=axes, keepdims=True) if axes else x


def _core_bwd(static: Static, residuals, cotangents):
    q, k, v, bias, aux, probs, raw = residuals
    d_out, d_lse = cotangents
    kh = static.num_kv_heads
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
    d_raw = d_logits if static.ir is None else _mod_gradient(static, raw, aux, d_logits)
    d_raw = d_raw * _F32(static.scale)
    # dQ = dS . K (sum over keys, reading K once); dK[b, s, k] = sum_{t, g} dS q
    d_q = _over_keys(d_raw, k)
    d_k = _over_queries(d_raw, _split_heads(q, kh))
    return (d_q.reshape(q.shape).astype(q.dtype), d_k.astype(k.dtype), d_v.astype(v.dtype), d_bias, None)


_core.defvjp(_core_fwd, _core_bwd)


def attend(static: Static, q: Any, k: Any, v: Any, bias: Any, aux: Aux) -> tuple[Any, Any]:
    """(output (B, T, N, H_v) in V's dtype, logsumexp (B, N, T) fp32) of q (B, T, N, H) over
    k (B, S, K, H) and v (B, S, K, H_v); `bias` is 4-D (B|1, N|1, T|1, S|1) or None."""
    out, lse = _core(static, q, k, v, bias, aux)
    b, t, kh, g = lse.shape
    return out, jnp.transpose(lse.reshape(b, t, kh * g), (0, 2, 1))


def probabilities(static: Static, q: Any, k: Any, v: Any, bias: Any, aux: Aux) -> Any:
    """The probabilities the gradient saves, as (B, N, T, S) fp32."""
    _, residuals = _core_fwd(static, q, k, v, bias, aux)
    return from_score_layout(residuals[5])
