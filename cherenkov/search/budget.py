"""How a search spends its time budget over the kernels of a graph.

A budget must never leave a graph that cannot run, so a search goes in two rounds:

1. **First round** (:func:`first_round`): every kernel's cost-model favourite, the
   favourite of the other family class where the target has two (Hopper's and the portable
   ones: a model that misjudges one class must not starve it of measurements), and its
   safest plan (:func:`risk`: the portable ``mma.sync``/row/pointwise families before the
   Hopper ones, a family's default schedule before its knobs) are compiled and verified
   before anything else, whatever the budget — and where all fail, the kernel's next
   candidates until one passes. :func:`first_round_seconds` estimates what that costs
   here; a budget below it is refused before the search starts.
2. **The rest** is shared out by :func:`shares`: each kernel gets the part of the time
   left that its predicted share of the graph's time is of the kernels still to search (a
   GEMM that is 40 % of the step gets ~40 % of the measuring), the largest first; time a
   kernel does not use passes to the others.

The estimates are deliberately plain constants, measured once (2026-12-01): nvcc 13.0
takes 0.2-0.6 s a candidate on one core of the 2-core CI machine, a measurement worker
takes seconds to import torch and cupy and create its CUDA context, and verifying then
timing one candidate takes a fraction of a second.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence

from cherenkov.codegen.term_plan import TmaGemmSchedule, WgmmaGemmSchedule
from cherenkov.rewrites.plan_sm90a import HopperFlashSchedule
from cherenkov.search.space import Candidate

COMPILE_ESTIMATE_S = 0.6
"""Seconds to compile one candidate on one core (the slowest family measured)."""
MEASURE_ESTIMATE_S = 0.5
"""Seconds to verify one candidate against its reference and time it."""
WORKER_START_S = 10.0
"""Seconds for a measurement worker to start (torch, cupy, a CUDA context)."""

_HOPPER_SCHEDULES = (HopperFlashSchedule, WgmmaGemmSchedule, TmaGemmSchedule)


def is_hopper(candidate: Candidate) -> bool:
    """Whether a candidate is of the Hopper families (wgmma, TMA, warp specialisation)."""
    return isinstance(candidate.plan.schedule, _HOPPER_SCHEDULES)


def risk(candidate: Candidate) -> tuple[int, int]:
    """How far a candidate is from the most exercised code (lower is safer): the Hopper
    families and absorbed producers add one each, a schedule other than its family's
    default one more."""
    schedule = candidate.plan.schedule
    family = int(is_hopper(candidate)) + int(candidate.absorbs is not None)
    return family, int(schedule != type(schedule)())


def first_round(candidates: Sequence[Candidate], predicted_ms: Callable[[Candidate], float]) -> list[Candidate]:
    """A kernel's cost-model favourite, the favourite of the other family class (Hopper or
    portable) where there is one, and its safest candidate, without repeats."""
    if not candidates:
        return []
    favourite = min(candidates, key=lambda c: (predicted_ms(c), c.id))
    others = [c for c in candidates if is_hopper(c) != is_hopper(favourite)]
    rival = [min(others, key=lambda c: (predicted_ms(c), c.id))] if others else []
    safest = min(candidates, key=lambda c: (risk(c), predicted_ms(c), c.id))
    picked: list[Candidate] = []
    for candidate in (favourite, *rival, safest):
        if all(candidate is not p for p in picked):
            picked.append(candidate)
    return picked


def first_round_seconds(compiles: int, measures: int, cores: int) -> float:
    """Estimated wall time of a first round that compiles ``compiles`` candidates on
    ``cores`` cores and verifies and times ``measures`` of them on a GPU."""
    compiling = math.ceil(compiles / max(1, cores)) * COMPILE_ESTIMATE_S
    measuring = WORKER_START_S + measures * MEASURE_ESTIMATE_S if measures else 0.0
    return compiling + measuring


def shares(times_ms: Mapping[str, float]) -> list[tuple[str, float]]:
    """Kernels by their share of the graph's time, largest first: ``(kernel, fraction of
    what is left)`` — the first takes its share of all the time left, the next its share of
    what the remaining kernels' times add up to, and so on, so that the fractions apply in
    turn to whatever time is left when each kernel's turn comes."""
    ordered = sorted(times_ms.items(), key=lambda item: (-item[1], item[0]))
    left = sum(max(ms, 0.0) for _, ms in ordered)
    result = []
    for kernel, ms in ordered:
        result.append((kernel, max(ms, 0.0) / left if left > 0 else 1.0 / (len(ordered) - len(result))))
        left -= max(ms, 0.0)
    return result
