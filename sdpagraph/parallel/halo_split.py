"""One causal halo block on cuDNN as two calls of square, top-left graphs, merged by logsumexp.

A halo block's queries (L) over [left halo (hl) ++ its own keys (L)] are one call with the window
relative to the bottom-right diagonal (`halo.HaloPlan.block_spec`); on 2 H200s such calls (T16384,
S17408, window (1024, 0)) ran 10x slower than the same window over T = S, as if no tile were skipped.
So a causal block splits into
- the local part: its queries over its own keys, T = S = L, the causal window top-left (the
  one-device graph);
- the halo part: with a window of `left` = hl <= L keys, query i sees halo key j iff j >= i, which
  with both reversed is causal top-left over T = S = hl (`reverse`); with the block inside one chunk
  and no window (`chunk_fit` WITHIN), every query sees every halo key: a dense (L, hl) call;
merged by their logsumexps. As in the ring, one custom_vjp: each part's backward graph is given the
FINAL output and logsumexp (cuDNN's backward takes no logsumexp cotangent), and the sinks join once,
after the merge.

`present` (traced bools, one per batch row or one for all; None: True) says whether a row's block
has the halo at all: where it has none (the sequence's first block), the halo part still runs, on
whatever keys arrived, and adds nothing (its logsumexp -inf forward, its dO zero backward). So every
device runs the same two calls, where a `lax.switch` between "halo" and "no halo" made XLA copy the
branch index to the host and wait for the device before each branch, on every step.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Mapping

import jax
import jax.numpy as jnp

from sdpagraph.backends import registry, sinks as sinks_mod
from sdpagraph.backends.softmax_merge import merge
from sdpagraph.call import RuntimeInputs
from sdpagraph.scoremod.ir import ScoreModIR
from sdpagraph.spec import AttentionSpec


@dataclass(frozen=True)
class SplitPlan:
    """The two calls of one block (hashable: custom_vjp's static argument)."""

    local: AttentionSpec  # T = S = L
    halo: AttentionSpec | None  # T = rows, S = hl; None without a halo
    rows: int  # the block's first `rows` queries see the halo
    reverse: bool  # the halo part runs on reversed queries and keys (a causal graph)
    score_mod: ScoreModIR | None  # reads no positions (a reversed part would see them mirrored)
    scalars: tuple[tuple[str, Any], ...]

    def statics(self) -> tuple[Any, Any]:
        primary = registry.primary()
        static = lambda spec: None if spec is None else primary.block_static(spec, self.score_mod,  # noqa: E731
                                                                             dict(self.scalars))
        return static(self.local), static(self.halo)


def _flip(x: Any, axis: int = 1) -> Any:
    return jnp.flip(x, axis=axis)


def _halo_inputs(plan: SplitPlan, q: Any, kv: tuple[Any, Any]) -> tuple[Any, Any, Any]:
    """The halo part's q (its first `rows`), k, v, reversed when the plan says so."""
    q = q[:, :plan.rows]
    k, v = kv
    return (_flip(q), _flip(k), _flip(v)) if plan.reverse else (q, k, v)


def _per_row(present: Any, x: Any) -> Any:
    """`present` (one bool, or one per batch row) shaped to broadcast against `x` (batch first)."""
    return jnp.reshape(present, (-1,) + (1,) * (x.ndim - 1))


def _forward(plan: SplitPlan, q, local_kv, halo_kv, arrays, sinks, present) -> tuple[Any, Any]:
    primary = registry.primary()
    local, halo = plan.statics()
    inputs = RuntimeInputs(mod_arrays=arrays)
    out, lse = primary.block_forward(local, q, *local_kv, primary.block_operands(local, inputs))
    hq, hk, hv = _halo_inputs(plan, q, halo_kv)
    h_out, h_lse = primary.block_forward(halo, hq, hk, hv, primary.block_operands(halo, inputs))
    if plan.reverse:
        h_out, h_lse = _flip(h_out), _flip(h_lse, axis=-1)
    if present is not None:
        h_lse = jnp.where(_per_row(present, h_lse), h_lse, -jnp.inf)
    # only the first `rows` rows change (joined by concatenation: an in-place update of the graph's
    # result made XLA 0.11 report a cycle in a dynamic-slice fusion on 2 H100s)
    head, head_lse = merge((out[:, :plan.rows], lse[..., :plan.rows]), (h_out, h_lse))
    out = jnp.concatenate([head.astype(out.dtype), out[:, plan.rows:]], axis=1).astype(q.dtype)
    lse = jnp.concatenate([head_lse, lse[..., plan.rows:]], axis=-1)
    return (out, lse) if sinks is None else sinks_mod.apply(out, lse, sinks)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def split_attention(plan: SplitPlan, q, local_kv, halo_kv, arrays: Mapping[str, Any], sinks,
                    present=None) -> tuple[Any, Any]:
    """(output (B, L, N, Hv), logsumexp (B, N, L)) of a block's queries over its halo (`halo_kv`, hl
    keys before the block; `plan.halo` set) and its own keys (`local_kv`); `arrays` (the score_mod's)
    are constants; `present`: whether the halo exists (module docstring)."""
    return _forward(plan, q, local_kv, halo_kv, arrays, sinks, present)


def _split_fwd(plan: SplitPlan, q, local_kv, halo_kv, arrays, sinks, present):
    out, lse = _forward(plan, q, local_kv, halo_kv, arrays, sinks, present)
    return (out, lse), (q, local_kv, halo_kv, arrays, sinks, present, out, lse)


def _split_bwd(plan: SplitPlan, residuals, cotangents):
    q, local_kv, halo_kv, arrays, sinks, present, out, lse = residuals
    d_o = cotangents[0]
    primary = registry.primary()
    local, halo = plan.statics()
    inputs = RuntimeInputs(mod_arrays=arrays)
    dq, dk, dv = primary.block_backward(local, q, *local_kv, primary.block_operands(local, inputs), out, lse, d_o)
    hq, hk, hv = _halo_inputs(plan, q, halo_kv)
    h_out, h_lse, h_do = out[:, :plan.rows], lse[..., :plan.rows], d_o[:, :plan.rows]
    if present is not None:  # zero dO: zero gradients from the halo part
        h_do = jnp.where(_per_row(present, h_do), h_do, jnp.zeros_like(h_do))
    if plan.reverse:
        h_out, h_lse, h_do = _flip(h_out), _flip(h_lse, axis=-1), _flip(h_do)
    h_dq, h_dk, h_dv = primary.block_backward(halo, hq, hk, hv, primary.block_operands(halo, inputs),
                                              h_out, h_lse, h_do)
    if plan.reverse:
        h_dq, h_dk, h_dv = _flip(h_dq), _flip(h_dk), _flip(h_dv)
    head = dq[:, :plan.rows].astype(jnp.float32) + h_dq.astype(jnp.float32)
    dq = jnp.concatenate([head.astype(dq.dtype), dq[:, plan.rows:]], axis=1)
    d_halo = (h_dk, h_dv)
    d_sinks = None if sinks is None else sinks_mod.gradient(d_o, out, lse, sinks)
    return dq, (dk, dv), d_halo, jax.tree.map(lambda _: None, arrays), d_sinks, None


split_attention.defvjp(_split_fwd, _split_bwd)
