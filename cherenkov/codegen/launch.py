"""Running a compiled kernel (flash attention, or any term kernel) on torch CUDA tensors,
without copies.

The cubin is loaded with ``cupy.RawModule(path=...)``; tensors are passed by
``data_ptr()`` and the kernel is launched on torch's current stream (wrapped as a cupy
``ExternalStream``), so it orders with the surrounding torch work. The sm_90a family, and
``mma.sync`` flash plans whose K/V ring is fed by TMA (``tma_kv``), take TMA tensor maps by
value and are launched through ``cuLaunchKernel`` (:mod:`cherenkov.codegen.tensor_map`).
cupy and torch are imported on first use only.
"""

from __future__ import annotations

import ctypes
import functools
import warnings
from collections.abc import Mapping

import numpy as np

from cherenkov.codegen import tensor_map
from cherenkov.codegen.errors import CodegenError
from cherenkov.codegen.plan import CompiledKernel, FlashLayout, FlashTiling
from cherenkov.rewrites.plan_sm90a import HOPPER_EIGHT_BIT_DTYPES, ROWS_PER_CONSUMER, box_row_bytes

MAX_CACHED_TENSOR_MAPS = 64  # tensor-map sets a TMA kernel keeps (keyed by its operands' data pointers)


@functools.cache
def _multiprocessors(device: int) -> int:
    """The SM count of CUDA device ``device``: the grid of a persistent kernel."""
    import cupy

    return cupy.cuda.runtime.getDeviceProperties(device)["multiProcessorCount"]


def _cached_tensor_maps(cache: dict, key: tuple[int, ...], encode) -> tuple:
    """``cache[key]``, encoded by ``encode()`` on a miss; the cache is emptied when it holds
    ``MAX_CACHED_TENSOR_MAPS`` entries (the maps of freed tensors are never used again)."""
    if key not in cache:
        if len(cache) >= MAX_CACHED_TENSOR_MAPS:
            cache.clear()
        cache[key] = encode()
    return cache[key]


def operand_view(problem, role: str, tensor):
    """The ``(B, H, S, D)`` view of an attention operand in its stored torch tensor (its
    layout's strides and offset: no copy)."""
    import torch

    layout = problem.layout(role)
    return torch.as_strided(tensor, problem.logical_shape(role), (*layout.strides(), 1), layout.offset)


def mask_view(problem, tensor):
    """The ``(B, H, Sq, Skv)`` view of a problem's bias in its stored torch tensor
    (:class:`~cherenkov.rewrites.plan.AttentionBias` strides, 0 where it broadcasts)."""
    import torch

    b = problem.bias
    return torch.as_strided(tensor, (problem.batch, problem.heads, problem.seq_q, problem.seq_kv),
                            (b.batch, b.head, b.row, b.key), b.offset)  # fmt: skip


def operand_map(problem, role: str, address: int, box_rows: int, box_heads: int = 1,
                row_bytes: int = tensor_map.SWIZZLE_BYTES) -> tensor_map.TensorMap:  # fmt: skip
    """The TMA tensor map of one attention operand at its layout's strides (both families),
    in boxes of ``row_bytes`` a row."""
    layout = problem.layout(role)
    dtype = problem.output_dtype if role == "o" else problem.dtype
    return tensor_map.operand_tensor_map(address, problem.logical_shape(role), layout.strides(), layout.offset,
                                         dtype, box_rows, box_heads, row_bytes)  # fmt: skip


TORCH_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32", "int32": "int32", "bool": "bool",
                "fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2", "e8m0": "float8_e8m0fnu"}


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


class FlashAttentionKernel(_StreamCache):
    """``kernel(q, k, v, out=None, bias=None, factors=()) -> out``: one compiled flash-attention plan as a callable.

    q, k, v (and out, if given) are the stored tensors the operands are read from (the same
    one more than once for slices of a fused projection): contiguous CUDA tensors on one
    device, of the plan's dtype and of the shapes its layouts name
    (:meth:`~cherenkov.rewrites.plan.AttentionProblem.stored_shapes`; BHSD for a plain
    problem), 16-byte aligned. ``bias`` is the problem's bias tensor (required when it has
    one: :class:`~cherenkov.rewrites.plan.AttentionBias`, contiguous, of its dtype and
    shape); ``factors`` the fp32 tensors of the problem's score factors, then of its output
    factors (:attr:`~cherenkov.rewrites.plan.AttentionProblem.factors`: 8-bit operands'
    descales); o is of the problem's output dtype; ``lse`` the fp32 tensor a problem with a
    log-sum-exp output (:class:`~cherenkov.rewrites.plan.LseOutput`) writes each query row's
    into (required then). Returns ``out`` (allocated if None). A plan with key splits
    owns a zeroed fp32 workspace on the device (its partial states and arrival counters,
    which every launch leaves zeroed again), so launches of one kernel object must not run
    concurrently on two streams.
    """

    def __init__(self, compiled: CompiledKernel, device: int = 0):
        import cupy

        self.compiled = compiled
        self.problem = compiled.plan.problem
        self.device = device
        self.smem_bytes = FlashLayout.from_plan(compiled.plan).total_bytes
        tiling = FlashTiling.from_plan(compiled.plan)
        self.grid = tiling.grid
        self.block = (compiled.plan.schedule.threads, 1, 1)
        self._workspace = None
        if tiling.workspace_floats:
            import torch

            self._workspace = torch.zeros(tiling.workspace_floats, dtype=torch.float32, device=f"cuda:{device}")
        with cupy.cuda.Device(device):
            module = cupy.RawModule(path=str(compiled.cubin_path))
            self._function = module.get_function(compiled.kernel_name)
            self._function.max_dynamic_shared_size_bytes = self.smem_bytes
        self._module = module

    def __call__(self, q, k, v, out=None, bias=None, factors=(), lse=None):
        import torch

        p = self.problem
        if out is None:
            out = torch.empty(p.layout("o").shape, dtype=getattr(torch, TORCH_DTYPES[p.output_dtype]),
                              device=q.device)  # fmt: skip
        name = self.compiled.kernel_name
        for role, tensor in (("q", q), ("k", k), ("v", v), ("o", out)):
            check_tensor(name, role, tensor, p.layout(role).shape, p.output_dtype if role == "o" else p.dtype,
                         self.device)  # fmt: skip
        if p.bias is None and bias is not None:
            raise CodegenError(f"{name} reads no bias tensor; got one")
        if p.bias is not None:
            check_tensor(name, p.bias.tensor, bias, p.bias.shape, p.bias.dtype, self.device)
        if len(factors) != len(p.factors):
            raise CodegenError(f"{name} reads {len(p.factors)} scale factors ({[f.tensor for f in p.factors]}); "
                               f"got {len(factors)}")  # fmt: skip
        for factor, tensor in zip(p.factors, factors):
            check_tensor(name, factor.tensor, tensor, factor.shape, "fp32", self.device)
        if (p.lse is None) != (lse is None):
            raise CodegenError(f"{name} writes {'no' if p.lse is None else 'a'} log-sum-exp output; "
                               f"got {'one' if lse is not None else 'none'} (lse=)")  # fmt: skip
        if p.lse is not None:
            check_tensor(name, p.lse.tensor, lse, p.lse.layout.shape, "fp32", self.device)
        self._launch(q, k, v, out, torch.cuda.current_stream(q.device).cuda_stream, bias, tuple(factors), lse)
        return out

    def _launch(self, q, k, v, out, stream: int, bias=None, factors=(), lse=None) -> None:
        """Launch on checked tensors, on the raw CUDA stream handle ``stream``."""
        import cupy

        with cupy.cuda.Device(self.device):
            args = tuple(np.uint64(t.data_ptr()) for t in (q, k, v, out, *self._tail_args(bias, factors, lse)))
            self._function(self.grid, self.block, args, shared_mem=self.smem_bytes, stream=self._stream(stream))

    def _tail_args(self, bias, factors=(), lse=None) -> tuple:
        """The tensors after the operands: the bias (if the problem has one), the factors, the key
        splits' workspace (if the plan has one), then the log-sum-exp output (if the problem has one)."""
        return ((() if bias is None else (bias,)) + tuple(factors)
                + (() if self._workspace is None else (self._workspace,)) + (() if lse is None else (lse,)))  # fmt: skip


class TermKernel(_StreamCache):
    """``kernel(out=None, **tensors) -> out``: one compiled term plan as a callable.

    Tensors are passed by name (``kernel(x=x, w=w)``, or ``kernel.launch({"x": x, ...})``
    for names that are Python keywords); each must be a contiguous CUDA tensor on one
    device, of its plan's dtype and exact shape, 16-byte aligned. Returns ``out``
    (allocated if None), a tensor of the kernel's output shape and dtype.

    A TMA GEMM plan (:class:`~cherenkov.codegen.term_plan.TmaGemmSchedule`) also takes the
    tensor maps of its two operands (and of its output, when it stores through the copy
    engine), by value before the pointers: they are encoded per data pointers (cached) and
    the kernel is launched through ``cuLaunchKernel``.
    """

    def __init__(self, compiled: CompiledKernel, device: int = 0):
        import cupy

        from cherenkov.codegen.cuda.gemm_sm90a_tma import tensor_maps
        from cherenkov.codegen.cuda.term_kernels import term_dynamic_smem, term_grid
        from cherenkov.codegen.term_plan import TmaGemmSchedule

        self.compiled = compiled
        self.plan = compiled.plan
        self.device = device
        self.grid, self.block = term_grid(self.plan)
        self.smem_bytes = term_dynamic_smem(self.plan)
        self._operand_maps = tensor_maps(self.plan) if isinstance(self.plan.schedule, TmaGemmSchedule) else None
        self._maps: dict[tuple[int, ...], tuple[tensor_map.TensorMap, ...]] = {}
        with cupy.cuda.Device(device):
            if getattr(self.plan.schedule, "persistent", False):  # one block an SM walks the tiles
                self.grid = (min(self.grid[0], _multiprocessors(device)), *self.grid[1:])
            module = cupy.RawModule(path=str(compiled.cubin_path))
            self._function = module.get_function(compiled.kernel_name)
            if self.smem_bytes > 48 * 1024:
                self._function.max_dynamic_shared_size_bytes = self.smem_bytes
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
        expected = self._expected_tensors
        if out is None:
            _, shape, dtype = expected[-1]
            out = torch.empty(shape, dtype=dtype, device=self._torch_device)
        args = []
        for (name, shape, dtype), info in zip(expected, (*plan.inputs, plan.output), strict=True):
            tensor = out if info is plan.output else tensors[name]
            if not (
                isinstance(tensor, torch.Tensor) and tensor.dtype == dtype and tensor.shape == shape
                and tensor.device == self._torch_device and tensor.is_contiguous() and tensor.data_ptr() % 16 == 0
            ):  # fmt: skip
                check_tensor(self.compiled.kernel_name, info.name, tensor, info.shape, info.dtype, self.device)
            args.append(np.uint64(tensor.data_ptr()))
        handle = torch.cuda.current_stream(self._torch_device).cuda_stream
        if self._operand_maps is not None:
            return self._bind_tma({**tensors, plan.output.name: out}, args, handle), out
        stream = self._stream(handle)
        args = tuple(args)

        def run() -> None:
            with cupy.cuda.Device(self.device):
                self._function(self.grid, self.block, args, shared_mem=self.smem_bytes, stream=stream)

        return run, out

    def _bind_tma(self, tensors: Mapping[str, object], pointers: list, stream: int):
        """``run()`` of a TMA GEMM: the tensor maps (of ``tensors``, the output among them),
        then the pointers, through ``cuLaunchKernel`` on the raw stream handle ``stream``."""
        import torch

        operands = [tensors[m.tensor] for m in self._operand_maps]
        dtype = self.plan.tensor_map[self._operand_maps[0].tensor].dtype
        maps = _cached_tensor_maps(self._maps, tuple(t.data_ptr() for t in operands), lambda: tuple(
            tensor_map.encode_tiled(t.data_ptr(), dtype, m.dims, (m.row_stride,), m.box)
            for t, m in zip(operands, self._operand_maps)
        ))  # fmt: skip
        args = (*maps, *(ctypes.c_uint64(int(p)) for p in pointers))
        function = self._function.kernel.ptr  # the CUfunction (its shared-memory limit set above)

        def run() -> None:
            with torch.cuda.device(self.device):
                tensor_map.launch(function, self.grid, self.block, self.smem_bytes, stream, args)

        return run

    @functools.cached_property
    def _torch_device(self):
        import torch

        return torch.device("cuda", self.device)

    @functools.cached_property
    def _expected_tensors(self) -> list[tuple[str, object, object]]:
        """(name, torch.Size, torch dtype) of each parameter tensor."""
        import torch

        return [
            (info.name, torch.Size(info.shape), getattr(torch, TORCH_DTYPES[info.dtype]))
            for info in (*self.plan.inputs, self.plan.output)
        ]


def check_tensor(kernel: str, role: str, tensor, shape: tuple[int, ...], dtype_name: str, device: int) -> None:
    """That ``kernel`` can read ``tensor`` for ``role``: a contiguous, 16-byte aligned CUDA tensor
    of ``shape`` and the dtype named; a ``CodegenError`` naming every mismatch otherwise."""
    import torch

    dtype = getattr(torch, TORCH_DTYPES[dtype_name])
    if not isinstance(tensor, torch.Tensor):
        raise CodegenError(f"{role}: expected a torch tensor, got {type(tensor).__name__}")
    shape = tuple(shape)
    problems = []
    if tensor.device != torch.device("cuda", device):
        problems.append(f"device {tensor.device} (expected cuda:{device})")
    if tensor.dtype != dtype:
        problems.append(f"dtype {tensor.dtype} (expected {dtype})")
    if tuple(tensor.shape) != shape:
        problems.append(f"shape {tuple(tensor.shape)} (expected {shape})")
    if not tensor.is_contiguous():
        problems.append("not contiguous (row-major contiguous expected)")
    if tensor.numel() and tensor.data_ptr() % 16:
        problems.append("data pointer not 16-byte aligned")
    if problems:
        raise CodegenError(f"{role} for {kernel}: {', '.join(problems)}")


class TmaFlashKernel(FlashAttentionKernel):
    """:class:`FlashAttentionKernel` for an ``mma.sync`` plan with TMA K/V copies (``tma_kv``).

    Same contract; k and v reach the kernel as tensor maps (boxes of 64 columns by
    ``block_kv`` rows, encoded per data pointers and cached) next to the q and o pointers,
    through ``cuLaunchKernel``."""

    def __init__(self, compiled: CompiledKernel, device: int = 0):
        super().__init__(compiled, device)
        self._maps: dict[tuple[int, int], tuple[tensor_map.TensorMap, ...]] = {}

    def _launch(self, q, k, v, out, stream: int, bias=None, factors=(), lse=None) -> None:
        import torch

        rows = self.compiled.plan.schedule.block_kv
        maps = _cached_tensor_maps(self._maps, (k.data_ptr(), v.data_ptr()), lambda: (
            operand_map(self.problem, "k", k.data_ptr(), rows), operand_map(self.problem, "v", v.data_ptr(), rows),
        ))  # fmt: skip
        with torch.cuda.device(self.device):
            tensor_map.launch(self._function.kernel.ptr, self.grid, self.block, self.smem_bytes, stream,
                              (ctypes.c_uint64(q.data_ptr()), ctypes.c_uint64(out.data_ptr()), *maps,
                               *(ctypes.c_uint64(t.data_ptr()) for t in self._tail_args(bias, (), lse))))  # fmt: skip


class HopperFlashKernel(FlashAttentionKernel):
    """``kernel(q, k, v, out=None, bias=None, factors=()) -> out`` for a compiled sm_90a flash-attention plan.

    Same contract as :class:`FlashAttentionKernel`; the kernel reads q, k and v and may write
    o through TMA tensor maps (encoded per data pointers and cached; o's boxes are one
    consumer warpgroup's 64 rows), passed by value with the output pointer through
    ``cuLaunchKernel`` (:mod:`cherenkov.codegen.tensor_map`); the bias or the factors follow as
    pointers. With 8-bit operands a first launch writes V transposed (keys contiguous, in P's
    slot order) into a workspace of this object, which the kernel's V tensor map reads: launches
    of one kernel object must not run concurrently on two streams."""

    def __init__(self, compiled: CompiledKernel, device: int = 0):
        import cupy

        self.compiled = compiled
        self.problem = p = compiled.plan.problem
        self.schedule = s = compiled.plan.schedule
        self.device = device
        self.smem_bytes = s.problem_smem_bytes(p)
        self.block = (s.threads, 1, 1)
        with cupy.cuda.Device(device):
            self.grid = (s.grid_blocks(p, _multiprocessors(device)), 1, 1)
            self._module = cupy.RawModule(path=str(compiled.cubin_path))
            self._raw_kernel = self._module.get_function(compiled.kernel_name)
            self._function = self._raw_kernel.kernel.ptr  # the CUfunction handle on this device
        tensor_map.set_max_dynamic_smem(self._function, self.smem_bytes)
        self._maps: dict[tuple[int, int, int, int], tuple[tensor_map.TensorMap, ...]] = {}
        self._transposed = None  # 8-bit: V transposed, and the kernel writing it
        if p.dtype in HOPPER_EIGHT_BIT_DTYPES:
            import torch

            from cherenkov.codegen.cuda.flash_attention_sm90a import transpose_kernel_name, transposed_keys

            keys = transposed_keys(p.seq_kv)
            workspace = torch.empty(p.batch * p.kv_heads * p.head_dim * keys, dtype=torch.uint8,
                                    device=f"cuda:{device}")  # fmt: skip
            with cupy.cuda.Device(device):
                transpose = self._module.get_function(transpose_kernel_name(s))
            self._transposed = (workspace, keys, transpose)

    def _tensor_maps(self, q, k, v, out) -> tuple[tensor_map.TensorMap, ...]:
        key = (q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr())
        p, s = self.problem, self.schedule

        row_bytes = box_row_bytes(p.head_dim, p.v_dim, p.dtype)

        def v_map() -> tensor_map.TensorMap:
            if self._transposed is None:
                return operand_map(p, "v", key[2], s.block_kv, row_bytes=row_bytes)
            workspace, keys, _ = self._transposed  # [B][H_kv][D][keys]: D rows of a key tile's bytes a box
            d = p.head_dim
            return tensor_map.operand_tensor_map(workspace.data_ptr(), (p.batch, p.kv_heads, d, keys),
                                                 (p.kv_heads * d * keys, d * keys, keys), 0, p.dtype, d)  # fmt: skip

        # q's box is a work tile (packed: Sq rows of each of its heads), o's one consumer's 64 rows
        heads = s.tile_heads(p)
        q_rows, o_rows = s.block_q // heads, min(s.block_q // heads, ROWS_PER_CONSUMER)
        return _cached_tensor_maps(self._maps, key, lambda: (
            operand_map(p, "q", key[0], q_rows, heads, row_bytes),
            operand_map(p, "k", key[1], s.block_kv, 1, row_bytes),
            v_map(),
            operand_map(p, "o", key[3], o_rows, ROWS_PER_CONSUMER // o_rows, row_bytes),
        ))  # fmt: skip

    def _launch(self, q, k, v, out, stream: int, bias=None, factors=(), lse=None) -> None:
        import cupy
        import torch

        if self._transposed is not None:
            from cherenkov.codegen.cuda.flash_attention_sm90a import TRANSPOSE_THREADS, transpose_grid

            workspace, _, transpose = self._transposed
            with cupy.cuda.Device(self.device):
                transpose(transpose_grid(self.problem), (TRANSPOSE_THREADS, 1, 1),
                          (np.uint64(v.data_ptr()), np.uint64(workspace.data_ptr())), stream=self._stream(stream))
        maps = self._tensor_maps(q, k, v, out)
        pointers = (out,) + (() if bias is None else (bias,)) + tuple(factors) + (() if lse is None else (lse,))
        with torch.cuda.device(self.device):
            tensor_map.launch(self._function, self.grid, self.block, self.smem_bytes, stream,
                              (*maps, *(ctypes.c_uint64(t.data_ptr()) for t in pointers)))  # fmt: skip


class Fp8FlashKernel(FlashAttentionKernel):
    """:class:`FlashAttentionKernel` for a compiled 8-bit ``mma.sync`` plan
    (:mod:`cherenkov.codegen.cuda.flash_attention_fp8`): q, k, v as ``float8_e4m3fn`` tensors."""

    def __init__(self, compiled: CompiledKernel, device: int = 0):
        import cupy

        from cherenkov.codegen.cuda.flash_attention_fp8 import fp8_dynamic_smem, fp8_grid

        self.compiled = compiled
        self.problem = compiled.plan.problem
        self.device = device
        self.smem_bytes = fp8_dynamic_smem(compiled.plan)
        self.grid, threads = fp8_grid(compiled.plan)
        self.block = (threads, 1, 1)
        self._workspace = None
        with cupy.cuda.Device(device):
            module = cupy.RawModule(path=str(compiled.cubin_path))
            self._function = module.get_function(compiled.kernel_name)
            self._function.max_dynamic_shared_size_bytes = self.smem_bytes
        self._module = module


class FlashBackwardKernel(_StreamCache):
    """``kernel(q, k, v, grad_output, out=None) -> {role: tensor}``: one compiled flash-attention
    backward plan as a callable (its three launches on the current stream).

    q, k, v and dO are the stored tensors the operands are read from (shapes and dtypes as
    :meth:`~cherenkov.rewrites.plan_backward.AttentionBackwardProblem.stored_shapes` names
    them: contiguous CUDA tensors, 16-byte aligned); ``out`` may hold a tensor per gradient
    role (``dq``, ``dk``, ``dv``), the others are allocated. The kernel owns an fp32 workspace
    (each query row's log-sum-exp and D, the dq accumulator), so launches of one kernel object
    must not run concurrently on two streams. A plan whose statistics the forward saved
    (``saved_statistics``) also reads the saved ``o`` and ``lse`` (keywords; in ``launch``, by
    their names in the problem's :class:`~cherenkov.rewrites.plan_backward.SavedStatistics`); a
    problem with a bias tensor reads it (``bias``, at the strides its
    :class:`~cherenkov.rewrites.plan.AttentionBias` gives; in ``launch``, by its name)."""

    def __init__(self, compiled: CompiledKernel, device: int = 0):
        import cupy
        import torch

        from cherenkov.codegen.cuda.flash_attention_backward import grids, workspace_floats

        self.compiled = compiled
        self.problem = compiled.plan.problem
        self.device = device
        self.launches = grids(compiled.plan, _multiprocessors(device))
        names = {"statistics": "_statistics", "main": "", "dq": "_dq"}
        with cupy.cuda.Device(device):
            module = cupy.RawModule(path=str(compiled.cubin_path))
            self._functions = {step: module.get_function(compiled.kernel_name + suffix) for step, suffix in names.items()}
            for step, (_, _, smem) in self.launches.items():
                if smem > 48 * 1024:
                    self._functions[step].max_dynamic_shared_size_bytes = smem
        self._module = module
        self._workspace = torch.empty(workspace_floats(compiled.plan), dtype=torch.float32, device=f"cuda:{device}")

    def __call__(self, q, k, v, grad_output, out=None, steps: tuple[str, ...] = ("statistics", "main", "dq"),
                 o=None, lse=None, bias=None) -> dict:  # fmt: skip
        """The gradients; ``steps`` runs only some of the launches (``statistics``, ``main``, ``dq``: for
        timing them apart; the gradients are then those of the last full call)."""
        import torch

        p, a = self.problem, self.problem.attention
        name = self.compiled.kernel_name
        dtype = getattr(torch, TORCH_DTYPES[a.dtype])
        out = dict(out or {})
        for gradient in p.gradients:
            if gradient.role not in out:
                out[gradient.role] = torch.empty(gradient.layout.shape, dtype=dtype, device=q.device)
        checks = [("q", q, a.layout("q").shape, a.dtype), ("k", k, a.layout("k").shape, a.dtype),
                  ("v", v, a.layout("v").shape, a.dtype), ("dO", grad_output, p.grad_output_layout.shape, a.dtype),
                  *((g.role, out[g.role], g.layout.shape, a.dtype) for g in p.gradients)]  # fmt: skip
        saved = self.compiled.plan.schedule.saved_statistics
        if saved:
            if o is None or lse is None:
                raise CodegenError(f"{name}: reads the forward's saved o and lse; pass both (o=..., lse=...)")
            checks += [("o", o, p.saved.o_layout.shape, a.dtype), ("lse", lse, p.saved.lse_layout.shape, "fp32")]
        if a.bias is None and bias is not None:
            raise CodegenError(f"{name} reads no bias tensor; got one")
        if a.bias is not None:
            if bias is None:
                raise CodegenError(f"{name}: reads the bias tensor {a.bias.tensor}; pass it (bias=...)")
            checks.append(("bias", bias, a.bias.shape, a.bias.dtype))
        for role, tensor, shape, expected in checks:
            check_tensor(name, role, tensor, shape, expected, self.device)
        self._launch((q, k, v, grad_output), (o, lse) if saved else None, out,
                     torch.cuda.current_stream(q.device).cuda_stream, steps, bias if a.bias is not None else None)  # fmt: skip
        return {g.role: out[g.role] for g in p.gradients}

    def launch(self, buffers: Mapping[str, object]) -> dict:
        """The gradients of the problem's stored tensors in ``buffers`` (by name): ``{buffer name: tensor}``."""
        p, a = self.problem, self.problem.attention
        q, k, v, grad_output = (buffers[n] for n in (a.q, a.k, a.v, p.grad_output))
        saved = {"o": buffers[p.saved.o], "lse": buffers[p.saved.lse]} \
            if self.compiled.plan.schedule.saved_statistics else {}
        bias = {"bias": buffers[a.bias.tensor]} if a.bias is not None else {}
        values = self(q, k, v, grad_output, **saved, **bias)
        return {p.gradient(role).tensor: tensor for role, tensor in values.items()}

    def _launch(self, operands, saved, out: Mapping[str, object], stream: int, steps: tuple[str, ...],
                bias=None) -> None:  # fmt: skip
        """The launches of ``steps``: ``operands`` (q, k, v, dO), ``saved`` (o, lse, or None when recomputed),
        ``bias`` (the problem's bias tensor, or None without one)."""
        import cupy

        def pointer(tensor) -> np.uint64:
            return np.uint64(0 if tensor is None else tensor.data_ptr())

        operands = tuple(pointer(t) for t in operands)
        workspace = pointer(self._workspace)
        statistics = (*operands, workspace) if saved is None else (*(pointer(t) for t in saved), operands[3], workspace)
        tail = () if bias is None else (pointer(bias),)
        arguments = {
            "statistics": (*statistics, *tail),
            "main": (*operands, pointer(out.get("dk")), pointer(out.get("dv")), workspace, *tail),
            "dq": (workspace, pointer(out.get("dq"))),
        }
        with cupy.cuda.Device(self.device):
            for step, (grid, threads, smem) in self.launches.items():
                if step not in steps or (step == "dq" and "dq" not in out):
                    continue
                self._functions[step](grid, (threads, 1, 1), arguments[step], shared_mem=smem,
                                      stream=self._stream(stream))  # fmt: skip


def load_kernel(compiled: CompiledKernel, device: int = 0) -> FlashAttentionKernel | TermKernel | FlashBackwardKernel:
    """Load a compiled kernel onto CUDA device ``device`` and return it as a callable:
    a :class:`FlashAttentionKernel` (``kernel(q, k, v)``) for a flash-attention plan (a
    :class:`HopperFlashKernel` for the sm_90a family, a :class:`TmaFlashKernel` for TMA K/V
    copies), a :class:`FlashBackwardKernel` for a backward plan, a :class:`TermKernel`
    (``kernel(**tensors)``) for a term plan."""
    from cherenkov.codegen.term_plan import TermKernelPlan
    from cherenkov.rewrites.plan_backward import BackwardPlan
    from cherenkov.rewrites.plan_fp8 import Fp8FlashSchedule
    from cherenkov.rewrites.plan_sm90a import HopperFlashSchedule

    if isinstance(compiled.plan, TermKernelPlan):
        return TermKernel(compiled, device)
    if isinstance(compiled.plan, BackwardPlan):
        return FlashBackwardKernel(compiled, device)
    if isinstance(compiled.plan.schedule, HopperFlashSchedule):
        return HopperFlashKernel(compiled, device)
    if isinstance(compiled.plan.schedule, Fp8FlashSchedule):
        return Fp8FlashKernel(compiled, device)
    if compiled.plan.schedule.tma_kv:
        return TmaFlashKernel(compiled, device)
    return FlashAttentionKernel(compiled, device)
