"""The numerical check of paged K/V graphs (a spec with `paged`), on the CPU.

A paged graph's k and v are pools of pages read through a page table, and it always takes the
sequence lengths. It is inference-only: its "training" graph is the forward one with softmax stats,
and no backward exists. The check draws a page table that scatters each sequence's pages over the
pool out of order (some pool pages unused), key lengths that end inside a page and, with
bottom-right causal alignment, hold every query's keys; the reference reads the same pool through
the same table. Its three ways of running a graph are shown: a candidate in one compiled program,
the cuDNN path's graph core replaced by XLA (`tests/test_numerics.fake_gpu`), and the direct run
with the graph evaluated on XLA (`tests/test_numerics_direct.standin`, `graph_on_xla`'s gather: a
cross-check of the reference's). Right graphs pass; a graph that reads the pages in reverse order,
ignores the table, or reads a partial last page whole or not at all fails.
"""
import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

import sdpagraph
from sdpagraph import graph_store as cached_graphs
from sdpagraph import paged
from sdpagraph.backends.cudnn import backend as cudnn_backend
from sdpagraph.backends.xla import BACKEND as XLA
from sdpagraph.cache import GraphCache
from sdpagraph.deploy.numerics import verify_numerics
from sdpagraph.deploy.spec_entry import SpecEntry
from sdpagraph.graphs.operands import PAGE_TABLES
from sdpagraph.numerics import check as numerics
from sdpagraph.numerics import direct as numerics_direct
from sdpagraph.numerics import draw as numerics_draw
from sdpagraph.numerics import gate as numerics_gate
from sdpagraph.spec import directions_for
from tests.test_numerics import entry_metas, fake_gpu, xla_core
from tests.test_numerics_direct import check as direct_check, standin

__all__ = ["fake_gpu"]  # a fixture of tests.test_numerics, which pytest finds here by name

N, K, H, PAGE = 8, 2, 16, 4  # GQA; more query heads than a slice keeps (MAX_HEADS)
BOTTOM_RIGHT = dict(is_causal=True, causal_alignment="bottom_right")
# (batch, T, pool pages, max pages per sequence, attention kwargs)
CONFIGS = {
    "decode": (3, 1, 24, 5, BOTTOM_RIGHT),  # T = 1: `prepare_paged_call` drops the causal mask
    "multi_token_bottom_right": (3, 4, 24, 5, BOTTOM_RIGHT),
    "prefill_chunk": (2, 8, 16, 6, dict(BOTTOM_RIGHT, query_seq_lengths=True)),
    "shared_pages": (5, 4, 12, 5, BOTTOM_RIGHT),  # a pool smaller than the tables: sequences share pages
    "no_key_lengths": (3, 2, 24, 5, dict(key_value_seq_lengths=False)),
}
# The budgets: whole; 3 of 5 batch rows (or all 3), 4 of 8 heads, 1 query row each.
SLICES = {"whole": numerics_draw.SLICE_ELEMENTS, "rows and heads": 1}


def paged_call(name, dtype=jnp.bfloat16, seed=0):
    """The prepared paged call of config `name`, on concrete random pools, table and lengths."""
    batch, t, pool, max_pages, kwargs = CONFIGS[name]
    kwargs = dict(kwargs)
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.standard_normal((batch, t, N, H)), dtype)
    k_pages, v_pages = (jnp.asarray(rng.standard_normal((pool, PAGE, K, H)), dtype) for _ in range(2))
    table = jnp.asarray(numerics_draw.random_page_table(rng, pool, batch, max_pages))
    if kwargs.pop("key_value_seq_lengths", True):
        kwargs["key_value_seq_lengths"] = jnp.asarray(rng.integers(t, max_pages * PAGE + 1, batch), jnp.int32)
    if kwargs.pop("query_seq_lengths", False):
        kwargs["query_seq_lengths"] = jnp.asarray(rng.integers(1, t + 1, batch), jnp.int32)
    call = paged.prepare_paged_call(q, k_pages, v_pages, table, **kwargs)
    return call, (q, k_pages, v_pages), kwargs


def paged_spec(name, dtype=jnp.bfloat16):
    return paged_call(name, dtype)[0].spec


def tampered(wrong, spec, table, kv_lengths):
    """(table (B, max_pages), key lengths (B,)) as a `wrong` graph reads them: "pages in reverse
    order", "ignores the table" (pool pages 0, 1, ... for every sequence), "reads the last page
    whole" (each length rounded up to whole pages), "drops a partial last page" (rounded down)."""
    if wrong == "pages in reverse order":
        table = table[:, ::-1]
    elif wrong == "ignores the table":
        table = jnp.broadcast_to(jnp.arange(table.shape[1], dtype=jnp.int32) % spec.paged[0], table.shape)
    elif wrong == "reads the last page whole":
        kv_lengths = jnp.minimum(-(-kv_lengths // PAGE) * PAGE, spec.kv_len)
    elif wrong == "drops a partial last page":
        kv_lengths = kv_lengths // PAGE * PAGE
    return table, kv_lengths


def candidate(wrong=None):
    """A paged graph on XLA (the backend gathers the pools through the table): right, or `wrong`
    (`tampered`)."""
    def run(spec, q, k_pages, v_pages, inputs, ir, training=True):
        assert k_pages.shape[:2] == spec.paged and inputs.page_table is not None
        lengths = jnp.full((spec.batch,), spec.kv_len, jnp.int32) if inputs.kv_lengths is None else inputs.kv_lengths
        table, lengths = tampered(wrong, spec, inputs.page_table, lengths)
        return XLA.attention(spec, q, k_pages, v_pages, dataclasses.replace(inputs, page_table=table,
                                                                             kv_lengths=lengths), ir)
    return run


# ----------------------------------------------------------------------------- what is drawn

def test_the_page_table_scatters_each_sequence_over_the_pool_out_of_order():
    spec = paged_spec("multi_token_bottom_right")
    tables = [numerics_draw.host_inputs(spec, None, seed)["arrays"]["page_table"] for seed in range(20)]
    for table in tables:
        assert table.shape == (3, 5) and table.dtype == np.int32
        assert len(np.unique(table)) == 15 and table.min() >= 0 and table.max() < 24  # 9 pool pages unused
    assert len({table.tobytes() for table in tables}) == 20
    out_of_order = [np.any(np.diff(row) < 0) for table in tables for row in table]
    assert np.mean(out_of_order) > 0.9
    shared = numerics_draw.host_inputs(paged_spec("shared_pages"), None, 0)["arrays"]["page_table"]
    assert shared.shape == (5, 5) and set(np.unique(shared)) == set(range(12))  # 25 entries, 12 pages


@pytest.mark.parametrize("name", ["decode", "multi_token_bottom_right", "prefill_chunk"])
def test_key_lengths_end_inside_a_page_and_hold_every_query(name):
    spec = paged_spec(name)
    for seed in range(20):
        arrays = numerics_draw.host_inputs(spec, None, seed)["arrays"]
        lengths = arrays["kv_lengths"]
        assert lengths[-1] == spec.kv_len and np.all(lengths[:-1] % PAGE != 0)  # full pages; partial last pages
        assert lengths.min() >= (spec.q_len if spec.is_causal else 1)
        if spec.has_q_lengths:
            assert 1 <= arrays["q_lengths"].min() and arrays["q_lengths"].max() <= spec.q_len
    assert "kv_lengths" not in numerics_draw.host_inputs(paged_spec("no_key_lengths"), None, 0)["arrays"]


def test_the_direct_run_s_reference_reads_the_keys_the_graph_reads(fake_gpu):
    """The keys and values the reference gets are the pools read through the drawn table (the
    runtime's `paged.gather`), for the slice's rows and kv heads; also from pools over POOL_VALUES
    elements, which the check tiles from a random pool."""
    spec = dataclasses.replace(paged_spec("decode"), batch=2, kv_len=64 * 16, num_heads=4, head_dim=128,
                               head_dim_v=128, paged=(1100, 16))
    assert 1100 * 16 * K * 128 > numerics_direct.POOL_VALUES
    chosen = numerics_draw.plan_slice(spec, 1, np.random.default_rng(0))
    host = numerics_draw.host_inputs(spec, None, 3)
    data, _ = numerics_direct.run_direct(spec, None, False, chosen, host, 3, execute=standin(spec, None))
    inputs = numerics_direct.draw_inputs(spec, None, 3)
    table = host["arrays"]["page_table"]
    for role in ("k", "v"):
        pool = np.asarray(inputs[role])  # a `Tiled` pool, whole
        keys = np.asarray(paged.gather(pool, table))[list(chosen.rows)][:, :, list(chosen.kv_heads)]
        np.testing.assert_array_equal(np.asarray(data[role]), keys)


# ----------------------------------------------------------------------------- a candidate in one program

@pytest.mark.parametrize("name", CONFIGS)
def test_the_reference_on_the_gathered_keys_matches_the_xla_backend(name):
    """In float32, on every slice, the reference's o and logsumexp agree with XLA's attention on the
    pools to float32 rounding."""
    spec = paged_spec(name, jnp.float32)
    for where, elements in SLICES.items():
        result = numerics.check_numerics(spec, None, True, candidate=candidate(), slice_elements=elements, seed=3)
        assert set(result.errors) == {"o", "lse", "empty_rows"}, result.errors
        assert all(error < 2e-5 for error in result.errors.values()), (name, where, result.errors)
        assert (result.slice == "whole") == (where == "whole") and "dk and dv" not in result.slice


@pytest.mark.parametrize("name", CONFIGS)
def test_a_right_paged_graph_passes(name):
    spec = paged_spec(name)
    for training, outputs in ((True, {"o", "lse", "empty_rows"}), (False, {"o", "empty_rows"})):
        for elements in SLICES.values():
            result = numerics.check_numerics(spec, None, training, candidate=candidate(), slice_elements=elements)
            assert result.passed and set(result.errors) == outputs, (name, training, result.summary())
            assert 0 < result.errors["o"] < 1e-2


WRONG = ["pages in reverse order", "ignores the table", "reads the last page whole", "drops a partial last page"]


@pytest.mark.parametrize("wrong", WRONG)
@pytest.mark.parametrize("name", ["decode", "multi_token_bottom_right", "prefill_chunk"])
def test_a_wrong_paged_graph_fails(name, wrong):
    spec = paged_spec(name)
    for seed in range(2):
        for elements in SLICES.values():
            result = numerics.check_numerics(spec, None, True, candidate=candidate(wrong), slice_elements=elements,
                                             seed=seed)
            assert "o" in result.failures() and result.errors["o"] > 5e-2, (seed, result.summary())


# ----------------------------------------------------------------------------- the direct run

def direct_standin(spec, wrong=None):
    """`standin` (the graph on XLA through the executor's interface, `graph_on_xla` gathering the
    pools), reading its table and key lengths as a `wrong` graph does (`tampered`)."""
    right = standin(spec, None)

    def execute(graph, operands, results, scalars):
        table = operands[PAGE_TABLES[0]].reshape(spec.batch, -1)
        table, lengths = tampered(wrong, spec, jnp.asarray(table), jnp.asarray(operands["seq_len_kv"]))
        table = np.asarray(table).reshape(spec.batch, 1, -1, 1)
        given = {**operands, **{role: table for role in PAGE_TABLES}, "seq_len_kv": np.asarray(lengths)}
        return right(graph, given, results, scalars)
    return execute


@pytest.mark.parametrize("name", CONFIGS)
def test_the_direct_run_of_right_paged_graphs_passes(fake_gpu, name):
    spec = paged_spec(name)
    for training, outputs in ((True, {"o", "lse", "empty_rows"}), (False, {"o", "empty_rows"})):
        for elements in SLICES.values():
            errors = direct_check(spec, None, training, direct_standin(spec), elements)
            assert set(errors) == outputs and all(errors[key] < 1e-2 for key in errors), (name, training, errors)


@pytest.mark.parametrize("wrong", WRONG)
def test_the_direct_run_of_a_wrong_paged_graph_fails(fake_gpu, wrong):
    spec = paged_spec("multi_token_bottom_right")
    for elements in SLICES.values():
        errors = direct_check(spec, None, True, direct_standin(spec, wrong), elements)
        assert errors["o"] > 5e-2, errors


def test_the_direct_run_checks_the_spec_s_own_forward_graph_and_no_backward(fake_gpu, monkeypatch):
    """Through the gate, as on a GPU: a multi-token decode's check runs its own paged graph (not the
    folded prefix the runtime may run in its place), forward with its stats, and no backward."""
    spec = paged_spec("multi_token_bottom_right")
    ran = []
    real, execute = numerics_direct.run_direct, direct_standin(spec)

    def recording(graph, operands, results, scalars):
        ran.append((graph.key, graph.compiled.direction, set(results)))
        return execute(graph, operands, results, scalars)

    monkeypatch.setattr(numerics_direct, "available", lambda: True)
    monkeypatch.setattr(numerics_direct, "run_direct", lambda *args: real(*args, execute=recording))
    answer = cached_graphs.check_graphs(spec, None, True, fake_gpu, verify=numerics_gate.checked)
    assert answer.supported, answer.reason
    own = cached_graphs.graph_key(spec, None, "forward")
    assert [(key, direction, results) for key, direction, results in ran if key == own] == [
        (own, "forward", {"o", "stats"})]
    assert all(direction == "forward" for _, direction, _ in ran)  # the folded prefix's, checked after
    [record] = entry_metas(fake_gpu, spec, None)
    assert record["passed"] and set(record["errors"]) == {"o", "lse", "empty_rows"}


# ----------------------------------------------------------------------------- the gate on the cuDNN path

def wrong_core(wrong):
    """The cuDNN path's graph core reading its table and key lengths as a `wrong` graph does."""
    def core(static, q, k, v, bias, aux, validity, sinks=None):
        spec = static.graph_spec
        if spec.paged is not None:
            table, lengths = tampered(wrong, spec, aux[PAGE_TABLES[0]].reshape(spec.batch, -1), aux["seq_len_kv"])
            aux = {**aux, **{role: table.reshape(spec.batch, 1, -1, 1) for role in PAGE_TABLES}, "seq_len_kv": lengths}
        return xla_core(static, q, k, v, bias, aux, validity, sinks)
    return core


@pytest.mark.parametrize("name", ["decode", "multi_token_bottom_right"])
def test_the_gate_passes_right_paged_graphs_and_records_exactly_the_graphs_they_have(fake_gpu, name):
    spec = paged_spec(name)
    for training, direction, outputs in ((True, "forward", {"o", "lse", "empty_rows"}),
                                         (False, "inference", {"o", "empty_rows"})):
        answer = cached_graphs.check_graphs(spec, None, training, fake_gpu, verify=numerics_gate.checked)
        assert answer.supported, answer.reason
        [(key, record)] = numerics_gate.numerics_records(spec, None, training, fake_gpu)
        assert key.direction == direction and record["passed"] is True, record
        assert set(record["errors"]) == outputs and 0 < record["errors"]["o"] < 1e-2
    assert fake_gpu.get(cached_graphs.graph_key(spec, None, "backward")) is None  # none built, none checked


@pytest.mark.parametrize("wrong", WRONG)
@pytest.mark.parametrize("name", ["decode", "multi_token_bottom_right"])
def test_the_gate_refuses_wrong_paged_graphs_and_the_call_runs_on_xla(fake_gpu, monkeypatch, name, wrong):
    monkeypatch.setattr(cudnn_backend, "_core", wrong_core(wrong))
    call, (q, k_pages, v_pages), kwargs = paged_call(name, seed=1)
    answer = cached_graphs.check_graphs(call.spec, None, True, fake_gpu, verify=numerics_gate.checked)
    assert not answer.supported and "o error " in answer.reason, answer.reason
    assert answer.reason.startswith("cuDNN's graph for this config computed wrong values")  # one graph
    assert [record["passed"] for record in entry_metas(fake_gpu, call.spec, None)] == [False]
    table = call.inputs.page_table
    support = sdpagraph.check_support(q, k_pages, v_pages, page_table=table, **kwargs)
    assert not support.supported and support.backend == "xla", support.reason
    out = sdpagraph.attention(q, k_pages, v_pages, page_table=table, **kwargs)
    expected = sdpagraph.attention(q, k_pages, v_pages, page_table=table, implementation="xla", **kwargs)
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(expected, np.float32))


def test_verify_numerics_checks_and_records_a_paged_entry_s_one_graph(fake_gpu):
    spec = paged_spec("multi_token_bottom_right")
    assert cached_graphs.check_graphs(spec, None, True, fake_gpu).supported  # built, not checked
    entry = SpecEntry(spec, None, directions_for(True, spec))
    assert entry.directions == ("forward",)
    report = verify_numerics([entry], fake_gpu.directory, progress=False)
    assert report.exit_code == 0 and set(report.checks[0].errors) == {"o", "lse", "empty_rows"}
    assert report.text().splitlines()[0].split()[:5] == ["#", "STATUS", "O", "LSE", "EMPTY_ROWS"]
    [record] = entry_metas(GraphCache(fake_gpu.directory), spec, None)
    assert record["passed"] is True and record["errors"] == report.checks[0].errors
