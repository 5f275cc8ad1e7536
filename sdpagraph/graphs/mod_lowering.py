"""ScoreModIR -> cuDNN pointwise ops, inside sdpa's score_mod / score_mod_bprop callbacks.

A graph's mod runs in stages: the user's IR, then the spec's masks (`scoremod.masks`).
The forward callback applies them in that order; the bprop callback applies their
bprops in reverse (mask bprop first, then the user's). Every op gets an explicit
compute type and result type: cuDNN declines backward graphs whose callback
intermediates are untyped (measured on cuDNN 9.19 with frontend 1.32).

Leaves are graph tensors created on the outer pygraph before `sdpa` is called (cuDNN
calls the callbacks later, while it lowers the graph): scalars and literals become
[1,1,1,1] pass-by-value tensors, aux arrays are the graph's input operands.
Scalars (`score_mod_tensors`) and float literals are FLOAT pass-by-value tensors; int
literals are INT32 ones, as in cuDNN's own diagonal band mask: cuDNN's tile skipping
reads a diagonal's shift as an int32, so a FLOAT -128.0 there made it skip every tile
(bottom-right causal with T > S gave zeros, H100, cuDNN 9.19). Comparisons against an
int literal build; against a FLOAT pass-by-value (a float literal or a scalar) they find
no engine, so `scoremod.masks` compares positions with positions plus int literals.

The bprop may use forward tensors (softcap's bprop reads the pre-tanh value), so the
node -> tensor map of each stage lives on the `ModEmitter` of one graph, shared by its
two callbacks, and is reset whenever cuDNN calls the forward callback again. Only
tensors computed from the score are shared: positions and the masks built from them are
emitted again in the bprop, which is what lets cuDNN skip masked tiles in the backward.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

from sdpagraph.errors import Unsupported
from sdpagraph.scoremod.ir import BOOL, FLOAT, INT, OP_PARAMS, ScoreModIR
from sdpagraph.scoremod.scale_folding import LeadingScale, folded_scale
from sdpagraph.graphs.operands import ATTN_SCALE, CONST_PREFIX, SCALAR_PREFIX

BOUND_LEAVES = ("score", "dscore")


@dataclass(frozen=True)
class ModStage:
    """One IR of the mod and the operand role that feeds each of its aux arrays."""

    ir: ScoreModIR
    array_roles: Mapping[str, str]  # array name -> operand role


@dataclass(frozen=True)
class PassByValue:
    """A [1,1,1,1] host-bound tensor: ("scalar", name) bound at run time, ("const", value) baked, or
    ("attn_scale", (scale, name, op)), cuDNN's attention scale computed from the scalar `name` at run
    time (`attention_scale`).

    `dtype` is its storage: "float32", or "int32" for int literals.
    """

    role: str
    source: tuple[str, Any]
    dtype: str = "float32"


def live_nodes(ir: ScoreModIR, direction: str) -> set[int]:
    """Nodes a graph of `direction` emits: the forward part, or everything for backward."""
    return set(range(len(ir.nodes))) if direction == "backward" else ir.forward_nodes()


def pass_by_value_plan(stages: list[ModStage], direction: str) -> list[PassByValue]:
    """Every pass-by-value tensor the stages read, in a deterministic order.

    Scalars keep their names; equal literals of one type share one tensor.
    """
    plan: list[PassByValue] = []
    roles: set[str] = set()
    for stage in stages:
        for index in sorted(live_nodes(stage.ir, direction)):
            node = stage.ir.nodes[index]
            if node.op == "scalar":
                name = stage.ir.scalar_names[node.attr("slot")]
                entry = PassByValue(SCALAR_PREFIX + name, ("scalar", name))
            elif node.op == "const":
                if node.dtype == BOOL:
                    raise Unsupported("boolean literals in a score_mod are not supported on cuDNN; "
                                      "write a comparison instead")
                if _literal_role(plan, node) is not None:
                    continue
                literals = sum(p.source[0] == "const" for p in plan)
                entry = PassByValue(f"{CONST_PREFIX}{literals}", *_literal(node))
            else:
                continue
            if entry.role not in roles:
                roles.add(entry.role)
                plan.append(entry)
    return plan


def attention_scale(scale: float, fold: LeadingScale | None) -> tuple[float, PassByValue | None]:
    """cuDNN's attn_scale for a mod whose leading scaling was folded into it (`fold`): a float for a
    literal factor; for a scalar, a pass-by-value tensor the executor computes from the scalar's
    value at run time (so the graph serves every value). Without a fold, the spec's scale."""
    if fold is None:
        return scale, None
    kind, value = fold.factor
    if kind == "const":
        return folded_scale(scale, value, fold.op), None
    return scale, PassByValue(ATTN_SCALE, ("attn_scale", (scale, value, fold.op)))


def _literal(node) -> tuple[tuple[str, Any], str]:
    """(source, storage dtype) of a literal node."""
    if node.dtype == INT:
        return ("const", int(node.attr("value"))), "int32"
    return ("const", float(node.attr("value"))), "float32"


def _literal_role(plan: list[PassByValue], node) -> str | None:
    """The plan's tensor for a literal node (repr tells -0.0 from 0.0 and matches NaN)."""
    (_, value), dtype = _literal(node)
    for entry in plan:
        if entry.source[0] == "const" and entry.dtype == dtype and repr(entry.source[1]) == repr(value):
            return entry.role
    return None


@dataclass
class _StageState:
    stage: ModStage
    leaves: dict[int, Any]  # node index -> pre-created graph tensor
    values: dict[int, Any] = field(default_factory=dict)
    score: Any = None
    score_dependent: frozenset[int] = frozenset()  # nodes whose value depends on the score


class ModEmitter:
    """The score_mod and score_mod_bprop callbacks of one cuDNN graph."""

    def __init__(self, stages: list[ModStage], plan: list[PassByValue], tensors: Mapping[str, Any],
                 cudnn_types: Mapping[str, Any]):
        """`tensors`: role -> pre-created graph tensor (operands and pass-by-value)."""
        self._types = cudnn_types
        self._states = [_StageState(stage, _leaf_tensors(stage, plan, tensors), score_dependent=_score_dependent(stage.ir))
                        for stage in stages]
        self._translators: list[Any] = []  # the frontend's IR -> C++ translators our callbacks were handed

    def forward(self, graph: Any, score: Any) -> Any:
        self._remember_translator(graph)
        for state in self._states:
            state.values = {}
            state.score = score
            score = self._emit(graph, state, state.stage.ir.output, score=score)
        return score

    def bprop(self, graph: Any, dscore: Any) -> Any:
        self._remember_translator(graph)
        for state in reversed(self._states):
            # Positions, and masks computed from them, are emitted again inside the bprop from
            # dscore's indices: cuDNN skips the masked tiles in the backward only when the bprop's
            # selects compare their own indices (reusing the forward's comparisons ran every tile:
            # 2.7 against 1.4 ms for causal, bf16 B4 T4096 N16 H128, H100, bench/plans.py).
            state.values = {i: v for i, v in state.values.items() if i in state.score_dependent}
            dscore = self._emit(graph, state, state.stage.ir.grad_output, score=state.score, dscore=dscore,
                                index_input=dscore)
        return dscore

    def release(self) -> None:
        """Free what the built graph holds through these callbacks; call once its plan is serialized.

        cudnn-frontend 1.3x keeps each callback in the C++ graph, wrapped in a closure whose
        translator (`_lower` on the graph it hands the callback) closes over that same C++ graph.
        A cycle through a C++ object is invisible to Python's collector, so every built graph
        (its cuDNN tensors and engine objects) would live until exit, where nanobind reports
        them as leaks. Emptying the translator's closure cells breaks the cycle: the graph is
        freed when the builder drops it. The emitter is not usable afterwards.
        """
        for translator in self._translators:
            for cell in getattr(translator, "__closure__", None) or ():
                cell.cell_contents = None
        self._translators.clear()
        for state in self._states:
            state.leaves, state.values, state.score = {}, {}, None

    def _remember_translator(self, graph: Any) -> None:
        translator = getattr(graph, "_lower", None)  # absent on graphs that are not the frontend's shim
        if translator is not None and translator not in self._translators:
            self._translators.append(translator)

    def _emit(self, graph: Any, state: _StageState, root: int, index_input: Any = None, **bound: Any) -> Any:
        nodes = state.stage.ir.nodes
        for index in sorted(_missing(nodes, root, state.values)):
            node = nodes[index]
            if node.op in BOUND_LEAVES:
                state.values[index] = bound[node.op]
            elif index in state.leaves:
                state.values[index] = state.leaves[index]
            else:
                state.values[index] = self._apply(graph, node, [state.values[a] for a in node.args], index_input)
        return state.values[root]

    def _apply(self, graph: Any, node, operands: list, index_input: Any = None) -> Any:
        kwargs: dict[str, Any] = dict(zip(OP_PARAMS[node.op], operands))
        if node.op == "gen_index":
            kwargs["axis"] = node.attr("axis")
            if index_input is not None:
                kwargs["input"] = index_input
        # The result type doubles as the compute type: BOOLEAN for comparisons and
        # logic (as cuDNN's own masks do), INT32 for index arithmetic, FLOAT otherwise.
        result = getattr(graph, node.op)(**kwargs, compute_data_type=self._types[node.dtype])
        result.set_data_type(self._types[node.dtype])
        return result


def _leaf_tensors(stage: ModStage, plan: list[PassByValue], tensors: Mapping[str, Any]) -> dict[int, Any]:
    ir = stage.ir
    roles: dict[int, str] = {}
    for index, node in enumerate(ir.nodes):
        if node.op == "scalar":
            roles[index] = SCALAR_PREFIX + ir.scalar_names[node.attr("slot")]
        elif node.op == "array":
            roles[index] = stage.array_roles[ir.array_names[node.attr("slot")]]
        elif node.op == "const":
            roles[index] = _literal_role(plan, node)
    # Leaves this direction never emits have no tensor (and no plan entry); they are never looked up.
    return {index: tensors[role] for index, role in roles.items() if role in tensors}


def _score_dependent(ir: ScoreModIR) -> frozenset[int]:
    """Nodes computed from the score's values (gen_index reads only its shape); nodes are topologically ordered."""
    dependent: set[int] = set()
    for index, node in enumerate(ir.nodes):
        if node.op == "score" or (node.op != "gen_index" and any(arg in dependent for arg in node.args)):
            dependent.add(index)
    return frozenset(dependent)


def _missing(nodes, root: int, known: Mapping[int, Any]) -> set[int]:
    """Nodes `root` needs that have no tensor yet."""
    missing: set[int] = set()
    stack = [root]
    while stack:
        index = stack.pop()
        if index in missing or index in known:
            continue
        missing.add(index)
        stack.extend(nodes[index].args)
    return missing


def cudnn_type_map(cudnn: Any) -> dict[str, Any]:
    return {FLOAT: cudnn.data_type.FLOAT, INT: cudnn.data_type.INT32, BOOL: cudnn.data_type.BOOLEAN}

