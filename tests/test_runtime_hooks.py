"""What attention() does around the backends: recording specs, strict-mode misses."""
import json

import jax.numpy as jnp
import numpy as np
import pytest

import sdpagraph
from sdpagraph import mods
from sdpagraph.cache import CacheMissError
from sdpagraph.backends.cudnn import execute as cudnn_execute


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
    def missing(spec, ir, training, verify=None):
        raise CacheMissError("no cached graph for spec ... in cache directory /srv/graphs.")

    monkeypatch.setattr(cudnn_execute, "support", missing)
    q, k, v = qkv()
    with pytest.raises(CacheMissError, match=r"B2 T16 S16 N4/K4 H8 float32 causal.*sdpagraph precompile"):
        sdpagraph.attention(q, k, v, is_causal=True)
    answer = sdpagraph.check_support(q, k, v, is_causal=True)
    assert not answer.supported and answer.backend == "xla" and "sdpagraph precompile" in answer.reason
    assert sdpagraph.attention(q, k, v, is_causal=True, implementation="xla").shape == q.shape


def test_import_is_light_and_recording_needs_only_the_public_attention(tmp_path):
    """`import sdpagraph` loads no jax (the CLI's cache and --version start fast); reaching
    `sdpagraph.attention` loads the spec recorder too, so SDPAGRAPH_RECORD sees every call."""
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    path = tmp_path / "recorded.json"
    script = (
        "import sys, sdpagraph\n"
        "assert 'jax' not in sys.modules, 'import sdpagraph imported jax'\n"
        "import jax.numpy as jnp, numpy as np\n"
        "q = jnp.asarray(np.random.default_rng().standard_normal((1, 8, 2, 8)), jnp.float32)\n"
        "sdpagraph.attention(q, q, q, is_causal=True)\n"
    )
    env = dict(os.environ, SDPAGRAPH_RECORD=str(path), PYTHONPATH=root)
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert len(json.loads(path.read_text())["entries"]) == 1
