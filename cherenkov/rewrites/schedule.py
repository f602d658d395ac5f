"""Schedules: one alternative per valid schedule of each fused kernel form.

A flash-attention e-node gains a ``Scheduled(form, FlashSchedule(...))`` plan for every
schedule the target can hold. The guard is the relation ``FlashScheduleFits``, filled per
target from :func:`cherenkov.rewrites.plan.flash_schedule_problems` (shared-memory and
register budgets), so the e-graph and the code generator share one resource model.
"""

from __future__ import annotations

import itertools

from cherenkov.rewrites.plan import (
    ATTENTION_HEAD_DIMS,
    FLASH_KNOBS,
    AttentionProblem,
    FlashSchedule,
    Target,
    flash_schedule_problems,
)
from cherenkov.rewrites.rule import Rule, Ruleset
from cherenkov.rewrites.terms import literal

KNOB_ORDER = (
    "block_q", "block_kv", "warps", "stages", "kv_split", "swizzle", "ldmatrix_x", "pingpong", "lazy_rescale",
    "head_major", "overlap", "min_blocks",
)
_VARIABLES = " ".join(KNOB_ORDER)

RULES = (
    Rule(
        "flash-schedule",
        "FlashAttention(...) runs under schedule σ when σ fits the target (one plan per σ)",
        lhs="(FlashAttention j n d nd q k v c m)",
        where=(f"(FlashScheduleFits nd {_VARIABLES})",),
        rhs=f"(Scheduled __lhs (FlashSchedule {_VARIABLES}))",
        union=False,
    ),
)

SCHEDULE = Ruleset("schedule", __doc__.splitlines()[0], RULES)


def flash_schedules(head_dim: int, target: Target) -> list[FlashSchedule]:
    """Every schedule of the knob space that a ``head_dim`` problem fits on ``target``.

    A schedule qualifies when it fits a causal or a non-causal probe problem (some knobs,
    such as the head-major grid order, are for causal problems only); the plans of a
    concrete problem are filtered again with that problem (``Derivation.plans``)."""
    probes = [
        AttentionProblem(batch=1, heads=1, kv_heads=1, seq_q=1, seq_kv=1, head_dim=head_dim, causal=causal)
        for causal in (False, True)
    ]
    schedules = []
    for values in itertools.product(*(FLASH_KNOBS[k] for k in KNOB_ORDER)):
        schedule = FlashSchedule(**dict(zip(KNOB_ORDER, values)))
        if any(not flash_schedule_problems(schedule, probe, target) for probe in probes):
            schedules.append(schedule)
    return schedules


def schedule_facts(target: Target) -> str:
    """``FlashScheduleFits`` facts for every supported head dimension on ``target``."""
    lines = []
    for head_dim in ATTENTION_HEAD_DIMS:
        for schedule in flash_schedules(head_dim, target):
            values = " ".join(literal(getattr(schedule, knob)) for knob in KNOB_ORDER)
            lines.append(f"(FlashScheduleFits {head_dim} {values})")
    return "\n".join(lines)


def schedule_from_term(term: tuple) -> FlashSchedule:
    """The :class:`FlashSchedule` of a ``FlashSchedule(...)`` term."""
    return FlashSchedule(**dict(zip(KNOB_ORDER, term[1:])))
