"""The XLA backend: an AttentionSpec + ScoreModIR evaluated with jax.numpy.

It is the reference for every test, the fallback when cuDNN declines a config, and
the backend on machines without a GPU. Semantics, shared with the cuDNN lowering:

    logits = score_mod(scale * q . k) + bias      (fp32; fp64 for float64 inputs)
    masked where any mask says no (user mask, padding, segments, causal, window, chunk)
    out    = softmax(logits) . v                  (fp32 softmax; fully masked rows give 0)
             (with dropout, the softmax's weights times kept / (1 - rate): `dropout.apply`)

Which positions attend which (padding, segments, causal, windows, chunks) is `backends.masking`.
Short calls form all scores at once; long ones run `xla_blocks`, an online softmax over key blocks
with the same `scores` function per block (`_runs_direct` says which).
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from sdpagraph.backends.base import Backend, Verify
from sdpagraph.backends.masking import TokenLayout, key_slice, positions_and_mask, token_layout
from sdpagraph.backends.xla_blocks import accumulation_dtype, blockwise_attention, raw_scores, weighted_values
from sdpagraph import dropout, paged
from sdpagraph.call import RuntimeInputs
from sdpagraph.graphs.support import Support
from sdpagraph.scoremod.ir import ScoreModIR
from sdpagraph.scoremod.ir_eval import JAX, ArrayModule, evaluate
from sdpagraph.scoremod.jnp.apply import apply_jnp_mask_mod, apply_jnp_score_mod
from sdpagraph.spec import AttentionSpec


def _masked_softmax(logits: Any, allowed: Any) -> tuple[Any, Any]:
    """Softmax over keys in the logits' dtype; rows with no allowed key give zeros (no NaN, no NaN grads)."""
    masked = jnp.where(allowed, logits, -jnp.inf)
    row_max = jax.lax.stop_gradient(jnp.max(masked, axis=-1, keepdims=True, initial=-jnp.inf))  # S = 0: -inf
    row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
    weights = jnp.where(allowed, jnp.exp(masked - row_max), 0.0)
    total = jnp.sum(weights, axis=-1, keepdims=True)
    probs = weights / jnp.where(total > 0, total, 1.0)
    lse = jnp.where(total > 0, row_max + jnp.log(jnp.where(total > 0, total, 1.0)), -jnp.inf)
    return probs, lse[..., 0]


def _apply_score_mod(ir: ScoreModIR, score: Any, scalars: dict, arrays: dict, index: tuple) -> Any:
    """The mod's forward, its FLOAT nodes in the score's dtype; its gradient is the IR's bprop
    (`grad_output`), so a user's `score_mod_bprop` is honoured here as on cuDNN (a derived bprop
    equals autodiff: use that)."""
    module = JAX if score.dtype == JAX.float_dtype else dataclasses.replace(JAX, float_dtype=score.dtype)
    if not ir.user_bprop:
        return evaluate(ir, score, scalars=scalars, arrays=arrays, index=index, module=module)[0]
    return _mod_with_bprop(ir, module, score, scalars, arrays, index)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _mod_with_bprop(ir: ScoreModIR, module: ArrayModule, score: Any, scalars: dict, arrays: dict,
                    index: tuple) -> Any:
    return evaluate(ir, score, scalars=scalars, arrays=arrays, index=index, module=module)[0]


def _mod_with_bprop_fwd(ir, module, score, scalars, arrays, index):
    return _mod_with_bprop(ir, module, score, scalars, arrays, index), (score, scalars, arrays, index)


def _mod_with_bprop_bwd(ir, module, residuals, dscore):
    score, scalars, arrays, index = residuals
    _, grad = evaluate(ir, score, scalars=scalars, arrays=arrays, index=index, dscore=dscore, module=module)
    # Scalars, aux arrays and positions are constants for differentiation, as on cuDNN.
    return (jnp.broadcast_to(grad, score.shape).astype(score.dtype), None, None, None)


_mod_with_bprop.defvjp(_mod_with_bprop_fwd, _mod_with_bprop_bwd)


# Keys per block of the blockwise path (`xla_blocks`), whose memory is O(B·N·T·block) where the
# direct path's (all scores at once, as jax.nn.dot_product_attention) is O(B·N·T·S). 1024: on an
# H100 (bf16, N16 H128) 1024 keys a block ran 1.0-1.4x the direct path's time where 512 ran
# 1.1-1.6x (fewer, larger steps); on CPU both ran 0.25-1.0x of it (bench/xla_fallback.py).
KEY_BLOCK = 1024

# On accelerators the direct path runs while its temporaries take at most this share of the
# device's memory: there its saved probabilities beat the blockwise backward's recomputation, so a
# call that fits keeps the speed it had (on an H100 at B1 N16 H128 bf16 causal, fwd+bwd held 2 GiB
# of temporaries at T=S=4096, about 8 bytes a score, and ran 1.37x faster than in blocks); past it,
# the blocks' O(B·N·T·block) memory wins. On CPU the blockwise path is faster at every size
# measured (its blocks stay in cache), so there only S <= KEY_BLOCK runs direct.
DIRECT_MEMORY_SHARE = 0.25
DIRECT_BYTES_PER_SCORE = 8  # forward and backward temporaries, measured (bench/xla_fallback.py)
# A device that reports no memory limit: as 2**28 scores (2 GiB of temporaries) were on an H100.
DIRECT_MAX_SCORES = 2**28


def _direct_max_scores() -> int:
    """How many scores (B·N·T·S) the direct path may form at once on this accelerator."""
    stats = jax.devices()[0].memory_stats() or {}
    if "bytes_limit" not in stats:
        return DIRECT_MAX_SCORES
    return int(DIRECT_MEMORY_SHARE * stats["bytes_limit"] / DIRECT_BYTES_PER_SCORE)


def _runs_direct(query: Any, key: Any, block: int | None) -> bool:
    """Whether all scores are formed at once: S <= block when a block is given, else the policy above."""
    (b, t, n, _), s = query.shape, key.shape[1]
    if block is not None:
        return s <= block
    return s <= KEY_BLOCK or (jax.default_backend() != "cpu" and b * n * t * s <= _direct_max_scores())


_INDEX = (np.zeros((), np.int32),) * 4  # an element's (b, h, q_idx, kv_idx), as the Python mods see it


def _scores(spec: AttentionSpec, inputs: RuntimeInputs, score_mod: ScoreModIR | None, layout: TokenLayout,
            acc: Any) -> tuple[Any, dict]:
    """(scores, params): scores(raw, bias, start, params) -> (logits, allowed) for the keys
    [start, start + size) of raw = scale * q.k (B, N, T, size): score_mod, the Python mods, the bias
    (that block's slice), and every mask. `params` holds what the mods read that may be
    differentiated: the values the Python mods close over."""
    s = layout.kv_pos.shape[-1]
    arrays = {name: jax.lax.stop_gradient(v) for name, v in (inputs.mod_arrays or {}).items()}
    python = inputs.python_mods  # jax.numpy mods the IR cannot express, run as Python here
    py_score = py_mask = None
    scalars = dict(inputs.mod_scalars or {})  # Python numbers: constants
    params = {"score_mod": [], "mask_mod": []}
    if python is not None and python.score_mod is not None:
        py_score, params["score_mod"] = jax.closure_convert(python.score_mod, np.zeros((), acc), *_INDEX)
    if python is not None and python.mask_mod is not None:
        py_mask, params["mask_mod"] = jax.closure_convert(python.mask_mod, *_INDEX)

    def scores(raw: Any, bias: Any, start: Any, params: dict) -> tuple[Any, Any]:
        b, n, _, size = raw.shape
        q_pos, kv_pos, allowed = positions_and_mask(spec, inputs, layout, keys=(start, size))
        index = (
            jnp.arange(b, dtype=jnp.int32)[:, None, None, None],
            jnp.arange(n, dtype=jnp.int32)[None, :, None, None],
            q_pos[:, None, :, None],
            kv_pos[:, None, None, :],
        )
        logits = raw
        if score_mod is not None:
            block_arrays = {name: key_slice(v, start, size, s) for name, v in arrays.items()}
            logits = _apply_score_mod(score_mod, logits, scalars, block_arrays, index).astype(acc)
        if py_score is not None:
            mod = lambda *a: py_score(*a, *params["score_mod"])  # noqa: E731
            logits = apply_jnp_score_mod(mod, logits, index).astype(acc)
        if bias is not None:
            logits = logits + bias.astype(acc)
        if py_mask is not None:
            mask = lambda *a: py_mask(*a, *params["mask_mod"])  # noqa: E731
            allowed = allowed & apply_jnp_mask_mod(mask, index, logits.shape)
        return logits, allowed

    return scores, params


def xla_attention(
    spec: AttentionSpec,
    query: Any,
    key: Any,
    value: Any,
    inputs: RuntimeInputs,
    score_mod: ScoreModIR | None = None,
    layout: TokenLayout | None = None,
    block: int | None = None,
) -> tuple[Any, Any]:
    """Return (output (B, T, N, H_v) in the input dtype, logsumexp (B, N, T) fp32, or fp64 for
    float64 inputs).

    `layout` (default: from the spec and `inputs`) says where each query and key token sits.
    Long calls run blockwise (`xla_blocks`), never holding the (B, N, T, S) scores: past KEY_BLOCK
    keys (and, off CPU, DIRECT_MAX_SCORES scores); `block` given: past `block` keys, in blocks of it."""
    acc = accumulation_dtype(query.dtype)
    layout = token_layout(spec, inputs) if layout is None else layout
    scores, params = _scores(spec, inputs, score_mod, layout, acc)
    if not _runs_direct(query, key, block):
        return blockwise_attention(scores, query, key, value, inputs.bias, params, scale=spec.scale,
                                   block=block or KEY_BLOCK, dropout_rate=spec.dropout,
                                   dropout_seeds=inputs.dropout_seeds)
    logits, allowed = scores(raw_scores(query, key, spec.scale), inputs.bias, 0, params)
    probs, lse = _masked_softmax(logits, allowed)
    probs = dropout.apply(probs, spec.dropout, inputs.dropout_seeds)
    return weighted_values(probs, value).astype(value.dtype), lse


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
        if spec.paged is not None:  # the pages gathered into each sequence's keys
            key, value = (paged.gather(pool, inputs.page_table) for pool in (key, value))
            spec = dataclasses.replace(spec, paged=None)
        return xla_attention(spec, query, key, value, inputs, score_mod)

    @staticmethod
    def block_attention(spec: AttentionSpec, query: Any, key: Any, value: Any, inputs: RuntimeInputs,
                        score_mod: ScoreModIR | None, layout: TokenLayout) -> tuple[Any, Any]:
        """One block of a longer sequence (`parallel.ring`): `layout` gives its tokens' global positions."""
        return xla_attention(spec, query, key, value, inputs, score_mod, layout)


BACKEND = XlaBackend()
