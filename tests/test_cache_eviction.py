"""The directory stays within max_bytes by dropping least recently used entries."""
import os
import random
from concurrent.futures import ThreadPoolExecutor

from sdpagraph.cache import GraphCache, key_digest
from sdpagraph.cache.disk import DiskStore
from sdpagraph.cache.entry import Entry

BLOB = b"g" * 1000


def entry_size(directory):
    cache = GraphCache(directory / "probe")
    cache.put("size probe", BLOB, {})
    return os.path.getsize(cache.entry_path("size probe"))


def age(cache, key, seconds_ago):
    """Set an entry's last use (its mtime) to a fixed point in the past."""
    stamp = 1_700_000_000 - seconds_ago
    os.utime(cache.entry_path(key), (stamp, stamp))


def on_disk(cache, keys):
    return {key for key in keys if cache.entry_path(key)}


def test_total_stays_under_the_budget_dropping_least_recent(tmp_path):
    budget = 3 * entry_size(tmp_path) + 10
    cache = GraphCache(tmp_path / "cache", max_bytes=budget)
    keys = [f"k{index}" for index in range(8)]
    for index, key in enumerate(keys):
        cache.put(key, BLOB, {})
        age(cache, key, seconds_ago=100 - index)
        assert cache.stats()["bytes_on_disk"] <= budget
    assert on_disk(cache, keys) == {"k5", "k6", "k7"}


def test_a_disk_hit_counts_as_a_use(tmp_path):
    budget = 3 * entry_size(tmp_path) + 10
    cache = GraphCache(tmp_path / "cache", max_bytes=budget)
    for index, key in enumerate(["a", "b", "c"]):
        cache.put(key, BLOB, {})
        age(cache, key, seconds_ago=100 - index)
    GraphCache(tmp_path / "cache", mode="readonly").get("a")  # readonly: no touch
    GraphCache(tmp_path / "cache").get("b")  # readwrite: touch
    cache.put("d", BLOB, {})
    assert on_disk(cache, "abcd") == {"b", "c", "d"}


def test_the_entry_just_published_survives_even_alone_over_budget(tmp_path):
    cache = GraphCache(tmp_path, max_bytes=10)
    cache.put("old", BLOB, {})
    cache.get_or_build("new", lambda: (BLOB, {}))
    assert on_disk(cache, ["old", "new"]) == {"new"}


def test_an_entry_used_since_the_scan_is_not_removed(tmp_path):
    GraphCache(tmp_path).put("k", BLOB, {})
    store = DiskStore(tmp_path, writable=True, lock_timeout_s=1)
    [scanned] = store.scan()
    os.utime(scanned.path, ns=(scanned.mtime_ns + 10**9, scanned.mtime_ns + 10**9))
    assert not store.remove(scanned)
    assert store.remove(store.scan()[0])
    assert store.scan() == []


def test_an_entry_whose_lock_is_held_is_not_removed(tmp_path):
    GraphCache(tmp_path).put("k", BLOB, {})
    publisher = DiskStore(tmp_path, writable=True, lock_timeout_s=1)
    evictor = DiskStore(tmp_path, writable=True, lock_timeout_s=1)
    with publisher.key_lock(key_digest("k")):  # a separate open file: conflicts like another process
        assert evictor.evict(0) == []
    assert [stored.digest for stored in evictor.evict(0)] == [key_digest("k")]


def test_concurrent_publishers_and_evictors_keep_the_budget_and_valid_entries(tmp_path):
    budget = 5 * entry_size(tmp_path)
    directory = tmp_path / "cache"

    def worker(seed):
        # One GraphCache per worker: separate lock file descriptors, as separate processes have.
        cache = GraphCache(directory, max_bytes=budget)
        chooser = random.Random(seed)
        for _ in range(40):
            key = f"k{chooser.randrange(12)}"
            assert cache.get_or_build(key, lambda: (key.encode() + BLOB, {}))[0] == key.encode() + BLOB

    with ThreadPoolExecutor(6) as pool:
        list(pool.map(worker, range(6)))
    store = DiskStore(directory, writable=False, lock_timeout_s=1)
    assert store.total_bytes() <= budget
    assert all(isinstance(store.read(stored.digest), Entry) for stored in store.scan())
