"""Where a halo call's blocks lie and which keys each reads (`parallel.halo`): the sequence cut into
`HaloLayout.count` equal blocks, in natural order or load-balanced; a query reads the keys its sliding
window, its chunk (`chunk_fit`) or its packed document (`document_reach`) allows, so a block needs
only the keys up to `left` before it and `right` after it (`HaloLayout.case_of`). `unsupported` says
which calls the halo cannot run, naming the argument at fault."""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

from sdpagraph.parallel.load_balance import DOCUMENTS, device_chunks
from sdpagraph.parallel.row_updates import MAX_KERNEL_ROWS
from sdpagraph.spec import UNBOUNDED, AttentionSpec

WHOLE, WITHIN, MISALIGNED = "whole", "within", "misaligned"  # `chunk_fit`
# A packed document's halo (`document_reach` keys) is rounded up to a multiple of this (at most a
# block): the rows it updates then start and end on the row kernels' blocks (`row_updates`), which
# run in place of XLA's two fusions per array. The keys and query rows it adds lie in other documents
# than the one the halo call serves (a document holds at most `max_seqlen_kv` tokens), so that call
# masks them.
DOCUMENT_HALO_MULTIPLE = MAX_KERNEL_ROWS


def document_reach(spec: AttentionSpec) -> int | None:
    """Keys before a query that its packed document can hold: `max_seqlen_kv` - 1 (at least 1), or
    None without packed documents or that hint."""
    if spec.segments != "self" or spec.max_seqlen_kv is None:
        return None
    return max(1, spec.max_seqlen_kv - 1)


def sides(spec: AttentionSpec) -> tuple[int, int]:
    """(keys before, keys after) a query's own position that its window (or its packed document,
    `document_reach`) can read; UNBOUNDED for an open side. Causal calls read none after."""
    left, right = spec.window
    if spec.segments and not spec.has_window:
        reach = document_reach(spec)
        left = UNBOUNDED if reach is None else reach
    return left, 0 if spec.is_causal else right


def chunk_fit(spec: AttentionSpec, count: int) -> str | None:
    """How `chunk_size`'s chunks lie on `count` equal blocks of the sequence: None without
    chunk_size, WHOLE (every chunk inside one block), WITHIN (every block inside one chunk), or
    MISALIGNED (a chunk boundary cuts a block and chunks span blocks)."""
    size, block = spec.chunk_size, spec.q_len // count
    if size is None:
        return None
    if block % size == 0:
        return WHOLE
    if all(b * block // size == ((b + 1) * block - 1) // size for b in range(count)):
        return WITHIN
    return MISALIGNED


def _documents_unsupported(spec: AttentionSpec, count: int, load_balanced: Any, packed_graphs: bool) -> str | None:
    """Why the halo cannot run these packed documents on `count` blocks (None: it can)."""
    if load_balanced == DOCUMENTS:
        return (f"needs whole blocks of the sequence: load_balanced={DOCUMENTS!r} cuts each document over the "
                "devices; use load_balanced=True or False, or 'ring' or 'all_to_all'")
    if not spec.is_causal or spec.has_window or spec.chunk_size is not None:
        return ("runs packed documents with is_causal=True and no local_window_size or chunk_size; use 'ring' or "
                "'all_to_all'")
    if not packed_graphs:
        return ("runs packed documents on packed graphs: no score_mod or mask_mod, and a value head dim equal to "
                "the key's; use 'ring' or 'all_to_all'")
    block = spec.q_len // count
    if count < 2:
        return "has nothing to exchange over one block: use 'ring'"
    if spec.max_seqlen_kv is None or document_reach(spec) > block:
        given = "none" if spec.max_seqlen_kv is None else spec.max_seqlen_kv
        return (f"needs max_seqlen_kv (the longest packed document) <= {block + 1}, one more than the blocks of "
                f"{block} tokens the devices hold, so a document reaches back one block at most (given: {given}); "
                "use 'ring' or 'all_to_all'")
    return None


def unsupported(spec: AttentionSpec, cp: int, load_balanced: Any, packed_graphs: bool = True) -> str | None:
    """Why the halo strategy cannot run this call over `cp` devices (None: it can); names the
    argument at fault. `spec` has the global sequence lengths; `packed_graphs`: whether its packed
    documents run on packed graphs, with no mod at all (`strategy.halo_packed_graphs`)."""
    count = cp * (2 if load_balanced else 1)
    if spec.segments:
        if spec.q_len != spec.kv_len or spec.segments != "self":
            return "takes packed documents of self-attention only (one segment_ids array)"
        return _documents_unsupported(spec, count, load_balanced, packed_graphs)
    fit = chunk_fit(spec, count)
    if fit == MISALIGNED:
        blocks = "T/(2cp), load_balanced=True" if load_balanced else "T/cp"
        return (f"needs chunk_size={spec.chunk_size} to divide the blocks of {spec.q_len // count} tokens the "
                f"devices hold ({blocks}), or to be a multiple of them; use 'ring' or 'all_to_all'")
    left, right = sides(spec)
    if fit is None and (not spec.has_window or left == UNBOUNDED or right == UNBOUNDED):
        return ("needs a sliding window bounded on each side it reads, or chunk_size: local_window_size=(left, 0) "
                f"with is_causal=True, or (left, right); this call has local_window_size={spec.window} "
                f"(-1: unbounded) and is_causal={spec.is_causal}")
    if spec.q_len != spec.kv_len:
        return f"needs self-attention lengths: query length T={spec.q_len} != key length S={spec.kv_len}"
    return None


@dataclass(frozen=True)
class HaloLayout:
    """Where the blocks of a call's sequence lie and which keys each needs (static). `spec` has the
    global sequence lengths."""

    spec: AttentionSpec
    size: int  # devices along the axis
    load_balanced: bool

    @property
    def slots(self) -> int:
        """Blocks per device."""
        return 2 if self.load_balanced else 1

    @property
    def count(self) -> int:
        return self.size * self.slots

    @property
    def block(self) -> int:
        return self.spec.q_len // self.count

    @functools.cached_property
    def blocks_of(self) -> tuple[tuple[int, ...], ...]:
        """The blocks each device holds, in the order of its tokens."""
        return device_chunks(self.size, self.load_balanced)

    @functools.cached_property
    def holder(self) -> dict[int, tuple[int, int]]:
        """block -> (the device holding it, its slot there)."""
        return {b: (d, s) for d, blocks in enumerate(self.blocks_of) for s, b in enumerate(blocks)}

    @functools.cached_property
    def fit(self) -> str | None:
        return chunk_fit(self.spec, self.count)

    def case_of(self, block: int) -> tuple[int, int]:
        """(hl, hr): the halo lengths block `block` receives: the window's sides (a packed document's
        reach rounded up, `DOCUMENT_HALO_MULTIPLE`), capped by the tokens that exist and by the bounds
        of its chunk."""
        start, end = block * self.block, (block + 1) * self.block
        low, high = 0, self.spec.q_len  # the keys its queries may reach
        if self.fit == WHOLE:
            low, high = start, end
        elif self.fit == WITHIN:
            low = start // self.spec.chunk_size * self.spec.chunk_size
            high = min(low + self.spec.chunk_size, high)
        left, right = sides(self.spec)
        if left != UNBOUNDED and self.spec.segments and not self.spec.has_window:  # a document's reach
            left = min(-(-left // DOCUMENT_HALO_MULTIPLE) * DOCUMENT_HALO_MULTIPLE, self.block)
        return (start - low if left == UNBOUNDED else min(left, start - low),
                high - end if right == UNBOUNDED else min(right, high - end))

    @functools.cached_property
    def cases(self) -> tuple[tuple[int, int], ...]:
        return tuple(sorted({self.case_of(b) for b in range(self.count)}))

    def reach(self, slot: int) -> tuple[int, int]:
        """(left, right): the longest halos of the blocks in `slot` (one per device): the sizes of
        their halo buffers."""
        cases = [self.case_of(blocks[slot]) for blocks in self.blocks_of]
        return tuple(max(case[i] for case in cases) for i in (0, 1))

    def wanted(self, slot: int, step: int, before: bool) -> list[tuple[int, int] | None]:
        """Per device, the (device, slot) holding the block `step` blocks before (`before`) or after
        its block in `slot`, where that block's halo reaches it; else None (`halo_exchange.route`)."""
        wanted = []
        for blocks in self.blocks_of:
            mine = blocks[slot]
            needs = self.case_of(mine)[0 if before else 1] > (step - 1) * self.block
            wanted.append(self.holder[mine - step if before else mine + step] if needs else None)
        return wanted

    @property
    def received(self) -> int:
        """Key (and value) tokens the busiest device's blocks read beyond themselves (what it
        receives, and the slices of its own other block when load-balanced)."""
        return max(sum(sum(self.case_of(b)) for b in blocks) for blocks in self.blocks_of)
