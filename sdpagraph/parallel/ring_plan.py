"""What is static about a ring (`parallel.ring`): its plan, which backend runs its blocks, and the
status of a (query chunk, key chunk) pair from the chunks' global offsets: skipped, run unmasked or
run masked (`pair_status`), decided at trace time where every device has the same
(`RingPlan.static_status`)."""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any, Mapping

import jax.numpy as jnp
import numpy as np

from sdpagraph.backends import registry
from sdpagraph.parallel import ring_documents
from sdpagraph.parallel.load_balance import DOCUMENTS, device_chunks
from sdpagraph.scoremod.forms import PythonMods
from sdpagraph.scoremod.ir import ScoreModIR, with_position_offsets
from sdpagraph.scoremod.masks import KEY_AXIS, QUERY_AXIS
from sdpagraph.spec import UNBOUNDED, AttentionSpec

SKIP, FULL, MASKED = 0, 1, 2
OFFSETS = {QUERY_AXIS: "__cp_q_offset", KEY_AXIS: "__cp_kv_offset"}  # gen_index axis -> operand name


class OffsetMods:
    """The score_mod of a context-parallel plan's cuDNN blocks (the ring's, the halo's): one that reads
    positions sees them shifted by the block's global offsets, int32 operands (`OFFSETS`), so one
    graph serves every block. For a frozen dataclass with a `score_mod` field."""

    score_mod: ScoreModIR | None

    @property
    def reads_positions(self) -> bool:
        return self.score_mod is not None and self.score_mod.reads_positions

    @functools.cached_property
    def block_ir(self) -> ScoreModIR | None:
        return with_position_offsets(self.score_mod, OFFSETS) if self.reads_positions else self.score_mod


@dataclass(frozen=True)
class RingPlan(OffsetMods):
    """Everything static about one ring (hashable: custom_vjp's non-differentiable argument).

    `spec` is the call's spec with the batch of one device (the sequence lengths stay global)."""

    spec: AttentionSpec
    axis: str
    size: int  # devices along `axis`
    load_balanced: bool | str  # False, True (chunks) or load_balance.DOCUMENTS (`document_order`)
    backend: str  # the primary backend's name (cuDNN: its block graphs) or the reference's (XLA)
    score_mod: ScoreModIR | None
    scalars: tuple[tuple[str, Any], ...]
    python_mods: PythonMods | None = None

    @property
    def chunks(self) -> int:
        return 2 if self.load_balanced else 1

    @property
    def q_chunk(self) -> int:
        return self.spec.q_len // (self.size * self.chunks)

    @property
    def kv_chunk(self) -> int:
        return self.spec.kv_len // (self.size * self.chunks)

    @property
    def shift(self) -> int:
        """The aligned diagonal: query q sees key q + shift."""
        return self.spec.kv_len - self.spec.q_len if self.spec.causal_alignment == "bottom_right" else 0

    def offsets(self, device: Any, length: int) -> list[Any]:
        """Global start of each chunk `device` (traced) holds, for chunks of `length` tokens."""
        table = jnp.asarray(device_chunks(self.size, self.load_balanced), jnp.int32)
        return [table[device, c] * length for c in range(self.chunks)]

    def static_status(self, step: int, q_chunk: int, kv_chunk: int) -> int | None:
        """`pair_status` of the pair of a device's query chunk `q_chunk` and the key chunk `kv_chunk`
        visiting at `step` (indices among the chunks a device holds) where it is the same on every
        device, else None (decided per device when the step runs). A pair SKIP everywhere is left out;
        one FULL or MASKED everywhere runs its graph without a branch. Load-balanced and causal, only
        the pairs of the two chunks with the visitor's like-numbered chunk differ between devices."""
        table = device_chunks(self.size, self.load_balanced)
        found = {int(pair_status(self, table[me][q_chunk] * self.q_chunk,
                                  table[(me - step) % self.size][kv_chunk] * self.kv_chunk, np))
                 for me in range(self.size)}
        return found.pop() if len(found) == 1 else None

    @property
    def documents(self) -> bool:
        """Whether the cuDNN blocks run packed documents (`ring_documents`)."""
        return bool(self.spec.segments) and self.backend != registry.reference().name

    def block_spec(self, diagonal: bool) -> AttentionSpec:
        """The spec of one (query chunk, key chunk) pair on the cuDNN path: causal on the diagonal of a
        causal call; with packed documents, as many document slots as the pair can share."""
        spec = dataclasses.replace(self.spec, q_len=self.q_chunk, kv_len=self.kv_chunk,
                                   is_causal=diagonal and self.spec.is_causal, causal_alignment="top_left")
        if not self.spec.segments:
            return spec
        return dataclasses.replace(spec, max_segments=ring_documents.slots(self.spec.max_segments, self.q_chunk,
                                                                           diagonal),
                                   max_seqlen_q=None, max_seqlen_kv=None)

    @functools.cached_property
    def whole_steps(self) -> bool:
        """Whether each step runs one call over the device's whole blocks (`ring_documents.shared_ids`):
        packed documents on packed graphs (not their dense twin, which a score_mod needs)."""
        return self.documents and not cudnn_static(self, True).graph_spec.segment_mask

    def step_spec(self, first: bool) -> AttentionSpec:
        """The spec of a `whole_steps` call: the device's whole query block against a whole key block,
        causal per document on the first step of a causal call."""
        local = self.q_chunk * self.chunks
        spec = dataclasses.replace(self.spec, q_len=local, kv_len=self.kv_chunk * self.chunks,
                                   is_causal=first and self.spec.is_causal, causal_alignment="top_left")
        # Documents balanced per document: every document has pieces on every device.
        every = first or self.load_balanced == DOCUMENTS
        return dataclasses.replace(spec, max_segments=ring_documents.step_slots(self.spec.max_segments, local,
                                                                                self.chunks, every),
                                   max_seqlen_q=None, max_seqlen_kv=None)

    @property
    def block_specs(self) -> tuple[AttentionSpec, ...]:
        """The specs of the cuDNN block graphs, each once: off the diagonal and on it (a step's whole
        blocks, later steps and the first, with `whole_steps`)."""
        if self.whole_steps:
            return tuple(dict.fromkeys(self.step_spec(first) for first in (False, True)))
        return tuple(dict.fromkeys(self.block_spec(diagonal) for diagonal in (False, True)))


def cudnn_reason(spec: AttentionSpec, score_mod: ScoreModIR | None, python_mods: PythonMods | None) -> str | None:
    """Why a ring of this call cannot run cuDNN blocks (None: it can)."""
    if python_mods is not None:
        return python_mods.reason
    if score_mod is not None and score_mod.reads_positions and any(n.op == "binary_select" for n in score_mod.nodes):
        return ("its mods select by position (a mask_mod, or jnp.where in a score_mod): a block can leave a row "
                "with nothing to attend, which the XLA blocks handle")
    if spec.segments and score_mod is not None and score_mod.reads_positions:
        return ("a score_mod that reads positions with packed segments counts from each document's start, which "
                "the block graphs do not see (the XLA blocks take each token's position in its segment)")
    if spec.has_window or spec.chunk_size is not None:
        return "windows and chunks mask blocks at varying offsets (the XLA blocks mask by global positions)"
    if spec.is_causal and spec.q_len != spec.kv_len:
        return f"causal with T={spec.q_len} != S={spec.kv_len} has no diagonal block"
    return None


def pair_status(plan: RingPlan, q_start: Any, kv_start: Any, xp: Any = jnp) -> Any:
    """SKIP when no query of the pair may see any of its keys, FULL when each sees every key, else
    MASKED; from the position masks (causal, window) and the chunks' global starts (traced, or
    Python ints with `xp=np` for `RingPlan.static_status`)."""
    spec = plan.spec
    q_lo, q_hi = q_start + plan.shift, q_start + plan.shift + plan.q_chunk - 1  # aligned diagonals
    k_lo, k_hi = kv_start, kv_start + plan.kv_chunk - 1
    left, right = spec.window
    none, every = xp.bool_(False), xp.bool_(not spec.segments and spec.chunk_size is None)
    if spec.is_causal:
        none, every = none | (k_lo > q_hi), every & (k_hi <= q_lo)
    if left != UNBOUNDED:
        none, every = none | (k_hi < q_lo - left), every & (k_lo >= q_hi - left)
    if right != UNBOUNDED:
        none, every = none | (k_lo > q_hi + right), every & (k_hi <= q_lo + right)
    return xp.where(none, SKIP, xp.where(every, FULL, MASKED)).astype(xp.int32)


def cudnn_static(plan: RingPlan, diagonal: bool) -> Any:
    return registry.primary().block_static(plan.block_spec(diagonal), plan.block_ir, dict(plan.scalars))


def with_offsets(arrays: Mapping[str, Any], q_start: Any, kv_start: Any) -> dict[str, Any]:
    """`arrays` and a block's global query and key offsets (`OFFSETS`), the operands a block graph whose
    score_mod reads positions takes (`scoremod.ir.with_position_offsets`)."""
    offset = lambda start: jnp.reshape(start, (1, 1, 1, 1)).astype(jnp.int32)  # noqa: E731
    return {**arrays, OFFSETS[QUERY_AXIS]: offset(q_start), OFFSETS[KEY_AXIS]: offset(kv_start)}
