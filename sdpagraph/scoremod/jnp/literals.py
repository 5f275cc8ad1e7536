"""Which float literals of a jax.numpy mod are bound when the graph runs instead of baked into it.

In `lambda s, b, h, i, j: cap * jnp.tanh(s / cap)` the two `cap`s are literals of the jaxpr. As IR
literals (`const` nodes) their values would be part of the IR's digest, so of every graph key: each
new softcap value, ALiBi slope scale or bias constant would build a new cuDNN graph and miss a
precompiled cache. Instead they become pass-by-value scalars (`scalar` leaves), the way Python
scalars in `score_mod_tensors` are: the digest holds the structure only, and the value is bound
when the graph runs (`CompiledGraph.pass_by_value`) and by the XLA and small-seq backends
(`ir_eval.evaluate`'s `scalars`); the derived bprop (`scoremod.ir_grad`) reads the same scalar.

The rule. A literal is lifted when all of these hold:

- it is a float (float32 in the jaxpr; a Python int in float arithmetic is a float literal there:
  `30 * jnp.tanh(s / 30)` lifts both 30s), finite, and concrete (a closed-over traced value is a
  device operand already);
- it is an operand of float arithmetic (add, sub, mul, div, max, min, pow, rem, and what jnp
  builds from them: clip, ...);
- the result of that arithmetic is used as a float value only, all the way to the mod's output:
  through float arithmetic, float unary ops and the value branches of selects, never into a
  comparison, a select's condition, a logical op, a cast to int or any int arithmetic.

Everything else stays a literal: integer and boolean constants, literals that decide a mask (what
`scoremod.masks` and the jnp converter's native-mask forms compare, window and chunk sizes, an
`integer_pow` exponent, which is a static parameter anyway), a select's fill value (`jnp.where(
q >= k, s, -1e30)`; a mask_mod's masked value), non-finite values, and the constants the converter
itself writes to spell a jnp function in IR ops (`log1p(x)` as `log(x + 1.0)`, `exp2`'s `log(2)`).

One scalar per use: `cap * tanh(s / cap)` reads two, so the digest never depends on which values
happen to be equal. Literals of jax's own functions inlined into the mod (`jax.nn.gelu`'s 0.044715)
follow the same rule.
"""
from __future__ import annotations

import math
from typing import Sequence

from sdpagraph.scoremod.ir import FLOAT, Node, reachable


def lifted_literals(nodes: Sequence[Node], root: int, candidates: Sequence[int]) -> list[int]:
    """The candidates (per-use float literal nodes that float arithmetic reads) that the rule lifts,
    in node order. `nodes` are topologically ordered; only what `root` reaches counts."""
    live = reachable(nodes, (root,))
    # Nodes whose value reaches a boolean (a comparison, a select's condition, a logical op) or an
    # int (a cast, int arithmetic): they decide structure. gen_index reads the score's shape only.
    deciding: set[int] = set()
    for index in sorted(live, reverse=True):
        node = nodes[index]
        if node.op != "gen_index" and (index in deciding or node.dtype != FLOAT):
            deciding.update(node.args)
    return sorted(i for i in set(candidates) & live
                  if i not in deciding and math.isfinite(nodes[i].attr("value")))


def literal_name(prefix: str, number: int) -> str:
    """The name of the mod's `number`th lifted literal ("captured_literal0", ...)."""
    return f"{prefix}_literal{number}"
