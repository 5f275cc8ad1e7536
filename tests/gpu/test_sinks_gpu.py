"""Attention sinks on cuDNN (cuDNN's own `sink_token` where its graphs build, else composed from the
logsumexp), against the XLA backend in float32 on the same GPU: out, dq, dk, dv and d sinks.

Skipped without a GPU (conftest.py).
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import sdpagraph
from sdpagraph import mods
from sdpagraph.backends import sinks as sinks_mod

from tests.reference import rel_err
from tests.gpu.test_attention_gpu import random_ids

B, T, N, K, H = 2, 256, 8, 2, 64


def case(name, rng):
    """(T, S, attention kwargs)"""
    lengths = lambda high: jnp.asarray(rng.integers(high // 2, high + 1, B), jnp.int32)  # noqa: E731
    return {
        "causal": (T, T, dict(is_causal=True)),
        "gpt_oss_window": (T, T, dict(is_causal=True, local_window_size=(32, 0))),
        "softcap": (T, T, dict(is_causal=True, score_mod=mods.softcap(30.0))),
        "plain": (T, 384, dict()),
        "padding": (T, T, dict(is_causal=True, query_seq_lengths=lengths(T), key_value_seq_lengths=lengths(T))),
        "segments": (T, T, dict(is_causal=True, segment_ids=random_ids(rng, B, T, 3), max_segments_per_seq=3)),
        "decode": (1, 512, dict()),
    }[name]


@pytest.mark.parametrize("native", [True, False], ids=["native", "composed"])
@pytest.mark.parametrize("name", ["causal", "gpt_oss_window", "softcap", "plain", "padding", "segments", "decode"])
def test_sinks_match_the_xla_backend(name, native, monkeypatch):
    monkeypatch.setenv("SDPAGRAPH_NATIVE_SINKS", "1" if native else "0")
    rng = np.random.default_rng(abs(hash((name, native))) % 2**31)
    t, s, kwargs = case(name, rng)
    x = {"q": rng.standard_normal((B, t, N, H)), "k": rng.standard_normal((B, s, K, H)),
         "v": rng.standard_normal((B, s, K, H)), "sinks": rng.normal(1.0, 1.5, N)}
    bf16 = {key: jnp.asarray(a, jnp.bfloat16 if key != "sinks" else jnp.float32) for key, a in x.items()}
    f32 = {key: a.astype(jnp.float32) for key, a in bf16.items()}
    d_out = jnp.asarray(rng.standard_normal((B, t, N, H)), jnp.float32)

    def grads(implementation, arrays):
        def loss(a):
            out = sdpagraph.attention(a["q"], a["k"], a["v"], sinks=a["sinks"], implementation=implementation,
                                      **kwargs)
            return jnp.sum(out.astype(jnp.float32) * d_out), out
        return jax.jit(jax.grad(loss, has_aux=True))(arrays)

    (got, out), (want, want_out) = grads("cudnn", bf16), grads("xla", f32)
    assert rel_err(out, want_out) < 2e-2, name
    for key in ("q", "k", "v", "sinks"):
        assert rel_err(got[key], want[key]) < 3e-2, (name, key, rel_err(got[key], want[key]))
    answer = sdpagraph.check_support(bf16["q"], bf16["k"], bf16["v"], sinks=bf16["sinks"], **kwargs)
    assert answer.supported and answer.backend == "cudnn", answer.reason
    if not native:
        assert answer.reason.endswith(sinks_mod.COMPOSED)
    print(f"{name} native={native}: {answer.reason.split('; ')[-1]}")


def test_an_inference_call_with_sinks_matches_and_native_sinks_run_the_inference_graph():
    rng = np.random.default_rng(7)
    q, k, v = (jnp.asarray(rng.standard_normal((B, T, N, H)), jnp.bfloat16) for _ in range(3))
    k, v = k[:, :, :K], v[:, :, :K]
    sinks = jnp.asarray(rng.normal(1.0, 1.5, N), jnp.float32)
    got = jax.jit(lambda q: sdpagraph.attention(q, k, v, sinks=sinks, is_causal=True, training=False,
                                                implementation="cudnn"))(q)
    want = sdpagraph.attention(*(a.astype(jnp.float32) for a in (q, k, v)), sinks=sinks, is_causal=True,
                               implementation="xla")
    assert rel_err(got, want) < 2e-2
