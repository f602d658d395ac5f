"""Code generation: kernel plans to CUDA C++, compiled and launched.

``cuda_source(plan)`` gives the deterministic CUDA C++ of a plan — a flash-attention
:class:`KernelPlan` (the ``mma.sync`` family, or the sm_90a wgmma/TMA family for a
:class:`~cherenkov.rewrites.plan_sm90a.HopperFlashSchedule`), or a :class:`TermKernelPlan` of any other fused kernel (pointwise,
row-reduction and mma GEMM families, see :mod:`cherenkov.codegen.term_plan`);
``compile_plan`` / ``compile_plans`` build cubins (nvcc, or NVRTC through cupy; cached on
disk) with their ptxas resource reports, and ``load_kernel`` wraps a compiled kernel as a
callable on torch CUDA tensors. Importing this package loads neither cupy nor torch.
"""

from cherenkov.codegen.compile import compile_plan, compile_plans, find_compiler, plan_kernel_name
from cherenkov.codegen.compile import plan_source as cuda_source
from cherenkov.codegen.cuda.flash_attention import kernel_name
from cherenkov.codegen.errors import CodegenError, CompileError
from cherenkov.codegen.launch import FlashAttentionKernel, HopperFlashKernel, TermKernel, TmaFlashKernel, load_kernel
from cherenkov.codegen.plan import (
    CompiledKernel,
    FlashLayout,
    FlashTiling,
    KernelPlan,
    ResourceReport,
    valid_flash_plans,
)
from cherenkov.codegen.term_plan import (
    GemmSchedule,
    PointwiseSchedule,
    RowSchedule,
    TermKernelPlan,
    term_plans,
)

__all__ = [
    "CodegenError",
    "CompileError",
    "CompiledKernel",
    "FlashAttentionKernel",
    "FlashLayout",
    "FlashTiling",
    "HopperFlashKernel",
    "GemmSchedule",
    "KernelPlan",
    "PointwiseSchedule",
    "ResourceReport",
    "RowSchedule",
    "TermKernel",
    "TermKernelPlan",
    "TmaFlashKernel",
    "compile_plan",
    "compile_plans",
    "cuda_source",
    "find_compiler",
    "kernel_name",
    "load_kernel",
    "plan_kernel_name",
    "term_plans",
    "valid_flash_plans",
]
