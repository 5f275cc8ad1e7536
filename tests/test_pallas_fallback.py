"""The Pallas kernels without Pallas' Triton backend (`backends.pallas_triton`), on a CPU: the probe
sees its removal whether the module no longer imports or the lowering raises, and then the
small-sequence backend and the bin packer run their XLA formulations, with the results of the
regular path, and say so in their support answers."""
import dataclasses
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import sdpagraph
from sdpagraph.backends import pallas_triton
from sdpagraph.backends.cudnn.bins import packed as packed_bins
from sdpagraph.backends.cudnn.bins import packer as bin_packer
from sdpagraph.backends.small_seq import kernel as small_seq_kernel
from sdpagraph.backends.small_seq.backend import BACKEND as SMALL_SEQ, small_seq_attention
from sdpagraph.call import prepare_call
from sdpagraph.config import SMALL_SEQ_KERNEL
from sdpagraph.graphs.binning import bin_plan
from tests.test_packed_bins import prepared, random_documents, xla_in_place_of_cudnn


@pytest.fixture(autouse=True)
def fresh_probe():
    """Each test asks the probe anew, and leaves the process's real answer behind."""
    pallas_triton._probe.cache_clear()
    yield
    pallas_triton._probe.cache_clear()


def _unimportable(monkeypatch, package, name):
    """`from package import name` raises ImportError until the test ends."""
    monkeypatch.delattr(sys.modules[package], name, raising=False)
    monkeypatch.setitem(sys.modules, f"{package}.{name}", None)


@pytest.fixture
def triton_removed(monkeypatch):
    """jax as it will be once Pallas' Triton backend is removed: its module no longer imports."""
    _unimportable(monkeypatch, "jax.experimental.pallas", "triton")


@pytest.fixture
def one_gpu(monkeypatch):
    """The process looks like one GPU's, and the kernel runs in Pallas' interpreter (counted)."""
    pytest.importorskip("jax.experimental.pallas.triton")  # the regular path these tests compare with
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(jax, "device_count", lambda: 1)
    calls = []
    real = small_seq_kernel.forward
    monkeypatch.setattr(small_seq_kernel, "forward", lambda *a: calls.append(1) or real(*a, interpret=True))
    return calls


def test_the_probe_finds_triton_in_this_jax_once():
    pytest.importorskip("jax.experimental.pallas.triton")
    inside = []
    jax.jit(lambda x: inside.append(pallas_triton.status()) or x)(jnp.ones(2))  # asked while jit traces
    assert inside == [pallas_triton.Availability(True, "")]
    assert pallas_triton.status() is inside[0]


def test_the_probe_sees_a_module_that_no_longer_imports(triton_removed):
    answer = pallas_triton.status()
    assert not answer.available
    assert answer.reason.startswith(f"Pallas Triton unavailable in jax {jax.__version__} (")
    assert "Error" in answer.reason


def test_the_probe_sees_a_lowering_that_raises(monkeypatch):
    """The module still imports, but the lowering has no Triton backend for the kernel's compiler
    parameters: jax raises "Cannot lower pallas_call on platform: gpu", as when the backend is gone."""
    plt = pytest.importorskip("jax.experimental.pallas.triton")

    @dataclasses.dataclass(frozen=True)
    class CompilerParams:  # Triton's fields, but no lowering registered for it
        num_warps: int | None = None
        num_stages: int | None = None

    monkeypatch.setattr(plt, "CompilerParams", CompilerParams)
    answer = pallas_triton.status()
    # On a CPU jax raises "ValueError: Cannot lower pallas_call"; with a GPU its lowering asserts instead.
    assert not answer.available and answer.reason.startswith("Pallas Triton unavailable in jax"), answer
    assert "ValueError: Cannot lower pallas_call" in answer.reason or jax.default_backend() != "cpu", answer


# ----------------------------------------------------------------------------- small_seq

def _small_seq_call(dtype="float32"):
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((6, 1, 4, 16)), dtype)
    k, v = (jnp.asarray(rng.standard_normal((6, 8, 4, 16)), dtype) for _ in range(2))
    call = prepare_call(q, k, v)
    return call, jax.jit(lambda q, k, v: small_seq_attention(call.spec, q, k, v, call.inputs)), (q, k, v)


def test_small_seq_runs_the_kernel_where_triton_lowers(one_gpu):
    call, run, arrays = _small_seq_call()
    run(*arrays)
    assert one_gpu == [1]
    reason = SMALL_SEQ.support(call.spec, None, training=False).reason
    assert "one Pallas Triton kernel" in reason, reason


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_small_seq_without_triton_runs_its_xla_formulation(one_gpu, monkeypatch, dtype):
    call, run, arrays = _small_seq_call(dtype)
    kernel_out, kernel_lse = run(*arrays)  # the regular path: the kernel
    assert one_gpu == [1]
    with monkeypatch.context() as off:
        off.setenv(SMALL_SEQ_KERNEL.name, "0")
        want_out, want_lse = jax.jit(lambda q, k, v: small_seq_attention(call.spec, q, k, v, call.inputs))(*arrays)
    _unimportable(monkeypatch, "jax.experimental.pallas", "triton")
    pallas_triton._probe.cache_clear()
    out, lse = jax.jit(lambda q, k, v: small_seq_attention(call.spec, q, k, v, call.inputs))(*arrays)
    assert one_gpu == [1]  # the kernel did not run again
    # Bit for bit the XLA formulation; the kernel's result up to the order of its sums.
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(want_out, np.float32))
    np.testing.assert_array_equal(lse, want_lse)
    tolerance = 2e-5 if dtype == "float32" else 1e-2
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(kernel_out, np.float32),
                               rtol=tolerance, atol=tolerance)
    np.testing.assert_allclose(lse, kernel_lse, rtol=1e-5, atol=1e-5)
    answer = SMALL_SEQ.support(call.spec, None, training=False)
    assert answer.supported and answer.backend == "small_seq"
    assert answer.reason.startswith("Pallas Triton unavailable in jax"), answer.reason
    assert answer.reason.endswith("; small_seq runs its XLA formulation"), answer.reason


def test_small_seq_support_names_the_formulation_and_why(monkeypatch):
    call, _, (q, k, v) = _small_seq_call()
    if jax.default_backend() == "cpu":
        assert SMALL_SEQ.support(call.spec, None, training=True).reason == (
            "the Pallas kernel runs on a GPU only; small_seq runs its XLA formulation")
    causal = prepare_call(q, k, v, is_causal=True).spec
    assert "nothing to mask or modify" in SMALL_SEQ.support(causal, None, training=True).reason
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(jax, "device_count", lambda: 1)
    wide = prepare_call(q, jnp.concatenate([k, k[:, :4]], 1), jnp.concatenate([v, v[:, :4]], 1)).spec
    assert SMALL_SEQ.support(wide, None, training=True).reason.startswith("S=12: ")
    assert not SMALL_SEQ.support(prepare_call(q, jnp.tile(k, (1, 8, 1, 1)), jnp.tile(v, (1, 8, 1, 1))).spec,
                                 None, training=True).supported  # S 64: outside the regime


# ----------------------------------------------------------------------------- the bin packer

def test_the_packer_without_triton_places_what_the_kernel_places(triton_removed):
    rng = np.random.default_rng(1)
    for rows, bins in [(64, 40), (64, 1), (128, 40)]:
        lengths = np.sort(rng.integers(1, rows, size=int(rng.integers(20, 60))))[::-1]
        lengths = jnp.asarray(np.concatenate([lengths, np.zeros(7, np.int64)]), jnp.int32)
        kernel = bin_packer.pack(lengths, rows, bins, interpret=True)  # the kernel, in Pallas' interpreter
        xla = jax.jit(bin_packer.pack, static_argnums=(1, 2))(lengths, rows, bins)
        for got, want in zip(xla, kernel):
            np.testing.assert_array_equal(got, want)
    assert bin_packer.formulation().endswith("; the bin packer runs its XLA formulation (a loop of kernels)")
    assert bin_packer.formulation().startswith("Pallas Triton unavailable in jax")


def test_the_packer_names_its_kernel_where_triton_lowers():
    pytest.importorskip("jax.experimental.pallas.triton")
    assert bin_packer.formulation() == "the bin packer runs as one Pallas Triton kernel"


def test_a_binned_call_without_triton_matches_the_kernel_path(triton_removed):
    rng = np.random.default_rng(2)
    ids = random_documents(rng, 2, 512, 8, 96, padding=5)
    call, q, k, v = prepared(rng, ids, hint=96)
    plan = bin_plan(call.spec, call.score_mod)
    assert plan is not None
    run = xla_in_place_of_cudnn(call.score_mod)

    def binned(interpret):
        return jax.jit(lambda q, k, v: packed_bins.attention(plan, call.spec, q, k, v, call.inputs, run,
                                                             interpret=interpret))(q, k, v)

    for got, want in zip(binned(False), binned(True)):
        np.testing.assert_array_equal(got, want)


def test_the_switch_forces_the_xla_formulations(monkeypatch):
    monkeypatch.setenv("SDPAGRAPH_PALLAS_TRITON", "0")
    answer = pallas_triton.status()
    assert not answer.available and answer.reason == "SDPAGRAPH_PALLAS_TRITON=0"
    assert "XLA formulation" in bin_packer.formulation()
    q = jax.ShapeDtypeStruct((4096, 1, 4, 16), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((4096, 8, 4, 16), jnp.bfloat16)
    said = sdpagraph.check_support(q, kv, kv, implementation="small_seq", training=False)
    assert said.backend == "small_seq" and "small_seq runs its XLA formulation" in said.reason
    monkeypatch.setenv("SDPAGRAPH_PALLAS_TRITON", "1")
    assert pallas_triton.status().available
