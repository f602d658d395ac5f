"""Running a compiled flash-attention kernel on torch CUDA tensors, without copies.

The cubin is loaded with ``cupy.RawModule(path=...)``; tensors are passed by
``data_ptr()`` and the kernel is launched on torch's current stream (wrapped as a cupy
``ExternalStream``), so it orders with the surrounding torch work. cupy and torch are
imported on first use only.
"""

from __future__ import annotations

import warnings

import numpy as np

from cherenkov.codegen.errors import CodegenError
from cherenkov.codegen.plan import CompiledKernel, FlashLayout, FlashTiling

TORCH_DTYPES = {"bf16": "bfloat16", "fp16": "float16"}


class FlashAttentionKernel:
    """``kernel(q, k, v, out=None) -> out``: one compiled flash-attention plan as a callable.

    q, k, v (and out, if given) must be contiguous CUDA tensors on one device, of the plan's
    dtype and exact BHSD shapes, 16-byte aligned. Returns ``out`` (allocated if None).
    """

    def __init__(self, compiled: CompiledKernel, device: int = 0):
        import cupy

        self.compiled = compiled
        self.problem = compiled.plan.problem
        self.device = device
        self.smem_bytes = FlashLayout.from_plan(compiled.plan).total_bytes
        tiling = FlashTiling.from_plan(compiled.plan)
        self.grid = (tiling.q_tiles, self.problem.heads, self.problem.batch)
        self.block = (compiled.plan.schedule.threads, 1, 1)
        with cupy.cuda.Device(device):
            module = cupy.RawModule(path=str(compiled.cubin_path))
            self._function = module.get_function(compiled.kernel_name)
            self._function.max_dynamic_shared_size_bytes = self.smem_bytes
        self._module = module
        self._streams: dict[int, object] = {}

    def _stream(self, handle: int):
        """cupy's view of a torch stream (cupy 14 deprecates ExternalStream, the raw-handle bridge)."""
        import cupy

        if handle not in self._streams:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", "ExternalStream is deprecated", DeprecationWarning)
                self._streams[handle] = cupy.cuda.ExternalStream(handle, self.device)
        return self._streams[handle]

    def __call__(self, q, k, v, out=None):
        import cupy
        import torch

        p = self.problem
        if out is None:
            out = torch.empty(p.shapes()[p.out], dtype=getattr(torch, TORCH_DTYPES[p.dtype]), device=q.device)
        for role, name, tensor in (("q", p.q, q), ("k", p.k, k), ("v", p.v, v), ("out", p.out, out)):
            self._check(role, tensor, p.shapes()[name])
        stream = self._stream(torch.cuda.current_stream(q.device).cuda_stream)
        with cupy.cuda.Device(self.device):
            args = tuple(np.uint64(t.data_ptr()) for t in (q, k, v, out))
            self._function(self.grid, self.block, args, shared_mem=self.smem_bytes, stream=stream)
        return out

    def _check(self, role: str, tensor, shape: tuple[int, ...]) -> None:
        import torch

        dtype = getattr(torch, TORCH_DTYPES[self.problem.dtype])
        if not isinstance(tensor, torch.Tensor):
            raise CodegenError(f"{role}: expected a torch tensor, got {type(tensor).__name__}")
        problems = []
        if tensor.device != torch.device("cuda", self.device):
            problems.append(f"device {tensor.device} (expected cuda:{self.device})")
        if tensor.dtype != dtype:
            problems.append(f"dtype {tensor.dtype} (expected {dtype})")
        if tuple(tensor.shape) != shape:
            problems.append(f"shape {tuple(tensor.shape)} (expected {shape})")
        if not tensor.is_contiguous():
            problems.append("not contiguous (BHSD contiguous expected)")
        if tensor.data_ptr() % 16:
            problems.append("data pointer not 16-byte aligned")
        if problems:
            raise CodegenError(f"{role} for {self.compiled.kernel_name}: {', '.join(problems)}")


def load_kernel(compiled: CompiledKernel, device: int = 0) -> FlashAttentionKernel:
    """Load a compiled kernel onto CUDA device ``device`` and return it as a callable."""
    return FlashAttentionKernel(compiled, device)
