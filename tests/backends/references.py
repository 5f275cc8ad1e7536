"""The conformance suite's references: float64 NumPy (tests/reference.py, written from the
definitions) and `jax.nn.dot_product_attention(implementation="xla")` where it expresses a case."""
from __future__ import annotations

import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from tests import reference as ref
from tests.backends.cases import Call
from tests.backends.conftest import jit


@dataclass(frozen=True)
class Result:
    out: np.ndarray  # (B, T, N, H)
    lse: np.ndarray  # (B, T, N)
    grads: tuple  # dq, dk, dv, and dbias when the call has a bias
    rows: np.ndarray | None = None  # (B, T, N) rows to compare (None: all)


def _allowed(call: Call) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(allowed (B, N, T, S), query positions (B, T), key positions (B, S)), cell by cell."""
    b, t, n, _ = call.q.shape
    s = call.k.shape[1]
    ok, q_pos, k_pos = ref.allowed(b, t, s, **call.parts.allowed)
    ok = np.broadcast_to(ok[:, None], (b, n, t, s))
    if call.parts.mask is not None:
        ok = ok & np.broadcast_to(call.parts.mask, ok.shape)
    return ok, q_pos, k_pos


@functools.lru_cache(maxsize=None)
def numpy_reference(call: Call) -> Result:
    """tests.reference's float64 forward and backward, and the logsumexp, on the call's inputs."""
    ok, q_pos, k_pos = _allowed(call)
    mod = call.parts.mod
    q, k, bias = (None if x is None else np.asarray(x, np.float64) for x in (call.q, call.k, call.bias))
    out, (dq, dk, dv, dbias) = ref.attention_fwd_bwd(call.q, call.k, call.v, call.cotangent, scale=call.scale, ok=ok,
                                                     q_pos=q_pos, k_pos=k_pos, mod=mod, bias=call.bias)
    group = q.shape[2] // k.shape[2]
    raw = np.einsum("btnh,bsnh->bnts", q, np.repeat(k, group, axis=2)) * call.scale
    index = np.ix_(np.arange(q.shape[0]), np.arange(q.shape[2]), np.arange(1), np.arange(1))[:2]
    logits = mod.f(raw, *index, q_pos[:, None, :, None], k_pos[:, None, None, :])
    if bias is not None:
        logits = logits + bias
    masked = np.where(ok, logits, -np.inf)
    peak = np.max(masked, axis=-1, keepdims=True)
    peak = np.where(np.isfinite(peak), peak, 0.0)
    total = np.sum(np.where(ok, np.exp(masked - peak), 0.0), axis=-1)
    lse = np.where(total > 0, peak[..., 0] + np.log(np.where(total > 0, total, 1.0)), -np.inf)
    grads = (dq, dk, dv) + ((dbias,) if call.bias is not None else ())
    return Result(out, np.swapaxes(lse, 1, 2), grads)


@functools.lru_cache(maxsize=None)
def jax_reference(call: Call) -> Result | None:
    """jax.nn.dot_product_attention(implementation="xla") in float32 where it expresses the case
    (None elsewhere). jax averages the values of a row with nothing to attend where sdpagraph gives
    0: such rows are left out (`rows`) and their cotangent is 0."""
    if call.parts.jax is None or call.dtype != "float32":
        return None
    ok, q_pos, k_pos = _allowed(call)
    rows = np.swapaxes(ok.any(-1), 1, 2)  # (B, T, N)
    kwargs = dict(call.parts.jax, scale=call.scale)
    if call.parts.jax_bias is not None:
        extra = call.parts.jax_bias(np.arange(call.q.shape[1]), np.arange(call.k.shape[1])).astype(np.float32)
    cotangent = jnp.asarray(call.cotangent * rows[..., None])
    arrays = tuple(jnp.asarray(x) for x in (call.q, call.k, call.v, call.bias) if x is not None)

    def loss(q, k, v, *bias):
        user = bias[0] if bias else None
        if call.parts.jax_bias is not None:
            user = extra if user is None else user + extra
        out, lse = jax.nn.dot_product_attention(q, k, v, user, implementation="xla", return_residual=True, **kwargs)
        return jnp.sum(out * cotangent), (out, lse)

    (_, (out, lse)), grads = jit(jax.value_and_grad(loss, argnums=tuple(range(len(arrays))), has_aux=True))(
        *arrays)
    return Result(np.asarray(out), np.asarray(lse), tuple(np.asarray(g) for g in grads), rows)
