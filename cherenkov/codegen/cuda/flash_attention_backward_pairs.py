"""The ``mma.sync`` backward main pass with warp pairs: 32 keys to two warps (``warp_pairs`` schedules).

The one-warp-per-16-keys main pass (:mod:`.flash_attention_backward`) reads each streamed q and
dO tile once a warp for each of its four products, and a warp's 16 keys are the only rows its
loads of those tiles serve: a 16-row mma tile reads 16 bytes of shared memory for every 256
FLOPs of its B operand, more than the ``mma.sync`` rate leaves room for. Here two warps share
32 keys (``BLOCK_KV = 128``: four pairs, eight warps; ``BLOCK_Q = 64``), and each product is
split so that every warp's tile has 32 rows:

* ``Sᵀ = K Qᵀ`` and ``dPᵀ = V dOᵀ``: warp ``2p + h`` of pair ``p`` computes its 32 keys
  against queries ``32h … 32h + 31`` of the step, then ``Pᵀ`` and ``dSᵀ = Pᵀ∘(dPᵀ − D)``,
  which it stores (16-bit, padded rows) to two shared ``BLOCK_KV × BLOCK_Q`` tiles;
* after a block barrier, ``dv += Pᵀ dO`` and ``dk += dSᵀ Q`` for its pair's 32 keys and head-dim
  columns ``h·D/2 …`` (A operands read back from the shared tiles, so each warp holds a quarter
  of the block's dk and dv: ``D`` fp32 registers a thread), and ``dq = dS K`` for a 32-row,
  ``D/4``-column part of the step's dq tile (A: dSᵀ read transposed), added to the workspace's
  fp32 accumulator as the one-warp pass adds it.

Under a soft cap each raw score is capped before its probability, and dSᵀ needs ``Pᵀ`` times the cap's
slope ``1 − tanh²``: a warp writes that product to its own places of the dSᵀ tile beside ``Pᵀ``, and
reads it back (no barrier: the same thread's places) instead of ``Pᵀ``, so no register holds the slope
across the dPᵀ product.

Per step a block then reads ~0.058 bytes of shared memory a FLOP where the one-warp pass with
64-query steps reads ~0.078 (and ~0.081 with 32-query steps): the layout FlashAttention-2's
backward uses for head dims 64 and 128.
"""

from __future__ import annotations

from cherenkov.codegen.cuda.text import block, fill_line, indent

PAIR_CONSTANTS = """constexpr int DS_ROW = BLOCK_Q + 8;  // padded dS^T and P^T row (elements)
constexpr int HALF_Q = BLOCK_Q / 2, HALF_D = D / 2;  // a warp's queries of S^T, its head-dim columns of dk, dv
constexpr int DQ_ROW_GROUPS = BLOCK_Q / 32, DQ_COLUMNS = D / (WARPS / DQ_ROW_GROUPS);  // a warp's part of dq
static_assert(WARPS == 8 && BLOCK_Q == 64, "four warp pairs, two 32-query halves");
static_assert(DQ_COLUMNS % 16 == 0 && HALF_D % 16 == 0, "dq and dk, dv columns in whole ldmatrix pairs");"""
"""What only the warp-pair main pass reads."""


def helpers() -> str:
    """Products over two 16-row mma tiles, and the 16-bit store of a pair's score tile."""
    return block(
        """
        // acc[i] = rows [row0 + 16 i, row0 + 16 i + 16) of padded tile `a` times rows [col0, col0 + N) of padded
        // tile `b`, transposed, over the head dim (both tiles D columns wide), fp32.
        template <int N>
        __device__ __forceinline__ void pair_rows_times_rows(float (&acc)[2][N / 8][4], const elem_t* a_tile, int row0,
                                                             const elem_t* b_tile, int col0, int lane) {
            #pragma unroll
            for (int i = 0; i < 2; ++i) {
                #pragma unroll
                for (int n = 0; n < N / 8; ++n) acc[i][n][0] = acc[i][n][1] = acc[i][n][2] = acc[i][n][3] = 0.0f;
            }
            #pragma unroll
            for (int kk = 0; kk < D / 16; ++kk) {
                u32 a[2][4];
                load_a(a[0], a_tile, row0, kk, lane);
                load_a(a[1], a_tile, row0 + 16, kk, lane);
                #pragma unroll
                for (int p = 0; p < N / 16; ++p) {
                    u32 b[4];
                    load_b_rows(b, b_tile, col0 + 16 * p, kk, lane);
                    #pragma unroll
                    for (int i = 0; i < 2; ++i) {
                        mma_16816(acc[i][2 * p], a[i], b[0], b[1]);
                        mma_16816(acc[i][2 * p + 1], a[i], b[2], b[3]);
                    }
                }
            }
        }

        // acc[i] += A B over K_STEPS x 16 of the contracted axis, fp32. A: rows [row0 + 16 i, ...) of a
        // keys x queries tile (DS_ROW elements a row), or with TRANSPOSED of its transpose (rows: queries, k: keys);
        // B: columns [col0, col0 + N) of padded tile `b`, whose rows are the contracted axis. dq's product (TRANSPOSED)
        // is unrolled by two: with its loads hoisted over every k step, the D 128 kernel passes 255 registers.
        template <int N, int K_STEPS, bool TRANSPOSED>
        __device__ __forceinline__ void pair_accumulate(float (&acc)[2][N / 8][4], const elem_t* a_tile, int row0,
                                                        const elem_t* b_tile, int col0, int lane) {
            #pragma unroll (TRANSPOSED ? 2 : K_STEPS)
            for (int kk = 0; kk < K_STEPS; ++kk) {
                u32 a[2][4];
                #pragma unroll
                for (int i = 0; i < 2; ++i) {
                    if (TRANSPOSED) load_a_transposed(a[i], a_tile, DS_ROW, row0 + 16 * i, kk, lane);
                    else ldmatrix_x4(a[i], smem_address(a_tile + (row0 + 16 * i + (lane & 15)) * DS_ROW + 16 * kk
                                                        + 8 * (lane >> 4)));
                }
                #pragma unroll
                for (int c = 0; c < N / 16; ++c) {
                    u32 b[4];
                    load_b_cols(b, b_tile, ROW, kk, col0 + 16 * c, lane);
                    #pragma unroll
                    for (int i = 0; i < 2; ++i) {
                        mma_16816(acc[i][2 * c], a[i], b[0], b[1]);
                        mma_16816(acc[i][2 * c + 1], a[i], b[2], b[3]);
                    }
                }
            }
        }

        // A warp's 32 keys x HALF_Q queries of fp32 scores, rounded, into rows [row0, row0 + 32) and columns
        // [col0, col0 + HALF_Q) of a keys x queries tile (DS_ROW elements a row).
        __device__ __forceinline__ void store_pair_tile(elem_t* tile, const float (&x)[2][HALF_Q / 8][4], int row0,
                                                        int col0, int g, int t) {
            #pragma unroll
            for (int i = 0; i < 2; ++i) {
                #pragma unroll
                for (int n = 0; n < HALF_Q / 8; ++n) {
                    elem_t* upper = tile + (row0 + 16 * i + g) * DS_ROW + col0 + 8 * n + 2 * t;
                    *reinterpret_cast<u32*>(upper) = pack2(x[i][n][0], x[i][n][1]);
                    *reinterpret_cast<u32*>(upper + 8 * DS_ROW) = pack2(x[i][n][2], x[i][n][3]);
                }
            }
        }
        """
    )


PAIR_P_TILE = "elem_t* sP = sDs + BLOCK_KV * DS_ROW;  // BLOCK_KV x DS_ROW: P^T"

PAIR_ROLES = """// warp pair p = warp / 2 owns keys 32 p ..; warp h = warp % 2 of it takes the step's queries HALF_Q h ..
// of S^T and dP^T, and head-dim columns HALF_D h .. of dk and dv
const int kr0 = 32 * (warp >> 1), qc0 = HALF_Q * (warp & 1), dc0 = HALF_D * (warp & 1);"""

PAIR_ACCUMULATORS = """float dk[2][HALF_D / 8][4], dv[2][HALF_D / 8][4];  // keys k0 + kr0 + 16 i + g (+ 8), columns dc0 .., fp32
#pragma unroll
for (int i = 0; i < 2; ++i) {
    #pragma unroll
    for (int n = 0; n < HALF_D / 8; ++n) {
        #pragma unroll
        for (int e = 0; e < 4; ++e) dk[i][n][e] = dv[i][n][e] = 0.0f;
    }
}
const int key0 = k0 + kr0 + g;  // this thread's keys: key0 + 16 i + 8 h"""


_P_UNCAPPED = """// P^T = 2^(S^T SCALE_LOG2 - LSE2), 0 where masked
#pragma unroll
for (int i = 0; i < 2; ++i) {
    #pragma unroll
    for (int n = 0; n < HALF_Q / 8; ++n) {
        #pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int column = qc0 + 8 * n + 2 * t + (e & 1), query = q0 + column, row = key0 + 16 * i + 8 * (e >> 1);
            const bool masked = row >= SEQ_KV || query >= SEQ_Q || hidden_key(row, query);
            s[i][n][e] = masked ? 0.0f : fast_exp2(s[i][n][e] * SCALE_LOG2 - tlse[column]);
        }
    }
}"""
"""The uncapped step's probabilities; dS^T reads them back from ``sP``."""

_P_CAPPED = """// P^T = 2^(cap(S^T) SCALE_LOG2 - LSE2), 0 where masked; P^T times the cap's slope 1 - tanh^2 (the gradient of the
// capped score's argument) to this thread's places of the dS^T tile, which dS^T reads back and overwrites
#pragma unroll
for (int i = 0; i < 2; ++i) {
    #pragma unroll
    for (int n = 0; n < HALF_Q / 8; ++n) {
        #pragma unroll
        for (int h = 0; h < 2; ++h) {  // rows g and g + 8: two probabilities a 4-byte store
            const int column = qc0 + 8 * n + 2 * t, row = key0 + 16 * i + 8 * h;
            float sloped[2];
            #pragma unroll
            for (int c = 0; c < 2; ++c) {
                const int query = q0 + column + c;
                const bool masked = row >= SEQ_KV || query >= SEQ_Q || hidden_key(row, query);
                const float capped = soft_cap(s[i][n][2 * h + c]);
                s[i][n][2 * h + c] = masked ? 0.0f : fast_exp2(capped * SCALE_LOG2 - tlse[column + c]);
                sloped[c] = masked ? 0.0f : s[i][n][2 * h + c] * soft_cap_slope(capped);
            }
            *reinterpret_cast<u32*>(sDs + (kr0 + 16 * i + g + 8 * h) * DS_ROW + column) = pack2(sloped[0], sloped[1]);
        }
    }
}"""
"""The capped step's probabilities, and their products with the cap's slope that dS^T reads back from ``sDs``."""


def pair_step(dq_add: str, capped: bool = False) -> str:
    """One step of the warp-pair main pass (the loop body after the step's tiles are found);
    ``dq_add`` adds a 16-row ``acc`` of dq at rows ``r0``, columns ``c0`` to the accumulator; ``capped``:
    each raw score is soft-capped, and dS gains the cap's slope."""
    text = block(
        """
        // S^T = K Q^T: the pair's 32 keys x this warp's half of the queries
        float s[2][HALF_Q / 8][4];
        pair_rows_times_rows<HALF_Q>(s, sK, kr0, tq, qc0, lane);
        @PROBABILITIES@
        store_pair_tile(sP, s, kr0, qc0, g, t);  // for dv, and read back rounded for dS^T: S^T's registers are free
        if (WANT_DQ || WANT_DK) {
            // dP^T = V dO^T, then dS^T = P^T (dP^T - D)
            float dp[2][HALF_Q / 8][4];
            pair_rows_times_rows<HALF_Q>(dp, sV, kr0, tdo, qc0, lane);
            #pragma unroll
            for (int i = 0; i < 2; ++i) {
                #pragma unroll
                for (int n = 0; n < HALF_Q / 8; ++n) {
                    #pragma unroll
                    for (int h = 0; h < 2; ++h) {  // rows g and g + 8: two probabilities a 4-byte load
                        const int row = kr0 + 16 * i + g + 8 * h, column = qc0 + 8 * n + 2 * t;
                        const u32 p = *reinterpret_cast<const u32*>(@P_READ@ + row * DS_ROW + column);
                        dp[i][n][2 * h] = to_float(elem_t(p & 0xFFFFu)) * (dp[i][n][2 * h] - tdelta[column]);
                        dp[i][n][2 * h + 1] = to_float(elem_t(p >> 16)) * (dp[i][n][2 * h + 1] - tdelta[column + 1]);
                    }
                }
            }
            store_pair_tile(sDs, dp, kr0, qc0, g, t);
        }
        __syncthreads();  // the block's P^T and dS^T are in shared memory
        // dv += P^T dO and dk += dS^T Q: the pair's keys, this warp's columns
        if (WANT_DV) pair_accumulate<HALF_D, BLOCK_Q / 16, false>(dv, sP, kr0, tdo, dc0, lane);
        if (WANT_DK) pair_accumulate<HALF_D, BLOCK_Q / 16, false>(dk, sDs, kr0, tq, dc0, lane);
        if (WANT_DQ) {  // dq (BLOCK_Q x D) += dS K, warps over (32-row group, column group)
            const int c0 = (warp / DQ_ROW_GROUPS) * DQ_COLUMNS;
            float dq[2][DQ_COLUMNS / 8][4];
            #pragma unroll
            for (int i = 0; i < 2; ++i) {
                #pragma unroll
                for (int n = 0; n < DQ_COLUMNS / 8; ++n) dq[i][n][0] = dq[i][n][1] = dq[i][n][2] = dq[i][n][3] = 0.0f;
            }
            pair_accumulate<DQ_COLUMNS, BLOCK_KV / 16, true>(dq, sDs, 32 * (warp % DQ_ROW_GROUPS), sK, c0, lane);
            float* rows = dq_accumulator + ((size_t(batch) * HEADS + head) * SEQ_Q + q0) * D;
            #pragma unroll
            for (int i = 0; i < 2; ++i) {
                const int r0 = 32 * (warp % DQ_ROW_GROUPS) + 16 * i;
                const float (&acc)[DQ_COLUMNS / 8][4] = dq[i];
                @DQ_ADD@
            }
        }
        """
    ).replace("@DQ_ADD@", indent(dq_add, 2).lstrip()).replace("@P_READ@", "sDs" if capped else "sP")
    return fill_line(text, "PROBABILITIES", _P_CAPPED if capped else _P_UNCAPPED)


PAIR_EPILOGUE = """// dk * SCALE and dv, rounded, at their strides: the pair's keys, this warp's columns
#pragma unroll
for (int i = 0; i < 2; ++i) {
    #pragma unroll
    for (int n = 0; n < HALF_D / 8; ++n) {
        #pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int key = key0 + 16 * i + 8 * h, d = dc0 + 8 * n + 2 * t;
            if (key >= SEQ_KV) continue;
            if (WANT_DK) {
                *reinterpret_cast<u32*>(dk_out + DK_OFFSET + batch * DK_BATCH + kv_head * DK_HEAD + key * DK_SEQ + d)
                    = pack2(dk[i][n][2 * h] * SCALE, dk[i][n][2 * h + 1] * SCALE);
            }
            if (WANT_DV) {
                *reinterpret_cast<u32*>(dv_out + DV_OFFSET + batch * DV_BATCH + kv_head * DV_HEAD + key * DV_SEQ + d)
                    = pack2(dv[i][n][2 * h], dv[i][n][2 * h + 1]);
            }
        }
    }
}"""
