"""Masks: every spelling of a mask becomes ``where(condition, −∞, scores)``.

``k_idx <= q_idx`` arrives as ``where(q_idx < k_idx, false, true)``; an additive mask is
``scores + where(c, −∞, 0)``; a scale may follow the mask. Causal masks then match the
flash-attention rule, which turns them into its causal flag. Broadcast K/V heads (GQA)
need no rule: at the border they already index K/V with ``h // group``. A "safe" softmax
(PyTorch's for a mask tensor: 0 for a row whose every score is masked) is
``where(max_j s > −∞, softmax_j(s), 0)``; its ``where`` moves out of the product with ``v``
and out of the sum over keys, where the streaming rules meet it. A sliding window's mask has
a second edge, ``j < i + w``: its bool spelling splits into one condition at a time, and its
lower edge becomes a bias added under the causal mask, which flash attention reads stored.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from cherenkov.rewrites.casts import HALF_ROUNDING
from cherenkov.rewrites.rule import Example, Rule, Ruleset
from cherenkov.rewrites.terms import Term, ax, extent, mask_bias, replace, tensor

s = tensor("s", "i:3", "j:4")
t = tensor("t", "i:3", "j:4")
condition = ("Lt", ("Iota", ax("i:3")), ("Iota", ax("j:4")))
row_condition = ("Lt", ("Iota", ax("i:3")), ("Num", 1.0))  # false for row 0 only

EXAMPLE_CAUSAL = ("Lt", ("Iota", ax("i:3")), ("Iota", ax("j:7")))
EXAMPLE_KEYS_AHEAD = ("Lt", ("Add", ("Iota", ax("i:3")), ("Num", 4.0)), ("Iota", ax("j:7")))
"""The causal condition of the examples (``i:3``, ``j:7``), and the one aligned to the last key (4 keys ahead)."""


FINITE_CAUSAL = ("Where", EXAMPLE_CAUSAL, ("Num", -65536.0), ("Num", 0.0))
"""An example of the additive causal mask transformers and PyTorch's cuDNN path build: a finite
minimum, not −∞."""


WINDOW_LOWER = "(Lt (Iota (Ax j)) (Add (Iota iq) (Num w)))"
"""A sliding window's lower edge, ``j < i + w`` (``w`` ≤ 0: the keys more than ``−w`` before the query), as the
capture spells a band's."""
KEYS_AHEAD = "(Lt (Add (Iota iq) (Num o)) (Iota (Ax j)))"
"""The keys more than ``o`` after query ``i`` masked, ``i + o < j``: a window's upper edge, and alone a causal mask
aligned to the last key (``o = S_kv − S_q``: a chunk of queries after ``o`` cached keys)."""
WINDOW_EDGE = ("Lt", ("Iota", ax("j:7")), ("Add", ("Iota", ax("i:3")), ("Num", -1.0)))
"""An example of it over the examples' ``i:3, j:7``: keys ``j < i − 1``."""


def sliding_window(mask: Term) -> tuple[int, int] | None:
    """``(W, ahead)`` of a flash-attention mask (after any soft cap) that is a sliding window: the
    causal mask plus the window's lower edge ``where(j < i + w, m, 0)`` (query ``i`` sees keys
    ``i − W < j ≤ i``, ``W = 1 − w``, ahead 0: the ``-band`` bias form), or a bias that is a window
    about the query, ``where(i + o < j, m, where(j < i + w, m₂, 0))`` (keys ``i − W < j ≤ i + o``,
    ahead ``o``: ``-band2``), or that upper edge alone, ``where(i + o < j, m, 0)`` (a causal mask aligned to
    the last of more keys: ``-ahead``, a window of as many keys as there are queries and keys, so that no
    key is cut behind), that edge added to a stored bias (``-beside-ahead``: the window, the kernel reading the
    stored bias, :func:`stored_bias`); ``w ≤ 0`` and ``o ≥ 0`` whole, ``m, m₂ ≤ −2¹³`` (the masked scores'
    exponentials underflow as the causal ones do), a lower edge over at least two queries and no more
    queries than keys (every row sees its own key). None for any other mask. A kernel applies such a
    window itself, skipping the key tiles outside it, where any other bias is a tensor it reads."""
    if mask[0] == "CausalBiasMask":
        window = _lower_edge(mask[2], mask[1])
        return None if window is None else (window, 0)
    if mask[0] != "BiasMask":
        return None
    return _band_window(mask[1]) or _band_window(_band_beside_bias(mask[1])[0])


def _band_window(bias: Term) -> tuple[int, int] | None:
    """``(W, ahead)`` of a bias that is a window about the query (the ``-band2`` and ``-ahead`` forms), else None."""
    match bias:
        case ("Where", ("Lt", ("Add", ("Iota", query), ("Num", o)), ("Iota", ("Ax", key))), ("Num", m), ("Num", 0.0)):
            # keys at most o ahead and none cut behind: a window over every key (i − W < 0 ≤ j for each row i)
            rows = extent(query[1]) if query[0] == "Ax" else 0
            if rows and float(o).is_integer() and o >= 0 and m <= MASK_FLOOR:
                return rows + extent(key), int(o)
        case ("Where", ("Lt", ("Add", ("Iota", query), ("Num", o)), ("Iota", ("Ax", _))), ("Num", m), lower):
            window = _lower_edge(lower, query)
            if window is not None and float(o).is_integer() and o >= 0 and m <= MASK_FLOOR:
                return window, int(o)
    return None


def _band_beside_bias(bias: Term) -> tuple[Term, Term | None]:
    """A bias that adds a stored one to the band of a causal mask aligned to the last key, ``b₁ + where(i + o <
    j, m, 0)`` (either order; ALiBi beside a KV cache's mask), or that fills it, ``where(i + o < j, m, b₁)`` (the same
    under the window the band is, rule ``additive-mask``'s spelling): ``(band, b₁)``; any other bias: ``(bias, None)``."""
    if bias[0] == "Where" and bias[3] != ("Num", 0.0):
        band = ("Where", bias[1], bias[2], ("Num", 0.0))
        if _band_window(band) is not None:
            return band, bias[3]
    if bias[0] == "Add":
        for band, rest in ((bias[2], bias[1]), (bias[1], bias[2])):
            if band[0] == "Where" and band[3] == ("Num", 0.0) and _band_window(band) is not None:
                return band, rest
    return bias, None


def window_parts(mask: Term) -> tuple[Term | None, Term | None]:
    """A mask's bias (after any soft cap) as ``(window, stored)``: the term its :func:`sliding_window` is, which the
    kernel bounds its key range by (None: no window), and the bias the kernel reads (None: none) — the window's
    stored neighbour ``b₁`` where a band is added to one, else the mask's whole bias where it is no window."""
    bias = mask_bias(mask)
    if bias is None or sliding_window(mask) is None:
        return None, bias
    if mask[0] == "CausalBiasMask" or _band_window(bias) is not None:
        return bias, None
    return _band_beside_bias(bias)


def stored_bias(mask: Term) -> Term | None:
    """The bias a flash kernel reads of a mask (:func:`window_parts`)."""
    return window_parts(mask)[1]


def with_stored_bias(mask: Term, stored: Term) -> Term:
    """``mask`` with the bias a kernel reads (:func:`stored_bias`) replaced by ``stored``, any window's band kept."""
    if mask[0] == "CausalBiasMask":
        return ("CausalBiasMask", mask[1], stored)
    band = window_parts(mask)[0]
    return ("BiasMask", stored if band is None else ("Add", stored, band))


def _lower_edge(bias: Term, query: Term) -> int | None:
    """``W`` of a window's lower edge ``where(j < i + w, m, 0)`` over the query axis ``query`` (``w ≤ 0``
    whole, ``m ≤ −2¹³``; 2 to as many queries as keys), else None."""
    match bias:
        case ("Where", ("Lt", ("Iota", ("Ax", key)), ("Add", ("Iota", q), ("Num", w))), ("Num", m), ("Num", 0.0)):
            pass
        case ("Where", ("Lt", ("Iota", ("Ax", key)), ("Iota", q)), ("Num", m), ("Num", 0.0)):
            w = 0.0  # `i + 0` folded to `i` (``add-zero``): a full sliding KV cache's window, one key behind
        case _:
            return None
    rows = extent(q[1]) if q == query and q[0] == "Ax" else 0
    if 1 < rows <= extent(key) and float(w).is_integer() and w <= 0 and m <= MASK_FLOOR:
        return 1 - int(w)
    return None


@dataclass(frozen=True)
class FiniteCausalSpelling:
    """One way a finite causal mask (minimum ``m``) reaches the scores ``s``: as text, as the
    pattern (``{causal}``: the condition ``i < j``), the example built from unmasked scores,
    why the masked exponentials underflow, the ``facts`` its other variables need, the
    ``tolerance`` of the identity (a spelling that rounds the scores states that rounding), and
    what the causal mask keeps of the scores (``kept``: ``s``, or ``s`` plus a window's edge)."""

    text: str
    pattern: str
    example: Callable[[Term], Term]
    underflow: str
    facts: tuple[str, ...] = ()
    tolerance: float = 1e-9
    kept: tuple[str, str] = ("s", "s")  # as text, as the pattern under the causal where


MASK_FLOOR = -8192.0
"""The largest finite value a mask may fill or add and still mask (−2¹³): ``e^{m − max}`` underflows to 0
while the scores lie above ``m + 104``, 8088 of room (GPT-1 fills −10⁴, transformers bf16's lowest)."""
UNDER_FLOOR_M = f"(<= m {MASK_FLOOR})"
UNDER_FLOOR_M2 = f"(<= m2 {MASK_FLOOR})"
"""The facts a rule's mask value ``m`` (``m2``) states: at most :data:`MASK_FLOOR`."""

BF16_LOWEST = -3.3895313892515355e38
"""``torch.finfo(torch.bfloat16).min``: the floor XGLM's attention clamps its masked scores to."""


FINITE_CAUSAL_SPELLINGS = {
    "additive": FiniteCausalSpelling(
        "s + where(i < j, m, 0)", "(Add s (Where {causal} (Num m) (Num 0.0)))",
        lambda scores: ("Add", scores, FINITE_CAUSAL),
        "e^(m + s_j − max) underflows to 0 wherever the scores span less than |m| − 104"),
    # a causal mask filled into a bias added to the scores (Doge's dynamic mask: where(i < j, m, b))
    "additive-fill": FiniteCausalSpelling(
        "s + where(i < j, m, b)", "(Add s (Where {causal} (Num m) b1))",
        lambda scores: ("Add", scores, ("Where", FINITE_CAUSAL[1], FINITE_CAUSAL[2], tensor("bias", "i:3", "j:7"))),
        "e^(m + s_j − max) underflows to 0 wherever the scores and the bias span less than |m| − 104",
        kept=("s + b", "(Add s b1)")),
    # a causal masked_fill of the scores (MPT's)
    "fill": FiniteCausalSpelling(
        "where(i < j, m, s)", "(Where {causal} (Num m) s)",
        lambda scores: ("Where", FINITE_CAUSAL[1], FINITE_CAUSAL[2], scores),
        "e^(m − max) underflows to 0 wherever the scores lie above m + 104"),
    # a sliding window's additive mask (transformers' minimum): the causal edge and the window's lower one
    "additive-window": FiniteCausalSpelling(
        "s + where(i < j, m, where(j < i + w, m₂, 0))",
        f"(Add s (Where {{causal}} (Num m) (Where {WINDOW_LOWER} (Num m2) (Num 0.0))))",
        lambda scores: ("Add", scores, ("Where", FINITE_CAUSAL[1], FINITE_CAUSAL[2],
                                        ("Where", WINDOW_EDGE, ("Num", -65536.0), ("Num", 0.0)))),
        "e^(m + s_j − max) underflows to 0 wherever the scores span less than |m| − 104",
        (UNDER_FLOOR_M2,), kept=("s + where(j < i + w, m₂, 0)", f"(Add s (Where {WINDOW_LOWER} (Num m2) (Num 0.0)))")),
    # a sliding window's bool mask filling the scores (GPT-Neo's local layers: where(band, s, m)), one edge at a time
    "fill-window": FiniteCausalSpelling(
        "where(i < j, m, where(j < i + w, m₂, s))",
        f"(Where {{causal}} (Num m) (Where {WINDOW_LOWER} (Num m2) s))",
        lambda scores: ("Where", FINITE_CAUSAL[1], FINITE_CAUSAL[2], ("Where", WINDOW_EDGE, ("Num", -65536.0), scores)),
        "e^(m − max) underflows to 0 wherever the scores lie above m + 104, and e^(m₂ − max) and e^(m₂ + s_j − max) "
        "wherever they span less than |m₂| − 104",
        (UNDER_FLOOR_M2,), kept=("s + where(j < i + w, m₂, 0)", f"(Add s (Where {WINDOW_LOWER} (Num m2) (Num 0.0)))")),
    # XGLM's: the masked scores clamped from below at a floor m₂, computed in fp32 and rounded back
    "clamped": FiniteCausalSpelling(
        "round(max(s + where(i < j, m, 0), m₂))", "(Cast dt (Maximum (Add s (Where {causal} (Num m) (Num 0.0))) (Num m2)))",
        lambda scores: ("Cast", "bf16", ("Maximum", ("Add", scores, FINITE_CAUSAL), ("Num", BF16_LOWEST))),
        "the floor m₂ ≤ −2¹³ moves only scores whose exponentials underflow to 0 either way, and the rounding is "
        "that of 16-bit scores (exact where a 16-bit product made them)",
        (UNDER_FLOOR_M2, '(!= dt "int32")', '(!= dt "bool")'), HALF_ROUNDING),
}


def finite_causal_mask_rule(name: str, spelled: str, head: str, scores: Term, after: str = "",
                            example_after: tuple[Term, ...] = (), spelling: str = "additive",
                            keys_ahead: bool = False) -> Rule:  # fmt: skip
    """``head_j(mask(s), …) = head_j(where(i < j, −∞, s), …)`` for a finite causal ``mask`` of
    minimum ``m ≤ −2¹³`` spelled as one of :data:`FINITE_CAUSAL_SPELLINGS`, where ``head``
    (spelled ``spelled``, ``{}`` its scores) folds the row's exponentials: the masked ones
    underflow to 0. ``after``: the arguments after the scores (``example_after`` in the
    example, whose unmasked scores are ``scores``). ``keys_ahead``: the mask aligned to the last
    key instead, ``i + o < j`` for whole ``o ≥ 0`` (a chunk of queries after a KV cache)."""
    form = FINITE_CAUSAL_SPELLINGS[spelling]
    causal, text = (KEYS_AHEAD, "i + o < j") if keys_ahead else ("(Lt (Iota iq) (Iota (Ax j)))", "i < j")
    example = form.example(scores)
    if keys_ahead:
        example = replace(example, EXAMPLE_CAUSAL, EXAMPLE_KEYS_AHEAD)
    return Rule(
        name,
        f"{spelled.format(form.text.replace('i < j', text))} = "
        f"{spelled.format(f'where({text}, −∞, {form.kept[0]})')} for m ≤ −2¹³: each row keeps j = 0, and "
        f"{form.underflow}",
        lhs=f"({head} j n {form.pattern.format(causal=causal)}{after})",
        rhs=f"({head} j n (Where {causal} (Num -inf) {form.kept[1]}){after})",
        where=(UNDER_FLOOR_M, *(("(>= o 0.0)",) if keys_ahead else ()), *form.facts),
        example=Example((head, "j:7", 7, example, *example_after)),
        tolerance=form.tolerance,
    )


RULES = (
    Rule(
        "where-not",
        "where(where(c, false, true), a, b) = where(c, b, a)",
        lhs="(Where (Where c (Flag false) (Flag true)) a b)",
        rhs="(Where c b a)",
        example=Example(("Where", ("Where", condition, ("Flag", False), ("Flag", True)), s, t)),
    ),
    Rule(
        "where-false",
        "where(false, a, b) = b: a mask whose condition folded to false (a decoded token's causal mask aligned to "
        "the last key, i + o < j with i = 0 and o = S_kv − 1, hides nothing)",
        lhs="(Where (Flag false) a b)",
        rhs="b",
        example=Example(("Where", ("Flag", False), s, t)),
    ),
    Rule(
        "where-false-branch",
        "where(where(c, false, x), a, b) = where(c, b, where(x, a, b)): a band's two edges (a sliding window's "
        "bool mask) one condition at a time",
        lhs="(Where (Where c (Flag false) x) a b)",
        rhs="(Where c b (Where x a b))",
        example=Example(("Where", ("Where", condition, ("Flag", False), ("Lt", ("Iota", ax("j:4")), ("Num", 2.0))), s, t)),
    ),
    Rule(
        "where-same-condition",
        "where(c, a, where(c, b, d)) = where(c, a, d): the inner where is read only where c is false",
        lhs="(Where c a (Where c b d))",
        rhs="(Where c a d)",
        example=Example(("Where", condition, s, ("Where", condition, t, ("Neg", s)))),
    ),
    Rule(
        "window-edge-additive",
        "where(j < i + w, −∞, s) = s + where(j < i + w, −∞, 0): a sliding window's lower edge as an added bias",
        lhs=f"(Where {WINDOW_LOWER} (Num -inf) s)",
        rhs=f"(Add s (Where {WINDOW_LOWER} (Num -inf) (Num 0.0)))",
        example=Example(("Where", ("Lt", ("Iota", ax("j:4")), ("Add", ("Iota", ax("i:3")), ("Num", -1.0))),
                         ("Num", -math.inf), s)),
    ),
    Rule(
        "keys-ahead-additive",
        "where(i + o < j, −∞, s) = s + where(i + o < j, −∞, 0): a causal mask aligned to the last of more keys "
        "(query i sees keys j ≤ i + o, a chunk of queries after o cached keys) as an added bias",
        lhs=f"(Where {KEYS_AHEAD} (Num -inf) s)",
        rhs=f"(Add s (Where {KEYS_AHEAD} (Num -inf) (Num 0.0)))",
        example=Example(("Where", ("Lt", ("Add", ("Iota", ax("i:3")), ("Num", 4.0)), ("Iota", ax("j:4"))),
                         ("Num", -math.inf), s)),
    ),
    Rule(
        "keys-ahead-beside-bias",
        "(a + c·Σ_d q·k) + where(i + o < j, m, 0) = c·Σ_d q·k + (a + where(i + o < j, m, 0)): a bias a added to "
        "attention's scores (ALiBi's) joins the band of a causal mask aligned to the last key",
        lhs=f"(Add (Add a (Mul (Contract d nd q k) (Num c))) (Where {KEYS_AHEAD} (Num m) (Num 0.0)))",
        rhs=f"(Add (Mul (Contract d nd q k) (Num c)) (Add a (Where {KEYS_AHEAD} (Num m) (Num 0.0))))",
        where=("(= axes-a (axes a))", "(set-not-contains axes-a d)"),
        example=Example(("Add", ("Add", tensor("a", "i:3", "j:7"),
                                 ("Mul", ("Contract", "d:4", 4, tensor("q", "i:3", "d:4"), tensor("k", "j:7", "d:4")),
                                  ("Num", 0.5))),
                         ("Where", EXAMPLE_KEYS_AHEAD, ("Num", -65536.0), ("Num", 0.0)))),
    ),
    Rule(
        "additive-mask",
        "s + where(c, −∞, 0) = where(c, −∞, s)",
        lhs="(Add s (Where c (Num -inf) (Num 0.0)))",
        rhs="(Where c (Num -inf) s)",
        example=Example(("Add", s, ("Where", condition, ("Num", -math.inf), ("Num", 0.0)))),
    ),
    Rule(
        "additive-mask-bias",
        "s + where(c, −∞, b) = where(c, −∞, s + b) for finite s: a mask tensor that carries a bias beside its −∞ "
        "(ALiBi's slopes times positions, causally filled) whose axes the scores s all have (not a softmax's "
        "shift −max_j s, which has no key axis)",
        lhs="(Add s (Where c (Num -inf) b))",
        rhs="(Where c (Num -inf) (Add s b))",
        where=("(= axes-s (axes s))", "(= axes-b (axes b))", "(> (set-length axes-b) 0)",
               "(= axes-s (set-union axes-s axes-b))"),
        example=Example(("Add", s, ("Where", condition, ("Num", -math.inf), t))),
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
    Rule(
        "where-zero-factor",
        "where(c, a, 0)·b = where(c, a·b, 0) for a finite b",
        lhs="(Mul (Where c a (Num 0.0)) b)",
        rhs="(Where c (Mul a b) (Num 0.0))",
        example=Example(("Mul", ("Where", condition, s, ("Num", 0.0)), t)),
    ),
    Rule(
        "product-with-band",
        "x·where(c, 0, 1) = where(c, 0, x) for a finite x: scores times a 0/1 band (GPT-1's w·b)",
        lhs="(Mul x (Where c (Num 0.0) (Num 1.0)))",
        rhs="(Where c (Num 0.0) x)",
        example=Example(("Mul", s, ("Where", condition, ("Num", 0.0), ("Num", 1.0)))),
    ),
    Rule(
        "sum-where-invariant",
        "Σ_j where(c, a, 0) = where(c, Σ_j a, 0) when c does not depend on j",
        lhs="(Sum j n (Where c a (Num 0.0)))",
        rhs="(Where c (Sum j n a) (Num 0.0))",
        where=("(= axes-c (axes c))", "(set-not-contains axes-c j)"),
        example=Example(("Sum", "j:4", 4, ("Where", row_condition, s, ("Num", 0.0)))),
    ),
)

MASKS = Ruleset("masks", __doc__.splitlines()[0], RULES)
