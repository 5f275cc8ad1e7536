"""The in-process layer: LRU bounds and order, per-key locks, 16 threads on one key."""
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from sdpagraph.cache import GraphCache
from sdpagraph.cache.entry import Entry
from sdpagraph.cache.memory import KeyedLocks, MemoryLRU
from sdpagraph.memo import BoundedMemo


def entry(size: int) -> Entry:
    return Entry("k", "d", b"x" * size, {})


def test_lru_drops_least_recently_used_beyond_entry_count():
    lru = MemoryLRU(max_entries=3)
    for name in "abc":
        lru.put(name, entry(1))
    assert lru.get("a") is not None  # now most recent
    lru.put("d", entry(1))
    assert [name for name in "abcd" if lru.get(name)] == ["a", "c", "d"]
    assert lru.sizes() == (3, 3)


def test_lru_drops_beyond_byte_budget_but_keeps_the_newest():
    lru = MemoryLRU(max_entries=100, max_bytes=250)
    lru.put("a", entry(100))
    lru.put("b", entry(100))
    lru.put("c", entry(100))
    assert lru.get("a") is None and lru.sizes() == (2, 200)
    lru.put("huge", entry(1000))
    assert lru.get("huge") is not None and lru.sizes() == (1, 1000)


def test_lru_replacing_an_entry_updates_the_byte_count():
    lru = MemoryLRU()
    lru.put("a", entry(100))
    lru.put("a", entry(7))
    assert lru.sizes() == (1, 7)


def test_keyed_locks_serialize_one_key_and_are_forgotten_after_use():
    locks = KeyedLocks()
    inside, overlaps = [], []

    def hold(name):
        with locks.hold(name):
            inside.append(name)
            overlaps.append(inside.count(name))
            time.sleep(0.01)
            inside.remove(name)

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(hold, ["a"] * 8 + ["b"] * 8))
    assert max(overlaps) == 1
    assert len(locks) == 0


def test_keyed_locks_let_other_keys_proceed():
    locks = KeyedLocks()
    entered_b = threading.Event()

    def hold_b():
        with locks.hold("b"):
            entered_b.set()

    with locks.hold("a"):
        threading.Thread(target=hold_b).start()
        assert entered_b.wait(timeout=2)


@pytest.mark.parametrize("with_disk", [False, True])
def test_16_threads_on_one_missing_key_build_once(tmp_path, with_disk):
    cache = GraphCache(tmp_path if with_disk else None)
    builds = []
    start = threading.Barrier(16)

    def build():
        builds.append(threading.get_ident())
        time.sleep(0.05)  # long enough that every thread arrives while the build runs
        return b"graph-%d" % len(builds), {"n": len(builds)}

    def ask(_):
        start.wait()
        return cache.get_or_build("the key", build)

    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(ask, range(16)))
    assert len(builds) == 1
    assert all(result == results[0] for result in results)
    assert results[0][0] == b"graph-1"
    assert cache.stats()["builds"] == 1 and cache.stats()["memory_hits"] == 15


def test_16_threads_hammering_many_keys_build_each_once(tmp_path):
    cache = GraphCache(tmp_path)
    builds = {}
    builds_lock = threading.Lock()

    def builder(key):
        def build():
            with builds_lock:
                builds[key] = builds.get(key, 0) + 1
            time.sleep(0.002)
            return key.encode() * 100, {"key": key}
        return build

    def hammer(seed):
        for step in range(200):
            key = f"key-{(seed * 7 + step) % 10}"
            blob, meta = cache.get_or_build(key, builder(key))
            assert blob == key.encode() * 100 and meta["key"] == key

    with ThreadPoolExecutor(16) as pool:
        list(pool.map(hammer, range(16)))
    assert builds == {f"key-{index}": 1 for index in range(10)}


def test_failed_build_is_not_cached_and_is_retried(tmp_path):
    cache = GraphCache(tmp_path)

    def failing():
        raise RuntimeError("cudnn declined")

    with pytest.raises(RuntimeError, match="declined"):
        cache.get_or_build("k", failing)
    assert cache.get("k") is None
    assert cache.get_or_build("k", lambda: (b"ok", {}))[0] == b"ok"


def test_bounded_memo_keeps_the_most_recent_answers_and_computes_each_once():
    memo = BoundedMemo(3)
    calls = []
    for question in ["a", "b", "c", "a", "d"]:  # "a" is used again, so "b" is the oldest when "d" comes
        memo.get_or_compute(question, lambda q=question: calls.append(q) or q.upper())
    assert calls == ["a", "b", "c", "d"] and len(memo) == 3
    assert memo.get("b") is None and memo.get("a") == "A"
    assert memo.add("x") is True and memo.add("x") is False and len(memo) == 3
    with pytest.raises(ValueError, match="max_entries"):
        BoundedMemo(0)


def test_bounded_memo_is_safe_under_threads():
    memo = BoundedMemo(64)
    errors = []

    def worker(seed):
        try:
            for i in range(2000):
                question = (seed * 7 + i) % 200
                assert memo.get_or_compute(question, lambda q=question: q * 2) == question * 2
        except Exception as error:  # noqa: BLE001 - reported below
            errors.append(error)

    threads = [threading.Thread(target=worker, args=(seed,)) for seed in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors and len(memo) <= 64
