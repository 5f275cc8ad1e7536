"""Compiled cuDNN graphs through the graph cache: each graph's key, get-or-build, and the
remembered support answers.

    cached_graph(spec, ir, direction, cache=None) -> CachedGraph   the runtime's one lookup
    graph_key(spec, ir, direction, env) -> CacheKey                  precompile/verify ask this too
    check_graphs(spec, ir, training, cache=None) -> Support          "does cuDNN run this here?"

The key is `CacheKey(spec text, IR text, direction, cuDNN version, frontend version, GPU)`,
the first two from `graphs.builder.graph_identity`. It is composed once per graph per trace;
its digest is computed when the key is made and reused by every lookup and by the executor.
"""
from __future__ import annotations

import functools
import threading
import weakref
from dataclasses import dataclass

from sdpagraph.cache.defaults import default_cache
from sdpagraph.cache.graph_cache import CacheMissError, GraphCache
from sdpagraph.cache.keys import CacheKey
from sdpagraph.cache.memory import BoundedMemo
from sdpagraph.graphs import builder
from sdpagraph.graphs.builder import BuildEnvironment
from sdpagraph.graphs.compiled import CompiledGraph
from sdpagraph.graphs.ir import ScoreModIR
from sdpagraph.graphs.support import Support, answer_from_builds
from sdpagraph.spec import AttentionSpec

# Support answers remembered per cache (a long-running process asking about many shapes keeps the
# most recent ones).
ANSWERS_PER_CACHE = 4096


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
    cache = default_cache() if cache is None else cache
    env = builder.build_environment()
    key = graph_key(spec, ir, direction, env)
    blob, meta = cache.get_or_build(key, functools.partial(builder.compile_graph, spec, ir, direction, env))
    return CachedGraph(key, CompiledGraph.from_meta(blob, meta), cache.entry_path(key))


_answers: "weakref.WeakKeyDictionary[GraphCache, BoundedMemo]" = weakref.WeakKeyDictionary()
_answers_lock = threading.Lock()


def check_graphs(spec: AttentionSpec, ir: ScoreModIR | None, training: bool,
                 cache: GraphCache | None = None) -> Support:
    """Whether cuDNN builds the graphs `attention` would run for (spec, ir).

    Builds through `cached_graph`, with the runtime's own keys, so a supported answer leaves
    the graphs in `cache` and the later call builds nothing. Answers that stay true for the
    process (positive and negative) are remembered per cache: asking again is a lookup.
    Raises only `CacheMissError` (strict mode: a graph is not precompiled).
    """
    cache = default_cache() if cache is None else cache
    with _answers_lock:  # weakly keyed: a dropped cache takes its answers with it
        answers = _answers.setdefault(cache, BoundedMemo(ANSWERS_PER_CACHE))
    question = (spec, None if ir is None else ir.digest, training)
    answer = answers.get(question)
    if answer is None:
        answer, final = answer_from_builds(spec, ir, training,
                                           lambda direction: cached_graph(spec, ir, direction, cache),
                                           passthrough=(CacheMissError,))
        if final:
            answers.put(question, answer)
    return answer
