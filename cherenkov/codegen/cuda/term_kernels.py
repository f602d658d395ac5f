"""Dispatch of term plans to their kernel family's generator and launch geometry."""

from __future__ import annotations

from cherenkov.codegen.cuda import elementwise, gemm, gemm_sm90a, row_reduction
from cherenkov.codegen.cuda.term_common import kernel_name
from cherenkov.codegen.errors import CodegenError
from cherenkov.codegen.term_plan import TermKernelPlan, term_plan_problems

FAMILIES = {
    "pointwise": (elementwise.pointwise_source, elementwise.grid),
    "rows": (row_reduction.row_source, row_reduction.grid),
    "mma": (gemm.gemm_source, gemm.grid),
    "wgmma": (gemm_sm90a.gemm_sm90a_source, gemm_sm90a.grid),
}
DYNAMIC_SMEM = {"mma": gemm.dynamic_smem, "wgmma": gemm_sm90a.dynamic_smem}

__all__ = ["kernel_name", "term_dynamic_smem", "term_grid", "term_kernel_source"]


def _family(plan: TermKernelPlan):
    problems = term_plan_problems(plan)
    if problems:
        raise CodegenError(f"invalid plan {plan.name}: {'; '.join(problems)}")
    if plan.family not in FAMILIES:
        raise CodegenError(f"no generator for kernel family {plan.family!r}")
    return FAMILIES[plan.family]


def term_kernel_source(plan: TermKernelPlan) -> str:
    """Deterministic CUDA C++ of one term plan (same plan → same bytes)."""
    return _family(plan)[0](plan)


def term_grid(plan: TermKernelPlan) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
    """``(grid, block)`` of a term plan's launch (shared memory: :func:`term_dynamic_smem`)."""
    return _family(plan)[1](plan)


def term_dynamic_smem(plan: TermKernelPlan) -> int:
    """Bytes of dynamic shared memory a term plan's launch needs (the GEMMs' tile rings)."""
    _family(plan)  # refuses invalid plans
    return DYNAMIC_SMEM[plan.family](plan) if plan.family in DYNAMIC_SMEM else 0
