"""What the numerical check draws: the slice of the results the reference computes, and the random
inputs' small host-side parts (valid lengths, packed segments, score_mod scalars, attention sinks,
paged K/V's page table).

    plan_slice(spec, slice_elements, rng) -> Slice
    host_inputs(spec, ir, seed, given) -> {"arrays": {...}, "scalars": {...}}
    kv_shapes(spec) -> (k shape, v shape)          the graph's k and v operands (paged: the pools)
    key_index(spec, picks, xp, page_table) -> where the slice's rows' keys lie in k and v
    slicers(spec, picks, xp, page_table) -> (on_q, on_kv, on_kv_grad, on_score)

The slice (`plan_slice`, drawn from the seed): at most about `slice_elements` score elements.
Whole batch rows and heads while MIN_QUERY_ROWS query rows of each fit and their keys and values
stay within SLICE_KV_ELEMENTS; else the first, the last and random other batch rows (up to
MAX_ROWS) and heads (up to MAX_HEADS), and query rows spread over the sequence (one random row in
each of equal strata). The reference reads every key and value of its rows and heads, but compares
dk and dv at a sample of key positions only (`key_rows`: blocks of adjacent keys, the first, the
last and one in each stratum between), which keeps its key-side work and what comes back from the device small at long
sequences. Both ways of running the check (`numerics.direct` on the host and
`numerics.check`'s compiled program) cut their results to it with the same `slicers`.

Paged K/V (`spec.paged`): the graph's k and v are pools of num_pages pages (the spec's), read
through a page table (B, max_pages). The check's table is a random permutation of the pool (pages
of a sequence scattered and out of order; where the pool holds more pages than the table names,
some are never read; where it holds fewer, sequences share pages), and the key lengths end inside a
page (`_paged_kv_lengths`). The reference reads the slice's rows' logical keys from the same pool
through the same table (`key_index`): exactly the keys the graph reads.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping

import numpy as np

from sdpagraph.graphs.operands import page_count
from sdpagraph.scoremod.ir import INT, ScoreModIR
from sdpagraph.spec import AttentionSpec

# The reference computes at most about this many score elements (rows x heads x query rows x S):
# its float32 matmuls then take milliseconds on the host. Above it, a slice (`plan_slice`).
SLICE_ELEMENTS = 1 << 19
SLICE_KV_ELEMENTS = 1 << 23  # key and value elements of the slice's heads (32 MiB in float32)
MAX_ROWS = 3  # batch rows of a slice: the first, the last, random others
MAX_HEADS = 4  # query heads of a slice: the first, the last, random others
MIN_QUERY_ROWS = 2  # batch rows and heads are kept whole while this many query rows of each fit
# Key positions dk and dv are compared at: blocks of KEY_BLOCK adjacent keys, one per stratum (at
# S = 4096, one block of 8 in every 64 keys). 128 single keys let one key's rounding swing the
# relative error: a correct graph measured dk 1.0e-2 once on an H100, against 2e-3 over all keys.
MAX_KEY_ROWS = 512
MIN_KEY_ROWS = 8
KEY_BLOCK = 8
SCALAR_RANGE = (1.0, 50.0)  # score_mod scalars: positive (softcap divides by its cap)
# Attention sinks' logits: normal around log(S), where a sink takes half of a row of S logits of 0
# (random q and k give logits of about unit spread around 0), with this spread: in one check some
# heads' sinks take most of their rows, some (negative ones at short S) next to nothing, and most a
# sizable share that o and lse depend on.
SINK_SPREAD = 3.0
MASK_KEEP = 0.7
MAX_RANDOM_SEGMENTS = 8


@dataclass(frozen=True)
class Slice:
    """Which batch rows, query heads and key/value heads the reference computes, for each (batch
    row, head) pair which query rows (`queries[i][j]` for rows[i], heads[j]), and at which key
    positions dk and dv are compared (`keys`, the same in every row)."""

    rows: tuple[int, ...]
    heads: tuple[int, ...]
    kv_heads: tuple[int, ...]
    queries: tuple[tuple[tuple[int, ...], ...], ...]
    keys: tuple[int, ...]

    def indices(self) -> dict[str, np.ndarray]:
        return {"rows": np.asarray(self.rows, np.int32), "heads": np.asarray(self.heads, np.int32),
                "kv_heads": np.asarray(self.kv_heads, np.int32), "queries": np.asarray(self.queries, np.int32),
                "keys": np.asarray(self.keys, np.int32)}

    def query_rows(self) -> int:
        return len(self.queries[0][0])

    def whole(self, spec: AttentionSpec) -> bool:
        return (len(self.rows), len(self.heads), len(self.kv_heads), self.query_rows(), len(self.keys)) == (
            spec.batch, spec.num_heads, spec.num_kv_heads, spec.q_len, spec.kv_len)

    def describe(self, spec: AttentionSpec, gradients: bool) -> str:
        """"whole", or which rows, heads and query rows the reference computed (and, for `gradients`,
        at which keys dk and dv were compared)."""
        if self.whole(spec):
            return "whole"
        keys = "" if len(self.keys) == spec.kv_len or not gradients else (
            f", dk and dv at {len(self.keys)} of {spec.kv_len} keys")
        return (f"batch rows {list(self.rows)}, heads {list(self.heads)}, kv heads {list(self.kv_heads)}, "
                f"{self.query_rows()} of {spec.q_len} query rows each{keys}")


def plan_slice(spec: AttentionSpec, slice_elements: int = SLICE_ELEMENTS,
               rng: np.random.Generator | None = None) -> Slice:
    """The slice the reference computes (module docstring); random parts drawn from `rng`."""
    rng = np.random.default_rng(0) if rng is None else rng
    b, n, t, s = spec.batch, spec.num_heads, spec.q_len, spec.kv_len
    few = min(t, MIN_QUERY_ROWS)
    # Whole only while the scores fit and the keys and values the reference reads stay small: whole K
    # and V of B4 S4096 N16 H128 (in float64 then) cost the reference 1.65 s on an H100's host.
    kv_per_head = s * (spec.head_dim + spec.head_dim_v) * max(1, spec.num_kv_heads) // n
    whole = lambda r, h: r * h * few * s <= slice_elements and r * h * kv_per_head <= SLICE_KV_ELEMENTS  # noqa: E731
    rows = tuple(range(b)) if whole(b, n) else _ends_and_random(rng, b, MAX_ROWS)
    heads = tuple(range(n)) if whole(len(rows), n) else _ends_and_random(rng, n, MAX_HEADS)
    group = n // spec.num_kv_heads
    count = max(1, slice_elements // (len(rows) * len(heads) * s))
    # The row the random mask empties (`_device_inputs`) is among the first pair's rows.
    empty = t // 2 if spec.mask_shape is not None and spec.mask_shape[2] == t and t > 1 else None
    queries = tuple(tuple(_strata(rng, t, count, empty if (i, j) == (0, 0) else None) for j in range(len(heads)))
                    for i in range(len(rows)))
    # Within the bounds for whole rows and heads, dk and dv are small: compared at every key.
    keys = tuple(range(s)) if whole(b, n) else key_rows(
        rng, s, min(MAX_KEY_ROWS, max(MIN_KEY_ROWS, slice_elements >> 10)))
    return Slice(rows, heads, tuple(sorted({head // group for head in heads})), queries, keys)


def key_rows(rng: np.random.Generator, size: int, count: int) -> tuple[int, ...]:
    """About `count` keys of range(size) (all when size <= count): blocks of adjacent keys
    (KEY_BLOCK, fewer when `count` is small), the first block at 0, the last at the end, one at a
    random offset in each equal stratum between: every tile of keys is sampled, the edges always."""
    if size <= count:
        return tuple(range(size))
    block = min(KEY_BLOCK, count // 2)
    edges = np.linspace(0, size, count // block + 1).astype(int)
    starts = [0, *(int(rng.integers(low, high - block + 1)) for low, high in zip(edges[1:-2], edges[2:-1])),
              size - block]
    return tuple(start + offset for start in starts for offset in range(block))


def _ends_and_random(rng: np.random.Generator, size: int, count: int) -> tuple[int, ...]:
    """The first and last of range(size) and random others, `count` in all (all when size <= count):
    an error confined to one batch row or head is found when that row is picked, the last always."""
    if size <= count:
        return tuple(range(size))
    middle = rng.choice(np.arange(1, size - 1), count - 2, replace=False)
    return tuple(sorted({0, size - 1, *(int(i) for i in middle)}))


def _strata(rng: np.random.Generator, size: int, count: int, fixed: int | None = None) -> tuple[int, ...]:
    """One random index in each of `count` equal parts of range(size) (all when size <= count);
    `fixed`, when given, is the one of its part."""
    if size <= count:
        return tuple(range(size))
    edges = np.linspace(0, size, count + 1).astype(int)
    return tuple(fixed if fixed is not None and low <= fixed < high else int(rng.integers(low, high))
                 for low, high in zip(edges[:-1], edges[1:]))


def host_inputs(spec: AttentionSpec, ir: ScoreModIR | None, seed: int,
                given: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The small random inputs drawn on the host: valid lengths, segment ids, score_mod scalars
    (those not `given`), for a spec with sinks their logits ("sinks", (N,) float32) and for paged
    K/V the page table ("page_table", (B, max_pages) int32)."""
    rng = np.random.default_rng(seed)
    b, t, s = spec.batch, spec.q_len, spec.kv_len
    arrays: dict[str, Any] = {}
    if spec.has_q_lengths:
        arrays["q_lengths"] = _lengths(rng, b, t)
    if spec.has_kv_lengths:
        arrays["kv_lengths"] = _lengths(rng, b, s) if spec.paged is None else _paged_kv_lengths(rng, spec)
    if spec.segments:
        count = max(1, min(spec.max_segments or t, MAX_RANDOM_SEGMENTS))
        arrays["q_segment_ids"] = random_segment_ids(rng, b, t, count, spec.max_seqlen_q)
        if spec.segments == "cross":
            arrays["kv_segment_ids"] = random_segment_ids(rng, b, s, count, spec.max_seqlen_kv)
    scalars = {}
    if ir is not None:
        for _, node in ir.slots("scalar"):
            name = ir.scalar_names[node.attr("slot")]
            low, high = SCALAR_RANGE
            drawn = int(rng.integers(low, high + 1)) if node.dtype == INT else float(rng.uniform(low, high))
            scalars[name] = (given or {}).get(name, drawn)  # drawn anyway: a seed draws the same inputs
    if spec.sinks:
        arrays["sinks"] = rng.normal(np.log(s), SINK_SPREAD, spec.num_heads).astype(np.float32)
    if spec.paged is not None:
        arrays["page_table"] = random_page_table(rng, spec.paged[0], b, page_count(spec))
    return {"arrays": arrays, "scalars": scalars}


def _lengths(rng: np.random.Generator, batch: int, length: int) -> np.ndarray:
    lengths = rng.integers(1, length + 1, batch).astype(np.int32)
    lengths[0] = length  # one full row
    return lengths


def _paged_kv_lengths(rng: np.random.Generator, spec: AttentionSpec) -> np.ndarray:
    """Key lengths of a paged spec: the last row all S keys (every page full), the others (with
    one row: that one) ending inside a page, where a graph that reads its last page whole, or not
    at all, is wrong; the first among them, whose query rows are all valid (`_lengths`), makes
    every query row of the slice's first row see a partial page. With bottom-right causal
    alignment at least T keys (decoding T new tokens: every query has keys to attend to, as
    `backends.cudnn.paged_decode` requires)."""
    s, page = spec.kv_len, spec.paged[1]
    bottom_right = spec.is_causal and spec.causal_alignment == "bottom_right"
    choices = np.arange(min(spec.q_len, s) if bottom_right else 1, s + 1)
    inside_a_page = choices[choices % page != 0]
    lengths = rng.choice(inside_a_page if len(inside_a_page) else choices, spec.batch).astype(np.int32)
    if spec.batch > 1:
        lengths[-1] = s
    return lengths


def random_page_table(rng: np.random.Generator, num_pages: int, batch: int, max_pages: int) -> np.ndarray:
    """(batch, max_pages) int32 pages of a pool of `num_pages`: random permutations of the pool one
    after another, so a sequence's pages are scattered and out of order, distinct while the pool
    holds them all (the pages past batch * max_pages are never read)."""
    rounds = -(-batch * max_pages // num_pages)
    pages = np.concatenate([rng.permutation(num_pages) for _ in range(rounds)])[:batch * max_pages]
    return pages.reshape(batch, max_pages).astype(np.int32)


def random_segment_ids(rng: np.random.Generator, batch: int, length: int, count: int,
                       longest: int | None = None) -> np.ndarray:
    """Per row: 1..count contiguous segments numbered 1, 2, ..., then some padding (0); none longer
    than `longest` (the call's `max_seqlen_*` hint: a call never gets longer ones, `attention`
    checks), so a row holds at most count * longest tokens of segments."""
    longest = length if longest is None else max(1, min(longest, length))
    ids = np.zeros((batch, length), np.int32)
    for row in range(batch):
        used = min(length - int(rng.integers(0, max(1, length // 8))), count * longest)
        fewest = -(-used // longest)
        segments = int(rng.integers(fewest, min(count, used) + 1))
        for number, (start, end) in enumerate(_cuts(rng, used, segments, longest)):
            ids[row, start:end] = number + 1
    return ids


def _cuts(rng: np.random.Generator, used: int, segments: int, longest: int) -> list[tuple[int, int]]:
    """`segments` contiguous (start, end) runs covering range(used), each 1..longest long, at random
    cut points (even cuts when random ones keep giving a run over `longest`)."""
    for _ in range(16):
        cuts = sorted(int(c) for c in rng.choice(np.arange(1, used), segments - 1, replace=False)) if segments > 1 else []
        bounds = [0, *cuts, used]
        if max(np.diff(bounds)) <= longest:
            break
    else:
        bounds = np.linspace(0, used, segments + 1).round().astype(int).tolist()
    return list(zip(bounds[:-1], bounds[1:]))


def kv_shapes(spec: AttentionSpec) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The shapes of the graph's k and v operands: (B, S, K, H), or paged the pools (num_pages,
    page_size, K, H)."""
    leading = (spec.batch, spec.kv_len) if spec.paged is None else tuple(spec.paged)
    return (*leading, spec.num_kv_heads, spec.head_dim), (*leading, spec.num_kv_heads, spec.head_dim_v)


def key_index(spec: AttentionSpec, picks: Mapping[str, Any], xp: Any,
              page_table: Any) -> tuple[Any, Any, Any]:
    """Index arrays into the first three axes of k and v (`kv_shapes`), broadcasting to (B', S, K'):
    every key of the slice's batch rows at its kv heads. Paged, key j of row b lies on the pool's
    page `page_table[b, j // page_size]` at row j % page_size: the keys the graph reads (dense:
    `page_table` is None)."""
    rows, kv_heads = picks["rows"][:, None, None], picks["kv_heads"][None, None, :]
    keys = xp.arange(spec.kv_len, dtype=xp.int32)[None, :, None]
    if spec.paged is None:
        return rows, keys, kv_heads
    page = spec.paged[1]
    return page_table[rows, keys // page], keys % page, kv_heads


def slicers(spec: AttentionSpec, picks: Mapping[str, Any], xp: Any,
            page_table: Any) -> tuple[Callable, Callable, Callable, Callable]:
    """(on_q, on_kv, on_kv_grad, on_score): cut a query-side (B, T, N, ...) array to (B', N', T', ...),
    k or v (`kv_shapes`, paged through `page_table`) to the slice's rows' keys (B', S, K', ...)
    (`on_kv_grad`: a (B, S, K, ...) gradient to the slice's keys, (B', S', K', ...)), and a
    score-shaped (B|1, N|1, T|1, S|1) one (or None) to (B', N', T', S|1); `picks` are
    `Slice.indices()`, as NumPy (xp=numpy) or traced (xp=jax.numpy)."""
    b, t, n = spec.batch, spec.q_len, spec.num_heads
    rows, heads, queries = picks["rows"][:, None, None], picks["heads"][None, :, None], picks["queries"]
    nowhere = xp.zeros((1, 1, 1), xp.int32)
    kv_index = key_index(spec, picks, xp, page_table)

    def on_q(x):
        return x[rows, queries, heads]

    def on_kv(x):
        return x[kv_index]

    def on_kv_grad(x):  # one gather: only the picked elements of a large result are read
        return x[picks["rows"][:, None, None], picks["keys"][None, :, None], picks["kv_heads"][None, None, :]]

    def on_score(x):
        if x is None:
            return None
        full = [size == whole for size, whole in zip(x.shape, (b, n, t))]
        return x[rows if full[0] else nowhere, heads if full[1] else nowhere, queries if full[2] else nowhere]

    return on_q, on_kv, on_kv_grad, on_score
