"""The XLA backend: an AttentionSpec + ScoreModIR evaluated with jax.numpy.

It is the reference for every test, the fallback when cuDNN declines a config, and
the backend on machines without a GPU. Semantics, shared with the cuDNN lowering:

    logits = score_mod(scale * q . k) + bias      (fp32)
    masked where any mask says no (user mask, padding, segments, causal, window, chunk)
    out    = softmax(logits) . v                  (fp32 softmax; fully masked rows give 0)

Which positions attend which (padding, segments, causal, windows, chunks) is `backends.masking`.
"""
from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

from sdpagraph.backends.base import Backend, Verify
from sdpagraph.backends.masking import TokenLayout, positions_and_mask
from sdpagraph.call import RuntimeInputs
from sdpagraph.graphs.support import Support
from sdpagraph.scoremod.ir import ScoreModIR
from sdpagraph.scoremod.ir_eval import evaluate
from sdpagraph.scoremod.jnp.apply import apply_jnp_mask_mod, apply_jnp_score_mod
from sdpagraph.spec import AttentionSpec


def _dot_precision(dtype: Any) -> Any:
    # As jax.nn.dot_product_attention: bf16/fp16 inputs, fp32 accumulation. XLA:CPU rejects the
    # fp16 preset in the gradient's dots; there the default precision already accumulates in fp32.
    if jax.default_backend() == "cpu":
        return None
    return {jnp.bfloat16: jax.lax.DotAlgorithmPreset.BF16_BF16_F32,
            jnp.float16: jax.lax.DotAlgorithmPreset.F16_F16_F32}.get(jnp.dtype(dtype).type)


def _masked_softmax(logits: Any, allowed: Any) -> tuple[Any, Any]:
    """fp32 softmax over keys; rows with no allowed key give zeros (no NaN, no NaN grads)."""
    masked = jnp.where(allowed, logits, -jnp.inf)
    row_max = jax.lax.stop_gradient(jnp.max(masked, axis=-1, keepdims=True, initial=-jnp.inf))  # S = 0: -inf
    row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
    weights = jnp.where(allowed, jnp.exp(masked - row_max), 0.0)
    total = jnp.sum(weights, axis=-1, keepdims=True)
    probs = weights / jnp.where(total > 0, total, 1.0)
    lse = jnp.where(total > 0, row_max + jnp.log(jnp.where(total > 0, total, 1.0)), -jnp.inf)
    return probs, lse[..., 0]


def _apply_score_mod(ir: ScoreModIR, score: Any, scalars: dict, arrays: dict, index: tuple) -> Any:
    """The mod's forward; its gradient is the IR's bprop (`grad_output`), so a user's
    `score_mod_bprop` is honoured here as on cuDNN (a derived bprop equals autodiff: use that)."""
    if not ir.user_bprop:
        return evaluate(ir, score, scalars=scalars, arrays=arrays, index=index)[0]
    return _mod_with_bprop(ir, score, scalars, arrays, index)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _mod_with_bprop(ir: ScoreModIR, score: Any, scalars: dict, arrays: dict, index: tuple) -> Any:
    return evaluate(ir, score, scalars=scalars, arrays=arrays, index=index)[0]


def _mod_with_bprop_fwd(ir, score, scalars, arrays, index):
    return _mod_with_bprop(ir, score, scalars, arrays, index), (score, scalars, arrays, index)


def _mod_with_bprop_bwd(ir, residuals, dscore):
    score, scalars, arrays, index = residuals
    _, grad = evaluate(ir, score, scalars=scalars, arrays=arrays, index=index, dscore=dscore)
    # Scalars, aux arrays and positions are constants for differentiation, as on cuDNN.
    return (jnp.broadcast_to(grad, score.shape).astype(score.dtype), None, None, None)


_mod_with_bprop.defvjp(_mod_with_bprop_fwd, _mod_with_bprop_bwd)


def xla_attention(
    spec: AttentionSpec,
    query: Any,
    key: Any,
    value: Any,
    inputs: RuntimeInputs,
    score_mod: ScoreModIR | None = None,
    layout: TokenLayout | None = None,
) -> tuple[Any, Any]:
    """Return (output (B, T, N, H_v) in the input dtype, logsumexp (B, N, T) fp32).

    `layout` (default: from the spec and `inputs`) says where each query and key token sits."""
    b, t, n, h = query.shape
    s, k = key.shape[1], key.shape[2]
    g = n // k
    precision = _dot_precision(query.dtype)
    logits = jnp.einsum("btkgh,bskh->bkgts", query.reshape(b, t, k, g, h), key,
                        precision=precision, preferred_element_type=jnp.float32)
    logits = logits.reshape(b, n, t, s) * jnp.float32(spec.scale)

    q_pos, kv_pos, allowed = positions_and_mask(spec, inputs, layout)
    index = (
        jnp.arange(b, dtype=jnp.int32)[:, None, None, None],
        jnp.arange(n, dtype=jnp.int32)[None, :, None, None],
        q_pos[:, None, :, None],
        kv_pos[:, None, None, :],
    )
    if score_mod is not None:
        arrays = {name: jax.lax.stop_gradient(v) for name, v in (inputs.mod_arrays or {}).items()}
        logits = _apply_score_mod(score_mod, logits, dict(inputs.mod_scalars or {}), arrays, index)
        logits = logits.astype(jnp.float32)
    python = inputs.python_mods  # jax.numpy mods the IR cannot express, run as Python here
    if python is not None and python.score_mod is not None:
        logits = apply_jnp_score_mod(python.score_mod, logits, index).astype(jnp.float32)
    if inputs.bias is not None:
        logits = logits + inputs.bias.astype(jnp.float32)

    if python is not None and python.mask_mod is not None:
        allowed = allowed & apply_jnp_mask_mod(python.mask_mod, index, logits.shape)
    probs, lse = _masked_softmax(logits, allowed)
    probs = probs.astype(value.dtype).reshape(b, k, g, t, s)
    out = jnp.einsum("bkgts,bskh->btkgh", probs, value, precision=precision,
                     preferred_element_type=jnp.float32)
    return out.reshape(b, t, n, value.shape[-1]).astype(value.dtype), lse


class XlaBackend(Backend):
    """jax.numpy on whatever device JAX runs: every call, and mods the score_mod IR cannot express."""

    name = "xla"
    runs_python_mods = True

    def support(self, spec: AttentionSpec, score_mod: ScoreModIR | None, *, training: bool,
                verify: Verify | None = None) -> Support:
        return Support(True, self.name, "")

    def attention(self, spec: AttentionSpec, query: Any, key: Any, value: Any, inputs: RuntimeInputs,
                  score_mod: ScoreModIR | None, *, training: bool = True,
                  verify: Verify | None = None) -> tuple[Any, Any]:
        return xla_attention(spec, query, key, value, inputs, score_mod)

    @staticmethod
    def block_attention(spec: AttentionSpec, query: Any, key: Any, value: Any, inputs: RuntimeInputs,
                        score_mod: ScoreModIR | None, layout: TokenLayout) -> tuple[Any, Any]:
        """One block of a longer sequence (`parallel.ring`): `layout` gives its tokens' global positions."""
        return xla_attention(spec, query, key, value, inputs, score_mod, layout)


BACKEND = XlaBackend()
