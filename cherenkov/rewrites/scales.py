"""Scales: the descale factors of 8-bit attention operands move out of the contractions.

An 8-bit tensor enters the graph dequantised, ``cast(x₈)·s`` with ``s`` per tensor, per
batch or per head. In attention, a factor of ``v`` that does not vary along the key axis
``j`` leaves ``Σ_j p_j·v_j`` and multiplies the output (``FlashAttentionScaled``'s output
factor); a factor of ``q`` or ``k`` that varies along neither ``j`` nor the head dim ``d``
leaves the contraction ``Σ_d q·k`` and multiplies the scores (its operand's score factor,
next to the softmax scale). The kernel then reads the 8-bit tensors themselves and the
factors once. The rules fire only for tensors the graph stores in 8 bits (relation
``EightBit``): for 16-bit operands the plain form has the kernels, and moving a factor
would only hide it from them. Each move makes the form cheaper (one product fewer), so
extraction takes the form with every factor moved.
"""

from __future__ import annotations

from cherenkov.rewrites.rule import Example, Rule, Ruleset
from cherenkov.rewrites.terms import tensor

q = tensor("q", "i:3", "d:4")
k = tensor("k", "j:7", "d:4")
v = tensor("v", "j:7", "e:2")
s_i = tensor("s", "i:3")  # a factor varying along the query axis only (a per-row scale)
t_e = tensor("t", "e:2")  # a factor varying along the value axis (a per-channel scale of v)
f = tensor("f", "i:3")
g = tensor("g", "e:2")
EIGHT_BIT = ("q", "k", "v")
LACKS_JD = ("(= axes-s (axes s))", "(set-not-contains axes-s j)", "(set-not-contains axes-s d)")


def _scaled(qq, kk, score_q, score_k) -> tuple:
    return ("FlashAttentionScaled", "j:7", 7, "d:4", 4, qq, kk, v, 0.5, ("NoMask",), score_q, score_k, g)


RULES = (
    Rule(
        "attention-value-factor",
        "Σ_j softmax_j(s)_j·(v_j·t) = t·Σ_j softmax_j(s)_j·v_j for an 8-bit v and t free of j",
        lhs="(FlashAttention j n d nd q k (Mul (Tensor vn vi) s) c m)",
        rhs="(FlashAttentionScaled j n d nd q k (Tensor vn vi) c m (Num 1.0) (Num 1.0) s)",
        where=("(EightBit vn)", "(= axes-s (axes s))", "(set-not-contains axes-s j)"),
        example=Example(("FlashAttention", "j:7", 7, "d:4", 4, q, k, ("Mul", v, t_e), 0.5, ("NoMask",)),
                        eight_bit=EIGHT_BIT),  # fmt: skip
    ),
    Rule(
        "attention-query-factor",
        "softmax_j(c·f_q·f_k·Σ_d (q·s)·k) = softmax_j(c·(f_q·s)·f_k·Σ_d q·k) for an 8-bit q and s free of j and d",
        lhs="(FlashAttentionScaled j n d nd (Mul (Tensor qn qi) s) k v c m fq fk g)",
        rhs="(FlashAttentionScaled j n d nd (Tensor qn qi) k v c m (Mul fq s) fk g)",
        where=("(EightBit qn)", *LACKS_JD),
        example=Example(_scaled(("Mul", q, s_i), k, f, ("Num", 1.0)), eight_bit=EIGHT_BIT),
    ),
    Rule(
        "attention-key-factor",
        "softmax_j(c·f_q·f_k·Σ_d q·(k·s)) = softmax_j(c·f_q·(f_k·s)·Σ_d q·k) for an 8-bit k and s free of j and d",
        lhs="(FlashAttentionScaled j n d nd q (Mul (Tensor kn ki) s) v c m fq fk g)",
        rhs="(FlashAttentionScaled j n d nd q (Tensor kn ki) v c m fq (Mul fk s) g)",
        where=("(EightBit kn)", *LACKS_JD),
        example=Example(_scaled(q, ("Mul", k, s_i), ("Num", 1.0), f), eight_bit=EIGHT_BIT),
    ),
)

SCALES = Ruleset("scales", __doc__.splitlines()[0], RULES)
