"""Compiled cuDNN graphs through the graph cache: each graph's key, get-or-build, and the
remembered support answers.

    cached_graph(spec, ir, direction, cache=None) -> CachedGraph   the runtime's one lookup
    graph_key(spec, ir, direction, env) -> CacheKey                  precompile/verify ask this too
    check_graphs(spec, ir, training, cache=None, verify=None) -> Support
                                                    "does cuDNN run this here, with the right numbers?"
    using_cache(cache)                              the cache `cached_graph(cache=None)` uses in a block

`verify(spec, ir, training, cache, built) -> Support` is the numerical check's gate
(`numerics.gate.checked`, passed in by the layer above, so this layer knows nothing of the check
or of its records in the entries): given the supported answer the builds gave, it answers whether
the graphs may be used.

The key is `CacheKey(spec text, IR text, direction, cuDNN version, frontend version, GPU)`,
the first two from `graphs.builder.graph_identity`. It is composed once per graph per trace;
its digest is computed when the key is made and reused by every lookup and by the executor.
"""
from __future__ import annotations

import contextlib
import contextvars
import functools
import threading
import weakref
from dataclasses import dataclass
from typing import Callable, Iterator

from sdpagraph.cache.defaults import default_cache
from sdpagraph.config import VERIFY
from sdpagraph.cache.graph_cache import CacheMissError, GraphCache
from sdpagraph.cache.keys import CacheKey
from sdpagraph.memo import BoundedMemo
from sdpagraph.graphs import builder
from sdpagraph.graphs.alternatives import alternatives
from sdpagraph.graphs.builder import BuildEnvironment
from sdpagraph.graphs.compiled import CompiledGraph
from sdpagraph.scoremod.ir import ScoreModIR
from sdpagraph.graphs.support import Support, answer_from_builds
from sdpagraph.spec import AttentionSpec

# Support answers remembered per cache (a long-running process asking about many shapes keeps the
# most recent ones).
ANSWERS_PER_CACHE = 4096
Verify = Callable[..., Support]  # (spec, ir, training, cache, built: Support) -> Support: the check's gate


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


def check_graphs(spec: AttentionSpec, ir: ScoreModIR | None, training: bool,
                 cache: GraphCache | None = None, verify: Verify | None = None) -> Support:
    """Whether cuDNN builds the graphs `attention` would run for (spec, ir), and, given `verify`,
    whether they compute the right values on this GPU.

    Builds through `cached_graph`, with the runtime's own keys, so a supported answer leaves
    the graphs in `cache` and the later call builds nothing. With `verify` and SDPAGRAPH_VERIFY
    not "off", a supported answer is the one `verify(spec, ir, training, cache, answer)` gives.
    Answers that stay true for the process (positive and negative) are remembered per cache:
    asking again is a lookup.
    Raises only `CacheMissError` (strict mode: a graph is not precompiled, or `verify` found it
    never checked).
    """
    cache = _current_cache() if cache is None else cache
    verifying = verify is not None and VERIFY.get() != "off"
    with _answers_lock:  # weakly keyed: a dropped cache takes its answers with it
        answers = _answers.setdefault(cache, BoundedMemo(ANSWERS_PER_CACHE))
    question = (spec, None if ir is None else ir.digest, training, verifying)
    answer = answers.get(question)
    if answer is None:
        answer, final = answer_from_builds(spec, ir, training,
                                           lambda direction: cached_graph(spec, ir, direction, cache),
                                           passthrough=(CacheMissError,))
        if verifying and answer.supported:
            answer = verify(spec, ir, training, cache, answer)
        if final:
            answers.put(question, answer)
        # The graphs a call may run as (`graphs.alternatives`): checked too, so a precompiled cache holds
        # them (strict mode, a cache made without them: the call runs as it is).
        for other, other_ir, stats in alternatives(spec, ir, training) if answer.supported else ():
            try:
                check_graphs(other, other_ir, stats, cache, verify)
            except CacheMissError:
                pass
    return answer
