"""Every Python block of docs/sinks.md runs as pasted (the gpt-oss nnx layer included), and the
sinks' gradient it takes is the one a float64 reference gives."""
import pathlib
import re

import numpy as np
import pytest

DOC = pathlib.Path(__file__).resolve().parent.parent / "docs" / "sinks.md"
BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def test_the_blocks_run_in_order():
    pytest.importorskip("flax.nnx")
    blocks = [match.group(1) for match in BLOCK.finditer(DOC.read_text())]
    assert len(blocks) == 2
    scope = {"__name__": "__main__"}
    exec(compile(blocks[0], str(DOC), "exec"), scope)
    assert scope["out"].shape == (1, 16, 4, 8) and scope["lse"].shape == (1, 16, 4)
    # d s_h = -sum_i exp(s_h - L'_i) <dO_i, out'_i> with dO = 1 (the loss is a sum)
    causal_out, causal_lse = (np.asarray(a, np.float64) for a in scope["sdpagraph"].attention(
        scope["q"], scope["k"], scope["v"], is_causal=True, sinks=scope["sinks"], return_residual=True))
    want = -np.sum(np.exp(0.0 - causal_lse) * causal_out.sum(-1), axis=(0, 1))
    np.testing.assert_allclose(np.asarray(scope["d_sinks"]), want, rtol=1e-4, atol=1e-5)
    exec(compile(blocks[1], str(DOC), "exec"), scope)
    grads = scope["grads"]
    assert grads.sinks.shape == (64,) and np.all(np.isfinite(np.asarray(grads.sinks[...])))
    assert np.any(np.asarray(grads.sinks[...]) != 0)
