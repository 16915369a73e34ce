"""A small, safe expression language for sweep files: arithmetic and comparisons over ranks
and a point's arguments, nothing else.

    "{32 * stages // ranks}"      an argument derived from the point (micro-batches at a
                                  fixed global batch)
    require: "stages <= layers"   a skip rule

Parsed with `ast` and evaluated node by node from a whitelist: numbers, strings, names,
+ - * / // %, comparisons, and/or/not, `x if c else y`, min(), max(). No attribute access,
no other calls, no eval.
"""

from __future__ import annotations

import ast
import operator

BINARY = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
}
COMPARE = {
    ast.Eq: operator.eq,
    ast.NotEq: operator.ne,
    ast.Lt: operator.lt,
    ast.LtE: operator.le,
    ast.Gt: operator.gt,
    ast.GtE: operator.ge,
}
FUNCTIONS = {"min": min, "max": max}


class ExprError(ValueError):
    """An expression that does not parse, names an unknown value, or fails (x // 0)."""


def parse(text: str) -> ast.Expression:
    try:
        tree = ast.parse(text.strip(), mode="eval")
    except SyntaxError:
        raise ExprError(f"cannot parse expression {text!r}") from None
    for node in ast.walk(tree):
        allowed = (
            ast.Expression,
            ast.BinOp,
            ast.UnaryOp,
            ast.BoolOp,
            ast.Compare,
            ast.IfExp,
            ast.Constant,
            ast.Name,
            ast.Load,
            ast.Call,
            ast.USub,
            ast.UAdd,
            ast.Not,
            ast.And,
            ast.Or,
            *BINARY,
            *COMPARE,
        )
        if not isinstance(node, allowed):
            raise ExprError(f"{text!r}: {type(node).__name__} is not allowed in expressions")
        if isinstance(node, ast.Call) and (
            not isinstance(node.func, ast.Name) or node.func.id not in FUNCTIONS or node.keywords
        ):
            raise ExprError(f"{text!r}: only min(...) and max(...) may be called")
    return tree


def names(text: str) -> set[str]:
    """The value names an expression uses (functions excluded)."""
    tree = parse(text)
    called = {id(n.func) for n in ast.walk(tree) if isinstance(n, ast.Call)}
    return {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and id(n) not in called}


def evaluate(text: str, values: dict[str, object]) -> object:
    """Evaluate `text` with `values` for its names; ExprError on any problem."""
    tree = parse(text)
    try:
        return _eval(tree.body, values, text)
    except ZeroDivisionError:
        raise ExprError(f"{text!r}: division by zero") from None
    except TypeError as e:
        raise ExprError(f"{text!r}: {e}") from None


def _eval(node: ast.AST, values: dict[str, object], text: str) -> object:
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, ast.Name):
        if node.id not in values:
            known = ", ".join(sorted(values))
            raise ExprError(f"{text!r}: unknown name {node.id!r} (known: {known})")
        return values[node.id]
    if isinstance(node, ast.BinOp):
        left, right = _eval(node.left, values, text), _eval(node.right, values, text)
        return BINARY[type(node.op)](left, right)
    if isinstance(node, ast.UnaryOp):
        v = _eval(node.operand, values, text)
        return {ast.USub: operator.neg, ast.UAdd: operator.pos, ast.Not: operator.not_}[
            type(node.op)
        ](v)
    if isinstance(node, ast.BoolOp):
        if isinstance(node.op, ast.And):
            return all(_eval(v, values, text) for v in node.values)
        return any(_eval(v, values, text) for v in node.values)
    if isinstance(node, ast.Compare):
        left = _eval(node.left, values, text)
        for op, comp in zip(node.ops, node.comparators, strict=True):
            right = _eval(comp, values, text)
            if not COMPARE[type(op)](left, right):
                return False
            left = right
        return True
    if isinstance(node, ast.IfExp):
        branch = node.body if _eval(node.test, values, text) else node.orelse
        return _eval(branch, values, text)
    if isinstance(node, ast.Call):
        return FUNCTIONS[node.func.id](*(_eval(a, values, text) for a in node.args))
    raise ExprError(f"{text!r}: {type(node).__name__} is not allowed")  # parse() forbids it
