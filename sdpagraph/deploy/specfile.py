"""Spec files: every attention graph a program needs, without its code or its data.

A spec file is JSON:

    {"format": "sdpagraph-specs", "version": 1, "entries": [ENTRY, ...]}

An entry is either *recorded* (what `record` writes; complete, needs no user code):

    {"spec": AttentionSpec.to_dict(), "score_mod": ScoreModIR.to_dict() or null,
     "directions": ["forward", "backward"] (training) or ["inference"],
     "summary": "B4 T4096 ..."}                       (for readers; ignored when loading)

or *hand-written*: the arguments of `sdpagraph.attention`, as shapes instead of arrays:

    {"shapes": {"query": [B, T, N, H], "key": [B, S, K, H], "value": [B, S, K, Hv],
                "bias": [...], "mask": [...]},         (bias and mask are optional)
     "dtype": "bfloat16", "training": true,            (training defaults to true)
     "is_causal": true, "local_window_size": [128, 0], "causal_alignment": "top_left",
     "chunk_size": 512, "scale": 0.125,
     "segment_ids": {"shape": [B, T]} or {"q_shape": [B, T], "kv_shape": [B, S]},
     "max_segments_per_seq": 8, "query_seq_lengths": true, "key_value_seq_lengths": true,
     "score_mod": SCORE_MOD, "score_mod_tensors": {"name": 1.5 or {"shape": [...], "dtype": "float32"}}}

    SCORE_MOD: "pkg.module:name"                       (a ScoreMod or score_mod callable)
             | {"import": "pkg.module:factory", "args": [...], "kwargs": {...}}
             | {"mod": "softcap", "args": [30.0]}      (a factory of sdpagraph.mods)
             | [SCORE_MOD, ...]                         (mods.compose of the list)

A hand-written entry is resolved by tracing `call.prepare_call` on
`jax.ShapeDtypeStruct`s, the runtime's own normalization, so it yields exactly the spec
and IR the runtime traces. Recorded specs are checked the same way. An invalid entry
raises SpecFileError (a ValueError): "specs.json: entry 3: field 'dtype': ...". So does a
file that cannot be read as a spec file (missing, a directory, unreadable, binary, not
UTF-8, not JSON): "specs.json: no such file". A recorded score_mod IR is checked node by
node and must be in the canonical form the recorder writes (`deploy.recorded_ir`).

An entry is a `deploy.spec_entry.SpecEntry`, parsed by `deploy.entry_parser`. Recording into spec
files (`record`, SDPAGRAPH_RECORD) is in `sdpagraph.deploy.recording`.
"""
from __future__ import annotations

import json
import os
from typing import Any, Iterable

import filelock

from sdpagraph.cache.disk import write_atomically
from sdpagraph.deploy.entry_parser import parse_entry
from sdpagraph.deploy.spec_entry import SpecEntry, SpecFileError

FORMAT = "sdpagraph-specs"
VERSION = 1
JSON_WIDTH = 100


# -- reading -------------------------------------------------------------------------------

def load_specs(path: str | os.PathLike[str]) -> list[SpecEntry]:
    """The entries of a spec file, resolved and validated, in file order."""
    name = os.fspath(path)
    document = _read_document(name)
    try:
        return parse_specs(document)
    except SpecFileError as error:
        raise SpecFileError(f"{name}: {error}", name, error.entry, error.field) from error.__cause__


def _read_document(name: str) -> Any:
    """The parsed JSON of the file `name`; every way of not being one is a one-line SpecFileError."""

    def fail(problem: str) -> SpecFileError:
        return SpecFileError(f"{name}: {problem}", name)

    if os.path.isdir(name):
        raise fail("is a directory, not a spec file")
    try:
        with open(name, "rb") as file:
            data = file.read()
    except FileNotFoundError:
        raise fail("no such file") from None
    except PermissionError:
        raise fail("permission denied (cannot read it)") from None
    except OSError as error:
        raise fail(f"cannot read it: {error.strerror or error}") from None
    if b"\0" in data:
        raise fail("not a spec file: binary data (a spec file is JSON text)")
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as error:
        raise fail(f"not a spec file: not UTF-8 text (byte 0x{data[error.start]:02x} at offset {error.start})") \
            from None
    if not text.strip():
        raise fail('empty; a spec file is {"format": "sdpagraph-specs", "version": 1, "entries": [...]}')
    try:
        return json.loads(text)
    except RecursionError:
        raise fail("not JSON: nested too deeply") from None
    except ValueError as error:
        raise fail(f"not JSON: {error}") from None


def load_entries(specs: str | os.PathLike[str] | Iterable[str | os.PathLike[str] | SpecEntry]) -> list[SpecEntry]:
    """Spec file path(s) and/or entries -> one merged list (first occurrences, in order)."""
    if isinstance(specs, (str, os.PathLike)):
        specs = [specs]
    return merge(*([item] if isinstance(item, SpecEntry) else load_specs(item) for item in specs))


def parse_specs(document: Any) -> list[SpecEntry]:
    """The entries of a parsed spec-file document, in file order."""
    if not isinstance(document, dict) or not isinstance(document.get("entries"), list):
        raise SpecFileError('a spec file is a JSON object {"format": "sdpagraph-specs", "version": 1, "entries": [...]}')
    if document.get("format", FORMAT) != FORMAT or document.get("version", VERSION) != VERSION:
        raise SpecFileError(f"format {document.get('format')!r} version {document.get('version')!r}; "
                            f"this sdpagraph reads {FORMAT!r} version {VERSION}")
    return [parse_entry(index, item) for index, item in enumerate(document["entries"])]


# -- writing -------------------------------------------------------------------------------


def merge(*entry_lists: Iterable[SpecEntry]) -> list[SpecEntry]:
    """The entries of all lists, first occurrence kept, duplicates dropped."""
    merged: dict[tuple, SpecEntry] = {}
    for entries in entry_lists:
        for entry in entries:
            merged.setdefault(entry.identity, entry)
    return list(merged.values())


def dumps(entries: Iterable[SpecEntry]) -> str:
    """The spec-file text: de-duplicated, sorted, stable formatting (same entries, same bytes)."""
    ordered = sorted(merge(entries), key=lambda entry: entry.identity)
    document = {"format": FORMAT, "version": VERSION, "entries": [entry.to_dict() for entry in ordered]}
    return _json_text(document) + "\n"


def _json_text(value: Any, depth: int = 0) -> str:
    """Reviewable JSON: one object field per line, keys sorted; a list on one line when it
    holds no object and fits in JSON_WIDTH, else one item per line (an IR node per line)."""
    inner, outer = "  " * (depth + 1), "  " * depth
    if isinstance(value, dict) and value:
        fields = [f"{inner}{json.dumps(key)}: {_json_text(value[key], depth + 1)}" for key in sorted(value)]
        return "{\n" + ",\n".join(fields) + f"\n{outer}}}"
    compact = json.dumps(value, separators=(", ", ": "))
    if not isinstance(value, list) or (len(compact) <= JSON_WIDTH and not _holds_object(value)):
        return compact
    return "[\n" + ",\n".join(inner + _json_text(item, depth + 1) for item in value) + f"\n{outer}]"


def _holds_object(value: Any) -> bool:
    return isinstance(value, dict) or (isinstance(value, list) and any(map(_holds_object, value)))


def save_specs(path: str | os.PathLike[str], entries: Iterable[SpecEntry]) -> None:
    """Write a spec file atomically: readers see the old file or the new one, never a part."""
    write_atomically(os.fspath(path), dumps(entries).encode(), temp_prefix=os.path.basename(path) + ".")


def add_to_spec_file(path: str | os.PathLike[str], entries: Iterable[SpecEntry]) -> None:
    """Merge `entries` into the spec file at `path` (created when missing).

    Under a lock file beside it (`<path>.lock`), so processes recording into one file
    merge their entries instead of overwriting each other's.
    """
    path = os.fspath(path)
    with filelock.FileLock(path + ".lock"):
        existing = load_specs(path) if os.path.exists(path) else []
        save_specs(path, merge(existing, entries))
