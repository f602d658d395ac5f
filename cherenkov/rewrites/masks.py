"""Masks: every spelling of a mask becomes ``where(condition, −∞, scores)``.

``k_idx <= q_idx`` arrives as ``where(q_idx < k_idx, false, true)``; an additive mask is
``scores + where(c, −∞, 0)``; a scale may follow the mask. Causal masks then match the
flash-attention rule, which turns them into its causal flag. Broadcast K/V heads (GQA)
need no rule: at the border they already index K/V with ``h // group``.
"""

from __future__ import annotations

import math

from cherenkov.rewrites.rule import Example, Rule, Ruleset
from cherenkov.rewrites.terms import ax, tensor

s = tensor("s", "i:3", "j:4")
t = tensor("t", "i:3", "j:4")
condition = ("Lt", ("Iota", ax("i:3")), ("Iota", ax("j:4")))

RULES = (
    Rule(
        "where-not",
        "where(where(c, false, true), a, b) = where(c, b, a)",
        lhs="(Where (Where c (Flag false) (Flag true)) a b)",
        rhs="(Where c b a)",
        example=Example(("Where", ("Where", condition, ("Flag", False), ("Flag", True)), s, t)),
    ),
    Rule(
        "additive-mask",
        "s + where(c, −∞, 0) = where(c, −∞, s)",
        lhs="(Add s (Where c (Num -inf) (Num 0.0)))",
        rhs="(Where c (Num -inf) s)",
        example=Example(("Add", s, ("Where", condition, ("Num", -math.inf), ("Num", 0.0)))),
    ),
    Rule(
        "add-commute",
        "a + b = b + a",
        lhs="(Add a b)",
        rhs="(Add b a)",
        example=Example(("Add", s, t)),
    ),
    Rule(
        "scale-masked",
        "where(c, −∞, s)·k = where(c, −∞, s·k) for a constant k > 0 and scores s that vary",
        lhs="(Mul (Where c (Num -inf) s) (Num k))",
        rhs="(Where c (Num -inf) (Mul s (Num k)))",
        where=("(> k 0.0)", "(= axes-s (axes s))", "(> (set-length axes-s) 0)"),
        example=Example(("Mul", ("Where", condition, ("Num", -math.inf), s), ("Num", 0.25))),
    ),
)

MASKS = Ruleset("masks", __doc__.splitlines()[0], RULES)
