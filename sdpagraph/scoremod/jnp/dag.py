"""The DAG a jax.numpy mod is converted into (`scoremod.jnp.convert`), its booleans, and its replay.

`Dag` holds hash-consed score_mod IR nodes (`scoremod.ir.Node`), with the axes each node reads and
whether it reads the score; INT nodes can be read as linear forms over positions (how the converter
finds `q - kv >= c` however it is written). Booleans are never DAG values (cuDNN 9.19 finds no
engine for logical ops): they are formulas over comparisons, expanded into selects where they are
consumed. `replay` records a DAG's nodes on a pygraph-like graph (a `RecordingGraph`, or the
graph cuDNN hands a score_mod callback) in a canonical order, so the same mod always records the
same IR.
"""
from __future__ import annotations

from typing import Any, Mapping, Sequence

from sdpagraph.scoremod.ir import FLOAT, INT, OP_PARAMS, Node, reachable, result_type
from sdpagraph.scoremod.recording import ModTensor


# ----------------------------------------------------------------------------- the DAG

class Dag:
    """Hash-consed IR nodes, with the axes each reads and whether it reads the score."""

    def __init__(self) -> None:
        self.nodes: list[Node] = []
        self.axes: list[frozenset] = []
        self.score_dep: list[bool] = []
        self.names: dict[int, str] = {}  # array leaf -> name
        self.literals: list[int] = []  # float literals read by float arithmetic, one node per use
        self._memo: dict[Any, int] = {}
        self._lin: dict[int, tuple[dict, int]] = {}
        self.score = self._add(Node("score"), frozenset(), True)

    def _add(self, node: Node, axes: frozenset, dep: bool, key: Any = None) -> int:
        key = node if key is None else key
        if key not in self._memo:
            self.nodes.append(node)
            self.axes.append(axes)
            self.score_dep.append(dep)
            self._memo[key] = len(self.nodes) - 1
        return self._memo[key]

    def dtype(self, index: int) -> str:
        return self.nodes[index].dtype

    def op(self, op: str, args: Sequence[int], dtype: str | None = None) -> int:
        args = tuple(args)
        natural = result_type(op, tuple(self.nodes[a].dtype for a in args))
        axes = frozenset().union(*(self.axes[a] for a in args))
        dep = any(self.score_dep[a] for a in args)
        return self._add(Node(op, args, (), natural if dtype is None else dtype), axes, dep)

    def gen(self, axis: int) -> int:
        return self._add(Node("gen_index", (self.score,), (("axis", axis),), INT), frozenset({axis}), False)

    def const(self, value: Any, dtype: str) -> int:
        value = float(value) if dtype == FLOAT else int(value)
        # keyed by repr: -0.0 and 0.0 (equal as numbers) stay two literals
        return self._add(Node("const", (), (("value", value),), dtype), frozenset(), False,
                         key=("const", dtype, repr(value)))

    def literal(self, value: float) -> int:
        """A float literal that float arithmetic reads: a node of its own for each use, which
        `scoremod.jnp.literals` may turn into a bound scalar."""
        index = self._add(Node("const", (), (("value", float(value)),), FLOAT), frozenset(), False,
                          key=("literal", len(self.literals)))
        self.literals.append(index)
        return index

    def array(self, name: str, shape: tuple[int, ...], dtype: str, axes: frozenset) -> int:
        index = self._add(Node("array", (), (("shape", shape),), dtype), axes, False, key=("array", name))
        self.names[index] = name
        return index

    def int_const(self, index: int) -> int | None:
        node = self.nodes[index]
        return node.attr("value") if node.op == "const" and node.dtype == INT else None

    def linear(self, index: int) -> tuple[dict, int]:
        """An INT node as sum(coeff * atom) + constant, over add / sub / neg / mul by a literal."""
        if index in self._lin:
            return self._lin[index]
        node = self.nodes[index]
        result: tuple[dict, int] = ({index: 1}, 0)
        if node.dtype == INT:
            if node.op == "const":
                result = ({}, node.attr("value"))
            elif node.op in ("add", "sub"):
                (fa, ca), (fb, cb) = self.linear(node.args[0]), self.linear(node.args[1])
                sign = 1 if node.op == "add" else -1
                result = (combine(fa, fb, sign), ca + sign * cb)
            elif node.op == "neg":
                fa, ca = self.linear(node.args[0])
                result = ({k: -v for k, v in fa.items()}, -ca)
            elif node.op == "mul":
                for x, y in (node.args, node.args[::-1]):
                    c = self.int_const(y)
                    if c is not None:
                        fa, ca = self.linear(x)
                        result = ({k: v * c for k, v in fa.items() if v * c}, ca * c)
                        break
        self._lin[index] = result
        return result


def combine(fa: dict, fb: dict, sign: int) -> dict:
    out = dict(fa)
    for k, v in fb.items():
        out[k] = out.get(k, 0) + sign * v
    return {k: v for k, v in out.items() if v}

# ----------------------------------------------------------------------------- booleans
# Formulas: ("const", bool) | ("cmp", op, a, b, is_int) | ("ncmp", op, a, b, False) (the negation
# of an ordered float comparison, which is not the opposite comparison when NaN is around) |
# ("and", f, g) | ("or", f, g) | ("xor", f, g). Nodes in atoms are raw; they are canonicalized
# when a select consumes the atom.

TRUE, FALSE = ("const", True), ("const", False)
FLIP = {"cmp_ge": "cmp_lt", "cmp_lt": "cmp_ge", "cmp_gt": "cmp_le", "cmp_le": "cmp_gt",
         "cmp_eq": "cmp_neq", "cmp_neq": "cmp_eq"}
MIRROR = {"cmp_ge": "cmp_le", "cmp_le": "cmp_ge", "cmp_gt": "cmp_lt", "cmp_lt": "cmp_gt",
           "cmp_eq": "cmp_eq", "cmp_neq": "cmp_neq"}


def not_(f: tuple) -> tuple:
    tag = f[0]
    if tag == "const":
        return ("const", not f[1])
    if tag == "cmp":
        _, op, a, b, is_int = f
        if is_int or op in ("cmp_eq", "cmp_neq"):
            return ("cmp", FLIP[op], a, b, is_int)
        return ("ncmp", op, a, b, False)
    if tag == "ncmp":
        return ("cmp",) + f[1:]
    if tag == "and":
        return or_(not_(f[1]), not_(f[2]))
    if tag == "or":
        return and_(not_(f[1]), not_(f[2]))
    return xor_(not_(f[1]), f[2])


def and_(f: tuple, g: tuple) -> tuple:
    if f[0] == "const":
        return g if f[1] else FALSE
    if g[0] == "const":
        return f if g[1] else FALSE
    return ("and", f, g)


def or_(f: tuple, g: tuple) -> tuple:
    if f[0] == "const":
        return TRUE if f[1] else g
    if g[0] == "const":
        return TRUE if g[1] else f
    return ("or", f, g)


def xor_(f: tuple, g: tuple) -> tuple:
    if f[0] == "const":
        return not_(g) if f[1] else g
    if g[0] == "const":
        return not_(f) if g[1] else f
    return ("xor", f, g)


def formula_nodes(f: tuple) -> list[int]:
    if f[0] in ("cmp", "ncmp"):
        return [f[2], f[3]]
    if f[0] == "const":
        return []
    return formula_nodes(f[1]) + formula_nodes(f[2])

# ----------------------------------------------------------------------------- replay

def replay(nodes: Sequence[Node], root: int, graph: Any, score: Any, leaves: Mapping[int, Any]) -> Any:
    """Record the DAG's nodes that `root` reaches on a pygraph-like `graph`, in a canonical order:
    positions first (by axis), then depth first with each select chain's conditions before its
    values (innermost first). `leaves` maps node -> tensor for the array leaves and the literals
    bound as scalars (`scoremod.jnp.literals`); other literals are passed as Python numbers where
    an op reads them. Returns the tensor of `root`."""
    values: dict[int, Any] = {0: score}
    live = reachable(nodes, (root,))
    for i in sorted((i for i in live if nodes[i].op == "gen_index"), key=lambda i: nodes[i].attr("axis")):
        values[i] = graph.gen_index(input=score, axis=nodes[i].attr("axis"))

    def children(i: int) -> tuple[int, ...]:
        node = nodes[i]
        if node.op != "binary_select":
            return node.args
        masks, s = [], i
        while nodes[s].op == "binary_select" and (s == i or s not in values):
            masks.append(nodes[s].args[2])
            s = nodes[s].args[0]
        return tuple(reversed(masks)) + node.args[:2]

    work = [(root, False)]
    while work:
        i, expanded = work.pop()
        if i in values:
            continue
        node = nodes[i]
        if node.op == "array" or i in leaves:  # arrays, and the literals bound as scalars
            values[i] = leaves[i]
        elif node.op == "const":
            values[i] = node.attr("value")
        elif expanded:
            operands = [values[a] for a in node.args]
            tensor = getattr(graph, node.op)(**dict(zip(OP_PARAMS[node.op], operands)))
            if tensor.get_data_type() != node.dtype:
                tensor.set_data_type(node.dtype)
            values[i] = tensor
        else:
            work.append((i, True))
            work.extend((c, False) for c in reversed(children(i)) if c not in values)
    out = values[root]
    if not isinstance(out, ModTensor) and not hasattr(out, "set_data_type"):  # the mod is a literal
        out = graph.identity(input=out)
    return out

