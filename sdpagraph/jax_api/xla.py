"""The XLA backend: an AttentionSpec + ScoreModIR evaluated with jax.numpy.

It is the reference for every test, the fallback when cuDNN declines a config, and
the backend on machines without a GPU. Semantics, shared with the cuDNN lowering:

    logits = score_mod(scale * q . k) + bias      (fp32)
    masked where any mask says no (user mask, padding, segments, causal, window, chunk)
    out    = softmax(logits) . v                  (fp32 softmax; fully masked rows give 0)

Positions used by masks and by `gen_index` count from the start of each packed
segment. With `causal_alignment="bottom_right"` the diagonal is shifted by
`kv_len - q_len` (per row, or per segment when packed), so the last query sees the
last key; windows and chunks are measured from that shifted diagonal.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp

from sdpagraph.graphs.ir import ScoreModIR
from sdpagraph.graphs.ir_eval import evaluate
from sdpagraph.graphs.jnp_mods import apply_jnp_mask_mod, apply_jnp_score_mod
from sdpagraph.jax_api.call import RuntimeInputs
from sdpagraph.jax_api.segments import at_runs, segment_metadata, segment_positions, segment_run_ids
from sdpagraph.spec import UNBOUNDED, AttentionSpec


@dataclass(frozen=True)
class TokenLayout:
    """Per-token facts shared by the masks and by score_mod's gen_index. A context-parallel block
    passes its own (`xla_attention(layout=...)`): global positions and segments of its tokens."""

    q_pos: Any  # (B, T) position of each query in its sequence / segment
    kv_pos: Any  # (B, S)
    q_valid: Any  # (B, T) bool: not padding
    kv_valid: Any  # (B, S)
    q_group: Any  # (B, T) segment number (1-based) or None without segments
    kv_group: Any
    diag_offset: Any  # broadcastable to (B, T, S): kv_len - q_len for bottom-right, else 0


def _segment_layout(spec: AttentionSpec, inputs: RuntimeInputs) -> TokenLayout:
    q_ids, kv_ids = inputs.q_segment_ids, inputs.kv_segment_ids
    q_run, kv_run = segment_run_ids(q_ids), segment_run_ids(kv_ids)
    # Segments past max_segments are dropped (treated as padding), as the THD metadata does.
    q_valid = (q_run > 0) & (q_run <= spec.max_segments)
    kv_valid = (kv_run > 0) & (kv_run <= spec.max_segments)
    offset = 0
    if spec.causal_alignment == "bottom_right" and spec.segments == "cross":
        q_len = at_runs(segment_metadata(q_ids, spec.max_segments).seq_lens, q_run)
        kv_len = at_runs(segment_metadata(kv_ids, spec.max_segments).seq_lens, kv_run)
        offset = kv_len[:, None, :] - q_len[:, :, None]
    return TokenLayout(segment_positions(q_ids), segment_positions(kv_ids), q_valid, kv_valid, q_run, kv_run, offset)


def _dense_layout(spec: AttentionSpec, inputs: RuntimeInputs) -> TokenLayout:
    b, t, s = spec.batch, spec.q_len, spec.kv_len
    q_pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    kv_pos = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
    q_len = jnp.full((b,), t, jnp.int32) if inputs.q_lengths is None else inputs.q_lengths.astype(jnp.int32)
    kv_len = jnp.full((b,), s, jnp.int32) if inputs.kv_lengths is None else inputs.kv_lengths.astype(jnp.int32)
    offset = 0
    if spec.causal_alignment == "bottom_right":
        offset = (kv_len - q_len)[:, None, None]
    return TokenLayout(q_pos, kv_pos, q_pos < q_len[:, None], kv_pos < kv_len[:, None], None, None, offset)


def _layout(spec: AttentionSpec, inputs: RuntimeInputs) -> TokenLayout:
    return _segment_layout(spec, inputs) if spec.segments else _dense_layout(spec, inputs)


def position_allowed(spec: AttentionSpec, diag: Any, kv: Any, xp: Any = jnp) -> Any:
    """Boolean (`diag` and `kv` broadcast together): where the key at position `kv` passes the spec's
    causal, window and chunk masks around the aligned query position `diag`; None without them.
    `xp`: jax.numpy, or numpy for the numerical check's host-side reference."""
    if not spec.has_position_mask:
        return None
    allowed = xp.ones(xp.broadcast_shapes(xp.shape(diag), xp.shape(kv)), xp.bool_)
    left, right = spec.window
    if spec.is_causal:
        allowed &= kv <= diag
    if left != UNBOUNDED:
        allowed &= kv >= diag - left
    if right != UNBOUNDED:
        allowed &= kv <= diag + right
    if spec.chunk_size is not None:
        allowed &= xp.floor_divide(diag, spec.chunk_size) == xp.floor_divide(kv, spec.chunk_size)
    return allowed


def allowed_mask(spec: AttentionSpec, inputs: RuntimeInputs, layout: TokenLayout) -> Any:
    """Boolean (B|1, N|1, T, S): True where a query may attend to a key."""
    allowed = layout.q_valid[:, :, None] & layout.kv_valid[:, None, :]
    if layout.q_group is not None:
        allowed &= layout.q_group[:, :, None] == layout.kv_group[:, None, :]
    diag = layout.q_pos[:, :, None] + layout.diag_offset  # aligned query position, (B, T, 1|S)
    positions = position_allowed(spec, diag, layout.kv_pos[:, None, :])
    if positions is not None:
        allowed &= positions
    allowed = allowed[:, None, :, :]
    if inputs.mask is not None:
        allowed = allowed & inputs.mask
    return allowed


def positions_and_mask(spec: AttentionSpec, inputs: RuntimeInputs,
                       layout: TokenLayout | None = None) -> tuple[Any, Any, Any]:
    """(query positions (B, T), key positions (B, S), allowed (B|1, N|1, T, S)): what `gen_index`
    reads on the sequence axes, and where a query may attend to a key. `layout` (default: from the
    spec and `inputs`) says where each query and key token sits."""
    layout = _layout(spec, inputs) if layout is None else layout
    return layout.q_pos, layout.kv_pos, allowed_mask(spec, inputs, layout)


def attended_rows(spec: AttentionSpec, inputs: RuntimeInputs) -> Any:
    """Boolean (B|1, N|1, T): the query rows that may attend to at least one key."""
    return jnp.any(allowed_mask(spec, inputs, _layout(spec, inputs)), axis=-1)


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
