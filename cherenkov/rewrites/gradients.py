"""Gradients: the vector-Jacobian products ``ck.grad`` writes, rewritten into the flash backward.

``ck.grad`` differentiates attention primitive by primitive, so the gradient of the scores
arrives as the chain rule spells it: through the quotient ``p / Σ_j p`` (``g·r − (Σ_j g·e)·r²``
times ``e``), through ``exp2(x·log2 e)`` (times ``ln 2·log2 e``), and through the row maximum
(a term that vanishes). Small identities turn it into the form a streaming kernel computes:

1. the constants of the exponential's chain rule cancel, ``g·exp2(z)·ln 2·log2 e = g·exp2(z)``;
2. the quotient's VJP is the softmax's: ``(g·r − (Σ_j g·e)·r²)·e = P∘(g − Σ_j P∘g)``,
   ``P = e·r``;
3. the shift by the row maximum carries no gradient: ``Σ_j P∘(g − Σ_j P∘g) = 0`` (spelled as ``ck.grad``
   writes max's VJP, through its argmax mask, or as torch scatters it to the argmax);
4. ``rowsum(P∘dP) = rowsum(dO∘O)``: with ``dP = Σ_e dO·v``, the sums over keys and over the
   value dim swap and ``Σ_j P·v`` is the attention output ``O`` itself;
5. ``P = e^{s − LSE(s)}``: the probabilities recomputed from the row's log-sum-exp (a causal
   mask added as a large finite negative, as transformers builds it, is the −∞ one there);
6. ``dS = P∘(dP − D)`` over scores ``c·Σ_d q·k`` (causally masked, plus a bias, or both: a stored
   bias or ALiBi's computed one, :data:`~cherenkov.rewrites.streaming.BIAS_FORMS`) is
   ``AttentionDs``, and the three contractions of the backward stream over it:
   ``dq = c·Σ_j dS·k``, ``dk = c·Σ_i dS·q``, ``dv = Σ_i P·dO``;
7. with GQA, a K/V head's dk and dv sum those of its group's query heads (``Σ_g``): one form
   streams over the group's queries;
8. scores soft-capped at ``m`` (``m·tanh(a·Σ_d q·k)``, Gemma 2's) carry the cap's slope: its chain rule
   through tanh's exponential spelling is ``g·(1 − tanh²)``, and ``AttentionDs`` of capped scores is
   ``P∘(dP − D)∘(1 − tanh²)``, the gradient of the cap's argument, so ``dq = a·m·Σ_j dS·k`` as before;
9. SDPA under a float mask, as a captured module spells it, wraps its softmax in
   ``where(max_j s > −∞, P, 0)`` (a row without a live score gives 0): its gradient passes the
   where to ``g`` and to ``P`` before ``dv``, and the flash backward's ``P``, 0 in such a row,
   stands for both;
10. scores clamped from below under a finite causal mask (XGLM's ``max(s + mask, m₂)``): the clamp's
    VJP, torch's ``where(x < m₂, 0, where(x == m₂, g/2, g))``, moves only masked entries, whose
    probability is 0, so the gradient is the causal softmax's.

Every rule is an identity with a small random example (``tests/rewrites/test_rules.py``).
"""

from __future__ import annotations

import math

from cherenkov.rewrites.masks import (BF16_LOWEST, UNDER_FLOOR_M2, WINDOW_EDGE, WINDOW_LOWER,
                                     finite_causal_mask_rule)
from cherenkov.rewrites.rule import Example, Rule, Ruleset
from cherenkov.rewrites.algebra import HALF_LN2
from cherenkov.rewrites.casts import HALF_ROUNDING
from cherenkov.rewrites.streaming import CAP_EXAMPLE, CAUSAL_CONDITION, SCALE, score_forms
from cherenkov.rewrites.terms import ax, tensor

x = tensor("x", "i:3", "j:7")
s = tensor("s", "i:3", "j:7")
g = tensor("g", "i:3", "j:7")
w = tensor("w", "i:3", "j:7")
u = tensor("u", "i:3")
q, k = tensor("q", "i:3", "d:4"), tensor("k", "j:7", "d:4")
v, do = tensor("v", "j:7", "e:2"), tensor("do", "i:3", "e:2")
k2, q2, do2 = tensor("k", "j:7", "f:4"), tensor("q", "i:3", "f:4"), tensor("do", "i:3", "f:2")

shifted = ("Exp", ("Add", s, ("Neg", ("Max", "j:7", 7, s))))


def _slope(tanh: str) -> str:
    """``1 − t·t`` for the pattern ``t`` of a tanh: the slope of a soft cap ``m·tanh`` over ``m``."""
    return f"(Add (Num 1.0) (Neg (Mul {tanh} {tanh})))"


def _slope_example(tanh: tuple) -> tuple:
    return ("Add", ("Num", 1.0), ("Neg", ("Mul", tanh, tanh)))


CAP_SLOPE = _slope("(Tanh (Mul (Contract d nd q k) (Num a)))")
"""``1 − tanh²(a·Σ_d q·k)``, the slope of capped scores (a pattern)."""
cap_slope = _slope_example(("Tanh", ("Mul", ("Contract", "d:4", 4, q, k), ("Num", CAP_EXAMPLE[0]))))
RECIPROCALS = "(< (abs (- (* m u) 1.0)) 1e-12)"
"""``u·m = 1`` (to rounding): a cap ``m`` and its inverse ``u``, both in a soft cap's chain rule."""
SAME_SCALE = "(< (abs (- c c2)) (* 1e-12 c))"
"""The scale a contraction of ``dS`` is multiplied by is ``dS``'s own (to rounding: a soft cap's chain
rule folds ``m``, ``1/m`` and ``a`` in another order than ``a·m``)."""
normaliser = ("Recip", ("Sum", "j:7", 7, shifted))
probability = ("SoftmaxRow", "j:7", 7, s)
_windowed = f"(Add s (Where {WINDOW_LOWER} (Num m2) (Num 0.0)))"  # scores under a window's lower edge

def _recomputed(score: str) -> str:
    """The probabilities of ``score`` recomputed from their row's log-sum-exp (a pattern)."""
    return f"(Exp (Add {score} (Neg (LogSumExp j nj {score}))))"


def _recomputed_example(score: tuple) -> tuple:
    return ("Exp", ("Add", score, ("Neg", ("LogSumExp", "j:7", 7, score))))


def _score_gradient_rules() -> tuple[Rule, ...]:
    """``AttentionDs`` for each score form: ``P∘(dP − D)``, times ``1 − t²`` for scores soft-capped at
    ``m`` (``t = tanh(a·Σ_d q·k)``, so that ``dS`` is the gradient of the capped scores' argument
    ``a·m·Σ_d q·k``, and ``dq = a·m·Σ_j dS·k`` as for any other scale)."""
    rules = []
    for form in score_forms():
        output = ("FlashAttention", "j:7", 7, "d:4", 4, q, k, v, form.scale_example, form.mask_example)
        lhs = (f"(Mul {_recomputed(form.score)} (Add (Contract e ne do v) "
               f"(Neg (Contract e ne do (FlashAttention j nj d nd q k v c {form.mask})))))")
        example = ("Mul", _recomputed_example(form.score_example),
                   ("Add", ("Contract", "e:2", 2, do, v), ("Neg", ("Contract", "e:2", 2, do, output))))
        facts, text = form.facts, "P∘(Σ_e dO·v − Σ_e dO·O)"
        if form.softcap:
            lhs, example = f"(Mul {lhs} {CAP_SLOPE})", ("Mul", example, cap_slope)
            facts, text = (*facts, "(= c (* a cap))"), f"{text}∘(1 − tanh²(a·Σ_d q·k))"
        rules.append(Rule(
            f"attention-ds{form.suffix}",
            f"{text} with P = e^{{s − LSE(s)}}, s = {form.text} and O its attention = AttentionDs(q, k, v, dO): "
            "the score gradient the backward streams",
            lhs=lhs,
            rhs=f"(AttentionDs j nj d nd e ne q k v do {form.scale} {form.mask})",
            where=facts,
            example=Example(example),
        ))  # fmt: skip
    return tuple(rules)


def _value_gradient_rules() -> tuple[Rule, ...]:
    """dv streamed over the queries, for each score form, also through SDPA's safe softmax's where
    (the flash backward's P is 0 in a row without a live score): a masked SDPA spells it, and so does
    CUDA's math SDPA without one."""
    rules = []
    for form in score_forms():
        rules.append(Rule(
            f"flash-grad-v{form.suffix}",
            f"Σ_i P·dO with P = e^{{s − LSE(s)}}, s = {form.text} = FlashAttentionGradV: dv streamed over the queries",
            lhs=f"(Contract i ni {_recomputed(form.score)} do2)",
            rhs=f"(FlashAttentionGradV i ni j nj d nd q k {form.scale} {form.mask} do2)",
            where=form.facts,
            example=Example(("Contract", "i:3", 3, _recomputed_example(form.score_example), do2)),
        ))
        live = f"(Lt (Num -inf) (Max j nj {form.score}))"
        rules.append(Rule(
            f"flash-grad-v{form.suffix}-safe",
            f"Σ_i where(max_j s > −∞, P, 0)·dO with P = e^{{s − LSE(s)}}, s = {form.text} "
            "= FlashAttentionGradV: dv through the safe softmax's where (the flash backward's P is 0 in a row "
            "without a live score)",
            lhs=f"(Contract i ni (Where {live} {_recomputed(form.score)} (Num 0.0)) do2)",
            rhs=f"(FlashAttentionGradV i ni j nj d nd q k {form.scale} {form.mask} do2)",
            where=form.facts,
            example=Example(("Contract", "i:3", 3, ("Where", ("Lt", ("Num", -math.inf),
                                                               ("Max", "j:7", 7, form.score_example)),
                                                     _recomputed_example(form.score_example), ("Num", 0.0)), do2)),
        ))  # fmt: skip
    return tuple(rules)


def _soft_cap_output_vjp_rules() -> tuple[Rule, ...]:
    """The chain rule through a soft cap ``m·tanh(y/m)`` as autograd's ``tanh_backward`` spells it, from
    tanh's output ``t``: ``(g·m)·(1 − t·t)·u = g·(1 − t·t)`` for ``u·m = 1``; and on ``g`` rounded to 16
    bits (a bf16 model's softmax gradient), within that rounding, which the flash backward's dS gets
    anyway before its products."""
    slope, slope_example = _slope("(Tanh y)"), _slope_example(("Tanh", x))
    rules = []
    for suffix, pattern, example, tolerance in (("", "g", g, 1e-9),
                                                ("-rounded", "(Cast dt g)", ("Cast", "bf16", g), HALF_ROUNDING)):
        rules.append(Rule(
            f"soft-cap-vjp-output{suffix}",
            f"({'round16(g)' if suffix else 'g'}·m)·(1 − t·t)·u = g·(1 − t·t) for u·m = 1, t = tanh(y): the chain "
            "rule through a soft cap m·tanh(y/m) from tanh's output (autograd's tanh_backward)"
            + (", within the 16-bit rounding of g" if suffix else ""),
            lhs=f"(Mul (Mul (Mul {pattern} (Num m)) {slope}) (Num u))",
            rhs=f"(Mul g {slope})",
            where=(RECIPROCALS,),
            example=Example(("Mul", ("Mul", ("Mul", example, ("Num", 1.5)), slope_example), ("Num", 1 / 1.5))),
            tolerance=tolerance,
        ))  # fmt: skip
    return tuple(rules)


_LIVE_ROW = "(Lt (Num -inf) (Max j n s))"
"""A row with a live score: the condition of the safe softmax's where (as SDPA under a mask spells it)."""


def _live_only(x: tuple) -> tuple:
    """``where(max_j s > −∞, x, 0)``, an example's cotangent through the safe softmax's where."""
    return ("Where", ("Lt", ("Num", -math.inf), ("Max", "j:7", 7, s)), x, ("Num", 0.0))


_causal = ("Lt", ("Iota", ax("i:3")), ("Iota", ax("j:7")))
# XGLM's: scores under a causal mask of bf16's lowest, clamped there (a masked score ties the floor), and the
# gradient of their causal softmax
_clamped = ("Add", s, ("Where", _causal, ("Num", BF16_LOWEST), ("Num", 0.0)))
_causal_gradient = ("Mul", ("SoftmaxRow", "j:7", 7, ("Where", _causal, ("Num", -math.inf), s)), g)

grouped_q, grouped_q2 = tensor("q", "g:2", "i:3", "d:4"), tensor("q", "g:2", "i:3", "f:4")
grouped_do, grouped_do2 = tensor("do", "g:2", "i:3", "e:2"), tensor("do", "g:2", "i:3", "f:2")
_exp2 = ("Exp2", ("Mul", x, ("Num", 0.7)))
_exp2_reciprocal = ("Recip", ("Add", _exp2, ("Num", 1.0)))
ds = ("AttentionDs", "j:7", 7, "d:4", 4, "e:2", 2, q, k, v, do, SCALE, ("NoMask",))
gradient_of_shifted = ("Mul", probability, ("Add", g, ("Neg", ("Sum", "j:7", 7, ("Mul", probability, g)))))

RULES = (
    Rule(
        "exp2-vjp-constants",
        "g·exp2(z)·a·b = g·exp2(z) when a·b = 1: the chain rule of exp2(x·log2 e) multiplies by ln 2 and log2 e",
        lhs="(Mul (Mul (Mul g (Exp2 z)) (Num a)) (Num b))",
        rhs="(Mul g (Exp2 z))",
        where=("(= 1.0 (* a b))",),
        example=Example(("Mul", ("Mul", ("Mul", g, ("Exp2", x)), ("Num", math.log(2.0))), ("Num", math.log2(math.e)))),
    ),
    Rule(
        "quotient-vjp",
        "(g·r − (Σ_j g·e)·r·r)·e = (e·r)·(g − Σ_j (e·r)·g) with r = (Σ_j e)⁻¹: the softmax's VJP, P∘(g − rowsum(P∘g))",
        lhs="(Mul (Add (Mul g r) (Neg (Mul (Mul (Sum j n (Mul g e)) r) r))) e)",
        rhs="(Mul (Mul e r) (Add g (Neg (Sum j n (Mul (Mul e r) g)))))",
        where=("(= r (Recip (Sum j n e)))",),
        example=Example(("Mul", ("Add", ("Mul", g, normaliser),
                                 ("Neg", ("Mul", ("Mul", ("Sum", "j:7", 7, ("Mul", g, shifted)), normaliser), normaliser))),
                         shifted)),
    ),  # fmt: skip
    Rule(
        "softmax-shift-gradient",
        "x + (−Σ_j x)·w·u = x for x = P∘(g − Σ_j P∘g): the softmax's shift (its row maximum) carries no gradient",
        lhs="(Add x (Mul (Mul (Neg (Sum j n x)) w) u))",
        rhs="x",
        where=("(= x (Mul (SoftmaxRow j n s) (Add g (Neg (Sum j n (Mul (SoftmaxRow j n s) g))))))",),
        example=Example(("Add", gradient_of_shifted,
                         ("Mul", ("Mul", ("Neg", ("Sum", "j:7", 7, gradient_of_shifted)), w), u))),
    ),  # fmt: skip
    Rule(
        "softmax-shift-gradient-scaled",
        "x·a + (−Σ_j x·a)·w·u = x·a for x = P∘(g − Σ_j P∘g) and a constant a (a base-2 softmax's shift)",
        lhs="(Add y (Mul (Mul (Neg (Sum j n y)) w) u))",
        rhs="y",
        where=("(= y (Mul x (Num a)))",
               "(= x (Mul (SoftmaxRow j n s) (Add g (Neg (Sum j n (Mul (SoftmaxRow j n s) g))))))"),
        example=Example(("Add", ("Mul", gradient_of_shifted, ("Num", math.log(2.0))),
                         ("Mul", ("Mul", ("Neg", ("Sum", "j:7", 7, ("Mul", gradient_of_shifted, ("Num", math.log(2.0))))),
                                  w), u))),
    ),  # fmt: skip
    Rule(
        "softmax-shift-gradient-scatter",
        "x + where(a, 0, where(b, 0, Σ_j −x)) = x for x = P∘(g − Σ_j P∘g): the row maximum's gradient, torch's "
        "scatter of −Σ_j x to the argmax (the position neither below nor above it), is 0",
        lhs="(Add x (Where a (Num 0.0) (Where b (Num 0.0) (Sum j n (Neg x)))))",
        rhs="x",
        where=("(= x (Mul (SoftmaxRow j n s) (Add g (Neg (Sum j n (Mul (SoftmaxRow j n s) g))))))",),
        example=Example(("Add", gradient_of_shifted,
                         ("Where", ("Lt", ("Iota", ax("j:7")), u), ("Num", 0.0),
                          ("Where", ("Lt", u, ("Iota", ax("j:7"))), ("Num", 0.0),
                           ("Sum", "j:7", 7, ("Neg", gradient_of_shifted)))))),
    ),  # fmt: skip
    Rule(
        "softmax-row-unshifted",
        "e^{s}·(e^{max_j s}·L_j(s))⁻¹ = softmax_j(s): a softmax spelled without its shift is the row form",
        lhs="(Mul (Exp s) (Recip (Mul (Exp (Max j n s)) (SoftmaxFoldL j n s))))",
        rhs="(SoftmaxRow j n s)",
        example=Example(("Mul", ("Exp", s), ("Recip", ("Mul", ("Exp", ("Max", "j:7", 7, s)),
                                                         ("SoftmaxFoldL", "j:7", 7, s))))),
    ),  # fmt: skip
    finite_causal_mask_rule("softmax-row-finite-causal-mask", "softmax_j({})", "SoftmaxRow", s),
    finite_causal_mask_rule("softmax-row-finite-causal-where", "softmax_j({})", "SoftmaxRow", s, spelling="fill"),
    finite_causal_mask_rule("softmax-row-finite-causal-fill-bias", "softmax_j({})", "SoftmaxRow", s,
                            spelling="additive-fill"),
    finite_causal_mask_rule("softmax-row-finite-causal-window", "softmax_j({})", "SoftmaxRow", s,
                            spelling="additive-window"),
    finite_causal_mask_rule("softmax-row-finite-causal-fill-window", "softmax_j({})", "SoftmaxRow", s,
                            spelling="fill-window"),
    finite_causal_mask_rule("softmax-row-finite-causal-clamped", "softmax_j({})", "SoftmaxRow", s,
                            spelling="clamped"),
    finite_causal_mask_rule("softmax-row-finite-keys-ahead-clamped", "softmax_j({})", "SoftmaxRow", s,
                            spelling="clamped", keys_ahead=True),
    Rule(
        "masked-softmax-gradient",
        "where(m, 0, softmax_j(where(m, −∞, s))·y) = softmax_j(where(m, −∞, s))·y: a masked score's probability is 0",
        lhs="(Where m (Num 0.0) (Mul (SoftmaxRow j n (Where m (Num -inf) s)) y))",
        rhs="(Mul (SoftmaxRow j n (Where m (Num -inf) s)) y)",
        example=Example(("Where", ("Lt", ("Iota", ax("i:3")), ("Iota", ax("j:7"))), ("Num", 0.0),
                         ("Mul", ("SoftmaxRow", "j:7", 7, ("Where", ("Lt", ("Iota", ax("i:3")), ("Iota", ax("j:7"))),
                                                           ("Num", -math.inf), s)), g))),
    ),  # fmt: skip
    Rule(
        "window-masked-softmax-gradient",
        "where(j < i + w, 0, softmax_j(where(c, −∞, s + where(j < i + w, m₂, 0)))·y) = softmax_j(…)·y for m₂ ≤ −2¹³: "
        "a score below a sliding window has probability 0 (GPT-Neo's window filling the scores, its VJP a where)",
        lhs=f"(Where {WINDOW_LOWER} (Num 0.0) (Mul (SoftmaxRow j n (Where c (Num -inf) {_windowed})) y))",
        rhs=f"(Mul (SoftmaxRow j n (Where c (Num -inf) {_windowed})) y)",
        where=(UNDER_FLOOR_M2,),
        example=Example(("Where", WINDOW_EDGE, ("Num", 0.0),
                         ("Mul", ("SoftmaxRow", "j:7", 7, ("Where", ("Lt", ("Iota", ax("i:3")), ("Iota", ax("j:7"))),
                                                           ("Num", -math.inf),
                                                           ("Add", s, ("Where", WINDOW_EDGE, ("Num", -65536.0),
                                                                       ("Num", 0.0))))), g))),
    ),  # fmt: skip
    Rule(
        "clamp-gradient-masked-softmax",
        "where(x < m₂, 0, where(m₂ < x, g, g·½)) = g for x = s + where(i < j, m, 0), g = softmax_j(where(i < j, "
        "−∞, s))·y and a floor m₂ ≤ −2¹³ below every score s: the VJP of the clamp max(x, m₂) (½ at a tie, as "
        "torch's) moves only masked entries, whose probability is 0",
        lhs="(Where (Lt x (Num m2)) (Num 0.0) (Where (Lt (Num m2) x) g (Mul g (Num 0.5))))",
        rhs="g",
        where=(f"(= x (Add s (Where {CAUSAL_CONDITION} (Num m) (Num 0.0))))",
               f"(= g (Mul (SoftmaxRow j n (Where {CAUSAL_CONDITION} (Num -inf) s)) y))", UNDER_FLOOR_M2),
        example=Example(("Where", ("Lt", _clamped, ("Num", BF16_LOWEST)), ("Num", 0.0),
                         ("Where", ("Lt", ("Num", BF16_LOWEST), _clamped), _causal_gradient,
                          ("Mul", _causal_gradient, ("Num", 0.5))))),
    ),  # fmt: skip
    Rule(
        "safe-softmax-gradient",
        "P∘(w − Σ_j P∘w) = P∘(g − Σ_j P∘g) for w = where(max_j s > −∞, g, 0), P = softmax_j(s): the gradient "
        "through the safe softmax's where (a row without a live score has no probabilities either way)",
        lhs=(f"(Mul (SoftmaxRow j n s) (Add (Where {_LIVE_ROW} g (Num 0.0)) "
             f"(Neg (Sum j n (Mul (SoftmaxRow j n s) (Where {_LIVE_ROW} g (Num 0.0)))))))"),
        rhs="(Mul (SoftmaxRow j n s) (Add g (Neg (Sum j n (Mul (SoftmaxRow j n s) g)))))",
        example=Example(("Mul", probability, ("Add", _live_only(g), ("Neg", ("Sum", "j:7", 7,
                                                                             ("Mul", probability, _live_only(g))))))),
    ),  # fmt: skip
    Rule(
        "safe-softmax-output-gradient",
        "w∘(g − Σ_j w∘g) = P∘(g − Σ_j P∘g) for w = where(max_j s > −∞, P, 0), P = softmax_j(s): the softmax's "
        "VJP from the safe softmax's output (autograd's), P read as the flash backward's (0 in a row without a "
        "live score, as w is)",
        lhs=(f"(Mul (Where {_LIVE_ROW} (SoftmaxRow j n s) (Num 0.0)) (Add g (Neg (Sum j n (Mul (Where {_LIVE_ROW} "
             "(SoftmaxRow j n s) (Num 0.0)) g)))))"),
        rhs="(Mul (SoftmaxRow j n s) (Add g (Neg (Sum j n (Mul (SoftmaxRow j n s) g)))))",
        example=Example(("Mul", _live_only(probability), ("Add", g, ("Neg", ("Sum", "j:7", 7,
                                                                             ("Mul", _live_only(probability), g)))))),
    ),  # fmt: skip
    Rule(
        "sum-swap",
        "Σ_j a·Σ_e b·c = Σ_e b·Σ_j a·c when a does not depend on e nor b on j",
        lhs="(Sum j n (Mul a (Sum e m (Mul b c))))",
        rhs="(Sum e m (Mul b (Sum j n (Mul a c))))",
        where=("(= axes-a (axes a))", "(set-not-contains axes-a e)", "(= axes-b (axes b))",
               "(set-not-contains axes-b j)"),
        example=Example(("Sum", "j:7", 7, ("Mul", s, ("Sum", "e:2", 2, ("Mul", do, v))))),
    ),  # fmt: skip
    Rule(
        "softmax-from-logsumexp",
        "softmax_j(s) = e^{s − LSE_j(s)}: a probability recomputed from its row's log-sum-exp",
        lhs="(SoftmaxRow j n s)",
        rhs="(Exp (Add s (Neg (LogSumExp j n s))))",
        example=Example(probability),
    ),
    Rule(
        "soft-cap-vjp",
        "−(−(g·m)·2·r)·r·e·2·u = g·(1 − tanh²(x·a·ln 2/2)) with e = exp2(x·a), r = (e + 1)⁻¹ and u·m = 1: "
        "the chain rule through a soft cap m·tanh(y/m), tanh(y) spelled 1 − 2·(e^{2y} + 1)⁻¹",
        lhs=("(Mul (Mul (Mul (Neg (Mul (Mul (Mul (Neg (Mul g (Num m))) (Num 2.0)) "
             "(Recip (Add (Exp2 (Mul x (Num a))) (Num 1.0)))) (Recip (Add (Exp2 (Mul x (Num a))) (Num 1.0))))) "
             "(Exp2 (Mul x (Num a)))) (Num 2.0)) (Num u))"),
        rhs=f"(Mul g {_slope(f'(Tanh (Mul x (Num (* a {HALF_LN2}))))')})",
        where=(RECIPROCALS,),
        example=Example(("Mul", ("Mul", ("Mul", ("Neg", ("Mul", ("Mul", ("Mul", ("Neg", ("Mul", g, ("Num", 1.5))),
                                                                          ("Num", 2.0)), _exp2_reciprocal),
                                                         _exp2_reciprocal)), _exp2), ("Num", 2.0)), ("Num", 1 / 1.5))),
    ),  # fmt: skip
    *_soft_cap_output_vjp_rules(),
    *_score_gradient_rules(),
    Rule(
        "flash-grad-q",
        "c·Σ_j dS·k = FlashAttentionGradQ: dq streamed over the keys, dS recomputed tile by tile",
        lhs="(Mul (Contract j nj (AttentionDs j nj d nd e ne q k v do c m) k2) (Num c2))",
        rhs="(FlashAttentionGradQ j nj d nd e ne q k v do c m k2)",
        where=(SAME_SCALE,),
        example=Example(("Mul", ("Contract", "j:7", 7, ds, k2), ("Num", SCALE))),
    ),
    Rule(
        "flash-grad-k",
        "c·Σ_i dS·q = FlashAttentionGradK: dk streamed over the queries, dS recomputed tile by tile",
        lhs="(Mul (Contract i ni (AttentionDs j nj d nd e ne q k v do c m) q2) (Num c2))",
        rhs="(FlashAttentionGradK i ni j nj d nd e ne q k v do c m q2)",
        where=(SAME_SCALE,),
        example=Example(("Mul", ("Contract", "i:3", 3, ds, q2), ("Num", SCALE))),
    ),
    *_value_gradient_rules(),
    Rule(
        "flash-grad-k-group",
        "Σ_g FlashAttentionGradK = FlashAttentionGradKGroup: a K/V head's dk sums the query heads of its group",
        lhs="(Sum g ng (FlashAttentionGradK i ni j nj d nd e ne q k v do c m q2))",
        rhs="(FlashAttentionGradKGroup g ng i ni j nj d nd e ne q k v do c m q2)",
        example=Example(("Sum", "g:2", 2, ("FlashAttentionGradK", "i:3", 3, "j:7", 7, "d:4", 4, "e:2", 2, grouped_q,
                                            k, v, grouped_do, SCALE, ("NoMask",), grouped_q2))),
    ),  # fmt: skip
    Rule(
        "flash-grad-v-group",
        "Σ_g FlashAttentionGradV = FlashAttentionGradVGroup: a K/V head's dv sums the query heads of its group",
        lhs="(Sum g ng (FlashAttentionGradV i ni j nj d nd q k c m do2))",
        rhs="(FlashAttentionGradVGroup g ng i ni j nj d nd q k c m do2)",
        example=Example(("Sum", "g:2", 2, ("FlashAttentionGradV", "i:3", 3, "j:7", 7, "d:4", 4, grouped_q, k, SCALE,
                                            ("NoMask",), grouped_do2))),
    ),  # fmt: skip
)

GRADIENTS = Ruleset("gradients", __doc__.splitlines()[0], RULES)
