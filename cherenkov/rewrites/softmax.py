"""Softmax and normalisation: shift invariance and cancelling the normaliser.

A softmax written as ``exp(s − logsumexp(s))`` is the quotient of exponentials (the log of
a positive sum cancels against the exponential). A softmax written without the max
subtraction, ``Σ_j e^{s_j} v_j / Σ_j e^{s_j}``, equals the shifted one: ``e^{max s}`` factors out of numerator and denominator and cancels. The
shifted sums are the online-softmax fold's accumulator and normaliser.
"""

from __future__ import annotations

import math

from cherenkov.rewrites.rule import Example, Rule, Ruleset
from cherenkov.rewrites.terms import tensor

s = tensor("s", "i:3", "j:7")
v = tensor("v", "j:7", "e:2")
a = tensor("a", "i:3")
b = tensor("b", "i:3", "e:2")

LN2 = math.log(2.0)
t = tensor("t", "i:3", "j:7")

RULES = (
    Rule(
        "exp-minus-logsumexp",
        "e^{a − (b + ln Σ_j e^{t_j})} = e^{a − b} / Σ_j e^{t_j} (a softmax spelled exp(s − logsumexp s))",
        lhs=f"(Exp (Add a (Neg (Add b (Mul (Log2 (Sum j n (Exp u))) (Num {LN2!r}))))))",
        rhs="(Mul (Exp (Add a (Neg b))) (Recip (Sum j n (Exp u))))",
        example=Example(("Exp", ("Add", s, ("Neg", ("Add", a, ("Mul", ("Log2", ("Sum", "j:7", 7, ("Exp", t))),
                                                                   ("Num", LN2))))))),  # fmt: skip
    ),
    Rule(
        "scale-shifted-scores",
        "(s − max_j s)·c = s·c − max_j(s·c) for a constant c > 0",
        lhs="(Mul (Add s (Neg (Max j n s))) (Num c))",
        rhs="(Add (Mul s (Num c)) (Neg (Max j n (Mul s (Num c)))))",
        where=("(> c 0.0)",),
        example=Example(("Mul", ("Add", s, ("Neg", ("Max", "j:7", 7, s))), ("Num", 0.6))),
    ),
    Rule(
        "softmax-shift-acc",
        "Σ_j e^{s_j}·v_j = e^{m}·Σ_j e^{s_j−m}·v_j with m = max_j s (the fold accumulator)",
        lhs="(Sum j n (Mul (Exp s) v))",
        rhs="(Mul (Exp (Max j n s)) (SoftmaxFoldAcc j n s v))",
        example=Example(("Sum", "j:7", 7, ("Mul", ("Exp", s), v))),
    ),
    Rule(
        "softmax-shift-l",
        "Σ_j e^{s_j} = e^{m}·Σ_j e^{s_j−m} with m = max_j s (the fold normaliser)",
        lhs="(Sum j n (Exp s))",
        rhs="(Mul (Exp (Max j n s)) (SoftmaxFoldL j n s))",
        example=Example(("Sum", "j:7", 7, ("Exp", s))),
    ),
    Rule(
        "cancel-positive-factor",
        "(e^m·a)⁻¹·(e^m·b) = a⁻¹·b",
        lhs="(Mul (Recip (Mul (Exp m) a)) (Mul (Exp m) b))",
        rhs="(Mul (Recip a) b)",
        example=Example(
            ("Mul", ("Recip", ("Mul", ("Exp", tensor("m", "i:3")), a)), ("Mul", ("Exp", tensor("m", "i:3")), b)),
            positive=("a",),
        ),
    ),
)

SOFTMAX = Ruleset("softmax", __doc__.splitlines()[0], RULES)
