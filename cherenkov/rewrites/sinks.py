"""Attention sinks: a column appended to the scores, softmaxed with them, then dropped.

GPT-OSS gives each head a learned logit ``b`` (its sink), concatenates it to the row of
scores, softmaxes the ``n + 1`` entries and keeps the first ``n`` probabilities. A
concatenation arrives as two zero-padded pieces summed; where the appended piece does not
vary along the row it is ``where(j < n, s_j, b)``, and pointwise work moves into that
``where``'s branches. A sum or max over the whole row splits at the column; a sum over the
first ``n`` entries reads only the scores' branch. The sink's share of the normaliser is a
factor of the row: ``(Σ_j e^{u_j} + e^w)⁻¹ = (Σ_j e^{u_j})⁻¹·σ(LSE_j u − w)``, so the
attention is flash attention over the scores times ``σ(LSE − b)``, from the same kernel's
log-sum-exp (its row shifts cancel: ``(x − c) − (y − c) = x − y``).
"""

from __future__ import annotations

import math

from cherenkov.rewrites.rule import Example, Rule, Ruleset
from cherenkov.rewrites.terms import ax, tensor

s = tensor("s", "i:3", "j:7")
b = tensor("b", "i:3")
c = tensor("c", "i:3")
z = tensor("z", "i:3", "j:7")
APPENDED = "(Lt (Iota (Ax j)) (Num f))"
"""The condition of an appended column's ``where``: the row's first ``f`` entries."""
appended = ("Lt", ("Iota", ax("j:7")), ("Num", 6.0))
column = ("Where", appended, s, b)
"""An example: scores ``s`` (``j < 6``) with the column ``b`` appended, over ``j:7``."""
LN2 = math.log(2.0)
Y_CONSTANT_ALONG_J = ("(= axes-y (axes y))", "(set-not-contains axes-y j)")


def _into_branches(name: str, text: str, outer: str, example: tuple) -> Rule:
    """``op(where(j < f, x, y), …) = where(j < f, op(x, …), op(y, …))`` for one pointwise ``op``
    (``outer``: its pattern with ``{}`` for the where's place)."""
    return Rule(
        name,
        f"{text} = where(j < f, …x…, …y…): pointwise work on an appended column's where moves into its branches",
        lhs=outer.format(f"(Where {APPENDED} x y)"),
        rhs=f"(Where {APPENDED} {outer.format('x')} {outer.format('y')})",
        where=Y_CONSTANT_ALONG_J,
        example=Example(example),
    )


def _over_the_column(reduction: str, text: str, rhs: str) -> Rule:
    """A reduction over a row with a column appended: the scores' entries reduced, then the column."""
    head = reduction.capitalize()
    return Rule(
        f"{reduction}-over-appended-column",
        f"{text} for y constant along j",
        lhs=f"({head} j N (Where {APPENDED} x y))",
        rhs=rhs,
        where=(*Y_CONSTANT_ALONG_J, "(> f 0.0)", "(< f (to-f64 N))"),
        example=Example((head, "j:7", 7, column)),
    )


RULES = (
    Rule(
        "appended-column",
        "pad(s, (0, m)) + pad(b, (n, 0)) = where(j < n, s, b) along j over its n + m entries, b constant along j",
        lhs="(Add (PadAxis (Ax j) 0 n 0.0 x) (PadAxis (Ax j) n m 0.0 y))",
        rhs="(Where (Lt (Iota (Ax j)) (Num (to-f64 n))) x y)",
        where=Y_CONSTANT_ALONG_J,
        example=Example(("Add", ("PadAxis", ax("j:7"), 0, 6, 0.0, s), ("PadAxis", ax("j:7"), 6, 1, 0.0, b))),
    ),
    _into_branches("appended-column-add", "where(j < f, x, y) + z", "(Add {} z)", ("Add", column, z)),
    _into_branches("appended-column-mul", "where(j < f, x, y)·z", "(Mul {} z)", ("Mul", column, z)),
    _into_branches("appended-column-exp", "e^{where(j < f, x, y)}", "(Exp {})", ("Exp", column)),
    _over_the_column("sum", "Σ_{j<N} where(j < n, x, y) = Σ_{j<n} x + (N − n)·y",
                     "(Add (Sum j (to-i64 f) x) (Mul y (Num (- (to-f64 N) f))))"),
    _over_the_column("max", "max_{j<N} where(j < n, x, y) = max(max_{j<n} x, y)", "(Maximum (Max j (to-i64 f) x) y)"),
    Rule(
        "sum-before-appended-column",
        "Σ_{j<n} where(j < f, x, y)·w = Σ_{j<n} x·w for n ≤ f (the appended column dropped)",
        lhs=f"(Sum j n (Mul (Where {APPENDED} x y) w))",
        rhs="(Sum j n (Mul x w))",
        where=("(<= (to-f64 n) f)",),
        example=Example(("Sum", "j:6", 6, ("Mul", ("Where", ("Lt", ("Iota", ax("j:6")), ("Num", 6.0)),
                                                   tensor("x", "i:3", "j:6"), b), tensor("w", "j:6", "e:2")))),
    ),
    Rule(
        "sink-normaliser",
        "a·(Σ_j e^{u_j} + e^w)⁻¹ = (a·(Σ_j e^{u_j})⁻¹)·(1 + e^{w − LSE_j u})⁻¹ for w constant along j (LSE_j u "
        "spelled max_j u + ln L_j(u), what a row kernel computes where no flash kernel writes it)",
        lhs="(Mul a (Recip (Add (Sum j n (Exp u)) (Exp w))))",
        rhs=("(Mul (Mul a (Recip (Sum j n (Exp u)))) (Recip (Add (Num 1.0) (Exp (Add w (Neg (Add (Max j n u) "
             f"(Mul (Log2 (SoftmaxFoldL j n u)) (Num {LN2!r})))))))))"),
        where=("(= axes-w (axes w))", "(set-not-contains axes-w j)"),
        example=Example(("Mul", tensor("a", "i:3", "e:2"), ("Recip", ("Add", ("Sum", "j:7", 7, ("Exp", s)), ("Exp", b))))),
    ),
    Rule(
        "shift-cancels",
        "(x − c) − (y − c) = x − y",
        lhs="(Add (Add x (Neg c)) (Neg (Add y (Neg c))))",
        rhs="(Add x (Neg y))",
        example=Example(("Add", ("Add", b, ("Neg", c)), ("Neg", ("Add", tensor("y", "i:3"), ("Neg", c))))),
    ),
)

SINKS = Ruleset("sinks", __doc__.splitlines()[0], RULES)
