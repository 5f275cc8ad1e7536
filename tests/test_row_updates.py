"""`parallel.row_updates`: the halo's in-place row updates, their Pallas kernels (run in Pallas'
interpreter here) and XLA's formulation, against a float64 NumPy reference."""
from __future__ import annotations

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from sdpagraph.parallel import row_updates

B, L, N = 2, 96, 3


def _merged(out, lse, part_out, part_lse, present):
    """float64 reference of the merge of the first R rows."""
    out, lse = np.asarray(out, np.float64).copy(), np.asarray(lse, np.float64).copy()
    part_out, part_lse = np.asarray(part_out, np.float64), np.asarray(part_lse, np.float64)
    rows = part_out.shape[1]
    part_lse = np.where(np.asarray(present)[:, None, None], part_lse, -np.inf)
    a, c = lse[..., :rows], part_lse
    with np.errstate(invalid="ignore", divide="ignore"):
        total = np.logaddexp(a, c)
        wa = np.where(np.isneginf(a), 0.0, np.exp(a - np.where(np.isneginf(total), 0.0, total)))
        wc = np.where(np.isneginf(c), 0.0, np.exp(c - np.where(np.isneginf(total), 0.0, total)))
    t = lambda w: np.swapaxes(w, 1, 2)[..., None]  # noqa: E731  (B, N, R) -> (B, R, N, 1)
    out[:, :rows] = out[:, :rows] * t(wa) + part_out * t(wc)
    lse[..., :rows] = total
    return out, lse


def _inputs(rng, rows, head_dim, dtype):
    out = jnp.asarray(rng.standard_normal((B, L, N, head_dim)), dtype)
    lse = rng.standard_normal((B, N, L)).astype(np.float32) * 3
    part_out = jnp.asarray(rng.standard_normal((B, rows, N, head_dim)), dtype)
    part_lse = rng.standard_normal((B, N, rows)).astype(np.float32) * 3
    lse[0, 1, 2] = part_lse[0, 1, 2] = -np.inf  # a row with nothing to attend on either side
    lse[1, 0, 5] = -np.inf  # only the part attends
    part_lse[1, 2, 7] = -np.inf  # only the block attends
    return out, jnp.asarray(lse), part_out, jnp.asarray(part_lse)


@pytest.mark.parametrize("interpret", [True, False], ids=["kernel-interpreted", "default"])
@pytest.mark.parametrize("present", [None, (True, False), False], ids=["all", "second-absent", "none"])
@pytest.mark.parametrize("rows,dtype", [(16, jnp.bfloat16), (40, jnp.float32)])
def test_merge_rows(interpret, present, rows, dtype):
    rng = np.random.default_rng(rows)
    out, lse, part_out, part_lse = _inputs(rng, rows, 16, dtype)
    flags = None if present is None else jnp.asarray(present)
    assert not interpret or row_updates.kernel_rows(rows, 0, (out, part_out), interpret=True) > 0
    got_out, got_lse, got_backward = jax.jit(
        lambda *a: row_updates.merge_rows(*a[:2], a[2:4], flags, backward_lse=True, interpret=interpret))(
        out, lse, part_out, part_lse)
    flags_np = np.broadcast_to(True if present is None else present, (B,))
    want_out, want_lse = _merged(np.asarray(out.astype(jnp.float32)), lse, np.asarray(part_out.astype(jnp.float32)),
                                 part_lse, flags_np)
    # the backward's logsumexp: the merged rows', +inf where the part is absent
    want_backward = np.where(flags_np[:, None, None], want_lse[..., :rows], np.inf)
    assert got_backward.shape == part_lse.shape and got_backward.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(got_backward), want_backward, atol=1e-5, rtol=1e-5)
    plain = jax.jit(lambda *a: row_updates.merge_rows(*a[:2], a[2:4], flags, interpret=interpret))(
        out, lse, part_out, part_lse)
    assert len(plain) == 2
    np.testing.assert_array_equal(np.asarray(plain[1]), np.asarray(got_lse))
    assert got_out.dtype == out.dtype and got_lse.dtype == jnp.float32
    tol = 1e-2 if dtype == jnp.bfloat16 else 1e-5
    np.testing.assert_allclose(np.asarray(got_out.astype(jnp.float32)), want_out, atol=tol, rtol=tol)
    np.testing.assert_allclose(np.asarray(got_lse), want_lse, atol=1e-5, rtol=1e-5)
    # rows past the part's are the block's own, untouched
    np.testing.assert_array_equal(np.asarray(got_out[:, rows:]), np.asarray(out[:, rows:]))
    np.testing.assert_array_equal(np.asarray(got_lse[..., rows:]), np.asarray(lse[..., rows:]))
    for row in np.flatnonzero(~np.broadcast_to(True if present is None else present, (B,))):
        # an absent row's part adds nothing (where its block attends at all)
        attends = np.isfinite(np.swapaxes(np.asarray(lse[row]), 0, 1))[..., None]  # (L, N, 1)
        np.testing.assert_array_equal(np.where(attends, np.asarray(got_out[row].astype(jnp.float32)), 0),
                                      np.where(attends, np.asarray(out[row].astype(jnp.float32)), 0))


@pytest.mark.parametrize("interpret", [True, False], ids=["kernel-interpreted", "default"])
@pytest.mark.parametrize("stacked", [True, False], ids=["stacked", "pair"])
@pytest.mark.parametrize("start", [0, 32, 56])
def test_add_rows(interpret, stacked, start):
    rng = np.random.default_rng(start)
    rows = 40 if start != 32 else 64
    xs = tuple(jnp.asarray(rng.standard_normal((B, L, N, 16)), jnp.bfloat16) for _ in range(2))
    grads = tuple(jnp.asarray(rng.standard_normal((B, rows, N, 16)), jnp.float32) for _ in range(2))
    given = jnp.stack(grads) if stacked else grads
    assert not interpret or row_updates.kernel_rows(rows, start, xs + grads, interpret=True) > 0
    got = jax.jit(lambda xs, g: row_updates.add_rows(xs, g, start, interpret=interpret))(xs, given)
    for x, g, y in zip(xs, grads, got):
        # the sum in fp32, rounded once to bf16 (a bf16 sum of the rounded rows differs)
        want = np.asarray(x.astype(jnp.float32)).copy()
        want[:, start:start + rows] += np.asarray(g)
        want = np.asarray(jnp.asarray(want).astype(jnp.bfloat16).astype(jnp.float32))
        assert y.dtype == x.dtype
        np.testing.assert_array_equal(np.asarray(y.astype(jnp.float32)), want)
        np.testing.assert_array_equal(np.asarray(y[:, :start]), np.asarray(x[:, :start]))
        np.testing.assert_array_equal(np.asarray(y[:, start + rows:]), np.asarray(x[:, start + rows:]))


@pytest.mark.parametrize("active", [True, False])
def test_add_rows_active_flag(active):
    """A traced `active`: where True the rows are added; where False the kernel touches nothing (here
    given rows that are not zeros, to show it reads none of them)."""
    rng = np.random.default_rng(3)
    xs = tuple(jnp.asarray(rng.standard_normal((B, L, N, 16)), jnp.float32) for _ in range(2))
    grads = jnp.asarray(rng.standard_normal((2, B, 32, N, 16)), jnp.float32)
    assert row_updates.kernel_rows(32, 32, xs, interpret=True) > 0
    got = jax.jit(lambda xs, g, a: row_updates.add_rows(xs, g, 32, a, interpret=True))(xs, grads, jnp.asarray(active))
    for i, (x, y) in enumerate(zip(xs, got)):
        want = np.asarray(x).copy()
        if active:
            want[:, 32:64] += np.asarray(grads[i])
        np.testing.assert_allclose(np.asarray(y), want, rtol=1e-6)


def test_add_rows_traced_start_runs_xla():
    """A start known only at run time (a device's slot) takes XLA's formulation, with the same result."""
    rng = np.random.default_rng(1)
    xs = (jnp.asarray(rng.standard_normal((B, L, N, 16)), jnp.float32),)
    grads = (jnp.asarray(rng.standard_normal((B, 8, N, 16)), jnp.float32),)
    got = jax.jit(lambda xs, g, s: row_updates.add_rows(xs, g, s, interpret=True))(xs, grads, jnp.int32(24))
    want = np.asarray(xs[0]).copy()
    want[:, 24:32] += np.asarray(grads[0])
    np.testing.assert_allclose(np.asarray(got[0]), want, rtol=1e-6)


def test_add_rows_arrays_of_other_shapes_run_xla():
    """Arrays of different head counts in one call take XLA's formulation (the kernel's grid is one
    array's); a start the rows do not fit from is refused."""
    rng = np.random.default_rng(2)
    xs = (jnp.asarray(rng.standard_normal((B, L, 2, 16)), jnp.float32),
          jnp.asarray(rng.standard_normal((B, L, 4, 16)), jnp.float32))
    grads = (jnp.asarray(rng.standard_normal((B, 16, 2, 16)), jnp.float32),
             jnp.asarray(rng.standard_normal((B, 16, 4, 16)), jnp.float32))
    got = row_updates.add_rows(xs, grads, 32, interpret=True)
    for x, g, y in zip(xs, grads, got):
        want = np.asarray(x).copy()
        want[:, 32:48] += np.asarray(g)
        np.testing.assert_allclose(np.asarray(y), want, rtol=1e-6)
    with pytest.raises(ValueError, match="do not fit"):
        row_updates.add_rows(xs, grads, L - 8, interpret=True)


def test_kernel_rows_choice():
    """Rows per program: the largest power of two up to MAX_KERNEL_ROWS dividing the rows and the
    start; none (XLA's formulation) for odd counts, traced starts, non-power-of-two head dims, 8-byte
    values, or, without the interpreter, on a CPU."""
    x = jax.ShapeDtypeStruct((1, 4096, 16, 128), jnp.bfloat16)
    assert row_updates.kernel_rows(1024, 15360, (x,), interpret=True) == row_updates.MAX_KERNEL_ROWS
    assert row_updates.kernel_rows(24, 0, (x,), interpret=True) == 8
    assert row_updates.kernel_rows(8191, 0, (x,), interpret=True) == 0
    assert row_updates.kernel_rows(1024, 4, (x,), interpret=True) == 0
    assert row_updates.kernel_rows(1024, jnp.int32(0) + 0, (x,), interpret=True) == 0  # traced start
    assert row_updates.kernel_rows(1024, 0, (jax.ShapeDtypeStruct((1, 4096, 16, 96), jnp.bfloat16),),
                                   interpret=True) == 0
    assert row_updates.kernel_rows(1024, 0, (jax.ShapeDtypeStruct((1, 4096, 16, 128), jnp.float64),),
                                   interpret=True) == 0
    if jax.default_backend() == "cpu":
        assert row_updates.kernel_rows(1024, 0, (x,)) == 0
