"""Code generation: kernel plans to CUDA C++, compiled and launched.

``cuda_source(plan)`` gives the deterministic CUDA C++ of a plan, ``compile_plan`` /
``compile_plans`` build cubins (nvcc, or NVRTC through cupy; cached on disk) with their
ptxas resource reports, and ``load_kernel`` wraps a compiled kernel as a callable on torch
CUDA tensors. Importing this package loads neither cupy nor torch.
"""

from cherenkov.codegen.compile import compile_plan, compile_plans, find_compiler
from cherenkov.codegen.cuda.flash_attention import flash_attention_source, kernel_name
from cherenkov.codegen.errors import CodegenError, CompileError
from cherenkov.codegen.launch import FlashAttentionKernel, load_kernel
from cherenkov.codegen.plan import (
    CompiledKernel,
    FlashLayout,
    FlashTiling,
    KernelPlan,
    ResourceReport,
    valid_flash_plans,
)

__all__ = [
    "CodegenError",
    "CompileError",
    "CompiledKernel",
    "FlashAttentionKernel",
    "FlashLayout",
    "FlashTiling",
    "KernelPlan",
    "ResourceReport",
    "compile_plan",
    "compile_plans",
    "cuda_source",
    "find_compiler",
    "kernel_name",
    "load_kernel",
    "valid_flash_plans",
]


def cuda_source(plan: KernelPlan) -> str:
    """Deterministic CUDA C++ for one plan (same plan → byte-identical source)."""
    if plan.kind == "flash_attention":
        return flash_attention_source(plan)
    raise CodegenError(f"no CUDA generator for plan kind {plan.kind!r}")
