"""The built-in calibration table: `dispatch`'s measured points on an H100 80GB HBM3, dated and
sourced; `python bench/dispatch.py --write-table PATH` on a GPU writes a newer one
(`SDPAGRAPH_DISPATCH_TABLE=PATH`)."""
from __future__ import annotations

from sdpagraph.jax_api.dispatch_table import Point, Shape, Table


def _points(rows: list[tuple], source: str) -> tuple[Point, ...]:
    """rows: (B, T, S, N, K, H, causal, pass, {backend: ms})."""
    return tuple(Point(Shape(b, t, s, n, k, h, h, "bfloat16", causal), pass_, times, source)
                 for b, t, s, n, k, h, causal, pass_, times in rows)


_SWEEP_H100 = _points([
    # bench/dispatch.py on an H100 80GB HBM3 (jax 0.11.2, cuDNN 9.19), 2026-11-24, three runs (T1 S2/S8:
    # the first; T 1-4, S <= 32: the second; T 8-16, S 64-256 and the anchors: the third), in
    # docs/results/h100-2026-11-24.md. They replace the older points of the same shapes (`_newest`).
    # T1 S2-16 forward: small_seq and xla re-measured with small_seq's one-kernel forward (0b36ccb):
    # S4 and S16 by bench/dispatch.py, S2 and S8 by bench/probe_small_seq_pallas.py --backend-only,
    # the same run (docs/results/h100-2026-11-24.md, thirteenth run); cudnn from the first runs.
    (30720, 1, 2, 16, 16, 128, False, "fwd", {"cudnn": 4.9616, "small_seq": 0.2638, "xla": 0.3014}),
    (30720, 1, 2, 16, 16, 128, False, "fwd_bwd", {"cudnn": 20.914, "small_seq": 0.7008, "xla": 3.1959}),
    (30720, 1, 4, 16, 16, 128, False, "fwd", {"cudnn": 4.91, "small_seq": 0.482, "xla": 0.508}),
    (30720, 1, 4, 16, 16, 128, False, "fwd_bwd", {"cudnn": 20.8441, "small_seq": 1.2345, "xla": 3.8761}),
    (30720, 1, 8, 16, 16, 128, False, "fwd", {"cudnn": 4.9898, "small_seq": 0.7741, "xla": 0.7929}),
    (30720, 1, 8, 16, 16, 128, False, "fwd_bwd", {"cudnn": 21.1129, "small_seq": 2.2809, "xla": 5.5585}),
    (30720, 1, 16, 16, 4, 128, False, "fwd", {"cudnn": 1.3858, "small_seq": 1.1317, "xla": 1.2782}),
    (30720, 1, 16, 16, 4, 128, False, "fwd_bwd", {"cudnn": 19.0013, "small_seq": 2.5335, "xla": 2.9321}),
    (30720, 1, 16, 16, 16, 128, False, "fwd", {"cudnn": 5.03, "small_seq": 1.51, "xla": 1.64}),
    (30720, 1, 16, 16, 16, 128, False, "fwd_bwd", {"cudnn": 21.4103, "small_seq": 4.393, "xla": 7.4536}),
    (15640, 1, 32, 16, 16, 128, False, "fwd", {"cudnn": 2.635, "small_seq": 1.5761, "xla": 1.6608}),
    (15640, 1, 32, 16, 16, 128, False, "fwd_bwd", {"cudnn": 11.8317, "small_seq": 4.8557, "xla": 6.6433}),
    (7820, 1, 64, 16, 16, 128, False, "fwd", {"cudnn": 1.7611, "xla": 1.5555}),
    (7820, 1, 64, 16, 16, 128, False, "fwd_bwd", {"cudnn": 7.2271, "xla": 6.5521}),
    (1955, 1, 256, 16, 16, 128, False, "fwd", {"cudnn": 1.3939, "xla": 1.4564}),
    (1955, 1, 256, 16, 16, 128, False, "fwd_bwd", {"cudnn": 4.5729, "xla": 6.4103}),
    (64, 1, 8192, 32, 8, 128, False, "fwd", {"cudnn": 0.7474, "xla": 2.4213}),
    (64, 1, 8192, 32, 8, 128, False, "fwd_bwd", {"cudnn": 9.057, "xla": 5.201}),
    (30720, 2, 4, 16, 16, 128, False, "fwd", {"cudnn": 10.2679, "small_seq": 0.6097, "xla": 3.2405}),
    (30720, 2, 4, 16, 16, 128, False, "fwd_bwd", {"cudnn": 26.7308, "small_seq": 1.4193, "xla": 7.6275}),
    (30720, 2, 16, 16, 16, 128, False, "fwd", {"cudnn": 10.4732, "small_seq": 1.8331, "xla": 5.6269}),
    (30720, 2, 16, 16, 16, 128, False, "fwd_bwd", {"cudnn": 26.9495, "small_seq": 4.3767, "xla": 12.1582}),
    (15640, 2, 32, 16, 16, 128, False, "fwd", {"cudnn": 5.238, "small_seq": 4.4688, "xla": 4.7615}),
    (15640, 2, 32, 16, 16, 128, False, "fwd_bwd", {"cudnn": 14.7512, "small_seq": 7.5559, "xla": 10.0956}),
    (7820, 2, 64, 16, 16, 128, False, "fwd", {"cudnn": 2.6715, "xla": 4.4675}),
    (7820, 2, 64, 16, 16, 128, False, "fwd_bwd", {"cudnn": 8.3227, "xla": 9.6145}),
    (1955, 2, 256, 16, 16, 128, False, "fwd", {"cudnn": 1.3955, "xla": 4.3734}),
    (1955, 2, 256, 16, 16, 128, False, "fwd_bwd", {"cudnn": 4.8448, "xla": 9.3995}),
    (30720, 4, 4, 16, 16, 128, False, "fwd", {"cudnn": 10.2334, "small_seq": 0.8069, "xla": 3.5389}),
    (30720, 4, 4, 16, 16, 128, False, "fwd_bwd", {"cudnn": 28.5691, "small_seq": 2.0163, "xla": 8.6355}),
    (30720, 4, 16, 16, 16, 128, False, "fwd", {"cudnn": 10.2937, "small_seq": 2.49, "xla": 6.388}),
    (30720, 4, 16, 16, 16, 128, False, "fwd_bwd", {"cudnn": 29.0233, "small_seq": 6.1205, "xla": 13.1411}),
    (15640, 4, 32, 16, 16, 128, False, "fwd", {"cudnn": 5.2949, "small_seq": 4.8731, "xla": 5.6069}),
    (15640, 4, 32, 16, 16, 128, False, "fwd_bwd", {"cudnn": 15.6203, "small_seq": 8.8459, "xla": 10.8298}),
    (7820, 4, 64, 16, 16, 128, False, "fwd", {"cudnn": 2.667, "xla": 4.9207}),
    (7820, 4, 64, 16, 16, 128, False, "fwd_bwd", {"cudnn": 8.8785, "xla": 10.1599}),
    (1955, 4, 256, 16, 16, 128, False, "fwd", {"cudnn": 1.4371, "xla": 4.5214}),
    (1955, 4, 256, 16, 16, 128, False, "fwd_bwd", {"cudnn": 5.2168, "xla": 9.797}),
    (30720, 8, 4, 16, 16, 128, False, "fwd", {"cudnn": 10.259, "xla": 5.3189}),
    (30720, 8, 4, 16, 16, 128, False, "fwd_bwd", {"cudnn": 30.5264, "xla": 10.407}),
    (30720, 8, 16, 16, 16, 128, False, "fwd", {"cudnn": 10.2034, "xla": 8.517}),
    (30720, 8, 16, 16, 16, 128, False, "fwd_bwd", {"cudnn": 31.6038, "xla": 15.3555}),
    (15640, 8, 32, 16, 16, 128, False, "fwd", {"cudnn": 5.3056, "xla": 7.4216}),
    (15640, 8, 32, 16, 16, 128, False, "fwd_bwd", {"cudnn": 16.6578, "xla": 12.5519}),
    (7820, 8, 64, 16, 16, 128, False, "fwd", {"cudnn": 2.6957, "xla": 5.4387}),
    (7820, 8, 64, 16, 16, 128, False, "fwd_bwd", {"cudnn": 9.5018, "xla": 11.2843}),
    (1955, 8, 256, 16, 16, 128, False, "fwd", {"cudnn": 1.5627, "xla": 4.8654}),
    (1955, 8, 256, 16, 16, 128, False, "fwd_bwd", {"cudnn": 5.5642, "xla": 10.3688}),
    (30720, 16, 4, 16, 16, 128, False, "fwd", {"cudnn": 10.1962, "xla": 5.8878}),
    (30720, 16, 4, 16, 16, 128, False, "fwd_bwd", {"cudnn": 33.7401, "xla": 13.0524}),
    (30720, 16, 16, 16, 16, 128, False, "fwd", {"cudnn": 10.208, "xla": 10.3926}),
    (30720, 16, 16, 16, 16, 128, False, "fwd_bwd", {"cudnn": 35.2786, "xla": 19.6295}),
    (15640, 16, 32, 16, 16, 128, False, "fwd", {"cudnn": 5.2927, "xla": 9.3353}),
    (15640, 16, 32, 16, 16, 128, False, "fwd_bwd", {"cudnn": 18.4224, "xla": 15.4757}),
    (7820, 16, 64, 16, 16, 128, False, "fwd", {"cudnn": 2.675, "xla": 6.0914}),
    (7820, 16, 64, 16, 16, 128, False, "fwd_bwd", {"cudnn": 10.5008, "xla": 13.1411}),
    (1955, 16, 256, 16, 16, 128, False, "fwd", {"cudnn": 1.519, "xla": 5.3152}),
    (1955, 16, 256, 16, 16, 128, False, "fwd_bwd", {"cudnn": 5.9652, "xla": 11.4835}),
    (64, 128, 128, 16, 16, 128, False, "fwd", {"cudnn": 0.0766, "xla": 0.305}),
    (64, 128, 128, 16, 16, 128, False, "fwd_bwd", {"cudnn": 0.3323, "xla": 0.6157}),
    (4, 4096, 4096, 16, 16, 128, True, "fwd", {"cudnn": 0.5171, "xla": 7.6361}),
    (4, 4096, 4096, 16, 16, 128, True, "fwd_bwd", {"cudnn": 2.0172, "xla": 16.078}),
], "bench/dispatch.py, H100, 2026-11-24")

_DESIGN_H100 = _points([
    # /work/shared/DESIGN.md "Facts measured on an H100 and on two H200s, 2026-11-23", and issue 14
    # (H100, implementation=None): sdpagraph's cuDNN graphs.
    (64, 1, 8192, 32, 8, 128, False, "fwd", {"cudnn": 0.705}),
    (30720, 1, 16, 16, 16, 128, False, "fwd", {"cudnn": 4.88}),
    (30720, 1, 16, 16, 16, 128, False, "fwd_bwd", {"cudnn": 21.5}),
    (30720, 1, 4, 16, 16, 128, False, "fwd", {"cudnn": 4.80}),
    (30720, 1, 4, 16, 16, 128, False, "fwd_bwd", {"cudnn": 20.9}),
], "DESIGN.md / issue 14, H100, 2026-11-23")

_DENSE_H100 = _points([
    # docs/results/attention-h100-2026-11-22.json (bench/attention.py on an H100, 2026-11-22):
    # sdpagraph's cuDNN graphs and its XLA backend on dense shapes (forward+backward: q, k, v grads).
    (4, 4096, 4096, 16, 16, 128, True, "fwd", {"cudnn": 0.4987, "xla": 7.5468}),
    (4, 4096, 4096, 16, 16, 128, True, "fwd_bwd", {"cudnn": 2.0671, "xla": 15.5029}),
    (4, 4096, 4096, 16, 16, 128, False, "fwd", {"cudnn": 0.8956, "xla": 7.4146}),
    (4, 4096, 4096, 16, 16, 128, False, "fwd_bwd", {"cudnn": 3.5437, "xla": 15.5035}),
    (8, 2048, 2048, 16, 16, 64, True, "fwd", {"cudnn": 0.1947, "xla": 3.7671}),
    (8, 2048, 2048, 16, 16, 64, True, "fwd_bwd", {"cudnn": 0.7971, "xla": 7.7216}),
    (1, 8192, 8192, 32, 8, 128, True, "fwd", {"cudnn": 0.9862, "xla": 21.8234}),
    (1, 8192, 8192, 32, 8, 128, True, "fwd_bwd", {"cudnn": 3.7782, "xla": 52.6519}),
], "docs/results/attention-h100-2026-11-22.json, H100, 2026-11-22")

_EXPLORE_H100 = _points([
    # An H100 80GB HBM3 (jax 0.11.2), 2026-11-23: the XLA backend and this small-sequence backend
    # (its formulation before the output-normalization epilogue), bf16, wall-clock medians of jitted
    # calls; forward+backward is jax.grad of sum(out * dO) for a random dO (q, k, v gradients).
    (30720, 1, 2, 16, 16, 128, False, "fwd", {"xla": 0.2843, "small_seq": 0.2774}),
    (30720, 1, 2, 16, 16, 128, False, "fwd_bwd", {"xla": 3.1636, "small_seq": 0.6626}),
    (30720, 1, 4, 16, 16, 128, False, "fwd", {"xla": 0.4546, "small_seq": 0.4587}),
    (30720, 1, 4, 16, 16, 128, False, "fwd_bwd", {"xla": 3.8042, "small_seq": 1.2048}),
    (30720, 1, 8, 16, 16, 128, False, "fwd", {"xla": 0.788, "small_seq": 0.8134}),
    (30720, 1, 8, 16, 16, 128, False, "fwd_bwd", {"xla": 5.481, "small_seq": 2.2424}),
    (30720, 1, 16, 16, 16, 128, False, "fwd", {"xla": 1.5699, "small_seq": 1.5245}),
    (30720, 1, 16, 16, 16, 128, False, "fwd_bwd", {"xla": 7.3645, "small_seq": 4.3305}),
    (30720, 1, 32, 16, 16, 128, False, "fwd", {"xla": 3.2029, "small_seq": 2.9957}),
    (30720, 1, 32, 16, 16, 128, False, "fwd_bwd", {"xla": 12.7969, "small_seq": 9.4505}),
    (30720, 2, 8, 16, 16, 128, False, "fwd", {"xla": 4.3952, "small_seq": 0.964}),
    (30720, 2, 8, 16, 16, 128, False, "fwd_bwd", {"xla": 10.0667, "small_seq": 2.4248}),
    (30720, 4, 16, 16, 16, 128, False, "fwd", {"xla": 6.3375, "small_seq": 2.4606}),
    (30720, 4, 16, 16, 16, 128, False, "fwd_bwd", {"xla": 13.0093, "small_seq": 6.0975}),
    (30720, 1, 16, 16, 4, 128, False, "fwd", {"xla": 1.2477, "small_seq": 1.1055}),
    (30720, 1, 16, 16, 4, 128, False, "fwd_bwd", {"xla": 2.9405, "small_seq": 2.5359}),
], "H100 exploration run, 2026-11-23")

def _newest(*groups: tuple[Point, ...]) -> tuple[Point, ...]:
    """The points of `groups` (newest group first), each shape and pass once: a shape measured
    again keeps only its newest point, so the table never holds two answers for one question."""
    seen, kept = set(), []
    for point in (p for group in groups for p in group):
        if (point.shape, point.pass_) not in seen:
            seen.add((point.shape, point.pass_))
            kept.append(point)
    return tuple(kept)


H100_TABLE = Table(
    gpu="NVIDIA H100 80GB HBM3",
    points=_newest(_SWEEP_H100, _DESIGN_H100, _DENSE_H100, _EXPLORE_H100),
    date="2026-11-24",
    source="H100 80GB HBM3. The sweep (T 1-16, S 2-256, GQA, decode and dense anchors: xla, small_seq, cudnn): bench/dispatch.py, "
           "2026-11-24; cuDNN small-sequence and decode: DESIGN.md and issue 14 (2026-11-23); dense "
           "cuDNN and XLA: docs/results/attention-h100-2026-11-22.json; XLA and small_seq small-sequence "
           "shapes: measured 2026-11-23. "
           "Refresh with `python bench/dispatch.py --write-table` on the GPU.",
)
