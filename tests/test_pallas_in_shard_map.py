"""The Pallas kernels' paths inside a `shard_map` that checks manual axes (jax's default), on 2 CPU
devices: the bin packer's XLA formulation (its loop carry varies over the axes), and the Triton
probe asked first inside such a trace (its answer is cached for the process, so a failure there
would switch the kernels off everywhere). The first test runs this file again in a subprocess with
the devices."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from sdpagraph.backends import pallas_triton
from sdpagraph.backends.cudnn.bins import packer
from tests.devices import has_cpu_devices, make_mesh, rerun_with_cpu_devices

DEVICES = 2
HERE_WITH_DEVICES = has_cpu_devices(DEVICES)
needs_devices = pytest.mark.skipif(not HERE_WITH_DEVICES, reason=f"runs in the {DEVICES}-device subprocess")


def test_in_a_process_with_two_cpu_devices():
    if HERE_WITH_DEVICES:
        pytest.skip("this process has the devices: the tests below run here")
    rerun_with_cpu_devices(__file__, DEVICES, timeout=600)


def decreasing_lengths(rng, rows, count):
    return np.sort(rng.integers(1, 120, (rows, count)).astype(np.int32), axis=1)[:, ::-1].copy()


@needs_devices
@pytest.mark.parametrize("axis_type", ["auto", "explicit"])
def test_the_packer_runs_per_device_inside_a_shard_map(axis_type, monkeypatch):
    monkeypatch.setattr(pallas_triton, "status", lambda: pallas_triton.Availability(False, "test: XLA formulation"))
    lengths = decreasing_lengths(np.random.default_rng(), DEVICES, 24)
    mesh = make_mesh((DEVICES,), ("x",), axis_type)

    def per_device(x):
        bins, offsets = packer.pack(x[0], 256, 12)
        return bins[None], offsets[None]

    with jax.set_mesh(mesh):
        inside = jax.jit(jax.shard_map(per_device, mesh=mesh, in_specs=P("x"), out_specs=(P("x"), P("x"))))
        bins, offsets = inside(jax.device_put(jnp.asarray(lengths), jax.sharding.NamedSharding(mesh, P("x"))))
    bins, offsets = np.asarray(bins), np.asarray(offsets)
    for row in range(DEVICES):
        want = packer.pack(jnp.asarray(lengths[row]), 256, 12)
        np.testing.assert_array_equal(bins[row], np.asarray(want[0]))
        np.testing.assert_array_equal(offsets[row], np.asarray(want[1]))


@needs_devices
def test_the_triton_probe_answers_the_same_inside_a_shard_map():
    pallas_triton._probe.cache_clear()
    outside = pallas_triton._probe()
    pallas_triton._probe.cache_clear()
    mesh = make_mesh((DEVICES,), ("x",))
    answers = []

    def per_device(x):
        answers.append(pallas_triton._probe())
        return x

    try:
        jax.jit(jax.shard_map(per_device, mesh=mesh, in_specs=P("x"), out_specs=P("x")))(jnp.arange(4.0))
    finally:
        pallas_triton._probe.cache_clear()
    assert answers == [outside], (answers, outside)
