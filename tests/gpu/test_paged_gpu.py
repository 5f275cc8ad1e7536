"""Paged K/V on cuDNN (its paged graphs, the page table read on the device) against the XLA backend
on the gathered keys, on the same GPU. Skipped without a GPU (conftest.py)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import sdpagraph
from sdpagraph import paged

from tests.reference import rel_err

B, N, K, H, PAGE, POOL, MAX_PAGES = 4, 16, 2, 128, 64, 64, 8


@pytest.mark.parametrize("t, prefill, with_sinks", [(1, False, False), (1, False, True), (4, False, False),
                                                     (8, False, False), (128, True, False)])
def test_paged_attention_matches_the_xla_backend(t, prefill, with_sinks):
    rng = np.random.default_rng(t + 10 * prefill + 100 * with_sinks)
    bf16 = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.bfloat16)  # noqa: E731
    q, kp, vp = bf16(B, t, N, H), bf16(POOL, PAGE, K, H), bf16(POOL, PAGE, K, H)
    table = jnp.asarray(rng.permutation(POOL)[:B * MAX_PAGES].reshape(B, MAX_PAGES), jnp.int32)
    lengths = jnp.asarray(rng.integers(t, MAX_PAGES * PAGE + 1, B), jnp.int32)
    q_lengths = jnp.asarray(rng.integers(1, t + 1, B), jnp.int32) if prefill else None
    sinks = jnp.asarray(rng.normal(1.0, 1.5, N), jnp.float32) if with_sinks else None

    def attend(implementation, q, kp, vp):
        return jax.jit(lambda q, kp, vp, table, lengths, q_lengths: sdpagraph.attention(
            q, kp, vp, page_table=table, key_value_seq_lengths=lengths, query_seq_lengths=q_lengths,
            is_causal=True, causal_alignment="bottom_right", sinks=sinks, implementation=implementation))(
            q, kp, vp, table, lengths, q_lengths)

    got = attend("cudnn", q, kp, vp)
    want = attend("xla", *(x.astype(jnp.float32) for x in (q, kp, vp)))
    assert rel_err(got, want) < 2e-2
    answer = sdpagraph.check_support(q, kp, vp, page_table=table, key_value_seq_lengths=lengths,
                                     query_seq_lengths=q_lengths, is_causal=True, causal_alignment="bottom_right")
    assert answer.supported and answer.backend == "cudnn", answer.reason


def test_a_score_mod_with_pages_runs_on_xla_and_says_why():
    rng = np.random.default_rng(3)
    q = jnp.asarray(rng.standard_normal((B, 1, N, H)), jnp.bfloat16)
    kp = vp = jnp.asarray(rng.standard_normal((POOL, PAGE, K, H)), jnp.bfloat16)
    table = jnp.asarray(rng.permutation(POOL)[:B * MAX_PAGES].reshape(B, MAX_PAGES), jnp.int32)
    answer = sdpagraph.check_support(q, kp, vp, page_table=table, score_mod=sdpagraph.mods.softcap(30.0))
    assert not answer.supported and "padding mask" in answer.reason
    out = sdpagraph.attention(q, kp, vp, page_table=table, score_mod=sdpagraph.mods.softcap(30.0))
    dense = [paged.gather(x, table) for x in (kp, vp)]
    want = sdpagraph.attention(q, *dense, score_mod=sdpagraph.mods.softcap(30.0), implementation="xla")
    assert rel_err(out, want) < 1e-2
