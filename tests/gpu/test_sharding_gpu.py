"""sdpagraph.attention under SPMD on two GPUs: batch- and head-sharded jitted calls run the cuDNN graph
once per device on the local shapes, match the XLA backend on the same sharded inputs, keep the
input's sharding, and compile to no all-gather / all-to-all. Context parallelism (sequence split over
the two GPUs, ring and all-to-all) equals the unsplit call.

Skipped without two GPUs or without the built executor (and, as every GPU test, without torch or
the cuDNN frontend: conftest.py). Run on a two-GPU machine:

    python3 -m pytest -q tests/gpu/test_sharding_gpu.py
"""
import logging
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import sdpagraph
from sdpagraph import ffi, mods
from sdpagraph.cache import CacheMissError, GraphCache, set_default_cache
from tests.reference import rel_err


def skip_reason():
    gpus = [d for d in jax.devices() if d.platform == "gpu"]
    if len(gpus) < 2:
        return f"needs 2 GPUs, JAX sees {len(gpus)}"
    return ffi.unavailable_reason()


pytestmark = [pytest.mark.skipif(skip_reason() is not None, reason=str(skip_reason())),
              pytest.mark.usefixtures("private_cache")]
GATHERS = re.compile(r"\b(all-gather(?:-start)?|all-to-all(?:-start)?)\(")
EXECUTE = re.compile(r'custom_call_target="sdpagraph_execute"')


def mesh():
    return Mesh(np.array(jax.devices()[:2]), ("x",))


def place(x, m, spec):
    return None if x is None else jax.device_put(jnp.asarray(x), NamedSharding(m, spec))


def random_ids(rng, B, T, segments):
    ids = np.zeros((B, T), np.int32)
    for b in range(B):
        cuts = np.sort(rng.choice(np.arange(8, T - 8), segments - 1, replace=False))
        bounds = [0, *cuts, T - int(rng.integers(0, 8))]
        for m in range(segments):
            ids[b, bounds[m]:bounds[m + 1]] = m + 1
    return ids


B, T, H = 4, 512, 64
CASES = {  # name: (N, K, where q/k/v are split, kwargs maker, bias shape)
    "batch_causal": (8, 8, "batch", lambda rng: dict(is_causal=True), None),
    "heads_causal": (8, 8, "heads", lambda rng: dict(is_causal=True), None),
    "gqa_heads_softcap": (8, 2, "heads", lambda rng: dict(is_causal=True, score_mod=mods.softcap(20.0)), None),
    "batch_padding_softcap": (8, 8, "batch", lambda rng: dict(
        is_causal=True, score_mod=mods.softcap(20.0),
        query_seq_lengths=rng.integers(T // 2, T + 1, B).astype(np.int32),
        key_value_seq_lengths=rng.integers(T // 2, T + 1, B).astype(np.int32)), None),
    "batch_packed": (8, 8, "batch", lambda rng: dict(is_causal=True, segment_ids=random_ids(rng, B, T, 3),
                                                     max_segments_per_seq=3), None),
    "heads_packed": (8, 4, "heads", lambda rng: dict(is_causal=True, segment_ids=random_ids(rng, B, T, 3),
                                                     max_segments_per_seq=3), None),
    "batch_bias_per_head": (8, 8, "batch", lambda rng: dict(), (1, 8, T, T)),
}


def sharded(m, where, q, k, v, bias, kwargs):
    spec = P("x") if where == "batch" else P(None, None, "x")
    kwargs = dict(kwargs)
    for name in ("query_seq_lengths", "key_value_seq_lengths", "segment_ids"):
        if name in kwargs:
            kwargs[name] = place(kwargs[name], m, P("x") if where == "batch" else P())
    bias_spec = None if bias is None else P(*("x" if where == "batch" and bias.shape[0] > 1 else
                                              "x" if where == "heads" and i == 1 and bias.shape[1] > 1 else None
                                              for i in range(2)))
    return (place(q, m, spec), place(k, m, spec), place(v, m, spec), place(bias, m, bias_spec)), kwargs, spec


def grad_step(impl, kwargs, with_bias):
    def loss(q, k, v, bias, cotangent):
        out = sdpagraph.attention(q, k, v, bias, implementation=impl, **kwargs)
        return jnp.sum(out.astype(jnp.float32) * cotangent), out

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3) if with_bias else (0, 1, 2), has_aux=True))


@pytest.mark.parametrize("name", CASES)
def test_sharded_cudnn_matches_xla_on_local_shapes_without_gathers(name):
    N, K, where, make_kwargs, bias_shape = CASES[name]
    rng = np.random.default_rng()
    q = jnp.asarray(rng.standard_normal((B, T, N, H)), jnp.bfloat16)
    k, v = (jnp.asarray(rng.standard_normal((B, T, K, H)), jnp.bfloat16) for _ in range(2))
    bias = None if bias_shape is None else jnp.asarray(rng.standard_normal(bias_shape), jnp.bfloat16)
    cotangent = jnp.asarray(rng.standard_normal((B, T, N, H)), jnp.float32)
    m = mesh()
    (qs, ks, vs, bs), kwargs, spec = sharded(m, where, q, k, v, bias, make_kwargs(rng))
    cot = place(cotangent, m, spec)
    ours = grad_step("cudnn", kwargs, bias is not None).lower(qs, ks, vs, bs, cot).compile()
    (_, out), grads = ours(qs, ks, vs, bs, cot)
    (_, out_ref), grads_ref = grad_step("xla", kwargs, bias is not None)(qs, ks, vs, bs, cot)
    assert rel_err(out, out_ref) < 2e-2
    for grad, grad_ref in zip(grads, grads_ref):
        assert rel_err(grad, grad_ref) < 2e-2
    assert out.sharding.is_equivalent_to(qs.sharding, 4), out.sharding
    text = ours.as_text()
    assert GATHERS.findall(text) == [], [line for line in text.splitlines() if GATHERS.search(line)][:5]
    # Each device runs the graph on its shard: the executor's q operand has the local shape.
    local = (B // 2, T, N, H) if where == "batch" else (B, T, N // 2, H)
    assert f"bf16[{','.join(map(str, local))}]" in text and len(EXECUTE.findall(text)) == 2


def test_user_shard_map_runs_on_the_local_arrays():
    rng = np.random.default_rng()
    q, k, v = (jnp.asarray(rng.standard_normal((B, T, 8, H)), jnp.bfloat16) for _ in range(3))
    m = mesh()
    spec = P("x", None, None)
    inside = jax.shard_map(lambda q, k, v: sdpagraph.attention(q, k, v, is_causal=True, implementation="cudnn"),
                           mesh=m, in_specs=(spec,) * 3, out_specs=spec)
    qs, ks, vs = (place(x, m, spec) for x in (q, k, v))

    def step(f):
        loss = lambda q, k, v: jnp.sum(f(q, k, v).astype(jnp.float32) ** 2)  # noqa: E731
        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))

    value, grads = step(inside)(qs, ks, vs)
    value_ref, grads_ref = step(lambda q, k, v: sdpagraph.attention(q, k, v, is_causal=True,
                                                                    implementation="xla"))(q, k, v)
    assert rel_err(value, value_ref) < 2e-2
    assert all(rel_err(a, b) < 2e-2 for a, b in zip(grads, grads_ref))


@pytest.mark.parametrize("hint", [1024, None])
def test_packed_documents_run_on_bins_per_device_under_jit(monkeypatch, hint):
    """Packed softcap documents under jax.jit with batch-sharded arguments over 2 GPUs (no shard_map):
    each device packs and runs its own rows on bins (`bins.partitioned`), nothing is gathered, and
    the result and gradients match the XLA backend."""
    from sdpagraph.backends.cudnn.bins import partitioned as partitioned_bins
    from tests.test_packed_bins import random_documents
    from tests.test_sharding import COLLECTIVE_GATHERS

    calls = []
    real = partitioned_bins._execute
    # (direction, batch) of each call of the per-device function: B // 2 on a device's shard
    monkeypatch.setattr(partitioned_bins, "_execute",
                        lambda *a, **kw: calls.append((a[2], a[1].spec.batch)) or real(*a, **kw))
    partitioned_bins._executor.cache_clear()
    rng = np.random.default_rng()
    t = 4096
    q, k, v = (jnp.asarray(rng.standard_normal((B, t, 8, H)), jnp.bfloat16) for _ in range(3))
    ids = jnp.asarray(random_documents(rng, B, t, 64, 1000, padding=int(rng.integers(0, 100))))
    m = mesh()
    kwargs = dict(is_causal=True, score_mod=mods.softcap(30.0), max_seqlen_kv=hint)

    def step(impl):
        def loss(q, k, v, ids):
            out = sdpagraph.attention(q, k, v, segment_ids=ids, implementation=impl, **kwargs)
            return jnp.sum(out.astype(jnp.float32) ** 2)
        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))

    placed = [place(x, m, P("x")) for x in (q, k, v, ids)]
    try:
        value, grads = step("cudnn")(*placed)
        hlo = step("cudnn").lower(*placed).compile().as_text()
    finally:
        partitioned_bins._executor.cache_clear()
    assert {("forward", B // 2), ("backward", B // 2)} <= set(calls), "the documents ran on bins per device"
    assert not COLLECTIVE_GATHERS.search(hlo), "q, k, v or the ids were gathered"
    value_ref, grads_ref = step("xla")(q, k, v, ids)
    assert rel_err(value, value_ref) < 2e-2
    assert all(rel_err(a, b) < 2e-2 for a, b in zip(grads, grads_ref))


def test_packed_documents_run_on_bins_per_device_inside_a_user_shard_map(monkeypatch):
    """Packed softcap documents, the batch split over 2 GPUs inside a shard_map: each device packs its
    own rows into bins (`bins.packed.usable`), and the result and gradients match the XLA backend."""
    from sdpagraph.backends.cudnn.bins import packed as packed_bins
    from tests.test_packed_bins import random_documents

    calls = []
    real = packed_bins.attention
    monkeypatch.setattr(packed_bins, "attention", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    rng = np.random.default_rng()
    t = 4096
    q, k, v = (jnp.asarray(rng.standard_normal((B, t, 8, H)), jnp.bfloat16) for _ in range(3))
    ids = jnp.asarray(random_documents(rng, B, t, 64, 1000))
    m = mesh()
    spec = P("x")
    kwargs = dict(is_causal=True, score_mod=mods.softcap(30.0))
    inside = jax.shard_map(lambda q, k, v, ids: sdpagraph.attention(q, k, v, segment_ids=ids, implementation="cudnn",
                                                                    **kwargs),
                           mesh=m, in_specs=(spec,) * 4, out_specs=spec)

    def step(f):
        loss = lambda q, k, v, ids: jnp.sum(f(q, k, v, ids).astype(jnp.float32) ** 2)  # noqa: E731
        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))

    value, grads = step(inside)(*(place(x, m, spec) for x in (q, k, v, ids)))
    assert calls, "the documents ran on bins"
    value_ref, grads_ref = step(lambda q, k, v, ids: sdpagraph.attention(q, k, v, segment_ids=ids, implementation="xla",
                                                                         **kwargs))(q, k, v, ids)
    assert rel_err(value, value_ref) < 2e-2
    assert all(rel_err(a, b) < 2e-2 for a, b in zip(grads, grads_ref))


def test_sequence_sharded_inputs_are_gathered_with_a_warning(caplog):
    caplog.set_level(logging.WARNING, logger="sdpagraph")
    rng = np.random.default_rng()
    q, k, v = (jnp.asarray(rng.standard_normal((2, 384, 4, H)), jnp.bfloat16) for _ in range(3))
    m = mesh()
    qs, ks, vs = (place(x, m, P(None, "x")) for x in (q, k, v))
    out = jax.jit(lambda q, k, v: sdpagraph.attention(q, k, v, is_causal=True, implementation="cudnn"))(qs, ks, vs)
    assert rel_err(out, sdpagraph.attention(q, k, v, is_causal=True, implementation="xla")) < 2e-2
    assert any("context_parallel_axis" in r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)


def test_recorded_specs_precompile_a_cache_that_serves_the_sharded_run_in_strict_mode(tmp_path, private_cache):
    rng = np.random.default_rng()
    q, k, v = (jnp.asarray(rng.standard_normal((B, 256, 4, H)), jnp.bfloat16) for _ in range(3))
    m = mesh()
    qs, ks, vs = (place(x, m, P("x")) for x in (q, k, v))

    def step():  # a fresh jit each time: traced, partitioned and compiled again
        return jax.jit(jax.grad(lambda q, k, v: jnp.sum(sdpagraph.attention(
            q, k, v, is_causal=True, score_mod=mods.softcap(11.0)).astype(jnp.float32)), argnums=(0, 1, 2)))

    specs = tmp_path / "specs.json"
    with sdpagraph.record(str(specs)):
        expected = step()(qs, ks, vs)
    report = sdpagraph.precompile(str(specs), str(tmp_path / "shipped"), progress=False)
    assert report.ok, report
    set_default_cache(GraphCache(str(tmp_path / "shipped"), mode="strict"))
    try:
        got = step()(qs, ks, vs)
    except CacheMissError as miss:  # pragma: no cover - the failure this test guards against
        pytest.fail(f"the precompiled cache misses a graph of the sharded run: {miss}")
    finally:
        set_default_cache(private_cache)
    assert all(rel_err(a, b) < 1e-6 for a, b in zip(got, expected))


# ----------------------------------------------------------------------------- context parallelism

CP_CASES = {  # name: (N, K, strategy, load_balanced, kwargs maker)
    "ring_causal": (8, 8, "ring", False, lambda rng: dict(is_causal=True)),
    "ring_causal_balanced": (8, 8, "ring", True, lambda rng: dict(is_causal=True)),
    "ring_gqa_softcap_balanced": (8, 2, "ring", True, lambda rng: dict(is_causal=True,
                                                                       score_mod=mods.softcap(20.0))),
    "ring_plain": (8, 8, "ring", False, lambda rng: dict()),
    "ring_alibi_balanced": (8, 8, "ring", True, lambda rng: dict(  # global positions: offset operands
        is_causal=True, score_mod=mods.alibi(rng.random(8).astype(np.float32)))),
    "ring_window_balanced": (8, 8, "ring", True, lambda rng: dict(local_window_size=(100, 0))),  # XLA blocks
    "all_to_all_causal_balanced": (8, 8, "all_to_all", True, lambda rng: dict(is_causal=True)),
    "all_to_all_packed": (8, 8, "all_to_all", False, lambda rng: dict(
        is_causal=True, segment_ids=random_ids(rng, B, T, 3), max_segments_per_seq=3)),
    # packed documents on the ring's cuDNN blocks (THD pairs over the documents two chunks share)
    "ring_documents_balanced": (8, 2, "ring", True, lambda rng: dict(
        is_causal=True, segment_ids=random_ids(rng, B, T, 5), max_segments_per_seq=5)),
    "ring_documents": (8, 8, "ring", False, lambda rng: dict(
        is_causal=True, segment_ids=random_ids(rng, B, T, 3), max_segments_per_seq=3)),
    "ring_documents_softcap_balanced": (8, 8, "ring", True, lambda rng: dict(  # the dense twin per pair
        is_causal=True, score_mod=mods.softcap(20.0), segment_ids=random_ids(rng, B, T, 4), max_segments_per_seq=4)),
    # each document cut over the devices (load_balance's segment_ids; the ids themselves in natural order)
    "ring_documents_by_document": (8, 2, "ring", "documents", lambda rng: dict(
        is_causal=True, segment_ids=random_ids(rng, B, T, 5), max_segments_per_seq=5)),
    "all_to_all_documents_softcap_by_document": (8, 8, "all_to_all", "documents", lambda rng: dict(
        is_causal=True, score_mod=mods.softcap(20.0), segment_ids=random_ids(rng, B, T, 4), max_segments_per_seq=4)),
    # sliding windows and chunks: the halo (keys from the neighbour only), natural order and balanced
    "halo_window": (8, 2, "halo", False, lambda rng: dict(is_causal=True, local_window_size=(100, 0))),
    "halo_window_balanced": (8, 8, "halo", True, lambda rng: dict(is_causal=True, local_window_size=(300, 0))),
    "halo_chunks_whole": (8, 8, "halo", False, lambda rng: dict(is_causal=True, chunk_size=T // 4)),
    "halo_chunks_within": (8, 8, "halo", False, lambda rng: dict(is_causal=True, chunk_size=T)),
    # packed documents of at most max_seqlen_kv tokens: the halo (the last keys of the block before)
    "halo_documents": (8, 2, "halo", False, lambda rng: documents_of_at_most(rng, T // 2 + 1)),
    "halo_documents_balanced": (8, 8, "halo", True, lambda rng: documents_of_at_most(rng, T // 4 + 1)),
}


def documents_of_at_most(rng, longest):
    """Causal packed documents of 1-`longest` tokens, back to back (some cross the blocks' bounds), with
    `max_seqlen_kv=longest`."""
    ids = np.zeros((B, T), np.int32)
    for row in ids:
        at, doc = 0, 1
        while at < T:
            size = int(rng.integers(longest // 2, longest + 1))
            row[at:at + size], at, doc = doc, at + size, doc + 1
    return dict(is_causal=True, segment_ids=ids, max_segments_per_seq=int(ids.max()), max_seqlen_kv=longest)


@pytest.mark.parametrize("name", CP_CASES)
def test_context_parallel_matches_one_gpu(name):
    """q, k, v split along the sequence over 2 GPUs: output and gradients equal to the unsplit call on
    one GPU (XLA backend), the ring with collective-permutes and no all-gather of k or v."""
    N, K, strategy, load_balanced, make_kwargs = CP_CASES[name]
    rng = np.random.default_rng()
    q = rng.standard_normal((B, T, N, H)).astype(np.float32)
    k, v = (rng.standard_normal((B, T, K, H)).astype(np.float32) for _ in range(2))
    cotangent = rng.standard_normal((B, T, N, H)).astype(np.float32)
    kwargs = make_kwargs(rng)
    order = (lambda x: np.asarray(sdpagraph.load_balance(x, 2))) if load_balanced else (lambda x: x)  # noqa: E731
    back = (lambda x: sdpagraph.unload_balance(x, 2)) if load_balanced else (lambda x: x)  # noqa: E731
    cp_kwargs = dict(kwargs, context_parallel_axis="x", load_balanced=load_balanced,
                     context_parallel_strategy=strategy)
    if load_balanced == "documents":  # q, k, v cut per document; the ids stay in natural order
        ids = kwargs["segment_ids"]
        order = lambda x: np.asarray(sdpagraph.load_balance(x, 2, segment_ids=ids))  # noqa: E731
        back = lambda x: sdpagraph.unload_balance(x, 2, segment_ids=ids)  # noqa: E731
    elif "segment_ids" in kwargs:
        cp_kwargs["segment_ids"] = order(kwargs["segment_ids"])
    m = mesh()
    args = [place(jnp.asarray(order(x), jnp.bfloat16 if i < 3 else jnp.float32), m, P(None, "x"))
            for i, x in enumerate((q, k, v, cotangent))]
    with jax.set_mesh(m):
        ours = grad_step(None, cp_kwargs, False).lower(*args[:3], None, args[3]).compile()
        (_, out), grads = ours(*args[:3], None, args[3])
    host = [jnp.asarray(x, jnp.bfloat16 if i < 3 else jnp.float32) for i, x in enumerate((q, k, v, cotangent))]
    (_, out_ref), grads_ref = grad_step("xla", kwargs, False)(*host[:3], None, host[3])
    assert rel_err(back(out), out_ref) < 2e-2
    for grad, grad_ref in zip(grads, grads_ref):
        assert rel_err(back(grad), grad_ref) < 2e-2
    text = ours.as_text()
    if strategy == "ring":
        # k and v travel by collective-permute, never gathered (packed documents gather their int32 ids)
        assert "collective-permute" in text
        assert not re.search(r"= \(?(?:f32|bf16|f16)\[[^\n]*\ball-gather(?:-start)?\(", text)
    # the blocks run the cuDNN graphs (but the ring's windows, and its dense-twin document blocks, whose
    # backward cuDNN 9.19 has no engine for: XLA blocks)
    if ("window" not in name or strategy == "halo") and "documents_softcap" not in name:
        assert EXECUTE.findall(text)


def test_context_parallel_check_support_names_the_block_backend():
    q = jax.ShapeDtypeStruct((1, 4096, 8, 128), jnp.bfloat16)
    with jax.set_mesh(mesh()):
        answer = sdpagraph.check_support(q, q, q, is_causal=True, context_parallel_axis="x", load_balanced=True)
    assert answer.supported and answer.backend == "cudnn", answer
