"""Masks the cuDNN path passes as an additive bias: a boolean `mask=`, and key padding when a
score_mod switches cuDNN's padding mask off. Rows with no key to attend to are zeroed.

On the CPU, run that recipe through the XLA backend (the same bias operand, the same mod,
the same zeroing) and check it against the XLA backend given the masks themselves, and the
mask case against a float64 NumPy reference: outputs, logsumexp and gradients, with fully
masked rows and a user bias.
"""
import numpy as np
import pytest

import jax
import jax.numpy as jnp

from sdpagraph import mods
from sdpagraph.graphs.operands import bias_operand_shape, folds_padding, graph_io, plan_layout
from sdpagraph.backends.cudnn import call_operands
from sdpagraph.call import prepare_call
from sdpagraph.call import RuntimeInputs
from sdpagraph.backends.xla import xla_attention
from sdpagraph.arguments import normalize_arguments
from tests import reference as ref

B, T, S, N, H = 2, 24, 32, 4, 16


def folded_recipe(kwargs):
    """attention as the cuDNN path computes it, with XLA standing in for the cuDNN graph."""

    def run(q, k, v, user_bias):
        call = prepare_call(q, k, v, user_bias, **kwargs)
        spec, ir, inputs = call.spec, call.score_mod, call.inputs
        plan = plan_layout(spec, ir)
        _, validity = call_operands.call_operands(spec, inputs, spec.max_segments)
        operand = call_operands.bias_operand(plan, inputs, validity, q.dtype)
        graph_spec = normalize_arguments(q, k, v, operand, is_causal=spec.is_causal).spec
        graph_inputs = RuntimeInputs(bias=operand, mod_scalars=inputs.mod_scalars, mod_arrays=inputs.mod_arrays)
        out, lse = xla_attention(graph_spec, q, k, v, graph_inputs, ir)
        out = call_operands.zero_rows(out, validity.q)
        attended = call_operands.attended(plan, inputs)
        out = jnp.where(attended, out, 0)
        return out, jnp.where(jnp.swapaxes(attended[..., 0], 1, 2), lse, -jnp.inf)

    return run


def reference(kwargs):
    def run(q, k, v, user_bias):
        call = prepare_call(q, k, v, user_bias, **kwargs)
        return xla_attention(call.spec, q, k, v, call.inputs, call.score_mod)

    return run


def check_against(fn, ref, args, argnums, rng):
    out, lse = fn(*args)
    out_ref, lse_ref = ref(*args)
    tol = 2e-2
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(out_ref, np.float32), atol=tol, rtol=tol)
    finite = np.isfinite(np.asarray(lse_ref))
    assert np.array_equal(np.isfinite(np.asarray(lse)), finite)
    np.testing.assert_allclose(np.asarray(lse)[finite], np.asarray(lse_ref)[finite], atol=tol, rtol=tol)
    do = jnp.asarray(rng.standard_normal(out.shape), jnp.float32)
    loss = lambda f: lambda *a: jnp.sum(f(*a)[0].astype(jnp.float32) * do)  # noqa: E731
    grads = jax.grad(loss(fn), argnums)(*args)
    grads_ref = jax.grad(loss(ref), argnums)(*args)
    for got, want in zip(grads, grads_ref):
        got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
        assert np.all(np.isfinite(got))
        assert np.linalg.norm(got - want) <= 3e-2 * np.linalg.norm(want)
    return out


def random_qkv(rng, dtype):
    return [jnp.asarray(rng.standard_normal(shape), dtype) for shape in ((B, T, N, H), (B, S, N, H), (B, S, N, H))]


@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_mask_folded_into_the_bias_matches_the_mask(with_bias, dtype):
    rng = np.random.default_rng()
    q, k, v = random_qkv(rng, dtype)
    mask = rng.random((B, 1, T, S)) < 0.6
    mask[0, 0, 3] = False  # a fully masked row in every head
    bias = (rng.standard_normal((1, N, T, S)) if with_bias else np.zeros((1, N, T, S))).astype(np.float32)
    user_bias = jnp.asarray(bias) if with_bias else None
    kwargs = dict(mask=jnp.asarray(mask))
    spec = prepare_call(q, k, v, user_bias, **kwargs).spec
    assert bias_operand_shape(spec, None) == (B, N if with_bias else 1, T, S)

    out = check_against(folded_recipe(kwargs), reference(kwargs), (q, k, v, user_bias),
                        (0, 1, 2, 3) if with_bias else (0, 1, 2), rng)
    positions = np.broadcast_to(np.arange(T), (B, T)), np.broadcast_to(np.arange(S), (B, S))
    expected, _ = ref.attention_fwd_bwd(q, k, v, np.zeros((B, T, N, H)), scale=spec.scale, ok=np.broadcast_to(
        mask, (B, N, T, S)), q_pos=positions[0], k_pos=positions[1], bias=bias)
    np.testing.assert_allclose(np.asarray(out, np.float64), expected, atol=2e-2, rtol=2e-2)
    assert np.all(np.asarray(out)[0, 3] == 0)


@pytest.mark.parametrize("causal", [False, True])
def test_padding_with_a_score_mod_folds_key_lengths_into_the_bias(causal):
    rng = np.random.default_rng()
    q, k, v = random_qkv(rng, "bfloat16")
    kwargs = dict(score_mod=mods.softcap(20.0), is_causal=causal,
                  query_seq_lengths=jnp.asarray([T - 5, T], jnp.int32),
                  key_value_seq_lengths=jnp.asarray([S - 7, 0], jnp.int32))  # row 1: no key at all
    call = prepare_call(q, k, v, **kwargs)
    assert folds_padding(call.spec, call.score_mod)
    assert bias_operand_shape(call.spec, call.score_mod) == (B, 1, T, S)  # full query axis: see the function
    operands, _ = graph_io(call.spec, call.score_mod, "backward")
    assert "bias" in operands and "seq_len_q" not in operands and "seq_len_kv" not in operands

    out = check_against(folded_recipe(kwargs), reference(kwargs), (q, k, v, None), (0, 1, 2), rng)
    assert np.all(np.asarray(out)[1] == 0) and np.all(np.asarray(out)[0, T - 5:] == 0)
    assert np.any(np.asarray(out)[0, : T - 5] != 0)
