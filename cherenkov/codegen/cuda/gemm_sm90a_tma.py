"""The warp-specialised Hopper (sm_90a) ``wgmma`` GEMM: TMA loads by a producer warpgroup.

Same contractions, tiles, descriptors and epilogue as the cp.async kernel of
:mod:`.gemm_sm90a` (whose docstring describes the 128-byte-swizzled K-major and MN-major
tile layouts); what differs is who loads the tiles and how the steps synchronise
(:class:`~cherenkov.codegen.term_plan.TmaGemmSchedule`):

* Warpgroup 0 is the producer: it lowers its registers to ``PRODUCER_REGS``
  (``setmaxnreg``) and one thread issues every copy — per k step, one
  ``cp.async.bulk.tensor.2d`` box per operand tile (K-major: ``64 × rows``, at most 256
  rows) or per 64-row box (MN-major: ``64 × 64``), all completing on the stage's *full*
  mbarrier, whose expected byte count it announces first. The TMA writes the boxes
  128-byte-swizzled (``CU_TENSOR_MAP_SWIZZLE_128B``), exactly the layout the wgmma
  descriptors describe, and zero-fills what lies past M, N or K: tails need nothing else.
* Warpgroups ``1 .. CONSUMERS`` raise their registers to ``CONSUMER_REGS``, wait on a
  stage's full barrier, issue its wgmmas as one commit group, wait until the previous
  step's group has retired (``wgmma_wait<1>``) and release that step's buffer to the
  producer: each consumer warp arrives once on its *empty* mbarrier.
* The ring of ``STAGES`` buffers runs on across tiles: with ``persistent`` blocks
  (``gridDim.x`` of them, one an SM) walk the tiles ``blockIdx.x, blockIdx.x + gridDim.x,
  ...``, and while the consumers run a tile's epilogue, the producer already fills the
  ring with the next tile's operands.
* ``pingpong``: the consumer warpgroups do not split a tile's rows but take the block's
  tiles in turn (warpgroup ``w`` its tiles ``w, w + 2, ...``), each skipping the other's k
  steps in the ring; only the warps of one warpgroup release a buffer. A warpgroup starts
  a tile's k steps once the other's warps are past those of the tile before (a *turn*
  mbarrier a warpgroup, one arrival a warp of the other): its k steps follow the other's,
  it runs its epilogue while the other multiplies, and no ring barrier it waits on is
  more than one phase behind (a parity wait cannot tell phase ``p`` from ``p + 2``).

With an absorbed RMSNorm (:class:`~cherenkov.codegen.term_plan.NormPrologue`: A is
``RmsNormRow_k(x)·w``, the TMA loads plain ``x``) the consumers take A from registers
instead: per k16 step each warp reads its 16 rows of x with one ``ldmatrix.x4`` from the
swizzled tile (chunk ``c`` of row ``r`` lives at chunk ``c ^ (r % 8)``), adds their squares
to its two rows' sums (rows ``g`` and ``g + 8``), multiplies them by the weight's pairs (the
weight sits whole in static shared memory) and
issues the wgmma with A in registers (``rs``). Two k steps' fragments alternate, each kept
live until the wait that retires its wgmmas. The epilogue sums the row sums over the lane
quad and multiplies each accumulator row by ``(Σ x²/K + ε)^{-1/2}``: the norm's row scale,
which does not depend on k, applied after the sum.

With ``store_boxes`` the epilogue does not store from registers: each consumer warpgroup
writes its rows of the output, box by box (``STORE_BOX`` rows × ``STORE_BOX`` columns,
128-byte-swizzled like the operand tiles, so the 8 rows of one store instruction hit 8
different bank groups), into one of its ``store_boxes`` staging buffers, and one thread
hands each box to the copy engine (``cp.async.bulk.tensor`` store, full 128-byte lines,
what lies past M or N clipped by the output's tensor map) while the warpgroup goes on. A
buffer is written again only once its previous store has read it (``wait_group.read``).
Where the output's rows are not 16-byte aligned (a TMA store's row stride must be;
``copy_out``), the warpgroup's threads copy each written box out themselves instead: a
warp a row of the box at a time, each lane one word of it, stored as one coalesced 4-byte
store where the row's element pairs are 4-byte aligned and, in a row that starts at an
odd element, the pairs realigned by one column (the odd column from the lane before) with
the row's first and last column stored alone.

Parities: a stage's barriers complete once per use; pass ``u`` of the ring over stage
``s`` waits for phase parity ``u & 1`` of full[s] (consumers) and ``(u & 1) ^ 1`` of
empty[s] (producer: a fresh barrier counts its phase of parity 1 as complete, so the
first pass does not wait).

Launch: grid ``(min(TILES, PERSISTENT_BLOCKS), 1, 1)`` when persistent, else ``(TILES, 1,
1)``, ``128 · (CONSUMERS + 1)`` threads, :func:`~cherenkov.codegen.term_plan.wgmma_smem_bytes`
of dynamic shared memory; parameters: the TMA tensor maps of A and B (and of the output
with TMA stores; by value, ``__grid_constant__``; :func:`tensor_maps` says how the
host encodes them), then the pointers of every tensor as in every term kernel.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from cherenkov.codegen.cuda import mma, tma, wgmma
from cherenkov.codegen.cuda.gemm import accumulator_epilogue, epilogue_loops, epilogue_pair_values, shape_constants
from cherenkov.codegen.cuda.ldmatrix import emit_ldmatrix_primitives
from cherenkov.codegen.cuda.norm_prologue import emit_norm_helpers, fragment_prologue, norm_constants, row_scales
from cherenkov.codegen.cuda.term_common import (
    decompose,
    header,
    indent_lines,
    kernel_name,
    tensor_infos,
    vector_helpers,
)
from cherenkov.codegen.cuda.term_expr import TermEmitter, emit_prelude, index_type
from cherenkov.codegen.cuda.text import block, section
from cherenkov.codegen.errors import CodegenError
from cherenkov.codegen.term_plan import (
    GROUP_M,
    MBARRIER_BYTES,
    PERSISTENT_BLOCKS,
    STORE_BOX,
    SWIZZLE_ALIGN,
    SWIZZLE_ROW_BYTES,
    WGMMA_M,
    GemmLayout,
    epilogue_sources,
    gemm_layout,
    shifted_cores,
    term_plan_problems,
    tma_matrix,
    wgmma_smem_bytes,
)

BOX_ROWS = 64  # rows of an MN-major box (128 bytes of them); a K-major box holds the whole tile
PRODUCER_REGS = 40
CONSUMER_REGS = 232


@dataclass(frozen=True)
class OperandMap:
    """The 2-D tensor map of one operand: the tensor (by name), its extents innermost first,
    the byte stride of its rows, and the box one copy moves (innermost first)."""

    tensor: str
    dims: tuple[int, int]
    row_stride: int
    box: tuple[int, int]


def tensor_maps(plan) -> tuple[OperandMap, ...]:
    """The tensor maps a TMA GEMM plan's launch passes: A and B — K-major operands in boxes
    of ``64 k × tile rows``, MN-major ones in boxes of ``64 rows × 64 k`` — then, with
    TMA stores (:func:`tma_stores`), the output's, in staging boxes of ``STORE_BOX × STORE_BOX``."""
    s = plan.schedule
    layout = gemm_layout(plan.kernel, tensor_infos(plan))
    maps = []
    for op, rows, kmajor, tile in ((layout.a, layout.m_axes, layout.a_kmajor, s.block_m),
                                   (layout.b, layout.n_axes, layout.b_kmajor, s.block_n)):  # fmt: skip
        dims = tma_matrix(op, rows, layout.k_axis, kmajor, plan.tensor_map)
        if dims is None:
            raise CodegenError(f"kernel {plan.kernel.output}: an operand is not a plain matrix read")
        box = (64, tile) if kmajor else (BOX_ROWS, 64)
        maps.append(OperandMap(plan.tensor_map[op[1]].name, dims, dims[0] * 2, box))
    if tma_stores(s):
        maps.append(OperandMap(plan.output.name, (layout.n, layout.m), layout.n * 2, (STORE_BOX, STORE_BOX)))
    for read in staged_sources(plan, layout):
        maps.append(OperandMap(plan.tensor_map[read[1]].name, (layout.n, layout.m), layout.n * 2,
                               (STORE_BOX, STORE_BOX)))  # fmt: skip
    return tuple(maps)


def tma_stores(schedule) -> bool:
    """Whether the copy engine stores the schedule's staging boxes (else its threads copy
    them out, or there are none)."""
    return bool(schedule.store_boxes) and not schedule.copy_out


def staged_sources(plan, layout: GemmLayout) -> tuple:
    """The epilogue sources a plan's consumers load into staging boxes (the first
    ``staged_sources`` of :func:`~cherenkov.codegen.term_plan.epilogue_sources`)."""
    return epilogue_sources(plan.kernel, layout, plan.tensor_map)[:plan.schedule.staged_sources]


def grid(plan) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
    layout = gemm_layout(plan.kernel, tensor_infos(plan))
    s = plan.schedule
    tiles = math.ceil(layout.m / s.block_m) * math.ceil(layout.n / s.block_n)
    return (min(tiles, PERSISTENT_BLOCKS) if s.persistent else tiles, 1, 1), (s.threads, 1, 1)


def _loads(kmajor: bool, role: str, tile_rows: str, origin: str) -> list[str]:
    """The producer's copies of one operand tile of k step ``kt`` into buffer ``stage``."""
    if kmajor:
        return [
            f"tma_load_2d(smem + {role}_SMEM + stage * {role}_TILE_BYTES, &{role.lower()}_map, full, kt * BK, {origin});"
        ]
    return [
        "#pragma unroll",
        f"for (int box = 0; box < {tile_rows} / {BOX_ROWS}; ++box)",
        f"    tma_load_2d(smem + {role}_SMEM + stage * {role}_TILE_BYTES + box * BOX_BYTES, &{role.lower()}_map, full,",
        f"                {origin} + {BOX_ROWS} * box, kt * BK);",
    ]


def _ss_main_loop(mma_name: str) -> list[str]:
    """The consumer's k steps with both operands in shared memory."""
    return [
        "int previous = -1;  // the buffer of the step before, released once its wgmmas retire",
        "for (int kt = 0; kt < KT; ++kt) {",
        "    mbar_wait(smem + BARRIERS + 8 * stage, phase);  // full: step kt's tiles have landed",
        "    #pragma unroll",
        "    for (int mi = 0; mi < M_TILES; ++mi) fence_operands(acc[mi]);",
        "    wgmma_fence();",
        *indent_lines(wgmma.k_step_wgmmas(mma_name), 1),
        "    wgmma_commit();",
        "    wgmma_wait<1>();  // step kt - 1 has retired; step kt may still run",
        "    if (previous >= 0 && lane == 0) mbar_arrive(smem + BARRIERS + 8 * (STAGES + previous));",
        "    previous = stage;",
        "    advance_ring(stage, phase);",
        "}",
    ]


def _turn_loop() -> list[str]:
    """The head of a ping-pong consumer's tile loop: warpgroup ``w`` takes the block's tiles
    ``w, w + 2, ...``; its tile ``turn`` starts at ring step ``turn · KT`` (the producer
    loads the block's tiles in order, KT steps each)."""
    return [
        "for (int tile = blockIdx.x + warpgroup * gridDim.x, turn = warpgroup; tile < TILES;",
        "     tile += CONSUMERS * gridDim.x, turn += CONSUMERS) {",
        "    stage = turn * KT % STAGES;  // skip the other warpgroup's k steps in the ring",
        "    phase = turn * KT / STAGES & 1;",
    ]


def _norm_fragments(weighted: bool) -> list[str]:
    """``load_fragments(f, buffer, step)``: this warp's rows of x in ring buffer ``buffer``
    as the wgmma A fragments of k step ``step`` (scaled by the weight), their squares added
    to ``row_ss`` — a lambda of the consumer."""
    weights = ("w[0]", "w[4]") if weighted else None  # k 2t, 2t + 1 and 2t + 8, 2t + 9
    return [
        "// A fragments of k step `step` from ring buffer `buffer`: ldmatrix.x4 of rows (lane & 15), 16-byte",
        "// chunk 2 ks + (lane >> 4), stored at chunk ^ (row % 8); then their squares and the weight",
        "auto load_fragments = [&](u32 (&f)[M_TILES][BK / 16][4], int buffer, int step) {",
        "    const u32 a_tile = smem + A_SMEM + buffer * A_TILE_BYTES;",
        "    #pragma unroll",
        "    for (int mi = 0; mi < M_TILES; ++mi) {",
        "        const int row = wg_row + 64 * mi + 16 * warp + (lane & 15);",
        "        #pragma unroll",
        "        for (int ks = 0; ks < BK / 16; ++ks) {",
        "            ldmatrix_x4(f[mi][ks], a_tile + row * ROW_BYTES + (((2 * ks + (lane >> 4)) ^ (row & 7)) << 4));",
        *(["            const u32* w = norm_weight + (step * BK + 16 * ks) / 2 + (lane & 3);"] if weighted else []),
        *indent_lines(fragment_prologue("f[mi][ks]", "row_ss[mi]", weights), 3),
        "        }",
        "    }",
        "};",
    ]


def _norm_step(parity: int, mma_name: str) -> list[str]:
    """One k step of the register-A main loop: fragments ``frag[parity]``, buffer ``stage``."""
    other = 1 - parity
    return [
        f"// k step kt + {parity}: A from frag[{parity}], B from buffer `stage`",
        "#pragma unroll",
        "for (int mi = 0; mi < M_TILES; ++mi) fence_operands(acc[mi]);",
        "wgmma_fence();",
        "#pragma unroll",
        "for (int ks = 0; ks < BK / 16; ++ks)",
        "    #pragma unroll",
        "    for (int mi = 0; mi < M_TILES; ++mi) {",
        f"        const u32* a = frag[{parity}][mi][ks];",
        "        const u32 b_bytes = stage * B_TILE_BYTES + ks * B_K_STEP;",
        f"        {mma_name}(acc[mi], a[0], a[1], a[2], a[3], b_desc + (b_bytes >> 4), 1);",
        "    }",
        "wgmma_commit();",
        "wgmma_wait<1>();  // the step before has retired: its buffer and fragments are free",
        "#pragma unroll",
        "for (int mi = 0; mi < M_TILES; ++mi)",
        "    #pragma unroll",
        f"    for (int ks = 0; ks < BK / 16; ++ks) fence_operands(frag[{other}][mi][ks]);",
        "if (previous >= 0 && lane == 0) mbar_arrive(smem + BARRIERS + 8 * (STAGES + previous));",
        "previous = stage;",
        "advance_ring(stage, phase);",
        f"if (kt + {parity + 1} < KT) {{  // the next step's fragments, while this step's wgmmas run",
        "    mbar_wait(smem + BARRIERS + 8 * stage, phase);",
        f"    load_fragments(frag[{other}], stage, kt + {parity + 1});",
        "}",
    ]


def _norm_main_loop(mma_name: str) -> list[str]:
    """The consumer's k steps with A from registers (an absorbed RMSNorm), unrolled by two so
    that the fragments of consecutive steps live in different registers."""
    return [
        "int previous = -1;  // the buffer of the step before, released once its wgmmas retire",
        "mbar_wait(smem + BARRIERS + 8 * stage, phase);",
        "load_fragments(frag[0], stage, 0);",
        "#pragma unroll 1",
        "for (int kt = 0; kt < KT; kt += 2) {",
        *indent_lines(_norm_step(0, mma_name), 1),
        "    if (kt + 1 >= KT) break;",
        *indent_lines(_norm_step(1, mma_name), 1),
        "}",
    ]


def _box_loop(header: list[str], setup: list[str], element: list[str], store: list[str],
              after_box: Sequence[str] = ()) -> list[str]:  # fmt: skip
    """The loop of the consumer's epilogues through staging boxes: per box (m64 tile ``mi``,
    64 columns ``j``) the ``setup`` statements; per pair of columns ``n``, ``n + 1`` of row
    ``m`` in range (row ``r``, 16-byte chunk ``c`` of the box) the ``element`` statements;
    then the ``store`` of the box (:func:`_tma_box_store`, :func:`_copied_box_store`) and
    ``after_box`` (every thread)."""
    return [
        *header,
        "#pragma unroll",
        "for (int mi = 0; mi < M_TILES; ++mi) {",
        "    #pragma unroll",
        "    for (int j = 0; j < BN / STORE_BOX; ++j) {",
        *indent_lines(setup, 2),
        "        #pragma unroll",
        "        for (int c = 0; c < STORE_BOX / 8; ++c) {",
        "            #pragma unroll",
        "            for (int e = 0; e < 4; e += 2) {",
        "                const int r = 16 * warp + (lane >> 2) + 8 * (e >> 1);  // r % 8 == lane / 4",
        "                const int m = m0 + wg_row + 64 * mi + r;",
        "                const int n = n0 + STORE_BOX * j + 8 * c + 2 * (lane & 3);",
        "                if (m < M && n < N) {",
        *indent_lines(element, 5),
        "                }",
        "            }",
        "        }",
        *indent_lines(store, 2),
        *indent_lines(after_box, 2),
        "    }",
        "}",
    ]


def _tma_box_store(fence_note: str, after_store: Sequence[str] = ()) -> list[str]:
    """A written box to the output by one thread's TMA store, after a fence (``fence_note``
    says which accesses it orders) and the warpgroup's barrier; then ``after_store`` (that
    thread)."""
    return [
        f"fence_proxy_async();  // {fence_note}",
        "named_barrier_sync(1 + warpgroup, 128);",
        "if (store_thread) {",
        "    tma_store_2d(&y_map, box, n0 + STORE_BOX * j, m0 + wg_row + 64 * mi);",
        "    bulk_commit();",
        *indent_lines(after_store, 1),
        "}",
    ]


def _copied_box_store() -> list[str]:
    """A written box to the output by the warpgroup's threads (:func:`copy_out_lambda`),
    once all of it is written."""
    return [
        "named_barrier_sync(1 + warpgroup, 128);  // the box is written",
        "copy_out(box, m0 + wg_row + 64 * mi, n0 + STORE_BOX * j);",
    ]


def copy_out_lambda(output: str, index: str) -> list[str]:
    """``copy_out(box, row0, col0)``: a staged box to the output (the pointer ``output``,
    rows of ``N`` elements, offsets of type ``index``) at row ``row0``, column ``col0``,
    what lies past M or N left out — a lambda of the consumer. Warp ``w`` copies rows
    ``16 w .. 16 w + 15``: it first reads every row's word ``lane`` (columns ``2 lane``,
    ``2 lane + 1``; 16-byte chunk ``c`` of row ``r`` sits at chunk ``c ^ (r % 8)``: 32
    lanes, 32 banks), then stores each row — as its words where the row starts at an even
    element of the output, else (N odd, an odd row) column 0 alone, the realigned words
    of columns ``2 lane - 1``, ``2 lane`` (the odd column is lane ``lane - 1``'s) and
    column 63 alone."""
    return [
        "// the staged box at (row0, col0) to the output, a warp 16 rows, a lane a word of each: 4-byte stores must",
        "// be 4-byte aligned, so a row that starts at an odd element stores its columns 2l - 1, 2l as a word",
        "auto copy_out = [&](u32 box, int row0, int col0) {",
        "    constexpr int ROWS = STORE_BOX / 4;  // rows of a warp",
        "    u32 word[ROWS];",
        "    #pragma unroll",
        "    for (int i = 0; i < ROWS; ++i) {",
        "        const int r = ROWS * warp + i;",
        "        word[i] = ld_shared_u32(box + r * ROW_BYTES + (((lane >> 2) ^ (r & 7)) << 4) + 4 * (lane & 3));",
        "    }",
        "    #pragma unroll",
        "    for (int i = 0; i < ROWS; ++i) {",
        "        const u32 before = __shfl_up_sync(0xffffffffu, word[i], 1);  // columns 2l - 2, 2l - 1",
        "        const int m = row0 + ROWS * warp + i, n = col0 + 2 * lane;",
        "        if (m >= M) break;  // the warp's later rows are past M too",
        f"        const {index} start = {index}(m) * N + col0;  // the row's first column in the output",
        f"        auto* row = {output} + start;",
        "        if ((start & 1) == 0) {  // columns 2l, 2l + 1 are an aligned word",
        "            if (n + 1 < N) st_global_b32(row + 2 * lane, word[i]);",
        "            else if (n < N) st_global_b16(row + 2 * lane, word[i]);",
        "        } else {  // columns 2l - 1, 2l are an aligned word; columns 0 and 63 stand alone",
        "            if (lane == 0) {",
        "                if (n < N) st_global_b16(row, word[i]);",
        "            } else if (n < N) {",
        "                st_global_b32(row + 2 * lane - 1, __byte_perm(before, word[i], 0x5432));",
        "            } else if (n - 1 < N) {",
        "                st_global_b16(row + 2 * lane - 1, before >> 16);",
        "            }",
        "            if (lane == 31 && n + 1 < N) st_global_b16(row + 2 * lane + 1, word[i] >> 16);",
        "        }",
        "    }",
        "};",
    ]


def emit_global_stores() -> str:
    """``st_global_b32`` / ``st_global_b16``: a word, or its low half, to global memory."""
    return block(
        """
        // A 4-byte word (two 16-bit outputs, 4-byte aligned) or its low 16 bits to global memory.
        __device__ __forceinline__ void st_global_b32(void* at, u32 value) {
            asm volatile("st.global.b32 [%0], %1;\\n" :: "l"(at), "r"(value));
        }

        __device__ __forceinline__ void st_global_b16(void* at, u32 value) {
            asm volatile("st.global.b16 [%0], %1;\\n" :: "l"(at), "h"(static_cast<unsigned short>(value)));
        }
        """
    )


def _staged_epilogue(epilogue: list[str], values: list[str], copy_out: bool, buffers: int) -> list[str]:
    """The consumer's epilogue through its ``buffers`` staging boxes: per box, ``epilogue``
    binds the ``values`` of each in-range pair, which lands at row ``r``, 16-byte chunk
    ``c`` of the box; then one thread stores the box, or (``copy_out``) the warpgroup's
    threads copy it out. A buffer is written again once its last store has read it: the
    copy engine's, or every thread's copy (with two buffers or more, each thread's copy
    precedes its arrival at the barrier of the box written since)."""
    if copy_out:
        single = ["named_barrier_sync(1 + warpgroup, 128);  // the buffer's last copy has read it"]
        wait = single if buffers == 1 else []
    else:
        wait = ["if (store_thread) bulk_wait_read<STORE_BOXES - 1>();  // the buffer's last store has read it",
                "named_barrier_sync(1 + warpgroup, 128);"]  # fmt: skip
    return _box_loop(
        [
            "// epilogue through shared memory, a 64x64 box at a time (the producer loads the next tile meanwhile):",
            "// accumulator d[4c + e] of m64 tile mi is row 16 warp + lane / 4 (+8 for e >= 2), column",
            "// 8c + 2 (lane % 4) + (e & 1); in the box, 16-byte chunk c of row r sits at chunk c ^ (r % 8)",
        ],
        [
            "const int buffer = (mi * (BN / STORE_BOX) + j) % STORE_BOXES;",
            "const u32 box = smem + STORE_SMEM + (warpgroup * STORE_BOXES + buffer) * BOX_BYTES;",
            *wait,
        ],
        [
            *epilogue,
            "st_shared_u32(box + r * ROW_BYTES + ((c ^ (lane >> 2)) << 4) + 4 * (lane & 3),",
            f"              pack2({values[0]}, {values[1]}));",
        ],
        _copied_box_store() if copy_out else _tma_box_store("the generic-proxy writes before the copy engine's reads"),
    )


def _sourced_epilogue(epilogue: list[str], values: list[str], sources: int) -> list[str]:
    """The staged epilogue when the epilogue's sources come into staging boxes by TMA: per
    box, wait for its sources (loaded when the tile started, or when the store that last
    used the buffer had read it), read each thread's pairs from them (``src0``, ``src1``),
    write the result over the first source's box, store it, and start the loads of the
    box a round later into the same buffer."""
    return _box_loop(
        [
            "// epilogue through the sources' staging boxes, a 64x64 box at a time (the producer loads the next",
            "// tile meanwhile): accumulator d[4c + e] of m64 tile mi is row 16 warp + lane / 4 (+8 for e >= 2),",
            "// column 8c + 2 (lane % 4) + (e & 1); in a box, 16-byte chunk c of row r sits at chunk c ^ (r % 8);",
            "// each thread reads its source pairs and writes its result pair at the same place",
        ],
        [
            "const int b = mi * (BN / STORE_BOX) + j, buffer = b % STORE_BOXES;",
            "const u32 box = source_box(0, buffer);",
            "mbar_wait(source_barrier(buffer), source_phase);  // the box's sources have landed",
        ],
        [
            "const u32 at = r * ROW_BYTES + ((c ^ (lane >> 2)) << 4) + 4 * (lane & 3);",
            *(f"const u32 src{i} = ld_shared_u32(source_box({i}, buffer) + at);" for i in range(sources)),
            *epilogue,
            f"st_shared_u32(box + at, pack2({values[0]}, {values[1]}));",
        ],
        _tma_box_store("the generic-proxy accesses before the copy engine's", after_store=[
            "if (b + STORE_BOXES < BOXES) {  // the buffer's next box, once this store has read it",
            "    bulk_wait_read<0>();",
            "    load_sources(b + STORE_BOXES, m0, n0);",
            "}",
        ]),
        after_box=["if (buffer == STORE_BOXES - 1) source_phase ^= 1;  // a round of the buffers is done"],
    )


def _source_loads(maps: int) -> list[str]:
    """``load_sources(b, m0, n0)``: the TMA loads of box ``b`` of a tile (m64 tile ``b /
    BOXES_N``, columns ``64 (b % BOXES_N)``) of every staged source into buffer ``b %
    STORE_BOXES``, completing on the buffer's barrier — a lambda of the store thread."""
    loads = [f"    tma_load_2d(source_box({i}, buffer), &s{i}_map, bar, column, row);" for i in range(maps)]
    return [
        "// this warpgroup's staging box of source i in buffer `buffer`, and the buffer's barrier",
        "auto source_box = [&](int i, int buffer) -> u32 {",
        "    return smem + STORE_SMEM + ((warpgroup * SOURCES + i) * STORE_BOXES + buffer) * BOX_BYTES;",
        "};",
        "auto source_barrier = [&](int buffer) -> u32 {",
        "    return smem + SOURCE_BARRIERS + 8 * (warpgroup * STORE_BOXES + buffer);",
        "};",
        "// the staged sources of box b of the tile at (m0, n0), into buffer b % STORE_BOXES",
        "auto load_sources = [&](int b, int m0, int n0) {",
        "    const int buffer = b % STORE_BOXES;",
        "    const int row = m0 + wg_row + 64 * (b / BOXES_N), column = n0 + STORE_BOX * (b % BOXES_N);",
        "    const u32 bar = source_barrier(buffer);",
        "    mbar_arrive_expect_tx(bar, SOURCES * BOX_BYTES);",
        *loads,
        "};",
    ]


def _partners(shifts: dict, index: str, scale: str) -> dict:
    """The accumulators of columns ``n + offset`` and ``n + 1 + offset`` for each shifted
    contraction (``offset`` columns on: ``offset / 2`` accumulators, four to an n8
    fragment), given the accumulator ``index`` of column ``n``; wrapped around the tile
    where a guard discards the value (the validity rules keep the used ones inside)."""
    return {
        node: tuple(f"acc[mi][({index} + {half + offset // 2} + ACC) % ACC]{scale}" for half in (0, 1))
        for node, offset in sorted(shifts.items(), key=lambda item: repr(item[0]))
    }


def _signature(plan, name: str, threads: int) -> str:
    params = ["const __grid_constant__ TensorMap a_map", "const __grid_constant__ TensorMap b_map"]
    if tma_stores(plan.schedule):
        params.append("const __grid_constant__ TensorMap y_map")
    params += [f"const __grid_constant__ TensorMap s{i}_map" for i in range(plan.schedule.staged_sources)]
    params += [f"const {i.c_type}* __restrict__ {i.param}" for i in plan.inputs]
    params.append(f"{plan.output.c_type}* __restrict__ {plan.output.param}")
    joined = ",\n    ".join(params)
    return f'extern "C" __global__ void __launch_bounds__({threads}, 1) {name}(\n    {joined})'


def gemm_sm90a_tma_source(plan) -> str:
    """Deterministic CUDA C++ of one TMA GEMM plan (same plan → same bytes)."""
    s = plan.schedule
    kernel = plan.kernel
    problems = term_plan_problems(plan)
    if problems:
        raise CodegenError(f"kernel {kernel.output}: no TMA wgmma GEMM: {'; '.join(problems)}")
    infos = tensor_infos(plan)
    layout: GemmLayout = gemm_layout(kernel, infos)
    dtype = layout.dtype
    em = TermEmitter(infos, index_type(infos), fast_math=True)  # the output is 16-bit (wgmma_problems)
    name = kernel_name(plan)
    (blocks, _, _), _ = grid(plan)
    smem_bytes = wgmma_smem_bytes(s)
    tiles_m, tiles_n = math.ceil(layout.m / s.block_m), math.ceil(layout.n / s.block_n)
    norm = layout.norm
    sources = staged_sources(plan, layout)
    mma_name = wgmma.wgmma_name(s.block_n, dtype, norm is not None, not layout.b_kmajor, not layout.a_kmajor)

    def order(kmajor: bool) -> str:
        return "K-major [row][k]" if kmajor else "MN-major [k][row] boxes"

    ring_offsets = (
        "constexpr u32 A_SMEM = 0, B_SMEM = STAGES * A_TILE_BYTES, BARRIERS = STAGES * STAGE_BYTES;"
        if not s.store_boxes else
        f"constexpr int STORE_BOX = {STORE_BOX}, STORE_BOXES = {s.store_boxes};  // output staging boxes a warpgroup\n"
        "        constexpr u32 A_SMEM = 0, B_SMEM = STAGES * A_TILE_BYTES, STORE_SMEM = STAGES * STAGE_BYTES;\n"
        "        constexpr u32 BARRIERS = STORE_SMEM + CONSUMERS * STORE_BOXES * BOX_BYTES;"
    )  # fmt: skip
    if sources:
        ring_offsets = block(f"""
            constexpr int STORE_BOX = {STORE_BOX}, STORE_BOXES = {s.store_boxes};  // staging buffers a warpgroup and source
            constexpr int SOURCES = {len(sources)};  // staged epilogue sources; the result goes over source 0's box
            constexpr int BOXES_N = BN / STORE_BOX, BOXES = M_TILES * BOXES_N;  // boxes of a warpgroup's tile
            static_assert(BOXES % STORE_BOXES == 0, "a tile's boxes are whole rounds of the buffers");
            constexpr u32 A_SMEM = 0, B_SMEM = STAGES * A_TILE_BYTES, STORE_SMEM = STAGES * STAGE_BYTES;
            constexpr u32 BARRIERS = STORE_SMEM + CONSUMERS * SOURCES * STORE_BOXES * BOX_BYTES;
            constexpr u32 SOURCE_BARRIERS = BARRIERS + 2 * STAGES * {MBARRIER_BYTES};  // one a warpgroup and buffer""").strip().replace("\n", "\n        ")
    layout_note = ("| source boxes of warpgroup 1, 2 " if sources else
                   "| output boxes of warpgroup 1, 2 " if s.store_boxes else "")  # fmt: skip
    source_barrier_bytes = f" + CONSUMERS * STORE_BOXES * {MBARRIER_BYTES}" if sources else ""
    turn_barriers = (f"\n        constexpr u32 TURN_BARRIERS = BARRIERS + 2 * STAGES * {MBARRIER_BYTES}{source_barrier_bytes};"
                     "  // ping-pong: one a consumer warpgroup" if s.pingpong else "")
    turn_barrier_bytes = f" + 2 * {MBARRIER_BYTES}" if s.pingpong else ""
    a_constants = (
        f"// A {order(layout.a_kmajor)}: fragments from registers" if norm else
        f"constexpr u32 A_K_STEP = {'32' if layout.a_kmajor else '16 * ROW_BYTES'}, "
        f"A_LBO = {'16' if layout.a_kmajor else 'BOX_BYTES'};  // A {order(layout.a_kmajor)}"
    )
    constants = block(f"""
        {shape_constants(layout, s, "        ", batch=False)}
        constexpr int CONSUMERS = {s.consumer_warpgroups}, THREADS = {s.threads};  // + one producer warpgroup
        constexpr int RELEASING_WARPS = {4 if s.pingpong else "4 * CONSUMERS"};  // warps that multiply from one ring buffer
        constexpr int PRODUCER_REGS = {PRODUCER_REGS}, CONSUMER_REGS = {CONSUMER_REGS};  // setmaxnreg budgets
        constexpr int WG_M = {s.warpgroup_m};  // rows of a tile one consumer warpgroup multiplies
        constexpr int M_TILES = WG_M / {WGMMA_M};         // its m64 wgmma tiles
        constexpr int ACC = BN / 2;               // fp32 accumulators of one m64 tile, a thread
        constexpr int KT = (K + BK - 1) / BK;     // k steps
        constexpr int TILES_M = {tiles_m}, TILES_N = {tiles_n}, TILES = TILES_M * TILES_N, GROUP_M = {GROUP_M};
        static_assert(BK == 64 && M_TILES >= 1 && STAGES >= 3, "one swizzle row of k; a ring of buffers");
        static_assert(PRODUCER_REGS * 128 + CONSUMER_REGS * 128 * CONSUMERS <= 65536, "the register file");

        // Shared memory from a {SWIZZLE_ALIGN}-byte aligned base: [A stage 0..STAGES-1 | B stage 0..STAGES-1 {layout_note}|
        // full mbarrier 0..STAGES-1 | empty mbarrier 0..STAGES-1{" | source mbarriers" if sources else ""}{" | turn mbarriers" if s.pingpong else ""}].
        constexpr u32 ROW_BYTES = {SWIZZLE_ROW_BYTES};           // a swizzled row: 64 elements
        constexpr u32 BOX_BYTES = 64 * ROW_BYTES;     // 64 K-major rows, or one MN-major box of 64 k rows
        constexpr u32 A_TILE_BYTES = BM * BK * 2, B_TILE_BYTES = BN * BK * 2;
        constexpr u32 STAGE_BYTES = A_TILE_BYTES + B_TILE_BYTES;  // what the TMA delivers a k step
        {ring_offsets}{turn_barriers}
        static_assert(BARRIERS + 2 * STAGES * {MBARRIER_BYTES}{source_barrier_bytes}{turn_barrier_bytes} + {SWIZZLE_ALIGN} == {smem_bytes}, "the plan's shared memory");
        {a_constants}
        constexpr u32 B_K_STEP = {"32" if layout.b_kmajor else "16 * ROW_BYTES"}, B_LBO = {"16" if layout.b_kmajor else "BOX_BYTES"};  // B {order(layout.b_kmajor)}

        {norm_constants(norm.eps) if norm else ""}
        // Output tile `tile` (row-tile groups of GROUP_M, column tiles within a group): its origin.
        __device__ __forceinline__ void tile_origin(int tile, int& m0, int& n0) {{
            const int first_m = tile / (GROUP_M * TILES_N) * GROUP_M;
            const int group_rows = min(TILES_M - first_m, GROUP_M);
            m0 = (first_m + tile % (GROUP_M * TILES_N) % group_rows) * BM;
            n0 = tile % (GROUP_M * TILES_N) / group_rows * BN;
        }}

        // Next ring buffer; the parity flips each time the ring wraps.
        __device__ __forceinline__ void advance_ring(int& stage, u32& phase) {{
            if (++stage == STAGES) {{
                stage = 0;
                phase ^= 1;
            }}
        }}
        """)

    em.push()
    batch_lines, batch_env = decompose("0", layout.batch, 0, "bz")
    scale = " * row_scale[mi][e >> 1]" if norm else ""  # columns e, e + 1 share a row
    shifts = shifted_cores(kernel, layout)
    if s.store_boxes:  # columns n, n + 1 (n even) are one word of a staging box
        paired = False
        chunk = "STORE_BOX / 8 * j + c"  # the n8 tile of chunk c of box j
        known = {read: (f"unpack_lo(src{i})", f"unpack_hi(src{i})") for i, read in enumerate(sources)}
        known |= _partners(shifts, f"4 * ({chunk}) + e", scale)
        next_column = "min(n + 1, N - 1)" if layout.n % 2 else "(n + 1)"  # an odd N's last column has no pair
        lines, values, _ = epilogue_pair_values(em, plan, layout, batch_env, (
            f"acc[mi][4 * ({chunk}) + e]{scale}", f"acc[mi][4 * ({chunk}) + e + 1]{scale}"), known, next_column)
        epilogue = (_sourced_epilogue(lines, values, len(sources)) if sources
                    else _staged_epilogue(lines, values, s.copy_out, s.store_boxes))  # fmt: skip
    else:
        paired, stores = accumulator_epilogue(em, plan, layout, batch_env, f"acc[mi][4 * c + e]{scale}",
                                              f"acc[mi][4 * c + e + 1]{scale}", _partners(shifts, "4 * c + e", scale))
        epilogue = [
            "// epilogue (the producer loads the next tile meanwhile): accumulator d[4c + e] of m64",
            "// tile mi is row 16 warp + lane / 4 (+8 for e >= 2), column 8c + 2 (lane % 4) + (e & 1)",
            *epilogue_loops(
                ("mi", "M_TILES"), ("c", "BN / 8"),
                "m0 + wg_row + 64 * mi + 16 * warp + (lane >> 2) + 8 * (e >> 1)",
                "n0 + 8 * c + 2 * (lane & 3) + (e & 1)",
                stores, paired,
            ),
        ]  # fmt: skip
    top = em.pop()

    producer = [
        "// producer: one thread issues every copy; a stage is refilled once every consumer warp has",
        "// released it",
        "reg_dealloc<PRODUCER_REGS>();",
        "if (threadIdx.x == 0) {",
        "    tma_prefetch_map(&a_map);",
        "    tma_prefetch_map(&b_map);",
        "    int stage = 0;",
        "    u32 phase = 0;",
        "    for (int tile = blockIdx.x; tile < TILES; tile += gridDim.x) {",
        "        int m0, n0;",
        "        tile_origin(tile, m0, n0);",
        "        for (int kt = 0; kt < KT; ++kt) {",
        "            mbar_wait(smem + BARRIERS + 8 * (STAGES + stage), phase ^ 1);  // empty",
        "            const u32 full = smem + BARRIERS + 8 * stage;",
        "            mbar_arrive_expect_tx(full, STAGE_BYTES);",
        f"            // A tile, {order(layout.a_kmajor)}",
        *indent_lines(_loads(layout.a_kmajor, "A", "BM", "m0"), 3),
        f"            // B tile, {order(layout.b_kmajor)}",
        *indent_lines(_loads(layout.b_kmajor, "B", "BN", "n0"), 3),
        "            advance_ring(stage, phase);",
        "        }",
        "    }",
        "}",
    ]
    weight = plan.tensor_map[norm.weight[1]].param if norm is not None and norm.weight is not None else None
    consumer = [
        *(["// consumers: warpgroup w multiplies every other tile of the block, then runs its epilogue while the",
            "// other warpgroup multiplies the next"] if s.pingpong else
          ["// consumers: warpgroup w multiplies rows w * WG_M .. of each tile, then runs its epilogue"]),
        "reg_alloc<CONSUMER_REGS>();",
        "const int warpgroup = threadIdx.x / 128 - 1, warp = (threadIdx.x / 32) % 4, lane = threadIdx.x & 31;",
        ("const int wg_row = 0;  // each warpgroup multiplies whole tiles, the two in turn" if s.pingpong else
         "const int wg_row = warpgroup * WG_M;  // the warpgroup's first row of a tile"),
        *(["const bool store_thread = threadIdx.x % 128 == 0;  // hands the warpgroup's boxes to the copy engine"]
          if tma_stores(s) else []),
        *(copy_out_lambda(plan.output.param, em.index_type) if s.copy_out else []),
        *batch_lines,
        *(["// values every tile shares (batch-only parts of the terms)", *top] if top else []),
        *([] if norm else [
            "const unsigned long long a_desc = make_smem_desc(smem + A_SMEM + wg_row * ROW_BYTES, A_LBO, 1024);"]),
        "const unsigned long long b_desc = make_smem_desc(smem + B_SMEM, B_LBO, 1024);",
        *(["float row_ss[M_TILES][2][2];  // sums of x^2 over k, two chains: rows g and g + 8 of each m64 tile",
           "u32 frag[2][M_TILES][BK / 16][4] = {};  // A fragments of two consecutive k steps",
           *_norm_fragments(weight is not None)] if norm else []),
        *(_source_loads(len(sources)) if sources else []),
        *(["u32 source_phase = 0;  // parity of the source barriers' current round"] if sources else []),
        "int stage = 0;",
        "u32 phase = 0;",
        *(_turn_loop() if s.pingpong else ["for (int tile = blockIdx.x; tile < TILES; tile += gridDim.x) {"]),
        "    int m0, n0;",
        "    tile_origin(tile, m0, n0);",
        *(["    if (store_thread) {  // the tile's first round of source boxes: they land during its k steps",
           "        bulk_wait_read<0>();  // the buffers' last stores have read them",
           "        #pragma unroll",
           "        for (int b = 0; b < STORE_BOXES; ++b) load_sources(b, m0, n0);",
           "    }"] if sources else []),
        "    float acc[M_TILES][ACC];",
        "    #pragma unroll",
        "    for (int mi = 0; mi < M_TILES; ++mi) {",
        "        #pragma unroll",
        "        for (int i = 0; i < ACC; ++i) acc[mi][i] = 0.0f;",
        *(["        row_ss[mi][0][0] = row_ss[mi][0][1] = row_ss[mi][1][0] = row_ss[mi][1][1] = 0.0f;"]
          if norm else []),
        "    }",
        *(["    if (turn > 0)  // the tile before (the other warpgroup's) has had all its k steps: its ring steps are done",
           "        mbar_wait(smem + TURN_BARRIERS + 8 * warpgroup, ((turn - 1) >> 1) & 1);"] if s.pingpong else []),
        *indent_lines(_norm_main_loop(mma_name) if norm else _ss_main_loop(mma_name), 1),
        *(["    if (lane == 0) mbar_arrive(smem + TURN_BARRIERS + 8 * (1 - warpgroup));  // the other warpgroup's turn"]
          if s.pingpong else []),
        "    wgmma_wait<0>();",
        "    #pragma unroll",
        "    for (int mi = 0; mi < M_TILES; ++mi) fence_operands(acc[mi]);",
        "    if (previous >= 0 && lane == 0) mbar_arrive(smem + BARRIERS + 8 * (STAGES + previous));",
        *(indent_lines(row_scales("M_TILES"), 1) if norm else []),
        "",
        *indent_lines(epilogue, 1),
        "}",
        *(["if (store_thread) bulk_wait_all();  // shared memory must outlive the stores"] if tma_stores(s) else []),
    ]  # fmt: skip
    body = [
        f"// shared memory: the tile ring at the first {SWIZZLE_ALIGN}-byte boundary, then the mbarriers",
        "extern __shared__ __align__(16) unsigned char ck_smem[];",
        f"const u32 smem = (smem_u32(ck_smem) + {SWIZZLE_ALIGN - 1}u) & ~{SWIZZLE_ALIGN - 1}u;",
        "if (threadIdx.x == 0) {",
        "    #pragma unroll",
        "    for (int s = 0; s < STAGES; ++s) {",
        "        mbar_init(smem + BARRIERS + 8 * s, 1);                     // full: the producer's arrival + bytes",
        "        mbar_init(smem + BARRIERS + 8 * (STAGES + s), RELEASING_WARPS);  // empty: one arrival a consumer warp",
        "    }",
        *(["    #pragma unroll",
           "    for (int b = 0; b < CONSUMERS * STORE_BOXES; ++b)",
           "        mbar_init(smem + SOURCE_BARRIERS + 8 * b, 1);  // a source box: the store thread's arrival + bytes"]
          if sources else []),
        *(["    mbar_init(smem + TURN_BARRIERS, 4);      // warpgroup 0's turn: the other's warps are past their k steps",
           "    mbar_init(smem + TURN_BARRIERS + 8, 4);"] if s.pingpong else []),
        "    fence_barrier_init();",
        "}",
        *(["// the norm's weight, whole, in shared memory (the consumers read its pairs every k step)",
           "__shared__ u32 norm_weight[K / 2];",
           "for (int i = threadIdx.x; i < K / 2; i += THREADS)",
           f"    norm_weight[i] = __ldg(reinterpret_cast<const u32*>({weight}) + i);"] if weight else []),
        "__syncthreads();",
        "",
        "if (threadIdx.x < 128) {",
        *indent_lines(producer, 1),
        "} else {",
        *indent_lines(consumer, 1),
        "}",
    ]
    summary = (
        f"GEMM: warp-specialised wgmma.mma_async m64n{s.block_n}k16 {dtype}, fp32 accumulators; M={layout.m} "
        f"N={layout.n} K={layout.k}; tile {s.block_m}x{s.block_n}x{s.block_k}, {s.consumer_warpgroups} consumer "
        f"warpgroups{' taking the tiles in turn (ping-pong)' if s.pingpong else ''} and a TMA producer warpgroup, "
        f"{s.stages} stages{', persistent' if s.persistent else ''}; "
        f"A {order(layout.a_kmajor)}, B {order(layout.b_kmajor)}."
        + (f" The output goes through {s.store_boxes} shared-memory box(es) a warpgroup and "
           f"{'the threads copy them out (rows not 16-byte aligned)' if s.copy_out else 'TMA stores'}."
           if s.store_boxes else "")
        + (f" The epilogue's source{'s' if len(sources) > 1 else ''} "
           f"{', '.join(plan.tensor_map[r[1]].name for r in sources)} come{'' if len(sources) > 1 else 's'} into "
           "staging boxes by TMA loads issued when a tile starts." if sources else "")
        + (" A is an absorbed RMSNorm of x: fragments from registers (x * w), row sums of x^2, row scales in the "
           "epilogue." if norm else "")
    )
    launch = (f"grid ({blocks}, 1, 1), {s.threads} threads, {smem_bytes} bytes of dynamic shared memory; "
              f"the tensor maps of A{', B and the output' if tma_stores(s) else ' and B'}"
              f"{' and the staged sources' if sources else ''} first")  # fmt: skip
    helpers = [
        emit_prelude(),
        tma.emit_tensor_map_type(),
        tma.emit_mbarrier(),
        tma.emit_tma_load(2),
        tma.emit_setmaxnreg(),
        wgmma.emit_descriptor(),
        wgmma.emit_sync(),
        wgmma.emit_wgmma(s.block_n, dtype, norm is not None, not layout.b_kmajor,
                         not layout.a_kmajor and norm is None),
    ]
    if tma_stores(s):
        helpers += [tma.emit_tma_store(2), tma.emit_fence_proxy_async()]
    if s.store_boxes:
        helpers += [tma.emit_named_barriers(), mma.emit_pack(dtype)]
    if sources or s.copy_out:
        helpers.append(tma.emit_ld_shared())
    if sources:
        helpers.append(mma.emit_unpack(plan.output.dtype))
    if s.copy_out:
        helpers += [tma.emit_st_shared(), emit_global_stores()]
    if norm is not None:
        helpers += [emit_ldmatrix_primitives(4), emit_norm_helpers(dtype)]
    if paired:
        helpers.append(vector_helpers([(plan.output.dtype, 2)]))
    kernel_text = "\n".join([_signature(plan, name, s.threads) + " {", *indent_lines(body, 1), "}"])
    parts = [
        header(plan, summary, launch),
        section("types and helpers", *helpers),
        section("problem and tile constants", constants),
        section("kernel", kernel_text),
    ]
    return "\n\n".join(parts) + "\n"
