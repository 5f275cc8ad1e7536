"""The small-sequence kernel and the bin packer on a GPU: their Pallas Triton path against the XLA
formulations, forced as jax's removal of Triton would force them (the module no longer imports), each
in a fresh process (a process keeps the traces it made). Needs a GPU.

    PYTHONPATH=. python bench/probe_pallas_fallback.py
"""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
import warnings


def measure(forced: bool, out: str) -> None:
    if forced:  # as when jax has no Triton backend: the module does not import
        sys.modules["jax.experimental.pallas.triton"] = None
    warnings.simplefilter("always", DeprecationWarning)  # show jax's Triton deprecation, not hide it
    import jax
    import jax.numpy as jnp
    import numpy as np

    from sdpagraph.backends import pallas_triton
    from sdpagraph.backends.cudnn.bins import packer
    from sdpagraph.backends.small_seq.backend import BACKEND, small_seq_attention
    from sdpagraph.call import prepare_call

    def timed(fn, *args):
        jax.block_until_ready(fn(*args))
        start = time.perf_counter()
        for _ in range(20):
            result = fn(*args)
        jax.block_until_ready(result)
        return result, (time.perf_counter() - start) / 20 * 1e3

    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((30720, 1, 16, 128)), jnp.bfloat16)
    k, v = (jnp.asarray(rng.standard_normal((30720, 16, 16, 128)), jnp.bfloat16) for _ in range(2))
    call = prepare_call(q, k, v)
    lengths = jnp.asarray(np.concatenate([np.sort(rng.integers(1, 2048, 400))[::-1], np.zeros(9)]), jnp.int32)
    small = jax.jit(lambda q, k, v: small_seq_attention(call.spec, q, k, v, call.inputs))
    pack = jax.jit(packer.pack, static_argnums=(1, 2))
    hlo = small.lower(q, k, v).as_text() + pack.lower(lengths, 2048, 40).as_text()
    (o, lse), small_ms = timed(small, q, k, v)
    placed, pack_ms = timed(pack, lengths, 2048, 40)
    tag = "forced XLA" if forced else "triton"
    print(f"[{tag}] jax {jax.__version__} status={pallas_triton.status()} triton_in_hlo={'triton' in hlo}")
    print(f"[{tag}] small_seq B30720 T1 S16 N16 H128 bf16 fwd {small_ms:.3f} ms, bin packer (409 docs) {pack_ms:.3f} ms")
    print(f"[{tag}] support: {BACKEND.support(call.spec, None, training=False).reason} | {packer.formulation()}")
    np.savez(out, out=np.asarray(o, np.float32), lse=np.asarray(lse), triton=("triton" in hlo),
             **{f"placed{i}": np.asarray(x) for i, x in enumerate(placed)})


def main() -> int:
    if len(sys.argv) == 3:
        measure(sys.argv[1] == "forced", sys.argv[2])
        return 0
    import numpy as np

    with tempfile.TemporaryDirectory() as tmp:
        results = {}
        for mode in ("triton", "forced"):
            path = os.path.join(tmp, mode + ".npz")
            subprocess.run([sys.executable, __file__, mode, path], check=True)
            results[mode] = dict(np.load(path))
    real, forced = results["triton"], results["forced"]
    assert real["triton"] and not forced["triton"], (real["triton"], forced["triton"])
    for name in real:
        if name.startswith("placed"):
            np.testing.assert_array_equal(real[name], forced[name])
    np.testing.assert_allclose(real["out"], forced["out"], rtol=2e-2, atol=2e-2)
    np.testing.assert_allclose(real["lse"], forced["lse"], rtol=1e-4, atol=1e-4)
    print("OK: packer identical, small_seq max |diff|", float(np.max(np.abs(real["out"] - forced["out"]))))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
