"""Casts: the dtype conversions around the scores that the fused kernels make themselves.

PyTorch code often widens the attention scores to fp32 for the softmax and rounds the
probabilities back to 16 bits for the product with ``v`` (Hugging Face's eager attention:
``softmax(s, dtype=float32).to(q.dtype)``). The kernels already compute every softmax
in fp32 and round a contraction's operands to 16 bits for the tensor cores, so these casts
say nothing the kernels do not do anyway; dropping them lets the softmax and contraction
identities see the plain forms. Widening is exact (up to fp32's own rounding of the
float64 reference); dropping the rounding of a contraction operand changes the value by
at most that rounding — each rule's tolerance says which.
"""

from __future__ import annotations

from cherenkov.rewrites.rule import Example, Rule, Ruleset
from cherenkov.rewrites.terms import tensor

x = tensor("x", "i:3", "j:4")
a_ik = tensor("a", "i:3", "k:16")
b_kj = tensor("b", "k:16", "j:2")

BOTH_DEPEND_ON_K = ("(= axes-a (axes a))", "(set-contains axes-a k)", "(= axes-b (axes b))", "(set-contains axes-b k)")
FP32_ROUNDING = 2.0**-23  # fp32's unit roundoff (the reference computes in float64)
HALF_ROUNDING = 2.0**-7  # bf16's unit roundoff 2^-8, twice for a sum of rounded products

RULES = (
    Rule(
        "widen-to-fp32",
        "cast_fp32(x) = x: widening a value the kernels hold in fp32 (or 16 bits) keeps it",
        lhs='(Cast "fp32" x)',
        rhs="x",
        example=Example(("Cast", "fp32", x)),
        tolerance=FP32_ROUNDING,
    ),
    Rule(
        "contract-rounded-operand",
        "Σ_k round16(a)·b = Σ_k a·b up to that rounding (a, b depend on k): the tensor cores' operands are 16-bit",
        lhs="(Sum k n (Mul (Cast d a) b))",
        rhs="(Sum k n (Mul a b))",
        where=('(!= d "fp32")', '(!= d "int32")', '(!= d "bool")', *BOTH_DEPEND_ON_K),
        example=Example(("Sum", "k:16", 16, ("Mul", ("Cast", "bf16", a_ik), b_kj))),
        tolerance=HALF_ROUNDING,
    ),
    Rule(
        "contract-rounded-operand-right",
        "Σ_k a·round16(b) = Σ_k a·b up to that rounding (a, b depend on k): the tensor cores' operands are 16-bit",
        lhs="(Sum k n (Mul a (Cast d b)))",
        rhs="(Sum k n (Mul a b))",
        where=('(!= d "fp32")', '(!= d "int32")', '(!= d "bool")', *BOTH_DEPEND_ON_K),
        example=Example(("Sum", "k:16", 16, ("Mul", a_ik, ("Cast", "fp16", b_kj)))),
        tolerance=HALF_ROUNDING,
    ),
)

CASTS = Ruleset("casts", __doc__.splitlines()[0], RULES)
