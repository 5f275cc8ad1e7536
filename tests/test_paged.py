"""Paged K/V (`attention(q, k_pages, v_pages, page_table=..., key_value_seq_lengths=...)`): decode,
multi-token decode and chunked prefill against a float64 NumPy reference on the gathered keys; the
cuDNN path's plumbing with stand-in graphs (operands, one graph for every table and length under
jit); validation naming the argument; inference only."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import sdpagraph
from sdpagraph.errors import Unsupported
from sdpagraph.graphs.lowering import _check_lowerable
from sdpagraph.graphs.operands import PAGE_TABLES, graph_io
from sdpagraph.paged import PagedGradientError, prepare_paged_call
from tests.test_sharding import cudnn_on_cpu  # noqa: F401 (a fixture)

PAGE, POOL = 4, 24


def reference(q, k_pages, v_pages, table, lengths, *, q_lengths=None, causal=True, sinks=None):
    """float64 attention of each sequence's query block, aligned to the end of its keys (bottom right)."""
    q, k_pages, v_pages = (np.asarray(x, np.float64) for x in (q, k_pages, v_pages))
    b, t, n, h = q.shape
    group = n // k_pages.shape[2]
    out = np.zeros((b, t, n, v_pages.shape[-1]))
    for row in range(b):
        keys = k_pages[np.asarray(table)[row]].reshape(-1, k_pages.shape[2], h)[:lengths[row]]
        values = v_pages[np.asarray(table)[row]].reshape(-1, v_pages.shape[2], v_pages.shape[-1])[:lengths[row]]
        kk, vv = np.repeat(keys, group, axis=1), np.repeat(values, group, axis=1)
        used = t if q_lengths is None else q_lengths[row]
        for i in range(used):
            last = lengths[row] - used + i if causal else lengths[row] - 1  # bottom-right diagonal
            logits = np.einsum("nh,snh->ns", q[row, i], kk[:last + 1]) / np.sqrt(h)
            top = logits.max(-1, keepdims=True)
            if sinks is not None:
                top = np.maximum(top, np.asarray(sinks, np.float64)[:, None])
            weights = np.exp(logits - top)
            total = weights.sum(-1, keepdims=True)
            if sinks is not None:
                total = total + np.exp(np.asarray(sinks, np.float64)[:, None] - top)
            out[row, i] = np.einsum("ns,snh->nh", weights / total, vv[:last + 1])
    return out


def paged_inputs(rng, b=3, t=1, n=8, k=2, h=16, max_pages=5):
    f32 = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)  # noqa: E731
    table = jnp.asarray(rng.permutation(POOL)[:b * max_pages].reshape(b, max_pages), jnp.int32)
    lengths = jnp.asarray(rng.integers(t, max_pages * PAGE + 1, b), jnp.int32)
    return f32(b, t, n, h), f32(POOL, PAGE, k, h), f32(POOL, PAGE, k, h), table, lengths


@pytest.mark.parametrize("t, prefill", [(1, False), (4, False), (8, True)])
def test_decode_multi_token_and_chunked_prefill_match_the_reference(rng, t, prefill):
    q, kp, vp, table, lengths = paged_inputs(rng, t=t)
    q_lengths = jnp.asarray(rng.integers(1, t + 1, 3), jnp.int32) if prefill else None
    sinks = jnp.asarray(rng.standard_normal(8), jnp.float32)
    run = jax.jit(lambda q, table, lengths, q_lengths, sinks: sdpagraph.attention(
        q, kp, vp, page_table=table, key_value_seq_lengths=lengths, query_seq_lengths=q_lengths, is_causal=True,
        causal_alignment="bottom_right", sinks=sinks))
    for with_sinks in (False, True):
        out = np.asarray(run(q, table, lengths, q_lengths, sinks if with_sinks else None))
        want = reference(q, kp, vp, table, np.asarray(lengths), sinks=sinks if with_sinks else None,
                         q_lengths=None if q_lengths is None else np.asarray(q_lengths))
        if q_lengths is not None:  # rows past a sequence's query length give 0
            for row, used in enumerate(np.asarray(q_lengths)):
                assert np.all(out[row, used:] == 0)
        np.testing.assert_allclose(out, want, rtol=2e-5, atol=2e-5)


def test_decode_is_not_causal_and_equals_dense_attention_on_the_gathered_keys(rng):
    q, kp, vp, table, lengths = paged_inputs(rng)
    call = prepare_paged_call(q, kp, vp, table, is_causal=True, causal_alignment="bottom_right",
                                              key_value_seq_lengths=lengths)
    assert not call.spec.is_causal and call.spec.paged == (POOL, PAGE) and call.spec.kv_len == 5 * PAGE
    dense = [np.asarray(x)[np.asarray(table)].reshape(3, 5 * PAGE, 2, 16) for x in (kp, vp)]
    want = jax.nn.dot_product_attention(q, *map(jnp.asarray, dense), key_value_seq_lengths=lengths,
                                        implementation="xla")
    got = sdpagraph.attention(q, kp, vp, page_table=table, key_value_seq_lengths=lengths)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)


def test_bad_pages_tables_and_lengths_name_the_argument(rng):
    q, kp, vp, table, lengths = paged_inputs(rng)
    attend = lambda **kw: sdpagraph.attention(**{**dict(query=q, key=kp, value=vp, page_table=table,  # noqa: E731
                                                        key_value_seq_lengths=lengths), **kw})
    with pytest.raises(ValueError, match=r"page_table entries must lie in \[0, num_pages\) = \[0, 24\)"):
        attend(page_table=table.at[1, 2].set(POOL))
    with pytest.raises(ValueError, match=r"key_value_seq_lengths must lie in \[0, 20\]"):
        attend(key_value_seq_lengths=lengths.at[0].set(21))
    with pytest.raises(ValueError, match=r"page_table must have shape \(B, max_pages\) = \(3, max_pages >= 1\)"):
        attend(page_table=table[:2])
    with pytest.raises(TypeError, match="page_table must be an int32 array"):
        attend(page_table=table.astype(jnp.float32))
    with pytest.raises(ValueError, match="key and value pools must share"):
        attend(value=vp[:-1])
    with pytest.raises(ValueError, match="page pools of shape"):
        attend(key=kp[0])
    with pytest.raises(ValueError, match="segment_ids cannot be combined with page_table"):
        attend(segment_ids=jnp.ones((3, 1), jnp.int32))
    with pytest.raises(ValueError, match="cannot be combined with context_parallel_axis"):
        attend(context_parallel_axis="cp")


def test_paged_attention_is_inference_only(rng):
    q, kp, vp, table, lengths = paged_inputs(rng)
    with pytest.raises(PagedGradientError, match="inference-only"):
        jax.grad(lambda q: sdpagraph.attention(q, kp, vp, page_table=table, key_value_seq_lengths=lengths).sum())(q)


def test_new_tables_and_lengths_reuse_the_trace_and_the_graph(rng, cudnn_on_cpu):
    built = cudnn_on_cpu[0]
    q, kp, vp, table, lengths = paged_inputs(rng, t=4)
    traces = []

    @jax.jit
    def step(q, kp, vp, table, lengths):
        traces.append(1)
        return sdpagraph.attention(q, kp, vp, page_table=table, key_value_seq_lengths=lengths, is_causal=True,
                                   causal_alignment="bottom_right", implementation="cudnn")

    for _ in range(3):
        out = step(q, kp, vp, table, lengths)
        want = reference(q, kp, vp, table, np.asarray(lengths))
        np.testing.assert_allclose(out, want, rtol=2e-5, atol=2e-5)
        table = jnp.asarray(rng.permutation(POOL)[:15].reshape(3, 5), jnp.int32)
        lengths = jnp.asarray(rng.integers(4, 21, 3), jnp.int32)
    assert len(traces) == 1
    # T = 4 new tokens: one maskless call of the 4 tokens x 4 query heads per key/value head, folded
    [(spec, _, direction)] = built
    assert (spec.paged, spec.q_len, spec.num_heads, spec.is_causal, direction) == ((POOL, PAGE), 16, 2, False, "forward")
    operands, results = graph_io(spec, None, "forward")
    assert set(PAGE_TABLES) | {"seq_len_q", "seq_len_kv"} <= set(operands) and results == ("o", "stats")


@pytest.mark.parametrize("t", [1, 2, 5, 16])
def test_multi_token_decode_on_the_cudnn_path_matches_the_reference(rng, t, cudnn_on_cpu):
    """The folded prefix call and the tail on XLA, merged (T >= 2), or the plain decode graph (T = 1);
    lengths down to T (a one-key prefix)."""
    built = cudnn_on_cpu[0]
    q, kp, vp, table, lengths = paged_inputs(rng, t=t)
    lengths = lengths.at[0].set(t)
    out = jax.jit(lambda q, table, lengths: sdpagraph.attention(
        q, kp, vp, page_table=table, key_value_seq_lengths=lengths, is_causal=True,
        causal_alignment="bottom_right", implementation="cudnn"))(q, table, lengths)
    np.testing.assert_allclose(out, reference(q, kp, vp, table, np.asarray(lengths)), rtol=2e-5, atol=2e-5)
    assert {d for _, _, d in built} == ({"inference"} if t == 1 else {"forward"})


def test_check_support_answers_for_paged_calls(rng, cudnn_on_cpu):
    q, kp, vp, table, lengths = paged_inputs(rng)
    answer = sdpagraph.check_support(q, kp, vp, page_table=table, key_value_seq_lengths=lengths,
                                     implementation="cudnn")
    assert answer.supported and answer.backend == "cudnn"  # the stand-in builds; the real lowering refuses:
    call = prepare_paged_call(q, kp, vp, table, key_value_seq_lengths=lengths,
                                              score_mod=sdpagraph.mods.softcap(30.0))
    with pytest.raises(Unsupported, match="padding mask"):
        _check_lowerable(call.spec, call.score_mod, "inference")
    with pytest.raises(Unsupported, match="inference-only"):
        _check_lowerable(call.spec, None, "backward")


@pytest.mark.parametrize("native", ["1", "0"])
def test_a_multi_token_decode_with_sinks_on_the_cudnn_path_keeps_them(rng, native, cudnn_on_cpu, monkeypatch):
    """The fold's merged logsumexp is the whole row's: the sinks join after it (cuDNN's own sinks would
    take the call off its folded form, so they are composed there)."""
    monkeypatch.setenv("SDPAGRAPH_NATIVE_SINKS", native)
    q, kp, vp, table, lengths = paged_inputs(rng, t=4)
    sinks = jnp.asarray(rng.standard_normal(8), jnp.float32)
    out = sdpagraph.attention(q, kp, vp, page_table=table, key_value_seq_lengths=lengths, is_causal=True,
                              causal_alignment="bottom_right", sinks=sinks, implementation="cudnn")
    want = reference(q, kp, vp, table, np.asarray(lengths), sinks=sinks)
    np.testing.assert_allclose(out, want, rtol=2e-5, atol=2e-5)
    assert all(not spec.sinks for spec, _, _ in cudnn_on_cpu[0])


def test_sequences_shorter_than_the_new_tokens_see_only_the_keys_they_have(rng, cudnn_on_cpu):
    q, kp, vp, table, _ = paged_inputs(rng, t=4)
    lengths = jnp.asarray([2, 9, 1], jnp.int32)
    attend = lambda implementation: sdpagraph.attention(  # noqa: E731
        q, kp, vp, page_table=table, key_value_seq_lengths=lengths, is_causal=True, causal_alignment="bottom_right",
        implementation=implementation)
    np.testing.assert_allclose(attend("cudnn"), attend("xla"), rtol=2e-5, atol=2e-5)
