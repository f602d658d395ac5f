"""Warpgroup matrix multiply-accumulate (``wgmma.mma_async``, sm_90a) and shared-memory
matrix descriptors.

One ``wgmma.mma_async.sync.aligned.m64nNk16.f32.{bf16,f16}.{bf16,f16}`` is issued by the
four warps of a warpgroup together: D (64 × N, fp32) += A (64 × 16) · B (16 × N). B is
read from shared memory through a 64-bit matrix descriptor; A either likewise (``ss``) or
from registers (``rs``). The instruction is asynchronous: ``wgmma.fence`` orders earlier
register writes of the operands before it, ``commit_group`` closes a group of issued
wgmmas and ``wait_group N`` waits until at most N groups are still in flight.

Register layouts (lane ``l`` of warp ``w`` in the warpgroup, ``g = l / 4``, ``t = l % 4``):
warp ``w`` owns rows ``16w .. 16w + 15``. The fp32 accumulator is ``N / 2`` floats a
thread, for each column block ``c`` of 8: ``d[4c + 0..1]`` = row ``16w + g``, columns
``8c + 2t, 8c + 2t + 1``; ``d[4c + 2..3]`` = row ``16w + g + 8``, same columns, i.e.
``mma.sync``'s m16n8 C fragment repeated over N / 8. A in registers is four b32 (two
16-bit values each) in ``mma.sync``'s m16k16 A layout. So the packed pairs
``pack(d[2i], d[2i + 1])`` of an accumulator, taken in order, are exactly the A operands
of a following wgmma, four registers per k16 step.

Shared-memory matrix descriptor (64 bits), as the PTX ISA defines it:

====== ================================================================================
bits   field
====== ================================================================================
0–13   start address >> 4 (shared-window byte address, 16-byte aligned)
16–29  leading-dimension byte offset (LBO) >> 4
32–45  stride-dimension byte offset (SBO) >> 4
49–51  base offset (0 when each swizzle pattern starts on a 1024-byte boundary)
62–63  swizzle mode: 0 none, 1 128-byte, 2 64-byte, 3 32-byte
====== ================================================================================

With the 128-byte swizzle a tile is made of 1024-byte atoms of 8 rows × 128 bytes (64
16-bit elements a row); the hardware XORs address bits 4–6 with bits 7–9, exactly as the
TMA's ``CU_TENSOR_MAP_SWIZZLE_128B`` stores them, so tiles must be 1024-byte aligned.

* K-major operand (rows of M or N, K contiguous; Q and K here): SBO = 1024 (from one group
  of 8 rows to the next); LBO is unused by swizzled K-major layouts (encoded as 1). A k16
  step is 32 bytes of each row: the start address advances by 32 inside the 128-byte row
  (the swizzle is applied to the computed address, so this is exact), and by a whole
  64-column box past every fourth step.
* MN-major operand (K rows, N contiguous; V here, with ``imm-trans-b = 1``): SBO = 1024
  (from one group of 8 K rows to the next), LBO = the offset from one 64-column box of N to
  the next. A k16 step is 16 rows: the start address advances by 2048 bytes.

The 64-byte swizzle (tiles of head dim 32 in 16 bits) is the same with rows of 64 bytes: atoms
of 8 rows × 64 bytes (512), address bits 4–5 XORed with bits 7–8, SBO = 512, two k16 steps a
row of a K-major tile, and a k16 step of an MN-major tile 1024 bytes.
"""

from __future__ import annotations

from cherenkov.codegen.cuda.mma import PTX_TYPES
from cherenkov.codegen.cuda.text import block
from cherenkov.codegen.errors import CodegenError

SWIZZLE_MODES = {"none": 0, "128B": 1, "64B": 2, "32B": 3}
DESCRIPTOR_FIELD_MASK = 0x3FFF  # 14-bit address / offset fields (bytes >> 4)


def smem_descriptor(address: int, lbo: int, sbo: int, swizzle: str = "128B", base_offset: int = 0) -> int:
    """The 64-bit wgmma descriptor of a shared-memory matrix (the Python twin of the
    emitted ``make_smem_desc``; used by tests and for documentation)."""
    for name, value in (("address", address), ("lbo", lbo), ("sbo", sbo)):
        if value % 16 or not 0 <= value < 1 << 18:
            raise CodegenError(f"descriptor {name} {value} must be a multiple of 16 below 256 KiB")
    if swizzle not in SWIZZLE_MODES or not 0 <= base_offset < 8:
        raise CodegenError(f"descriptor swizzle {swizzle!r} / base offset {base_offset} invalid")
    return (
        (address >> 4)
        | (lbo >> 4) << 16
        | (sbo >> 4) << 32
        | base_offset << 49
        | SWIZZLE_MODES[swizzle] << 62
    )


def emit_descriptor(row_bytes: int = 128) -> str:
    """``make_smem_desc(address, lbo, sbo)``: a descriptor of tiles swizzled in rows of
    ``row_bytes`` (128: the 128-byte swizzle; 64: the 64-byte one, whose atoms are 8 rows of 64
    bytes); see the module docstring for the encoding."""
    if row_bytes not in (64, 128):
        raise CodegenError(f"swizzled rows of {row_bytes} bytes (valid: 64, 128)")
    mode = SWIZZLE_MODES[f"{row_bytes}B"]
    atom = 8 * row_bytes
    return block(
        f"""
        // 64-bit wgmma matrix descriptor of a {row_bytes}-byte-swizzled shared-memory tile:
        //   bits  0-13  start address >> 4     bits 16-29  leading byte offset (LBO) >> 4
        //   bits 32-45  stride byte offset >> 4 bits 49-51  base offset (0: 1024-byte aligned atoms)
        //   bits 62-63  swizzle mode, {mode} = {row_bytes}-byte swizzle.
        // K-major tiles: SBO = {atom} (8 rows of {row_bytes} bytes), LBO unused (1). MN-major tiles:
        // SBO = {atom} (8 K rows), LBO = bytes from one {row_bytes // 2}-column box of N to the next.
        // Adding (bytes >> 4) to a descriptor moves its start address (no carry out of the field
        // while the address stays below 256 KiB).
        __device__ __forceinline__ unsigned long long make_smem_desc(u32 address, u32 lbo, u32 sbo) {{
            return (unsigned long long)((address >> 4) & 0x3FFFu)
                 | (unsigned long long)((lbo >> 4) & 0x3FFFu) << 16
                 | (unsigned long long)((sbo >> 4) & 0x3FFFu) << 32
                 | {mode}ull << 62;
        }}
        """
    )


def emit_sync() -> str:
    """``wgmma_fence``, ``wgmma_commit``, ``wgmma_wait<N>`` and ``fence_operands`` (pins
    accumulator / operand registers so the compiler does not move their reads or writes
    across an asynchronous wgmma)."""
    return block(
        """
        // Order earlier register writes (accumulators, register A operands) before the next wgmma.
        __device__ __forceinline__ void wgmma_fence() {
            asm volatile("wgmma.fence.sync.aligned;\\n" ::: "memory");
        }

        // Close the group of wgmmas issued since the last commit.
        __device__ __forceinline__ void wgmma_commit() {
            asm volatile("wgmma.commit_group.sync.aligned;\\n" ::: "memory");
        }

        // Wait until at most N committed groups are still in flight.
        template <int N>
        __device__ __forceinline__ void wgmma_wait() {
            asm volatile("wgmma.wait_group.sync.aligned %0;\\n" :: "n"(N) : "memory");
        }

        // Keep the compiler from moving accesses of these registers across a wgmma boundary.
        template <int N>
        __device__ __forceinline__ void fence_operands(float (&r)[N]) {
            #pragma unroll
            for (int i = 0; i < N; ++i) asm volatile("" : "+f"(r[i]) :: "memory");
        }

        template <int N>
        __device__ __forceinline__ void fence_operands(u32 (&r)[N]) {
            #pragma unroll
            for (int i = 0; i < N; ++i) asm volatile("" : "+r"(r[i]) :: "memory");
        }
        """
    )


WGMMA_K = {"bf16": 16, "fp16": 16, "fp8_e4m3": 32}
"""The K of one wgmma: 32 bytes of each operand row (16 16-bit or 32 8-bit elements)."""
WGMMA_TYPES = {**PTX_TYPES, "fp8_e4m3": "e4m3"}


def wgmma_name(n: int, dtype: str, a_from_registers: bool, trans_b: bool, trans_a: bool = False) -> str:
    """``wgmma_m64n128k16_ss_bf16`` (``rs``: A from registers; ``_ta``: A MN-major; ``_tb``:
    B MN-major; 8-bit operands: ``k32``)."""
    mode = "rs" if a_from_registers else "ss"
    return f"wgmma_m64n{n}k{WGMMA_K[dtype]}_{mode}_{dtype}{'_ta' if trans_a else ''}{'_tb' if trans_b else ''}"


def emit_wgmma(n: int, dtype: str, a_from_registers: bool, trans_b: bool, trans_a: bool = False) -> str:
    """One wgmma wrapper: ``d (64 x n, fp32) (+)= A · B``; ``scale_d`` 0 ignores d's old value.

    ``a_from_registers``: A is four b32 registers (``a0..a3``), else a descriptor, K-major
    or, with ``trans_a``, MN-major (``imm-trans-a = 1``); ``trans_b``: B's descriptor is
    MN-major (``imm-trans-b = 1``), else K-major.
    """
    if n % 8 or not 8 <= n <= 256:
        raise CodegenError(f"wgmma N {n} is not a multiple of 8 in 8..256")
    if trans_a and a_from_registers:
        raise CodegenError("wgmma: only an A operand in shared memory can be MN-major (transposed)")
    if WGMMA_K[dtype] != 16 and (trans_a or trans_b):
        raise CodegenError(f"wgmma: {dtype} operands must be K-major (no transposed descriptors)")
    ptx, k = WGMMA_TYPES[dtype], WGMMA_K[dtype]
    regs = n // 2
    chunks = [",".join(f"%{i}" for i in range(j, min(j + 16, regs))) for j in range(0, regs, 16)]
    acc = "\n".join(f'{" " * 16}"{"{" if j == 0 else ""}{c}{"}, " if j == len(chunks) - 1 else ","}"'
                     for j, c in enumerate(chunks))
    acc_lines = "\n".join(
        " " * 16 + ", ".join(f'"+f"(d[{i}])' for i in range(j, min(j + 8, regs))) + ("," if j + 8 < regs else "")
        for j in range(0, regs, 8)
    )
    if a_from_registers:
        a_operand = "{" + ",".join(f"%{regs + i}" for i in range(4)) + "}"
        b_index, scale_index = regs + 4, regs + 5
        inputs = '"r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(desc_b), "r"(scale_d)'
        a_param = "u32 a0, u32 a1, u32 a2, u32 a3"
        tail = f"p, 1, 1, {int(trans_b)}" if k == 16 else "p, 1, 1"  # 8-bit: no transpose immediates
        what = f"A (64x{k}) from registers"
    else:
        a_operand = f"%{regs}"
        b_index, scale_index = regs + 1, regs + 2
        inputs = '"l"(desc_a), "l"(desc_b), "r"(scale_d)'
        a_param = "unsigned long long desc_a"
        tail = f"p, 1, 1, {int(trans_a)}, {int(trans_b)}" if k == 16 else "p, 1, 1"
        what = f"A (64x{k}, {'MN' if trans_a else 'K'}-major) from shared memory"
    name = wgmma_name(n, dtype, a_from_registers, trans_b, trans_a)
    layout = "MN-major" if trans_b else "K-major"
    return block(
        f"""
        // d (64x{n}, fp32) = d * (scale_d != 0) + A * B: {what}, B ({k}x{n}, {layout}) from shared memory.
        __device__ __forceinline__ void {name}(float (&d)[{regs}], {a_param}, unsigned long long desc_b, int scale_d) {{
            asm volatile(
                "{{\\n"
                ".reg .pred p;\\n"
                "setp.ne.b32 p, %{scale_index}, 0;\\n"
                "wgmma.mma_async.sync.aligned.m64n{n}k{k}.f32.{ptx}.{ptx} "
{acc}
                "{a_operand}, %{b_index}, {tail};\\n"
                "}}\\n"
                :
{acc_lines}
                : {inputs});
        }}
        """
    )


def k_step_wgmmas(mma_name: str) -> list[str]:
    """The wgmmas of one GEMM k step from ring buffer ``stage`` into ``acc[mi]``: ``BK / 16``
    k16 steps × ``M_TILES`` m64 tiles, both operands through the descriptors ``a_desc`` and
    ``b_desc`` of buffer 0 (the kernel defines those and the byte constants ``A_TILE_BYTES``,
    ``B_TILE_BYTES``, ``BOX_BYTES``, ``A_K_STEP``, ``B_K_STEP``)."""
    return [
        "#pragma unroll",
        "for (int kk = 0; kk < BK / 16; ++kk) {",
        "    #pragma unroll",
        "    for (int mi = 0; mi < M_TILES; ++mi) {",
        "        const u32 a_bytes = stage * A_TILE_BYTES + mi * BOX_BYTES + kk * A_K_STEP;",
        "        const u32 b_bytes = stage * B_TILE_BYTES + kk * B_K_STEP;",
        f"        {mma_name}(acc[mi], a_desc + (a_bytes >> 4), b_desc + (b_bytes >> 4), 1);",
        "    }",
        "}",
    ]
