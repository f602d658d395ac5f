"""Host side of TMA kernels: CUtensorMap encoding and ``cuLaunchKernel``, through ctypes.

The CUDA driver (``libcuda.so.1``) is loaded on first use; without it every call raises
:class:`CodegenError`. :func:`encode_tiled` wraps ``cuTensorMapEncodeTiled`` for 16-bit
tensors with the 128-byte swizzle; :func:`operand_tensor_map` views an attention operand
at its strides (a BHSD tensor, a transposed view, a slice of a fused projection) as the
4-D tensor ``(D, S, H, B)`` (innermost first) read in boxes of ``64 × rows × 1 × 1`` — 64
elements (128 bytes) is the widest box the 128-byte swizzle allows, so a 128-wide head dim
takes two boxes. :func:`launch` calls ``cuLaunchKernel``
with a CUfunction handle from cupy (``RawModule(...).get_function(name).kernel.ptr``): each
argument is a ctypes value (``c_uint64`` for a device pointer, :class:`TensorMap` by
value), and ``kernelParams`` is the array of their addresses. Any ``CUresult`` other
than 0 raises :class:`CodegenError` naming the call and the driver's error string.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from collections.abc import Sequence

from cherenkov.codegen.errors import CodegenError

log = logging.getLogger(__name__)

TENSOR_MAP_BYTES = 128
TENSOR_MAP_ALIGN = 64
DATA_TYPES = {"fp16": 6, "bf16": 9, "fp8_e4m3": 0}  # CU_TENSOR_MAP_DATA_TYPE_FLOAT16 / _BFLOAT16 / _UINT8
ELEMENT_BYTES = {"fp16": 2, "bf16": 2, "fp8_e4m3": 1}
INTERLEAVE_NONE = 0
SWIZZLE_MODES = {64: 2, 128: 3}  # box row bytes -> CU_TENSOR_MAP_SWIZZLE_64B / _128B
L2_PROMOTION_256B = 3  # CU_TENSOR_MAP_L2_PROMOTION_L2_256B
OOB_FILL_ZERO = 0  # CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE: out-of-bounds elements read as zero
SWIZZLE_BYTES = 128
FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8


class TensorMap(ctypes.Structure):
    """A CUtensorMap: 128 opaque bytes (the driver wants its address 64-byte aligned)."""

    _fields_ = [("words", ctypes.c_uint64 * (TENSOR_MAP_BYTES // 8))]


@functools.cache
def _driver() -> ctypes.CDLL:
    for name in ("libcuda.so.1", "libcuda.so"):
        try:
            lib = ctypes.CDLL(name)
            break
        except OSError:
            continue
    else:
        raise CodegenError("the CUDA driver library (libcuda.so.1) could not be loaded: TMA kernels need a GPU driver")
    u32, u64, ptr = ctypes.c_uint32, ctypes.c_uint64, ctypes.c_void_p
    lib.cuGetErrorString.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
    lib.cuTensorMapEncodeTiled.argtypes = [
        ptr, ctypes.c_int, u32, ptr, ctypes.POINTER(u64), ctypes.POINTER(u64), ctypes.POINTER(u32),
        ctypes.POINTER(u32), ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int,
    ]  # fmt: skip
    lib.cuLaunchKernel.argtypes = [
        ptr, u32, u32, u32, u32, u32, u32, u32, ptr, ctypes.POINTER(ptr), ctypes.POINTER(ptr),
    ]  # fmt: skip
    lib.cuFuncSetAttribute.argtypes = [ptr, ctypes.c_int, ctypes.c_int]
    for fn in (lib.cuGetErrorString, lib.cuTensorMapEncodeTiled, lib.cuLaunchKernel, lib.cuFuncSetAttribute):
        fn.restype = ctypes.c_int
    return lib


def _check(call: str, result: int) -> None:
    if result != 0:
        text = ctypes.c_char_p()
        _driver().cuGetErrorString(result, ctypes.byref(text))
        reason = text.value.decode() if text.value else "unknown error"
        raise CodegenError(f"{call} failed: CUresult {result} ({reason})")


def _aligned_tensor_map() -> TensorMap:
    """A zeroed TensorMap at a 64-byte-aligned address (its backing buffer rides along)."""
    buffer = ctypes.create_string_buffer(TENSOR_MAP_BYTES + TENSOR_MAP_ALIGN)
    address = (ctypes.addressof(buffer) + TENSOR_MAP_ALIGN - 1) & ~(TENSOR_MAP_ALIGN - 1)
    tensor_map = TensorMap.from_address(address)
    tensor_map._buffer = buffer  # keep the memory alive as long as the map
    return tensor_map


def encode_tiled(
    address: int, dtype: str, dims: Sequence[int], strides: Sequence[int], box: Sequence[int],
    swizzle_bytes: int = SWIZZLE_BYTES,
) -> TensorMap:
    """``cuTensorMapEncodeTiled`` for a 16- or 8-bit tensor with the 128-byte swizzle (or the
    64-byte one: ``swizzle_bytes`` 64).

    ``dims`` are the sizes innermost first (the innermost contiguous), ``strides`` the
    byte strides of dims 1.. (multiples of 16), ``box`` the box size a copy moves (its
    innermost extent at most ``swizzle_bytes``). Out-of-bounds elements of a box read as zero.
    """
    if dtype not in DATA_TYPES:
        raise CodegenError(f"tensor map dtype {dtype!r} (valid: {', '.join(DATA_TYPES)})")
    rank = len(dims)
    if not 1 <= rank <= 5 or len(strides) != rank - 1 or len(box) != rank:
        raise CodegenError(f"tensor map of rank {rank}: {rank - 1} strides and {rank} box sizes expected")
    if address % 16 or any(s % 16 for s in strides):
        raise CodegenError(f"tensor map address {address:#x} and strides {list(strides)} must be 16-byte aligned")
    if swizzle_bytes not in SWIZZLE_MODES:
        raise CodegenError(f"swizzle of {swizzle_bytes} bytes (valid: {', '.join(map(str, SWIZZLE_MODES))})")
    if box[0] * ELEMENT_BYTES[dtype] > swizzle_bytes or any(not 1 <= b <= 256 for b in box):
        raise CodegenError(f"box {list(box)}: inner extent at most {swizzle_bytes} bytes, every extent in 1..256")
    tensor_map = _aligned_tensor_map()
    u32, u64 = ctypes.c_uint32, ctypes.c_uint64
    element_strides = (u32 * rank)(*([1] * rank))
    result = _driver().cuTensorMapEncodeTiled(
        ctypes.addressof(tensor_map), DATA_TYPES[dtype], rank, ctypes.c_void_p(address),
        (u64 * rank)(*dims), (u64 * max(1, rank - 1))(*strides), (u32 * rank)(*box), element_strides,
        INTERLEAVE_NONE, SWIZZLE_MODES[swizzle_bytes], L2_PROMOTION_256B, OOB_FILL_ZERO,
    )  # fmt: skip
    _check("cuTensorMapEncodeTiled", result)
    return tensor_map


def operand_tensor_map(address: int, logical: Sequence[int], strides: Sequence[int], offset: int, dtype: str,
                       box_rows: int, box_heads: int = 1, row_bytes: int = SWIZZLE_BYTES) -> TensorMap:  # fmt: skip
    """The tensor map of an attention operand of ``logical`` shape ``(B, H, S, D)`` whose
    element ``(b, h, s, d)`` lies at ``offset + b·strides[0] + h·strides[1] + s·strides[2] +
    d`` elements from ``address``: 4-D ``(D, S, H, B)`` with boxes of ``row_bytes`` (128: 64
    16-bit elements, swizzled as wide) ``× box_rows × box_heads × 1`` (coordinates ``(d, s, h,
    b)`` in the kernel; a box of several heads lands as their row blocks one after another).
    An axis of extent 1 gets a stride that never moves (its coordinate is always 0)."""
    batch, heads, seq, head_dim = logical
    elem = ELEMENT_BYTES.get(dtype, 2)
    sizes = {"b": batch, "h": heads, "s": seq}
    byte_strides = dict(zip("bhs", (stride * elem for stride in strides)))
    still = max(16, *(byte_strides[axis] * sizes[axis] for axis in "bhs"))  # multiples of 16 already
    moving = {axis: byte_strides[axis] if sizes[axis] > 1 else still for axis in "bhs"}
    return encode_tiled(
        address + offset * elem, dtype, (head_dim, seq, heads, batch), (moving["s"], moving["h"], moving["b"]),
        (row_bytes // elem, box_rows, box_heads, 1), row_bytes,
    )  # fmt: skip


def set_max_dynamic_smem(function: int, nbytes: int) -> None:
    """Allow ``function`` (a CUfunction handle) ``nbytes`` of dynamic shared memory."""
    _check(
        "cuFuncSetAttribute(MAX_DYNAMIC_SHARED_SIZE_BYTES)",
        _driver().cuFuncSetAttribute(ctypes.c_void_p(function), FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, nbytes),
    )


def launch(
    function: int,
    grid: tuple[int, int, int],
    block: tuple[int, int, int],
    smem_bytes: int,
    stream: int,
    args: Sequence[ctypes.Structure | ctypes._SimpleCData],
) -> None:
    """``cuLaunchKernel(function, grid, block, smem_bytes, stream, args)``; each argument is
    a ctypes value whose bytes are the parameter (a TensorMap is passed by value)."""
    params = (ctypes.c_void_p * len(args))(*[ctypes.addressof(a) for a in args])
    result = _driver().cuLaunchKernel(
        ctypes.c_void_p(function), *grid, *block, smem_bytes, ctypes.c_void_p(stream), params, None
    )
    _check("cuLaunchKernel", result)
