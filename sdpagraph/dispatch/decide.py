"""Which backend runs a call, and why: the answer `attention` acts on and `check_support` gives.

    decide(call, implementation, training, raise_on_miss) -> Support
    choose_backend(call, implementation, training) -> backend name (raises where a forced one cannot)

A backend runs a call where its graphs build and pass the numerical check; among those, `rule.choose`
picks the fastest, asking each backend (and building its graphs) only when it would win.
"""
from __future__ import annotations

import functools
import logging

from sdpagraph.backends import registry
from sdpagraph.backends.base import Backend
from sdpagraph.cache import CacheMissError
from sdpagraph.call import PreparedCall
from sdpagraph.dispatch import rule as dispatch
from sdpagraph.graphs.support import Support
from sdpagraph.logs import log_once, logger
from sdpagraph.numerics import gate as numerics_gate
from sdpagraph.spec import AttentionSpec


def _strict_miss_message(call: PreparedCall, miss: CacheMissError) -> str:
    return (f"{miss} Spec: {call.spec.summary()}. Record it with SDPAGRAPH_RECORD=specs.json (or "
            "`with sdpagraph.record('specs.json')`), then on this GPU type run `sdpagraph precompile specs.json "
            "--cache-dir $SDPAGRAPH_CACHE_DIR`; `sdpagraph verify --specs specs.json --cache-dir DIR` checks a cache.")


def _answer(backend: Backend, call: PreparedCall, training: bool, *, raise_on_miss: bool) -> Support:
    """Whether `backend` runs the call. Its compiled kernels must compute the right values once (the
    numerical check, with the call's scalar values) before they are used; a strict cache that lacks
    them raises (the runtime) or answers no (`check_support`), with how to precompile them."""
    if call.inputs.python_mods is not None and not backend.runs_python_mods:
        return Support(False, registry.reference().name, call.inputs.python_mods.reason)
    try:
        verify = functools.partial(numerics_gate.checked, scalars=call.inputs.mod_scalars)
        return backend.support(call.spec, call.score_mod, training=training, verify=verify)
    except CacheMissError as miss:
        if raise_on_miss:
            raise CacheMissError(_strict_miss_message(call, miss)) from None
        return Support(False, registry.reference().name, _strict_miss_message(call, miss))


def decide(call: PreparedCall, implementation: str | None, training: bool, *, raise_on_miss: bool) -> Support:
    """Which backend runs the call, and why: `Support(the first backend runs it, backend, reason)`.

    `Support.supported` speaks of the first backend in preference order (cuDNN): whether it can run
    the call. `implementation=None` asks `dispatch.choose` for the fastest backend that can run the
    call, asking each backend (and building its graphs) only when it would win; a forced backend that
    cannot run the call answers with its reason (`choose_backend` raises it as a ValueError).
    """
    primary = registry.primary().name
    if implementation is not None:
        answer = _answer(registry.get(implementation), call, training, raise_on_miss=raise_on_miss)
        if not answer.supported:
            return Support(False, registry.reference().name, answer.reason)
        if implementation == primary:
            return answer
        return Support(False, implementation, joined(f"implementation={implementation!r} was requested",
                                                      answer.reason))
    answers: dict[str, Support] = {}

    def lazily(backend: Backend):
        def ask() -> Support:
            answers[backend.name] = _answer(backend, call, training, raise_on_miss=raise_on_miss)
            return answers[backend.name]
        return ask

    candidates = {name: lazily(registry.get(name)) for name in registry.names()}
    choice = dispatch.choose(call.spec, candidates, training=training, has_score_mod=call.score_mod is not None)
    primary_answer = answers.get(primary)
    if choice.backend == primary:
        return primary_answer
    if choice.backend == registry.reference().name and primary_answer is not None and not primary_answer.supported:
        return Support(False, choice.backend, primary_answer.reason)  # the first cannot: its reason is the answer
    chosen = answers.get(choice.backend)
    return Support(primary_answer is not None and primary_answer.supported, choice.backend,
                   joined(choice.reason, chosen.reason if chosen is not None else ""))


def joined(*reasons: str) -> str:
    """Reasons in one sentence (how the backend runs the call follows why it was chosen)."""
    return "; ".join(r for r in reasons if r)


# A long call that leaves the first backend is worth a WARNING: the others are slower there by far.
LONG_CALL_SCORES = 2**24  # T * S


def _leaving_level(spec: AttentionSpec) -> int:
    """The level the first backend's refusal is logged at: WARNING for T * S >= LONG_CALL_SCORES."""
    return logging.WARNING if spec.q_len * spec.kv_len >= LONG_CALL_SCORES else logging.INFO


def choose_backend(call: PreparedCall, implementation: str | None, training: bool) -> str:
    decision = decide(call, implementation, training, raise_on_miss=True)
    if implementation is not None and decision.backend != implementation:
        raise ValueError(f"implementation={implementation!r} cannot run {call.spec.summary()}: {decision.reason}")
    if decision.backend != registry.primary().name and implementation is None:
        log_once(logger, _leaving_level(call.spec),
                 f"sdpagraph: using the {decision.backend} backend for {call.spec.summary()}: {decision.reason}")
    return decision.backend
