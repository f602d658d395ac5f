"""A flash-attention problem's score modifiers in both flash families: the bias tensor's
constants and reader, and the soft cap.

An :class:`~cherenkov.rewrites.plan.AttentionBias` (an additive mask, as transformers
hands SDPA) is read in place, one element per score, where the kernel masks its scores
(every key tile, not only the diagonal and tail ones). The reader returns the element in
the scores' own units: the kernels keep raw ``q·k`` scores (scaled by ``SCALE_LOG2`` in the
softmax) or, with a pre-scaled Q, exponents in log2 units, so a bias ``b`` becomes
``b · BIAS_SCALE`` with ``BIAS_SCALE`` = ``1 / scale`` or ``log2 e``. A finite bias stays
finite, at least ``−2^100``: a score plus that floor is the floor itself (the score is
below half its ulp), and the floor times any scale is exact, so the softmax's
``fma(s, c, −m·c)`` of a row such a bias masks wholly is exactly 0 for every key and the
row averages its keys, as PyTorch's math does with transformers' lowest-value mask (at
``−FLT_MAX`` the fma's rounding error alone would be ~2^100). ``−∞`` masks the score, and
a row without a live score gives 0.

A soft cap ``c`` (Gemma 2's) replaces each score ``x`` by ``c·tanh(x / c)`` before the mask: the
kernels apply it to the raw scores where the QKᵀ product leaves them, in the same raw units
(``soft_cap``), so the softmax, the bias and the row statistics are unchanged.
"""

from __future__ import annotations

import math

from cherenkov.codegen.cuda.text import block, float_literal, identifier
from cherenkov.rewrites.plan import AttentionProblem

# The C++ type a bias element is read as, and how it becomes a float.
_ELEMENT = {
    "bf16": ("unsigned short", "__uint_as_float(u32(raw) << 16)"),
    "fp16": ("unsigned short", "half_bits_to_float(raw)"),
    "fp32": ("float", "raw"),
}


def score_formula(problem: AttentionProblem) -> str:
    """The scores in a kernel header's formula: ``scale * q k^T``, soft-capped where the problem is."""
    scores = f"scale * {identifier(problem.q)} {identifier(problem.k)}^T"
    if problem.softcap:
        return f"{problem.softcap:.9g} * tanh({scores} / {problem.softcap:.9g})"
    return scores


def emit_soft_cap(problem: AttentionProblem, scale: float) -> str:
    """``soft_cap(s)``: a raw score ``s`` (``q·k``, unscaled) soft-capped, ``c·tanh(scale·s / c) /
    scale``, raw again (empty without a soft cap); ``scale`` the problem's softmax scale. And
    ``soft_cap_slope(capped)``: the cap's slope ``1 − tanh²`` at a capped score, which a backward's dS gains.
    ``tanh(y) = 1 − 2 / (2^(2y·log2 e) + 1)``: an FMUL, an ex2 and a fast division a score, with
    an absolute error of a few fp32 ulp of 1 (the expression underflows and saturates cleanly
    to ±c)."""
    if not problem.softcap:
        return ""
    exponent = 2.0 * math.log2(math.e) * scale / problem.softcap
    return block(
        f"""
        // The soft cap {problem.softcap:.9g}: a raw score s becomes (cap / scale) * tanh(s * scale / cap), raw again.
        constexpr float SOFTCAP_RAW = {float_literal(problem.softcap / scale)};  // cap / scale: the raw scores' bound
        constexpr float SOFTCAP_EXP2 = {float_literal(exponent)};  // 2 log2(e) scale / cap
        __device__ __forceinline__ float soft_cap(float s) {{
            return SOFTCAP_RAW - __fdividef(2.0f * SOFTCAP_RAW, fast_exp2(s * SOFTCAP_EXP2) + 1.0f);
        }}
        // 1 - tanh^2 at a capped score (tanh = capped / SOFTCAP_RAW): the cap's slope.
        __device__ __forceinline__ float soft_cap_slope(float capped) {{
            const float tanh_of_score = capped * (1.0f / SOFTCAP_RAW);
            return 1.0f - tanh_of_score * tanh_of_score;
        }}
        """
    )


def mask_clause(problem: AttentionProblem) -> str:
    """The mask in a kernel header's formula: `` + <bias>``, `` + causal mask`` (with any window),
    both or empty."""
    bias = f" + {identifier(problem.bias.tensor)}" if problem.bias is not None else ""
    window = f" (window {problem.window})" if problem.window else ""
    return bias + (f" + causal mask{window}" if problem.causal else "")


def emit_mask_constants(problem: AttentionProblem, factor: float, why: str) -> str:
    """``BIAS`` (whether the problem reads a bias tensor) and, when it does, the tensor's
    element type, strides and ``BIAS_SCALE = factor``, which brings a bias to the scores'
    units (``why`` says which those are)."""
    bias = problem.bias
    if bias is None:
        return "constexpr bool BIAS = false;  // no bias tensor"
    return block(
        f"""
        // The bias tensor ({bias.dtype}): element (b, h, i, j) at BIAS_OFFSET + b * BIAS_BATCH_STRIDE
        // + h * BIAS_HEAD_STRIDE + i * BIAS_ROW_STRIDE + j * BIAS_KEY_STRIDE (h a query head; stride 0:
        // shared along that axis).
        constexpr bool BIAS = true;
        typedef {_ELEMENT[bias.dtype][0]} bias_t;
        constexpr size_t BIAS_BATCH_STRIDE = {bias.batch};
        constexpr size_t BIAS_HEAD_STRIDE = {bias.head};
        constexpr size_t BIAS_ROW_STRIDE = {bias.row};
        constexpr size_t BIAS_KEY_STRIDE = {bias.key};
        constexpr size_t BIAS_OFFSET = {bias.offset};
        constexpr float BIAS_SCALE = {float_literal(factor)};  // {why}
        """
    )


def emit_bias_score(problem: AttentionProblem) -> str:
    """``bias_score(row, key)``: the bias of one score in the scores' units (empty without a
    bias tensor)."""
    bias = problem.bias
    if bias is None:
        return ""
    convert = ""
    if bias.dtype == "fp16":
        convert = block(
            """
            __device__ __forceinline__ float half_bits_to_float(unsigned short bits) {
                float x;
                asm("cvt.f32.f16 %0, %1;" : "=f"(x) : "h"(bits));
                return x;
            }
            """
        ) + "\n\n"
    return convert + block(
        """
        // The bias of the score of key `key` in the row whose elements start at `row`, in the
        // scores' units; a finite bias stays finite, at least -2^100 (the floor absorbs a score).
        __device__ __forceinline__ float bias_score(const bias_t* row, int key) {
            const bias_t raw = __ldg(row + size_t(key) * BIAS_KEY_STRIDE);
            const float b = @TO_FLOAT@;
            return b == neg_inf() ? b : fmaxf(b * BIAS_SCALE, -1267650600228229401496703205376.0f);  // -2^100
        }
        """
    ).replace("@TO_FLOAT@", _ELEMENT[bias.dtype][1])
