"""Which packed softcap calls on bins crash inside a batch-sharded `jax.shard_map` (2 GPUs): each
variant of bench/packed.py's binned case runs its jitted forward in a process of its own, with
Python's fault handler on, and the table says whether it ran and where a crash stopped it.

    python3 bench/probe_bins_shard_map.py [PART ...]     # only the variants whose labels hold a PART

Variants change one thing at a time from the bench's call (B8 T8192 N16 H128, documents of
64-2048, a jax.numpy softcap, max_segments_per_seq from the ids, max_seqlen_kv=2048).
"""
from __future__ import annotations

import json
import sys

VARIANTS = {  # label: changes to the bench's call
    "bench's call": {},
    "mods.softcap": {"mod": "mods"},
    "no max_segments_per_seq": {"max_segments": False},
    "B2 (one row a device)": {"B": 2},
    "max_segments_per_seq=512": {"max_segments": 512},
    "packer on XLA (SDPAGRAPH_PALLAS_TRITON=0)": {"env": {"SDPAGRAPH_PALLAS_TRITON": "0"}},
    "no score_mod": {"mod": None},
}
CHILD = "import sys; sys.path.insert(0, sys.argv[1]); import probe_bins_shard_map as p; p.child(sys.argv[-1])"


def child(request: str) -> None:
    import jax
    import jax.numpy as jnp
    import numpy as np

    import sdpagraph
    from sdpagraph import mods
    from sdpagraph.segments.metadata import segment_run_ids

    from packed import random_docs, softcap

    config = {"B": 8, "T": 8192, "N": 16, "mod": "jnp", "max_segments": True, "hint": 2048,
              **VARIANTS[json.loads(request)]}  # "env" is the child's environment (main)
    ids = random_docs(config["B"], config["T"], 64, 2048)
    rng = np.random.default_rng(1)
    q, k, v = (jnp.asarray(rng.standard_normal((config["B"], config["T"], config["N"], 128)), jnp.bfloat16)
               for _ in range(3))
    seg = jnp.asarray(ids)
    most = config["max_segments"]
    most = int(np.asarray(segment_run_ids(seg)).max()) if most is True else (most or None)
    mod = {"jnp": softcap, "mods": mods.softcap(30.0), None: None}[config["mod"]]

    def call(q, k, v, seg):
        return sdpagraph.attention(q, k, v, is_causal=True, segment_ids=seg, max_segments_per_seq=most,
                                   score_mod=mod, max_seqlen_kv=config["hint"], implementation="cudnn",
                                   training=True)

    mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("batch",))
    split = jax.sharding.PartitionSpec("batch")
    fn = jax.jit(jax.shard_map(call, mesh=mesh, in_specs=(split,) * 4, out_specs=split))
    placed = [jax.device_put(x, jax.sharding.NamedSharding(mesh, split)) for x in (q, k, v, seg)]
    print("compiling", flush=True)
    compiled = fn.lower(*placed).compile()
    print("running", flush=True)
    jax.block_until_ready(compiled(*placed))
    print("RESULT " + json.dumps({"ok": True}), flush=True)


def main() -> int:
    import os

    from child import run_child

    here = os.path.dirname(os.path.abspath(__file__))
    print("| variant | result |\n|---|---|")
    for label in VARIANTS:
        if sys.argv[1:] and not any(part in label for part in sys.argv[1:]):
            continue
        try:
            run_child(CHILD, [here, json.dumps(label)], env=VARIANTS[label].get("env"), timeout=300, label=label)
            result = "ran"
        except Exception as error:  # the crash's last lines: the fault handler's Python stack
            lines = [line.strip() for line in str(error).splitlines() if line.strip()]
            result = "crashed: " + " / ".join(lines[-12:])
        print(f"| {label} | {result} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
