"""Static values of node inputs, where the graph fixes them; UNKNOWN everywhere else.

`value(graph, node, name)` follows links through the nodes whose output is a pure function of their
inputs and that ComfyUI ships at the pin:
- PrimitiveInt/Float/String/StringMultiline/Boolean (comfy_extras/nodes_primitive.py): their `value`;
- ComfySwitchNode and ComfySoftSwitchNode (comfy_extras/nodes_logic.py): the branch their `switch` picks,
  when `switch` itself resolves (a soft switch falls back to the connected branch as upstream does);
- ComfyMathExpression (comfy_extras/nodes_math.py): the expression, evaluated with the same functions
  (sum, min, max, abs, round, pow, sqrt, ceil, floor, log*, sin, cos, tan, int, float) when every variable
  resolves; outputs FLOAT, INT, BOOL in that order.
Anything else (a custom node, a value computed from an image) is UNKNOWN: checks skip it, never guess.
"""

from __future__ import annotations

import ast
import math
import operator

from h3kit.workflow.graph import Graph, Link, Node


class _Unknown:
    __slots__ = ()

    def __repr__(self):
        return "UNKNOWN"

    def __bool__(self):
        return False


UNKNOWN = _Unknown()

PRIMITIVES = frozenset({"PrimitiveInt", "PrimitiveFloat", "PrimitiveString", "PrimitiveStringMultiline",
                        "PrimitiveBoolean"})
SWITCHES = frozenset({"ComfySwitchNode", "ComfySoftSwitchNode"})
MAX_HOPS = 64


def value(graph: Graph, node: Node, name: str, _hops: int = 0):
    if _hops > MAX_HOPS:
        return UNKNOWN
    raw = node.inputs.get(name, UNKNOWN)
    if not isinstance(raw, Link):
        return raw
    return output_value(graph, raw, _hops + 1)


def output_value(graph: Graph, link: Link, _hops: int = 0):
    if _hops > MAX_HOPS:
        return UNKNOWN
    src = graph.nodes.get(link.node)
    if src is None:
        return UNKNOWN
    kind = src.class_type
    if kind in PRIMITIVES and link.slot == 0:
        return value(graph, src, "value", _hops + 1)
    if kind in SWITCHES and link.slot == 0:
        chosen = switch_branch(graph, src, _hops + 1)
        return value(graph, src, chosen, _hops + 1) if chosen else UNKNOWN
    if kind == "ComfyMathExpression" and link.slot in (0, 1, 2):
        result = math_expression(graph, src, _hops + 1)
        if result is UNKNOWN:
            return UNKNOWN
        return (float(result), int(result), bool(result))[link.slot]
    return UNKNOWN


def switch_branch(graph: Graph, node: Node, _hops: int = 0) -> str | None:
    """"on_true" or "on_false" when the switch value is known (a soft switch with one branch: that one)."""
    if node.class_type == "ComfySoftSwitchNode":
        present = [b for b in ("on_false", "on_true") if b in node.inputs]
        if len(present) == 1:
            return present[0]
    flag = value(graph, node, "switch", _hops)
    if isinstance(flag, bool):
        return "on_true" if flag else "on_false"
    return None


def link_source(graph: Graph, link, _hops: int = 0):
    """The Link after passing through switches with known conditions (None when a switch is undecided)."""
    while isinstance(link, Link) and _hops <= MAX_HOPS:
        src = graph.nodes.get(link.node)
        if src is None or src.class_type not in SWITCHES or link.slot != 0:
            return link
        branch = switch_branch(graph, src, _hops)
        if branch is None:
            return None
        link = src.inputs.get(branch)
        _hops += 1
    return link if isinstance(link, Link) else None


# ---------------------------------------------------------------------------- ComfyMathExpression

_FUNCS = {
    "sum": lambda *a: sum(a[0]) if len(a) == 1 and isinstance(a[0], (list, tuple)) else sum(a),
    "min": min, "max": max, "abs": abs, "round": round, "sqrt": math.sqrt, "ceil": math.ceil,
    "floor": math.floor, "log": math.log, "log2": math.log2, "log10": math.log10, "sin": math.sin,
    "cos": math.cos, "tan": math.tan, "int": int, "float": float,
}
_BINOPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod}
_CMPOPS = {ast.Eq: operator.eq, ast.NotEq: operator.ne, ast.Lt: operator.lt, ast.LtE: operator.le,
           ast.Gt: operator.gt, ast.GtE: operator.ge}
MAX_EXPRESSION = 2000
MAX_EXPONENT = 4000


def math_expression(graph: Graph, node: Node, _hops: int = 0):
    expression = value(graph, node, "expression", _hops)
    if not isinstance(expression, str) or not expression.strip() or len(expression) > MAX_EXPRESSION:
        return UNKNOWN
    names = {}
    for key in node.inputs:
        if key.startswith("values."):
            v = value(graph, node, key, _hops)
            if v is UNKNOWN or isinstance(v, str):
                return UNKNOWN
            names[key[len("values."):]] = v
    names["values"] = list(names.values())
    try:
        tree = ast.parse(expression.strip(), mode="eval")
        result = _eval(tree.body, names, 0)
    except Exception:  # any expression the evaluator does not model is simply not resolved
        return UNKNOWN
    if isinstance(result, bool) or not isinstance(result, (int, float)):
        return UNKNOWN if not isinstance(result, bool) else result
    if isinstance(result, float) and not math.isfinite(result):
        return UNKNOWN
    return result


def _eval(node, names, depth):
    if depth > 50:
        raise ValueError("too deep")
    d = depth + 1
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float, bool)):
        return node.value
    if isinstance(node, ast.Name):
        if node.id not in names:
            raise NameError(node.id)
        return names[node.id]
    if isinstance(node, ast.BinOp):
        left, right = _eval(node.left, names, d), _eval(node.right, names, d)
        if isinstance(node.op, ast.Pow):
            if abs(right) > MAX_EXPONENT:
                raise ValueError("exponent")
            return left ** right
        return _BINOPS[type(node.op)](left, right)
    if isinstance(node, ast.UnaryOp):
        operand = _eval(node.operand, names, d)
        if isinstance(node.op, ast.USub):
            return -operand
        if isinstance(node.op, ast.UAdd):
            return +operand
        if isinstance(node.op, ast.Not):
            return not operand
        raise ValueError("op")
    if isinstance(node, ast.Compare):
        left = _eval(node.left, names, d)
        for op, comp in zip(node.ops, node.comparators):
            right = _eval(comp, names, d)
            if not _CMPOPS[type(op)](left, right):
                return False
            left = right
        return True
    if isinstance(node, ast.BoolOp):
        vals = [_eval(v, names, d) for v in node.values]
        if isinstance(node.op, ast.And):
            return all(vals)
        return any(vals)
    if isinstance(node, ast.IfExp):
        return _eval(node.body, names, d) if _eval(node.test, names, d) else _eval(node.orelse, names, d)
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _FUNCS \
            and not node.keywords:
        args = [_eval(a, names, d) for a in node.args]
        if node.func.id == "pow" and len(args) == 2 and abs(args[1]) > MAX_EXPONENT:
            raise ValueError("exponent")
        return _FUNCS[node.func.id](*args)
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "pow" \
            and len(node.args) == 2 and not node.keywords:
        base, exp = _eval(node.args[0], names, d), _eval(node.args[1], names, d)
        if abs(exp) > MAX_EXPONENT:
            raise ValueError("exponent")
        return pow(base, exp)
    raise ValueError(type(node).__name__)


def as_int(v):
    """An integer from a resolved value (ints, integral floats); None for anything else."""
    if isinstance(v, bool):
        return None
    if isinstance(v, int):
        return v
    if isinstance(v, float) and math.isfinite(v) and v.is_integer():
        return int(v)
    return None
