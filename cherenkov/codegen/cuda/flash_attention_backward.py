"""The ``mma.sync`` flash-attention backward (sm_80 … sm_120): one plan → three ``__global__`` kernels.

(A ``wgmma`` schedule on sm_90a keeps this module's constants, helpers and launch shape — but for
dq, a block a (query tile, 64-column part) — and takes its three kernels from
:mod:`.flash_attention_backward_sm90a`.)

For ``o = softmax(c·q kᵀ [causal]) v`` and the gradient ``dO`` of its output, the derivation
gives ``dS = P∘(dP − D)`` with ``P = 2^{c·log2e·q·k − LSE₂}``, ``dP = dO vᵀ``, ``D = rowsum(dO∘O)``,
and ``dq = c·dS k``, ``dk = c·dSᵀ q``, ``dv = Pᵀ dO``
(:mod:`cherenkov.rewrites.gradients`). The three launches:

1. ``<name>_statistics`` — one block of 4 warps per 64 query rows of one head: the forward
   once more (S = Q Kᵀ, the online softmax, O = P V in registers) over the keys the rows
   see, then each row's ``LSE₂`` (the log-sum-exp in log2 units of the scaled scores) and
   ``D = Σ_e dO·O``; it also zeroes the rows' fp32 dq accumulator. Where the forward saved its
   output and log-sum-exp (``saved_statistics``), the pass reads them instead: a warp per
   query row computes ``D`` from the saved O and converts the saved log-sum-exp to ``LSE₂``,
   and the blocks zero the whole dq accumulator.
2. ``<name>`` (the main pass) — one block per ``BLOCK_KV`` keys of one K/V head; warp ``w``
   owns keys ``16w … 16w + 15`` and holds their dk and dv in fp32 registers while the query
   tiles of every query head of the group stream through shared memory (``STAGES`` buffers:
   with 2 the next tile loads while this one is used). Per tile a warp computes Sᵀ = K Qᵀ,
   Pᵀ from the saved ``LSE₂``, dv += Pᵀ dO (Pᵀ repacked from the accumulators as A operands,
   as the forward does with P), dPᵀ = V dOᵀ, dSᵀ = Pᵀ∘(dPᵀ − D), dk += dSᵀ Q; dSᵀ goes to
   shared memory, and the warps together compute the tile's dq = dS K, added to the fp32
   accumulator with atomic adds (with ``warp_pairs``, two warps share 32 keys instead and exchange
   Pᵀ and dSᵀ through shared memory: :mod:`.flash_attention_backward_pairs`). Causal blocks start
   at the first query tile that sees their keys. Finally dk·c and dv are written. The blocks take
   ``chunk`` slabs (batch × K/V
   head) at a time, key tile by key tile (:func:`chunk_slabs`): with a causal mask the longest
   blocks then start first and the last to start are short.
3. ``<name>_dq`` — dq = c·accumulator, rounded, written at dq's strides.

Shared-memory rows are padded by 16 bytes (``PAD``), so the 8 row addresses of an ldmatrix
phase fall in 8 different bank groups. Every problem value and tile size is a compile-time
constant; q, k, v, dO and the gradients may lie at any strides with a contiguous head dim.

Launch (:class:`cherenkov.codegen.launch.FlashBackwardKernel`): statistics on grid
``(ceil(Sq / 64), H, B)`` × 128 threads (saved statistics: ``(ceil(B·H·Sq / 8),)`` × 256), the
main pass on ``(chunk · ceil(Skv / BLOCK_KV), ceil(H_kv·B / chunk))`` × ``32·BLOCK_KV/16`` threads, dq on
``(ceil(B·H·Sq·D / 512),)`` × 256 threads; arguments ``(q, k, v, dO, workspace)`` for the
statistics pass, ``(q, k, v, dO, dk, dv, workspace)`` for the main pass (pointers; a gradient not
wanted is null; a problem's bias tensor follows in both; the saved statistics pass takes ``(o,
lse, dO, workspace)``) and ``(workspace, dq)`` for dq; the workspace ``B·H·Sq·(2 + D)`` floats
(LSE₂, D, the dq accumulator; with a bias ``B·H·Sq·(3 + D)``: each row's max and log2 sum apart,
so a row the bias masks wholly at its floor keeps the ``1 / sum`` of its keys).
"""

from __future__ import annotations

from cherenkov.codegen.cuda import attention_mask, cp_async, flash_attention_backward_sm90a, ldmatrix, mma, softmax
from cherenkov.codegen.cuda import flash_attention_backward_pairs as warp_pairs
from cherenkov.codegen.cuda.flash_attention import softmax_scale
from cherenkov.codegen.cuda.text import (block, bool_literal, comment_lines, fill_line, float_literal, identifier, indent,
                                         section)
from cherenkov.codegen.errors import CodegenError
from cherenkov.rewrites.plan import OperandLayout
from cherenkov.rewrites.plan_backward import (
    PAD,
    STATISTICS_KEYS,
    BackwardPlan,
    backward_schedule_problems,
    backward_smem_bytes,
    main_work_items,
    statistics_rows,
    statistics_smem_bytes,
)

LOG2E = 1.4426950408889634
STATISTICS_THREADS = 4 * 32
SAVED_STATISTICS_THREADS = 256
"""Threads of a saved-statistics block: a warp per query row."""
DQ_THREADS = 256


def kernel_name(plan: BackwardPlan) -> str:
    """The main pass's ``extern "C"`` name; the other two append ``_statistics`` and ``_dq``."""
    return identifier(f"ck_flash_attention_backward_{plan.schedule.key()}")


def dq_warp_grid(plan: BackwardPlan) -> tuple[int, int]:
    """(row tiles, column groups) the warps split a query tile's dq (BLOCK_Q × D) into."""
    row_tiles, warps = plan.schedule.block_q // 16, plan.schedule.warps
    if warps % row_tiles:
        raise CodegenError(f"{warps} warps do not split {row_tiles} dq row tiles")
    return row_tiles, warps // row_tiles


def workspace_floats(plan: BackwardPlan) -> int:
    """The fp32 workspace: each query row's LSE₂ and D, then (16-byte aligned) the dq accumulator
    (B, H, Sq, D; the ``wgmma`` passes tile it: :func:`.flash_attention_backward_sm90a.workspace_floats`)."""
    if plan.schedule.wgmma:
        return flash_attention_backward_sm90a.workspace_floats(plan)
    a = plan.problem.attention
    rows = a.batch * a.heads * a.seq_q
    return dq_accumulator_offset(plan) + rows * a.head_dim


def row_slots(plan: BackwardPlan) -> int:
    """fp32 words of each query row's statistics in the workspace: LSE₂ and D; with a bias tensor the
    row's max and log2 of its sum in place of LSE₂ (a row the bias masks wholly, every score at its
    −2^100 floor, keeps its sum that way: ``max + log2(sum)`` would round to the max)."""
    return 3 if plan.problem.attention.bias is not None else 2


def dq_accumulator_offset(plan: BackwardPlan) -> int:
    """Where the dq accumulator starts in the workspace: after each row's statistics, 16-byte aligned."""
    a = plan.problem.attention
    return -(-row_slots(plan) * a.batch * a.heads * a.seq_q // 4) * 4


def chunk_slabs(plan: BackwardPlan, sms: int | None) -> int:
    """Slabs (batch × K/V head) a one-tile main pass takes at a time (:func:`grids`). With a causal
    mask, about one block an SM (``round(sms / key tiles)``, 1 to all slabs): the chunk's blocks
    start longest first and the last chunk's work covers the device, so no long block starts last
    (H200, B2 H32/8 2k causal: 0.64 -> 0.45 ms; B4 H16 4k causal: 1.61 -> 1.56 ms). Without a mask
    or a device count: 1 (one slab's key tiles in order, its queries shared in L2)."""
    a, s = plan.problem.attention, plan.schedule
    if not (a.causal and sms):
        return 1
    slabs, kv_tiles = a.batch * a.kv_heads, -(-a.seq_kv // s.block_kv)
    return max(1, min(slabs, round(sms / kv_tiles)))


def grids(plan: BackwardPlan, sms: int | None = None) -> dict[str, tuple[tuple[int, int, int], int, int]]:
    """Per launch (``statistics``, ``main``, ``dq``): grid, threads and dynamic shared memory. A
    persistent main pass launches one block an SM (``sms``, the device's count; None: one a work item);
    a one-tile main pass ``(chunk · key tiles, chunks, head-dim parts)`` blocks, ``chunk`` slabs a chunk
    (:func:`chunk_slabs`)."""
    a, s = plan.problem.attention, plan.schedule
    if s.persistent:
        items = main_work_items(s, plan.problem)
        main_grid = (min(items, sms) if sms else items, 1, 1)
    else:
        chunk, slabs = chunk_slabs(plan, sms), a.batch * a.kv_heads
        main_grid = (chunk * -(-a.seq_kv // s.block_kv), -(-slabs // chunk), s.dim_parts)
    # dq: a thread a pair of elements; wgmma: a block a (query tile, 64-column part) of the tiled accumulator
    dq_blocks = (a.batch * a.heads * -(-a.seq_q // s.block_q) * (a.head_dim // 64) if s.wgmma
                 else -(-a.batch * a.heads * a.seq_q * a.head_dim // (2 * DQ_THREADS)))
    saved_rows = SAVED_STATISTICS_THREADS // 32
    return {
        "statistics": (((-(-a.batch * a.heads * a.seq_q // saved_rows), 1, 1), SAVED_STATISTICS_THREADS, 0)
                       if s.saved_statistics else
                       ((-(-a.seq_q // statistics_rows(s)), a.heads, a.batch),
                        2 * 128 if s.wgmma else STATISTICS_THREADS, statistics_smem_bytes(plan.problem, s))),
        "main": (main_grid, s.threads, backward_smem_bytes(s, plan.problem)),
        "dq": ((max(1, dq_blocks), 1, 1), DQ_THREADS, 0),
    }  # fmt: skip


def flash_attention_backward_source(plan: BackwardPlan) -> str:
    """The deterministic CUDA C++ of one backward plan."""
    problems = backward_schedule_problems(plan.schedule, plan.problem, plan.target)
    if problems:
        raise CodegenError(f"{plan.name} does not fit: {'; '.join(problems)}")
    name = kernel_name(plan)
    hopper = flash_attention_backward_sm90a if plan.schedule.wgmma else None
    bias, capped = plan.problem.attention.bias is not None, bool(plan.problem.attention.softcap)
    vector_reductions = plan.target.compute_capability >= 90  # red.global.add.v4.f32
    parts = [
        _header(plan, name),
        section("problem and tile constants", _types(), _constants(plan), *([hopper.constants(plan)] if hopper else [])),
        section("helpers", mma.emit_mma(plan.problem.attention.dtype), mma.emit_pack(plan.problem.attention.dtype),
                ldmatrix.emit_ldmatrix_primitives(4), cp_async.emit_cp_async(), softmax.emit_math_helpers(),
                attention_mask.emit_bias_score(plan.problem.attention),
                attention_mask.emit_soft_cap(plan.problem.attention, softmax_scale(plan.problem.attention)),
                _helpers(),
                *([warp_pairs.helpers()] if plan.schedule.warp_pairs else []),
                *([hopper.helpers(plan)] if hopper else
                              [flash_attention_backward_sm90a.emit_reduce_add_v4_f32()] if vector_reductions else [])),
        section("statistics: each query row's log-sum-exp and D = rowsum(dO o)",
                _saved_statistics_kernel(name) if plan.schedule.saved_statistics else
                hopper.statistics_kernel(plan, name) if hopper else _statistics_kernel(name, bias, capped)),
        section("main pass: dk and dv held per key tile, dq accumulated",
                hopper.main_kernel(plan, name) if hopper else
                _main_kernel(name, vector_reductions, plan.schedule.warp_pairs, bias, capped)),
        section("dq: the accumulator scaled and rounded", hopper.dq_kernel(name) if hopper else _dq_kernel(name)),
    ]  # fmt: skip
    return "\n\n".join(parts) + "\n"


def _header(plan: BackwardPlan, name: str) -> str:
    a = plan.problem.attention
    launches = grids(plan)
    persistent = (" (work items; launched with at most one block an SM)" if plan.schedule.persistent else
                  " (one slab a chunk; causal launches size the chunks to the device)" if a.causal else "")
    lines = [
        f"Generated by cherenkov: flash-attention backward, plan {identifier(plan.name)} for {identifier(plan.target.name)}.",
        f"Gradients {', '.join(plan.problem.roles)} of o = softmax(scale q k^T"
        f"{f' soft-capped at {a.softcap:.9g}' if a.softcap else ''}{' + causal mask' if a.causal else ''}"
        f"{f' + {identifier(a.bias.tensor)}' if a.bias is not None else ''}) v given dO "
        f"({identifier(plan.problem.grad_output)}).",
        f"B={a.batch} H={a.heads} H_kv={a.kv_heads} Sq={a.seq_q} Skv={a.seq_kv} D={a.head_dim} {a.dtype}; "
        f"BLOCK_KV={plan.schedule.block_kv} BLOCK_Q={plan.schedule.block_q} STAGES={plan.schedule.stages}; "
        f"main pass: {'wgmma (two warpgroups of 64 keys)' if plan.schedule.wgmma else 'mma.sync (a warp per 16 keys)'}; "
        f"statistics {'read from the saved o and log-sum-exp' if plan.schedule.saved_statistics else 'recomputed'}.",
        *(f"{identifier(name + suffix)}: grid {g}{persistent if suffix == '' else ''}, {t} threads, "
          f"{m} bytes of dynamic shared memory."
          for suffix, (g, t, m) in zip(("_statistics", "", "_dq"), launches.values())),
    ]  # fmt: skip
    return comment_lines(lines)


def _types() -> str:
    return block(
        """
        typedef unsigned int u32;
        typedef unsigned short elem_t;  // the bits of one 16-bit element
        """
    )


def _helpers() -> str:
    return block(
        """
        // Whether a query does not see a key under the causal mask or a window: a key after it (more than
        // AHEAD after it), or (WINDOW) one at least WINDOW before it.
        __device__ __forceinline__ bool hidden_key(int key, int query) {
            return UPPER_EDGE && (key > query + AHEAD || (WINDOW > 0 && query - key >= WINDOW));
        }

        // The first query tile (of BLOCK_Q) that sees a key of the tile from k0: that of key k0's query
        // (AHEAD before it) under the causal mask or a window; else 0.
        __device__ __forceinline__ int query_tiles_begin(int k0) {
            return UPPER_EDGE ? (AHEAD > 0 && k0 < AHEAD ? 0 : k0 - AHEAD) / BLOCK_Q : 0;
        }

        // The keys the rows from q0 of a block of `rows` see, up to: the last row's last key (causal mask
        // or window), or every key.
        __device__ __forceinline__ int keys_end(int q0, int rows) {
            return UPPER_EDGE ? min(SEQ_KV, q0 + rows + AHEAD) : SEQ_KV;
        }

        // The first key of a pass over keys in steps of `step` for the rows from q0: with a window, the
        // step of the first row's first key (the steps below it are never loaded); else 0.
        __device__ __forceinline__ int first_key_step(int q0, int step) {
            return WINDOW > 0 && q0 >= WINDOW ? (q0 - (WINDOW - 1)) / step * step : 0;
        }

        // The query tiles (of BLOCK_Q) up to the last that sees a key of the tile from k0: every tile, or
        // with a window those up to the one of key k0 + BLOCK_KV - 1's last query.
        __device__ __forceinline__ int query_tiles_end(int k0) {
            constexpr int TILES = (SEQ_Q + BLOCK_Q - 1) / BLOCK_Q;
            if constexpr (WINDOW == 0) return TILES;
            return min(TILES, (k0 + BLOCK_KV + WINDOW - 2) / BLOCK_Q + 1);
        }

        // A one-tile main-pass block's key tile. The grid is (CHUNK * KV_TILES, chunks): in launch order the
        // blocks take CHUNK slabs at a time, key tile by key tile, so with a causal mask the longest (key tile 0
        // sees every query) start first and the last to start are short. `valid`: false for the blocks of the
        // last chunk past the last slab.
        struct BlockKeyTile {
            int k0, kv_head, batch;
            bool valid;
        };

        __device__ __forceinline__ BlockKeyTile block_key_tile() {
            const int chunk = gridDim.x / KV_TILES, first = blockIdx.y * chunk;  // slabs a chunk, the chunk's first
            const int slabs = min(chunk, SLABS - first);
            const int slab = first + blockIdx.x % slabs, tile = blockIdx.x / slabs;
            return {tile * BLOCK_KV, slab % KV_HEADS, slab / KV_HEADS, tile < KV_TILES};
        }

        // Two n8 accumulator tiles (16 rows x 16 columns) repacked as one mma A operand (k = the columns).
        __device__ __forceinline__ void accumulators_as_a(u32 (&a)[4], const float (&lo)[4], const float (&hi)[4]) {
            a[0] = pack2(lo[0], lo[1]);
            a[1] = pack2(lo[2], lo[3]);
            a[2] = pack2(hi[0], hi[1]);
            a[3] = pack2(hi[2], hi[3]);
        }

        // Two rows' running max moved to include this tile's (tile_max: this thread's part of each row): the factor
        // the running sums and O are rescaled by, and the shift of this tile's exponents; l is rescaled here.
        __device__ __forceinline__ void advance_row_max(float (&m)[2], float (&l)[2], const float (&tile_max)[2],
                                                        float (&rescale)[2], float (&shift)[2]) {
            #pragma unroll
            for (int h = 0; h < 2; ++h) {
                const float m_new = fmaxf(m[h], quad_max(tile_max[h]));
                rescale[h] = m_new == -INFINITY ? 1.0f : exp2f(m[h] - m_new);
                shift[h] = m_new == -INFINITY ? 0.0f : m_new;
                m[h] = m_new;
                l[h] *= rescale[h];
            }
        }

        // Each row's sum over its quad, and its reciprocal (0 for a row without a live key).
        __device__ __forceinline__ void finish_row_sums(float (&l)[2], float (&inverse)[2]) {
            #pragma unroll
            for (int h = 0; h < 2; ++h) {
                l[h] = quad_sum(l[h]);
                inverse[h] = l[h] > 0.0f ? 1.0f / l[h] : 0.0f;
            }
        }

        // Rows row[0], row[1] of (batch, head): LSE2 = m + log2(l) (a row without a live key: +inf, so its
        // probabilities are 0; BIAS: m and log2(l) apart) and D (summed over the quad here) into the
        // workspace, by lane t == 0.
        __device__ __forceinline__ void store_row_statistics(float* workspace, size_t base, const int (&row)[2],
                                                             const float (&m)[2], const float (&l)[2], float (&delta)[2],
                                                             int t) {
            #pragma unroll
            for (int h = 0; h < 2; ++h) {
                delta[h] = quad_sum(delta[h]);
                if (t == 0 && row[h] < SEQ_Q) {
                    const float log2_sum = l[h] > 0.0f ? log2f(l[h]) : 0.0f;
                    workspace[base + row[h]] = l[h] > 0.0f ? (BIAS ? m[h] : m[h] + log2_sum) : INFINITY;
                    workspace[ROWS_TOTAL + base + row[h]] = delta[h];
                    if (BIAS) workspace[2 * ROWS_TOTAL + base + row[h]] = log2_sum;
                }
            }
        }

        __device__ __forceinline__ u32 smem_address(const void* p) {
            return u32(__cvta_generic_to_shared(p));
        }

        // A 16-bit element's value (bf16: its bits are the float's upper half; fp16 converted).
        __device__ __forceinline__ float to_float(elem_t x) {
        #if CK_BF16
            return __uint_as_float(u32(x) << 16);
        #else
            float f;
            asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(x));
            return f;
        #endif
        }

        // Copy `rows` rows of WIDTH elements (row `r` at src + r * stride) into a padded shared tile
        // (rows of WIDTH + PAD); rows at or past `valid` are zero-filled (nothing read). All threads of
        // the block take part.
        template <int ROWS, int THREADS_, int WIDTH = D>
        __device__ __forceinline__ void load_rows(elem_t* tile, const elem_t* src, size_t stride, int valid) {
            constexpr int ROW_CHUNKS = WIDTH / 8;  // 16-byte chunks of a row
            #pragma unroll
            for (int c = int(threadIdx.x); c < ROWS * ROW_CHUNKS; c += THREADS_) {
                const int row = c / ROW_CHUNKS, chunk = c % ROW_CHUNKS;
                const bool in_range = row < valid;
                cp_async_16(smem_address(tile + row * (WIDTH + PAD) + 8 * chunk),
                            in_range ? src + row * stride + 8 * chunk : src, in_range);
            }
        }

        // A operand (16 rows x k16 at k-step kk) of a padded tile of `row_elements` a row, rows [row0, row0 + 16).
        __device__ __forceinline__ void load_a(u32 (&a)[4], const elem_t* tile, int row0, int kk, int lane,
                                               int row_elements = ROW) {
            ldmatrix_x4(a, smem_address(tile + (row0 + (lane & 15)) * row_elements + 16 * kk + 8 * (lane >> 4)));
        }

        // B operands of the n8 tiles of rows [row0, row0 + 8) and [row0 + 8, row0 + 16) of a tile whose
        // rows are the mma's n and columns its k (k-step kk): b[0..1] the first tile, b[2..3] the second.
        __device__ __forceinline__ void load_b_rows(u32 (&b)[4], const elem_t* tile, int row0, int kk, int lane,
                                                    int row_elements = ROW) {
            const int row = row0 + (lane & 7) + ((lane >> 4) << 3);
            ldmatrix_x4(b, smem_address(tile + row * row_elements + 16 * kk + 8 * ((lane >> 3) & 1)));
        }

        // acc = A B^T over a head dim, fp32: rows [row0, row0 + 16) of tile `a` against the N rows of
        // tile `b` (both padded tiles of WIDTH columns: q, k's D or v, dO's DV), as N / 8 n8 accumulator tiles.
        template <int N, int WIDTH = D>
        __device__ __forceinline__ void rows_times_rows(float (&acc)[N / 8][4], const elem_t* a_tile, int row0,
                                                        const elem_t* b_tile, int lane) {
            #pragma unroll
            for (int n = 0; n < N / 8; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.0f;
            #pragma unroll
            for (int kk = 0; kk < WIDTH / 16; ++kk) {
                u32 a[4];
                load_a(a, a_tile, row0, kk, lane, WIDTH + PAD);
                #pragma unroll
                for (int p = 0; p < N / 16; ++p) {
                    u32 b[4];
                    load_b_rows(b, b_tile, 16 * p, kk, lane, WIDTH + PAD);
                    mma_16816(acc[2 * p], a, b[0], b[1]);
                    mma_16816(acc[2 * p + 1], a, b[2], b[3]);
                }
            }
        }

        // B operands of the n8 tiles of columns [col0, col0 + 8) and [col0 + 8, col0 + 16) over rows
        // [16 kk, 16 kk + 16) of a tile whose rows are the mma's k (loaded transposed).
        __device__ __forceinline__ void load_b_cols(u32 (&b)[4], const elem_t* tile, int row_elements, int kk,
                                                    int col0, int lane) {
            ldmatrix_x4_trans(b, smem_address(tile + (16 * kk + (lane & 15)) * row_elements + col0 + 8 * (lane >> 4)));
        }

        // A operand of rows [row0, row0 + 16) x k [16 kk, 16 kk + 16) of the transpose of a tile whose
        // rows are k (dS^T stored keys x queries, read as dS).
        __device__ __forceinline__ void load_a_transposed(u32 (&a)[4], const elem_t* tile, int row_elements, int row0,
                                                          int kk, int lane) {
            const int k = 16 * kk + (lane & 7) + 8 * ((lane >> 4) & 1);
            ldmatrix_x4_trans(a, smem_address(tile + k * row_elements + row0 + 8 * ((lane >> 3) & 1)));
        }
        """
    )


def _strides(prefix: str, layout: OperandLayout) -> str:
    return (f"constexpr size_t {prefix}_BATCH = {layout.batch}, {prefix}_HEAD = {layout.head}, "
            f"{prefix}_SEQ = {layout.seq}, {prefix}_OFFSET = {layout.offset};")  # fmt: skip


def _constants(plan: BackwardPlan) -> str:
    p, s = plan.problem, plan.schedule
    a = p.attention
    scale = softmax_scale(a)
    unused = OperandLayout(p.grad_output_layout.shape, 0, 0, 0)
    gradient = {role: p.gradient(role) for role in ("dq", "dk", "dv")}
    return "\n".join([
        f"#define CK_BF16 {int(a.dtype == 'bf16')}",
        f"constexpr int BATCH = {a.batch}, HEADS = {a.heads}, GROUP = {a.group_size};  // query heads a K/V head serves",
        "constexpr int KV_HEADS = HEADS / GROUP, SLABS = BATCH * KV_HEADS;  // slab: one (batch, K/V head)",
        f"constexpr int SEQ_Q = {a.seq_q}, SEQ_KV = {a.seq_kv}, D = {a.head_dim}, DV = {a.v_dim};  // q, k; v, o, dO",
        f"constexpr bool CAUSAL = {bool_literal(a.causal)};  // query i sees keys j <= i",
        f"constexpr int WINDOW = {a.window};  // 0: none; else query i sees keys i - WINDOW < j (<= i + AHEAD)",
        f"constexpr int AHEAD = {a.window_ahead};  // keys after the query a window without the causal mask sees",
        f"constexpr bool UPPER_EDGE = {bool_literal(a.upper_edge is not None)};  // causal or a window",
        f"constexpr float SCALE = {float_literal(scale)};  // of the scores",
        f"constexpr float SCALE_LOG2 = {float_literal(scale * LOG2E)};  // scores to log2 units",
        *(f"constexpr bool WANT_{role.upper()} = {bool_literal(gradient[role] is not None)};" for role in gradient),
        "// element (b, h, s, d) of an operand at OFFSET + b * BATCH + h * HEAD + s * SEQ + d (h: the K/V head for k, v,",
        "// dk, dv)",
        _strides("Q", a.layout("q")), _strides("K", a.layout("k")), _strides("V", a.layout("v")),
        _strides("DO", p.grad_output_layout),
        *(_strides(role.upper(), (gradient[role] or unused).layout if gradient[role] else unused)
          for role in gradient),
        f"constexpr int PAD = {PAD}, ROW = D + PAD, ROW_V = DV + PAD;  // padded shared-memory rows (elements): q, k; v, dO",
        "constexpr int CHUNKS = D / 8;  // 16-byte chunks of a q or k row",
        f"constexpr int STAT_ROWS = {statistics_rows(s)};  // query rows of a statistics block",
        *([] if s.wgmma else [f"constexpr int STAT_KEYS = {STATISTICS_KEYS}, STAT_THREADS = {STATISTICS_THREADS};"]),
        f"constexpr int BLOCK_KV = {s.block_kv}, BLOCK_Q = {s.block_q}, STAGES = {s.stages};",
        "constexpr int KV_TILES = (SEQ_KV + BLOCK_KV - 1) / BLOCK_KV;  // key tiles of a slab",
        "constexpr int WARPS = BLOCK_KV / 16, THREADS = 32 * WARPS;",
        *([] if s.wgmma else [warp_pairs.PAIR_CONSTANTS] if s.warp_pairs else _key_warp_constants(plan)),
        "constexpr size_t ROWS_TOTAL = size_t(BATCH) * HEADS * SEQ_Q;",
        "// workspace: each row's LSE2 (bias: its max), D (bias: then log2 of its sum), then dq (B, H, Sq, D)",
        f"constexpr int ROW_SLOTS = {row_slots(plan)};",
        "constexpr size_t DQ_ACCUMULATOR = (ROW_SLOTS * ROWS_TOTAL + 3) / 4 * 4;  // the dq accumulator, 16-byte aligned",
        attention_mask.emit_mask_constants(a, LOG2E, "log2 e: the scores' log2 units"),
        *(_saved_constants(plan) if s.saved_statistics else []),
        f"constexpr int DQ_THREADS = {DQ_THREADS}, DQ_BLOCKS = {grids(plan)['dq'][0][0]};  // the dq launch",
        "static_assert(D % 16 == 0 && DV % 16 == 0, \"head dims in whole k16 steps\");",
    ])  # fmt: skip


def _key_warp_constants(plan: BackwardPlan) -> list[str]:
    """What only the one-warp-per-16-keys main pass reads: the dS^T row and its dq warp grid."""
    row_tiles, column_groups = dq_warp_grid(plan)
    return [
        "constexpr int DS_ROW = BLOCK_Q + 8;  // padded dS^T row (elements)",
        f"constexpr int DIM_PARTS = {plan.schedule.dim_parts};  // head-dim parts of dk, dv, dq: a block holds one",
        "constexpr int D_PART = D / DIM_PARTS, DV_PART = DV / DIM_PARTS;  // its columns of dk, dq; of dv",
        f"constexpr int DQ_ROW_TILES = {row_tiles}, DQ_COLUMNS = D_PART / {column_groups};  // a warp's part of a dq tile",
        "static_assert(DQ_COLUMNS % 16 == 0, \"dq columns in whole ldmatrix pairs\");",
    ]


def _saved_constants(plan: BackwardPlan) -> list[str]:
    """Where the saved o and log-sum-exp lie, and the workspace's dq accumulator size."""
    saved = plan.problem.saved
    return [
        "// the forward's saved o (b, h, s, d) and log-sum-exp (b, h, s) at OFFSET + b * BATCH + h * HEAD + s * SEQ (+ d)",
        _strides("O", saved.o_layout), _strides("LSE", saved.lse_layout),
        f"constexpr size_t DQ_FLOATS = {workspace_floats(plan) - dq_accumulator_offset(plan)};  // the dq accumulator",
        f"constexpr int SAVED_THREADS = {SAVED_STATISTICS_THREADS}, SAVED_ROWS = SAVED_THREADS / 32, "
        f"SAVED_BLOCKS = {grids(plan)['statistics'][0][0]};",
        f"constexpr float LOG2E = {float_literal(LOG2E)};",
    ]


def _saved_statistics_kernel(name: str) -> str:
    return block(
        """
        // A warp per query row: D = rowsum(dO o) from the saved o, and the saved log-sum-exp (natural log) as LSE2
        // (an infinite one, a row without a live key, as +inf: its probabilities are 0); then every block zeroes
        // its part of the dq accumulator.
        extern "C" __global__ void __launch_bounds__(SAVED_THREADS) @NAME@_statistics(
            const elem_t* __restrict__ o, const float* __restrict__ lse, const elem_t* __restrict__ dout,
            float* __restrict__ workspace) {
            const int lane = threadIdx.x & 31;
            const size_t row = size_t(blockIdx.x) * SAVED_ROWS + (threadIdx.x >> 5);
            if (row < ROWS_TOTAL) {
                const int s = int(row % SEQ_Q), head = int(row / SEQ_Q % HEADS), batch = int(row / SEQ_Q / HEADS);
                const elem_t* orow = o + O_OFFSET + batch * O_BATCH + head * O_HEAD + s * O_SEQ;
                const elem_t* drow = dout + DO_OFFSET + batch * DO_BATCH + head * DO_HEAD + s * DO_SEQ;
                float delta = 0.0f;
                #pragma unroll
                for (int pair = lane; pair < DV / 2; pair += 32) {
                    const u32 x = *reinterpret_cast<const u32*>(orow + 2 * pair);
                    const u32 y = *reinterpret_cast<const u32*>(drow + 2 * pair);
                    delta += to_float(elem_t(x & 0xFFFFu)) * to_float(elem_t(y & 0xFFFFu))
                           + to_float(elem_t(x >> 16)) * to_float(elem_t(y >> 16));
                }
                #pragma unroll
                for (int offset = 16; offset > 0; offset >>= 1) delta += __shfl_xor_sync(0xffffffffu, delta, offset);
                if (lane == 0) {
                    const float x = lse[LSE_OFFSET + batch * LSE_BATCH + head * LSE_HEAD + s * LSE_SEQ];
                    workspace[row] = fabsf(x) == INFINITY ? INFINITY : x * LOG2E;
                    workspace[ROWS_TOTAL + row] = delta;
                }
            }
            if (WANT_DQ) {
                float4* accumulator = reinterpret_cast<float4*>(workspace + DQ_ACCUMULATOR);
                for (size_t i = size_t(blockIdx.x) * SAVED_THREADS + threadIdx.x; i < DQ_FLOATS / 4;
                     i += size_t(SAVED_BLOCKS) * SAVED_THREADS) {
                    accumulator[i] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
                }
            }
        }
        """
    ).replace("@NAME@", name)


def _statistics_kernel(name: str, bias: bool = False, capped: bool = False) -> str:
    """The statistics pass that runs the forward again; ``bias``: each score gains the bias tensor's element;
    ``capped``: each raw score is soft-capped first."""
    rows = ("\n    // the bias tensor's rows of this thread's two queries (a row past SEQ_Q reads the last one, never stored)"
            "\n    const bias_t* head_bias = bias + BIAS_OFFSET + batch * BIAS_BATCH_STRIDE + head * BIAS_HEAD_STRIDE;"
            "\n    const bias_t* bias_rows[2] = {head_bias + min(row[0], SEQ_Q - 1) * BIAS_ROW_STRIDE,"
            "\n                                  head_bias + min(row[1], SEQ_Q - 1) * BIAS_ROW_STRIDE};")
    values = {"@BIAS_PARAMETER@": _BIAS_PARAMETER, "@BIAS_ROWS@": rows,
              "@BIAS_TERM@": " + bias_score(bias_rows[e >> 1], key)"} if bias else dict.fromkeys(
        ("@BIAS_PARAMETER@", "@BIAS_ROWS@", "@BIAS_TERM@"), "")
    values["@SCORE@"] = "soft_cap(s[n][e])" if capped else "s[n][e]"
    text = _statistics_source(name)
    for placeholder, value in values.items():
        text = text.replace(placeholder, value)
    return text


def _statistics_source(name: str) -> str:
    return block(
        """
        extern "C" __global__ void __launch_bounds__(STAT_THREADS) @NAME@_statistics(
            const elem_t* __restrict__ q, const elem_t* __restrict__ k, const elem_t* __restrict__ v,
            const elem_t* __restrict__ dout, float* __restrict__ workspace@BIAS_PARAMETER@) {
            extern __shared__ __align__(16) unsigned char smem[];
            elem_t* sQ = reinterpret_cast<elem_t*>(smem);
            elem_t* sDO = sQ + STAT_ROWS * ROW;
            elem_t* sK = sDO + STAT_ROWS * ROW_V;
            elem_t* sV = sK + STAT_KEYS * ROW;
            const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
            const int q0 = blockIdx.x * STAT_ROWS, head = blockIdx.y, batch = blockIdx.z, kv_head = head / GROUP;
            const elem_t* qh = q + Q_OFFSET + batch * Q_BATCH + head * Q_HEAD;
            const elem_t* doh = dout + DO_OFFSET + batch * DO_BATCH + head * DO_HEAD;
            const elem_t* kh = k + K_OFFSET + batch * K_BATCH + kv_head * K_HEAD;
            const elem_t* vh = v + V_OFFSET + batch * V_BATCH + kv_head * V_HEAD;
            load_rows<STAT_ROWS, STAT_THREADS>(sQ, qh + q0 * Q_SEQ, Q_SEQ, SEQ_Q - q0);
            load_rows<STAT_ROWS, STAT_THREADS, DV>(sDO, doh + q0 * DO_SEQ, DO_SEQ, SEQ_Q - q0);
            cp_async_commit();
            cp_async_wait<0>();
            __syncthreads();
            u32 qa[D / 16][4];  // this warp's 16 query rows as A operands
            #pragma unroll
            for (int kk = 0; kk < D / 16; ++kk) load_a(qa[kk], sQ, 16 * warp, kk, lane);
            float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f}, o[DV / 8][4];
            #pragma unroll
            for (int n = 0; n < DV / 8; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.0f;
            const int row[2] = {q0 + 16 * warp + g, q0 + 16 * warp + g + 8};@BIAS_ROWS@
            const int keys = keys_end(q0, STAT_ROWS);  // the keys these rows see
            for (int k0 = first_key_step(q0, STAT_KEYS); k0 < keys; k0 += STAT_KEYS) {
                __syncthreads();  // every warp is done with the previous K and V tiles
                load_rows<STAT_KEYS, STAT_THREADS>(sK, kh + k0 * K_SEQ, K_SEQ, SEQ_KV - k0);
                load_rows<STAT_KEYS, STAT_THREADS, DV>(sV, vh + k0 * V_SEQ, V_SEQ, SEQ_KV - k0);
                cp_async_commit();
                cp_async_wait<0>();
                __syncthreads();
                // S = Q K^T for 16 rows x STAT_KEYS keys, in log2 units (soft-capped first where the problem
                // caps its scores), masked (BIAS: plus the bias)
                float s[STAT_KEYS / 8][4];
                #pragma unroll
                for (int n = 0; n < STAT_KEYS / 8; ++n) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.0f;
                #pragma unroll
                for (int kk = 0; kk < D / 16; ++kk) {
                    #pragma unroll
                    for (int p = 0; p < STAT_KEYS / 16; ++p) {
                        u32 b[4];
                        load_b_rows(b, sK, 16 * p, kk, lane);
                        mma_16816(s[2 * p], qa[kk], b[0], b[1]);
                        mma_16816(s[2 * p + 1], qa[kk], b[2], b[3]);
                    }
                }
                float tile_max[2] = {-INFINITY, -INFINITY};
                #pragma unroll
                for (int n = 0; n < STAT_KEYS / 8; ++n) {
                    #pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        const int key = k0 + 8 * n + 2 * t + (e & 1);
                        const bool masked = key >= SEQ_KV || hidden_key(key, row[e >> 1]);
                        s[n][e] = masked ? -INFINITY : @SCORE@ * SCALE_LOG2@BIAS_TERM@;
                        tile_max[e >> 1] = fmaxf(tile_max[e >> 1], s[n][e]);
                    }
                }
                float rescale[2], shift[2];
                advance_row_max(m, l, tile_max, rescale, shift);
                #pragma unroll
                for (int n = 0; n < DV / 8; ++n) {
                    o[n][0] *= rescale[0]; o[n][1] *= rescale[0]; o[n][2] *= rescale[1]; o[n][3] *= rescale[1];
                }
                #pragma unroll
                for (int n = 0; n < STAT_KEYS / 8; ++n) {
                    #pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        s[n][e] = fast_exp2(s[n][e] - shift[e >> 1]);
                        l[e >> 1] += s[n][e];
                    }
                }
                // O += P V: P repacked as A operands, V loaded transposed
                #pragma unroll
                for (int kk = 0; kk < STAT_KEYS / 16; ++kk) {
                    u32 a[4];
                    accumulators_as_a(a, s[2 * kk], s[2 * kk + 1]);
                    #pragma unroll
                    for (int c = 0; c < DV / 16; ++c) {
                        u32 b[4];
                        load_b_cols(b, sV, ROW_V, kk, 16 * c, lane);
                        mma_16816(o[2 * c], a, b[0], b[1]);
                        mma_16816(o[2 * c + 1], a, b[2], b[3]);
                    }
                }
            }
            // LSE2 = m + log2(l) (a row without a live key: +inf, so its probabilities are 0), D = rowsum(dO o)
            float delta[2] = {0.0f, 0.0f}, inverse[2];
            finish_row_sums(l, inverse);
            #pragma unroll
            for (int n = 0; n < DV / 8; ++n) {
                #pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int r = 16 * warp + g + 8 * (e >> 1), d = 8 * n + 2 * t + (e & 1);
                    delta[e >> 1] += o[n][e] * inverse[e >> 1] * to_float(sDO[r * ROW_V + d]);
                }
            }
            const size_t base = (size_t(batch) * HEADS + head) * SEQ_Q;
            store_row_statistics(workspace, base, row, m, l, delta, t);
            if (WANT_DQ) {  // zero this tile's rows of the dq accumulator
                float4* accumulator = reinterpret_cast<float4*>(workspace + DQ_ACCUMULATOR + (base + q0) * D);
                const int valid = min(STAT_ROWS, SEQ_Q - q0) * D / 4;
                for (int i = int(threadIdx.x); i < valid; i += STAT_THREADS) accumulator[i] = make_float4(0, 0, 0, 0);
            }
        }
        """
    ).replace("@NAME@", name)


_DQ_ATOMICS = block(
    """
    #pragma unroll
    for (int n = 0; n < DQ_COLUMNS / 8; ++n) {
        #pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int r = r0 + g + 8 * (e >> 1), d = c0 + 8 * n + 2 * t + (e & 1);
            if (q0 + r < SEQ_Q) atomicAdd(rows + r * D + d, acc[n][e]);
        }
    }
    """
)

_DQ_VECTOR_REDUCTIONS = block(
    """
    // Four floats a reduction: lanes t and t ^ 1 swap half their fragment, so the even lane holds
    // row g's columns 4 (t / 2) .. + 3 and the odd lane row g + 8's.
    const bool odd = t & 1;
    #pragma unroll
    for (int n = 0; n < DQ_COLUMNS / 8; ++n) {
        const float x = __shfl_xor_sync(0xffffffffu, odd ? acc[n][0] : acc[n][2], 1);
        const float y = __shfl_xor_sync(0xffffffffu, odd ? acc[n][1] : acc[n][3], 1);
        const int r = r0 + g + 8 * odd, d = c0 + 8 * n + 4 * (t >> 1);
        if (q0 + r < SEQ_Q) {
            if (odd) reduce_add_v4_f32(rows + r * D + d, x, y, acc[n][2], acc[n][3]);
            else reduce_add_v4_f32(rows + r * D + d, acc[n][0], acc[n][1], x, y);
        }
    }
    """
)


_KEY_WARP_ACCUMULATORS = """// columns d0 .. d0 + D_PART - 1 of dk (and of dq), dv0 .. dv0 + DV_PART - 1 of dv, for keys
// 16 warp + g (+ 8) of this block, fp32
const int d0 = int(blockIdx.z) * D_PART, dv0 = int(blockIdx.z) * DV_PART;
float dk[D_PART / 8][4], dv[DV_PART / 8][4];
#pragma unroll
for (int n = 0; n < D_PART / 8; ++n) {
    #pragma unroll
    for (int e = 0; e < 4; ++e) dk[n][e] = 0.0f;
}
#pragma unroll
for (int n = 0; n < DV_PART / 8; ++n) {
    #pragma unroll
    for (int e = 0; e < 4; ++e) dv[n][e] = 0.0f;
}
const int key[2] = {k0 + 16 * warp + g, k0 + 16 * warp + g + 8};"""
"""A 16-key warp's dk and dv (the block's head-dim part) and its two keys."""

_KEY_WARP_STEP = """// S^T = K Q^T: 16 keys x BLOCK_Q queries
float s[BLOCK_Q / 8][4];
rows_times_rows<BLOCK_Q>(s, sK, 16 * warp, tq, lane);
@SOFT_CAP@
@P_FORMULA@
#pragma unroll
for (int n = 0; n < BLOCK_Q / 8; ++n) {
    #pragma unroll
    for (int e = 0; e < 4; ++e) {
        const int column = 8 * n + 2 * t + (e & 1), query = q0 + column;
        const bool masked = key[e >> 1] >= SEQ_KV || query >= SEQ_Q || hidden_key(key[e >> 1], query);
        s[n][e] = masked ? 0.0f : fast_exp2(@P_EXPONENT@);
    }
}
if (WANT_DV) {  // dv += P^T dO
    #pragma unroll
    for (int kk = 0; kk < BLOCK_Q / 16; ++kk) {
        u32 a[4];
        accumulators_as_a(a, s[2 * kk], s[2 * kk + 1]);
        #pragma unroll
        for (int c = 0; c < DV_PART / 16; ++c) {
            u32 b[4];
            load_b_cols(b, tdo, ROW_V, kk, dv0 + 16 * c, lane);
            mma_16816(dv[2 * c], a, b[0], b[1]);
            mma_16816(dv[2 * c + 1], a, b[2], b[3]);
        }
    }
}
if (WANT_DQ || WANT_DK) {
    // dP^T = V dO^T, then dS^T = P^T (dP^T - D) (in s)
    float dp[BLOCK_Q / 8][4];
    rows_times_rows<BLOCK_Q, DV>(dp, sV, 16 * warp, tdo, lane);
    #pragma unroll
    for (int n = 0; n < BLOCK_Q / 8; ++n) {
        #pragma unroll
        for (int e = 0; e < 4; ++e) s[n][e] *= (dp[n][e] - tdelta[8 * n + 2 * t + (e & 1)])@SLOPE@;
    }
    #pragma unroll
    for (int kk = 0; kk < BLOCK_Q / 16; ++kk) {
        u32 a[4];
        accumulators_as_a(a, s[2 * kk], s[2 * kk + 1]);
        if (WANT_DK) {  // dk += dS^T Q
            #pragma unroll
            for (int c = 0; c < D_PART / 16; ++c) {
                u32 b[4];
                load_b_cols(b, tq, ROW, kk, d0 + 16 * c, lane);
                mma_16816(dk[2 * c], a, b[0], b[1]);
                mma_16816(dk[2 * c + 1], a, b[2], b[3]);
            }
        }
        if (WANT_DQ) {  // dS^T to shared memory, rows = this warp's keys
            u32* upper = reinterpret_cast<u32*>(sDs + (16 * warp + g) * DS_ROW + 16 * kk + 2 * t);
            u32* lower = reinterpret_cast<u32*>(sDs + (16 * warp + g + 8) * DS_ROW + 16 * kk + 2 * t);
            upper[0] = a[0];
            lower[0] = a[1];
            upper[4] = a[2];
            lower[4] = a[3];
        }
    }
}
if (WANT_DQ) {  // dq (BLOCK_Q x D_PART) += dS K, warps over (row tile, column group), atomics
    __syncthreads();
    const int r0 = 16 * (warp % DQ_ROW_TILES), c0 = d0 + (warp / DQ_ROW_TILES) * DQ_COLUMNS;
    if (warp < DQ_ROW_TILES * (D_PART / DQ_COLUMNS)) {
        float acc[DQ_COLUMNS / 8][4];
        #pragma unroll
        for (int n = 0; n < DQ_COLUMNS / 8; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.0f;
        #pragma unroll
        for (int kk = 0; kk < BLOCK_KV / 16; ++kk) {
            u32 a[4];
            load_a_transposed(a, sDs, DS_ROW, r0, kk, lane);
            #pragma unroll
            for (int c = 0; c < DQ_COLUMNS / 16; ++c) {
                u32 b[4];
                load_b_cols(b, sK, ROW, kk, c0 + 16 * c, lane);
                mma_16816(acc[2 * c], a, b[0], b[1]);
                mma_16816(acc[2 * c + 1], a, b[2], b[3]);
            }
        }
        float* rows = dq_accumulator + ((size_t(batch) * HEADS + head) * SEQ_Q + q0) * D;
        @DQ_ADD@
    }
}"""
"""One step of the one-warp-per-16-keys main pass (the loop body after the step's tiles are found)."""

_KEY_WARP_EPILOGUE = """// dk * SCALE and dv (the block's head-dim parts), rounded, at their strides
#pragma unroll
for (int n = 0; n < D_PART / 8; ++n) {
    #pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int d = d0 + 8 * n + 2 * t;
        if (WANT_DK && key[h] < SEQ_KV) {
            *reinterpret_cast<u32*>(dk_out + DK_OFFSET + batch * DK_BATCH + kv_head * DK_HEAD + key[h] * DK_SEQ + d)
                = pack2(dk[n][2 * h] * SCALE, dk[n][2 * h + 1] * SCALE);
        }
    }
}
#pragma unroll
for (int n = 0; n < DV_PART / 8; ++n) {
    #pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int d = dv0 + 8 * n + 2 * t;
        if (WANT_DV && key[h] < SEQ_KV) {
            *reinterpret_cast<u32*>(dv_out + DV_OFFSET + batch * DV_BATCH + kv_head * DV_HEAD + key[h] * DV_SEQ + d)
                = pack2(dv[n][2 * h], dv[n][2 * h + 1]);
        }
    }
}"""
"""A 16-key warp's dk (scaled) and dv, rounded, written at their strides."""

_MAIN_KERNEL = """
        extern "C" __global__ void __launch_bounds__(THREADS) @NAME@(
            @PARAMETERS@) {
            extern __shared__ __align__(16) unsigned char smem[];
            elem_t* sK = reinterpret_cast<elem_t*>(smem);
            elem_t* sV = sK + BLOCK_KV * ROW;
            elem_t* sQ = sV + BLOCK_KV * ROW_V;           // STAGES tiles of BLOCK_Q rows
            elem_t* sDO = sQ + STAGES * BLOCK_Q * ROW;    // STAGES tiles of BLOCK_Q rows (of ROW_V)
            float* sLse = reinterpret_cast<float*>(sDO + STAGES * BLOCK_Q * ROW_V);  // STAGES x BLOCK_Q
            float* sDelta = sLse + STAGES * BLOCK_Q;
            elem_t* sDs = reinterpret_cast<elem_t*>(sDelta + STAGES * BLOCK_Q);  // BLOCK_KV x DS_ROW: dS^T
            @P_TILE@
            @BIAS_SMEM@
            const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
            @ROLES@
            const BlockKeyTile mine = block_key_tile();
            if (!mine.valid) return;  // past the last slab
            const int k0 = mine.k0, kv_head = mine.kv_head, batch = mine.batch;
            const elem_t* kh = k + K_OFFSET + batch * K_BATCH + kv_head * K_HEAD;
            const elem_t* vh = v + V_OFFSET + batch * V_BATCH + kv_head * V_HEAD;
            load_rows<BLOCK_KV, THREADS>(sK, kh + k0 * K_SEQ, K_SEQ, SEQ_KV - k0);
            load_rows<BLOCK_KV, THREADS, DV>(sV, vh + k0 * V_SEQ, V_SEQ, SEQ_KV - k0);
            // the query tiles that see these keys, for each query head of the group: the steps
            const int first = query_tiles_begin(k0);
            const int tiles = query_tiles_end(k0) - first;
            const int steps = tiles > 0 ? GROUP * tiles : 0;
            const float* lse2 = workspace;
            const float* deltas = workspace + ROWS_TOTAL;
            @BIAS_SUMS@
            float* dq_accumulator = workspace + DQ_ACCUMULATOR;
            auto load_step = [&](int step) {  // q, dO, LSE2 and D rows of step `step` into its stage
                const int stage = step % STAGES, head = kv_head * GROUP + step / tiles;
                const int q0 = (first + step % tiles) * BLOCK_Q;
                load_rows<BLOCK_Q, THREADS>(sQ + stage * BLOCK_Q * ROW,
                                            q + Q_OFFSET + batch * Q_BATCH + head * Q_HEAD + q0 * Q_SEQ, Q_SEQ,
                                            SEQ_Q - q0);
                load_rows<BLOCK_Q, THREADS, DV>(sDO + stage * BLOCK_Q * ROW_V,
                                            dout + DO_OFFSET + batch * DO_BATCH + head * DO_HEAD + q0 * DO_SEQ, DO_SEQ,
                                            SEQ_Q - q0);
                const size_t rows = (size_t(batch) * HEADS + head) * SEQ_Q + q0;
                for (int i = int(threadIdx.x); i < BLOCK_Q; i += THREADS) {
                    const bool in_range = q0 + i < SEQ_Q;
                    sLse[stage * BLOCK_Q + i] = in_range ? lse2[rows + i] : INFINITY;
                    sDelta[stage * BLOCK_Q + i] = in_range ? deltas[rows + i] : 0.0f;
                    @BIAS_LOAD@
                }
            };
            if (steps > 0) load_step(0);
            cp_async_commit();
            @ACCUMULATORS@
            for (int step = 0; step < steps; ++step) {
                const int stage = step % STAGES, head = kv_head * GROUP + step / tiles;
                const int q0 = (first + step % tiles) * BLOCK_Q;
                cp_async_wait<0>();
                __syncthreads();  // this step's tiles are in; every warp is done with the last step
                if (STAGES == 1 && step > 0) {  // one buffer: load now, then wait
                    load_step(step);
                    cp_async_commit();
                    cp_async_wait<0>();
                    __syncthreads();
                }
                if (STAGES > 1 && step + 1 < steps) load_step(step + 1);
                cp_async_commit();
                const elem_t* tq = sQ + stage * BLOCK_Q * ROW;
                const elem_t* tdo = sDO + stage * BLOCK_Q * ROW_V;
                const float* tlse = sLse + stage * BLOCK_Q;
                const float* tdelta = sDelta + stage * BLOCK_Q;
                @BIAS_TILE@
                @STEP@
            }
            @EPILOGUE@
        }
"""
"""The main pass's opening and step loop; a warp layout fills its roles, accumulators, step and epilogue."""


_BIAS_PARAMETER = ", const bias_t* __restrict__ bias"
"""The bias tensor, the last parameter of the statistics and main passes of a problem with one."""

_P_UNBIASED = ("// P^T = 2^(S^T SCALE_LOG2 - LSE2), 0 where masked", "s[n][e] * SCALE_LOG2 - tlse[column]")
_P_BIASED = (
    "// P^T = 2^((S^T SCALE_LOG2 + bias - max) - log2(sum)), 0 where masked (a row at the bias's floor: 1 / sum)\n"
    "const bias_t* bias_rows = bias + BIAS_OFFSET + batch * BIAS_BATCH_STRIDE + head * BIAS_HEAD_STRIDE;\n"
    "auto exponent = [&](float score, int query, int key, int column) {\n"
    "    const float biased = score * SCALE_LOG2 + bias_score(bias_rows + size_t(query) * BIAS_ROW_STRIDE, key);\n"
    "    return (biased - tlse[column]) - tlog2[column];\n"
    "};",
    "exponent(s[n][e], query, key[e >> 1], column)",
)
_BIAS_MAIN_PARTS = {
    "BIAS_SUMS": "const float* log2_sums = workspace + 2 * ROWS_TOTAL;",
    "BIAS_SMEM": "float* sLog2 = reinterpret_cast<float*>(sDs + BLOCK_KV * DS_ROW);  // STAGES x BLOCK_Q: log2 of row sums",
    "BIAS_LOAD": "sLog2[stage * BLOCK_Q + i] = in_range ? log2_sums[rows + i] : 0.0f;",
    "BIAS_TILE": "const float* tlog2 = sLog2 + stage * BLOCK_Q;",
}
"""The bias's lines of the one-warp-per-16-keys main pass: each row's log2 sum staged beside its max."""

_SOFT_CAP_SCORES = """// the soft cap: each raw score capped, and its slope 1 - tanh^2 kept for dS (the gradient of the
// capped score's argument: dq = SCALE dS K as without a cap)
float slope[BLOCK_Q / 8][4];
#pragma unroll
for (int n = 0; n < BLOCK_Q / 8; ++n) {
    #pragma unroll
    for (int e = 0; e < 4; ++e) {
        s[n][e] = soft_cap(s[n][e]);
        slope[n][e] = soft_cap_slope(s[n][e]);
    }
}"""
"""The soft cap's lines of the one-warp-per-16-keys main pass, after Sᵀ: the capped scores and their slopes."""


def _main_kernel(name: str, vector_reductions: bool, pairs: bool, bias: bool = False, capped: bool = False) -> str:
    """The main pass: a warp per 16 keys, or with ``pairs`` two warps per 32 keys
    (:mod:`.flash_attention_backward_pairs`); ``vector_reductions`` (sm_90 and later): dq is added
    four floats a ``red.global.add.v4.f32`` instead of one float an atomic add; ``bias`` (16-key
    warps only): each score gains the bias tensor's element before its probability is recomputed;
    ``capped``: each raw score is soft-capped, and dS gains the cap's slope."""
    dq_add = _DQ_VECTOR_REDUCTIONS if vector_reductions else _DQ_ATOMICS
    if pairs:
        parts = {"ROLES": warp_pairs.PAIR_ROLES, "P_TILE": warp_pairs.PAIR_P_TILE,
                 "ACCUMULATORS": warp_pairs.PAIR_ACCUMULATORS, "STEP": warp_pairs.pair_step(dq_add, capped),
                 "EPILOGUE": warp_pairs.PAIR_EPILOGUE}
    else:
        formula, exponent = _P_BIASED if bias else _P_UNBIASED
        step = (_KEY_WARP_STEP.replace("@DQ_ADD@", indent(dq_add, 2).lstrip()).replace("@P_EXPONENT@", exponent)
                .replace("@SLOPE@", " * slope[n][e]" if capped else ""))
        step = fill_line(fill_line(step, "P_FORMULA", formula), "SOFT_CAP", _SOFT_CAP_SCORES if capped else "")
        parts = {"ROLES": "", "P_TILE": "", "ACCUMULATORS": _KEY_WARP_ACCUMULATORS, "STEP": step,
                 "EPILOGUE": _KEY_WARP_EPILOGUE}
    parts.update({key: value if bias else "" for key, value in _BIAS_MAIN_PARTS.items()})
    text = block(_MAIN_KERNEL).replace("@NAME@", name)
    text = text.replace("@PARAMETERS@", flash_attention_backward_sm90a.MAIN_PASS_PARAMETERS + (_BIAS_PARAMETER if bias else ""))
    for key, value in parts.items():
        text = fill_line(text, key, value)
    return text


def _dq_kernel(name: str) -> str:
    return block(
        """
        extern "C" __global__ void __launch_bounds__(DQ_THREADS) @NAME@_dq(const float* __restrict__ workspace,
                                                                   elem_t* __restrict__ dq_out) {
            const float* accumulator = workspace + DQ_ACCUMULATOR;
            const size_t pairs = ROWS_TOTAL * D / 2;
            for (size_t i = size_t(blockIdx.x) * DQ_THREADS + threadIdx.x; i < pairs; i += size_t(DQ_BLOCKS) * DQ_THREADS) {
                const size_t element = 2 * i;
                const int d = int(element % D);
                const size_t row = element / D;
                const int s = int(row % SEQ_Q), head = int(row / SEQ_Q % HEADS), batch = int(row / SEQ_Q / HEADS);
                const float2 x = *reinterpret_cast<const float2*>(accumulator + element);
                *reinterpret_cast<u32*>(dq_out + DQ_OFFSET + batch * DQ_BATCH + head * DQ_HEAD + s * DQ_SEQ + d)
                    = pack2(x.x * SCALE, x.y * SCALE);
            }
        }
        """
    ).replace("@NAME@", name)
