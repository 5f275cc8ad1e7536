"""Attention dropout on the GPU (`attention(..., dropout_rate=p, dropout_rng=key)`), on cuDNN (Philox)
and on the XLA backend. Skipped without a GPU (conftest.py).

The mask a call draws is read back from the call itself: with the values the identity (S keys of head
dimension S, `v[b, j, kv, :] = e_j`), `out[b, i, h, j] = p_ij * m_ij / (1 - p)`, so the kept weights are
the nonzero outputs (softmax weights of these inputs are far from underflow in bf16). The mask depends
only on the rng, the shapes and the flags, so the same call on random values uses that mask, and a
float64 NumPy reference built on it gives the expected output and gradients. cuDNN and XLA draw
different masks from the same rng; each is checked against its own.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import sdpagraph

from tests.reference import rel_err

B, T, S, H = 2, 256, 128, 128  # S == H: identity values fit the head dimension
HEADS = [(4, 2), (4, 4)]  # (N, K): GQA and one key/value head per query head
RATE = 0.1


def random_inputs(seed, n, k):
    """q, k, v and an output cotangent, bf16 from jax.random."""
    keys = jax.random.split(jax.random.key(seed), 4)
    shapes = ((B, T, n, H), (B, S, k, H), (B, S, k, H), (B, T, n, H))
    return [jax.random.normal(key, shape, jnp.bfloat16) for key, shape in zip(keys, shapes)]


def identity_values(k):
    return jnp.broadcast_to(jnp.eye(S, dtype=jnp.bfloat16)[None, :, None, :], (B, S, k, S))


def allowed(causal):
    """(T, S) bool: the positions a query attends (top-left causal: key j <= query i)."""
    return np.tril(np.ones((T, S), bool)) if causal else np.ones((T, S), bool)


def attend(implementation, causal, rate, **kwargs):
    """The jitted call, its rng a jit argument."""
    return jax.jit(lambda q, k, v, rng: sdpagraph.attention(
        q, k, v, is_causal=causal, implementation=implementation, dropout_rate=rate, dropout_rng=rng, **kwargs))


def with_grads(implementation, causal, rate, deterministic=None):
    """jit of (out, (dq, dk, dv)) for a cotangent, through jax.vjp."""
    def run(q, k, v, d_out, rng):
        out, pullback = jax.vjp(lambda q, k, v: sdpagraph.attention(
            q, k, v, is_causal=causal, implementation=implementation, dropout_rate=rate, dropout_rng=rng,
            deterministic=deterministic), q, k, v)
        return out, pullback(d_out)
    return jax.jit(run)


def recovered(implementation, causal, rate, q, k, rng):
    """(keep (B, N, T, S) bool, the identity-value output (B, N, T, S) in float64) of the call with q, k."""
    out = attend(implementation, causal, rate)(q, k, identity_values(k.shape[2]), rng)
    out = np.asarray(out, np.float64).transpose(0, 2, 1, 3)
    return (out != 0) & allowed(causal), out


def expand(x, group):
    """(B, S, K, H) -> (B, S, N, H) in float64: query head n reads key/value head n // group."""
    return np.repeat(np.asarray(x, np.float64), group, axis=2)


def softmax(q, k, causal):
    """float64 softmax weights (B, N, T, S) and logsumexp (B, T, N) of the scaled scores."""
    q = np.asarray(q, np.float64)
    logits = np.einsum("btnh,bsnh->bnts", q, expand(k, q.shape[2] // k.shape[2])) / np.sqrt(H)
    logits = np.where(allowed(causal), logits, -np.inf)
    top = logits.max(-1, keepdims=True)
    lse = top + np.log(np.exp(logits - top).sum(-1, keepdims=True))
    return np.exp(logits - lse), lse[..., 0].transpose(0, 2, 1)


def reference(q, k, v, d_out, keep, rate, causal):
    """float64 dropout attention on `keep`: out (B, T, N, H) and (dq, dk, dv)."""
    q, d_out = np.asarray(q, np.float64), np.asarray(d_out, np.float64)
    kv_heads = k.shape[2]
    group = q.shape[2] // kv_heads
    ke, ve = expand(k, group), expand(v, group)
    p, _ = softmax(q, k, causal)
    dropped = p * keep / (1.0 - rate)
    out = np.einsum("bnts,bsnh->btnh", dropped, ve)
    dp = np.einsum("btnh,bsnh->bnts", d_out, ve) * keep / (1.0 - rate)  # d loss / d p
    dlogits = p * (dp - np.sum(p * dp, -1, keepdims=True))
    dq = np.einsum("bnts,bsnh->btnh", dlogits, ke) / np.sqrt(H)
    dk = np.einsum("bnts,btnh->bsnh", dlogits, q) / np.sqrt(H)
    dv = np.einsum("bnts,btnh->bsnh", dropped, d_out)
    fold = lambda x: x.reshape(B, S, kv_heads, group, H).sum(3)  # noqa: E731 (a group's heads -> its kv head)
    return out, (dq, fold(dk), fold(dv))


@pytest.mark.parametrize("rate", [0.1, 0.3])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"N{h[0]}K{h[1]}")
@pytest.mark.parametrize("implementation", ["cudnn", "xla"])
def test_kept_fraction_and_the_one_over_one_minus_p_scaling(implementation, heads, causal, rate, report):
    q, k, _, _ = random_inputs(1, *heads)
    keep, out = recovered(implementation, causal, rate, q, k, jax.random.key(0))
    count = B * heads[0] * allowed(causal).sum()
    kept = keep.sum() / count
    sigma = np.sqrt(rate * (1 - rate) / count)
    report(f"dropout {implementation} N{heads[0]}K{heads[1]} causal={causal} p={rate}: kept {kept:.5f} "
           f"(expected {1 - rate}, {abs(kept - (1 - rate)) / sigma:.1f} sigma)")
    assert abs(kept - (1 - rate)) < 5 * sigma
    # each (batch row, query head) draws a mask of its own
    assert len({block.tobytes() for block in keep.reshape(B * heads[0], T * S)}) == B * heads[0]
    assert not np.any(out[:, :, ~allowed(causal)]), "a masked position reached the output"
    assert rel_err(out, softmax(q, k, causal)[0] / (1 - rate), where=keep) < 1e-2


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"N{h[0]}K{h[1]}")
@pytest.mark.parametrize("implementation", ["cudnn", "xla"])
def test_forward_and_gradients_match_float64_on_the_recovered_mask(implementation, heads, causal):
    q, k, v, d_out = random_inputs(2, *heads)
    rng = jax.random.key(3)
    keep, _ = recovered(implementation, causal, RATE, q, k, rng)
    out, grads = with_grads(implementation, causal, RATE)(q, k, v, d_out, rng)
    want_out, want_grads = reference(q, k, v, d_out, keep, RATE, causal)
    assert rel_err(out, want_out) <= 1e-2
    for name, got, want in zip(("dq", "dk", "dv"), grads, want_grads):
        assert rel_err(got, want) <= 2e-2, (name, rel_err(got, want))


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"N{h[0]}K{h[1]}")
def test_the_same_rng_gives_bitwise_the_same_output_and_deterministic_gradients(heads, causal):
    q, k, v, d_out = random_inputs(4, *heads)
    step = with_grads("cudnn", causal, RATE, deterministic=True)
    first, second = step(q, k, v, d_out, jax.random.key(5)), step(q, k, v, d_out, jax.random.key(5))
    for name, a, b in zip(("out", "dq", "dk", "dv"), jax.tree.leaves(first), jax.tree.leaves(second)):
        assert np.array_equal(np.asarray(a), np.asarray(b)), name


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("implementation", ["cudnn", "xla"])
def test_another_rng_draws_another_mask(implementation, causal):
    q, k, _, _ = random_inputs(6, *HEADS[0])
    masks = [recovered(implementation, causal, RATE, q, k, jax.random.key(seed))[0] for seed in (7, 7, 8)]
    assert np.array_equal(masks[0], masks[1])
    # two independent masks disagree on a fraction 2p(1 - p) of the positions; ask for half of that
    disagree = np.sum(masks[0] != masks[2]) / (B * HEADS[0][0] * allowed(causal).sum())
    assert disagree > RATE * (1 - RATE), disagree


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("implementation", ["cudnn", "xla"])
def test_the_logsumexp_is_the_softmax_before_dropout(implementation, causal):
    q, k, v, _ = random_inputs(9, *HEADS[0])
    _, with_dropout = attend(implementation, causal, RATE, return_residual=True)(q, k, v, jax.random.key(10))
    _, without = attend(implementation, causal, 0.0, return_residual=True)(q, k, v, None)
    # the residual comes in the inputs' dtype: equal up to bf16's rounding (2**-8 relative), where dropping
    # weights from the sum would move it by log(1 - p) ~ -0.1
    np.testing.assert_allclose(np.asarray(with_dropout, np.float64), np.asarray(without, np.float64), rtol=2**-7)
    np.testing.assert_allclose(np.asarray(with_dropout, np.float64), softmax(q, k, causal)[1], rtol=2**-7)
