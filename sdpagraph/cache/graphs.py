"""Compiled cuDNN graphs through the graph cache: each graph's key, get-or-build, and the
remembered support answers.

    cached_graph(spec, ir, direction, cache=None) -> CachedGraph   the runtime's one lookup
    graph_key(spec, ir, direction, env) -> CacheKey                  precompile/verify ask this too
    check_graphs(spec, ir, training, cache=None, verify=None) -> Support
                                                    "does cuDNN run this here, with the right numbers?"
    using_cache(cache)                              the cache `cached_graph(cache=None)` uses in a block

`verify(spec, ir, training, cache)` is the numerical check (`jax_api.numerics.check_numerics`,
passed in by the layer above, so this layer never imports JAX code): its result is recorded in
each graph's entry metadata under "numerics" (`NUMERICS_FIELD`), and a graph whose record says
it computed wrong values is never used.

The key is `CacheKey(spec text, IR text, direction, cuDNN version, frontend version, GPU)`,
the first two from `graphs.builder.graph_identity`. It is composed once per graph per trace;
its digest is computed when the key is made and reused by every lookup and by the executor.
"""
from __future__ import annotations

import contextlib
import contextvars
import functools
import logging
import math
import threading
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping

from sdpagraph.cache.defaults import default_cache, verify_mode
from sdpagraph.cache.graph_cache import CacheMissError, GraphCache
from sdpagraph.cache.keys import CacheKey
from sdpagraph.cache.memory import BoundedMemo, KeyedLocks
from sdpagraph.graphs import builder
from sdpagraph.graphs.binning import bin_plan
from sdpagraph.graphs.builder import BuildEnvironment
from sdpagraph.graphs.compiled import CompiledGraph
from sdpagraph.graphs.ir import ScoreModIR
from sdpagraph.graphs.support import Support, answer_from_builds
from sdpagraph.spec import AttentionSpec, directions_for

# Support answers remembered per cache (a long-running process asking about many shapes keeps the
# most recent ones).
ANSWERS_PER_CACHE = 4096
# The entry metadata field holding the numerical check's record:
#   {"passed": bool, "errors": {output: relative error}, "tolerances": {output: bound},
#    "checked": unix time, "seed": int, "seconds": float, "slice": str}
NUMERICS_FIELD = "numerics"
VERIFY_COMMAND = "sdpagraph verify --numerics --specs FILE --cache-dir DIR"

log = logging.getLogger("sdpagraph.numerics")
_warned = BoundedMemo(1024)  # each failure is logged once per process

Verify = Callable[..., Any]  # (spec, ir, training, cache) -> a result with .passed and .to_record()


class UncheckedGraphError(CacheMissError):
    """Strict mode: the cached graphs were never checked numerically on this GPU type, and strict
    serving runs checked graphs only. The message says how to check them."""


@dataclass(frozen=True)
class CachedGraph:
    """One compiled graph as the executor needs it: its key (and digest) and the plan."""

    key: CacheKey
    compiled: CompiledGraph
    entry_path: str | None  # the on-disk entry the executor may load on its own, or None

    @property
    def digest(self) -> str:
        return self.key.digest()


def graph_key(spec: AttentionSpec, ir: ScoreModIR | None, direction: str,
              env: BuildEnvironment | None = None) -> CacheKey:
    """The runtime's key for the `direction` graph of a call of `spec` (the call's own spec)."""
    env = builder.build_environment() if env is None else env
    spec_text, ir_text = builder.graph_identity(spec, ir, direction)
    return CacheKey(spec_text, ir_text, direction, env.cudnn_version, env.frontend_version, env.gpu)


def cached_graph(spec: AttentionSpec, ir: ScoreModIR | None, direction: str,
                 cache: GraphCache | None = None) -> CachedGraph:
    """The compiled `direction` graph of (spec, ir): from the cache, else built once.

    Raises `Unsupported` (a config sdpagraph cannot lower), `GraphBuildError` (cuDNN
    declined) or `CacheMissError` in strict mode.
    """
    cache = _current_cache() if cache is None else cache
    env = builder.build_environment()
    key = graph_key(spec, ir, direction, env)
    blob, meta = cache.get_or_build(key, functools.partial(builder.compile_graph, spec, ir, direction, env))
    return CachedGraph(key, CompiledGraph.from_meta(blob, meta), cache.entry_path(key))


_override: contextvars.ContextVar[GraphCache | None] = contextvars.ContextVar("sdpagraph_cache", default=None)


@contextlib.contextmanager
def using_cache(cache: GraphCache | None) -> Iterator[None]:
    """Within the block (this thread or task only), `cached_graph(..., cache=None)` uses `cache`:
    the numerical check runs the runtime's own code on the graphs of the cache it checks."""
    token = _override.set(cache)
    try:
        yield
    finally:
        _override.reset(token)


def _current_cache() -> GraphCache:
    cache = _override.get()
    return default_cache() if cache is None else cache


_answers: "weakref.WeakKeyDictionary[GraphCache, BoundedMemo]" = weakref.WeakKeyDictionary()
_answers_lock = threading.Lock()
_checking = KeyedLocks()  # one numerical check at a time per config


def check_graphs(spec: AttentionSpec, ir: ScoreModIR | None, training: bool,
                 cache: GraphCache | None = None, verify: Verify | None = None) -> Support:
    """Whether cuDNN builds the graphs `attention` would run for (spec, ir), and, given `verify`,
    whether they compute the right values on this GPU.

    Builds through `cached_graph`, with the runtime's own keys, so a supported answer leaves
    the graphs in `cache` and the later call builds nothing. With `verify` and SDPAGRAPH_VERIFY
    not "off", graphs whose entries hold no numerics record are checked once (`verify(spec, ir,
    training, cache)`), and the record is written into their entries; a failed record answers
    unsupported (the call runs on XLA) with the errors in the reason, logged once at WARNING.
    Answers that stay true for the process (positive and negative) are remembered per cache:
    asking again is a lookup.
    Raises only `CacheMissError` (strict mode: a graph is not precompiled, or, as
    `UncheckedGraphError`, was never checked).
    """
    cache = _current_cache() if cache is None else cache
    verifying = verify is not None and verify_mode() != "off"
    with _answers_lock:  # weakly keyed: a dropped cache takes its answers with it
        answers = _answers.setdefault(cache, BoundedMemo(ANSWERS_PER_CACHE))
    question = (spec, None if ir is None else ir.digest, training, verifying)
    answer = answers.get(question)
    if answer is None:
        answer, final = answer_from_builds(spec, ir, training,
                                           lambda direction: cached_graph(spec, ir, direction, cache),
                                           passthrough=(CacheMissError,))
        if verifying and answer.supported:
            answer = _checked_answer(spec, ir, training, cache, verify, answer)
        if final:
            answers.put(question, answer)
        bins = bin_plan(spec, ir)
        if answer.supported and bins is not None:  # the bins' graphs too, so a precompiled cache holds them
            try:
                check_graphs(bins.spec, ir, training, cache, verify)
            except CacheMissError:  # strict mode, a cache made without them: the call runs unbinned
                pass
    return answer


# ----------------------------------------------------------------------------- numerics records

def numerics_records(spec: AttentionSpec, ir: ScoreModIR | None, training: bool,
                     cache: GraphCache) -> list[tuple[CacheKey, dict[str, Any] | None]]:
    """(key, numerics record or None) of each graph the call needs, from `cache` (never builds;
    a graph not in the cache has no record)."""
    env = builder.build_environment()
    records = []
    for direction in directions_for(training):
        key = graph_key(spec, ir, direction, env)
        found = cache.get(key)
        record = None if found is None else found[1].get(NUMERICS_FIELD)
        records.append((key, record if isinstance(record, Mapping) else None))
    return records


def record_numerics(cache: GraphCache, keys: list[CacheKey], record: Mapping[str, Any]) -> None:
    """Write one check's record into every involved entry (same key, same blob)."""
    for key in keys:
        cache.update_meta(key, {NUMERICS_FIELD: dict(record)})


def record_failures(record: Mapping[str, Any]) -> list[str]:
    """'o error 0.31 > 0.01' for each output over its tolerance (or not finite) in a record."""
    errors, tolerances = record.get("errors") or {}, record.get("tolerances") or {}
    failures = []
    for name, error in errors.items():
        bound = tolerances.get(name)
        if bound is None:
            continue
        error = float("inf") if error is None else float(error)
        if not math.isfinite(error) or error > float(bound):
            failures.append(f"{name} error {_number(error)} > {_number(float(bound))}")
    return failures


def failure_reason(record: Mapping[str, Any], directions: tuple[str, ...] = ()) -> str:
    what = "graphs" if len(directions) != 1 else "graph"
    failures = record_failures(record) or [str(record.get("detail") or "the check did not pass")]
    return (f"cuDNN's {what} for this config computed wrong values on this GPU ({', '.join(failures)}; "
            f"checked against a float32 NumPy reference, seed {record.get('seed')}); the call runs on XLA")


def _number(value: float) -> str:
    return "nan" if math.isnan(value) else ("inf" if math.isinf(value) else f"{value:.3g}")


def _warn_once(topic: Any, message: str) -> None:
    if _warned.add(topic):
        log.warning(message)


def _unchecked_message(spec: AttentionSpec, keys: list[CacheKey], cache: GraphCache) -> str:
    where = f"cache directory {cache.directory}" if cache.directory else "memory (no cache directory)"
    return (f"cuDNN's graphs for spec {spec.summary()!r} (key {keys[0].digest()[:16]}) in {where} were never "
            "checked numerically on this GPU, and cache mode 'strict' runs checked graphs only. Check them on "
            f"this GPU type with `{VERIFY_COMMAND}` (FILE: the spec file the cache was precompiled from; "
            "`sdpagraph precompile` then a first run in readwrite mode also checks them), or set "
            "SDPAGRAPH_VERIFY=off to accept unchecked graphs.")


def _checked_answer(spec: AttentionSpec, ir: ScoreModIR | None, training: bool, cache: GraphCache,
                    verify: Verify, built: Support) -> Support:
    """`built` (a supported answer) once the graphs' numerics record says they are right: from the
    entries' records, else from running `verify` now and recording its result."""
    directions = directions_for(training)
    keys = [key for key, _ in numerics_records(spec, ir, training, cache)]
    with _checking.hold(keys[0].digest()):
        records = numerics_records(spec, ir, training, cache)  # another thread may have checked meanwhile
        failed = next((record for _, record in records if record is not None and not record.get("passed")), None)
        if failed is None and all(record is not None for _, record in records):
            return built
        if failed is not None:
            reason = failure_reason(failed, directions)
            _warn_once(("failed", keys[0].digest()), f"sdpagraph: {spec.summary()}: {reason}")
            return Support(False, "xla", reason)
        if cache.mode == "strict":
            raise UncheckedGraphError(_unchecked_message(spec, keys, cache))
        try:
            result = verify(spec, ir, training, cache)
            record = result.to_record()
        except Exception as error:  # noqa: BLE001 - a check that cannot run must not break the call
            reason = (f"the numerical check of cuDNN's graphs for this config could not run "
                      f"({type(error).__name__}: {' '.join(str(error).split())[:300]}), so they are not used; "
                      "the call runs on XLA")
            _warn_once(("error", keys[0].digest()), f"sdpagraph: {spec.summary()}: {reason}")
            return Support(False, "xla", reason)
        record_numerics(cache, keys, record)
    if not record.get("passed"):
        reason = failure_reason(record, directions)
        _warn_once(("failed", keys[0].digest()), f"sdpagraph: {spec.summary()}: {reason}")
        return Support(False, "xla", reason)
    return built
