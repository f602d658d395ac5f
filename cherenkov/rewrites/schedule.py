"""Schedules: one alternative per valid schedule of each fused kernel form.

A flash-attention e-node gains a ``Scheduled(form, FlashSchedule(...))`` plan for every
``mma.sync`` schedule the target can hold, and on a wgmma target (``sm_90a``) also a
``Scheduled(form, HopperSchedule(...))`` plan for every Hopper schedule; its split-KV form
(``FlashAttentionSplitKv``) gains the ``mma.sync`` schedules with more than one key split. The
guards are the
relations ``FlashScheduleFits``, ``HopperScheduleFits`` and ``Fp8ScheduleFits`` (an 8-bit
``FlashAttentionScaled`` form's e4m3 schedules), filled per target from
:func:`cherenkov.rewrites.plan.flash_schedule_problems`,
:func:`cherenkov.rewrites.plan_sm90a.hopper_schedule_problems` and
:func:`cherenkov.rewrites.plan_fp8.fp8_schedule_problems` (shared-memory and register
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
    SHORT_QUERY_KNOBS,
    AttentionProblem,
    FlashSchedule,
    Target,
    flash_schedule_problems,
)
from cherenkov.rewrites.plan_fp8 import FP8_SCHEDULES, Fp8FlashSchedule, fp8_schedule_problems
from cherenkov.rewrites.plan_sm90a import HOPPER_SCHEDULES, HopperFlashSchedule, hopper_schedule_problems
from cherenkov.rewrites.rule import Rule, Ruleset
from cherenkov.rewrites.terms import literal

KNOB_ORDER = (
    "block_q", "block_kv", "warps", "stages", "kv_split", "swizzle", "ldmatrix_x", "pingpong", "lazy_rescale",
    "head_major", "overlap", "min_blocks", "late_copy", "mbarrier_ring",
    "tma_kv", "row_sums_mma", "q_prescaled", "last_warp_refill", "kv_splits", "pack_group", "warp_keys",
)
_VARIABLES = " ".join(KNOB_ORDER)
_UNSPLIT = " ".join("1" if knob == "kv_splits" else knob for knob in KNOB_ORDER)
HOPPER_KNOB_ORDER = ("block_kv", "stages", "consumer_warpgroups", "pingpong", "persistent", "q_buffers", "pack_group",
                     "balanced", "lazy_rescale", "row_sums_mma")
_HOPPER_VARIABLES = " ".join(HOPPER_KNOB_ORDER)
FP8_KNOB_ORDER = ("block_q", "block_kv", "stages")
_FP8_VARIABLES = " ".join(FP8_KNOB_ORDER)

RULES = (
    Rule(
        "flash-schedule",
        "FlashAttention(...) runs under schedule σ when σ fits the target (one plan per σ)",
        lhs="(FlashAttention j n d nd q k v c m)",
        where=(f"(FlashScheduleFits nd {_UNSPLIT})",),
        rhs=f"(Scheduled __lhs (FlashSchedule {_UNSPLIT}))",
        union=False,
    ),
    Rule(
        "split-kv-schedule",
        "FlashAttentionSplitKv(...) runs under schedule σ with σ's key splits when σ fits the target",
        lhs="(FlashAttentionSplitKv j n d nd q k v c m)",
        where=(f"(FlashScheduleFits nd {_VARIABLES})", "(> kv_splits 1)"),
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
    Rule(
        "hopper-fp8-flash-schedule",
        "FlashAttentionScaled(...) runs under Hopper schedule η with e4m3 wgmma when η fits the target",
        lhs="(FlashAttentionScaled j n d nd q k v c m fq fk g)",
        where=(f"(HopperFp8ScheduleFits nd {_HOPPER_VARIABLES})",),
        rhs=f"(Scheduled __lhs (HopperSchedule {_HOPPER_VARIABLES}))",
        union=False,
    ),
    Rule(
        "fp8-flash-schedule",
        "FlashAttentionScaled(...) runs under 8-bit schedule φ (e4m3 mma.sync) when φ fits the target",
        lhs="(FlashAttentionScaled j n d nd q k v c m fq fk g)",
        where=(f"(Fp8ScheduleFits nd {_FP8_VARIABLES})",),
        rhs=f"(Scheduled __lhs (Fp8Schedule {_FP8_VARIABLES}))",
        union=False,
    ),
)

SCHEDULE = Ruleset("schedule", __doc__.splitlines()[0], RULES)


@functools.cache
def flash_schedules(head_dim: int, target: Target, value_dim: int = 0) -> tuple[FlashSchedule, ...]:
    """Every schedule of the knob space that a ``head_dim`` problem (``value_dim`` for v) fits
    on ``target``: the long-query knobs (:data:`FLASH_KNOBS`), then the short-query ones
    (:func:`short_query_schedules`).

    A schedule qualifies when it fits a causal or a non-causal probe problem (some knobs,
    such as the head-major grid order, are for causal problems only); the plans of a
    concrete problem are filtered again with that problem (``Derivation.plans``)."""
    probes = [
        AttentionProblem(batch=1, heads=1, kv_heads=1, seq_q=1, seq_kv=1, head_dim=head_dim, causal=causal,
                         value_dim=value_dim)
        for causal in (False, True)
    ]
    # The TMA ring's step knobs (the last, fastest-varying ones) only add restrictions, so
    # they are crossed with the schedules that are valid without them: the same schedules, in
    # the same order, as the full product.
    long_knobs = tuple(FLASH_KNOBS)
    base_knobs = long_knobs[: -len(RING_STEP_KNOBS)]
    assert long_knobs[-len(RING_STEP_KNOBS):] == RING_STEP_KNOBS, "step knobs vary fastest"
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
    seen = set(schedules)
    return tuple(schedules) + tuple(s for s in short_query_schedules(head_dim, target, value_dim) if s not in seen)


def short_query_schedules(head_dim: int, target: Target, value_dim: int = 0) -> list[FlashSchedule]:
    """The short-query schedules (:data:`SHORT_QUERY_KNOBS`) a probe decode problem fits: one
    query of a group of 8 heads over 2^20 keys, whose packed rows and key splits every
    short-query knob value serves."""
    probe = AttentionProblem(batch=1, heads=8, kv_heads=1, seq_q=1, seq_kv=1 << 20, head_dim=head_dim,
                             value_dim=value_dim)
    rings = {
        "split": {"kv_split": True},
        "mbarrier": {"kv_split": False, "lazy_rescale": True, "mbarrier_ring": True},
        "tma": {"kv_split": False, "lazy_rescale": True, "mbarrier_ring": True, "tma_kv": True},
    }
    schedules = []
    for values in itertools.product(*SHORT_QUERY_KNOBS.values()):
        knobs = dict(zip(SHORT_QUERY_KNOBS, values))
        ring = rings[knobs.pop("ring")]
        block_q, warps, warp_keys = knobs.pop("rows")
        schedule = FlashSchedule(block_q=block_q, warps=warps, warp_keys=warp_keys, **ring, **knobs)
        if not flash_schedule_problems(schedule, probe, target):
            schedules.append(schedule)
    return schedules


def hopper_schedules(head_dim: int, target: Target, value_dim: int = 0) -> list[HopperFlashSchedule]:
    """The Hopper schedules a problem of head dims ``head_dim`` (q·k) and ``value_dim`` (v; 0:
    the same) fits on ``target`` (none off wgmma targets).

    As for :func:`flash_schedules`, probe problems (sequence lengths a multiple of every
    tile; a short query of a group of 8 heads for the packed schedules) decide; the plans of
    a concrete problem are filtered again with it."""
    probes = [
        AttentionProblem(batch=1, heads=1, kv_heads=1, seq_q=64 * 3 * 176, seq_kv=64 * 3 * 176, head_dim=head_dim,
                         causal=causal, value_dim=value_dim)
        for causal in (False, True)
    ] + [AttentionProblem(batch=1, heads=8, kv_heads=1, seq_q=64, seq_kv=64 * 3 * 176, head_dim=head_dim,
                          value_dim=value_dim)]  # fmt: skip
    return [s for s in HOPPER_SCHEDULES if any(not hopper_schedule_problems(s, probe, target) for probe in probes)]


def hopper_fp8_schedules(head_dim: int, target: Target) -> list[HopperFlashSchedule]:
    """The Hopper schedules an e4m3 problem of ``head_dim`` fits on ``target`` (none off wgmma targets)."""
    probes = [
        AttentionProblem(batch=1, heads=1, kv_heads=1, seq_q=64 * 3 * 176, seq_kv=64 * 3 * 176, head_dim=head_dim,
                         dtype="fp8_e4m3", causal=causal, out_dtype="bf16")
        for causal in (False, True)
    ]  # fmt: skip
    return [s for s in HOPPER_SCHEDULES if any(not hopper_schedule_problems(s, probe, target) for probe in probes)]


def fp8_schedules(head_dim: int, target: Target) -> list[Fp8FlashSchedule]:
    """The 8-bit schedules a ``head_dim`` problem (e4m3, contiguous) fits on ``target``."""
    probe = AttentionProblem(batch=1, heads=1, kv_heads=1, seq_q=1, seq_kv=1, head_dim=head_dim, dtype="fp8_e4m3",
                             out_dtype="bf16")  # fmt: skip
    return [s for s in FP8_SCHEDULES if not fp8_schedule_problems(s, probe, target)]


@functools.cache
def schedule_facts(target: Target, dims: tuple[tuple[int, int], ...]) -> str:
    """``FlashScheduleFits`` and ``HopperScheduleFits`` facts for the ``(head_dim, value_dim)``
    pairs of a graph's attention problems on ``target`` (each pair's schedules enumerated
    once a process: seconds for the whole knob space). The relations are keyed by the q·k
    head dim; a value dim's schedules join its head dim's."""
    lines = []
    for head_dim, value_dim in sorted(set(dims)):
        for schedule in flash_schedules(head_dim, target, value_dim) if head_dim in ATTENTION_HEAD_DIMS else ():
            values = " ".join(literal(getattr(schedule, knob)) for knob in KNOB_ORDER)
            lines.append(f"(FlashScheduleFits {head_dim} {values})")
        for hopper in hopper_schedules(head_dim, target, value_dim):
            values = " ".join(literal(getattr(hopper, knob)) for knob in HOPPER_KNOB_ORDER)
            lines.append(f"(HopperScheduleFits {head_dim} {values})")
        for hopper in hopper_fp8_schedules(head_dim, target) if value_dim in (0, head_dim) else ():
            values = " ".join(literal(getattr(hopper, knob)) for knob in HOPPER_KNOB_ORDER)
            lines.append(f"(HopperFp8ScheduleFits {head_dim} {values})")
        for eight_bit in fp8_schedules(head_dim, target) if value_dim in (0, head_dim) else ():
            values = " ".join(literal(getattr(eight_bit, knob)) for knob in FP8_KNOB_ORDER)
            lines.append(f"(Fp8ScheduleFits {head_dim} {values})")
    return "\n".join(lines)


def schedule_from_term(term: tuple) -> FlashSchedule | HopperFlashSchedule | Fp8FlashSchedule:
    """The schedule of a ``FlashSchedule(...)``, ``HopperSchedule(...)`` or ``Fp8Schedule(...)`` term."""
    if term[0] == "HopperSchedule":
        return HopperFlashSchedule(**dict(zip(HOPPER_KNOB_ORDER, term[1:])))
    if term[0] == "Fp8Schedule":
        return Fp8FlashSchedule(**dict(zip(FP8_KNOB_ORDER, term[1:])))
    return FlashSchedule(**dict(zip(KNOB_ORDER, term[1:])))
