"""sdpagraph's cuDNN graphs on a GPU: build through the cache, deserialize, execute, compare with XLA.

Each case normalizes its arguments with `prepare_call` (the code `attention` uses),
asks the support query (which builds forward and backward), checks that the runtime's
builds then hit the cache, executes the serialized graphs through the cudnn Python API
with torch buffers laid out as the executor contract says (`graphs/builder.py`), and
compares output, softmax stats and dq/dk/dv(/dbias) with the XLA backend's forward and
`jax.vjp` on the same bf16/fp16 inputs.
"""
from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
cudnn = pytest.importorskip("cudnn")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from sdpagraph import mods  # noqa: E402
from sdpagraph.cache import GraphCache  # noqa: E402
from sdpagraph.graph_store import cached_graph, check_graphs  # noqa: E402
from sdpagraph.graphs import builder, support  # noqa: E402
from sdpagraph.scoremod.ir import FLOAT, INT  # noqa: E402
from sdpagraph.scoremod.trace import TensorInfo, trace_score_mod  # noqa: E402
from sdpagraph.graphs.lowering import lower, new_graph  # noqa: E402
from sdpagraph.call import prepare_call  # noqa: E402
from sdpagraph.segments.metadata import segment_metadata  # noqa: E402
from sdpagraph.backends.masking import allowed_mask, token_layout as _layout  # noqa: E402
from sdpagraph.backends.xla import xla_attention  # noqa: E402
from sdpagraph.spec import AttentionSpec  # noqa: E402
from tests.reference import rel_err  # noqa: E402

FORWARD_TOLERANCE = 1e-2  # relative L2 error, bf16/fp16 inputs, fp32 accumulation on both sides
BACKWARD_TOLERANCE = 2e-2
TORCH_TYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}
HEURISTICS = [cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK]
HERE = os.path.dirname(os.path.abspath(__file__))
blob_failures: list[str] = []  # serialized graphs that did not execute (the tests then run a rebuilt graph)


@dataclass(frozen=True)
class Case:
    name: str
    B: int
    T: int
    S: int
    N: int
    K: int
    H: int
    Hv: int | None = None
    dtype: str = "bfloat16"
    options: dict = field(default_factory=dict)  # attention() keyword arguments
    bias_shape: tuple | None = None
    mask: bool = False  # a boolean (B, 1, T, S) mask
    q_lengths: bool = False
    kv_lengths: bool = False
    max_segments: int = 0  # > 0: packed self-attention with this many segment slots
    may_decline: bool = False  # cuDNN may legitimately not support it; then the test skips with the reason


SLOPES = 2.0 ** -np.arange(1, 9, dtype=np.float32)
TABLE = np.linspace(-1, 1, 8 * 9, dtype=np.float32).reshape(8, 9)
CASES = [
    Case("plain", 1, 128, 128, 8, 8, 64),
    Case("causal_gqa_8_2", 3, 1024, 1024, 8, 2, 128, options=dict(is_causal=True)),
    Case("bottom_right_cross_mqa_fp16", 1, 128, 256, 8, 1, 64, dtype="float16",
         options=dict(is_causal=True, causal_alignment="bottom_right")),
    Case("window_64_0", 1, 1024, 1024, 8, 8, 64, options=dict(local_window_size=(64, 0))),
    Case("window_32_32", 3, 256, 256, 8, 2, 64, options=dict(local_window_size=(32, 32))),
    Case("padding_causal", 3, 256, 256, 8, 2, 64, options=dict(is_causal=True), q_lengths=True, kv_lengths=True),
    Case("bias_1NTS", 3, 128, 128, 8, 8, 64, bias_shape=(1, 8, 128, 128)),
    Case("softcap_causal", 3, 1024, 1024, 8, 2, 128, options=dict(is_causal=True, score_mod=mods.softcap(30.0))),
    Case("alibi_causal", 1, 256, 256, 8, 8, 64, options=dict(is_causal=True, score_mod=mods.alibi(SLOPES))),
    Case("chunk_128_causal", 1, 512, 512, 8, 2, 64, options=dict(is_causal=True, chunk_size=128)),
    Case("softcap_window_64_0", 1, 512, 512, 8, 2, 64,
         options=dict(local_window_size=(64, 0), score_mod=mods.softcap(30.0))),
    # cuDNN 9.19 found no engine for these mods on an H100: they compare positions with a
    # pass-by-value scalar (prefix-LM) or select between two aux arrays (relative bias).
    Case("relative_bias", 1, 128, 128, 8, 8, 64, options=dict(score_mod=mods.relative_position_bias(TABLE, 4)),
         may_decline=True),
    Case("prefix_lm", 1, 256, 256, 8, 8, 64, options=dict(score_mod=mods.prefix_lm(64)), may_decline=True),
    Case("segments_causal", 2, 256, 256, 8, 2, 64, options=dict(is_causal=True), max_segments=4),
    Case("softcap_bottom_right_T_gt_S", 1, 256, 128, 8, 8, 64,
         options=dict(is_causal=True, causal_alignment="bottom_right", score_mod=mods.softcap(30.0))),
    Case("head_dim_256_causal", 1, 256, 256, 8, 8, 256, options=dict(is_causal=True)),
    Case("head_dims_128_64", 1, 256, 256, 8, 8, 128, Hv=64),
]
# Declined before building (graphs.lowering): cuDNN 9.19 crashed the process planning packed
# segments with a mod. A mod that reads no positions runs as a dense graph masking by segment
# bounds instead (tests/gpu/test_attention_gpu.py); one that reads positions stays declined.
DECLINED_BEFORE_BUILDING = [
    (Case("segments_alibi", 2, 256, 256, 8, 2, 64, options=dict(score_mod=mods.alibi(SLOPES)), max_segments=4),
     "packed segments cannot be combined with chunk_size or a score_mod that reads positions"),
]


@pytest.fixture(scope="session")
def cache(tmp_path_factory):
    return GraphCache(tmp_path_factory.mktemp("graphs"))


@pytest.fixture(scope="session")
def handle():
    return cudnn.create_handle()


# ----------------------------------------------------------------------------- inputs

def random_segment_ids(rng, batch, length, max_segments):
    """Rows of up to `max_segments` contiguous segments with padding between and after them."""
    ids = np.zeros((batch, length), np.int32)
    for row in ids:
        position = 0
        for segment in range(1, max_segments + 1):
            position += int(rng.integers(0, 8))
            size = int(rng.integers(16, length // max_segments))
            row[position:position + size] = segment
            position += size
    return ids


def make_inputs(case: Case, seed: int = 0) -> dict[str, Any]:
    """Host inputs (numpy) and the prepared call sdpagraph's runtime would see."""
    rng = np.random.default_rng(seed)
    Hv = case.Hv or case.H
    host = {
        "q": rng.normal(size=(case.B, case.T, case.N, case.H)).astype(np.float32),
        "k": rng.normal(size=(case.B, case.S, case.K, case.H)).astype(np.float32),
        "v": rng.normal(size=(case.B, case.S, case.K, Hv)).astype(np.float32),
        "dO": rng.normal(size=(case.B, case.T, case.N, Hv)).astype(np.float32),
    }
    kwargs = dict(case.options)
    if case.bias_shape:
        host["bias"] = rng.normal(size=case.bias_shape).astype(np.float32)
    if case.mask:
        host["mask"] = rng.random((case.B, 1, case.T, case.S)) < 0.8
    if case.q_lengths:
        kwargs["query_seq_lengths"] = jnp.asarray(rng.integers(case.T // 2, case.T + 1, case.B), jnp.int32)
    if case.kv_lengths:
        kwargs["key_value_seq_lengths"] = jnp.asarray(rng.integers(case.S // 2, case.S + 1, case.B), jnp.int32)
    if case.max_segments:
        kwargs["segment_ids"] = jnp.asarray(random_segment_ids(rng, case.B, case.T, case.max_segments))
        kwargs["max_segments_per_seq"] = case.max_segments
    dtype = jnp.dtype(case.dtype)
    device = {name: jnp.asarray(value).astype(dtype) for name, value in host.items() if name != "mask"}
    call = prepare_call(device["q"], device["k"], device["v"], device.get("bias"),
                        None if "mask" not in host else jnp.asarray(host["mask"]), **kwargs)
    return {"host": host, "device": device, "call": call}


def to_torch(array, dtype) -> "torch.Tensor":
    return torch.from_numpy(np.ascontiguousarray(np.asarray(array))).to("cuda").to(dtype)


def operand_buffers(case: Case, inputs: dict, roles) -> dict[str, "torch.Tensor"]:
    """Every forward operand, as the JAX side would pass it (see builder.py's contract)."""
    spec, call, host = inputs["call"].spec, inputs["call"], inputs["host"]
    io = TORCH_TYPES[case.dtype]
    buffers = {name: to_torch(host[name], io) for name in ("q", "k", "v", "bias") if name in host}
    if spec.segments:
        buffers.update(packed_metadata(spec, call.inputs.q_segment_ids, call.inputs.kv_segment_ids))
    elif spec.has_padding:
        full = lambda n: jnp.full((spec.batch,), n, jnp.int32)  # noqa: E731
        lengths = {"seq_len_q": call.inputs.q_lengths if call.inputs.q_lengths is not None else full(spec.q_len),
                   "seq_len_kv": call.inputs.kv_lengths if call.inputs.kv_lengths is not None else full(spec.kv_len)}
        buffers.update({role: to_torch(value, torch.int32) for role, value in lengths.items()})
    for name, value in (call.inputs.mod_arrays or {}).items():
        kind = np.asarray(value).dtype
        buffers["array:" + name] = to_torch(value, torch.int32 if np.issubdtype(kind, np.integer) else torch.float32)
    missing = [role for role in roles if role not in buffers and role not in ("o", "dO", "stats")]
    assert not missing, f"test has no buffer for operand roles {missing}"
    return buffers


def packed_metadata(spec, q_ids, kv_ids) -> dict[str, "torch.Tensor"]:
    """THD operands from the O(T) segment helpers: lengths and element offsets per sequence."""
    M = spec.max_segments
    q_meta, kv_meta = segment_metadata(q_ids, M), segment_metadata(kv_ids, M)

    def starts(meta, length):  # token index of each sequence's first token in the flat (B*len) buffer
        flat = (np.arange(spec.batch)[:, None] * length + np.asarray(meta.offsets)[:, :M]).reshape(-1)
        return np.append(flat, spec.batch * length).astype(np.int64)

    q_start, kv_start = starts(q_meta, spec.q_len), starts(kv_meta, spec.kv_len)
    return {
        "seq_len_q": to_torch(np.asarray(q_meta.seq_lens).reshape(-1), torch.int32),
        "seq_len_kv": to_torch(np.asarray(kv_meta.seq_lens).reshape(-1), torch.int32),
        "ragged_offset_q": to_torch(q_start * spec.num_heads * spec.head_dim, torch.int32),
        "ragged_offset_kv": to_torch(kv_start * spec.num_kv_heads * spec.head_dim, torch.int32),
        "ragged_offset_stats": to_torch(q_start * spec.num_heads, torch.int32),
    }


def result_buffers(spec, roles, io) -> dict[str, "torch.Tensor"]:
    B, T, S, N, K, H, Hv = (spec.batch, spec.q_len, spec.kv_len, spec.num_heads, spec.num_kv_heads,
                            spec.head_dim, spec.head_dim_v)
    shapes = {"o": (B, T, N, Hv), "stats": (B, T, N) if spec.segments else (B, N, T), "dq": (B, T, N, H),
              "dk": (B, S, K, H), "dv": (B, S, K, Hv), "dbias": spec.bias_shape}
    # Zeroed: rows cuDNN does not compute (padding) must read 0, as the JAX side will make them.
    return {role: torch.zeros(shapes[role], dtype=torch.float32 if role == "stats" else io, device="cuda")
            for role in roles}


# ----------------------------------------------------------------------------- execution

def execute(compiled, spec, ir, buffers: dict, scalars: dict, handle) -> dict[str, "torch.Tensor"]:
    """Run a CompiledGraph from its serialized bytes; fall back to a rebuilt graph (and record why)."""
    results = result_buffers(spec, compiled.result_roles, TORCH_TYPES[spec.dtype])
    pack = {compiled.uids[role]: buffers[role] for role in compiled.operand_roles}
    pack.update({compiled.uids[role]: results[role] for role in compiled.result_roles})
    pack.update({uid: torch.tensor(value).reshape(1, 1, 1, 1)  # host memory: pass-by-value
                 for uid, value in compiled.pass_by_value_values(scalars).items()})
    workspace = torch.empty(max(compiled.workspace_size, 1), dtype=torch.uint8, device="cuda")
    try:
        graph = cudnn.pygraph()
        graph.deserialize(handle, compiled.blob)
        graph.execute(pack, workspace, handle=handle)
    except Exception as error:  # noqa: BLE001 - recorded; test_serialized_graphs_execute reports it
        blob_failures.append(f"{spec.summary()} {compiled.direction}: {type(error).__name__}: {error}")
        print(f"serialized graph did not execute ({blob_failures[-1]}); running a rebuilt graph")
        graph = rebuilt_graph(spec, ir, compiled.direction)
        graph.execute(pack, workspace, handle=handle)
    torch.cuda.synchronize()
    return results


def rebuilt_graph(spec, ir, direction):
    graph = new_graph(spec, direction, cudnn)
    lower(graph, spec, ir, direction, cudnn)
    graph.build(HEURISTICS)
    return graph


def reference(inputs: dict):
    """XLA backend output, logsumexp and gradients (w.r.t. q, k, v, bias) on the same inputs."""
    call, device = inputs["call"], inputs["device"]

    def forward(q, k, v, bias):
        return xla_attention(call.spec, q, k, v, dataclasses.replace(call.inputs, bias=bias), call.score_mod)

    (out, lse), vjp = jax.vjp(forward, device["q"], device["k"], device["v"], device.get("bias"))
    grads = vjp((device["dO"], jnp.zeros_like(lse)))
    return out, lse, dict(zip(("dq", "dk", "dv", "dbias"), grads))


def host(tensor) -> np.ndarray:
    return tensor.float().cpu().numpy()


# ----------------------------------------------------------------------------- score_mod op support

def _positions(graph, score):
    return graph.gen_index(input=score, axis=2), graph.gen_index(input=score, axis=3)


def _masked(graph, score, keep):
    return graph.binary_select(input0=score, input1=float("-inf"), mask=keep)


def _probe_literal_cmp(g, s, t):
    q, k = _positions(g, s)
    return _masked(g, s, g.cmp_lt(input=k, comparison=64))


def _probe_chained_selects(g, s, t):
    q, k = _positions(g, s)
    return _masked(g, _masked(g, s, g.cmp_le(input=k, comparison=q)), g.cmp_ge(input=k, comparison=q - 8.0))


def _probe_logical_and(g, s, t):
    q, k = _positions(g, s)
    return _masked(g, s, g.logical_and(a=g.cmp_le(input=k, comparison=q), b=g.cmp_ge(input=k, comparison=q - 8.0)))


def _probe_logical_or(g, s, t):
    q, k = _positions(g, s)
    return _masked(g, s, g.logical_or(a=g.cmp_le(input=k, comparison=q), b=g.cmp_lt(input=k, comparison=16)))


def _probe_logical_not(g, s, t):
    q, k = _positions(g, s)
    return _masked(g, s, g.logical_not(input=g.cmp_gt(input=k, comparison=q)))


def _probe_min_max_int(g, s, t):
    q, k = _positions(g, s)
    clipped = g.max(input0=g.min(input0=g.sub(a=k, b=q), input1=4), input1=-4)
    return g.add(a=s, b=g.mul(a=clipped, b=0.1))


def _probe_max_float(g, s, t):
    return g.max(input0=s, input1=-1.0)


def _probe_cmp_eq_int(g, s, t):
    q, k = _positions(g, s)
    return _masked(g, s, g.cmp_eq(input=g.sub(a=k, b=q), comparison=0))


def _probe_floor_div_cmp_eq(g, s, t):
    q, k = _positions(g, s)
    same = g.cmp_eq(input=g.floor(input=g.div(a=q, b=32.0)), comparison=g.floor(input=g.div(a=k, b=32.0)))
    return _masked(g, s, same)


def _probe_mod_int(g, s, t):
    q, k = _positions(g, s)
    return _masked(g, s, g.cmp_eq(input=g.mod(input0=k, input1=2), comparison=0))


def _probe_select_arrays(g, s, t):
    q, k = _positions(g, s)
    return g.add(a=s, b=g.binary_select(input0=t["a"], input1=t["b"], mask=g.cmp_ge(input=k, comparison=q)))


def _probe_int_array_cmp(g, s, t):
    q, k = _positions(g, s)
    return _masked(g, s, g.cmp_lt(input=k, comparison=t["length"]))


def _probe_causal_index_cmp(g, s, t):
    q, k = _positions(g, s)
    return _masked(g, s, g.cmp_le(input=k, comparison=q))


def _probe_int_literal_window(g, s, t):
    q, k = _positions(g, s)
    return _masked(g, _masked(g, s, g.cmp_le(input=k, comparison=q)), g.cmp_ge(input=k, comparison=g.sub(a=q, b=8)))


def _probe_chunk_mod(g, s, t):
    q, k = _positions(g, s)
    start = lambda x: g.sub(a=x, b=g.mod(input0=x, input1=32))  # noqa: E731
    return _masked(g, s, g.cmp_eq(input=start(q), comparison=start(k)))


def _probe_abs_int(g, s, t):
    q, k = _positions(g, s)
    return g.add(a=s, b=g.mul(a=g.abs(input=g.sub(a=k, b=q)), b=-0.01))


def _probe_int_scalar(g, s, t):
    q, k = _positions(g, s)
    return _masked(g, s, g.cmp_lt(input=k, comparison=t["n"]))


PER_HEAD = TensorInfo("array", FLOAT, (1, 8, 1, 1))
OP_PROBES = {  # name -> (score_mod, tensors); each is built forward and backward on B1 T128 S128 N8 H64
    "literal_cmp": (_probe_literal_cmp, {}),
    "chained_selects": (_probe_chained_selects, {}),
    "logical_and": (_probe_logical_and, {}),
    "logical_or": (_probe_logical_or, {}),
    "logical_not": (_probe_logical_not, {}),
    "min_max_int": (_probe_min_max_int, {}),
    "max_float": (_probe_max_float, {}),
    "cmp_eq_int": (_probe_cmp_eq_int, {}),
    "floor_div_cmp_eq": (_probe_floor_div_cmp_eq, {}),
    "mod_int": (_probe_mod_int, {}),
    "select_arrays": (_probe_select_arrays, {"a": PER_HEAD, "b": PER_HEAD}),
    "int_array_cmp": (_probe_int_array_cmp, {"length": TensorInfo("array", INT, (1, 1, 1, 1))}),
    "causal_index_cmp": (_probe_causal_index_cmp, {}),
    "int_literal_window": (_probe_int_literal_window, {}),
    "chunk_mod": (_probe_chunk_mod, {}),
    "abs_int": (_probe_abs_int, {}),
    "int_scalar": (_probe_int_scalar, {"n": TensorInfo("scalar", INT)}),
}
# What sdpagraph's own mask lowering (scoremod.masks) emits: these must build. (A boolean
# aux array used as a select mask crashed the probe process with SIGFPE on cuDNN 9.19.)
MASK_LOWERING_PROBES = ("causal_index_cmp", "int_literal_window", "chunk_mod")


def run_op_probes(names):
    """Entry point of the probe subprocess: one line per probe and direction."""
    env = builder.build_environment()
    spec = AttentionSpec(batch=1, q_len=128, kv_len=128, num_heads=8, num_kv_heads=8, head_dim=64, head_dim_v=64,
                         dtype="bfloat16", scale=0.125)
    for name in names:
        fn, tensors = OP_PROBES[name]
        ir = trace_score_mod(fn, tensors)
        outcome = []
        for direction in ("forward", "backward"):
            print(f"PROBE-START {name} {direction}", flush=True)
            try:
                builder.compile_graph(spec, ir, direction, env)
                outcome.append(f"{direction} builds")
            except Exception as error:  # noqa: BLE001 - the outcome is the finding
                outcome.append(f"{direction} declined ({' '.join(str(error).split())[-160:]})")
        print(f"PROBE {name}: {'; '.join(outcome)}", flush=True)


def test_score_mod_op_support(report):
    """Which pointwise ops cuDNN's score_mod fusion takes, each in its own process (a decline may crash)."""
    pending, outcomes = list(OP_PROBES), {}
    script = f"import sys; sys.path.insert(0, {HERE!r}); import test_builder_gpu as t; t.run_op_probes(sys.argv[1:])"
    while pending:
        done = subprocess.run([sys.executable, "-c", script, *pending], capture_output=True, text=True, timeout=300)
        started = None
        for line in done.stdout.splitlines():
            if line.startswith("PROBE-START "):
                started = line.split()[1]
            elif line.startswith("PROBE "):
                name, outcome = line[len("PROBE "):].split(": ", 1)
                outcomes[name] = outcome
        if started is not None and started not in outcomes:
            outcomes[started] = f"crashed the process (exit {done.returncode}): {done.stderr.strip()[-200:]}"
        if started is None:
            pytest.fail(f"probe process failed before probing: {done.stderr[-2000:]}")
        pending = [name for name in pending if name not in outcomes]
    for name, outcome in outcomes.items():
        report(f"[op probe] {name:<18} {outcome}")
    broken = [name for name in MASK_LOWERING_PROBES if outcomes[name] != "forward builds; backward builds"]
    assert not broken, f"ops of sdpagraph's mask lowering do not build: {broken}"


# ----------------------------------------------------------------------------- tests (the grid last: it takes longest)

def test_inference_graph_matches_training_forward(cache, handle, build_times):
    case = Case("inference_causal", 2, 512, 512, 8, 2, 128, options=dict(is_causal=True, score_mod=mods.softcap(30.0)))
    inputs = make_inputs(case, seed=1)
    spec, ir = inputs["call"].spec, inputs["call"].score_mod
    assert check_graphs(spec, ir, False, cache).supported
    inference = cached_graph(spec, ir, "inference", cache).compiled
    forward = cached_graph(spec, ir, "forward", cache).compiled
    build_times.append((case.name, "inference", inference.build_time_s, len(inference.blob), inference.workspace_size))
    buffers = operand_buffers(case, inputs, inference.operand_roles)
    scalars = inputs["call"].inputs.mod_scalars
    assert inference.result_roles == ("o",)
    o_inference = execute(inference, spec, ir, buffers, scalars, handle)["o"]
    o_forward = execute(forward, spec, ir, buffers, scalars, handle)["o"]
    assert rel_err(host(o_inference), host(o_forward)) < 1e-3


def test_new_scalar_value_reuses_the_graph(cache, handle):
    softcap_5 = Case("softcap_5", 1, 256, 256, 8, 8, 64, options=dict(score_mod=mods.softcap(5.0)))
    first = make_inputs(dataclasses.replace(softcap_5, options=dict(score_mod=mods.softcap(20.0))))
    second = make_inputs(softcap_5)
    spec, ir = first["call"].spec, first["call"].score_mod
    compiled = cached_graph(spec, ir, "forward", cache).compiled
    builds = cache.stats()["builds"]
    assert cached_graph(second["call"].spec, second["call"].score_mod, "forward", cache).compiled == compiled
    assert cache.stats()["builds"] == builds
    buffers = operand_buffers(softcap_5, second, compiled.operand_roles)
    out = execute(compiled, spec, ir, buffers, second["call"].inputs.mod_scalars, handle)["o"]
    expected = reference(second)[0]
    assert rel_err(host(out), expected) < FORWARD_TOLERANCE


def test_serialized_graphs_execute_and_reload_from_disk(cache, handle):
    case = CASES[1]
    inputs = make_inputs(case)
    spec = inputs["call"].spec
    compiled = cached_graph(spec, None, "forward", cache).compiled
    reloaded = cached_graph(spec, None, "forward", GraphCache(cache.directory)).compiled  # a new process, same directory
    assert reloaded == compiled
    buffers = operand_buffers(case, inputs, compiled.operand_roles)
    from_blob = execute(compiled, spec, None, buffers, {}, handle)["o"]
    graph = rebuilt_graph(spec, None, "forward")
    rebuilt = result_buffers(spec, ("o", "stats"), TORCH_TYPES[case.dtype])
    workspace = torch.empty(max(graph.get_workspace_size(), 1), dtype=torch.uint8, device="cuda")
    graph.execute({compiled.uids[r]: buffers[r] for r in compiled.operand_roles}
                  | {compiled.uids[r]: rebuilt[r] for r in ("o", "stats")}, workspace, handle=handle)
    torch.cuda.synchronize()
    assert not blob_failures, "serialized graphs failed to execute:\n" + "\n".join(blob_failures)
    assert torch.equal(from_blob, rebuilt["o"]), "a deserialized graph must compute bit-identical output"


@pytest.mark.parametrize("case, expect", DECLINED_BEFORE_BUILDING, ids=lambda x: getattr(x, "name", ""))
def test_crash_prone_configs_are_declined_before_building(cache, case, expect):
    call = make_inputs(case)["call"]
    builds = cache.stats()["builds"]
    answer = check_graphs(call.spec, call.score_mod, True, cache)
    assert not answer.supported and expect in answer.reason
    assert cache.stats()["builds"] == builds


@pytest.mark.parametrize("head_dim, expect", [(68, "multiple of 8"), (72, None), (512, None)])
def test_unsupported_configs_answer_with_a_reason(cache, head_dim, expect, report):
    call = make_inputs(Case(f"h{head_dim}", 1, 128, 128, 8, 8, head_dim))["call"]
    answer = check_graphs(call.spec, None, True, cache)
    report(f"[head dim {head_dim}] supported={answer.supported} backend={answer.backend} reason: {answer.reason}")
    if expect is not None:
        assert not answer.supported and answer.backend == "" and expect in answer.reason
    float32 = make_inputs(dataclasses.replace(Case("f32", 1, 128, 128, 8, 8, 64), dtype="float32"))["call"]
    assert "bfloat16 or float16" in check_graphs(float32.spec, None, True, cache).reason


@pytest.mark.parametrize("case", CASES, ids=lambda case: case.name)
def test_forward_and_backward_match_xla(case, cache, handle, build_times, report):
    inputs = make_inputs(case)
    call = inputs["call"]
    spec, ir = call.spec, call.score_mod
    answer = check_graphs(spec, ir, True, cache)
    report(f"[{case.name}] {spec.summary()}: supported={answer.supported} ({answer.reason})")
    if not answer.supported:
        if case.may_decline:
            pytest.skip(f"cuDNN declines: {answer.reason}")
        pytest.fail(f"not supported: {answer.reason}")
    builds = cache.stats()["builds"]
    forward = cached_graph(spec, ir, "forward", cache).compiled
    backward = cached_graph(spec, ir, "backward", cache).compiled
    assert cache.stats()["builds"] == builds, "the support query's graphs were rebuilt"
    for compiled in (forward, backward):
        build_times.append((case.name, compiled.direction, compiled.build_time_s, len(compiled.blob),
                            compiled.workspace_size))

    buffers = operand_buffers(case, inputs, forward.operand_roles)
    scalars = call.inputs.mod_scalars or {}
    out = execute(forward, spec, ir, buffers, scalars, handle)
    buffers.update(o=out["o"], stats=out["stats"], dO=to_torch(inputs["host"]["dO"], TORCH_TYPES[case.dtype]))
    grads = execute(backward, spec, ir, buffers, scalars, handle)

    expected_out, expected_lse, expected_grads = reference(inputs)
    layout = _layout(spec, call.inputs)
    allowed = np.asarray(allowed_mask(spec, call.inputs, layout))
    has_key = np.broadcast_to(allowed.any(-1), (spec.batch, spec.num_heads, spec.q_len))  # (B, N, T)
    rows = np.transpose(has_key, (0, 2, 1))[..., None]  # (B, T, N, 1): query rows with a visible key
    unreachable = np.asarray(layout.q_valid)[:, :, None, None] & ~rows  # valid rows that see no key: must be 0
    kv_rows = np.asarray(layout.kv_valid)[:, :, None, None]
    stats = host(out["stats"])
    stats = np.transpose(stats, (0, 2, 1)) if spec.segments else stats

    errors = {
        "o": rel_err(host(out["o"]), expected_out, rows),
        "stats": rel_err(stats, expected_lse, has_key),
        "dq": rel_err(host(grads["dq"]), expected_grads["dq"], rows),
        "dk": rel_err(host(grads["dk"]), expected_grads["dk"], kv_rows),
        "dv": rel_err(host(grads["dv"]), expected_grads["dv"], kv_rows),
    }
    if "dbias" in grads:
        errors["dbias"] = rel_err(host(grads["dbias"]), expected_grads["dbias"])
    unreachable_max = max(float(np.abs(host(out["o"])[np.broadcast_to(unreachable, out["o"].shape)]).max(initial=0)),
                          float(np.abs(host(grads["dq"])[np.broadcast_to(unreachable, grads["dq"].shape)]).max(initial=0)))
    report(f"[{case.name}] rel err " + " ".join(f"{k} {v:.2e}" for k, v in errors.items())
          + f" | fully masked rows: {int(unreachable.sum())}, max |o|,|dq| there {unreachable_max:.2e}"
          + f" | build {forward.build_time_s * 1e3:.0f}/{backward.build_time_s * 1e3:.0f} ms")
    for name, error in errors.items():
        tolerance = FORWARD_TOLERANCE if name in ("o", "stats") else BACKWARD_TOLERANCE
        assert error < tolerance, f"{name}: relative error {error:.3e} >= {tolerance}"
    assert unreachable_max == 0.0, "rows with no visible key must give 0 output and 0 dq"


def test_build_environment_reads_the_versions_the_frontend_reports():
    """The cache key's versions come from the loaded libcudnn and package metadata, not an import."""
    env = builder.build_environment()
    version = cudnn.backend_version()
    assert env.cudnn_version == f"{version // 10000}.{version % 10000 // 100}.{version % 100}"
    assert env.frontend_version == cudnn.__version__
    assert builder._loaded_cudnn_version() == version
