"""Why FlexAttention's time for one call differs between runs of bench/packed.py: torch.compile
recompiles `flex_attention` when a later call has other shapes, and from the second shape on it
compiles with dynamic shapes, whose kernels are slower. Times the softcap + documents case
(B8 T8192, documents of 64-2048, as bench/packed.py) compiled fresh, then again after the
function was compiled for bench/packed.py's earlier cases (B4 T4096 and B8 T8192 without the
softcap), as one process running every case does. Needs a GPU and torch.

    python3 bench/probe_flex_recompile.py
"""
from __future__ import annotations

import json

import torch

from attention import torch_flex_ms  # bench/ is on sys.path when a script here runs
from packed import N, H, equal_docs, random_docs

CASE = random_docs(8, 8192, 64, 2048)
EARLIER = [(equal_docs(4, 4096, 4), False), (equal_docs(4, 4096, 16), False), (CASE, False)]


def main() -> int:
    rows = []
    for backward in (False, True):
        B, T = CASE.shape
        fresh = torch_flex_ms(B, T, N, H, backward, CASE, softcap=True)
        torch._dynamo.reset()
        for ids, softcap in EARLIER:  # the earlier cases of one bench/packed.py process, same function
            torch_flex_ms(*ids.shape, N, H, backward, ids, softcap=softcap, fresh=False)
        after = torch_flex_ms(B, T, N, H, backward, CASE, softcap=True, fresh=False)
        rows.append({"pass": "fwd+bwd" if backward else "fwd", "fresh compile ms": fresh,
                     "after other shapes ms": after, "ratio": after / fresh, "torch": torch.__version__})
        print(json.dumps(rows[-1]), flush=True)
    print("| pass | fresh compile ms | after other shapes ms | ratio |\n|---|---|---|---|")
    for r in rows:
        print(f"| {r['pass']} | {r['fresh compile ms']:.3f} | {r['after other shapes ms']:.3f} | {r['ratio']:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
