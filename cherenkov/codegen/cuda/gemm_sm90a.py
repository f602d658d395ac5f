"""The Hopper (sm_90a) ``wgmma`` GEMM family for contraction kernels.

A contraction kernel computes ``epilogue(Σ_k a[m, k] · b[k, n])`` (see
:class:`~cherenkov.codegen.term_plan.GemmLayout`: M, N and the batch flatten several axes
each). This family serves the case where both operands are plain 16-bit reads that
16-byte copies can load (``GemmLayout.a_fast`` / ``b_fast``); prologues stay with the
``mma.sync`` family of :mod:`.gemm`.

One block computes a ``BM × BN`` output tile of one batch entry with
``CONSUMERS`` (1 or 2) warpgroups; warpgroup ``w`` owns rows ``w · BM / CONSUMERS`` onwards
as one or two m64 tiles, each ``wgmma.mma_async.m64nBNk16`` with fp32 accumulators in
registers and both operands read from shared memory through matrix descriptors.

Operand tiles, ``BK = 64`` deep (one 128-byte row of 16-bit elements), are copied by every
thread with 16-byte ``cp.async`` (no tensor maps: the kernel takes plain pointers, like
every term kernel) into the 128-byte-swizzled layout the descriptors describe, the XOR
swizzle applied to the shared-memory address by the copying thread:

* K-major operand (innermost memory index follows k): ``rows × 128 B``, 8-row atoms of
  1024 bytes; 16-byte chunk ``c`` of row ``r`` sits at ``r · 128 + ((c ^ (r % 8)) · 16)``.
  Descriptor SBO = 1024; a k16 step advances the start address by 32 bytes.
* MN-major operand (innermost memory index follows its rows): boxes of 64 rows (128 bytes)
  × 64 k, 8 KiB each; chunk ``c`` of k-row ``k`` sits at ``k · 128 + ((c ^ (k % 8)) · 16)``
  of its box. Descriptor LBO = 8 KiB (box to box along M/N), SBO = 1024; a k16 step
  advances the start address by 2 KiB; the wgmma's transpose bit is set.

Chunks past M, N or K are zero-filled (src-size 0), so tails need no other path; the
epilogue stores only in-range elements.

Pipeline: a ring of ``STAGES`` tile buffers in dynamic shared memory (1024-byte aligned).
Step ``kt`` waits for its own copies (``cp.async.wait_group``), fences them into the async
proxy the wgmma reads through, and passes one block barrier — after which every thread's
tile ``kt`` has landed and every warpgroup has retired the wgmmas of step ``kt - 2``. It
then issues the step's ``4 · (BM / CONSUMERS / 64)`` wgmmas as one commit group, starts
the copies of step ``kt + STAGES - 2`` into the buffer step ``kt - 2`` used, and waits
until at most one wgmma group is in flight (``wait_group 1``): the wgmmas of step ``kt``
run on while the next step's barrier and issue proceed, and two buffers are held by
wgmmas while ``STAGES - 2`` load.

Blocks are rasterised in groups of ``GROUP_M`` row tiles (consecutive blocks share B
columns and A rows in L2). The epilogue evaluates the kernel's term around the
contraction at each accumulator element through the term emitter (shared with
:mod:`.gemm`, fast math: the output is 16-bit): element ``d[4c + e]`` of m64 tile ``i``
of warp ``w`` is row ``64i + 16w + lane / 4 + 8 (e / 2)``, column ``8c + 2 (lane % 4) +
e % 2``; elements ``e`` and ``e + 1`` (adjacent columns) are stored as one 4-byte word
where the output's innermost axis is N's, of even extent.

Split-K (``split_k`` > 1, grids of few tiles such as few-token GEMMs): grid z is
``BATCH · SPLITS`` and block ``z`` runs k steps ``[s · KT_SPLIT, (s + 1) · KT_SPLIT)`` of
split ``s = z % SPLITS``. Each block writes its fp32 accumulators to a module-global
workspace (thread-major, coalesced), fences, and counts its arrival on the tile's
counter; the last block to arrive resets the counter, adds the partials of splits
``0 .. SPLITS - 1`` in that order (the sum does not depend on which block came last) and
runs the epilogue. Launches of one loaded module must therefore not run concurrently.

Launch: grid ``(ceil(N / BN), ceil(M / BM), BATCH · split_k)``, ``128 · CONSUMERS``
threads, :func:`~cherenkov.codegen.term_plan.wgmma_smem_bytes` of dynamic shared memory.

Measured on an H200 (``benchmarks/bench_gemm_sm90a.py``, bf16, L2 flushed, median of 10):
128×256 with 4 stages reaches 510 TFLOP/s at 4096³ (torch.matmul 767; the TMA kernel of
:mod:`.gemm_sm90a_tma` 696) and 465 at 4096×8192×2048 (torch 750). Prefetch depth matters
most (3 stages lose 30 %); the per-step ``fence.proxy.async`` (a ``MEMBAR.ALL.CTA`` in
SASS) costs 1–2 %. With 64 tokens the m64 tiles and split-K match cuBLAS: 64×2048×8192 in
0.019 ms (64×64, 4 splits; torch 0.020, the best unsplit tile 0.039), 64×4096×4096 in
0.018 (torch 0.017).
"""

from __future__ import annotations

import math

from cherenkov.codegen.cuda import gemm_sm90a_tma, tma, wgmma
from cherenkov.codegen.cuda.gemm import (
    TileOperand,
    accumulator_epilogue,
    copy_tile,
    cp_async_helpers,
    epilogue_loops,
    shape_constants,
)
from cherenkov.codegen.cuda.term_common import (
    decompose,
    indent_lines,
    kernel_name,
    tensor_infos,
    term_source,
    vector_helpers,
)
from cherenkov.codegen.cuda.term_expr import TermEmitter, index_type
from cherenkov.codegen.cuda.text import block
from cherenkov.codegen.errors import CodegenError
from cherenkov.codegen.term_plan import (
    GROUP_M,
    SWIZZLE_ALIGN,
    SWIZZLE_ROW_BYTES,
    WGMMA_M,
    TmaGemmSchedule,
    gemm_layout,
    wgmma_problems,
    wgmma_smem_bytes,
)



def grid(plan) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
    """``(grid, block)``: ``(ceil(N / BN), ceil(M / BM), BATCH · split_k)`` blocks (the TMA
    kernel's: :func:`.gemm_sm90a_tma.grid`)."""
    if isinstance(plan.schedule, TmaGemmSchedule):
        return gemm_sm90a_tma.grid(plan)
    layout = gemm_layout(plan.kernel, tensor_infos(plan))
    s = plan.schedule
    blocks = (math.ceil(layout.n / s.block_n), math.ceil(layout.m / s.block_m), layout.batch_size * s.split_k)
    return blocks, (s.threads, 1, 1)


def dynamic_smem(plan) -> int:
    """Bytes of dynamic shared memory a wgmma GEMM plan's launch needs."""
    return wgmma_smem_bytes(plan.schedule)


def _helpers(dtype: str, block_n: int, stages: int, trans_a: bool, trans_b: bool) -> str:
    """cp.async (shared with :mod:`.gemm`), the proxy fence, the swizzle, descriptors and
    the one wgmma shape this kernel issues."""
    swizzle = block(f"""
        // 32-bit shared-window address of a generic pointer into shared memory.
        __device__ __forceinline__ u32 smem_u32(const void* ptr) {{
            return static_cast<u32>(__cvta_generic_to_shared(ptr));
        }}

        // Byte offset of 16-byte chunk `chunk` (0-7) of row `row` in a 128-byte-swizzled tile
        // ({SWIZZLE_ALIGN}-byte aligned): the chunk index is XORed with the row's place in its 8-row atom,
        // as the wgmma descriptor's swizzle mode 1 expects.
        __device__ __forceinline__ u32 swizzle_128b(int row, int chunk) {{
            return u32(row * {SWIZZLE_ROW_BYTES} + ((chunk ^ (row & 7)) << 4));
        }}
        """)
    return "\n\n".join(
        [
            cp_async_helpers(stages - 3, "the tile of the step about to multiply has landed"),
            tma.emit_fence_proxy_async(),
            swizzle,
            wgmma.emit_descriptor(),
            wgmma.emit_sync(),
            wgmma.emit_wgmma(block_n, dtype, False, trans_b, trans_a),
        ]
    )


def _destination(op: TileOperand, base: str) -> str:
    """The shared-memory pointer of chunk ``(row, kk)`` of ``op``'s tile in buffer ``stage``."""
    if op.kmajor:
        return f"tiles + {base} + stage * {op.role}_TILE_BYTES + swizzle_128b(row, kk >> 3)"
    return f"tiles + {base} + stage * {op.role}_TILE_BYTES + (row >> 6) * BOX_BYTES + swizzle_128b(kk, (row & 63) >> 3)"


def gemm_sm90a_source(plan) -> str:
    """Deterministic CUDA C++ of one wgmma GEMM plan (same plan → same bytes); TMA plans
    (:class:`~cherenkov.codegen.term_plan.TmaGemmSchedule`) come from :mod:`.gemm_sm90a_tma`."""
    if isinstance(plan.schedule, TmaGemmSchedule):
        return gemm_sm90a_tma.gemm_sm90a_tma_source(plan)
    s = plan.schedule
    kernel = plan.kernel
    problems = wgmma_problems(plan)
    if problems:
        raise CodegenError(f"kernel {kernel.output}: no wgmma GEMM: {'; '.join(problems)}")
    infos = tensor_infos(plan)
    layout = gemm_layout(kernel, infos)
    dtype = layout.dtype
    em = TermEmitter(infos, index_type(infos), fast_math=True)  # the output is 16-bit (wgmma_problems)
    name = kernel_name(plan)
    (gx, gy, gz), _ = grid(plan)
    smem_bytes = wgmma_smem_bytes(s)

    a = TileOperand("A", layout.a, layout.m_axes, layout.a_kmajor, True, "BM", "M", "m0")
    b = TileOperand("B", layout.b, layout.n_axes, layout.b_kmajor, True, "BN", "N", "n0")
    mma_name = wgmma.wgmma_name(s.block_n, dtype, False, not b.kmajor, not a.kmajor)

    def order(op: TileOperand) -> str:
        return "K-major [row][k]" if op.kmajor else "MN-major [k][row] boxes"

    constants = block(f"""
        {shape_constants(layout, s, "        ")}
        constexpr int CONSUMERS = {s.consumer_warpgroups}, THREADS = {s.threads};
        constexpr int WG_M = BM / CONSUMERS;      // rows of one warpgroup
        constexpr int M_TILES = WG_M / {WGMMA_M};         // its m64 wgmma tiles
        constexpr int ACC = BN / 2;               // fp32 accumulators of one m64 tile, a thread
        constexpr int KT = (K + BK - 1) / BK;     // k steps
        constexpr int SPLITS = {s.split_k};                  // blocks a tile's k steps are split over (grid z: BATCH x SPLITS)
        constexpr int KT_SPLIT = (KT + SPLITS - 1) / SPLITS;  // k steps of one split
        constexpr int TILES_M = {gy}, TILES_N = {gx}, GROUP_M = {GROUP_M};  // grid (TILES_N, TILES_M, BATCH * SPLITS)
        static_assert(BK == 64 && M_TILES >= 1 && STAGES >= 3, "one swizzle row of k; two buffers under wgmma");
        static_assert(TILES_M == (M + BM - 1) / BM && TILES_N == (N + BN - 1) / BN && BATCH >= 1, "grid");

        // Shared memory: [A stage 0..STAGES-1 | B stage 0..STAGES-1] from a {SWIZZLE_ALIGN}-byte aligned base.
        constexpr u32 ROW_BYTES = {SWIZZLE_ROW_BYTES};           // a swizzled row: 64 elements
        constexpr u32 BOX_BYTES = 64 * ROW_BYTES;     // 64 K-major rows, or one MN-major box of 64 k rows
        constexpr u32 A_TILE_BYTES = BM * BK * 2, B_TILE_BYTES = BN * BK * 2;
        constexpr u32 A_SMEM = 0, B_SMEM = STAGES * A_TILE_BYTES;
        static_assert(B_SMEM + STAGES * B_TILE_BYTES + {SWIZZLE_ALIGN} == {smem_bytes}, "the plan's shared memory");
        // Descriptor steps: bytes from one k16 step to the next (32 within a K-major row, 16 rows
        // of an MN-major box), and the leading byte offset (MN-major: box to box; K-major: unused).
        constexpr u32 A_K_STEP = {"32" if a.kmajor else "16 * ROW_BYTES"}, A_LBO = {"16" if a.kmajor else "BOX_BYTES"};  // A {order(a)}
        constexpr u32 B_K_STEP = {"32" if b.kmajor else "16 * ROW_BYTES"}, B_LBO = {"16" if b.kmajor else "BOX_BYTES"};  // B {order(b)}
        """)

    body: list[str] = [
        "const int warpgroup = threadIdx.x / 128, warp = (threadIdx.x / 32) % 4, lane = threadIdx.x & 31;",
        "",
        "// this block's output tile: groups of GROUP_M row tiles, column tiles within a group",
        "const int tile = blockIdx.y * TILES_N + blockIdx.x;",
        "const int first_m = tile / (GROUP_M * TILES_N) * GROUP_M;",
        "const int group_rows = min(TILES_M - first_m, GROUP_M);",
        "const int m0 = (first_m + tile % (GROUP_M * TILES_N) % group_rows) * BM;",
        "const int n0 = tile % (GROUP_M * TILES_N) / group_rows * BN;",
        "",
        f"// shared memory: the tile ring at the first {SWIZZLE_ALIGN}-byte boundary ({smem_bytes} bytes with the slack)",
        "extern __shared__ __align__(16) unsigned char ck_smem[];",
        f"unsigned char* const tiles = ck_smem + ({SWIZZLE_ALIGN} - smem_u32(ck_smem) % {SWIZZLE_ALIGN}) % {SWIZZLE_ALIGN};",
    ]
    em.push()
    batch_lines, batch_env = decompose("blockIdx.z / SPLITS" if s.split_k > 1 else "blockIdx.z", layout.batch, 0, "bz")
    body += batch_lines
    load_a = copy_tile(em, a, layout, batch_env, _destination(a, "A_SMEM"))
    load_b = copy_tile(em, b, layout, batch_env, _destination(b, "B_SMEM"))
    paired, epilogue = accumulator_epilogue(em, plan, layout, batch_env, "acc[mi][4 * c + e]",
                                            "acc[mi][4 * c + e + 1]")
    top = em.pop()
    if top:
        body += ["// values the whole block shares (batch-only parts of the terms)", *top]
    body += [
        "",
        "// this block's k steps: split blockIdx.z % SPLITS of the tile's KT",
        "const int kt_begin = (blockIdx.z % SPLITS) * KT_SPLIT;",
        "const int steps = max(0, min(KT, kt_begin + KT_SPLIT) - kt_begin);",
        "",
        "float acc[M_TILES][ACC];",
        "#pragma unroll",
        "for (int mi = 0; mi < M_TILES; ++mi)",
        "    #pragma unroll",
        "    for (int i = 0; i < ACC; ++i) acc[mi][i] = 0.0f;",
        "",
        "// start copying this block's k step `next` into ring buffer next % STAGES (one copy group, empty",
        "// past its steps)",
        "auto load_tiles = [&](int next) {",
        "    if (next < steps) {",
        "        const int k0 = (kt_begin + next) * BK, stage = next % STAGES;",
        f"        // A tile, {order(a)}",
        *indent_lines(load_a, 2),
        f"        // B tile, {order(b)}",
        *indent_lines(load_b, 2),
        "    }",
        "    ck_cp_async_commit();",
        "};",
        "",
        "// descriptors of buffer 0: this warpgroup's first m64 tile of A, and B",
        "const u32 tiles_addr = smem_u32(tiles);",
        "const unsigned long long a_desc = make_smem_desc(tiles_addr + A_SMEM + warpgroup * M_TILES * BOX_BYTES, A_LBO, 1024);",
        "const unsigned long long b_desc = make_smem_desc(tiles_addr + B_SMEM, B_LBO, 1024);",
        "",
        "// the wgmmas of one k step from buffer `stage`: BK / 16 k16 steps x M_TILES m64 tiles",
        "auto issue = [&](int stage) {",
        *indent_lines(wgmma.k_step_wgmmas(mma_name), 1),
        "};",
        "",
        "#pragma unroll",
        "for (int next = 0; next < STAGES - 2; ++next) load_tiles(next);",
        "",
        "// main loop: step kt's wgmmas run while step kt + 1 is issued; STAGES - 2 steps load ahead",
        "for (int kt = 0; kt < steps; ++kt) {",
        "    ck_cp_async_wait_oldest();",
        "    fence_proxy_async();  // this thread's copies of step kt are visible to the wgmma (async proxy)",
        "    __syncthreads();      // every thread's copies have landed; every warpgroup retired step kt - 2",
        "    #pragma unroll",
        "    for (int mi = 0; mi < M_TILES; ++mi) fence_operands(acc[mi]);",
        "    wgmma_fence();",
        "    issue(kt % STAGES);",
        "    wgmma_commit();",
        "    load_tiles(kt + STAGES - 2);  // into the buffer of step kt - 2",
        "    wgmma_wait<1>();  // step kt - 1 has retired; step kt may still run",
        "}",
        "wgmma_wait<0>();",
        "#pragma unroll",
        "for (int mi = 0; mi < M_TILES; ++mi) fence_operands(acc[mi]);",
        *_split_reduction(s.split_k),
        "",
        "// epilogue: accumulator d[4c + e] of m64 tile mi is row 16 warp + lane / 4 (+8 for e >= 2),",
        "// column 8c + 2 (lane % 4) + (e & 1)",
        *epilogue_loops(
            ("mi", "M_TILES"), ("c", "BN / 8"),
            "m0 + warpgroup * WG_M + 64 * mi + 16 * warp + (lane >> 2) + 8 * (e >> 1)",
            "n0 + 8 * c + 2 * (lane & 3) + (e & 1)",
            epilogue, paired,
        ),
    ]  # fmt: skip
    summary = (
        f"GEMM: wgmma.mma_async m64n{s.block_n}k16 {dtype}, fp32 accumulators, operands from 128-byte-swizzled "
        f"shared memory; M={layout.m} N={layout.n} K={layout.k} batch={layout.batch_size}; tile "
        f"{s.block_m}x{s.block_n}x{s.block_k}, {s.consumer_warpgroups} warpgroups, {s.stages} stages; "
        f"A {order(a)}, B {order(b)}, both copied with cp.async"
        + (f"; K split over {s.split_k} blocks a tile, fp32 partials added by the last." if s.split_k > 1 else ".")
    )
    launch = f"grid ({gx}, {gy}, {gz}), {s.threads} threads, {smem_bytes} bytes of dynamic shared memory"
    helpers = _helpers(dtype, s.block_n, s.stages, not a.kmajor, not b.kmajor)
    if paired:
        helpers += "\n\n" + vector_helpers([(plan.output.dtype, 2)])
    if s.split_k > 1:
        constants += "\n\n" + _split_workspace(gx * gy * gz // s.split_k, s)
    return term_source(plan, name, s.threads, body, summary, launch, helpers, constants)


def _split_workspace(tiles: int, s) -> str:
    """The split-K workspace: module globals, zero at load, sized for this problem."""
    return block(f"""
        // Split-K workspace: each block's fp32 partial sums, thread-major (PARTIALS floats a block:
        // accumulator i of thread t at i * THREADS + t), and one arrival counter a tile, which the
        // tile's last block resets to zero for the next launch. Launches of this module must not overlap.
        constexpr int TILES = {tiles};  // output tiles, all batch entries
        constexpr int PARTIALS = M_TILES * ACC * THREADS;
        __device__ float ck_partials[TILES * SPLITS * PARTIALS];
        __device__ unsigned int ck_arrivals[TILES];
        """)


def _split_reduction(split_k: int) -> list[str]:
    """Statements after the main loop of a split-K block: publish the partial sums; every
    block but the tile's last returns, the last replaces its accumulators by the sum of all
    the splits' partials in split order (the same order whichever block is last)."""
    if split_k == 1:
        return []
    return [
        "",
        "// split-K: publish this block's partial sums; the tile's last block to arrive adds up every",
        "// split's partials in split order and runs the epilogue, the others are done",
        "__shared__ int last_split;",
        "const int tile_id = blockIdx.z / SPLITS * (TILES_M * TILES_N) + tile;",
        "float* const partials = ck_partials + size_t(tile_id) * SPLITS * PARTIALS + threadIdx.x;",
        "#pragma unroll",
        "for (int mi = 0; mi < M_TILES; ++mi)",
        "    #pragma unroll",
        "    for (int i = 0; i < ACC; ++i)",
        "        __stcg(partials + (blockIdx.z % SPLITS) * PARTIALS + (mi * ACC + i) * THREADS, acc[mi][i]);",
        "__threadfence();  // the partials are visible device-wide before the arrival is counted",
        "__syncthreads();",
        "if (threadIdx.x == 0) {",
        "    last_split = atomicAdd(&ck_arrivals[tile_id], 1u) == SPLITS - 1;",
        "    if (last_split) ck_arrivals[tile_id] = 0;  // every split has arrived: ready for the next launch",
        "}",
        "__syncthreads();",
        "if (!last_split) return;",
        "__threadfence();  // the other splits' partials are read after their arrivals",
        "#pragma unroll",
        "for (int mi = 0; mi < M_TILES; ++mi) {",
        "    #pragma unroll",
        "    for (int i = 0; i < ACC; ++i) {",
        "        float sum = 0.0f;",
        "        for (int split = 0; split < SPLITS; ++split) sum += __ldcg(partials + split * PARTIALS + (mi * ACC + i) * THREADS);",
        "        acc[mi][i] = sum;",
        "    }",
        "}",
    ]
