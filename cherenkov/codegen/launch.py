"""Running a compiled kernel (flash attention, or any term kernel) on torch CUDA tensors,
without copies.

The cubin is loaded with ``cupy.RawModule(path=...)``; tensors are passed by
``data_ptr()`` and the kernel is launched on torch's current stream (wrapped as a cupy
``ExternalStream``), so it orders with the surrounding torch work. cupy and torch are
imported on first use only.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping

import numpy as np

from cherenkov.codegen.errors import CodegenError
from cherenkov.codegen.plan import CompiledKernel, FlashLayout, FlashTiling

TORCH_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32", "int32": "int32", "bool": "bool"}


class _StreamCache:
    """cupy's views of torch streams (cupy 14 deprecates ExternalStream, the raw-handle bridge)."""

    device: int

    def _stream(self, handle: int):
        import cupy

        streams = self.__dict__.setdefault("_streams", {})
        if handle not in streams:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", "ExternalStream is deprecated", DeprecationWarning)
                streams[handle] = cupy.cuda.ExternalStream(handle, self.device)
        return streams[handle]


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


class TermKernel(_StreamCache):
    """``kernel(out=None, **tensors) -> out``: one compiled term plan as a callable.

    Tensors are passed by name (``kernel(x=x, w=w)``, or ``kernel.launch({"x": x, ...})``
    for names that are Python keywords); each must be a contiguous CUDA tensor on one
    device, of its plan's dtype and exact shape, 16-byte aligned. Returns ``out``
    (allocated if None), a tensor of the kernel's output shape and dtype.
    """

    def __init__(self, compiled: CompiledKernel, device: int = 0):
        import cupy

        from cherenkov.codegen.cuda.term_kernels import term_grid

        self.compiled = compiled
        self.plan = compiled.plan
        self.device = device
        self.grid, self.block = term_grid(self.plan)
        with cupy.cuda.Device(device):
            module = cupy.RawModule(path=str(compiled.cubin_path))
            self._function = module.get_function(compiled.kernel_name)
        self._module = module

    @property
    def inputs(self) -> tuple[str, ...]:
        """Names of the tensors the kernel reads, in parameter order."""
        return tuple(info.name for info in self.plan.inputs)

    @property
    def output(self) -> str:
        return self.plan.output.name

    def __call__(self, out=None, **tensors):
        return self.launch(tensors, out)

    def launch(self, tensors: Mapping[str, object], out=None):
        """Run the kernel on ``tensors`` (name -> tensor; extra names are ignored)."""
        run, out = self.bind(tensors, out)
        run()
        return out

    def bind(self, tensors: Mapping[str, object], out=None):
        """Check the tensors once and return ``(run, out)``: ``run()`` launches the kernel on
        them with no further checks (for timing loops; the tensors must stay alive)."""
        import cupy
        import torch

        plan = self.plan
        missing = [name for name in self.inputs if name not in tensors]
        if missing:
            raise CodegenError(f"{self.compiled.kernel_name}: missing tensors {missing}; it reads {list(self.inputs)}")
        device = torch.device("cuda", self.device)
        if out is None:
            dtype = getattr(torch, TORCH_DTYPES[plan.output.dtype])
            out = torch.empty(plan.output.shape, dtype=dtype, device=device)
        args = []
        for info in (*plan.inputs, plan.output):
            tensor = out if info is plan.output else tensors[info.name]
            _check_tensor(self.compiled.kernel_name, info.name, tensor, info.shape, info.dtype, self.device)
            args.append(np.uint64(tensor.data_ptr()))
        stream = self._stream(torch.cuda.current_stream(device).cuda_stream)
        args = tuple(args)

        def run() -> None:
            with cupy.cuda.Device(self.device):
                self._function(self.grid, self.block, args, stream=stream)

        return run, out


def _check_tensor(kernel: str, role: str, tensor, shape: tuple[int, ...], dtype_name: str, device: int) -> None:
    import torch

    dtype = getattr(torch, TORCH_DTYPES[dtype_name])
    if not isinstance(tensor, torch.Tensor):
        raise CodegenError(f"{role}: expected a torch tensor, got {type(tensor).__name__}")
    problems = []
    if tensor.device != torch.device("cuda", device):
        problems.append(f"device {tensor.device} (expected cuda:{device})")
    if tensor.dtype != dtype:
        problems.append(f"dtype {tensor.dtype} (expected {dtype})")
    if tuple(tensor.shape) != tuple(shape):
        problems.append(f"shape {tuple(tensor.shape)} (expected {tuple(shape)})")
    if not tensor.is_contiguous():
        problems.append("not contiguous (row-major contiguous expected)")
    if tensor.numel() and tensor.data_ptr() % 16:
        problems.append("data pointer not 16-byte aligned")
    if problems:
        raise CodegenError(f"{role} for {kernel}: {', '.join(problems)}")


def load_kernel(compiled: CompiledKernel, device: int = 0) -> FlashAttentionKernel | TermKernel:
    """Load a compiled kernel onto CUDA device ``device`` and return it as a callable:
    a :class:`FlashAttentionKernel` (``kernel(q, k, v)``) for a flash-attention plan, a
    :class:`TermKernel` (``kernel(**tensors)``) for a term plan."""
    from cherenkov.codegen.term_plan import TermKernelPlan

    if isinstance(compiled.plan, TermKernelPlan):
        return TermKernel(compiled, device)
    return FlashAttentionKernel(compiled, device)
