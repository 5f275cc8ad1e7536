"""Context parallelism for chunked attention (`chunk_size`, Llama 4) on 8 CPU devices.

Chunks aligned with the blocks the devices hold run as the "halo" strategy (`parallel.halo`):
blocks holding whole chunks need no communication at all; blocks inside a longer chunk receive the
keys from their chunk's start (and, non-causal, up to its end) from the devices before (after)
them. Chunks that cut blocks unevenly run another strategy, correctly. As in
tests/test_context_parallel_windows.py, the first test runs this file again with 8 CPU devices.
"""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import sdpagraph
from sdpagraph import mods
from sdpagraph.parallel.strategy import choose_strategy
from sdpagraph.spec import AttentionSpec
from tests.devices import make_mesh, on_axis_types, rerun_with_cpu_devices
from tests.test_context_parallel_windows import (B, DEVICES, HERE_WITH_DEVICES, H, N, T, assert_same_step, needs_devices,
                                                 run, seed_of)
from sdpagraph.backends.cudnn import execute as cudnn_execute
from tests.cudnn_standin import stats_backward_executor
from tests.test_sharding import cudnn_on_cpu  # noqa: F401 (a fixture)

COLLECTIVE = re.compile(r"\b(collective-permute|all-gather|all-to-all)(?:-start)?\(")  # the loss sums by all-reduce


def test_in_a_process_with_eight_cpu_devices():
    if HERE_WITH_DEVICES:
        pytest.skip("this process has the devices: the tests below run here")
    rerun_with_cpu_devices(__file__, DEVICES, timeout=1200)


def case(name):
    """(attention kwargs, K), T = 64: blocks of 64/cp tokens, 64/(2cp) when load-balanced."""
    slopes = np.linspace(0.1, 1.0, N).astype(np.float32)
    return {
        "causal_8": (dict(is_causal=True, chunk_size=8), N),
        "plain_4": (dict(chunk_size=4), N),
        "causal_32": (dict(is_causal=True, chunk_size=32), N),
        "plain_32": (dict(chunk_size=32), 2),
        "causal_64": (dict(is_causal=True, chunk_size=64), N),  # one chunk: the whole sequence
        "window_16": (dict(is_causal=True, chunk_size=16, local_window_size=(5, 0)), N),
        "two_sided_32": (dict(chunk_size=32, local_window_size=(6, 3)), N),
        "alibi_32": (dict(is_causal=True, chunk_size=32, score_mod=mods.alibi(slopes)), 2),
        "alibi_8": (dict(is_causal=True, chunk_size=8, score_mod=mods.alibi(slopes)), N),
        "causal_12": (dict(is_causal=True, chunk_size=12), N),  # cuts the blocks unevenly
        "plain_24": (dict(chunk_size=24, local_window_size=(3, 3)), 2),
    }[name]


def check(name, cp, load_balanced, axis_type, impl, strategy="halo", tol=2e-5):
    ours, ref, hlo = run(name, cp, axis_type, impl, strategy, seed_of(name, cp, load_balanced, impl),
                         load_balanced, kwargs=case(name))
    assert_same_step(ours, ref, tol)
    return hlo


# Blocks holding whole chunks (the block a multiple of chunk_size): no communication.
WHOLE = [("causal_8", 4, False), ("causal_8", 2, True), ("plain_4", 8, True), ("plain_4", 2, False),
         ("window_16", 4, False), ("alibi_8", 4, True)]
# Blocks inside one chunk (chunk_size a multiple of the block): halos from the chunk's start (and end).
WITHIN = [("causal_32", 4, False), ("causal_32", 8, True), ("plain_32", 8, False), ("plain_32", 4, True),
          ("causal_64", 2, False), ("window_16", 8, False), ("two_sided_32", 8, True), ("alibi_32", 4, True)]


@needs_devices
@pytest.mark.parametrize("name, cp, load_balanced, axis_type",
                         on_axis_types(WHOLE, explicit=[("causal_8", 2, True)]))
def test_chunks_inside_blocks_need_no_communication(name, cp, load_balanced, axis_type):
    hlo = check(name, cp, load_balanced, axis_type, "xla")
    assert not COLLECTIVE.search(hlo), COLLECTIVE.search(hlo).group(0)


@needs_devices
@pytest.mark.parametrize("name, cp, load_balanced, axis_type",
                         on_axis_types(WITHIN, explicit=[("causal_32", 8, True), ("plain_32", 8, False)]))
def test_blocks_inside_chunks_take_halos_from_their_chunk(name, cp, load_balanced, axis_type):
    hlo = check(name, cp, load_balanced, axis_type, "xla")
    assert "collective-permute" in hlo
    assert not re.search(r"\b(all-gather|all-to-all)(?:-start)?\(", hlo)


@needs_devices
@pytest.mark.parametrize("name, cp, load_balanced, strategy", [
    ("causal_12", 4, False, "auto"), ("causal_12", 4, True, "auto"), ("plain_24", 4, False, "auto"),
    ("causal_12", 2, True, "ring"), ("plain_24", 2, False, "all_to_all")])
def test_misaligned_chunks_run_another_strategy(name, cp, load_balanced, strategy):
    check(name, cp, load_balanced, "auto", "xla", strategy)


@needs_devices
@pytest.mark.parametrize("name, cp, load_balanced", [
    ("causal_8", 4, False), ("plain_4", 2, True), ("alibi_8", 4, True), ("causal_32", 4, False),
    ("plain_32", 8, True), ("two_sided_32", 4, False), ("alibi_32", 8, True)])
def test_chunks_on_the_cudnn_path(name, cp, load_balanced, cudnn_on_cpu, monkeypatch):
    # Backward graphs that read the o and stats they are given, as cuDNN's (a split block merges two)
    monkeypatch.setattr(cudnn_execute, "call_executor", stats_backward_executor)
    check(name, cp, load_balanced, "auto", "cudnn", tol=3e-5)
    kwargs, _ = case(name)
    size, blocks = kwargs["chunk_size"], cp * (2 if load_balanced else 1)
    block = T // blocks
    split = kwargs.get("is_causal") and "alibi" not in name  # causal blocks as square top-left calls
    built = {(s.q_len, s.kv_len, s.chunk_size, s.causal_alignment) for s, _, _ in cudnn_on_cpu[0]}
    if block % size == 0:  # one graph: the block's call, as on one device (its chunks as packed documents)
        documents = "alibi" not in name and block > size  # a score_mod keeps the chunk mask
        want = (block, block, None, "top_left") if documents else (block, block, size, "top_left" if split else
                                                                   "bottom_right")
        assert built == {want}, built
        return
    # No chunk mask: a block's keys are its chunk's, from its start (and to its end), within the window;
    # split: its own keys, and every key of its halo (a dense (L, hl) call)
    left, right = kwargs.get("local_window_size", (T, T))
    right = 0 if kwargs.get("is_causal") else right
    halos = {(min(left, b * block % size), min(right, -(b + 1) * block % size)) for b in range(blocks)}
    if split:
        want = {(block, block, None, "top_left")} | {(block, hl, None, "top_left") for hl, _ in halos if hl}
    else:
        want = {(block, hl + block + hr, None, "bottom_right") for hl, hr in halos}
    assert built == want, (built, halos)


def test_auto_takes_the_halo_for_chunks_that_fit_the_blocks():
    spec = lambda t, chunk, k=16, causal=True: AttentionSpec(  # noqa: E731
        1, t, t, 16, k, 128, 128, "bfloat16", 0.1, is_causal=causal, chunk_size=chunk)
    for load_balanced in (False, True):
        assert choose_strategy(spec(65536, 8192), 2, "auto", load_balanced=load_balanced) == "halo"  # no traffic
        # One chunk over 8 devices, non-causal: each receives 7 blocks, 4x what all_to_all moves.
        assert choose_strategy(spec(65536, 65536, causal=False), 8, "auto", load_balanced=load_balanced) == "all_to_all"
    assert choose_strategy(spec(65536, 16384), 8, "auto") == "halo"  # 2 blocks per chunk, causal: 1 block back
    assert choose_strategy(spec(65536, 12288), 2, "auto") == "all_to_all"  # misaligned
    assert choose_strategy(spec(65536, 12288, k=1), 2, "auto") == "ring"


@needs_devices
def test_check_support_names_the_strategy_and_the_block_backend(cudnn_on_cpu):
    q = jax.ShapeDtypeStruct((B, T, N, H), jnp.float32)
    with jax.set_mesh(make_mesh((4,), ("cp",))):
        for chunk, strategy in ((8, "halo"), (32, "halo"), (12, "all_to_all")):
            answer = sdpagraph.check_support(q, q, q, is_causal=True, chunk_size=chunk, context_parallel_axis="cp",
                                             context_parallel_strategy="auto")
            assert (answer.supported, answer.backend) == (True, "cudnn"), answer
            assert f"{strategy} over 'cp', cp=4" in answer.reason and "cuDNN" in answer.reason, answer
