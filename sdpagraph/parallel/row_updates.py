"""In-place updates of a few rows of a block: the halo part's result merged into the local part's
output and logsumexp, and gradients added into the rows of dq, dk and dv they belong to.

    merge_rows(out, lse, part, present) -> (out, lse)
    merge_rows(out, lse, part, present, backward_lse=True) -> (out, lse, the merged rows' lse for a backward)
    add_rows(xs, rows, start, active) -> xs
    present_rows(present, batch) -> (batch,) bools

`merge_rows` and `add_rows` run as one Pallas (Triton) kernel each on a GPU, the arrays they update
aliased to the kernel's outputs, so only their rows are read and written and every array of the
update is done in the same launch. Sums are taken in fp32 (fp64 for float64) and rounded once to the
array's dtype.

Elsewhere, and where the kernel's block shapes do not fit (`kernel_rows`: among others a start known
only at run time, as a load-balanced halo's transfers have), they run XLA's formulation. XLA's GPU
emitter writes a dynamic-update-slice in place only where nothing else in its fusion reads the
updated operand, so each array's update there is two fusions (the rows' new values computed apart,
then written), and the merge's logsumexp condition a third: 11 small fusions a window step where the
kernels take 3 launches, 0.03-0.04 ms of a (1024, 0) window's step at T32768 on 2 H100s
(docs/results/h100x2-2026-11-27-row-kernels.md). `SDPAGRAPH_PALLAS_TRITON=0` keeps XLA's formulation
everywhere.
"""
from __future__ import annotations

import functools
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from sdpagraph.backends import pallas_triton
from sdpagraph.backends.softmax_merge import merge
from sdpagraph.meshes import struct_like

MAX_KERNEL_ROWS = 64  # rows of one head a kernel program updates (a block of rows x head dim)
MIN_KERNEL_ROWS = 8  # fewer rows a program (an odd row count or start): XLA's formulation
NUM_WARPS = 4


# ----------------------------------------------------------------------------- XLA's formulation

def _accumulation(dtype: Any) -> Any:
    """The dtype a sum of `dtype` values is taken in: fp64 for float64, else fp32."""
    return jnp.float64 if jnp.dtype(dtype) == jnp.float64 else jnp.float32


def _replace_rows(x: Any, rows: Any, start: Any, axis: int = 1) -> Any:
    """`x` with its `rows.shape[axis]` tokens from `start` along `axis` replaced by `rows`, in place.
    The optimization barrier keeps XLA 0.11 on GPUs from fusing the update with the call that
    produced `rows` or `x` (with the update straight after a merge it reported a cycle in a
    dynamic-slice fusion on 2 H100s; fused with a graph call it failed to compile, "DynamicSliceFusion:
    DUS target must be a fusion parameter"); a concatenation instead copies the whole block."""
    x, rows = jax.lax.optimization_barrier((x, rows.astype(x.dtype)))
    return jax.lax.dynamic_update_slice_in_dim(x, rows, start, axis=axis)


def _add_rows_xla(x: Any, rows: Any, start: Any) -> Any:
    """`x` with `rows` added to its tokens from `start` (axis 1): the sum of the rows computed apart,
    then written (`_replace_rows`); as one fusion (a scatter-add, or a slice, an add and an update)
    XLA copied the whole block, 0.2 ms for a T65536 block on an H100."""
    x, rows = jax.lax.optimization_barrier((x, rows))
    acc = _accumulation(x.dtype)
    summed = jax.lax.dynamic_slice_in_dim(x, start, rows.shape[1], axis=1).astype(acc) + rows.astype(acc)
    return _replace_rows(x, summed, start)


def present_rows(present: Any, batch: int) -> Any:
    """`present` (None, one bool, or one per batch row) as (batch,) bools."""
    if present is None:
        return jnp.ones((batch,), bool)
    return jnp.broadcast_to(jnp.reshape(present, (-1,)), (batch,))


def _merge_rows_xla(out: Any, lse: Any, part: tuple[Any, Any], present: Any,
                    backward_lse: bool) -> tuple[Any, ...]:
    part_out, part_lse = part
    rows = part_out.shape[1]
    flags = present_rows(present, out.shape[0])[:, None, None]
    part_lse = jnp.where(flags, part_lse, -jnp.inf)
    lse = lse.astype(jnp.float32)
    head, head_lse = merge((out[:, :rows], lse[..., :rows]), (part_out, part_lse))
    merged = (_replace_rows(out, head, 0), _replace_rows(lse, head_lse, 0, axis=2))
    return (*merged, jnp.where(flags, head_lse, jnp.inf)) if backward_lse else merged


# ----------------------------------------------------------------------------- when the kernel runs

def _power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _block_rows(rows: int, start: int) -> int:
    """The most rows (a power of two up to MAX_KERNEL_ROWS) dividing both `rows` and `start`, or 0
    below MIN_KERNEL_ROWS."""
    block = MAX_KERNEL_ROWS
    while block >= MIN_KERNEL_ROWS and (rows % block or start % block):
        block //= 2
    return block if block >= MIN_KERNEL_ROWS else 0


def kernel_rows(rows: int, start: Any, arrays: Sequence[Any], interpret: bool = False) -> int:
    """Rows per kernel program for an update of `rows` rows from `start` of `arrays` (the values
    updated and read, (B, T, heads, H); `add_rows` also wants one batch, head count and row count
    for all of them), or 0 where XLA's formulation runs: a traced `start` (a
    block's rows must start at a multiple of its size), fewer than MIN_KERNEL_ROWS rows dividing
    both, a head dim that is not a power of two (Triton's block shapes), 8-byte values, and, unless
    `interpret` (Pallas' interpreter, for tests), no GPU or no Pallas Triton in this jax."""
    if not isinstance(start, (int, np.integer)):
        return 0
    if not all(_power_of_two(x.shape[-1]) and jnp.dtype(x.dtype).itemsize <= 4 for x in arrays):
        return 0
    block = _block_rows(rows, int(start))
    if interpret or not block:
        return block
    return block if jax.default_backend() == "gpu" and pallas_triton.status().available else 0


# ----------------------------------------------------------------------------- the merge

def merge_rows(out: Any, lse: Any, part: tuple[Any, Any], present: Any = None, backward_lse: bool = False,
               interpret: bool = False) -> tuple[Any, ...]:
    """(out, lse) with their first R rows merged with `part` = (output (B, R, N, Hv), logsumexp
    (B, N, R)) of the same queries over other keys (`softmax_merge.merge`), in place; out (B, L, N,
    Hv) keeps its dtype, lse (B, N, L) comes back in fp32. `present` (None, one bool or one per batch row):
    where False, that row's part adds nothing. `backward_lse`: also the merged rows' logsumexp (B, N,
    R) with +inf where `present` is False, which a backward of the part's keys takes so that P = exp(s -
    lse) = 0 there (written by the same kernel, where a select before the backward took a launch of
    its own). `interpret`: the kernel in Pallas' interpreter (tests on a CPU)."""
    rows = part[0].shape[1]
    block = kernel_rows(rows, 0, (out, part[0]), interpret)
    if not block:
        return _merge_rows_xla(out, lse, part, present, backward_lse)
    from jax.experimental import pallas as pl

    batch, _, heads, head_dim = out.shape
    flags = present_rows(present, batch).astype(jnp.int32)
    values = pl.BlockSpec((1, block, 1, head_dim), lambda b, r, n: (b, r, n, 0))
    sums = pl.BlockSpec((1, 1, block), lambda b, r, n: (b, n, r))
    operands = (flags, out, lse.astype(jnp.float32), *part)
    out_shape = [struct_like(out.shape, out.dtype, operands), struct_like(lse.shape, jnp.float32, operands)]
    if backward_lse:
        out_shape.append(struct_like(part[1].shape, jnp.float32, operands))
    return tuple(pl.pallas_call(
        functools.partial(_merge_kernel, backward_lse=backward_lse), grid=(batch, rows // block, heads),
        in_specs=[pl.BlockSpec((1,), lambda b, r, n: (b,)), values, sums, values, sums],
        out_specs=[values, sums, sums][:len(out_shape)], out_shape=out_shape,
        input_output_aliases={1: 0, 2: 1}, compiler_params=pallas_triton.compiler_params(NUM_WARPS, interpret),
        interpret=interpret)(*operands))


def _merge_kernel(flag_ref, out_ref, lse_ref, part_ref, part_lse_ref, new_out_ref, new_lse_ref, *backward_ref,
                  backward_lse: bool) -> None:
    """Blocks: flag (1,); out, part (1, R, 1, H); lse, part_lse and the backward's lse (1, 1, R):
    `softmax_merge.merge`'s arithmetic, rows with nothing to attend on both sides left 0 / -inf."""
    a = lse_ref[0, 0]
    present = flag_ref[0] != 0
    c = jnp.where(present, part_lse_ref[0, 0].astype(jnp.float32), -jnp.inf)
    peak = jnp.maximum(a, c)
    safe = jnp.where(peak == -jnp.inf, 0.0, peak)
    weight_a = jnp.where(a == -jnp.inf, 0.0, jnp.exp(a - safe))
    weight_c = jnp.where(c == -jnp.inf, 0.0, jnp.exp(c - safe))
    total = weight_a + weight_c
    inverse = jnp.where(total > 0, 1.0 / jnp.where(total > 0, total, 1.0), 0.0)
    merged = (out_ref[0, :, 0, :].astype(jnp.float32) * (weight_a * inverse)[:, None]
              + part_ref[0, :, 0, :].astype(jnp.float32) * (weight_c * inverse)[:, None])
    new_out_ref[0, :, 0, :] = merged.astype(new_out_ref.dtype)
    merged_lse = jnp.where(total > 0, safe + jnp.log(jnp.where(total > 0, total, 1.0)), -jnp.inf)
    new_lse_ref[0, 0] = merged_lse
    if backward_lse:
        backward_ref[0][0, 0] = jnp.where(present, merged_lse, jnp.inf)


# ----------------------------------------------------------------------------- the sums

def add_rows(xs: tuple[Any, ...], rows: Any, start: Any, active: Any = None,
             interpret: bool = False) -> tuple[Any, ...]:
    """`xs` (arrays (B, L, K, H)) with `rows` added to their R tokens from
    `start`, in place: `rows` one (B, R, K, H) array per x, or all of them stacked (len(xs), B, R, K,
    H) as a transfer brings them. `active` (None, or a traced bool): where False, `rows` are zeros
    (a device a transfer brought nothing), and the kernel reads and writes nothing. `interpret`: the
    kernel in Pallas' interpreter (tests on a CPU)."""
    stacked = hasattr(rows, "shape")
    count = len(xs)
    pieces = [rows[i] for i in range(count)] if stacked else list(rows)  # one (B, R, K, H) per x
    batch, length, heads = xs[0].shape[0], pieces[0].shape[1], xs[0].shape[2]
    if isinstance(start, (int, np.integer)) and not 0 <= start <= xs[0].shape[1] - length:
        raise ValueError(f"add_rows: {length} rows from start {start} do not fit {xs[0].shape[1]} tokens")
    # the kernel's grid is one batch, row count and head count for every array
    fits = all(x.ndim == g.ndim == 4 and (x.shape[0], x.shape[2]) == (batch, heads)
               and g.shape[:3] == (batch, length, heads) for x, g in zip(xs, pieces))
    block = kernel_rows(length, start, (*xs, *pieces), interpret) if fits else 0
    if not block:
        return tuple(_add_rows_xla(x, g, start) for x, g in zip(xs, pieces))
    from jax.experimental import pallas as pl

    offset = int(start) // block
    targets = [pl.BlockSpec((1, block, 1, x.shape[-1]), lambda b, r, n: (b, offset + r, n, 0)) for x in xs]
    if stacked:
        source_specs = [pl.BlockSpec((count, 1, block, 1, rows.shape[-1]), lambda b, r, n: (0, b, r, n, 0))]
        operands = (*xs, rows)
    else:
        source_specs = [pl.BlockSpec((1, block, 1, g.shape[-1]), lambda b, r, n: (b, r, n, 0)) for g in rows]
        operands = (*xs, *rows)
    flag = jnp.reshape(jnp.asarray(True if active is None else active), (1,)).astype(jnp.int32)
    operands += (flag,)
    kernel = functools.partial(_add_kernel, count=count, stacked=stacked)
    return tuple(pl.pallas_call(
        kernel, grid=(batch, length // block, heads),
        in_specs=targets + source_specs + [pl.BlockSpec((1,), lambda b, r, n: (0,))], out_specs=targets,
        out_shape=[struct_like(x.shape, x.dtype, operands) for x in xs],
        input_output_aliases={i: i for i in range(count)},
        compiler_params=pallas_triton.compiler_params(NUM_WARPS, interpret),
        interpret=interpret)(*operands))


def _add_kernel(*refs, count: int, stacked: bool) -> None:
    """Blocks: each x and output (1, R, 1, H); rows (count, 1, R, 1, H) stacked, else one (1, R, 1, H)
    per x; the active flag (1,). The sum in fp32 (the kernel takes no 8-byte values), written in the
    x's dtype; nothing read or written where the flag is 0 (the outputs are the xs, aliased)."""
    from jax.experimental import pallas as pl

    targets, outputs, flag = refs[:count], refs[-count:], refs[-count - 1]

    @pl.when(flag[0] != 0)
    def _() -> None:
        for i in range(count):
            added = refs[count][i, 0, :, 0, :] if stacked else refs[count + i][0, :, 0, :]
            total = targets[i][0, :, 0, :].astype(jnp.float32) + added.astype(jnp.float32)
            outputs[i][0, :, 0, :] = total.astype(outputs[i].dtype)
