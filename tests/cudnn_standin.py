"""A stand-in for the cuDNN graphs on the CPU that is faithful where it matters for composed
results: the forward is the graph's computation on XLA (`graph_on_xla.run_on_xla`); the backward,
like cuDNN's, reads the `o` and `stats` it is given and nothing of a logsumexp's cotangent. A caller
that merges partial results (a ring, a split halo block) or joins sinks must hand each backward the
final output and logsumexp: this stand-in gives wrong gradients otherwise, as cuDNN would."""
import jax
import jax.numpy as jnp

from sdpagraph.backends.cudnn.execute import restacked, unstacked
from sdpagraph.backends.cudnn.graph_on_xla import graph_forward_without_sinks, run_on_xla


def stats_backward_executor(static, graph, operands, results):
    """A stand-in for the cuDNN graphs that, like cuDNN's backward, reads the `o` and `stats` it is
    given and nothing of a logsumexp's cotangent: the forward is the graph's computation on XLA
    (`run_on_xla`); the backward differentiates
        sum_i <dO_i, sum_j exp(l_ij - stats_i) v_j>  -  sum_i D_i sum_j exp(l_ij - stats_i),
    D_i = <dO_i, o_i> (from the `o` operand), whose gradient is cuDNN's: dl = P (dP - D)."""
    wanted, results = results, unstacked(results)  # dk and dv stacked where the call asks for it
    if "dq" not in results:
        return run_on_xla(static, operands, results)
    forward = graph_forward_without_sinks(static, operands)
    stats, d_o = operands["stats"], operands["dO"].astype(jnp.float32)
    lse_of = (lambda x: jnp.swapaxes(x, 1, 2)) if static.graph_spec.segments else (lambda x: x)  # noqa: E731
    given = lse_of(stats)  # (B, N, T)
    d_rows = jnp.swapaxes(jnp.sum(d_o * operands["o"].astype(jnp.float32), axis=-1), 1, 2)

    def loss(q, k, v, bias):
        out, graph_stats = forward(q, k, v, bias)
        lse = lse_of(graph_stats)
        empty = jnp.isneginf(lse) | jnp.isneginf(given)
        share = jnp.where(empty, 0.0, jnp.exp(jnp.where(empty, 0.0, lse - given)))  # sum_j exp(l_ij - stats_i)
        unnormalized = out.astype(jnp.float32) * jnp.swapaxes(share, 1, 2)[..., None]
        return jnp.sum(d_o * unnormalized) - jnp.sum(d_rows * share)

    q, k, v, bias = (operands.get(role) for role in ("q", "k", "v", "bias"))
    dq, dk, dv, dbias = jax.grad(loss, argnums=(0, 1, 2, 3))(q, k, v, bias)
    grads = {"dq": dq, "dk": dk, "dv": dv, "dbias": dbias}
    return restacked({role: grads[role].astype(results[role].dtype) for role in results}, wanted)
