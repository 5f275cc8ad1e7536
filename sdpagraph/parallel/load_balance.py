"""Load balancing for causal context parallelism: which chunks of the sequence each device holds.

Under a causal mask the last tokens attend to the most keys, so splitting a sequence into `cp`
contiguous pieces gives the last device `2cp - 1` times the work of the first. Cut it into `2cp`
chunks instead and give device i chunks i and 2cp - 1 - i: every device then holds one early and
one late chunk, and the same amount of causal work.

`load_balance` reorders a (global) array so that the plain contiguous split over `cp` devices is
that assignment; `unload_balance` undoes it. Both are one static permutation of chunks, slices
and one concatenation, which XLA partitions into collective permutes and all-to-alls of the
chunks that change device. A sharded array keeps its sharding (with Explicit mesh axes, its type).

Packed documents do causal work within each document, wherever it lies, so chunks of the row
balance them only as evenly as the documents happen to fall (`bench/cp_balance.py`). Given the
row's `segment_ids`, the same assignment applies to each document instead (`document_order`):
every run of equal ids (padding too) is cut into 2cp pieces, device i takes pieces i and
2cp - 1 - i of every document, in the row's order. Pieces differ by at most one token; the longer
ones go round the 2cp piece positions along the row, so every device holds T / cp tokens. Or the
documents stay whole and only their order in the row changes (`whole_documents`), which leaves an
ordinary packed row that every strategy runs.
"""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from sdpagraph.meshes import explicit_axes
from sdpagraph.parallel.whole_documents import whole_document_order

DOCUMENTS = "documents"  # load_balanced=DOCUMENTS: q, k, v in `document_order`


def device_chunks(cp_size: int, load_balanced: bool) -> tuple[tuple[int, ...], ...]:
    """The chunks of the sequence each device holds, in order: ((i,), ...) contiguous, or
    ((i, 2cp - 1 - i), ...) load-balanced (the sequence in `2 * cp_size` chunks)."""
    if not load_balanced:
        return tuple((i,) for i in range(cp_size))
    return tuple((i, 2 * cp_size - 1 - i) for i in range(cp_size))


def balanced_order(cp_size: int) -> np.ndarray:
    """The chunk order of a load-balanced sequence: [0, 2cp-1, 1, 2cp-2, ...]."""
    return np.array([c for pair in device_chunks(cp_size, True) for c in pair], np.int32)


def _check(x: Any, cp_size: Any, seq_axis: int, who: str, whole_documents: bool = False) -> int:
    if isinstance(cp_size, bool) or not isinstance(cp_size, (int, np.integer)) or cp_size < 1:
        raise ValueError(f"{who}: cp_size must be a positive int (the size of the context-parallel mesh axis), "
                         f"got {cp_size!r}")
    ndim = len(x.shape)
    if not -ndim <= seq_axis < ndim:
        raise ValueError(f"{who}: seq_axis={seq_axis} is out of range for an array of shape {tuple(x.shape)}")
    length = x.shape[seq_axis]
    if whole_documents and length % cp_size:
        raise ValueError(f"{who}: the sequence length {length} (axis {seq_axis}) must be divisible by "
                         f"cp_size = {cp_size}: each device holds an equal shard")
    if not whole_documents and length % (2 * cp_size):
        raise ValueError(f"{who}: the sequence length {length} (axis {seq_axis}) must be divisible by "
                         f"2 * cp_size = {2 * cp_size}: it is cut into 2 * cp_size equal chunks")
    return seq_axis % ndim


def _permute_chunks(x: Any, cp_size: int, seq_axis: int, order: np.ndarray) -> Any:
    x = jnp.asarray(x)
    explicit = explicit_axes(x)
    if explicit:  # slices of an Explicit-sharded axis have no type: permute on Auto axes, typed as x
        permute = lambda x: _permute_chunks(x, cp_size, seq_axis, order)  # noqa: E731
        return jax.sharding.auto_axes(permute, axes=explicit, out_sharding=jax.typeof(x).sharding)(x)
    shape = x.shape
    chunks = x.reshape(shape[:seq_axis] + (2 * cp_size, shape[seq_axis] // (2 * cp_size)) + shape[seq_axis + 1:])
    out = jnp.concatenate([jax.lax.slice_in_dim(chunks, c, c + 1, axis=seq_axis) for c in order], axis=seq_axis)
    out = out.reshape(shape)
    if isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer):  # eager: the sharding it came with
        out = jax.device_put(out, x.sharding)
    return out


def document_order(segment_ids: Any, cp_size: int) -> tuple[Any, Any]:
    """(order, high) (B, T) int32 each, for natural-order `segment_ids` (B, T): `order[b, i]` is the
    natural index of the token at position i of the document-balanced row (module docstring), and
    `high[b, t]` says whether natural token t lies in the later piece a device holds of its document
    (piece index >= cp)."""
    ids = jnp.asarray(segment_ids)
    b, t = ids.shape
    pieces = 2 * cp_size
    starts = jnp.concatenate([jnp.ones((b, 1), bool), ids[:, 1:] != ids[:, :-1]], axis=1)
    run = jnp.cumsum(starts, axis=1, dtype=jnp.int32) - 1  # 0-based, padding runs included
    index = jnp.arange(t, dtype=jnp.int32)
    position = index - jax.lax.cummax(jnp.where(starts, index, 0), axis=1)
    rows = jnp.arange(b)[:, None]
    lengths = jnp.zeros((b, t), jnp.int32).at[rows, run].add(1)  # per run
    rem = lengths % pieces
    first_extra = (jnp.cumsum(rem, axis=1) - rem) % pieces  # the piece position its first longer piece takes
    at = lambda per_run: jnp.take_along_axis(per_run, run, axis=1)[..., None]  # noqa: E731 - per token
    piece_positions = jnp.arange(pieces, dtype=jnp.int32)
    longer = (piece_positions - at(first_extra)) % pieces < at(rem)
    ends = jnp.cumsum(at(lengths // pieces) + longer, axis=-1)  # (B, T, 2cp): where each piece ends
    piece = jnp.sum(position[..., None] >= ends[..., :-1], axis=-1, dtype=jnp.int32)
    device = jnp.where(piece < cp_size, piece, pieces - 1 - piece)
    return jnp.argsort(device, axis=1, stable=True).astype(jnp.int32), (piece >= cp_size).astype(jnp.int32)


def _check_documents(x: Any, segment_ids: Any, seq_axis: int, who: str) -> Any:
    ids = jnp.asarray(segment_ids)
    if ids.ndim != 2 or not jnp.issubdtype(ids.dtype, jnp.integer):
        raise ValueError(f"{who}: segment_ids must be (B, T) integers in the natural order, got "
                         f"{ids.dtype}{tuple(ids.shape)}")
    if x.shape[0] != ids.shape[0] or x.shape[seq_axis] != ids.shape[1]:
        raise ValueError(f"{who}: segment_ids {tuple(ids.shape)} must match the batch (axis 0) and the sequence "
                         f"(axis {seq_axis}) of an array of shape {tuple(x.shape)}")
    return ids


def gather_tokens(x: Any, order: Any, seq_axis: int) -> Any:
    """`x` (batch first) with its sequence axis gathered by `order` (B, T) per batch row."""
    shape = [1] * x.ndim
    shape[0], shape[seq_axis] = order.shape
    return jnp.take_along_axis(x, order.reshape(shape), axis=seq_axis)


def _reorder_documents(x: Any, cp_size: int, seq_axis: int, segment_ids: Any, inverse: bool, whole: bool,
                       who: str) -> Any:
    """`x` in `document_order` of `segment_ids` (or `whole_document_order`; back, `inverse`), keeping
    its sharding."""
    x = jnp.asarray(x)
    ids = _check_documents(x, segment_ids, seq_axis, who)
    if whole:
        if isinstance(segment_ids, jax.core.Tracer):
            raise TypeError(f"{who}(whole_documents=True) orders the documents on the host: pass concrete "
                            "segment_ids (the data pipeline's, a NumPy array), not traced values (jit, vmap, "
                            "shard_map); call it eagerly, outside jit")
        order = jnp.asarray(whole_document_order(np.asarray(segment_ids), cp_size))
    else:
        order = document_order(ids, cp_size)[0]
    order = jnp.argsort(order, axis=1).astype(jnp.int32) if inverse else order
    explicit = explicit_axes(x)
    if explicit:  # gathers along an Explicit-sharded axis have no type: reorder on Auto axes, typed as x
        gather = lambda x, order: gather_tokens(x, order, seq_axis)  # noqa: E731
        return jax.sharding.auto_axes(gather, axes=explicit, out_sharding=jax.typeof(x).sharding)(x, order)
    out = gather_tokens(x, order, seq_axis)
    if isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer):  # eager: the sharding it came with
        out = jax.device_put(out, x.sharding)
    return out


def load_balance(x: Any, cp_size: int, seq_axis: int = 1, segment_ids: Any = None,
                 whole_documents: bool = False) -> Any:
    """Reorder the sequence of `x` for load-balanced causal context parallelism.

    The sequence (axis `seq_axis`, length divisible by `2 * cp_size`) is cut into `2 * cp_size`
    equal chunks and reordered so that device i of a contiguous split over `cp_size` devices holds
    chunks i and `2 * cp_size - 1 - i`. Apply it to q, k, v and segment ids (`seq_axis=1`) before
    `attention(..., context_parallel_axis=..., load_balanced=True)`, and `unload_balance` to the
    output. Example, `cp_size=2`, 8 tokens: `[0 1 2 3 4 5 6 7] -> [0 1 6 7 2 3 4 5]`.

    With `segment_ids` (B, T), the row's packed documents in their natural order, each document is
    cut that way instead (`document_order`; x batch first): apply it to q, k, v, and pass the
    natural-order `segment_ids` with `load_balanced="documents"`. Example, `cp_size=2`, documents
    `[1 1 1 1 2 2 2 2]`: `[0 1 2 3 4 5 6 7] -> [0 3 4 7 1 2 5 6]`.

    With `segment_ids` and `whole_documents=True`, the documents stay whole and are reordered in
    their row so that each device's contiguous shard holds an even share of their causal work
    (`whole_documents.whole_document_order`, searched on the host: call it eagerly, in the data
    pipeline, with concrete `segment_ids`; the sequence length need only divide by `cp_size`). The
    result is an ordinary packed row: apply it to q, k, v and to the segment ids themselves, and pass
    those reordered ids with `load_balanced=False`; every strategy takes such rows, the halo
    (`max_seqlen_kv`) included.
    """
    axis = _check(x, cp_size, seq_axis, "load_balance", whole_documents and segment_ids is not None)
    if segment_ids is not None:
        return _reorder_documents(x, cp_size, axis, segment_ids, False, whole_documents, "load_balance")
    _no_whole_documents(whole_documents, "load_balance")
    return _permute_chunks(x, cp_size, axis, balanced_order(cp_size))


def unload_balance(x: Any, cp_size: int, seq_axis: int = 1, segment_ids: Any = None,
                   whole_documents: bool = False) -> Any:
    """The inverse of `load_balance` (with the same natural-order `segment_ids` and `whole_documents`):
    the sequence back in its natural order."""
    axis = _check(x, cp_size, seq_axis, "unload_balance", whole_documents and segment_ids is not None)
    if segment_ids is not None:
        return _reorder_documents(x, cp_size, axis, segment_ids, True, whole_documents, "unload_balance")
    _no_whole_documents(whole_documents, "unload_balance")
    return _permute_chunks(x, cp_size, axis, np.argsort(balanced_order(cp_size)).astype(np.int32))


def _no_whole_documents(whole_documents: bool, who: str) -> None:
    if whole_documents:
        raise ValueError(f"{who}: whole_documents=True reorders a row's documents: pass the row's natural-order "
                         "segment_ids too")
