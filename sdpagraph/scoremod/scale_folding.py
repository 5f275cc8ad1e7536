"""A score_mod whose first step scales the score, rewritten so that cuDNN's attention scale does it.

cuDNN multiplies Q·Kᵀ by its attention scale and hands the result to the score_mod. A mod that
starts by dividing (or multiplying) that score by a scalar or a literal, as softcap's
`cap * tanh(score / cap)` does, spends a pointwise op per score on it, and its derived bprop
another (softcap+causal ran 2-4% slower for it on an H100). The same value comes out when the
attention scale is divided by the factor and the mod starts from the score itself:

    fold_leading_scale(ir, direction) -> LeadingScale(ir without that step, the factor, "div" or "mul") | None
    folds_leading_scale(ir, direction) -> bool                    (the graph key's mark, `graphs.builder`)

The factor stays a run-time value: a scalar's attention scale is computed from the scalar when
the graph runs (`graphs.compiled`), so one graph still serves every softcap value. The gradient
is unchanged too: cuDNN's backward multiplies the bprop's result by the attention scale it ran
with, and the bprop is derived again for the shorter mod.

A mod keeps its form (None) when the score has another use (positions, `gen_index`, read only its
shape and may stay) or the factor is a device array (a traced value); a backward graph keeps it
too where the user gave the bprop, which names the score as the user wrote it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from sdpagraph.scoremod.ir import FLOAT, INT, ScoreModIR
from sdpagraph.scoremod.ir_grad import derive_bprop
from sdpagraph.scoremod.recording import RecordingGraph


@dataclass(frozen=True)
class LeadingScale:
    """`ir` is the mod after its leading `score <op> factor`.

    factor: ("scalar", name), bound at run time, or ("const", value)
    op:     "div" (the score was divided by the factor) or "mul"
    """

    ir: ScoreModIR
    factor: tuple[str, Any]
    op: str


def folded_scale(attn_scale: float, factor: Any, op: str) -> float:
    """The attention scale that makes a folded mod equal the original: `attn_scale / factor` ("div")
    or `attn_scale * factor` ("mul"), in IEEE arithmetic (a zero factor divides to inf, as the mod's
    own division would have)."""
    with np.errstate(divide="ignore", invalid="ignore"):
        scale, value = np.float64(attn_scale), np.float64(factor)
        return float(scale / value if op == "div" else scale * value)


def fold_leading_scale(ir: ScoreModIR, direction: str) -> LeadingScale | None:
    """`ir` with its leading scaling moved into the attention scale, for a graph of `direction`
    ("forward", "inference" or "backward"), or None (see the module doc). Forward and inference
    graphs get the forward part alone (they never run the bprop); a backward graph gets the bprop
    derived again, and none where the user gave it."""
    found = _leading_step(ir, direction)
    if found is None:
        return None
    step, score, factor, op = found
    return LeadingScale(_without(ir, step, score, bprop=direction == "backward"), factor, op)


def folds_leading_scale(ir: ScoreModIR | None, direction: str) -> bool:
    """Whether `fold_leading_scale` rewrites `ir` for a `direction` graph (cheap: no rewriting)."""
    return ir is not None and _leading_step(ir, direction) is not None


def _leading_step(ir: ScoreModIR, direction: str) -> tuple[int, int, tuple[str, Any], str] | None:
    """(step node, score node, factor, op) of the mod's leading scaling, or None."""
    if direction == "backward" and ir.user_bprop:
        return None
    forward = ir.forward_nodes()
    scores = [i for i in forward if ir.nodes[i].op == "score"]
    if len(scores) != 1 or ir.output == scores[0]:
        return None
    score = scores[0]
    # gen_index reads only the score's shape, which the fold keeps
    users = [i for i in forward if score in ir.nodes[i].args and ir.nodes[i].op != "gen_index"]
    if len(users) != 1 or users[0] == ir.output:
        return None
    scaling = _scaling(ir, users[0], score)
    return None if scaling is None else (users[0], score, *scaling)


def _scaling(ir: ScoreModIR, index: int, score: int) -> tuple[tuple[str, Any], str] | None:
    """(factor, op) when node `index` is `score / factor`, `score * factor` or `factor * score`."""
    node = ir.nodes[index]
    if node.dtype != FLOAT:
        return None
    if node.op == "div" and node.args[0] == score and node.args[1] != score:
        other = node.args[1]
    elif node.op == "mul" and score in node.args and node.args != (score, score):
        other = node.args[1] if node.args[0] == score else node.args[0]
    else:
        return None
    leaf = ir.nodes[other]
    if leaf.op == "scalar" and leaf.dtype == FLOAT:
        return ("scalar", ir.scalar_names[leaf.attr("slot")]), node.op
    if leaf.op == "const" and leaf.dtype in (FLOAT, INT) and math.isfinite(leaf.attr("value")) and leaf.attr("value"):
        return ("const", float(leaf.attr("value"))), node.op
    return None


def _without(ir: ScoreModIR, step: int, score: int, bprop: bool) -> ScoreModIR:
    """The forward of `ir` with node `step` replaced by the score; with `bprop` (and a bprop in
    `ir`), its bprop derived again. The original's bprop was derived over these same ops, so this
    one derives too."""
    graph = RecordingGraph()
    remap: dict[int, int] = {}
    for index in sorted(ir.forward_nodes()):
        node = ir.nodes[index]
        if index == step:
            remap[index] = remap[score]
            continue
        name = None
        if node.op == "scalar":
            name = ir.scalar_names[node.attr("slot")]
        elif node.op == "array":
            name = ir.array_names[node.attr("slot")]
        remap[index] = graph.append(node.op, tuple(remap[a] for a in node.args), node.attrs, node.dtype, name)
    output = remap[ir.output]
    if not bprop or ir.grad_output is None:
        return graph.to_ir(output, None)
    folded = graph.to_ir(output, derive_bprop(graph, output, remap[score]))
    return ScoreModIR(folded.nodes, folded.output, folded.grad_output, folded.scalar_names, folded.array_names,
                      grad_derived=True)
