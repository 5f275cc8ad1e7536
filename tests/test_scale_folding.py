"""A mod's leading scaling moved into cuDNN's attention scale (scoremod.scale_folding): the folded mod, run on
the score scaled by the factor, gives the original mod's scores and gradients; what does not fold keeps its form;
the attention scale travels with the graph (lowering, CompiledGraph) and is computed from the scalar at run time."""
import dataclasses

import jax.numpy as jnp
import msgpack
import numpy as np
import pytest

from sdpagraph import mods
from sdpagraph.graphs.compiled import CompiledGraph, scalar_bits
from sdpagraph.scoremod.ir import FLOAT
from sdpagraph.scoremod.ir_eval import evaluate
from sdpagraph.scoremod.jnp.convert import convert_jnp_score_mod
from sdpagraph.scoremod.scale_folding import fold_leading_scale, folded_scale, folds_leading_scale
from sdpagraph.scoremod.trace import TensorInfo, trace_score_mod

SCALAR = TensorInfo("scalar", FLOAT)


def graph_mod(fn, **scalars):
    return trace_score_mod(fn, {name: SCALAR for name in scalars}), scalars


def jnp_mod(fn):
    mod = convert_jnp_score_mod(fn)
    return mod.ir, dict(mod.scalars)


FOLDING = {
    "softcap": lambda: (trace_score_mod(mods.softcap(30.0), {"cap": SCALAR}), {"cap": 23.5}),
    "jnp softcap": lambda: jnp_mod(lambda s, b, h, i, j: 30.0 * jnp.tanh(s / 30.0)),
    "scalar temperature, factor first": lambda: graph_mod(lambda g, s, t: g.sigmoid(input=t["temp"] * s) * 4.0,
                                                          temp=0.37),
    "literal divisor": lambda: graph_mod(lambda g, s, t: g.tanh(input=s / 8.0) + s / 8.0),
    "literal multiplier, int": lambda: graph_mod(lambda g, s, t: g.exp(input=s * 2) - 1.0),
    "softcap, then a distance bias from positions of the score": lambda: graph_mod(
        lambda g, s, t: g.tanh(input=s / t["cap"]) * t["cap"]
        + (g.gen_index(input=s, axis=3) - g.gen_index(input=s, axis=2)) * 0.25, cap=17.0),
}


def index_arrays(shape):
    b, n, t, s = shape
    return (jnp.arange(b)[:, None, None, None], jnp.arange(n)[None, :, None, None],
            jnp.arange(t)[None, None, :, None], jnp.arange(s)[None, None, None, :])


def fresh_rng():
    seed = int(np.random.SeedSequence().entropy % 2**32)
    return np.random.default_rng(seed), f"seed {seed}"


@pytest.mark.parametrize("case", sorted(FOLDING))
def test_the_folded_mod_on_the_rescaled_score_is_the_mod(case):
    ir, scalars = FOLDING[case]()
    fold = fold_leading_scale(ir, "backward")
    assert fold is not None and fold.ir.grad_derived and len(fold.ir.nodes) < len(ir.nodes)
    kind, name_or_value = fold.factor
    factor = scalars[name_or_value] if kind == "scalar" else name_or_value
    rng, seed = fresh_rng()
    shape = (2, 3, 16, 24)
    score = jnp.asarray(rng.normal(size=shape) * 20, jnp.float32)
    dscore = jnp.asarray(rng.normal(size=shape), jnp.float32)
    index = index_arrays(shape)
    expected, expected_grad = evaluate(ir, score, scalars=scalars, arrays={}, index=index, dscore=dscore)

    # cuDNN hands the folded mod Q·Kᵀ times the folded scale, i.e. the original score times scale'/scale
    ratio = folded_scale(1.0, factor, fold.op)
    got, grad = evaluate(fold.ir, score * ratio, scalars=scalars, arrays={}, index=index, dscore=dscore)
    np.testing.assert_allclose(got, expected, rtol=2e-5, atol=2e-5, err_msg=seed)
    # and multiplies the bprop's result by the scale it ran with: d/d(original score) = ratio * d/d(its input)
    np.testing.assert_allclose(grad * ratio, expected_grad, rtol=2e-4, atol=2e-5, err_msg=seed)
    forward = fold_leading_scale(ir, "forward")  # forward graphs never run the bprop: none is derived
    assert forward.ir.grad_output is None and forward.factor == fold.factor and forward.op == fold.op


@pytest.mark.parametrize("fn, tensors, bprop", [
    (lambda g, s, t: s + g.tanh(input=s / t["cap"]), {"cap": SCALAR}, None),  # the score has another use
    (lambda g, s, t: g.tanh(input=s * t["slope"]), {"slope": TensorInfo("array", FLOAT, (1, 1, 1, 1))}, None),
    (lambda g, s, t: g.tanh(input=t["cap"] / s), {"cap": SCALAR}, None),  # the score is the divisor
    (lambda g, s, t: s, {}, None),  # nothing to fold
    (lambda g, s, t: s * 3.0, {}, None),  # the scaling is the whole mod
    (lambda g, s, t: g.tanh(input=s / 0.0), {}, None),  # a literal that is no factor
    (lambda g, s, t: g.tanh(input=s * s), {}, None),
])
def test_what_does_not_fold_keeps_its_form(fn, tensors, bprop):
    ir = trace_score_mod(fn, tensors, bprop)
    for direction in ("forward", "inference", "backward"):
        assert fold_leading_scale(ir, direction) is None and not folds_leading_scale(ir, direction)


def test_a_user_bprop_keeps_the_backward_graph_unfolded_and_the_key_says_which_graphs_fold():
    from sdpagraph.graphs.builder import SCALE_FOLDED, graph_identity
    from tests.test_builder_cpu import make_spec

    spec = make_spec(is_causal=True)
    derived = trace_score_mod(lambda g, s, t: g.tanh(input=s / t["cap"]), {"cap": SCALAR})
    user = trace_score_mod(lambda g, s, t: g.tanh(input=s / t["cap"]), {"cap": SCALAR}, lambda g, d, t: d * 0.5)
    assert fold_leading_scale(user, "backward") is None
    assert fold_leading_scale(user, "forward").ir.forward_digest == fold_leading_scale(derived, "forward").ir.forward_digest
    for ir, direction, folded in [(derived, "forward", True), (derived, "backward", True), (user, "inference", True),
                                  (user, "backward", False), (None, "forward", False),
                                  (trace_score_mod(lambda g, s, t: s + 1.0, {}), "forward", False)]:
        assert graph_identity(spec, ir, direction)[1].endswith(SCALE_FOLDED) is folded, (ir, direction)
    # the forward key ignores the bprop, and so does the fold of a forward graph
    assert graph_identity(spec, user, "forward") == graph_identity(spec, derived, "forward")


def test_one_graph_serves_every_cap_the_scale_is_computed_at_run_time():
    ir = trace_score_mod(mods.softcap(30.0), {"cap": SCALAR})
    assert fold_leading_scale(ir, "backward").factor == ("scalar", "cap")
    compiled = CompiledGraph(blob=b"plan", workspace_size=0, operand_roles=("q", "k", "v"), result_roles=("o",),
                             uids={"scalar:cap": 5, "attn_scale": 6},
                             pass_by_value=((5, ("scalar", "cap"), "float32"),
                                            (6, ("attn_scale", (0.125, "cap", "div")), "float32")),
                             direction="forward", versions={}, build_time_s=0.0)
    for cap in (20.0, 50.0):
        values = compiled.pass_by_value_values({"cap": cap})
        assert values[5] == np.float32(cap) and values[6] == np.float32(0.125 / cap)
        uids, bits = scalar_bits(compiled, {"cap": cap})
        assert list(uids) == [5, 6] and bits[1] == np.float32(0.125 / cap).view(np.int32)
    assert compiled.pass_by_value_values({"cap": 0.0})[6] == np.inf  # as the mod's own division by zero
    with pytest.raises(KeyError, match="'cap'"):
        compiled.pass_by_value_values({})
    meta = msgpack.unpackb(msgpack.packb(compiled.to_meta(), use_bin_type=True), raw=False)
    assert CompiledGraph.from_meta(compiled.blob, meta) == compiled
    temperature = dataclasses.replace(compiled, pass_by_value=((6, ("attn_scale", (0.125, "t", "mul")), "float32"),))
    assert temperature.pass_by_value_values({"t": 0.37})[6] == np.float32(0.125 * 0.37)


def test_a_literal_factor_becomes_a_float_scale_and_a_scalar_a_pass_by_value_tensor():
    cudnn = pytest.importorskip("cudnn")
    from sdpagraph.graphs.lowering import lower
    from tests.test_builder_cpu import FakeGraph, make_spec

    spec = make_spec(is_causal=True)
    for fn, tensors, expected in [
        (lambda g, s, t: g.tanh(input=s / 8.0) * 8.0, {}, spec.scale / 8.0),
        (mods.softcap(30.0), {"cap": SCALAR}, "tensor"),
        (lambda g, s, t: s + 1.0, {}, spec.scale),
    ]:
        for direction in ("forward", "backward"):
            graph = FakeGraph()
            lowering = lower(graph, spec, trace_score_mod(fn, tensors), direction, cudnn)
            (_, options), = graph.nodes
            if expected == "tensor":
                assert options["attn_scale"] is graph.tensors["attn_scale"]
                assert (lowering.uids["attn_scale"], ("attn_scale", (spec.scale, "cap", "div")), "float32") \
                    in lowering.pass_by_value
            else:
                assert options["attn_scale"] == pytest.approx(expected, rel=1e-12)
                assert "attn_scale" not in lowering.uids


@pytest.mark.parametrize("overrides", [dict(is_causal=True), dict(window=(16, 0), causal_alignment="bottom_right",
                                                                   q_len=64, kv_len=128), dict(chunk_size=24)])
def test_the_lowered_callbacks_with_the_folded_scale_are_the_mod_and_its_masks(overrides):
    """What the graph computes: the callbacks `lower` hands cuDNN (the folded mod, then the masks), run on the
    score times the attention scale `lower` chose over the spec's, against the original mod and masks."""
    pytest.importorskip("cudnn")
    from sdpagraph.backends.masking import allowed_mask, token_layout
    from sdpagraph.call import RuntimeInputs
    from tests.test_builder_cpu import emitted_ir, lower_fake, make_spec

    spec = make_spec(**overrides)
    ir = trace_score_mod(mods.softcap(30.0), {"cap": SCALAR})
    scalars = {"cap": 23.5}
    _, lowering, _, options = lower_fake(spec, ir, "backward")
    (uid, (kind, (scale, name, op)), _), = [e for e in lowering.pass_by_value if e[1][0] == "attn_scale"]
    assert lowering.uids["attn_scale"] == uid and (kind, scale, name) == ("attn_scale", spec.scale, "cap")
    ratio = folded_scale(scale, scalars[name], op) / spec.scale

    emitted, plan = emitted_ir(spec, fold_leading_scale(ir, "backward").ir, "backward")
    values = {entry.role: scalars[entry.source[1]] if entry.source[0] == "scalar" else entry.source[1]
              for entry in plan}
    inputs = RuntimeInputs()
    layout = token_layout(spec, inputs)
    index = (jnp.arange(spec.batch)[:, None, None, None], jnp.arange(spec.num_heads)[None, :, None, None],
             layout.q_pos[:, None, :, None], layout.kv_pos[:, None, None, :])
    rng, seed = fresh_rng()
    score = jnp.asarray(rng.normal(size=(spec.batch, spec.num_heads, spec.q_len, spec.kv_len)) * 40, jnp.float32)
    dscore = jnp.asarray(rng.normal(size=score.shape), jnp.float32)
    logits, grad = evaluate(emitted, score * ratio, scalars=values, arrays={}, index=index, dscore=dscore)

    expected, expected_grad = evaluate(ir, score, scalars=scalars, arrays={}, index=index, dscore=dscore)
    allowed = allowed_mask(spec, inputs, layout)
    np.testing.assert_allclose(logits, jnp.where(allowed, expected, -jnp.inf), rtol=2e-5, atol=2e-5, err_msg=seed)
    np.testing.assert_allclose(grad * ratio, jnp.where(allowed, expected_grad, 0.0), rtol=2e-4, atol=2e-5,
                               err_msg=seed)
