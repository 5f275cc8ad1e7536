"""jnp score_mod / mask_mod conversion (scoremod.jnp.convert): the IR against the Python function.

Each converted IR is evaluated with scoremod.ir_eval over full (B, N, T, S) index grids and compared
with the function itself under jax.vmap (and a float64 NumPy formula where one is easy), forward
and the IR's derived gradient against jax.grad. Canonical forms are checked against the IRs of
mods.* / scoremod.masks, digests across processes, and every error path.
"""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sdpagraph import mods
from sdpagraph.scoremod.ir import FLOAT, INT
from sdpagraph.scoremod.recording import RecordingGraph
from sdpagraph.scoremod.ir_eval import evaluate
from sdpagraph.scoremod.jnp.apply import apply_jnp_mask_mod, apply_jnp_score_mod
from sdpagraph.scoremod.jnp.convert import (
    convert_jnp_mask_mod, convert_jnp_score_mod, trace_jnp_mask_mod, trace_jnp_score_mod,
)
from sdpagraph.scoremod.jnp.interpreter import JnpModUnsupported
from sdpagraph.scoremod.masks import MASKED, position_conditions, select_each
from sdpagraph.errors import Unsupported
from sdpagraph.scoremod.trace import TensorInfo, trace_score_mod
from sdpagraph.spec import UNBOUNDED

B, N, T, S = 2, 3, 7, 9
SHAPE = (B, N, T, S)


def grid(shape=SHAPE):
    return [np.arange(n, dtype=np.int32).reshape(tuple(n if a == axis else 1 for a in range(4)))
            for axis, n in enumerate(shape)]


def full_grid(shape=SHAPE):
    return [np.broadcast_to(i, shape) for i in grid(shape)]


def random_inputs(seed, shape=SHAPE, scale=4.0):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal(shape).astype(np.float32) * scale,
            rng.standard_normal(shape).astype(np.float32))


def run_ir(mod, score, dscore, shape=SHAPE):
    out, grad = evaluate(mod.ir, jnp.asarray(score), scalars=mod.scalars, arrays=mod.arrays, index=grid(shape),
                         dscore=jnp.asarray(dscore))
    return np.asarray(jnp.broadcast_to(out, shape)), np.asarray(jnp.broadcast_to(grad, shape))


def vmap_score_mod(fn, score, shape=SHAPE):
    """fn applied elementwise with jax.vmap (written independently of apply_jnp_score_mod)."""
    flat = [jnp.asarray(i).reshape(-1) for i in full_grid(shape)]
    out = jax.vmap(fn)(jnp.asarray(score).reshape(-1), *flat).reshape(shape)
    grad = jax.vmap(jax.grad(fn))(jnp.asarray(score).reshape(-1), *flat).reshape(shape)
    return np.asarray(out), np.asarray(grad)


def vmap_mask_mod(fn, shape=SHAPE):
    flat = [jnp.asarray(i).reshape(-1) for i in full_grid(shape)]
    return np.asarray(jax.vmap(fn)(*flat).reshape(shape))


def check_score_mod(fn, seed=0, shape=SHAPE, numpy_reference=None, rtol=2e-5, atol=2e-5):
    mod = convert_jnp_score_mod(fn, shape)
    assert mod.kind == "score_mod" and mod.ir.grad_derived
    for s in (seed, seed + 1):  # fresh inputs: the IR is traced once
        score, dscore = random_inputs(s, shape)
        out, grad = run_ir(mod, score, dscore, shape)
        ref_out, ref_grad = vmap_score_mod(fn, score, shape)
        np.testing.assert_allclose(out, ref_out, rtol=rtol, atol=atol)
        np.testing.assert_allclose(grad, ref_grad * dscore, rtol=rtol, atol=atol)
        if numpy_reference is not None:
            b, h, q, k = (i.astype(np.float64) for i in full_grid(shape))
            np.testing.assert_allclose(out, numpy_reference(score.astype(np.float64), b, h, q, k), rtol=1e-5, atol=1e-5)
    return mod


def check_mask_mod(fn, shape=SHAPE, numpy_reference=None, masked=MASKED):
    mod = convert_jnp_mask_mod(fn, shape, masked_value=masked)
    assert mod.kind == "mask_mod"
    keep = vmap_mask_mod(fn, shape)
    assert keep.dtype == np.bool_ and keep.any() and not keep.all()  # the test masks something
    if numpy_reference is not None:
        np.testing.assert_array_equal(keep, numpy_reference(*full_grid(shape)))
    for seed in (0, 1):
        score, dscore = random_inputs(seed, shape)
        out, grad = run_ir(mod, score, dscore, shape)
        np.testing.assert_array_equal(out, np.where(keep, score, np.float32(masked)))
        np.testing.assert_array_equal(grad, np.where(keep, dscore, 0.0))
        # jax.grad of where(mask, score, masked) agrees
        ref_out, ref_grad = vmap_score_mod(lambda s, b, h, q, k: jnp.where(fn(b, h, q, k), s, masked), score, shape)
        np.testing.assert_array_equal(out, ref_out)
        np.testing.assert_array_equal(grad, ref_grad * dscore)
    return mod


def ops(ir):
    return [n.op for n in ir.nodes]


def expression(ir, index):
    node = ir.nodes[index]
    if node.op == "gen_index":
        return f"gen{node.attr('axis')}"
    if node.op == "const":
        return repr(node.attr("value"))
    if node.op == "array":
        return f"array{node.attr('slot')}"
    return f"{node.op}({','.join(expression(ir, a) for a in node.args)})"


def conditions(ir):
    """The comparisons of the forward, as expressions."""
    return {expression(ir, i) for i in ir.forward_nodes() if ir.nodes[i].op.startswith("cmp")}


def masks_form(conditions_fn, masked=MASKED):
    """The IR of scoremod.masks' own form: chained selects over `conditions_fn(graph, score)`."""
    return trace_score_mod(lambda g, s, t: select_each(g, s, masked, conditions_fn(g, s)), {})


def traced(mod):
    infos = {}
    for name, value in mod.tensors.items():
        value = np.asarray(value)
        shape = (1,) * (4 - value.ndim) + value.shape
        infos[name] = TensorInfo("array", INT if np.issubdtype(value.dtype, np.integer) else FLOAT, shape)
    return trace_score_mod(mod, infos)


# ----------------------------------------------------------------------------- score mods

def test_softcap():
    mod = check_score_mod(lambda s, b, h, q, k: 30.0 * jnp.tanh(s / 30.0),
                          numpy_reference=lambda s, b, h, q, k: 30.0 * np.tanh(s / 30.0))
    assert mod.arrays == {} and ops(mod.ir).count("tanh") == 1 and "tanh_backward" in ops(mod.ir)


def test_alibi_with_captured_slopes():
    slopes_np = np.float32(2.0) ** -np.arange(1, N + 1, dtype=np.float32)
    slopes = jnp.asarray(slopes_np)
    mod = check_score_mod(lambda s, b, h, q, k: s + (k - q) * slopes[h],
                          numpy_reference=lambda s, b, h, q, k: s + (k - q) * slopes_np[h.astype(int)])
    assert list(mod.arrays) == ["captured0"] and mod.arrays["captured0"].shape == (1, N, 1, 1)
    np.testing.assert_array_equal(np.asarray(mod.arrays["captured0"]).reshape(-1), slopes_np)
    assert mod.infos["captured0"] == TensorInfo("array", FLOAT, (1, N, 1, 1))
    # written in mods.alibi's operand order, it records mods.alibi's IR exactly
    assert mod.ir.digest == traced(mods.alibi(slopes_np)).digest
    # the other operand order: same values, and the cast int -> float is still not an op
    other = check_score_mod(lambda s, b, h, q, k: s + slopes[h] * (k - q))
    assert "identity" not in ops(other.ir)


def test_relative_position():
    mod = check_score_mod(lambda s, b, h, q, k: s + (q - k) * 0.1,
                          numpy_reference=lambda s, b, h, q, k: s + (q - k) * np.float32(0.1))
    assert ops(mod.ir)[:7] == ["score", "scalar", "gen_index", "gen_index", "sub", "mul", "add"]
    assert mod.arrays == {} and mod.scalars == {"captured_literal0": pytest.approx(0.1)}


def test_ops_kitchen_sink():
    def fn(s, b, h, q, k):
        x = jax.nn.softplus(s) + jax.nn.sigmoid(s) + jax.nn.relu(s) + jax.nn.gelu(s) + jax.lax.erf(s / 4)
        x = x + jnp.clip(s, -2.0, 2.0) + jnp.sqrt(jnp.abs(s) + 1) + jnp.exp(-s * s) + jnp.log(s * s + 1)
        x = x + s ** 3 + jnp.square(s) / 10 + 1 / (s * s + 2) + jax.lax.rsqrt(s * s + 1) + jnp.maximum(s, 0.5 * s)
        x = x + jnp.where(s > 0.5, s, -s) + (q // 2) * 0.25 + (k % 3) * 0.5 + jnp.float32(q - 2 * k) / 7
        x = x + (q >= k) * 1.5 + jnp.logical_xor(q > 2, k > 4) + jnp.where(~(q < k), 1.0, -1.0) * s
        x = x + jnp.sign(s) + jnp.sign(q - k) + jnp.expm1(s / 8) + jnp.log1p(s * s) + jnp.exp2(s / 4)
        x = x + b * 0.5 - h * 0.25 + jnp.minimum(jnp.abs(q - k), 3) + jnp.where(jnp.isfinite(s), s, 0.0)
        return x

    mod = check_score_mod(fn, rtol=1e-4, atol=1e-4)
    assert "softplus" in ops(mod.ir) and "sigmoid" in ops(mod.ir)
    assert not {"logical_and", "logical_or", "logical_not"} & set(ops(mod.ir))  # cuDNN 9.19 runs none


def test_integer_division_and_remainder_of_negatives():
    check_score_mod(lambda s, b, h, q, k: s + ((q - k) // 3) * 1.0 + ((q - k) % 4) * 0.5 + jax.lax.div(q - k, 2) * 0.25
                    + jax.lax.rem(q - k, 3) * 0.125)


def test_float_comparisons_keep_nan_semantics():
    # not(s < 0) is not s >= 0 when s is NaN: the converter swaps branches instead of flipping
    fn = lambda s, b, h, q, k: jnp.where(~(s < 0.0), s, 2 * s)  # noqa: E731
    mod = convert_jnp_score_mod(fn, SHAPE)
    score = np.array([np.nan, -1.0, 1.0], np.float32).reshape(1, 1, 1, 3)
    out, _ = evaluate(mod.ir, jnp.asarray(score), scalars=mod.scalars, arrays={}, index=grid((1, 1, 1, 3)))
    ref = jax.vmap(lambda s: fn(s, 0, 0, 0, 0))(jnp.asarray(score).reshape(-1))
    np.testing.assert_array_equal(np.asarray(out).reshape(-1), np.asarray(ref))


def test_bitwise_ops_on_positions_become_aux_arrays():
    fn = lambda b, h, q, k: (q >> 1) == (k >> 1)  # noqa: E731
    mod = check_mask_mod(fn, numpy_reference=lambda b, h, q, k: (q >> 1) == (k >> 1))
    assert sorted(v.shape for v in mod.arrays.values()) == [(1, 1, 1, S), (1, 1, T, 1)]


# ----------------------------------------------------------------------------- literals bound as scalars

def literals(ir):
    return [(n.attr("value"), n.dtype) for n in ir.nodes if n.op == "const"]


@pytest.mark.parametrize("cap", [2.0, 30.0])
def test_softcap_values_are_bound_scalars_of_one_ir(cap):
    mod = check_score_mod(lambda s, b, h, q, k: cap * jnp.tanh(s / cap),
                          numpy_reference=lambda s, b, h, q, k: cap * np.tanh(s / cap))
    assert mod.scalars == {"captured_literal0": cap, "captured_literal1": cap}  # one per use
    assert mod.infos["captured_literal0"] == TensorInfo("scalar", FLOAT) and mod.tensors == mod.scalars
    assert not any(value == cap for value, _ in literals(mod.ir))
    assert mod.ir.digest == convert_jnp_score_mod(lambda s, b, h, q, k: 30 * jnp.tanh(s / 30)).ir.digest
    # the derived bprop reads the same scalars: tanh_backward's input is s / cap, then / cap
    (grad_div,) = [n for i, n in enumerate(mod.ir.nodes) if n.op == "div" and i > mod.ir.output]
    assert mod.ir.nodes[grad_div.args[1]].op == "scalar"


def test_only_float_literals_on_the_score_path_are_lifted():
    mod = check_score_mod(lambda s, b, h, q, k: s + (q // 2) * 0.5 - (q - 2 * k) * 0.25 + jnp.clip(s, -2.0, 2.0))
    assert sorted(mod.scalars.values()) == [-2.0, 0.25, 0.5, 2.0]
    assert literals(mod.ir) == [(2, INT)] + [(0.0, FLOAT)] * (len(literals(mod.ir)) - 1)  # ints stay, 0.0: bprop's
    cases = [  # (mod, the literal values that stay literals)
        (lambda s, b, h, q, k: jnp.where(s / 4.0 > 1.0, 1.0, s), [4.0, 1.0]),  # into a comparison; a fill value
        (lambda s, b, h, q, k: jnp.where(q >= k, s * 2.0, -1e30), [np.float32(-1e30).item()]),  # 2.0 lifted
        (lambda s, b, h, q, k: jnp.maximum(s, -jnp.inf), [-np.inf]),  # not finite
        (lambda s, b, h, q, k: jnp.log1p(s) + jnp.exp2(s), [1.0, float(np.log(2.0))]),  # the converter's own
        (lambda s, b, h, q, k: s + jnp.float32((q * 0.5).astype(jnp.int32) >= k), [0.5, 1.0]),  # cast to int
    ]
    for fn, kept in cases:
        mod = check_score_mod(fn)
        assert [v for v, dtype in literals(mod.ir) if dtype == FLOAT and v != 0.0] == kept
    assert convert_jnp_score_mod(lambda s, b, h, q, k: jnp.where(q >= k, s * 2.0, -1e30)).scalars == {
        "captured_literal0": 2.0}


def test_mask_mod_literals_stay_and_its_tensors_have_their_own_names():
    mod = check_mask_mod(lambda b, h, q, k: (q * 0.5).astype(jnp.int32) >= k // 2,
                         numpy_reference=lambda b, h, q, k: (q * 0.5).astype(np.int32) >= k // 2)
    assert mod.scalars == {} and 0.5 in [v for v, _ in literals(mod.ir)]
    score_mod = convert_jnp_score_mod(lambda s, b, h, q, k: s * 0.5, name_prefix="mask_captured")
    assert list(score_mod.scalars) == ["mask_captured_literal0"]


# ----------------------------------------------------------------------------- mask mods

def test_causal_mask_is_mods_causal():
    fn = lambda b, h, i, j: i >= j  # noqa: E731
    mod = check_mask_mod(fn, numpy_reference=lambda b, h, q, k: q >= k)
    # default -inf: scoremod.masks' causal form; with mods' masked value: mods.causal() exactly
    assert mod.ir.digest == masks_form(lambda g, s: position_conditions(g, s, causal=True)).digest
    assert trace_jnp_mask_mod(fn, masked_value=mods.MASKED_SCORE)[0].digest == trace_score_mod(mods.causal(), {}).digest
    # written any other way, the same IR
    for other in (lambda b, h, i, j: j <= i, lambda b, h, i, j: ~(i < j), lambda b, h, i, j: i - j >= 0,
                  lambda b, h, i, j: jnp.logical_not(j > i), lambda b, h, i, j: i + 1 > j):
        assert trace_jnp_mask_mod(other)[0].digest == mod.ir.digest


@pytest.mark.parametrize("w", [0, 2, 4])
def test_sliding_window_masks(w):
    causal_window = check_mask_mod(lambda b, h, i, j: (i - j <= w) & (i >= j),
                                   numpy_reference=lambda b, h, q, k: (q - k <= w) & (q >= k))
    # the conditions of mods.sliding_window(w, 0), which writes the causal side as `add(q, 0) >= k`
    reference = {c.replace("add(gen2,0)", "gen2") for c in conditions(traced(mods.sliding_window(w, 0)))}
    assert conditions(causal_window.ir) == reference == {f"cmp_gt(add(gen3,{w + 1}),gen2)", "cmp_ge(gen2,gen3)"}
    # conditions in position_conditions' order: scoremod.masks' IR exactly
    assert trace_jnp_mask_mod(lambda b, h, i, j: (i >= j) & (i - j <= w))[0].digest == masks_form(
        lambda g, s: position_conditions(g, s, causal=True, window=(w, UNBOUNDED))).digest
    # one-sided and symmetric windows are mods.sliding_window's IRs
    left = check_mask_mod(lambda b, h, i, j: i - j <= w, numpy_reference=lambda b, h, q, k: q - k <= w)
    assert convert_jnp_mask_mod(lambda b, h, i, j: i - j <= w, masked_value=mods.MASKED_SCORE).ir.digest == \
        traced(mods.sliding_window(w, -1)).digest
    assert left.ir.digest == masks_form(lambda g, s: position_conditions(g, s, window=(w, UNBOUNDED))).digest
    both = check_mask_mod(lambda b, h, i, j: jnp.abs(i - j) <= w, numpy_reference=lambda b, h, q, k: abs(q - k) <= w)
    if w == 0:  # scoremod.masks writes the right side `add(q, 0) >= k`; the converter drops the add
        assert conditions(both.ir) == {c.replace("add(gen2,0)", "gen2") for c in conditions(traced(mods.sliding_window(0, 0)))}
        return
    assert both.ir.digest == masks_form(lambda g, s: position_conditions(g, s, window=(w, w))).digest
    assert trace_jnp_mask_mod(lambda b, h, i, j: jnp.abs(i - j) <= w, masked_value=mods.MASKED_SCORE)[0].digest == \
        traced(mods.sliding_window(w, w)).digest


def test_document_mask_with_captured_ids():
    ids = np.array([[0, 0, 0, 1, 1, 2, 2, 2, 2], [0, 1, 1, 1, 1, 1, 2, 3, 3]], np.int32)  # (B, S); T <= S
    doc = jnp.asarray(ids)
    fn = lambda b, h, q, k: doc[b, q] == doc[b, k]  # noqa: E731
    mod = check_mask_mod(fn, numpy_reference=lambda b, h, q, k: ids[b, q] == ids[b, k])
    shapes = {name: value.shape for name, value in mod.arrays.items()}
    assert shapes == {"captured0": (B, 1, T, 1), "captured1": (B, 1, 1, S)}
    assert {info.dtype for info in mod.infos.values()} == {INT}
    # the IR does not depend on the ids' values
    other = jnp.zeros_like(doc).at[:, 4:].set(1)
    assert convert_jnp_mask_mod(lambda b, h, q, k: other[b, q] == other[b, k], SHAPE).ir.digest == mod.ir.digest


def test_prefix_lm_masks():
    check_mask_mod(lambda b, h, q, k: (k < 3) | (q >= k), numpy_reference=lambda b, h, q, k: (k < 3) | (q >= k))
    lengths = np.array([2, 5], np.int32)
    prefix = jnp.asarray(lengths)
    fn = lambda b, h, q, k: (k < prefix[b]) | (q >= k)  # noqa: E731
    mod = check_mask_mod(fn, numpy_reference=lambda b, h, q, k: (k < lengths[b]) | (q >= k))
    assert {name: v.shape for name, v in mod.arrays.items()} == {"captured0": (B, 1, 1, 1)}
    # the key position is the comparison's input, as in scoremod.masks' segment bounds
    (cmp,) = [n for n in mod.ir.nodes if n.op == "cmp_lt"]
    assert mod.ir.nodes[cmp.args[0]].op == "gen_index" and mod.ir.nodes[cmp.args[1]].op == "array"
    assert trace_jnp_mask_mod(lambda b, h, q, k: (prefix[b] > k) | (q >= k), SHAPE)[0].digest == mod.ir.digest


def test_lookup_chains_and_per_head_masks():
    doc = jnp.array([[0, 0, 1, 1, 1, 2, 2, 2, 3], [0, 0, 0, 0, 1, 1, 1, 1, 1]], jnp.int32)
    heads = jnp.array([1, 0, 2], jnp.int32)  # a permutation read twice
    fn = lambda b, h, q, k: (doc[b][q] == doc[b][k]) & (q - k <= heads[heads[h]] + 1)  # noqa: E731
    mod = check_mask_mod(fn)
    assert sorted(v.shape for v in mod.arrays.values()) == [(1, N, 1, 1), (B, 1, 1, S), (B, 1, T, 1)]


def test_mask_constant_results():
    keep_all = convert_jnp_mask_mod(lambda b, h, q, k: True, SHAPE)
    score, dscore = random_inputs(0)
    out, grad = run_ir(keep_all, score, dscore)
    np.testing.assert_array_equal(out, score)
    np.testing.assert_array_equal(grad, dscore)
    keep_none = convert_jnp_mask_mod(lambda b, h, q, k: q < 0, SHAPE)  # positions are never negative: still a comparison
    out, grad = run_ir(keep_none, score, dscore)
    assert np.all(np.isneginf(out)) and np.all(grad == 0)


# ----------------------------------------------------------------------------- identity and helpers

def test_same_digest_across_processes():
    code = textwrap.dedent("""
        import json, jax.numpy as jnp, numpy as np
        from sdpagraph.scoremod.jnp.convert import trace_jnp_score_mod, trace_jnp_mask_mod
        slopes = jnp.arange(1, 4, dtype=jnp.float32)
        doc = jnp.arange(18, dtype=jnp.int32).reshape(2, 9) // 4
        shape = (2, 3, 7, 9)
        print(json.dumps([
            trace_jnp_score_mod(lambda s, b, h, q, k: 30 * jnp.tanh(s / 30), shape)[0].digest,
            trace_jnp_score_mod(lambda s, b, h, q, k: s + slopes[h] * (k - q) + (q // 2) * 0.5, shape)[0].digest,
            trace_jnp_mask_mod(lambda b, h, q, k: (doc[b, q] == doc[b, k]) & (q >= k), shape)[0].digest,
        ]))
    """)
    digests = []
    for _ in range(2):
        run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                             cwd=str(__import__("pathlib").Path(__file__).resolve().parents[1]))
        assert run.returncode == 0, run.stderr
        digests.append(json.loads(run.stdout.strip().splitlines()[-1]))
    slopes = jnp.arange(1, 4, dtype=jnp.float32)
    doc = jnp.arange(18, dtype=jnp.int32).reshape(2, 9) // 4
    here = [
        trace_jnp_score_mod(lambda s, b, h, q, k: 30 * jnp.tanh(s / 30), SHAPE)[0].digest,
        trace_jnp_score_mod(lambda s, b, h, q, k: s + slopes[h] * (k - q) + (q // 2) * 0.5, SHAPE)[0].digest,
        trace_jnp_mask_mod(lambda b, h, q, k: (doc[b, q] == doc[b, k]) & (q >= k), SHAPE)[0].digest,
    ]
    assert digests[0] == digests[1] == here
    assert len(set(here)) == 3


def test_callback_records_the_same_ir_and_values_are_not_hashed():
    slopes = jnp.arange(1, N + 1, dtype=jnp.float32)
    mod = convert_jnp_score_mod(lambda s, b, h, q, k: s * 0.5 + slopes[h], SHAPE)
    assert trace_score_mod(mod.callback, mod.infos).digest == mod.ir.digest
    assert convert_jnp_score_mod(lambda s, b, h, q, k: s * 0.5 + (slopes * 7)[h], SHAPE).ir.digest == mod.ir.digest
    assert convert_jnp_score_mod(lambda s, b, h, q, k: s * 0.25 + slopes[h], SHAPE).ir.digest == mod.ir.digest
    assert convert_jnp_score_mod(lambda s, b, h, q, k: s / 0.5 + slopes[h], SHAPE).ir.digest != mod.ir.digest
    assert mod.ir.to_dict() == type(mod.ir).from_dict(json.loads(json.dumps(mod.ir.to_dict()))).to_dict()


def test_captured_traced_values_inside_jit():
    def run(slopes, score):
        mod = convert_jnp_score_mod(lambda s, b, h, q, k: s + slopes[h] * (q - k), SHAPE)
        out, _ = evaluate(mod.ir, score, scalars={}, arrays=mod.arrays, index=grid())
        return out, mod.ir.digest

    slopes = jnp.arange(1, N + 1, dtype=jnp.float32)
    score, _ = random_inputs(3)
    out = jax.jit(lambda sl, sc: run(sl, sc)[0])(slopes, score)
    ref, _ = vmap_score_mod(lambda s, b, h, q, k: s + slopes[h] * (q - k), score)
    np.testing.assert_allclose(np.asarray(out), ref, rtol=1e-6, atol=1e-6)
    assert run(slopes, score)[1] == convert_jnp_score_mod(lambda s, b, h, q, k: s + jnp.ones(N)[h] * (q - k),
                                                          SHAPE).ir.digest


def test_apply_helpers_run_any_mod():
    table_np = np.arange(N * (T + S), dtype=np.float32).reshape(N, T + S) / 10
    table = jnp.asarray(table_np)
    fn = lambda s, b, h, q, k: s + table[h, q - k + S]  # noqa: E731  (not convertible)
    score, _ = random_inputs(0)
    out = apply_jnp_score_mod(fn, score, grid())
    b, h, q, k = full_grid()
    np.testing.assert_allclose(np.asarray(out), score + table_np[h, q - k + S], rtol=1e-6)
    mask = apply_jnp_mask_mod(lambda b, h, q, k: q >= k, grid(), SHAPE)
    np.testing.assert_array_equal(np.asarray(mask), q >= k)


# ----------------------------------------------------------------------------- errors

def unsupported(fn, kind="score_mod", shape=SHAPE):
    convert = convert_jnp_score_mod if kind == "score_mod" else convert_jnp_mask_mod
    with pytest.raises(JnpModUnsupported) as info:
        convert(fn, shape)
    assert isinstance(info.value, Unsupported) and isinstance(info.value, ValueError)
    message = str(info.value)
    assert message.startswith(kind) and message.endswith("which cuDNN cannot express; it runs on XLA")
    return message


def test_gather_at_a_computed_index():
    table = jnp.zeros((N, T + S), jnp.float32)
    message = unsupported(lambda s, b, h, q, k: s + table[h, q - k + S])
    assert "`dynamic_slice` at a computed index" in message and "q_idx and kv_idx" in message
    message = unsupported(lambda s, b, h, q, k: s + jnp.take(table[0], q - k + S))
    assert "`gather` at a computed index" in message
    message = unsupported(lambda s, b, h, q, k: s + table[0, jnp.int32(s) % 4])
    assert "index computed from the score" in message


def test_unsupported_primitives_are_named():
    assert "control flow (`cond`)" in unsupported(lambda s, b, h, q, k: jax.lax.cond(s > 0, lambda: s, lambda: -s))
    assert "`while`" in unsupported(
        lambda s, b, h, q, k: jax.lax.while_loop(lambda x: x < 10, lambda x: x * 2 + 1, s))
    key = jax.random.key(0)
    assert "random numbers (`random_fold_in`)" in unsupported(
        lambda s, b, h, q, k: s + jax.random.normal(jax.random.fold_in(key, q)))
    assert "`atan2`" in unsupported(lambda s, b, h, q, k: jnp.arctan2(s, 2.0))
    assert "`round`" in unsupported(lambda s, b, h, q, k: jnp.round(s))
    assert "`stop_gradient`" in unsupported(lambda s, b, h, q, k: s * jax.lax.stop_gradient(s))
    assert "non-scalar value" in unsupported(lambda s, b, h, q, k: jnp.sum(s * jnp.arange(4.0)))

    @jax.custom_vjp
    def clip_gradient(x):
        return x

    clip_gradient.defvjp(lambda x: (x, None), lambda _, g: (jnp.clip(g, -1, 1),))
    assert "custom_vjp" in unsupported(lambda s, b, h, q, k: clip_gradient(s))
    assert "`dynamic_slice`" in unsupported(lambda b, h, q, k: jnp.eye(T + S, dtype=bool)[q, k], kind="mask_mod")


def test_stop_gradient_of_positions_is_fine():
    check_score_mod(lambda s, b, h, q, k: s + jax.lax.stop_gradient(jnp.float32(q - k)) * 0.5)


def test_result_type_errors():
    with pytest.raises(TypeError, match="score_mod must return one float score.*bool.*mask_mod"):
        convert_jnp_score_mod(lambda s, b, h, q, k: q >= k)
    with pytest.raises(TypeError, match="score_mod must return one float score.*int32"):
        convert_jnp_score_mod(lambda s, b, h, q, k: q - k)
    with pytest.raises(TypeError, match="score_mod must return one float score"):
        convert_jnp_score_mod(lambda s, b, h, q, k: (s, s))
    with pytest.raises(TypeError, match="score_mod must return one float score.*float32\\[4\\]"):
        convert_jnp_score_mod(lambda s, b, h, q, k: s + jnp.zeros(4))
    with pytest.raises(TypeError, match="mask_mod must return one boolean.*int32"):
        convert_jnp_mask_mod(lambda b, h, q, k: q - k)
    with pytest.raises(TypeError, match="mask_mod must return one boolean.*float32"):
        convert_jnp_mask_mod(lambda b, h, q, k: jnp.float32(q >= k))
    with pytest.raises(TypeError, match="score_mod must take \\(score, b, h, q_idx, kv_idx\\)"):
        convert_jnp_score_mod(lambda b, h, q, k: q >= k)
    with pytest.raises(TypeError, match="mask_mod must take \\(b, h, q_idx, kv_idx\\)"):
        convert_jnp_mask_mod(lambda s, b, h, q, k: s)
    with pytest.raises(TypeError, match="must be callable"):
        convert_jnp_mask_mod(3)


def test_lookups_need_the_shape():
    slopes = jnp.ones(N, jnp.float32)
    with pytest.raises(ValueError, match="needs the call's shape=\\(B, N, T, S\\)"):
        convert_jnp_score_mod(lambda s, b, h, q, k: s + slopes[h])
    with pytest.raises(ValueError, match="shape must be the call's"):
        convert_jnp_score_mod(lambda s, b, h, q, k: s, (2, 3))
    convert_jnp_score_mod(lambda s, b, h, q, k: s + (q - k) * 0.5)  # no lookup: no shape needed


# ----------------------------------------------------------------------------- the recorder's memo

def test_recorder_memo_after_set_data_type():
    graph = RecordingGraph()
    score = graph.leaf("score")
    first = graph.mul(a=score, b=2.0).set_data_type("INT32")
    assert first.dtype == INT
    second = graph.mul(a=score, b=2.0)
    assert second.dtype == FLOAT and second.index != first.index
    third = graph.mul(a=score, b=2.0)
    assert third.index == second.index  # identical ops still merge
