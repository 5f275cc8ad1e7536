"""A score_mod IR read from a spec file, checked before it is used.

    recorded_score_mod(raw, spec) -> ScoreModIR

`ScoreModIR.from_dict` trusts its input. A recorded IR (`ScoreModIR.to_dict()`, as `record` writes
it into a spec file) may have been edited by hand, so each node is checked: a known op, argument
nodes that exist and come earlier, slots, attributes, dtypes. The IR must also be in the
canonical form the recorder writes. Errors are ValueError / TypeError with the node and the
reason; `deploy.specfile` adds the file, the entry and the field.
"""
from __future__ import annotations

from typing import Any, Mapping

from sdpagraph.scoremod.ir import BOOL, FLOAT, INT, LEAF_OPS, OP_PARAMS, ScoreModIR, canonicalize
from sdpagraph.spec import AttentionSpec


def clip(text: str, width: int = 200) -> str:
    """`text`, cut to `width` characters for an error message."""
    return text if len(text) <= width else text[:width - 3] + "..."


IR_FIELDS = ("nodes", "output", "grad_output", "scalar_names", "array_names", "grad_derived")
# The attributes each op's nodes carry (every other op carries none), as the recorder writes them.
IR_ATTRIBUTES = {"scalar": ("slot",), "array": ("slot", "shape"), "const": ("value",), "gen_index": ("axis",)}
IR_DTYPES = (FLOAT, INT, BOOL)


def recorded_score_mod(raw: Any, spec: AttentionSpec) -> ScoreModIR:
    """A recorded score_mod IR (`ScoreModIR.to_dict()`), checked before it is used.

    `ScoreModIR.from_dict` trusts its input; a hand-edited IR whose nodes name nodes that do
    not exist, or come later, would fail (or loop) only when a graph is lowered. The IR must
    also be canonical, as the recorder writes it: another form of the same mod has another
    digest, so its graphs would be keyed where the runtime never looks.
    """
    if not isinstance(raw, dict):
        raise TypeError(f'must be a score_mod IR object {{"nodes": [...], "output": N, ...}} or null, '
                        f"got {clip(repr(raw))}")
    for name in raw:
        if name not in IR_FIELDS:
            raise ValueError(f"unknown IR field {name!r}; a score_mod IR has {', '.join(IR_FIELDS)}")
    for name in ("nodes", "output"):
        if name not in raw:
            raise ValueError(f"the IR's {name!r} is missing")
    nodes = raw["nodes"]
    if not isinstance(nodes, list) or not nodes:
        raise TypeError(f"the IR's 'nodes' must be a non-empty list of nodes, got {clip(repr(nodes))}")
    names = {kind: raw.get(f"{kind}_names", []) for kind in ("scalar", "array")}
    for kind, listed in names.items():
        if not isinstance(listed, list) or not all(isinstance(name, str) for name in listed):
            raise TypeError(f"the IR's '{kind}_names' must be a list of names, got {clip(repr(listed))}")
    if not isinstance(raw.get("grad_derived", False), bool):
        raise TypeError(f"the IR's 'grad_derived' must be true or false, got {raw['grad_derived']!r}")
    full_shape = (spec.batch, spec.num_heads, spec.q_len, spec.kv_len)
    for index, node in enumerate(nodes):
        _check_ir_node(index, node, len(nodes), names, full_shape)
    for name in ("output", "grad_output"):
        root = raw.get(name)
        if name == "grad_output" and root is None:
            continue
        if not _is_int(root) or not 0 <= root < len(nodes):
            raise ValueError(f"the IR's {name!r} is {root!r}, which is not a node "
                             f"(the IR has nodes 0..{len(nodes) - 1})")
    try:
        ir = ScoreModIR.from_dict(raw)
    except (KeyError, IndexError, TypeError, ValueError) as error:
        raise ValueError(f"not a valid score_mod IR: {type(error).__name__}: {error}") from error
    if "dscore" in (ir.nodes[index].op for index in ir.forward_nodes()):
        raise ValueError("the IR's forward part ('output') reads 'dscore', the incoming gradient, "
                         "which only the bprop ('grad_output') has")
    if ir.nodes[ir.output].dtype == BOOL:
        raise ValueError(f"the IR's output (node {ir.output}) is boolean; a score_mod returns the modified score")
    canonical = canonicalize(ir.nodes, ir.output, ir.grad_output, {}, ir.scalar_names, ir.array_names)
    if (canonical.nodes, canonical.output, canonical.grad_output, canonical.scalar_names, canonical.array_names) != (
            ir.nodes, ir.output, ir.grad_output, ir.scalar_names, ir.array_names):
        raise ValueError("the IR is not in the canonical form the recorder writes (every node reachable from "
                         "'output' or 'grad_output', in order, scalar and array slots numbered by first use, "
                         "every name used): record the mod again rather than editing its IR")
    return ir


def _check_ir_node(index: int, node: Any, count: int, names: Mapping[str, list], full_shape: tuple) -> None:
    if not (isinstance(node, list) and len(node) == 4 and isinstance(node[0], str)
            and isinstance(node[1], list) and isinstance(node[2], list)):
        raise TypeError(f"node {index}: a node is [op, [argument nodes], [[attribute, value], ...], dtype], "
                        f"got {clip(repr(node))}")
    op, args, attrs, dtype = node
    where = f"node {index} ({op})"
    if op not in OP_PARAMS and op not in LEAF_OPS:
        raise ValueError(f"node {index}: unknown op {op!r}")
    arity = 0 if op in LEAF_OPS else len(OP_PARAMS[op])
    if len(args) != arity:
        raise ValueError(f"{where}: takes {arity} argument node(s), got {len(args)}: {args!r}")
    for position, arg in enumerate(args):
        if not _is_int(arg):
            raise TypeError(f"{where}: argument {position} must be a node index, got {arg!r}")
        if not 0 <= arg < count:
            raise ValueError(f"{where}: argument {position} is node {arg}, which does not exist "
                             f"(the IR has nodes 0..{count - 1})")
        if arg >= index:
            raise ValueError(f"{where}: argument {position} is node {arg}, which does not come before it "
                             "(a node's arguments are earlier nodes)")
    if dtype not in IR_DTYPES:
        raise ValueError(f"{where}: dtype must be one of {', '.join(IR_DTYPES)}, got {dtype!r}")
    if not all(isinstance(pair, list) and len(pair) == 2 and isinstance(pair[0], str) for pair in attrs):
        raise TypeError(f"{where}: attributes are [[name, value], ...], got {clip(repr(attrs))}")
    values = dict(attrs)
    expected = IR_ATTRIBUTES.get(op, ())
    if sorted(values) != sorted(expected) or len(values) != len(attrs):
        raise ValueError(f"{where}: has attributes {sorted(values)}; a {op} node has "
                         + (", ".join(expected) if expected else "none"))
    if op in ("scalar", "array"):
        slot = values["slot"]
        if not _is_int(slot) or not 0 <= slot < len(names[op]):
            raise ValueError(f"{where}: slot {slot!r} is not one of the IR's {op}_names "
                             f"({len(names[op])} of them)")
        if dtype == BOOL:
            raise ValueError(f"{where}: a {op} operand is float32 or int32, got bool")
    if op == "array":
        shape = values["shape"]
        if not (isinstance(shape, list) and len(shape) == 4 and all(_is_int(d) for d in shape)
                and all(d in (1, full) for d, full in zip(shape, full_shape))):
            raise ValueError(f"{where}: shape {shape!r} is not a 4-D shape broadcastable to (B, N, T, S)="
                             f"{full_shape}")
    if op == "const" and (isinstance(values["value"], bool) != (dtype == BOOL)
                          or not isinstance(values["value"], (int, float))):
        raise TypeError(f"{where}: value {values['value']!r} is not a {dtype} constant")
    if op == "gen_index" and values["axis"] not in (0, 1, 2, 3):
        raise ValueError(f"{where}: axis must be 0..3 (batch, head, query, key position), got {values['axis']!r}")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
