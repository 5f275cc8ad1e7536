"""`sdpagraph demo` on CPU: it says what runs where and why, checks sdpagraph against
jax.nn.dot_product_attention and a float64 NumPy reference (checks that can fail), labels
its timings with what ran, shows the cache, and runs the length it is asked for."""
import importlib
import os
import re
import subprocess
import sys
from pathlib import Path

import jax
import pytest

from sdpagraph import cli

demo = importlib.import_module("sdpagraph.cli.demo")
REPO = Path(__file__).resolve().parents[1]
ON_GPU = any(device.platform == "gpu" for device in jax.devices())
cpu_only = pytest.mark.skipif(ON_GPU, reason="the CPU demo's output (on a GPU, cuDNN runs the calls)")
SMALL = ["--batch", "1", "--heads", "2", "--head-dim", "16", "--repeats", "1"]


@pytest.fixture
def cache_env(tmp_path, monkeypatch):
    directory = tmp_path / "graphs"
    monkeypatch.setenv("SDPAGRAPH_CACHE_DIR", str(directory))
    monkeypatch.delenv("SDPAGRAPH_CACHE_MODE", raising=False)
    return directory


def run_demo(capsys, *argv):
    code = cli.main(["demo", *argv])
    out, err = capsys.readouterr()
    return code, out.splitlines(), err


def line_starting(lines, prefix):
    [line] = [line for line in lines if line.strip().startswith(prefix)]
    return line.strip()


def errors_of(line):
    return [float(x) for x in re.findall(r"\d\.\d\de[-+]\d\d", line.split(":")[-1])]


@cpu_only
def test_cpu_demo_says_what_runs_where_checks_for_real_and_labels_timings(cache_env, capsys):
    code, lines, _ = run_demo(capsys, "--seq", "40", *SMALL)
    assert code == 0 and lines[-1] == "demo OK"
    assert line_starting(lines, "config:").startswith("config: B1 T40 N2 H16 float32;")
    where = [line.split() for line in lines[lines.index("where it runs (sdpagraph.check_support):") + 1:][:2]]
    assert [words[0] for words in where] == ["causal", "softcap(30)"]
    for words in where:
        assert "sdpagraph's XLA backend: no GPU visible to JAX" in " ".join(words), words

    drop_in = line_starting(lines, "drop-in, causal:")
    assert drop_in.startswith("drop-in, causal: sdpagraph (XLA backend) vs jax.nn.dot_product_attention "
                              "(implementation='xla'): ")
    plain = line_starting(lines, "causal: sdpagraph (XLA backend) vs")
    assert plain.startswith("causal: sdpagraph (XLA backend) vs float64 NumPy reference: ")
    flex = line_starting(lines, "softcap(30) + causal: sdpagraph (XLA backend) vs")
    assert flex.startswith("softcap(30) + causal: sdpagraph (XLA backend) vs float64 NumPy reference: ")
    for line in (drop_in, plain, flex):
        errors = errors_of(line)
        assert len(errors) == 4 and max(errors) < 1e-4, line  # out, dq, dk, dv

    [timing] = [line.strip() for line in lines if line.strip().startswith("causal: sdpagraph") and line.endswith(" ms")]
    assert re.fullmatch(r"causal: sdpagraph \(XLA backend\) [\d.]+ ms \| "
                        r"jax\.nn\.dot_product_attention \(implementation='xla'\) [\d.]+ ms", timing), timing
    [flex_timing] = [line.strip() for line in lines if line.strip().startswith("softcap(30) + causal: sdpagraph")
                     and line.endswith(" ms")]
    assert re.fullmatch(r"softcap\(30\) \+ causal: sdpagraph \(XLA backend\) [\d.]+ ms", flex_timing), flex_timing
    assert not any(re.search(r"\bxla [\d.]+ ms, xla", line) for line in lines), "two timings both called xla"

    assert line_starting(lines, "graph cache:") == (
        f"graph cache: {cache_env} (from SDPAGRAPH_CACHE_DIR), mode readwrite (the default; "
        "SDPAGRAPH_CACHE_MODE changes it)")
    assert "not used on this machine" in line_starting(lines, "not used")
    assert not cache_env.exists(), "the CPU demo builds nothing, so it creates no cache directory"


@cpu_only
def test_the_sequence_length_flag_is_honoured_above_the_cpu_default(cache_env, capsys):
    code, lines, _ = run_demo(capsys, "--seq", "300", "--batch", "1", "--heads", "1", "--head-dim", "8",
                              "--repeats", "1")
    assert code == 0 and lines[-1] == "demo OK"
    assert line_starting(lines, "config:").startswith("config: B1 T300 N1 H8 float32;")
    code, lines, _ = run_demo(capsys, *SMALL[:-2], "--repeats", "1", "--seq", "8")
    assert line_starting(lines, "config:").startswith("config: B1 T8 N2 H16")


@cpu_only
def test_a_wrong_result_fails_the_demo(cache_env, capsys, monkeypatch):
    # The NumPy reference is a real check: a reference for another softcap value disagrees.
    real = demo._numpy_causal_attention
    monkeypatch.setattr(demo, "_numpy_causal_attention", lambda q, k, v, cap: real(q, k, v, cap and cap / 3))
    code, lines, _ = run_demo(capsys, "--seq", "32", *SMALL)
    assert code == 1
    assert lines[-1].startswith("demo FAILED: error ")
    assert lines[-1].endswith("in: softcap(30) + causal: sdpagraph (XLA backend) vs float64 NumPy reference")
    # ... and so is the plain causal one: a reference for other keys disagrees.
    monkeypatch.setattr(demo, "_numpy_causal_attention",
                        lambda q, k, v, cap: real(q, k * 1.1 if cap is None else k, v, cap))
    code, lines, _ = run_demo(capsys, "--seq", "32", *SMALL)
    assert code == 1 and lines[-1].endswith("in: causal: sdpagraph (XLA backend) vs float64 NumPy reference")


def test_default_length_depends_on_the_device_and_a_large_cpu_run_is_announced(cache_env, capsys, monkeypatch):
    monkeypatch.setattr(demo, "CPU_WARN_SCORE_BYTES", 0)
    code, lines, _ = run_demo(capsys, "--seq", "16", *SMALL)
    assert code == 0
    if not ON_GPU:
        assert line_starting(lines, "note: T16 on CPU is slow").startswith(
            "note: T16 on CPU is slow: the XLA backend materializes the B*N*T*T scores")


def test_help_describes_the_demo(capsys):
    assert cli.main(["demo", "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "jax.nn.dot_product_attention" in text and "float64 NumPy reference" in text
    assert "--seq T" in text and "any length given is run" in text


@pytest.mark.parametrize("argv, message", [
    (["--seq", "0"], "argument --seq: expected a positive integer, got '0'"),
    (["--seq", "many"], "argument --seq: expected a positive integer, got 'many'"),
    (["--heads", "-2"], "argument --heads: expected a positive integer, got '-2'"),
    (["--sequence", "8"], "unrecognized arguments: --sequence 8"),
])
def test_bad_flags_exit_2_with_one_line(capsys, argv, message):
    code, lines, err = run_demo(capsys, *argv)
    assert code == 2 and lines == [] and err.count("\n") == 1
    assert err.startswith(f"sdpagraph demo: {message}")


def test_a_bad_cache_mode_exits_2_with_one_line(capsys, monkeypatch):
    monkeypatch.setenv("SDPAGRAPH_CACHE_MODE", "sometimes")
    code, lines, err = run_demo(capsys, "--seq", "8")
    assert code == 2 and lines == []
    assert err == "sdpagraph demo: SDPAGRAPH_CACHE_MODE must be one of readwrite, readonly, off, strict; " \
                  "got 'sometimes'\n"


@cpu_only
def test_the_quickstart_command_ends_with_demo_ok(tmp_path):
    # README's `python3 -m sdpagraph demo`, as CI runs it: default flags, a fresh process.
    environment = {**os.environ, "PYTHONPATH": str(REPO), "JAX_PLATFORMS": "cpu",
                   "SDPAGRAPH_CACHE_DIR": str(tmp_path / "graphs")}
    environment.pop("SDPAGRAPH_CACHE_MODE", None)
    done = subprocess.run([sys.executable, "-m", "sdpagraph", "demo"], cwd=tmp_path, env=environment,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert lines[-1] == "demo OK" and "Traceback" not in done.stderr
    assert line_starting(lines, "config:").startswith("config: B2 T256 N8 H64 float32 (the default on CPU")
