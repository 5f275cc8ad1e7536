"""Ring attention: the body of a context-parallel call, run inside `jax.shard_map` on one device's
blocks of q, k, v (sequence-split over the mesh axis `RingPlan.axis`).

Forward: the key/value blocks pass around the ring with `jax.lax.ppermute`, keys and values as one
transfer (`transfer.paired`: XLA overlaps one transfer at a time with compute), each issued before
the attention of the block already here, so XLA overlaps it with that compute. Every step attends
the local queries to the visiting keys; the partial outputs merge by their logsumexp
(`softmax_merge.merge`). Backward (`jax.custom_vjp`): the other blocks visit first, in the same order, the own
block last, starting from the block that arrived first in the forward (kept as a residual); each
block's dk/dv accumulator moves one device on after each step, in flight during the next step, and
so arrives home for the last step instead of after it (`_visits`, `_ring_backward`). Each block's
gradients are computed from the FINAL output and logsumexp, which makes them exact (the softmax of
a block row is exp(score - final logsumexp)). Packed segments' per-token facts are computed for
the whole sequence on every device, which cuts each visiting block's out (`_block_tok`).

A device holds one chunk of the sequence, or two when load-balanced (`load_balance.device_chunks`).
Work is done per (query chunk, key chunk) pair, whose global offsets decide if it is skipped (every
pair masked: a block in the future, or outside the window), runs unmasked, or runs masked
(`pair_status`), so each pair runs one of at most three graphs whatever the step and device. Where
that status is the same on every device at a step (`RingPlan.static_status`: with load balancing
and a causal mask, all pairs of the first step and half of the others) it is decided at trace time:
the pair is left out or runs its graph directly; elsewhere a `lax.switch` decides per device.

Block backends: cuDNN (`registry.primary()`) runs its forward and backward graphs (`block_*`): the
unmasked graph, and for the diagonal pair the causal one (equal offsets: local causal is global
causal); a score_mod runs in both, and one that reads positions gets the pair's global offsets as
int32 operands (`RingPlan.block_ir`), so the graphs stay the same at every step. Packed documents
run one packed (THD) call a step over the device's whole query block and the visiting key block,
over the documents both hold (`RingPlan.whole_steps`, `ring_documents.shared_ids`), without a branch:
the ring is the same calls on every device. With a score_mod (which the packed graphs do not take)
they run per pair on the dense twin, given each query's document bounds in the key chunk: one
document off the diagonal, every document of the chunk on it. XLA
(`registry.reference()`) runs with each token's global position (`masking.TokenLayout`), so masks, windows, chunks, packed segments and
score_mods that read positions see global positions; its backward is jax's vjp of the block with
the final output and logsumexp folded in (`_xla_pair_backward`).
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Mapping

import jax
import jax.numpy as jnp

from sdpagraph.backends import registry, sinks as sinks_mod
from sdpagraph.backends.masking import TokenLayout
from sdpagraph.backends.softmax_merge import merge
from sdpagraph.call import RuntimeInputs
from sdpagraph.parallel import ring_documents
from sdpagraph.parallel.transfer import grads_to_send, paired
from sdpagraph.parallel.ring_plan import MASKED, SKIP, RingPlan, cudnn_static, pair_status, with_offsets

# ----------------------------------------------------------------------------- one pair of chunks

def _layout(plan: RingPlan, q_start: Any, kv_start: Any, q_tok: Any, kv_tok: Any) -> TokenLayout:
    """Global positions (and segments) of the pair's tokens. `*_tok`: (position, valid, segment) per
    token with packed segments, computed over the whole sequence; None: positions from the start."""
    b = plan.spec.batch

    def side(start, length, tok):
        if tok is not None:
            return tok
        pos = jnp.broadcast_to(start + jnp.arange(length, dtype=jnp.int32), (b, length))
        return pos, jnp.ones((b, length), bool), None

    (qp, qv, qg), (kp, kv, kg) = side(q_start, plan.q_chunk, q_tok), side(kv_start, plan.kv_chunk, kv_tok)
    return TokenLayout(qp, kp, qv, kv, qg, kg, plan.shift)


def _xla_pair(plan: RingPlan, arrays: Mapping[str, Any], q, k, v, layout: TokenLayout) -> tuple[Any, Any]:
    spec = dataclasses.replace(plan.spec, q_len=plan.q_chunk, kv_len=plan.kv_chunk, segments=None, max_segments=0)
    inputs = RuntimeInputs(mod_scalars=dict(plan.scalars), mod_arrays=arrays, python_mods=plan.python_mods)
    return registry.reference().block_attention(spec, q, k, v, inputs, plan.score_mod, layout)


def _cudnn_operands(plan: RingPlan, static: Any, arrays: Mapping[str, Any], q_start: Any, kv_start: Any,
                    ids: tuple[Any, Any] | None) -> Any:
    """The block graph's operands: the score_mod's arrays, the pair's global offsets when it reads
    positions, and with packed documents the call's document ids (`ring_documents.shared_ids`)."""
    if plan.reads_positions:
        arrays = with_offsets(arrays, q_start, kv_start)
    q_ids, kv_ids = (None, None) if ids is None else ids
    inputs = RuntimeInputs(mod_arrays=arrays, q_segment_ids=q_ids, kv_segment_ids=kv_ids)
    return registry.primary().block_operands(static, inputs)


def _cudnn_pair(plan: RingPlan, arrays, q_start, kv_start, q_tok, kv_tok, known: int | None, diagonal: bool,
                skip, run):
    """One pair on cuDNN as a function of its running value and q, k, v; `run(static, operands, *args)`
    runs a block graph. Dense: the graph its status names, the off-diagonal one (FULL) or the diagonal
    one (MASKED on cuDNN is only ever the diagonal pair of a causal call, `cudnn_reason`): `known`
    where the status is the same on every device (`RingPlan.static_status`), else `lax.switch` by
    `pair_status` between those and `skip`. Packed documents come here only on their dense twin (with
    a score_mod; packed graphs run `whole_steps`): the graph `diagonal` (static) names, over the
    documents the pair shares, under `lax.cond`, skipped where it has nothing to compute."""
    def block(diagonal, ids=None):
        static = cudnn_static(plan, diagonal)
        return lambda *args: run(static, _cudnn_operands(plan, static, arrays, q_start, kv_start, ids), *args)

    if plan.documents:
        causal = plan.spec.is_causal and not diagonal and known is None  # known: attends on every device
        attends = ~ring_documents.keys_after_queries(causal, q_start, kv_start)
        ids = ring_documents.shared_ids(q_tok, kv_tok, attends, attends, plan.spec.max_segments,
                                        cudnn_static(plan, diagonal).spec.max_segments)
        # The dense twin computes every tile whatever the ids: a pair without work skips.
        return lambda *args: jax.lax.cond(jnp.any(ids[0] > 0), block(diagonal, ids), skip, *args)
    if known is not None:
        return block(known == MASKED)
    status, branches = pair_status(plan, q_start, kv_start), (skip, block(False), block(True))
    return lambda *args: jax.lax.switch(status, branches, *args)


def _xla_switch(plan: RingPlan, known: int | None, q_start, kv_start, skip, run):
    """An XLA block (the same function FULL or MASKED): `run` where it attends on every device, else
    `lax.switch` by `pair_status` between `skip` and `run`."""
    if known is not None:
        return run
    status = pair_status(plan, q_start, kv_start)
    return lambda *args: jax.lax.switch(status, (skip, run, run), *args)


def _pair_forward(plan: RingPlan, arrays, acc, q, k, v, q_start, kv_start, q_tok, kv_tok, known: int | None,
                  diagonal: bool) -> tuple[Any, Any]:
    """`acc` (output fp32, logsumexp (B, N, T)) of the local query chunk, merged with one key chunk's;
    a skipped pair leaves it as it is (no merge pass). `known`: the pair's status where every device
    has the same (`RingPlan.static_status`); `diagonal`: the chunk with itself (static)."""
    skip = lambda acc, q, k, v: acc  # noqa: E731
    if plan.backend == registry.reference().name:
        layout = _layout(plan, q_start, kv_start, q_tok, kv_tok)
        run = lambda acc, q, k, v: merge(acc, _xla_pair(plan, arrays, q, k, v, layout))  # noqa: E731
        return _xla_switch(plan, known, q_start, kv_start, skip, run)(acc, q, k, v)
    forward = registry.primary().block_forward
    pair = _cudnn_pair(plan, arrays, q_start, kv_start, q_tok, kv_tok, known, diagonal, skip,
                       lambda static, aux, acc, q, k, v: merge(acc, forward(static, q, k, v, aux)))
    return pair(acc, q, k, v)


def _xla_pair_backward(plan, arrays, q, k, v, layout, o, lse, d_o, d_rows) -> tuple[Any, Any, Any]:
    """Exact block gradients on XLA: with w = exp(lse_block - lse) the block's share of each row,
    the output is sum_blocks w * out_block, so the block receives d_out = w * dO and
    d_lse_block = w * (<dO, out_block> - <dO, o>) (`d_rows` = <dO, o>)."""
    (out_b, lse_b), pullback = jax.vjp(lambda q, k, v: _xla_pair(plan, arrays, q, k, v, layout), q, k, v)
    w = jnp.where(jnp.isneginf(lse_b), 0.0, jnp.exp(lse_b - jnp.where(jnp.isneginf(lse), 0.0, lse)))  # (B, N, T)
    w_rows = jnp.swapaxes(w, 1, 2)[..., None]
    d_out = (d_o.astype(jnp.float32) * w_rows).astype(out_b.dtype)
    mine = jnp.swapaxes(jnp.sum(d_o.astype(jnp.float32) * out_b.astype(jnp.float32), axis=-1), 1, 2)
    return pullback((d_out, w * (mine - d_rows)))


def _pair_backward(plan, arrays, grads, q, k, v, q_start, kv_start, q_tok, kv_tok, o, lse, d_o, d_rows, known,
                   diagonal):
    """`grads` (dq, dk, dv, fp32) plus one pair's; a skipped pair leaves them as they are."""
    skip = lambda grads, q, k, v: grads  # noqa: E731
    add = lambda grads, new: tuple(g + x.astype(jnp.float32) for g, x in zip(grads, new))  # noqa: E731
    if plan.backend == registry.reference().name:
        layout = _layout(plan, q_start, kv_start, q_tok, kv_tok)
        run = lambda grads, q, k, v: add(grads, _xla_pair_backward(  # noqa: E731
            plan, arrays, q, k, v, layout, o, lse, d_o, d_rows))
        return _xla_switch(plan, known, q_start, kv_start, skip, run)(grads, q, k, v)
    o_io, backward = o.astype(q.dtype), registry.primary().block_backward
    pair = _cudnn_pair(plan, arrays, q_start, kv_start, q_tok, kv_tok, known, diagonal, skip,
                       lambda static, aux, grads, q, k, v: add(grads, backward(static, q, k, v, aux, o_io, lse, d_o)))
    return pair(grads, q, k, v)


# ----------------------------------------------------------------------------- the ring

def _split(x: Any, parts: int, axis: int = 1) -> list[Any]:
    return [None] * parts if x is None else jnp.split(x, parts, axis=axis)


def _tok_chunks(tok: Any, parts: int) -> list[Any]:
    """Per-chunk (position, valid, segment) of a side's tokens, or None each."""
    if tok is None:
        return [None] * parts
    return list(zip(*(jnp.split(x, parts, axis=1) for x in tok)))


def _block_tok(plan: RingPlan, tok: Any, device: Any) -> Any:
    """(position, valid, segment) of the tokens of `device`'s block (traced), cut from the whole
    sequence's (`tok`, in the order of q, k, v), or None without packed segments: every device
    derives any block's facts itself, so they need no transfer of their own."""
    if tok is None:
        return None
    length = tok[0].shape[1] // plan.size
    return tuple(jax.lax.dynamic_slice_in_dim(x, device * length, length, axis=1) for x in tok)


def _step_high(plan: RingPlan, extras: Mapping[str, Any], step: int, me: Any) -> Any:
    """(query side, key side) of `extras["high"]` at `step` (documents balanced per document), or None."""
    if extras.get("high") is None:
        return None
    cut = lambda device: _block_tok(plan, (extras["high"],), device)[0]  # noqa: E731
    return cut(me), cut((me - step) % plan.size)


def _onwards(plan: RingPlan) -> list[tuple[int, int]]:
    """The ring's (source, destination) pairs: each device sends to the next."""
    return [(i, (i + 1) % plan.size) for i in range(plan.size)]


def _pass(plan: RingPlan, tree: Any) -> Any:
    """Send to the next device along the ring."""
    return jax.lax.ppermute(tree, plan.axis, _onwards(plan))


def _visits(plan: RingPlan, k: Any, v: Any, first: Any = None) -> tuple[list[tuple[int, Any]], Any]:
    """([(step, (k, v) visiting)] in the order the ring runs them, the key/value block that arrived
    first). Step s holds the block of device me - s. Each transfer is issued before the compute of
    the step in hand, which does not need it, so XLA overlaps the two. Forward (`first` None): the
    own block first, then me - 1, me - 2, ...; backward (`first`: the block that arrived first in the
    forward, a residual): the other blocks first and the own block last, so the dk/dv accumulators,
    which follow their blocks one device on (`_ring_backward`), reach home during the last step
    instead of after it."""
    order = list(range(plan.size)) if first is None else [*range(1, plan.size), 0]
    travelling, arrived, visits = (paired(k, v) if first is None else first), None, []
    for i, step in enumerate(order):
        visits.append((step, (k, v) if step == 0 else (travelling[0], travelling[1])))
        if i + 1 < len(order) and order[i + 1] != 0:
            travelling = _pass(plan, travelling)
            arrived = travelling if arrived is None else arrived
    return visits, arrived


def _nothing_attended(q: Any, head_dim_v: int) -> tuple[Any, Any]:
    """(output 0 (B, T, N, head_dim_v) fp32, logsumexp -inf (B, N, T)) of queries `q` before any key:
    made from q (`*_like`), so that inside a user's shard_map they vary over its axes as the computed
    results do."""
    rows = jnp.zeros_like(q[..., :1], jnp.float32)
    lse = jnp.swapaxes(jnp.full_like(rows[..., 0], -jnp.inf), 1, 2)
    return jnp.broadcast_to(rows, q.shape[:3] + (head_dim_v,)), lse


def _step_call(plan: RingPlan, arrays, q_tok, kv_tok, step: int, me: Any, high: Any = None) -> tuple[Any, Any]:
    """(static graph, operands) of a `whole_steps` step: the device's whole query block against the
    whole key block visiting at `step`, over the documents both hold, limited to the chunks whose
    pairs attend (`pair_status`, traced; a rectangle, `ring_documents`, which
    test_a_pairs_status_is_static_where_every_device_has_the_same checks for every cp). Documents
    balanced per document (`high`: (query side, key side) per-token piece flags) hold a piece of
    each chunk in every document: the same rule per document, its pieces in place of the chunks."""
    c, first = plan.chunks, step == 0
    q_starts, kv_starts = plan.offsets(me, plan.q_chunk), plan.offsets((me - step) % plan.size, plan.kv_chunk)
    attends = [[pair_status(plan, q_starts[a], kv_starts[j]) != SKIP for j in range(c)] for a in range(c)]

    def per_token(flags, chunk, side):  # the flag of each token's chunk (or piece)
        if high is None:
            return jnp.repeat(jnp.stack(flags), chunk)[None, :]
        return jnp.stack(flags)[high[side]]

    q_allowed = per_token([functools.reduce(jnp.logical_or, attends[a]) for a in range(c)], plan.q_chunk, 0)
    kv_allowed = per_token([functools.reduce(jnp.logical_or, [attends[a][j] for a in range(c)]) for j in range(c)],
                           plan.kv_chunk, 1)
    spec = plan.step_spec(first)
    ids = ring_documents.shared_ids(q_tok, kv_tok, q_allowed, kv_allowed, plan.spec.max_segments, spec.max_segments)
    static = registry.primary().block_static(spec, plan.block_ir, dict(plan.scalars))
    return static, _cudnn_operands(plan, static, arrays, None, None, ids)


def _step_forward(plan: RingPlan, arrays, acc, q, kv, q_tok, kv_tok, step: int, me: Any, high: Any) -> list[Any]:
    """`acc` (per local query chunk: output fp32, logsumexp) merged with the key block visiting at
    `step`: one call over the whole blocks (`RingPlan.whole_steps`, one chunk in `acc`, None before
    the first step) or one per pair of chunks."""
    if plan.whole_steps:  # the first step's result starts the accumulator (no pass merging it with nothing)
        static, aux = _step_call(plan, arrays, q_tok, kv_tok, step, me, high)
        result = registry.primary().block_forward(static, q, kv[0], kv[1], aux)
        return [result if acc[0] is None else merge(acc[0], result)]
    c = plan.chunks
    q_starts, kv_starts = plan.offsets(me, plan.q_chunk), plan.offsets((me - step) % plan.size, plan.kv_chunk)
    qs, q_toks = _split(q, c), _tok_chunks(q_tok, c)
    ks, vs, kv_toks = _split(kv[0], c), _split(kv[1], c), _tok_chunks(kv_tok, c)
    acc = list(acc)
    for a in range(c):
        for j in range(c):
            known = plan.static_status(step, a, j)
            if known != SKIP:
                acc[a] = _pair_forward(plan, arrays, acc[a], qs[a], ks[j], vs[j], q_starts[a], kv_starts[j],
                                       q_toks[a], kv_toks[j], known, diagonal=step == 0 and a == j)
    return acc


def _ring_forward(plan: RingPlan, q, k, v, extras) -> tuple[Any, Any, Any]:
    """(output, logsumexp, the key/value block that arrived first: the backward's first visitor)."""
    me = jax.lax.axis_index(plan.axis)
    acc = [None] if plan.whole_steps else [_nothing_attended(x, v.shape[-1]) for x in _split(q, plan.chunks)]
    q_tok = _block_tok(plan, extras["tok"], me)
    visits, arrived = _visits(plan, k, v)
    for step, kv in visits:
        kv_tok = _block_tok(plan, extras["tok"], (me - step) % plan.size)
        high = _step_high(plan, extras, step, me)
        acc = _step_forward(plan, extras["arrays"], acc, q, kv, q_tok, kv_tok, step, me, high)
    out = jnp.concatenate([o for o, _ in acc], axis=1).astype(q.dtype)
    return out, jnp.concatenate([lse for _, lse in acc], axis=-1), arrived


def _step_backward(plan: RingPlan, arrays, q, kv, q_tok, kv_tok, o, lse, d_o, step: int, me: Any,
                   high: Any) -> tuple[Any, Any]:
    """(dq, (dk, dv) as one transfer takes them: `transfer.paired`) of the local queries against the
    key block visiting at `step`: one call over the whole blocks (`RingPlan.whole_steps`, in the io
    dtype; its graph writes dk and dv stacked where they stack: `transfer.grads_to_send`) or the sum
    over pairs of chunks (fp32)."""
    if plan.whole_steps:
        static, aux = _step_call(plan, arrays, q_tok, kv_tok, step, me, high)
        return grads_to_send(registry.primary(), static, q, kv[0], kv[1], aux, o.astype(q.dtype), lse, d_o)
    c = plan.chunks
    q_starts, kv_starts = plan.offsets(me, plan.q_chunk), plan.offsets((me - step) % plan.size, plan.kv_chunk)
    d_rows = jnp.swapaxes(jnp.sum(d_o.astype(jnp.float32) * o.astype(jnp.float32), axis=-1), 1, 2)  # (B, N, T)
    qs, q_toks, os_, dos = _split(q, c), _tok_chunks(q_tok, c), _split(o, c), _split(d_o, c)
    lses, d_rowss = _split(lse, c, axis=-1), _split(d_rows, c, axis=-1)
    ks, vs, kv_toks = _split(kv[0], c), _split(kv[1], c), _tok_chunks(kv_tok, c)
    dq = [jnp.zeros_like(x, jnp.float32) for x in qs]  # `*_like`: varying as the results (see forward)
    dks, dvs = [jnp.zeros_like(x, jnp.float32) for x in ks], [jnp.zeros_like(x, jnp.float32) for x in vs]
    for j in range(c):
        for a in range(c):
            known = plan.static_status(step, a, j)
            if known != SKIP:
                dq[a], dks[j], dvs[j] = _pair_backward(
                    plan, arrays, (dq[a], dks[j], dvs[j]), qs[a], ks[j], vs[j], q_starts[a], kv_starts[j],
                    q_toks[a], kv_toks[j], os_[a], lses[a], dos[a], d_rowss[a], known, diagonal=step == 0 and a == j)
    dk, dv = jnp.concatenate(dks, axis=1), jnp.concatenate(dvs, axis=1)
    return jnp.concatenate(dq, axis=1), ((dk, dv) if step == 0 else paired(dk, dv))  # step 0: the last, sent nowhere


def _summed(total: Any, part: Any) -> Any:
    """`part` added to the running `total` in fp32; the first part (`total` None) as computed, so
    no fp32 copy of a whole block is made or held, and a first dk/dv partial travels as it is."""
    return part if total is None else total.astype(jnp.float32) + part.astype(jnp.float32)


def _ring_backward(plan: RingPlan, q, k, v, extras, o, lse, d_o, first) -> tuple[Any, Any, Any]:
    """(dq, dk, dv). The key/value blocks visit in `_visits`' backward order (the others, then the
    own); each block's dk/dv accumulator starts where the block is first computed, moves one device
    on after every step, in flight during the next step's compute, and arrives home for the last."""
    me = jax.lax.axis_index(plan.axis)
    q_tok = _block_tok(plan, extras["tok"], me)
    dq, d_kv = None, None
    visits, _ = _visits(plan, k, v, first)
    for step, kv in visits:
        kv_tok = _block_tok(plan, extras["tok"], (me - step) % plan.size)
        d_q, d_kv_step = _step_backward(plan, extras["arrays"], q, kv, q_tok, kv_tok, o, lse, d_o, step, me,
                                        _step_high(plan, extras, step, me))
        dq = _summed(dq, d_q)
        if step == 0:  # the last step: the sums come out in the io dtype, one array each (no fp32 stack)
            dk, dv = (_summed(None if d_kv is None else d_kv[i], d_kv_step[i]).astype(x.dtype)
                      for i, x in enumerate((k, v)))
            return dq.astype(q.dtype), dk, dv
        d_kv = d_kv_step if d_kv is None else jax.tree.map(_summed, d_kv, d_kv_step)
        d_kv = _pass(plan, d_kv)
    raise AssertionError("the ring's backward visits the own block last")


def _forward_with_sinks(plan: RingPlan, q, k, v, extras, sinks) -> tuple[Any, Any, Any]:
    """The ring's merged (output, logsumexp), with the sinks joined once per row at the end, and the
    key/value block that arrived first (`_ring_forward`)."""
    out, lse, arrived = _ring_forward(plan, q, k, v, extras)
    if sinks is None:
        return out, lse, arrived
    return (*sinks_mod.apply(out, lse, sinks), arrived)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def ring_attention(plan: RingPlan, q, k, v, extras, sinks=None) -> tuple[Any, Any]:
    """(output (B, T_local, N, Hv), logsumexp (B, N, T_local)) of the local queries over every key.

    `extras`: {"arrays": score_mod arrays (B|1, N|1, 1, 1), "tok": (position, valid, segment) per
    token of the whole sequence, in the order of q, k, v, with packed segments, else None; "high":
    with documents balanced per document, whether each token (same order) lies in the later piece
    its device holds of its document, else None}; constants for differentiation.
    `sinks`: attention sinks (N,) (`backends.sinks`), or None. The logsumexp is returned without a
    gradient, as on the cuDNN path."""
    return _forward_with_sinks(plan, q, k, v, extras, sinks)[:2]


def _ring_fwd(plan: RingPlan, q, k, v, extras, sinks=None):
    out, lse, arrived = _forward_with_sinks(plan, q, k, v, extras, sinks)
    return (out, lse), (q, k, v, extras, out, lse, sinks, arrived)


def _ring_bwd(plan: RingPlan, residuals, cotangents):
    # With sinks the blocks' backward is given the output and logsumexp with the sink: exact.
    q, k, v, extras, out, lse, sinks, arrived = residuals
    dq, dk, dv = _ring_backward(plan, q, k, v, extras, out, lse, cotangents[0], arrived)
    d_sinks = None if sinks is None else sinks_mod.gradient(cotangents[0], out, lse, sinks)
    return dq, dk, dv, jax.tree.map(lambda _: None, extras), d_sinks


ring_attention.defvjp(_ring_fwd, _ring_bwd)
