"""Tensor-core matrix multiply-accumulate (``mma.sync.aligned.m16n8k16``) and operand packing.

Fragment layout (lane ``l``, ``g = l / 4``, ``t = l % 4``): A 16×16 in four b32 registers,
a[0] (row g, k 2t..2t+1), a[1] (row g+8, same k), a[2] (row g, k 2t+8..), a[3] (row g+8,
k 2t+8..); B 16×8 in two, b[0] (k 2t..2t+1, col g), b[1] (k 2t+8.., col g); the fp32
accumulator 16×8 in four floats, c[0..1] (row g, cols 2t, 2t+1), c[2..3] (row g+8, same).
Two adjacent accumulator n8 tiles are therefore exactly one A fragment once packed to
16-bit pairs, which is how P stays in registers between the two matmuls.
"""

from __future__ import annotations

from cherenkov.codegen.cuda.text import block

PTX_TYPES = {"bf16": "bf16", "fp16": "f16"}
ONE_PAIRS = {"bf16": 0x3F803F80, "fp16": 0x3C003C00}  # two 1.0 of the type in one b32 register


def emit_mma(dtype: str) -> str:
    """``mma_16816``: d += a·b with ``dtype`` operands and fp32 accumulators."""
    ptx = PTX_TYPES[dtype]
    return block(
        f"""
        // d (16x8, fp32) += a (16x16, {dtype}, row-major) * b (16x8, {dtype}, column-major).
        __device__ __forceinline__ void mma_16816(float (&d)[4], const u32 (&a)[4], u32 b0, u32 b1) {{
            asm volatile(
                "mma.sync.aligned.m16n8k16.row.col.f32.{ptx}.{ptx}.f32 "
                "{{%0, %1, %2, %3}}, {{%4, %5, %6, %7}}, {{%8, %9}}, {{%0, %1, %2, %3}};\\n"
                : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
        }}

        // d = a * b (the accumulator starts at zero: no zeroing instructions, and d is not live
        // before this mma, which keeps register pressure down where mmas are interleaved).
        __device__ __forceinline__ void mma_16816_zero(float (&d)[4], const u32 (&a)[4], u32 b0, u32 b1) {{
            asm volatile(
                "mma.sync.aligned.m16n8k16.row.col.f32.{ptx}.{ptx}.f32 "
                "{{%0, %1, %2, %3}}, {{%4, %5, %6, %7}}, {{%8, %9}}, {{%10, %10, %10, %10}};\\n"
                : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
                : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1), "f"(0.0f));
        }}
        """
    )


def emit_pack(dtype: str) -> str:
    """``pack2``: two floats rounded to one b32 register of ``dtype`` (low half first)."""
    ptx = PTX_TYPES[dtype]
    return block(
        f"""
        // Round two floats to {dtype} (nearest even) and pack them, `lo` in the low 16 bits.
        __device__ __forceinline__ u32 pack2(float lo, float hi) {{
            u32 r;
            asm("cvt.rn.{ptx}x2.f32 %0, %1, %2;\\n" : "=r"(r) : "f"(hi), "f"(lo));
            return r;
        }}
        """
    )


def emit_mma_from(dtype: str) -> str:
    """``mma_16816_from``: d = a·b + c with the accumulator's rows g and g + 8 starting from
    ``c0`` and ``c1`` (one value a row, as a thread's two rows of an m16 tile)."""
    ptx = PTX_TYPES[dtype]
    return block(
        f"""
        // d = a * b + c, where c is c0 on row g and c1 on row g + 8 (no copies into d first).
        __device__ __forceinline__ void mma_16816_from(float (&d)[4], const u32 (&a)[4], u32 b0, u32 b1, float c0,
                                                       float c1) {{
            asm volatile(
                "mma.sync.aligned.m16n8k16.row.col.f32.{ptx}.{ptx}.f32 "
                "{{%0, %1, %2, %3}}, {{%4, %5, %6, %7}}, {{%8, %9}}, {{%10, %10, %11, %11}};\\n"
                : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
                : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1), "f"(c0), "f"(c1));
        }}
        """
    )


def emit_one_pair(dtype: str) -> str:
    """``ONE_PAIR``: a B fragment register of ones (two ``dtype`` 1.0), so that ``A · ones``
    sums each row of A into every column of the accumulator."""
    return f"constexpr u32 ONE_PAIR = 0x{ONE_PAIRS[dtype]:08x}u;  // two {dtype} 1.0: a B operand of ones"


def emit_unpack(dtype: str) -> str:
    """``unpack_lo`` / ``unpack_hi``: the two ``dtype`` halves of a b32 register as floats (exact)."""
    if dtype == "bf16":
        body = """
        // The low / high bf16 of a pair as a float: its bits are the float's upper half.
        __device__ __forceinline__ float unpack_lo(u32 pair) { return __uint_as_float(pair << 16); }
        __device__ __forceinline__ float unpack_hi(u32 pair) { return __uint_as_float(pair & 0xffff0000u); }
        """
    else:
        body = """
        // The low / high fp16 of a pair as a float.
        __device__ __forceinline__ float unpack_lo(u32 pair) {
            float x;
            asm("{ .reg .f16 lo, hi; mov.b32 {lo, hi}, %1; cvt.f32.f16 %0, lo; }\\n" : "=f"(x) : "r"(pair));
            return x;
        }
        __device__ __forceinline__ float unpack_hi(u32 pair) {
            float x;
            asm("{ .reg .f16 lo, hi; mov.b32 {lo, hi}, %1; cvt.f32.f16 %0, hi; }\\n" : "=f"(x) : "r"(pair));
            return x;
        }
        """
    return block(body)
