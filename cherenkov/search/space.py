"""The search space: every candidate implementation of every kernel of a graph.

A candidate is one plan (fused form × schedule × target) for one kernel of the
derivation's partition. Kernels whose form has no CUDA generator yet are listed as such,
so reports say what could not be searched rather than silently skipping it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from cherenkov.codegen import cuda_source
from cherenkov.codegen.cache import sha256_hex
from cherenkov.rewrites.derive import Derivation
from cherenkov.rewrites.kernels import FusedKernel
from cherenkov.rewrites.plan import KernelPlan

GENERATED_KINDS = frozenset({"flash_attention"})


@dataclass(frozen=True)
class Candidate:
    """One plan for one kernel, with its generated source."""

    kernel: str
    plan: KernelPlan
    source: str = field(repr=False)

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
    """Enumerate candidates: each flash-attention kernel × each schedule its plans offer."""
    plans_by_kernel: dict[str, list[KernelPlan]] = {}
    for plan in derivation.plans(target):
        plans_by_kernel.setdefault(plan.problem.out, []).append(plan)
    candidates, ungenerated = {}, []
    for kernel in derivation.kernels:
        plans = plans_by_kernel.get(kernel.output, [])
        if kernel.kind in GENERATED_KINDS and plans:
            candidates[kernel.output] = tuple(Candidate(kernel.output, p, cuda_source(p)) for p in plans)
        else:
            ungenerated.append(kernel)
    return SearchSpace(tuple(derivation.kernels), candidates, tuple(ungenerated))
