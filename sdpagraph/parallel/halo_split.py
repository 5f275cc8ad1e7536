"""One causal halo block on cuDNN as two calls of square, top-left graphs, merged by logsumexp.

A halo block's queries (L) over [left halo (hl) ++ its own keys (L)] are one call with the window
relative to the bottom-right diagonal (`halo.HaloPlan.block_spec`); on 2 H200s such calls (T16384,
S17408, window (1024, 0)) ran 10x slower than the same window over T = S, as if no tile were skipped.
So a causal block splits into
- the local part: its queries over its own keys, T = S = L, the causal window top-left (the
  one-device graph);
- the halo part: with a window of `left` = hl <= L keys, query i sees halo key j iff j >= i: the
  band (0, unbounded) around the top-left diagonal over T = S = hl, no causal mask; with the block
  inside one chunk and no window (`chunk_fit` WITHIN), every query sees every halo key: a dense
  (L, hl) call;
merged by their logsumexps. As in the ring, one custom_vjp: each part's backward graph is given the
FINAL output and logsumexp (cuDNN's backward takes no logsumexp cotangent), and the sinks join once,
after the merge.

`present` (traced bools, one per batch row or one for all; None: True) says whether a row's block
has the halo at all: where it has none (the sequence's first block), the halo part still runs, on
whatever keys arrived, and adds nothing (its logsumexp -inf forward; +inf backward, so that
P = exp(s - lse) = 0). So every device runs the same two calls, where a `lax.switch` between "halo"
and "no halo" made XLA copy the branch index to the host and wait for the device before each
branch, on every step.

Only the block's first `rows` rows see the halo: the merge and dq's sum update those rows of the
local call's results in place (`row_updates`). `exchanged_attention` runs all of a
device's blocks as the batch rows of one split call and receives their halos inside its custom_vjp,
so their dk/dv go back and are added in place where they came from (`halo_exchange`).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Mapping

import jax
import jax.numpy as jnp

from sdpagraph.backends import registry, sinks as sinks_mod
from sdpagraph.call import RuntimeInputs
from sdpagraph.parallel import halo_exchange
from sdpagraph.parallel.halo_exchange import Route
from sdpagraph.parallel.row_updates import add_rows, merge_rows, present_rows
from sdpagraph.parallel.transfer import grads_to_send
from sdpagraph.scoremod.ir import ScoreModIR
from sdpagraph.spec import AttentionSpec


@dataclass(frozen=True)
class SplitPlan:
    """The two calls of one block (hashable: custom_vjp's static argument)."""

    local: AttentionSpec  # T = S = L
    halo: AttentionSpec | None  # T = rows, S = hl; None without a halo
    rows: int  # the block's first `rows` queries see the halo
    score_mod: ScoreModIR | None  # reads no positions (each call counts them from its own first token)
    scalars: tuple[tuple[str, Any], ...]

    def statics(self) -> tuple[Any, Any]:
        primary = registry.primary()
        static = lambda spec: None if spec is None else primary.block_static(spec, self.score_mod,  # noqa: E731
                                                                             dict(self.scalars))
        return static(self.local), static(self.halo)


@dataclass(frozen=True)
class DocumentIds:
    """With packed documents, the call-local document ids (`ring_documents.shared_ids`) of both calls,
    (query ids, key ids) each: the local call's (B, L) and the halo call's (B, rows)."""

    local: tuple[Any, Any]
    halo: tuple[Any, Any]


jax.tree_util.register_dataclass(DocumentIds, data_fields=["local", "halo"], meta_fields=[])


def _operands(static: Any, arrays: Mapping[str, Any], ids: tuple[Any, Any] | None) -> Any:
    """A call's graph operands: the score_mod's arrays, and its document ids with packed documents."""
    q_ids, kv_ids = (None, None) if ids is None else ids
    inputs = RuntimeInputs(mod_arrays=arrays, q_segment_ids=q_ids, kv_segment_ids=kv_ids)
    return registry.primary().block_operands(static, inputs)


def _halo_inputs(plan: SplitPlan, q: Any, kv: tuple[Any, Any]) -> tuple[Any, Any, Any]:
    """The halo part's q (the block's first `rows` queries), k and v."""
    return (q[:, :plan.rows], *kv)


def halo_first(halo_grads: Any, local_inputs: Any) -> tuple[Any, Any]:
    """Makes the local part's backward inputs wait for the halo part's gradients, so these can travel
    back (`send_back`) while the local part computes. Without it XLA put the local part first on 2
    H100s and a documents step took 5% longer; the halo part's calls on a second stream (XLA's stream
    annotation) took 3-5% longer than on one (docs/results/h100-2026-11-27-thirteenth-session.md).
    A trace with it still showed their transfer back after the local part; forcing the transfer
    before the local part too was 1.8-3.3% slower there with documents (bench/probe_halo_in_place.py)."""
    return jax.lax.optimization_barrier((halo_grads, local_inputs))


def forward(plan: SplitPlan, q, local_kv, halo_kv, arrays, sinks, present, ids=None) -> tuple[Any, Any, Any]:
    """(output, logsumexp, the halo part's backward logsumexp or None) of the block: both calls,
    merged (module docstring); `ids`: a `DocumentIds` with packed documents. The third is what
    `backward` gives the halo part's graph (the first rows' final logsumexp, +inf where `present` is
    False), written by the merge where the final logsumexp is the merged one (no sinks)."""
    primary = registry.primary()
    local, halo = plan.statics()
    out, lse = primary.block_forward(local, q, *local_kv, _operands(local, arrays, ids and ids.local), True)
    hq, hk, hv = _halo_inputs(plan, q, halo_kv)
    h_out, h_lse = primary.block_forward(halo, hq, hk, hv, _operands(halo, arrays, ids and ids.halo), True)
    backward_lse = present is not None and sinks is None
    out, lse, *halo_lse = merge_rows(out, lse, (h_out, h_lse), present, backward_lse)  # only the first rows change
    out = out.astype(q.dtype)
    if sinks is not None:
        out, lse = sinks_mod.apply(out, lse, sinks)
    return out, lse, halo_lse[0] if halo_lse else None


def backward(plan: SplitPlan, q, local_kv, halo_kv, arrays, sinks, present, out, lse, d_o, halo_lse=None,
             ids=None) -> tuple[Any, ...]:
    """(dq, (dk, dv) of the block's own keys, dk and dv of the halo (`transfer.grads_to_send`:
    stacked or the pair), d_sinks) given the FINAL output and logsumexp, the output's cotangent and
    `forward`'s halo logsumexp (None: taken from `lse` here)."""
    primary = registry.primary()
    local, halo = plan.statics()
    # The halo part first: its dk/dv can travel back (`send_back`) while the local part computes.
    hq, hk, hv = _halo_inputs(plan, q, halo_kv)
    # The cotangent materialized once, both parts reading it (the halo part its first rows, in place):
    # a cotangent XLA can compute (a broadcast, as `sum(out)`'s is) it otherwise computed a second time
    # for the halo part's rows, one more kernel a step.
    d_o = jax.lax.optimization_barrier(d_o)
    h_out, h_lse, h_do = out[:, :plan.rows], lse[..., :plan.rows], d_o[:, :plan.rows]
    if halo_lse is not None:
        h_lse = halo_lse
    elif present is not None:  # an infinite logsumexp: P = exp(s - lse) = 0, no gradient from the halo part
        h_lse = jnp.where(present_rows(present, h_lse.shape[0])[:, None, None], h_lse, jnp.inf)
    h_dq, h_dkv = grads_to_send(primary, halo, hq, hk, hv, _operands(halo, arrays, ids and ids.halo), h_out, h_lse,
                                h_do, zero_unwritten=True)
    h_dkv, (q, local_kv, out, lse, d_o) = halo_first(h_dkv, (q, local_kv, out, lse, d_o))
    dq, dk, dv = primary.block_backward(local, q, *local_kv, _operands(local, arrays, ids and ids.local), out, lse,
                                        d_o, True)
    (dq,) = add_rows((dq,), (h_dq,), 0)
    d_sinks = None if sinks is None else sinks_mod.gradient(d_o, out, lse, sinks)
    return dq, (dk, dv), h_dkv, d_sinks


def _no_gradient(tree: Any) -> Any:
    return jax.tree.map(lambda _: None, tree)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def split_attention(plan: SplitPlan, q, local_kv, halo_kv, arrays: Mapping[str, Any], sinks,
                    present=None) -> tuple[Any, Any]:
    """(output (B, L, N, Hv), logsumexp (B, N, L)) of a block's queries over its halo (`halo_kv`, hl
    keys before the block; `plan.halo` set) and its own keys (`local_kv`); `arrays` (the score_mod's)
    are constants; `present`: whether the halo exists (module docstring)."""
    return forward(plan, q, local_kv, halo_kv, arrays, sinks, present)[:2]


def _split_fwd(plan: SplitPlan, q, local_kv, halo_kv, arrays, sinks, present):
    out, lse, halo_lse = forward(plan, q, local_kv, halo_kv, arrays, sinks, present)
    return (out, lse), (q, local_kv, halo_kv, arrays, sinks, present, out, lse, halo_lse)


def _split_bwd(plan: SplitPlan, residuals, cotangents):
    q, local_kv, halo_kv, arrays, sinks, present, out, lse, halo_lse = residuals
    dq, d_local, d_halo, d_sinks = backward(plan, q, local_kv, halo_kv, arrays, sinks, present, out, lse,
                                            cotangents[0], halo_lse)
    return dq, d_local, (d_halo[0], d_halo[1]), _no_gradient(arrays), d_sinks, None


split_attention.defvjp(_split_fwd, _split_bwd)


# ----------------------------------------------------------------------------- a device's blocks as rows

@dataclass(frozen=True)
class Exchange:
    """Where the halos of a device's blocks come from, when they all run as the batch rows of one
    split call (`halo._stacked_split`): per slot, the route of its blocks' left halo
    (`halo_exchange.route`, None where no block in the slot has one), and whether each device's
    block in the slot has it (`present[slot][device]`)."""

    axis: str
    routes: tuple[Route | None, ...]
    present: tuple[tuple[bool, ...], ...]


def _rows(x: Any, slots: int) -> Any:
    """(B, slots·L, ...) -> (B·slots, L, ...): a device's blocks as batch rows (a free reshape)."""
    return x.reshape((x.shape[0] * slots, x.shape[1] // slots) + x.shape[2:])


def slot_rows(per_slot: list[Any]) -> Any:
    """One (B, ...) array per slot -> (B·slots, ...), row b·slots + slot: the order `_rows` gives a
    device's blocks."""
    x = jnp.stack(per_slot, axis=1)
    return x.reshape((-1,) + x.shape[2:])


def _halo_rows(exchange: Exchange, k, v, hl: int) -> tuple[tuple[Any, Any], Any]:
    """The halos of k and v received for each slot, as batch rows (B·slots, hl, ...), and `present`
    per row."""
    batch, slots, me = k.shape[0], len(exchange.routes), jax.lax.axis_index(exchange.axis)
    received = halo_exchange.receive(exchange.routes, exchange.axis, (k, v))
    halos = [tuple(jnp.zeros((batch, hl) + x.shape[2:], x.dtype) for x in (k, v)) if got is None else got
             for got in received]
    kv = tuple(slot_rows([h[i] for h in halos]) for i in range(2))
    present = jnp.asarray(exchange.present)[:, me]
    return kv, jnp.broadcast_to(present, (batch, slots)).reshape(batch * slots)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def exchanged_attention(plan: SplitPlan, exchange: Exchange, q, k, v, arrays: Mapping[str, Any],
                        sinks, ids: DocumentIds | None = None) -> tuple[Any, Any]:
    """(output (B, slots·L, N, Hv), logsumexp (B, N, slots·L)) of a device's blocks (q, k, v: its
    tokens), each over its own keys and the halo `exchange` brings it, all as the rows of one split
    call (`plan`: one row's, batch B·slots). The halos' gradients go back to where they came from
    and are added there in place (`halo_exchange.send_back`). `ids`: with packed documents, both
    calls' document ids per row."""
    return _exchanged_fwd(plan, exchange, q, k, v, arrays, sinks, ids)[0]


def _exchanged_fwd(plan: SplitPlan, exchange: Exchange, q, k, v, arrays, sinks, ids=None):
    slots = len(exchange.routes)
    halo_kv, present = _halo_rows(exchange, k, v, plan.halo.kv_len)
    local_kv = (_rows(k, slots), _rows(v, slots))
    out, lse, halo_lse = forward(plan, _rows(q, slots), local_kv, halo_kv, arrays, sinks, present, ids)
    batch, heads, block = q.shape[0], lse.shape[1], q.shape[1] // slots
    joined = (out.reshape(q.shape[:2] + out.shape[2:]),
              jnp.swapaxes(lse.reshape(batch, slots, heads, block), 1, 2).reshape(batch, heads, slots * block))
    return joined, (q, k, v, halo_kv, present, arrays, sinks, ids, out, lse, halo_lse)


def _exchanged_bwd(plan: SplitPlan, exchange: Exchange, residuals, cotangents):
    q, k, v, halo_kv, present, arrays, sinks, ids, out, lse, halo_lse = residuals
    slots = len(exchange.routes)
    dq, (dk, dv), h_dkv, d_sinks = backward(
        plan, _rows(q, slots), (_rows(k, slots), _rows(v, slots)), halo_kv, arrays, sinks, present, out, lse,
        _rows(cotangents[0], slots), halo_lse, ids)
    dq, dk, dv = (x.reshape(y.shape) for x, y in ((dq, q), (dk, k), (dv, v)))
    # (..., B·slots, hl, K, H) -> (..., B, slots, hl, K, H), the stacked form's leading 2 kept
    h_dkv = jax.tree.map(lambda x: x.reshape(x.shape[:-4] + (q.shape[0], slots) + x.shape[-3:]), h_dkv)
    grads = [None if r is None else jax.tree.map(lambda x: x[..., slot, :, :, :], h_dkv)
             for slot, r in enumerate(exchange.routes)]
    dk, dv = halo_exchange.send_back(exchange.routes, exchange.axis, grads, (dk, dv))
    return dq, dk, dv, _no_gradient(arrays), d_sinks, _no_gradient(ids)


exchanged_attention.defvjp(_exchanged_fwd, _exchanged_bwd)
