"""Streaming reduction: the online-softmax fold, and flash attention.

With ``m = max_j s``, the pair ``(Σ_j e^{s_j−m}·v_j, Σ_j e^{s_j−m})`` is an associative
fold over ``j`` of the state ``(m, l, acc)`` (combine: rescale both by ``e^{m_old−m_new}``
and add), so one pass over the keys computes both sums and the normalised result. When
the scores are themselves a scaled contraction ``c·Σ_d q·k`` (optionally causally
masked, plus a bias that does not depend on the head dim, or both: ALiBi, or a sliding
window's lower edge, under a causal mask) the streaming softmax-contraction is flash attention,
the kernel reading a computed bias from a buffer an earlier kernel writes; a causal mask added as a large finite negative (PyTorch's cuDNN path) is the
causal mask once the exponentials underflow. Both give 0 for a row without a live score (all −∞), so a safe softmax's
``where(max_j s > −∞, ·, 0)`` around them is the form itself. Scores soft-capped at ``m``,
``m·tanh(a·Σ_d q·k)`` (Gemma 2's), are flash attention at scale ``a·m`` with the cap.
Scores shifted by a row constant first (by their row's max, as GPT-OSS does) give the same softmax.
The fold's associativity
splits it: folding the keys in chunks and folding the chunks' partial states gives the
same result (split-KV attention, for decoding). The fold's ``m + log l`` is the row's
log-sum-exp, and that of attention's scores is the statistic a forward pass saves for its
backward (``AttentionLse``: the same parts as flash attention, without ``v``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from cherenkov.rewrites.casts import HALF_ROUNDING
from cherenkov.rewrites.masks import (KEYS_AHEAD, UNDER_FLOOR_M, UNDER_FLOOR_M2, WINDOW_EDGE, WINDOW_LOWER,
                                     finite_causal_mask_rule)
from cherenkov.rewrites.rule import Example, Rule, Ruleset
from cherenkov.rewrites.terms import Term, ax, tensor

s = tensor("s", "i:3", "j:7")
v = tensor("v", "j:7", "e:2")
q = tensor("q", "i:3", "d:4")
k = tensor("k", "j:7", "d:4")
shifted = ("Add", s, ("Neg", ("Max", "j:7", 7, s)))
SCALE = 0.5
scores = ("Mul", ("Contract", "d:4", 4, q, k), ("Num", SCALE))
causal = ("Where", ("Lt", ("Iota", ax("i:3")), ("Iota", ax("j:7"))), ("Num", -math.inf), scores)
bias = tensor("b", "i:3", "j:7")
# ALiBi: a slope (here per query row, as a head would be) times each key's position
alibi = ("Mul", tensor("m", "i:3"), ("Iota", ax("j:7")))
WITHOUT_HEAD_DIM = ("(= axes-b (axes b))", "(set-not-contains axes-b d)")
# scores soft-capped at 1.5, a·Σ_d q·k with a = 0.4 (tanh's argument spans its curved part)
CAP_EXAMPLE = (0.4, 1.5)
capped_scores = ("Mul", ("Tanh", ("Mul", ("Contract", "d:4", 4, q, k), ("Num", CAP_EXAMPLE[0]))), ("Num", CAP_EXAMPLE[1]))
CAPPED = "(Mul (Tanh (Mul (Contract d nd q k) (Num a))) (Num cap))"
"""Attention's scores soft-capped at ``cap`` (Gemma 2's logit cap), ``cap·tanh(a·Σ_d q·k)``: a pattern."""
# row 0 wholly masked: the safe softmax's where and the fold's empty row agree there
dead_row = ("Where", ("Lt", ("Iota", ax("i:3")), ("Num", 1.0)), ("Num", -math.inf), s)

LN2 = math.log(2.0)


@dataclass(frozen=True)
class BiasForm:
    """A bias added to attention's scores that flash attention takes: ``suffix`` of its rules'
    names, ``pattern`` (a stored tensor read in place, or the variable ``b`` that ``facts``
    constrain), what it is in words, an ``example`` over the examples' ``i:3, j:7``, and whether the scores also
    take it under a causal mask (``under_causal``)."""

    suffix: str
    pattern: str
    facts: tuple[str, ...]
    what: str
    example: Term
    under_causal: bool = True


# a sliding window's edges over the examples' i:3, j:7: keys j < i − 1 masked (the lower edge), and (a
# symmetric window, ModernBERT's local attention) keys j > i + 2 too
window_lower = ("Where", WINDOW_EDGE, ("Num", -math.inf), ("Num", 0.0))
window_both = ("Where", ("Lt", ("Add", ("Iota", ax("i:3")), ("Num", 2.0)), ("Iota", ax("j:7"))), ("Num", -math.inf),
               window_lower)

keys_ahead = ("Where", ("Lt", ("Add", ("Iota", ax("i:3")), ("Num", 4.0)), ("Iota", ax("j:7"))), ("Num", -math.inf),
              ("Num", 0.0))

BIAS_FORMS = (
    BiasForm("", "(Tensor b bix)", (), "a stored tensor b", bias),
    BiasForm("-band", "b", (f"(= b (Where {WINDOW_LOWER} (Num m) (Num 0.0)))", UNDER_FLOOR_M),
             "b = where(j < i + w, m, 0) for m ≤ −2¹³, a sliding window's lower edge", window_lower),
    BiasForm("-band2", "b", (f"(= b (Where (Lt (Add (Iota iq) (Num o)) (Iota (Ax j))) (Num m) (Where {WINDOW_LOWER} "
                             "(Num m2) (Num 0.0))))", UNDER_FLOOR_M, UNDER_FLOOR_M2),
             "b = where(i + o < j, m, where(j < i + w, m₂, 0)) for m, m₂ ≤ −2¹³, a window about the query", window_both),
    BiasForm("-ahead", "b", (f"(= b (Where {KEYS_AHEAD} (Num m) (Num 0.0)))", UNDER_FLOOR_M),
             "b = where(i + o < j, m, 0) for m ≤ −2¹³, a causal mask aligned to the last of more keys",
             keys_ahead),
    BiasForm("-beside-ahead", "b", (f"(= b (Add b1 (Where {KEYS_AHEAD} (Num m) (Num 0.0))))", UNDER_FLOOR_M,
                                    "(= axes-b1 (axes b1))", "(set-not-contains axes-b1 d)"),
             "b = b₁ + where(i + o < j, m, 0) for m ≤ −2¹³ and b₁ computed without d (ALiBi beside a KV cache's "
             "causal mask)", ("Add", alibi, keys_ahead), under_causal=False),
    BiasForm("-product", "b", ("(= b (Mul b1 b2))", *WITHOUT_HEAD_DIM),
             "b = b₁·b₂ computed without d (ALiBi's slope times key position)", alibi),
    BiasForm("-rounded", "b", ("(= b (Cast dt b1))", *WITHOUT_HEAD_DIM),
             "b = round(b₁) to a dtype, computed without d (Bloom's ALiBi rounded to bf16)", ("Cast", "bf16", alibi)),
)
"""The biases of :func:`score_forms`. A computed bias of any other form is not taken (a causal mask
spelled as an added ``where`` would be one, and it is the causal mask); an earlier kernel stores
a computed one for the flash kernels to read."""
BAND = BIAS_FORMS[1]
"""A sliding window's lower edge (the ``-band`` bias form)."""
BAND2, AHEAD = BIAS_FORMS[2:4]
"""A window about the query (the ``-band2`` bias form; with keys cached before the queries, a sliding window's
edges), and a causal mask aligned to the last key (``-ahead``)."""

CAUSAL_CONDITION = "(Lt (Iota iq) (Iota (Ax j)))"


@dataclass(frozen=True)
class ScoreForm:
    """Attention's scores ``c·Σ_d q·k`` under one mask flash attention takes: ``suffix`` of the
    rules' names, the scores in words (``text``) and as a ``score`` pattern, the ``mask`` term its
    flash forms carry, the ``facts`` of a computed bias or a cap, examples of both (``i:3, j:7,
    d:4``), the ``bias`` added (None: none), and the ``scale`` the flash forms carry (``c``, or
    ``a·m`` for scores soft-capped at ``m``, ``m·tanh(a·Σ_d q·k)``; ``scale_example`` in the
    examples)."""

    suffix: str
    text: str
    score: str
    mask: str
    facts: tuple[str, ...]
    score_example: Term
    mask_example: Term
    bias: BiasForm | None = None
    scale: str = "c"
    scale_example: float = SCALE
    softcap: bool = False


def score_forms() -> tuple[ScoreForm, ...]:
    """Every masked score form of flash attention: none, causal, and each :data:`BIAS_FORMS`
    bias without and with a causal mask."""
    plain = "(Mul (Contract d nd q k) (Num c))"
    causal_condition = ("Lt", ("Iota", ax("i:3")), ("Iota", ax("j:7")))
    forms = [
        ScoreForm("", "c·Σ_d q·k", plain, "(NoMask)", (), scores, ("NoMask",)),
        ScoreForm("-causal", "where(i < j, −∞, c·Σ_d q·k)", f"(Where {CAUSAL_CONDITION} (Num -inf) {plain})",
                  "(CausalMask iq)", (), causal, ("CausalMask", ax("i:3"))),
    ]  # fmt: skip
    for b in BIAS_FORMS:
        biased, biased_example = f"(Add {plain} {b.pattern})", ("Add", scores, b.example)
        forms.append(ScoreForm(f"-bias{b.suffix}", "c·Σ_d q·k + b", biased, f"(BiasMask {b.pattern})", b.facts,
                               biased_example, ("BiasMask", b.example), b))
        if not b.under_causal:
            continue
        forms.append(ScoreForm(f"-causal-bias{b.suffix}", "where(i < j, −∞, c·Σ_d q·k + b)",
                               f"(Where {CAUSAL_CONDITION} (Num -inf) {biased})", f"(CausalBiasMask iq {b.pattern})",
                               b.facts, ("Where", causal_condition, ("Num", -math.inf), biased_example),
                               ("CausalBiasMask", ax("i:3"), b.example), b))  # fmt: skip
    capped_facts, capped_scale = ("(> a 0.0)", "(> cap 0.0)"), CAP_EXAMPLE[0] * CAP_EXAMPLE[1]
    for suffix, text, score, mask, score_example, mask_example, b in (
        ("", "m·tanh(a·Σ_d q·k)", CAPPED, "(NoMask)", capped_scores, ("NoMask",), None),
        ("-causal", "where(i < j, −∞, m·tanh(a·Σ_d q·k))", f"(Where {CAUSAL_CONDITION} (Num -inf) {CAPPED})",
         "(CausalMask iq)", ("Where", causal_condition, ("Num", -math.inf), capped_scores), ("CausalMask", ax("i:3")),
         None),
        ("-bias", "m·tanh(a·Σ_d q·k) + b", f"(Add {CAPPED} (Tensor b bix))", "(BiasMask (Tensor b bix))",
         ("Add", capped_scores, bias), ("BiasMask", bias), BIAS_FORMS[0]),
        # Gemma 2 attending with its KV cache: the capped scores under a causal mask aligned to the last key, and
        # (its sliding layers) under that mask's band of a window
        *((f"-bias{form.suffix}", "m·tanh(a·Σ_d q·k) + b", f"(Add {CAPPED} {form.pattern})",
           f"(BiasMask {form.pattern})", ("Add", capped_scores, form.example), ("BiasMask", form.example), form)
          for form in (AHEAD, BAND2)),
        # Gemma 2's sliding layers: the capped scores under a window
        ("-causal-bias-band", "where(i < j, −∞, m·tanh(a·Σ_d q·k) + b)",
         f"(Where {CAUSAL_CONDITION} (Num -inf) (Add {CAPPED} {BAND.pattern}))", f"(CausalBiasMask iq {BAND.pattern})",
         ("Where", causal_condition, ("Num", -math.inf), ("Add", capped_scores, BAND.example)),
         ("CausalBiasMask", ax("i:3"), BAND.example), BAND),
    ):  # fmt: skip
        facts = capped_facts + (b.facts if b is not None else ())
        forms.append(ScoreForm(f"-softcap{suffix}", text, score, f"(SoftcapMask cap {mask})", facts, score_example,
                               ("SoftcapMask", CAP_EXAMPLE[1], mask_example), b, "(* a cap)", capped_scale, True))
    return tuple(forms)


def _flash_rules() -> tuple[Rule, ...]:
    """``Σ_j softmax_j(scores)·v_j = FlashAttention(q, k, v, c, mask)`` for each biased or soft-capped
    score form of :func:`score_forms` (the plain and causal ones are rules of their own)."""
    return tuple(
        Rule(
            f"flash-attention{form.suffix}",
            f"Σ_j softmax_j({form.text})·v_j = FlashAttention(q, k, v, {'a·m, soft cap m' if form.softcap else 'c'}"
            f"{', bias b' if form.bias else ''}{', causal on i' if 'causal' in form.suffix else ''})"
            + (f" for {form.bias.what}" if form.bias else "") + (" for a, m > 0" if form.softcap else ""),
            lhs=f"(OnlineSoftmaxContract j n {form.score} v)",
            rhs=f"(FlashAttention j n d nd q k v {form.scale} {form.mask})",
            where=form.facts,
            example=Example(("OnlineSoftmaxContract", "j:7", 7, form.score_example, v)),
        )
        for form in score_forms()
        if form.bias is not None or form.softcap
    )


def _clamped_floor_rules() -> tuple[Rule, ...]:
    """``head_j(round(max(c·Σ_d q·k, m₂))) = head_j(c·Σ_d q·k)`` for the softmax-contraction and the log-sum-exp,
    ``m₂ ≤ −2¹³``: attention's unmasked scores lie above any such floor (XGLM clamps its scores at bf16's lowest and
    rounds them; with one query after its cache the mask it clamps is gone)."""
    clamped = "(Cast dt (Maximum (Mul (Contract d nd q k) (Num c)) (Num m2)))"
    example = ("Cast", "bf16", ("Maximum", scores, ("Num", -3.3895313892515355e38)))
    return tuple(
        Rule(
            name,
            f"{text.format('round(max(c·Σ_d q·k, m₂))')} = {text.format('c·Σ_d q·k')} for m₂ ≤ −2¹³: the floor "
            "moves no score of a product, and the rounding is that of 16-bit scores",
            lhs=f"({head} j n {clamped}{after})",
            rhs=f"({head} j n (Mul (Contract d nd q k) (Num c)){after})",
            where=(UNDER_FLOOR_M2, '(!= dt "int32")', '(!= dt "bool")'),
            example=Example((head, "j:7", 7, example, *example_after)),
            tolerance=HALF_ROUNDING,
        )
        for name, text, head, after, example_after in (
            ("softmax-clamped-floor", "Σ_j softmax_j({})·v_j", "OnlineSoftmaxContract", " v", (v,)),
            ("logsumexp-clamped-floor", "LSE_j({})", "LogSumExp", "", ()),
        )
    )


def _attention_lse_rules() -> tuple[Rule, ...]:
    """``LSE_j(scores) = AttentionLse(q, k, c, mask)`` for each score form flash attention takes."""
    return tuple(
        Rule(
            f"attention-lse{form.suffix}",
            f"LSE_j({form.text}) = AttentionLse(q, k, {'a·m' if form.softcap else 'c'}): the log-sum-exp of "
            "attention's scores, a statistic its forward pass can save",
            lhs=f"(LogSumExp j n {form.score})",
            rhs=f"(AttentionLse j n d nd q k {form.scale} {form.mask})",
            where=form.facts,
            example=Example(("LogSumExp", "j:7", 7, form.score_example)),
        )
        for form in score_forms()
    )


RULES = (
    Rule(
        "softmax-fold-acc",
        "Σ_j e^{s_j−max_j s}·v_j = Acc_j(s, v), the accumulator of the online-softmax fold",
        lhs="(Sum j n (Mul (Exp (Add s (Neg (Max j n s)))) v))",
        rhs="(SoftmaxFoldAcc j n s v)",
        example=Example(("Sum", "j:7", 7, ("Mul", ("Exp", shifted), v))),
    ),
    Rule(
        "softmax-fold-l",
        "Σ_j e^{s_j−max_j s} = L_j(s), the normaliser of the online-softmax fold",
        lhs="(Sum j n (Exp (Add s (Neg (Max j n s)))))",
        rhs="(SoftmaxFoldL j n s)",
        example=Example(("Sum", "j:7", 7, ("Exp", shifted))),
    ),
    Rule(
        "online-softmax-contract",
        "L_j(s)⁻¹·Acc_j(s, v) = Σ_j softmax_j(s)·v_j, both from one pass of the fold",
        lhs="(Mul (Recip (SoftmaxFoldL j n s)) (SoftmaxFoldAcc j n s v))",
        rhs="(OnlineSoftmaxContract j n s v)",
        example=Example(("Mul", ("Recip", ("SoftmaxFoldL", "j:7", 7, s)), ("SoftmaxFoldAcc", "j:7", 7, s, v))),
    ),
    Rule(
        "flash-attention",
        "Σ_j softmax_j(c·Σ_d q·k)·v_j = FlashAttention(q, k, v, c)",
        lhs="(OnlineSoftmaxContract j n (Mul (Contract d nd q k) (Num c)) v)",
        rhs="(FlashAttention j n d nd q k v c (NoMask))",
        example=Example(("OnlineSoftmaxContract", "j:7", 7, scores, v)),
    ),
    Rule(
        "flash-attention-causal",
        "Σ_j softmax_j(where(i < j, −∞, c·Σ_d q·k))·v_j = FlashAttention(q, k, v, c, causal on i)",
        lhs=(
            "(OnlineSoftmaxContract j n (Where (Lt (Iota iq) (Iota (Ax j))) (Num -inf) "
            "(Mul (Contract d nd q k) (Num c))) v)"
        ),
        rhs="(FlashAttention j n d nd q k v c (CausalMask iq))",
        example=Example(("OnlineSoftmaxContract", "j:7", 7, causal, v)),
    ),
    finite_causal_mask_rule("softmax-finite-causal-mask", "Σ_j softmax_j({})·v_j", "OnlineSoftmaxContract", scores,
                            " v", (v,)),
    finite_causal_mask_rule("logsumexp-finite-causal-mask", "LSE_j({})", "LogSumExp", scores),
    finite_causal_mask_rule("softmax-finite-causal-fill-bias", "Σ_j softmax_j({})·v_j", "OnlineSoftmaxContract",
                            scores, " v", (v,), spelling="additive-fill"),
    finite_causal_mask_rule("logsumexp-finite-causal-fill-bias", "LSE_j({})", "LogSumExp", scores,
                            spelling="additive-fill"),
    finite_causal_mask_rule("softmax-finite-keys-ahead-fill-bias", "Σ_j softmax_j({})·v_j", "OnlineSoftmaxContract",
                            scores, " v", (v,), spelling="additive-fill", keys_ahead=True),
    finite_causal_mask_rule("logsumexp-finite-keys-ahead-fill-bias", "LSE_j({})", "LogSumExp", scores,
                            spelling="additive-fill", keys_ahead=True),
    finite_causal_mask_rule("softmax-finite-causal-where", "Σ_j softmax_j({})·v_j", "OnlineSoftmaxContract",
                            scores, " v", (v,), spelling="fill"),
    finite_causal_mask_rule("logsumexp-finite-causal-where", "LSE_j({})", "LogSumExp", scores, spelling="fill"),
    finite_causal_mask_rule("softmax-finite-causal-window", "Σ_j softmax_j({})·v_j", "OnlineSoftmaxContract",
                            scores, " v", (v,), spelling="additive-window"),
    finite_causal_mask_rule("logsumexp-finite-causal-window", "LSE_j({})", "LogSumExp", scores,
                            spelling="additive-window"),
    finite_causal_mask_rule("softmax-finite-causal-fill-window", "Σ_j softmax_j({})·v_j", "OnlineSoftmaxContract",
                            scores, " v", (v,), spelling="fill-window"),
    finite_causal_mask_rule("logsumexp-finite-causal-fill-window", "LSE_j({})", "LogSumExp", scores,
                            spelling="fill-window"),
    finite_causal_mask_rule("softmax-finite-causal-clamped", "Σ_j softmax_j({})·v_j", "OnlineSoftmaxContract",
                            scores, " v", (v,), spelling="clamped"),
    finite_causal_mask_rule("logsumexp-finite-causal-clamped", "LSE_j({})", "LogSumExp", scores, spelling="clamped"),
    # MPT attending with its KV cache: its masked_fill aligned to the last key
    finite_causal_mask_rule("softmax-finite-keys-ahead-where", "Σ_j softmax_j({})·v_j", "OnlineSoftmaxContract",
                            scores, " v", (v,), spelling="fill", keys_ahead=True),
    finite_causal_mask_rule("logsumexp-finite-keys-ahead-where", "LSE_j({})", "LogSumExp", scores, spelling="fill",
                            keys_ahead=True),
    # XGLM attending with its KV cache: the clamped mask aligned to the last key
    finite_causal_mask_rule("softmax-finite-keys-ahead-clamped", "Σ_j softmax_j({})·v_j", "OnlineSoftmaxContract",
                            scores, " v", (v,), spelling="clamped", keys_ahead=True),
    finite_causal_mask_rule("logsumexp-finite-keys-ahead-clamped", "LSE_j({})", "LogSumExp", scores,
                            spelling="clamped", keys_ahead=True),
    # XGLM decoding one token: its causal mask folded away, the clamp of the scores at bf16's lowest stays
    *_clamped_floor_rules(),
    *_flash_rules(),
    Rule(
        "online-softmax-safe-rows",
        "where(max_j s > −∞, Σ_j softmax_j(s)·v_j, 0) = Σ_j softmax_j(s)·v_j: the fold gives 0 for a row "
        "without a live score",
        lhs="(Where (Lt (Num -inf) (Max j n s)) (OnlineSoftmaxContract j n s v) (Num 0.0))",
        rhs="(OnlineSoftmaxContract j n s v)",
        example=Example(("Where", ("Lt", ("Num", -math.inf), ("Max", "j:7", 7, dead_row)),
                         ("OnlineSoftmaxContract", "j:7", 7, dead_row, v), ("Num", 0.0))),
    ),
    Rule(
        "online-softmax-shift",
        "Σ_j softmax_j(s − c)·v_j = Σ_j softmax_j(s)·v_j when c does not depend on j (scores shifted by their "
        "row's max before a softmax that shifts them again)",
        lhs="(OnlineSoftmaxContract j n (Add s (Neg c)) v)",
        rhs="(OnlineSoftmaxContract j n s v)",
        where=("(= axes-c (axes c))", "(set-not-contains axes-c j)"),
        example=Example(("OnlineSoftmaxContract", "j:7", 7, ("Add", s, ("Neg", ("Max", "j:7", 7, s))), v)),
    ),
    Rule(
        "logsumexp-shift",
        "LSE_j(s − c) = LSE_j(s) − c when c does not depend on j",
        lhs="(LogSumExp j n (Add s (Neg c)))",
        rhs="(Add (LogSumExp j n s) (Neg c))",
        where=("(= axes-c (axes c))", "(set-not-contains axes-c j)"),
        example=Example(("LogSumExp", "j:7", 7, ("Add", s, ("Neg", tensor("c", "i:3"))))),
    ),
    Rule(
        "logsumexp-fold",
        "max_j s + log2(L_j(s))·ln 2 = LSE_j(s): the fold's max and sum are the row's log-sum-exp",
        lhs=f"(Add (Max j n s) (Mul (Log2 (SoftmaxFoldL j n s)) (Num {LN2!r})))",
        rhs="(LogSumExp j n s)",
        example=Example(("Add", ("Max", "j:7", 7, s), ("Mul", ("Log2", ("SoftmaxFoldL", "j:7", 7, s)), ("Num", LN2)))),
    ),
    *_attention_lse_rules(),
    Rule(
        "flash-split-kv",
        "FlashAttention(q, k, v) = ⊕_chunks FlashAttention(q, k_chunk, v_chunk): the fold over j is a fold "
        "of per-chunk partial states (m, l, acc)",
        lhs="(FlashAttention j n d nd q k v c m)",
        rhs="(FlashAttentionSplitKv j n d nd q k v c m)",
        example=Example(("FlashAttention", "j:7", 7, "d:4", 4, q, k, v, 0.5, ("NoMask",))),
    ),
)

STREAMING = Ruleset("streaming", __doc__.splitlines()[0], RULES)
