"""The numerical check as the gate compiled graphs pass before they run user data: a config's
graphs are used once the records in their cache entries (`numerics.record`) say they computed
the right values on this GPU.

    checked(spec, ir, training, cache, built, *, scalars=None) -> Support
                        `graph_store.check_graphs`'s `verify`, passed in by the layers above
                        (with the call's scalars through functools.partial)
    numerics_records(spec, ir, training, cache) -> [(key, record or None)]   per graph the call needs
    record_numerics(cache, keys, record)                                      into every involved entry

Graphs whose entries hold no record are checked once (`check.check_numerics`, with `scalars`:
the call's values of the IR's scalars) and the record is written into their entries. A failed
record answers unsupported (the call runs on XLA) with the errors in the reason, logged once at
WARNING; so does a check that cannot run, which records nothing. In cache mode "strict", graphs
without a record raise `UncheckedGraphError`: strict serving runs checked graphs only.
SDPAGRAPH_VERIFY=off is `graph_store`'s to read: it then never calls the gate.
"""
from __future__ import annotations

import logging
from typing import Any, Mapping

from sdpagraph.cache.graph_cache import CacheMissError, GraphCache
from sdpagraph.cache.keys import CacheKey
from sdpagraph.cache.memory import KeyedLocks
from sdpagraph.graph_store import graph_key
from sdpagraph.graphs import builder
from sdpagraph.graphs.support import Support, graph_answer
from sdpagraph.logs import log_once, numerics_logger
from sdpagraph.numerics.record import check_error_reason, failure_reason, meta_update, read_record, record_passed
from sdpagraph.scoremod.ir import ScoreModIR
from sdpagraph.spec import AttentionSpec, directions_for

VERIFY_COMMAND = "sdpagraph verify --numerics --specs FILE --cache-dir DIR"

_checking = KeyedLocks()  # one numerical check at a time per config


class UncheckedGraphError(CacheMissError):
    """Strict mode: the cached graphs were never checked numerically on this GPU type, and strict
    serving runs checked graphs only. The message says how to check them."""


def numerics_records(spec: AttentionSpec, ir: ScoreModIR | None, training: bool,
                     cache: GraphCache) -> list[tuple[CacheKey, Mapping[str, Any] | None]]:
    """(key, numerics record or None) of each graph the call needs (`spec.directions_for`: the
    training graph of a paged spec or one with sinks is its forward one alone), from `cache` (never
    builds; a graph not in the cache has no record)."""
    env = builder.build_environment()
    records = []
    for direction in directions_for(training, spec):
        key = graph_key(spec, ir, direction, env)
        found = cache.get(key)
        records.append((key, None if found is None else read_record(found[1])))
    return records


def record_numerics(cache: GraphCache, keys: list[CacheKey], record: Mapping[str, Any]) -> None:
    """Write one check's record into every involved entry (same key, same blob)."""
    for key in keys:
        cache.update_meta(key, meta_update(record))


def checked(spec: AttentionSpec, ir: ScoreModIR | None, training: bool, cache: GraphCache, built: Support, *,
            scalars: Mapping[str, Any] | None = None) -> Support:
    """`built` (a supported answer) once the graphs' numerics record says they are right: from the
    entries' records, else from running the check now and recording its result; otherwise an
    unsupported answer saying why. Raises `UncheckedGraphError` in strict mode for unchecked graphs."""
    directions = directions_for(training, spec)
    keys = [key for key, _ in numerics_records(spec, ir, training, cache)]
    with _checking.hold(keys[0].digest()):
        records = numerics_records(spec, ir, training, cache)  # another thread may have checked meanwhile
        failed = next((record for _, record in records if record is not None and not record_passed(record)), None)
        if failed is None and all(record is not None for _, record in records):
            return built
        if failed is not None:
            return _refused(spec, keys, "failed", failure_reason(failed, directions))
        if cache.mode == "strict":
            raise UncheckedGraphError(_unchecked_message(spec, keys, cache))
        try:
            from sdpagraph.numerics import check  # only a graph without a record needs it (not a warm serving start)
            record = check.check_numerics(spec, ir, training, cache, scalars=scalars).to_record()
        except Exception as error:  # noqa: BLE001 - a check that cannot run must not break the call
            return _refused(spec, keys, "error", check_error_reason(error))
        record_numerics(cache, keys, record)
    if not record_passed(record):
        return _refused(spec, keys, "failed", failure_reason(record, directions))
    return built


def _refused(spec: AttentionSpec, keys: list[CacheKey], topic: str, reason: str) -> Support:
    """The unsupported answer for graphs that are not used, its reason logged once per config and topic."""
    log_once(numerics_logger, logging.WARNING, "sdpagraph: %s: %s", spec.summary(), reason,
             topic=(topic, keys[0].digest()))
    return graph_answer(False, reason)


def _unchecked_message(spec: AttentionSpec, keys: list[CacheKey], cache: GraphCache) -> str:
    where = f"cache directory {cache.directory}" if cache.directory else "memory (no cache directory)"
    return (f"cuDNN's graphs for spec {spec.summary()!r} (key {keys[0].digest()[:16]}) in {where} were never "
            "checked numerically on this GPU, and cache mode 'strict' runs checked graphs only. Check them on "
            f"this GPU type with `{VERIFY_COMMAND}` (FILE: the spec file the cache was precompiled from; "
            "`sdpagraph precompile` then a first run in readwrite mode also checks them), or set "
            "SDPAGRAPH_VERIFY=off to accept unchecked graphs.")
