"""The cuDNN graph builder without a GPU: operand contract, lowering structure, mod semantics, cache path.

The lowering is exercised three ways: against a fake pygraph that records every call,
against the real `cudnn.pygraph` up to its IR-level validate() (no backend needed),
and numerically, by emitting the mod into the score_mod recorder and evaluating it
with jax.numpy against the XLA backend's own masks.
"""
import dataclasses
import gc
import time
import weakref

import jax.numpy as jnp
import msgpack
import numpy as np
import pytest

from sdpagraph import mods
from sdpagraph.cache import GraphCache
from sdpagraph.graph_store import cached_graph, check_graphs, graph_key
from sdpagraph.graphs import builder, support
from sdpagraph.graphs.binning import bin_plan
from sdpagraph.graphs.compiled import CompiledGraph
from sdpagraph.scoremod.ir import BOOL, FLOAT, INT
from sdpagraph.scoremod.trace import TensorInfo, trace_score_mod
from sdpagraph.scoremod.ir_eval import evaluate
from sdpagraph.scoremod.jnp.convert import convert_jnp_score_mod
from sdpagraph.graphs.lowering import lower, mod_stages, native_band
from sdpagraph.errors import Unsupported
from sdpagraph.graphs.mod_lowering import ModEmitter, pass_by_value_plan
from sdpagraph.graphs.operands import bias_operand_shape, describe, graph_io, graph_spec, uid_map
from sdpagraph.call import RuntimeInputs
from sdpagraph.backends.masking import allowed_mask, token_layout as _layout
from sdpagraph.spec import AttentionSpec

cudnn = pytest.importorskip("cudnn")

SCALAR = TensorInfo("scalar", FLOAT)
DIRECTIONS = ("forward", "inference", "backward")


def make_spec(**overrides):
    fields = dict(batch=2, q_len=128, kv_len=128, num_heads=8, num_kv_heads=2, head_dim=64, head_dim_v=64,
                  dtype="bfloat16", scale=0.125)
    fields.update(overrides)
    return AttentionSpec(**fields)


def softcap_ir():
    return trace_score_mod(mods.softcap(30.0), {"cap": SCALAR})


def user_mod(kind):
    """(IR, its scalars): an identity mod (it forces the mod path: every mask goes into the mod),
    mods.softcap, or a jax.numpy softcap whose literals are bound scalars."""
    if kind == "graph":
        return softcap_ir(), {"cap": 30.0}
    if kind == "jnp":
        mod = convert_jnp_score_mod(lambda s, b, h, i, j: 30.0 * jnp.tanh(s / 30.0))
        return mod.ir, dict(mod.scalars)
    return trace_score_mod(lambda g, s, t: s, {}), {}


# ----------------------------------------------------------------------------- fake pygraph

class FakeTensor:
    """Records what the lowering sets on a tensor."""

    def __init__(self, name, **attrs):
        self.name = name
        self.attrs = dict(attrs)

    def __getattr__(self, method):
        if not method.startswith("set_"):
            raise AttributeError(method)

        def setter(value):
            self.attrs[method[len("set_"):]] = value
            return self

        return setter

    def __repr__(self):
        return f"FakeTensor({self.name})"


class FakeGraph:
    """Stands in for cudnn.pygraph (outer calls) and for the graph cuDNN hands to callbacks."""

    def __init__(self):
        self.tensors = {}
        self.nodes = []  # (op, kwargs)
        self.results = []  # what each node returned

    def tensor(self, name, **attrs):
        self.tensors[name] = FakeTensor(name, **attrs)
        return self.tensors[name]

    def sdpa(self, **kwargs):
        stats = FakeTensor("stats") if kwargs["generate_stats"] else None
        return self._record("sdpa", kwargs, [FakeTensor("o"), stats])

    def sdpa_backward(self, **kwargs):
        return self._record("sdpa_backward", kwargs, [FakeTensor("dq"), FakeTensor("dk"), FakeTensor("dv")])

    def __getattr__(self, op):  # pointwise ops inside callbacks
        if op.startswith("_"):
            raise AttributeError(op)
        return lambda **kwargs: self._record(op, kwargs, FakeTensor(f"%{len(self.nodes)}", op=op, inputs=kwargs))

    def _record(self, op, kwargs, result):
        self.nodes.append((op, kwargs))
        self.results.append(result)
        return result


def lower_fake(spec, ir, direction):
    graph = FakeGraph()
    lowering = lower(graph, spec, ir, direction, cudnn)
    (op, options), = graph.nodes
    return graph, lowering, op, options


# ----------------------------------------------------------------------------- operand contract

def test_operand_order_per_direction():
    spec = make_spec(bias_shape=(1, 8, 128, 128), has_q_lengths=True)
    assert graph_io(spec, None, "forward") == (("q", "k", "v", "bias", "seq_len_q", "seq_len_kv"), ("o", "stats"))
    assert graph_io(spec, None, "inference") == (("q", "k", "v", "bias", "seq_len_q", "seq_len_kv"), ("o",))
    assert graph_io(spec, None, "backward") == (
        ("q", "k", "v", "o", "dO", "stats", "bias", "seq_len_q", "seq_len_kv"), ("dq", "dk", "dv", "dbias"))
    packed = make_spec(segments="self", max_segments=4)
    assert graph_io(packed, None, "forward")[0] == (
        "q", "k", "v", "seq_len_q", "seq_len_kv", "ragged_offset_q", "ragged_offset_kv", "ragged_offset_stats")
    assert "ragged_offset_stats" not in graph_io(packed, None, "inference")[0]
    with pytest.raises(ValueError, match="direction"):
        graph_io(spec, None, "sideways")


def test_aux_arrays_follow_ir_order_and_bprop_only_arrays_are_backward_only():
    infos = {"slopes": TensorInfo("array", FLOAT, (1, 8, 1, 1)), "gain": TensorInfo("array", FLOAT, (1, 8, 1, 1))}
    ir = trace_score_mod(lambda g, s, t: s + t["slopes"], infos, lambda g, d, t: d * t["gain"])
    assert graph_io(make_spec(), ir, "forward")[0] == ("q", "k", "v", "array:slopes")
    assert graph_io(make_spec(), ir, "backward")[0][-2:] == ("array:slopes", "array:gain")


def test_tensor_descriptions_are_bshd_strides_and_thd_offsets():
    spec = make_spec(q_len=256, kv_len=128, head_dim_v=32)
    descs = describe(spec, None, "backward")
    assert descs["q"].dims == (2, 8, 256, 64) and descs["q"].strides == (256 * 8 * 64, 64, 8 * 64, 1)
    assert descs["v"].dims == (2, 2, 128, 32) and descs["v"].strides == (128 * 2 * 32, 32, 2 * 32, 1)
    assert descs["o"].dims == (2, 8, 256, 32) and descs["dv"] == descs["v"] and descs["dq"] == descs["q"]
    assert descs["stats"].dims == (2, 8, 256, 1) and descs["stats"].dtype == "float32"
    packed = describe(make_spec(segments="self", max_segments=3), None, "forward")
    assert packed["q"].dims[0] == 6 and packed["q"].ragged_offset == "ragged_offset_q"
    assert packed["stats"].strides == (128 * 8, 1, 8, 1) and packed["stats"].ragged_offset == "ragged_offset_stats"
    assert packed["ragged_offset_kv"].dims == (7, 1, 1, 1) and packed["seq_len_q"].dims == (6, 1, 1, 1)


def test_uids_are_positions_and_stable():
    spec = make_spec(is_causal=True)
    first = lower_fake(spec, softcap_ir(), "backward")[1]
    again = lower_fake(spec, softcap_ir(), "backward")[1]
    assert first == again
    assert sorted(first.uids.values()) == list(range(1, len(first.uids) + 1))
    assert uid_map(("q", "k")) == {"q": 1, "k": 2}
    with pytest.raises(ValueError):
        uid_map(("q", "q"))


# ----------------------------------------------------------------------------- lowering structure

@pytest.mark.parametrize("causal, alignment, window, expected", [
    (True, "top_left", (-1, -1), ("TOP_LEFT", None, 0)),
    (True, "bottom_right", (-1, -1), ("BOTTOM_RIGHT", None, 0)),
    (False, "top_left", (64, 0), ("TOP_LEFT", 65, 0)),
    (False, "top_left", (32, 32), ("TOP_LEFT", 33, 32)),
    (True, "top_left", (16, 8), ("TOP_LEFT", 17, 0)),
])
def test_native_masks_become_cudnn_flags(causal, alignment, window, expected):
    spec = make_spec(is_causal=causal, causal_alignment=alignment, window=window)
    _, _, op, options = lower_fake(spec, None, "forward")
    alignment_name, left, right = expected
    assert op == "sdpa" and "score_mod" not in options
    assert options["diagonal_alignment"] == getattr(cudnn.diagonal_alignment, alignment_name)
    assert options.get("diagonal_band_left_bound") == left and options["diagonal_band_right_bound"] == right
    assert native_band(spec) == (left, right)


def test_padding_gqa_and_bias_natively():
    spec = make_spec(has_kv_lengths=True, bias_shape=(1, 8, 128, 128))
    graph, lowering, _, options = lower_fake(spec, None, "backward")
    assert options["use_padding_mask"] is True
    assert options["seq_len_q"] is graph.tensors["seq_len_q"] and options["attn_scale"] == 0.125
    assert graph.tensors["k"].attrs["dim"] == [2, 2, 128, 64] and graph.tensors["q"].attrs["dim"] == [2, 8, 128, 64]
    assert graph.tensors["seq_len_q"].attrs["data_type"] == cudnn.data_type.INT32
    assert options["dBias"].attrs["output"] is True and options["dBias"].attrs["uid"] == lowering.uids["dbias"]
    assert "diagonal_alignment" not in options


def test_packed_outputs_carry_uids_layouts_and_ragged_offsets():
    spec = make_spec(segments="cross", max_segments=2, is_causal=True)
    graph, lowering, _, options = lower_fake(spec, None, "forward")
    assert options["use_padding_mask"] is True and options["max_total_seq_len_q"] == 2 * 128
    assert graph.tensors["q"].attrs["ragged_offset"] is graph.tensors["ragged_offset_q"]
    assert graph.tensors["v"].attrs["ragged_offset"] is graph.tensors["ragged_offset_kv"]
    o, stats = graph.results[0]
    assert o.attrs["output"] and o.attrs["uid"] == lowering.uids["o"] and o.attrs["dim"] == [4, 8, 128, 64]
    assert o.attrs["ragged_offset"] is graph.tensors["ragged_offset_q"]
    assert stats.attrs["data_type"] == cudnn.data_type.FLOAT and stats.attrs["stride"] == [128 * 8, 1, 8, 1]
    assert stats.attrs["ragged_offset"] is graph.tensors["ragged_offset_stats"]


def test_a_score_mod_turns_native_flags_into_a_typed_mod():
    spec = make_spec(is_causal=True, window=(32, 4))
    graph, lowering, op, options = lower_fake(spec, softcap_ir(), "forward")
    assert op == "sdpa" and callable(options["score_mod"])
    for flag in ("use_padding_mask", "diagonal_alignment", "diagonal_band_right_bound", "seq_len_q"):
        assert flag not in options
    assert dict((source, dtype) for _, source, dtype in lowering.pass_by_value)[("scalar", "cap")] == "float32"
    assert graph.tensors["scalar:cap"].attrs["is_pass_by_value"] is True

    # softcap's division by the cap is cuDNN's attention scale (scoremod.scale_folding), computed from the cap at run time
    assert options["attn_scale"] is graph.tensors["attn_scale"] and graph.tensors["attn_scale"].attrs["is_pass_by_value"]
    callback_graph = FakeGraph()
    out = options["score_mod"](callback_graph, FakeTensor("score"))
    ops = [op for op, _ in callback_graph.nodes]
    assert ops[:2] == ["tanh", "mul"] and ops[-1] == "binary_select"
    assert not [op for op in ops if op.startswith("logical_")]  # masks chain selects (see scoremod.masks)
    # The window's int literals are INT32 pass-by-value tensors (cuDNN's tile skipping reads them as ints).
    assert {source: dtype for _, source, dtype in lowering.pass_by_value} == {
        ("scalar", "cap"): "float32", ("const", 33): "int32", ("const", 4): "int32", ("const", float("-inf")): "float32",
        ("attn_scale", (spec.scale, "cap", "div")): "float32"}
    assert graph.tensors["const:0"].attrs["data_type"] in (cudnn.data_type.INT32, cudnn.data_type.FLOAT)
    assert out.attrs["op"] == "binary_select" and out.attrs["inputs"]["mask"].attrs["data_type"] == cudnn.data_type.BOOLEAN
    for _, kwargs in callback_graph.nodes:  # every intermediate is typed (cuDNN declines untyped backward graphs)
        assert kwargs["compute_data_type"] in (cudnn.data_type.FLOAT, cudnn.data_type.INT32, cudnn.data_type.BOOLEAN)
    assert options["score_mod"](FakeGraph(), FakeTensor("score")).attrs["op"] == "binary_select"  # re-callable


def test_bprop_reuses_score_tensors_and_recomputes_position_masks():
    spec = make_spec(is_causal=True)
    _, _, op, options = lower_fake(spec, softcap_ir(), "backward")
    assert op == "sdpa_backward"
    callback_graph = FakeGraph()
    score = FakeTensor("score")
    options["score_mod"](callback_graph, score)
    forward_ops = len(callback_graph.nodes)
    forward_compare = next(t for t in callback_graph.results if t.attrs["op"] == "cmp_ge")
    dscore = FakeTensor("dS")
    grad = options["score_mod_bprop"](callback_graph, dscore)
    bprop_nodes = list(zip(callback_graph.nodes[forward_ops:], callback_graph.results[forward_ops:]))
    bprop_ops = [op for (op, _), _ in bprop_nodes]
    # The mask's bprop first, on indices of its own (cuDNN then skips masked tiles), then softcap's.
    assert bprop_ops[:4] == ["gen_index", "gen_index", "cmp_ge", "binary_select"] and "tanh_backward" in bprop_ops
    assert all(kwargs["input"] is dscore for (op, kwargs), _ in bprop_nodes if op == "gen_index")
    select = next(kwargs for (op, kwargs), _ in bprop_nodes if op == "binary_select")
    assert select["mask"] is not forward_compare and select["mask"].attrs["op"] == "cmp_ge"
    tanh_backward = next(kw for (op, kw), _ in bprop_nodes if op == "tanh_backward")
    assert tanh_backward["input"] is score  # the pre-tanh value (the score: its division by the cap is the attention scale)
    assert grad.attrs["op"] in ("mul", "div", "tanh_backward")


def test_chunks_go_through_a_mod_even_without_a_score_mod():
    spec = make_spec(chunk_size=32, is_causal=True)
    graph, lowering, _, options = lower_fake(spec, None, "backward")
    assert "score_mod" in options and "score_mod_bprop" in options and "diagonal_alignment" not in options
    assert lowering.operand_roles == ("q", "k", "v", "o", "dO", "stats")


def test_configs_the_lowering_cannot_express_raise_unsupported():
    with pytest.raises(Unsupported, match="float32"):
        builder.new_graph(make_spec(dtype="float32"), "forward", cudnn)
    with pytest.raises(Unsupported, match="value head dim"):
        lower_fake(make_spec(segments="self", max_segments=2, head_dim_v=32), None, "forward")
    with pytest.raises(Unsupported, match="packed"):
        lower_fake(make_spec(segments="self", max_segments=2, bias_shape=(2, 8, 128, 128)), None, "forward")
    with pytest.raises(Unsupported, match="int32 element offsets"):
        lower_fake(make_spec(segments="self", max_segments=2, batch=64, q_len=8192, kv_len=8192, num_heads=32,
                             num_kv_heads=32, head_dim=128, head_dim_v=128), None, "forward")
    with pytest.raises(Unsupported, match="bottom-right alignment with sequence lengths"):
        lower_fake(make_spec(has_kv_lengths=True, is_causal=True, causal_alignment="bottom_right"), softcap_ir(),
                   "forward")
    with pytest.raises(Unsupported, match="packed segments cannot be combined"):
        lower_fake(make_spec(segments="self", max_segments=2, chunk_size=64), None, "backward")
    bool_literal = trace_score_mod(lambda g, s, t: g.binary_select(input0=s, input1=0.0, mask=True), {})
    with pytest.raises(Unsupported, match="boolean literal"):
        lower_fake(make_spec(), bool_literal, "forward")


def test_padding_with_a_mod_becomes_a_key_bias_and_no_lengths():
    spec = make_spec(has_q_lengths=True, has_kv_lengths=True, is_causal=True)
    _, lowering, _, options = lower_fake(spec, softcap_ir(), "backward")
    assert lowering.operand_roles == ("q", "k", "v", "o", "dO", "stats", "bias")
    assert "use_padding_mask" not in options and "bias" in options and "dBias" not in options
    assert describe(spec, softcap_ir(), "forward")["bias"].dims == (2, 1, 128, 128)
    _, lowering, _, options = lower_fake(spec, None, "forward")  # no mod: cuDNN's own padding mask
    assert "seq_len_kv" in lowering.operand_roles and options["use_padding_mask"] is True


def test_a_boolean_mask_becomes_the_bias_operand():
    """Alone or broadcast together with a bias; dbias only for a user bias, shaped like the operand."""
    spec = make_spec(mask_shape=(2, 1, 128, 128), is_causal=True)
    _, lowering, _, options = lower_fake(spec, None, "backward")
    assert "bias" in lowering.operand_roles and "dbias" not in lowering.result_roles and "dBias" not in options
    both = make_spec(mask_shape=(2, 1, 128, 128), bias_shape=(1, 8, 128, 128))
    assert bias_operand_shape(both, None) == (2, 8, 128, 128)
    # A bias broadcast over queries is materialized along them (cuDNN's dq was wrong otherwise).
    assert bias_operand_shape(make_spec(bias_shape=(2, 1, 1, 128)), None) == (2, 1, 128, 128)
    _, lowering, _, options = lower_fake(both, None, "backward")
    assert lowering.result_roles == ("dq", "dk", "dv", "dbias")
    assert describe(both, None, "backward")["dbias"].dims == (2, 8, 128, 128)


def test_sinks_are_the_sdpa_nodes_sink_token_in_forward_graphs_only():
    spec = make_spec(is_causal=True, sinks=True)
    for direction in ("forward", "inference"):
        graph, lowering, _, options = lower_fake(spec, None, direction)
        sink = graph.tensors["sink_token"]
        assert options["sink_token"] is sink and "sink_token" in lowering.operand_roles
        assert sink.attrs["dim"] == [1, 8, 1, 1] and sink.attrs["data_type"] == cudnn.data_type.FLOAT
        assert sink.attrs["uid"] == lowering.uids["sink_token"]
        operands, results = graph_io(dataclasses.replace(spec, sinks=False), None, direction)
        assert (operands + ("sink_token",), results) == graph_io(spec, None, direction)
    with pytest.raises(Unsupported, match="forward graphs only"):  # the backward runs the spec without sinks
        lower_fake(spec, None, "backward")
    with pytest.raises(Unsupported, match="sinks inside a packed graph"):
        lower_fake(make_spec(segments="self", max_segments=2, sinks=True), None, "forward")


@pytest.mark.parametrize("direction", DIRECTIONS)
@pytest.mark.parametrize("case", ["native", "mod", "jnp_mod", "packed", "chunk_bias", "sinks"])
def test_real_pygraph_accepts_the_description(direction, case):
    """Up to the IR-level validate(), which needs no cuDNN backend library."""
    if case == "sinks" and direction == "backward":
        pytest.skip("sinks specs have forward graphs only")
    spec, ir = {
        "native": (make_spec(is_causal=True, window=(64, 0), has_q_lengths=True), None),
        "mod": (make_spec(is_causal=True, causal_alignment="bottom_right", kv_len=256), softcap_ir()),
        "jnp_mod": (make_spec(is_causal=True, window=(64, 0)), user_mod("jnp")[0]),
        "packed": (make_spec(segments="self", max_segments=4, is_causal=True), None),
        "chunk_bias": (make_spec(chunk_size=64, bias_shape=(1, 8, 128, 128)), None),
        "sinks": (make_spec(is_causal=True, window=(64, 0), sinks=True), None),
    }[case]
    graph = builder.new_graph(spec, direction, cudnn)
    lowering = lower(graph, spec, ir, direction, cudnn)
    graph.validate()
    (node,) = graph._nodes
    outputs = {t.uid for t in node.outputs.values() if t is not None}
    assert {lowering.uids[role] for role in lowering.result_roles} <= outputs
    if case == "jnp_mod":  # the softcap's literals are bound scalars, not baked constants
        sources = [source for _, source, _ in lowering.pass_by_value]
        assert ("attn_scale", (spec.scale, "captured_literal0", "div")) in sources  # s / 30: the attention scale
        assert ("scalar", "captured_literal1") in sources and ("const", 30.0) not in sources


# ----------------------------------------------------------------------------- mod semantics on the CPU

def emitted_ir(spec, ir, direction):
    """Run the graph's two callbacks on the score_mod recorder: the exact op stream cuDNN would get."""
    stages = mod_stages(spec, ir)
    plan = pass_by_value_plan(stages, direction)
    descs = describe(spec, ir, direction)
    infos = {entry.role: TensorInfo("scalar", FLOAT) for entry in plan}  # pass-by-value tensors are FLOAT
    infos.update({role: TensorInfo("array", FLOAT if desc.dtype == "float32" else INT, desc.dims)
                  for role, desc in descs.items() if role.startswith("array:")})
    names = {FLOAT: "FLOAT", INT: "INT32", BOOL: "BOOLEAN"}
    emitters = {}

    def forward(graph, score, tensors):
        emitters["it"] = ModEmitter(stages, plan, tensors, names)
        return emitters["it"].forward(graph, score)

    bprop = (lambda graph, dscore, tensors: emitters["it"].bprop(graph, dscore)) if direction == "backward" else None
    return trace_score_mod(forward, infos, bprop), plan


@pytest.mark.parametrize("overrides", [
    dict(is_causal=True),
    dict(is_causal=True, causal_alignment="bottom_right", q_len=96, kv_len=160),
    dict(is_causal=True, causal_alignment="bottom_right", q_len=160, kv_len=96),
    dict(window=(16, 0), causal_alignment="bottom_right", q_len=64, kv_len=128),
    dict(window=(8, 8)),
    dict(window=(-1, 4)),
    dict(chunk_size=24, is_causal=True),
    dict(chunk_size=32, causal_alignment="bottom_right", q_len=48, kv_len=128),
    dict(chunk_size=32, causal_alignment="bottom_right", q_len=150, kv_len=64),
])
@pytest.mark.parametrize("kind", ["identity", "graph", "jnp"])
def test_emitted_mod_matches_the_xla_backend(overrides, kind):
    spec = make_spec(**overrides)
    ir, scalars = user_mod(kind)
    rng = np.random.default_rng(0)
    inputs = RuntimeInputs()
    layout = _layout(spec, inputs)
    index = (jnp.arange(spec.batch)[:, None, None, None], jnp.arange(spec.num_heads)[None, :, None, None],
             layout.q_pos[:, None, :, None], layout.kv_pos[:, None, None, :])
    score = jnp.asarray(rng.normal(size=(spec.batch, spec.num_heads, spec.q_len, spec.kv_len)) * 40, jnp.float32)
    dscore = jnp.asarray(rng.normal(size=score.shape), jnp.float32)

    emitted, plan = emitted_ir(spec, ir, "backward")
    values = {entry.role: scalars[entry.source[1]] if entry.source[0] == "scalar" else entry.source[1]
              for entry in plan}
    logits, grad = evaluate(emitted, score, scalars=values, arrays={}, index=index, dscore=dscore)

    expected, expected_grad = evaluate(ir, score, scalars=scalars, arrays={}, index=index, dscore=dscore)
    allowed = allowed_mask(spec, inputs, layout)
    np.testing.assert_allclose(logits, jnp.where(allowed, expected, -jnp.inf), rtol=1e-6)
    np.testing.assert_allclose(grad, jnp.where(allowed, expected_grad, 0.0), rtol=1e-6, atol=1e-6)


def test_mask_comparisons_have_int_operands_and_no_logical_ops():
    """What cuDNN 9.19's score_mod fusion built on an H100 (see scoremod.masks)."""
    spec = make_spec(is_causal=True, window=(16, 4), chunk_size=32, causal_alignment="bottom_right", q_len=96)
    emitted, _ = emitted_ir(spec, trace_score_mod(lambda g, s, t: s, {}), "backward")
    for node in emitted.nodes:
        assert not node.op.startswith("logical_")
        if node.op.startswith("cmp_"):
            assert [emitted.nodes[a].dtype for a in node.args] == [INT, INT], node


def test_forward_graphs_emit_no_bprop_only_constants():
    ir = trace_score_mod(lambda g, s, t: s * 2.0, {}, lambda g, d, t: d * 7.0)
    forward = lower_fake(make_spec(), ir, "forward")[1]
    backward = lower_fake(make_spec(), ir, "backward")[1]
    assert [source for _, source, _ in forward.pass_by_value] == [("const", 2.0)]
    assert ("const", 7.0) in [source for _, source, _ in backward.pass_by_value]


# ----------------------------------------------------------------------------- CompiledGraph and the cache

def compiled_example(**overrides):
    fields = dict(blob=b"\x00plan", workspace_size=4096, operand_roles=("q", "k", "v"), result_roles=("o", "stats"),
                  uids={"q": 1, "k": 2, "v": 3, "o": 4, "stats": 5, "scalar:cap": 6, "const:0": 7},
                  pass_by_value=((6, ("scalar", "cap"), "float32"), (7, ("const", float("-inf")), "float32")),
                  direction="forward", versions={"cudnn": "9.19.0", "frontend": "1.32.0", "gpu": "sm90 H200"},
                  build_time_s=0.8)
    fields.update(overrides)
    return CompiledGraph(**fields)


def test_compiled_graph_round_trips_through_msgpack_meta():
    compiled = compiled_example()
    meta = msgpack.unpackb(msgpack.packb(compiled.to_meta(), use_bin_type=True), raw=False, strict_map_key=True)
    assert CompiledGraph.from_meta(compiled.blob, meta) == compiled
    values = compiled.pass_by_value_values({"cap": 30})
    assert values == {6: np.float32(30.0), 7: np.float32(-np.inf)} and isinstance(values[6], np.float32)
    with pytest.raises(KeyError, match="cap"):
        compiled.pass_by_value_values({})
    with pytest.raises(ValueError, match="meta version"):
        CompiledGraph.from_meta(b"", {**meta, "meta_version": 0})


@pytest.fixture
def fake_gpu(monkeypatch):
    """A build environment and a compile step that need no GPU; records what was compiled."""
    compiled = []
    env = builder.BuildEnvironment("9.19.0", "1.32.0", "sm90 NVIDIA H200")

    def compile_graph(spec, ir, direction, env):
        spec = graph_spec(spec, ir)  # as builder.compile_graph: it takes the call's spec
        if spec.head_dim % 8:
            raise builder.GraphBuildError(direction, "[cudnn_frontend] Error: Num hidden_dim should be less than "
                                          "or equal to 256 and hidden_dim should be multiple of 8", env.cudnn_version)
        graph = FakeGraph()
        lowering = lower(graph, spec, ir, direction, cudnn)
        compiled.append((spec, direction))
        result = compiled_example(operand_roles=lowering.operand_roles, result_roles=lowering.result_roles,
                                  uids=lowering.uids, pass_by_value=lowering.pass_by_value, direction=direction)
        return result.blob, result.to_meta()

    monkeypatch.setattr(builder, "build_environment", lambda: env)
    monkeypatch.setattr(builder, "compile_graph", compile_graph)
    monkeypatch.setattr(support, "environment_reason", lambda: None)
    return compiled


def test_build_goes_through_the_cache_once_per_key(fake_gpu, tmp_path):
    cache = GraphCache(tmp_path)
    spec = make_spec(is_causal=True)
    first = cached_graph(spec, softcap_ir(), "forward", cache).compiled
    again = cached_graph(spec, softcap_ir(), "forward", cache).compiled
    assert first == again and cache.stats()["builds"] == 1
    cached_graph(spec, softcap_ir(), "backward", cache).compiled
    cached_graph(spec, None, "forward", cache).compiled
    assert cache.stats()["builds"] == 3
    fresh_process = GraphCache(tmp_path)  # the disk layer serves a new process without building
    assert cached_graph(spec, softcap_ir(), "forward", fresh_process).compiled == first
    assert fresh_process.stats()["builds"] == 0


def test_keys_hash_the_forward_part_for_forward_graphs():
    env = builder.BuildEnvironment("9.19.0", "1.32.0", "sm90 NVIDIA H200")
    custom = trace_score_mod(lambda g, s, t: s * 2.0, {}, lambda g, d, t: d * 3.0)
    derived = trace_score_mod(lambda g, s, t: s * 2.0, {})
    spec = make_spec()
    assert graph_key(spec, custom, "forward", env) == graph_key(spec, derived, "forward", env)
    assert graph_key(spec, custom, "backward", env) != graph_key(spec, derived, "backward", env)
    assert graph_key(spec, None, "inference", env).ir_hash == f"lowering{builder.LOWERING_VERSION}:none"


def test_support_builds_the_runtime_graphs_and_remembers_answers(fake_gpu, tmp_path):
    cache = GraphCache(tmp_path)
    spec = make_spec(is_causal=True)
    answer = check_graphs(spec, softcap_ir(), True, cache)
    assert answer.supported and answer.backend == ""  # the graphs layer names no backend
    assert [direction for _, direction in fake_gpu] == ["forward", "backward"]
    cached_graph(spec, softcap_ir(), "forward", cache).compiled  # what attention() does next
    cached_graph(spec, softcap_ir(), "backward", cache).compiled
    assert cache.stats()["builds"] == 2
    assert check_graphs(spec, None, False, cache).reason == "cuDNN builds the inference graph"
    packed = make_spec(is_causal=True, segments="self", max_segments=4)
    assert "dense layout" in check_graphs(packed, softcap_ir(), False, cache).reason
    # Too few documents a row for quarter-row bins: the answer names the hint where one could plan bins
    four = make_spec(batch=4, q_len=4096, kv_len=4096, is_causal=True, segments="self", max_segments=4)
    reason = check_graphs(four, softcap_ir(), False, cache).reason
    assert "max_segments_per_seq=4 and no max_seqlen_kv" in reason and "pass max_seqlen_kv" in reason, reason
    for no_advice in (dataclasses.replace(four, max_seqlen_kv=1024),  # on bins: says so instead
                      dataclasses.replace(four, max_segments=2),  # bins of T/2 would not pay
                      packed):  # nor would bins of a whole row
        assert "pass max_seqlen_kv" not in check_graphs(no_advice, softcap_ir(), False, cache).reason, no_advice
    assert check_graphs(packed, None, False, cache).reason == "cuDNN builds the inference graph"


def test_support_builds_the_bins_graphs_too_and_says_so(fake_gpu, tmp_path):
    """A packed call with a score_mod (with a max_seqlen_kv hint, or without): check_graphs (what precompile and
    check_support run) builds the graphs of its bins too (graphs.binning), so a precompiled cache
    holds them; the answer says how the documents run."""
    cache = GraphCache(tmp_path)
    packed = make_spec(batch=2, q_len=4096, kv_len=4096, is_causal=True, segments="self", max_segments=4096,
                       max_seqlen_kv=500)
    answer = check_graphs(packed, softcap_ir(), True, cache)
    bins = bin_plan(packed, softcap_ir())
    assert answer.supported and f"{bins.bins} bins of 512 tokens" in answer.reason
    built = [(spec.batch, spec.q_len, direction) for spec, direction in fake_gpu]
    assert built == [(2, 4096, "forward"), (2, 4096, "backward"), (bins.bins, 512, "forward"),
                     (bins.bins, 512, "backward")]
    unhinted = dataclasses.replace(packed, max_seqlen_kv=None)  # bins of a quarter of a row, and the advice
    reason = check_graphs(unhinted, softcap_ir(), True, cache).reason
    assert "bins of 1024 tokens" in reason and "pass max_seqlen_kv=<the longest document>" in reason
    short_docs_only = dataclasses.replace(packed, max_seqlen_kv=3000)  # bins would save too little
    assert "bins" not in check_graphs(short_docs_only, softcap_ir(), True, cache).reason


def test_support_declines_with_one_actionable_sentence(fake_gpu, tmp_path):
    cache = GraphCache(tmp_path)
    answer = check_graphs(make_spec(head_dim=68, head_dim_v=68), None, True, cache)
    assert not answer.supported and answer.backend == ""
    assert answer.reason == "head dim 68 is not a multiple of 8"
    assert check_graphs(make_spec(dtype="float32"), None, True, cache).reason == (
        "cuDNN SDPA takes bfloat16 or float16 inputs, not float32")
    generic = builder.GraphBuildError("backward", "Tensor q has bad strides. Details follow.", "9.19.0")
    assert support.condense_reason(make_spec(), generic) == (
        "cuDNN 9.19.0 declined the backward graph: Tensor q has bad strides.")


def test_support_never_raises(fake_gpu, monkeypatch, tmp_path):
    def broken(*args):
        raise RuntimeError("driver exploded\nwith details")

    monkeypatch.setattr(builder, "compile_graph", broken)
    answer = check_graphs(make_spec(), None, True, GraphCache(tmp_path))
    assert not answer.supported and "driver exploded with details" in answer.reason


def test_cached_answers_cost_at_most_50_microseconds(fake_gpu, tmp_path):
    cache = GraphCache(tmp_path)
    questions = [(make_spec(is_causal=True), softcap_ir(), True), (make_spec(head_dim=68, head_dim_v=68), None, True)]
    for spec, ir, training in questions:
        check_graphs(spec, ir, training, cache)
    builds = cache.stats()["builds"]
    for spec, ir, training in questions:
        calls = 2000
        started = time.perf_counter()
        for _ in range(calls):
            check_graphs(spec, ir, training, cache)
        per_call = (time.perf_counter() - started) / calls
        assert per_call <= 50e-6, f"cached answer took {per_call * 1e6:.1f} us"
    assert cache.stats()["builds"] == builds


def test_no_gpu_answer_comes_from_the_environment(tmp_path):
    answer = check_graphs(make_spec(), None, True, GraphCache(tmp_path))
    if support.environment_reason() is not None:  # this CPU machine
        assert not answer.supported and answer.reason == support.environment_reason()


def test_spec_fields_all_reach_the_key():
    env = builder.BuildEnvironment("9.19.0", "1.32.0", "sm90 NVIDIA H200")
    base = graph_key(make_spec(), None, "forward", env)
    for field, value in [("scale", 0.5), ("max_segments", 3), ("causal_alignment", "bottom_right")]:
        assert graph_key(dataclasses.replace(make_spec(), **{field: value}), None, "forward", env) != base


@pytest.mark.parametrize("causal", [True, False])
def test_a_dense_segment_twin_compares_key_positions_with_segment_bounds(causal):
    spec = make_spec(segment_mask=True, max_segments=3, is_causal=causal)
    for direction in ("forward", "backward"):
        graph, lowering, _, options = lower_fake(spec, softcap_ir(), direction)
        bounds = ("segment_start",) if causal else ("segment_start", "segment_end")
        assert lowering.operand_roles[-len(bounds):] == bounds
        assert all(graph.tensors[role].attrs["dim"] == [2, 1, 128, 1] for role in bounds)
        assert "score_mod" in options and "use_padding_mask" not in options
        callback = options["score_mod_bprop" if direction == "backward" else "score_mod"]
        inner = FakeGraph()
        callback(inner, FakeTensor("score"))
        compared = {(op, id(kw["comparison"])) for op, kw in inner.nodes if op in ("cmp_ge", "cmp_le")}
        # Both passes compare afresh, key position against the graph's own int32 bound tensors.
        assert ("cmp_ge", id(graph.tensors["segment_start"])) in compared
        assert (("cmp_le", id(graph.tensors.get("segment_end"))) in compared) == (not causal)


def test_release_breaks_the_cycle_the_frontend_keeps_through_callbacks():
    """cudnn-frontend hands callbacks a shim whose `_lower` closes over the C++ graph, which holds
    the callbacks: a cycle Python cannot collect. `Lowering.release` must empty those cells."""

    class CppGraph:  # stands in for the frontend's C++ graph
        pass

    cpp = CppGraph()
    alive = weakref.ref(cpp)
    tensor_map = {}

    def lower_tensor(tensor):  # as the frontend's translator: a closure over the C++ graph
        return cpp, tensor_map

    class Shim(FakeGraph):
        def __init__(self, translator):
            super().__init__()
            self._lower = translator

    graph = FakeGraph()
    lowering = lower(graph, make_spec(is_causal=True), softcap_ir(), "backward", cudnn)
    options = graph.nodes[-1][1]
    shim = Shim(lower_tensor)
    options["score_mod"](shim, FakeTensor("score"))  # cuDNN calls the callbacks while it builds
    options["score_mod_bprop"](shim, FakeTensor("dscore"))
    lowering.release()
    assert all(cell.cell_contents is None for cell in lower_tensor.__closure__)
    gc.disable()  # the graph must go by reference counting alone, as a C++ object would
    try:
        del cpp
        assert alive() is None
    finally:
        gc.enable()
