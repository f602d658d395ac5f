"""The mma.sync flash-attention kernel family (sm_80 … sm_120): one plan → one ``__global__``.

``o = softmax(scale · q kᵀ [causal mask]) v`` for BHSD-contiguous q, k, v, o. One block
computes ``BLOCK_Q`` query rows of one (batch, head); its warps own ``ROWS_PER_WARP`` rows
each. Q is loaded once (kept as mma fragments in registers when they fit, see
:func:`cherenkov.codegen.plan.keeps_q_in_registers`), K/V tiles stream through the cp.async
ring of :mod:`.pipeline`; per key tile a warp computes S = Q Kᵀ (fp32), folds it into the
online softmax (:mod:`.softmax`), re-packs the probabilities as the A operands of P·V
without leaving registers and accumulates O in fp32. Causal blocks visit key tiles up to
their diagonal only, and apply per-element masks only on the diagonal (and Skv-tail) tiles.
The output is normalised, staged in the (now free) Q tile and written with 16-byte stores.
On the TMA ring three step knobs change a tile step: the row sums ride on P·V as one more
mma with a B operand of ones (``row_sums_mma``), Q is scaled by ``scale·log2 e`` in shared
memory once and each row's offset starts the first QKᵀ mma (``q_prescaled``), and the last
warp out of a stage refills it (``last_warp_refill``, in :mod:`.pipeline`).

Specialisation: every problem value (B, H, Hkv, Sq, Skv, D, dtype, causal, GQA group,
scale) and every schedule value is a compile-time constant, so a kernel serves exactly one
problem shape; tail handling compiles away when the lengths are multiples of the tiles.
Short queries (decode, speculative decoding, chunked prefill) have three more knobs: a
packed GQA group (one block's rows are the queries of every query head of a K/V head), key
splits (each block folds a share of the keys into a partial state in a workspace; the last
block of a query tile combines them) and warps that split each key tile's keys (their
states meet in shared memory at the end). They take a causal mask or window whose last query
sees the last key (a chunk of queries after a KV cache: query ``i`` sees keys ``j ≤ i + AHEAD``,
and a sliding window over its cache, masked on every tile); a packed row's query for the mask
is its row over the group. Head dims narrower than a power-of-two row are
padded in shared memory (``FlashLayout``); v and o may have their own head dim. A head dim that is
a multiple of 8 but not of 16 (40) is held as the next multiple of 16 (``QK_COLUMNS``,
``V_COLUMNS``): the copies zero-fill the columns past it (``load_tile``'s ``DATA`` chunks), so
``Q Kᵀ``'s last k16 step and ``P V``'s last n8 pair read zeros, and O's zero columns are not stored.

Launch: grid ``(ceil(rows / BLOCK_Q) · KV_SPLITS, H or Hkv (packed), B)`` (causal: block x
takes the query tile counted from the end, longest first), ``THREADS`` threads,
``SMEM_BYTES`` of dynamic shared memory, arguments ``(q, k, v, o)`` device pointers — or, for
a ring fed by TMA (``tma_kv``), ``(q, o, k_map, v_map)``: K and V as tensor maps
(``launch.TmaFlashKernel`` encodes them) — and, with key splits, the workspace last.
"""

from __future__ import annotations

import re

from cherenkov.codegen.cuda import attention_mask, cp_async, ldmatrix, mma, softmax, swizzle, tma
from cherenkov.codegen.cuda.pipeline import KvPipeline, MbarrierKvPipeline, UnitPipeline
from cherenkov.codegen.cuda.text import (
    block,
    bool_literal,
    comment_lines,
    float_literal,
    identifier,
    indent,
    section,
)
from cherenkov.codegen.errors import CodegenError
from cherenkov.codegen.plan import FlashLayout, FlashTiling, KernelPlan
from cherenkov.rewrites.plan import (
    ATTENTION_ROLES,
    TMA_ALIGN_BYTES,
    AttentionProblem,
    FlashSchedule,
    flash_schedule_problems,
    padded_head_dim,
)

LOG2E = 1.4426950408889634


def kernel_name(plan: KernelPlan) -> str:
    """The ``extern "C"`` name of a plan's kernel, e.g. ``flash_attention_q128_kv64_w4_s2_split_swz_x4``."""
    return identifier(f"flash_attention_{plan.schedule.key()}")


def softmax_scale(problem: AttentionProblem) -> float:
    """The problem's scale, ``head_dim ** -0.5`` when it is left at 0 (both flash families)."""
    scale = problem.scale or problem.head_dim**-0.5
    if scale <= 0:
        raise CodegenError(f"softmax scale {problem.scale} must be positive (or 0 for head_dim ** -0.5)")
    return scale


def problem_summary(problem: AttentionProblem) -> str:
    """The ``Problem:`` line of a flash kernel's header (both flash families)."""
    p = problem
    mask = (" causal" if p.causal else "") + (f" window={p.window}" if p.window else "")
    return (f"Problem: B={p.batch} H={p.heads} Hkv={p.kv_heads} Sq={p.seq_q} Skv={p.seq_kv} D={p.head_dim} "
            f"{f'D_v={p.value_dim} ' if p.value_dim else ''}{p.dtype}{mask} scale={softmax_scale(p):.9g}.")


def flash_attention_source(plan: KernelPlan) -> str:
    """Deterministic CUDA C++ of one flash-attention plan (same plan → same bytes)."""
    _check(plan)
    layout = FlashLayout.from_plan(plan)
    tiling = FlashTiling.from_plan(plan)
    schedule = plan.schedule
    bias = plan.problem.bias is not None
    if schedule.pingpong or schedule.overlap:
        pipeline = UnitPipeline(schedule.stages)
        pipeline_title = (f"cp.async pipeline: {schedule.stages} stage(s) of units (K_j, V_(j-1)), "
                          f"{'pingpong' if schedule.pingpong else 'overlap'}")
        step_parts = (_unit_phases(bias),) + ((_overlap_steps(),) if schedule.overlap else ())
    elif schedule.mbarrier_ring:
        pipeline = MbarrierKvPipeline(schedule.stages, schedule.late_copy, schedule.tma_kv, schedule.last_warp_refill)
        barriers = "full mbarriers, the last warp refills" if schedule.last_warp_refill else "full/empty mbarriers"
        pipeline_title = (f"{'TMA' if schedule.tma_kv else 'cp.async'} pipeline: {schedule.stages} stages, K/V joint, "
                          f"{barriers}{', late copy' if schedule.late_copy else ''}")
        step_parts = (pipeline.emit_release(), _attend_tile(pipeline.release_call, pipeline.source, schedule, bias))
    else:
        pipeline = KvPipeline(schedule.stages, schedule.kv_split, schedule.late_copy)
        pipeline_title = (f"cp.async pipeline: {schedule.stages} stage(s), K/V {'split' if schedule.kv_split else 'joint'}"
                          f"{', late copy' if schedule.late_copy else ''}")
        step_parts = (_attend_tile("", "const elem_t*", schedule, bias),)
    dtype = plan.problem.dtype
    lse = plan.problem.lse is not None
    parts = [
        _header(plan, layout, tiling),
        section("types and helpers", _types(dtype, schedule.tma_kv)),
        section("problem and schedule constants", _constants(plan, tiling)),
        section("shared-memory layout", _layout_constants(layout), swizzle.emit_tile_addressing(layout.swizzle),
                swizzle.emit_shared_access()),
        section("cp.async copies", cp_async.emit_cp_async(), cp_async.emit_tile_loader(),
                *([_load_query_rows()] if schedule.short_query else [])),
        section("ldmatrix fragments", ldmatrix.emit_ldmatrix_primitives(plan.schedule.ldmatrix_x),
                ldmatrix.emit_fragment_loaders(plan.schedule.ldmatrix_x,
                                               kv_boxes=layout.kv_boxes if layout.tma_kv else 0)),
        section("tensor-core mma", *_mma_helpers(dtype, schedule)),
        section("online softmax", softmax.emit_math_helpers(),
                softmax.emit_online_softmax(schedule.lazy_rescale, schedule.row_sums_mma, schedule.q_prescaled),
                softmax.emit_row_finish(schedule.row_sums_mma),
                *([softmax.emit_row_log_sum_exp(schedule.q_prescaled)] if lse else [])),
        section(pipeline_title, pipeline.emit()),
        section("one key tile", _q_fragments(tiling), *([_scale_q_rows()] if schedule.q_prescaled else []),
                _row_state(schedule.row_sums_mma, bias),
                attention_mask.emit_soft_cap(plan.problem, softmax_scale(plan.problem)),
                _compute_scores(schedule.q_prescaled, bool(plan.problem.softcap)), *_mask_readers(plan.problem),
                _pack_probabilities(), _accumulate_values(schedule.row_sums_mma), *step_parts),
        section("epilogue", _store_output(schedule.pack_group, lse),
                *([_partial_states()] if schedule.kv_splits > 1 or schedule.warp_keys else []),
                *([_split_partials(lse)] if schedule.kv_splits > 1 else []),
                *([_WARP_MERGE] if schedule.warp_keys else [])),
        section("kernel", _kernel(plan, tiling)),
    ]
    return "\n\n".join(parts) + "\n"


def _mma_helpers(dtype: str, schedule: FlashSchedule) -> list[str]:
    """The mma and packing helpers a schedule uses: a pre-scaled Q adds the mma from given
    initial values and the unpacking of Q's pairs, row sums on the tensor cores the ones."""
    parts = [mma.emit_mma(dtype)]
    if schedule.q_prescaled:
        parts.append(mma.emit_mma_from(dtype))
    parts.append(mma.emit_pack(dtype))
    if schedule.q_prescaled:
        parts.append(mma.emit_unpack(dtype))
    if schedule.row_sums_mma:
        parts.append(mma.emit_one_pair(dtype))
    return parts


def _check(plan: KernelPlan) -> None:
    if plan.kind != "flash_attention":
        raise CodegenError(f"plan kind {plan.kind!r} is not flash_attention")
    p = plan.problem
    problems = flash_schedule_problems(plan.schedule, p, plan.target)
    if problems:
        raise CodegenError(f"invalid flash-attention plan {plan.name}: {'; '.join(problems)}")
    if min(p.batch, p.heads, p.kv_heads, p.seq_q, p.seq_kv) < 1 or p.heads % p.kv_heads:
        raise CodegenError(
            f"attention shape B={p.batch} H={p.heads} Hkv={p.kv_heads} Sq={p.seq_q} Skv={p.seq_kv}: "
            "every size must be positive and kv_heads must divide heads"
        )
    for name in (p.q, p.k, p.v, p.out):
        identifier(name)
    softmax_scale(plan.problem)


def _header(plan: KernelPlan, layout: FlashLayout, tiling: FlashTiling) -> str:
    p, s = plan.problem, plan.schedule
    names = ", ".join(identifier(n) for n in (p.q, p.k, p.v, p.out))
    lines = [
        f"Generated by cherenkov: flash attention, plan {identifier(plan.name)} for {identifier(plan.target.name)}.",
        f"{identifier(p.out)} = softmax({attention_mask.score_formula(p)}"
        f"{attention_mask.mask_clause(p)}) {identifier(p.v)}; tensors ({names}) BHSD contiguous.",
        problem_summary(p),
        f"Schedule: {s.key()}: BLOCK_Q={s.block_q} BLOCK_KV={s.block_kv} warps={s.warps} stages={s.stages} "
        f"kv_split={s.kv_split} swizzle={s.swizzle} ldmatrix x{s.ldmatrix_x} pingpong={s.pingpong} "
        f"lazy_rescale={s.lazy_rescale} head_major={s.head_major} overlap={s.overlap} min_blocks={s.min_blocks} "
        f"late_copy={s.late_copy} mbarrier_ring={s.mbarrier_ring}{' tma_kv=True' if s.tma_kv else ''}"
        f"{' row_sums_mma=True' if s.row_sums_mma else ''}{' q_prescaled=True' if s.q_prescaled else ''}"
        f"{' last_warp_refill=True' if s.last_warp_refill else ''}"
        f"{f' kv_splits={s.kv_splits}' if s.kv_splits > 1 else ''}{' pack_group=True' if s.pack_group else ''}; "
        f"Q fragments in {'registers' if tiling.q_in_registers else 'shared memory'}.",
        f"Shared memory: {layout.total_bytes} bytes, layout {layout.swizzle_pattern}"
        + (f"; K/V tiles in {layout.kv_boxes} TMA box(es) of 64 columns each, {layout.swizzle_pattern} "
           f"({layout.align_slack} bytes of slack to align the base)." if layout.tma_kv else "."),
        "Every problem and schedule value is a compile-time constant: this kernel serves one shape.",
        f"Launch: grid {tiling.grid}, {s.threads} threads, "
        f"{layout.total_bytes} bytes dynamic shared memory, "
        + ("args (q, o, k_map, v_map): K and V through TMA tensor maps of (D, Skv, B*Hkv) in boxes of "
           f"64 x {s.block_kv} x 1" if s.tma_kv else "args (q, k, v, o)")
        + (", then the bias tensor" if p.bias is not None else "")
        + (f", then the key splits' workspace ({tiling.workspace_floats} fp32 words, zeroed once)."
           if s.kv_splits > 1 else "."),
    ]
    return comment_lines(lines)


def _types(dtype: str, tma_kv: bool) -> str:
    text = block(
        f"""
        typedef unsigned int u32;
        typedef unsigned short elem_t;  // the bits of one {dtype} element

        __device__ __forceinline__ int imin(int a, int b) {{ return a < b ? a : b; }}
        __device__ __forceinline__ int imax(int a, int b) {{ return a > b ? a : b; }}
        """
    )
    if not tma_kv:
        return text
    return text + "\n\n" + tma.emit_tensor_map_type() + "\n\n" + block(
        """
        // Where the ring reads one head's K (or V) tiles: the tensor's map, a (D, SEQ_KV, KV_HEADS,
        // BATCH) view at the operand's strides, and the K/V head and batch coordinates.
        struct KvSource {
            const TensorMap* map;
            int head;
            int batch;
        };
        """
    )


def _constants(plan: KernelPlan, tiling: FlashTiling) -> str:
    p, s = plan.problem, plan.schedule
    scale = softmax_scale(plan.problem)
    return block(
        f"""
        constexpr int BATCH = {p.batch};
        constexpr int HEADS = {p.heads};
        constexpr int KV_HEADS = {p.kv_heads};
        constexpr int GROUP = {p.group_size};  // query heads per K/V head
        constexpr int SEQ_Q = {p.seq_q};
        constexpr int SEQ_KV = {p.seq_kv};
        constexpr int HEAD_DIM = {p.head_dim};  // of q and k
        constexpr int VALUE_DIM = {p.v_dim};  // of v and o
        constexpr int QK_COLUMNS = {padded_head_dim(p.head_dim)};  // a Q or K tile row: HEAD_DIM, zeros to a multiple of 16
        constexpr int V_COLUMNS = {padded_head_dim(p.v_dim)};  // a V tile row and O's accumulators: VALUE_DIM, and zeros
        constexpr bool CAUSAL = {bool_literal(p.causal)};
        constexpr int WINDOW = {p.window};  // 0: none; else query i sees keys i - WINDOW < j (<= i + AHEAD)
        constexpr int AHEAD = {p.window_ahead};  // keys after the query a window without the causal mask sees
        constexpr bool UPPER_EDGE = {bool_literal(p.upper_edge is not None)};  // causal or a window: keys j > i + AHEAD hidden
        constexpr float SCALE_LOG2 = {float_literal(scale * LOG2E)};  // scale {scale:.9g} * log2(e)
        @MASK_CONSTANTS@

        constexpr int BLOCK_Q = {s.block_q};
        constexpr int BLOCK_KV = {s.block_kv};
        constexpr int WARPS = {s.warps};
        constexpr int THREADS = {s.threads};
        constexpr int ROWS_PER_WARP = {s.rows_per_warp};
        constexpr bool WARP_KEYS = {bool_literal(s.warp_keys)};  // warps split each key tile's keys, not the rows
        constexpr int KEYS_PER_WARP = {s.keys_per_warp};
        constexpr int STAGES = {s.stages};
        constexpr int MIN_BLOCKS = {s.min_blocks};  // __launch_bounds__: resident blocks per SM
        constexpr bool HEAD_MAJOR = {bool_literal(s.head_major)};  // grid order: heads fastest
        constexpr int M_TILES = {tiling.m_tiles};     // m16 tiles of query rows per warp
        constexpr int KV_NTILES = {tiling.kv_ntiles};   // n8 tiles of S per key tile
        constexpr int KV_STEPS = {tiling.kv_steps};    // k16 steps of P*V per key tile
        constexpr int D_NTILES = {tiling.d_ntiles};    // n8 tiles of O
        constexpr int D_STEPS = {tiling.d_steps};     // k16 steps of Q*K^T
        constexpr int Q_TILES = {tiling.q_tiles};
        constexpr int KV_TILES = {tiling.kv_tiles};
        constexpr bool PACK = {bool_literal(s.pack_group)};  // a block's rows: query r / GROUP of head r % GROUP
        constexpr int Q_ROWS = PACK ? SEQ_Q * GROUP : SEQ_Q;  // rows of one head (or packed K/V head group)
        constexpr int ROW_HEADS = PACK ? KV_HEADS : HEADS;  // the grid's y
        constexpr int KV_SPLITS = {s.kv_splits};  // blocks sharing a query tile's keys
        constexpr int TILES_PER_SPLIT = {tiling.tiles_per_split};
        constexpr bool Q_TAIL = Q_ROWS % BLOCK_Q != 0;
        constexpr bool KV_TAIL = SEQ_KV % BLOCK_KV != 0;
        constexpr bool NEEDS_MASK = UPPER_EDGE || WINDOW || KV_TAIL || BIAS;  // a bias tensor masks every tile
        constexpr bool SHORT_QUERY = {bool_literal(s.short_query)};  // a row space's key splits, packed rows, warps on keys
        constexpr bool CUTS_BEHIND = WINDOW > 0 && WINDOW < SEQ_Q;  // the window hides keys behind the later queries
        static_assert(THREADS == 32 * WARPS && (WARP_KEYS ? ROWS_PER_WARP : ROWS_PER_WARP * WARPS) == BLOCK_Q,
                      "warps split the query tile (or, WARP_KEYS, each key tile)");
        static_assert(QK_COLUMNS == 16 * D_STEPS && V_COLUMNS == 8 * D_NTILES && ROW_HEADS * GROUP >= HEADS,
                      "head dims and row spaces");

        // The query tile of a long-query block. The grid is (Q_TILES, HEADS, BATCH), issued x fastest;
        // HEAD_MAJOR reads the linear block index heads-fastest instead, so that one query tile of every
        // head runs before the next. Causal: query tiles are counted from the end, longest first.
        __device__ __forceinline__ int long_query_tile() {{
            const int linear = int(blockIdx.x) + Q_TILES * (int(blockIdx.y) + HEADS * int(blockIdx.z));
            const int tile_index = HEAD_MAJOR ? linear / (HEADS * BATCH) : int(blockIdx.x);
            return CAUSAL ? Q_TILES - 1 - tile_index : tile_index;
        }}

        // A windowed block's key tiles (long-query): [first, end), from that of its first row's first key
        // (the tiles below it are never loaded) to that of its last row's last (the diagonal, or AHEAD
        // past it); those below lower_end hold keys that some row's window leaves out (they need the
        // mask, as the diagonal ones do).
        struct WindowTiles {{
            int first, lower_end, end;
        }};

        __device__ __forceinline__ WindowTiles window_tiles() {{
            const int q0 = long_query_tile() * BLOCK_Q;
            const int end = imin(KV_TILES, (imin(q0 + BLOCK_Q, SEQ_Q) + AHEAD + BLOCK_KV - 1) / BLOCK_KV);
            const int first = q0 >= WINDOW ? (q0 - (WINDOW - 1)) / BLOCK_KV : 0;
            const int edge = q0 + BLOCK_Q - WINDOW;  // keys below it are outside the last row's window
            return {{first, edge > 0 ? imin(end, (edge + BLOCK_KV - 1) / BLOCK_KV) : first, end}};
        }}

        // The key tile of the sequence that the block's key tile `tile` is: with key splits, block
        // x % KV_SPLITS folds tiles [split * TILES_PER_SPLIT, +TILES_PER_SPLIT), counted from 0 in its loop.
        // With a window, the block's tiles rotated so that those wholly inside every row's window come
        // first: [lower_end, end) (the unmasked ones, then the diagonal's), then [first, lower_end).
        __device__ __forceinline__ int kv_tile(int tile) {{
            if constexpr (WINDOW > 0 && !SHORT_QUERY) {{
                const WindowTiles w = window_tiles();  // block-uniform: one evaluation once inlined
                const int rotated = tile + w.lower_end - w.first;  // < 2 (end - first): one wrap at most
                return w.first + (rotated < w.end - w.first ? rotated : rotated - (w.end - w.first));
            }}
            return KV_SPLITS == 1 ? tile : int(blockIdx.x) % KV_SPLITS * TILES_PER_SPLIT + tile;
        }}

        // The first key of every key tile this warp folds (WARP_KEYS: its KEYS_PER_WARP of them).
        __device__ __forceinline__ u32 warp_first_key() {{
            return WARP_KEYS ? (threadIdx.x >> 5) * KEYS_PER_WARP : 0;
        }}
        """
    ).replace("@MASK_CONSTANTS@", _mask_constants(plan)) + "\n\n" + operand_strides(p)


def _mask_constants(plan: KernelPlan) -> str:
    """The bias tensor's constants; a pre-scaled Q makes the scores log2 exponents."""
    if plan.schedule.q_prescaled:
        return attention_mask.emit_mask_constants(plan.problem, LOG2E, "log2(e): the scores are log2 exponents")
    return attention_mask.emit_mask_constants(plan.problem, 1.0 / softmax_scale(plan.problem), "1 / scale")


def operand_strides(problem: AttentionProblem) -> str:
    """Element strides of each operand's batch, head and sequence axes and the offset of its
    element (0, 0, 0, 0) in its stored tensor (both flash families); the head dimension is
    contiguous. K and V heads are K/V heads."""
    lines = ["// Where q, k, v and o lie in their tensors: element (b, h, s, d) at",
             "// OFFSET + b * BATCH_STRIDE + h * HEAD_STRIDE + s * ROW_STRIDE + d."]
    for role in ATTENTION_ROLES:
        layout = problem.layout(role)
        prefix = role.upper()
        if layout.seq >= 2**31:
            raise CodegenError(f"{role}'s row stride {layout.seq} does not fit a 32-bit int")
        lines += [
            f"constexpr size_t {prefix}_BATCH_STRIDE = {layout.batch};",
            f"constexpr size_t {prefix}_HEAD_STRIDE = {layout.head};",
            f"constexpr int {prefix}_ROW_STRIDE = {layout.seq};",
            f"constexpr size_t {prefix}_OFFSET = {layout.offset};",
        ]
    if problem.lse is not None:
        layout = problem.lse.layout
        lines += [
            "// Each query row's log-sum-exp (natural log, fp32), row (b, h, s) at",
            "// LSE_OFFSET + b * LSE_BATCH_STRIDE + h * LSE_HEAD_STRIDE + s * LSE_ROW_STRIDE.",
            f"constexpr size_t LSE_BATCH_STRIDE = {layout.batch}, LSE_HEAD_STRIDE = {layout.head}, "
            f"LSE_ROW_STRIDE = {layout.seq}, LSE_OFFSET = {layout.offset};",
            "constexpr float LN2 = 0.6931471805599453f;",
        ]
    return "\n".join(lines)


def _layout_constants(layout: FlashLayout) -> str:
    if layout.tma_kv:
        return _boxed_layout_constants(layout)
    return block(
        f"""
        // [Q tile | stage 0: K, V | stage 1: K, V | ...], rows of ROW_BYTES, {layout.swizzle_pattern}.
        constexpr u32 ROW_BYTES = {layout.row_bytes};
        constexpr int CHUNKS_PER_ROW = {layout.chunks_per_row};  // 16-byte chunks of a Q or K row
        constexpr int V_CHUNKS = {layout.value_chunks};  // 16-byte chunks of a V or O row
        constexpr int QK_DATA_CHUNKS = {layout.data_chunks};  // of a Q or K row, read (the rest zero-filled)
        constexpr int V_DATA_CHUNKS = {layout.value_data_chunks};  // of a V row read, of an O row stored
        constexpr u32 Q_SMEM = {layout.q_offset};
        constexpr u32 K_SMEM = {layout.k_offset(0)};  // K tile of stage s at K_SMEM + s * STAGE_BYTES
        constexpr u32 V_SMEM = {layout.v_offset(0)};  // V tile of stage s at V_SMEM + s * STAGE_BYTES
        constexpr u32 STAGE_BYTES = {layout.stage_bytes};
        constexpr u32 KV_ROW_BYTES = ROW_BYTES;  // from one key's row of a K or V tile to the next
        constexpr u32 SMEM_BYTES = {layout.total_bytes};
        static_assert(V_SMEM + (STAGES - 1) * STAGE_BYTES + BLOCK_KV * ROW_BYTES == SMEM_BYTES, "layout is packed");
        """
    )


def _boxed_layout_constants(layout: FlashLayout) -> str:
    return block(
        f"""
        // [Q tile | stage 0: K, V | stage 1: K, V | ...] from a {TMA_ALIGN_BYTES}-byte aligned base. Q: rows of
        // ROW_BYTES, {layout.swizzle_pattern}. K and V tiles: KV_BOXES TMA boxes of 64 columns
        // (BLOCK_KV rows of BOX_ROW_BYTES, the copy engine's 128-byte swizzle, the same pattern).
        constexpr u32 ROW_BYTES = {layout.row_bytes};
        constexpr int CHUNKS_PER_ROW = {layout.chunks_per_row};  // 16-byte chunks of a Q or K row
        constexpr int V_CHUNKS = {layout.value_chunks};  // 16-byte chunks of a V or O row
        constexpr int QK_DATA_CHUNKS = {layout.data_chunks};  // of a Q or K row, read (the rest zero-filled)
        constexpr int V_DATA_CHUNKS = {layout.value_data_chunks};  // of a V row read, of an O row stored
        constexpr u32 BOX_ROW_BYTES = {layout.box_row_bytes};
        constexpr int KV_BOXES = {layout.kv_boxes};
        constexpr u32 KV_BOX_BYTES = {layout.kv_box_bytes};
        constexpr u32 Q_SMEM = {layout.q_offset};
        constexpr u32 K_SMEM = {layout.k_offset(0)};  // K tile of stage s at K_SMEM + s * STAGE_BYTES
        constexpr u32 V_SMEM = {layout.v_offset(0)};  // V tile of stage s at V_SMEM + s * STAGE_BYTES
        constexpr u32 STAGE_BYTES = {layout.stage_bytes};
        constexpr u32 KV_ROW_BYTES = BOX_ROW_BYTES;  // from one key's row of a K or V box to the next
        constexpr u32 SMEM_ALIGN = {TMA_ALIGN_BYTES};  // a 128-byte swizzle atom: 8 rows of 128 bytes
        constexpr u32 SMEM_BYTES = {layout.total_bytes};  // the tiles plus SMEM_ALIGN of slack
        static_assert(V_SMEM + (STAGES - 1) * STAGE_BYTES + KV_BOXES * KV_BOX_BYTES + SMEM_ALIGN == SMEM_BYTES,
                      "layout is packed");
        static_assert(K_SMEM % SMEM_ALIGN == 0 && KV_BOX_BYTES % SMEM_ALIGN == 0, "boxes start on swizzle atoms");
        """
    )


def _q_fragments(tiling: FlashTiling) -> str:
    if tiling.q_in_registers:
        return block(
            """
            // The warp's Q rows as mma A fragments, loaded once and kept in registers.
            struct QFragments {
                u32 frag[M_TILES][D_STEPS][4];

                __device__ __forceinline__ void init(u32 q_tile, int warp_row0, int lane) {
                    #pragma unroll
                    for (int m = 0; m < M_TILES; ++m) {
                        #pragma unroll
                        for (int kk = 0; kk < D_STEPS; ++kk) {
                            load_a(frag[m][kk], q_tile, warp_row0 + 16 * m, kk, lane);
                        }
                    }
                }

                __device__ __forceinline__ void get(u32 (&a)[4], int m, int kk, int) const {
                    a[0] = frag[m][kk][0]; a[1] = frag[m][kk][1]; a[2] = frag[m][kk][2]; a[3] = frag[m][kk][3];
                }
            };
            """
        )
    return block(
        """
        // The warp's Q rows, re-read from the shared Q tile as mma A fragments at every step.
        struct QFragments {
            u32 q_tile;
            int warp_row0;

            __device__ __forceinline__ void init(u32 tile, int row0, int) {
                q_tile = tile;
                warp_row0 = row0;
            }

            __device__ __forceinline__ void get(u32 (&a)[4], int m, int kk, int lane) const {
                load_a(a, q_tile, warp_row0 + 16 * m, kk, lane);
            }
        };
        """
    )


def _scale_q_rows() -> str:
    return block(
        """
        // Pre-scaled Q: the warp's own rows of the Q tile times SCALE_LOG2 (scale * log2 e), in
        // place, once a block; the scores then come out of the mma as base-2 exponents.
        __device__ __forceinline__ u32 scale_pair(u32 pair) {
            return pack2(unpack_lo(pair) * SCALE_LOG2, unpack_hi(pair) * SCALE_LOG2);
        }

        __device__ __forceinline__ void st_shared_v4(u32 addr, uint4 v) {
            asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};\\n" :: "r"(addr), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w)
                         : "memory");
        }

        __device__ __forceinline__ void scale_q_rows(u32 q_tile, int warp_row0, int lane) {
            #pragma unroll
            for (int i = 0; i < ROWS_PER_WARP * CHUNKS_PER_ROW / 32; ++i) {
                const u32 addr = q_tile + u32(warp_row0) * ROW_BYTES + u32(32 * i + lane) * 16;
                const uint4 v = ld_shared_v4(addr);
                st_shared_v4(addr, make_uint4(scale_pair(v.x), scale_pair(v.y), scale_pair(v.z), scale_pair(v.w)));
            }
            __syncwarp();
        }
        """
    )


def _row_state(row_sums_mma: bool, bias: bool) -> str:
    if row_sums_mma:
        what, columns = "the row sums' m16 x n8 accumulator (P times ones)", 4
        zero = "row_sum[m][0] = row_sum[m][1] = row_sum[m][2] = row_sum[m][3] = 0.0f;"
    else:
        what, columns, zero = "partial row sum", 2, "row_sum[m][0] = row_sum[m][1] = 0.0f;"
    return block(
        f"""
        // This thread's running softmax state: O accumulators (fp32), row max, {what}.
        struct RowState {{
            float o[M_TILES][D_NTILES][4];
            float row_max[M_TILES][2];
            float row_sum[M_TILES][{columns}];@BIAS_ROWS@

            __device__ __forceinline__ void init() {{
                #pragma unroll
                for (int m = 0; m < M_TILES; ++m) {{
                    #pragma unroll
                    for (int d = 0; d < D_NTILES; ++d) {{
                        o[m][d][0] = o[m][d][1] = o[m][d][2] = o[m][d][3] = 0.0f;
                    }}
                    row_max[m][0] = row_max[m][1] = neg_inf();
                    @ZERO@
                }}
            }}
        }};
        """
    ).replace("@ZERO@", zero).replace(
        "@BIAS_ROWS@", "\n    const bias_t* bias_rows;  // the bias tensor's rows of this block's row space" if bias else "")


def _compute_scores(q_prescaled: bool, soft_cap: bool = False) -> str:
    """``compute_scores``: S = Q Kᵀ for the warp's rows and one key tile, raw or (``q_prescaled``)
    as log2 exponents less the row offsets; ``soft_cap``: each raw score then soft-capped."""
    if q_prescaled:
        what = ("S = Q K^T - offsets (Q pre-scaled: exponents) for the warp's rows and the BLOCK_KV keys of\n"
                "// `k_tile`. Each K fragment pair is loaded once and used by every m16 tile of the warp; the\n"
                "// first k16 step starts each row from its negated offset (0 for a fresh row).")
        params = "u32 k_tile, int lane, const float (&row_max)[M_TILES][2]"
        start = ("mma_16816_from(s[m][2 * np], a[m], b[0], b[1], start[m][0], start[m][1]);",
                 "mma_16816_from(s[m][2 * np + 1], a[m], b[2], b[3], start[m][0], start[m][1]);")
        prelude = block(
            """
            float start[M_TILES][2];
            #pragma unroll
            for (int m = 0; m < M_TILES; ++m) {
                start[m][0] = row_max[m][0] == neg_inf() ? 0.0f : -row_max[m][0];
                start[m][1] = row_max[m][1] == neg_inf() ? 0.0f : -row_max[m][1];
            }
            """
        )
    else:
        what = ("S = Q K^T (raw, unscaled) for the warp's rows and the BLOCK_KV keys of `k_tile`.\n"
                "// Each K fragment pair is loaded once and used by every m16 tile of the warp; the first\n"
                "// k16 step starts the accumulators from zero (no separate zeroing).")
        params = "u32 k_tile, int lane"
        start = ("mma_16816_zero(s[m][2 * np], a[m], b[0], b[1]);", "mma_16816_zero(s[m][2 * np + 1], a[m], b[2], b[3]);")
        prelude = ""
    text = block(
        """
        // @WHAT@
        __device__ __forceinline__ void compute_scores(float (&s)[M_TILES][KV_NTILES][4], const QFragments& q,
                                                       @PARAMS@) {@PRELUDE@
            #pragma unroll
            for (int kk = 0; kk < D_STEPS; ++kk) {
                u32 a[M_TILES][4];
                #pragma unroll
                for (int m = 0; m < M_TILES; ++m) {
                    q.get(a[m], m, kk, lane);
                }
                #pragma unroll
                for (int np = 0; np < KV_NTILES / 2; ++np) {
                    u32 b[4];
                    load_b_k(b, k_tile, 16 * np, kk, lane);
                    #pragma unroll
                    for (int m = 0; m < M_TILES; ++m) {
                        if (kk == 0) {
                            @START0@
                            @START1@
                        } else {
                            mma_16816(s[m][2 * np], a[m], b[0], b[1]);
                            mma_16816(s[m][2 * np + 1], a[m], b[2], b[3]);
                        }
                    }
                }
            }@CAP@
        }
        """
    )
    cap = ""
    if soft_cap:
        what += "\n// Then each score is soft-capped (soft_cap), in the same raw units."
        cap = block(
            """
            #pragma unroll
            for (int m = 0; m < M_TILES; ++m) {
                #pragma unroll
                for (int n = 0; n < KV_NTILES; ++n) {
                    #pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        s[m][n][e] = soft_cap(s[m][n][e]);
                    }
                }
            }
            """
        )
        cap = "".join("\n    " + line for line in cap.splitlines())
    text = text.replace("@CAP@", cap)
    prelude = "".join("\n    " + line for line in prelude.splitlines())
    return (text.replace("@WHAT@", what).replace("@PARAMS@", params).replace("@PRELUDE@", prelude)
            .replace("@START0@", start[0]).replace("@START1@", start[1]))


def _mask_readers(problem: AttentionProblem) -> list[str]:
    """``mask_scores`` and, for a bias tensor, the reader of its elements."""
    if problem.bias is None:
        return [_mask_scores(bias=False)]
    return [attention_mask.emit_bias_score(problem), _bias_row(), _mask_scores(bias=True)]


def _bias_row() -> str:
    return block(
        """
        // Where row `row` of the block's row space starts in the bias tensor, from the row space's
        // first element `rows`: packed rows interleave the group's heads.
        __device__ __forceinline__ const bias_t* bias_row(const bias_t* rows, int row) {
            if constexpr (PACK) {
                return rows + size_t(row / GROUP) * BIAS_ROW_STRIDE + size_t(row % GROUP) * BIAS_HEAD_STRIDE;
            }
            return rows + size_t(row) * BIAS_ROW_STRIDE;
        }
        """
    )


def _mask_scores(bias: bool) -> str:
    """``mask_scores``: -inf past SEQ_KV and after the query (causal); with a bias tensor
    (``bias``) every other score gains its bias, on every tile."""
    text = block(
        """
        // -inf for keys past SEQ_KV and, when causal, keys after the query (key > row; a window about
        // the query: key > row + AHEAD) and (WINDOW) keys at least WINDOW before it.@BIAS_NOTE@
        // Called only for the @WHICH@. Element e of n8 tile n of m16 tile m
        // is (row0 + 16m + lane/4 + 8(e/2), key0 + 8n + 2(lane%4) + e%2): the lane's part is
        // folded into two per-thread values, the rest are compile-time offsets. A packed row r is
        // query r / GROUP, so there the query is divided out of each element's row.
        __device__ __forceinline__ void mask_scores(float (&s)[M_TILES][KV_NTILES][4], int row0, int key0, int lane@PARAM@) {
            const int lane_key = key0 + 2 * (lane & 3);
            const int lane_key_minus_row = lane_key - (row0 + (lane >> 2));
            #pragma unroll
            for (int m = 0; m < M_TILES; ++m) {
                #pragma unroll
                for (int n = 0; n < KV_NTILES; ++n) {
                    #pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        const int key_offset = 8 * n + (e & 1);
                        const bool past_end = KV_TAIL && lane_key + key_offset >= SEQ_KV;
                        const int key_minus_row =
                            PACK ? lane_key + key_offset - (row0 + (lane >> 2) + 16 * m + 8 * (e >> 1)) / GROUP
                                 : lane_key_minus_row + key_offset - 16 * m - 8 * (e >> 1);
                        const bool future = UPPER_EDGE && key_minus_row > AHEAD;
                        const bool outside = WINDOW > 0 && key_minus_row <= -WINDOW;
                        if (past_end || future || outside) {
                            s[m][n][e] = neg_inf();
                        }@BIAS@
                    }
                }
            }
        }
        """
    )
    values = {"@BIAS_NOTE@": "", "@WHICH@": "diagonal, window-edge and Skv-tail tiles", "@PARAM@": "", "@BIAS@": ""}
    if bias:
        values = {
            "@BIAS_NOTE@": "\n// Every other score gains its bias (rows past Q_ROWS read nothing).",
            "@WHICH@": "key tiles: with a bias tensor, every one",
            "@PARAM@": ", const bias_t* bias_rows",
            "@BIAS@": (" else {\n" + " " * 20 + "const int row = row0 + (lane >> 2) + 16 * m + 8 * (e >> 1);\n"
                       + " " * 20 + "if (!Q_TAIL || row < Q_ROWS) {\n"
                       + " " * 24 + "s[m][n][e] += bias_score(bias_row(bias_rows, row), lane_key + key_offset);\n"
                       + " " * 20 + "}\n" + " " * 16 + "}"),
        }
    for placeholder, value in values.items():
        text = text.replace(placeholder, value)
    return text


def _pack_probabilities() -> str:
    return block(
        """
        // P as the A operands of P*V, straight from the S accumulators: n8 tiles 2kk and 2kk+1
        // of S are the k16 step kk of P.
        __device__ __forceinline__ void pack_probabilities(const float (&s)[M_TILES][KV_NTILES][4],
                                                           u32 (&p)[M_TILES][KV_STEPS][4]) {
            #pragma unroll
            for (int m = 0; m < M_TILES; ++m) {
                #pragma unroll
                for (int kk = 0; kk < KV_STEPS; ++kk) {
                    p[m][kk][0] = pack2(s[m][2 * kk][0], s[m][2 * kk][1]);
                    p[m][kk][1] = pack2(s[m][2 * kk][2], s[m][2 * kk][3]);
                    p[m][kk][2] = pack2(s[m][2 * kk + 1][0], s[m][2 * kk + 1][1]);
                    p[m][kk][3] = pack2(s[m][2 * kk + 1][2], s[m][2 * kk + 1][3]);
                }
            }
        }
        """
    )


def _accumulate_values(row_sums_mma: bool) -> str:
    text = block(
        """
        // O += P V for the BLOCK_KV keys of `v_tile`; each V fragment pair serves every m16 tile.@SUMS_NOTE@
        __device__ __forceinline__ void accumulate_values(float (&o)[M_TILES][D_NTILES][4],
                                                          const u32 (&p)[M_TILES][KV_STEPS][4], u32 v_tile, int lane@SUMS_PARAM@) {
            #pragma unroll
            for (int kk = 0; kk < KV_STEPS; ++kk) {@SUMS_MMA@
                #pragma unroll
                for (int dp = 0; dp < D_NTILES / 2; ++dp) {
                    u32 b[4];
                    load_b_v(b, v_tile, kk, 16 * dp, lane);
                    #pragma unroll
                    for (int m = 0; m < M_TILES; ++m) {
                        mma_16816(o[m][2 * dp], p[m][kk], b[0], b[1]);
                        mma_16816(o[m][2 * dp + 1], p[m][kk], b[2], b[3]);
                    }
                }
            }
        }
        """
    )
    sums = {"@SUMS_NOTE@": "", "@SUMS_PARAM@": "", "@SUMS_MMA@": ""}
    if row_sums_mma:
        sums = {
            "@SUMS_NOTE@": "\n// The row sums ride along: P times a B operand of ones adds each row's probabilities to"
                           "\n// every column of its accumulator (one mma per m16 tile and k16 step).",
            "@SUMS_PARAM@": ",\n" + " " * 50 + "float (&row_sum)[M_TILES][4]",
            "@SUMS_MMA@": "\n        #pragma unroll\n        for (int m = 0; m < M_TILES; ++m) {"
                          "\n            mma_16816(row_sum[m], p[m][kk], ONE_PAIR, ONE_PAIR);\n        }",
        }
    for placeholder, value in sums.items():
        text = text.replace(placeholder, value)
    return text


def _attend_tile(release: str, source: str, schedule: FlashSchedule, bias: bool) -> str:
    """``attend_tile``; ``release``: the statement that frees the tile's stage after the warp's
    P·V (mbarrier ring; empty elsewhere); ``source``: the C++ type the pipeline reads a head's
    K or V from; the schedule's step knobs pass the offsets to the scores (pre-scaled Q) and
    the row sums to P·V (row sums on the tensor cores); ``bias``: the mask reads a tensor."""
    text = block(
        """
        // One main-loop step: key tile j (in pipeline stage `slot`) folded into the state.
        // MASK: apply the causal / Skv-tail mask (diagonal and tail tiles only).
        template <bool MASK>
        __device__ __forceinline__ void attend_tile(RowState& state, const QFragments& q, u32 smem,
                                                    @SOURCE@ k_head, @SOURCE@ v_head,
                                                    int j, int slot, int n_tiles, int row0, int lane) {
            const u32 k_tile = smem + K_SMEM + u32(slot) * STAGE_BYTES + warp_first_key() * KV_ROW_BYTES;
            const u32 v_tile = smem + V_SMEM + u32(slot) * STAGE_BYTES + warp_first_key() * KV_ROW_BYTES;

            pipeline_wait_k(smem, k_head, v_head, j, slot, n_tiles);
            float s[M_TILES][KV_NTILES][4];
            compute_scores(s, q, k_tile, lane@OFFSETS@);
            if constexpr (MASK) {
                mask_scores(s, row0, kv_tile(j) * BLOCK_KV + int(warp_first_key()), lane@BIAS_ARG@);
            }
            online_softmax(s, state.o, state.row_max, state.row_sum);
            u32 p[M_TILES][KV_STEPS][4];
            pack_probabilities(s, p);

            pipeline_wait_v(smem, k_head, v_head, j, slot, n_tiles);
            accumulate_values(state.o, p, v_tile, lane@SUMS@);@RELEASE@
        }
        """
    )
    for placeholder, value in (("@RELEASE@", "\n    " + release if release else ""), ("@SOURCE@", source),
                               ("@BIAS_ARG@", ", state.bias_rows" if bias else ""),
                               ("@OFFSETS@", ", state.row_max" if schedule.q_prescaled else ""),
                               ("@SUMS@", ", state.row_sum" if schedule.row_sums_mma else "")):
        text = text.replace(placeholder, value)
    return text


def _unit_phases(bias: bool) -> str:
    return block(
        """
        // The phases of a step on the unit ring. Step u: O += P V_(u-1) with the P of the softmax
        // of tile u - 1 (u >= 1), and S = Q K_u^T (u < n_tiles); both tiles are unit u of the ring,
        // in stage `slot`. The softmax phase of key tile t: mask (diagonal / Skv-tail tiles),
        // fold into the online softmax, re-pack as P.
        __device__ __forceinline__ void values_phase(RowState& state, const u32 (&p)[M_TILES][KV_STEPS][4],
                                                     u32 smem, int slot, int lane) {
            accumulate_values(state.o, p, smem + V_SMEM + u32(slot) * STAGE_BYTES, lane);
        }

        __device__ __forceinline__ void scores_phase(float (&s)[M_TILES][KV_NTILES][4], const QFragments& q,
                                                     u32 smem, int slot, int lane) {
            compute_scores(s, q, smem + K_SMEM + u32(slot) * STAGE_BYTES, lane);
        }

        __device__ __forceinline__ void softmax_phase(RowState& state, float (&s)[M_TILES][KV_NTILES][4],
                                                      u32 (&p)[M_TILES][KV_STEPS][4], int t, int n_unmasked,
                                                      int row0, int lane) {
            if (NEEDS_MASK && t >= n_unmasked) {
                mask_scores(s, row0, kv_tile(t) * BLOCK_KV, lane@BIAS_ARG@);
            }
            online_softmax(s, state.o, state.row_max, state.row_sum);
            pack_probabilities(s, p);
        }
        """
    ).replace("@BIAS_ARG@", ", state.bias_rows" if bias else "")


def _store_output(pack_group: bool, lse: bool = False) -> str:
    """``store_output`` (and ``output_row_offset``); a packed group's rows interleave its heads;
    ``lse``: the rows' log-sum-exps are written too (``lse_row_offset``: where, as in o)."""
    text = block(
        """
        // Where row `row` of the block's query tile (from row q0 of its row space) lies in o, in
        // elements from the block's o_block: packed rows interleave the group's heads.
        __device__ __forceinline__ size_t output_row_offset(int q0, int row) {
            if constexpr (PACK) {
                const int packed = q0 + row;
                return size_t(packed % GROUP) * O_HEAD_STRIDE + size_t(packed / GROUP) * O_ROW_STRIDE;
            }
            return size_t(row) * O_ROW_STRIDE;
        }
@LSE_OFFSET@
        // Normalise O by the row sums, stage the warp's rows (as elem_t) in its own rows of the
        // Q tile, then copy them out with 16-byte stores; rows past Q_ROWS are not written.
        __device__ __forceinline__ void store_output(const RowState& state, u32 q_tile, elem_t* o_block,@LSE_PARAM@
                                                     int q0, int warp_row0, int lane) {
            float inv_sum[M_TILES][2];
            row_inverse_sums(state.row_sum, inv_sum);
            @LSE_STORE@
            __syncwarp();  // the warp's last reads of its Q rows are done
            #pragma unroll
            for (int m = 0; m < M_TILES; ++m) {
                #pragma unroll
                for (int d = 0; d < D_NTILES; ++d) {
                    #pragma unroll
                    for (int h = 0; h < 2; ++h) {
                        const int row = warp_row0 + 16 * m + (lane >> 2) + 8 * h;
                        const u32 packed = pack2(state.o[m][d][2 * h] * inv_sum[m][h],
                                                 state.o[m][d][2 * h + 1] * inv_sum[m][h]);
                        st_shared_b32(q_tile + smem_offset(row, d) + 4 * (lane & 3), packed);
                    }
                }
            }
            __syncwarp();
            #pragma unroll
            for (int i = 0; i < ROWS_PER_WARP * V_CHUNKS / 32; ++i) {
                const int c = 32 * i + lane;
                const int row = warp_row0 + c / V_CHUNKS;
                const int chunk = c % V_CHUNKS;
                if ((!Q_TAIL || q0 + row < Q_ROWS) && chunk < V_DATA_CHUNKS) {  // O's zero columns stay behind
                    const uint4 value = ld_shared_v4(q_tile + smem_offset(row, chunk));
                    *reinterpret_cast<uint4*>(o_block + @ROW_OFFSET@ + 8 * chunk) = value;
                }
            }
        }
        """
    ).replace("@ROW_OFFSET@", "output_row_offset(q0, row)" if pack_group else "size_t(row) * O_ROW_STRIDE")
    text = text.replace("@LSE_PARAM@", " float* lse_block," if lse else "")
    text = text.replace("@LSE_OFFSET@\n", "\n" + _LSE_ROW_OFFSET + "\n" if lse else "")
    return re.sub(r"^( *)@LSE_STORE@\n", (lambda m: indent(_LSE_STORE, len(m[1]) // 4) + "\n") if lse else "", text,
                  flags=re.MULTILINE)


_LSE_ROW_OFFSET = block(
    """
    // Where row `row` of the block's query tile lies in the log-sum-exp output, from the block's lse_block (as in o).
    __device__ __forceinline__ size_t lse_row_offset(int q0, int row) {
        if constexpr (PACK) {
            const int packed = q0 + row;
            return size_t(packed % GROUP) * LSE_HEAD_STRIDE + size_t(packed / GROUP) * LSE_ROW_STRIDE;
        }
        return size_t(row) * LSE_ROW_STRIDE;
    }
    """
)


_LSE_STORE = block(
    """
    if ((lane & 3) == 0) {  // the rows' log-sum-exps, one lane of a quad writing each
        #pragma unroll
        for (int m = 0; m < M_TILES; ++m) {
            #pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int row = warp_row0 + 16 * m + (lane >> 2) + 8 * h;
                if (!Q_TAIL || q0 + row < Q_ROWS)
                    lse_block[lse_row_offset(q0, row)] = row_log_sum_exp(state.row_max[m][h], inv_sum[m][h]);
            }
        }
    }
    """
)


def _kernel(plan: KernelPlan, tiling: FlashTiling) -> str:
    q_init = "q_frags.init(smem + Q_SMEM, warp_row0, lane);"
    if plan.schedule.q_prescaled:  # the TMA ring's prologue waited for Q
        q_init = "scale_q_rows(smem + Q_SMEM, warp_row0, lane);\n" + q_init
    if tiling.q_in_registers:
        q_init = "pipeline_wait_q();  // Q fragments are read once, into registers\n" + q_init
    elif plan.schedule.pingpong or plan.schedule.overlap:
        q_init += "  // Q tile landed at step 0's barrier, before any read"
    name = kernel_name(plan)
    if plan.schedule.tma_kv:
        params = ("const elem_t* __restrict__ q, elem_t* __restrict__ o,",
                  "const __grid_constant__ TensorMap k_map, const __grid_constant__ TensorMap v_map")
    else:
        params = ("const elem_t* __restrict__ q, const elem_t* __restrict__ k,",
                  "const elem_t* __restrict__ v, elem_t* __restrict__ o")
    if plan.problem.bias is not None:
        params = (params[0], params[1] + ", const bias_t* __restrict__ bias")
    if plan.schedule.kv_splits > 1:
        params = (params[0], params[1] + ", float* __restrict__ workspace")
    if plan.problem.lse is not None:  # last: after the bias, the factors and the workspace
        params = (params[0], params[1] + ", float* __restrict__ lse")
    head = (
        f'extern "C" __global__ void __launch_bounds__(THREADS, MIN_BLOCKS)\n'
        f"{name}({params[0]}\n{' ' * (len(name) + 1)}{params[1]}) {{\n"
    )
    prologue = block(
        """
        extern __shared__ __align__(128) unsigned char smem_raw[];
        @SMEM_BASE@
        const int lane = int(threadIdx.x) & 31;
        const int warp_row0 = WARP_KEYS ? 0 : (int(threadIdx.x) >> 5) * ROWS_PER_WARP;

        @BLOCK_INDEX@
        cp_async_commit();
        pipeline_prologue(smem, k_head, v_head, n_tiles);
        QFragments q_frags;
        @Q_INIT@
        RowState state;
        state.init();@BIAS_ROWS@
        """
    ).replace("@Q_INIT@", q_init)
    if plan.problem.bias is not None:
        row_space_head = "head0" if plan.schedule.short_query else "head"
        prologue = prologue.replace("@BIAS_ROWS@", (
            f"\nstate.bias_rows = bias + BIAS_OFFSET + batch * BIAS_BATCH_STRIDE + {row_space_head} * BIAS_HEAD_STRIDE;"))
    prologue = prologue.replace("@BIAS_ROWS@", "")
    prologue = prologue.replace("@BLOCK_INDEX@", _short_query_index() if plan.schedule.short_query else _LONG_QUERY_INDEX)
    for placeholder, text in zip(("@SMEM_BASE@", "@KV_SOURCES@"), _smem_base_and_kv_sources(plan.schedule.tma_kv)):
        prologue = prologue.replace(placeholder, text)
    if plan.schedule.pingpong:
        main_loop = _pingpong_loop()
    elif plan.schedule.overlap:
        main_loop = _overlap_loop()
    else:
        main_loop = _plain_loop()
    lse = plan.problem.lse is not None
    lse_arg = " lse_block," if lse else ""
    epilogue = block(
        f"""
        cp_async_wait<0>();  // only empty groups remain

        store_output(state, smem + Q_SMEM, o_block,{lse_arg} q0, warp_row0, lane);
        """
    )
    if plan.schedule.warp_keys:
        epilogue = _warp_keys_epilogue(plan.schedule.kv_splits > 1, lse)
    elif plan.schedule.kv_splits > 1:
        epilogue = _SPLIT_TILE_POINTERS + "\n" + block(
            f"""
            store_partial(state, split_o, split_lse, warp_row0, lane);
            if (last_split_arrived(counter)) {{
                combine_splits(tile_o, tile_lse, o_block,{lse_arg} q0);
            }}
            """
        )
    if lse:
        epilogue = (_SHORT_QUERY_LSE_BLOCK if plan.schedule.short_query else _LSE_BLOCK) + "\n" + epilogue
    return head + indent(prologue + "\n\n" + main_loop + "\n" + epilogue) + "\n}"


_LSE_BLOCK = block(
    """
    // The block's first row of the log-sum-exp output (the row space is one head).
    float* const lse_block = lse + LSE_OFFSET + batch * LSE_BATCH_STRIDE + head * LSE_HEAD_STRIDE
                             + size_t(q0) * LSE_ROW_STRIDE;
    """
)
_SHORT_QUERY_LSE_BLOCK = block(
    """
    // The block's log-sum-exp rows: from its row space's first query head (packed rows at their own offsets).
    float* const lse_block = lse + LSE_OFFSET + batch * LSE_BATCH_STRIDE + head0 * LSE_HEAD_STRIDE
                             + (PACK ? size_t(0) : size_t(q0) * LSE_ROW_STRIDE);
    """
)


_LONG_QUERY_INDEX = block(
    """
    // This block's query tile (long_query_tile), head and batch, in the same grid order. Query
    // head h reads K/V head h / GROUP.
    int head, batch;
    if constexpr (HEAD_MAJOR) {
        const int linear = int(blockIdx.x) + Q_TILES * (int(blockIdx.y) + HEADS * int(blockIdx.z));
        head = linear % HEADS;
        batch = (linear / HEADS) % BATCH;
    } else {
        head = int(blockIdx.y);
        batch = int(blockIdx.z);
    }
    const int q_tile = long_query_tile();
    const int kv_head = head / GROUP;
    const int q0 = q_tile * BLOCK_Q;
    const elem_t* q_block = q + Q_OFFSET + batch * Q_BATCH_STRIDE + head * Q_HEAD_STRIDE + size_t(q0) * Q_ROW_STRIDE;
    elem_t* o_block = o + O_OFFSET + batch * O_BATCH_STRIDE + head * O_HEAD_STRIDE + size_t(q0) * O_ROW_STRIDE;
    @KV_SOURCES@

    // Key tiles to visit (causal: up to the diagonal; tiles above it are never loaded; a window:
    // from its first, kv_tile's order) and how many of them need no mask (wholly below the diagonal,
    // inside SEQ_KV and, with a window, inside every row's; none with a bias tensor).
    const WindowTiles window = window_tiles();
    const int n_tiles = WINDOW ? window.end - window.first
                        : CAUSAL ? imin(KV_TILES, (imin(q0 + BLOCK_Q, SEQ_Q) + BLOCK_KV - 1) / BLOCK_KV) : KV_TILES;
    const int below_diagonal = UPPER_EDGE ? imin(SEQ_KV / BLOCK_KV, (q0 + 1 + AHEAD) / BLOCK_KV) : SEQ_KV / BLOCK_KV;
    const int n_unmasked = BIAS ? 0 : WINDOW ? imax(0, below_diagonal - window.lower_end) : below_diagonal;

    // Prologue: Q tile (first group), then the pipeline's prefetch.
    load_tile<BLOCK_Q, Q_TAIL, Q_ROW_STRIDE>(smem + Q_SMEM, q_block, SEQ_Q - q0);
    """
)


def _short_query_index() -> str:
    return block(
        """
        // This block's query tile, row space and key split (a short-query kernel: no causal grid order).
        // The grid is (Q_TILES * KV_SPLITS, ROW_HEADS, BATCH): block x folds key split
        // x % KV_SPLITS of query tile x / KV_SPLITS. A row space is one query head, or (PACK) the
        // group of K/V head y: its row r is query r / GROUP of query head y * GROUP + r % GROUP.
        const int q_tile = int(blockIdx.x) / KV_SPLITS;
        const int split = int(blockIdx.x) % KV_SPLITS;
        const int batch = int(blockIdx.z);
        const int kv_head = PACK ? int(blockIdx.y) : int(blockIdx.y) / GROUP;
        const int head0 = PACK ? kv_head * GROUP : int(blockIdx.y);  // the row space's first query head
        const int q0 = q_tile * BLOCK_Q;
        const elem_t* q_space = q + Q_OFFSET + batch * Q_BATCH_STRIDE + head0 * Q_HEAD_STRIDE;
        elem_t* o_block = o + O_OFFSET + batch * O_BATCH_STRIDE + head0 * O_HEAD_STRIDE
                          + (PACK ? size_t(0) : size_t(q0) * O_ROW_STRIDE);
        @KV_SOURCES@

        // Key tiles of this split (kv_tile offsets them) and how many need no mask (none with a bias
        // tensor or a window that hides keys behind a query): inside SEQ_KV and, under the band's upper
        // edge, at or below the block's first query's last key (the last query sees the last key: no
        // tile is skipped).
        const int n_tiles = imin(TILES_PER_SPLIT, KV_TILES - split * TILES_PER_SPLIT);
        const int first_query = PACK ? q0 / GROUP : q0;
        const int seen_by_all = UPPER_EDGE ? imin(SEQ_KV, first_query + AHEAD + 1) : SEQ_KV;
        const int whole_tiles = seen_by_all / BLOCK_KV - split * TILES_PER_SPLIT;
        const int n_unmasked = BIAS || CUTS_BEHIND || whole_tiles < 0 ? 0 : imin(n_tiles, whole_tiles);

        // Prologue: Q tile (first group), then the pipeline's prefetch.
        load_query_rows(smem + Q_SMEM, q_space, q0);
        """
    )


def _load_query_rows() -> str:
    return block(
        """
        // Copy the block's BLOCK_Q query rows, from row q0 of its row space, into the Q tile (no
        // commit). Packed rows gather query p / GROUP of the group's head p % GROUP (p = q0 + row),
        // one 16-byte chunk a thread at a time; rows past Q_ROWS are zero-filled.
        __device__ __forceinline__ void load_query_rows(u32 q_tile, const elem_t* q_space, int q0) {
            if constexpr (PACK) {
                constexpr int TILE_CHUNKS = BLOCK_Q * CHUNKS_PER_ROW;
                #pragma unroll
                for (int i = 0; i < (TILE_CHUNKS + THREADS - 1) / THREADS; ++i) {
                    const int c = int(threadIdx.x) + i * THREADS;
                    const int row = c / CHUNKS_PER_ROW;
                    const int chunk = c % CHUNKS_PER_ROW;
                    const int packed = q0 + row;
                    const bool in_range = packed < Q_ROWS && chunk < QK_DATA_CHUNKS;  // zeros past HEAD_DIM
                    const elem_t* src = q_space + size_t(packed % GROUP) * Q_HEAD_STRIDE
                                        + size_t(packed / GROUP) * Q_ROW_STRIDE + 8 * chunk;
                    if (TILE_CHUNKS % THREADS == 0 || c < TILE_CHUNKS) {
                        cp_async_16(q_tile + smem_offset(row, chunk), in_range ? src : q_space, in_range);
                    }
                }
            } else {
                load_tile<BLOCK_Q, Q_TAIL, Q_ROW_STRIDE>(q_tile, q_space + size_t(q0) * Q_ROW_STRIDE, SEQ_Q - q0);
            }
        }
        """
    )


def _partial_states() -> str:
    return block(
        """
        // Partial states (key splits, warps that split the keys): a state's rows' O normalised by
        // their own sums, BLOCK_Q rows of V_COLUMNS fp32, and their log2-sum-exps (row max *
        // SCALE_LOG2 + log2 of the row sum; -inf for a row that saw no key).

        // This thread's rows of the state, into `o_rows` and `lse_rows` (row r at r * V_COLUMNS, r).
        __device__ __forceinline__ void store_partial(const RowState& state, float* o_rows, float* lse_rows,
                                                      int warp_row0, int lane) {
            float inv_sum[M_TILES][2];
            row_inverse_sums(state.row_sum, inv_sum);
            #pragma unroll
            for (int m = 0; m < M_TILES; ++m) {
                #pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const int row = warp_row0 + 16 * m + (lane >> 2) + 8 * h;
                    float* o_row = o_rows + size_t(row) * V_COLUMNS + 2 * (lane & 3);
                    #pragma unroll
                    for (int d = 0; d < D_NTILES; ++d) {
                        *reinterpret_cast<float2*>(o_row + 8 * d) =
                            make_float2(state.o[m][d][2 * h] * inv_sum[m][h], state.o[m][d][2 * h + 1] * inv_sum[m][h]);
                    }
                    if ((lane & 3) == 0) {
                        lse_rows[row] = inv_sum[m][h] > 0.0f ? state.row_max[m][h] * SCALE_LOG2 - __log2f(inv_sum[m][h])
                                                             : neg_inf();
                    }
                }
            }
        }

        // Columns [8 chunk, 8 chunk + 8) of row `row` merged over COUNT states (state i's rows at
        // o + i * BLOCK_Q * V_COLUMNS and lse + i * BLOCK_Q): out = sum_i 2^(lse_i - top) o_i /
        // sum_i 2^(lse_i - top). Returns the merged log2-sum-exp. GLOBAL: the states are in global
        // memory, written by other blocks, so they are read past L1.
        template <int COUNT, bool GLOBAL>
        __device__ __forceinline__ float merge_partials(const float* o, const float* lse, int row, int chunk,
                                                        float (&out)[8]) {
            float top = neg_inf();
            #pragma unroll 4
            for (int i = 0; i < COUNT; ++i) {
                top = fmaxf(top, GLOBAL ? __ldcg(lse + i * BLOCK_Q + row) : lse[i * BLOCK_Q + row]);
            }
            float total = 0.0f;
            #pragma unroll
            for (int e = 0; e < 8; ++e) {
                out[e] = 0.0f;
            }
            #pragma unroll 4
            for (int i = 0; i < COUNT; ++i) {
                const float state_lse = GLOBAL ? __ldcg(lse + i * BLOCK_Q + row) : lse[i * BLOCK_Q + row];
                const float weight = state_lse == neg_inf() ? 0.0f : exp2f(state_lse - top);
                const float4* part = reinterpret_cast<const float4*>(o + (size_t(i) * BLOCK_Q + row) * V_COLUMNS + 8 * chunk);
                const float4 lo = GLOBAL ? __ldcg(part) : part[0];
                const float4 hi = GLOBAL ? __ldcg(part + 1) : part[1];
                total += weight;
                out[0] += weight * lo.x; out[1] += weight * lo.y; out[2] += weight * lo.z; out[3] += weight * lo.w;
                out[4] += weight * hi.x; out[5] += weight * hi.y; out[6] += weight * hi.z; out[7] += weight * hi.w;
            }
            const float inv = total > 0.0f ? 1.0f / total : 0.0f;
            #pragma unroll
            for (int e = 0; e < 8; ++e) {
                out[e] *= inv;
            }
            return total > 0.0f ? top + __log2f(total) : neg_inf();
        }

        // 8 merged columns of a row, as elem_t, to o (16 bytes).
        __device__ __forceinline__ void store_columns(elem_t* o_block, int q0, int row, int chunk, const float (&out)[8]) {
            const uint4 value = make_uint4(pack2(out[0], out[1]), pack2(out[2], out[3]), pack2(out[4], out[5]),
                                           pack2(out[6], out[7]));
            *reinterpret_cast<uint4*>(o_block + output_row_offset(q0, row) + 8 * chunk) = value;
        }
        """
    )


def _split_partials(lse: bool) -> str:
    """The key splits' workspace, arrival counter and ``combine_splits`` (``lse``: it writes the merged rows'
    log-sum-exp too)."""
    text = block(
        """
        // Key splits. Workspace (fp32): the partial states of every split of every query tile,
        // O [SPLIT_TILES][KV_SPLITS][BLOCK_Q][V_COLUMNS] and log2-sum-exps
        // [SPLIT_TILES][KV_SPLITS][BLOCK_Q], then one arrival counter (int) per query tile, zero
        // between launches.
        constexpr int SPLIT_TILES = BATCH * ROW_HEADS * Q_TILES;
        constexpr size_t PARTIAL_O_FLOATS = size_t(SPLIT_TILES) * KV_SPLITS * BLOCK_Q * V_COLUMNS;
        constexpr size_t PARTIAL_LSE_FLOATS = size_t(SPLIT_TILES) * KV_SPLITS * BLOCK_Q;

        // Whether this block is the last of its query tile's KV_SPLITS blocks to store its partial
        // state (each block's stores are fenced before its arrival); the last one resets the
        // counter for the next launch.
        __device__ __forceinline__ bool last_split_arrived(int* counter) {
            __shared__ int last;
            __threadfence();
            __syncthreads();
            if (threadIdx.x == 0) {
                last = atomicAdd(counter, 1) == KV_SPLITS - 1;
                if (last) {
                    *counter = 0;
                }
            }
            __syncthreads();
            return last;
        }

        // The tile's splits merged into o, a thread per 8 columns of a row.
        __device__ __forceinline__ void combine_splits(const float* tile_o, const float* tile_lse, elem_t* o_block,@LSE_PARAM@
                                                       int q0) {
            __threadfence();
            for (int c = int(threadIdx.x); c < BLOCK_Q * V_DATA_CHUNKS; c += THREADS) {
                const int row = c / V_DATA_CHUNKS;
                const int chunk = c % V_DATA_CHUNKS;
                if (!Q_TAIL || q0 + row < Q_ROWS) {
                    float out[8];
                    @MERGE@
                    store_columns(o_block, q0, row, chunk, out);@LSE_STORE@
                }
            }
        }
        """
    )
    return _with_merged_lse(text, "KV_SPLITS, true", "tile_o, tile_lse", lse)


def _with_merged_lse(text: str, merge_arguments: str, states: str, lse: bool) -> str:
    """``text`` with its ``merge_partials`` call (``@MERGE@``, of ``merge_arguments`` over ``states``) and, for
    ``lse``, the merged rows' log-sum-exp (natural log) stored from a row's first chunk (``@LSE_STORE@``) into the
    ``lse_block`` parameter (``@LSE_PARAM@``)."""
    call = f"merge_partials<{merge_arguments}>({states}, row, chunk, out);"
    store = ("\nif (chunk == 0) {\n    lse_block[lse_row_offset(q0, row)] = merged * LN2;  // log2 to natural log\n}")
    indent_of = re.search(r"^( *)@MERGE@", text, flags=re.MULTILINE)[1]
    text = text.replace("@MERGE@", f"const float merged = {call}" if lse else call)
    text = text.replace("@LSE_STORE@", store.replace("\n", "\n" + indent_of) if lse else "")
    return text.replace("@LSE_PARAM@", " float* lse_block," if lse else "")


_SPLIT_TILE_POINTERS = block(
    """
    cp_async_wait<0>();  // only empty groups remain

    // Key splits: the block's partial state goes to its split's slice of the query tile's
    // workspace; the tile's last split to arrive combines them all.
    const int tile_id = (batch * ROW_HEADS + int(blockIdx.y)) * Q_TILES + q_tile;
    float* tile_o = workspace + size_t(tile_id) * KV_SPLITS * BLOCK_Q * V_COLUMNS;
    float* tile_lse = workspace + PARTIAL_O_FLOATS + size_t(tile_id) * KV_SPLITS * BLOCK_Q;
    float* split_o = tile_o + size_t(split) * BLOCK_Q * V_COLUMNS;
    float* split_lse = tile_lse + split * BLOCK_Q;
    int* counter = reinterpret_cast<int*>(workspace + PARTIAL_O_FLOATS + PARTIAL_LSE_FLOATS) + tile_id;
    """
)


def _warp_keys_epilogue(split: bool, lse: bool) -> str:
    """The end of a block whose warps split the keys: each warp's state to shared memory (the
    ring's stages, free once every warp is past its last tile), then a thread per 8 columns of
    a row merges them — into o (``lse``: and the rows' log-sum-exp into ``lse_block``), or into the split's
    partial state."""
    head = _SPLIT_TILE_POINTERS if split else "cp_async_wait<0>();  // only empty groups remain\n"
    if split:
        result = block(
            """
            const float lse = merge_partials<WARPS, false>(merge, merge + MERGE_O_FLOATS, row, chunk, out);
            *reinterpret_cast<float4*>(split_o + row * V_COLUMNS + 8 * chunk) = make_float4(out[0], out[1], out[2], out[3]);
            *reinterpret_cast<float4*>(split_o + row * V_COLUMNS + 8 * chunk + 4) = make_float4(out[4], out[5], out[6], out[7]);
            if (chunk == 0) {
                split_lse[row] = lse;
            }
            """
        )
    else:
        result = _with_merged_lse(block(
            """
            @MERGE@
            store_columns(o_block, q0, row, chunk, out);@LSE_STORE@
            """
        ), "WARPS, false", "merge, merge + MERGE_O_FLOATS", lse)
    merged = block(
        """
        // The warps' states meet in shared memory; each thread merges 8 columns of a row.
        __syncthreads();
        float* merge = reinterpret_cast<float*>(smem_raw + (smem + K_SMEM - u32(__cvta_generic_to_shared(smem_raw))));
        const int warp = int(threadIdx.x) >> 5;
        store_partial(state, merge + warp * BLOCK_Q * V_COLUMNS, merge + MERGE_O_FLOATS + warp * BLOCK_Q, 0, lane);
        __syncthreads();
        for (int c = int(threadIdx.x); c < BLOCK_Q * V_DATA_CHUNKS; c += THREADS) {
            const int row = c / V_DATA_CHUNKS;
            const int chunk = c % V_DATA_CHUNKS;
            if (!Q_TAIL || q0 + row < Q_ROWS) {
                float out[8];
                @RESULT@
            }
        }
        """
    ).replace("@RESULT@", ("\n" + " " * 8).join(result.splitlines()))
    tail = block(
        f"""
        if (last_split_arrived(counter)) {{
            combine_splits(tile_o, tile_lse, o_block,{' lse_block,' if lse else ''} q0);
        }}
        """
    ) if split else ""
    return head + "\n" + merged + ("\n" + tail if tail else "")


_WARP_MERGE = block(
    """
    // Warps that split the keys (WARP_KEYS) folded the same BLOCK_Q rows over their own keys of
    // every tile. Their partial states in shared memory (the ring's stages, from K_SMEM): O
    // [WARPS][BLOCK_Q][V_COLUMNS] fp32, then the log2-sum-exps [WARPS][BLOCK_Q].
    constexpr int MERGE_O_FLOATS = WARPS * BLOCK_Q * V_COLUMNS;
    """
)


def _smem_base_and_kv_sources(tma_kv: bool) -> tuple[str, str]:
    """The kernel's shared-memory base and where the ring reads K and V: the dynamic shared
    memory and the heads' first rows; for a TMA ring the first 1024-byte aligned address in
    it and the tensor maps (with the K/V head and batch coordinates)."""
    if tma_kv:
        return (
            "// TMA boxes land on SMEM_ALIGN-byte swizzle atoms: the layout starts at the first such\n"
            "// address (the launch adds SMEM_ALIGN bytes of slack).\n"
            "const u32 smem = (u32(__cvta_generic_to_shared(smem_raw)) + SMEM_ALIGN - 1) & ~(SMEM_ALIGN - 1);",
            "const KvSource k_head = {&k_map, kv_head, batch};\n"
            "const KvSource v_head = {&v_map, kv_head, batch};",
        )
    return (
        "const u32 smem = u32(__cvta_generic_to_shared(smem_raw));",
        "const elem_t* k_head = k + K_OFFSET + batch * K_BATCH_STRIDE + kv_head * K_HEAD_STRIDE;\n"
        "const elem_t* v_head = v + V_OFFSET + batch * V_BATCH_STRIDE + kv_head * V_HEAD_STRIDE;",
    )


def _plain_loop() -> str:
    return block(
        """
        // Main loop: unmasked tiles, then (causal diagonal, Skv tail) masked ones.
        int slot = 0;
        #pragma unroll 1
        for (int j = 0; j < n_unmasked; ++j) {
            attend_tile<false>(state, q_frags, smem, k_head, v_head, j, slot, n_tiles, q0 + warp_row0, lane);
            slot = slot + 1 == STAGES ? 0 : slot + 1;
        }
        if constexpr (NEEDS_MASK) {
            #pragma unroll 1
            for (int j = n_unmasked; j < n_tiles; ++j) {
                attend_tile<true>(state, q_frags, smem, k_head, v_head, j, slot, n_tiles, q0 + warp_row0, lane);
                slot = slot + 1 == STAGES ? 0 : slot + 1;
            }
        }
        """
    )


def _pingpong_loop() -> str:
    return block(
        """
        // Pingpong main loop: n_tiles + 1 steps of two half-steps, each opened by a block barrier
        // (the first also waits for the step's ring unit and starts the next). Group 0 (warps
        // 0-3) runs the matmul phase of step u in the first half and the softmax of tile u in the
        // second; group 1 (warps 4-7, each on the scheduler partition of warp w - 4) runs the
        // softmax of tile u - 1 in the first half and the matmul phase of step u in the second:
        // the tensor cores of a partition always have one group's matmuls while the other group
        // does its softmax. Step 0 has no P V, step n_tiles no Q K^T and no softmax: peeled, so
        // that S and P are never live across the loop at the same time. (No `#pragma unroll 1` on
        // these loops: nvcc 13 answers it by duplicating the group-1 loop body four times.)
        const int row0 = q0 + warp_row0;
        const int last = n_tiles % STAGES;  // the stage of unit n_tiles
        float s[M_TILES][KV_NTILES][4];
        u32 p[M_TILES][KV_STEPS][4];
        if ((threadIdx.x >> 7) == 0) {
            pipeline_open_step(smem, k_head, v_head, 0, 0, n_tiles);
            scores_phase(s, q_frags, smem, 0, lane);
            __syncthreads();
            softmax_phase(state, s, p, 0, n_unmasked, row0, lane);
            int slot = 0;
            for (int u = 1; u < n_tiles; ++u) {
                slot = slot + 1 == STAGES ? 0 : slot + 1;
                pipeline_open_step(smem, k_head, v_head, u, slot, n_tiles);
                values_phase(state, p, smem, slot, lane);
                scores_phase(s, q_frags, smem, slot, lane);
                __syncthreads();
                softmax_phase(state, s, p, u, n_unmasked, row0, lane);
            }
            pipeline_open_step(smem, k_head, v_head, n_tiles, last, n_tiles);
            values_phase(state, p, smem, last, lane);
            __syncthreads();
        } else {
            pipeline_open_step(smem, k_head, v_head, 0, 0, n_tiles);
            __syncthreads();
            scores_phase(s, q_frags, smem, 0, lane);
            int slot = 0;
            for (int u = 1; u < n_tiles; ++u) {
                slot = slot + 1 == STAGES ? 0 : slot + 1;
                pipeline_open_step(smem, k_head, v_head, u, slot, n_tiles);
                softmax_phase(state, s, p, u - 1, n_unmasked, row0, lane);
                __syncthreads();
                values_phase(state, p, smem, slot, lane);
                scores_phase(s, q_frags, smem, slot, lane);
            }
            pipeline_open_step(smem, k_head, v_head, n_tiles, last, n_tiles);
            softmax_phase(state, s, p, n_tiles - 1, n_unmasked, row0, lane);
            __syncthreads();
            values_phase(state, p, smem, last, lane);
        }
        """
    )


def _overlap_steps() -> str:
    return block(
        """
        // One overlap step u (0 < u < n_tiles) in stage `slot`: S_u = Q K_u^T is issued first, into
        // `s_next`, then the softmax of S_(u-1) (in `s_prev`) runs while those mmas execute (they
        // are independent), then O += P V_(u-1). One block barrier a step (in open_step).
        __device__ __forceinline__ void overlap_step(float (&s_next)[M_TILES][KV_NTILES][4],
                                                     float (&s_prev)[M_TILES][KV_NTILES][4],
                                                     u32 (&p)[M_TILES][KV_STEPS][4], RowState& state,
                                                     const QFragments& q, u32 smem, const elem_t* k_head,
                                                     const elem_t* v_head, int u, int slot, int n_tiles,
                                                     int n_unmasked, int row0, int lane) {
            pipeline_open_step(smem, k_head, v_head, u, slot, n_tiles);
            scores_phase(s_next, q, smem, slot, lane);
            softmax_phase(state, s_prev, p, u - 1, n_unmasked, row0, lane);
            values_phase(state, p, smem, slot, lane);
        }

        // The last step (u = n_tiles): no key tile is left, only the softmax of S_(n-1) and its P V.
        __device__ __forceinline__ void overlap_last_step(float (&s_prev)[M_TILES][KV_NTILES][4],
                                                          u32 (&p)[M_TILES][KV_STEPS][4], RowState& state,
                                                          u32 smem, const elem_t* k_head, const elem_t* v_head,
                                                          int slot, int n_tiles, int n_unmasked, int row0, int lane) {
            pipeline_open_step(smem, k_head, v_head, n_tiles, slot, n_tiles);
            softmax_phase(state, s_prev, p, n_tiles - 1, n_unmasked, row0, lane);
            values_phase(state, p, smem, slot, lane);
        }
        """
    )


def _overlap_loop() -> str:
    return block(
        """
        // Overlap main loop: steps 0..n_tiles on the unit ring, unrolled by two so that the two S
        // tiles swap roles without copies (sa holds S of even steps, sb of odd ones). Step 0 only
        // issues S_0; the last step has no Q K^T.
        const int row0 = q0 + warp_row0;
        float sa[M_TILES][KV_NTILES][4];
        float sb[M_TILES][KV_NTILES][4];
        u32 p[M_TILES][KV_STEPS][4];
        pipeline_open_step(smem, k_head, v_head, 0, 0, n_tiles);
        scores_phase(sa, q_frags, smem, 0, lane);
        int u = 1;
        int slot = 0;
        for (; u + 1 < n_tiles; u += 2) {
            slot = slot + 1 == STAGES ? 0 : slot + 1;
            overlap_step(sb, sa, p, state, q_frags, smem, k_head, v_head, u, slot, n_tiles, n_unmasked, row0, lane);
            slot = slot + 1 == STAGES ? 0 : slot + 1;
            overlap_step(sa, sb, p, state, q_frags, smem, k_head, v_head, u + 1, slot, n_tiles, n_unmasked, row0, lane);
        }
        slot = slot + 1 == STAGES ? 0 : slot + 1;
        if (u < n_tiles) {  // one more full step (odd): its S goes to sb
            overlap_step(sb, sa, p, state, q_frags, smem, k_head, v_head, u, slot, n_tiles, n_unmasked, row0, lane);
            slot = slot + 1 == STAGES ? 0 : slot + 1;
            overlap_last_step(sb, p, state, smem, k_head, v_head, slot, n_tiles, n_unmasked, row0, lane);
        } else {
            overlap_last_step(sa, p, state, smem, k_head, v_head, slot, n_tiles, n_unmasked, row0, lane);
        }
        """
    )
