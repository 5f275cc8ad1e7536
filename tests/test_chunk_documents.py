"""Chunked attention on the cuDNN path runs as packed documents cut at the chunk boundaries (the
packed graph computes only the chunks' tiles), with stand-in graphs on the CPU: equal to the XLA
backend's chunk mask, forward and gradients; calls the packed graph cannot take keep the chunk mask."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import sdpagraph
from sdpagraph import mods
from sdpagraph.backends.cudnn import execute as cudnn_execute
from sdpagraph.call import prepare_call
from sdpagraph.graphs.chunk_documents import chunk_documents
from tests.cudnn_standin import stats_backward_executor
from tests.test_sharding import cudnn_on_cpu  # noqa: F401 (a fixture)


@pytest.mark.parametrize("kwargs", [dict(is_causal=True, chunk_size=8), dict(chunk_size=16),
                                    dict(is_causal=True, chunk_size=12, local_window_size=(5, 0)),
                                    dict(is_causal=True, chunk_size=16, causal_alignment="bottom_right")])
def test_chunks_run_as_packed_documents(rng, kwargs, cudnn_on_cpu, monkeypatch):
    monkeypatch.setattr(cudnn_execute, "call_executor", stats_backward_executor)
    built = cudnn_on_cpu[0]
    q = jnp.asarray(rng.standard_normal((2, 40, 4, 8)), jnp.float32)
    k, v = (jnp.asarray(rng.standard_normal((2, 40, 2, 8)), jnp.float32) for _ in range(2))
    d_out = jnp.asarray(rng.standard_normal((2, 40, 4, 8)), jnp.float32)

    def grads(implementation):
        loss = lambda q, k, v: jnp.sum(sdpagraph.attention(q, k, v, implementation=implementation, **kwargs)  # noqa: E731
                                       * d_out)
        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))(q, k, v)

    (got, got_grads), (want, want_grads) = grads("cudnn"), grads("xla")
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    for a, b in zip(got_grads, want_grads):
        np.testing.assert_allclose(a, b, rtol=3e-5, atol=3e-5)
    chunks = -(-40 // kwargs["chunk_size"])
    assert {(s.segments, s.max_segments, s.chunk_size) for s, _, _ in built} == {("self", chunks, None)}


def test_calls_the_packed_graph_cannot_take_keep_the_chunk_mask(rng):
    q = jax.ShapeDtypeStruct((2, 32, 4, 8), jnp.bfloat16)
    plain = prepare_call(q, q, q, is_causal=True, chunk_size=8).spec
    assert chunk_documents(plain, None) == dataclasses.replace(plain, chunk_size=None, segments="self", max_segments=4)
    for kwargs in (dict(score_mod=mods.softcap(5.0)), dict(key_value_seq_lengths=jnp.full((2,), 20, jnp.int32)),
                   dict(bias=jnp.zeros((32, 32), jnp.bfloat16))):
        call = prepare_call(q, q, q, is_causal=True, chunk_size=8, **kwargs)
        assert chunk_documents(call.spec, call.score_mod) is None, kwargs
    assert chunk_documents(prepare_call(q, q, q, chunk_size=32).spec, None) is None  # one chunk: no mask at all
