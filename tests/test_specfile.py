"""Spec files: hand-written entries resolve to what the runtime traces, recorded entries
round-trip, invalid entries name their field, merging de-duplicates, recording is
deterministic and safe across processes."""
import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sdpagraph import mods
from sdpagraph.deploy import specfile
from sdpagraph.call import prepare_call
from sdpagraph.spec import DTYPES
from sdpagraph.config import RECORD
from sdpagraph.deploy.recording import record, record_call
from sdpagraph.deploy.spec_entry import SpecEntry, SpecFileError

REPO = Path(__file__).resolve().parents[1]

# Importable by "tests.test_specfile:NAME", as a hand-written entry names a user's mod.
SOFTCAP_20 = mods.softcap(20.0)


def shifted(graph, score, tensors):
    return graph.add(a=score, b=tensors["shift"])


def scaled_softcap(cap, factor=1.0):
    return mods.softcap(cap * factor)


def random_call(rng):
    """A random valid call: (hand-written entry fields, the same call's prepare_call arguments)."""
    batch, q_len, heads_kv = int(rng.integers(1, 4)), int(rng.integers(1, 40)), int(rng.integers(1, 3))
    kv_len = int(rng.integers(1, 40))
    heads, head_dim = heads_kv * int(rng.choice([1, 2, 4])), 8 * int(rng.integers(1, 9))
    head_dim_v = int(rng.choice([head_dim, 8 * int(rng.integers(1, 9))]))
    dtype = str(rng.choice(DTYPES))
    layout = str(rng.choice(["dense", "lengths", "self segments", "cross segments"]))
    if layout == "self segments":
        kv_len = q_len
    shapes = {"query": [batch, q_len, heads, head_dim], "key": [batch, kv_len, heads_kv, head_dim],
              "value": [batch, kv_len, heads_kv, head_dim_v]}
    fields = {"shapes": shapes, "dtype": dtype, "training": bool(rng.integers(2)),
              "is_causal": bool(rng.integers(2)), "causal_alignment": str(rng.choice(["top_left", "bottom_right"]))}
    arrays = {name: np.zeros(shape, jnp.dtype(dtype)) for name, shape in shapes.items()}
    if rng.integers(2):
        fields["local_window_size"] = [int(rng.integers(-1, 9)), int(rng.integers(-1, 9))]
    if rng.integers(2):
        fields["chunk_size"] = int(rng.integers(1, 16))
    if rng.integers(2):
        fields["scale"] = float(rng.uniform(0.05, 1.0))
    if layout == "dense" and rng.integers(2):
        shapes["bias"] = [int(rng.choice([1, batch])), int(rng.choice([1, heads])), q_len, kv_len]
        arrays["bias"] = np.zeros(shapes["bias"], jnp.dtype(dtype))
    if layout == "dense" and rng.integers(2):
        shapes["mask"] = [1, 1, q_len, kv_len]
        arrays["mask"] = np.ones(shapes["mask"], bool)
    if layout == "lengths":
        fields["query_seq_lengths"] = fields["key_value_seq_lengths"] = True
        arrays["query_seq_lengths"] = np.full(batch, q_len, np.int32)
        arrays["key_value_seq_lengths"] = np.full(batch, kv_len, np.int32)
    if layout.endswith("segments"):
        fields["max_segments_per_seq"] = int(rng.integers(1, 5))
        q_ids, kv_ids = np.ones((batch, q_len), np.int32), np.ones((batch, kv_len), np.int32)
        if layout == "self segments":
            fields["segment_ids"], arrays["segment_ids"] = {"shape": [batch, q_len]}, q_ids
        else:
            fields["segment_ids"] = {"q_shape": [batch, q_len], "kv_shape": [batch, kv_len]}
            arrays["segment_ids"] = (q_ids, kv_ids)
    mod_fields, mod = random_mod(rng, heads)
    if mod is not None:
        fields["score_mod"] = mod_fields
    arguments = {**arrays, **{name: value for name, value in fields.items()
                              if name not in ("shapes", "dtype", "training", "segment_ids", "score_mod")
                              and not name.endswith("seq_lengths")}}
    return fields, {**arguments, "score_mod": mod}


def random_mod(rng, heads):
    slopes = [float(s) for s in rng.uniform(0.1, 1.0, heads)]
    cap = float(rng.uniform(5, 50))
    choices = [
        (None, None),
        ({"mod": "softcap", "args": [cap]}, mods.softcap(cap)),
        ([{"mod": "softcap", "args": [cap]}, {"mod": "alibi", "args": [slopes]}],
         mods.compose(mods.softcap(cap), mods.alibi(slopes))),
        ({"import": "tests.test_specfile:scaled_softcap", "args": [cap], "kwargs": {"factor": 2.0}},
         scaled_softcap(cap, factor=2.0)),
        ("tests.test_specfile:SOFTCAP_20", SOFTCAP_20),
    ]
    return choices[int(rng.integers(len(choices)))]


def entry_of(fields):
    return specfile.parse_entry(0, fields)


@pytest.mark.parametrize("seed", range(12))
def test_hand_written_entry_is_what_the_runtime_traces(seed):
    rng = np.random.default_rng(seed)
    fields, arguments = random_call(rng)
    entry = entry_of(fields)
    runtime = prepare_call(**arguments)
    assert entry.spec == runtime.spec
    assert entry.spec.canonical() == runtime.spec.canonical()
    assert (entry.score_mod is None) == (runtime.score_mod is None)
    if runtime.score_mod is not None:
        assert entry.score_mod.digest == runtime.score_mod.digest
    assert entry.directions == (("forward", "backward") if fields["training"] else ("inference",))


@pytest.mark.parametrize("seed", range(12))
def test_recorded_entries_round_trip_through_the_file(seed, tmp_path):
    rng = np.random.default_rng(100 + seed)
    entries = [entry_of(random_call(rng)[0]) for _ in range(4)]
    path = tmp_path / "specs.json"
    specfile.save_specs(path, entries)
    loaded = specfile.load_specs(path)
    assert {e.identity for e in loaded} == {e.identity for e in entries}
    assert path.read_text() == specfile.dumps(reversed(loaded)), "the file's text depends on its entries only"
    document = json.loads(path.read_text())
    assert document["format"] == "sdpagraph-specs" and document["version"] == 1
    assert [e["summary"] for e in document["entries"]] == [e.describe() for e in loaded]


def test_mod_tensors_are_recorded_by_shape_without_allocating():
    heads = 8
    # (B, N, T, S) float32 of this size is 128 GiB: resolving must never materialize it.
    big = [8, heads, 8192, 8192]
    fields = {"shapes": {"query": [8, 8192, heads, 64], "key": [8, 8192, 2, 64], "value": [8, 8192, 2, 64]},
              "dtype": "bfloat16", "score_mod": "tests.test_specfile:shifted",
              "score_mod_tensors": {"shift": {"shape": big, "dtype": "float32"}}}
    entry = entry_of(fields)
    [(_, node)] = entry.score_mod.slots("array")
    assert node.attr("shape") == tuple(big) and entry.score_mod.array_names == ("shift",)
    small = {**fields, "score_mod_tensors": {"shift": {"shape": [1, heads, 1, 1], "dtype": "float32"}}}
    q, kv = (jax.ShapeDtypeStruct(fields["shapes"][name], jnp.bfloat16) for name in ("query", "key"))
    runtime = prepare_call(q, kv, kv, score_mod=shifted,
                           score_mod_tensors={"shift": np.ones((1, heads, 1, 1), np.float32)})
    assert entry_of(small).score_mod.digest == runtime.score_mod.digest != entry.score_mod.digest


def test_scalar_mod_tensor_values_do_not_change_the_entry():
    base = {"shapes": {"query": [1, 16, 2, 16], "key": [1, 16, 2, 16], "value": [1, 16, 2, 16]},
            "dtype": "float16", "score_mod": "tests.test_specfile:shifted"}
    one = entry_of({**base, "score_mod_tensors": {"shift": 1.5}})
    other = entry_of({**base, "score_mod_tensors": {"shift": -7.0}})
    assert one.identity == other.identity and one.score_mod.scalar_names == ("shift",)


VALID = {"shapes": {"query": [2, 32, 4, 32], "key": [2, 32, 2, 32], "value": [2, 32, 2, 32]}, "dtype": "bfloat16"}


@pytest.mark.parametrize("change, field, message", [
    ({"dtype": "int8"}, "dtype", "must be one of"),
    ({"dtype": 3}, "dtype", "dtype name"),
    ({"shapes": {"query": [2, 32, 4, 32], "key": [2, 32, 3, 32], "value": [2, 32, 3, 32]}}, "shapes", "multiple"),
    ({"shapes": {"query": [2, 32, 4, 32], "key": [2, 32, 2, 32]}}, "shapes", "'value' is missing"),
    ({"shapes": {**VALID["shapes"], "bias": [3, 1, 32, 32]}}, "shapes", "not broadcastable"),
    ({"shapes": {**VALID["shapes"], "query": [2, 32.5, 4, 32]}}, "shapes", "list of sizes"),
    ({"is_causal": "yes"}, "is_causal", "bool"),
    ({"is_casual": True}, "is_casual", "unknown field"),
    ({"local_window_size": [1, 2, 3]}, "local_window_size", "(left, right)"),
    ({"causal_alignment": "middle"}, "causal_alignment", "top_left"),
    ({"chunk_size": 0}, "chunk_size", "positive"),
    ({"training": "no"}, "training", "true or false"),
    ({"query_seq_lengths": [2]}, "query_seq_lengths", "true"),
    ({"segment_ids": {"shape": [2, 32]}, "key_value_seq_lengths": True}, "segment_ids", "not both"),
    ({"max_segments_per_seq": 4}, "max_segments_per_seq", "needs segment_ids"),
    ({"segment_ids": {"shape": [2, 31]}}, "segment_ids", "must have shape"),
    ({"score_mod": {"mod": "tanh"}}, "score_mod", "unknown sdpagraph.mods factory"),
    ({"score_mod": "no_such_package.mods:cap"}, "score_mod", "ModuleNotFoundError"),
    ({"score_mod": "tests.test_specfile:missing"}, "score_mod", "AttributeError"),
    ({"score_mod": "tests.test_specfile"}, "score_mod", "package.module:name"),
    ({"score_mod": "tests.test_specfile:VALID"}, "score_mod", "not a score_mod callable"),
    ({"score_mod": {"mod": "softcap", "args": [-1.0]}}, "score_mod", "cap must be > 0"),
    ({"score_mod": "tests.test_specfile:shifted"}, "score_mod", "'shift'"),  # read a tensor not given
    ({"score_mod": []}, "score_mod", "non-empty list"),
    ({"score_mod_tensors": {"shift": 1.0}}, "score_mod_tensors", "needs a score_mod"),
    ({"score_mod": "tests.test_specfile:shifted", "score_mod_tensors": {"shift": "big"}}, "score_mod_tensors",
     "number or"),
    ({"score_mod": "tests.test_specfile:shifted", "score_mod_tensors": {"shift": {"shape": [3, 1, 1, 1],
                                                                                  "dtype": "float32"}}},
     "score_mod", "not broadcastable"),
])
def test_invalid_hand_written_entry_names_the_entry_and_field(change, field, message):
    entries = [VALID, VALID, VALID, {**VALID, **change}]
    with pytest.raises(SpecFileError) as error:
        specfile.parse_specs({"entries": entries})
    text = str(error.value)
    assert text.startswith(f"entry 3: field {field!r}: "), text
    assert message in text


def test_invalid_recorded_entry_names_the_entry_and_field():
    recorded = entry_of(VALID).to_dict()
    cases = [
        ({"spec": {**recorded["spec"], "max_segments": 3}}, "spec", "max_segments is 3, the runtime has 0"),
        ({"spec": {**recorded["spec"], "batch": 2.0}}, "spec", "list of sizes"),
        ({"spec": {**recorded["spec"], "is_causal": "yes"}}, "spec", "bool"),
        ({"spec": {**recorded["spec"], "heads": 4}}, "spec", "unknown AttentionSpec field"),
        ({"spec": [1, 2]}, "spec", "AttentionSpec object"),
        ({"directions": ["forward"]}, "directions", "must be"),
        ({"score_mod": {"nodes": [["zz", [], [], "float32"]], "output": 0}}, "score_mod", "unknown op"),
        ({"score_mod": {"output": 0}}, "score_mod", "'nodes' is missing"),
        ({"shapes": VALID["shapes"]}, None, "either 'spec'"),
    ]
    for change, field, message in cases:
        with pytest.raises(SpecFileError) as error:
            specfile.parse_specs({"entries": [recorded, {**recorded, **change}]})
        prefix = "entry 1: " if field is None else f"entry 1: field {field!r}: "
        assert str(error.value).startswith(prefix) and message in str(error.value), (change, str(error.value))


def recorded_softcap_causal():
    entry = entry_of({**VALID, "score_mod": [{"mod": "softcap", "args": [30.0]}, {"mod": "causal"}]})
    return entry.to_dict()


def edit_node(ir, index, node):
    nodes = [list(n) for n in ir["nodes"]]
    nodes[index] = node
    return {**ir, "nodes": nodes}


def test_a_recorded_score_mod_ir_is_checked_node_by_node():
    recorded = recorded_softcap_causal()
    ir = recorded["score_mod"]
    assert ir["nodes"][2] == ["div", [0, 1], [], "float32"] and ir["nodes"][3] == ["tanh", [2], [], "float32"]
    count = len(ir["nodes"])
    cases = [
        (edit_node(ir, 2, ["div", [0, 99], [], "float32"]),
         f"node 2 (div): argument 1 is node 99, which does not exist (the IR has nodes 0..{count - 1})"),
        (edit_node(ir, 2, ["div", [0, -1], [], "float32"]), "argument 1 is node -1, which does not exist"),
        (edit_node(ir, 2, ["div", [0, 3], [], "float32"]), "node 2 (div): argument 1 is node 3, which does not "
                                                           "come before it"),
        (edit_node(ir, 2, ["div", [0], [], "float32"]), "node 2 (div): takes 2 argument node(s), got 1"),
        (edit_node(ir, 2, ["div", [0, "1"], [], "float32"]), "argument 1 must be a node index"),
        (edit_node(ir, 2, ["div", [0, 1], [], "float64"]), "dtype must be one of"),
        (edit_node(ir, 2, ["div", [0, 1]]), "node 2: a node is [op"),
        (edit_node(ir, 2, ["div", [0, 1], [["axis", 2]], "float32"]), "a div node has none"),
        (edit_node(ir, 1, ["scalar", [], [["slot", 5]], "float32"]), "node 1 (scalar): slot 5 is not one of"),
        (edit_node(ir, 5, ["gen_index", [4], [["axis", 7]], "int32"]), "axis must be 0..3"),
        ({**ir, "output": count}, f"the IR's 'output' is {count}, which is not a node"),
        ({**ir, "grad_output": "x"}, "the IR's 'grad_output' is 'x', which is not a node"),
        ({**ir, "scalar_names": [1]}, "'scalar_names' must be a list of names"),
        ({**ir, "extra": 1}, "unknown IR field 'extra'"),
        ({**ir, "nodes": []}, "non-empty list"),
        ({**ir, "output": 0, "grad_output": None}, "not in the canonical form"),  # nodes nothing reaches
        ([1, 2], "must be a score_mod IR object"),
    ]
    for bad, message in cases:
        with pytest.raises(SpecFileError) as error:
            specfile.parse_specs({"entries": [recorded, {**recorded, "score_mod": bad}]})
        text = str(error.value)
        assert text.startswith("entry 1: field 'score_mod': ") and message in text, (bad, text)
        assert (error.value.entry, error.value.field) == (1, "score_mod") and "\n" not in text
    assert specfile.parse_specs({"entries": [recorded]})[0].score_mod.to_dict() == ir


def test_a_score_mod_ir_reading_the_gradient_in_its_forward_part_is_rejected():
    recorded = recorded_softcap_causal()
    ir = recorded["score_mod"]
    dscore = next(i for i, node in enumerate(ir["nodes"]) if node[0] == "dscore")
    bad = {**ir, "output": dscore, "grad_output": None}
    with pytest.raises(SpecFileError, match="reads 'dscore'"):
        specfile.parse_specs({"entries": [{**recorded, "score_mod": bad}]})


def test_invalid_files_name_the_file(tmp_path):
    path = tmp_path / "broken.json"
    for text, message in [("{", "not JSON"), ("[]", "JSON object"), ("", "empty"), ("  \n", "empty"),
                          ('{"format": "sdpagraph-specs", "version": 2, "entries": []}', "version 2")]:
        path.write_text(text)
        with pytest.raises(SpecFileError, match=message) as error:
            specfile.load_specs(path)
        assert str(error.value).startswith(str(path)) and error.value.path == str(path)


def test_files_that_are_not_spec_files_give_one_line_naming_the_path(tmp_path, monkeypatch):
    binary, latin1, directory = tmp_path / "graph.sdpg", tmp_path / "latin1.json", tmp_path / "specs"
    binary.write_bytes(b"SDPG\x00\x01\x02\xff" * 8)
    latin1.write_bytes('{"entries": [], "note": "caf\u00e9"}'.encode("latin-1"))
    directory.mkdir()
    cases = [(tmp_path / "missing.json", "no such file"), (directory, "is a directory, not a spec file"),
             (binary, "not a spec file: binary data (a spec file is JSON text)"),
             (latin1, "not a spec file: not UTF-8 text (byte 0xe9 at offset 28)")]
    for path, message in cases:
        with pytest.raises(SpecFileError) as error:
            specfile.load_entries([str(path)])
        assert str(error.value) == f"{path}: {message}"
    bom = tmp_path / "bom.json"
    bom.write_bytes(b"\xef\xbb\xbf" + json.dumps({"entries": [VALID]}).encode())
    assert len(specfile.load_specs(bom)) == 1

    unreadable = tmp_path / "unreadable.json"
    unreadable.write_text(json.dumps({"entries": [VALID]}))
    real_open = open

    def refuse(path, *args, **kwargs):  # as for a file without read permission (root reads any file)
        if os.fspath(path) == str(unreadable):
            raise PermissionError(13, "Permission denied", str(path))
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr("builtins.open", refuse)
    with pytest.raises(SpecFileError, match="permission denied") as error:
        specfile.load_specs(unreadable)
    assert str(error.value).startswith(str(unreadable))


def test_merge_de_duplicates_in_any_order(tmp_path):
    rng = np.random.default_rng(7)
    shared = [entry_of(random_call(rng)[0]) for _ in range(3)]
    only_a = [entry_of(random_call(rng)[0]) for _ in range(2)]
    only_b = [entry_of(random_call(rng)[0]) for _ in range(2)]
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    specfile.save_specs(a, shared + only_a + shared)
    specfile.save_specs(b, only_b + shared)
    assert len(specfile.load_specs(a)) == 5
    merged = specfile.load_entries([a, b])
    assert len(merged) == 7 and len({e.identity for e in merged}) == 7
    assert specfile.dumps(merged) == specfile.dumps(specfile.load_entries([b, a]))
    inference = SpecEntry(shared[0].spec, shared[0].score_mod, ("inference",) if shared[0].training
                          else ("forward", "backward"))
    assert len(specfile.merge(shared, [inference])) == 4, "another direction set is another entry"


def test_record_writes_distinct_entries_deterministically(tmp_path):
    rng = np.random.default_rng(11)
    calls = [entry_of(random_call(rng)[0]) for _ in range(5)]
    traced = calls + calls[:3]  # a program traces some configs more than once
    first, second = tmp_path / "first.json", tmp_path / "second.json"
    for path in (first, second):
        with record(path):
            for entry in traced:
                record_call(entry.spec, entry.score_mod, entry.training)
    assert first.read_text() == second.read_text()
    assert {e.identity for e in specfile.load_specs(first)} == {e.identity for e in calls}
    before = first.read_text()
    with record(first):  # the same run again appends nothing new
        for entry in reversed(traced):
            record_call(entry.spec, entry.score_mod, entry.training)
    assert first.read_text() == before


def test_nothing_is_recorded_outside_a_record_block(tmp_path, monkeypatch):
    monkeypatch.delenv(RECORD.name, raising=False)
    entry = entry_of(VALID)
    path = tmp_path / "specs.json"
    with record(path):
        pass
    record_call(entry.spec, entry.score_mod, entry.training)
    assert specfile.load_specs(path) == []


def test_record_from_the_environment_variable(tmp_path, monkeypatch):
    path = tmp_path / "env.json"
    monkeypatch.setenv(RECORD.name, str(path))
    entry = entry_of({**VALID, "training": False, "score_mod": {"mod": "softcap", "args": [12.0]}})
    record_call(entry.spec, entry.score_mod, entry.training)
    [loaded] = specfile.load_specs(path)
    assert loaded.identity == entry.identity and loaded.directions == ("inference",)


def test_record_merges_into_a_hand_written_file(tmp_path):
    path = tmp_path / "specs.json"
    path.write_text(json.dumps({"entries": [VALID]}))
    extra = entry_of({**VALID, "is_causal": True})
    with record(path):
        record_call(extra.spec, extra.score_mod, extra.training)
    assert {e.identity for e in specfile.load_specs(path)} == {entry_of(VALID).identity, extra.identity}


RECORDING_PROCESS = r"""
import json, sys
from sdpagraph.deploy import recording, specfile
path, fields = sys.argv[1], json.loads(sys.argv[2])
entries = [specfile.parse_entry(i, item) for i, item in enumerate(fields)]
with recording.record(path):
    for entry in entries:
        recording.record_call(entry.spec, entry.score_mod, entry.training)
"""


def test_processes_recording_into_one_file_merge(tmp_path):
    rng = np.random.default_rng(23)
    shared = [random_call(rng)[0] for _ in range(2)]
    per_process = [[random_call(rng)[0] for _ in range(4)] + shared for _ in range(3)]
    path = tmp_path / "specs.json"
    environment = {**os.environ, "PYTHONPATH": str(REPO), "JAX_PLATFORMS": "cpu"}
    children = [subprocess.Popen([sys.executable, "-c", RECORDING_PROCESS, str(path), json.dumps(fields)],
                                 env=environment, cwd=REPO, stderr=subprocess.PIPE, text=True)
                for fields in per_process]
    for child in children:
        assert child.wait(timeout=60) == 0, child.stderr.read()
    expected = {entry_of(fields).identity for group in per_process for fields in group}
    assert {e.identity for e in specfile.load_specs(path)} == expected
    assert path.read_text() == specfile.dumps(entry_of(f) for group in per_process for f in group)


def test_the_file_reads_one_field_or_ir_node_per_line():
    entry = entry_of({**VALID, "score_mod": [{"mod": "softcap", "args": [30.0]}, {"mod": "causal"}]})
    lines = specfile.dumps([entry]).splitlines()
    assert '          ["tanh", [2], [], "float32"],' in lines
    assert '      "directions": ["forward", "backward"],' in lines
    assert '        "batch": 2,' in lines
    assert max(map(len, lines)) <= 100
