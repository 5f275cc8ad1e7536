"""Where a context-parallel ring over packed documents spends its time, on one GPU: the ring's block
code runs on a one-device mesh (load-balanced: two chunks, so the skipped, diagonal and off-diagonal
pairs all run), against the same packed call without context parallelism. Prints times, the
graphs the ring built and every sdpagraph log line (a block graph that failed its numerical check
runs on XLA and says so).

    python3 bench/probe_ring_documents.py [T]
"""
from __future__ import annotations

import logging
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

import sdpagraph
from sdpagraph.backends.cudnn import backend as cudnn_backend

from jax_timing import time_ms  # bench/ is on sys.path when a script here runs
from packed import random_docs

logging.basicConfig(level=logging.INFO, format="log: %(levelname)s %(message)s")
logging.getLogger("sdpagraph").setLevel(logging.INFO)


def main():
    t = int(sys.argv[1]) if len(sys.argv) > 1 else 32768
    n, h = 16, 128
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.standard_normal((1, t, n, h)), jnp.bfloat16) for _ in range(3))
    ids = random_docs(1, t, 512, 8192)
    bound = t // 512 + 1
    mesh = Mesh(np.array(jax.devices()[:1]), ("cp",))
    built = []
    real = cudnn_backend.cached_graph
    cudnn_backend.cached_graph = lambda spec, ir, direction, *a: (built.append((spec.summary(), direction)),
                                                                  real(spec, ir, direction, *a))[1]

    def step(cp):
        def loss(q, k, v, ids):
            kw = dict(context_parallel_axis="cp", mesh=mesh, load_balanced=True) if cp else {}
            out = sdpagraph.attention(q, k, v, is_causal=True, segment_ids=ids, max_segments_per_seq=bound,
                                      implementation="cudnn", **kw)
            return jnp.sum(out.astype(jnp.float32))
        return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))

    plain_ids = jnp.asarray(ids)
    print(f"packed call, one device: {time_ms(step(False), q, k, v, plain_ids, repeats=10, rounds=3):.3f} ms",
          flush=True)
    balanced = [sdpagraph.load_balance(x, 1) for x in (q, k, v)] + [jnp.asarray(sdpagraph.load_balance(ids, 1))]
    built.clear()
    print(f"ring over a one-device mesh (load-balanced): {time_ms(step(True), *balanced, repeats=10, rounds=3):.3f} ms",
          flush=True)
    for spec, direction in dict.fromkeys(built):
        print(f"  ring graph: {direction} {spec}")


if __name__ == "__main__":
    main()
