"""How evenly context-parallel load balancing spreads causal attention over packed documents.

    python3 bench/cp_balance.py [--draws 200] [--seed 0]      # CPU only, numpy (jax for doc-mirror's order)

Rows pack documents of uniformly random lengths 512-8192 tokens (the last one cut at T), causal
within each document. For each scheme every token goes to one of cp devices; the work of a device is
the number of (query, key) pairs its queries attend, and the ring's step s pairs the queries of
device i with the keys of device i - s, so a step lasts as long as its busiest device. Printed per
(T, cp, scheme), as the mean (and worst) over the draws:
- `max/mean`: the busiest device's total work over the mean (1.00 is even);
- `ring`: the sum over the ring's steps of the busiest device's work in that step, over the total work
  / cp: the ring's critical path against a perfect split (1.00 is ideal).

Schemes:
- `contiguous`: device i holds tokens [i T/cp, (i+1) T/cp) (load_balanced=False);
- `mirror`: the sequence in 2cp chunks, device i holds chunks i and 2cp-1-i (`load_balance`);
- `doc-mirror`: each document cut into 2cp pieces, device i holds pieces i and 2cp-1-i of every document
  (`load_balance(x, cp, segment_ids=ids)`, `load_balanced="documents"`: Transformer Engine's THD
  scheme, with the pieces' odd tokens sent round the piece positions so every device holds T/cp);
- `stripe`: token t on device t mod cp;
- `whole-docs`: the documents kept whole and reordered in the row until the busiest contiguous shard is
  within 0.5% of the mean (`load_balance(x, cp, segment_ids=ids, whole_documents=True)`; the call sees
  an ordinary packed row, load_balanced=False).

Result (200 draws, seed 0, this script's output): `max/mean` mean (worst), then `ring` mean (worst);
`doc-mirror` and `stripe` were 1.00 (1.00) on every row:

    T       cp  contiguous                 mirror (load_balance)      whole-docs
    32768   2   1.12 (1.40)  1.17 (1.40)   1.12 (1.41)  1.16 (1.41)   1.01 (1.10)  1.12 (1.40)
    32768   4   1.32 (1.73)  1.50 (2.14)   1.34 (1.95)  1.77 (2.16)   1.07 (1.28)  1.44 (1.85)
    32768   8   1.71 (2.41)  2.00 (2.57)   1.64 (2.37)  2.46 (3.11)   1.35 (1.70)  1.82 (2.23)
    131072  2   1.05 (1.18)  1.06 (1.19)   1.06 (1.22)  1.07 (1.22)   1.00 (1.00)  1.02 (1.09)
    131072  4   1.13 (1.34)  1.18 (1.41)   1.14 (1.41)  1.25 (1.53)   1.00 (1.01)  1.10 (1.20)
    131072  8   1.26 (1.53)  1.39 (1.68)   1.27 (1.59)  1.57 (2.05)   1.01 (1.05)  1.27 (1.44)

The mirror of `load_balance` is no more even than no balancing for documents, and not within a few %
of even: the work of a causal document sits where the document lies, so the dense causal ramp the
mirror evens out is not there. At T32768 the busiest device does 12% (cp=2) to 64% (cp=8) more than
the mean, and the ring's critical path is 1.16x-2.46x the ideal. Per-document cuts and striping are
even (1.00). Per-document cuts are `load_balanced="documents"` (the ring's one packed call a step
keeps one rectangle of chunk pieces per document). Whole documents reordered are even where the
documents are short against a shard (T131072: 1.00-1.01) and as even as whole documents allow where
they are not (T32768, cp 8: shards of 4096 tokens, documents of up to 8192); their `ring` column is a
contiguous row's (the ring does not gain from them; the halo, which needs whole documents, does).
Striping is not taken: its blocks need a causal diagonal per document that falls between tokens
(key b of stripe j precedes query a of stripe i when b < a, or b == a and j <= i), a change of the
whole ring.
"""
from __future__ import annotations

import argparse

import numpy as np

from sdpagraph.parallel.load_balance import document_order
from sdpagraph.parallel.whole_documents import whole_document_order

LENGTHS = (32768, 131072)
CPS = (2, 4, 8)
DOC_MIN, DOC_MAX = 512, 8192


def documents(rng: np.random.Generator, length: int) -> tuple[np.ndarray, np.ndarray]:
    """(document number, position in the document) per token of one packed row."""
    sizes = []
    while sum(sizes) < length:
        sizes.append(int(rng.integers(DOC_MIN, DOC_MAX + 1)))
    sizes[-1] -= sum(sizes) - length
    doc = np.repeat(np.arange(len(sizes)), sizes)
    starts = np.repeat(np.cumsum([0] + sizes[:-1]), sizes)
    return doc, np.arange(length) - starts


def owners(scheme: str, doc: np.ndarray, pos: np.ndarray, cp: int) -> np.ndarray:
    """The device of every token under `scheme`."""
    t = np.arange(len(doc))
    mirror = lambda piece: np.where(piece < cp, piece, 2 * cp - 1 - piece)  # noqa: E731
    if scheme == "contiguous":
        return t * cp // len(t)
    if scheme == "mirror":
        return mirror(t * 2 * cp // len(t))
    if scheme == "doc-mirror":  # the library's order: natural token -> balanced position -> device
        order = np.asarray(document_order(doc[None] + 1, cp)[0])[0]
        return np.argsort(order) * cp // len(t)
    if scheme == "stripe":
        return t % cp
    if scheme == "whole-docs":  # natural token -> its position in the reordered row -> device
        order = whole_document_order(doc[None] + 1, cp)[0]
        return np.argsort(order) * cp // len(t)
    raise ValueError(scheme)


def pair_work(doc: np.ndarray, owner: np.ndarray, cp: int) -> np.ndarray:
    """(cp, cp): attended causal (query, key) pairs with the query on device i and the key on device j."""
    work = np.zeros((cp, cp))
    starts = np.flatnonzero(np.r_[True, doc[1:] != doc[:-1]])
    for j in range(cp):
        mine = (owner == j).astype(np.int64)
        seen = np.cumsum(mine)  # keys of device j at or before each token, within the row
        before_doc = np.r_[0, seen][starts][np.searchsorted(starts, np.arange(len(doc)), side="right") - 1]
        work[:, j] = np.bincount(owner, weights=seen - before_doc, minlength=cp)
    return work


def measure(work: np.ndarray) -> tuple[float, float]:
    """(busiest device over the mean, the ring's critical path over the ideal)."""
    cp = len(work)
    per_device = work.sum(axis=1)
    steps = [max(work[i, (i - s) % cp] for i in range(cp)) for s in range(cp)]
    ideal = work.sum() / cp
    return per_device.max() / per_device.mean(), sum(steps) / ideal


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--draws", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    schemes = ("contiguous", "mirror", "doc-mirror", "stripe", "whole-docs")
    print(f"causal packed documents of {DOC_MIN}-{DOC_MAX} tokens, {args.draws} draws: "
          "max/mean mean (worst) and ring critical path / ideal, mean (worst)")
    print(f"{'T':<8}{'cp':<4}" + "".join(f"{s:<26}" for s in schemes))
    for length in LENGTHS:
        rng = np.random.default_rng(args.seed)
        rows = [documents(rng, length) for _ in range(args.draws)]
        for cp in CPS:
            cells = []
            for scheme in schemes:
                results = np.array([measure(pair_work(doc, owners(scheme, doc, pos, cp), cp)) for doc, pos in rows])
                mean, worst = results.mean(axis=0), results.max(axis=0)
                cells.append(f"{mean[0]:.2f} ({worst[0]:.2f}) {mean[1]:.2f} ({worst[1]:.2f})")
            print(f"{length:<8}{cp:<4}" + "".join(f"{c:<26}" for c in cells))


if __name__ == "__main__":
    main()
