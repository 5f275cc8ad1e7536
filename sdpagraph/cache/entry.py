"""The entry file format: one compiled graph plus its metadata, as bytes.

Layout (all integers little-endian), read directly by the C++ executor too:

    offset 0   8 bytes   magic b"SDPAGRPH"
    offset 8   uint32    format version (FORMAT_VERSION)
    offset 12  uint32    zlib.crc32 of the payload
    offset 16  payload   one msgpack map with string keys:
                           "key"      str  full canonical key text
                           "key_hash" str  sha256 hex of "key" (also the file name)
                           "blob"     bin  serialized graph bytes
                           "meta"     map  caller's metadata + "created" (+ "build_time_s")
                           "versions" map  optional: versions the graph was built for

Decoding checks every one of those properties and reports any failure as a
`CorruptEntry` with a short reason; nothing else escapes, whatever the bytes are.
"""
from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass
from typing import Any

import msgpack

from sdpagraph.cache.keys import FORMAT_VERSION, key_digest
from sdpagraph.errors import SdpagraphError

MAGIC = b"SDPAGRPH"
HEADER = struct.Struct("<8sII")  # magic, format version, crc32 of the payload

ENTRY_SUFFIX = ".sdpg"

_FIELD_TYPES = {"key": str, "key_hash": str, "blob": bytes, "meta": dict}  # required top-level fields


class CorruptEntry(SdpagraphError, ValueError):
    """The bytes are not a valid entry (for the expected key); the message says why."""


@dataclass(frozen=True)
class Entry:
    """A decoded entry. `meta` is shared by every reader of the entry: do not mutate it."""

    key: str
    key_hash: str
    blob: bytes
    meta: dict[str, Any]
    versions: dict[str, Any] | None = None


def encode_entry(entry: Entry) -> bytes:
    """Entry -> file bytes. Raises TypeError when meta or versions are not msgpack-able."""
    document: dict[str, Any] = {
        "key": entry.key,
        "key_hash": entry.key_hash,
        "blob": entry.blob,
        "meta": entry.meta,
    }
    if entry.versions is not None:
        document["versions"] = entry.versions
    payload = msgpack.packb(document, use_bin_type=True)
    return HEADER.pack(MAGIC, FORMAT_VERSION, zlib.crc32(payload)) + payload


def decode_entry(data: bytes, digest: str, key: str | None = None) -> Entry:
    """File bytes -> Entry, for the entry named `digest` (and, when given, holding `key`).

    Raises CorruptEntry on any problem: bad header, checksum, payload shape, or an entry
    that belongs to another key (a renamed file or, in theory, a hash collision).
    """
    if len(data) < HEADER.size:
        raise CorruptEntry(f"truncated: {len(data)} bytes, shorter than the {HEADER.size}-byte header")
    magic, version, crc = HEADER.unpack_from(data)
    if magic != MAGIC:
        raise CorruptEntry(f"wrong magic {magic!r}")
    if version != FORMAT_VERSION:
        raise CorruptEntry(f"format version {version}, this sdpagraph reads {FORMAT_VERSION}")
    payload = memoryview(data)[HEADER.size:]
    if zlib.crc32(payload) != crc:
        raise CorruptEntry("checksum mismatch (truncated or modified payload)")
    entry = _entry_from_document(_unpack(payload))
    if entry.key_hash != digest or key_digest(entry.key) != digest:
        raise CorruptEntry(f"entry belongs to another key (key_hash {entry.key_hash[:16]}...)")
    if key is not None and entry.key != key:
        raise CorruptEntry("stored key text differs from the requested key")
    return entry


def _unpack(payload: memoryview) -> Any:
    # The checksum matched, so these bytes are what some writer produced; still, a buggy or
    # hostile writer can produce anything, and msgpack signals that with a zoo of exception
    # types (ExtraData, FormatError, StackError, ValueError, TypeError, UnicodeDecodeError).
    try:
        # strict_map_key=False: builders may key meta maps by int (operand UIDs).
        return msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except Exception as error:  # noqa: BLE001 - every msgpack failure means the same thing here
        raise CorruptEntry(f"payload is not msgpack: {type(error).__name__}") from None



def _entry_from_document(document: Any) -> Entry:
    if not isinstance(document, dict):
        raise CorruptEntry(f"payload is a {type(document).__name__}, not a map")
    for field, expected in _FIELD_TYPES.items():
        if not isinstance(document.get(field), expected):
            raise CorruptEntry(f"field {field!r} missing or not a {expected.__name__}")
    versions = document.get("versions")
    if versions is not None and not isinstance(versions, dict):
        raise CorruptEntry("field 'versions' is not a map")
    return Entry(document["key"], document["key_hash"], document["blob"], document["meta"], versions)
