"""cuDNN's deterministic backward (`attention(..., deterministic=)`): asked for explicitly or by XLA's
`--xla_gpu_deterministic_ops`, carried by the spec into the backward graph only (one forward graph
serves both), recorded in spec files."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import sdpagraph
from sdpagraph.config import xla_deterministic_ops
from sdpagraph.graphs.builder import graph_identity
from sdpagraph.spec import AttentionSpec
from tests.test_sharding import cudnn_on_cpu  # noqa: F401 (a fixture)

cudnn = pytest.importorskip("cudnn")


@pytest.mark.parametrize("flags, expected", [
    ("", False), ("--xla_gpu_deterministic_ops=true", True), ("--xla_gpu_deterministic_ops", True),
    ("--xla_gpu_deterministic_ops=false", False), ("--a=1 --xla_gpu_deterministic_ops=1 --b", True),
    ("--xla_gpu_deterministic_ops=true --xla_gpu_deterministic_ops=false", False),
    ("--xla_gpu_deterministic_ops_other=true", False)])
def test_the_xla_flag_is_read_as_xla_reads_it(flags, expected):
    assert xla_deterministic_ops({"XLA_FLAGS": flags}) is expected


def test_only_the_backward_graph_is_keyed_and_lowered_with_it():
    from tests.test_builder_cpu import lower_fake, make_spec
    plain, deterministic = make_spec(is_causal=True), make_spec(is_causal=True, deterministic=True)
    assert graph_identity(plain, None, "forward") == graph_identity(deterministic, None, "forward")
    assert graph_identity(plain, None, "backward") != graph_identity(deterministic, None, "backward")
    assert lower_fake(deterministic, None, "backward")[3]["use_deterministic_algorithm"] is True
    assert "use_deterministic_algorithm" not in lower_fake(plain, None, "backward")[3]
    assert "use_deterministic_algorithm" not in lower_fake(deterministic, None, "forward")[3]


@pytest.mark.parametrize("how", ["argument", "xla_flag", "off"])
def test_a_training_call_builds_the_deterministic_backward(rng, how, cudnn_on_cpu, monkeypatch):
    built = cudnn_on_cpu[0]
    if how == "xla_flag":
        monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_deterministic_ops=true")
    length = {"argument": 16, "xla_flag": 24, "off": 32}[how]  # a call of its own: nothing memoized across cases
    q = jnp.asarray(rng.standard_normal((2, length, 4, 8)), jnp.float32)
    kwargs = dict(deterministic=True) if how == "argument" else {}
    grad = jax.grad(lambda q: sdpagraph.attention(q, q, q, is_causal=True, implementation="cudnn", **kwargs).sum())(q)
    want = jax.grad(lambda q: sdpagraph.attention(q, q, q, is_causal=True, implementation="xla").sum())(q)
    np.testing.assert_allclose(grad, want, rtol=2e-5, atol=2e-5)
    assert {(spec.deterministic, d) for spec, _, d in built} == {(how != "off", "forward"), (how != "off", "backward")}
    answer = sdpagraph.check_support(q, q, q, is_causal=True, **kwargs)
    assert answer.supported


def test_bad_values_name_the_argument(rng):
    q = jnp.zeros((1, 4, 2, 8))
    with pytest.raises(TypeError, match="deterministic must be True, False or None"):
        sdpagraph.attention(q, q, q, deterministic="yes")


def test_the_spec_field_is_kept_out_of_older_keys():
    spec = AttentionSpec(1, 8, 8, 2, 2, 8, 8, "bfloat16", 0.3)
    assert "deterministic" not in spec.to_dict()
    assert dataclasses.replace(spec, deterministic=True).to_dict()["deterministic"] is True
    assert "deterministic" in dataclasses.replace(spec, deterministic=True).summary()
