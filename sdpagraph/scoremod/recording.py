"""Recording a `score_mod` callback: `RecordingGraph` stands in for a cudnn-frontend `pygraph`, and
each `ModTensor` it hands out records the pointwise ops applied to it as `Node`s; `finish` gives the
canonical `ScoreModIR` (`scoremod.ir`).
"""
from __future__ import annotations

import numbers
from typing import Any, Callable

import numpy as np

from sdpagraph.scoremod.ir import (BOOL, FLOAT, INT, LEAF_OPS, OP_PARAMS, Node, ScoreModError, ScoreModIR,
                                   canonicalize, parse_data_type, result_type)


def _operator(op: str, reflected: bool = False) -> Callable:
    """A Python operator method that records `op` (operands swapped when reflected)."""

    def method(self: "ModTensor", other: Any) -> "ModTensor":
        return self.graph._record(op, (other, self) if reflected else (self, other))

    return method


class ModTensor:
    """A value inside a recording; supports the pygraph tensor calls and Python operators."""

    __slots__ = ("graph", "index")

    def __init__(self, graph: "RecordingGraph", index: int):
        self.graph = graph
        self.index = index

    # cudnn-frontend tensor methods a callback may call; they return self for chaining.
    def set_data_type(self, data_type: Any) -> "ModTensor":
        self.graph._set_dtype(self.index, parse_data_type(data_type))
        return self

    def set_name(self, _name: str) -> "ModTensor":
        return self

    def set_output(self, _flag: bool = True) -> "ModTensor":
        return self

    def set_is_virtual(self, _flag: bool = True) -> "ModTensor":
        return self

    def get_data_type(self) -> str:
        return self.graph._nodes[self.index].dtype

    @property
    def dtype(self) -> str:
        return self.get_data_type()

    __add__ = _operator("add")
    __radd__ = _operator("add", reflected=True)
    __sub__ = _operator("sub")
    __rsub__ = _operator("sub", reflected=True)
    __mul__ = _operator("mul")
    __rmul__ = _operator("mul", reflected=True)
    __truediv__ = _operator("div")
    __rtruediv__ = _operator("div", reflected=True)
    __pow__ = _operator("pow")
    __lt__ = _operator("cmp_lt")
    __le__ = _operator("cmp_le")
    __gt__ = _operator("cmp_gt")
    __ge__ = _operator("cmp_ge")
    __and__ = _operator("logical_and")
    __or__ = _operator("logical_or")

    def __neg__(self) -> "ModTensor":
        return self.graph._record("neg", (self,))

    def __invert__(self) -> "ModTensor":
        return self.graph._record("logical_not", (self,))

    def __bool__(self) -> bool:
        raise ScoreModError(
            "a score_mod tensor has no Python truth value: use graph.binary_select / cmp_* instead of if/and/or"
        )

    def __repr__(self) -> str:
        node = self.graph._nodes[self.index]
        return f"ModTensor(%{self.index} = {node.op}, {node.dtype})"


class RecordingGraph:
    """Stands in for a cudnn-frontend pygraph while a score_mod callback runs."""

    def __init__(self) -> None:
        self._nodes: list[Node] = []
        self._memo: dict[Node, int] = {}
        self._leaf_names: dict[int, str] = {}

    def to_ir(self, output: int, grad_output: int | None) -> "ScoreModIR":
        """The canonical IR of what `output` (and the bprop `grad_output`) reach."""
        return canonicalize(self._nodes, output, grad_output, self._leaf_names)

    # -- pygraph-compatible pointwise methods --------------------------------------------
    def __getattr__(self, op: str) -> Callable[..., ModTensor]:
        if op.startswith("_"):  # private names are never ops: getattr(graph, "_x", default) works
            raise AttributeError(op)
        if op not in OP_PARAMS:
            raise ScoreModError(
                f"score_mod used unknown op {op!r}; supported ops: {', '.join(sorted(OP_PARAMS))}"
            )
        params = OP_PARAMS[op]

        def method(*args: Any, axis: Any = None, compute_data_type: Any = None, name: str | None = None,
                   **kwargs: Any) -> ModTensor:
            del name  # names are cosmetic in cuDNN; they never change the graph
            values = self._bind(params, args, kwargs, op=op)
            attrs: tuple[tuple[str, Any], ...] = ()
            if op == "gen_index":
                if axis is None:
                    raise ScoreModError("gen_index needs axis= (2 = query position, 3 = key position)")
                if int(axis) not in (0, 1, 2, 3):
                    raise ScoreModError(f"gen_index axis must be 0..3 (b, h, q, kv), got {axis}")
                attrs = (("axis", int(axis)),)
            if compute_data_type is not None:
                parse_data_type(compute_data_type)  # validated only: result types are inferred (result_type)
            return self._record(op, values, attrs)

        return method

    def _bind(self, params: tuple[str, ...], args: tuple, kwargs: dict, op: str) -> tuple:
        if len(args) > len(params):
            raise ScoreModError(f"{op} takes {len(params)} tensor argument(s) {params}, got {len(args)}")
        bound = dict(zip(params, args))
        for key, value in kwargs.items():
            if key not in params or key in bound:
                raise ScoreModError(f"{op} got unexpected keyword {key!r}; expected {params}")
            bound[key] = value
        missing = [p for p in params if p not in bound]
        if missing:
            raise ScoreModError(f"{op} is missing argument(s) {missing}")
        return tuple(bound[p] for p in params)

    # -- node creation ----------------------------------------------------------------------
    def _emit(self, node: Node, leaf_name: str | None = None) -> int:
        if node.op not in ("score", "dscore", "scalar", "array") and node in self._memo:
            return self._memo[node]
        self._nodes.append(node)
        index = len(self._nodes) - 1
        self._memo.setdefault(node, index)
        if leaf_name is not None:
            self._leaf_names[index] = leaf_name
        return index

    def _operand(self, value: Any) -> int:
        if isinstance(value, ModTensor):
            if value.graph is not self:
                raise ScoreModError("a score_mod used a tensor from a different graph")
            return value.index
        if isinstance(value, (bool, np.bool_)):
            return self._emit(Node("const", (), (("value", bool(value)),), BOOL))
        if isinstance(value, numbers.Integral):
            return self._emit(Node("const", (), (("value", int(value)),), INT))
        if isinstance(value, numbers.Real):
            return self._emit(Node("const", (), (("value", float(value)),), FLOAT))
        raise ScoreModError(
            f"score_mod passed a {type(value).__name__} to an op; use graph tensors, the `tensors` "
            "mapping (score_mod_tensors) or Python numbers"
        )

    def _record(self, op: str, values: tuple, attrs: tuple = ()) -> ModTensor:
        args = tuple(self._operand(v) for v in values)
        types = tuple(self._nodes[a].dtype for a in args)
        return ModTensor(self, self._emit(Node(op, args, attrs, result_type(op, types))))

    def _set_dtype(self, index: int, dtype: str) -> None:
        node = self._nodes[index]
        if node.dtype == dtype:
            return
        if node.op in LEAF_OPS:
            raise ScoreModError(f"cannot change the data type of a {node.op} input to {dtype}")
        if (node.dtype == BOOL) != (dtype == BOOL):
            raise ScoreModError(f"cannot set data type {dtype} on a {node.op} result of type {node.dtype}")
        retyped = Node(node.op, node.args, node.attrs, dtype)
        self._nodes[index] = retyped
        # The node no longer computes its old type: a later identical op of the old type must get a
        # node of its own, not this retyped one (mul(s, 2) retyped to int32 came back for a second mul(s, 2)).
        if self._memo.get(node) == index:
            del self._memo[node]
        self._memo.setdefault(retyped, index)

    def leaf(self, op: str, attrs: tuple = (), dtype: str = FLOAT, name: str | None = None) -> ModTensor:
        return ModTensor(self, self._emit(Node(op, (), attrs, dtype), leaf_name=name))

    def append(self, op: str, args: tuple[int, ...], attrs: tuple, dtype: str, leaf_name: str | None = None) -> int:
        """Append a node of a given type (a leaf named `leaf_name`): replaying an IR's nodes."""
        return self._emit(Node(op, args, attrs, dtype), leaf_name=leaf_name)

    def emit(self, op: str, args: tuple[int, ...], attrs: tuple = ()) -> int:
        """Append an op over existing node indices (used by the differentiator)."""
        types = tuple(self._nodes[a].dtype for a in args)
        return self._emit(Node(op, args, attrs, result_type(op, types)))

    def const(self, value: float) -> int:
        return self._operand(float(value))

    def node(self, index: int) -> Node:
        return self._nodes[index]


