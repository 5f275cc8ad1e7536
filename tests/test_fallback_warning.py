"""A call that leaves cuDNN says why: at INFO, and at WARNING when it is long (T * S >= 2**24), where
the other backends are slower by far."""
import logging

import jax
import jax.numpy as jnp
import pytest

import sdpagraph
from sdpagraph.dispatch.decide import LONG_CALL_SCORES


def _trace(t, s):
    shapes = [jax.ShapeDtypeStruct(shape, jnp.bfloat16) for shape in ((1, t, 2, 16), (1, s, 2, 16), (1, s, 2, 16))]
    jax.eval_shape(lambda q, k, v: sdpagraph.attention(q, k, v, is_causal=True), *shapes)  # traced, not run


@pytest.mark.parametrize("t, s, level", [(4096, 4096, logging.WARNING), (8192, 2048, logging.WARNING),
                                         (4096, 4095, logging.INFO), (256, 512, logging.INFO)])
def test_leaving_cudnn_is_a_warning_for_long_calls(caplog, t, s, level):
    if sdpagraph.check_support(*(jax.ShapeDtypeStruct((1, 8, 2, 16), jnp.bfloat16),) * 3).supported:
        pytest.skip("cuDNN runs calls here: nothing leaves it")
    assert (t * s >= LONG_CALL_SCORES) == (level == logging.WARNING)
    with caplog.at_level(logging.INFO, logger="sdpagraph"):
        _trace(t, s)
    said = [r for r in caplog.records if f"T={t}" in r.getMessage() or f"{t}" in r.getMessage()]
    assert said, [r.getMessage() for r in caplog.records]
    assert {r.levelno for r in said} == {level}
    assert "using the xla backend" in said[0].getMessage() and "GPU" in said[0].getMessage()
