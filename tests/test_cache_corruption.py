"""Every kind of bad entry file is a miss with one warning: rebuilt, reported, or raised on."""
import os
import struct
import zlib

import msgpack
import pytest

from sdpagraph.cache import CacheMissError, GraphCache, key_digest
from sdpagraph.cache.entry import HEADER, MAGIC, CorruptEntry, Entry, decode_entry, encode_entry

KEY = "B2 S128 H4 D64 bf16 causal"
DIGEST = key_digest(KEY)
GOOD = Entry(KEY, DIGEST, b"graph-bytes" * 10, {"workspace": 1024, "uids": {"q": 1, "k": 2}}, {"format": 1})


def framed(payload: bytes, version: int = 1) -> bytes:
    """A file with a valid header (checksum included) around any payload."""
    return HEADER.pack(MAGIC, version, zlib.crc32(payload)) + payload


def flip(data: bytes, index: int, mask: int = 0x01) -> bytes:
    return data[:index] + bytes([data[index] ^ mask]) + data[index + 1:]


def as_other_key(data: bytes) -> bytes:
    return encode_entry(Entry("another spec", key_digest("another spec"), b"other graph", {}))


CORRUPTIONS = {
    "truncated": lambda data: data[: len(data) // 2],
    "truncated_header": lambda data: data[:10],
    "flipped_payload_byte": lambda data: flip(data, len(data) - 20),
    "flipped_checksum_byte": lambda data: flip(data, 13),
    "empty": lambda data: b"",
    "wrong_magic": lambda data: b"NOTAGRPH" + data[8:],
    "future_version": lambda data: framed(data[HEADER.size:], version=2),
    "renamed_file_of_other_key": as_other_key,
    "payload_not_msgpack": lambda data: framed(b"\xc1\xc1\xc1"),
    "payload_trailing_garbage": lambda data: framed(data[HEADER.size:] + b"\x00"),
    "payload_not_a_map": lambda data: framed(msgpack.packb([1, 2, 3])),
    "payload_missing_blob": lambda data: framed(msgpack.packb({"key": KEY, "key_hash": DIGEST, "meta": {}})),
    "blob_wrong_type": lambda data: framed(msgpack.packb({"key": KEY, "key_hash": DIGEST, "blob": "str", "meta": {}})),
    "versions_wrong_type": lambda data: framed(msgpack.packb(
        {"key": KEY, "key_hash": DIGEST, "blob": b"x", "meta": {}, "versions": 3})),
    "key_hash_lies": lambda data: framed(msgpack.packb({"key": "other", "key_hash": DIGEST, "blob": b"x", "meta": {}})),
    "deeply_nested": lambda data: framed(b"\x91" * 100_000),
}


def test_good_entry_round_trips():
    data = encode_entry(GOOD)
    assert data[:8] == MAGIC and struct.unpack_from("<II", data, 8) == (1, zlib.crc32(data[16:]))
    assert decode_entry(data, DIGEST, KEY) == GOOD


@pytest.mark.parametrize("kind", sorted(CORRUPTIONS))
def test_each_corruption_is_rejected_with_a_reason(kind):
    with pytest.raises(CorruptEntry) as raised:
        decode_entry(CORRUPTIONS[kind](encode_entry(GOOD)), DIGEST, KEY)
    assert str(raised.value)


def test_every_single_bit_flip_and_truncation_is_rejected():
    data = encode_entry(Entry(KEY, DIGEST, b"g" * 16, {"w": 1}))
    damaged = [data[:length] for length in range(len(data))]
    damaged += [flip(data, index, 1 << bit) for index in range(len(data)) for bit in range(8)]
    for candidate in damaged:
        with pytest.raises(CorruptEntry):
            decode_entry(candidate, DIGEST, KEY)


def test_right_file_but_different_requested_key_is_rejected():
    # Stands in for a sha256 collision: same file name, different key text.
    with pytest.raises(CorruptEntry, match="differs"):
        decode_entry(encode_entry(GOOD), DIGEST, KEY + " ")


# -- through GraphCache ---------------------------------------------------------------------


def cache_warnings(caplog):
    return [record for record in caplog.records if record.name == "sdpagraph.cache"]


@pytest.fixture
def damaged_cache(tmp_path, request):
    """A cache directory whose entry for KEY has been damaged in the requested way."""
    GraphCache(tmp_path).get_or_build(KEY, lambda: (b"original", {}))
    path = GraphCache(tmp_path).entry_path(KEY)
    with open(path, "rb") as file:
        data = file.read()
    with open(path, "wb") as file:
        file.write(CORRUPTIONS[request.param](data))
    return tmp_path


@pytest.mark.parametrize("damaged_cache", sorted(CORRUPTIONS), indirect=True)
def test_readwrite_rebuilds_over_a_bad_entry_and_warns_once(damaged_cache, caplog):
    cache = GraphCache(damaged_cache)
    assert cache.get(KEY) is None
    blob, _ = cache.get_or_build(KEY, lambda: (b"rebuilt", {}))
    assert blob == b"rebuilt"
    assert cache.stats()["builds"] == 1 and cache.stats()["invalid_entries"] == 1  # one bad file
    assert len(cache_warnings(caplog)) == 1
    assert "ignoring cache entry" in caplog.text
    assert GraphCache(damaged_cache, mode="readonly").get(KEY)[0] == b"rebuilt"


@pytest.mark.parametrize("damaged_cache", ["truncated", "wrong_magic", "renamed_file_of_other_key"], indirect=True)
def test_readonly_reports_a_bad_entry_and_leaves_it(damaged_cache, caplog):
    path = os.path.join(damaged_cache, DIGEST[:2], DIGEST + ".sdpg")
    before = open(path, "rb").read()
    cache = GraphCache(damaged_cache, mode="readonly")
    for _ in range(3):
        assert cache.get(KEY) is None
    assert cache.get_or_build(KEY, lambda: (b"in memory", {}))[0] == b"in memory"
    assert len(cache_warnings(caplog)) == 1
    assert open(path, "rb").read() == before


@pytest.mark.parametrize("damaged_cache", ["flipped_payload_byte"], indirect=True)
def test_strict_raises_on_a_bad_entry_naming_spec_and_reason(damaged_cache):
    with pytest.raises(CacheMissError, match="checksum") as raised:
        GraphCache(damaged_cache, mode="strict").get_or_build(KEY, pytest.fail)
    assert KEY in str(raised.value)


def test_unreadable_entry_is_a_miss(tmp_path, monkeypatch, caplog):
    GraphCache(tmp_path).get_or_build(KEY, lambda: (b"original", {}))
    path = GraphCache(tmp_path).entry_path(KEY)
    real_open = os.open

    def deny(target, flags, *args, **kwargs):
        if os.fspath(target) == path:
            raise PermissionError(13, "Permission denied", path)
        return real_open(target, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", deny)
    cache = GraphCache(tmp_path, mode="readonly")
    assert cache.get(KEY) is None and cache.get(KEY) is None
    assert [record.getMessage() for record in cache_warnings(caplog)] == [
        f"ignoring cache entry {path}: unreadable: Permission denied"]


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads files whatever their mode")
def test_entry_without_read_permission_is_a_miss(tmp_path, caplog):
    GraphCache(tmp_path).get_or_build(KEY, lambda: (b"original", {}))
    os.chmod(GraphCache(tmp_path).entry_path(KEY), 0)
    assert GraphCache(tmp_path, mode="readonly").get(KEY) is None
    assert "unreadable" in caplog.text


@pytest.mark.parametrize("mode", ["readwrite", "readonly"])
def test_invalid_entries_counts_each_bad_file_once(tmp_path, mode):
    keys = [f"{KEY} #{i}" for i in range(8)]
    writer = GraphCache(tmp_path)
    for key in keys:
        writer.get_or_build(key, lambda: (b"original", {}))
        with open(writer.entry_path(key), "r+b") as file:
            file.truncate(10)
    cache = GraphCache(tmp_path, mode=mode)
    for key in keys:  # each bad file is looked at by get, then twice by get_or_build (before and under the lock)
        assert cache.get(key) is None
        assert cache.get_or_build(key, lambda: (b"rebuilt", {}))[0] == b"rebuilt"
    assert (cache.stats()["invalid_entries"], cache.stats()["builds"]) == (8, 8)
