"""Packed documents on bins on a GPU (`graphs.binning`, `backends.cudnn.bins.packed`): cuDNN's dense twin on
the bins, with the packer as a Triton program, against the XLA backend on the whole rows: outputs and
gradients on fresh random inputs, and documents that do not fit running unbinned."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import sdpagraph
from sdpagraph import mods
from sdpagraph.graphs.binning import bin_plan
from sdpagraph.backends.cudnn.bins import packed as packed_bins
from sdpagraph.call import prepare_call

from tests.reference import rel_err
from tests.test_packed_bins import random_documents

N, H = 8, 128


def values_and_grads(impl, q, k, v, ids, hint, score_mod, do):
    def loss(q, k, v):
        out = sdpagraph.attention(q, k, v, is_causal=True, segment_ids=ids, score_mod=score_mod,
                                  max_seqlen_kv=hint, implementation=impl)
        return jnp.sum(out.astype(jnp.float32) * do), out
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)


# hint None: bins of a quarter of a row (1024 tokens here); documents past that run unbinned
@pytest.mark.parametrize("low,high,hint,fits", [(64, 1024, 1024, True), (40, 300, 512, True),
                                                (520, 600, 1024, False), (64, 1000, None, True),
                                                (900, 1400, None, False)])
def test_bins_match_xla(low, high, hint, fits, monkeypatch):
    calls = []
    real = packed_bins.attention
    monkeypatch.setattr(packed_bins, "attention", lambda *a, **k: calls.append(1) or real(*a, **k))
    rng = np.random.default_rng()
    ids = jnp.asarray(random_documents(rng, 2, 4096, low, high, padding=100))
    q, k, v, do = (jnp.asarray(rng.standard_normal((2, 4096, N, H)), jnp.bfloat16) for _ in range(4))
    score_mod = mods.softcap(30.0)
    (_, out), grads = values_and_grads("cudnn", q, k, v, ids, hint, score_mod, do.astype(jnp.float32))
    assert calls == [1]
    call = prepare_call(q, k, v, is_causal=True, segment_ids=ids, score_mod=score_mod, max_seqlen_kv=hint)
    layout = packed_bins.lay_out(ids, bin_plan(call.spec, call.score_mod), call.spec.max_segments, False)
    assert bool(layout.fits) == fits
    (_, want), want_grads = values_and_grads("xla", q, k, v, ids, hint, score_mod, do.astype(jnp.float32))
    errors = [rel_err(out, want)] + [rel_err(a, b) for a, b in zip(grads, want_grads)]
    assert all(np.isfinite(errors)) and max(errors) < 2e-2, errors
    assert np.all(np.asarray(out[:, -100:]) == 0)  # the padding

