"""A small, safe evaluator for the arithmetic in search-space files.

Constraints and derived values are written as Python expressions over parameter names
(``"BLOCK_M % (16 * NUM_WARPS) == 0"``). Only arithmetic, comparisons, boolean logic,
conditional expressions and ``min``/``max``/``abs`` are allowed; anything else is refused when
the space is loaded, not when it is evaluated.
"""

from __future__ import annotations

import ast
import operator
from collections.abc import Iterable, Mapping

_BINOPS = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
    ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
    ast.Div: operator.truediv,
}
_CMPOPS = {
    ast.Eq: operator.eq, ast.NotEq: operator.ne, ast.Lt: operator.lt, ast.LtE: operator.le,
    ast.Gt: operator.gt, ast.GtE: operator.ge, ast.In: lambda a, b: a in b,
    ast.NotIn: lambda a, b: a not in b,
}
_FUNCS = {"min": min, "max": max, "abs": abs}
_MAX_EXPONENT = 64


class ExprError(ValueError):
    """An expression in a search space is malformed or uses something not allowed."""


class Expr:
    """A parsed expression; ``names`` are the variables it reads."""

    def __init__(self, text: str) -> None:
        self.text = text
        try:
            self._tree = ast.parse(text, mode="eval").body
        except SyntaxError as e:
            raise ExprError(f"cannot parse {text!r}: {e.msg}") from None
        self.names = frozenset(self._check(self._tree))

    def _check(self, node: ast.AST) -> Iterable[str]:
        if isinstance(node, ast.Constant):
            if not isinstance(node.value, (int, float, str, bool)):
                raise ExprError(f"constant {node.value!r} not allowed in {self.text!r}")
            return []
        if isinstance(node, ast.Name):
            if node.id in _FUNCS:
                raise ExprError(f"{node.id} must be called in {self.text!r}")
            return [node.id]
        if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
            return [*self._check(node.left), *self._check(node.right)]
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.Not, ast.UAdd)):
            return list(self._check(node.operand))
        if isinstance(node, ast.BoolOp):
            return [n for v in node.values for n in self._check(v)]
        if isinstance(node, ast.Compare) and all(type(op) in _CMPOPS for op in node.ops):
            return [n for v in (node.left, *node.comparators) for n in self._check(v)]
        if isinstance(node, ast.IfExp):
            return [n for v in (node.test, node.body, node.orelse) for n in self._check(v)]
        if isinstance(node, (ast.Tuple, ast.List)):
            return [n for v in node.elts for n in self._check(v)]
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                and node.func.id in _FUNCS and not node.keywords):
            return [n for a in node.args for n in self._check(a)]
        raise ExprError(f"{type(node).__name__} not allowed in {self.text!r}")

    def __call__(self, env: Mapping[str, object]) -> object:
        try:
            return self._eval(self._tree, env)
        except (ArithmeticError, TypeError, ValueError) as e:
            if isinstance(e, ExprError):
                raise
            raise ExprError(f"cannot evaluate {self.text!r}: {e}") from None

    def _eval(self, node: ast.AST, env: Mapping[str, object]) -> object:
        if isinstance(node, ast.Constant):
            return node.value
        if isinstance(node, ast.Name):
            try:
                return env[node.id]
            except KeyError:
                raise ExprError(f"unknown name {node.id!r} in {self.text!r}") from None
        if isinstance(node, ast.BinOp):
            left, right = self._eval(node.left, env), self._eval(node.right, env)
            if isinstance(node.op, ast.Pow) and abs(right) > _MAX_EXPONENT:  # type: ignore[arg-type]
                raise ExprError(f"exponent {right} too large in {self.text!r}")
            return _BINOPS[type(node.op)](left, right)
        if isinstance(node, ast.UnaryOp):
            value = self._eval(node.operand, env)
            if isinstance(node.op, ast.Not):
                return not value
            return -value if isinstance(node.op, ast.USub) else +value  # type: ignore[operator]
        if isinstance(node, ast.BoolOp):  # short-circuit, returning an operand as Python does
            want = isinstance(node.op, ast.Or)
            value: object = None
            for v in node.values:
                value = self._eval(v, env)
                if bool(value) is want:
                    return value
            return value
        if isinstance(node, ast.Compare):
            left = self._eval(node.left, env)
            for op, right_node in zip(node.ops, node.comparators, strict=True):
                right = self._eval(right_node, env)
                if not _CMPOPS[type(op)](left, right):
                    return False
                left = right
            return True
        if isinstance(node, ast.IfExp):
            branch = node.body if self._eval(node.test, env) else node.orelse
            return self._eval(branch, env)
        if isinstance(node, (ast.Tuple, ast.List)):
            return tuple(self._eval(v, env) for v in node.elts)
        assert isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
        return _FUNCS[node.func.id](*(self._eval(a, env) for a in node.args))

    def __repr__(self) -> str:
        return f"Expr({self.text!r})"
