"""Context parallelism for sliding windows: the "halo" strategy (`parallel.halo`) on 8 CPU devices.

As in tests/test_context_parallel.py, the first test runs this file again in a subprocess with
`--xla_force_host_platform_device_count=8`, where the device tests run. The XLA backend runs as it
is; the cuDNN path runs with test_sharding's stand-ins for the graph builder and the executor (each
device runs one whole call, differentiated as on one device: no block backward to stand in for).
"""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import sdpagraph
from sdpagraph import mods
from sdpagraph.parallel.context_parallel import choose_strategy
from sdpagraph.spec import AttentionSpec
from tests.devices import has_cpu_devices, make_mesh, on_axis_types, rerun_with_cpu_devices
from tests.test_context_parallel import assert_same, value_and_grads
from tests.test_sharding import cudnn_on_cpu, random_ids  # noqa: F401 (a fixture)

DEVICES = 8
HERE_WITH_DEVICES = has_cpu_devices(DEVICES)
needs_devices = pytest.mark.skipif(not HERE_WITH_DEVICES, reason=f"runs in the {DEVICES}-device subprocess")
B, T, N, H = 2, 64, 4, 8


def test_in_a_process_with_eight_cpu_devices():
    if HERE_WITH_DEVICES:
        pytest.skip("this process has the devices: the tests below run here")
    rerun_with_cpu_devices(__file__, DEVICES, timeout=1200)


def case(name):
    """(attention kwargs, K): windows against the shard of T / cp tokens (16 at cp=4)."""
    slopes = np.linspace(0.1, 1.0, N).astype(np.float32)
    return {
        "narrow": (dict(is_causal=True, local_window_size=(5, 0)), N),  # within one shard
        "one_shard": (dict(is_causal=True, local_window_size=(16, 0)), N),
        "wide": (dict(is_causal=True, local_window_size=(37, 0)), N),  # spans 3 shards at cp=4
        "two_sided": (dict(local_window_size=(6, 21)), N),
        "gqa": (dict(is_causal=True, local_window_size=(20, 0)), 2),
        "softcap": (dict(is_causal=True, local_window_size=(9, 0), score_mod=mods.softcap(3.0)), N),
        "alibi": (dict(is_causal=True, local_window_size=(9, 0), score_mod=mods.alibi(slopes)), 2),
        "relative_jnp": (dict(local_window_size=(7, 18),
                              score_mod=lambda s, b, h, q, kv: s - 0.05 * jnp.abs(q - kv).astype(s.dtype)), N),
    }[name]


def run(name, cp, axis_type, impl, strategy="halo", seed=0):
    """(the context-parallel step's value and gradients, the one-device XLA reference's, the HLO)."""
    kwargs, K = case(name)
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B, T, N, H)).astype(np.float32)
    k, v = (rng.standard_normal((B, T, K, H)).astype(np.float32) for _ in range(2))
    cot = rng.standard_normal((B, T, N, H)).astype(np.float32)
    ref = value_and_grads(lambda q, k, v: sdpagraph.attention(q, k, v, implementation="xla", **kwargs))(q, k, v, cot)
    m = make_mesh((cp,), ("cp",), axis_type)
    with jax.set_mesh(m):
        step = jax.jit(value_and_grads(lambda q, k, v: sdpagraph.attention(
            q, k, v, implementation=impl, context_parallel_axis="cp", context_parallel_strategy=strategy, **kwargs)))
        args = tuple(jax.device_put(x, NamedSharding(m, P(None, "cp"))) for x in (q, k, v, cot))
        compiled = step.lower(*args).compile()
        ours = compiled(*args)
        for x, like in zip((ours[0][1], *ours[1]), args):
            assert x.sharding.is_equivalent_to(like.sharding, 4), (x.sharding, like.sharding)
    return ours, ref, compiled.as_text()


def assert_no_gather(hlo):
    assert "collective-permute" in hlo
    assert not re.search(r"\ball-gather(?:-start)?\(", hlo), "the halo gathers nothing"
    assert "all-to-all" not in hlo


@needs_devices
@pytest.mark.parametrize("name, cp, axis_type", on_axis_types(
    [("narrow", 4), ("one_shard", 4), ("wide", 4), ("wide", 2), ("two_sided", 4), ("two_sided", 8), ("gqa", 8),
     ("softcap", 2), ("alibi", 4), ("relative_jnp", 8)],
    explicit=[("wide", 4), ("two_sided", 8)]))
def test_halo_on_xla_equals_one_device(name, cp, axis_type):
    ours, ref, hlo = run(name, cp, axis_type, "xla")
    assert_same(ours, ref)
    assert_no_gather(hlo)


@needs_devices
@pytest.mark.parametrize("name, cp, axis_type", on_axis_types(
    [("narrow", 4), ("wide", 4), ("two_sided", 8), ("gqa", 2), ("softcap", 4), ("alibi", 8)],
    explicit=[("wide", 4)]))
def test_halo_on_the_cudnn_path(name, cp, axis_type, cudnn_on_cpu):
    ours, ref, hlo = run(name, cp, axis_type, "cudnn")
    assert_same(ours, ref, tol=3e-5)
    assert_no_gather(hlo)
    # One graph per case of halo lengths (the first / last devices have shorter halos), bottom-right aligned.
    kwargs, _ = case(name)
    left, right = kwargs["local_window_size"]
    right = 0 if kwargs.get("is_causal") else right
    block = T // cp
    cases = {(min(left, d * block, T - block), min(right, (cp - 1 - d) * block)) for d in range(cp)}
    built = {(s.q_len, s.kv_len, s.causal_alignment) for s, _, _ in cudnn_on_cpu[0]}
    assert built == {(block, hl + block + hr, "bottom_right") for hl, hr in cases}, built


@needs_devices
def test_check_support_names_the_halo_and_its_block_backend(cudnn_on_cpu):
    q = jax.ShapeDtypeStruct((B, T, N, H), jnp.float32)
    with jax.set_mesh(make_mesh((4,), ("cp",))):
        answer = sdpagraph.check_support(q, q, q, is_causal=True, local_window_size=(9, 0),
                                         context_parallel_axis="cp", context_parallel_strategy="halo")
        assert (answer.supported, answer.backend) == (True, "cudnn"), answer
        assert "halo over 'cp', cp=4" in answer.reason and "cuDNN" in answer.reason
        answer = sdpagraph.check_support(q, q, q, is_causal=True, local_window_size=(9, 0), implementation="xla",
                                         context_parallel_axis="cp", context_parallel_strategy="halo")
        assert answer.backend == "xla" and "halo over 'cp'" in answer.reason, answer


def test_auto_takes_the_halo_only_when_asked():
    spec = lambda t, window, causal=True, k=16: AttentionSpec(  # noqa: E731
        1, t, t, 16, k, 128, 128, "bfloat16", 0.1, is_causal=causal, window=window)
    assert choose_strategy(spec(32768, (1024, 0)), 2, "auto") == "all_to_all"  # not yet measured on GPUs
    assert choose_strategy(spec(32768, (1024, 0)), 2, "halo") == "halo"
    assert choose_strategy(spec(32768, (1024, 0)), 2, "ring") == "ring"


@needs_devices
def test_halo_errors_name_the_argument():
    q = jnp.zeros((B, T, N, H), jnp.float32)
    m = make_mesh((4,), ("cp",))
    halo = dict(context_parallel_axis="cp", context_parallel_strategy="halo", mesh=m)
    prefix = r"context_parallel_axis='cp': context_parallel_strategy='halo' "
    with pytest.raises(ValueError, match=prefix + r"needs a sliding window .*local_window_size=\(-1, -1\)"):
        sdpagraph.attention(q, q, q, is_causal=True, **halo)
    with pytest.raises(ValueError, match=prefix + r"needs a sliding window .*local_window_size=\(4, -1\)"):
        sdpagraph.attention(q, q, q, local_window_size=(4, -1), **halo)
    with pytest.raises(ValueError, match=prefix + r"takes the sequence in natural order \(load_balanced=False\)"):
        sdpagraph.attention(q, q, q, is_causal=True, local_window_size=(4, 0), load_balanced=True, **halo)
    with pytest.raises(ValueError, match=prefix + "does not take packed segment_ids"):
        sdpagraph.attention(q, q, q, is_causal=True, local_window_size=(4, 0),
                            segment_ids=random_ids(np.random.default_rng(0), B, T, 3), **halo)
    with pytest.raises(ValueError, match=prefix + "does not take chunk_size"):
        sdpagraph.attention(q, q, q, is_causal=True, local_window_size=(4, 0), chunk_size=8, **halo)
    with pytest.raises(ValueError, match=prefix + r"needs self-attention lengths: .*T=64 != .*S=32"):
        sdpagraph.attention(q, q[:, :32], q[:, :32], local_window_size=(4, 4), **halo)
    with pytest.raises(ValueError, match="context_parallel_axis='cp': context parallelism does not take bias"):
        sdpagraph.attention(q, q, q, jnp.ones((T, T)), is_causal=True, local_window_size=(4, 0), **halo)


@needs_devices
def test_halo_with_a_batch_axis_and_inside_shard_map():
    kwargs, K = case("two_sided")
    rng = np.random.default_rng(3)
    q = rng.standard_normal((B, T, N, H)).astype(np.float32)
    k, v = (rng.standard_normal((B, T, K, H)).astype(np.float32) for _ in range(2))
    cot = rng.standard_normal((B, T, N, H)).astype(np.float32)
    ref = value_and_grads(lambda q, k, v: sdpagraph.attention(q, k, v, implementation="xla", **kwargs))(q, k, v, cot)
    m = make_mesh((2, 4), ("data", "cp"))
    spec = P("data", "cp")
    args = tuple(jax.device_put(x, NamedSharding(m, spec)) for x in (q, k, v, cot))

    def attn(q, k, v, mesh=None):
        return sdpagraph.attention(q, k, v, context_parallel_axis="cp", context_parallel_strategy="halo", mesh=mesh,
                                   **kwargs)

    assert_same(jax.jit(value_and_grads(lambda q, k, v: attn(q, k, v, m)))(*args), ref)  # the batch over "data"
    inner = jax.shard_map(attn, mesh=m, in_specs=spec, out_specs=spec)  # q, k, v are the local blocks
    assert_same(jax.jit(value_and_grads(inner))(*args), ref)
