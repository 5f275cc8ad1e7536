"""The small-sequence kernel and the bin packer on a GPU: their Pallas Triton path against the XLA
formulation forced as jax's removal of Triton would (the module no longer imports). Needs a GPU.

    PYTHONPATH=. python bench/probe_pallas_fallback.py
"""
import sys, time, warnings
import jax, jax.numpy as jnp, numpy as np
import jax.experimental.pallas.triton  # noqa: F401 (removed below to force the fallback)
warnings.simplefilter("always", DeprecationWarning)  # show jax's Triton deprecation, not hide it
from sdpagraph.backends import pallas_triton
from sdpagraph.backends.cudnn.bins import packer
from sdpagraph.backends.small_seq.backend import BACKEND, small_seq_attention
from sdpagraph.call import prepare_call

def timed(fn, *a):
    jax.block_until_ready(fn(*a)); t = time.perf_counter()
    for _ in range(20): out = fn(*a)
    jax.block_until_ready(out); return out, (time.perf_counter() - t) / 20 * 1e3

def run_all(tag):
    small = jax.jit(lambda q, k, v: small_seq_attention(call.spec, q, k, v, call.inputs))
    pack = jax.jit(packer.pack, static_argnums=(1, 2))
    hlo = small.lower(q, k, v).as_text() + pack.lower(lengths, 2048, 40).as_text()
    (o, lse), ms = timed(small, q, k, v); placed, ms_pack = timed(pack, lengths, 2048, 40)
    print(f"[{tag}] status={pallas_triton.status()} triton_in_hlo={'triton' in hlo}")
    print(f"[{tag}] small_seq {ms:.3f} ms, pack {ms_pack:.3f} ms")
    print(f"[{tag}] support: {BACKEND.support(call.spec, None, training=False).reason} | {packer.formulation()}")
    return o, lse, placed, 'triton' in hlo

print(jax.__version__, jax.devices())
rng = np.random.default_rng(0)
q = jnp.asarray(rng.standard_normal((30720, 1, 16, 128)), jnp.bfloat16)
k, v = (jnp.asarray(rng.standard_normal((30720, 16, 16, 128)), jnp.bfloat16) for _ in range(2))
call = prepare_call(q, k, v)
lengths = jnp.asarray(np.concatenate([np.sort(rng.integers(1, 2048, 400))[::-1], np.zeros(9)]), jnp.int32)
o1, l1, p1, t1 = run_all("triton")
# Force the fallback as jax's removal would: the module no longer imports.
delattr(sys.modules["jax.experimental.pallas"], "triton"); sys.modules["jax.experimental.pallas.triton"] = None
pallas_triton._probe.cache_clear()
o2, l2, p2, t2 = run_all("forced XLA")
assert t1 and not t2, (t1, t2)
for a, b in zip(p1, p2): np.testing.assert_array_equal(a, b)
np.testing.assert_allclose(np.float32(o1), np.float32(o2), rtol=2e-2, atol=2e-2)
np.testing.assert_allclose(l1, l2, rtol=1e-4, atol=1e-4)
print("OK: packer identical, small_seq max |diff|", float(jnp.max(jnp.abs(o1.astype(jnp.float32) - o2.astype(jnp.float32)))))
