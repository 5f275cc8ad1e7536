"""Several processes on one cache directory: one build per key, atomic publication even
when a writer is SIGKILLed mid-write, no lock outliving its holder, safe eviction."""
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from sdpagraph.cache import GraphCache, key_digest

REPO = Path(__file__).resolve().parents[1]

# argv: cache directory, key, action, marker directory. Markers are empty files named
# "<event>.<pid>" so the test can count builds and see where a child is.
WORKER = r"""
import os, sys, time
from sdpagraph.cache import GraphCache

directory, key, action, markers = sys.argv[1:5]

def mark(event):
    open(os.path.join(markers, f"{event}.{os.getpid()}"), "x").close()

def build():
    mark("build")
    time.sleep(0.3)  # long enough for every sibling to be waiting on the lock
    return f"built by {os.getpid()}".encode(), {}

def hang_in_build():
    mark("building")
    time.sleep(3600)

def write_half_then_hang(fd, data, write=os.write):
    write(fd, bytes(data[: len(data) // 2]))
    mark("writing")
    time.sleep(3600)

cache = GraphCache(directory)
if action == "get_or_build":
    mark("ready")
    while not os.path.exists(os.path.join(markers, "go")):  # start together, after the slow imports
        time.sleep(0.005)
    blob, _ = cache.get_or_build(key, build)
    stats = cache.stats()
    print(blob.decode(), stats["builds"], stats["disk_hits"])
elif action == "hang_in_build":
    cache.get_or_build(key, hang_in_build)
elif action == "die_mid_put":
    os.write = write_half_then_hang
    cache.put(key, b"new bytes " * 10_000, {})
"""


@pytest.fixture
def markers(tmp_path):
    path = tmp_path / "markers"
    path.mkdir()
    return path


def spawn(directory, key, action, markers):
    environment = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.Popen([sys.executable, "-c", WORKER, str(directory), key, action, str(markers)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=environment)


def events(markers, event):
    return sorted(markers.glob(f"{event}.*"))


def wait_for(markers, event, child, timeout=20.0):
    deadline = time.monotonic() + timeout
    while not events(markers, event):
        assert child.poll() is None, child.communicate()
        assert time.monotonic() < deadline, f"child never reached {event!r}"
        time.sleep(0.01)


def kill(child):
    child.send_signal(signal.SIGKILL)
    child.communicate()


def temp_files(directory):
    return sorted(directory.rglob("*.tmp"))


def test_processes_asking_for_one_missing_key_build_it_once(tmp_path, markers):
    children = [spawn(tmp_path / "cache", "shared key", "get_or_build", markers) for _ in range(6)]
    deadline = time.monotonic() + 60
    while len(events(markers, "ready")) < len(children):
        assert time.monotonic() < deadline and all(child.poll() is None for child in children)
        time.sleep(0.01)
    (markers / "go").touch()
    outputs = [child.communicate(timeout=60) for child in children]
    assert all(child.returncode == 0 for child in children), outputs
    assert len(events(markers, "build")) == 1
    blobs = {stdout.rsplit(" ", 2)[0] for stdout, _ in outputs}
    assert len(blobs) == 1
    # One process built; the five others waited on its lock and loaded its entry from disk.
    assert sorted(stdout.split()[-2:] for stdout, _ in outputs) == [["0", "1"]] * 5 + [["1", "0"]]


def test_lock_of_a_killed_builder_does_not_block(tmp_path, markers):
    directory = tmp_path / "cache"
    child = spawn(directory, "k", "hang_in_build", markers)
    wait_for(markers, "building", child)
    with pytest.raises(TimeoutError, match="another process is building") as raised:
        GraphCache(directory, lock_timeout_s=0.2).get_or_build("k", pytest.fail)
    assert os.path.join(directory, key_digest("k")[:2], key_digest("k") + ".lock") in str(raised.value)
    kill(child)
    started = time.monotonic()
    assert GraphCache(directory, lock_timeout_s=10).get_or_build("k", lambda: (b"mine", {}))[0] == b"mine"
    assert time.monotonic() - started < 2


def test_writer_killed_mid_write_publishes_nothing(tmp_path, markers, caplog):
    directory = tmp_path / "cache"
    child = spawn(directory, "k", "die_mid_put", markers)
    wait_for(markers, "writing", child)
    reader = GraphCache(directory, mode="readonly")
    assert reader.get("k") is None
    kill(child)
    assert reader.get("k") is None
    assert len(temp_files(directory)) == 1  # the half-written temp file, which no reader opens
    assert not caplog.records
    assert GraphCache(directory).get_or_build("k", lambda: (b"rebuilt", {}))[0] == b"rebuilt"


def test_writer_killed_while_replacing_leaves_the_old_entry_whole(tmp_path, markers, caplog):
    directory = tmp_path / "cache"
    GraphCache(directory).put("k", b"old bytes", {})
    child = spawn(directory, "k", "die_mid_put", markers)
    wait_for(markers, "writing", child)
    assert GraphCache(directory, mode="readonly").get("k")[0] == b"old bytes"
    kill(child)
    assert GraphCache(directory, mode="readonly").get("k")[0] == b"old bytes"
    assert not caplog.records


def test_eviction_skips_an_entry_being_published_and_removes_abandoned_temps(tmp_path, markers):
    directory = tmp_path / "cache"
    seed = GraphCache(directory)
    for key in ("a", "b", "c"):
        seed.put(key, key.encode() * 1000, {})
    child = spawn(directory, "b", "die_mid_put", markers)  # holds b's lock while it writes
    wait_for(markers, "writing", child)
    try:
        evictor = GraphCache(directory, max_bytes=0)
        evictor.put("d", b"d", {})  # publishing d evicts everything it may
        present = {key for key in "abcd" if evictor.entry_path(key)}
        assert present == {"b", "d"}
    finally:
        kill(child)
    [abandoned] = temp_files(directory)
    os.utime(abandoned, (0, 0))  # as if left by a writer killed long ago
    GraphCache(directory, max_bytes=0).put("e", b"e", {})
    assert temp_files(directory) == []
