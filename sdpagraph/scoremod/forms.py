"""The forms of a call's mods, and how they become one score_mod IR.

    score_mod(graph, score, tensors) -> tensor      graph form: cudnn-frontend pygraph ops
    score_mod(score, b, h, q_idx, kv_idx) -> score  jax.numpy form, as in PyTorch FlexAttention
    mask_mod(b, h, q_idx, kv_idx) -> bool           jax.numpy, True = attend

A call's mods are applied in that order: the score_mod, then the mask_mod (a masked score
becomes -inf). jax.numpy mods are converted into the IR (`scoremod.jnp.convert`), so they run on
cuDNN like graph mods. A jax.numpy mod the IR cannot express (a gather at a computed index,
control flow, random numbers, ...) is kept as a Python function (`PythonMods`): the XLA backend
calls it, and the call's support answer names what declined.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from sdpagraph.scoremod.jnp.convert import JnpMod, convert_jnp_mask_mod, convert_jnp_score_mod
from sdpagraph.scoremod.jnp.interpreter import JnpModUnsupported

GRAPH_FORM, JNP_FORM = "graph", "jnp"
FORMS_TEXT = ("score_mod(graph, score, tensors) -> tensor (cudnn pygraph ops) or "
               "score_mod(score, b, h, q_idx, kv_idx) -> score (jax.numpy)")
MASK_PREFIX = "mask_captured"  # prefix of the tensors a mask_mod reads (the score_mod's: "captured")


@dataclass(frozen=True)
class PythonMods:
    """jax.numpy mods the IR cannot express: the XLA backend runs them as Python functions."""

    score_mod: Callable | None
    mask_mod: Callable | None
    reason: str  # what declined, for the support answer


@dataclass(frozen=True)
class FlexMods:
    """A call's mods, resolved: a graph-form callback recording all that the IR can express (None
    when there is nothing to record), the tensors the jax.numpy mods read (captured arrays, graph
    operands, and lifted float literals, bound scalars; by name, as score_mod_tensors), and the
    mods left to Python."""

    callback: Callable | None
    tensors: Mapping[str, Any]
    python: PythonMods | None


def score_mod_form(score_mod: Callable) -> str:
    """GRAPH_FORM or JNP_FORM, from the number of positional parameters (3 or 5)."""
    count = _positional_count(score_mod, "score_mod")
    if count == 3:
        return GRAPH_FORM
    if count == 5:
        return JNP_FORM
    raise TypeError(f"score_mod takes {count} positional arguments; write it as {FORMS_TEXT}")


def check_mask_mod(mask_mod: Any) -> None:
    if not callable(mask_mod):
        raise TypeError(f"mask_mod must be callable (b, h, q_idx, kv_idx) -> bool, got {type(mask_mod).__name__}")
    count = _positional_count(mask_mod, "mask_mod")
    if count != 4:
        raise TypeError(f"mask_mod takes {count} positional arguments; write it as "
                        "mask_mod(b, h, q_idx, kv_idx) -> bool (True = attend)")


def resolve(score_mod: Callable | None, mask_mod: Callable | None, shape: tuple[int, int, int, int]) -> FlexMods:
    """The call's mods as one graph-form callback (plus the tensors it reads), or as Python functions.

    `score_mod` may be in either form; `mask_mod` is jax.numpy. `shape` is (B, N, T, S). When a
    jax.numpy mod cannot be converted, every jax.numpy mod of the call stays Python (a graph-form
    score_mod is still recorded: the XLA backend evaluates it first).
    """
    graph_mod = score_mod if score_mod is not None and score_mod_form(score_mod) == GRAPH_FORM else None
    jnp_score = score_mod if score_mod is not None and graph_mod is None else None
    if mask_mod is not None:
        check_mask_mod(mask_mod)
    try:
        converted = ([convert_jnp_score_mod(jnp_score, shape)] if jnp_score is not None else []) + \
                    ([convert_jnp_mask_mod(mask_mod, shape, name_prefix=MASK_PREFIX)] if mask_mod is not None else [])
    except JnpModUnsupported as error:
        return FlexMods(graph_mod, {}, PythonMods(jnp_score, mask_mod, str(error)))
    tensors = {name: value for mod in converted for name, value in mod.tensors.items()}
    return FlexMods(_chain(graph_mod, converted), tensors, None)


def _chain(graph_mod: Callable | None, converted: list[JnpMod]) -> Callable | None:
    """One graph-form callback: the graph mod (with the call's own tensors), then each converted
    mod (with the tensors it reads)."""
    if not converted:
        return graph_mod
    captured = {name for mod in converted for name in mod.tensors}

    def chained(graph: Any, score: Any, tensors: Mapping[str, Any]) -> Any:
        if graph_mod is not None:
            score = graph_mod(graph, score, {n: t for n, t in tensors.items() if n not in captured})
        for mod in converted:
            score = mod.callback(graph, score, tensors)
        return score

    return chained


def _positional_count(fn: Callable, argname: str) -> int:
    try:
        parameters = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        raise TypeError(f"{argname}'s parameters cannot be inspected; pass a Python function") from None
    kinds = [p.kind for p in parameters]
    if inspect.Parameter.VAR_POSITIONAL in kinds:
        raise TypeError(f"{argname} takes *args: name its parameters "
                        + ("(b, h, q_idx, kv_idx)" if argname == "mask_mod" else f"({FORMS_TEXT})"))
    return sum(kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD) for kind in kinds)
