"""Context parallelism for sliding windows: the "halo" strategy (`parallel.halo`) on 8 CPU devices,
in natural order and load-balanced.

As in tests/test_context_parallel.py, the first test runs this file again in a subprocess with
`--xla_force_host_platform_device_count=8`, where the device tests run. The XLA backend runs as it
is; the cuDNN path runs with test_sharding's stand-ins for the graph builder and the executor (each
device runs one whole call, differentiated as on one device: no block backward to stand in for).
"""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import sdpagraph
from sdpagraph import mods
from sdpagraph.parallel.strategy import choose_strategy
from sdpagraph.spec import UNBOUNDED, AttentionSpec
from tests.devices import has_cpu_devices, make_mesh, on_axis_types, rerun_with_cpu_devices
from tests.test_context_parallel import assert_same, value_and_grads
from sdpagraph.backends.cudnn import execute as cudnn_execute
from sdpagraph.graphs.operands import KV_GRADS
from tests.cudnn_standin import stats_backward_executor
from tests.test_sharding import cudnn_on_cpu, random_ids  # noqa: F401 (a fixture)

DEVICES = 8
HERE_WITH_DEVICES = has_cpu_devices(DEVICES)
needs_devices = pytest.mark.skipif(not HERE_WITH_DEVICES, reason=f"runs in the {DEVICES}-device subprocess")
B, T, N, H = 2, 64, 4, 8


def test_in_a_process_with_eight_cpu_devices():
    if HERE_WITH_DEVICES:
        pytest.skip("this process has the devices: the tests below run here")
    rerun_with_cpu_devices(__file__, DEVICES, timeout=1200)


def case(name):
    """(attention kwargs, K): windows against the shard of T / cp tokens (16 at cp=4)."""
    slopes = np.linspace(0.1, 1.0, N).astype(np.float32)
    return {
        "narrow": (dict(is_causal=True, local_window_size=(5, 0)), N),  # within one shard
        "one_shard": (dict(is_causal=True, local_window_size=(16, 0)), N),
        "wide": (dict(is_causal=True, local_window_size=(37, 0)), N),  # spans 3 shards at cp=4
        "two_sided": (dict(local_window_size=(6, 21)), N),
        "gqa": (dict(is_causal=True, local_window_size=(20, 0)), 2),
        "softcap": (dict(is_causal=True, local_window_size=(9, 0), score_mod=mods.softcap(3.0)), N),
        "alibi": (dict(is_causal=True, local_window_size=(9, 0), score_mod=mods.alibi(slopes)), 2),
        "relative_jnp": (dict(local_window_size=(7, 18),
                              score_mod=lambda s, b, h, q, kv: s - 0.05 * jnp.abs(q - kv).astype(s.dtype)), N),
    }[name]


def run(name, cp, axis_type, impl, strategy="halo", seed=0, load_balanced=False, kwargs=None, head_dim_v=H):
    """(the context-parallel step's value and gradients in natural order, the one-device XLA
    reference's, the HLO) of `case(name)`, or of `(kwargs, K)` when given; values of `head_dim_v`."""
    kwargs, K = kwargs or case(name)
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B, T, N, H)).astype(np.float32)
    k = rng.standard_normal((B, T, K, H)).astype(np.float32)
    v = rng.standard_normal((B, T, K, head_dim_v)).astype(np.float32)
    cot = rng.standard_normal((B, T, N, head_dim_v)).astype(np.float32)
    ref = value_and_grads(lambda q, k, v: sdpagraph.attention(q, k, v, implementation="xla", **kwargs))(q, k, v, cot)
    order = (lambda x: sdpagraph.load_balance(x, cp)) if load_balanced else (lambda x: x)  # noqa: E731
    back = (lambda x: sdpagraph.unload_balance(x, cp)) if load_balanced else (lambda x: x)  # noqa: E731
    m = make_mesh((cp,), ("cp",), axis_type)
    with jax.set_mesh(m):
        step = jax.jit(value_and_grads(lambda q, k, v: sdpagraph.attention(
            q, k, v, implementation=impl, context_parallel_axis="cp", context_parallel_strategy=strategy,
            load_balanced=load_balanced, **kwargs)))
        args = tuple(jax.device_put(order(x), NamedSharding(m, P(None, "cp"))) for x in (q, k, v, cot))
        compiled = step.lower(*args).compile()
        (loss, out), grads = compiled(*args)
        for x, like in zip((out, *grads), args):
            assert x.sharding.is_equivalent_to(like.sharding, 4), (x.sharding, like.sharding)
        ours = (loss, back(out)), tuple(back(g) for g in grads)
    return ours, ref, compiled.as_text()


def assert_same_step(ours, ref, tol=2e-5):
    """Outputs and gradients within `tol`; the loss, a sum of B·T·N·H products whose float32 rounding
    depends on the order of the sum, within 1e-4."""
    (loss, out), grads = ours
    (ref_loss, ref_out), ref_grads = ref
    np.testing.assert_allclose(np.asarray(loss), np.asarray(ref_loss), rtol=1e-4, atol=1e-4)
    assert_same((out, grads), (ref_out, ref_grads), tol)


def assert_no_gather(hlo):
    assert "collective-permute" in hlo
    assert not re.search(r"\ball-gather(?:-start)?\(", hlo), "the halo gathers nothing"
    assert "all-to-all" not in hlo


def seed_of(*params):
    """Fresh random inputs per test case, the same on every run of it."""
    return sum(ord(c) * (i + 1) for i, c in enumerate(repr(params)))


@needs_devices
@pytest.mark.parametrize("name, cp, load_balanced, axis_type", on_axis_types(
    [("narrow", 4, False), ("one_shard", 4, False), ("wide", 4, False), ("wide", 2, False), ("two_sided", 4, False),
     ("two_sided", 8, False), ("gqa", 8, False), ("softcap", 2, False), ("alibi", 4, False), ("relative_jnp", 8, False),
     # load-balanced: blocks of T/(2cp), device i holding blocks i and 2cp-1-i
     ("narrow", 4, True), ("one_shard", 2, True), ("wide", 4, True), ("wide", 8, True), ("two_sided", 2, True),
     ("two_sided", 8, True), ("gqa", 4, True), ("alibi", 8, True), ("relative_jnp", 4, True)],
    explicit=[("wide", 4, False), ("two_sided", 8, False), ("wide", 8, True)]))
def test_halo_on_xla_equals_one_device(name, cp, load_balanced, axis_type):
    ours, ref, hlo = run(name, cp, axis_type, "xla", seed=seed_of(name, cp, load_balanced), load_balanced=load_balanced)
    assert_same_step(ours, ref)
    assert_no_gather(hlo)


def halo_cases(kwargs, blocks):
    """The (hl, hr) halo lengths of the `blocks` equal blocks of a windowed call: the window's sides,
    cut at the sequence's ends."""
    left, right = kwargs["local_window_size"]
    right = 0 if kwargs.get("is_causal") else right
    block = T // blocks
    return {(min(left, b * block), min(right, T - (b + 1) * block)) for b in range(blocks)}


@needs_devices
@pytest.mark.parametrize("name, cp, load_balanced, axis_type", on_axis_types(
    [("narrow", 4, False), ("wide", 4, False), ("two_sided", 8, False), ("gqa", 2, False), ("softcap", 4, False),
     ("alibi", 8, False), ("wide", 4, True), ("two_sided", 8, True), ("alibi", 2, True), ("narrow", 4, True),
     ("gqa", 2, True), ("softcap", 8, True)],
    explicit=[("wide", 4, False), ("wide", 4, True), ("narrow", 4, True)]))
def test_halo_on_the_cudnn_path(name, cp, load_balanced, axis_type, cudnn_on_cpu, monkeypatch):
    # Backward graphs that read the o and stats they are given, as cuDNN's (a split block merges two)
    monkeypatch.setattr(cudnn_execute, "call_executor", stats_backward_executor)
    ours, ref, hlo = run(name, cp, axis_type, "cudnn", seed=seed_of(name, cp, load_balanced, "cudnn"),
                         load_balanced=load_balanced)
    assert_same_step(ours, ref, tol=3e-5)
    assert_no_gather(hlo)
    # Per case of halo lengths (blocks near the ends have shorter halos): a causal window its halo
    # covers as square top-left calls, its own keys (L, L) and its halo (hl, hl) with the band
    # (0, unbounded) (`halo_split`); otherwise one call over [halo ++ block], bottom-right aligned.
    kwargs = case(name)[0]
    blocks = cp * (2 if load_balanced else 1)
    block, left = T // blocks, kwargs["local_window_size"][0]
    split = kwargs.get("is_causal") and name != "alibi"  # alibi reads positions: one call
    want = set()
    for hl, hr in halo_cases(kwargs, blocks):
        if split and (hl == 0 or hl == left <= block):
            want |= {(block, block, "top_left")} | ({(hl, hl, "top_left")} if hl else set())
        else:
            want.add((block, hl + block + hr, "bottom_right"))
    built = {(s.q_len, s.kv_len, s.causal_alignment) for s, _, _ in cudnn_on_cpu[0]}
    assert built == want, built
    if split:  # the block's own keys: the call's causal window; its halo: the band (0, unbounded), no causal mask
        bands = {(s.is_causal, s.window) for s, _, _ in cudnn_on_cpu[0] if s.causal_alignment == "top_left"}
        halo_band = (False, (0, UNBOUNDED))
        assert bands <= {(True, tuple(kwargs["local_window_size"])), halo_band}, bands
        assert (halo_band in bands) == any(hl == left <= block for hl, _ in halo_cases(kwargs, blocks)), bands
    if split and all(hl in (0, left) for hl, _ in halo_cases(kwargs, blocks)) and left <= block:
        # every device runs the same calls: no lax.switch, whose branch index XLA reads on the host
        assert not re.search(r"\bconditional\(", hlo), "a split halo block runs without a conditional"
        # the halo rows' results join the block's in place, and the halos' gradients are added in
        # place where they came from: nothing pads or concatenates a whole block of the device's tokens
        whole = re.compile(r"= f32\[%d,%d,\d+,%d\]\{[^}]*\} (pad|concatenate)\(" % (B, T // cp, H))
        assert not [line for line in hlo.splitlines() if whole.search(line)], "a pass over the whole block"


@needs_devices
@pytest.mark.parametrize("cp, load_balanced, head_dim_v", [(2, False, H // 2), (4, True, H // 2), (2, False, H)])
def test_the_halo_gradients_go_back_stacked_where_dk_and_dv_stack(cp, load_balanced, head_dim_v, cudnn_on_cpu,
                                                                   monkeypatch):
    """The halo part's backward writes dk and dv as one stacked result where they have one shape, which
    goes back as it is; values with a head dim of their own give them as a pair, sent back as such
    (`transfer.grads_to_send`)."""
    asked = []

    def recording(static, graph, operands, results):
        asked.append(set(results))
        return stats_backward_executor(static, graph, operands, results)

    monkeypatch.setattr(cudnn_execute, "call_executor", recording)
    ours, ref, hlo = run("narrow", cp, "auto", "cudnn", seed=seed_of("head_dim_v", cp, load_balanced, head_dim_v),
                         load_balanced=load_balanced, head_dim_v=head_dim_v)
    assert_same_step(ours, ref, tol=3e-5)
    assert_no_gather(hlo)
    built = {(s.head_dim, s.head_dim_v) for s, _, _ in cudnn_on_cpu[0]}
    assert built == {(H, head_dim_v)}, built
    stacked = [roles for roles in asked if KV_GRADS in roles]
    assert len(stacked) == (1 if head_dim_v == H else 0), asked  # the halo part's backward alone


@needs_devices
@pytest.mark.parametrize("cp, transfers", [(2, 1), (4, 2)])
def test_a_load_balanced_halo_sends_its_blocks_halos_together(cp, transfers, cudnn_on_cpu, monkeypatch):
    """Both slots' halos in one transfer each way where no device sends or receives twice (cp = 2:
    device 0 sends block 0's tail to device 1, device 1 block 2's to device 0); at cp = 4 the middle
    devices send one piece per slot, so two transfers. Forward and backward alike."""
    monkeypatch.setattr(cudnn_execute, "call_executor", stats_backward_executor)
    ours, ref, hlo = run("narrow", cp, "auto", "cudnn", seed=seed_of("narrow", cp, True, "cudnn"), load_balanced=True)
    assert_same_step(ours, ref, tol=3e-5)
    permutes = len(re.findall(r"\bcollective-permute(?:-start)?\(", hlo))
    assert permutes == 2 * transfers, permutes


def _adjoint_gap(cp, slots, wanted_per_route, block, offset, length, seed, stacked=False):
    """max |send_back - autodiff's transpose of receive| for random gradients of every piece, given
    to `send_back` as pairs or `stacked` (one (2, ...) array each)."""
    from jax.sharding import Mesh
    from sdpagraph.parallel import halo_exchange as hx

    routes = [None if w is None else hx.route(block, w, offset, length) for w in wanted_per_route]
    rng = np.random.default_rng(seed)
    k, v = (jnp.asarray(rng.standard_normal((1, cp * slots * block, 3)), jnp.float32) for _ in range(2))
    grads = [jnp.asarray(rng.standard_normal((2, 1, cp, length, 3)), jnp.float32) for _ in routes]
    local = lambda gs: [None if r is None else (g[0][:, 0], g[1][:, 0]) for r, g in zip(routes, gs)]  # noqa: E731

    def transpose(k, v, *gs):
        return jax.vjp(lambda k, v: hx.receive(routes, "x", (k, v)), k, v)[1](local(gs))

    def ours(k, v, *gs):
        given = [None if r is None else g[:, :, 0] for r, g in zip(routes, gs)] if stacked else local(gs)
        return hx.send_back(routes, "x", given, (jnp.zeros_like(k), jnp.zeros_like(v)))

    mesh = Mesh(np.array(jax.devices()[:cp]), ("x",))
    run = lambda f: jax.jit(jax.shard_map(  # noqa: E731
        f, mesh=mesh, in_specs=(P(None, "x"), P(None, "x")) + (P(None, None, "x"),) * len(grads),
        out_specs=(P(None, "x"), P(None, "x")), check_vma=False))(k, v, *grads)
    return max(float(jnp.abs(a - b).max()) for a, b in zip(run(transpose), run(ours)))


@needs_devices
@pytest.mark.parametrize("cp", [2, 4, 8])
def test_send_back_is_the_transpose_of_receive(cp):
    """`halo_exchange.send_back` against autodiff's transpose of `receive`, with gradients on every
    device (also where a device reads no piece): the load-balanced halo's routes, and random ones
    (own slices, several rounds, per-device slots, devices that read nothing)."""
    blocks = [(i, 2 * cp - 1 - i) for i in range(cp)]
    holder = {b: (d, s) for d, held in enumerate(blocks) for s, b in enumerate(held)}
    balanced = [[holder[held[s] - 1] if held[s] else None for held in blocks] for s in range(2)]
    assert _adjoint_gap(cp, 2, balanced, 8, 5, 3, seed=cp) < 1e-5
    assert _adjoint_gap(cp, 2, balanced, 8, 5, 3, seed=cp, stacked=True) < 1e-5
    rng = np.random.default_rng(cp)
    for trial in range(6):
        slots = int(rng.integers(1, 4))
        wanted = [[None if rng.random() < 0.25 else (int(rng.integers(cp)), int(rng.integers(slots)))
                   for _ in range(cp)] for _ in range(int(rng.integers(1, 4)))]
        wanted = [w if any(x is not None for x in w) else None for w in wanted]
        if any(w is not None for w in wanted):
            assert _adjoint_gap(cp, slots, wanted, 6, 2, 3, seed=trial, stacked=trial % 2 == 1) < 1e-5, (trial, wanted)


def test_transfers_merge_routes_whose_devices_send_and_receive_once():
    from sdpagraph.parallel.halo_exchange import route, transfers

    # cp = 2, load-balanced: slot 0's block 1 reads block 0 (device 0, slot 0); slot 1's block 3 reads
    # block 2 (device 1, slot 1) and block 2 reads block 1 (device 1's own slot 0)
    slot0, slot1 = route(16, [None, (0, 0)], 11, 5), route(16, [(1, 1), (1, 0)], 11, 5)
    (merged,) = transfers([slot0, slot1])
    assert sorted(merged.pairs) == [(0, 1), (1, 0)] and merged.slots == (0, 1)
    assert merged.takes == ((1, 1), (0, 0))
    # a device sending in both: two transfers
    assert len(transfers([route(16, [None, (0, 0), (1, 0)], 11, 5), route(16, [(1, 1), (2, 1), None], 11, 5)])) == 2


@needs_devices
def test_check_support_names_the_halo_and_its_block_backend(cudnn_on_cpu):
    q = jax.ShapeDtypeStruct((B, T, N, H), jnp.float32)
    with jax.set_mesh(make_mesh((4,), ("cp",))):
        for strategy in ("halo", "auto"):  # "auto" takes the halo for a narrow window
            for load_balanced in (False, True):
                answer = sdpagraph.check_support(q, q, q, is_causal=True, local_window_size=(9, 0),
                                                 context_parallel_axis="cp", context_parallel_strategy=strategy,
                                                 load_balanced=load_balanced)
                assert (answer.supported, answer.backend) == (True, "cudnn"), answer
                assert "halo over 'cp', cp=4" in answer.reason and "cuDNN" in answer.reason, answer
        answer = sdpagraph.check_support(q, q, q, is_causal=True, local_window_size=(9, 0), implementation="xla",
                                         context_parallel_axis="cp", context_parallel_strategy="auto")
        assert answer.backend == "xla" and "halo over 'cp'" in answer.reason, answer
        answer = sdpagraph.check_support(q, q, q, is_causal=True, context_parallel_axis="cp",
                                         context_parallel_strategy="auto")  # no window: not the halo
        assert answer.backend == "cudnn" and "all_to_all over 'cp', cp=4" in answer.reason, answer


def test_auto_takes_the_halo_for_windows_it_serves_with_less_traffic():
    spec = lambda t, window, causal=True, k=16: AttentionSpec(  # noqa: E731
        1, t, t, 16, k, 128, 128, "bfloat16", 0.1, is_causal=causal, window=window)
    for load_balanced in (False, True):
        for t in (32768, 131072):
            assert choose_strategy(spec(t, (1024, 0)), 2, "auto", load_balanced=load_balanced) == "halo"
    assert choose_strategy(spec(32768, (1024, 512), causal=False), 8, "auto") == "halo"
    # A window that makes the halo move more than all_to_all (3 of 4 blocks, both ways): all_to_all.
    assert choose_strategy(spec(32768, (24576, 24576), causal=False), 4, "auto") == "all_to_all"
    # ... unless the heads do not divide cp (no all_to_all; the ring would run XLA blocks).
    assert choose_strategy(spec(32768, (24576, 24576), causal=False, k=1), 4, "auto") == "halo"
    assert choose_strategy(spec(32768, (1024, -1), causal=False), 2, "auto") == "all_to_all"  # unbounded side
    assert choose_strategy(spec(32768, (1024, 0)), 2, "halo") == "halo"
    assert choose_strategy(spec(32768, (1024, 0)), 2, "ring") == "ring"
    assert choose_strategy(spec(32768, (-1, -1)), 2, "auto") == "all_to_all"  # no window: unchanged


@needs_devices
def test_halo_errors_name_the_argument():
    q = jnp.zeros((B, T, N, H), jnp.float32)
    m = make_mesh((4,), ("cp",))
    halo = dict(context_parallel_axis="cp", context_parallel_strategy="halo", mesh=m)
    prefix = r"context_parallel_axis='cp': context_parallel_strategy='halo' "
    with pytest.raises(ValueError, match=prefix + r"needs a sliding window .*local_window_size=\(-1, -1\)"):
        sdpagraph.attention(q, q, q, is_causal=True, **halo)
    with pytest.raises(ValueError, match=prefix + r"needs a sliding window .*local_window_size=\(4, -1\)"):
        sdpagraph.attention(q, q, q, local_window_size=(4, -1), **halo)
    with pytest.raises(ValueError, match=prefix + "runs packed documents with is_causal=True and no local_window_size"):
        sdpagraph.attention(q, q, q, is_causal=True, local_window_size=(4, 0),
                            segment_ids=random_ids(np.random.default_rng(0), B, T, 3), **halo)
    with pytest.raises(ValueError, match=prefix + r"needs chunk_size=12 to divide the blocks of 16 tokens .*\(T/cp\)"):
        sdpagraph.attention(q, q, q, is_causal=True, local_window_size=(4, 0), chunk_size=12, **halo)
    with pytest.raises(ValueError, match=prefix + r"needs chunk_size=12 .*blocks of 8 tokens .*load_balanced=True"):
        sdpagraph.attention(q, q, q, is_causal=True, chunk_size=12, load_balanced=True, **halo)
    with pytest.raises(ValueError, match=prefix + r"needs self-attention lengths: .*T=64 != .*S=32"):
        sdpagraph.attention(q, q[:, :32], q[:, :32], local_window_size=(4, 4), **halo)
    with pytest.raises(ValueError, match="context_parallel_axis='cp': context parallelism does not take bias"):
        sdpagraph.attention(q, q, q, jnp.ones((T, T)), is_causal=True, local_window_size=(4, 0), **halo)


@needs_devices
def test_halo_with_a_batch_axis_and_inside_shard_map():
    kwargs, K = case("two_sided")
    rng = np.random.default_rng(3)
    q = rng.standard_normal((B, T, N, H)).astype(np.float32)
    k, v = (rng.standard_normal((B, T, K, H)).astype(np.float32) for _ in range(2))
    cot = rng.standard_normal((B, T, N, H)).astype(np.float32)
    ref = value_and_grads(lambda q, k, v: sdpagraph.attention(q, k, v, implementation="xla", **kwargs))(q, k, v, cot)
    m = make_mesh((2, 4), ("data", "cp"))
    spec = P("data", "cp")
    args = tuple(jax.device_put(x, NamedSharding(m, spec)) for x in (q, k, v, cot))

    def attn(q, k, v, mesh=None):
        return sdpagraph.attention(q, k, v, context_parallel_axis="cp", context_parallel_strategy="halo", mesh=mesh,
                                   **kwargs)

    assert_same(jax.jit(value_and_grads(lambda q, k, v: attn(q, k, v, m)))(*args), ref)  # the batch over "data"
    inner = jax.shard_map(attn, mesh=m, in_specs=spec, out_specs=spec)  # q, k, v are the local blocks
    assert_same(jax.jit(value_and_grads(inner))(*args), ref)


@needs_devices
@pytest.mark.parametrize("strategy", ["halo", "ring", "all_to_all"])
def test_sinks_inside_a_shard_map_over_another_axis_too(strategy):
    """Inside a user's shard_map over ("data", "cp"), q varies over both axes: the sinks' gradient
    must too (summed over both by the transposes), not over "cp" alone."""
    rng = np.random.default_rng(31)
    q, k, v = (jnp.asarray(rng.standard_normal((4, T, N, H)), jnp.float32) for _ in range(3))
    sinks = jnp.asarray(rng.standard_normal(N), jnp.float32)
    kwargs = dict(is_causal=True, local_window_size=(5, 0))
    mesh = make_mesh((2, 2), ("data", "cp"))

    def local(q, k, v, sinks):
        return sdpagraph.attention(q, k, v, sinks=sinks, context_parallel_axis="cp", context_parallel_strategy=strategy,
                                   implementation="xla", **kwargs)

    sharded = jax.shard_map(local, mesh=mesh, in_specs=(P("data", "cp"),) * 3 + (P(),), out_specs=P("data", "cp"))
    loss = lambda f: lambda q, k, v, s: jnp.sum(f(q, k, v, s) ** 2)  # noqa: E731
    got = jax.jit(jax.grad(loss(sharded), argnums=(0, 1, 2, 3)))(q, k, v, sinks)
    one = lambda q, k, v, s: sdpagraph.attention(q, k, v, sinks=s, implementation="xla", **kwargs)  # noqa: E731
    want = jax.grad(loss(one), argnums=(0, 1, 2, 3))(q, k, v, sinks)
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=2e-4, atol=2e-4)
