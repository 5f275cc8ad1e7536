"""Graph cache benchmark: multi-process stress with a killed writer, then hit latencies.

    python bench/cache.py                       # 8 processes x 200 calls over 50 keys, then speed
    python bench/cache.py --skip-stress         # speed only

Stress: every process calls get_or_build over overlapping keys and re-reads each result
from disk through a fresh read-only cache; one process is SIGKILLed while it builds.
Blobs carry their own sha256, so a torn or mixed-up read is detected by the reader.
Builds are counted with marker files "<digest>.<pid>" written when a build starts.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import platform
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from functools import partial
from pathlib import Path

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from sdpagraph.cache import CacheKey, GraphCache, key_digest  # noqa: E402
from sdpagraph.deploy.cache_admin import verify_entries  # noqa: E402
from sdpagraph.cache.disk import DiskStore  # noqa: E402

CHECKSUM_BYTES = 32


# -- stress: worker side -------------------------------------------------------------------


def make_blob(key: str, size: int) -> bytes:
    """Unique per build (random body), self-checking (trailing sha256 of the rest)."""
    body = key.encode() + b"|" + os.urandom(size)
    return body + hashlib.sha256(body).digest()


def blob_is_whole(key: str, blob: bytes) -> bool:
    body, checksum = blob[:-CHECKSUM_BYTES], blob[-CHECKSUM_BYTES:]
    return body.startswith(key.encode() + b"|") and hashlib.sha256(body).digest() == checksum


class CountWarnings(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.count = 0

    def emit(self, record: logging.LogRecord) -> None:
        self.count += 1


def run_worker(args: argparse.Namespace) -> None:
    warnings = CountWarnings()
    logging.getLogger("sdpagraph.cache").addHandler(warnings)
    cache = GraphCache(args.directory)
    chooser = random.Random(args.seed)
    seen: dict[str, set[str]] = defaultdict(set)
    reads = corrupt_reads = 0

    def builder(key: str):
        def build():
            open(os.path.join(args.markers, f"{key_digest(key)}.{os.getpid()}"), "x").close()
            time.sleep(chooser.uniform(0.02, 0.08))  # a real build takes 0.5-1.3 s; keep the bench short
            return make_blob(key, args.blob_kb * 1024), {"builder": os.getpid()}
        return build

    for _ in range(args.calls):
        key = f"stress-key-{chooser.randrange(args.keys)}"
        blob, _ = cache.get_or_build(key, builder(key))
        from_disk = GraphCache(args.directory, mode="readonly").get(key)
        for read in (blob, from_disk[0] if from_disk else None):
            if read is not None:
                reads += 1
                corrupt_reads += not blob_is_whole(key, read)
                seen[key].add(hashlib.sha256(read).hexdigest())
    report = {"pid": os.getpid(), "reads": reads, "corrupt_reads": corrupt_reads, "warnings": warnings.count,
              "seen": {key: sorted(hashes) for key, hashes in seen.items()}, "stats": cache.stats()}
    Path(args.out).write_text(json.dumps(report))


# -- stress: parent side -------------------------------------------------------------------


def run_stress(processes: int, calls: int, keys: int, blob_kb: int, seed: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="sdpagraph-stress-") as scratch:
        work = Path(scratch)
        directory, markers = work / "cache", work / "markers"
        markers.mkdir()
        directory.mkdir(mode=0o700)
        children = {}
        for index in range(processes):
            command = [sys.executable, __file__, "--worker", "--directory", str(directory),
                       "--markers", str(markers), "--out", str(work / f"worker{index}.json"), "--calls", str(calls),
                       "--keys", str(keys), "--blob-kb", str(blob_kb), "--seed", str(seed + index)]
            child = subprocess.Popen(command)
            children[child.pid] = child
        store = DiskStore(directory, writable=False, lock_timeout_s=0)
        killed = kill_a_builder(children, markers, store, random.Random(seed))
        for child in children.values():
            child.wait(timeout=600)
        reports = [json.loads(path.read_text()) for path in sorted(work.glob("worker*.json"))]
        return {**summarize(reports, markers, killed, processes, calls),
                "bad_entries_after": len(verify_entries(str(directory), remove=False).data["bad"])}


def kill_a_builder(children: dict, markers: Path, store: DiskStore, chooser: random.Random) -> dict:
    """SIGKILL one process while it is building (its marker exists, its entry does not yet)."""
    wait_until_builds = chooser.randrange(5, 20)
    while True:
        started = sorted(markers.iterdir())
        building = [marker for marker in started
                    if children[int(marker.suffix[1:])].poll() is None
                    and not os.path.exists(store.entry_path(marker.stem))]
        if len(started) >= wait_until_builds and building:
            victim = chooser.choice(building)
            os.kill(int(victim.suffix[1:]), signal.SIGKILL)
            return {"pid": int(victim.suffix[1:]), "digest": victim.stem}
        if all(child.poll() is not None for child in children.values()):
            return {}
        time.sleep(0.002)


def summarize(reports: list[dict], markers: Path, killed: dict, processes: int, calls: int) -> dict:
    builds = Counter(marker.stem for marker in markers.iterdir())
    hashes: dict[str, set[str]] = defaultdict(set)
    for report in reports:
        for key, seen in report["seen"].items():
            hashes[key].update(seen)
    rebuilt = sorted(digest for digest, count in builds.items() if count > 1)
    return {
        "processes": processes, "finished": len(reports), "killed": killed,
        "get_or_build_calls": calls * len(reports),
        "reads_checked": sum(report["reads"] for report in reports),
        "corrupt_reads": sum(report["corrupt_reads"] for report in reports),
        "warnings": sum(report["warnings"] for report in reports),
        "keys_built": len(builds), "builds": sum(builds.values()),
        "builds_per_key": dict(Counter(builds.values())),
        "keys_built_more_than_once": rebuilt,
        "only_the_killed_builders_key_rebuilt": set(rebuilt) <= {killed.get("digest")},
        "keys_with_differing_bytes": sorted(key for key, seen in hashes.items() if len(seen) > 1),
    }


# -- speed ---------------------------------------------------------------------------------


def percentiles(samples_ns: list[int]) -> tuple[float, float]:
    """(median, p99) in microseconds."""
    ordered = sorted(samples_ns)
    return statistics.median(ordered) / 1000, ordered[int(len(ordered) * 0.99)] / 1000


KEY_FIELDS = ("B4 S4096 H16 D128 bf16 BSHD causal softcap", "ab" * 32, "forward", "9.19.0", "1.32.0",
              "sm90 NVIDIA H200")


def time_memory_hits(repeats: int, fresh_key: bool) -> tuple[float, float]:
    """A hit on a hot entry; with fresh_key, building the CacheKey (as a caller does per lookup) is timed too."""
    cache = GraphCache()
    reused = CacheKey(*KEY_FIELDS)
    cache.get_or_build(reused, lambda: (b"x" * 100_000, {}))
    key_for_call = (lambda: CacheKey(*KEY_FIELDS)) if fresh_key else (lambda: reused)
    return time_calls(lambda: lambda: cache.get_or_build(key_for_call(), build_must_not_run), repeats)


def time_disk_hits(directory: Path, mode: str, repeats: int, blob_kb: int) -> tuple[float, float]:
    """First lookup in a fresh cache: read, checksum, decode and (readwrite) record the use."""
    GraphCache(directory).put("disk", os.urandom(blob_kb * 1024), {"workspace": 1 << 20})
    return time_calls(lambda: partial(GraphCache(directory, mode=mode).get_or_build, "disk", build_must_not_run),
                      repeats)


def time_calls(prepare, repeats: int) -> tuple[float, float]:
    """(median, p99) of calls to the function prepare() returns; prepare() itself is not timed."""
    samples = []
    for _ in range(repeats):
        call = prepare()
        started = time.perf_counter_ns()
        call()
        samples.append(time.perf_counter_ns() - started)
    return percentiles(samples)


def build_must_not_run():
    raise AssertionError("benchmark expected a cache hit")


# -- report --------------------------------------------------------------------------------


def print_speed_table(rows: list[tuple[str, tuple[float, float], str]]) -> None:
    print("| measurement | median (us) | p99 (us) | target |")
    print("| --- | ---: | ---: | --- |")
    for name, (median, p99), target in rows:
        print(f"| {name} | {median:.1f} | {p99:.1f} | {target} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--processes", type=int, default=8)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--keys", type=int, default=50)
    parser.add_argument("--blob-kb", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=2000, help="samples per speed measurement")
    parser.add_argument("--skip-stress", action="store_true")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--directory", help=argparse.SUPPRESS)
    parser.add_argument("--markers", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        run_worker(args)
        return
    print(f"python {platform.python_version()}, {platform.platform()}, {os.cpu_count()} CPUs")
    if not args.skip_stress:
        started = time.perf_counter()
        result = run_stress(args.processes, args.calls, args.keys, args.blob_kb, args.seed)
        print(f"stress ({time.perf_counter() - started:.1f} s):")
        print(json.dumps(result, indent=2))
    with tempfile.TemporaryDirectory(prefix="sdpagraph-speed-") as scratch:
        print_speed_table([
            ("memory hit, same CacheKey", time_memory_hits(args.repeats * 10, fresh_key=False), "<= 20 us"),
            ("memory hit, new CacheKey per call", time_memory_hits(args.repeats * 10, fresh_key=True), "<= 20 us"),
            (f"disk hit {args.blob_kb} KB, readwrite", time_disk_hits(Path(scratch) / "rw", "readwrite",
                                                                     args.repeats, args.blob_kb), "<= 2000 us"),
            (f"disk hit {args.blob_kb} KB, readonly", time_disk_hits(Path(scratch) / "ro", "readonly",
                                                                    args.repeats, args.blob_kb), "<= 2000 us"),
        ])


if __name__ == "__main__":
    main()
