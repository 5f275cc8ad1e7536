"""FP8 calls in deployment: `record` writes the specs of FP8 inference and training calls (their FP8
dtype), and a spec file holding them reads back, so `precompile` and strict starts cover them."""
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import sdpagraph
from sdpagraph import fp8
from sdpagraph.deploy.specfile import load_specs
from tests.test_sharding import cudnn_on_cpu  # noqa: F401 (a fixture)


def test_recorded_fp8_calls_read_back(rng, tmp_path, cudnn_on_cpu):
    q = jnp.asarray(rng.standard_normal((1, 32, 2, 128)), jnp.bfloat16)
    path = tmp_path / "specs.json"
    with sdpagraph.record(str(path)):
        q8 = q.astype(jnp.float8_e4m3fn)
        fp8.attention(q8, q8, q8, is_causal=True)
        jax.grad(lambda q: fp8.quantized_attention(q, q, q, training=True, implementation="cudnn")
                 .astype(jnp.float32).sum())(q)
    entries = load_specs(path)
    found = {(entry.spec.dtype, entry.spec.is_causal, entry.directions) for entry in entries}
    assert found == {("float8_e4m3fn", True, ("inference",)), ("float8_e4m3fn", False, ("forward", "backward"))}
    assert np.all([entry.spec.is_fp8 for entry in entries])


def test_fp8_calls_are_recorded_where_cuDNN_cannot_run_them(rng, tmp_path):
    q8 = jnp.asarray(rng.standard_normal((1, 32, 2, 128)), jnp.float32).astype(jnp.float8_e4m3fn)
    path = tmp_path / "specs.json"
    with sdpagraph.record(str(path)):  # no GPU here: the call runs dequantized (that bf16 call is recorded too)
        fp8.attention(q8, q8, q8)
    assert "float8_e4m3fn" in [entry.spec.dtype for entry in load_specs(path)]


def test_the_spec_file_reader_refuses_fp8_specs_sdpagraph_never_makes(rng, tmp_path, cudnn_on_cpu):
    q8 = jnp.asarray(rng.standard_normal((1, 32, 2, 128)), jnp.float32).astype(jnp.float8_e4m3fn)
    path = tmp_path / "specs.json"
    with sdpagraph.record(str(path)):
        fp8.attention(q8, q8, q8, is_causal=True)
    document = json.loads(path.read_text())
    (entry,) = [entry for entry in document["entries"] if entry["spec"]["dtype"] == "float8_e4m3fn"]
    entry["spec"]["window"] = [16, 0]
    path.write_text(json.dumps(document))
    with pytest.raises(Exception, match="takes causal and sequence lengths only.*window"):
        load_specs(path)
