"""The Hopper (sm_90a) statistics and main passes of the flash-attention backward, on ``wgmma``.

Same work and arguments as the ``mma.sync`` passes of :mod:`.flash_attention_backward`;
the workspace's dq accumulator is tiled (below), so the dq launch here reads it that way (a thread a 16-byte slot).

**Statistics**: one block of two warpgroups per 128 query rows of one head; warpgroup ``w``
owns rows ``64w …``. Per step of 128 keys it issues ``S = Q Kᵀ`` (m64n128k16, both operands
K-major) and then the last step's ``O += P V`` (m64nDk16, P from registers, V MN-major),
runs the online softmax on ``S`` while ``P V`` still runs, and rescales O once it is done;
K and V take three buffers (this step's, the last step's for its ``P V``, and the next
step's copies). At the end each row's ``LSE₂`` and
``D = Σ dO·O/l`` (dO read from global memory in the accumulator's layout), and the rows' dq
accumulator (its two query tiles) zeroed.

**Main pass**: one block per ``BLOCK_KV = 128`` keys of one
K/V head (launched in chunks of slabs as the ``mma.sync`` pass is), the query tiles of every query head of the group streaming past, dk and dv held
in fp32 registers, dq accumulated in the fp32 workspace by vector reductions. ``PERSISTENT``:
at most one block an SM, each walking work items (a key tile, or with a causal mask key
tiles ``p`` and ``n − 1 − p``, so every item has as many steps) with two K/V buffers: the copies
run one step ahead over the whole walk, so the next key tile's K and V (and its first q and dO)
land during the current one's last step and its dk, dv stores overlap the next tile's start. The block is two
warpgroups; warpgroup ``w`` owns keys ``64w … 64w + 63``, and per query tile of
``BLOCK_Q = 64`` rows issues

* ``Sᵀ = K Qᵀ`` and ``dPᵀ = V dOᵀ`` (m64n64k16, both operands from shared memory, K-major:
  the head dim is the contracted axis of both), as two commit groups, so ``Pᵀ = 2^(Sᵀ·c·log₂e
  − LSE₂)`` is computed while ``dPᵀ`` still runs;
* ``dq = dS K`` (m64n64k16, A MN-major: dSᵀ written by both warpgroups to shared memory,
  keys × queries, each warp's 16 × 64 block by four ``stmatrix.x4``, read transposed; B
  MN-major: K's rows are the contracted keys): with D 128 warpgroup ``w`` computes dq's columns ``64w …`` over all 128 keys, with D 64 the whole row
  over its own 64 keys (both then add theirs);
* then ``dv += Pᵀ dO`` and ``dk += dSᵀ Q`` with ``dSᵀ = Pᵀ∘(dPᵀ − D)`` (m64nDk16, A from
  registers: an accumulator's packed pairs are the next wgmma's A fragments; B MN-major: the
  queries are the contracted axis and q, dO rows are stored head-dim-contiguous), and while
  they run the warpgroup adds its 64 × 64 fp32 dq part to the workspace's accumulator from
  its registers, four floats a ``red.global.add.v4.f32``. The accumulator is tiled per query
  tile and 64-column part in the accumulator's own order (thread-major, four floats a
  thread, a warp's 32 threads contiguous), so every reduction of a warp is one 512-byte run,
  and this module's dq launch reads it so. Seed shape on the H200, main pass alone: 1.02 ms
  when dq followed dv and dk and was staged in shared memory for one bulk reduction
  (``cp.reduce.async.bulk``) a warpgroup, 0.80 ms issued first and reduced from registers,
  0.60 ms without dq; per-thread scalar atomics had been 1.07 ms.

Tiles are copied by every thread with 16-byte ``cp.async`` into boxes of 64 columns (128
bytes a row) in the 128-byte-swizzled layout the wgmma descriptors read (16-byte chunk ``c``
of row ``r`` of a box at ``r·128 + (c ⊕ (r mod 8))·16``; boxes 1024-byte aligned), rows
past a sequence's end zero-filled. A product makes one descriptor per operand tile and adds its k steps to it
as constants (``make_smem_desc`` once, not a step), and the warpgroup index those tiles are found by is
broadcast from lane 0 (``uniform_warpgroup``), so the compiler keeps the descriptors in uniform registers;
the probabilities are ``ex2.approx`` (``fast_exp2``). H200, seed shape: the main pass's code 1504 -> 1160
SASS instructions, 0.62 -> 0.59 ms. The main pass keeps ``STAGES`` (2 or 3) q and dO
buffers, its copies ``STAGES − 1`` steps ahead. In the one-tile kernel every thread's copies
of a step arrive on the stage's mbarrier when they land (``cp.async.mbarrier.arrive``); a step
waits on it and fences the copies into the async proxy, and the copies of the step ``STAGES − 1``
later start after the step's dSᵀ barrier (both warpgroups are then done with the last step,
whose buffer they fill); dSᵀ alternates between two buffers, since one warpgroup may store the
next while the other's dq product still reads the last. The persistent walk waits for its
copies with ``cp.async.wait_group`` and a block barrier at each step's start, then starts the
next copies (one dSᵀ: two do not fit beside its two K/V buffers). Scores are masked only in tiles
that cross the causal diagonal or a sequence's end.
"""

from __future__ import annotations

import re

from cherenkov.codegen.cuda import cp_async, tma, wgmma
from cherenkov.codegen.cuda.text import block, bool_literal, fill_line, indent
from cherenkov.rewrites.plan_backward import (
    WGMMA_BLOCK_KV,
    WGMMA_BLOCK_Q,
    WGMMA_STATISTICS_BUFFERS,
    WGMMA_STATISTICS_KEYS,
    WGMMA_STATISTICS_ROWS,
    BackwardPlan,
)
from cherenkov.rewrites.plan_sm90a import SWIZZLE_ALIGN, SWIZZLE_ROW_BYTES



def wgmma_names(plan: BackwardPlan) -> dict[str, str]:
    """The wgmma wrappers the kernels issue directly: ``update`` (dv, dk; the statistics' O) and ``dq`` (the
    head-dim products go through :func:`_head_dim_product`)."""
    a = plan.problem.attention
    return {
        "update": wgmma.wgmma_name(a.head_dim, a.dtype, True, True),
        "dq": wgmma.wgmma_name(64, a.dtype, False, True, True),
    }


def helpers(plan: BackwardPlan) -> str:
    """Descriptors, wgmma synchronisation, the three wgmma shapes, the proxy fence and the swizzled tile copy."""
    a = plan.problem.attention
    swizzled_copy = block(
        f"""
        // Copy ROWS rows of D elements (row r at src + r * stride) into a tile of 64-column boxes of ROWS x
        // {SWIZZLE_ROW_BYTES} bytes, 128-byte swizzled: 16-byte chunk c of row r of box b at
        // b * ROWS * {SWIZZLE_ROW_BYTES} + r * {SWIZZLE_ROW_BYTES} + ((c ^ (r % 8)) << 4). Rows at or past `valid` are zero-filled.
        // A thread copies one chunk of the rows row, row + PASS_ROWS, ...: PASS_ROWS is a multiple of 8, so their
        // swizzled column is the same and the addresses only step.
        template <int ROWS>
        __device__ __forceinline__ void load_swizzled(u32 tile, const elem_t* src, size_t stride, int valid) {{
            constexpr int PASS_ROWS = WG_THREADS / CHUNKS;  // rows one pass of the block's threads copies
            static_assert(PASS_ROWS % 8 == 0 && ROWS % PASS_ROWS == 0, "whole swizzle atoms a pass");
            const int chunk = int(threadIdx.x) % CHUNKS, row = int(threadIdx.x) / CHUNKS;
            const u32 to = tile + (chunk >> 3) * (ROWS * {SWIZZLE_ROW_BYTES}) + row * {SWIZZLE_ROW_BYTES} + (((chunk & 7) ^ (row & 7)) << 4);
            const elem_t* from = src + row * stride + 8 * chunk;
            #pragma unroll
            for (int pass = 0; pass < ROWS / PASS_ROWS; ++pass) {{
                const bool in_range = row + pass * PASS_ROWS < valid;
                cp_async_16(to + pass * PASS_ROWS * {SWIZZLE_ROW_BYTES}, in_range ? from + pass * PASS_ROWS * stride : src, in_range);
            }}
        }}

        // Copy 4 bytes global -> shared without blocking; in_range = false writes 4 zero bytes.
        __device__ __forceinline__ void cp_async_4(u32 smem_addr, const void* gmem, bool in_range) {{
            asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\\n"
                         :: "r"(smem_addr), "l"(gmem), "r"(in_range ? 4 : 0) : "memory");
        }}
        """
    )
    shapes = (
        wgmma.emit_wgmma(WGMMA_BLOCK_Q, a.dtype, False, False),
        wgmma.emit_wgmma(WGMMA_STATISTICS_KEYS, a.dtype, False, False),
        wgmma.emit_wgmma(a.head_dim, a.dtype, True, True),
        wgmma.emit_wgmma(64, a.dtype, False, True, True),
    )
    products = (_head_dim_product(WGMMA_BLOCK_Q, a.dtype), _head_dim_product(WGMMA_STATISTICS_KEYS, a.dtype))
    return "\n\n".join(
        [wgmma.emit_descriptor(), wgmma.emit_sync(), *dict.fromkeys(shapes), *dict.fromkeys(products),
         tma.emit_fence_proxy_async(), tma.emit_mbarrier_basics(), cp_async.emit_cp_async_arrive(), emit_stmatrix_x4(),
         emit_reduce_add_v4_f32(), swizzled_copy]
    )


def emit_stmatrix_x4() -> str:
    """``stmatrix_x4(address, a, b, c, d)``: store four 8 × 8 16-bit matrices held in the
    accumulator fragment layout (thread ``T``: row ``T / 4``, columns ``2 (T % 4)`` and ``+ 1``),
    row ``r`` of matrix ``m`` to the 16 bytes at lane ``8m + r``'s address."""
    return block(
        """
        __device__ __forceinline__ void stmatrix_x4(u32 address, u32 a, u32 b, u32 c, u32 d) {
            asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};\\n"
                         :: "r"(address), "r"(a), "r"(b), "r"(c), "r"(d) : "memory");
        }
        """
    )


def emit_reduce_add_v4_f32() -> str:
    """``reduce_add_v4_f32(dst, a, b, c, d)``: add four floats to 16-byte-aligned global memory in one
    reduction (``red.global.add.v4.f32``, sm_90), without waiting for it."""
    return block(
        """
        __device__ __forceinline__ void reduce_add_v4_f32(float* dst, float a, float b, float c, float d) {
            asm volatile("red.global.add.v4.f32 [%0], {%1, %2, %3, %4};\\n"
                         :: "l"(dst), "f"(a), "f"(b), "f"(c), "f"(d) : "memory");
        }
        """
    )


def _head_dim_product(n: int, dtype: str) -> str:
    """``head_dim_product_n{n}<A_BOX, B_BOX>(acc, a, b)``: issue ``acc (64 x n) = A Bᵀ`` over the head dim
    (Sᵀ, dPᵀ, the statistics' S)."""
    return block(
        f"""
        // Issue acc (64 x {n}) = A B^T over the head dim: 64 rows of a K-major tile at `a` against {n} rows of one at
        // `b` (both 64-column boxes of 128-byte rows, A_BOX and B_BOX bytes apart), one wgmma a k16 step: 32 bytes
        // further along a row, a box further every 4 steps (added to the tiles' descriptors: constants, no
        // descriptor built a step). The caller fences before and commits after.
        template <u32 A_BOX, u32 B_BOX>
        __device__ __forceinline__ void head_dim_product_n{n}(float (&acc)[{n // 2}], u32 a, u32 b) {{
            const unsigned long long a_desc = make_smem_desc(a, 16, 1024), b_desc = make_smem_desc(b, 16, 1024);
            #pragma unroll
            for (int kk = 0; kk < D / 16; ++kk) {{
                const u32 step = (kk & 3) * 32;
                {wgmma.wgmma_name(n, dtype, False, False)}(acc, a_desc + (((kk >> 2) * A_BOX + step) >> 4),
                    b_desc + (((kk >> 2) * B_BOX + step) >> 4), kk > 0);
            }}
        }}
        """
    )


def constants(plan: BackwardPlan) -> str:
    """Tile sizes and shared-memory offsets of the main pass."""
    d = plan.problem.attention.head_dim
    split_keys = d == 64
    return "\n".join([
        "constexpr int WG_THREADS = 256;  // both passes: two warpgroups",
        "constexpr int BOXES = D / 64;  // 64-column boxes of a tile row",
        f"constexpr u32 KV_BOX_BYTES = BLOCK_KV * {SWIZZLE_ROW_BYTES}, Q_BOX_BYTES = BLOCK_Q * {SWIZZLE_ROW_BYTES};",
        "constexpr u32 KV_TILE_BYTES = BOXES * KV_BOX_BYTES, Q_TILE_BYTES = BOXES * Q_BOX_BYTES;",
        f"constexpr u32 DS_BYTES = BLOCK_KV * {SWIZZLE_ROW_BYTES};  // dS^T: keys x BLOCK_Q queries, one box",
        "constexpr u32 K_STEP_ROWS_BYTES = 16 * 128;  // a k16 step along an MN-major tile's rows",
        f"constexpr u32 ALIGN = {SWIZZLE_ALIGN};",
        f"constexpr bool DQ_SPLIT_KEYS = {'true' if split_keys else 'false'};  // dq over a warpgroup's own keys "
        "(D 64), else over its 64 columns",
        "constexpr int DQ_KEYS = DQ_SPLIT_KEYS ? 64 : BLOCK_KV;  // the k extent of a warpgroup's dq product",
        "// the dq accumulator, after LSE2 and D (16-byte aligned): per (batch, head, query tile) BLOCK_Q x D floats",
        "// as D / 64 parts of 64 columns (D 64: one, both warpgroups add to it), each part thread-major: the float2",
        "// pair j of warpgroup thread tau at ((j / 2) * 128 + tau) * 4 + (j % 2) * 2 (rows 16 (tau / 32) + tau % 32 / 4",
        "// + 8 (j % 2), columns 8 (j / 2) + 2 (tau % 4) + 0, 1: the accumulator layout of an m64n64 wgmma), so a",
        "// thread adds four floats at once and a warp's additions are one contiguous run",
        "constexpr int Q_TILES = (SEQ_Q + BLOCK_Q - 1) / BLOCK_Q;",
        *(_walk_constants() if plan.schedule.persistent else []),
        "constexpr u32 DQ_PART_FLOATS = 64 * 64;  // a warpgroup's dq part",
        "// dq's strides keep its rows 16-byte aligned (its pointer is, as the launcher checks): the dq launch",
        "// writes 16-byte chunks, else four 4-byte pairs",
        "constexpr bool DQ_CHUNKS_ALIGNED = DQ_OFFSET % 8 == 0 && DQ_BATCH % 8 == 0 && DQ_HEAD % 8 == 0 && DQ_SEQ % 8 == 0;",
        f"constexpr int STAT_BLOCK_KEYS = {WGMMA_STATISTICS_KEYS};  // keys of a statistics step",
        f"constexpr int STAT_BUFFERS = {WGMMA_STATISTICS_BUFFERS};  // the statistics pass's K and V buffers",
        "constexpr u32 STAT_Q_BOX_BYTES = STAT_ROWS * 128, STAT_KV_BOX_BYTES = STAT_BLOCK_KEYS * 128;",
        "constexpr u32 STAT_KV_TILE_BYTES = BOXES * STAT_KV_BOX_BYTES;",
        f"static_assert(STAT_ROWS == {WGMMA_STATISTICS_ROWS}, \"two warpgroups of 64 query rows\");",
        f"static_assert(BLOCK_KV == {WGMMA_BLOCK_KV} && BLOCK_Q == {WGMMA_BLOCK_Q} && (STAGES == 2 || STAGES == 3)",
        '              && D % 64 == 0, "two warpgroups of 64 keys, 64-query steps, 2 or 3 buffers, whole boxes");',
    ])  # fmt: skip


def _walk_constants() -> list[str]:
    """The persistent main pass's work items and K/V buffers."""
    return [
        "// a persistent block walks work items of key tiles; an item: a key tile, or (PAIRED, causal) key tiles p",
        "// and KV_TILES - 1 - p, as long together as any other pair",
        "constexpr bool PAIRED = CAUSAL;",
        "constexpr int ITEM_TILES = PAIRED ? 2 : 1, HEAD_ITEMS = PAIRED ? (KV_TILES + 1) / 2 : KV_TILES;",
        "constexpr int ITEMS = HEAD_ITEMS * KV_HEADS * BATCH;",
        "constexpr int KV_BUFFERS = 2;  // the next key tile's K and V load beside this one's",
        "constexpr u32 KV_BUFFER_BYTES = 2 * KV_TILE_BYTES;  // K, then V",
        "static_assert(STAGES == 2, \"a key tile's K and V load one step ahead, into the buffer two tiles back\");",
    ]


def main_kernel(plan: BackwardPlan, name: str) -> str:
    """The ``extern "C"`` main pass (arguments as the ``mma.sync`` one's): a block a key tile, or (persistent)
    a block an SM walking its work items; both copy a step's rows with ``_STEP_COPIES`` and run ``_MAIN_STEP``
    per (query head, query tile)."""
    names = wgmma_names(plan)
    driver = block(_KEY_TILE) + "\n\n" + block(_WALK_KERNEL) if plan.schedule.persistent else block(_ONE_TILE_KERNEL)
    step_level, store_level = (3, 2) if plan.schedule.persistent else (2, 1)
    refill = "" if plan.schedule.persistent else \
        "if (step + STAGES - 1 < steps) copy_step(step + STAGES - 1);  // into the last step's stage\n"
    step = fill_line(_MAIN_STEP.replace("@REFILL@\n", refill), "PROBABILITIES",
                     _P_CAPPED if plan.problem.attention.softcap else _P_UNCAPPED)
    return (
        re.sub(r"^ *@STEP@\n", lambda _: indent(step, step_level) + "\n", driver, flags=re.MULTILINE)
        .replace("@OPENING@", _KERNEL_OPENING)
        .replace("        @STEP_COPIES@\n", indent(_STEP_COPIES, 2) + "\n")
        .replace("@KEY_ROWS@", indent(_KEY_ROWS, step_level - 1).lstrip())
        .replace("@STORE_DK_DV@", indent(_STORE_DK_DV, store_level).lstrip())
        .replace("@NAME@", name)
        .replace("@BLOCK_Q@", str(WGMMA_BLOCK_Q))
        .replace("@UPDATE@", names["update"])
        .replace("@DQ@", names["dq"])
    )


MAIN_PASS_PARAMETERS = """const elem_t* __restrict__ q, const elem_t* __restrict__ k, const elem_t* __restrict__ v,
    const elem_t* __restrict__ dout, elem_t* __restrict__ dk_out, elem_t* __restrict__ dv_out,
    float* __restrict__ workspace"""
"""The main pass's parameters in both families (the launcher's arguments), continuation lines indented by four."""

_KERNEL_OPENING = """extern "C" __global__ void __launch_bounds__(THREADS, 1) @NAME@(
    """ + MAIN_PASS_PARAMETERS + """) {
    extern __shared__ __align__(16) unsigned char smem_raw[];
    const int warpgroup = threadIdx.x >> 7, warp = (threadIdx.x >> 5) & 3, lane = threadIdx.x & 31;
    const int tau = threadIdx.x & 127;  // thread of the warpgroup"""
"""Both main-pass drivers' signature (the launcher's arguments) and thread roles."""

_ONE_TILE_KERNEL = """
        @OPENING@
            // [K | V | STAGES q tiles | STAGES dO tiles | 2 dS^T | LSE2 | D | STAGES mbarriers],
            // tiles 1024-byte aligned
            const u32 raw = smem_address(smem_raw);
            const u32 sK = (raw + ALIGN - 1) & ~(ALIGN - 1);
            const u32 sV = sK + KV_TILE_BYTES, sQ = sV + KV_TILE_BYTES, sDO = sQ + STAGES * Q_TILE_BYTES;
            const u32 sDs = sDO + STAGES * Q_TILE_BYTES;
            float* sLse = reinterpret_cast<float*>(smem_raw + (sDs - raw) + 2 * DS_BYTES);  // STAGES x BLOCK_Q
            float* sDelta = sLse + STAGES * BLOCK_Q;
            const u32 full = smem_address(sDelta + STAGES * BLOCK_Q);  // + 8 * stage: its copies landed
            const int g = lane >> 2, t = lane & 3;
            const BlockKeyTile mine = block_key_tile();
            if (!mine.valid) return;  // past the last slab
            if (threadIdx.x == 0) {
                #pragma unroll
                for (int stage = 0; stage < STAGES; ++stage) mbar_init(full + 8 * stage, THREADS);
            }
            __syncthreads();  // the barriers, initialised
            const int k0 = mine.k0, kv_head = mine.kv_head, batch = mine.batch;
            const elem_t* kh = k + K_OFFSET + batch * K_BATCH + kv_head * K_HEAD;
            const elem_t* vh = v + V_OFFSET + batch * V_BATCH + kv_head * V_HEAD;
            load_swizzled<BLOCK_KV>(sK, kh + k0 * K_SEQ, K_SEQ, SEQ_KV - k0);
            load_swizzled<BLOCK_KV>(sV, vh + k0 * V_SEQ, V_SEQ, SEQ_KV - k0);
            // the query tiles that see these keys, for each query head of the group: the steps
            const int first = query_tiles_begin(k0);
            const int tiles = query_tiles_end(k0) - first;
            const int steps = tiles > 0 ? GROUP * tiles : 0;
            const float* lse2 = workspace;
            const float* deltas = workspace + ROWS_TOTAL;
            float* dq_accumulator = workspace + DQ_ACCUMULATOR;
            auto load_step = [&](int step) {  // q, dO, LSE2 and D rows of step `step` into its stage
                const int stage = step % STAGES, head = kv_head * GROUP + step / tiles;
                const int q0 = (first + step % tiles) * BLOCK_Q;
                @STEP_COPIES@
            };
            // A step's copies: every thread's arrive on the stage's barrier once its copies (K and V too, for
            // step 0) have landed, so no block barrier opens a step.
            auto copy_step = [&](int step) {
                load_step(step);
                cp_async_arrive(full + 8 * (step % STAGES));
            };
            #pragma unroll
            for (int ahead = 0; ahead < STAGES - 1; ++ahead) {  // the first STAGES - 1 steps
                if (ahead < steps) copy_step(ahead);
            }
            // this warpgroup's 64 keys x D of dk and dv, fp32 (row 16 warp + g (+ 8), columns 8c + 2t (+ 1))
            float dk[D / 2], dv[D / 2];
            #pragma unroll
            for (int i = 0; i < D / 2; ++i) dk[i] = dv[i] = 0.0f;
            @KEY_ROWS@
            for (int step = 0; step < steps; ++step) {
                const int stage = step % STAGES, head = kv_head * GROUP + step / tiles;
                const int q0 = (first + step % tiles) * BLOCK_Q;
                mbar_wait(full + 8 * stage, (step / STAGES) & 1);  // every thread's copies of this step
                fence_proxy_async();  // ... visible to this thread's wgmmas (async proxy)
                const u32 tds = sDs + (step & 1) * DS_BYTES;  // dS^T by step parity: the other may still be read
                @STEP@
            }
            @STORE_DK_DV@
        }
        """

_KEY_TILE = """
        // The block's n-th key tile: the tiles of work items blockIdx.x, blockIdx.x + gridDim.x, ... in order, an
        // item being a key tile of one (batch, K/V head), or (PAIRED) key tiles p and KV_TILES - 1 - p. `valid`: the
        // block has an n-th tile; `store`: it writes dk and dv (not the repeated middle tile of an odd count);
        // `steps`: its (query head, query tile) steps.
        struct KeyTile {
            bool valid, store;
            int k0, kv_head, batch;
            int first, tiles, steps;  // its first query tile (causal: the diagonal), query tiles a head, steps
        };

        __device__ __forceinline__ KeyTile key_tile(int n) {
            KeyTile kt;
            const int item = blockIdx.x + (n / ITEM_TILES) * gridDim.x;
            const int p = item % HEAD_ITEMS, slab = item / HEAD_ITEMS;
            const int tile = PAIRED && n % ITEM_TILES == 1 ? KV_TILES - 1 - p : p;
            kt.valid = item < ITEMS;
            kt.store = kt.valid && !(PAIRED && n % ITEM_TILES == 1 && tile == p);
            kt.k0 = tile * BLOCK_KV;
            kt.kv_head = slab % KV_HEADS;
            kt.batch = slab / KV_HEADS;
            kt.first = query_tiles_begin(kt.k0);
            kt.tiles = query_tiles_end(kt.k0) - kt.first;
            kt.steps = kt.store && kt.tiles > 0 ? GROUP * kt.tiles : 0;
            return kt;
        }
        """

_WALK_KERNEL = """
        @OPENING@
            // [KV_BUFFERS x (K | V) | STAGES q tiles | STAGES dO tiles | dS^T | LSE2 | D],
            // tiles 1024-byte aligned
            const u32 raw = smem_address(smem_raw);
            const u32 sKV = (raw + ALIGN - 1) & ~(ALIGN - 1);  // K/V buffer b: K at sKV + b * KV_BUFFER_BYTES, V after
            const u32 sQ = sKV + KV_BUFFERS * KV_BUFFER_BYTES, sDO = sQ + STAGES * Q_TILE_BYTES;
            const u32 sDs = sDO + STAGES * Q_TILE_BYTES;
            float* sLse = reinterpret_cast<float*>(smem_raw + (sDs - raw) + DS_BYTES);  // STAGES x BLOCK_Q
            float* sDelta = sLse + STAGES * BLOCK_Q;
            const int g = lane >> 2, t = lane & 3;
            const float* lse2 = workspace;
            const float* deltas = workspace + ROWS_TOTAL;
            float* dq_accumulator = workspace + DQ_ACCUMULATOR;
            // The copies run STAGES - 1 steps ahead of the products, over the block's key tiles in order (tiles
            // without steps skipped): step load_step of tile load_n next, into stage load_position % STAGES. A key
            // tile's K and V come with its first step, into the K/V buffer after the last tile's.
            int load_n = -1, load_step = 0, load_steps = 0, load_buffer = KV_BUFFERS - 1, load_position = 0;
            auto next_load = [&]() -> bool {  // move to the next step to copy; false when the block has none left
                if (++load_step < load_steps) return true;
                for (KeyTile kt = key_tile(++load_n); kt.valid; kt = key_tile(++load_n)) {
                    if (kt.steps > 0) {
                        load_step = 0;
                        load_steps = kt.steps;
                        load_buffer = (load_buffer + 1) % KV_BUFFERS;
                        return true;
                    }
                }
                return false;
            };
            auto issue_load = [&]() {  // q, dO, LSE2 and D rows of the next step (and its tile's K, V) into their stage
                const KeyTile kt = key_tile(load_n);
                const int stage = load_position++ % STAGES, head = kt.kv_head * GROUP + load_step / kt.tiles;
                const int q0 = (kt.first + load_step % kt.tiles) * BLOCK_Q, batch = kt.batch;
                if (load_step == 0) {
                    const u32 to = sKV + load_buffer * KV_BUFFER_BYTES;
                    load_swizzled<BLOCK_KV>(to, k + K_OFFSET + kt.batch * K_BATCH + kt.kv_head * K_HEAD + kt.k0 * K_SEQ,
                                            K_SEQ, SEQ_KV - kt.k0);
                    load_swizzled<BLOCK_KV>(to + KV_TILE_BYTES,
                                            v + V_OFFSET + kt.batch * V_BATCH + kt.kv_head * V_HEAD + kt.k0 * V_SEQ,
                                            V_SEQ, SEQ_KV - kt.k0);
                }
                @STEP_COPIES@
            };
            bool loading = next_load();
            #pragma unroll
            for (int ahead = 0; ahead < STAGES - 1; ++ahead) {  // the first STAGES - 1 steps, a commit group each
                if (loading) {
                    issue_load();
                    loading = next_load();
                }
                cp_async_commit();
            }
            int position = 0, buffer = KV_BUFFERS - 1;  // the block's steps so far; the K/V buffer in use
            for (int n = 0;; ++n) {
                const KeyTile kt = key_tile(n);
                if (!kt.valid) break;
                if (kt.steps > 0) buffer = (buffer + 1) % KV_BUFFERS;
                const u32 sK = sKV + buffer * KV_BUFFER_BYTES, sV = sK + KV_TILE_BYTES;
                // this warpgroup's 64 keys x D of dk and dv, fp32 (row 16 warp + g (+ 8), columns 8c + 2t (+ 1))
                float dk[D / 2], dv[D / 2];
                #pragma unroll
                for (int i = 0; i < D / 2; ++i) dk[i] = dv[i] = 0.0f;
                const int k0 = kt.k0, kv_head = kt.kv_head, batch = kt.batch;
                @KEY_ROWS@
                for (int step = 0; step < kt.steps; ++step, ++position) {
                    const int stage = position % STAGES, head = kv_head * GROUP + step / kt.tiles;
                    const int q0 = (kt.first + step % kt.tiles) * BLOCK_Q;
                    cp_async_wait<STAGES - 2>();  // this step's group (the later steps' may still land)
                    fence_proxy_async();  // this thread's copies, visible to the wgmmas (async proxy)
                    __syncthreads();      // every copy of this step is in; every warpgroup is past the last step
                    if (loading) {  // into the stage (and K/V buffer) the last steps have finished with
                        issue_load();
                        loading = next_load();
                    }
                    cp_async_commit();
                    const u32 tds = sDs;  // one dS^T: the barrier above closed the last step
                    @STEP@
                }
                if (!kt.store) continue;
                @STORE_DK_DV@
            }
        }
        """

_P_UNCAPPED = """// P^T = 2^(S^T SCALE_LOG2 - LSE2), 0 where masked (tiles on the diagonal or past an end)
#pragma unroll
for (int i = 0; i < BLOCK_Q / 2; ++i) {
    const int column = 8 * (i >> 2) + 2 * t + (i & 1), query = q0 + column, kr = key[(i >> 1) & 1];
    const bool masked = edge && (kr >= SEQ_KV || query >= SEQ_Q || hidden_key(kr, query));
    s[i] = masked ? 0.0f : fast_exp2(s[i] * SCALE_LOG2 - tlse[column]);
}
#pragma unroll
for (int i = 0; i < BLOCK_Q / 4; ++i) pa[i] = pack2(s[2 * i], s[2 * i + 1]);"""
"""The uncapped step's probabilities: ``pa`` for dv, and ``s`` for dS."""

_P_CAPPED = """// P^T = 2^(cap(S^T) SCALE_LOG2 - LSE2), 0 where masked (tiles on the diagonal or past an end), to pa; s keeps
// P^T times the cap's slope 1 - tanh^2 for dS^T (the gradient of the capped score's argument)
#pragma unroll
for (int i = 0; i < BLOCK_Q / 4; ++i) {
    float p[2];
    #pragma unroll
    for (int c = 0; c < 2; ++c) {
        const int e = 2 * i + c, column = 8 * (e >> 2) + 2 * t + c, query = q0 + column, kr = key[i & 1];
        const bool masked = edge && (kr >= SEQ_KV || query >= SEQ_Q || hidden_key(kr, query));
        const float capped = soft_cap(s[e]);
        p[c] = masked ? 0.0f : fast_exp2(capped * SCALE_LOG2 - tlse[column]);
        s[e] = p[c] * soft_cap_slope(capped);
    }
    pa[i] = pack2(p[0], p[1]);
}"""
"""The capped step's probabilities to ``pa``, and their products with the cap's slope to ``s``."""

# One step of the main pass, its copies already waited for and the next ones issued: Sᵀ and dPᵀ, Pᵀ and dSᵀ, dq
# (stored dSᵀ, one product, vector reductions), dv and dk.
_MAIN_STEP = """const u32 tq = sQ + stage * Q_TILE_BYTES, tdo = sDO + stage * Q_TILE_BYTES;
const float* tlse = sLse + stage * BLOCK_Q;
const float* tdelta = sDelta + stage * BLOCK_Q;
// S^T = K Q^T and dP^T = V dO^T: 64 keys x BLOCK_Q queries, contracted over the head dim
float s[BLOCK_Q / 2], dp[BLOCK_Q / 2];
wgmma_fence();
head_dim_product_n@BLOCK_Q@<KV_BOX_BYTES, Q_BOX_BYTES>(s, k_rows, tq);
wgmma_commit();
head_dim_product_n@BLOCK_Q@<KV_BOX_BYTES, Q_BOX_BYTES>(dp, v_rows, tdo);
wgmma_commit();
wgmma_wait<1>();
fence_operands(s);
const bool edge = (UPPER_EDGE && q0 + AHEAD < k0 + BLOCK_KV) || (WINDOW > 0 && q0 + BLOCK_Q - 1 - k0 >= WINDOW)
                  || q0 + BLOCK_Q > SEQ_Q || k0 + BLOCK_KV > SEQ_KV;
u32 pa[BLOCK_Q / 4];  // P^T as A fragments: pairs of adjacent columns
@PROBABILITIES@
wgmma_wait<0>();
fence_operands(dp);
// dS^T = P^T (dP^T - D): A fragments, and (for dq) the swizzled keys x queries tile
u32 dsa[BLOCK_Q / 4];
#pragma unroll
for (int i = 0; i < BLOCK_Q / 4; ++i) {
    const float2 delta = *reinterpret_cast<const float2*>(tdelta + 8 * (i >> 1) + 2 * t);  // columns 2t, 2t + 1
    dsa[i] = pack2(s[2 * i] * (dp[2 * i] - delta.x), s[2 * i + 1] * (dp[2 * i + 1] - delta.y));
}
if (WANT_DQ) {  // dsa[i] is the 8 x 8 block (key rows 8 (i % 2), query columns 8 (i / 2)) of the
                // warp's 16 keys: four blocks a stmatrix, lane l giving row l % 8 of block l / 8
    const int block_of_lane = lane >> 3, r = lane & 7;
    const u32 row_address = tds + (64 * warpgroup + 16 * warp + 8 * (block_of_lane & 1) + r) * 128;
    #pragma unroll
    for (int j = 0; j < BLOCK_Q / 16; ++j) {
        const int chunk = 2 * j + (block_of_lane >> 1);
        stmatrix_x4(row_address + ((chunk ^ r) << 4), dsa[4 * j], dsa[4 * j + 1], dsa[4 * j + 2], dsa[4 * j + 3]);
    }
}
// dq (BLOCK_Q x 64) = dS K first (A = dS^T read MN-major, B = K MN-major), then dv += P^T dO and
// dk += dS^T Q (A from registers, B MN-major: the queries are contracted); dq is added to the
// accumulator while dv and dk still run
const int key0 = DQ_SPLIT_KEYS ? 64 * uniform_warpgroup : 0, column0 = DQ_SPLIT_KEYS ? 0 : 64 * uniform_warpgroup;
float dq[32];
fence_proxy_async();  // the dS^T stores, visible to the wgmmas
__syncthreads();      // both warpgroups' dS^T are in, and both are done with the last step
@REFILL@
if (WANT_DQ) {
    const unsigned long long ds_desc = make_smem_desc(tds + key0 * 128, DS_BYTES, 1024);
    const unsigned long long k_desc = make_smem_desc(sK + (column0 / 64) * KV_BOX_BYTES + key0 * 128, KV_BOX_BYTES, 1024);
    wgmma_fence();
    #pragma unroll
    for (int kk = 0; kk < DQ_KEYS / 16; ++kk) {  // k16 steps down the keys: K_STEP_ROWS_BYTES further in both
        @DQ@(dq, ds_desc + ((kk * K_STEP_ROWS_BYTES) >> 4), k_desc + ((kk * K_STEP_ROWS_BYTES) >> 4), kk > 0);
    }
    wgmma_commit();
}
const unsigned long long do_desc = make_smem_desc(tdo, Q_BOX_BYTES, 1024), q_desc = make_smem_desc(tq, Q_BOX_BYTES, 1024);
wgmma_fence();
#pragma unroll
for (int kk = 0; kk < BLOCK_Q / 16; ++kk) {  // k16 steps down the queries
    if (WANT_DV) {
        @UPDATE@(dv, pa[4 * kk], pa[4 * kk + 1], pa[4 * kk + 2], pa[4 * kk + 3],
                 do_desc + ((kk * K_STEP_ROWS_BYTES) >> 4), 1);
    }
    if (WANT_DK) {
        @UPDATE@(dk, dsa[4 * kk], dsa[4 * kk + 1], dsa[4 * kk + 2], dsa[4 * kk + 3],
                 q_desc + ((kk * K_STEP_ROWS_BYTES) >> 4), 1);
    }
}
wgmma_commit();
if (WANT_DQ) {  // four floats a reduction, a warp's 32 of them one contiguous 512-byte run
    wgmma_wait<1>();
    fence_operands(dq);
    float* part = dq_accumulator + ((size_t(batch) * HEADS + head) * Q_TILES + q0 / BLOCK_Q) * (BLOCK_Q * D)
                  + (column0 / 64) * DQ_PART_FLOATS;
    #pragma unroll
    for (int m = 0; m < 8; ++m) {
        reduce_add_v4_f32(part + (m * 128 + tau) * 4, dq[4 * m], dq[4 * m + 1], dq[4 * m + 2], dq[4 * m + 3]);
    }
}
wgmma_wait<0>();
fence_operands(dk);
fence_operands(dv);"""

_KEY_ROWS = """const int key_row = 64 * warpgroup + 16 * warp + g;  // rows key_row and key_row + 8 of the block
const int key[2] = {k0 + key_row, k0 + key_row + 8};
// the warpgroup index broadcast from lane 0, so the compiler knows it warp-uniform: the addresses and wgmma
// descriptors made from it live in uniform registers (the masks keep `warpgroup`)
const int uniform_warpgroup = __shfl_sync(0xffffffffu, warpgroup, 0);
const u32 k_rows = sK + 64 * uniform_warpgroup * 128, v_rows = sV + 64 * uniform_warpgroup * 128;"""
"""A key tile's rows of this thread (the masks, the dk and dv stores) and of its warpgroup (K, V) in both drivers."""

_STORE_DK_DV = """// dk * SCALE and dv, rounded, at their strides
#pragma unroll
for (int i = 0; i < D / 2; i += 2) {
    const int h = (i >> 1) & 1, d = 8 * (i >> 2) + 2 * t;
    if (key[h] >= SEQ_KV) continue;
    if (WANT_DK) {
        *reinterpret_cast<u32*>(dk_out + DK_OFFSET + batch * DK_BATCH + kv_head * DK_HEAD + key[h] * DK_SEQ + d)
            = pack2(dk[i] * SCALE, dk[i + 1] * SCALE);
    }
    if (WANT_DV) {
        *reinterpret_cast<u32*>(dv_out + DV_OFFSET + batch * DV_BATCH + kv_head * DV_HEAD + key[h] * DV_SEQ + d)
            = pack2(dv[i], dv[i + 1]);
    }
}"""


def statistics_kernel(plan: BackwardPlan, name: str) -> str:
    """The ``extern "C"`` statistics pass (arguments as the ``mma.sync`` one's)."""
    names = wgmma_names(plan)
    return (
        block(
            """
        extern "C" __global__ void __launch_bounds__(WG_THREADS, 1) @NAME@_statistics(
            const elem_t* __restrict__ q, const elem_t* __restrict__ k, const elem_t* __restrict__ v,
            const elem_t* __restrict__ dout, float* __restrict__ workspace) {
            extern __shared__ __align__(16) unsigned char smem_raw[];
            // [q tile | K buffers 0..STAT_BUFFERS-1 | V buffers 0..STAT_BUFFERS-1], tiles 1024-byte aligned
            const u32 raw = smem_address(smem_raw);
            const u32 sQ = (raw + ALIGN - 1) & ~(ALIGN - 1);
            const u32 sK = sQ + BOXES * STAT_Q_BOX_BYTES, sV = sK + STAT_BUFFERS * STAT_KV_TILE_BYTES;
            const int warpgroup = threadIdx.x >> 7, warp = (threadIdx.x >> 5) & 3, lane = threadIdx.x & 31;
            const int g = lane >> 2, t = lane & 3;
            const int q0 = blockIdx.x * STAT_ROWS, head = blockIdx.y, batch = blockIdx.z, kv_head = head / GROUP;
            const elem_t* qh = q + Q_OFFSET + batch * Q_BATCH + head * Q_HEAD;
            const elem_t* doh = dout + DO_OFFSET + batch * DO_BATCH + head * DO_HEAD;
            const elem_t* kh = k + K_OFFSET + batch * K_BATCH + kv_head * K_HEAD;
            const elem_t* vh = v + V_OFFSET + batch * V_BATCH + kv_head * V_HEAD;
            const int keys = keys_end(q0, STAT_ROWS);  // the keys these rows see
            const int steps = (keys + STAT_BLOCK_KEYS - 1) / STAT_BLOCK_KEYS;
            const int first_step = first_key_step(q0, STAT_BLOCK_KEYS) / STAT_BLOCK_KEYS;  // a window's first
            auto load_keys = [&](int step) {  // K and V of step `step` into its buffer
                const int k0 = step * STAT_BLOCK_KEYS, buffer = step % STAT_BUFFERS;
                load_swizzled<STAT_BLOCK_KEYS>(sK + buffer * STAT_KV_TILE_BYTES, kh + k0 * K_SEQ, K_SEQ, SEQ_KV - k0);
                load_swizzled<STAT_BLOCK_KEYS>(sV + buffer * STAT_KV_TILE_BYTES, vh + k0 * V_SEQ, V_SEQ, SEQ_KV - k0);
            };
            load_swizzled<STAT_ROWS>(sQ, qh + q0 * Q_SEQ, Q_SEQ, SEQ_Q - q0);
            if (steps > first_step) load_keys(first_step);
            cp_async_commit();
            const int row[2] = {q0 + 64 * warpgroup + 16 * warp + g, q0 + 64 * warpgroup + 16 * warp + g + 8};
            const u32 q_rows = sQ + 64 * warpgroup * 128;
            float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f}, o[D / 2];
            #pragma unroll
            for (int i = 0; i < D / 2; ++i) o[i] = 0.0f;
            u32 pa[STAT_BLOCK_KEYS / 4];  // the last step's P as A fragments, for its O += P V (none yet: zero)
            #pragma unroll
            for (int i = 0; i < STAT_BLOCK_KEYS / 4; ++i) pa[i] = 0u;
            auto issue_pv = [&](int step) {  // O += P V of step `step` (A from registers, V MN-major: keys contracted)
                const unsigned long long v_desc = make_smem_desc(sV + step % STAT_BUFFERS * STAT_KV_TILE_BYTES,
                                                                 STAT_KV_BOX_BYTES, 1024);
                #pragma unroll
                for (int kk = 0; kk < STAT_BLOCK_KEYS / 16; ++kk) {
                    @UPDATE@(o, pa[4 * kk], pa[4 * kk + 1], pa[4 * kk + 2], pa[4 * kk + 3],
                             v_desc + ((kk * K_STEP_ROWS_BYTES) >> 4), 1);
                }
            };
            for (int step = first_step; step < steps; ++step) {
                const int k0 = step * STAT_BLOCK_KEYS;
                cp_async_wait<0>();
                fence_proxy_async();  // this thread's copies, visible to the wgmmas (async proxy)
                __syncthreads();      // this step's keys are in; every warpgroup's products of two steps ago are done
                if (step + 1 < steps) load_keys(step + 1);  // into the buffers of two steps ago
                cp_async_commit();
                // S = Q K^T (64 rows x STAT_BLOCK_KEYS keys a warpgroup), then the last step's O += P V, so this
                // step's softmax runs while P V does
                float s[STAT_BLOCK_KEYS / 2];
                wgmma_fence();
                head_dim_product_n@STAT_KEYS@<STAT_Q_BOX_BYTES, STAT_KV_BOX_BYTES>(
                    s, q_rows, sK + step % STAT_BUFFERS * STAT_KV_TILE_BYTES);
                wgmma_commit();
                // (the first step adds its zero P times its own V: a wgmma under a branch makes ptxas fence around it)
                issue_pv(max(step - 1, first_step));
                wgmma_commit();
                wgmma_wait<1>();  // S (the last step's P V may still run)
                fence_operands(s);
                // in log2 units (soft-capped first where the problem caps), masked
                const bool edge = k0 + STAT_BLOCK_KEYS > SEQ_KV || (UPPER_EDGE && k0 + STAT_BLOCK_KEYS - 1 > q0 + AHEAD)
                                  || (WINDOW > 0 && q0 + STAT_ROWS - 1 - k0 >= WINDOW);
                float tile_max[2] = {-INFINITY, -INFINITY};
                #pragma unroll
                for (int i = 0; i < STAT_BLOCK_KEYS / 2; ++i) {
                    const int key = k0 + 8 * (i >> 2) + 2 * t + (i & 1), h = (i >> 1) & 1;
                    const bool masked = edge && (key >= SEQ_KV || hidden_key(key, row[h]));
                    s[i] = masked ? -INFINITY : @SCORE@ * SCALE_LOG2;
                    tile_max[h] = fmaxf(tile_max[h], s[i]);
                }
                float rescale[2], shift[2];
                advance_row_max(m, l, tile_max, rescale, shift);
                u32 p_next[STAT_BLOCK_KEYS / 4];
                #pragma unroll
                for (int i = 0; i < STAT_BLOCK_KEYS / 4; ++i) {
                    const int h = i & 1;
                    const float p0 = fast_exp2(s[2 * i] - shift[h]), p1 = fast_exp2(s[2 * i + 1] - shift[h]);
                    l[h] += p0 + p1;
                    p_next[i] = pack2(p0, p1);
                }
                wgmma_wait<0>();  // the last step's P V: O is its sum up to the last step
                fence_operands(o);
                fence_operands(pa);  // read by that P V until here, so p_next may not take its registers
                #pragma unroll
                for (int i = 0; i < D / 2; ++i) o[i] *= rescale[(i >> 1) & 1];
                #pragma unroll
                for (int i = 0; i < STAT_BLOCK_KEYS / 4; ++i) pa[i] = p_next[i];
            }
            if (steps > first_step) {  // the last step's O += P V
                wgmma_fence();
                issue_pv(steps - 1);
                wgmma_commit();
                wgmma_wait<0>();
                fence_operands(o);
            }
            // LSE2 = m + log2(l) (a row without a live key: +inf, so its probabilities are 0), D = rowsum(dO o)
            float delta[2] = {0.0f, 0.0f}, inverse[2];
            finish_row_sums(l, inverse);
            #pragma unroll
            for (int i = 0; i < D / 2; i += 2) {
                const int h = (i >> 1) & 1, d = 8 * (i >> 2) + 2 * t;
                if (row[h] < SEQ_Q) {
                    const u32 pair = *reinterpret_cast<const u32*>(doh + row[h] * DO_SEQ + d);
                    delta[h] += (o[i] * to_float(elem_t(pair & 0xFFFFu)) + o[i + 1] * to_float(elem_t(pair >> 16))) * inverse[h];
                }
            }
            store_row_statistics(workspace, (size_t(batch) * HEADS + head) * SEQ_Q, row, m, l, delta, t);
            if (WANT_DQ) {  // zero the dq accumulator of this block's two query tiles
                const int tile = 2 * blockIdx.x;
                float4* accumulator = reinterpret_cast<float4*>(
                    workspace + DQ_ACCUMULATOR + ((size_t(batch) * HEADS + head) * Q_TILES + tile) * (BLOCK_Q * D));
                const int count = min(2, Q_TILES - tile) * BLOCK_Q * D / 4;
                for (int i = int(threadIdx.x); i < count; i += WG_THREADS) accumulator[i] = make_float4(0, 0, 0, 0);
            }
        }
        """
        )
        .replace("@NAME@", name)
        .replace("@STAT_KEYS@", str(WGMMA_STATISTICS_KEYS))
        .replace("@UPDATE@", names["update"])
        .replace("@SCORE@", "soft_cap(s[i])" if plan.problem.attention.softcap else "s[i]")
    )


def dq_kernel(name: str) -> str:
    """The ``extern "C"`` dq conversion: a block a (query tile, 64-column part) of the tiled, thread-major
    accumulator (arguments as the ``mma.sync`` one's). Its 1024 16-byte slots are read in order (a thread four:
    a warp 512 contiguous bytes), scaled and rounded into a 64 × 64 tile in shared memory (rows padded by 16
    bytes: a warp's stores hit 32 banks), and written at dq's strides a 16-byte chunk a thread, eight to a
    128-byte row piece, so every write fills whole sectors (two 4-byte stores a slot, 16 bytes a row, had
    filled half of each)."""
    return block(
        """
        extern "C" __global__ void __launch_bounds__(DQ_THREADS) @NAME@_dq(const float* __restrict__ workspace,
                                                                   elem_t* __restrict__ dq_out) {
            static_assert(DQ_THREADS == 256 && BLOCK_Q == 64, "four slots and two row chunks a thread");
            constexpr int PITCH = 32 + 4;  // packed pairs a tile row: 64 columns and 16 bytes of padding
            __shared__ __align__(16) u32 tile[BLOCK_Q * PITCH];
            const size_t part = blockIdx.x;  // ((batch, head, query tile), 64-column part of the row)
            const float4* slots = reinterpret_cast<const float4*>(workspace + DQ_ACCUMULATOR) + part * (DQ_PART_FLOATS / 4);
            #pragma unroll
            for (int j = 0; j < 4; ++j) {
                // slot (c / 8) * 128 + tau: columns c, c + 1 of rows r and r + 8 of the tile, with
                // tau = (r / 16) * 32 + (r % 8) * 4 + (c % 8) / 2 (the accumulator's fragment order)
                const int i = j * DQ_THREADS + int(threadIdx.x), tau = i % 128;
                const int r = (tau >> 5) * 16 + ((tau >> 2) & 7), pair = (i / 128) * 4 + (tau & 3);
                const float4 x = slots[i];
                tile[r * PITCH + pair] = pack2(x.x * SCALE, x.y * SCALE);
                tile[(r + 8) * PITCH + pair] = pack2(x.z * SCALE, x.w * SCALE);
            }
            __syncthreads();
            const size_t query_tile = part / (D / 64);
            const int q_tile = int(query_tile % Q_TILES), head = int(query_tile / Q_TILES % HEADS);
            const int batch = int(query_tile / Q_TILES / HEADS), d0 = int(part % (D / 64)) * 64;
            #pragma unroll
            for (int j = 0; j < 2; ++j) {  // 16-byte chunk `chunk` of the tile: row chunk / 8, columns 8 (chunk % 8) ...
                const int chunk = j * DQ_THREADS + int(threadIdx.x), r = chunk / 8, s = q_tile * BLOCK_Q + r;
                if (s >= SEQ_Q) continue;
                const u32* from = tile + r * PITCH + (chunk % 8) * 4;
                elem_t* to = dq_out + DQ_OFFSET + batch * DQ_BATCH + head * DQ_HEAD + s * DQ_SEQ + d0 + (chunk % 8) * 8;
                if (DQ_CHUNKS_ALIGNED) {
                    *reinterpret_cast<uint4*>(to) = *reinterpret_cast<const uint4*>(from);
                } else {
                    #pragma unroll
                    for (int k = 0; k < 4; ++k) reinterpret_cast<u32*>(to)[k] = from[k];
                }
            }
        }
        """
    ).replace("@NAME@", name)


def workspace_floats(plan: BackwardPlan) -> int:
    """The fp32 workspace: each query row's LSE₂ and D, then (16-byte aligned) the tiled dq accumulator."""
    a = plan.problem.attention
    rows = a.batch * a.heads * a.seq_q
    tiles = -(-a.seq_q // WGMMA_BLOCK_Q)
    return -(-2 * rows // 4) * 4 + a.batch * a.heads * tiles * WGMMA_BLOCK_Q * a.head_dim


# A step's q and dO tiles and its rows' LSE2 and D (of query head `head`, rows q0.. of batch `batch`) into `stage`.
_STEP_COPIES = """load_swizzled<BLOCK_Q>(sQ + stage * Q_TILE_BYTES,
                       q + Q_OFFSET + batch * Q_BATCH + head * Q_HEAD + q0 * Q_SEQ, Q_SEQ, SEQ_Q - q0);
load_swizzled<BLOCK_Q>(sDO + stage * Q_TILE_BYTES,
                       dout + DO_OFFSET + batch * DO_BATCH + head * DO_HEAD + q0 * DO_SEQ, DO_SEQ,
                       SEQ_Q - q0);
// the rows' LSE2 and D, copied without blocking (rows past SEQ_Q read as 0: their q and dO are
// zero and their scores masked, so nothing they give is used)
const size_t rows = (size_t(batch) * HEADS + head) * SEQ_Q + q0;
if (threadIdx.x < 2 * BLOCK_Q) {
    const int i = threadIdx.x % BLOCK_Q;
    const float* src = (threadIdx.x < BLOCK_Q ? lse2 : deltas) + rows + i;
    float* dst = (threadIdx.x < BLOCK_Q ? sLse : sDelta) + stage * BLOCK_Q + i;
    cp_async_4(smem_address(dst), q0 + i < SEQ_Q ? src : lse2, q0 + i < SEQ_Q);
}"""
