"""The score_mod recorder, canonical hash, derived bprop and jnp evaluation."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sdpagraph import mods
from sdpagraph.scoremod.ir import ScoreModError, ScoreModIR
from sdpagraph.scoremod.trace import TensorInfo, trace_score_mod
from sdpagraph.scoremod.ir_eval import evaluate

SCALAR = TensorInfo("scalar", "float32")


def trace(fn, tensors=None, bprop=None):
    return trace_score_mod(fn, tensors or {}, bprop)


def test_same_mod_written_twice_shares_hash_and_different_mods_do_not():
    first = lambda g, s, t: g.tanh(input=s / 3.0) * 3.0  # noqa: E731
    second = lambda g, s, t: g.tanh(input=s / 3.0) * 3.0  # noqa: E731
    other = lambda g, s, t: g.tanh(input=s / 3.0) * 4.0  # noqa: E731  differs by a literal only
    assert trace(first).digest == trace(second).digest
    assert trace(first).digest != trace(other).digest
    assert trace(lambda g, s, t: g.exp(input=s)).digest != trace(lambda g, s, t: g.log(input=s)).digest


def test_scalar_values_and_tensor_names_are_not_in_the_hash():
    a = trace(mods.softcap(30.0), {"cap": SCALAR})
    renamed = trace(lambda g, s, t: g.mul(a=g.tanh(input=g.div(a=s, b=t["c"])), b=t["c"]), {"c": SCALAR})
    assert a.scalar_names == ("cap",) and renamed.scalar_names == ("c",)
    untyped = trace(lambda g, s, t: g.mul(a=g.tanh(input=g.div(a=s, b=t["c"])), b=t["c"]), {"c": SCALAR})
    assert renamed.digest == untyped.digest
    assert a.forward_digest == renamed.forward_digest


def test_array_shapes_and_the_bprop_are_in_the_hash():
    add = lambda g, s, t: s + t["x"]  # noqa: E731
    per_head = trace(add, {"x": TensorInfo("array", "float32", (1, 8, 1, 1))})
    per_batch = trace(add, {"x": TensorInfo("array", "float32", (2, 1, 1, 1))})
    assert per_head.digest != per_batch.digest
    custom = trace(lambda g, s, t: s * 2.0, bprop=lambda g, d, t: d * 3.0)
    derived = trace(lambda g, s, t: s * 2.0)
    assert custom.forward_digest == derived.forward_digest and custom.digest != derived.digest
    assert derived.grad_derived and not custom.grad_derived


def test_unused_tensors_and_dead_ops_do_not_change_the_ir():
    def with_dead(g, s, t):
        g.exp(input=s)  # result unused
        return s * 2.0
    assert trace(with_dead, {"unused": SCALAR}).digest == trace(lambda g, s, t: s * 2.0).digest


def test_ir_round_trips_through_plain_data():
    ir = trace(mods.compose(mods.softcap(5.0), mods.causal(), mods.chunked(4)),
               {"0.cap": SCALAR})
    again = ScoreModIR.from_dict(ir.to_dict())
    assert again.digest == ir.digest and again.scalar_names == ir.scalar_names


def many_ops(g, s, t):
    x = g.tanh(input=s * 0.5) + g.sigmoid(input=s)
    x = x + g.exp(input=s * 0.1) + g.log(input=g.abs(input=s) + 1.0) + g.sqrt(input=s * s + 1.0)
    x = x + g.rsqrt(input=s * s + 2.0) + g.reciprocal(input=s * s + 3.0) + g.sin(input=s) * g.cos(input=s)
    x = x + g.erf(input=s) + g.softplus(input=s) + g.max(input0=s, input1=0.3) - g.min(input0=s, input1=-0.2)
    x = x + g.pow(input0=s * s + 1.0, input1=1.5) + g.mod(input0=s, input1=0.7) + g.tan(input=s * 0.3)
    x = x / (g.abs(input=s) + 2.0) - (-s)
    q, k = g.gen_index(input=s, axis=2), g.gen_index(input=s, axis=3)
    return g.binary_select(input0=x, input1=s * t["c"], mask=g.cmp_le(input=k, comparison=q))


def test_derived_bprop_matches_jax_grad_of_the_forward():
    rng = np.random.default_rng()
    ir = trace(many_ops, {"c": SCALAR})
    score = jnp.asarray(rng.standard_normal((2, 3, 5, 5)), jnp.float32)
    dscore = jnp.asarray(rng.standard_normal(score.shape), jnp.float32)
    index = (None, None, jnp.arange(5)[:, None], jnp.arange(5)[None, :])
    fwd = lambda s: evaluate(ir, s, scalars={"c": 1.7}, arrays={}, index=index)[0]  # noqa: E731
    _, vjp = jax.vjp(fwd, score)
    (want,) = vjp(dscore)
    _, got = evaluate(ir, score, scalars={"c": 1.7}, arrays={}, index=index, dscore=dscore)
    np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-5)


def test_mask_mods_pass_zero_gradient_where_masked():
    ir = trace(mods.causal())
    score = jnp.ones((1, 1, 4, 4))
    index = (None, None, jnp.arange(4)[:, None], jnp.arange(4)[None, :])
    _, grad = evaluate(ir, score, scalars={}, arrays={}, index=index, dscore=jnp.full((1, 1, 4, 4), 2.0))
    np.testing.assert_array_equal(np.asarray(grad[0, 0]), 2.0 * np.tril(np.ones((4, 4))))


def test_user_bprop_is_recorded_and_may_use_forward_tensors():
    state = {}

    def fwd(g, s, t):
        state["pre"] = g.div(a=s, b=t["cap"])
        return g.mul(a=g.tanh(input=state["pre"]), b=t["cap"])

    def bwd(g, d, t):
        return g.tanh_backward(loss=d, input=state["pre"])

    ir = trace(fwd, {"cap": SCALAR}, bwd)
    score = jnp.linspace(-3, 3, 16).reshape(1, 1, 4, 4)
    _, grad = evaluate(ir, score, scalars={"cap": 2.0}, arrays={}, index=(None,) * 4, dscore=jnp.ones_like(score))
    np.testing.assert_allclose(grad, 1 - np.tanh(np.asarray(score) / 2.0) ** 2, rtol=1e-5)


@pytest.mark.parametrize("fn,message", [
    (lambda g, s, t: g.fancy_op(input=s), "unknown op 'fancy_op'"),
    (lambda g, s, t: 3.0, "must return a graph tensor"),
    (lambda g, s, t: g.cmp_gt(input=s, comparison=0.0), "boolean"),
    (lambda g, s, t: g.add(x=s, b=s), "unexpected keyword"),
    (lambda g, s, t: g.add(a=s, b="two"), "passed a str"),
    (lambda g, s, t: g.gen_index(input=s), "axis"),
    (lambda g, s, t: s if s > 0 else s, "truth value"),
])
def test_recorder_errors_are_clear(fn, message):
    with pytest.raises(ScoreModError, match=message):
        trace(fn)


def test_data_types_accept_cudnn_style_names():
    class FakeEnum:  # what cudnn.data_type.INT32 looks like
        name = "INT32"

    ir = trace(lambda g, s, t: g.binary_select(
        input0=s, input1=-1e30,
        mask=g.cmp_ge(input=g.gen_index(input=s, axis=2).set_data_type(FakeEnum()),
                      comparison=g.gen_index(input=s, axis=3), compute_data_type="BOOLEAN").set_data_type("bool")))
    assert {n.dtype for n in ir.nodes} == {"float32", "int32", "bool"}
    with pytest.raises(ScoreModError, match="data type"):
        trace(lambda g, s, t: s.set_data_type("complex64"))
