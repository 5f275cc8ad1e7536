"""GraphCache behaviour through its public API: layers, metadata, modes, stats."""
import os

import msgpack
import pytest

from sdpagraph.cache import CacheKey, CacheMissError, GraphCache, key_digest
from sdpagraph.cache.entry import HEADER, MAGIC

KEY = CacheKey(spec="B4 S4096 H16 D128 bf16 softcap", ir_hash="9f3c", direction="backward",
               cudnn_version="9.19.0", frontend_version="1.32.0", gpu="sm90 NVIDIA H200")


def files_under(directory):
    return sorted(os.path.relpath(os.path.join(root, name), directory)
                  for root, _, names in os.walk(directory) for name in names)


def counting(blob=b"graph", meta=None):
    """A build function that records how often it ran."""
    def build():
        build.calls += 1
        return blob, dict(meta or {"workspace": 4096})
    build.calls = 0
    return build


def test_build_once_then_memory_then_disk(tmp_path):
    build = counting()
    cache = GraphCache(tmp_path)
    first = cache.get_or_build(KEY, build)
    assert cache.get_or_build(KEY, build) == first
    assert GraphCache(tmp_path).get_or_build(KEY, build) == first
    assert build.calls == 1
    blob, meta = first
    assert blob == b"graph" and meta["workspace"] == 4096
    assert meta["created"] > 0 and meta["build_time_s"] >= 0


def test_entry_file_has_the_documented_layout(tmp_path):
    cache = GraphCache(tmp_path)
    cache.get_or_build(KEY, counting(meta={"roles": {"q": 1}}))
    path = cache.entry_path(KEY)
    assert path == os.path.join(str(tmp_path), KEY.digest()[:2], KEY.digest() + ".sdpg")
    data = open(path, "rb").read()
    assert data[:8] == MAGIC
    document = msgpack.unpackb(data[HEADER.size:])
    assert document["key"] == KEY.canonical() and document["key_hash"] == KEY.digest()
    assert document["blob"] == b"graph" and document["meta"]["roles"] == {"q": 1}
    assert document["versions"] == {"cudnn": "9.19.0", "frontend": "1.32.0", "gpu": "sm90 NVIDIA H200", "format": 1}


def test_meta_reads_the_same_from_memory_and_disk(tmp_path):
    fresh = GraphCache(tmp_path).get_or_build("k", counting(meta={"shape": (4, 16), "uids": {1: "q", 2: "k"}}))
    loaded = GraphCache(tmp_path).get("k")
    assert fresh == loaded and fresh[1]["shape"] == [4, 16] and fresh[1]["uids"] == {1: "q", 2: "k"}


def test_put_and_get(tmp_path):
    cache = GraphCache(tmp_path)
    assert cache.get("k") is None
    cache.put("k", bytearray(b"abc"), {"build_time_s": 0.7})
    assert cache.get("k")[0] == b"abc"
    blob, meta = GraphCache(tmp_path).get("k")
    assert blob == b"abc" and meta["build_time_s"] == 0.7 and "created" in meta


def test_string_and_cachekey_with_the_same_text_are_the_same_entry(tmp_path):
    cache = GraphCache(tmp_path)
    cache.put(KEY, b"x", {})
    assert cache.get(KEY.canonical()) == cache.get(KEY)


def test_build_must_return_bytes_and_dict(tmp_path):
    cache = GraphCache(tmp_path)
    with pytest.raises(TypeError, match="blob"):
        cache.get_or_build("k", lambda: ("text", {}))
    with pytest.raises(TypeError, match="meta"):
        cache.get_or_build("k", lambda: (b"x", None))
    with pytest.raises(TypeError):
        cache.get_or_build("k", lambda: (b"x", {"handle": object()}))  # not msgpack-able
    assert [name for name in files_under(tmp_path) if not name.endswith(".lock")] == []


def test_stats_count_each_layer(tmp_path):
    cache = GraphCache(tmp_path)
    cache.get_or_build("a", counting(b"x" * 100))
    cache.get_or_build("a", counting())
    cache.get("missing")
    other = GraphCache(tmp_path)
    other.get_or_build("a", counting())
    stats, other_stats = cache.stats(), other.stats()
    assert (stats["builds"], stats["memory_hits"], stats["disk_hits"], stats["misses"]) == (1, 1, 0, 2)
    assert (other_stats["builds"], other_stats["disk_hits"]) == (0, 1)
    assert other_stats["disk_load_seconds"] > 0 and stats["build_seconds"] >= 0
    assert stats["bytes_on_disk"] == os.path.getsize(cache.entry_path("a")) > 100
    assert (stats["memory_entries"], stats["memory_bytes"]) == (1, 100)
    assert stats["mode"] == "readwrite" and stats["directory"] == str(tmp_path)


def test_memory_only_caches(tmp_path):
    for cache in (GraphCache(), GraphCache(tmp_path, mode="off")):
        build = counting()
        cache.get_or_build("k", build)
        cache.get_or_build("k", build)
        assert build.calls == 1
        assert cache.entry_path("k") is None and cache.stats()["bytes_on_disk"] == 0
    assert files_under(tmp_path) == []


def test_readonly_reads_disk_and_never_writes(tmp_path):
    GraphCache(tmp_path).get_or_build("present", counting(b"from disk"))
    before = {name: os.stat(os.path.join(tmp_path, name)).st_mtime_ns for name in files_under(tmp_path)}
    cache = GraphCache(tmp_path, mode="readonly")
    assert cache.get_or_build("present", counting())[0] == b"from disk"
    build = counting(b"built here")
    assert cache.get_or_build("absent", build)[0] == b"built here"
    assert cache.get_or_build("absent", build)[0] == b"built here" and build.calls == 1
    cache.put("put here", b"x", {})
    assert cache.entry_path("absent") is None
    after = {name: os.stat(os.path.join(tmp_path, name)).st_mtime_ns for name in files_under(tmp_path)}
    assert after == before  # no new files, no lock files, no touched mtimes


def test_readonly_on_a_missing_directory_does_not_create_it(tmp_path, caplog):
    cache = GraphCache(tmp_path / "absent", mode="readonly")
    assert cache.get_or_build("k", counting())[0] == b"graph"
    assert not (tmp_path / "absent").exists()
    assert "does not exist" in caplog.text


def test_strict_never_builds_and_names_the_spec(tmp_path):
    GraphCache(tmp_path).get_or_build("present", counting(b"ok"))
    cache = GraphCache(tmp_path, mode="strict")
    assert cache.get_or_build("present", counting())[0] == b"ok"
    with pytest.raises(CacheMissError) as raised:
        cache.get_or_build(KEY, counting())
    message = str(raised.value)
    assert KEY.spec in message and key_digest(KEY)[:16] in message and "strict" in message
    assert str(tmp_path) in message
    assert isinstance(raised.value, LookupError)
    assert cache.get(KEY) is None
    assert not any(name.startswith(key_digest(KEY)[:2] + "/" + key_digest(KEY)) for name in files_under(tmp_path))


def test_strict_without_directory_raises_too():
    with pytest.raises(CacheMissError, match="no cache directory"):
        GraphCache(mode="strict").get_or_build("k", counting())


def test_bad_arguments():
    with pytest.raises(ValueError, match="readwrite, readonly, off, strict"):
        GraphCache(mode="sometimes")
    with pytest.raises(ValueError, match="max_bytes"):
        GraphCache(max_bytes=-1)
