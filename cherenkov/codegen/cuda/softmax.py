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

A row that has seen only masked (−inf) scores keeps offset 0 so ``exp2`` gives 0, not NaN.
Needs ``M_TILES``, ``KV_NTILES``, ``D_NTILES`` and ``SCALE_LOG2``.
"""

from __future__ import annotations

from cherenkov.codegen.cuda.text import block


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


def emit_online_softmax(lazy: bool = False) -> str:
    """``online_softmax``: scores → probabilities in place, running max/sum and O rescaled.

    ``lazy`` (the ``lazy_rescale`` knob): the running max is only moved, and O and the row
    sums only rescaled, when some row of the warp sees its max rise by more than
    ``RESCALE_THRESHOLD`` (log2 units) — a warp-uniform branch on one vote. Otherwise the
    stale max stays the exponent offset: probabilities are then at most 2^8, which bf16 /
    fp16 and the fp32 accumulators hold exactly as well, and the final division by the
    row sum (accumulated against the same offsets) cancels the offset either way.
    """
    if lazy:
        return _emit_thread_row_max() + "\n\n" + block(
            f"""
            // Fold one tile of raw scores s into the running softmax state of this thread's rows,
            // lazily: the offsets (row maxima) move only when a row's max rises by more than
            // {RESCALE_THRESHOLD:g} in log2 units somewhere in the warp (one vote); then O and the row sums
            // are rescaled, in the one warp-uniform branch, before the exponentials: those and the
            // P V mmas after them are then one straight-line block the compiler can interleave.
            __device__ __forceinline__ void online_softmax(float (&s)[M_TILES][KV_NTILES][4],
                                                           float (&o)[M_TILES][D_NTILES][4],
                                                           float (&row_max)[M_TILES][2],
                                                           float (&row_sum)[M_TILES][2]) {{
                constexpr float RESCALE_THRESHOLD = {RESCALE_THRESHOLD:.1f}f;
                // The vote needs no quad shuffles: a row's max rises too far exactly when one of
                // its four lanes holds a score that far above it, and every lane votes.
                float thread_max[M_TILES][2];
                bool raise = false;
                #pragma unroll
                for (int m = 0; m < M_TILES; ++m) {{
                    #pragma unroll
                    for (int h = 0; h < 2; ++h) {{
                        thread_max[m][h] = thread_row_max(s, m, h);
                        // -inf - (-inf) is NaN and compares false: an all-masked row never raises.
                        raise |= (thread_max[m][h] - row_max[m][h]) * SCALE_LOG2 > RESCALE_THRESHOLD;
                    }}
                }}
                raise = __any_sync(0xffffffffu, raise);
                if (raise) {{
                    // Move every row of the warp to its new max (now across the quad); rescale O and
                    // the partial sums.
                    #pragma unroll
                    for (int m = 0; m < M_TILES; ++m) {{
                        #pragma unroll
                        for (int h = 0; h < 2; ++h) {{
                            const float new_max = quad_max(fmaxf(row_max[m][h], thread_max[m][h]));
                            const float offset = new_max == neg_inf() ? 0.0f : new_max * SCALE_LOG2;
                            const float alpha = fast_exp2(row_max[m][h] * SCALE_LOG2 - offset);
                            row_max[m][h] = new_max;
                            row_sum[m][h] *= alpha;
                            #pragma unroll
                            for (int d = 0; d < D_NTILES; ++d) {{
                                o[m][d][2 * h] *= alpha;
                                o[m][d][2 * h + 1] *= alpha;
                            }}
                        }}
                    }}
                }}

                // Probabilities against the offsets (one FMA + ex2 each), after the branch: one
                // straight-line block with the P V mmas that follow, so they can interleave.
                #pragma unroll
                for (int m = 0; m < M_TILES; ++m) {{
                    #pragma unroll
                    for (int h = 0; h < 2; ++h) {{
                        const float offset = row_max[m][h] == neg_inf() ? 0.0f : row_max[m][h] * SCALE_LOG2;
                        float sum = 0.0f;
                        #pragma unroll
                        for (int n = 0; n < KV_NTILES; ++n) {{
                            #pragma unroll
                            for (int e = 0; e < 2; ++e) {{
                                const float p = fast_exp2(fmaf(s[m][n][2 * h + e], SCALE_LOG2, -offset));
                                s[m][n][2 * h + e] = p;
                                sum += p;
                            }}
                        }}
                        row_sum[m][h] += sum;
                    }}
                }}
            }}
            """
        )
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


def emit_row_finish() -> str:
    """``row_inverse_sums``: quad-reduce the partial row sums and invert them."""
    return block(
        """
        // 1 / (full row sum) for this thread's rows; 0 for a row that saw no key.
        __device__ __forceinline__ void row_inverse_sums(const float (&row_sum)[M_TILES][2],
                                                         float (&inv_sum)[M_TILES][2]) {
            #pragma unroll
            for (int m = 0; m < M_TILES; ++m) {
                #pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const float total = quad_sum(row_sum[m][h]);
                    inv_sum[m][h] = total > 0.0f ? 1.0f / total : 0.0f;
                }
            }
        }
        """
    )
