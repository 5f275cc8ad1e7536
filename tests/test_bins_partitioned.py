"""Packed documents with a score_mod on bins under jit's automatic partitioning
(`backends.cudnn.bins.partitioned`), on 8 CPU devices: the cuDNN path's own code around the CPU
stand-in for its graphs (`tests.test_context_parallel.cudnn_like_executor`, whose backward reads the
output and stats it is given, as cuDNN's does), with the batch split over devices. Each device packs
and runs its own rows: the per-device bins graphs are built, no q, k or v is gathered, and the
output, logsumexp and gradients equal the XLA backend's on the whole batch; where a device's
documents do not fit its bins, that device runs its rows unbinned; a recorded run's spec file covers
the per-device bins' graphs.

The rest of the suite runs in one process with one CPU device: the first test runs this file again
in a subprocess with the devices."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import sdpagraph
from sdpagraph import mods
from sdpagraph.backends.cudnn import execute as cudnn_execute
from sdpagraph.backends.cudnn.bins import packed as packed_bins, partitioned as partitioned_bins
from sdpagraph.shard_spec import local_spec, Split
from sdpagraph.graphs.binning import bin_plan
from tests.devices import has_cpu_devices, make_mesh, rerun_with_cpu_devices
from tests.test_context_parallel import cudnn_like_executor
from tests.test_packed_bins import random_documents
from tests.test_sharding import COLLECTIVE_GATHERS, cudnn_on_cpu  # noqa: F401,F811 (a fixture)

DEVICES = 8
HERE_WITH_DEVICES = has_cpu_devices(DEVICES)
needs_devices = pytest.mark.skipif(not HERE_WITH_DEVICES, reason=f"runs in the {DEVICES}-device subprocess")
B, T, N, H, HINT = 8, 1024, 2, 16, 128


def test_in_a_process_with_eight_cpu_devices():
    if HERE_WITH_DEVICES:
        pytest.skip("this process has the devices: the tests below run here")
    rerun_with_cpu_devices(__file__, DEVICES, timeout=900)


@pytest.fixture
def per_device_bins(cudnn_on_cpu, monkeypatch):
    """The cuDNN path on the CPU stand-in, with bins taken per device as on GPUs in a process with
    several devices (`partitioned.usable`); yields the specs whose graphs were built."""
    monkeypatch.setattr(cudnn_execute, "call_executor", cudnn_like_executor)
    monkeypatch.setattr(packed_bins, "usable", lambda: False)
    monkeypatch.setattr(partitioned_bins, "usable", lambda inputs, sinks: True)
    return cudnn_on_cpu[0]


def step(implementation, **kwargs):
    """A jitted value_and_grad of a weighted sum of the call's output; (value, out), (dq, dk, dv)."""
    def loss(q, k, v, ids):
        out = sdpagraph.attention(q, k, v, is_causal=True, segment_ids=ids, score_mod=mods.softcap(20.0),
                                  implementation=implementation, **kwargs)
        weights = jnp.cos(jnp.arange(out.size, dtype=jnp.float32).reshape(out.shape))
        return jnp.sum(out * weights), out

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))


def inputs(rng, ids, kv_heads=N):
    q = rng.standard_normal((B, T, N, H)).astype(np.float32)
    k, v = (rng.standard_normal((B, T, kv_heads, H)).astype(np.float32) for _ in range(2))
    return q, k, v, ids


def sharded(mesh, arrays, axis):
    return [jax.device_put(x, NamedSharding(mesh, P(axis))) for x in arrays]


def compare(got, want, tol=2e-4):
    (_, out), grads = got
    (_, want_out), want_grads = want
    np.testing.assert_allclose(np.asarray(out), np.asarray(want_out), atol=tol, rtol=tol)
    for g, w, name in zip(grads, want_grads, ("dq", "dk", "dv")):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=tol, rtol=tol, err_msg=name)


@needs_devices
@pytest.mark.parametrize("kv_heads, hint", [(N, HINT), (1, HINT), (N, None)])
def test_each_device_runs_its_rows_on_bins(per_device_bins, kv_heads, hint):
    rng = np.random.default_rng()
    ids = random_documents(rng, B, T, 9, HINT if hint else T // 8, padding=int(rng.integers(0, 40)))
    arrays = inputs(rng, ids, kv_heads)
    kwargs = {"max_seqlen_kv": hint, "max_segments_per_seq": T // 9 + 1}
    want = step("xla", **kwargs)(*arrays)
    mesh = make_mesh((4, 2), ("data", "model"))
    with jax.set_mesh(mesh):
        placed = sharded(mesh, arrays, "data")
        got = step("cudnn", **kwargs)(*placed)
        hlo = step("cudnn", **kwargs).lower(*placed).compile().as_text()
    compare(got, want)
    assert not COLLECTIVE_GATHERS.search(hlo), "q, k, v or the ids were gathered"
    # The per-device bins' graphs were built: the local spec's plan (2 of the 8 rows a device)
    global_spec = next(spec for spec, _, _ in per_device_bins if spec.batch == B)
    local = local_spec(global_spec, Split(("data",), (), 4, 1, 1))
    plan = bin_plan(local, next(ir for spec, ir, _ in per_device_bins if spec.batch == B))
    assert plan is not None
    assert any(spec == plan.spec for spec, _, _ in per_device_bins), [s.summary() for s, _, _ in per_device_bins]
    assert {direction for spec, _, direction in per_device_bins if spec == plan.spec} >= {"forward", "backward"}


@needs_devices
@pytest.mark.parametrize("kv_heads", [N, 1])
def test_bins_per_device_with_the_heads_split_too(per_device_bins, kv_heads):
    """Batch over one mesh axis and query heads over the other (key/value heads with them, or whole
    with one: their gradients summed over the heads' devices)."""
    rng = np.random.default_rng()
    ids = random_documents(rng, B, T, 9, HINT)
    arrays = inputs(rng, ids, kv_heads)
    kwargs = {"max_seqlen_kv": HINT, "max_segments_per_seq": T // 9 + 1}
    want = step("xla", **kwargs)(*arrays)
    mesh = make_mesh((4, 2), ("data", "model"))
    with jax.set_mesh(mesh):
        heads = P("data", None, "model")
        placed = [jax.device_put(x, NamedSharding(mesh, heads if x.ndim == 4 and x.shape[2] > 1 else P("data")))
                  for x in arrays]
        got = step("cudnn", **kwargs)(*placed)
    compare(got, want)
    assert any(spec.num_heads == N // 2 and spec.q_len < T for spec, _, _ in per_device_bins), "per-device bins"


@needs_devices
def test_a_device_whose_documents_do_not_fit_runs_its_rows_unbinned(per_device_bins):
    """Without a hint bins hold a quarter of a row: a document longer than that, on one device's
    rows only, sends that device's rows through the unbinned call (`lax.cond`, per device) and leaves
    the others on bins; the answer is right on every device."""
    rng = np.random.default_rng()
    ids = random_documents(rng, B, T, 9, T // 8)
    ids[2, :T // 2] = ids.max() + 1  # rows 2 and 3 are the second device's
    ids[2] = np.cumsum(np.diff(np.concatenate([[0], ids[2]])) != 0)  # renumbered runs
    arrays = inputs(rng, ids)
    kwargs = {"max_segments_per_seq": T // 9 + 1}
    want = step("xla", **kwargs)(*arrays)
    mesh = make_mesh((4, 2), ("data", "model"))
    with jax.set_mesh(mesh):
        got = step("cudnn", **kwargs)(*sharded(mesh, arrays, "data"))
    compare(got, want)
    # The case is the one named: only the second device's rows do not fit its bins.
    local = local_spec(next(spec for spec, _, _ in per_device_bins if spec.batch == B), Split(("data",), (), 4, 1, 1))
    plan = bin_plan(local, next(ir for spec, ir, _ in per_device_bins if spec.batch == B))
    fits = [bool(packed_bins.lay_out(jnp.asarray(ids[d * 2:d * 2 + 2]), plan, local.max_segments, True).fits)
            for d in range(4)]
    assert fits == [True, False, True, True], fits


@needs_devices
def test_bins_per_device_on_explicit_axes(per_device_bins):
    rng = np.random.default_rng()
    ids = random_documents(rng, B, T, 9, HINT)
    arrays = inputs(rng, ids)
    kwargs = {"max_seqlen_kv": HINT, "max_segments_per_seq": T // 9 + 1}
    want = step("xla", **kwargs)(*arrays)
    mesh = make_mesh((4, 2), ("data", "model"), "explicit")
    with jax.set_mesh(mesh):
        placed = sharded(mesh, arrays, "data")
        got = step("cudnn", **kwargs)(*placed)
        assert jax.typeof(got[1][0]).sharding.spec[0] == "data"
    compare(got, want)


def test_bins_per_device_need_a_gpu_process_with_several_devices_and_partitioning(monkeypatch):
    inputs_ = sdpagraph.call.RuntimeInputs()
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(jax, "device_count", lambda: 2)
    assert partitioned_bins.usable(inputs_, None)
    assert not partitioned_bins.usable(inputs_, jnp.zeros((N,)))  # sinks: the dense twin composes them
    assert not partitioned_bins.usable(dataclasses.replace(inputs_, dropout_seeds=jnp.zeros((B, N))), None)
    monkeypatch.setenv("SDPAGRAPH_PARTITION", "0")
    assert not partitioned_bins.usable(inputs_, None)
    monkeypatch.delenv("SDPAGRAPH_PARTITION")
    monkeypatch.setattr(jax, "device_count", lambda: 1)
    assert not partitioned_bins.usable(inputs_, None)


@needs_devices
def test_a_call_that_does_not_train_runs_the_inference_graphs_per_device(per_device_bins):
    rng = np.random.default_rng()
    ids = random_documents(rng, B, T, 9, HINT)
    q, k, v, ids = inputs(rng, ids)
    kwargs = dict(is_causal=True, segment_ids=ids, score_mod=mods.softcap(20.0), max_seqlen_kv=HINT,
                  max_segments_per_seq=T // 9 + 1, training=False)
    want = sdpagraph.attention(q, k, v, implementation="xla", **kwargs)
    mesh = make_mesh((4, 2), ("data", "model"))
    with jax.set_mesh(mesh):
        placed = sharded(mesh, (q, k, v, ids), "data")
        got = jax.jit(lambda q, k, v, ids: sdpagraph.attention(q, k, v, implementation="cudnn",
                                                               **{**kwargs, "segment_ids": ids}))(*placed)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-4, rtol=2e-4)
    directions = {direction for spec, _, direction in per_device_bins}
    assert directions == {"inference"}, directions
    assert any(spec.q_len == HINT and spec.batch < B * T // HINT for spec, _, _ in per_device_bins), "per-device bins"


@needs_devices
@pytest.mark.parametrize("training", [True, False])
def test_recorded_specs_and_their_alternatives_cover_the_per_device_bins(per_device_bins, cudnn_on_cpu, tmp_path,
                                                                         training):
    """Precompiling what a sharded run records builds its per-device bins: the partition callback
    records each device's spec, and precompile adds a spec's bins (`graphs.alternatives`); in
    training and in inference (whose graphs are the inference ones)."""
    from sdpagraph.deploy.specfile import load_specs
    from sdpagraph.graph_store import graph_key
    from sdpagraph.graphs.alternatives import alternatives

    env = cudnn_on_cpu[1]
    rng = np.random.default_rng()
    arrays = inputs(rng, random_documents(rng, B, T, 9, HINT))
    mesh = make_mesh((4, 2), ("data", "model"))
    path = tmp_path / "specs.json"
    kwargs = dict(max_seqlen_kv=HINT, max_segments_per_seq=T // 9 + 1)
    with sdpagraph.record(str(path)), jax.set_mesh(mesh):
        placed = sharded(mesh, arrays, "data")
        if training:
            step("cudnn", **kwargs)(*placed)
        else:
            jax.jit(lambda q, k, v, ids: sdpagraph.attention(
                q, k, v, is_causal=True, segment_ids=ids, score_mod=mods.softcap(20.0), implementation="cudnn",
                training=False, **kwargs))(*placed)
    entries = load_specs(path)
    calls = [(e.spec, e.score_mod, d) for e in entries for d in e.directions]
    derived = [alternative for e in entries for alternative in alternatives(e.spec, e.score_mod, e.training)]
    calls += [(spec, ir, d) for spec, ir, trains in derived
              for d in (("forward", "backward") if trains else ("inference",))]
    recorded = {graph_key(spec, ir, d, env) for spec, ir, d in calls}
    used = {graph_key(spec, ir, d, env) for spec, ir, d in per_device_bins}
    assert used <= recorded
