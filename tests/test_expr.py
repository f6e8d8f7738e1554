"""Tests of evoengine.expr: what the search-space evaluator computes and what it refuses."""

from __future__ import annotations

import pytest

from evoengine.expr import Expr, ExprError

ENV = {"A": 7, "B": 2, "C": 0, "S": "pad", "F": 2.5, "T": True}


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("A + B", 9),
        ("A - B", 5),
        ("A * B", 14),
        ("A // B", 3),
        ("A % B", 1),
        ("A / B", 3.5),
        ("B ** 3", 8),
        ("-A + +B", -5),
        ("(A + B) * 2 - 1", 17),
        ("A * (16 if S == 'pad' else 0)", 112),
        ("F * 2", 5.0),
    ],
)
def test_arithmetic(text: str, expected: object) -> None:
    value = Expr(text)(ENV)
    assert value == expected
    assert type(value) is type(expected)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("A == 7", True),
        ("A != 7", False),
        ("B < A", True),
        ("A <= 6", False),
        ("A > B", True),
        ("A >= 8", False),
        # Chains hold only when every link holds, as in Python.
        ("B < A < 10", True),
        ("B < A < 7", False),
        ("10 > A > B > C", True),
        ("0 <= C < B <= A", True),
        ("C < B > A", False),
        ("16 <= A * 16 <= 256", True),
    ],
)
def test_comparisons_and_chains(text: str, expected: bool) -> None:
    assert Expr(text)(ENV) is expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("A > 1 and B > 1", True),
        ("A > 1 and B > 5", False),
        ("A > 10 or B > 1", True),
        ("A > 10 or B > 5", False),
        ("not C", True),
        ("not T", False),
        ("A > 1 and (B > 5 or not C)", True),
        ("A > 1 and B > 1 and C > 1", False),
    ],
)
def test_boolean_ops(text: str, expected: bool) -> None:
    assert Expr(text)(ENV) is expected


def test_boolean_ops_short_circuit() -> None:
    # The right side would raise (unknown name) if it were evaluated.
    assert Expr("C > 0 and MISSING > 0")(ENV) is False
    assert Expr("A > 0 or MISSING > 0")(ENV) is True


def test_boolean_ops_return_an_operand_like_python() -> None:
    # The module promises Python expressions; in Python `C or A` is 7, `A and B` is 2.
    assert Expr("C or A")(ENV) == 7
    assert Expr("A and B")(ENV) == 2
    assert Expr("C and A")(ENV) == 0
    assert Expr("C or 0")(ENV) == 0
    assert Expr("B or MISSING")(ENV) == 2


def test_conditional_expressions() -> None:
    assert Expr("8 if S == 'pad' else 0")(ENV) == 8
    assert Expr("8 if S == 'xor' else 0")(ENV) == 0
    assert Expr("1 if C else (2 if B == 2 else 3)")(ENV) == 2
    assert Expr("max(A, B) if T else min(A, B)")({**ENV, "T": False}) == 2


def test_conditional_evaluates_only_the_taken_branch() -> None:
    assert Expr("A if T else MISSING")(ENV) == 7
    assert Expr("MISSING if C else B")(ENV) == 2


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("min(A, B)", 2),
        ("max(A, B)", 7),
        ("min(A, B, C)", 0),
        ("max(A * 2, B * 10, 3)", 20),
        ("abs(C - A)", 7),
        ("abs(-F)", 2.5),
        ("max(min(A, 5), abs(-3))", 5),
    ],
)
def test_min_max_abs(text: str, expected: object) -> None:
    assert Expr(text)(ENV) == expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("A in (1, 7, 9)", True),
        ("A in (1, 2, 3)", False),
        ("A not in (1, 2, 3)", True),
        ("S in ('none', 'pad')", True),
        ("S not in ('none', 'pad')", False),
        ("B in [2, 4]", True),
        ("A + B in (8, 9)", True),
    ],
)
def test_membership_in_tuples(text: str, expected: bool) -> None:
    assert Expr(text)(ENV) is expected


def test_tuple_literal_evaluates_to_a_tuple() -> None:
    assert Expr("(A, B + 1)")(ENV) == (7, 3)
    assert Expr("[A, B]")(ENV) == (7, 2)


@pytest.mark.parametrize(
    ("text", "names"),
    [
        ("A + B", {"A", "B"}),
        ("BLOCK_M % (16 * NUM_WARPS) == 0", {"BLOCK_M", "NUM_WARPS"}),
        ("min(X, Y) if Z else abs(W)", {"X", "Y", "Z", "W"}),
        ("S in ('pad', 'xor')", {"S"}),
        ("not FLAG and N > 0", {"FLAG", "N"}),
        ("-A * A", {"A"}),
        ("1 + 2", set()),
        ("'text'", set()),
    ],
)
def test_names_are_the_variables_read(text: str, names: set[str]) -> None:
    expr = Expr(text)
    assert expr.names == frozenset(names)
    # Function names and string constants are not variables.
    assert not expr.names & {"min", "max", "abs", "pad", "xor", "text"}


@pytest.mark.parametrize(
    ("text", "what"),
    [
        ("().__class__", "Attribute"),
        ("().__class__.__bases__[0].__subclasses__()", "Call"),
        ("A.real", "Attribute"),
        ("(1).__add__", "Attribute"),
        ("len(S)", "Call"),
        ("__import__('os')", "Call"),
        ("getattr(A, 'real')", "Call"),
        ("eval('1')", "Call"),
        ("(lambda: 1)()", "Call"),
        ("lambda: 1", "Lambda"),
        ("S[0]", "Subscript"),
        ("(1, 2)[0]", "Subscript"),
        ("[x for x in (1, 2)]", "ListComp"),
        ("{x for x in (1, 2)}", "SetComp"),
        ("{x: 1 for x in (1, 2)}", "DictComp"),
        ("sum(x for x in (1, 2))", "Call"),
        ("min(x for x in (1, 2))", "GeneratorExp"),
        ("min(*S)", "Starred"),
        ("max(A, B, key=abs)", "Call"),
        ("{1: 2}", "Dict"),
        ("{1, 2}", "Set"),
        ("f'{A}'", "JoinedStr"),
        ("~A", "UnaryOp"),
        ("A << 2", "BinOp"),
        ("A is None", "Compare"),
        ("None", "None"),
        ("b'x'", "b'x'"),
        ("1j", "1j"),
        ("...", "Ellipsis"),
        ("min", "min must be called"),
    ],
)
def test_refused_at_parse_time(text: str, what: str) -> None:
    with pytest.raises(ExprError) as info:
        Expr(text)
    message = str(info.value)
    assert what in message
    assert repr(text) in message


@pytest.mark.parametrize("text", ["A +", "A if B", "x := 1", "1 2", "", "import os", "A = 1"])
def test_syntax_errors_are_expr_errors(text: str) -> None:
    with pytest.raises(ExprError, match="cannot parse"):
        Expr(text)


def test_expr_error_is_a_value_error() -> None:
    assert issubclass(ExprError, ValueError)


def test_unknown_name_at_eval_raises_expr_error() -> None:
    expr = Expr("A + MISSING")
    with pytest.raises(ExprError) as info:
        expr(ENV)
    assert "MISSING" in str(info.value)
    assert "'A + MISSING'" in str(info.value)


def test_unknown_name_is_not_swallowed_in_nested_positions() -> None:
    with pytest.raises(ExprError, match="'NOPE'"):
        Expr("max(A, NOPE)")(ENV)
    with pytest.raises(ExprError, match="'NOPE'"):
        Expr("A in (1, NOPE)")(ENV)


def test_one_parse_many_environments() -> None:
    expr = Expr("BLOCK_M % (16 * NUM_WARPS) == 0")
    assert expr({"BLOCK_M": 64, "NUM_WARPS": 4}) is True
    assert expr({"BLOCK_M": 32, "NUM_WARPS": 4}) is False
    assert expr({"BLOCK_M": 128, "NUM_WARPS": 8}) is True
    assert expr.text == "BLOCK_M % (16 * NUM_WARPS) == 0"
    assert repr(expr) == "Expr('BLOCK_M % (16 * NUM_WARPS) == 0')"


def test_env_is_not_mutated() -> None:
    env = dict(ENV)
    Expr("max(A, B) + (1 if T else 0)")(env)
    assert env == ENV
