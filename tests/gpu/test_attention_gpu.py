"""sdpagraph.attention on cuDNN through the FFI executor, against the XLA backend on the same GPU.

Skipped without a GPU (conftest.py). Covers the JAX path end to end: jit, grad (query,
key, value, bias), remat, the inference graph, zero rebuilds after check_support, 16 threads,
the executor's host timing, a fresh process restored from JAX's persistent compilation cache,
command buffers, and the HLO bytes one call site adds.
"""
import collections
import functools
import json
import os
import re
import subprocess
import sys
import textwrap
import time
import threading

import numpy as np
import pytest

import jax
import jax.numpy as jnp

import sdpagraph
from sdpagraph import ffi, mods

from tests.reference import rel_err

pytestmark = pytest.mark.usefixtures("private_cache")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def random_ids(rng, B, T, max_segments):
    ids = np.zeros((B, T), np.int32)
    for b in range(B):
        cuts = np.sort(rng.choice(np.arange(1, T - 8), max_segments - 1, replace=False))
        bounds = [0, *cuts, T - int(rng.integers(0, 8))]
        for m in range(max_segments):
            ids[b, bounds[m]:bounds[m + 1]] = m + 1
    return jnp.asarray(ids)


def segments_with_hint(rng, B, T, max_segments, **kwargs):
    """Packed segments and `max_seqlen_kv` = the longest of them (about T / 3 with 6 segments)."""
    ids = random_ids(rng, B, T, max_segments)
    runs = np.asarray(ids)
    longest = max(int(np.sum(row == m)) for row in runs for m in range(1, max_segments + 1))
    return dict(segment_ids=ids, max_segments_per_seq=max_segments, max_seqlen_kv=longest, **kwargs)


def case_kwargs(name, rng, B, T, S, N):
    slopes = rng.random(N).astype(np.float32) * 0.2
    table = rng.standard_normal((N, 9)).astype(np.float32)
    return {
        "plain": dict(),
        "causal": dict(is_causal=True),
        "bottom_right": dict(is_causal=True, causal_alignment="bottom_right"),
        "window_left": dict(local_window_size=(64, 0)),
        "window_two_sided": dict(local_window_size=(32, 32)),
        "padding": dict(is_causal=True, query_seq_lengths=jnp.asarray(rng.integers(T // 2, T + 1, B), jnp.int32),
                        key_value_seq_lengths=jnp.asarray(rng.integers(S // 2, S + 1, B), jnp.int32)),
        "padding_softcap": dict(is_causal=True, score_mod=mods.softcap(30.0),
                                query_seq_lengths=jnp.asarray(rng.integers(T // 2, T + 1, B), jnp.int32),
                                key_value_seq_lengths=jnp.asarray(rng.integers(S // 2, S + 1, B), jnp.int32)),
        "kv_padding_softcap": dict(is_causal=True, score_mod=mods.softcap(30.0),
                                   key_value_seq_lengths=jnp.asarray(rng.integers(S // 2, S + 1, B), jnp.int32)),
        "q_padding_softcap": dict(is_causal=True, score_mod=mods.softcap(30.0),
                                  query_seq_lengths=jnp.asarray(rng.integers(T // 2, T + 1, B), jnp.int32)),
        "padding_softcap_noncausal": dict(score_mod=mods.softcap(30.0),
                                          query_seq_lengths=jnp.asarray(rng.integers(T // 2, T + 1, B), jnp.int32),
                                          key_value_seq_lengths=jnp.asarray(rng.integers(S // 2, S + 1, B), jnp.int32)),
        "segments": dict(is_causal=True, segment_ids=random_ids(rng, B, T, 3), max_segments_per_seq=3),
        # Packed segments the THD layout cannot take run as a dense graph masking by segment bounds.
        "segments_softcap": dict(is_causal=True, score_mod=mods.softcap(30.0), segment_ids=random_ids(rng, B, T, 3),
                                 max_segments_per_seq=3),
        # A length hint leaves the dense graph as it is (a window from it was 2x slower: docs/results).
        "segments_softcap_length_hint": segments_with_hint(rng, B, T, 6, is_causal=True, score_mod=mods.softcap(30.0)),
        "segments_mask_window_dropped": dict(local_window_size=(64, 0), mask=boolean_mask(rng, B, 1, T, S),
                                             segment_ids=random_ids(rng, B, T, 3), max_segments_per_seq=2),
        "chunk": dict(is_causal=True, chunk_size=128),
        "softcap_causal": dict(is_causal=True, score_mod=mods.softcap(30.0)),
        "alibi": dict(score_mod=mods.compose(mods.alibi(slopes), mods.causal())),
        "relative_bias": dict(score_mod=mods.relative_position_bias(table, 4)),
        "prefix_lm": dict(score_mod=mods.prefix_lm(100)),
        "sliding_window_mod": dict(score_mod=mods.sliding_window(64, 0)),
        "chunked_mod": dict(score_mod=mods.compose(mods.chunked(128), mods.causal())),
        "mask": dict(mask=boolean_mask(rng, B, 1, T, S)),
        "key_bias": dict(bias=jnp.asarray(rng.standard_normal((B, 1, 1, S)), jnp.bfloat16)),
        "mask_softcap": dict(mask=boolean_mask(rng, B, 1, T, S), score_mod=mods.softcap(30.0)),
        "mask_bias": dict(mask=boolean_mask(rng, B, 1, T, S),
                          bias=jnp.asarray(rng.standard_normal((1, N, T, S)), jnp.bfloat16)),
    }[name]


def boolean_mask(rng, *shape):
    """Random keep/drop with one query row fully masked (cuDNN must give 0 there, as XLA does)."""
    mask = rng.random(shape) < 0.7
    mask[..., 5, :] = False
    return jnp.asarray(mask)


CASES = ["plain", "causal", "bottom_right", "window_left", "window_two_sided", "padding", "segments", "chunk",
         "softcap_causal", "alibi", "relative_bias", "prefix_lm", "sliding_window_mod", "chunked_mod", "mask",
         "mask_softcap", "mask_bias", "key_bias", "padding_softcap",
         "kv_padding_softcap", "q_padding_softcap", "padding_softcap_noncausal", "segments_softcap",
         "segments_softcap_length_hint", "segments_mask_window_dropped"]
# Every case in bf16 with 8/8 heads; head layouts and fp16 where they change the graph most.
GRID = ([(name, (8, 8), "bfloat16") for name in CASES]
        + [(name, heads, "bfloat16") for name in ("causal", "padding", "softcap_causal") for heads in ((8, 2), (8, 1))]
        + [(name, (8, 2), "float16") for name in ("causal", "softcap_causal")]
        + [("segments_softcap", (8, 2), "bfloat16")])


@pytest.mark.parametrize("name,heads,dtype", GRID, ids=[f"{n}-{h[0]}/{h[1]}-{d}" for n, h, d in GRID])
def test_cudnn_matches_xla_forward_and_grads(name, heads, dtype, report, monkeypatch):
    if name.endswith("_dropped"):  # segments past max_segments_per_seq on purpose: switch the overflow check off
        monkeypatch.setenv("SDPAGRAPH_CHECK_SEGMENTS", "0")
    rng = np.random.default_rng()
    B, T, S, H = 3, 384, 512 if name == "bottom_right" else 384, 128
    N, K = heads
    q, k, v, do = (jnp.asarray(rng.standard_normal(shape), dtype) for shape in
                   ((B, T, N, H), (B, S, K, H), (B, S, K, H), (B, T, N, H)))
    kwargs = case_kwargs(name, rng, B, T, S, N)
    support = sdpagraph.check_support(q, k, v, **kwargs)
    if not support.supported:
        report(f"unsupported {name} {heads} {dtype}: {support.reason}")
        pytest.xfail(support.reason)

    def loss(impl, q, k, v):
        out = sdpagraph.attention(q, k, v, implementation=impl, **kwargs)
        return jnp.sum(out.astype(jnp.float32) * do.astype(jnp.float32)), out

    grad = lambda impl: jax.jit(jax.value_and_grad(functools.partial(loss, impl), argnums=(0, 1, 2), has_aux=True))
    (_, out), grads = grad("cudnn")(q, k, v)
    (_, out_ref), grads_ref = grad("xla")(q, k, v)
    errors = [rel_err(out, out_ref)] + [rel_err(a, b) for a, b in zip(grads, grads_ref)]
    report(f"{name:<18} {heads} {dtype}: rel err out {errors[0]:.1e} dq {errors[1]:.1e} dk {errors[2]:.1e} dv {errors[3]:.1e}")
    assert all(np.isfinite(errors)) and max(errors) < 2e-2, errors


def test_bias_gradient_and_inference_graph():
    rng = np.random.default_rng()
    B, T, N, H = 2, 256, 8, 64
    q, k, v = (jnp.asarray(rng.standard_normal((B, T, N, H)), jnp.bfloat16) for _ in range(3))
    bias = jnp.asarray(rng.standard_normal((1, N, T, T)), jnp.bfloat16)

    def loss(impl, q, bias):
        return jnp.sum(sdpagraph.attention(q, k, v, bias, implementation=impl).astype(jnp.float32) ** 2)

    ours = jax.jit(jax.grad(functools.partial(loss, "cudnn"), argnums=(0, 1)))(q, bias)
    ref = jax.jit(jax.grad(functools.partial(loss, "xla"), argnums=(0, 1)))(q, bias)
    assert rel_err(ours[0], ref[0]) < 2e-2 and rel_err(ours[1], ref[1]) < 2e-2
    serve = sdpagraph.attention(q, k, v, bias, implementation="cudnn", training=False)
    assert rel_err(serve, sdpagraph.attention(q, k, v, bias, implementation="xla")) < 2e-2


def test_remat_recomputes_the_forward_graph_and_matches_xla():
    rng = np.random.default_rng()
    q, k, v = (jnp.asarray(rng.standard_normal((2, 256, 4, 64)), jnp.bfloat16) for _ in range(3))
    w = jnp.asarray(rng.standard_normal((64, 64)) / 8, jnp.bfloat16)

    def model(impl, q, k, v):
        @jax.checkpoint  # saves nothing: the backward pass recomputes each layer's forward
        def layer(x):
            out = sdpagraph.attention(x, k, v, is_causal=True, score_mod=mods.softcap(20.0), implementation=impl)
            return out @ w
        return jnp.sum(layer(layer(q)).astype(jnp.float32) ** 2)

    step = lambda impl: jax.jit(jax.value_and_grad(functools.partial(model, impl), argnums=(0, 1, 2)))
    (value, grads), (value_ref, grads_ref) = step("cudnn")(q, k, v), step("xla")(q, k, v)
    assert rel_err(value, value_ref) < 2e-2
    assert all(rel_err(a, b) < 2e-2 for a, b in zip(grads, grads_ref))
    # Two layers: two forward calls, two recomputed forward calls, two backward calls, none merged by XLA.
    compiled = step("cudnn").lower(q, k, v).compile().as_text()
    calls = re.findall(r'custom_call_target="sdpagraph_execute".*?graph_key = "(\w+)"', compiled)
    assert sorted(collections.Counter(calls).values()) == [2, 4], collections.Counter(calls)


def test_check_support_then_attention_builds_nothing_more(private_cache):
    rng = np.random.default_rng()
    q, k, v = (jnp.asarray(rng.standard_normal((2, 640, 4, 64)), jnp.bfloat16) for _ in range(3))
    kwargs = dict(is_causal=True, score_mod=mods.softcap(17.0), local_window_size=(96, 0))
    assert sdpagraph.check_support(q, k, v, **kwargs).supported
    builds = private_cache.stats()["builds"]
    jax.block_until_ready(jax.jit(jax.grad(lambda q: jnp.sum(sdpagraph.attention(q, k, v, **kwargs).astype(jnp.float32))))(q))
    assert private_cache.stats()["builds"] == builds


def test_jnp_softcap_values_share_one_cached_graph_and_each_matches_xla(private_cache):
    """The literals of a jax.numpy softcap are bound scalars: a second cap value builds nothing."""
    rng = np.random.default_rng()
    q = jnp.asarray(rng.standard_normal((2, 384, 4, 64)) * 3, jnp.bfloat16)  # scores of a few units
    k, v = (jnp.asarray(rng.standard_normal((2, 384, 4, 64)), jnp.bfloat16) for _ in range(2))

    def step(impl, cap):
        def loss(q, k, v):
            out = sdpagraph.attention(q, k, v, score_mod=lambda s, b, h, i, j: cap * jnp.tanh(s / cap),
                                      mask_mod=lambda b, h, i, j: i >= j, implementation=impl)
            return jnp.sum(out.astype(jnp.float32) ** 2), out
        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)

    outs, builds = {}, []
    for cap in (2.0, 30.0):
        (_, out), grads = step("cudnn", cap)
        builds.append(private_cache.stats()["builds"])
        (_, out_ref), grads_ref = step("xla", cap)
        errors = [rel_err(out, out_ref)] + [rel_err(a, b) for a, b in zip(grads, grads_ref)]
        assert all(np.isfinite(errors)) and max(errors) < 2e-2, (cap, errors)
        outs[cap] = out_ref
    assert builds[0] > 0 and builds[1] == builds[0], builds
    assert rel_err(outs[2.0], outs[30.0]) > 5e-2  # the two caps really differ


def test_sixteen_threads_share_one_deserialized_graph():
    rng = np.random.default_rng()
    q, k, v = (jnp.asarray(rng.standard_normal((2, 256, 4, 64)), jnp.bfloat16) for _ in range(3))
    f = jax.jit(lambda q, k, v: sdpagraph.attention(q, k, v, is_causal=True, score_mod=mods.softcap(9.0),
                                                    implementation="cudnn"))
    expected = np.asarray(f(q, k, v))
    _wait_for_preparations()  # another test's graphs, prepared in the background, must not count here
    before = ffi.deserialize_count()
    results, errors = [], []

    def worker():
        try:
            for _ in range(10):
                results.append(np.asarray(f(q, k, v)))
        except Exception as error:  # collected and asserted below
            errors.append(error)

    threads = [threading.Thread(target=worker) for _ in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(results) == 160
    assert all(np.array_equal(r, expected) for r in results)
    assert ffi.deserialize_count() == before


@pytest.mark.skipif("command_buffer" in os.environ.get("XLA_FLAGS", ""),
                    reason="under command buffers the handler runs only while XLA records")
def test_host_timing_counts_each_call_and_splits_off_cudnn_execute():
    rng = np.random.default_rng()
    q, k, v = (jnp.asarray(rng.standard_normal((1, 128, 2, 64)), jnp.bfloat16) for _ in range(3))
    f = jax.jit(lambda q, k, v: sdpagraph.attention(q, k, v, implementation="cudnn", training=False))
    jax.block_until_ready(f(q, k, v))  # build and deserialize before timing
    executor = ffi.load()
    executor.host_timing(True)
    try:
        for _ in range(20):
            out = f(q, k, v)
        jax.block_until_ready(out)
    finally:
        timing = executor.host_timing(False)
    assert timing.was_enabled and timing.calls == 20
    assert 0 < timing.cudnn_execute_ns < timing.handler_ns
    jax.block_until_ready(f(q, k, v))
    assert executor.host_timing(False).calls == 0  # nothing is counted while timing is off


def test_unsupported_config_falls_back_with_a_reason(caplog):
    rng = np.random.default_rng()
    q, k, v = (jnp.asarray(rng.standard_normal((1, 128, 2, 68)), jnp.bfloat16) for _ in range(3))
    support = sdpagraph.check_support(q, k, v)
    assert not support.supported and support.backend == "xla" and "68" in support.reason
    caplog.set_level("INFO", logger="sdpagraph")
    out = sdpagraph.attention(q, k, v)
    assert rel_err(out, sdpagraph.attention(q, k, v, implementation="xla")) == 0
    with pytest.raises(ValueError, match="68"):
        sdpagraph.attention(q, k, v, implementation="cudnn")


def test_hlo_bytes_per_call_site(report):
    q = jax.ShapeDtypeStruct((2, 512, 8, 128), jnp.bfloat16)
    one = jax.jit(lambda q, k, v: sdpagraph.attention(q, k, v, is_causal=True, implementation="cudnn"))
    two = jax.jit(lambda q, k, v: sdpagraph.attention(sdpagraph.attention(q, k, v, is_causal=True,
                                                                          implementation="cudnn"), k, v,
                                                      is_causal=True, implementation="cudnn"))
    size = lambda f: len(f.lower(q, q, q).as_text())  # noqa: E731
    per_site = size(two) - size(one)
    report(f"HLO text per attention call site (forward): {per_site} bytes")
    assert per_site < 4096


FRESH_PROCESS = textwrap.dedent("""
    import json, os, sys, time
    import jax, jax.numpy as jnp, numpy as np
    jax.config.update("jax_compilation_cache_dir", sys.argv[1])
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    import sdpagraph
    from sdpagraph import mods
    rng = np.random.default_rng(7)
    q, k, v = (jnp.asarray(rng.standard_normal((2, 512, 4, 64)), jnp.bfloat16) for _ in range(3))
    f = jax.jit(jax.grad(lambda q, k, v: jnp.sum(sdpagraph.attention(
        q, k, v, is_causal=True, score_mod=mods.softcap(20.0), implementation="cudnn").astype(jnp.float32) ** 2),
        argnums=(0, 1, 2)))
    start = time.perf_counter()
    grads = jax.block_until_ready(f(q, k, v))
    print(json.dumps({"seconds": time.perf_counter() - start,
                      "checksum": [float(jnp.sum(jnp.abs(g.astype(jnp.float32)))) for g in grads]}))
""")


def run_fresh(tmp_path, extra_env=None):
    script = tmp_path / "fresh.py"
    script.write_text(FRESH_PROCESS)
    env = dict(os.environ, SDPAGRAPH_CACHE_DIR=str(tmp_path / "graphs"), PYTHONPATH=os.pathsep.join(
        [ROOT, os.environ.get("PYTHONPATH", "")]), **(extra_env or {}))
    result = subprocess.run([sys.executable, str(script), str(tmp_path / "jax-cache")], env=env,
                            capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_fresh_process_from_persistent_compilation_cache_and_command_buffers(tmp_path, report):
    first = run_fresh(tmp_path)
    restored = run_fresh(tmp_path)
    buffered = run_fresh(tmp_path, {"XLA_FLAGS": "--xla_gpu_enable_command_buffer=CUSTOM_CALL,FUSION"})
    report(f"fresh process fwd+bwd first call: cold {first['seconds']:.2f} s, restored {restored['seconds']:.2f} s, "
           f"command buffers {buffered['seconds']:.2f} s")
    assert np.allclose(first["checksum"], restored["checksum"], rtol=1e-6)
    assert np.allclose(first["checksum"], buffered["checksum"], rtol=1e-6)


def _wait_for_preparations():
    from sdpagraph.ffi import prepare

    deadline = time.monotonic() + 30
    while prepare.pending() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert prepare.pending() == 0


def test_graphs_are_prepared_while_xla_compiles(monkeypatch):
    """Tracing a call deserializes its graphs in the background (SDPAGRAPH_PREPARE, on by default):
    by the first run they are ready (the run deserializes nothing), and the values are the XLA
    backend's."""
    monkeypatch.delenv("SDPAGRAPH_PREPARE", raising=False)
    monkeypatch.setenv("SDPAGRAPH_VERIFY", "off")  # the check's own runs would deserialize them first
    rng = np.random.default_rng()
    q, k, v = (jnp.asarray(rng.standard_normal((1, 192, 2, 64)), jnp.bfloat16) for _ in range(3))

    def grads(implementation):
        def loss(q, k, v):
            out = sdpagraph.attention(q, k, v, is_causal=True, score_mod=mods.softcap(7.0),
                                      implementation=implementation)
            return jnp.sum(out.astype(jnp.float32) * jnp.arange(out.shape[-1], dtype=jnp.float32))
        return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))

    _wait_for_preparations()  # graphs of earlier tests (traced, never run) may still be queued
    before = ffi.deserialize_count()
    compiled = grads("cudnn").lower(q, k, v).compile()
    _wait_for_preparations()
    assert ffi.deserialize_count() == before + 2  # forward and backward, before any run
    got = compiled(q, k, v)
    assert ffi.deserialize_count() == before + 2
    want = grads("xla")(q, k, v)
    for name, g, w in zip(("dq", "dk", "dv"), got, want):
        assert rel_err(g, w) < 2e-2, name
