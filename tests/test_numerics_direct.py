"""The numerical check's direct run (`numerics.direct`), on the CPU.

On a GPU the check runs each graph through the executor, outside XLA, on operands it makes in
NumPy, and turns the graph's results into what `attention` returns. Here the graph runs on a
stand-in that computes what the graph computes from its own operands (tests/test_sharding.py's
`fake_executor`: packed sequences from the ragged offsets, padding from the sequence lengths,
masks from the bias operand, the dense twin's segment bounds). A right stand-in must pass every
layout with errors of bf16 rounding; a wrong one must fail, naming the output it got wrong.
"""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sdpagraph import mods
from sdpagraph.graphs.operands import graph_spec
from sdpagraph.backends.cudnn import execute as cudnn_execute
from sdpagraph.numerics import check as numerics
from sdpagraph.numerics import direct as numerics_direct
from sdpagraph.numerics import draw as numerics_draw
from tests.test_numerics import fake_gpu, spec_and_ir
from tests.test_sharding import fake_executor

__all__ = ["fake_gpu"]  # a fixture of tests.test_numerics, which pytest finds here by name

IDS = jax.ShapeDtypeStruct((4, 24), jnp.int32)
LENGTHS = jax.ShapeDtypeStruct((4,), jnp.int32)
CONFIGS = {
    "causal_softcap_gqa": dict(is_causal=True, score_mod=mods.softcap(20.0)),
    "padding_bottom_right_window": dict(query_seq_lengths=LENGTHS, key_value_seq_lengths=LENGTHS, is_causal=True,
                                        causal_alignment="bottom_right", local_window_size=(5, 0)),
    "padding_folded_into_a_mod": dict(key_value_seq_lengths=LENGTHS, score_mod=mods.softcap(10.0)),
    "bias_mask_alibi": dict(bias=jax.ShapeDtypeStruct((1, 4, 24, 24), jnp.bfloat16),
                            mask=jax.ShapeDtypeStruct((4, 1, 24, 24), jnp.bool_), is_causal=True,
                            score_mod=mods.alibi(np.linspace(0.1, 0.4, 4).astype(np.float32))),
    "chunked": dict(chunk_size=8, is_causal=True),
    "packed_causal": dict(segment_ids=IDS, max_segments_per_seq=3, is_causal=True),
    "packed_cross_bottom_right": dict(segment_ids=(IDS, IDS), max_segments_per_seq=4, is_causal=True,
                                      causal_alignment="bottom_right"),
    "packed_softcap_dense_twin": dict(segment_ids=IDS, max_segments_per_seq=8, is_causal=True,
                                      score_mod=mods.softcap(20.0)),
    # The check's segments keep to the length hint, as the call's must.
    "packed_softcap_dense_twin_length_hint": dict(segment_ids=IDS, max_segments_per_seq=8, is_causal=True,
                                                  score_mod=mods.softcap(20.0), max_seqlen_kv=5),
    "relative_bias_array": dict(is_causal=True, score_mod=mods.relative_position_bias(
        np.linspace(-1, 1, 4 * 9).reshape(4, 9).astype(np.float32), 4)),
}


def standin(spec, ir, wrong=None):
    """The graph on XLA; `wrong`: "scale" (q scaled by 1.5 in every graph) or "dk" (dk off by 50%)."""
    def execute(graph, operands, results, scalars):
        static = cudnn_execute.Static(spec, graph_spec(spec, ir), ir, tuple(sorted(scalars.items())), True)
        given = {role: jnp.asarray(np.asarray(x)) for role, x in operands.items()}  # Tiled, Sparse: whole
        if wrong == "scale":
            given["q"] = (given["q"].astype(jnp.float32) * 1.5).astype(given["q"].dtype)
        shapes = {role: jax.ShapeDtypeStruct(result.shape, result.dtype) for role, result in results.items()}
        out = {role: np.asarray(x) for role, x in fake_executor(static, graph, given, shapes).items()}
        for role, result in results.items():  # as the arena returns them: only the tokens asked for
            if result.tokens is not None:
                out[role] = out[role].reshape(-1, *result.shape[2:])[np.asarray(result.tokens)]
        if wrong == "dk" and "dk" in out:
            out["dk"] = (out["dk"].astype(np.float32) * 1.5).astype(out["dk"].dtype)
        return out
    return execute


def check(spec, ir, training, execute, slice_elements=numerics_draw.SLICE_ELEMENTS, seed=5):
    chosen = numerics_draw.plan_slice(spec, slice_elements, np.random.default_rng([seed, 1]))
    host = numerics_draw.host_inputs(spec, ir, seed)
    data, _ = numerics_direct.run_direct(spec, ir, training, chosen, host, seed, execute=execute)
    return numerics.compare(spec, ir, training, chosen, data, host["scalars"])


@pytest.mark.parametrize("name", CONFIGS)
@pytest.mark.parametrize("elements", [numerics_draw.SLICE_ELEMENTS, 700])
def test_a_right_graph_passes_on_every_layout(fake_gpu, name, elements):
    spec, ir = spec_and_ir(**dict(CONFIGS[name]))
    seed = int(np.random.default_rng().integers(2**31))
    errors = check(spec, ir, True, standin(spec, ir), elements, seed)
    bounds = numerics.tolerances_for(spec, True, spec.bias_shape is not None)
    assert set(errors) == set(bounds), errors
    assert all(errors[key] <= min(bounds[key], 1e-2) for key in errors), (name, seed, errors)
    assert errors["o"] > 0  # the stand-in rounds to bf16: the comparison is real


def test_the_inference_graph_is_checked_alone(fake_gpu):
    spec, ir = spec_and_ir(**dict(CONFIGS["padding_bottom_right_window"]))
    errors = check(spec, ir, False, standin(spec, ir))
    assert set(errors) == {"o", "empty_rows"} and errors["o"] < 1e-2


@pytest.mark.parametrize("name", ["causal_softcap_gqa", "packed_causal", "bias_mask_alibi", "padding_folded_into_a_mod"])
@pytest.mark.parametrize("wrong,output", [("scale", "o"), ("dk", "dk")])
def test_a_wrong_graph_fails_on_the_output_it_gets_wrong(fake_gpu, name, wrong, output):
    spec, ir = spec_and_ir(**dict(CONFIGS[name]))
    errors = check(spec, ir, True, standin(spec, ir, wrong), slice_elements=700)
    assert errors[output] > 5e-2, errors


def test_a_masked_out_row_gives_zeros_as_attention_does(fake_gpu):
    """The mask empties query row 12; cuDNN averages over masked keys there, attention gives 0."""
    spec, ir = spec_and_ir(**dict(CONFIGS["bias_mask_alibi"]))
    chosen = numerics_draw.plan_slice(spec, 1, np.random.default_rng(0))
    assert chosen.queries[0][0] == (12,)
    host = numerics_draw.host_inputs(spec, ir, 0)
    data, _ = numerics_direct.run_direct(spec, ir, True, chosen, host, 0, execute=standin(spec, ir))
    assert not np.asarray(data["allowed"])[0, 0, 0].any()  # batch row 0, head 0: its query row 12
    assert (np.asarray(data["o"], np.float32)[0, 0, 0] == 0).all() and np.isneginf(data["lse"][0, 0, 0])


def test_random_io_values_are_finite_varied_and_in_range():
    rng = np.random.default_rng(0)
    for dtype in ("bfloat16", "float16"):
        x = numerics_direct.random_io(rng, (64, 128), dtype).astype(np.float32)
        magnitude = np.abs(x)
        assert np.isfinite(x).all() and magnitude.min() >= 0.125 and magnitude.max() < 2.0
        assert 0.4 < np.mean(x > 0) < 0.6 and len(np.unique(x)) > 500


def test_the_check_runs_directly_where_graphs_can(fake_gpu, monkeypatch):
    """With the executor and a GPU (faked), check_numerics compiles nothing: no XLA program."""
    spec, ir = spec_and_ir(**dict(CONFIGS["causal_softcap_gqa"]))
    real = numerics_direct.run_direct
    monkeypatch.setattr(numerics_direct, "available", lambda: True)
    monkeypatch.setattr(numerics_direct, "run_direct",
                        lambda *args: real(*args, execute=standin(spec, ir)))
    monkeypatch.setattr(numerics, "_run_compiled", None)  # calling it would fail
    result = numerics.check_numerics(spec, ir, True)
    assert result.passed, result.summary()
    assert set(result.timings) == {"run_s", "reference_s"}


def test_a_dense_twin_gets_the_segment_bounds_the_runtime_gives(fake_gpu):
    spec, ir = spec_and_ir(**dict(CONFIGS["packed_softcap_dense_twin"]))
    ids = np.array([[1, 1, 1, 2, 2, 0], [1, 2, 2, 2, 3, 3]], np.int32)
    small = dataclasses.replace(spec, batch=2, q_len=6, kv_len=6)
    layout = numerics_direct._layout(small, {"q_segment_ids": ids})
    plan = numerics_direct.plan_layout(small, ir)
    operands, _ = numerics_direct._graph_operands(plan, layout, {"q": None, "k": None, "v": None, "arrays": {},
                                                                 "bias": None, "mask": None})
    np.testing.assert_array_equal(operands["segment_start"][:, 0, :, 0], [[0, 0, 0, 3, 3, 5], [0, 1, 1, 1, 4, 4]])
    if "segment_end" in operands:
        np.testing.assert_array_equal(operands["segment_end"][:, 0, :, 0], [[2, 2, 2, 4, 4, 5], [0, 3, 3, 3, 5, 5]])
