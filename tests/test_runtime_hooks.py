"""What attention() does around the backends: recording specs, strict-mode misses."""
import json

import jax.numpy as jnp
import numpy as np
import pytest

import sdpagraph
from sdpagraph import mods
from sdpagraph.cache import CacheMissError
from sdpagraph.jax_api import attention as attention_module


def qkv(seq=16):
    rng = np.random.default_rng()
    return tuple(jnp.asarray(rng.standard_normal((2, seq, 4, 8)), jnp.float32) for _ in range(3))


def test_record_captures_each_distinct_traced_spec(tmp_path):
    path = tmp_path / "specs.json"
    q, k, v = qkv()
    with sdpagraph.record(str(path)):
        sdpagraph.attention(q, k, v, is_causal=True, score_mod=mods.softcap(20.0))
        sdpagraph.attention(q, k, v, is_causal=True, score_mod=mods.softcap(50.0))  # same graph: not a new entry
        sdpagraph.attention(*qkv(32), training=False)
        sdpagraph.attention(q, k, v, implementation="xla")  # an explicit XLA call needs no graph
    entries = json.loads(path.read_text())["entries"]
    assert len(entries) == 2
    assert sorted(tuple(e["directions"]) for e in entries) == [("forward", "backward"), ("inference",)]
    assert any(e["score_mod"] is not None for e in entries)


def test_strict_mode_miss_names_the_spec_and_the_fix(monkeypatch):
    def missing(spec, ir, training):
        raise CacheMissError("no cached graph for spec ... in cache directory /srv/graphs.")

    monkeypatch.setattr(attention_module.cudnn_backend, "support", missing)
    q, k, v = qkv()
    with pytest.raises(CacheMissError, match=r"B2 T16 S16 N4/K4 H8 float32 causal.*sdpagraph precompile"):
        sdpagraph.attention(q, k, v, is_causal=True)
    answer = sdpagraph.check_support(q, k, v, is_causal=True)
    assert not answer.supported and answer.backend == "xla" and "sdpagraph precompile" in answer.reason
    assert sdpagraph.attention(q, k, v, is_causal=True, implementation="xla").shape == q.shape
