"""Command-line errors are one line `sdpagraph <command>: ...` on stderr, and with --json also
{"error", "exit_code"} on stdout; spec files and flags follow one rule for sizes and name the
field (and the type expected) of a wrong value."""
import json

import pytest

from sdpagraph.cli import main
from sdpagraph.deploy import specfile
from sdpagraph.deploy.spec_entry import SpecFileError
from sdpagraph.graphs import support

SHAPE = [2, 16, 4, 64]


def write_specs(path, *entries):
    path.write_text(json.dumps({"format": "sdpagraph-specs", "version": 1, "entries": list(entries)}))
    return path


def hand_written(**fields):
    shapes = fields.pop("shapes", {"query": SHAPE, "key": SHAPE, "value": SHAPE})
    return {"shapes": shapes, "dtype": "bfloat16", **fields}


def failure(capsys, argv):
    """Run a command that must fail with exit 2: (its stderr line, its --json object)."""
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and "Traceback" not in err, (out, err)
    assert main([*argv, "--json"]) == 2
    out, json_err = capsys.readouterr()
    data = json.loads(out)
    assert json_err == err and data["exit_code"] == 2 and err.startswith("sdpagraph ")
    assert err.strip().endswith(f": {data['error']}")
    return err.strip(), data


def test_verify_numerics_without_a_gpu_is_an_error_like_every_other(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(support, "environment_reason", lambda: "no GPU visible to JAX")
    specs = write_specs(tmp_path / "specs.json", hand_written())
    line, data = failure(capsys, ["verify", "--numerics", "--specs", str(specs), "--cache-dir", str(tmp_path)])
    assert line.startswith(f"sdpagraph verify: {specs} is valid (1 entry, 2 graphs); cannot check graphs "
                           "numerically on this machine: no GPU visible to JAX")
    assert line == f"sdpagraph verify: {data['error']}"
    assert (data["entries"], data["graphs"]) == (1, 2)


@pytest.mark.parametrize("fields, field, message", [
    ({"score_mod": {"mod": "softcap", "args": ["30"]}}, "score_mod",
     "softcap cap must be a real number (int or float), got str"),
    ({"score_mod": {"mod": "alibi", "args": [["a", "b", "c", "d"]]}}, "score_mod",
     "alibi slopes must be real numbers (int or float), got an array of str"),
    ({"score_mod": {"mod": "prefix_lm", "args": ["3"]}}, "score_mod",
     "prefix_lm prefix_len must be an int or a (B,) array of ints, got '3'"),
    ({"chunk_size": "512"}, "chunk_size", "must be a Python int, got str"),
    ({"scale": "0.1"}, "scale", "must be a Python float, got str"),
])
def test_a_field_of_the_wrong_type_names_the_field_and_the_type_expected(tmp_path, capsys, fields, field, message):
    specs = write_specs(tmp_path / "specs.json", hand_written(**fields))
    line, _ = failure(capsys, ["check", str(specs)])
    assert line.startswith(f"sdpagraph check: {specs}: entry 0: field '{field}': ") and message in line
    assert "not supported between instances" not in line


@pytest.mark.parametrize("shapes", [
    {"query": [2, 0, 4, 64], "key": SHAPE, "value": SHAPE},
    {"query": SHAPE, "key": [2, 0, 4, 64], "value": [2, 0, 4, 64]},
    {"query": [0, 16, 4, 64], "key": [0, 16, 4, 64], "value": [0, 16, 4, 64]},
])
def test_sizes_are_at_least_1_in_spec_files_as_in_flags(tmp_path, capsys, shapes):
    specs = write_specs(tmp_path / "specs.json", hand_written(shapes=shapes))
    line, _ = failure(capsys, ["check", str(specs)])
    assert line.startswith(f"sdpagraph check: {specs}: entry 0: field 'shapes': sizes must be >= 1, got ")
    assert "builds no graph" in line
    flags = ["--query", ",".join(map(str, shapes["query"])), "--key", ",".join(map(str, shapes["key"]))]
    line, _ = failure(capsys, ["check", *flags])
    assert "comma-separated positive integers" in line


def test_a_recorded_entry_with_an_empty_axis_is_refused_too(tmp_path):
    [entry] = specfile.parse_specs({"entries": [hand_written()]})
    recorded = entry.to_dict()
    recorded["spec"]["q_len"] = 0
    with pytest.raises(SpecFileError, match="entry 0: field 'spec': axis T has size 0: a call with an axis of size "
                                            "0 computes nothing and builds no graph"):
        specfile.parse_specs({"entries": [recorded]})
