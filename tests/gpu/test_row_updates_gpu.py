"""The halo's row updates (`parallel.row_updates`) on a GPU: the Pallas kernels run (a Triton call in
the compiled step) and give XLA's formulation's results (`SDPAGRAPH_PALLAS_TRITON=0`).

Skipped without a GPU (conftest.py).
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sdpagraph.parallel import row_updates


def _compiled_text(fn, *args):
    return jax.jit(fn).lower(*args).compile().as_text()


def _merge(present):  # a new function each time: jax's trace caches key on the function
    return lambda *a: row_updates.merge_rows(a[0], a[1], (a[2], a[3]), present, backward_lse=True)


def _add(start):
    return lambda xs, g: row_updates.add_rows(xs, g, start)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_merge_rows_kernel_matches_xla(monkeypatch, dtype):
    rng = np.random.default_rng(0)
    b, length, heads, head_dim, rows = 2, 4096, 16, 128, 1024
    out = jnp.asarray(rng.standard_normal((b, length, heads, head_dim)), dtype)
    lse = jnp.asarray(rng.standard_normal((b, heads, length)) * 4, jnp.float32).at[0, 3, 10].set(-jnp.inf)
    part_out = jnp.asarray(rng.standard_normal((b, rows, heads, head_dim)), dtype)
    part_lse = jnp.asarray(rng.standard_normal((b, heads, rows)) * 4, jnp.float32).at[0, 3, 10].set(-jnp.inf)
    present = jnp.asarray([True, False])
    assert "triton" in _compiled_text(_merge(present), out, lse, part_out, part_lse).lower()
    got = jax.jit(_merge(present))(out, lse, part_out, part_lse)
    monkeypatch.setenv("SDPAGRAPH_PALLAS_TRITON", "0")
    assert "triton" not in _compiled_text(_merge(present), out, lse, part_out, part_lse).lower()
    want = jax.jit(_merge(present))(out, lse, part_out, part_lse)
    np.testing.assert_allclose(np.asarray(got[0].astype(jnp.float32)), np.asarray(want[0].astype(jnp.float32)),
                               atol=2e-2, rtol=2e-2)
    np.testing.assert_allclose(np.asarray(got[1]), np.asarray(want[1]), atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(got[2]), np.asarray(want[2]), atol=1e-5, rtol=1e-5)
    assert np.all(np.isposinf(np.asarray(got[2][1])))  # the second row's part is absent
    np.testing.assert_array_equal(np.asarray(got[0][:, rows:]), np.asarray(out[:, rows:]))
    np.testing.assert_array_equal(np.asarray(got[1][..., rows:]), np.asarray(lse[..., rows:]))


@pytest.mark.parametrize("stacked", [True, False], ids=["stacked", "pair"])
def test_add_rows_kernel_matches_xla(monkeypatch, stacked):
    rng = np.random.default_rng(1)
    b, length, heads, head_dim, rows, start = 1, 16384, 16, 128, 1024, 14336
    xs = tuple(jnp.asarray(rng.standard_normal((b, length, heads, head_dim)), jnp.bfloat16) for _ in range(2))
    grads = tuple(jnp.asarray(rng.standard_normal((b, rows, heads, head_dim)), jnp.bfloat16) for _ in range(2))
    given = jnp.stack(grads) if stacked else grads
    assert "triton" in _compiled_text(_add(start), xs, given).lower()
    got = jax.jit(_add(start))(xs, given)
    monkeypatch.setenv("SDPAGRAPH_PALLAS_TRITON", "0")
    assert "triton" not in _compiled_text(_add(start), xs, given).lower()
    want = jax.jit(_add(start))(xs, given)
    for x, y, z in zip(xs, got, want):
        np.testing.assert_allclose(np.asarray(y.astype(jnp.float32)), np.asarray(z.astype(jnp.float32)),
                                   atol=1e-2, rtol=1e-2)
        np.testing.assert_array_equal(np.asarray(y[:, :start]), np.asarray(x[:, :start]))
        np.testing.assert_array_equal(np.asarray(y[:, start + rows:]), np.asarray(x[:, start + rows:]))


@pytest.mark.parametrize("active", [True, False])
def test_add_rows_kernel_active_flag(active):
    """The kernel adds where the traced flag is True and leaves every value as it was where it is
    False (given rows that are not zeros, to show it reads none of them)."""
    rng = np.random.default_rng(2)
    b, length, heads, head_dim, rows, start = 1, 16384, 16, 128, 1024, 15360
    xs = tuple(jnp.asarray(rng.standard_normal((b, length, heads, head_dim)), jnp.bfloat16) for _ in range(2))
    grads = jnp.asarray(rng.standard_normal((2, b, rows, heads, head_dim)), jnp.bfloat16)
    step = lambda xs, g, a: row_updates.add_rows(xs, g, start, a)  # noqa: E731
    assert "triton" in _compiled_text(step, xs, grads, jnp.asarray(active)).lower()
    got = jax.jit(step)(xs, grads, jnp.asarray(active))
    for i, (x, y) in enumerate(zip(xs, got)):
        want = x.at[:, start:].set((x[:, start:].astype(jnp.float32) + grads[i].astype(jnp.float32)).astype(x.dtype))
        np.testing.assert_array_equal(np.asarray(y.astype(jnp.float32)),
                                      np.asarray((want if active else x).astype(jnp.float32)))
