"""precompile and verify, with a fake cuDNN builder (no GPU here): what is built, what is
reused, unsupported vs failed, --jobs processes, progress, the CLI, and interruption."""
import argparse
import functools
import hashlib
import importlib
import io
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from sdpagraph.cache import GraphCache
from sdpagraph.deploy.cache_admin import verify_entries
from sdpagraph.graph_store import graph_key
from sdpagraph.graphs import builder
from sdpagraph.graphs.binning import bin_plan
from sdpagraph.graphs.support import Support
from sdpagraph.deploy.precompile import Builder, BuilderUnavailable, Progress, precompile
from sdpagraph.deploy.verify import verify
from sdpagraph.deploy.entry_parser import parse_entry
from sdpagraph.deploy.specfile import save_specs

# By module name: the package may re-export the function `precompile` under the same name.
module = importlib.import_module("sdpagraph.deploy.precompile")
deploy_cli = importlib.import_module("sdpagraph.cli.deploy")
REPO = Path(__file__).resolve().parents[1]
DECLINED_HEAD_DIM = 256  # the fake cuDNN declines head dims above 128
BROKEN_KV_LEN = 13  # and fails (an error, not a decline) on this key length
FATAL_KV_LEN = 29  # and kills its process on this one, as a crash in native code would


class FakeDecline(Exception):
    pass


@dataclass(frozen=True)
class FakeCudnn:
    """Builds deterministic bytes through the cache like the real builder, logging each build
    as a line "<event> <key digest> <pid>" so tests count builds across processes."""

    log_dir: str
    delay_s: float = 0.0
    gpu: str = "sm90 Fake H200"

    def builder(self) -> Builder:
        return Builder(build=self.build, graph_key=self.graph_key, check_graphs=self.check_graphs,
                       declines=(FakeDecline,), unavailable=self.unavailable)

    def graph_key(self, spec, ir, direction):
        env = builder.BuildEnvironment("9.19.0", "1.32.0", self.gpu)
        return graph_key(spec, ir, direction, env)

    def build(self, spec, ir, direction, cache):
        key = self.graph_key(spec, ir, direction)
        return cache.get_or_build(key, functools.partial(self.compile, spec, key))

    def compile(self, spec, key):
        if spec.head_dim > 128:
            raise FakeDecline(f"hidden_dim {spec.head_dim} unsupported")
        if spec.kv_len == BROKEN_KV_LEN:
            raise RuntimeError("CUDNN_STATUS_INTERNAL_ERROR")
        if spec.kv_len == FATAL_KV_LEN:
            os._exit(134)
        self.log("start", key)
        time.sleep(self.delay_s)
        self.log("done", key)
        return hashlib.sha256(key.canonical().encode()).digest() * 64, {"summary": spec.summary()}

    def check_graphs(self, spec, ir, training, cache):
        if spec.head_dim > 128:
            return Support(False, "xla", f"head dim {spec.head_dim} is above what cuDNN supports")
        return Support(True, "cudnn", "cuDNN builds it")

    def unavailable(self):
        return None

    def log(self, event, key):
        fd = os.open(os.path.join(self.log_dir, "builds.log"), os.O_WRONLY | os.O_APPEND | os.O_CREAT)
        try:
            os.write(fd, f"{event} {key.digest()} {os.getpid()}\n".encode())
        finally:
            os.close(fd)

    def events(self, event):
        path = os.path.join(self.log_dir, "builds.log")
        lines = open(path).read().split("\n") if os.path.exists(path) else []
        return [line.split()[1:] for line in lines if line.startswith(event + " ")]


@pytest.fixture
def fake(tmp_path):
    logs = tmp_path / "logs"
    logs.mkdir()
    return FakeCudnn(str(logs))


def random_entries(seed, count, training=None, **fixed):
    rng = np.random.default_rng(seed)
    entries = []
    for _ in range(count):
        batch, q_len, kv_len = (int(x) for x in rng.integers(1, 64, 3))
        kv_len = kv_len + 1 if kv_len in (BROKEN_KV_LEN, FATAL_KV_LEN) else kv_len
        fields = {"shapes": {"query": [batch, q_len, 4, 64], "key": [batch, kv_len, 2, 64],
                             "value": [batch, kv_len, 2, 64]},
                  "dtype": "bfloat16", "is_causal": bool(rng.integers(2)),
                  "training": bool(rng.integers(2)) if training is None else training}
        if rng.integers(2):
            fields["score_mod"] = {"mod": "softcap", "args": [float(rng.uniform(5, 50))]}
        entries.append(parse_entry(len(entries), {**fields, **fixed}))
    return entries


def graph_count(entries):
    return sum(len(entry.directions) for entry in entries)


def test_precompile_builds_every_graph_once(tmp_path, fake):
    entries = random_entries(1, 6)
    cache_dir = tmp_path / "cache"
    first = precompile(entries, cache_dir, progress=False, builder=fake.builder())
    assert first.counts() == {"built": graph_count(entries), "cached": 0, "unsupported": 0, "failed": 0}
    assert first.ok and first.exit_code == 0
    assert len(fake.events("done")) == graph_count(entries)
    again = precompile(entries, cache_dir, progress=False, builder=fake.builder())
    assert again.counts()["cached"] == graph_count(entries) and again.counts()["built"] == 0
    assert len(fake.events("done")) == graph_count(entries), "nothing is built twice"
    checked = verify(entries, cache_dir, builder=fake.builder())
    assert checked.exit_code == 0 and not checked.problems and len(checked.checks) == graph_count(entries)
    assert verify_entries(str(cache_dir), remove=False).exit_code == 0


def test_runtime_finds_precompiled_graphs_in_strict_mode(tmp_path, fake):
    entries = random_entries(2, 3)
    precompile(entries, tmp_path, progress=False, builder=fake.builder())
    strict = GraphCache(tmp_path, mode="strict")
    for entry in entries:
        for direction in entry.directions:
            fake.build(entry.spec, entry.score_mod, direction, cache=strict)  # raises CacheMissError if absent


def test_unsupported_and_failed_entries(tmp_path, fake):
    good = random_entries(3, 2)
    declined = random_entries(4, 1, training=True, shapes={"query": [1, 8, 2, DECLINED_HEAD_DIM],
                                                            "key": [1, 8, 2, DECLINED_HEAD_DIM],
                                                            "value": [1, 8, 2, DECLINED_HEAD_DIM]})
    broken = random_entries(5, 1, training=False, shapes={"query": [1, 8, 2, 64], "key": [1, BROKEN_KV_LEN, 2, 64],
                                                          "value": [1, BROKEN_KV_LEN, 2, 64]})
    report = precompile(good + declined, tmp_path, progress=False, builder=fake.builder())
    assert report.counts()["unsupported"] == 2 and report.ok and report.exit_code == 0
    forward, backward = [graph for graph in report.graphs if graph.entry == len(good)]
    assert forward.status == backward.status == "unsupported"
    assert forward.detail == f"head dim {DECLINED_HEAD_DIM} is above what cuDNN supports" == backward.detail
    assert "unsupported" in report.text() and forward.detail in report.text()

    strict = precompile(good + declined, tmp_path, strict=True, progress=False, builder=fake.builder())
    assert not strict.ok and strict.exit_code == 1 and "--strict" in strict.text()

    failed = precompile(good + broken, tmp_path, progress=False, builder=fake.builder())
    [graph] = [graph for graph in failed.graphs if graph.status == "failed"]
    assert graph.detail == "RuntimeError: CUDNN_STATUS_INTERNAL_ERROR" and failed.exit_code == 1
    assert failed.counts()["cached"] == graph_count(good)
    assert "run the same command again" in failed.text()


def test_parallel_jobs_build_each_graph_once_in_several_processes(tmp_path, fake):
    entries = random_entries(6, 8)
    slow = FakeCudnn(fake.log_dir, delay_s=0.2)
    report = precompile(entries, tmp_path / "cache", jobs=3, progress=False, builder=slow.builder())
    assert report.counts()["built"] == graph_count(entries)
    done = slow.events("done")
    assert len(done) == len({digest for digest, _ in done}) == graph_count(entries)
    assert len({pid for _, pid in done}) >= 2 and str(os.getpid()) not in {pid for _, pid in done}
    assert [graph.entry for graph in report.graphs] == sorted(graph.entry for graph in report.graphs)
    serial = precompile(entries, tmp_path / "serial", progress=False, builder=fake.builder())
    assert [(g.entry, g.direction, g.status) for g in serial.graphs] == \
           [(g.entry, g.direction, g.status) for g in report.graphs]


def test_a_crashed_build_process_is_a_failure_not_a_hang(tmp_path, fake):
    crashing = random_entries(11, 1, training=False, shapes={"query": [1, 8, 2, 64], "key": [1, FATAL_KV_LEN, 2, 64],
                                                              "value": [1, FATAL_KV_LEN, 2, 64]})
    report = precompile(random_entries(12, 3) + crashing, tmp_path, jobs=2, progress=False, builder=fake.builder())
    assert report.exit_code == 1
    [crashed] = [graph for graph in report.graphs if graph.entry == 3]
    assert crashed.status == "failed" and "a build process died" in crashed.detail
    assert verify_entries(str(tmp_path), remove=False).exit_code == 0


class FakeClock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


class Terminal(io.StringIO):
    def isatty(self):
        return True


def results(status, count):
    return [module.GraphResult(0, "forward", status)] * count


def test_progress_in_a_log_is_periodic_plain_lines():
    clock, stream = FakeClock(), io.StringIO()
    meter = Progress(8, stream, clock)
    clock.now += 10
    meter.add(results("built", 2))
    clock.now += 1
    meter.add(results("cached", 1))  # within the interval: no line
    clock.now += 10
    meter.add(results("unsupported", 1))
    meter.close()
    lines = stream.getvalue().splitlines()
    assert len(lines) == 4 and "\r" not in stream.getvalue()
    assert lines[0].startswith("precompile: 0/8 graphs") and lines[0].endswith("ETA ?")
    assert lines[1] == ("precompile: 2/8 graphs: 2 built, 0 already there, 0 unsupported, 0 failed; "
                        "elapsed 10 s, ETA 30 s")
    assert lines[2].startswith("precompile: 4/8 graphs: 2 built, 1 already there, 1 unsupported")
    assert lines[3] == lines[2]


def test_progress_on_a_terminal_redraws_one_line():
    clock, stream = FakeClock(), Terminal()
    meter = Progress(2, stream, clock)
    clock.now += 3
    meter.add(results("failed", 1))
    meter.close()
    text = stream.getvalue()
    assert text.count("\r") == 2 and text.count("\x1b[K") == 2 and text.endswith("\n")
    assert "1/2 graphs: 0 built, 0 already there, 0 unsupported, 1 failed; elapsed 3 s, ETA 3 s" in text


def test_precompile_progress_goes_to_the_given_stream(tmp_path, fake):
    stream = io.StringIO()
    entries = random_entries(7, 2)
    precompile(entries, tmp_path, progress=stream, builder=fake.builder())
    assert stream.getvalue().splitlines()[-1].startswith(f"precompile: {graph_count(entries)}/{graph_count(entries)}")


# -- the command line ---------------------------------------------------------------------------


def run_cli(capsys, *argv):
    parser = argparse.ArgumentParser(prog="sdpagraph")
    subparsers = parser.add_subparsers()
    deploy_cli.add_precompile_command(subparsers)
    deploy_cli.add_verify_command(subparsers)
    args = parser.parse_args(argv)
    code = args.handler(args)
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture
def spec_file(tmp_path):
    path = tmp_path / "specs.json"
    save_specs(path, random_entries(8, 4))
    return path


def test_cli_precompile_then_verify(tmp_path, fake, spec_file, capsys, monkeypatch):
    monkeypatch.setattr(module, "cudnn_builder", fake.builder)
    cache_dir = tmp_path / "cache"
    code, out, err = run_cli(capsys, "precompile", str(spec_file), "--cache-dir", str(cache_dir))
    header, *rows, footer = out.splitlines()
    assert code == 0 and header.split() == ["#", "GRAPH", "STATUS", "TIME", "SPEC", "NOTE"]
    assert all(" built " in row for row in rows) and footer.startswith(f"{len(rows)} graphs in {cache_dir}")
    assert err.startswith("precompile: 0/")
    code, out, _ = run_cli(capsys, "precompile", str(spec_file), "--cache-dir", str(cache_dir), "--json")
    data = json.loads(out)
    assert code == 0 and data["counts"]["cached"] == len(rows) and data["ok"]
    code, out, _ = run_cli(capsys, "verify", "--specs", str(spec_file), "--cache-dir", str(cache_dir))
    assert code == 0 and out.startswith(f"{len(rows)} of {len(rows)} graphs present and valid")
    assert "gpu sm90 Fake H200" in out


def test_cli_verify_reports_missing_graphs_with_the_command_to_fix_them(tmp_path, fake, spec_file, capsys,
                                                                         monkeypatch):
    monkeypatch.setattr(module, "cudnn_builder", fake.builder)
    cache_dir = tmp_path / "cache"
    precompile(spec_file, cache_dir, progress=False, builder=fake.builder())
    entry_files = sorted(cache_dir.glob("*/*.sdpg"))
    entry_files[0].unlink()
    with open(entry_files[1], "r+b") as file:
        file.seek(-3, os.SEEK_END)
        file.write(b"XXX")
    code, out, _ = run_cli(capsys, "verify", "--specs", str(spec_file), "--cache-dir", str(cache_dir))
    assert code == 1
    header, *rows = out.splitlines()[:3]
    assert header.split() == ["#", "GRAPH", "STATUS", "SPEC", "REASON"]
    assert sorted(row.split()[2] for row in rows) == ["invalid", "missing"]
    assert "checksum mismatch" in out and "not in the cache" in out
    assert f"sdpagraph precompile {spec_file} --cache-dir {cache_dir}" in out
    code, out, _ = run_cli(capsys, "verify", "--specs", str(spec_file), "--cache-dir", str(cache_dir), "--json")
    data = json.loads(out)
    assert code == 1 and not data["ok"] and sorted(g["status"] for g in data["graphs"] if g["status"] != "present") \
        == ["invalid", "missing"]
    code, _, _ = run_cli(capsys, "precompile", str(spec_file), "--cache-dir", str(cache_dir))
    assert code == 0 and run_cli(capsys, "verify", "--specs", str(spec_file), "--cache-dir", str(cache_dir))[0] == 0


def test_verify_names_the_environment_a_cache_was_built_for(tmp_path, fake, spec_file):
    other_gpu = FakeCudnn(fake.log_dir, gpu="sm80 Fake A100")
    precompile(spec_file, tmp_path, progress=False, builder=other_gpu.builder())
    report = verify(spec_file, tmp_path, builder=fake.builder())
    assert report.exit_code == 1 and all(check.status == "missing" for check in report.checks)
    assert report.environment["gpu"] == "sm90 Fake H200"
    [(label, count)] = report.other_environments
    assert label.startswith("built for ") and "gpu sm80 Fake A100" in label and count == len(report.checks)
    assert f"it also holds {count} graphs built for " in report.text()


def test_cli_errors_exit_2_with_a_message(tmp_path, fake, capsys, monkeypatch):
    monkeypatch.setattr(module, "cudnn_builder", fake.builder)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"entries": [{"shapes": {"query": [1, 8, 2, 64]}, "dtype": "bfloat16"}]}))
    code, out, err = run_cli(capsys, "precompile", str(bad), "--cache-dir", str(tmp_path / "cache"))
    assert code == 2 and out == "" and "entry 0: field 'shapes': 'key' is missing" in err
    code, _, err = run_cli(capsys, "verify", "--specs", str(tmp_path / "absent.json"), "--cache-dir", str(tmp_path))
    assert code == 2 and err == f"sdpagraph verify: {tmp_path / 'absent.json'}: no such file\n"
    a_file = tmp_path / "a_file"
    a_file.write_text("")
    for command in (["precompile", str(bad)], ["verify", "--specs", str(bad)]):
        code, out, err = run_cli(capsys, *command, "--cache-dir", str(a_file))
        assert code == 2 and out == "" and "entry 0: field 'shapes'" in err, "the spec file is checked first"
    good = tmp_path / "good.json"
    save_specs(good, random_entries(13, 1))
    for command in (["precompile", str(good)], ["verify", "--specs", str(good)]):
        code, out, err = run_cli(capsys, *command, "--cache-dir", str(a_file))
        assert (code, out) == (2, "") and err == f"sdpagraph {command[0]}: --cache-dir {a_file}: not a directory\n"
    code, out, err = run_cli(capsys, "precompile", str(good), "--cache-dir", str(a_file / "sub"))
    assert code == 2 and err == f"sdpagraph precompile: --cache-dir {a_file / 'sub'}: {a_file} is not a directory\n"


@pytest.mark.parametrize("command", ["precompile", "verify"])
def test_without_a_gpu_the_spec_file_is_still_checked_first(tmp_path, spec_file, capsys, command):
    # The real builder on this machine (no GPU): the spec file's problems come first, each one line.
    files = [str(spec_file)] if command == "precompile" else ["--specs", str(spec_file)]
    bad_ir = tmp_path / "bad_ir.json"
    with_mod = random_entries(14, 1, score_mod={"mod": "softcap", "args": [20.0]})
    document = {"entries": json.loads(spec_file.read_text())["entries"] + [with_mod[0].to_dict()]}
    entry = len(document["entries"]) - 1
    document["entries"][entry]["score_mod"]["output"] = 1000
    bad_ir.write_text(json.dumps(document))
    binary = tmp_path / "binary.json"
    binary.write_bytes(b"\x00\x9f" * 50)
    cases = [(tmp_path / "missing.json", "no such file"), (tmp_path, "is a directory, not a spec file"),
             (binary, "not a spec file: binary data"), (bad_ir, f"entry {entry}: field 'score_mod': the IR's "
                                                                "'output' is 1000, which is not a node")]
    for path, problem in cases:
        argv = [command, str(path)] if command == "precompile" else [command, "--specs", str(path)]
        code, out, err = run_cli(capsys, *argv, "--cache-dir", str(tmp_path / "cache"))
        assert (code, out) == (2, "") and err.startswith(f"sdpagraph {command}: {path}: {problem}"), err
        assert err.count("\n") == 1
        code, out, err = run_cli(capsys, *argv, "--cache-dir", str(tmp_path / "cache"), "--json")
        data = json.loads(out)
        assert code == data["exit_code"] == 2 and data["error"].startswith(f"{path}: {problem}")
    code, out, err = run_cli(capsys, command, *files, "--cache-dir", str(tmp_path / "cache"), "--json")
    data = json.loads(out)
    task = "precompile" if command == "precompile" else "verify a cache"
    assert code == data["exit_code"] == 2 and data["entries"] == 4 and data["graphs"] >= 4
    assert data["error"].startswith(f"{spec_file} is valid (4 entries, {data['graphs']} graphs); cannot {task} "
                                    "on this machine: no GPU visible to JAX")
    assert err == f"sdpagraph {command}: {data['error']}\n"
    assert not (tmp_path / "cache").exists(), "nothing is created where nothing can be built"


def test_cli_json_is_json_for_every_outcome(tmp_path, fake, spec_file, capsys, monkeypatch):
    monkeypatch.setattr(module, "cudnn_builder", fake.builder)
    cache_dir = str(tmp_path / "cache")
    code, out, _ = run_cli(capsys, "verify", "--specs", str(spec_file), "--cache-dir", cache_dir, "--json")
    data = json.loads(out)
    assert code == data["exit_code"] == 1 and not data["ok"] and data["fix_command"] == \
        f"sdpagraph precompile {spec_file} --cache-dir {cache_dir}"
    code, out, _ = run_cli(capsys, "precompile", str(spec_file), "--cache-dir", cache_dir, "--json")
    assert code == json.loads(out)["exit_code"] == 0
    code, out, _ = run_cli(capsys, "verify", "--specs", str(spec_file), "--cache-dir", cache_dir, "--json")
    assert code == json.loads(out)["exit_code"] == 0 and json.loads(out)["fix_command"] is None


def test_verify_without_a_gpu_says_so(tmp_path, spec_file, capsys):
    # The real builder on this machine (no GPU): a clear message and exit 2, no traceback.
    code, out, err = run_cli(capsys, "verify", "--specs", str(spec_file), "--cache-dir", str(tmp_path))
    assert code == 2 and out == ""
    assert "cannot verify a cache on this machine: no GPU visible to JAX" in err
    with pytest.raises(BuilderUnavailable, match="cannot precompile on this machine"):
        precompile(spec_file, tmp_path, progress=False)
    assert not list(tmp_path.glob("*/*.sdpg"))


# -- interruption -------------------------------------------------------------------------------

CHILD = r"""
import argparse, sys
from sdpagraph.cli import deploy as deploy_cli
from tests.test_precompile import FakeCudnn, module

module.cudnn_builder = FakeCudnn(sys.argv[1], delay_s=float(sys.argv[2])).builder
parser = argparse.ArgumentParser()
deploy_cli.add_precompile_command(parser.add_subparsers())
args = parser.parse_args(sys.argv[3:])
sys.exit(args.handler(args))
"""


def start_precompile(fake, delay_s, spec_file, cache_dir, jobs):
    environment = {**os.environ, "PYTHONPATH": str(REPO), "JAX_PLATFORMS": "cpu"}
    argv = [sys.executable, "-c", CHILD, fake.log_dir, str(delay_s), "precompile", str(spec_file),
            "--cache-dir", str(cache_dir), "--jobs", str(jobs)]
    # Its own process group, so the test can kill it with its workers, as Ctrl-C would.
    return subprocess.Popen(argv, env=environment, cwd=REPO, start_new_session=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_until(condition, child, timeout=60.0):
    deadline = time.monotonic() + timeout
    while not condition():
        assert child.poll() is None, child.communicate()
        assert time.monotonic() < deadline, "the precompile never got going"
        time.sleep(0.02)


def published(cache_dir):
    return {path.stem for path in cache_dir.glob("*/*.sdpg")}


def test_killed_precompile_leaves_whole_entries_and_a_rerun_builds_the_rest(tmp_path, fake):
    entries = random_entries(9, 8, training=False)
    spec_file = tmp_path / "specs.json"
    save_specs(spec_file, entries)
    cache_dir = tmp_path / "cache"
    child = start_precompile(fake, 0.4, spec_file, cache_dir, jobs=2)
    wait_until(lambda: len(published(cache_dir)) >= 2, child)
    os.killpg(child.pid, signal.SIGKILL)
    child.communicate()

    assert verify_entries(str(cache_dir), remove=False).exit_code == 0, "no partial or corrupt entry"
    finished = published(cache_dir)
    assert 2 <= len(finished) < len(entries)

    rerun_log = tmp_path / "rerun"
    rerun_log.mkdir()
    rerun = FakeCudnn(str(rerun_log))
    report = precompile(spec_file, cache_dir, progress=False, builder=rerun.builder())
    assert report.counts() == {"built": len(entries) - len(finished), "cached": len(finished),
                               "unsupported": 0, "failed": 0}
    assert not finished & {digest for digest, _ in rerun.events("start")}, "finished graphs are not rebuilt"
    assert verify(spec_file, cache_dir, builder=rerun.builder()).exit_code == 0


def test_terminated_precompile_stops_its_workers(tmp_path, fake):
    entries = random_entries(10, 6, training=False)
    spec_file = tmp_path / "specs.json"
    save_specs(spec_file, entries)
    child = start_precompile(fake, 0.4, spec_file, tmp_path / "cache", jobs=2)
    wait_until(lambda: fake.events("start"), child)
    child.send_signal(signal.SIGTERM)  # the parent only, as `kill PID` does
    _, err = child.communicate(timeout=30)
    assert child.returncode == 130 and "interrupted" in err and "run the same command again" in err
    workers = {int(pid) for _, pid in fake.events("start")}
    deadline = time.monotonic() + 10
    while any(is_running(pid) for pid in workers):
        assert time.monotonic() < deadline, "a build worker outlived its precompile"
        time.sleep(0.05)
    assert verify_entries(str(tmp_path / "cache"), remove=False).exit_code == 0


def is_running(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def numerics_wrong_for_long_keys(entry, cache, index=0):
    """A stand-in numerical check: graphs of key length 24 compute wrong values."""
    from sdpagraph.deploy.numerics import EntryCheck

    if entry.spec.kv_len == 24:
        return EntryCheck(index, "failed", {"o": 0.4}, {"o": 0.01}, detail="o error 0.4 > 0.01")
    return EntryCheck(index, "passed", {"o": 0.002}, {"o": 0.01})


def test_precompile_checks_numerics_and_a_wrong_graph_is_unsupported(tmp_path, fake, monkeypatch):
    import dataclasses

    entries = [parse_entry(0, {"shapes": {"query": [1, 16, 2, 8], "key": [1, kv, 2, 8], "value": [1, kv, 2, 8]},
                               "dtype": "bfloat16"}) for kv in (16, 24)]
    builder = dataclasses.replace(fake.builder(), check_numerics=numerics_wrong_for_long_keys)
    report = precompile(entries, tmp_path / "cache", progress=False, builder=builder)
    assert report.counts() == {"built": 2, "cached": 0, "unsupported": 2, "failed": 0}
    wrong = [g for g in report.graphs if report.entries[g.entry].spec.kv_len == 24]
    assert len(wrong) == 2 and all(g.status == "unsupported" for g in wrong)
    assert "computed wrong values on this GPU (o error 0.4 > 0.01)" in wrong[0].detail
    monkeypatch.setenv("SDPAGRAPH_VERIFY", "off")
    again = precompile(entries, tmp_path / "other", progress=False, builder=builder)
    assert again.counts()["built"] == 4


def test_cli_verify_numerics_reads_the_spec_file_first_and_says_why_it_cannot_check(tmp_path, capsys):
    from sdpagraph.cli import main
    from sdpagraph.graphs.support import environment_reason

    specs = tmp_path / "specs.json"
    specs.write_text(json.dumps({"format": "sdpagraph-specs", "version": 1, "entries": [
        {"shapes": {"query": [1, 16, 2, 8], "key": [1, 16, 2, 8], "value": [1, 16, 2, 8]}, "dtype": "bfloat16"}]}))
    assert main(["verify", "--numerics", "--specs", str(tmp_path / "missing.json"), "--cache-dir", str(tmp_path)]) == 2
    assert "missing.json: no such file" in capsys.readouterr().err
    if environment_reason() is None:
        pytest.skip("this machine has a GPU: the check runs")
    assert main(["verify", "--numerics", "--specs", str(specs), "--cache-dir", str(tmp_path)]) == 2
    assert "cannot check graphs numerically on this machine" in capsys.readouterr().err
    assert main(["verify", "--numerics", "--specs", str(specs), "--cache-dir", str(tmp_path), "--json"]) == 2
    assert json.loads(capsys.readouterr().out)["exit_code"] == 2


def test_precompile_builds_and_verify_checks_the_bins_a_packed_call_runs_on(tmp_path, fake):
    """A packed call with a score_mod and a max_seqlen_kv hint runs on bins (graphs.binning), as a
    call of shape (bins, rows) with graphs of its own: precompile builds them as an entry of their
    own, verify looks for them, and a strict cache then serves them."""
    shape = [2, 4096, 4, 64]
    [entry] = random_entries(21, 1, training=True, shapes={"query": shape, "key": shape, "value": shape},
                             segment_ids={"shape": [2, 4096]}, max_seqlen_kv=500, is_causal=True,
                             score_mod={"mod": "softcap", "args": [30.0]})
    report = precompile([entry], tmp_path, progress=False, builder=fake.builder())
    bins = bin_plan(entry.spec, entry.score_mod)
    assert [e.spec for e in report.entries] == [entry.spec, bins.spec]
    assert report.counts()["built"] == 4 and report.exit_code == 0
    strict = GraphCache(tmp_path, mode="strict")
    for direction in entry.directions:
        fake.build(bins.spec, entry.score_mod, direction, cache=strict)  # raises CacheMissError if absent
    checked = verify([entry], tmp_path, builder=fake.builder())
    assert checked.exit_code == 0 and len(checked.checks) == 4
    missing = verify([entry], tmp_path / "empty", builder=fake.builder())
    assert missing.exit_code != 0 and len(missing.checks) == 4
