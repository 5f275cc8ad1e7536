"""A process that builds cuDNN graphs exits quietly: no nanobind leak report of frontend objects.

cudnn-frontend keeps score_mod callbacks inside the C++ graph through a closure over that graph;
without `Lowering.release` every built graph stayed alive until exit, and nanobind printed
"leaked N instances ... leaked N types ... leaked N functions", which reads as a crash.
"""
import os
import subprocess
import sys
import textwrap

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

BUILD_AND_RUN = textwrap.dedent("""
    import jax, jax.numpy as jnp, numpy as np
    import sdpagraph
    from sdpagraph import mods
    rng = np.random.default_rng()
    q, k, v = (jnp.asarray(rng.standard_normal((2, 256, 4, 64)), jnp.bfloat16) for _ in range(3))
    kwargs = dict(is_causal=True, score_mod=mods.softcap(20.0), implementation="cudnn")
    loss = lambda q, k, v: sdpagraph.attention(q, k, v, **kwargs).astype(jnp.float32).sum()
    jax.block_until_ready(jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v))
    print("built and ran", flush=True)
""")


def test_a_process_that_built_graphs_prints_no_leak_report(tmp_path):
    env = dict(os.environ, SDPAGRAPH_CACHE_DIR=str(tmp_path), XLA_PYTHON_CLIENT_PREALLOCATE="false",
               PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, "-c", BUILD_AND_RUN], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "built and ran" in done.stdout
    assert "leaked" not in done.stderr, done.stderr[-3000:]
