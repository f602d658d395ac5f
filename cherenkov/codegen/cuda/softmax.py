"""Online softmax in registers, one key tile at a time.

A thread holds two rows per m16 tile (``g`` and ``g + 8``) and, of each row, two columns
per n8 tile; the other columns of the row sit in the 3 other lanes of its quad. Per tile:

* row max over the tile: the thread's columns as a tree, then two ``shfl.xor`` (1, 2) across
  the quad (the lazy form votes on the thread's maxima and shuffles only when it rescales);
* ``p = 2^(s·c − m·c)`` with ``c = scale·log2 e``: one FMA and one ``ex2.approx`` per score
  (scores stay unscaled; the max is tracked unscaled, valid because ``c > 0``);
* running state ``(m, l, O)``: ``alpha = 2^((m_old − m_new)·c)`` rescales the thread's
  partial row sum and its O accumulators. The row sum stays a per-thread partial sum
  (every lane of a quad applies the same alpha) and is reduced across the quad once, at
  the end, by :func:`emit_row_finish`.

Two forms of the lazy fold serve the TMA ring's step knobs: with the row sums on the tensor
cores the fold only rescales the sums' accumulator (P·V's extra mma with ones adds to it),
and with a pre-scaled Q the scores arrive as exponents ``s·c − m·c`` (no FMA; ``m·c`` is
the first mma's initial value), so the offsets are kept in log2 units.

A row that has seen only masked (−inf) scores keeps offset 0 so ``exp2`` gives 0, not NaN.
Needs ``M_TILES``, ``KV_NTILES``, ``D_NTILES`` and ``SCALE_LOG2``.
"""

from __future__ import annotations

from cherenkov.codegen.cuda.text import block, float_literal


def emit_math_helpers() -> str:
    """``neg_inf``, ``fast_exp2``, ``quad_max`` and ``quad_sum``."""
    return block(
        """
        __device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000u); }

        // 2^x with the SFU (ex2.approx, flush-to-zero): 2^-inf = 0.
        __device__ __forceinline__ float fast_exp2(float x) {
            float y;
            asm("ex2.approx.ftz.f32 %0, %1;\\n" : "=f"(y) : "f"(x));
            return y;
        }

        // Max / sum over the 4 lanes of a quad (the lanes that share an accumulator row).
        __device__ __forceinline__ float quad_max(float x) {
            x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
            return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
        }

        __device__ __forceinline__ float quad_sum(float x) {
            x += __shfl_xor_sync(0xffffffffu, x, 1);
            return x + __shfl_xor_sync(0xffffffffu, x, 2);
        }
        """
    )


POLY_EXP2_COEFFICIENTS: dict[int, tuple[float, ...]] = {
    2: (0.702942430973053, 0.23986445367336273),
    3: (0.693282961845398, 0.24221102893352509, 0.055008962750434875),
}
"""By degree: ``c1, c2, …`` of ``2^f ≈ 1 + c1·f + c2·f² (+ c3·f³)`` on ``f ∈ [−½, ½]``, fitted for the
least largest relative error (Lawson's iteration) with the constant held at 1, so every integer
power of two is exact (a row's max probability stays exactly ``2^P_SHIFT``). Largest relative
error in float32: 2.0e-3 at degree 2 (e4m3 P's half step is 6 %), 1.0e-4 at degree 3 (bf16's is
2e-3)."""

POLY_EXP2_FLOOR = -127.0
"""Where :func:`emit_poly_exp2` clamps its argument: ``2^−127`` has exponent field 0, so the shifted
exponent never goes negative, and −∞ (a masked score) gives +0 exactly (the fraction is 0 there)."""

ROUNDING_MAGIC = 12582912.0
"""1.5·2²³: adding it to a float below 2²² in magnitude rounds it to an integer, held in the low
mantissa bits of the sum."""


def emit_poly_exp2(degree: int) -> str:
    """``poly_exp2``: 2^x on the FMA and integer pipes, not the SFU — x rounded to an integer j by the
    magic-number addition, 2^(x − j) by a polynomial (:data:`POLY_EXP2_COEFFICIENTS`), j added to
    its exponent field."""
    coefficients = POLY_EXP2_COEFFICIENTS[degree]
    steps = [f"p = fmaf(p, f, {float_literal(c)});" for c in (*reversed(coefficients[:-1]), 1.0)]
    horner = "\n    ".join([f"float p = {float_literal(coefficients[-1])};", *steps])
    return block(
        f"""
        // 2^x without the SFU: j = x rounded to an integer (adding 1.5 * 2^23 leaves it in the low mantissa
        // bits), 2^(x - j) by a degree-{degree} polynomial on [-1/2, 1/2] (exact at 0), and j added to the
        // exponent field. x is clamped to {POLY_EXP2_FLOOR:g}, so the exponent field never goes below 0 and
        // 2^-inf = +0.
        __device__ __forceinline__ float poly_exp2(float x) {{
            x = fmaxf(x, {float_literal(POLY_EXP2_FLOOR)});
            const float t = __fadd_rn(x, {float_literal(ROUNDING_MAGIC)});
            const float f = __fsub_rn(x, __fsub_rn(t, {float_literal(ROUNDING_MAGIC)}));
            @HORNER@
            return __int_as_float(__float_as_int(p) + (__float_as_int(t) << 23));
        }}
        """
    ).replace("@HORNER@", horner)


def _emit_thread_row_max() -> str:
    return block(
        """
        // Max of this thread's 2 * KV_NTILES scores of row half h (row g or g + 8) of m16 tile m,
        // as a tree (depth log2(2 * KV_NTILES), not a chain of 2 * KV_NTILES dependent FMNMX).
        __device__ __forceinline__ float thread_row_max(const float (&s)[M_TILES][KV_NTILES][4], int m, int h) {
            static_assert((KV_NTILES & (KV_NTILES - 1)) == 0, "the tree halves KV_NTILES");
            float x[KV_NTILES];
            #pragma unroll
            for (int n = 0; n < KV_NTILES; ++n) {
                x[n] = fmaxf(s[m][n][2 * h], s[m][n][2 * h + 1]);
            }
            #pragma unroll
            for (int width = KV_NTILES / 2; width > 0; width /= 2) {
                #pragma unroll
                for (int n = 0; n < KV_NTILES / 2; ++n) {  // a constant trip count: x stays in registers
                    if (n < width) {
                        x[n] = fmaxf(x[n], x[n + width]);
                    }
                }
            }
            return x[0];
        }
        """
    )


RESCALE_THRESHOLD = 8.0
"""Lazy rescale: the row max (in log2 units) may rise this much before O is rescaled."""


def emit_online_softmax(lazy: bool = False, row_sums_mma: bool = False, q_prescaled: bool = False) -> str:
    """``online_softmax``: scores → probabilities in place, running max/sum and O rescaled.

    ``lazy`` (the ``lazy_rescale`` knob): the running max is only moved, and O and the row
    sums only rescaled, when some row of the warp sees its max rise by more than
    ``RESCALE_THRESHOLD`` (log2 units) — a warp-uniform branch on one vote. Otherwise the
    stale max stays the exponent offset: probabilities are then at most 2^8, which bf16 /
    fp16 and the fp32 accumulators hold exactly as well, and the final division by the
    row sum (accumulated against the same offsets) cancels the offset either way.

    Two forms of the lazy fold (the TMA ring's step knobs): ``row_sums_mma`` leaves the row
    sums to the tensor cores (``row_sum`` is then the m16×n8 accumulator of ``P · ones``,
    every column a full row sum; the fold only rescales it), and ``q_prescaled`` takes
    scores that are already exponents, ``x = c·s − offset`` (Q pre-scaled by ``c``, the
    offset the first mma's initial value): ``row_max`` then holds the offset in log2 units,
    and a raise also shifts the tile's exponents to the new offset.
    """
    if lazy:
        return _emit_thread_row_max() + "\n\n" + _emit_lazy_fold(row_sums_mma, q_prescaled)
    return _emit_thread_row_max() + "\n\n" + block(
        """
        // Fold one tile of raw scores s into the running softmax state of this thread's rows:
        // s becomes p = 2^((s - m_new) * SCALE_LOG2), O and the partial row sums are rescaled.
        __device__ __forceinline__ void online_softmax(float (&s)[M_TILES][KV_NTILES][4],
                                                       float (&o)[M_TILES][D_NTILES][4],
                                                       float (&row_max)[M_TILES][2],
                                                       float (&row_sum)[M_TILES][2]) {
            #pragma unroll
            for (int m = 0; m < M_TILES; ++m) {
                #pragma unroll
                for (int h = 0; h < 2; ++h) {
                    // New row max: this thread's columns, then the quad.
                    const float new_max = quad_max(fmaxf(row_max[m][h], thread_row_max(s, m, h)));
                    const float offset = new_max == neg_inf() ? 0.0f : new_max * SCALE_LOG2;
                    const float alpha = fast_exp2(row_max[m][h] * SCALE_LOG2 - offset);
                    row_max[m][h] = new_max;

                    // Probabilities (one FMA + ex2 each) and this thread's share of the row sum.
                    float tile_sum = 0.0f;
                    #pragma unroll
                    for (int n = 0; n < KV_NTILES; ++n) {
                        #pragma unroll
                        for (int e = 0; e < 2; ++e) {
                            const float p = fast_exp2(fmaf(s[m][n][2 * h + e], SCALE_LOG2, -offset));
                            s[m][n][2 * h + e] = p;
                            tile_sum += p;
                        }
                    }
                    row_sum[m][h] = row_sum[m][h] * alpha + tile_sum;

                    // Rescale the output rows to the new max.
                    #pragma unroll
                    for (int d = 0; d < D_NTILES; ++d) {
                        o[m][d][2 * h] *= alpha;
                        o[m][d][2 * h + 1] *= alpha;
                    }
                }
            }
        }
        """
    )


def _emit_lazy_fold(row_sums_mma: bool, q_prescaled: bool) -> str:
    """The lazy ``online_softmax`` in one of its four forms (see :func:`emit_online_softmax`)."""
    if q_prescaled:
        what = "exponents x = c*s - offset"
        vote = [
            "// Scores arrive relative to the offsets: a row raises when one reaches the threshold;",
            "// a fresh row (offset 0, max -inf) on its first score, an all-masked row never.",
            "raise |= thread_max[m][h] > (row_max[m][h] == neg_inf() ? neg_inf() : RESCALE_THRESHOLD);",
        ]
        new_offset = [
            "const float old_offset = row_max[m][h] == neg_inf() ? 0.0f : row_max[m][h];",
            "const float new_max = quad_max(fmaxf(row_max[m][h], thread_max[m][h] + old_offset));",
            "const float offset = new_max == neg_inf() ? 0.0f : new_max;",
            "const float alpha = fast_exp2(row_max[m][h] - offset);",
        ]
        shift = [
            "#pragma unroll",
            "for (int n = 0; n < KV_NTILES; ++n) {  // the tile's exponents to the new offset",
            "    s[m][n][2 * h] -= offset - old_offset;",
            "    s[m][n][2 * h + 1] -= offset - old_offset;",
            "}",
        ]
        offset, exponent = [], "s[m][n][2 * h + e]"
    else:
        what = "raw scores s"
        vote = [
            "// -inf - (-inf) is NaN and compares false: an all-masked row never raises.",
            "raise |= (thread_max[m][h] - row_max[m][h]) * SCALE_LOG2 > RESCALE_THRESHOLD;",
        ]
        new_offset = [
            "const float new_max = quad_max(fmaxf(row_max[m][h], thread_max[m][h]));",
            "const float offset = new_max == neg_inf() ? 0.0f : new_max * SCALE_LOG2;",
            "const float alpha = fast_exp2(row_max[m][h] * SCALE_LOG2 - offset);",
        ]
        shift = []
        offset = ["const float offset = row_max[m][h] == neg_inf() ? 0.0f : row_max[m][h] * SCALE_LOG2;"]
        exponent = "fmaf(s[m][n][2 * h + e], SCALE_LOG2, -offset)"
    if row_sums_mma:
        rescale_sum = ["row_sum[m][2 * h] *= alpha;", "row_sum[m][2 * h + 1] *= alpha;"]
        sum_start, sum_add, sum_end = [], [], []
    else:
        rescale_sum = ["row_sum[m][h] *= alpha;"]
        sum_start, sum_add, sum_end = ["float sum = 0.0f;"], ["sum += p;"], ["row_sum[m][h] += sum;"]
    cost = "one FMA + ex2 each" if not q_prescaled else "one ex2 each"
    sums_note = "\n            // (The row sums are P V's: one more mma, with a B operand of ones.)" if row_sums_mma else ""

    def lines(texts: list[str], spaces: int) -> str:
        return "".join("\n" + " " * spaces + t for t in texts)

    exponentials = (
        lines([*offset, *sum_start, "#pragma unroll", "for (int n = 0; n < KV_NTILES; ++n) {"], 12)
        + lines(["#pragma unroll", "for (int e = 0; e < 2; ++e) {"], 16)
        + lines([f"const float p = fast_exp2({exponent});", "s[m][n][2 * h + e] = p;", *sum_add], 20)
        + lines(["}"], 16) + lines(["}", *sum_end], 12)
    )
    return block(
        f"""
        // Fold one tile of {what} into the running softmax state of this thread's rows,
        // lazily: the offsets (row maxima) move only when a row's max rises by more than
        // {RESCALE_THRESHOLD:g} in log2 units somewhere in the warp (one vote); then O and the row sums
        // are rescaled, in the one warp-uniform branch, before the exponentials: those and the
        // P V mmas after them are then one straight-line block the compiler can interleave.
        __device__ __forceinline__ void online_softmax(float (&s)[M_TILES][KV_NTILES][4],
                                                       float (&o)[M_TILES][D_NTILES][4],
                                                       float (&row_max)[M_TILES][2],
                                                       float (&row_sum)[M_TILES][{4 if row_sums_mma else 2}]) {{
            constexpr float RESCALE_THRESHOLD = {RESCALE_THRESHOLD:.1f}f;
            // The vote needs no quad shuffles: a row's max rises too far exactly when one of
            // its four lanes holds a score that far above it, and every lane votes.
            float thread_max[M_TILES][2];
            bool raise = false;
            #pragma unroll
            for (int m = 0; m < M_TILES; ++m) {{
                #pragma unroll
                for (int h = 0; h < 2; ++h) {{
                    thread_max[m][h] = thread_row_max(s, m, h);@VOTE@
                }}
            }}
            raise = __any_sync(0xffffffffu, raise);
            if (raise) {{
                // Move every row of the warp to its new max (now across the quad); rescale O and
                // the partial sums.
                #pragma unroll
                for (int m = 0; m < M_TILES; ++m) {{
                    #pragma unroll
                    for (int h = 0; h < 2; ++h) {{@NEW_OFFSET@
                        row_max[m][h] = new_max;@RESCALE_SUM@
                        #pragma unroll
                        for (int d = 0; d < D_NTILES; ++d) {{
                            o[m][d][2 * h] *= alpha;
                            o[m][d][2 * h + 1] *= alpha;
                        }}@SHIFT@
                    }}
                }}
            }}

            // Probabilities against the offsets ({cost}), after the branch: one
            // straight-line block with the P V mmas that follow, so they can interleave.{sums_note}
            #pragma unroll
            for (int m = 0; m < M_TILES; ++m) {{
                #pragma unroll
                for (int h = 0; h < 2; ++h) {{@EXPONENTIALS@
                }}
            }}
        }}
        """
    ).replace("@VOTE@", lines(vote, 12)).replace("@NEW_OFFSET@", lines(new_offset, 16)).replace(
        "@RESCALE_SUM@", lines(rescale_sum, 16)).replace("@SHIFT@", lines(shift, 16)).replace(
        "@EXPONENTIALS@", exponentials)


def emit_row_log_sum_exp(q_prescaled: bool = False) -> str:
    """``row_log_sum_exp``: a row's log-sum-exp of the scaled scores (natural log) from its running
    max and the inverse of its row sum (``q_prescaled``: the max is already an exponent offset)."""
    offset = "row_max" if q_prescaled else "row_max * SCALE_LOG2"
    return block(
        f"""
        // log Σ_j e^(scale·s_j) of one row (-inf for a row that saw no key): log2 of its sum of 2^(c·s) is its
        // exponents' offset plus log2 of the sum of its probabilities, whose inverse inv_sum is.
        __device__ __forceinline__ float row_log_sum_exp(float row_max, float inv_sum) {{
            const float offset = row_max == neg_inf() ? 0.0f : {offset};
            return inv_sum > 0.0f ? (offset - log2f(inv_sum)) * LN2 : neg_inf();
        }}
        """
    )


def emit_row_finish(row_sums_mma: bool = False) -> str:
    """``row_inverse_sums``: quad-reduce the partial row sums and invert them (``row_sums_mma``:
    the sums' accumulator already holds full rows, column 0 of each half is read)."""
    columns, total = (4, "row_sum[m][2 * h]") if row_sums_mma else (2, "quad_sum(row_sum[m][h])")
    return block(
        f"""
        // 1 / (full row sum) for this thread's rows; 0 for a row that saw no key.
        __device__ __forceinline__ void row_inverse_sums(const float (&row_sum)[M_TILES][{columns}],
                                                         float (&inv_sum)[M_TILES][2]) {{
            #pragma unroll
            for (int m = 0; m < M_TILES; ++m) {{
                #pragma unroll
                for (int h = 0; h < 2; ++h) {{
                    const float total = {total};
                    inv_sum[m][h] = total > 0.0f ? 1.0f / total : 0.0f;
                }}
            }}
        }}
        """
    )
