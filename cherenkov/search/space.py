"""The search space: every candidate implementation of every kernel of a graph.

A candidate is one plan (fused form × schedule × target) for one kernel of the
derivation's partition. Flash-attention kernels take the flash plans the e-graph's
schedule rules admit; every other kernel — and a flash-attention kernel no flash plan
fits (an unsupported head dimension or dtype) — takes the generic plans of
:func:`cherenkov.codegen.term_plan.term_plans` (pointwise, row-reduction and mma GEMM
families, schedules enumerated in Python). Kernels with no plan at all are listed as
such, so reports say what could not be searched rather than silently skipping it.

A contraction that can absorb the RMSNorm kernel feeding it
(:func:`cherenkov.rewrites.kernels.absorptions`) also takes the plans of the absorbed
form — the GEMM that runs the norm in its main loop — as candidates that *absorb* that
producer: if one wins, the producer is not launched, so the search weighs it against the
other candidates plus the producer's own time.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from cherenkov.codegen import cuda_source
from cherenkov.codegen.cache import sha256_hex
from cherenkov.codegen.errors import CodegenError
from cherenkov.codegen.term_plan import TermKernelPlan, term_plans
from cherenkov.rewrites.derive import Derivation
from cherenkov.rewrites.kernels import FusedKernel, absorptions
from cherenkov.rewrites.plan import TARGETS, KernelPlan

GENERATED_KINDS = frozenset(
    {"flash_attention", "elementwise", "reduction", "contraction", "softmax_rows", "rms_norm_rows", "layer_norm_rows"}
)

Plan = KernelPlan | TermKernelPlan


@dataclass(frozen=True)
class Candidate:
    """One plan for one kernel, with its generated source; ``absorbs``: the producer kernel
    (by output) whose work this plan does itself, making it unnecessary."""

    kernel: str
    plan: Plan
    source: str = field(repr=False)
    absorbs: str | None = None

    @property
    def id(self) -> str:
        return self.plan.name

    @property
    def source_hash(self) -> str:
        return sha256_hex(self.source.encode())


@dataclass(frozen=True)
class SearchSpace:
    """Candidates per kernel (by output name) and the kernels nothing can generate yet."""

    kernels: tuple[FusedKernel, ...]
    candidates: Mapping[str, tuple[Candidate, ...]]
    ungenerated: tuple[FusedKernel, ...]

    def all(self) -> list[Candidate]:
        return [c for group in self.candidates.values() for c in group]


def search_space(derivation: Derivation, target: str) -> SearchSpace:
    """Enumerate candidates: flash-attention kernels × the schedules their plans offer,
    every other kernel × its generic plans."""
    plans_by_kernel: dict[str, list[Plan]] = {}
    for plan in derivation.plans(target):
        plans_by_kernel.setdefault(plan.problem.out, []).append(plan)
    shapes, dtypes = derivation.tensor_types()
    candidates, ungenerated = {}, []
    for kernel in derivation.kernels:
        plans = plans_by_kernel.get(kernel.output, [])
        if kernel.kind in GENERATED_KINDS and not plans:
            try:
                plans = list(term_plans(kernel, shapes, dtypes, TARGETS[target], kernel.trace))
            except CodegenError:
                plans = []
        if plans:
            candidates[kernel.output] = tuple(Candidate(kernel.output, p, cuda_source(p)) for p in plans)
        else:
            ungenerated.append(kernel)
    for consumer, (producer, fused) in absorptions(derivation.kernels, frozenset(derivation.graph.outputs)).items():
        if consumer not in candidates:
            continue
        try:
            plans = term_plans(fused, shapes, dtypes, TARGETS[target], fused.trace)
            plans = [p for p in plans if p.family != "pointwise"]  # absorbing is worth it only in a GEMM
        except CodegenError:
            plans = []
        absorbing = tuple(Candidate(consumer, p, cuda_source(p), absorbs=producer) for p in plans)
        candidates[consumer] = candidates[consumer] + absorbing
    return SearchSpace(tuple(derivation.kernels), candidates, tuple(ungenerated))
