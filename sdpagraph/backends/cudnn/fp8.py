"""cuDNN's FP8 graphs (sdpa_fp8, sdpa_fp8_backward) run from JAX: the scale operands and what each call
gives back. `backends.cudnn.backend` hands in `run(direction, operands, results)`, its graph call for the
spec (so this module needs nothing of it).

    inference(spec, q8, k8, v8, inputs, run) -> (o8, amax_o)            FP8 in, FP8 out (`sdpagraph.fp8.attention`)
    training(spec, q, k, v, inputs, run) -> (out, lse)                  differentiable, bf16 in and out

`training` quantizes q, k, v into the spec's FP8 dtype with the descales in `inputs.fp8_scales` (values
already on that grid with descale 1 stay exact: the numerical check's case), runs the forward graph with
its stats and the output scaled by 448 / max|v| (|out| <= max|v|), and in the backward quantizes dO by its
amax into e5m2 (`FP8_GRADIENT`). The gradients come out in e5m2 too (cuDNN 9.19 gives a BF16 gradient
on Blackwell only), so their scales are chosen before they exist (`_gradient_scales`); cuDNN reports
each gradient's amax, and where a guess saturated or underflowed the backward runs again with the exact
scales. The rounding of e5m2 (2 mantissa bits) is the price: gradients carry ~10% relative error, as in
FP8 training elsewhere (Transformer Engine's hybrid format).
"""
from __future__ import annotations

import functools
from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp

from sdpagraph.backends.cudnn.call_operands import call_operands, zero_rows
from sdpagraph.call import RuntimeInputs
from sdpagraph.fp8_values import largest, quantize
from sdpagraph.graphs.operands import FP8_AMAX, FP8_BACKWARD_AMAX, FP8_GRADIENT, stats_shape
from sdpagraph.spec import AttentionSpec

# The softmax's FP8 scale: probabilities in [0, 1] span e4m3's range (largest finite 448).
SOFTMAX_SCALE = 448.0
Run = Callable[[str, Mapping[str, Any], Mapping[str, jax.ShapeDtypeStruct]], dict[str, Any]]


def _scalar(x: Any) -> Any:
    return jnp.asarray(x, jnp.float32).reshape(1, 1, 1, 1)


def _amax_structs(roles: tuple[str, ...]) -> dict[str, jax.ShapeDtypeStruct]:
    return {role: jax.ShapeDtypeStruct((1, 1, 1, 1), jnp.float32) for role in roles}


def _forward_graph(spec: AttentionSpec, q8: Any, k8: Any, v8: Any, aux: Mapping[str, Any], scales: Mapping[str, Any],
                   run: Run, direction: str) -> dict[str, Any]:
    """The forward (or inference) graph's results for q, k, v's descales and the output's scale."""
    scales = {"descale_q": 1.0, "descale_k": 1.0, "descale_v": 1.0, "scale_o": 1.0, **scales,
              "descale_s": 1.0 / SOFTMAX_SCALE, "scale_s": SOFTMAX_SCALE}
    results = {"o": jax.ShapeDtypeStruct(q8.shape[:3] + v8.shape[3:], q8.dtype), **_amax_structs(FP8_AMAX)}
    if direction == "forward":
        results["stats"] = jax.ShapeDtypeStruct(stats_shape(spec), jnp.float32)
    operands = {"q": q8, "k": k8, "v": v8, **aux, **{role: _scalar(x) for role, x in scales.items()}}
    return run(direction, operands, results)


def inference(spec: AttentionSpec, q8: Any, k8: Any, v8: Any, inputs: RuntimeInputs, run: Run) -> tuple[Any, Any]:
    """(o (B, T, N, H_v) in the inputs' FP8 dtype, amax of o before scale_o) of cuDNN's sdpa_fp8, given
    q, k, v's descales and the output's scale (`inputs.fp8_scales`, float32 scalars; 1 when not given)."""
    aux, validity = call_operands(spec, inputs, 0)
    out = _forward_graph(spec, q8, k8, v8, aux, inputs.fp8_scales or {}, run, "inference")
    return zero_rows(out["o"], validity.q), out["amax_o"].reshape(())


def training(spec: AttentionSpec, query: Any, key: Any, value: Any, inputs: RuntimeInputs, run: Run) -> tuple[Any, Any]:
    """(out (B, T, N, H_v) in the inputs' dtype, logsumexp (B, N, T)), differentiable in q, k, v (straight
    through the quantization), through cuDNN's FP8 forward and backward graphs."""
    scales = inputs.fp8_scales or {}
    descales = tuple(jnp.asarray(scales.get(f"descale_{name}", 1.0), jnp.float32) for name in "qkv")
    aux, validity = call_operands(spec, inputs, 0)
    return _core(spec, run, jnp.dtype(query.dtype).name, aux, validity, query, key, value, descales)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _core(spec, run, dtype, aux, validity, query, key, value, descales):
    return _core_fwd(spec, run, dtype, aux, validity, query, key, value, descales)[0]


def _core_fwd(spec, run, dtype, aux, validity, query, key, value, descales):
    fp8 = jnp.dtype(spec.dtype)
    q8, k8, v8 = (quantize(x, d, fp8) for x, d in zip((query, key, value), descales))
    amax_v = jnp.max(jnp.abs(v8.astype(jnp.float32))) * descales[2]
    scale_o = largest(fp8) / jnp.maximum(amax_v, jnp.finfo(jnp.float32).tiny)
    given = {**dict(zip(("descale_q", "descale_k", "descale_v"), descales)), "scale_o": scale_o}
    out = _forward_graph(spec, q8, k8, v8, aux, given, run, "forward")
    o8 = zero_rows(out["o"], validity.q)
    result = (o8.astype(jnp.float32) / scale_o).astype(dtype)
    lse = out["stats"]
    if validity.q is not None:
        lse = jnp.where(validity.q[:, None, :], lse, -jnp.inf)
    return (result, lse), (q8, k8, v8, descales, o8, scale_o, out["stats"], aux, validity)


def _core_bwd(spec, run, dtype, residuals, cotangents):
    q8, k8, v8, descales, o8, scale_o, stats, aux, validity = residuals
    d_out, _ = cotangents  # the logsumexp is returned without a gradient, as jax does
    gradient = jnp.dtype(FP8_GRADIENT)
    d_out = zero_rows(d_out.astype(jnp.float32), validity.q)
    amax_do = jnp.maximum(jnp.max(jnp.abs(d_out)), jnp.finfo(jnp.float32).tiny)
    descale_do = amax_do / largest(gradient)
    fixed = {"q": q8, "k": k8, "v": v8, "o": o8, "dO": quantize(d_out, descale_do, gradient), "stats": stats, **aux,
             **{role: _scalar(x) for role, x in (("descale_q", descales[0]), ("descale_k", descales[1]),
                                                 ("descale_v", descales[2]), ("descale_o", 1.0 / scale_o),
                                                 ("descale_dO", descale_do), ("descale_s", 1.0 / SOFTMAX_SCALE),
                                                 ("scale_s", SOFTMAX_SCALE))}}
    results = {role: jax.ShapeDtypeStruct(x.shape, gradient) for role, x in (("dq", q8), ("dk", k8), ("dv", v8))}
    results.update(_amax_structs(FP8_BACKWARD_AMAX))

    def backward(scales):
        """(dq, dk, dv) in `dtype`, and whether a gradient left e5m2's well-resolved range at `scales`."""
        given = {"descale_dP": 1.0 / scales["dP"], "scale_dP": scales["dP"], "scale_dQ": scales["dQ"],
                 "scale_dK": scales["dK"], "scale_dV": scales["dV"]}
        out = run("backward", {**fixed, **{role: _scalar(x) for role, x in given.items()}}, results)
        grads = tuple((out[role].astype(jnp.float32) / scales[name]).astype(dtype) for role, name in _GRADIENTS)
        amax = {name: out[f"amax_{role.lower()}"].reshape(()) for role, name in (*_GRADIENTS, ("dp", "dP"))}
        return grads, amax

    guessed = _gradient_scales(spec, descales, amax_do, q8, k8, v8)
    first, amax = backward(guessed)
    # A gradient scaled past e5m2's largest value saturated, one scaled below RESOLVED lost bits to
    # subnormals: run once more with the scales its amaxes give (cuDNN reports them before scaling). dP's
    # scale is its bound, which holds. Under SPMD a device's dk, dv of an MQA split over query heads are
    # partial sums that add up to at most G times the largest one: room for G.
    scaled = [amax[name] * guessed[name] for name in ("dQ", "dK", "dV")]
    redo = jnp.any(jnp.stack([(x > largest(gradient)) | ((x > 0) & (x < RESOLVED)) for x in scaled]))
    room = {"dQ": 1, "dK": spec.num_heads // spec.num_kv_heads, "dV": spec.num_heads // spec.num_kv_heads}
    exact = {"dP": guessed["dP"], **{name: largest(gradient) / jnp.maximum(amax[name] * room[name],
                                                                            jnp.finfo(jnp.float32).tiny)
                                     for name in room}}
    dq, dk, dv = jax.lax.cond(redo, lambda: backward(exact)[0], lambda: first)
    return None, None, zero_rows(dq, validity.q), zero_rows(dk, validity.kv), zero_rows(dv, validity.kv), None


_GRADIENTS = (("dq", "dQ"), ("dk", "dK"), ("dv", "dV"))
# A gradient whose largest scaled value falls below this keeps too few values in e5m2's normal range
# (from 2^-14): 2^-6 leaves 8 binades above it.
RESOLVED = 2.0**-6


_core.defvjp(_core_fwd, _core_bwd)


def _gradient_scales(spec: AttentionSpec, descales: tuple[Any, Any, Any], amax_do: Any, q8: Any, k8: Any,
                     v8: Any) -> dict[str, Any]:
    """Scales for dP (the softmax gradient cuDNN quantizes), dq, dk, dv, chosen before they exist: each
    maps the geometric mean of a bound that holds for every input and a typical size onto e5m2's largest
    value, which keeps both ends inside e5m2's 2^30 of normal range; the backward checks the amaxes and
    reruns with exact scales when not (`_core_bwd`). With P the softmax and dS = P (dP - D):
    |dP| <= H max|dO| max|v|, |dS| <= 2 max|dP| P; a row of P sums to 1 and a column to at most T (G
    query heads share a key head), so |dq| <= 2 scale max|dP| max|k|, |dk| <= 2 scale max|dP| max|q| T G,
    |dv| <= max|dO| T G. Typical sizes take P ~ 1/S and sums of random signs: sqrt of the count."""
    top = largest(jnp.dtype(FP8_GRADIENT))
    amax_q, amax_k, amax_v = (jnp.max(jnp.abs(x.astype(jnp.float32))) * d for x, d in zip((q8, k8, v8), descales))
    count, keys = spec.q_len * (spec.num_heads // spec.num_kv_heads), spec.kv_len
    d_p = spec.head_dim_v * amax_do * amax_v
    typical_dp = d_p / spec.head_dim_v ** 0.5
    bounds = {"dP": (2 * d_p, 2 * d_p),
              "dQ": (2 * spec.scale * d_p * amax_k, spec.scale * typical_dp * amax_k / keys ** 0.5),
              "dK": (2 * spec.scale * d_p * amax_q * count, spec.scale * typical_dp * amax_q * count ** 0.5 / keys),
              "dV": (amax_do * count, amax_do * count ** 0.5 / keys)}
    tiny = jnp.finfo(jnp.float32).tiny
    return {name: top / jnp.maximum(jnp.sqrt(bound * typical), tiny) for name, (bound, typical) in bounds.items()}
