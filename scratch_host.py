import ctypes, os, statistics, sys, time
import numpy as np, jax, jax.numpy as jnp
import sdpagraph
from sdpagraph import ffi
sys.path.insert(0, "bench")
from attention import inputs

def per_call_us(fn, *args, repeats=500, rounds=7):
    jax.block_until_ready(fn(*args)); jax.block_until_ready(fn(*args))
    s = []
    for _ in range(rounds):
        t = time.perf_counter()
        for _ in range(repeats):
            out = fn(*args)
        jax.block_until_ready(out)
        s.append((time.perf_counter() - t) / repeats * 1e6)
    return statistics.median(s)

q, k, v = inputs(1, 128, 1, 1, 64)
lib = ffi.load()
prof = getattr(lib, "_library", None) or getattr(lib, "library", None)
print("lib attrs", [a for a in dir(lib) if not a.startswith("__")])
cd = None
for a in dir(lib):
    if isinstance(getattr(lib, a), ctypes.CDLL): cd = getattr(lib, a)
buf = (ctypes.c_int64 * 8)()
fns = {
  "floor q*2": jax.jit(lambda q, k, v: q * 2),
  "floor q+k+v": jax.jit(lambda q, k, v: q + k + v),
  "sdpagraph infer": jax.jit(lambda q, k, v: sdpagraph.attention(q, k, v, implementation="cudnn", training=False)),
  "sdpagraph train fwd": jax.jit(lambda q, k, v: sdpagraph.attention(q, k, v, implementation="cudnn", training=True)),
  "jax-cudnn": jax.jit(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, implementation="cudnn")),
}
print(os.environ.get("XLA_FLAGS"))
print(fns["sdpagraph infer"].lower(q, k, v).compile().as_text())
for name, fn in fns.items():
    cd.sdpagraph_profile(buf)
    us = per_call_us(fn, q, k, v)
    cd.sdpagraph_profile(buf)
    n = max(buf[0], 1)
    print(f"{name:22s} {us:7.2f} us/call | handler segments (us): lookup {buf[1]/n/1e3:.2f} pack {buf[2]/n/1e3:.2f} setstream {buf[3]/n/1e3:.2f} execute {buf[4]/n/1e3:.2f} (n={buf[0]})")
