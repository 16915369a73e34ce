"""A small, safe expression language for sweep files: arithmetic and comparisons over ranks
and a point's arguments, nothing else.

    "{32 * stages // ranks}"      an argument derived from the point (micro-batches at a
                                  fixed global batch)
    require: "stages <= layers"   a skip rule

Parsed with `ast` and evaluated node by node from a whitelist: numbers, strings, names,
+ - * / // %, comparisons, and/or/not, `x if c else y`, min(), max(). No attribute access,
no other calls, no eval.

A sweep file is trusted like a shell script, but an expression must still not be able to
exhaust the sweep's memory or stack by accident (`"x" * ranks ** 9`, `"%099999999d" % 1`,
a thousand nested minus signs): what an expression may build is bounded up front (its text,
its AST's size and depth) and before each operation that could grow a value (the size of a
repeated string, of a product of integers, of a %-format width), each breach an ExprError.
"""

from __future__ import annotations

import ast
import math
import operator
import re

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


# Bounds (README, "Scaling sweeps"). The language has no loops, so with the AST's size
# bounded, the work of an evaluation is bounded by the sizes of the values it builds.
MAX_TEXT = 1000  # characters of one expression
MAX_NODES = 500  # AST nodes, operators and names included
MAX_DEPTH = 50  # AST nesting: the evaluator recurses once per level
MAX_LEN = 10_000  # characters of a string (items of a sequence) an expression builds
MAX_INT_BITS = 4096  # bits of an integer an expression builds (about 1,200 digits)
MAX_WIDTH = 100  # width and precision in a %-format ("%08d", "%.3f")
SEQUENCES = (str, bytes, list, tuple)
ALLOWED = (
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
# A printf-style conversion: %[(key)][flags][width][.precision][length]type
FORMAT = re.compile(r"%(?:\([^)]*\))?[#0 +-]*(\*|\d+)?(?:\.(\*|\d*))?[hlL]?(.?)", re.S)


class ExprError(ValueError):
    """An expression that does not parse, names an unknown value, fails (x // 0) or would
    build a value beyond the bounds above."""


def parse(text: str) -> ast.Expression:
    """The checked AST of `text`: only whitelisted nodes, within MAX_TEXT, MAX_NODES and
    MAX_DEPTH (checked without recursion, before anything is evaluated)."""
    if not isinstance(text, str):
        raise ExprError(f"expected an expression string, got {text!r}")
    if len(text) > MAX_TEXT:
        raise ExprError(f"an expression of {len(text)} characters (at most {MAX_TEXT})")
    try:
        tree = ast.parse(text.strip(), mode="eval")
    except SyntaxError:
        raise ExprError(f"cannot parse expression {text!r}") from None
    except (ValueError, RecursionError, MemoryError):  # NUL bytes; the parser's own limits
        raise ExprError(f"cannot parse expression {text!r}") from None
    count = 0
    stack: list[tuple[ast.AST, int]] = [(tree, 0)]
    while stack:
        node, depth = stack.pop()
        count += 1
        if count > MAX_NODES:
            raise ExprError(f"{text!r}: more than {MAX_NODES} terms and operators")
        if depth > MAX_DEPTH:
            raise ExprError(f"{text!r}: nested more than {MAX_DEPTH} deep")
        if not isinstance(node, ALLOWED):
            raise ExprError(f"{text!r}: {type(node).__name__} is not allowed in expressions")
        if isinstance(node, ast.Call) and (
            not isinstance(node.func, ast.Name) or node.func.id not in FUNCTIONS or node.keywords
        ):
            raise ExprError(f"{text!r}: only min(...) and max(...) may be called")
        if isinstance(node, ast.Constant) and not isinstance(node.value, (int, float, str)):
            raise ExprError(f"{text!r}: {node.value!r}: only numbers and strings are values")
        stack.extend((child, depth + 1) for child in ast.iter_child_nodes(node))
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
    except OverflowError as e:
        raise ExprError(f"{text!r}: {e}") from None
    except (TypeError, ValueError) as e:
        if isinstance(e, ExprError):
            raise
        raise ExprError(f"{text!r}: {e}") from None
    except (RecursionError, MemoryError):  # the bounds should make these impossible
        raise ExprError(f"{text!r}: too large to evaluate") from None


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
        return binary(type(node.op), left, right, text)
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


def binary(op: type, left: object, right: object, text: str) -> object:
    """left OP right, refused before it is computed when its result would be too large."""
    if op is ast.Mult:
        for seq, n in ((left, right), (right, left)):
            if isinstance(seq, SEQUENCES) and isinstance(n, int) and len(seq) * n > MAX_LEN:
                raise ExprError(
                    f"{text!r}: repeating {len(seq)} characters {shown(n)} times makes more "
                    f"than {MAX_LEN}"
                )
        if isinstance(left, int) and isinstance(right, int):
            bits = left.bit_length() + right.bit_length()
            if bits > MAX_INT_BITS:
                raise ExprError(f"{text!r}: a product of {bits} bits (at most {MAX_INT_BITS})")
    if op is ast.Mod and isinstance(left, str):
        check_format(left, text)
    result = BINARY[op](left, right)
    if isinstance(result, SEQUENCES) and len(result) > MAX_LEN:
        raise ExprError(f"{text!r}: a value of {len(result)} characters (at most {MAX_LEN})")
    if isinstance(result, int) and result.bit_length() > MAX_INT_BITS:
        raise ExprError(
            f"{text!r}: a number of {result.bit_length()} bits (at most {MAX_INT_BITS})"
        )
    if isinstance(result, float) and not math.isfinite(result):
        raise ExprError(f"{text!r}: the result is {result} (not a finite number)")
    return result


def shown(n: int) -> str:
    """An integer for a message: digits when short, else its size."""
    return str(n) if abs(n) < 10**15 else f"about 10^{int(n.bit_length() * math.log10(2))}"


def check_format(template: str, text: str) -> None:
    """Refuse a %-format whose width or precision is larger than MAX_WIDTH (or given by *)."""
    for m in FORMAT.finditer(template):
        for part, what in ((m.group(1), "width"), (m.group(2), "precision")):
            if part == "*":
                raise ExprError(f"{text!r}: a %-format {what} must be a number, not *")
            if part and (len(part) > 3 or int(part) > MAX_WIDTH):
                raise ExprError(f"{text!r}: %-format {what} {part[:12]} (at most {MAX_WIDTH})")
