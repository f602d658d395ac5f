"""Row-reduction fusion: softmax rows and norms become one-pass row kernels.

A row kernel reads a row once, folds its statistics (online max and sum for softmax;
sum of squares for RMSNorm; Welford mean and variance for LayerNorm) and writes the
normalised row. Elementwise prologues and epilogues (a weight, a bias, an activation)
join whichever kernel consumes or produces them when the graph is partitioned
(``kernels.py``).
"""

from __future__ import annotations

from cherenkov.rewrites.rule import Example, Rule, Ruleset
from cherenkov.rewrites.terms import tensor

x = tensor("x", "i:3", "j:6")
INV6 = 1.0 / 6
mean = ("Mul", ("Sum", "j:6", 6, x), ("Num", INV6))
centred = ("Add", x, ("Neg", mean))


def _normalised(z: tuple) -> tuple:
    mean_square = ("Mul", ("Sum", "j:6", 6, ("Mul", z, z)), ("Num", INV6))
    return ("Mul", z, ("Recip", ("Sqrt", ("Add", mean_square, ("Num", 1e-5)))))


RULES = (
    Rule(
        "softmax-row",
        "e^{s_j − max_j s}·L_j(s)⁻¹ = softmax_j(s), one row pass of the fold",
        lhs="(Mul (Exp (Add s (Neg (Max j n s)))) (Recip (SoftmaxFoldL j n s)))",
        rhs="(SoftmaxRow j n s)",
        example=Example(
            ("Mul", ("Exp", ("Add", x, ("Neg", ("Max", "j:6", 6, x)))), ("Recip", ("SoftmaxFoldL", "j:6", 6, x)))
        ),
    ),
    Rule(
        "rms-norm-row",
        "x_j·(Σ_j x_j²/n + ε)^{-1/2} = RmsNormRow_j(x, ε)",
        lhs="(Mul x (Recip (Sqrt (Add (Mul (Sum j n (Mul x x)) (Num inv)) (Num eps)))))",
        rhs="(RmsNormRow j n x eps)",
        where=("(= inv (/ 1.0 (to-f64 n)))",),
        example=Example(_normalised(x)),
    ),
    Rule(
        "layer-norm-row",
        "c_j·(Σ_j c_j²/n + ε)^{-1/2} with c = x − Σ_j x_j/n = LayerNormRow_j(x, ε)",
        lhs="(Mul c (Recip (Sqrt (Add (Mul (Sum j n (Mul c c)) (Num inv)) (Num eps)))))",
        rhs="(LayerNormRow j n x eps)",
        where=("(= c (Add x (Neg (Mul (Sum j n x) (Num inv)))))", "(= inv (/ 1.0 (to-f64 n)))"),
        example=Example(_normalised(centred)),
    ),
)

FUSION = Ruleset("fusion", __doc__.splitlines()[0], RULES)
