"""An absorbed RMSNorm in a GEMM's A fragments (:class:`~cherenkov.codegen.term_plan.NormPrologue`).

A GEMM that absorbed the RMSNorm feeding it reads ``x`` as its A operand and holds it in
registers in ``mma.sync``'s m16k16 fragment layout, which is also ``wgmma``'s register-A
layout: of lane ``l`` (``g = l / 4``, ``t = l % 4``), registers 0 and 2 are row ``g`` at k
``2t, 2t + 1`` and ``2t + 8, 2t + 9``, registers 1 and 3 the same of row ``g + 8``. Per k16
step a thread adds the squares of its x values to its two rows' sums and multiplies the
values by the weight's pairs; after the last step the lane quad's sums give each row's
scale ``(Σ_k x²/K + ε)^{-1/2}``, which the epilogue multiplies into the accumulators (the
scale does not depend on k, so it may wait until the sum is done).

The kernels define ``K`` (the contracted extent) before the kernel and call these pieces;
the sums are ``row_ss[tiles][2][2]`` (two rows, two FMA chains each).
"""

from __future__ import annotations

from cherenkov.codegen.cuda.mma import PTX_TYPES
from cherenkov.codegen.cuda.term_expr import float_constant
from cherenkov.codegen.cuda.text import block


def emit_norm_helpers(dtype: str) -> str:
    """``add_squares``, ``scale_pair`` and ``weight_pair`` for 16-bit ``dtype`` fragments."""
    ptx = PTX_TYPES[dtype]
    return block(f"""
        // Add the squares of a packed pair of {dtype} values to two running sums (two chains).
        __device__ __forceinline__ void add_squares(float (&sums)[2], u32 v) {{
            const float lo = ck_from_{dtype}(u16(v & 0xffffu)), hi = ck_from_{dtype}(u16(v >> 16));
            sums[0] = fmaf(lo, lo, sums[0]);
            sums[1] = fmaf(hi, hi, sums[1]);
        }}

        // The packed pair times the weight's packed pair, each product rounded to {dtype}
        // (x * w + -0: exact products of 16-bit values, one rounding).
        __device__ __forceinline__ u32 scale_pair(u32 v, u32 w) {{
            u32 r;
            asm("fma.rn.{ptx}x2 %0, %1, %2, %3;" : "=r"(r) : "r"(v), "r"(w), "r"(0x80008000u));
            return r;
        }}

        // Weight elements k and k + 1 as a packed pair; indices past `last` read element `last`
        // (the x values they multiply are zero there).
        __device__ __forceinline__ u32 weight_pair(const u16* __restrict__ w, int k, int last) {{
            return u32(__ldg(w + min(k, last))) | (u32(__ldg(w + min(k + 1, last))) << 16);
        }}
        """)


def norm_constants(eps: float) -> str:
    return f"constexpr float NORM_INV_K = 1.0f / K, NORM_EPS = {float_constant(eps)};  // the absorbed RMSNorm"


def fragment_prologue(fragment: str, sums: str, weights: tuple[str, str] | None) -> list[str]:
    """Statements for one m16k16 fragment ``fragment`` (four ``u32``): its squares into
    ``sums`` (``[2][2]``: rows g and g + 8), then, with ``weights`` (the pairs at k ``2t``
    and ``2t + 8``), the fragment scaled in place."""
    lines = [
        f"add_squares({sums}[0], {fragment}[0]);  // row g",
        f"add_squares({sums}[0], {fragment}[2]);",
        f"add_squares({sums}[1], {fragment}[1]);  // row g + 8",
        f"add_squares({sums}[1], {fragment}[3]);",
    ]
    if weights is not None:
        low, high = weights
        lines += [
            f"{fragment}[0] = scale_pair({fragment}[0], {low});",
            f"{fragment}[1] = scale_pair({fragment}[1], {low});",
            f"{fragment}[2] = scale_pair({fragment}[2], {high});",
            f"{fragment}[3] = scale_pair({fragment}[3], {high});",
        ]
    return lines


def row_scales(tiles: str) -> list[str]:
    """``row_scale[tiles][2]`` from ``row_ss[tiles][2][2]``: the quad's partial sums added,
    then ``(Σx²/K + ε)^{-1/2}`` (all four lanes of a quad hold the same scales)."""
    return [
        "// the norm's row scales: each quad of lanes holds the partial sums of rows g and g + 8",
        f"float row_scale[{tiles}][2];",
        "#pragma unroll",
        f"for (int mi = 0; mi < {tiles}; ++mi)",
        "    #pragma unroll",
        "    for (int h = 0; h < 2; ++h) {",
        "        float ss = row_ss[mi][h][0] + row_ss[mi][h][1];",
        "        ss += __shfl_xor_sync(0xffffffffu, ss, 1);",
        "        ss += __shfl_xor_sync(0xffffffffu, ss, 2);",
        "        row_scale[mi][h] = rsqrtf(ss * NORM_INV_K + NORM_EPS);",
        "    }",
    ]
