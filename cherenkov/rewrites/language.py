"""The egglog language: sorts, constructors with extraction costs, and the axes analysis.

Every tensor expression is written in index notation: ``Tensor("q", [Ax b, Ax h, Ax i,
Ax d])`` is the element ``q[b,h,i,d]``; ``Sum(j, n, body)`` sums ``body`` over the axis
named ``j`` of extent ``n``. Derived forms (``Contract``, the online-softmax fold,
``FlashAttention``, the row kernels) are constructors whose costs make extraction prefer
them. ``axes(e)`` is the set of axis names an e-class varies along; rules use it as a
guard ("does not depend on ``j``"). Its merge is intersection: if any equal form is
independent of an axis, the value is.
"""

from __future__ import annotations

from dataclasses import dataclass

Signature = tuple[str, ...]


@dataclass(frozen=True)
class Constructor:
    """One e-graph constructor: argument sorts, extraction cost, and its binders.

    ``binds`` pairs the position of a String argument naming a bound axis with the
    positions of the operands it scopes over (the axis is removed from their axes).
    """

    name: str
    args: Signature
    cost: int
    binds: tuple[tuple[int, tuple[int, ...]], ...] = ()

    def bound_over(self, operand: int) -> tuple[int, ...]:
        """Positions of the axis-name arguments bound over one operand."""
        return tuple(name for name, scope in self.binds if operand in scope)


EXPR_CONSTRUCTORS: tuple[Constructor, ...] = (
    Constructor("Tensor", ("String", "IxList"), 1),
    Constructor("Num", ("f64",), 1),
    Constructor("Flag", ("bool",), 1),
    Constructor("Iota", ("Ix",), 1),
    Constructor("Cast", ("String", "Expr"), 2),
    *(Constructor(op, ("Expr",), 2) for op in ("Exp2", "Exp", "Log2", "Sin", "Sqrt", "Recip", "Neg")),
    *(Constructor(op, ("Expr", "Expr"), 2) for op in ("Add", "Mul", "Mod", "Lt", "Maximum")),
    Constructor("Where", ("Expr", "Expr", "Expr"), 2),
    # tanh(x), recognised in its exponential spelling for the soft-capped attention rules; no kernel
    # computes it as an element (its cost keeps it out of extraction: the spelling it came from stays)
    Constructor("Tanh", ("Expr",), 1000),
    Constructor("PadAxis", ("Ix", "i64", "i64", "f64", "Expr"), 2),
    Constructor("Sum", ("String", "i64", "Expr"), 20, binds=((0, (2,)),)),
    Constructor("Max", ("String", "i64", "Expr"), 20, binds=((0, (2,)),)),
    Constructor("Contract", ("String", "i64", "Expr", "Expr"), 15, binds=((0, (2, 3)),)),
    Constructor("SoftmaxFoldL", ("String", "i64", "Expr"), 12, binds=((0, (2,)),)),
    Constructor("SoftmaxFoldAcc", ("String", "i64", "Expr", "Expr"), 12, binds=((0, (2, 3)),)),
    Constructor("OnlineSoftmaxContract", ("String", "i64", "Expr", "Expr"), 10, binds=((0, (2, 3)),)),
    # key axis j (0) over q, k, v and the mask; head axis d (2) over q and k only
    Constructor(
        "FlashAttention",
        ("String", "i64", "String", "i64", "Expr", "Expr", "Expr", "f64", "Mask"),
        5,
        binds=((0, (4, 5, 6, 8)), (2, (4, 5))),
    ),
    # the same attention as a fold of per-split partial states (never extracted: costs more)
    Constructor(
        "FlashAttentionSplitKv",
        ("String", "i64", "String", "i64", "Expr", "Expr", "Expr", "f64", "Mask"),
        6,
        binds=((0, (4, 5, 6, 8)), (2, (4, 5))),
    ),
    # g·Σ_j softmax_j(c·f_q·f_k·Σ_d q·k [mask])·v_j: attention whose scores carry the factors f_q, f_k
    # (of the operands in positions 4 and 5) and whose output a factor g, none varying along j or d
    # (the descales of 8-bit q, k and v)
    Constructor(
        "FlashAttentionScaled",
        ("String", "i64", "String", "i64", "Expr", "Expr", "Expr", "f64", "Mask", "Expr", "Expr", "Expr"),
        # its three factors cost 2 each (a Num or a per-tensor read) where FlashAttention's v·s costs 4:
        # at 2 the form is the cheaper spelling once v's factor has moved (MX q and k keep theirs)
        2,
        binds=((0, (4, 5, 6, 8)), (2, (4, 5))),
    ),
    # log Σ_j e^{s_j}: the row statistic a backward pass recomputes probabilities from (no kernel computes
    # it alone: its cost keeps it out of extraction where the fold's max_j s + ln L_j(s) spells it)
    Constructor("LogSumExp", ("String", "i64", "Expr"), 1000, binds=((0, (2,)),)),
    # log Σ_j e^{s_j} of attention's scores s = c·Σ_d q·k [mask]: the statistic a forward pass saves for its
    # backward (the parts as FlashAttention's, without v)
    Constructor(
        "AttentionLse",
        ("String", "i64", "String", "i64", "Expr", "Expr", "f64", "Mask"),
        4,
        binds=((0, (4, 5, 7)), (2, (4, 5))),
    ),
    # attention's score gradient dS_ij = P_ij·(Σ_e do_ie v_je − Σ_e do_ie o_ie), P from q, k, c and
    # the mask, o its attention output; key axis j free, d bound over q and k, e over v and do.
    # An S×S intermediate of the backward forms, never a kernel of its own (its cost keeps it out).
    Constructor(
        "AttentionDs",
        ("String", "i64", "String", "i64", "String", "i64", "Expr", "Expr", "Expr", "Expr", "f64", "Mask"),
        1000,
        binds=((2, (6, 7)), (4, (8, 9))),
    ),
    # the flash-attention backward's streaming contractions: dq = c·Σ_j dS·k2, dk = c·Σ_i dS·q2,
    # dv = Σ_i P·do2 (k2, q2, do2: the operand read again with its own head axis); q and k may come
    # in either order (the contraction is symmetric), so each binder covers both
    Constructor(
        "FlashAttentionGradQ",
        ("String", "i64", "String", "i64", "String", "i64", "Expr", "Expr", "Expr", "Expr", "f64", "Mask", "Expr"),
        3,
        binds=((0, (6, 7, 8, 11, 12)), (2, (6, 7)), (4, (8, 9))),
    ),
    Constructor(
        "FlashAttentionGradK",
        ("String", "i64", "String", "i64", "String", "i64", "String", "i64", "Expr", "Expr", "Expr", "Expr", "f64",
         "Mask", "Expr"),
        3,
        binds=((0, (8, 9, 11, 13, 14)), (4, (8, 9)), (6, (10, 11))),
    ),
    Constructor(
        "FlashAttentionGradV",
        ("String", "i64", "String", "i64", "String", "i64", "Expr", "Expr", "f64", "Mask", "Expr"),
        3,
        binds=((0, (6, 7, 9, 10)), (4, (6, 7))),
    ),
    # dk and dv of a K/V head shared by a group of query heads: the sum over the group axis g of
    # the per-query-head forms (g names the query head within the group)
    Constructor(
        "FlashAttentionGradKGroup",
        ("String", "i64", "String", "i64", "String", "i64", "String", "i64", "String", "i64", "Expr", "Expr", "Expr",
         "Expr", "f64", "Mask", "Expr"),
        3,
        binds=((0, (10, 11, 13, 15, 16)), (2, (10, 11, 13, 15, 16)), (6, (10, 11)), (8, (12, 13))),
    ),
    Constructor(
        "FlashAttentionGradVGroup",
        ("String", "i64", "String", "i64", "String", "i64", "String", "i64", "Expr", "Expr", "f64", "Mask", "Expr"),
        3,
        binds=((0, (8, 9, 11, 12)), (2, (8, 9, 11, 12)), (6, (8, 9))),
    ),
    Constructor("SoftmaxRow", ("String", "i64", "Expr"), 10),
    Constructor("RmsNormRow", ("String", "i64", "Expr", "f64"), 10),
    Constructor("LayerNormRow", ("String", "i64", "Expr", "f64"), 10),
)

IX_CONSTRUCTORS: tuple[Constructor, ...] = (
    Constructor("Ax", ("String",), 0),
    Constructor("IxLit", ("i64",), 0),
    Constructor("IxAdd", ("Ix", "i64"), 0),
    Constructor("IxDiv", ("Ix", "i64"), 0),
    Constructor("IxMod", ("Ix", "i64"), 0),
    Constructor("IxLin", ("Ix", "i64", "Ix"), 0),
)

SORTS: dict[str, tuple[Constructor, ...]] = {
    "Ix": IX_CONSTRUCTORS,
    "IxList": (Constructor("INil", (), 0), Constructor("ICons", ("Ix", "IxList"), 0)),
    "Expr": EXPR_CONSTRUCTORS,
    # a flash-attention mask: none, causal on a query axis, scores plus a bias, both (a bias, then
    # causal); or the scores soft-capped at c (c·tanh(s/c), Gemma 2's logit cap) before an inner mask
    "Mask": (Constructor("NoMask", (), 0), Constructor("CausalMask", ("Ix",), 0), Constructor("BiasMask", ("Expr",), 0),
             Constructor("CausalBiasMask", ("Ix", "Expr"), 0), Constructor("SoftcapMask", ("f64", "Mask"), 0)),
    "Schedule": (
        Constructor(
            "FlashSchedule",
            ("i64", "i64", "i64", "i64", "bool", "bool", "i64", "bool", "bool", "bool", "bool", "i64", "bool", "bool", "bool",
             "bool", "bool", "bool", "i64", "bool", "bool"),
            0,
        ),
        Constructor("HopperSchedule", ("i64", "i64", "i64", "bool", "bool", "i64", "bool", "bool", "bool", "bool"), 0),
        Constructor("Fp8Schedule", ("i64", "i64", "i64"), 0),
    ),
    "Plan": (Constructor("Scheduled", ("Expr", "Schedule"), 0),),
}

# Sorts that refer to each other (an Expr holds a Mask, a Mask an Expr): declared together.
MUTUAL_SORTS = ("Expr", "Mask")

# The axes function of each sort that has one.
AXES_FUNCTION = {"Expr": "axes", "Ix": "ixaxes", "IxList": "listaxes", "Mask": "maskaxes"}

KERNEL_CONSTRUCTORS = frozenset(
    {"FlashAttention", "FlashAttentionScaled", "SoftmaxRow", "RmsNormRow", "LayerNormRow", "OnlineSoftmaxContract", "Contract"}
)


def declarations() -> str:
    """Sort, constructor, relation and analysis-function declarations."""
    lines = ["(sort StrSet (Set String))"]

    def variants(constructors: tuple[Constructor, ...]) -> str:
        return " ".join(f"({c.name}{''.join(' ' + a for a in c.args)} :cost {c.cost})" for c in constructors)

    for sort, constructors in SORTS.items():
        if sort == MUTUAL_SORTS[0]:
            lines.append(f"(datatype* {' '.join(f'({name} {variants(SORTS[name])})' for name in MUTUAL_SORTS)})")
        elif sort not in MUTUAL_SORTS:
            lines.append(f"(datatype {sort} {variants(constructors)})")
    for sort, function in AXES_FUNCTION.items():
        lines.append(f"(function {function} ({sort}) StrSet :merge (set-intersect old new))")
    # the graph inputs stored in 8 bits (the scale rules move only their factors)
    lines.append("(relation EightBit (String))")
    for schedule in SORTS["Schedule"]:
        lines.append(f"(relation {schedule.name}Fits (i64 {' '.join(schedule.args)}))")
    # the Hopper schedules an 8-bit form fits (the e4m3 variant has its own limits)
    hopper = next(c for c in SORTS["Schedule"] if c.name == "HopperSchedule")
    lines.append(f"(relation HopperFp8ScheduleFits (i64 {' '.join(hopper.args)}))")
    lines.append("(ruleset analysis)")
    return "\n".join(lines)


def _axes_rule(sort: str, constructor: Constructor) -> str:
    variables = [f"x{i}" for i in range(len(constructor.args))]
    pattern = f"({constructor.name}{''.join(' ' + v for v in variables)})"
    facts = [f"(= e {pattern})"]
    operand_sets = []
    for position, (var, arg) in enumerate(zip(variables, constructor.args)):
        if arg in AXES_FUNCTION:
            facts.append(f"(= s{var} ({AXES_FUNCTION[arg]} {var}))")
            operand = f"s{var}"
            for bound in constructor.bound_over(position):
                operand = f"(set-remove {operand} {variables[bound]})"
            operand_sets.append(operand)
    if constructor.name == "Ax":
        result = "(set-of x0)"
    elif not operand_sets:
        result = "(set-empty)"
    else:
        result = operand_sets[0]
        for other in operand_sets[1:]:
            result = f"(set-union {result} {other})"
    name = f"axes-{constructor.name}"
    return f'(rule ({" ".join(facts)}) ((set ({AXES_FUNCTION[sort]} e) {result})) :ruleset analysis :name "{name}")'


def analysis_rules() -> str:
    """One rule per constructor computing the axes its e-class varies along."""
    return "\n".join(
        _axes_rule(sort, c) for sort, constructors in SORTS.items() if sort in AXES_FUNCTION for c in constructors
    )


def prelude() -> str:
    """Everything a derivation program starts with."""
    return declarations() + "\n" + analysis_rules()
