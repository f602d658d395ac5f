"""Lowering and algebra: exponentials, constants and products in canonical forms.

The builder lowers ``exp(x)`` to ``exp2(x·log2 e)``; these rules lift it back to ``Exp``
(the natural base the softmax identities are stated in), fold the scale of a
contraction, and let products commute. Constants are folded and distributed only where
the softmax needs it (contraction scales, shifted scores): general rules such as
``(x·a)·b → x·(ab)`` or ``(a + b)·c → a·c + b·c`` meet e-classes that contain ``x·c``
(``0·c`` is ``0``; ``exp2(x) = exp(x·ln 2)`` feeds itself) and mint terms forever.
"""

from __future__ import annotations

import math

from cherenkov.rewrites.rule import Example, Rule, Ruleset
from cherenkov.rewrites.terms import literal, tensor

LOG2E = literal(math.log2(math.e))
LN2 = literal(math.log(2.0))

x = tensor("x", "i:3", "j:4")
y = tensor("y", "i:3", "j:4")

HALF_LN2 = literal(math.log(2.0) / 2.0)

RULES = (
    Rule(
        "exp2-log2e-is-exp",
        "exp2(x·log2 e) = exp(x)",
        lhs=f"(Exp2 (Mul x (Num {LOG2E})))",
        rhs="(Exp x)",
        example=Example(("Exp2", ("Mul", x, ("Num", math.log2(math.e))))),
    ),
    Rule(
        "exp2-is-exp",
        "exp2(x) = exp(x·ln 2)",
        lhs="(Exp2 x)",
        rhs=f"(Exp (Mul x (Num {LN2})))",
        example=Example(("Exp2", x)),
    ),
    Rule(
        "mul-commute",
        "a·b = b·a",
        lhs="(Mul a b)",
        rhs="(Mul b a)",
        example=Example(("Mul", x, y)),
    ),
    Rule(
        "mul-one",
        "x·1 = x",
        lhs="(Mul x (Num 1.0))",
        rhs="x",
        example=Example(("Mul", x, ("Num", 1.0))),
    ),
    Rule(
        "add-zero",
        "x + 0 = x (positions counted from a cache's start of 0: arange(S) + 0)",
        lhs="(Add x (Num 0.0))",
        rhs="x",
        example=Example(("Add", x, ("Num", 0.0))),
    ),
    Rule(
        "tanh-from-exp2",
        "1 − 2·(exp2(x·a) + 1)⁻¹ = tanh(x·a·ln 2 / 2): tanh in the exponential spelling ck.nn.tanh lowers to",
        lhs="(Add (Num 1.0) (Neg (Mul (Num 2.0) (Recip (Add (Exp2 (Mul x (Num a))) (Num 1.0))))))",
        rhs=f"(Tanh (Mul x (Num (* a {HALF_LN2}))))",
        example=Example(("Add", ("Num", 1.0),
                         ("Neg", ("Mul", ("Num", 2.0), ("Recip", ("Add", ("Exp2", ("Mul", x, ("Num", 1.7))), ("Num", 1.0))))))),
    ),
    Rule(
        "fold-contraction-scale",
        "(Σ_k a·b)·c₁·c₂ = (Σ_k a·b)·(c₁·c₂) for constants c₁, c₂",
        lhs="(Mul (Mul (Contract k n a b) (Num c1)) (Num c2))",
        rhs="(Mul (Contract k n a b) (Num (* c1 c2)))",
        example=Example(("Mul", ("Mul", ("Contract", "j:4", 4, x, y), ("Num", 0.75)), ("Num", -1.5))),
    ),
)

ALGEBRA = Ruleset("algebra", __doc__.splitlines()[0], RULES)
