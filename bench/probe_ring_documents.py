"""Where a context-parallel ring over packed documents spends its time, on one GPU: the ring's block
code runs on a one-device mesh (load-balanced: two chunks, so the skipped, diagonal and off-diagonal
pairs all run), against the same packed call without context parallelism. Prints times, the
graphs the ring built and every sdpagraph log line (a block graph that failed its numerical check
runs on XLA and says so).

    python3 bench/probe_ring_documents.py [T] [DEVICES]

With DEVICES = 2 the ring runs over two GPUs (the sequence split in two, load-balanced), next to the
same ring without documents; the compiled step's collectives and cuDNN calls are counted.
"""
from __future__ import annotations

import collections
import logging
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

import sdpagraph
from sdpagraph.backends.cudnn import execute as cudnn_execute

from jax_timing import time_ms  # bench/ is on sys.path when a script here runs
from packed import random_docs

logging.basicConfig(level=logging.INFO, format="log: %(levelname)s %(message)s")
logging.getLogger("sdpagraph").setLevel(logging.INFO)


def main():
    t = int(sys.argv[1]) if len(sys.argv) > 1 else 32768
    devices = int(sys.argv[2]) if len(sys.argv) > 2 else 1
    n, h = 16, 128
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.standard_normal((1, t, n, h)), jnp.bfloat16) for _ in range(3))
    ids = random_docs(1, t, 512, 8192)
    bound = t // 512 + 1
    mesh = Mesh(np.array(jax.devices()[:devices]), ("cp",))
    built = []
    real = cudnn_execute.cached_graph
    cudnn_execute.cached_graph = lambda spec, ir, direction, *a: (built.append((spec.summary(), direction)),
                                                                  real(spec, ir, direction, *a))[1]

    def step(cp, documents=True):
        def loss(q, k, v, ids):
            kw = dict(context_parallel_axis="cp", mesh=mesh, load_balanced=True) if cp else {}
            if documents:
                kw.update(segment_ids=ids, max_segments_per_seq=bound)
            out = sdpagraph.attention(q, k, v, is_causal=True, implementation="cudnn", **kw)
            return jnp.sum(out.astype(jnp.float32))
        return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))

    def census(fn, *args):
        text = fn.lower(*args).compile().as_text()
        ops = re.findall(r"= [\w\[\]{},0-9]+ (collective-permute-start|all-to-all|all-gather-start|all-gather|"
                         r"custom-call|while|conditional|all-reduce-start|all-reduce)\(", text)
        calls = len(re.findall(r'custom_call_target="sdpagraph_execute"', text))
        return dict(collections.Counter(ops)), calls

    plain_ids = jnp.asarray(ids)
    print(f"packed call, one device: {time_ms(step(False), q, k, v, plain_ids, repeats=10, rounds=3):.3f} ms",
          flush=True)
    balanced = [sdpagraph.load_balance(x, devices) for x in (q, k, v)]
    balanced.append(jnp.asarray(sdpagraph.load_balance(ids, devices)))
    if devices > 1:
        placed = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(None, "cp"))
        balanced = [jax.device_put(x, placed) for x in balanced]
    built.clear()
    with jax.set_mesh(mesh):
        for documents in (True, False):
            fn = step(True, documents)
            ms = time_ms(fn, *balanced, repeats=10, rounds=3)
            ops, calls = census(fn, *balanced)
            print(f"ring over {devices} device(s) (load-balanced), documents={documents}: {ms:.3f} ms; "
                  f"sdpagraph_execute calls {calls}; {ops}", flush=True)
    for spec, direction in dict.fromkeys(built):
        print(f"  ring graph: {direction} {spec}")


if __name__ == "__main__":
    main()
