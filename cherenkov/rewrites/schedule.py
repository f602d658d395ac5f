"""Schedules: one alternative per valid schedule of each fused kernel form.

A flash-attention e-node gains a ``Scheduled(form, FlashSchedule(...))`` plan for every
``mma.sync`` schedule the target can hold, and on a wgmma target (``sm_90a``) also a
``Scheduled(form, HopperSchedule(...))`` plan for every Hopper schedule. The guards are the
relations ``FlashScheduleFits`` and ``HopperScheduleFits``, filled per target from
:func:`cherenkov.rewrites.plan.flash_schedule_problems` and
:func:`cherenkov.rewrites.plan_sm90a.hopper_schedule_problems` (shared-memory and register
budgets, the target's instruction family), so the e-graph and the code generators share
one resource model.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools

from cherenkov.rewrites.plan import (
    ATTENTION_HEAD_DIMS,
    FLASH_KNOBS,
    RING_STEP_KNOBS,
    AttentionProblem,
    FlashSchedule,
    Target,
    flash_schedule_problems,
)
from cherenkov.rewrites.plan_sm90a import HOPPER_SCHEDULES, HopperFlashSchedule, hopper_schedule_problems
from cherenkov.rewrites.rule import Rule, Ruleset
from cherenkov.rewrites.terms import literal

KNOB_ORDER = (
    "block_q", "block_kv", "warps", "stages", "kv_split", "swizzle", "ldmatrix_x", "pingpong", "lazy_rescale",
    "head_major", "overlap", "min_blocks", "late_copy", "mbarrier_ring",
    "tma_kv", "row_sums_mma", "q_prescaled", "last_warp_refill",
)
_VARIABLES = " ".join(KNOB_ORDER)
HOPPER_KNOB_ORDER = ("block_kv", "stages", "consumer_warpgroups", "pingpong", "persistent", "q_buffers")
_HOPPER_VARIABLES = " ".join(HOPPER_KNOB_ORDER)

RULES = (
    Rule(
        "flash-schedule",
        "FlashAttention(...) runs under schedule σ when σ fits the target (one plan per σ)",
        lhs="(FlashAttention j n d nd q k v c m)",
        where=(f"(FlashScheduleFits nd {_VARIABLES})",),
        rhs=f"(Scheduled __lhs (FlashSchedule {_VARIABLES}))",
        union=False,
    ),
    Rule(
        "hopper-flash-schedule",
        "FlashAttention(...) runs under Hopper schedule η (wgmma, TMA, warp roles) when η fits the target",
        lhs="(FlashAttention j n d nd q k v c m)",
        where=(f"(HopperScheduleFits nd {_HOPPER_VARIABLES})",),
        rhs=f"(Scheduled __lhs (HopperSchedule {_HOPPER_VARIABLES}))",
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
    # The TMA ring's step knobs (the last, fastest-varying ones) only add restrictions, so
    # they are crossed with the schedules that are valid without them: the same schedules, in
    # the same order, as the full product.
    base_knobs = KNOB_ORDER[: -len(RING_STEP_KNOBS)]
    assert KNOB_ORDER[-len(RING_STEP_KNOBS):] == RING_STEP_KNOBS, "step knobs vary fastest"
    schedules = []
    for values in itertools.product(*(FLASH_KNOBS[k] for k in base_knobs)):
        base = FlashSchedule(**dict(zip(base_knobs, values)))
        if not any(not flash_schedule_problems(base, probe, target) for probe in probes):
            continue
        schedules.append(base)
        if not base.tma_kv:
            continue
        for step in itertools.product(*(FLASH_KNOBS[k] for k in RING_STEP_KNOBS)):
            if any(step):
                schedule = dataclasses.replace(base, **dict(zip(RING_STEP_KNOBS, step)))
                if any(not flash_schedule_problems(schedule, probe, target) for probe in probes):
                    schedules.append(schedule)
    return schedules


def hopper_schedules(head_dim: int, target: Target) -> list[HopperFlashSchedule]:
    """The Hopper schedules a ``head_dim`` problem fits on ``target`` (none off wgmma targets).

    As for :func:`flash_schedules`, a probe problem (sequence lengths a multiple of every
    tile) decides; the plans of a concrete problem are filtered again with it."""
    probes = [
        AttentionProblem(batch=1, heads=1, kv_heads=1, seq_q=64 * 3 * 176, seq_kv=64 * 3 * 176, head_dim=head_dim,
                         causal=causal)
        for causal in (False, True)
    ]  # fmt: skip
    return [s for s in HOPPER_SCHEDULES if any(not hopper_schedule_problems(s, probe, target) for probe in probes)]


@functools.cache
def schedule_facts(target: Target) -> str:
    """``FlashScheduleFits`` and ``HopperScheduleFits`` facts for every supported head
    dimension on ``target`` (enumerated once a process: seconds for the whole knob space)."""
    lines = []
    for head_dim in ATTENTION_HEAD_DIMS:
        for schedule in flash_schedules(head_dim, target):
            values = " ".join(literal(getattr(schedule, knob)) for knob in KNOB_ORDER)
            lines.append(f"(FlashScheduleFits {head_dim} {values})")
        for hopper in hopper_schedules(head_dim, target):
            values = " ".join(literal(getattr(hopper, knob)) for knob in HOPPER_KNOB_ORDER)
            lines.append(f"(HopperScheduleFits {head_dim} {values})")
    return "\n".join(lines)


def schedule_from_term(term: tuple) -> FlashSchedule | HopperFlashSchedule:
    """The schedule of a ``FlashSchedule(...)`` or ``HopperSchedule(...)`` term."""
    if term[0] == "HopperSchedule":
        return HopperFlashSchedule(**dict(zip(HOPPER_KNOB_ORDER, term[1:])))
    return FlashSchedule(**dict(zip(KNOB_ORDER, term[1:])))
