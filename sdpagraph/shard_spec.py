"""The spec and score_mod IR of one shard of a call whose batch and query heads are split over
devices: what a per-device graph is built and keyed from.

    Split(batch_axes, head_axes, batch, heads, kv_heads)    how one call is split
    local_spec(spec, split) -> AttentionSpec                 batch and heads divided, bias/mask shapes too
    local_ir(ir, spec, split) -> ScoreModIR                  its aux arrays' shapes divided the same way

Used by the cuDNN path's partitioning (`backends.cudnn.sharding`) and by context parallelism's heads
split (`parallel.context_parallel`). The dimension labels name each operand dim for both.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from sdpagraph.scoremod.ir import Node, ScoreModIR
from sdpagraph.spec import AttentionSpec

# Dimension labels: B batch, N query heads, K key/value heads, T query and S key positions, H / HV
# head dims of q/k and of v/o. None: a dim that is never split (broadcast size 1, segment slots).
BATCH, HEADS, KV_HEADS, Q_LEN, KV_LEN, HEAD_DIM, HEAD_DIM_V = "b", "n", "k", "t", "s", "h", "hv"
SPLIT_LABELS = (BATCH, HEADS, KV_HEADS)


@dataclass(frozen=True)
class Split:
    """How one call is split across devices: the mesh axes of its batch and query heads, and the
    shard counts along batch, query heads and key/value heads (1: not split)."""

    batch_axes: tuple[str, ...] = ()
    head_axes: tuple[str, ...] = ()
    batch: int = 1
    heads: int = 1
    kv_heads: int = 1

    @property
    def trivial(self) -> bool:
        return self.batch == 1 and self.heads == 1

    def axes(self, label: str | None) -> tuple[str, ...]:
        """The mesh axes of a dim with this label."""
        if label == BATCH:
            return self.batch_axes
        if label == HEADS or (label == KV_HEADS and self.kv_heads > 1):
            return self.head_axes
        return ()

    def count(self, label: str | None) -> int:
        return {BATCH: self.batch, HEADS: self.heads, KV_HEADS: self.kv_heads}.get(label, 1)


def _shrink(shape: tuple[int, ...] | None, spec: AttentionSpec, split: Split) -> tuple[int, ...] | None:
    """A 4-D (B|1, N|1, ...) bias / mask / score_mod array shape on one shard."""
    if shape is None:
        return None
    b, n, *rest = shape
    return (b // split.batch if b == spec.batch else b, n // split.heads if n == spec.num_heads else n, *rest)


def local_spec(spec: AttentionSpec, split: Split) -> AttentionSpec:
    """The spec of one shard: batch and heads divided, bias and mask shapes with them."""
    if split.trivial:
        return spec
    return dataclasses.replace(
        spec, batch=spec.batch // split.batch, num_heads=spec.num_heads // split.heads,
        num_kv_heads=spec.num_kv_heads // split.kv_heads,
        bias_shape=_shrink(spec.bias_shape, spec, split), mask_shape=_shrink(spec.mask_shape, spec, split))


def local_ir(ir: ScoreModIR | None, spec: AttentionSpec, split: Split) -> ScoreModIR | None:
    """The score_mod IR of one shard: its aux arrays' (B|1, N|1, T|1, S|1) shapes divided like the spec
    (the shapes are part of the IR, so of the graph key)."""
    if ir is None or split.trivial or not ir.array_names:
        return ir
    nodes = tuple(
        Node(n.op, n.args, tuple((key, tuple(_shrink(tuple(value), spec, split)) if key == "shape" else value)
                                 for key, value in n.attrs), n.dtype) if n.op == "array" else n
        for n in ir.nodes)
    return dataclasses.replace(ir, nodes=nodes, _digests={})
