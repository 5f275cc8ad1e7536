"""Halo attention: context parallelism for sliding windows and chunked attention, run inside
`jax.shard_map` on one device's part of q, k, v (the sequence split over the mesh axis
`HaloPlan.axis`, in natural order or load-balanced).

The sequence is cut into `HaloLayout.count` equal blocks of L tokens: cp in natural order (device d
holds block d), 2cp when load-balanced (device i holds blocks i and 2cp-1-i,
`load_balance.device_chunks`). A query at global position p reads only the keys its window allows,
[p - left, p + right] (causal: right is 0), and, with `chunk_size`, only those of its own chunk. So a
block needs only the keys up to `left` before it and `right` after it, and none past its chunk's
bounds: its halos (`HaloLayout.case_of`). Chunks fit the blocks in one of two ways (`chunk_fit`):
- WHOLE: L is a multiple of chunk_size, every chunk lies inside a block: no halo at all, no
  communication; each block runs the chunk mask locally (its start is a multiple of chunk_size);
- WITHIN: chunk_size is a multiple of L (or covers the sequence), every block lies inside one chunk:
  the halo reaches back (and, non-causal, forward) to the chunk's bounds, and the block's call needs
  no chunk mask (every key it is given lies in its chunk).
Chunks that cut blocks unevenly are not taken (`unsupported`). Causal packed documents with
`max_seqlen_kv` reach back `document_reach` = max_seqlen_kv - 1 keys at most, which must fit a block:
they run as that window (its halo rounded up to `halo_layout.DOCUMENT_HALO_MULTIPLE` tokens, at most a
block), each block's calls over its own documents and the one document crossing
into it (`_document_ids`), on cuDNN always as the batch rows of one split call (`_stacked_blocks`).

The halos come from the devices holding the neighbouring blocks, one `jax.lax.ppermute` per block
step they reach across (a window wider than a block spans several), each carrying only the tokens
needed; a device sending two pieces of one step (load-balanced) sends them in two rounds, a piece of
its own other block is a local slice, and the pieces of a device's blocks share a transfer where no
device sends or receives twice in it (`halo_exchange`). Then one attention call per block runs
its queries over [left halo ++ its keys ++ right halo], or, for causal blocks on cuDNN, two calls
that take the block's own keys and the halo apart, never joined into one buffer (`_split_block`).
Under autodiff the transpose of each ppermute sends the halo's dk/dv back to the device that holds
those keys. Where a device's blocks run as the batch rows of one split call (`_stacked_blocks`),
the exchange sits inside that call's custom_vjp instead, which adds the halos' dk/dv in place where
they came from (`halo_exchange.send_back`) rather than as whole-block padded gradients.

Blocks near the sequence's (or a chunk's) ends have shorter halos. Each block runs one of a few
cases (hl, hr) of halo lengths, chosen by the device's index with `lax.switch`; every case is one
call of static shapes (T = L, S = hl + L + hr):
- cuDNN (`registry.primary()`): a causal block as two square top-left calls, its own keys and its
  halo, merged (`halo_split`: a window relative to the bottom-right diagonal of S != T ran 10x
  slower); otherwise one call with the window relative to the bottom-right diagonal, where local
  query i sits at key i + hl + hr: a causal window is the call's own; a two-sided one is (left + hr,
  right - hr). A score_mod that reads positions gets the block's global offsets as int32 operands, as
  the ring's blocks do (`ring_plan.OFFSETS`).
- XLA (`registry.reference()`): `block_attention` with each token's global position (`TokenLayout`).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping

import jax
import jax.numpy as jnp

from sdpagraph.backends import registry, sinks as sinks_mod
from sdpagraph.backends.masking import TokenLayout
from sdpagraph.call import RuntimeInputs
from sdpagraph.numerics import gate as numerics_gate
from sdpagraph.parallel import halo_exchange, ring_documents
from sdpagraph.parallel.halo_layout import WHOLE, WITHIN, HaloLayout, sides
from sdpagraph.parallel.halo_split import (DocumentIds, Exchange, SplitPlan, exchanged_attention, slot_rows,
                                           split_attention)
from sdpagraph.parallel.ring_plan import OffsetMods, with_offsets
from sdpagraph.scoremod.forms import PythonMods
from sdpagraph.scoremod.ir import ScoreModIR
from sdpagraph.spec import UNBOUNDED, AttentionSpec


@dataclass(frozen=True)
class HaloPlan(OffsetMods):
    """Everything static about one halo call."""

    layout: HaloLayout  # its spec: the call's with one device's batch (the sequence lengths stay global)
    axis: str
    backend: str  # the primary backend's name (cuDNN) or the reference's (XLA)
    score_mod: ScoreModIR | None
    scalars: tuple[tuple[str, Any], ...]
    python_mods: PythonMods | None = None

    @property
    def spec(self) -> AttentionSpec:
        return self.layout.spec

    @property
    def graphs(self) -> list[tuple[AttentionSpec, ScoreModIR | None]]:
        """The (spec, score_mod IR) of the cuDNN graphs the blocks run: for packed documents the split
        calls of a device's blocks as batch rows (`_stacked_blocks`), else one per case of halo lengths."""
        if not self.spec.segments:
            return [(self.block_spec(case), self.block_ir) for case in self.layout.cases]
        rows = self.spec.batch * self.layout.slots
        split = split_plan(self, max(self.layout.cases))
        return [(dataclasses.replace(s, batch=rows), None) for s in (split.local, split.halo) if s is not None]

    def block_spec(self, case: tuple[int, int]) -> AttentionSpec:
        """The spec of one case's cuDNN call: a block's queries, hl + L + hr keys, the window relative
        to the bottom-right diagonal (module docstring); the chunk mask where blocks hold whole chunks."""
        hl, hr = case
        left, right = self.spec.window
        if not self.spec.is_causal:
            left, right = (left if left == UNBOUNDED else left + hr), (right if right == UNBOUNDED else right - hr)
        block = self.layout.block
        chunk = self.spec.chunk_size if self.layout.fit == WHOLE else None
        return dataclasses.replace(self.spec, q_len=block, kv_len=hl + block + hr, causal_alignment="bottom_right",
                                   window=(left, right), chunk_size=chunk)


# ----------------------------------------------------------------------------- the halos

def _halos(plan: HaloPlan, kv: tuple[Any, Any], slot: int) -> tuple[tuple[Any, ...] | None, tuple[Any, ...] | None]:
    """(left halo, right halo) of k and v for the block in `slot`, each `HaloLayout.reach` long (the
    farthest block's tokens first on the left), or None where the reach is 0."""
    layout = plan.layout
    block, reach = layout.block, layout.reach(slot)
    halos = []
    for before, length_reached in ((True, reach[0]), (False, reach[1])):
        parts = []
        for step in range(1, -(-length_reached // block) + 1):
            length = min(block, length_reached - (step - 1) * block)
            piece = halo_exchange.route(block, layout.wanted(slot, step, before), block - length if before else 0,
                                        length)
            got = halo_exchange.receive([piece], plan.axis, kv)[0]
            parts = [got, *parts] if before else [*parts, got]
        halos.append(tuple(jnp.concatenate([p[i] for p in parts], axis=1) for i in range(len(kv))) if parts else None)
    return halos[0], halos[1]


def _with_halos(plan: HaloPlan, kv: tuple[Any, Any], slot: int) -> tuple[Any, ...]:
    """[left halo ++ the block in `slot` ++ right halo] of k and v (`_halos`)."""
    block = plan.layout.block
    before, after = _halos(plan, kv, slot)
    parts = [p for p in (before, tuple(x[:, slot * block:(slot + 1) * block] for x in kv), after) if p is not None]
    return tuple(jnp.concatenate([p[i] for p in parts], axis=1) for i in range(len(kv)))


def _tokens(tok: tuple[Any, ...], start: Any, length: int) -> tuple[Any, ...]:
    """The facts (`halo_attention`'s `tok`) of the `length` tokens from global position `start`."""
    return tuple(jax.lax.dynamic_slice_in_dim(x, start, length, axis=1) for x in tok)


def _case_xla(plan: HaloPlan, case, q_start, q, k, v, arrays: Mapping[str, Any], sinks: Any,
              tok: Any = None) -> tuple[Any, Any]:
    hl, hr = case
    block = plan.layout.block
    b, length = plan.spec.batch, hl + block + hr
    if tok is None:
        q_pos = jnp.broadcast_to(q_start + jnp.arange(block, dtype=jnp.int32), (b, block))
        kv_pos = jnp.broadcast_to(q_start - hl + jnp.arange(length, dtype=jnp.int32), (b, length))
        every = lambda x: jnp.ones(x.shape, bool)  # noqa: E731
        layout = TokenLayout(q_pos, kv_pos, every(q_pos), every(kv_pos), None, None, 0)
    else:  # packed documents: each token's position in its document, and its document
        (qp, qv, qg), (kp, kv, kg) = _tokens(tok, q_start, block), _tokens(tok, q_start - hl, length)
        layout = TokenLayout(qp, kp, qv, kv, qg, kg, 0)
    spec = dataclasses.replace(plan.spec, q_len=block, kv_len=length, segments=None, max_segments=0,
                               max_seqlen_q=None, max_seqlen_kv=None)
    inputs = RuntimeInputs(mod_scalars=dict(plan.scalars), mod_arrays=arrays, python_mods=plan.python_mods)
    out, lse = registry.reference().block_attention(spec, q, k, v, inputs, plan.score_mod, layout)
    return (out, lse) if sinks is None else sinks_mod.apply(out, lse, sinks)


def split_plan(plan: HaloPlan, case: tuple[int, int]) -> SplitPlan | None:
    """How a causal block of `case` runs as square top-left calls (`halo_split`), or None where it
    runs as one call (two-sided windows, a window wider than its halo, mods that read positions)."""
    hl, hr = case
    spec, block = plan.spec, plan.layout.block
    if spec.segments:  # packed graphs: causal per document over its own keys; its halo holds one document
        local = dataclasses.replace(spec, q_len=block, kv_len=block, causal_alignment="top_left",
                                    max_segments=ring_documents.slots(spec.max_segments, block, True),
                                    max_seqlen_q=None, max_seqlen_kv=None)
        halo = dataclasses.replace(local, q_len=hl, kv_len=hl, is_causal=False, max_segments=1) if hl else None
        return SplitPlan(local, halo, hl, None, plan.scalars)
    left, _ = sides(spec)
    if not spec.is_causal or hr or plan.reads_positions or plan.python_mods is not None:
        return None
    windowed = left != UNBOUNDED
    if windowed and hl and (hl != left or left > block):
        return None
    if not windowed and hl and plan.layout.fit != WITHIN:
        return None
    local = dataclasses.replace(spec, q_len=block, kv_len=block, causal_alignment="top_left",
                                chunk_size=spec.chunk_size if plan.layout.fit == WHOLE else None)
    halo = None
    if hl:  # a window: query i sees halo key j >= i (T = S = hl); a chunk holding the block: every halo key
        halo = dataclasses.replace(local, q_len=hl if windowed else block, kv_len=hl, is_causal=False,
                                   window=(0, UNBOUNDED) if windowed else (UNBOUNDED, UNBOUNDED), chunk_size=None)
    return SplitPlan(local, halo, halo.q_len if halo is not None else 0, plan.score_mod, plan.scalars)


def _case_cudnn(plan: HaloPlan, case, q_start, q, k, v, arrays: Mapping[str, Any], sinks: Any) -> tuple[Any, Any]:
    split = split_plan(plan, case)
    if split is not None and split.halo is not None:
        hl = case[0]
        return split_attention(split, q, (k[:, hl:], v[:, hl:]), (k[:, :hl], v[:, :hl]), arrays, sinks)
    if split is not None:  # no halo: the block's own call, as on one device (chunks run as documents there)
        spec, ir = split.local, plan.score_mod
    else:
        if plan.reads_positions:
            arrays = with_offsets(arrays, q_start, q_start - case[0])
        spec, ir = plan.block_spec(case), plan.block_ir
    inputs = RuntimeInputs(mod_scalars=dict(plan.scalars), mod_arrays=arrays)
    # the numerical check, for graphs the call runs in place of the plan's (chunks as documents, sinks)
    verify, backend = numerics_gate.checked, registry.primary()
    if sinks is None:
        return backend.attention(spec, q, k, v, inputs, ir, training=True, verify=verify)
    return backend.attention_with_sinks(spec, q, k, v, inputs, ir, sinks, verify=verify)


def _block_attention(plan: HaloPlan, slot: int, me, q, k, v, arrays, sinks, tok=None) -> tuple[Any, Any]:
    """(output, logsumexp) of this device's block in `slot`: the case of its halo lengths."""
    layout = plan.layout
    block, left = layout.block, layout.reach(slot)[0]
    q = q[:, slot * block:(slot + 1) * block]
    mine = [blocks[slot] for blocks in layout.blocks_of]
    cases = sorted({layout.case_of(b) for b in mine})
    table = jnp.asarray([cases.index(layout.case_of(b)) for b in mine], jnp.int32)
    if plan.backend != registry.reference().name and all(split_plan(plan, case) is not None for case in cases):
        return _split_block(plan, slot, me, q, k, v, arrays, sinks, cases, table)
    keys, values = _with_halos(plan, (k, v), slot)
    q_start = jnp.asarray(mine, jnp.int32)[me] * block
    run = _case_xla if plan.backend == registry.reference().name else _case_cudnn

    def branch(case):
        hl, hr = case
        present = slice(left - hl, left + block + hr)  # this case's halos: the tokens it reads
        extra = () if tok is None else (tok,)  # packed documents run on XLA only (the cuDNN path stacks them)
        return lambda q, keys, values: run(plan, case, q_start, q, keys[:, present], values[:, present], arrays, sinks,
                                           *extra)

    if len(cases) == 1:
        return branch(cases[0])(q, keys, values)
    return jax.lax.switch(table[me], [branch(case) for case in cases], q, keys, values)


def _split_block(plan: HaloPlan, slot: int, me, q, k, v, arrays, sinks, cases, table) -> tuple[Any, Any]:
    """A causal block on cuDNN whose every case splits (`split_plan`): its own keys and the halo it
    receives go to the two calls apart, never joined into one buffer (a copy of the whole block, and
    of its gradients, per step)."""
    block = plan.layout.block
    local = tuple(x[:, slot * block:(slot + 1) * block] for x in (k, v))
    before, _ = _halos(plan, (k, v), slot)  # causal: nothing after

    def branch(case):
        split = split_plan(plan, case)
        if split.halo is None:
            return lambda q, local, before: _case_cudnn(plan, case, None, q, *local, arrays, sinks)
        hl = case[0]  # the halo buffer is `reach` long: its last hl tokens are this case's
        return lambda q, local, before: split_attention(split, q, local, tuple(x[:, x.shape[1] - hl:] for x in before),
                                                        arrays, sinks)

    if before is None:
        before = tuple(x[:, :0] for x in local)
    if len(cases) == 1:
        return branch(cases[0])(q, local, before)
    return jax.lax.switch(table[me], [branch(case) for case in cases], q, local, before)


def _stacked_split(plan: HaloPlan, arrays: Mapping[str, Any]) -> SplitPlan | None:
    """The split call (`split_plan`) of a block with the halo, when every block of the call is causal
    on cuDNN with either that halo (hl keys before it) or none: then all of a device's blocks run as
    its batch rows (`_stacked_blocks`); else None."""
    layout = plan.layout
    if plan.backend == registry.reference().name or layout.fit == WITHIN:
        return None
    if layout.slots > 1 and any(x.shape[0] != 1 for x in arrays.values()):  # arrays per batch row
        return None
    halos = {hl for hl, hr in layout.cases if hr == 0}
    if len(halos) != len(layout.cases) or len(halos - {0}) != 1:
        return None
    hl = max(halos)
    split = split_plan(plan, (hl, 0))
    if split is None or split.halo is None or any(layout.reach(s)[0] not in (0, hl) for s in range(layout.slots)):
        return None
    return split


def _stacked_blocks(plan: HaloPlan, split: SplitPlan, q, k, v, arrays, sinks, tok=None) -> tuple[Any, Any]:
    """A device's blocks as the batch rows of one split call (`_stacked_split`, `split` one block's):
    its queries and own keys, (B, slots·L) -> (B·slots, L), a free reshape; the halos, received per
    block, stacked the same way; where a block has no halo, its row's halo part adds nothing
    (`halo_split`, `present`). Every device runs the same two calls, with no branch on its index,
    and the halos' gradients are added in place where they came from (`halo_split.exchanged_attention`)."""
    layout = plan.layout
    slots, block, hl = layout.slots, layout.block, split.halo.kv_len
    routes, present = [], []
    for slot in range(slots):  # every block's case is (hl, 0) or (0, 0): a halo is one block step
        wanted = layout.wanted(slot, 1, before=True)
        present.append(tuple(w is not None for w in wanted))
        routes.append(halo_exchange.route(block, wanted, block - hl, hl) if any(present[-1]) else None)
    rows = q.shape[0] * slots
    split = dataclasses.replace(split, local=dataclasses.replace(split.local, batch=rows),
                                halo=dataclasses.replace(split.halo, batch=rows))
    ids = None if tok is None else _document_ids(plan, split, tok)
    return exchanged_attention(split, Exchange(plan.axis, tuple(routes), tuple(present)), q, k, v, arrays, sinks,
                               ids)


def _document_ids(plan: HaloPlan, split: SplitPlan, tok: tuple[Any, ...]) -> DocumentIds:
    """The call-local document ids of a device's blocks as batch rows (`ring_documents.shared_ids`):
    each block's own call numbers its documents; its halo call marks the one document that holds
    both its first query and the last key before it (the only one a causal block and the halo of
    the block before it can share), where the block has a halo."""
    layout, hl = plan.layout, split.halo.kv_len
    most, me = plan.spec.max_segments, jax.lax.axis_index(plan.axis)
    starts = jnp.asarray(layout.blocks_of, jnp.int32)[me] * layout.block
    local, halo = [], []
    for slot in range(layout.slots):
        start = starts[slot]
        mine = _tokens(tok, start, layout.block)
        local.append(ring_documents.shared_ids(mine, mine, True, True, most, split.local.max_segments))
        first, before = tuple(x[:, :hl] for x in mine), _tokens(tok, jnp.maximum(start - hl, 0), hl)
        halo.append(ring_documents.shared_ids(first, before, start > 0, start > 0, most, 1))

    rows = lambda pairs, side: slot_rows([p[side] for p in pairs])  # noqa: E731
    return DocumentIds((rows(local, 0), rows(local, 1)), (rows(halo, 0), rows(halo, 1)))


def halo_attention(plan: HaloPlan, q, k, v, arrays: Mapping[str, Any], sinks: Any = None,
                   tok: Any = None) -> tuple[Any, Any]:
    """(output (B, L·slots, N, Hv), logsumexp (B, N, L·slots)) of the local queries over every key
    their windows, chunks or packed documents reach (each block's call sees every key its rows
    attend: `sinks` (N,), when given, join it). `arrays`: the score_mod arrays (B|1, N|1, 1, 1).
    `tok`: with packed documents, (position in its document, valid, document number) of every
    token of the whole sequence in natural order, (B, T) each."""
    me = jax.lax.axis_index(plan.axis)
    if (split := _stacked_split(plan, arrays)) is not None:
        return _stacked_blocks(plan, split, q, k, v, arrays, sinks, tok)
    if plan.spec.segments and plan.backend != registry.reference().name:
        raise AssertionError("packed documents on cuDNN run as stacked blocks (`_stacked_split`)")
    results = [_block_attention(plan, slot, me, q, k, v, arrays, sinks, tok) for slot in range(plan.layout.slots)]
    if len(results) == 1:
        return results[0]
    return (jnp.concatenate([out for out, _ in results], axis=1),
            jnp.concatenate([lse for _, lse in results], axis=-1))
