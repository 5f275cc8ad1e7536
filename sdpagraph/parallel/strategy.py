"""Which context-parallel strategy a call runs: `choose_strategy` decides "auto" from the call's
global spec, the axis size and what its blocks run on, by the rules and measured thresholds below.
"""
from __future__ import annotations

from sdpagraph.call import PreparedCall
from sdpagraph.graphs.operands import folds_segments
from sdpagraph.parallel import halo_layout
from sdpagraph.spec import AttentionSpec

STRATEGIES = ("ring", "all_to_all", "halo", "auto")
# "auto" takes all_to_all up to this sequence length when the heads divide the axis: on two H200s
# all_to_all beat the load-balanced ring at both lengths measured, 1.33x at T16384 and 1.04x at
# T65536 (bench/multi_gpu.py, docs/results/h200x2-2026-11-24-multi-gpu.md). Beyond the longest
# length measured the ring, whose transfers hide better the longer its blocks, is kept.
AUTO_ALL_TO_ALL_MAX_LEN = 65536
# "auto" takes the ring for packed documents on packed graphs (one call a step, `RingPlan.whole_steps`)
# from this sequence length: on two H100s it beat all_to_all at both lengths measured, 1.262x against
# 1.221x of one GPU at T32768 and 1.494x against 1.399x at T131072 (docs/results/
# h100x2-2026-11-26-ring-one-transfer.md). Shorter, unmeasured: the dense rule applies.
AUTO_DOCUMENTS_RING_MIN_LEN = 32768
# "auto" takes the halo (windows, chunks) while it moves at most this share of what all_to_all moves
# (`_halo_traffic_share`): rows (least cp, share) in order, the first whose least cp the call's cp
# reaches applies.
# Design value until bench/multi_gpu.py --part cp-long measures the crossover on GPUs: both run one
# call per device over the same keys, so the one that moves fewer bytes wins, and the ring runs
# windows and chunks on XLA blocks (40x slower than one GPU on two H100s, window (1024, 0) T32768).
# Measured rows go first, e.g. ((4, 0.5), (2, 0.8), (1, 1.0)).
AUTO_HALO_TRAFFIC = ((1, 1.0),)



def halo_packed_graphs(call: PreparedCall) -> bool:
    """Whether the halo's packed documents run on packed graphs: no mod at all (the halo's block graphs
    take none with documents; a mod that reads positions would count from each document's start),
    and the packed layout (`folds_segments`)."""
    mods = call.score_mod is not None or call.inputs.python_mods is not None
    return not mods and not folds_segments(call.spec, call.score_mod)


def choose_strategy(spec: AttentionSpec, cp: int, strategy: str, ring_on_xla: bool = False,
                    load_balanced: bool | str = False, packed_graphs: bool = False,
                    halo_documents: bool = False) -> str:
    """The strategy a call runs; 'auto' decides here, in this order (`spec`: global lengths):
    1. "halo" for bounded sliding windows, chunks that fit the blocks, and packed documents in natural
       order on packed graphs (`halo_documents`: `halo_packed_graphs`) whose `max_seqlen_kv` reaches
       back one block at most (`halo_layout.unsupported`), while its traffic is at most
       AUTO_HALO_TRAFFIC's share of all_to_all's (`_halo_traffic_share`), or when the heads do not
       divide cp (no all_to_all; the ring runs windows and chunks on XLA blocks);
    2. the ring for packed documents on packed graphs (`packed_graphs`: no score_mod, so the ring's
       blocks run one packed call a step) when T >= AUTO_DOCUMENTS_RING_MIN_LEN;
    3. all_to_all when the heads divide cp and either T <= AUTO_ALL_TO_ALL_MAX_LEN, or the ring would
       run XLA blocks (`ring_on_xla`: windows, mask_mods; all_to_all runs those on cuDNN), or the call
       has packed documents the ring would run on the dense twin (with a score_mod: per chunk pair,
       every tile computed; all_to_all runs them on bins per device). Measured on two GPUs up to
       T65536 for dense calls: the ring's transfers hide behind its blocks' compute only when blocks
       are long, while all_to_all runs one whole-sequence call per device but moves q, k, v and o
       unhidden;
    4. else the ring."""
    if strategy != "auto":
        return strategy
    heads_divide = spec.num_heads % cp == 0 and spec.num_kv_heads % cp == 0
    # Packed documents take the halo in natural order only: load-balanced, on 2 H100s at T32768 it ran
    # 0.85x of the ring (4.50 against 3.82 ms; docs/results/h100x2-2026-11-26-documents-halo.md).
    documents_balanced = bool(spec.segments) and bool(load_balanced)
    if not documents_balanced and halo_layout.unsupported(spec, cp, load_balanced, halo_documents) is None:
        share = _halo_traffic_share(spec, cp, load_balanced)
        limit = next(limit for least, limit in AUTO_HALO_TRAFFIC if cp >= least)
        if not heads_divide or share <= limit:
            return "halo"
    if spec.segments and packed_graphs and not ring_on_xla and spec.q_len >= AUTO_DOCUMENTS_RING_MIN_LEN:
        return "ring"
    ring_slow = ring_on_xla or bool(spec.segments)
    return "all_to_all" if heads_divide and (spec.q_len <= AUTO_ALL_TO_ALL_MAX_LEN or ring_slow) else "ring"


def _halo_traffic_share(spec: AttentionSpec, cp: int, load_balanced: bool) -> float:
    """What the halo moves per device over what all_to_all moves, forward (the backward moves the
    same again in both): the halo, the keys and values its blocks reach (K heads each); all_to_all,
    (cp-1)/cp of the device's q, k, v and o ((2N + 2K) heads of T/cp tokens). 0 on one device."""
    halo_bytes = halo_layout.HaloLayout(spec, cp, load_balanced).received * 2 * spec.num_kv_heads
    all_to_all_bytes = (spec.q_len // cp) * (cp - 1) / cp * 2 * (spec.num_heads + spec.num_kv_heads)
    return halo_bytes / all_to_all_bytes if all_to_all_bytes else 0.0
