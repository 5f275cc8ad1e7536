"""A float32 NumPy reference of attention with a score_mod IR, on a slice of the scores.

    reference(spec, ir, gradients, picks, data, scalars) -> {"o", "lse", "attends", "dq", "dk", "dv", "dbias"}

The numerical check (`numerics.check`) compares cuDNN's results with it. It computes on the
host, so it compiles nothing (compiling an XLA float32 reference was nearly all of the check's
time). It computes in float32, as the XLA backend and cuDNN's own arithmetic do: products of bf16
or fp16 values are exact there and its rounding (about 1e-6 relative) is far below the check's
bounds (1e-2) and the bf16 rounding of the results it judges (2e-3); float64 cost twice the memory
traffic and the transcendental functions' vector speed (docs/results/). Its products run on a few
BLAS threads (`numerics.host_blas`). The mod runs through
`scoremod.ir_eval` on NumPy, the backward through the IR's bprop as cuDNN's backward graph does.
It computes only the scores of the picked (batch row, head, query row) elements, against every key,
and dk and dv at the picked keys. Keys are logical (B', S, K', H) ones: paged K/V's are given read
from the pool through the page table (`numerics_draw.key_index`), so nothing here is paged.

Attention sinks (`backends.sinks`, a spec with `sinks`): each head's sink logit s_h joins every row's
softmax denominator after the mod and the bias, adding no value; o and lse are the sink's. A spec
with sinks has no backward graph (`spec.directions_for`), so the check asks for its forward only.
"""
from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from sdpagraph.numerics.host_blas import few_blas_threads
from sdpagraph.scoremod.ir import ScoreModIR
from sdpagraph.scoremod.ir_eval import NUMPY_FLOAT32, evaluate
from sdpagraph.spec import AttentionSpec


@few_blas_threads()  # its products are small: waking every OpenBLAS thread costs more than it gives
def reference(spec: AttentionSpec, ir: ScoreModIR | None, gradients: bool, picks: Mapping[str, np.ndarray],
              data: Mapping[str, Any], scalars: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """Attention of the slice with NumPy (module docstring): o (B', N', T', H_v), lse (B', N', T'),
    `attends` (B', N', T'), whether a row attends to some key, and, with `gradients`, dq (B', N', T', H),
    dk, dv (B', S', K', H) and dbias (B', N', T', S|1).

    `picks`: the slice's batch `rows` (B',), `heads` (N',), `kv_heads` (K',), `queries`
    (B', N', T') and the `keys` (S') dk and dv are computed at. `data`: the slice of the inputs,
    query-side as (B', N', T', ...): q, the cotangent, k and v (B', S, K', H), `allowed` (where a
    query may attend, broadcastable to the scores), the positions `gen_index` reads (`q_pos`
    (B', N', T'), `kv_pos` (B', S)), the bias (None or broadcastable) and the mod's `arrays`;
    the sinks' logits of the picked heads (`sinks` (N',), None or absent without sinks); `scalars`:
    the mod's scalars."""
    f32 = lambda x: np.asarray(x, np.float32)  # noqa: E731
    scale = np.float32(spec.scale)
    group = spec.num_heads // spec.num_kv_heads
    kv_of = np.searchsorted(picks["kv_heads"], picks["heads"] // group)  # each head's K' index
    q = f32(data["q"])  # (B', N', T', H)
    k, v = (_per_head(data[name], kv_of) for name in ("k", "v"))  # (B', N', S, H): one matmul per (row, head)
    score = scale * (q @ k.swapaxes(-1, -2))  # (B', N', T', S)
    index = (np.asarray(picks["rows"], np.int32)[:, None, None, None],
             np.asarray(picks["heads"], np.int32)[None, :, None, None],
             np.asarray(data["q_pos"], np.int32)[..., None],
             np.asarray(data["kv_pos"], np.int32)[:, None, None, :])
    arrays = {name: np.asarray(x) for name, x in data["arrays"].items()}

    forward_values: list = []  # the backward's call reuses the forward's nodes

    def mod(dscore=None):
        out = evaluate(ir, score, scalars=scalars, arrays=arrays, index=index, dscore=dscore, module=NUMPY_FLOAT32,
                       memo=forward_values)
        return np.broadcast_to(out[0] if dscore is None else out[1], score.shape)

    logits = score if ir is None else mod()
    if data["bias"] is not None:
        logits = logits + f32(data["bias"])
    allowed = np.broadcast_to(np.asarray(data["allowed"], bool), logits.shape)
    sinks = data.get("sinks")
    sink = None if sinks is None else f32(sinks)[None, :, None, None]  # (1, N', 1, 1)
    probs, lse, attends = _softmax(logits, allowed, sink)
    out = probs @ v
    result = {"o": out, "lse": lse, "attends": attends}
    if not gradients:
        return result
    if ir is not None and ir.grad_output is None:
        raise ValueError("the score_mod has no bprop, so its backward graph cannot be checked")
    # Backward as the cuDNN graph computes it: through the softmax, then the mod's bprop (the IR's
    # derived one equals the XLA backend's autodiff; a user's is what both backends run).
    d_out = f32(data["cotangent"])
    row_term = np.sum(d_out * out, axis=-1, keepdims=True)  # <dO, o>
    d_logits = probs * (d_out @ v.swapaxes(-1, -2) - row_term)
    d_score = d_logits if ir is None else mod(d_logits)
    result["dq"] = scale * (d_score @ k)
    at_keys = lambda x: np.take(x, picks["keys"], axis=-1).swapaxes(-1, -2)  # noqa: E731 - (B', N', S', T')
    per_head = {"dk": scale * (at_keys(d_score) @ q), "dv": at_keys(probs) @ d_out}  # (B', N', S', H)
    for name, grads in per_head.items():
        result[name] = _sum_groups(grads, kv_of).transpose(0, 2, 1, 3)
    if data["bias"] is not None:
        result["dbias"] = _bias_gradient(spec, picks, d_logits)
    return result


def _softmax(logits: np.ndarray, allowed: np.ndarray,
             sink: np.ndarray | None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(probabilities (B', N', T', S), logsumexp (B', N', T'), whether each row attends to some key):
    the softmax over the allowed keys and the sink (None without sinks). A row with no allowed key
    has probabilities 0 and logsumexp -inf, or the sink's logit."""
    row_max = np.max(np.where(allowed, logits, -np.inf), axis=-1, keepdims=True)
    if sink is not None:
        row_max = np.maximum(row_max, sink)
    row_max = np.where(np.isfinite(row_max), row_max, 0.0)
    weights = np.where(allowed, np.exp(np.where(allowed, logits, row_max) - row_max), 0.0)
    total = np.sum(weights, axis=-1, keepdims=True)
    attends = total[..., 0] > 0
    if sink is not None:
        total = total + np.exp(sink - row_max)
    divisor = np.where(total > 0, total, 1.0)
    lse = np.where(total > 0, row_max + np.log(divisor), -np.inf)[..., 0]
    return weights / divisor, lse, attends


def _per_head(x: Any, kv_of: np.ndarray) -> np.ndarray:
    """(B', S, K', H) keys or values as (B', N', S, H) in float32: each picked head's kv head."""
    x = np.asarray(x.transpose(0, 2, 1, 3), np.float32)  # converted straight from the strided view
    return x if _identity(kv_of, x.shape[1]) else x[:, kv_of]


def _sum_groups(grads: np.ndarray, kv_of: np.ndarray) -> np.ndarray:
    """(B', N', ...) per head to (B', K', ...) per kv head: the sum over each kv head's group (the
    picked heads are sorted, so a group's heads are adjacent)."""
    if _identity(kv_of, grads.shape[1]):
        return grads
    return np.add.reduceat(grads, np.flatnonzero(np.r_[True, kv_of[1:] != kv_of[:-1]]), axis=1)


def _identity(kv_of: np.ndarray, size: int) -> bool:
    return len(kv_of) == size and bool(np.all(kv_of == np.arange(size)))


def _bias_gradient(spec: AttentionSpec, picks: Mapping[str, np.ndarray], d_logits: np.ndarray) -> np.ndarray:
    """The bias gradient at each of the slice's (row, head, query) elements, (B', N', T', S|1): the
    sum of `d_logits` over every element of the slice that reads the same bias element (a bias that
    broadcasts over B, N or T is read by several; the others send no gradient, their cotangent is 0)."""
    axes = [picks["rows"][:, None, None], picks["heads"][None, :, None], picks["queries"]]
    shape = spec.bias_shape
    where = np.broadcast_arrays(*(index if size == full else np.zeros_like(index)
                                  for index, size, full in zip(axes, shape, (spec.batch, spec.num_heads, spec.q_len))))
    if shape[3] == 1:
        d_logits = np.sum(d_logits, axis=-1, keepdims=True)
    _, inverse = np.unique(np.stack([w.ravel() for w in where]), axis=1, return_inverse=True)
    inverse = inverse.ravel()
    summed = np.zeros((inverse.max() + 1, d_logits.shape[-1]), d_logits.dtype)
    np.add.at(summed, inverse, d_logits.reshape(-1, d_logits.shape[-1]))
    return summed[inverse].reshape(*where[0].shape, d_logits.shape[-1])
