"""ScoreModIR: a `score_mod` callback recorded into a canonical, hashable ops DAG.

A user's `score_mod(graph, score, tensors)` is called once with a `RecordingGraph`
(`scoremod.recording`) in place of a cudnn-frontend `pygraph`. The recorder accepts the
pygraph's pointwise method names and keyword names, so callbacks written for cuDNN (or
Transformer Engine) run unchanged. The result is a `ScoreModIR`:

- nodes in topological order, dead nodes dropped, identical nodes merged;
- leaves: the score (`score`), the incoming gradient (`dscore`, backward only),
  pass-by-value scalars (`scalar`), aux arrays (`array`) and literals (`const`);
- a content hash over ops, wiring, attributes, literal values and operand
  shapes/dtypes, and never over the Python function's identity, closure or name, nor
  over scalar VALUES (those are bound at execution; a new softcap value reuses the
  graph) nor tensor names (names only say how to bind values to slots).

The forward part is what `output` reaches; `grad_output` (if any) is the bprop,
user-given or derived by `scoremod.ir_grad`, and may use forward nodes.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any, Mapping

from sdpagraph.errors import SdpagraphError

FLOAT, INT, BOOL = "float32", "int32", "bool"

# op name -> positional keyword names, as cudnn-frontend's pygraph spells them.
UNARY_OPS = (
    "abs", "ceil", "cos", "erf", "exp", "floor", "log", "neg", "reciprocal", "rsqrt",
    "sigmoid", "sin", "softplus", "sqrt", "tan", "tanh", "logical_not", "identity",
)
AB_OPS = ("add", "sub", "mul", "div", "logical_and", "logical_or")
INPUT01_OPS = ("max", "min", "mod", "pow")
CMP_OPS = ("cmp_eq", "cmp_neq", "cmp_gt", "cmp_ge", "cmp_lt", "cmp_le")
OP_PARAMS: dict[str, tuple[str, ...]] = {
    **{op: ("input",) for op in UNARY_OPS},
    **{op: ("a", "b") for op in AB_OPS},
    **{op: ("input0", "input1") for op in INPUT01_OPS},
    **{op: ("input", "comparison") for op in CMP_OPS},
    "binary_select": ("input0", "input1", "mask"),
    "gen_index": ("input",),  # plus the static `axis`
    "tanh_backward": ("loss", "input"),
    "sigmoid_backward": ("loss", "input"),
}
LEAF_OPS = ("score", "dscore", "scalar", "array", "const")
# Unary ops whose result keeps an integer input's type; every other unary op is float.
TYPE_PRESERVING_UNARY = ("abs", "neg", "identity", "ceil", "floor")
ARITH_OPS = ("add", "sub", "mul", "max", "min", "mod")


class ScoreModError(SdpagraphError, TypeError):
    """A score_mod callback did something the recorder cannot represent."""


# jax.numpy / NumPy / jax.nn names -> the pygraph op a graph score_mod calls instead.
_ARRAY_API_OPS = {
    "absolute": "abs", "negative": "neg", "maximum": "max", "minimum": "min", "where": "binary_select",
    "subtract": "sub", "multiply": "mul", "divide": "div", "true_divide": "div", "power": "pow",
    "fmod": "mod", "remainder": "mod", "equal": "cmp_eq", "not_equal": "cmp_neq", "greater": "cmp_gt",
    "greater_equal": "cmp_ge", "less": "cmp_lt", "less_equal": "cmp_le", "arange": "gen_index",
}


def array_api_error(function: str | None, detail: str) -> ScoreModError:
    """The error for a score_mod that called jax.numpy (or NumPy, jax.nn) on a graph tensor: a graph
    score_mod records cuDNN pointwise ops, so it must call the graph's op of that name."""
    op = _ARRAY_API_OPS.get(function or "", function)
    if op in OP_PARAMS:
        args = ", ".join(f"{p}=..." for p in OP_PARAMS[op]) + (", axis=2|3" if op == "gen_index" else "")
        advice = f"call graph.{op}({args}) instead"
    else:
        advice = (f"call the graph's ops instead (graph.tanh(input=score) for jnp.tanh(score); "
                  f"ops: {', '.join(sorted(OP_PARAMS))}) or Python operators")
    called = "a jax.numpy/NumPy function" if function is None else f"{function}()"
    return ScoreModError(f"score_mod called {called} on a graph tensor; a graph score_mod records cuDNN ops, "
                         f"not jax.numpy: {advice}, or write it in jax.numpy as "
                         f"score_mod(score, b, h, q_idx, kv_idx) [{detail}]")


def parse_data_type(value: Any) -> str:
    """cuDNN data-type enums or strings -> FLOAT / INT / BOOL."""
    text = str(getattr(value, "name", value)).lower().rsplit(".", 1)[-1]
    aliases = {"float": FLOAT, "float32": FLOAT, "fp32": FLOAT, "half": FLOAT, "float16": FLOAT,
               "bfloat16": FLOAT, "int32": INT, "int": INT, "int64": INT, "boolean": BOOL, "bool": BOOL}
    if text not in aliases:
        raise ScoreModError(f"unsupported data type {value!r} in score_mod; use FLOAT, INT32 or BOOLEAN")
    return aliases[text]


@dataclass(frozen=True)
class Node:
    op: str
    args: tuple[int, ...] = ()
    attrs: tuple[tuple[str, Any], ...] = ()
    dtype: str = FLOAT

    def attr(self, name: str, default: Any = None) -> Any:
        return dict(self.attrs).get(name, default)


def result_type(op: str, arg_types: tuple[str, ...]) -> str:
    if op in CMP_OPS or op in ("logical_and", "logical_or", "logical_not"):
        return BOOL
    if op == "gen_index":
        return INT
    if op == "binary_select":
        return INT if arg_types[0] == arg_types[1] == INT else FLOAT
    if op in TYPE_PRESERVING_UNARY:
        return arg_types[0]
    if op in ARITH_OPS:
        return INT if all(t == INT for t in arg_types) else FLOAT
    return FLOAT


# ----------------------------------------------------------------------------- the IR

@dataclass(frozen=True)
class ScoreModIR:
    """Canonical score_mod DAG. `scalar_names[i]`/`array_names[i]` bind slot i to a name."""

    nodes: tuple[Node, ...]
    output: int
    grad_output: int | None = None
    scalar_names: tuple[str, ...] = ()
    array_names: tuple[str, ...] = ()
    grad_derived: bool = False
    _digests: dict = field(default_factory=dict, compare=False, hash=False, repr=False)

    def _canonical(self, roots: tuple[int | None, ...]) -> bytes:
        payload = {
            "nodes": [[n.op, list(n.args), [[k, v] for k, v in n.attrs], n.dtype] for n in self.nodes],
            "roots": list(roots),
        }
        return json.dumps(payload, sort_keys=True, separators=(",", ":")).encode()

    @property
    def user_bprop(self) -> bool:
        """Whether the bprop is the user's `score_mod_bprop` (a derived one equals jax's autodiff of
        the forward, which the jax.numpy backends use instead)."""
        return self.grad_output is not None and not self.grad_derived

    @property
    def digest(self) -> str:
        """Hash of the whole IR (forward and bprop): the backward graph's key part."""
        if "all" not in self._digests:
            self._digests["all"] = hashlib.sha256(self._canonical((self.output, self.grad_output))).hexdigest()
        return self._digests["all"]

    @property
    def forward_digest(self) -> str:
        """Hash of the forward part only: forward/inference graphs ignore the bprop."""
        if "fwd" not in self._digests:
            forward = canonicalize(self.nodes, self.output, None, {}, self.scalar_names, self.array_names)
            self._digests["fwd"] = hashlib.sha256(forward._canonical((forward.output, None))).hexdigest()
        return self._digests["fwd"]

    @property
    def reads_positions(self) -> bool:
        """Whether the mod (forward or bprop) reads query or key positions: gen_index on axis 2 or 3."""
        return any(n.op == "gen_index" and n.attr("axis") in (2, 3) for n in self.nodes)

    def slots(self, op: str) -> list[tuple[int, Node]]:
        return [(i, n) for i, n in enumerate(self.nodes) if n.op == op]

    def forward_nodes(self) -> set[int]:
        return reachable(self.nodes, (self.output,))

    def to_dict(self) -> dict[str, Any]:
        """Plain data (msgpack/JSON-able) so spec files can carry a mod without user code."""
        return {
            "nodes": [[n.op, list(n.args), [[k, list(v) if isinstance(v, tuple) else v] for k, v in n.attrs], n.dtype]
                      for n in self.nodes],
            "output": self.output,
            "grad_output": self.grad_output,
            "scalar_names": list(self.scalar_names),
            "array_names": list(self.array_names),
            "grad_derived": self.grad_derived,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "ScoreModIR":
        nodes = tuple(
            Node(op, tuple(args), tuple((k, tuple(v) if isinstance(v, list) else v) for k, v in attrs), dtype)
            for op, args, attrs, dtype in data["nodes"]
        )
        for node in nodes:
            if node.op not in OP_PARAMS and node.op not in LEAF_OPS:
                raise ValueError(f"score_mod IR has unknown op {node.op!r}")
        return cls(nodes, data["output"], data.get("grad_output"), tuple(data.get("scalar_names", ())),
                   tuple(data.get("array_names", ())), bool(data.get("grad_derived", False)))


def reachable(nodes: tuple[Node, ...] | list[Node], roots: tuple[int | None, ...]) -> set[int]:
    seen: set[int] = set()
    stack = [r for r in roots if r is not None]
    while stack:
        i = stack.pop()
        if i not in seen:
            seen.add(i)
            stack.extend(nodes[i].args)
    return seen


def canonicalize(nodes, output, grad_output, leaf_names, scalar_names=(), array_names=()) -> ScoreModIR:
    """Drop dead nodes, renumber in order, number scalar/array slots by first use."""
    live = sorted(reachable(nodes, (output, grad_output)))
    remap: dict[int, int] = {}
    canon: list[Node] = []
    names: dict[str, list[str]] = {"scalar": [], "array": []}
    for old in live:
        node = nodes[old]
        attrs = node.attrs
        if node.op in ("scalar", "array"):
            name = leaf_names[old] if old in leaf_names else (
                scalar_names if node.op == "scalar" else array_names)[node.attr("slot")]
            attrs = (("slot", len(names[node.op])),) + tuple(kv for kv in node.attrs if kv[0] != "slot")
            names[node.op].append(name)
        remap[old] = len(canon)
        canon.append(Node(node.op, tuple(remap[a] for a in node.args), attrs, node.dtype))
    return ScoreModIR(
        nodes=tuple(canon),
        output=remap[output],
        grad_output=None if grad_output is None else remap[grad_output],
        scalar_names=tuple(names["scalar"]),
        array_names=tuple(names["array"]),
    )


def with_position_offsets(ir: ScoreModIR, offsets: Mapping[int, str]) -> ScoreModIR:
    """`ir` with every `gen_index(axis)` of `offsets` shifted by an int32 (1, 1, 1, 1) array operand
    named `offsets[axis]`: a graph of one block of a longer sequence sees global positions, and the
    offsets are operands, so one graph serves every block (context parallelism's ring)."""
    nodes: list[Node] = []
    remap: dict[int, int] = {}
    leaf_names: dict[int, str] = {}
    offset_leaf: dict[int, int] = {}
    for old, node in enumerate(ir.nodes):
        nodes.append(Node(node.op, tuple(remap[a] for a in node.args), node.attrs, node.dtype))
        remap[old] = len(nodes) - 1
        axis = node.attr("axis") if node.op == "gen_index" else None
        if axis not in offsets:
            continue
        if axis not in offset_leaf:
            nodes.append(Node("array", (), (("slot", -1), ("shape", (1, 1, 1, 1))), INT))
            offset_leaf[axis] = len(nodes) - 1
            leaf_names[offset_leaf[axis]] = offsets[axis]
        nodes.append(Node("add", (remap[old], offset_leaf[axis]), (), result_type("add", (node.dtype, INT))))
        remap[old] = len(nodes) - 1
    shifted = canonicalize(nodes, remap[ir.output], None if ir.grad_output is None else remap[ir.grad_output],
                            leaf_names, ir.scalar_names, ir.array_names)
    return ScoreModIR(shifted.nodes, shifted.output, shifted.grad_output, shifted.scalar_names, shifted.array_names,
                      ir.grad_derived)
