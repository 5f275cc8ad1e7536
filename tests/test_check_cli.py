"""`sdpagraph check`: verdicts per spec-file entry or per config given by flags."""
import json

import pytest

from sdpagraph.cli import main
from sdpagraph.graphs.support import Support
from sdpagraph.jax_api import cudnn as cudnn_backend


@pytest.fixture
def verdicts(monkeypatch):
    """cuDNN 'supports' head dims that are multiples of 8, as if on a GPU; the real query's inputs are kept."""
    asked = []

    def support(spec, ir, training):
        asked.append((spec, ir, training))
        if spec.head_dim % 8:
            return Support(False, "xla", f"head dim {spec.head_dim} is not a multiple of 8")
        return Support(True, "cudnn", "cuDNN builds the forward and backward graphs")

    monkeypatch.setattr(cudnn_backend, "support", support)
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
    assert main(["check", "--query", "2,512,8,128", "--segments", "0"]) == 2
    assert "max_segments_per_seq" in capsys.readouterr().out


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


def test_bad_input_exits_2_with_the_reason(tmp_path, capsys):
    assert main(["check"]) == 2
    assert "--query" in capsys.readouterr().out
    assert main(["check", "--query", "2,512,8,128", "--dtype", "float64"]) == 2
    assert "dtype" in capsys.readouterr().out
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    assert main(["check", str(bad)]) == 2
