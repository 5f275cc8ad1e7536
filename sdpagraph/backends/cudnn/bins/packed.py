"""Packed self-attention run on bins (`graphs.binning`): documents moved whole into short rows.

    usable() -> bool
    say_why_not() -> None
    attention(plan, spec, q, k, v, inputs, run) -> (out, lse or None)

`run(spec, q, k, v, inputs)` is the cuDNN backend's unbinned call. `attention`:
1. numbers the documents (maximal runs of one id, `segments.metadata`; segments past
   `max_segments` are padding, as on the dense twin) and packs them, longest first, into
   `plan.bins` rows of `plan.rows` tokens (`bin_packer`);
2. moves q, k and v into the bins, runs the call there with each document's own id, and moves
   the output and the logsumexp back;
3. runs the call unbinned instead when the documents do not fit: more bins than `plan.bins`
   needed, or a document longer than `plan.rows` (a call without a `max_seqlen_kv` hint, whose
   bins are a quarter of a row, or SDPAGRAPH_CHECK_SEGMENTS=0).
   `lax.cond` picks at run time, so both are compiled, and the answer is the same either way.
   Under autodiff a `cond` keeps a slot for every residual of either branch, sharing slots only
   between residuals of one shape and dtype: the unbinned call keeps q, k and v laid flat in the
   bins' shapes and recomputes its forward in the backward (`_in_bin_shapes`), so that a binned call
   keeps one set of residuals, not both branches'.

The moves are gathers of whole (heads, dim) token rows, one in each direction, and each is the
other's transpose (`_move`): the gradient goes back by a gather too, not by a scatter-add.

Where: a GPU call on one device: a process with one, or inside a `shard_map` manual over every
mesh axis (the packer is a Pallas call, which XLA cannot partition); under jit's partitioning in a
process with several devices, each device runs its rows through `partitioned` instead.
`SDPAGRAPH_BINS=0` switches it off (`graphs.binning` plans no bins then).
"""
from __future__ import annotations

import dataclasses
import functools
import logging
import math
from typing import Any, Callable

import jax
import jax.numpy as jnp

from sdpagraph.graphs.binning import BinPlan
from sdpagraph.logs import log_once, logger
from sdpagraph.meshes import inside_full_shard_map
from sdpagraph.backends.cudnn.bins import packer as bin_packer
from sdpagraph.call import RuntimeInputs
from sdpagraph.segments.metadata import segment_positions, segment_run_ids
from sdpagraph.spec import AttentionSpec

def usable() -> bool:
    """Whether calls that `graphs.binning` plans run on bins here (module docstring): on a GPU, where
    the call runs on one device: the process has one, or the call is traced inside a `shard_map`
    that is manual over every mesh axis (each device packs its own batch rows)."""
    if jax.default_backend() != "gpu":
        return False
    return jax.device_count() == 1 or inside_full_shard_map()


def say_why_not() -> None:
    """Say once, at WARNING, why packed documents that bins would take run on whole rows here (about
    twice as slow on an H100): on a GPU, a process with several devices outside a shard_map, where
    they cannot run per device either (`partitioned.usable`)."""
    if jax.default_backend() != "gpu":
        return
    log_once(logger, logging.WARNING,
             "sdpagraph: packed documents with a score_mod run on whole rows (the dense twin over every "
             "tile): bins run on one device, or per device under jit's partitioning, which is off here "
             "(SDPAGRAPH_PARTITION=0) or does not take the call's attention sinks or dropout; this process "
             "has %d devices. Call sdpagraph.attention inside a jax.shard_map that is manual over every mesh "
             "axis (each device packs its own rows), or run on one GPU (CUDA_VISIBLE_DEVICES).",
             jax.device_count(), topic="bins need one device")


# ----------------------------------------------------------------------------- moves

def _gather_rows(x: Any, index: Any) -> Any:
    """x[index] along axis 0, zero where index is out of range (x.shape[0]: the sentinel)."""
    size = x.shape[0]
    rows = jnp.take(x, jnp.minimum(index, size - 1), axis=0)
    keep = (index < size).reshape(index.shape + (1,) * (x.ndim - 1))
    return jnp.where(keep, rows, jnp.zeros((), x.dtype))


@jax.custom_vjp
def _move(x: Any, to: Any, back: Any) -> Any:
    """`x[to]` (zero at sentinels); `back` is `to`'s inverse (each row of x that `to` picks, at the
    index that picks it; the sentinel elsewhere), so the transpose is a gather by `back`."""
    return _gather_rows(x, to)


def _move_fwd(x, to, back):
    return _gather_rows(x, to), back


def _move_bwd(back, g):
    return _gather_rows(g, back), None, None


_move.defvjp(_move_fwd, _move_bwd)


# ----------------------------------------------------------------------------- packing

@dataclasses.dataclass(frozen=True)
class _Layout:
    """Where each token goes and where each bin slot comes from, flat over (B*T) and (bins*rows)."""

    dest: Any  # (B*T,) bin slot of each token; bins*rows for padding
    source: Any  # (bins*rows,) token in each bin slot; B*T where empty
    bin_ids: Any  # (bins, rows) int32 segment ids in the bins: document number + 1, 0 where empty
    fits: Any  # () bool: every document found a bin


# The fewest document slots the layout sizes its arrays for. Inside a batch-sharded shard_map on 2
# H100s (jax 0.11.2), XLA's GPU compiler crashed (segmentation fault) compiling the layout for 56
# slots (4 rows of at most 14 documents) and compiled it for 2048 (bench/probe_bins_shard_map.py).
MIN_DOC_SLOTS = 2048


def lay_out(ids: Any, plan: BinPlan, max_segments: int, interpret: bool) -> _Layout:
    tokens = ids.size
    # at most max_segments per row count (the others are padding), in at least MIN_DOC_SLOTS slots
    docs = min(tokens, max(ids.shape[0] * max_segments, MIN_DOC_SLOTS))
    run = segment_run_ids(ids)
    valid = ((run > 0) & (run <= max_segments)).reshape(-1)
    position = segment_positions(ids).reshape(-1)
    doc = jnp.cumsum(valid & (position == 0), dtype=jnp.int32) - 1  # numbered along the flat tokens
    doc = jnp.where(valid, doc, docs)  # padding: out of range, dropped by the scatters
    # A document's length is its last token's position + 1: one write per document (counting its
    # tokens into one counter each would make every token of a document contend for that counter).
    next_position, next_valid = jnp.append(position[1:], 0), jnp.append(valid[1:], False)
    last = valid & ((next_position == 0) | ~next_valid)
    lengths = jnp.zeros((docs,), jnp.int32).at[jnp.where(last, doc, docs)].set(position + 1, mode="drop")
    order = jnp.argsort(-lengths, stable=True)
    bin_sorted, offset_sorted = bin_packer.pack(lengths[order], plan.rows, plan.bins, interpret)
    bin_of = jnp.zeros((docs,), jnp.int32).at[order].set(bin_sorted)
    offset_of = jnp.zeros((docs,), jnp.int32).at[order].set(offset_sorted)
    fits = jnp.all((lengths <= plan.rows) & ((lengths == 0) | (bin_of < plan.bins)))
    slots = plan.bins * plan.rows
    doc_safe = jnp.minimum(doc, docs - 1)
    dest = jnp.where(valid, bin_of[doc_safe] * plan.rows + offset_of[doc_safe] + position, slots)
    dest = jnp.where(fits, dest, slots)  # a layout that does not fit is not used: keep it in range
    source = jnp.full((slots,), tokens, jnp.int32).at[dest].set(jnp.arange(tokens, dtype=jnp.int32), mode="drop")
    bin_doc = jnp.where(source < tokens, doc[jnp.minimum(source, tokens - 1)] + 1, 0)
    return _Layout(dest, source, bin_doc.reshape(plan.bins, plan.rows).astype(jnp.int32), fits)


# ----------------------------------------------------------------------------- the call

def attention(plan: BinPlan, spec: AttentionSpec, q: Any, k: Any, v: Any, inputs: RuntimeInputs,
              run: Callable[..., tuple[Any, Any]], interpret: bool = False) -> tuple[Any, Any]:
    """(out (B, T, N, H_v), logsumexp (B, N, T) or None) of the packed call `spec`, on bins when its
    documents fit them (module docstring). `interpret` runs the packer in Pallas' interpreter (tests
    on a CPU)."""
    layout = lay_out(inputs.q_segment_ids, plan, spec.max_segments, interpret)

    def binned(q, k, v):
        into = functools.partial(to_bins, layout=layout, plan=plan)
        bin_inputs = dataclasses.replace(inputs, q_segment_ids=layout.bin_ids, kv_segment_ids=layout.bin_ids)
        out, lse = run(plan.spec, into(q), into(k), into(v), bin_inputs)
        return from_bins(out, lse, layout, spec)

    def unbinned(q, k, v):
        return _in_bin_shapes(lambda q, k, v: run(spec, q, k, v, inputs), plan, q, k, v)

    return jax.lax.cond(layout.fits, binned, unbinned, q, k, v)


def _in_bin_shapes(call: Callable[..., Any], plan: BinPlan, *tokens: Any) -> Any:
    """`call(*tokens)` ((B, T, ...) each), keeping for its gradient only `tokens` laid flat into arrays
    of the bins' shapes (plan.bins * plan.rows >= B * T token rows, zero past them); its backward
    recomputes its forward. Under autodiff a `cond` keeps a slot for each residual of either branch,
    but one slot for residuals of the same shape and dtype: the unbinned branch's then share the binned
    graph's (q, k and v in the bins), so a binned call keeps one set, and only a call whose documents
    do not fit pays for a second forward."""
    slots = plan.bins * plan.rows
    shapes = [x.shape for x in tokens]

    def laid_flat(x):
        flat = x.reshape((-1,) + x.shape[2:])
        return jnp.pad(flat, [(0, slots - flat.shape[0])] + [(0, 0)] * (flat.ndim - 1)).reshape(
            (plan.bins, plan.rows) + x.shape[2:])

    def from_flat(*padded):
        return call(*(x.reshape((-1,) + x.shape[2:])[:math.prod(shape[:2])].reshape(shape)
                      for x, shape in zip(padded, shapes)))

    return jax.checkpoint(from_flat, policy=jax.checkpoint_policies.nothing_saveable)(*map(laid_flat, tokens))


def to_bins(x: Any, layout: _Layout, plan: BinPlan) -> Any:
    flat = x.reshape((-1,) + x.shape[2:])
    return _move(flat, layout.source, layout.dest).reshape((plan.bins, plan.rows) + x.shape[2:])


def from_bins(out: Any, lse: Any, layout: _Layout, spec: AttentionSpec) -> tuple[Any, Any]:
    b, t = spec.batch, spec.q_len
    out = _move(out.reshape((-1,) + out.shape[2:]), layout.dest, layout.source).reshape((b, t) + out.shape[2:])
    if lse is None:
        return out, None
    heads = lse.shape[1]
    rows = jnp.swapaxes(lse, 1, 2).reshape(-1, heads)  # (bins*rows, N)
    lse = _gather_rows(rows, layout.dest)
    lse = jnp.where((layout.dest < rows.shape[0])[:, None], lse, -jnp.inf)
    return out, jnp.swapaxes(lse.reshape(b, t, heads), 1, 2)
