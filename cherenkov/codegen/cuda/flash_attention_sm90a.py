"""The Hopper (sm_90a) flash-attention kernel family: TMA, wgmma, warp specialisation.

``o = softmax(scale · q kᵀ [causal mask]) v`` for q, k, v, o at their strides (bf16 or
fp16, or e4m3 operands; head dims of q·k and of v multiples of 8 up to 256 at 16 bits, of 16
at 8 bits, GQA). A head dim that is not a whole number of 64-column TMA boxes (40, 80, 96) reads
its last box's columns past the end as zeros: ``Q Kᵀ`` skips their whole k steps (and reads the
zeros of a step it ends inside: 40 columns take three 16-column steps), and O's columns from
them are dropped (the o tensor map clips them, the register stores skip them).

A work tile is ``BLOCK_Q = 64 · CONSUMERS`` query rows of one (batch, head); a block walks
the tiles ``blockIdx.x, blockIdx.x + gridDim.x, …`` (one tile when the grid has a block per
tile; many when it is persistent, one block an SM).
Its warpgroups have fixed roles:

* warpgroup 0, the producer, lowers its registers (``setmaxnreg``) and one thread issues
  every TMA copy, per work tile: its first key tile, Q (one ``64 × BLOCK_Q`` box per 64
  columns of the head dim) once the consumers have released the last tile's Q, then the
  other key tiles; with two Q buffers (``Q_BUFFERS``, persistent grids) Q comes first, into
  the buffer released a whole work tile earlier, so it is in place before the consumers
  need it. A key tile's K and V boxes go to the next stage of the ring after waiting on
  that stage's "empty" mbarrier (one for K and V, or, with a 2-stage ring, one each:
  ``SPLIT_RELEASE``); K and V complete on separate "full" mbarriers, so ``Q Kᵀ`` starts
  while V still lands. The ring's stage and phase run on across work tiles, so the next
  tile's Q and K land while the consumers finish and store the last one.
* warpgroups 1..CONSUMERS raise their registers and own 64 query rows each. Per key tile
  j they issue ``S_j = Q K_jᵀ`` (wgmma, both operands from shared memory, K-major) and
  ``O += P_(j-1) V_(j-1)`` (wgmma, P from registers, V MN-major), wait for ``S_j`` only,
  run the online softmax on the accumulator registers while ``P V`` still runs, then wait
  for it, hand stage ``j - 1`` back to the producer, rescale O and pack ``P_j`` to 16-bit
  A fragments. With ``pingpong`` the two consumers' matmul issues alternate through named
  barriers, so one warpgroup's softmax overlaps the other's matmuls. A thread's row maxima and
  sums run as four independent chains and a tree (the softmax's latency sits between the two
  consumers' matmuls). With ``lazy_rescale`` the warp votes whether any of its rows' maxima rose
  by more than ``LAZY_LOG2`` (2⁸ for 16-bit P; 2² for e4m3 P, whose 2^``P_SHIFT`` factor gives up
  as much); only then do the quad's max shuffles, the alpha exponentials and the O rescale run.
  With ``row_sums_mma`` (8-bit) each k step of ``P V`` also multiplies P by the eight rows of
  ones after the V tile (an m64n8k32 wgmma into its own four registers, from zero each key
  tile), and those per-tile sums are added in fp32: the softmax adds no probabilities, and the
  8-bit wgmma's reduced-precision accumulation never sees a whole row. With ``poly_exp`` some
  8-key chunks of each score tile take their exponentials as polynomials on the FMA pipe
  (``poly_exp2``), the rest the SFU's ``ex2``. The epilogue
  normalises O and either stores it from registers or (``O_THROUGH_SMEM``: one-tile blocks
  and two Q buffers) writes it to shared memory in Q's swizzled layout, from where one
  thread stores it with TMA bulk tensor stores while the warpgroup goes on.

Shared memory: ``[Q buffers | K stage 0..STAGES-1 | V stage 0..STAGES-1 | O | mbarriers]``
(O only with two Q buffers; a one-tile block stages O in its Q tile; with ``row_sums_mma`` each
V stage is followed by its eight 128-byte rows of ones, written once at the start), every tile 1024-byte
aligned and stored as 128-byte-swizzled boxes of 64 columns by the TMA
(``CU_TENSOR_MAP_SWIZZLE_128B``), the layout the wgmma descriptors of :mod:`.wgmma`
describe; head dims of at most 32 columns (16-bit) are 64-byte-swizzled boxes of 32 columns
instead (``box_row_bytes``, ``CU_TENSOR_MAP_SWIZZLE_64B``), so they read no zero columns.
Causal blocks visit key tiles up to their diagonal and mask only where a tile crosses a
consumer's diagonal. Tile order: the query tiles of one head are consecutive
(causal: longest first), so concurrent blocks share K and V in L2.

Launch: grid ``(schedule.grid_blocks(problem, SMs),)``, ``128 · (1 + CONSUMERS)`` threads,
``schedule.problem_smem_bytes(problem)`` bytes of dynamic shared memory, arguments
``(q_map, k_map, v_map, o_map, o)``: four TensorMaps of 4-D views ``(D, S, H, B)`` at each
operand's strides, with ``64 × rows × 1 × 1`` boxes (``32 × …`` with 64-byte rows; rows:
BLOCK_Q for q, BLOCK_KV for k and v, 64 for o; see
:func:`cherenkov.codegen.tensor_map.operand_tensor_map`) and the output
pointer (the register-store epilogue's, which writes at o's strides). Every problem and schedule value is a compile-time constant.
Tails: boxes past the end of a sequence read as zero (the tensor map's out-of-bounds
fill); scores of keys past ``SEQ_KV`` are masked in the last key tile, and rows past
``SEQ_Q`` are not stored (the o map clips them).
"""

from __future__ import annotations

import re

from cherenkov.codegen.cuda import attention_mask, mma, softmax, tma, wgmma
from cherenkov.codegen.cuda.flash_attention import operand_strides, problem_summary, softmax_scale
from cherenkov.codegen.cuda.flash_attention_fp8 import P_EXPONENT_SHIFT, PACK_E4M3X4, factor_arguments
from cherenkov.codegen.cuda.text import block, bool_literal, comment_lines, float_literal, identifier, indent, section
from cherenkov.codegen.errors import CodegenError
from cherenkov.rewrites.plan import ELEMENT_BYTES, AttentionProblem
from cherenkov.rewrites.plan_sm90a import (
    HOPPER_EIGHT_BIT_DTYPES,
    LAZY_RESCALE_LOG2,
    ONES_ROWS,
    POLY_EXP_CHUNKS,
    ROWS_PER_CONSUMER,
    SWIZZLE_ALIGN,
    HopperFlashSchedule,
    box_row_bytes,
    hopper_schedule_problems,
    problem_tile_columns,
)

LOG2E = 1.4426950408889634


def kernel_name(schedule: HopperFlashSchedule) -> str:
    """The ``extern "C"`` name, e.g. ``flash_attention_sm90a_q128_kv128_s2_c2_pp``."""
    return identifier(f"flash_attention_sm90a_{schedule.key()}")


def check(problem: AttentionProblem, schedule: HopperFlashSchedule) -> None:
    """CodegenError naming every reason the pair cannot be emitted."""
    p = problem
    if min(p.batch, p.heads, p.kv_heads, p.seq_q, p.seq_kv) < 1:
        raise CodegenError(f"attention shape B={p.batch} H={p.heads} Hkv={p.kv_heads} Sq={p.seq_q} Skv={p.seq_kv}: "
                           "every size must be positive")
    problems = hopper_schedule_problems(schedule, problem)
    if problems:
        raise CodegenError(f"invalid sm_90a flash-attention schedule {schedule.key()}: {'; '.join(problems)}")
    for name in (p.q, p.k, p.v, p.out):
        identifier(name)
    softmax_scale(problem)


def emit_flash_attention_sm90a(problem: AttentionProblem, schedule: HopperFlashSchedule) -> str:
    """Deterministic CUDA C++ of one problem × schedule (same inputs → same bytes)."""
    check(problem, schedule)
    dtype, s = problem.dtype, schedule
    eight_bit = dtype in HOPPER_EIGHT_BIT_DTYPES
    kv_wgmma = (s.block_kv, dtype, False, False)  # S = Q K^T: A, B K-major in shared memory
    # O += P V: A registers, B MN-major (V); 8-bit: B K-major (V transposed by the launch)
    o_wgmma = (problem_tile_columns(problem)[1], dtype, True, not eight_bit)
    row_bytes = box_row_bytes(problem.head_dim, problem.v_dim, dtype)
    parts = [
        _header(problem, schedule),
        section("types and helpers", _types(dtype), *([PACK_E4M3X4] if eight_bit else [])),
        section("problem and schedule constants", _constants(problem, schedule, row_bytes)),
        section("shared-memory layout", _layout_constants(s.problem_smem_bytes(problem), row_bytes)),
        section("TMA copies and mbarriers", tma.emit_tensor_map_type(), tma.emit_mbarrier(), tma.emit_tma_load(4),
                tma.emit_fence_proxy_async(), tma.emit_tma_store(4),
                *([tma.emit_tma_prefetch_l2(4)] if s.l2_prefetch else [])),
        section("warp specialisation", tma.emit_setmaxnreg(), tma.emit_named_barriers()),
        section("wgmma", wgmma.emit_descriptor(row_bytes), wgmma.emit_sync(), wgmma.emit_wgmma(*kv_wgmma),
                wgmma.emit_wgmma(*o_wgmma),
                *([wgmma.emit_wgmma(ONES_ROWS, dtype, True, False)] if s.row_sums_mma else []),
                mma.emit_pack(problem.output_dtype)),
        section("online softmax", softmax.emit_math_helpers(), attention_mask.emit_bias_score(problem),
                attention_mask.emit_soft_cap(problem, softmax_scale(problem)), _CAP_SCORES if problem.softcap else "",
                _softmax(problem.bias is not None, eight_bit, s.lazy_rescale, s.row_sums_mma, s.poly_exp)),
        section("work tiles", _work_tiles()),
        section("producer warpgroup", _producer(eight_bit, s.l2_prefetch)),
        section("consumer warpgroups", _consumer_matmuls(kv_wgmma, o_wgmma, eight_bit, s.row_sums_mma),
                _pingpong(s.pingpong), _consumer(s, problem)),
        *([section("V transposed for the 8-bit P V", _transpose_values(schedule))] if eight_bit else []),
        section("kernel", _kernel(schedule, problem)),
    ]
    return "\n\n".join(parts) + "\n"


def _header(problem: AttentionProblem, schedule: HopperFlashSchedule) -> str:
    p, s = problem, schedule
    lines = [
        f"Generated by cherenkov: flash attention for sm_90a (wgmma, TMA), schedule {s.key()}.",
        f"{identifier(p.out)} = softmax({attention_mask.score_formula(p)}"
        f"{attention_mask.mask_clause(p)}) {identifier(p.v)}; tensors BHSD contiguous.",
        problem_summary(p),
        f"Schedule: BLOCK_Q={s.block_q} BLOCK_KV={s.block_kv} stages={s.stages} "
        f"consumer warpgroups={s.consumer_warpgroups} pingpong={s.pingpong} Q buffers={s.q_buffers} "
        f"registers (producer, consumer)={s.register_split}.",
        f"Launch: grid ({'min(' if s.persistent else ''}{s.tiles(p)}{', SMs)' if s.persistent else ''},), "
        f"{s.threads} threads, "
        f"{s.problem_smem_bytes(p)} bytes dynamic shared memory, args (q_map, k_map, v_map, o_map, o"
        f"{', bias' if p.bias is not None else ''}).",
    ]
    return comment_lines(lines)


def _types(dtype: str) -> str:
    what = "one 16-bit output element" if dtype in HOPPER_EIGHT_BIT_DTYPES else f"one {dtype} element"
    return block(
        f"""
        typedef unsigned int u32;
        typedef unsigned short elem_t;  // the bits of {what}
        """
    )


def _constants(problem: AttentionProblem, schedule: HopperFlashSchedule, row_bytes: int) -> str:
    p, s = problem, schedule
    scale = softmax_scale(p)
    split = s.register_split
    regs = f"constexpr int PRODUCER_REGS = {split[0]};\n        constexpr int CONSUMER_REGS = {split[1]};" if split else (
        "// one consumer warpgroup: 256 threads get 255 registers, no reallocation")
    eight_bit = p.dtype in HOPPER_EIGHT_BIT_DTYPES
    lazy_log2 = LAZY_RESCALE_LOG2[ELEMENT_BYTES[p.dtype]]
    p_shift = (P_EXPONENT_SHIFT - (lazy_log2 if s.lazy_rescale else 0.0)) if eight_bit else 0.0
    lazy = (f"\n        constexpr float LAZY_LOG2 = {float_literal(lazy_log2)};  // a row's max moves when a tile "
            "raises it more (log2)" if s.lazy_rescale else "")
    q_tail = ("// rows past SEQ_Q: the o tensor map clips the TMA stores" if _through_smem(s, p) else
              "constexpr bool Q_TAIL = !PACK && SEQ_Q % BLOCK_Q != 0;  // the last query tile has rows past the end")
    return block(
        f"""
        constexpr int BATCH = {p.batch};
        constexpr int HEADS = {p.heads};
        constexpr int KV_HEADS = {p.kv_heads};
        constexpr int GROUP = {p.group_size};  // query heads per K/V head
        constexpr int SEQ_Q = {p.seq_q};
        constexpr int SEQ_KV = {p.seq_kv};
        constexpr int HEAD_DIM = {p.head_dim};  // of q and k
        constexpr int V_DIM = {p.v_dim};  // of v and o
        constexpr bool CAUSAL = {bool_literal(p.causal)};
        constexpr int WINDOW = {p.window};  // 0: none; else query i sees keys i - WINDOW < j (<= i + AHEAD)
        constexpr int AHEAD = {p.window_ahead};  // keys after the query a window without the causal mask sees
        constexpr bool UPPER_EDGE = {bool_literal(p.upper_edge is not None)};  // causal or a window: keys j > i + AHEAD hidden
        constexpr float SCALE_LOG2 = {float_literal(scale * LOG2E)};  // scale {scale:.9g} * log2(e)
        @MASK_CONSTANTS@

        constexpr int CONSUMERS = {s.consumer_warpgroups};  // consumer warpgroups of 64 query rows
        constexpr int BLOCK_Q = {s.block_q};
        constexpr int BLOCK_KV = {s.block_kv};
        constexpr int STAGES = {s.stages};
        constexpr int Q_BUFFERS = {s.q_buffers};  // Q tiles in shared memory (2: the next work tile's Q loads early)
        constexpr int THREADS = {s.threads};
        constexpr bool PINGPONG = {bool_literal(s.pingpong)};
        constexpr bool SPLIT_RELEASE = {bool_literal(s.split_release)};  // K and V of a stage released separately
        constexpr bool O_THROUGH_SMEM = {bool_literal(_through_smem(s, p))};  // O leaves by TMA stores from shared memory
        {regs}
        constexpr bool PACK = {bool_literal(s.pack_group)};  // a tile holds the rows of TILE_HEADS heads of one K/V head
        constexpr int PACK_ROWS = PACK ? SEQ_Q : BLOCK_Q;  // rows of one head in a work tile
        constexpr bool BALANCED = {bool_literal(s.balanced)};  // causal work tiles longest first, rounds alternating
        constexpr int TILE_HEADS = BLOCK_Q / PACK_ROWS;  // query heads a work tile serves
        constexpr int Q_TILES = PACK ? 1 : (SEQ_Q + BLOCK_Q - 1) / BLOCK_Q;
        constexpr int KV_TILES = (SEQ_KV + BLOCK_KV - 1) / BLOCK_KV;
        {q_tail}
        constexpr bool KV_TAIL = SEQ_KV % BLOCK_KV != 0;  // the last key tile has keys past the end
        constexpr int TILES = Q_TILES * (HEADS / TILE_HEADS) * BATCH;  // work tiles: query tile x heads x batch
        constexpr int ELEM_BYTES = {1 if eight_bit else 2};  // of q, k and v
        constexpr int BOX_COLUMNS = {row_bytes} / ELEM_BYTES;  // elements of a {row_bytes}-byte TMA box row
        // {row_bytes}-byte TMA boxes across the head dims; a last box past a head dim's end reads zeros
        constexpr int QK_BOXES = (HEAD_DIM + BOX_COLUMNS - 1) / BOX_COLUMNS;
        constexpr int V_BOXES = (V_DIM + BOX_COLUMNS - 1) / BOX_COLUMNS;
        constexpr int QK_STEPS = (HEAD_DIM * ELEM_BYTES + 31) / 32, PV_STEPS = BLOCK_KV * ELEM_BYTES / 32;  // wgmma k steps
        constexpr int S_REGS = BLOCK_KV / 2;  // fp32 accumulators of S a thread
        constexpr bool ROW_SUMS_MMA = {bool_literal(s.row_sums_mma)};  // P V also sums P, against rows of ones
        constexpr int ONES_ROWS = {ONES_ROWS if s.row_sums_mma else 0};  // rows of ones after each transposed V tile
        constexpr int O_REGS = V_BOXES * BOX_COLUMNS / 2;  // fp32 accumulators of O a thread (whole boxes)
        constexpr int P_REGS = BLOCK_KV * ELEM_BYTES / 8;  // packed P a thread (16-bit pairs or e4m3 quads)
        constexpr float P_SHIFT = {float_literal(p_shift)};  // log2 of P's factor{lazy}
        static_assert(BLOCK_Q == {ROWS_PER_CONSUMER} * CONSUMERS && THREADS == 128 * (CONSUMERS + 1), "warp roles");
        """
    ).replace("@MASK_CONSTANTS@", attention_mask.emit_mask_constants(p, 1.0 / scale, "1 / scale")) + "\n\n" + operand_strides(p)


def _layout_constants(smem_bytes: int, row_bytes: int) -> str:
    return block(
        f"""
        // [Q buffer 0..Q_BUFFERS-1 | K stage 0..STAGES-1 | V stage 0..STAGES-1 | O (two Q buffers) | mbarriers],
        // offsets from a {SWIZZLE_ALIGN}-byte aligned base. A tile is QK_BOXES (V and O: V_BOXES) boxes of
        // (rows x BOX_COLUMNS columns), {row_bytes}-byte swizzled rows; O has Q's layout.
        constexpr u32 ROW_BYTES = {row_bytes};
        constexpr int BOX_K_STEPS = ROW_BYTES / 32;  // 32-byte wgmma k steps in a box row
        constexpr int BOX_CHUNKS = ROW_BYTES / 16;  // 16-byte chunks in a box row (the swizzle permutes them)
        constexpr u32 Q_BOX_BYTES = BLOCK_Q * ROW_BYTES;
        constexpr u32 KV_BOX_BYTES = BLOCK_KV * ROW_BYTES;
        constexpr u32 Q_TILE_BYTES = QK_BOXES * Q_BOX_BYTES;
        constexpr u32 O_TILE_BYTES = V_BOXES * Q_BOX_BYTES;
        constexpr u32 K_TILE_BYTES = QK_BOXES * KV_BOX_BYTES;
        constexpr u32 V_TILE_BYTES = V_BOXES * KV_BOX_BYTES;
        constexpr u32 V_STAGE_BYTES = V_TILE_BYTES + ONES_ROWS * ROW_BYTES;  // a V tile and its rows of ones
        constexpr u32 Q_SMEM = 0;
        constexpr u32 K_SMEM = Q_SMEM + Q_BUFFERS * Q_TILE_BYTES;
        constexpr u32 V_SMEM = K_SMEM + STAGES * K_TILE_BYTES;
        constexpr u32 O_SMEM = V_SMEM + STAGES * V_STAGE_BYTES;
        constexpr u32 BAR_SMEM = O_SMEM + (Q_BUFFERS == 2 ? O_TILE_BYTES : 0);
        constexpr u32 Q_FULL = BAR_SMEM;                   // + 8 * buffer: Q landed
        constexpr u32 Q_EMPTY = Q_FULL + 8 * Q_BUFFERS;    // + 8 * buffer: every consumer warp is done with Q
        constexpr u32 K_FULL = Q_EMPTY + 8 * Q_BUFFERS;    // + 8 * stage: K tile landed
        constexpr u32 V_FULL = K_FULL + 8 * STAGES;        // + 8 * stage: V tile landed
        constexpr u32 K_EMPTY = V_FULL + 8 * STAGES;       // + 8 * stage: every consumer warp is done with K
        // + 8 * stage: every consumer warp is done with V (joint release: K's barrier, after P V)
        constexpr u32 V_EMPTY = SPLIT_RELEASE ? K_EMPTY + 8 * STAGES : K_EMPTY;
        constexpr u32 SMEM_BYTES = V_EMPTY + 8 * STAGES + {SWIZZLE_ALIGN};  // + slack to align the base
        static_assert(SMEM_BYTES == {smem_bytes}, "the schedule's shared-memory estimate is the layout");
        static_assert(KV_BOX_BYTES % {SWIZZLE_ALIGN} == 0 && Q_BOX_BYTES % {SWIZZLE_ALIGN} == 0, "swizzle atoms aligned");
        """
    )


def _softmax(bias: bool, eight_bit: bool = False, lazy: bool = False, row_sums: bool = False,
             poly_exp: int = 0) -> str:
    """The row state, masks and online softmax; ``bias``: the problem has a bias tensor (every
    tile is masked, each score gains its bias); ``eight_bit``: P is packed as e4m3 quads;
    ``lazy``: the running max moves only when a tile raises it by more than ``LAZY_LOG2``;
    ``row_sums``: the row sums come from the rows of ones' wgmma (``add_row_sums``);
    ``poly_exp``: of every four 8-key chunks, that many take :func:`softmax.emit_poly_exp2`."""
    text = block(
        """
        // The running softmax state of this thread's two rows (g and g + 8 of its warp's 16).
        struct RowState {
            float max[2];  // raw (unscaled) running row max
            float sum[2];  // this thread's partial row sum; the quad's partials are added at the end
        };

        // Mask of one key tile: scores of keys after the query (causal; a window about the query: more
        // than AHEAD after it), at least WINDOW before it (a window) or past SEQ_KV become -inf. A packed
        // tile starts at query 0 and its row r is query r % PACK_ROWS.@BIAS_NOTE@
        __device__ __forceinline__ void mask_scores(float (&s)[S_REGS], int row0, int kv0, int t@BIAS_PARAM@) {
            #pragma unroll
            for (int c = 0; c < BLOCK_KV / 8; ++c) {
                #pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int row = PACK ? (row0 + (e >> 1) * 8) % PACK_ROWS : row0 + (e >> 1) * 8;
                    const int col = kv0 + 8 * c + 2 * t + (e & 1);
                    if ((UPPER_EDGE && col > row + AHEAD) || (WINDOW > 0 && row - col >= WINDOW) || (KV_TAIL && col >= SEQ_KV))
                        s[4 * c + e] = neg_inf();@BIAS@
                }
            }
        }

        // Whether key tile kv0 needs the mask for the warpgroup whose first query is first_row (its 64 rows'
        // queries follow; packed: each of its heads' PACK_ROWS queries).
        __device__ __forceinline__ bool needs_mask(int kv0, int first_row) {
            constexpr int QUERIES = PACK ? PACK_ROWS : 64;
            return BIAS || (UPPER_EDGE && kv0 + BLOCK_KV - 1 > first_row + AHEAD)
                   || (WINDOW > 0 && first_row + QUERIES - 1 - kv0 >= WINDOW)
                   || (KV_TAIL && kv0 + BLOCK_KV > SEQ_KV);
        }

        // This thread's part of row r's maximum (from `start`) and of its sum: four independent
        // chains over its 8-key chunks, then a tree, so the latency is a quarter of one chain's.
        __device__ __forceinline__ float thread_row_max(const float (&s)[S_REGS], int r, float start) {
            float m[4] = {start, neg_inf(), neg_inf(), neg_inf()};
            #pragma unroll
            for (int c = 0; c < BLOCK_KV / 8; ++c)
                m[c % 4] = fmaxf(m[c % 4], fmaxf(s[4 * c + 2 * r], s[4 * c + 2 * r + 1]));
            return fmaxf(fmaxf(m[0], m[1]), fmaxf(m[2], m[3]));
        }

        @EXPONENTIAL@
        // Row r's scores to probabilities in place: 2^(s * c - shifted), one FMA and one exponential a score.
        __device__ __forceinline__ void row_exponentials(float (&s)[S_REGS], int r, float scale_log2, float shifted) {
            #pragma unroll
            for (int c = 0; c < BLOCK_KV / 8; ++c) {
                s[4 * c + 2 * r] = @EXP2@(fmaf(s[4 * c + 2 * r], scale_log2, -shifted));
                s[4 * c + 2 * r + 1] = @EXP2@(fmaf(s[4 * c + 2 * r + 1], scale_log2, -shifted));
            }
        }

        __device__ __forceinline__ float thread_row_sum(const float (&s)[S_REGS], int r) {
            float a[4] = {0.0f, 0.0f, 0.0f, 0.0f};
            #pragma unroll
            for (int c = 0; c < BLOCK_KV / 8; ++c) a[c % 4] += s[4 * c + 2 * r] + s[4 * c + 2 * r + 1];
            return (a[0] + a[1]) + (a[2] + a[3]);
        }

        @ONLINE_SOFTMAX@
        @ADD_ROW_SUMS@
        // Row r's sum of probabilities: the quad's partial sums, added; with ROW_SUMS_MMA every thread of
        // the quad holds the whole sum.
        __device__ __forceinline__ float row_sum(const RowState& st, int r) {
            return ROW_SUMS_MMA ? st.sum[r] : quad_sum(st.sum[r]);
        }

        __device__ __forceinline__ void rescale_output(float (&o)[O_REGS], const float (&alpha)[2]) {
            #pragma unroll
            for (int i = 0; i < O_REGS; ++i) o[i] *= alpha[(i >> 1) & 1];
        }

        @PACK@
        """
    ).replace("@PACK@", _PACK_EIGHT_BIT if eight_bit else _PACK_SIXTEEN_BIT)
    text = text.replace("@ONLINE_SOFTMAX@", (_LAZY_ONLINE_SOFTMAX if lazy else _EAGER_ONLINE_SOFTMAX) + "\n")
    text = re.sub(r"^@EXPONENTIAL@\n", _score_exponential(poly_exp, eight_bit) + "\n\n" if poly_exp else "", text,
                  flags=re.MULTILINE)
    text = text.replace("@EXP2@(", "score_exp2(c, " if poly_exp else "fast_exp2(")
    text = re.sub(r"^@ADD_ROW_SUMS@\n", _ADD_ROW_SUMS + "\n\n" if row_sums else "", text, flags=re.MULTILINE)
    values = {"@BIAS_NOTE@": "", "@BIAS_PARAM@": "", "@BIAS@": ""}
    if bias:
        values = {
            "@BIAS_NOTE@": "\n// Every other score gains its bias (rows past SEQ_Q read nothing); `bias_rows`: the bias\n"
                           "// tensor's rows of the tile's (batch, head).",
            "@BIAS_PARAM@": ", const bias_t* bias_rows",
            "@BIAS@": ("\n" + " " * 16 + "else if (SEQ_Q % BLOCK_Q == 0 || row < SEQ_Q)\n" + " " * 20
                       + "s[4 * c + e] += bias_score(bias_rows + size_t(row) * BIAS_ROW_STRIDE, col);"),
        }
    for placeholder, value in values.items():
        text = text.replace(placeholder, value)
    return text


POLY_EXP_DEGREE = {True: 2, False: 3}
"""The polynomial's degree by whether P is stored in 8 bits (e4m3's half step is 6 %: degree 2's
2e-3 suffices; 16-bit P takes degree 3, 1e-4)."""


def _score_exponential(poly_exp: int, eight_bit: bool) -> str:
    """``score_exp2(c, x)``: the exponential of chunk ``c``'s scores, a polynomial for ``poly_exp`` of
    every ``POLY_EXP_CHUNKS`` chunks (the FMA pipe), the SFU's ``ex2`` for the others."""
    return softmax.emit_poly_exp2(POLY_EXP_DEGREE[eight_bit]) + "\n\n" + block(
        f"""
        // Chunk c's exponentials: {poly_exp} of every {POLY_EXP_CHUNKS} 8-key chunks on the FMA pipe, the rest on the SFU,
        // so the SFU's queue (exponentials and P's conversions) no longer sets the softmax's length alone;
        // c is a constant of the unrolled loop, so the choice costs nothing.
        __device__ __forceinline__ float score_exp2(int c, float x) {{
            return c % {POLY_EXP_CHUNKS} < {poly_exp} ? poly_exp2(x) : fast_exp2(x);
        }}
        """
    )


_EAGER_ONLINE_SOFTMAX = """// Scores -> unnormalised probabilities in place; alpha: each row's rescale factor for O; returns
// whether O must be rescaled (always, in this eager form).
// p = 2^(s * c - m * c + P_SHIFT) with c = scale * log2(e) (times the score factors): one FMA
// and one ex2 a score. A row that has seen only masked scores keeps offset 0, so exp2(-inf)
// gives 0, not NaN.
__device__ __forceinline__ bool online_softmax(float (&s)[S_REGS], RowState& st, float (&alpha)[2],
                                               float scale_log2) {
    float row_max[2] = {thread_row_max(s, 0, st.max[0]), thread_row_max(s, 1, st.max[1])};
    #pragma unroll
    for (int r = 0; r < 2; ++r) {
        row_max[r] = quad_max(row_max[r]);
        const float offset = row_max[r] == neg_inf() ? 0.0f : row_max[r] * scale_log2;
        alpha[r] = fast_exp2(st.max[r] * scale_log2 - offset);
        st.max[r] = row_max[r];
        const float shifted = offset - P_SHIFT;
        row_exponentials(s, r, scale_log2, shifted);
        st.sum[r] = st.sum[r] * alpha[r] + (ROW_SUMS_MMA ? 0.0f : thread_row_sum(s, r));  // else P V sums them
    }
    return true;
}"""

_LAZY_ONLINE_SOFTMAX = """// Scores -> unnormalised probabilities in place, lazily: a row's running max (the exponents'
// offset) moves only when this tile raises it by more than LAZY_LOG2 (log2 units of the scaled
// scores), decided by a vote of the warp, so the quad's max shuffles, the alpha exponentials and
// the O rescale are skipped on most tiles; unmoved, probabilities stay below 2^(LAZY_LOG2 +
// P_SHIFT). Returns whether O must be rescaled by alpha (the same for the whole warp). A row
// that has seen only masked scores keeps offset 0, so exp2(-inf) gives 0, not NaN.
__device__ __forceinline__ bool online_softmax(float (&s)[S_REGS], RowState& st, float (&alpha)[2],
                                               float scale_log2) {
    // this thread's part of the rows
    float row_max[2] = {thread_row_max(s, 0, st.max[0]), thread_row_max(s, 1, st.max[1])};
    const bool grows = row_max[0] * scale_log2 > st.max[0] * scale_log2 + LAZY_LOG2
                       || row_max[1] * scale_log2 > st.max[1] * scale_log2 + LAZY_LOG2;
    const bool rescale = __any_sync(0xffffffffu, grows);
    if (rescale) {  // warp-uniform: the quads' shuffles are safe
        #pragma unroll
        for (int r = 0; r < 2; ++r) {
            row_max[r] = quad_max(row_max[r]);
            const float offset = row_max[r] == neg_inf() ? 0.0f : row_max[r] * scale_log2;
            alpha[r] = fast_exp2(st.max[r] * scale_log2 - offset);
            st.max[r] = row_max[r];
            st.sum[r] *= alpha[r];
        }
    }
    #pragma unroll
    for (int r = 0; r < 2; ++r) {
        const float shifted = (st.max[r] == neg_inf() ? 0.0f : st.max[r] * scale_log2) - P_SHIFT;
        row_exponentials(s, r, scale_log2, shifted);
        if (!ROW_SUMS_MMA) st.sum[r] += thread_row_sum(s, r);  // else P V sums them
    }
    return rescale;
}"""

_ADD_ROW_SUMS = """// ROW_SUMS_MMA: add one key tile's row sums, which its P V wgmmas computed against the rows of ones
// into their own accumulator (`sums`: row g in [0], [1], row g + 8 in [2], [3]; every column of a
// row holds the sum), to the row state, scaled by alpha where the row max moved after that P was
// made. A key tile's sum starts from zero in the tensor cores and is added up in fp32 here: the
// 8-bit wgmma accumulates at reduced precision, which loses a long row's small late terms.
__device__ __forceinline__ void add_row_sums(RowState& st, const float (&sums)[4], const float (&alpha)[2],
                                             bool rescaled) {
    #pragma unroll
    for (int r = 0; r < 2; ++r) st.sum[r] += rescaled ? sums[2 * r] * alpha[r] : sums[2 * r];
}"""

_PACK_SIXTEEN_BIT = block(
    """
    // P as wgmma A fragments: accumulator pairs (2i, 2i + 1) packed in order, 4 registers a k16 step.
    __device__ __forceinline__ void pack_probabilities(const float (&s)[S_REGS], u32 (&p)[P_REGS]) {
        #pragma unroll
        for (int i = 0; i < P_REGS; ++i) p[i] = pack2(s[2 * i], s[2 * i + 1]);
    }
    """
)

_PACK_EIGHT_BIT = block(
    """
    // P·2^8 as e4m3 wgmma A fragments, 4 registers a k32 step. A thread holds keys {2t, 2t+1} of each
    // 8-key chunk, the A operand 4 consecutive k slots: slot 4t + i of each 16-key half is key
    // {2t, 2t+1, 8+2t, 9+2t}[i], the order in which the launch writes V transposed.
    __device__ __forceinline__ void pack_probabilities(const float (&s)[S_REGS], u32 (&p)[P_REGS]) {
        #pragma unroll
        for (int kk = 0; kk < P_REGS / 4; ++kk) {
            const int c = 16 * kk;  // accumulator index of the step's first 8-key chunk
            p[4 * kk + 0] = pack_e4m3x4(s[c + 0], s[c + 1], s[c + 4], s[c + 5]);
            p[4 * kk + 1] = pack_e4m3x4(s[c + 2], s[c + 3], s[c + 6], s[c + 7]);
            p[4 * kk + 2] = pack_e4m3x4(s[c + 8], s[c + 9], s[c + 12], s[c + 13]);
            p[4 * kk + 3] = pack_e4m3x4(s[c + 10], s[c + 11], s[c + 14], s[c + 15]);
        }
    }
    """
)


def _work_tiles() -> str:
    return block(
        """
        // One work tile: BLOCK_Q query rows of one (batch, head) (packed: SEQ_Q rows of each of
        // TILE_HEADS heads) and the key tiles they attend to.
        struct WorkTile {
            int q0;        // first query row
            int head;      // (first) query head (of q and o)
            int kv_head;   // K/V head (of k and v; GQA: GROUP query heads share it)
            int batch;
            int kv_first;  // the first key tile visited (a window's; else 0)
            int kv_tiles;  // key tiles visited, from kv_first
        };

        // The query tiles of one head are consecutive, so concurrent blocks share its K and V in L2;
        // causal: longest first within the head. BALANCED (causal, persistent): longest first over
        // every head (the query tiles of one length are consecutive).
        __device__ __forceinline__ WorkTile work_tile(int tile) {
            constexpr int SLABS = BATCH * (HEADS / TILE_HEADS);
            const int q_tile = BALANCED ? Q_TILES - 1 - tile / SLABS
                               : CAUSAL ? Q_TILES - 1 - tile % Q_TILES : tile % Q_TILES;
            const int slab = BALANCED ? tile % SLABS : tile / Q_TILES;  // batch * HEADS / TILE_HEADS + head / TILE_HEADS
            WorkTile w;
            w.q0 = q_tile * BLOCK_Q;
            w.head = slab % (HEADS / TILE_HEADS) * TILE_HEADS;
            w.kv_head = w.head / GROUP;
            w.batch = slab / (HEADS / TILE_HEADS);
            // Causal: keys up to the tile's last row (top-left aligned, key j <= query i).
            // A window: from the tile of the first row's first key (the tiles below it are never loaded).
            w.kv_first = WINDOW > 0 ? max(0, w.q0 - (WINDOW - 1)) / BLOCK_KV : 0;
            w.kv_tiles = (UPPER_EDGE ? min(KV_TILES, (w.q0 + BLOCK_Q + AHEAD + BLOCK_KV - 1) / BLOCK_KV) : KV_TILES)
                         - w.kv_first;
            return w;
        }

        // The block's round-th work tile: tiles blockIdx.x, blockIdx.x + gridDim.x, ...; BALANCED: odd
        // rounds run the other way (block b takes the (gridDim.x - 1 - b)-th tile of the round), so a
        // block that took one of a round's longest tiles takes one of the next round's shortest.
        __device__ __forceinline__ int block_tile(int round) {
            const int b = BALANCED && (round & 1) ? gridDim.x - 1 - blockIdx.x : blockIdx.x;
            return round * gridDim.x + b;
        }

        // Row tile_row of a work tile is query position w.q0 + tile_row % PACK_ROWS of head
        // w.head + tile_row / PACK_ROWS (unpacked: position w.q0 + tile_row of w.head).
        __device__ __forceinline__ int row_head(const WorkTile& w, int tile_row) { return w.head + tile_row / PACK_ROWS; }
        __device__ __forceinline__ int row_position(const WorkTile& w, int tile_row) { return w.q0 + tile_row % PACK_ROWS; }

        // The next slot of a ring of SLOTS buffers (the K/V stages, the Q buffers): its index and the
        // phase its mbarriers are in.
        template <int SLOTS>
        __device__ __forceinline__ void advance(int& slot, u32& phase) {
            if (++slot == SLOTS) {
                slot = 0;
                phase ^= 1;
            }
        }
        """
    )


def _producer(eight_bit: bool = False, l2_prefetch: int = 0) -> str:
    """The producer's copies; ``eight_bit``: V comes from its transposed copy (D rows of the key
    tile's 128 key bytes: one box of the transposed map, at coordinates (keys, 0, head, batch));
    ``l2_prefetch``: before it waits for a slot, the producer asks L2 for K and V of the key tile
    that many ahead (at a work tile's first key tile: of every tile up to that one)."""
    v_copy = (
        "tma_load_4d(smem + V_SMEM + stage * V_STAGE_BYTES, v_map, v_bar, (w.kv_first + j) * BLOCK_KV, 0, w.kv_head, w.batch);"
        if eight_bit else
        "#pragma unroll\n"
        "for (int b = 0; b < V_BOXES; ++b)\n"
        "    tma_load_4d(smem + V_SMEM + stage * V_STAGE_BYTES + b * KV_BOX_BYTES, v_map, v_bar, BOX_COLUMNS * b,\n"
        "                (w.kv_first + j) * BLOCK_KV, w.kv_head, w.batch);"
    )
    prefetch, prefetch_call = "", ""
    if l2_prefetch:
        prefetch = block(
            f"""
            constexpr int L2_PREFETCH = {l2_prefetch};  // key tiles ahead of each load that L2 is asked for

            // Ask L2 for K and V of key tile j of a work tile (every box), unless the tile has no such key tile.
            __device__ __forceinline__ void prefetch_key_tile(const TensorMap* k_map, const TensorMap* v_map,
                                                              const WorkTile& w, int j) {{
                if (j >= w.kv_tiles) return;
                #pragma unroll
                for (int b = 0; b < QK_BOXES; ++b)
                    tma_prefetch_l2_4d(k_map, BOX_COLUMNS * b, (w.kv_first + j) * BLOCK_KV, w.kv_head, w.batch);
                #pragma unroll
                for (int b = 0; b < V_BOXES; ++b)
                    tma_prefetch_l2_4d(v_map, BOX_COLUMNS * b, (w.kv_first + j) * BLOCK_KV, w.kv_head, w.batch);
            }}
            """
        ) + "\n\n"
        prefetch_call = (
            "\n// Before waiting for the slot: L2 prefetch of key tile j + L2_PREFETCH (the work tile's first"
            "\n// key tile asks for every tile up to that one).\n"
            "for (int ahead = j == 0 ? 1 : L2_PREFETCH; ahead <= L2_PREFETCH; ++ahead)\n"
            "    prefetch_key_tile(k_map, v_map, w, j + ahead);"
        )
    return prefetch + block(
        """
        // K and V of key tile kv_first + j of one work tile into the ring's next slot, once every consumer warp has
        // released that slot's previous use (split release: K after its scores, V after its P V).
        __device__ __forceinline__ void produce_key_tile(const TensorMap* k_map, const TensorMap* v_map, u32 smem,
                                                         const WorkTile& w, int j, int& stage, u32& phase) {@PREFETCH@
            const u32 k_bar = smem + K_FULL + 8 * stage, v_bar = smem + V_FULL + 8 * stage;
            mbar_wait(smem + K_EMPTY + 8 * stage, phase ^ 1);
            mbar_arrive_expect_tx(k_bar, K_TILE_BYTES);
            #pragma unroll
            for (int b = 0; b < QK_BOXES; ++b)
                tma_load_4d(smem + K_SMEM + stage * K_TILE_BYTES + b * KV_BOX_BYTES, k_map, k_bar, BOX_COLUMNS * b,
                            (w.kv_first + j) * BLOCK_KV, w.kv_head, w.batch);
            if (SPLIT_RELEASE) mbar_wait(smem + V_EMPTY + 8 * stage, phase ^ 1);
            mbar_arrive_expect_tx(v_bar, V_TILE_BYTES);
            @V_COPY@
            advance<STAGES>(stage, phase);
        }

        // Q of one work tile into the next Q buffer, once every consumer warp has released it.
        __device__ __forceinline__ void produce_query_tile(const TensorMap* q_map, u32 smem, const WorkTile& w,
                                                           int& q_slot, u32& q_phase) {
            const u32 q_bar = smem + Q_FULL + 8 * q_slot;
            mbar_wait(smem + Q_EMPTY + 8 * q_slot, q_phase ^ 1);
            mbar_arrive_expect_tx(q_bar, Q_TILE_BYTES);
            #pragma unroll
            for (int b = 0; b < QK_BOXES; ++b)
                tma_load_4d(smem + Q_SMEM + q_slot * Q_TILE_BYTES + b * Q_BOX_BYTES, q_map, q_bar, BOX_COLUMNS * b,
                            w.q0, w.head, w.batch);
            advance<Q_BUFFERS>(q_slot, q_phase);
        }

        // One thread issues every copy, per work tile. One Q buffer: the tile's first key tile (that
        // slot frees up before Q does), Q once the consumers have released the previous tile's, then
        // the other key tiles. Two: Q first (its buffer was released a whole work tile ago), then
        // the key tiles in order.
        __device__ __forceinline__ void produce(const TensorMap* q_map, const TensorMap* k_map, const TensorMap* v_map,
                                                u32 smem) {
            tma_prefetch_map(q_map);
            tma_prefetch_map(k_map);
            tma_prefetch_map(v_map);
            int stage = 0, q_slot = 0;
            u32 phase = 0, q_phase = 0;
            for (int round = 0, tile; (tile = block_tile(round)) < TILES; ++round) {
                const WorkTile w = work_tile(tile);
                if (Q_BUFFERS > 1) produce_query_tile(q_map, smem, w, q_slot, q_phase);
                produce_key_tile(k_map, v_map, smem, w, 0, stage, phase);
                if (Q_BUFFERS == 1) produce_query_tile(q_map, smem, w, q_slot, q_phase);
                for (int j = 1; j < w.kv_tiles; ++j) produce_key_tile(k_map, v_map, smem, w, j, stage, phase);
            }
        }
        """
    ).replace("@V_COPY@", indent(v_copy, 1).lstrip()).replace("@PREFETCH@", indent(prefetch_call, 1))


def _consumer_matmuls(kv_wgmma: tuple, o_wgmma: tuple, eight_bit: bool = False, row_sums: bool = False) -> str:
    """``issue_scores`` and ``issue_values``; ``row_sums`` (8-bit): P V also issues the row sums' wgmma
    (N = ONES_ROWS against the rows of ones after the V tile) into ``sums``, from zero a key tile."""
    qk = wgmma.wgmma_name(*kv_wgmma)
    pv = wgmma.wgmma_name(*o_wgmma)
    sums = wgmma.wgmma_name(ONES_ROWS, o_wgmma[1], True, False)
    sums_note, sums_param, sums_issue = ("", "", "") if not row_sums else (
        "; and each k step's P against the\n// ONES_ROWS rows of ones after the tile, so `sums` (from zero) is this key "
        "tile's row sums",
        " float (&sums)[4],",
        f"\n        {sums}(sums, p[4 * kk], p[4 * kk + 1], p[4 * kk + 2], p[4 * kk + 3],"
        "\n            v_desc + ((V_TILE_BYTES + kk * 32) >> 4), kk > 0);",
    )
    values = block(
        f"""
        // O += P V with V transposed (K-major, keys in P's slot order): BLOCK_KV / 32 k-steps of 32
        // key bytes of each 128-byte swizzled row of the D-row tile@SUMS_NOTE@.
        __device__ __forceinline__ void issue_values(float (&o)[O_REGS],@SUMS_PARAM@ const u32 (&p)[P_REGS],
                                                     unsigned long long v_desc) {{
            #pragma unroll
            for (int kk = 0; kk < PV_STEPS; ++kk) {{
                {pv}(o, p[4 * kk], p[4 * kk + 1], p[4 * kk + 2], p[4 * kk + 3], v_desc + ((kk * 32) >> 4), 1);@SUMS_ISSUE@
            }}
        }}
        """
    ).replace("@SUMS_NOTE@", sums_note).replace("@SUMS_PARAM@", sums_param).replace("@SUMS_ISSUE@", sums_issue) \
        if eight_bit else block(
        f"""
        // O += P V: BLOCK_KV / 16 k-steps of 16 V rows; N = V_BOXES * BOX_COLUMNS columns spans
        // V_BOXES boxes, KV_BOX_BYTES apart (the descriptor's LBO).
        __device__ __forceinline__ void issue_values(float (&o)[O_REGS], const u32 (&p)[P_REGS],
                                                     unsigned long long v_desc) {{
            #pragma unroll
            for (int kk = 0; kk < PV_STEPS; ++kk)
                {pv}(o, p[4 * kk], p[4 * kk + 1], p[4 * kk + 2], p[4 * kk + 3],
                    v_desc + ((kk * 16 * ROW_BYTES) >> 4), 1);
        }}
        """
    )
    return block(
        f"""
        // S = Q K^T for this warpgroup's 64 rows: QK_STEPS k-steps. A k step is 32 bytes of each
        // swizzled row; every BOX_K_STEPS-th step moves to the next box (the zero columns of a
        // last box past HEAD_DIM are never read).
        __device__ __forceinline__ void issue_scores(float (&s)[S_REGS], unsigned long long q_desc,
                                                     unsigned long long k_desc) {{
            #pragma unroll
            for (int kk = 0; kk < QK_STEPS; ++kk) {{
                const u32 q_step = (kk / BOX_K_STEPS) * Q_BOX_BYTES + (kk % BOX_K_STEPS) * 32;
                const u32 k_step = (kk / BOX_K_STEPS) * KV_BOX_BYTES + (kk % BOX_K_STEPS) * 32;
                {qk}(s, q_desc + (q_step >> 4), k_desc + (k_step >> 4), kk > 0);
            }}
        }}
        """
    ) + "\n\n" + values


def _pingpong(enabled: bool) -> str:
    if not enabled:
        return block(
            """
            // No pingpong: the consumers issue their matmuls independently.
            __device__ __forceinline__ void matmul_turn_begin(int) {}
            __device__ __forceinline__ void matmul_turn_end(int, bool) {}
            """
        )
    return block(
        """
        // Pingpong of the two consumers (named barriers 1 and 2, 256 threads each): consumer c
        // waits on barrier 1 + c before issuing its matmuls and lets the other go after. Consumer 1
        // opens consumer 0's first turn and gives no turn after its last one, so every arrival is
        // matched by a wait.
        __device__ __forceinline__ void matmul_turn_begin(int consumer) {
            named_barrier_sync(1 + consumer, 256);
        }

        __device__ __forceinline__ void matmul_turn_end(int consumer, bool last) {
            if (!(consumer == 1 && last)) named_barrier_arrive(2 - consumer, 256);
        }
        """
    )


def _consumer(schedule: HopperFlashSchedule, problem: AttentionProblem) -> str:
    """``consume_tile`` and ``consume``: they pass the bias tensor and the factors on; 8-bit
    operands: V is read transposed (K-major)."""
    bias, eight_bit = problem.bias is not None, problem.dtype in HOPPER_EIGHT_BIT_DTYPES
    epilogue = _epilogue_through_smem() if _through_smem(schedule, problem) else _epilogue_from_registers()
    factor_params, _, score_factor, out_factor = factor_arguments(problem, "w.batch", "w.head")
    v_lbo = "16" if eight_bit else "KV_BOX_BYTES"
    text = block(
        """
        // Hand a shared-memory buffer back to the producer: one arrival per warp.
        __device__ __forceinline__ void release(u32 bar, int lane) {
            __syncwarp();
            if (lane == 0) mbar_arrive(bar);
        }

        // One work tile of one consumer warpgroup: 64 query rows, all their key tiles. Tile j's
        // scores are issued together with the previous tile's P V; the softmax of S_j runs while
        // P_(j-1) V_(j-1) is in flight. Stage j goes back to the producer after its P V (split
        // release: K_j already once S_j is done). Q is released after the last scores, so the producer can load the next
        // work tile's Q while this one finishes its last P V and stores O (with two Q buffers it
        // already has). (q_slot, q_phase) is the Q buffer of this tile; (stage, phase) is the ring
        // slot of the tile's first key tile and comes back as the slot after its last.
        __device__ __forceinline__ void consume_tile(u32 smem, const TensorMap* o_map, elem_t* __restrict__ o,@BIAS_PARAM@@LSE_PARAM@
                                                     int consumer, const WorkTile& w, int q_slot, u32 q_phase,
                                                     int& stage, u32& phase, bool last_tile, float scale_log2,
                                                     float out_factor) {
            const int lane = threadIdx.x % 32, warp = (threadIdx.x / 32) % 4;
            const int g = lane / 4, t = lane % 4;
            const int row0 = w.q0 + consumer * 64 + warp * 16 + g;  // this thread's first row (second: + 8)
            const int first_row = PACK ? w.q0 : w.q0 + consumer * 64;  // the warpgroup's first query@BIAS_ROWS@
            const u32 q_tile = smem + Q_SMEM + q_slot * Q_TILE_BYTES;
            const unsigned long long q_desc = make_smem_desc(q_tile + consumer * 64 * ROW_BYTES, 16, 8 * ROW_BYTES);
            const unsigned long long k_desc = make_smem_desc(smem + K_SMEM, 16, 8 * ROW_BYTES);
            const unsigned long long v_desc = make_smem_desc(smem + V_SMEM, @V_LBO@, 8 * ROW_BYTES);

            float s[S_REGS];
            float o_acc[O_REGS];@SUMS_DECL@
            u32 p[P_REGS];
            float alpha[2];
            RowState st = {{neg_inf(), neg_inf()}, {0.0f, 0.0f}};
            #pragma unroll
            for (int i = 0; i < O_REGS; ++i) o_acc[i] = 0.0f;

            // The work tile's first key tile (kv_first): scores only.
            mbar_wait(smem + Q_FULL + 8 * q_slot, q_phase);
            mbar_wait(smem + K_FULL + 8 * stage, phase);
            matmul_turn_begin(consumer);
            wgmma_fence();
            issue_scores(s, q_desc, k_desc + ((stage * K_TILE_BYTES) >> 4));
            wgmma_commit();
            matmul_turn_end(consumer, false);
            wgmma_wait<0>();
            fence_operands(s);
            if (SPLIT_RELEASE) release(smem + K_EMPTY + 8 * stage, lane);
            const int kv_first = w.kv_first * BLOCK_KV;
            if (needs_mask(kv_first, first_row)) mask_scores(s, row0, kv_first, t@BIAS_ARG@);
            online_softmax(s, st, alpha, scale_log2);
            pack_probabilities(s, p);

            int prev = stage;  // the ring slot of key tile j - 1
            u32 prev_phase = phase;
            advance<STAGES>(stage, phase);
            for (int j = 1; j < w.kv_tiles; ++j) {
                const int kv0 = (w.kv_first + j) * BLOCK_KV;
                mbar_wait(smem + K_FULL + 8 * stage, phase);
                matmul_turn_begin(consumer);
                fence_operands(o_acc);
                fence_operands(p);
                wgmma_fence();
                issue_scores(s, q_desc, k_desc + ((stage * K_TILE_BYTES) >> 4));
                wgmma_commit();
                mbar_wait(smem + V_FULL + 8 * prev, prev_phase);
                wgmma_fence();
                issue_values(o_acc,@SUMS_ARG@ p, v_desc + ((prev * V_STAGE_BYTES) >> 4));
                wgmma_commit();
                matmul_turn_end(consumer, false);
                wgmma_wait<1>();  // S_j is ready, P_(j-1) V_(j-1) may still run
                fence_operands(s);
                if (SPLIT_RELEASE) release(smem + K_EMPTY + 8 * stage, lane);
                if (needs_mask(kv0, first_row)) mask_scores(s, row0, kv0, t@BIAS_ARG@);
                const bool rescale = online_softmax(s, st, alpha, scale_log2);
                wgmma_wait<0>();
                fence_operands(o_acc);
                fence_operands(p);
                release(smem + V_EMPTY + 8 * prev, lane);
                if (rescale) rescale_output(o_acc, alpha);
                add_row_sums(st, sums, alpha, rescale);
                pack_probabilities(s, p);
                prev = stage;
                prev_phase = phase;
                advance<STAGES>(stage, phase);
            }

            // Every score is done: Q goes back to the producer for the next work tile. The last key
            // tile's P V; consumer 1 gives no turn after the block's last one.
            release(smem + Q_EMPTY + 8 * q_slot, lane);
            mbar_wait(smem + V_FULL + 8 * prev, prev_phase);
            matmul_turn_begin(consumer);
            fence_operands(o_acc);
            fence_operands(p);
            wgmma_fence();
            issue_values(o_acc,@SUMS_ARG@ p, v_desc + ((prev * V_STAGE_BYTES) >> 4));
            wgmma_commit();
            matmul_turn_end(consumer, last_tile);
            wgmma_wait<0>();
            fence_operands(o_acc);
            release(smem + V_EMPTY + 8 * prev, lane);
            add_row_sums(st, sums, alpha, false);

            @EPILOGUE@
        }

        // A consumer warpgroup walks the block's work tiles; the ring slot and the Q buffer run on.
        __device__ __forceinline__ void consume(u32 smem, const TensorMap* o_map, elem_t* __restrict__ o,@BIAS_PARAM@@LSE_PARAM@
                                                int consumer@FACTOR_PARAMS@) {
            int stage = 0, q_slot = 0;
            u32 phase = 0, q_phase = 0;
            if (PINGPONG && consumer == 1) named_barrier_arrive(1, 256);  // consumer 0 goes first
            for (int round = 0, tile; (tile = block_tile(round)) < TILES; ++round) {
                const WorkTile w = work_tile(tile);
                const float scale_log2 = SCALE_LOG2 * @SCORE_FACTOR@;  // times the tile's score factors
                consume_tile(smem, o_map, o,@BIAS_PASS@@LSE_PASS@ consumer, w, q_slot, q_phase, stage, phase,
                             block_tile(round + 1) >= TILES, scale_log2, @OUT_FACTOR@);
                advance<Q_BUFFERS>(q_slot, q_phase);
            }
            if (O_THROUGH_SMEM && threadIdx.x % 128 == 0) bulk_wait_all();  // shared memory must outlive the stores
        }
        """
    ).replace("    @EPILOGUE@", indent(epilogue))
    lse = problem.lse is not None
    text = text.replace("@LSE_PARAM@", " float* __restrict__ lse," if lse else "").replace("@LSE_PASS@",
                                                                                       " lse," if lse else "")
    text = re.sub(r"^( *)@LSE_STORE@\n", (lambda m: indent(_lse_store(), len(m[1]) // 4) + "\n") if lse else "", text,
                  flags=re.MULTILINE)
    row_sums = schedule.row_sums_mma
    text = text.replace("@SUMS_ARG@", " sums," if row_sums else "").replace(
        "@SUMS_DECL@", "\n    float sums[4];  // a key tile's row sums (the rows of ones' wgmma)" if row_sums else "")
    if not row_sums:
        text = re.sub(r"^ *add_row_sums\(.*\n", "", text, flags=re.MULTILINE)
    text = (text.replace("@V_LBO@", v_lbo).replace("@FACTOR_PARAMS@", factor_params)
            .replace("@SCORE_FACTOR@", f"({score_factor})").replace("@OUT_FACTOR@", out_factor))
    values = {"@BIAS_PARAM@": "", "@BIAS_ROWS@": "", "@BIAS_ARG@": "", "@BIAS_PASS@": ""}
    if bias:
        values = {
            "@BIAS_PARAM@": " const bias_t* __restrict__ bias,",
            "@BIAS_ROWS@": ("\n    const bias_t* bias_rows = bias + BIAS_OFFSET + w.batch * BIAS_BATCH_STRIDE"
                            " + w.head * BIAS_HEAD_STRIDE;  // the bias tensor's rows of the tile"),
            "@BIAS_ARG@": ", bias_rows",
            "@BIAS_PASS@": " bias,",
        }
    for placeholder, value in values.items():
        text = text.replace(placeholder, value)
    if problem.softcap:  # every tile's scores capped before its mask
        text = re.sub(r"^( *)(if \(needs_mask\()", r"\1cap_scores(s);\n\1\2", text, flags=re.MULTILINE)
    return text


_CAP_SCORES = """// A key tile's scores soft-capped in place (raw units), before its mask.
__device__ __forceinline__ void cap_scores(float (&s)[S_REGS]) {
    #pragma unroll
    for (int i = 0; i < S_REGS; ++i) s[i] = soft_cap(s[i]);
}"""


def _epilogue_from_registers() -> str:
    return block(
        """
            // Normalise by the row sums and store: each thread writes 2 values a row per 8 columns (of
            // V_DIM; O's columns past it, from the zeros of V's last box, are dropped).
            #pragma unroll
            for (int r = 0; r < 2; ++r) {
                const float sum = row_sum(st, r);
                @LSE_STORE@
                const float inv = sum > 0.0f ? out_factor / sum : 0.0f;  // a row without a live score gives 0
                const int tile_row = consumer * 64 + warp * 16 + g + 8 * r;
                const int position = row_position(w, tile_row);
                if (Q_TAIL && position >= SEQ_Q) continue;
                u32* out_row = reinterpret_cast<u32*>(o + O_OFFSET + w.batch * O_BATCH_STRIDE
                                                      + row_head(w, tile_row) * O_HEAD_STRIDE
                                                      + size_t(position) * O_ROW_STRIDE);
                #pragma unroll
                for (int c = 0; c < V_DIM / 8; ++c)
                    out_row[4 * c + t] = pack2(o_acc[4 * c + 2 * r] * inv, o_acc[4 * c + 2 * r + 1] * inv);
            }
        """
    )


def _epilogue_through_smem() -> str:
    return block(
        """
            // Normalise by the row sums into this warpgroup's 64 rows of the O tile (two Q buffers: its
            // own buffer; else the Q rows this warpgroup has finished with), in Q's swizzled box
            // layout: the 16-byte chunk k of row r sits at chunk k ^ ((r * ROW_BYTES / 128) % BOX_CHUNKS)
            // (128-byte rows: k ^ (r % 8)), so a store's rows hit different bank groups. Then one
            // thread stores the boxes with the copy engine
            // (packed: a box of 64 / SEQ_Q heads of SEQ_Q rows)
            // (full lines, rows past SEQ_Q and columns past V_DIM clipped by the tensor map) and
            // the warpgroup goes on.
            const u32 o_tile = (Q_BUFFERS == 2 ? smem + O_SMEM : q_tile) + consumer * 64 * ROW_BYTES;
            const bool store_thread = threadIdx.x % 128 == 0;
            if (Q_BUFFERS == 2) {  // the O tile's last store has read it
                if (store_thread) bulk_wait_read<0>();
                named_barrier_sync(3 + consumer, 128);
            }
            #pragma unroll
            for (int r = 0; r < 2; ++r) {
                const float sum = row_sum(st, r);
                @LSE_STORE@
                const float inv = sum > 0.0f ? 1.0f / sum : 0.0f;  // a row without a live score gives 0
                const u32 row = warp * 16 + g + 8 * r;
                const u32 swizzle = (row * ROW_BYTES / 128) % BOX_CHUNKS;
                #pragma unroll
                for (int c = 0; c < V_BOXES * BOX_CHUNKS; ++c)
                    st_shared_u32(o_tile + (c / BOX_CHUNKS) * Q_BOX_BYTES + row * ROW_BYTES
                                      + (((c % BOX_CHUNKS) ^ swizzle) << 4) + 4 * t,
                                  pack2(o_acc[4 * c + 2 * r] * inv, o_acc[4 * c + 2 * r + 1] * inv));
            }
            fence_proxy_async();  // the generic-proxy writes before the copy engine's reads
            named_barrier_sync(3 + consumer, 128);
            if (store_thread) {
                #pragma unroll
                for (int b = 0; b < V_BOXES; ++b)
                    tma_store_4d(o_map, o_tile + b * Q_BOX_BYTES, BOX_COLUMNS * b, row_position(w, consumer * 64),
                                 row_head(w, consumer * 64), w.batch);
                bulk_commit();
            }
        """
    )


def _lse_store() -> str:
    """One quad's row of the log-sum-exp output: log2 of the row's sum of 2^(c·s) is its exponents' offset
    (the running max times c, less P_SHIFT) plus log2 of the sum of its probabilities."""
    return block(
        """
        if (t == 0) {  // the row's log-sum-exp, natural log (-inf for a row without a live score)
            const int lse_row = consumer * 64 + warp * 16 + g + 8 * r;
            const int lse_position = row_position(w, lse_row);
            if (lse_position < SEQ_Q)
                lse[LSE_OFFSET + w.batch * LSE_BATCH_STRIDE + row_head(w, lse_row) * LSE_HEAD_STRIDE
                    + size_t(lse_position) * LSE_ROW_STRIDE]
                    = sum > 0.0f ? (st.max[r] * scale_log2 - P_SHIFT + log2f(sum)) * LN2 : neg_inf();
        }
        """
    )


def _through_smem(schedule: HopperFlashSchedule, problem: AttentionProblem) -> bool:
    """Whether O leaves by TMA stores from shared memory (16-bit operands only: an 8-bit Q tile
    cannot stage a 16-bit O tile)."""
    return schedule.o_through_smem and problem.dtype not in HOPPER_EIGHT_BIT_DTYPES


def transpose_kernel_name(schedule: HopperFlashSchedule) -> str:
    """The ``extern "C"`` name of the 8-bit variant's V transposition kernel."""
    return identifier(f"{kernel_name(schedule)}_transpose_v")


def transposed_keys(seq_kv: int) -> int:
    """Key slots of a row of the transposed V: the keys rounded up to whole 16-key groups."""
    return -(-seq_kv // 16) * 16


TRANSPOSE_THREADS = 256


def transpose_grid(problem: AttentionProblem) -> tuple[int, int, int]:
    """The V transposition's grid: units of 4 keys x 4 head-dim bytes, ``TRANSPOSE_THREADS`` a block."""
    units = transposed_keys(problem.seq_kv) // 16 * 4 * (problem.head_dim // 4)
    return -(-units // TRANSPOSE_THREADS), problem.kv_heads, problem.batch


def _transpose_values(schedule: HopperFlashSchedule) -> str:
    return block(
        f"""
        // V (BHSD at its strides) -> V^T [BATCH][KV_HEADS][HEAD_DIM][VT_KEYS]: within each 16-key group,
        // slot 4t + i holds key {{2t, 2t+1, 8+2t, 9+2t}}[i] (P's register order); keys past SEQ_KV are 0.
        // A thread moves 4 keys x 4 head-dim bytes (a 4x4 byte transpose with byte permutes).
        constexpr int VT_KEYS = (SEQ_KV + 15) / 16 * 16;
        extern "C" __global__ void __launch_bounds__({TRANSPOSE_THREADS})
        {transpose_kernel_name(schedule)}(const unsigned char* __restrict__ v, unsigned char* __restrict__ vt) {{
            const int unit = blockIdx.x * {TRANSPOSE_THREADS} + threadIdx.x;
            const int t = unit % 4, d4 = (unit / 4) % (HEAD_DIM / 4), group = unit / HEAD_DIM;
            if (group >= VT_KEYS / 16) return;
            const int kv_head = blockIdx.y, batch = blockIdx.z;
            const unsigned char* src = v + V_OFFSET + batch * V_BATCH_STRIDE + kv_head * V_HEAD_STRIDE + 4 * d4;
            const int keys[4] = {{16 * group + 2 * t, 16 * group + 2 * t + 1, 16 * group + 8 + 2 * t,
                                 16 * group + 9 + 2 * t}};
            u32 w[4];
            #pragma unroll
            for (int i = 0; i < 4; ++i)
                w[i] = keys[i] < SEQ_KV ? *reinterpret_cast<const u32*>(src + size_t(keys[i]) * V_ROW_STRIDE) : 0u;
            const u32 x01 = __byte_perm(w[0], w[1], 0x5140), x23 = __byte_perm(w[2], w[3], 0x5140);
            const u32 y01 = __byte_perm(w[0], w[1], 0x7362), y23 = __byte_perm(w[2], w[3], 0x7362);
            unsigned char* dst = vt + (size_t(batch) * KV_HEADS + kv_head) * HEAD_DIM * VT_KEYS
                                 + size_t(4 * d4) * VT_KEYS + 16 * group + 4 * t;
            *reinterpret_cast<u32*>(dst) = __byte_perm(x01, x23, 0x5410);
            *reinterpret_cast<u32*>(dst + VT_KEYS) = __byte_perm(x01, x23, 0x7632);
            *reinterpret_cast<u32*>(dst + 2 * VT_KEYS) = __byte_perm(y01, y23, 0x5410);
            *reinterpret_cast<u32*>(dst + 3 * VT_KEYS) = __byte_perm(y01, y23, 0x7632);
        }}
        """
    )


def _kernel(schedule: HopperFlashSchedule, problem: AttentionProblem) -> str:
    name = kernel_name(schedule)
    bias = problem.bias is not None
    bias_param, bias_arg = (", const bias_t* __restrict__ bias", " bias,") if bias else ("", "")
    factor_params, factor_args, _, _ = factor_arguments(problem, "w.batch", "w.head")
    lse_param, lse_arg = (", float* __restrict__ lse", " lse,") if problem.lse is not None else ("", "")
    if schedule.register_split:
        producer_regs, consumer_regs = "reg_dealloc<PRODUCER_REGS>();", "reg_alloc<CONSUMER_REGS>();"
    else:
        producer_regs = consumer_regs = "// (one consumer: no register reallocation)"
    return block(
        f"""
        extern "C" __global__ void __launch_bounds__(THREADS, 1)
        {name}(const __grid_constant__ TensorMap q_map, const __grid_constant__ TensorMap k_map,
                const __grid_constant__ TensorMap v_map, const __grid_constant__ TensorMap o_map,
                elem_t* __restrict__ o{bias_param}{factor_params}{lse_param}) {{
            extern __shared__ unsigned char smem_raw[];
            const u32 smem = (smem_u32(smem_raw) + {SWIZZLE_ALIGN - 1}u) & ~{SWIZZLE_ALIGN - 1}u;
            if (threadIdx.x == 0) {{
                #pragma unroll
                for (int b = 0; b < Q_BUFFERS; ++b) {{
                    mbar_init(smem + Q_FULL + 8 * b, 1);
                    mbar_init(smem + Q_EMPTY + 8 * b, 4 * CONSUMERS);  // one arrival per consumer warp
                }}
                #pragma unroll
                for (int s = 0; s < STAGES; ++s) {{
                    mbar_init(smem + K_FULL + 8 * s, 1);
                    mbar_init(smem + V_FULL + 8 * s, 1);
                    mbar_init(smem + K_EMPTY + 8 * s, 4 * CONSUMERS);
                    if (SPLIT_RELEASE) mbar_init(smem + V_EMPTY + 8 * s, 4 * CONSUMERS);
                }}
                fence_barrier_init();
                fence_proxy_async();
            }}
            if (ROW_SUMS_MMA) {{  // the rows of ones after each V stage (e4m3 1.0 = 0x38; the TMA never writes them)
                constexpr int WORDS = ONES_ROWS * ROW_BYTES / 4;  // a stage's
                for (int i = threadIdx.x; i < STAGES * WORDS; i += THREADS)
                    st_shared_u32(smem + V_SMEM + (i / WORDS) * V_STAGE_BYTES + V_TILE_BYTES + 4 * (i % WORDS),
                                  0x38383838u);
                fence_proxy_async();  // visible to the wgmmas (async proxy)
            }}
            __syncthreads();

            const int warpgroup = threadIdx.x / 128;
            if (warpgroup == 0) {{
                {producer_regs}
                if (threadIdx.x == 0) produce(&q_map, &k_map, &v_map, smem);
            }} else {{
                {consumer_regs}
                consume(smem, &o_map, o,{bias_arg}{lse_arg} warpgroup - 1{factor_args});
            }}
        }}
        """
    )
