"""The backend rule: fastest by measurement (dispatch.rule)."""
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sdpagraph.graphs.support import Support
from sdpagraph.config import DISPATCH_TABLE
from sdpagraph.dispatch import rule as dispatch
from sdpagraph.dispatch import table as dispatch_table
from sdpagraph.call import prepare_call
from sdpagraph.dispatch.rule import MODEL_MAX_KV_LEN, MODEL_MAX_Q_LEN, choose
from sdpagraph.dispatch.table import Point, Shape, Table, builtin_tables

H100_TABLE = builtin_tables()["NVIDIA H100 80GB HBM3"]


def spec_of(B, T, S, N=16, K=16, H=128, dtype=jnp.bfloat16, **kwargs):
    structs = [jax.ShapeDtypeStruct(s, dtype) for s in ((B, T, N, H), (B, S, K, H), (B, S, K, H))]
    return prepare_call(*structs, **kwargs).spec


ALL = {"cudnn": True, "xla": True, "small_seq": True}
SMALL = spec_of(30720, 1, 16)  # on an H100 cuDNN 5.05 / 21.6 ms, XLA 1.62 / 7.46 ms (docs/results/h100-2026-11-24.md)


@pytest.mark.parametrize("spec", [SMALL, spec_of(30720, 1, 4), spec_of(30720, 4, 16), spec_of(30720, 2, 8),
                                  spec_of(30720, 1, 16, K=4), spec_of(8192, 1, 32)],
                         ids=lambda s: s.summary())
def test_small_sequence_regime_picks_small_seq_for_training(spec):
    choice = choose(spec, ALL, H100_TABLE, training=True)
    assert choice.backend == "small_seq", choice.reason


@pytest.mark.parametrize("spec", [SMALL, spec_of(30720, 1, 4)], ids=lambda s: s.summary())
def test_small_sequence_regime_never_picks_cudnn(spec):
    for training in (False, True):
        assert choose(spec, ALL, H100_TABLE, training=training).backend != "cudnn"
        assert choose(spec, {"cudnn": True, "xla": True}, H100_TABLE, training=training).backend == "xla"


@pytest.mark.parametrize("spec", [spec_of(4, 4096, 4096, is_causal=True), spec_of(4, 4096, 4096),
                                  spec_of(16, 1024, 1024, is_causal=True), spec_of(64, 128, 128),
                                  spec_of(1, 8192, 8192, N=32, K=8, is_causal=True)],
                         ids=lambda s: s.summary())
def test_normal_shapes_pick_cudnn(spec):
    for training in (False, True):
        candidates = {"cudnn": True, "xla": True, "small_seq": False}
        choice = choose(spec, candidates, H100_TABLE, training=training)
        assert choice.backend == "cudnn", choice.reason


def test_decode_serves_on_cudnn_and_trains_on_xla_as_measured():
    """B64 T1 S8192 N32/K8 on the H100: cuDNN's forward 0.75 ms against XLA's 2.42, but forward+backward
    9.06 ms against 5.20 (bench/dispatch.py, 2026-11-24)."""
    decode = spec_of(64, 1, 8192, N=32, K=8)
    candidates = {"cudnn": True, "xla": True, "small_seq": False}
    assert choose(decode, candidates, H100_TABLE, training=False).backend == "cudnn"
    assert choose(decode, candidates, H100_TABLE, training=True).backend == "xla"


def test_unsupported_cudnn_leaves_the_best_of_the_rest():
    no_cudnn = {"cudnn": Support(False, "xla", "cuDNN 9.19 has no engine"), "xla": True, "small_seq": True}
    assert choose(SMALL, no_cudnn, H100_TABLE).backend == "small_seq"
    dense = spec_of(4, 4096, 4096, is_causal=True)
    choice = choose(dense, {**no_cudnn, "small_seq": False}, H100_TABLE)
    assert choice.backend == "xla" and "cudnn, small_seq cannot run it" in choice.reason
    with pytest.raises(ValueError, match="no backend can run"):
        choose(dense, {"cudnn": False, "xla": False}, H100_TABLE)


def test_support_objects_and_bools_both_work():
    choice = choose(SMALL, {"cudnn": Support(True, "cudnn", "builds"), "xla": True,
                            "small_seq": Support(True, "small_seq", "in regime")}, H100_TABLE)
    assert choice.backend == "small_seq"


def test_forced_implementations():
    assert choose(SMALL, ALL, H100_TABLE, implementation="cudnn").backend == "cudnn"  # slower, but asked for
    forced = choose(SMALL, ALL, H100_TABLE, implementation="xla")
    assert forced.backend == "xla" and "implementation='xla' was requested" in forced.reason
    assert "small_seq 4.39 ms" in forced.reason  # the numbers are still reported
    assert choose(SMALL, ALL, H100_TABLE, implementation="small_seq").backend == "small_seq"
    out_of_regime = {"cudnn": True, "xla": True, "small_seq": Support(False, "xla", "S=64 is above the limit of 32")}
    with pytest.raises(ValueError, match="implementation='small_seq' cannot run .*S=64 is above"):
        choose(spec_of(8, 1, 64), out_of_regime, H100_TABLE, implementation="small_seq")


def test_reason_carries_the_numbers_and_their_source():
    choice = choose(SMALL, ALL, H100_TABLE, training=True)
    assert choice.numbers == pytest.approx({"cudnn": 21.4103, "xla": 7.4536, "small_seq": 4.393})
    for text in ("small_seq is the fastest", "forward+backward", "cudnn 21.4 ms (measured)", "xla 7.45 ms (measured)",
                 "small_seq 4.39 ms (measured)", H100_TABLE.gpu, "B30720 T1 S16 N16 H128 bfloat16"):
        assert text in choice.reason, choice.reason
    inference = choose(SMALL, ALL, H100_TABLE, training=False)
    assert inference.pass_ == "fwd" and "cudnn 5.03 ms (measured)" in inference.reason
    # an unmeasured shape is predicted by the model, and says so
    other = choose(spec_of(20000, 3, 12), ALL, H100_TABLE)
    assert "(model)" in other.reason and all(v is not None and v > 0 for v in other.numbers.values())


def test_measured_times_scale_with_batch_within_range():
    half = choose(spec_of(15360, 1, 16), ALL, H100_TABLE)
    assert half.numbers["cudnn"] == pytest.approx(21.4103 / 2) and "(measured)" in half.reason
    far = choose(spec_of(1024, 1, 16), ALL, H100_TABLE)  # beyond MEASURED_BATCH_RANGE: the model
    assert "(measured)" not in far.reason


def test_never_picks_a_backend_the_table_measured_slower():
    for point in H100_TABLE.points:
        spec = spec_of(point.shape.batch, point.shape.q_len, point.shape.kv_len, point.shape.num_heads,
                       point.shape.num_kv_heads, point.shape.head_dim, is_causal=point.shape.causal)
        candidates = {name: True for name in point.times}
        choice = choose(spec, candidates, H100_TABLE, training=point.pass_ == "fwd_bwd")
        assert choice.backend == min(point.times, key=point.times.get), (point, choice.reason)


def test_the_model_alone_agrees_with_clear_measurements():
    """Without the measured points, the fitted cost models pick the measured best wherever it wins by 15%."""
    model_only = Table(H100_TABLE.gpu, H100_TABLE.points, use_measured=False)
    for point in H100_TABLE.points:
        if point.shape.q_len > MODEL_MAX_Q_LEN or point.shape.kv_len > MODEL_MAX_KV_LEN:  # models rank only there
            continue
        times = sorted(point.times.values())
        if len(times) < 2 or times[1] < 1.15 * times[0]:
            continue
        predicted = {name: model_only.predict(point.shape, name, point.pass_)[0] for name in point.times}
        assert min(predicted, key=predicted.get) == min(point.times, key=point.times.get), (point, predicted)


def test_a_table_decides_not_a_preference():
    """The same spec goes to whichever backend the table says is faster."""
    shape = Shape.of(SMALL)
    flipped = Table("Test GPU", (Point(shape, "fwd_bwd", {"cudnn": 1.0, "xla": 5.0, "small_seq": 3.0}),))
    assert choose(SMALL, ALL, flipped).backend == "cudnn"


def test_no_table_uses_the_fallback_order():
    choice = choose(SMALL, ALL, None, use_default_table=False)
    assert choice.backend == "cudnn" and "preference order" in choice.reason
    assert choose(SMALL, {"cudnn": False, "xla": True, "small_seq": True}, None,
                  use_default_table=False).backend == "xla"


def test_default_table_on_this_machine_and_with_a_gpu(monkeypatch, tmp_path):
    dispatch._default_table.cache_clear()
    monkeypatch.setattr(dispatch, "current_gpu", lambda: None)
    assert dispatch.default_table()[0] is None  # no GPU here: no table, XLA preferred over small_seq
    assert choose(SMALL, {"cudnn": False, "xla": True, "small_seq": True}).backend == "xla"
    monkeypatch.setattr(dispatch, "current_gpu", lambda: "NVIDIA H100 PCIe")
    assert dispatch.default_table() == (H100_TABLE, "")  # same chip, another board
    monkeypatch.setattr(dispatch, "current_gpu", lambda: "NVIDIA A100-SXM4-80GB")
    table, note = dispatch.default_table()
    assert table is H100_TABLE and "no table for NVIDIA A100-SXM4-80GB" in note
    assert note in choose(SMALL, ALL).reason
    # SDPAGRAPH_DISPATCH_TABLE adds tables by GPU name
    path = tmp_path / "tables.json"
    a100 = Table("NVIDIA A100-SXM4-80GB", (Point(Shape.of(SMALL), "fwd_bwd", {"cudnn": 1.0, "xla": 2.0}),), "2026-11-23")
    dispatch_table.tables_to_json({a100.gpu: a100}, path)
    monkeypatch.setenv(DISPATCH_TABLE.name, str(path))
    assert dispatch.default_table()[0] == a100
    assert choose(SMALL, {"cudnn": True, "xla": True}).backend == "cudnn"
    dispatch._default_table.cache_clear()


def test_table_json_round_trip_and_lookup(tmp_path):
    path = tmp_path / "t.json"
    other = Table("NVIDIA H200", (Point(Shape.of(SMALL), "fwd", {"xla": 1.0}, "test"),), "2026-11-23", "made up")
    dispatch_table.tables_to_json({H100_TABLE.gpu: H100_TABLE, other.gpu: other}, path)
    data = json.loads(path.read_text())
    assert data["format"] == dispatch_table.FORMAT and set(data["tables"]) == {H100_TABLE.gpu, "NVIDIA H200"}
    loaded = dispatch_table.load_table(path, H100_TABLE.gpu)
    assert loaded == H100_TABLE
    assert dispatch_table.load_table(path, "NVIDIA H200 NVL") == other  # matched by chip
    with pytest.raises(KeyError, match="no dispatch table for GPU 'NVIDIA B200'"):
        dispatch_table.load_table(path, "NVIDIA B200")
    only = tmp_path / "one.json"
    dispatch_table.tables_to_json({other.gpu: other}, only)
    assert dispatch_table.load_table(only, "NVIDIA B200") == other  # a file with one table serves any GPU
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"format": 99, "tables": {}}))
    with pytest.raises(ValueError, match="format 99"):
        dispatch_table.tables_from_json(bad)


def test_nnls_fit_recovers_known_costs():
    """Points made from known coefficients (within the features' span) are fitted back exactly."""
    truth = np.array([0.01, 0.3, 5.0, 0.0, 0.0, 0.0, 0.0])
    points = []
    for b, t, s in [(30720, 1, 16), (1024, 2, 8), (64, 128, 128), (4, 4096, 4096), (8, 1, 2), (512, 4, 32)]:
        shape = Shape(b, t, s, 16, 16, 128, 128, "bfloat16")
        points.append(Point(shape, "fwd", {"xla": float(dispatch_table.features(shape, "xla", "fwd") @ truth)}))
    coef = dispatch_table.fit_model(points, "xla", "fwd")
    np.testing.assert_allclose(coef, truth, rtol=1e-6, atol=1e-9)
    assert np.all(coef >= 0)
    assert dispatch_table.fit_model(points, "cudnn", "fwd") is None


def test_shape_of_spec_marks_extras():
    plain = Shape.of(SMALL)
    assert plain.plain and plain.extra_bytes == 0
    masked = Shape.of(spec_of(8, 1, 16, query_seq_lengths=jax.ShapeDtypeStruct((8,), jnp.int32)))
    assert not masked.plain
    assert not Shape.of(SMALL, has_score_mod=True).plain
    biased = prepare_call(*[jax.ShapeDtypeStruct(s, jnp.bfloat16) for s in ((8, 1, 16, 128), (8, 16, 16, 128),
                                                                           (8, 16, 16, 128))],
                          jax.ShapeDtypeStruct((1, 16, 1, 16), jnp.bfloat16)).spec
    assert Shape.of(biased).extra_bytes == 2 * 16 * 16
    # a spec with extras never takes a measured time: the model predicts it
    assert "(measured)" not in choose(SMALL.__class__(**{**SMALL.__dict__, "is_causal": False,
                                                         "has_kv_lengths": True}), ALL, H100_TABLE).reason


def test_lazy_candidates_are_asked_only_when_they_would_win():
    asked = []

    def cudnn_answer():
        asked.append("cudnn")
        return Support(True, "cudnn", "builds")

    choice = choose(SMALL, {"cudnn": cudnn_answer, "xla": True, "small_seq": True}, H100_TABLE)
    assert choice.backend == "small_seq" and asked == [] and "cudnn not asked (predicted slower)" in choice.reason
    dense = spec_of(4, 4096, 4096, is_causal=True)
    assert choose(dense, {"cudnn": cudnn_answer, "xla": True, "small_seq": False}, H100_TABLE).backend == "cudnn"
    assert asked == ["cudnn"]
    declined = choose(dense, {"cudnn": lambda: Support(False, "xla", "no engine"), "xla": True}, H100_TABLE)
    assert declined.backend == "xla" and "cudnn cannot run it" in declined.reason
    with pytest.raises(ValueError, match="implementation='cudnn' cannot run .*no engine"):
        choose(SMALL, {"cudnn": lambda: Support(False, "xla", "no engine"), "xla": True}, H100_TABLE,
               implementation="cudnn")


def test_packed_calls_pick_small_seq_only_with_hints_in_the_regime():
    """A packed call is in the small-sequence regime by its max_seqlen hints; without them (or with
    hints outside it) it is not, whatever the model says."""
    from sdpagraph.backends.small_seq.backend import small_seq_reason

    def pick(training, segment_ids=jax.ShapeDtypeStruct((8, 4096), jnp.int32), S=4096, **hints):
        spec = spec_of(8, 4096, S, segment_ids=segment_ids, **hints)
        candidates = {"cudnn": True, "xla": True, "small_seq": small_seq_reason(spec) is None}
        return choose(spec, candidates, H100_TABLE, training=training)

    cross = (jax.ShapeDtypeStruct((8, 4096), jnp.int32), jax.ShapeDtypeStruct((8, 16384), jnp.int32))
    for training in (True, False):
        for hints in (dict(max_seqlen_q=4), dict(max_seqlen_kv=1)):
            choice = pick(training, **hints)
            assert choice.backend == "small_seq" and "(model)" in choice.reason, choice.reason
        assert pick(training, cross, 16384, max_seqlen_q=1, max_seqlen_kv=16).backend == "small_seq"
        assert pick(training).backend == "cudnn"  # no hints
        assert pick(training, max_seqlen_q=8).backend == "cudnn"  # outside the regime
        assert pick(training, cross, 16384, max_seqlen_q=1).backend == "cudnn"  # keys unbounded
