"""`sdpagraph.attention` and `sdpagraph.check_support`: one argument path, two questions.

Both normalize arguments with `call.prepare_call` (the same code), so the support
query and the runtime can never disagree about what a call means.

Layers above (deployment's spec recording) watch the calls the runtime traces through
`call.add_trace_listener`, so this module never imports them.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp

from sdpagraph.config import NATIVE_SINKS, xla_deterministic_ops
from sdpagraph.graphs.support import Support
from sdpagraph.parallel import context_parallel
from sdpagraph.backends import registry, sinks as sinks_mod
from sdpagraph.dispatch.decide import choose_backend, decide, joined
from sdpagraph.call import PreparedCall, as_4d, notify_trace_listeners, prepare_call
from sdpagraph.numerics import gate as numerics_gate
from sdpagraph import dropout as dropout_mod, paged

# The backends load with the API, not inside the first call's trace: a serving process's first step
# (and a training step's first trace) then runs no imports.
registry.names()


def _notify_listeners(call: PreparedCall, training: bool, sinks: bool = False) -> None:
    """Report the call's graphs (spec recording); with sinks and cuDNN's own sinks on
    (`SDPAGRAPH_NATIVE_SINKS`), also the forward graph with them, which the call runs where it builds."""
    notify_trace_listeners(call.spec, call.score_mod, training or sinks)  # composed sinks read the stats
    if sinks and NATIVE_SINKS.enabled():
        notify_trace_listeners(dataclasses.replace(call.spec, sinks=True), call.score_mod, training)


def _prepare(query: Any, key: Any, value: Any, bias: Any = None, mask: Any = None, *, page_table: Any = None,
             **kwargs: Any) -> PreparedCall:
    """The validated call: with `page_table`, a paged one (`paged.prepare_paged_call`)."""
    if page_table is not None:
        return paged.prepare_paged_call(query, key, value, page_table, bias, mask, **kwargs)
    return prepare_call(query, key, value, bias, mask, **kwargs)


def _with_determinism(call: PreparedCall, deterministic: Any) -> PreparedCall:
    """`call` with its spec asking for cuDNN's deterministic backward when `deterministic` is True, or
    None and XLA runs deterministic ops (`--xla_gpu_deterministic_ops=true` in XLA_FLAGS)."""
    if deterministic is not None and not isinstance(deterministic, bool):
        raise TypeError(f"deterministic must be True, False or None, got {type(deterministic).__name__}")
    if deterministic is None:
        deterministic = xla_deterministic_ops()
    if not deterministic:
        return call
    return dataclasses.replace(call, spec=dataclasses.replace(call.spec, deterministic=True))


def _check_dropout_use(call: PreparedCall, page_table: Any, context_parallel_axis: Any) -> None:
    """ValueError for dropout where it has no meaning here: paged K/V (serving, inference only), and
    context parallelism (each device's blocks would draw masks of their own positions)."""
    if not call.spec.dropout:
        return
    if page_table is not None:
        raise ValueError("dropout_rate applies to training; paged K/V (page_table) is inference-only: pass "
                         "dropout_rate=0")
    if context_parallel_axis is not None:
        raise ValueError("dropout_rate cannot be combined with context_parallel_axis yet: pass dropout_rate=0, or "
                         "shard the batch or heads instead of the sequence")


def _check_implementation(implementation: Any) -> None:
    """ValueError unless `implementation` is None or a registered backend's name."""
    if implementation is not None:
        registry.get(implementation)


def attention(
    query: Any,
    key: Any,
    value: Any,
    bias: Any = None,
    mask: Any = None,
    *,
    scale: float | None = None,
    is_causal: bool = False,
    query_seq_lengths: Any = None,
    key_value_seq_lengths: Any = None,
    local_window_size: int | tuple[int, int] | None = None,
    implementation: str | None = None,
    return_residual: bool = False,
    causal_alignment: str = "top_left",
    segment_ids: Any = None,
    max_segments_per_seq: int | None = None,
    chunk_size: int | None = None,
    score_mod: Callable | None = None,
    score_mod_tensors: Mapping[str, Any] | None = None,
    score_mod_bprop: Callable | None = None,
    mask_mod: Callable | None = None,
    training: bool = True,
    sinks: Any = None,
    max_seqlen_q: int | None = None,
    max_seqlen_kv: int | None = None,
    page_table: Any = None,
    deterministic: bool | None = None,
    dropout_rate: float = 0.0,
    dropout_rng: Any = None,
    context_parallel_axis: str | None = None,
    load_balanced: bool | str = False,
    context_parallel_strategy: str = "ring",
    mesh: Any = None,
) -> Any:
    r"""Scaled dot-product attention with flex-attention extensions; a drop-in for
    `jax.nn.dot_product_attention`.

    Computes, per batch b and head n (query head n reads key/value head n // (N // K)):

        logits = score_mod(scale * q . k^T) + bias
        out    = softmax(logits masked by every mask below) . v
                 (with `sinks`, exp(sinks[n]) joins each row's softmax denominator)

    Args:
      query: `(B, T, N, H)` (or `(T, N, H)`), float32 / bfloat16 / float16.
      key: `(B, S, K, H)`; N must be a multiple of K (GQA / MQA).
      value: `(B, S, K, H_v)`.
      bias: additive bias broadcastable to `(B, N, T, S)`; differentiable. As in jax, a
        lower rank is left-padded with 1s: `(S,)`, `(T, S)`, `(N, T, S)` (also with 3-D
        unbatched inputs), a scalar; every other axis must be 1 or full.
      mask: boolean, broadcastable to `(B, N, T, S)` the same way; True means attend.
      scale: logit scale, default `1 / sqrt(H)`.
      is_causal: causal mask, aligned by `causal_alignment`.
      query_seq_lengths / key_value_seq_lengths: `(B,)` int32 valid lengths (padding).
        Padded query rows give zero output.
      local_window_size: `w` or `(left, right)`: query i sees keys in
        `[i - left, i + right]` around the aligned diagonal; -1 leaves a side open.
      implementation: None (the fastest backend that can run the call, by measured speed:
        cuDNN for most calls; XLA or "small_seq" where cuDNN is measured slower, e.g. query
        length 1-4 with 32 keys or fewer over a huge batch; the reason is logged once at
        INFO, at WARNING when T * S >= 2**24), "xla", "cudnn" (raises with the reason if
        unsupported), or "small_seq" (the small-sequence backend: T <= 4, S <= 32, or packed
        with `max_seqlen_q` <= 4 and `max_seqlen_kv` <= 32; raises outside that regime).
      return_residual: also return the logsumexp, shape `(B, T, N)`, as jax does.
      causal_alignment: "top_left" (jax's default) or "bottom_right": the diagonal ends
        at the last query/key pair, for T != S.
      segment_ids: packed sequences: `(B, T)` int32 (self-attention) or a pair
        `(q_segment_ids (B, T), kv_segment_ids (B, S))`. 0 marks padding; a segment is
        a contiguous run of one id; the k-th query segment attends to the k-th key
        segment only. Causal, windows, chunks and score_mod positions count from each
        segment's start.
      max_segments_per_seq: static bound on segments per row (default: T, always
        enough). A row of query ids with more segments raises `ValueError` (with the row,
        its count and the bound) when the ids are concrete. Under `jit` the ids are
        checked on the device (O(B*T), no host round trip) and a row past the bound gives
        NaN output (and logsumexp), so it cannot pass silently; with
        `SDPAGRAPH_CHECK_SEGMENTS=raise` it raises instead when the call runs (one host
        callback per call; a `jax.errors.JaxRuntimeError` with the message, also logged
        at ERROR). `SDPAGRAPH_CHECK_SEGMENTS=off` switches the checks off; segments past
        the bound are then dropped (their query rows give 0).
      chunk_size: Llama-4 chunked attention: only keys in the same chunk of
        `chunk_size` positions (per segment when packed); combines with `is_causal`.
      score_mod: an elementwise change of the scaled scores `score[b, h, q, kv]`, in one
        of two forms. jax.numpy, as in PyTorch FlexAttention:
        `score_mod(score, b, h, q_idx, kv_idx) -> score`, e.g.
        `lambda s, b, h, q, kv: 30 * jnp.tanh(s / 30)`; it is traced once and converted
        into a cuDNN graph (arrays it closes over and indexes by `b`, `h`, `q_idx` or
        `kv_idx`, like `slopes[h]`, become graph operands). What the conversion cannot
        express (a gather at a computed index, control flow, random numbers) runs on
        XLA, and `check_support` names it. Or the graph form
        `score_mod(graph, score, tensors) -> tensor`, written with cudnn-frontend
        pygraph pointwise ops (`graph.tanh(input=...)`, `graph.gen_index(input=score,
        axis=2)`, ...) or Python operators; see `sdpagraph.mods` for ready-made ones.
        Any other number of parameters is a TypeError.
      score_mod_tensors: names -> values the mod receives as graph tensors. Python or
        NumPy scalars are bound at execution (a new value does not rebuild a cuDNN
        graph); arrays broadcastable to `(B, N, T, S)` become operands and are
        constants for differentiation (use `bias` for a differentiable additive term).
        jax scalars (traced under `jit`, e.g. `mods.softcap(cap)` with `cap` an
        argument) are `(1, 1, 1, 1)` array operands: no new graph per value, and
        constants for differentiation too. A mod reading a name it was not given
        raises a `KeyError` that is also a `ValueError`, naming the missing tensor.
      score_mod_bprop: `score_mod_bprop(graph, dscore, tensors) -> tensor`, the gradient
        through the mod. Derived automatically when omitted.
      mask_mod: `mask_mod(b, h, q_idx, kv_idx) -> bool` in jax.numpy, True = attend, as in
        FlexAttention; applied after the score_mod and combined with every other mask.
        Native patterns (`q_idx >= kv_idx`, windows) become the masks cuDNN skips tiles
        for. A row it leaves with nothing to attend gives 0 on XLA (on cuDNN such rows
        are not yet checked on a GPU).
      training: False selects cuDNN's inference graph (no softmax stats) when no
        gradient is needed.
      sinks: attention sinks (gpt-oss): `(N,)` logits, one per query head (float32
        recommended), differentiable; exp(sinks[n]) joins each row's softmax denominator and
        adds no value (not passed through score_mod or bias). On cuDNN too, with gradients
        (docs/sinks.md); the residual then includes the sink.
      deterministic: run cuDNN's deterministic backward algorithm (bitwise-reproducible gradients,
        usually slower); None (default): when XLA runs with `--xla_gpu_deterministic_ops=true`
        (`XLA_FLAGS`), as XLA's own ops then are.
      dropout_rate: attention dropout: each attention weight is kept with probability
        1 - dropout_rate and scaled by 1 / (1 - dropout_rate) (docs/dropout.md); static, in [0, 1).
        The logsumexp residual is the softmax's before dropout. On cuDNN (Philox) and XLA alike.
      dropout_rng: a jax PRNG key (`jax.random.key(seed)`), needed when `dropout_rate > 0`; the
        same key and shapes draw the same mask, so pass a new key each step.
      page_table: paged K/V for serving (docs/paged.md): `key` and `value` are then page pools
        `(num_pages, page_size, K, H)`, `page_table` `(B, max_pages)` int32 lists each
        sequence's pages in order, and `key_value_seq_lengths` its key count; T = 1 is
        decode, small T multi-token decode, larger T with `query_seq_lengths` chunked
        prefill (use `is_causal=True, causal_alignment="bottom_right"`). Traced tables and
        lengths reuse the graph. Inference only: a gradient raises `paged.PagedGradientError`.
      max_seqlen_q / max_seqlen_kv: static bounds on the length of each packed query /
        key segment (positive ints; with `segment_ids` only). Runtime lengths are unknown
        at trace time, so these hints say when a packed call is in the small-sequence
        regime (`max_seqlen_q` <= 4, `max_seqlen_kv` <= 32; without a hint it is not).
        In self-attention (one ids array) a segment has as many keys as queries, so the
        smaller hint given bounds both. cuDNN runs packed self-attention with a score_mod
        on short rows of whole documents (bins: see `graphs.binning`; per device), as long
        as `max_seqlen_kv` (without it: a quarter of a row, and longer documents run on the
        whole rows); other backends only validate them. A longer
        segment raises `ValueError` (concrete ids) or gives its batch row NaN under `jit`,
        as `max_segments_per_seq` does (and `SDPAGRAPH_CHECK_SEGMENTS=off` switches that
        off: the small-sequence backend then drops keys past the bound).
      context_parallel_axis: a mesh axis name: q, k, v (and `segment_ids`) are split
        along the sequence (dim 1) over it, and attention runs without gathering k or v
        (docs/multi-gpu.md). The mesh is `jax.set_mesh(...)`'s or `mesh=`; inside a
        `jax.shard_map` that maps the axis, q, k, v are the local blocks. Other mesh
        axes split the batch when they divide it. Not with `bias`, `mask`, sequence
        lengths or cross-attention segment ids (use `segment_ids`). Score_mods, masks
        and windows see global positions. T and S must be divisible by the axis size
        (twice it when `load_balanced`), else `ValueError`.
      load_balanced: True: the sequence is in `sdpagraph.load_balance` order (device i
        holds chunks i and 2·cp−1−i of 2·cp), which evens out causal work; the output
        comes back in that order too (`sdpagraph.unload_balance` restores it).
        "documents" (packed documents): q, k, v come from `load_balance(x, cp,
        segment_ids=ids)`, which cuts every document that way, so their causal work is
        even too; `segment_ids` are given in their natural order. The ring runs it as
        one packed cuDNN call a step (no score_mod), all_to_all runs any call. Rows
        from `load_balance(x, cp, segment_ids=ids, whole_documents=True)` (documents
        kept whole, reordered to even their work) are ordinary packed rows: False.
      context_parallel_strategy: "ring" (K/V blocks pass around the ring with
        `ppermute`, overlapped with compute; causal blocks in the future are skipped),
        "all_to_all" (heads <-> sequence with `all_to_all`: each device attends the whole
        sequence on N/cp heads; N and K must be divisible by cp), "halo" (sliding windows
        and chunks: each device receives from its neighbours only the keys its windows
        reach, then runs one call), or "auto" (`strategy.choose_strategy`: the halo
        for windows and chunks it takes, the ring for packed documents without a score_mod
        from T32768, all_to_all when the heads divide cp and T <= 65536 or the ring would
        run XLA blocks, else the ring; measured on two GPUs, docs/multi-gpu.md).
      mesh: the mesh of `context_parallel_axis`, when no `jax.set_mesh` is active.

    Returns:
      `(B, T, N, H_v)` in the input dtype (and the logsumexp if `return_residual`).
      Differentiable in reverse mode (`jax.grad`, `jax.vjp`); forward mode (`jax.jvp`) works
      only where the XLA backend forms all scores at once (keys up to 1024 on CPU).
      With an empty axis (B, T, S or N of 0) it returns what jax does: an empty
      array, or zeros (logsumexp -inf) when S is 0, from the XLA backend whatever
      `implementation` says.
    """
    if context_parallel_axis is None and (load_balanced or context_parallel_strategy != "ring" or mesh is not None):
        raise ValueError("load_balanced, context_parallel_strategy and mesh apply to context parallelism: "
                         "pass context_parallel_axis= (the mesh axis the sequence is split over)")
    _check_implementation(implementation)
    if context_parallel_axis is not None and segment_ids is not None:
        segment_ids = context_parallel.natural_order(segment_ids, context_parallel_axis, mesh, load_balanced)
    if page_table is not None and context_parallel_axis is not None:
        raise ValueError("page_table (paged K/V) cannot be combined with context_parallel_axis")
    call = _prepare(
        query, key, value, bias, mask, page_table=page_table, scale=scale, is_causal=is_causal,
        query_seq_lengths=query_seq_lengths, key_value_seq_lengths=key_value_seq_lengths,
        local_window_size=local_window_size,
        causal_alignment=causal_alignment, segment_ids=segment_ids,
        max_segments_per_seq=max_segments_per_seq, chunk_size=chunk_size, score_mod=score_mod,
        score_mod_tensors=score_mod_tensors, score_mod_bprop=score_mod_bprop, mask_mod=mask_mod,
        max_seqlen_q=max_seqlen_q, max_seqlen_kv=max_seqlen_kv,
    )
    call = dropout_mod.with_dropout(_with_determinism(call, deterministic), dropout_rate, dropout_rng)
    _check_dropout_use(call, page_table, context_parallel_axis)
    if page_table is not None:  # inference only: the inference graph, and no gradient
        training = False
        query, key, value = paged.inference_only(query, key, value)
    if sinks is not None:
        sinks = sinks_mod.check(sinks, call.spec.num_heads)
    if call.spec.empty_axes:  # nothing to compute (no graph to build): jax's empty or zero result
        implementation = registry.reference().name
    # Only calls a graph can serve; a context-parallel call reports its block graphs itself.
    if (implementation != registry.reference().name and call.inputs.python_mods is None
            and context_parallel_axis is None):
        _notify_listeners(call, training, sinks is not None)
    q, k, v = (as_4d(x, call.unbatched) for x in (query, key, value))
    # A context-parallel call's blocks run the backend context_parallel.plan chooses.
    if context_parallel_axis is not None:
        out, lse = context_parallel.attention(
            call, q, k, v, axis=context_parallel_axis, load_balanced=load_balanced,
            strategy=context_parallel_strategy, mesh=mesh, implementation=implementation, sinks=sinks)
    elif sinks is not None:  # the sinks join the softmax inside the backend (`Backend.attention_with_sinks`)
        backend = registry.get(choose_backend(call, implementation, training))
        out, lse = backend.attention_with_sinks(call.spec, q, k, v, call.inputs, call.score_mod, sinks,
                                                training=training or return_residual, verify=numerics_gate.checked)
    else:  # an inference graph keeps no softmax stats: a residual needs the training one
        backend = registry.get(choose_backend(call, implementation, training))
        out, lse = backend.attention(call.spec, q, k, v, call.inputs, call.score_mod,
                                     training=training or return_residual, verify=numerics_gate.checked)
    if context_parallel_axis is None:  # a context-parallel call poisons its rows inside its shard_map
        out, lse = call.poison(out, lse)
    if call.unbatched:
        out, lse = out[0], (None if lse is None else lse[0])
    if return_residual:
        # As jax: the logsumexp is an output of the forward only, never differentiated through.
        return out, jax.lax.stop_gradient(jnp.swapaxes(lse, -1, -2).astype(out.dtype))
    return out


def check_support(query: Any, key: Any, value: Any, bias: Any = None, mask: Any = None, *,
                  training: bool = True, **kwargs: Any) -> Support:
    """Will `attention(query, key, value, bias, mask, **kwargs)` run on cuDNN here, and if not, why?

    `supported` says whether cuDNN runs the call; `backend` is the backend `attention` will use
    (the fastest that can run it, see `implementation`), and `reason` says why, with the predicted
    times when the choice was made by speed. Takes the same arguments as `attention` (arrays or
    `jax.ShapeDtypeStruct`s) and normalizes them with the same code. Invalid arguments raise the same errors
    `attention` raises. `training=True` checks the backward graph too. A supported
    answer leaves the graphs in the cache, so the later call builds nothing. With
    `context_parallel_axis`, the answer is about the graphs of one device's blocks.
    """
    kwargs.pop("return_residual", None)
    sinks = kwargs.pop("sinks", None)
    deterministic = kwargs.pop("deterministic", None)
    implementation = kwargs.pop("implementation", None)
    _check_implementation(implementation)
    parallel = {name: kwargs.pop(name) for name in ("context_parallel_axis", "load_balanced",
                                                    "context_parallel_strategy", "mesh") if name in kwargs}
    axis = parallel.get("context_parallel_axis")
    if axis is not None and kwargs.get("segment_ids") is not None:
        kwargs["segment_ids"] = context_parallel.natural_order(kwargs["segment_ids"], axis, parallel.get("mesh"),
                                                               parallel.get("load_balanced", False))
    dropout = {name: kwargs.pop(name, default) for name, default in (("dropout_rate", 0.0), ("dropout_rng", None))}
    call = _with_determinism(_prepare(query, key, value, bias, mask, **kwargs), deterministic)
    call = dropout_mod.with_dropout(call, dropout["dropout_rate"], dropout["dropout_rng"], draw=False)
    _check_dropout_use(call, call.inputs.page_table, axis)
    if call.spec.paged is not None:  # inference only
        training = False
    if sinks is not None:
        sinks_mod.check(sinks, call.spec.num_heads)
    if axis is not None:
        answer = context_parallel.support(call, axis, parallel.get("load_balanced", False),
                                          parallel.get("context_parallel_strategy", "ring"), parallel.get("mesh"),
                                          implementation)
    elif call.spec.empty_axes:
        answer = Support(False, registry.reference().name,
                         f"axis {', '.join(call.spec.empty_axes)} has size 0: nothing to compute; "
                         "attention returns jax's empty (or zero) result from the XLA backend")
    else:
        answer = decide(call, implementation, training, raise_on_miss=False)
    if sinks is None:
        return answer
    how = sinks_mod.COMPOSED
    if axis is None and not call.spec.empty_axes:
        how = registry.get(answer.backend).sinks_path(call.spec, call.score_mod, call.inputs, training=training,
                                                      verify=numerics_gate.checked)
    return Support(answer.supported, answer.backend, joined(answer.reason, how))
