"""`sdpagraph check`: verdicts per spec-file entry or per config given by flags."""
import json

import pytest

from sdpagraph.cli import main
from sdpagraph.graphs.support import Support
from sdpagraph.backends.cudnn import execute as cudnn_execute


@pytest.fixture
def verdicts(monkeypatch):
    """cuDNN 'supports' head dims that are multiples of 8, as if on a GPU; the real query's inputs are kept."""
    asked = []

    def support(spec, ir, training, verify=None):
        asked.append((spec, ir, training))
        if spec.head_dim % 8:
            return Support(False, "xla", f"head dim {spec.head_dim} is not a multiple of 8")
        return Support(True, "cudnn", "cuDNN builds the forward and backward graphs")

    monkeypatch.setattr(cudnn_execute, "support", support)
    return asked


def test_flags_describe_one_config(verdicts, capsys):
    assert main(["check", "--query", "2,512,8,128", "--causal", "--softcap", "30", "--window", "64,0"]) == 0
    out = capsys.readouterr().out
    assert "yes" in out and "cudnn" in out and "window(64, 0)" in out
    spec, ir, training = verdicts[0]
    assert spec.is_causal and spec.window == (64, 0) and ir is not None and training


def test_segments_flag_asks_about_packed_self_attention(verdicts, capsys):
    assert main(["check", "--query", "2,512,8,128", "--causal", "--softcap", "30", "--segments", "6"]) == 0
    spec, ir, _ = verdicts[0]
    assert spec.segments == "self" and spec.max_segments == 6 and ir is not None
    capsys.readouterr()
    assert main(["check", "--query", "2,512,8,128", "--segments", "0"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err == "sdpagraph check: --segments: max_segments_per_seq must be a positive int, got 0\n"


def test_spec_file_entries_get_a_verdict_and_a_reason_each(verdicts, tmp_path, capsys):
    path = tmp_path / "specs.json"
    path.write_text(json.dumps({"entries": [
        {"shapes": {"query": [1, 256, 4, 64], "key": [1, 256, 4, 64], "value": [1, 256, 4, 64]},
         "dtype": "bfloat16", "is_causal": True},
        {"shapes": {"query": [1, 256, 4, 68], "key": [1, 256, 4, 68], "value": [1, 256, 4, 68]},
         "dtype": "float16", "training": False},
    ]}))
    assert main(["check", str(path), "--json"]) == 0
    answers = json.loads(capsys.readouterr().out)
    assert [a["supported"] for a in answers] == [True, False]
    assert answers[1]["reason"] == "head dim 68 is not a multiple of 8" and answers[1]["directions"] == ["inference"]


def one_error_line(capsys, argv):
    """Run `sdpagraph *argv`, expect exit 2 and one line on stderr (nothing on stdout); return the line."""
    assert main(argv) == 2, argv
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and err.startswith("sdpagraph check: "), (argv, out, err)
    assert "Traceback" not in err
    return err.strip()


def test_bad_input_exits_2_with_the_reason(tmp_path, capsys):
    assert "--query" in one_error_line(capsys, ["check"])
    line = one_error_line(capsys, ["check", "--query", "2,512,8,128", "--dtype", "int8"])
    assert line == "sdpagraph check: --dtype: must be one of float32, bfloat16, float16, float64, got 'int8'"
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    assert one_error_line(capsys, ["check", str(bad)]).startswith(f"sdpagraph check: {bad}: not JSON: ")


def test_files_that_are_not_spec_files_exit_2_with_one_line_naming_them(tmp_path, capsys):
    binary, latin1 = tmp_path / "graph.bin", tmp_path / "latin1.json"
    binary.write_bytes(bytes(range(256)))
    latin1.write_bytes(b'{"entries": [], "x": "\xe9"}')
    cases = [(tmp_path / "missing.json", "no such file"), (tmp_path, "is a directory, not a spec file"),
             (binary, "not a spec file: binary data"), (latin1, "not a spec file: not UTF-8 text")]
    for path, problem in cases:
        assert one_error_line(capsys, ["check", str(path)]).startswith(f"sdpagraph check: {path}: {problem}")


def test_a_recorded_score_mod_naming_a_missing_node_is_rejected(tmp_path, capsys):
    from sdpagraph.deploy.entry_parser import parse_entry

    recorded = parse_entry(0, {"shapes": {"query": [1, 64, 2, 32], "key": [1, 64, 2, 32], "value": [1, 64, 2, 32]},
                               "dtype": "bfloat16", "score_mod": {"mod": "softcap", "args": [30.0]}}).to_dict()
    nodes = recorded["score_mod"]["nodes"]
    assert nodes[2] == ["div", [0, 1], [], "float32"]
    nodes[2] = ["div", [0, 42], [], "float32"]
    path = tmp_path / "specs.json"
    path.write_text(json.dumps({"entries": [recorded]}))
    line = one_error_line(capsys, ["check", str(path)])
    assert line == (f"sdpagraph check: {path}: entry 0: field 'score_mod': node 2 (div): argument 1 is node 42, "
                    f"which does not exist (the IR has nodes 0..{len(nodes) - 1})")


@pytest.mark.parametrize("argv, message", [
    (["--query", "2,1024,8"], "argument --query: expected 4 comma-separated positive integers B,T,N,H, "
                              "got '2,1024,8'"),
    (["--query", "2,1024,8,64,1"], "argument --query: expected 4"),
    (["--query", "2,0,8,64"], "argument --query: expected 4 comma-separated positive integers"),
    (["--query", "2,x,8,64"], "argument --query: expected 4"),
    (["--query", "2,64,8,64", "--key", "2,64,8"], "argument --key: expected 4 comma-separated positive integers "
                                                  "B,S,K,H"),
    (["--query", "2,64,8,64", "--value", "2,64,8"], "argument --value: expected 4"),
    (["--key", "2,64,8,64"], "--key and --value need --query"),
    (["--query", "2,64,8,64", "--window", "1,2,3"], "argument --window: expected LEFT,RIGHT"),
    (["--query", "2,64,8,64", "--window", "-2,0"], "--window: local_window_size left side must be >= 0"),
    (["--query", "2,64,8,64", "--window"], "argument --window: expected one argument"),
    (["--query", "2,64,8,64", "--chunk", "0"], "--chunk: chunk_size must be a positive int"),
    (["--query", "2,64,8,64", "--no-such-flag"], "unrecognized arguments: --no-such-flag"),
])
def test_bad_flags_exit_2_with_one_line_naming_the_flag(verdicts, capsys, argv, message):
    assert message in one_error_line(capsys, ["check", *argv])
    assert not verdicts


@pytest.mark.parametrize("window", [["--window", "-1,0"], ["--window=-1,0"], ["--window", "-1,-1"],
                                    ["--window", "-1"]])
def test_window_flag_takes_negative_sides_with_or_without_equals(verdicts, capsys, window):
    assert main(["check", "--query", "2,512,8,128", "--causal", *window]) == 0
    spec, _, _ = verdicts[0]
    expected = {"-1,0": (-1, 0), "-1,-1": (-1, -1), "-1": (-1, -1)}[window[-1].split("=")[-1]]
    assert spec.window == expected


def test_json_errors_are_json_on_stdout(tmp_path, capsys):
    for argv in (["check", str(tmp_path / "missing.json"), "--json"], ["check", "--json", "--query", "2,1,8"]):
        assert main(argv) == 2
        out, err = capsys.readouterr()
        data = json.loads(out)
        assert data["exit_code"] == 2 and data["error"] in err and err.count("\n") == 1
    assert "missing.json: no such file" in json.loads(
        (main(["check", str(tmp_path / "missing.json"), "--json"]), capsys.readouterr().out)[1])["error"]
