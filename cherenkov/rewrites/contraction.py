"""Contraction: sums of products become ``Contract`` (the matmul/einsum form).

``x @ y`` arrives as ``Σ_k x[i,k]·y[k,j]``. Factors that do not depend on the summed
axis move out of the sum (a scale on ``q``, a softmax normaliser), the remaining
product of two ``k``-dependent factors is a contraction. A tensor factor of a contraction
moves into the operand that varies along its axes (the norms of Swin V2's cosine attention),
so the scores keep attention's form ``c·Σ_d q·k``.
"""

from __future__ import annotations

from cherenkov.rewrites.rule import Example, Rule, Ruleset
from cherenkov.rewrites.terms import tensor

a_i = tensor("a", "i:3")
b_ik = tensor("b", "i:3", "k:5")
c_k = tensor("c", "k:5")
w_kj = tensor("w", "k:5", "j:2")
_FACTOR_OF_OPERAND = ("(= axes-x (axes x))", "(set-not-contains axes-x k)", "(> (set-length axes-x) 0)")
"""A factor that moves into a contraction's operand: a tensor (not a constant: the contraction's scale) constant
along the summed axis."""


def _factor_into(side: str, factor: tuple, what: str) -> Rule:
    """``x·Σ_k a·b = Σ_k …(x·operand)…`` for the contraction's operand on ``side`` (left: ``a``, right: ``b``)."""
    operand = "a" if side == "left" else "b"
    scaled = "(Mul x a) b" if operand == "a" else "a (Mul x b)"
    spelled = "(x·a)·b" if operand == "a" else "a·(x·b)"
    return Rule(
        f"contract-factor-into-{side}",
        f"x·Σ_k a·b = Σ_k {spelled} when x varies only along axes of {operand} other than k ({what})",
        lhs="(Mul x (Contract k n a b))",
        rhs=f"(Contract k n {scaled})",
        where=(*_FACTOR_OF_OPERAND, f"(= axes-{operand} (axes {operand}))",
               f"(= axes-{operand} (set-union axes-{operand} axes-x))"),
        example=Example(("Mul", factor, ("Contract", "k:5", 5, b_ik, w_kj))),
    )


RULES = (
    Rule(
        "sum-factor-out",
        "Σ_k a·b = a·Σ_k b when a does not depend on k",
        lhs="(Sum k n (Mul a b))",
        rhs="(Mul a (Sum k n b))",
        where=("(= axes-a (axes a))", "(set-not-contains axes-a k)"),
        example=Example(("Sum", "k:5", 5, ("Mul", a_i, b_ik))),
    ),
    Rule(
        "sum-rotate-product",
        "Σ_k (a·b)·c = Σ_k b·(a·c) when the tensor b does not depend on k (brings b out front)",
        lhs="(Sum k n (Mul (Mul a b) c))",
        rhs="(Sum k n (Mul b (Mul a c)))",
        where=("(= axes-b (axes b))", "(set-not-contains axes-b k)", "(> (set-length axes-b) 0)"),
        example=Example(("Sum", "k:5", 5, ("Mul", ("Mul", b_ik, a_i), c_k))),
    ),
    Rule(
        "sum-constant-out",
        "Σ_k (a·c)·b = (Σ_k a·b)·c for a constant c",
        lhs="(Sum k n (Mul (Mul a (Num c)) b))",
        rhs="(Mul (Sum k n (Mul a b)) (Num c))",
        example=Example(("Sum", "k:5", 5, ("Mul", ("Mul", b_ik, ("Num", 0.125)), c_k))),
    ),
    Rule(
        "contraction",
        "Σ_k a·b = Contract_k(a, b) when both depend on k",
        lhs="(Sum k n (Mul a b))",
        rhs="(Contract k n a b)",
        where=(
            "(= axes-a (axes a))",
            "(set-contains axes-a k)",
            "(= axes-b (axes b))",
            "(set-contains axes-b k)",
        ),
        example=Example(("Sum", "k:5", 5, ("Mul", b_ik, w_kj))),
    ),
    _factor_into("left", a_i, "a row's factor: a normalised q"),
    _factor_into("right", tensor("y", "j:2"), "a column's factor: a normalised k"),
    Rule(
        "contract-unit-scale",
        "Contract_k(a, b) = Contract_k(a, b)·1",
        lhs="(Contract k n a b)",
        rhs="(Mul (Contract k n a b) (Num 1.0))",
        example=Example(("Contract", "k:5", 5, b_ik, w_kj)),
    ),
)

CONTRACTION = Ruleset("contraction", __doc__.splitlines()[0], RULES)
