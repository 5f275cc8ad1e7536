"""FP8 attention (forward, inference) with per-tensor scales, on cuDNN's sdpa_fp8 where it runs.

    out8, amax_o = sdpagraph.fp8.attention(q8, k8, v8, descale_q=dq, descale_k=dk, descale_v=dv, scale_o=so,
                                           is_causal=True)
    out = sdpagraph.fp8.quantized_attention(q, k, v, is_causal=True)     bfloat16 in, bfloat16 out

`attention` takes q, k, v in one FP8 dtype (`jnp.float8_e4m3fn` or `jnp.float8_e5m2`) with their
descale factors (the real value of an element is its FP8 value times the descale) and the output's
scale, as Transformer Engine and jax's scaled attention do, and returns the output in the same FP8
dtype (saturated at the dtype's largest value) with `amax_o`, the largest |output| before `scale_o`
(the next step's scale in delayed scaling). The scales are traced: new values never rebuild a graph.

cuDNN 9.19 on Hopper runs FP8 attention forward with a head dim that is a multiple of 16 up to 256,
no mask or top-left causal, padding lengths, GQA; no bias, no bottom-right causal (and sdpagraph lowers
no score_mod, window, chunks, segments, sinks or dropout with it). Calls it does not run are
dequantized and run by `sdpagraph.attention` in bfloat16, and `check_support` says why.

`quantized_attention` is the inference convenience: it scales bfloat16 (or float16/float32) q, k, v
by their current absolute maxima into FP8 (the output's scale from v's: |out| <= max |v|), runs
`attention` and returns the dequantized output in the inputs' dtype. It uses FP8 only where FP8 is
measured faster than the bfloat16 call (`FP8_MIN_KV_LEN`, `FP8_MIN_SCORES`): shorter calls run in bfloat16.
`attention` is inference only (a gradient raises `FP8GradientError`); `quantized_attention(...,
training=True)` trains through cuDNN's FP8 forward and backward (gradients in e5m2) where that is faster.
"""
from __future__ import annotations

import dataclasses
import logging
import numbers
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from sdpagraph.api import attention as bf16_attention
from sdpagraph.backends import registry
from sdpagraph.call import PreparedCall, as_4d, notify_trace_listeners, prepare_call
from sdpagraph.errors import SdpagraphError
from sdpagraph.fp8_values import amax_descale, quantize, saturate
from sdpagraph.gradients import call_without_gradient, without_gradient
from sdpagraph.graphs.support import Support
from sdpagraph.logs import log_once, logger
from sdpagraph.numerics import gate as numerics_gate
from sdpagraph.spec import FP8_DTYPES

__all__ = ["attention", "check_support", "quantized_attention", "fp8_training_pays", "FP8GradientError",
           "FP8_MIN_KV_LEN", "FP8_MIN_SCORES", "FP8_TRAIN_MIN_KV_LEN"]

SCALES = ("descale_q", "descale_k", "descale_v", "scale_o")
IMPLEMENTATIONS = (None, "cudnn", "bf16")
# quantized_attention runs FP8 from FP8_MIN_KV_LEN keys and FP8_MIN_SCORES scores (B * N * T * S) on.
# Its quantizing passes (amax, then cast, of q, k and v) cost memory traffic that only long key rows
# repay: on an H100 (bench/fp8.py, docs/results/h100-2026-11-26-fp8.md) it ran 1.09x bf16's forward at
# B1 T8192 N16, 1.19x at N32/K8 T8192, 1.38x at N64/K8 T16384, but 0.83-0.86x at S = 4096 (B1 and B4
# N16) and 0.77x at T2048.
FP8_MIN_KV_LEN = 8192
FP8_MIN_SCORES = 2**30
# quantized_attention(training=True) runs FP8 from this many keys on, at head dim 128 (cuDNN's FP8
# backward on Hopper takes no other). On an H100 (bench/fp8.py) FP8 training ran 1.24x bf16's fwd+bwd
# (backward 1.21x) at B1 T16384 N16 without a mask, 1.18x (1.15x) with causal, 1.19x (1.10x) at T8192.
FP8_TRAIN_MIN_KV_LEN = 8192


class FP8GradientError(SdpagraphError, NotImplementedError):
    """An FP8 inference call (`attention`, `quantized_attention(training=False)`) was differentiated."""


def attention(query: Any, key: Any, value: Any, *, descale_q: Any = 1.0, descale_k: Any = 1.0, descale_v: Any = 1.0,
              scale_o: Any = 1.0, scale: float | None = None, is_causal: bool = False,
              query_seq_lengths: Any = None, key_value_seq_lengths: Any = None,
              implementation: str | None = None) -> tuple[Any, Any]:
    """FP8 scaled dot-product attention: `(out8, amax_o)`.

    Args:
      query, key, value: `(B, T, N, H)`, `(B, S, K, H)`, `(B, S, K, H)` in one FP8 dtype
        (`jnp.float8_e4m3fn` or `jnp.float8_e5m2`); N a multiple of K.
      descale_q, descale_k, descale_v: float32 scalars: the real value of an element is its FP8 value
        times its tensor's descale (1 / the scale it was quantized with).
      scale_o: the output's scale: `out8 = saturate(out * scale_o)` in the inputs' FP8 dtype.
      scale, is_causal, query_seq_lengths, key_value_seq_lengths: as in `sdpagraph.attention`
        (causal is top-left; padded query rows give 0).
      implementation: None (cuDNN's FP8 graph where it runs, else dequantized in bfloat16), "cudnn"
        (raise ValueError with the reason where it does not), or "bf16" (always dequantized).

    Returns:
      `out8` `(B, T, N, H)` in the inputs' FP8 dtype and `amax_o`, the largest |output| before
      `scale_o` (float32 scalar). Not differentiable (`FP8GradientError`).
    """
    call, fp8 = _prepare(query, key, value, scale, is_causal, query_seq_lengths, key_value_seq_lengths, implementation)
    scales = {name: _scale(value_, name) for name, value_ in zip(SCALES, (descale_q, descale_k, descale_v, scale_o))}
    if implementation != "bf16":  # spec recording (before the support answer: a spec file from any machine)
        notify_trace_listeners(call.spec, None, False)
    answer = _decide(call, implementation)
    q, k, v = (as_4d(x, call.unbatched) for x in (query, key, value))
    arguments = dict(scale=call.spec.scale, is_causal=is_causal, query_seq_lengths=query_seq_lengths,
                     key_value_seq_lengths=key_value_seq_lengths)
    if answer.supported:
        def run(arrays):
            q, k, v, scales, inputs = arrays
            inputs = dataclasses.replace(call.inputs, fp8_scales=scales, **inputs)
            return registry.primary().fp8_attention(call.spec, q, k, v, inputs, verify=numerics_gate.checked)
        traced = {"q_lengths": call.inputs.q_lengths, "kv_lengths": call.inputs.kv_lengths}
        out, amax = call_without_gradient(_no_gradient(), run, (q, k, v, scales, traced))
    else:
        if implementation is None:
            log_once(logger, logging.INFO, f"sdpagraph: FP8 attention {call.spec.summary()} runs dequantized in "
                                           f"bfloat16: {answer.reason}")
        out, amax = _dequantized(*without_gradient(_no_gradient(), q, k, v), scales, fp8, **arguments)
    return (out[0] if call.unbatched else out), amax


def _no_gradient() -> FP8GradientError:
    return FP8GradientError("sdpagraph.fp8.attention (and quantized_attention with training=False) has no "
                            "gradient: train with sdpagraph.fp8.quantized_attention(..., training=True) or "
                            "sdpagraph.attention in bfloat16")


def check_support(query: Any, key: Any, value: Any, *, scale: float | None = None, is_causal: bool = False,
                  query_seq_lengths: Any = None, key_value_seq_lengths: Any = None,
                  implementation: str | None = None, **scales: Any) -> Support:
    """Will `fp8.attention(query, key, value, ...)` run on cuDNN's FP8 graph here, and if not, why?
    `supported` says whether it does; `backend` is "cudnn" or "bf16" (dequantized). Arrays or
    `jax.ShapeDtypeStruct`s; the scales are accepted and not read."""
    unknown = set(scales) - set(SCALES)
    if unknown:
        raise TypeError(f"check_support() got unexpected arguments {sorted(unknown)}")
    call, _ = _prepare(query, key, value, scale, is_causal, query_seq_lengths, key_value_seq_lengths, implementation)
    return _decide(call, implementation, raise_unsupported=False)


def quantized_attention(query: Any, key: Any, value: Any, *, scale: float | None = None, is_causal: bool = False,
                        query_seq_lengths: Any = None, key_value_seq_lengths: Any = None,
                        fp8_dtype: Any = jnp.float8_e4m3fn, implementation: str | None = None,
                        training: bool = False) -> Any:
    """Attention through FP8 with current scaling: q, k, v (bfloat16, float16 or float32) quantized by
    their absolute maxima, cuDNN's FP8 graphs, the output dequantized to the inputs' dtype.

    `training=False` (inference; `fp8.attention` on the quantized inputs): FP8 where it is measured
    faster, from `FP8_MIN_KV_LEN` keys and `FP8_MIN_SCORES` scores on. Accuracy with e4m3 (relative L2
    on an H100): 3.3e-2 against float32 attention on the dequantized inputs, 5-9e-2 against attention
    on the inputs as given (their rounding included).
    `training=True`: differentiable (straight through the quantization), cuDNN's FP8 forward and
    backward, the gradients through e5m2 (~10% relative error); FP8 where it is measured faster
    (`fp8_training_pays`: head dim 128, from `FP8_TRAIN_MIN_KV_LEN` keys on).
    `implementation`: None (FP8 where it pays, else the bfloat16 `sdpagraph.attention`), "cudnn"
    (always FP8; ValueError where cuDNN's FP8 graphs do not run the call), or "bf16" (never).
    """
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation must be one of {IMPLEMENTATIONS}, got {implementation!r}")
    fp8 = _fp8_dtype(fp8_dtype)
    arguments = dict(scale=scale, is_causal=is_causal, query_seq_lengths=query_seq_lengths,
                     key_value_seq_lengths=key_value_seq_lengths)
    q_shape, k_shape = query.shape, key.shape
    if training:
        pays = fp8_training_pays(k_shape[-3], q_shape[-1])
        if implementation == "bf16" or (implementation is None and not pays):
            return bf16_attention(query, key, value, **arguments)
        return _quantized_training(query, key, value, fp8, implementation, arguments)
    scores = int(np.prod(q_shape[:-1])) * int(k_shape[-3])  # B * T * N * S
    pays = scores >= FP8_MIN_SCORES and k_shape[-3] >= FP8_MIN_KV_LEN
    if implementation == "bf16" or (implementation is None and not pays):  # no gradient at any size
        return bf16_attention(*without_gradient(_no_gradient(), query, key, value), training=False, **arguments)
    descales = [amax_descale(x, fp8) for x in (query, key, value)]
    quantized = [quantize(x, descale, fp8) for x, descale in zip((query, key, value), descales)]
    scale_o = 1.0 / descales[2]  # |out| <= max |v|: v's scale keeps the output in range
    out8, _ = attention(*quantized, descale_q=descales[0], descale_k=descales[1], descale_v=descales[2],
                        scale_o=scale_o, implementation=None if implementation is None else "cudnn", **arguments)
    return (out8.astype(jnp.float32) * descales[2]).astype(query.dtype)


def fp8_training_pays(kv_len: int, head_dim: int) -> bool:
    """Whether FP8 training (forward and backward) is measured faster than bf16 for such a call."""
    return head_dim == 128 and kv_len >= FP8_TRAIN_MIN_KV_LEN


# ----------------------------------------------------------------------------- pieces

def _quantized_training(query: Any, key: Any, value: Any, fp8: Any, implementation: str | None,
                        arguments: dict[str, Any]) -> Any:
    """The differentiable FP8 call (`backends.cudnn.fp8.training`) where cuDNN runs it, else bf16."""
    structs = [jax.ShapeDtypeStruct(x.shape, fp8) for x in (query, key, value)]
    call, _ = _prepare(*structs, arguments["scale"], arguments["is_causal"], arguments["query_seq_lengths"],
                       arguments["key_value_seq_lengths"], implementation)
    notify_trace_listeners(call.spec, None, True)  # before the support answer: a spec file from any machine
    answer = registry.primary().support(call.spec, None, training=True, verify=numerics_gate.checked)
    if not answer.supported:
        if implementation == "cudnn":
            raise ValueError(f"implementation='cudnn' cannot train FP8 attention {call.spec.summary()}: "
                             f"{answer.reason}")
        log_once(logger, logging.INFO, f"sdpagraph: FP8 training {call.spec.summary()} runs in bfloat16: "
                                       f"{answer.reason}")
        return bf16_attention(query, key, value, **arguments)
    descales = {f"descale_{name}": jax.lax.stop_gradient(amax_descale(x, fp8))
                for name, x in zip("qkv", (query, key, value))}
    q, k, v = (as_4d(x, call.unbatched) for x in (query, key, value))
    inputs = dataclasses.replace(call.inputs, fp8_scales=descales)
    out, _ = registry.primary().attention(call.spec, q, k, v, inputs, None, training=True,
                                          verify=numerics_gate.checked)
    return out[0] if call.unbatched else out


def _fp8_dtype(dtype: Any) -> Any:
    try:
        name = np.dtype(dtype).name
    except TypeError as error:
        raise TypeError(f"fp8_dtype must be one of {FP8_DTYPES}, got {dtype!r}") from error
    if name not in FP8_DTYPES:
        raise TypeError(f"fp8_dtype must be one of {FP8_DTYPES}, got {name}")
    return jnp.dtype(name)


def _prepare(query: Any, key: Any, value: Any, scale: Any, is_causal: Any, query_seq_lengths: Any,
             key_value_seq_lengths: Any, implementation: Any) -> tuple[PreparedCall, Any]:
    """The validated call, its spec in the inputs' FP8 dtype; and that dtype."""
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation must be one of {IMPLEMENTATIONS}, got {implementation!r}")
    dtypes = {name: getattr(x, "dtype", None) for name, x in (("query", query), ("key", key), ("value", value))}
    names = {name: (np.dtype(d).name if d is not None else type(x).__name__)
             for (name, d), x in zip(dtypes.items(), (query, key, value))}
    if len(set(names.values())) != 1 or names["query"] not in FP8_DTYPES:
        raise TypeError(f"query, key and value must share one FP8 dtype of {FP8_DTYPES} (sdpagraph.attention takes "
                        f"the others; sdpagraph.fp8.quantized_attention quantizes bfloat16), got {names}")
    # The arguments are validated as a bfloat16 call's (the FP8 graph takes a subset of them).
    as_bf16 = [jax.ShapeDtypeStruct(x.shape, jnp.bfloat16) for x in (query, key, value)]
    call = prepare_call(*as_bf16, scale=scale, is_causal=is_causal, query_seq_lengths=query_seq_lengths,
                        key_value_seq_lengths=key_value_seq_lengths)
    return dataclasses.replace(call, spec=dataclasses.replace(call.spec, dtype=names["query"])), dtypes["query"]


def _scale(value: Any, name: str) -> Any:
    """A scale argument as a float32 scalar (traced ones stay traced)."""
    if isinstance(value, bool) or not (isinstance(value, numbers.Real) or hasattr(value, "dtype")):
        raise TypeError(f"{name} must be a float or a float32 scalar array, got {type(value).__name__}")
    if hasattr(value, "shape") and int(np.prod(value.shape)) != 1:
        raise ValueError(f"{name} must be a scalar (one per tensor), got shape {tuple(value.shape)}")
    return jnp.asarray(value, jnp.float32).reshape(())


def _decide(call: PreparedCall, implementation: str | None, *, raise_unsupported: bool = True) -> Support:
    """Whether cuDNN's FP8 graph runs the call (built and numerically checked), else why not."""
    if implementation == "bf16":
        return Support(False, "bf16", "implementation='bf16' was requested: dequantized in bfloat16")
    answer = registry.primary().support(call.spec, None, training=False, verify=numerics_gate.checked)
    if answer.supported:
        return Support(True, registry.primary().name, answer.reason)
    if implementation == "cudnn" and raise_unsupported:
        raise ValueError(f"implementation='cudnn' cannot run FP8 attention {call.spec.summary()}: {answer.reason}")
    return Support(False, "bf16", f"dequantized in bfloat16: {answer.reason}")


def _dequantized(q: Any, k: Any, v: Any, scales: dict[str, Any], fp8: Any, **arguments: Any) -> tuple[Any, Any]:
    """The FP8 call run by `sdpagraph.attention` in bfloat16: (out8, amax_o)."""
    real = [(x.astype(jnp.float32) * scales[f"descale_{name}"]).astype(jnp.bfloat16)
            for name, x in zip("qkv", (q, k, v))]
    out = bf16_attention(*real, training=False, **arguments).astype(jnp.float32)
    return saturate(out * scales["scale_o"], fp8), jnp.max(jnp.abs(out))
