"""The numerical check of graphs with cuDNN's attention sinks (a spec with `sinks`), on the CPU.

Such a graph takes the sinks' logits (`sink_token`, one per query head). It has no backward graph
(`spec.directions_for`): its "training" graph is the forward one with softmax stats (a call with
sinks runs the backward graph of its spec without sinks, checked as that spec). The check draws
sinks that take sizable shares of the rows, puts them in the reference's softmax, and compares o
and, for the forward graph, the logsumexp. Its three ways of running a graph are shown: a
candidate in one compiled program (`check_numerics(candidate=...)`), the cuDNN path's graph core
replaced by XLA (`tests/test_numerics.fake_gpu`), and the direct run with the graph evaluated on
XLA (`tests/test_numerics_direct.standin`). Right graphs pass; a graph that ignores the sinks, or
reads other heads' sinks, fails.
"""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import sdpagraph
from sdpagraph import graph_store as cached_graphs
from sdpagraph import mods
from sdpagraph.backends import sinks as sinks_mod
from sdpagraph.backends.cudnn import backend as cudnn_backend
from sdpagraph.backends.cudnn.graph_on_xla import graph_forward_without_sinks
from sdpagraph.backends.xla import xla_attention
from sdpagraph.cache import GraphCache
from sdpagraph.deploy.numerics import verify_numerics
from sdpagraph.deploy.spec_entry import SpecEntry
from sdpagraph.graphs.operands import SINK_TOKEN
from sdpagraph.numerics import check as numerics
from sdpagraph.numerics import direct as numerics_direct
from sdpagraph.numerics import draw as numerics_draw
from sdpagraph.numerics import gate as numerics_gate
from sdpagraph.spec import directions_for
from tests.test_numerics import KWARGS, arrays, call_of, entry_metas, fake_gpu, spec_and_ir, xla_core
from tests.test_numerics_direct import check as direct_check, standin

__all__ = ["fake_gpu"]  # a fixture of tests.test_numerics, which pytest finds here by name

N, K = 8, 2  # more query heads than a slice keeps (MAX_HEADS)
LENGTHS = jax.ShapeDtypeStruct((4,), jnp.int32)
CONFIGS = {
    "causal_softcap_gqa": dict(is_causal=True, score_mod=mods.softcap(20.0)),
    # the mask empties query row 12: rows with nothing to attend, where only the sink is left
    "bias_mask_causal": dict(bias=jax.ShapeDtypeStruct((1, N, 24, 24), jnp.float32),
                             mask=jax.ShapeDtypeStruct((4, 1, 24, 24), jnp.bool_), is_causal=True),
    "padding_bottom_right_window": dict(query_seq_lengths=LENGTHS, key_value_seq_lengths=LENGTHS, is_causal=True,
                                        causal_alignment="bottom_right", local_window_size=(5, 0)),
}
# The budgets: whole; whole batch rows and heads with 3 of 24 query rows; 3 batch rows, 4 of 8 heads,
# 1 query row each.
SLICES = {"whole": numerics_draw.SLICE_ELEMENTS, "query rows": 3000, "rows and heads": 1}
# What the graphs of (training) give: the forward graph's o and logsumexp, the inference graph's o.
OUTPUTS = {True: {"o", "lse", "empty_rows"}, False: {"o", "empty_rows"}}
WRONG = ["ignores the sinks", "sinks of other heads"]


def sinks_spec(name, dtype=jnp.bfloat16):
    config = dict(CONFIGS[name])
    if "bias" in config:
        config["bias"] = jax.ShapeDtypeStruct(config["bias"].shape, dtype)
    spec, ir = spec_and_ir(heads=(N, K), dtype=dtype, **config)
    return dataclasses.replace(spec, sinks=True), ir


def candidate(wrong=None):
    """A graph with sinks on XLA (the backend's attention, the sinks composed from its logsumexp):
    right, or `wrong`: "ignores the sinks", "sinks of other heads" (reversed)."""
    def run(spec, q, k, v, inputs, ir, training=True, sinks=None):
        assert sinks is not None and sinks.shape == (spec.num_heads,)
        if wrong == "sinks of other heads":
            sinks = sinks[::-1]
        out, lse = xla_attention(dataclasses.replace(spec, sinks=False), q, k, v, inputs, ir)
        return (out, lse) if wrong == "ignores the sinks" else sinks_mod.apply(out, lse, sinks)
    return run


# ----------------------------------------------------------------------------- what is drawn and compared

def test_drawn_sinks_take_sizable_shares_of_the_rows():
    spec, _ = sinks_spec("causal_softcap_gqa")
    sinks = numerics_draw.host_inputs(spec, None, 0)["arrays"]["sinks"]
    assert sinks.shape == (N,) and sinks.dtype == np.float32
    # around log(S), where a sink takes half of a row of logits 0; some far above, some negative
    offsets = [numerics_draw.host_inputs(spec, None, seed)["arrays"]["sinks"] - np.log(spec.kv_len)
               for seed in range(50)]
    assert abs(np.mean(offsets)) < 0.5 and 2 < np.std(offsets) < 4
    assert np.max(offsets) > 4 and np.min(offsets) < -np.log(spec.kv_len)
    assert "sinks" not in numerics_draw.host_inputs(dataclasses.replace(spec, sinks=False), None, 0)["arrays"]


@pytest.mark.parametrize("name", CONFIGS)
def test_the_reference_with_sinks_matches_the_xla_backend(name):
    """In float32, on every slice, the reference's o and logsumexp agree with XLA's attention with
    sinks to float32 rounding; training checks the forward graph alone (no backward exists)."""
    spec, ir = sinks_spec(name, jnp.float32)
    assert directions_for(True, spec) == ("forward",)
    for where, elements in SLICES.items():
        result = numerics.check_numerics(spec, ir, True, candidate=candidate(), slice_elements=elements, seed=3)
        assert (result.slice == "whole") == (where == "whole") and "dk and dv" not in result.slice, result.slice
        assert set(result.errors) == OUTPUTS[True], result.errors
        assert all(error < 2e-5 for error in result.errors.values()), (name, result.slice, result.errors)
    assert result.slice.startswith("batch rows") and "heads [0, " in result.slice and ", 7]" in result.slice


# ----------------------------------------------------------------------------- a candidate in one program

@pytest.mark.parametrize("name", CONFIGS)
@pytest.mark.parametrize("where", ["whole", "rows and heads"])
def test_a_right_graph_with_sinks_passes(name, where):
    spec, ir = sinks_spec(name)
    for training in (True, False):
        result = numerics.check_numerics(spec, ir, training, candidate=candidate(), slice_elements=SLICES[where])
        assert result.passed and set(result.errors) == OUTPUTS[training], (name, training, result.summary())
        assert 0 < result.errors["o"] < 1e-2


@pytest.mark.parametrize("wrong", WRONG)
@pytest.mark.parametrize("where", ["whole", "rows and heads"])
def test_a_wrong_graph_with_sinks_fails(wrong, where):
    spec, ir = sinks_spec("causal_softcap_gqa")
    for training in (True, False):
        outputs = OUTPUTS[training] - {"empty_rows"}
        for seed in range(2):
            result = numerics.check_numerics(spec, ir, training, candidate=candidate(wrong),
                                             slice_elements=SLICES[where], seed=seed)
            assert set(result.failures()) == outputs, (training, seed, result.summary())
            assert all(result.errors[name] > 0.2 for name in outputs), (training, seed, result.summary())


# ----------------------------------------------------------------------------- the cuDNN path's graph core

def core_ignoring_the_sinks(static, q, k, v, bias, aux, validity, sinks=None):
    """A graph with sinks that leaves them out of its softmax (right where the graph has none)."""
    if not static.graph_spec.sinks:
        return xla_core(static, q, k, v, bias, aux, validity, sinks)
    return graph_forward_without_sinks(static, aux)(q, k, v, bias)


def core_with_other_heads_sinks(static, q, k, v, bias, aux, validity, sinks=None):
    """A graph with sinks that reads them in reverse head order (right where the graph has none)."""
    if static.graph_spec.sinks:
        sinks = sinks[::-1]
    return xla_core(static, q, k, v, bias, aux, validity, sinks)


def test_the_gate_passes_right_graphs_with_sinks_and_records_exactly_the_graphs_they_have(fake_gpu):
    q, k, v = arrays()
    call = call_of(q, k, v, **KWARGS)
    spec = dataclasses.replace(call.spec, sinks=True)
    for training, direction in ((True, "forward"), (False, "inference")):
        answer = cached_graphs.check_graphs(spec, call.score_mod, training, fake_gpu, verify=numerics_gate.checked)
        assert answer.supported, answer.reason
        [(key, record)] = numerics_gate.numerics_records(spec, call.score_mod, training, fake_gpu)
        assert key.direction == direction and record["passed"] is True, record
        assert set(record["errors"]) == OUTPUTS[training] and 0 < record["errors"]["o"] < 1e-2
    assert fake_gpu.get(cached_graphs.graph_key(spec, call.score_mod, "backward")) is None  # none built, none checked


def test_verify_numerics_checks_and_records_a_sinks_entry_s_one_training_graph(fake_gpu):
    q, k, v = arrays(2)
    call = call_of(q, k, v, **KWARGS)
    spec = dataclasses.replace(call.spec, sinks=True)
    assert cached_graphs.check_graphs(spec, call.score_mod, True, fake_gpu).supported  # built, not checked
    entry = SpecEntry(spec, call.score_mod, directions_for(True, spec))
    assert entry.directions == ("forward",)
    report = verify_numerics([entry], fake_gpu.directory, progress=False)
    assert report.exit_code == 0 and set(report.checks[0].errors) == OUTPUTS[True], report.text()
    assert report.text().splitlines()[0].split()[:5] == ["#", "STATUS", "O", "LSE", "EMPTY_ROWS"]
    [record] = entry_metas(GraphCache(fake_gpu.directory), spec, call.score_mod)
    assert record["passed"] is True and record["errors"] == report.checks[0].errors


@pytest.mark.parametrize("core", [core_ignoring_the_sinks, core_with_other_heads_sinks])
def test_the_gate_refuses_wrong_graphs_with_sinks(fake_gpu, monkeypatch, core):
    monkeypatch.setattr(cudnn_backend, "_core", core)
    q, k, v = arrays(1)
    call = call_of(q, k, v, **KWARGS)
    spec = dataclasses.replace(call.spec, sinks=True)
    for training in (True, False):
        answer = cached_graphs.check_graphs(spec, call.score_mod, training, fake_gpu, verify=numerics_gate.checked)
        assert not answer.supported and "o error " in answer.reason, answer.reason
        assert [record["passed"] for record in entry_metas(fake_gpu, spec, call.score_mod, training)] == [False]
    # The graphs without sinks are right: the call composes the sinks on them, with XLA's values.
    sinks = jnp.linspace(-2.0, 4.0, q.shape[2], dtype=jnp.float32)
    out = sdpagraph.attention(q, k, v, sinks=sinks, implementation="cudnn", **KWARGS)
    expected = sdpagraph.attention(q, k, v, sinks=sinks, implementation="xla", **KWARGS)
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(expected, np.float32), atol=2e-2)


# ----------------------------------------------------------------------------- the direct run

def direct_standin(spec, ir, wrong=None):
    """`standin` (the graph on XLA through the executor's interface); `wrong`: "ignores the sinks"
    (the sink_token operand read as -inf: no sink), "sinks of other heads" (read reversed)."""
    right = standin(spec, ir)

    def execute(graph, operands, results, scalars):
        sink = operands[SINK_TOKEN]
        if wrong == "ignores the sinks":
            sink = np.full_like(sink, -np.inf)
        elif wrong == "sinks of other heads":
            sink = np.ascontiguousarray(sink[:, ::-1])
        return right(graph, {**operands, SINK_TOKEN: sink}, results, scalars)
    return execute


@pytest.mark.parametrize("name", CONFIGS)
@pytest.mark.parametrize("where", ["whole", "rows and heads"])
def test_the_direct_run_of_right_graphs_with_sinks_passes(fake_gpu, name, where):
    spec, ir = sinks_spec(name)
    for training in (True, False):
        errors = direct_check(spec, ir, training, direct_standin(spec, ir), SLICES[where])
        assert set(errors) == set(numerics.tolerances_for(spec, training, spec.bias_shape is not None))
        assert set(errors) == OUTPUTS[training] and all(errors[key] < 1e-2 for key in errors), (name, errors)


def test_the_direct_run_gives_a_row_with_nothing_to_attend_the_sink_s_logit(fake_gpu):
    spec, ir = sinks_spec("bias_mask_causal")
    chosen = numerics_draw.plan_slice(spec, 1, np.random.default_rng(0))
    host = numerics_draw.host_inputs(spec, ir, 0)
    data, _ = numerics_direct.run_direct(spec, ir, True, chosen, host, 0, execute=direct_standin(spec, ir))
    assert chosen.queries[0][0] == (12,) and not np.asarray(data["allowed"])[0, 0, 0].any()
    assert (np.asarray(data["o"], np.float32)[0, 0, 0] == 0).all()
    assert data["lse"][0, 0, 0] == host["arrays"]["sinks"][chosen.heads[0]]
    np.testing.assert_array_equal(data["sinks"], host["arrays"]["sinks"][list(chosen.heads)])


@pytest.mark.parametrize("wrong", WRONG)
def test_the_direct_run_of_a_wrong_graph_with_sinks_fails(fake_gpu, wrong):
    spec, ir = sinks_spec("causal_softcap_gqa")
    for training in (True, False):
        for elements in (SLICES["whole"], SLICES["rows and heads"]):
            errors = direct_check(spec, ir, training, direct_standin(spec, ir, wrong), elements)
            assert errors["o"] > 5e-2, (training, errors)
