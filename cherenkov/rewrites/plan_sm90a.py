"""Schedules of the Hopper (sm_90a) flash-attention kernel family: wgmma, TMA, warp roles.

A block has one producer warpgroup, whose first thread issues the TMA copies (Q once, then
K/V tiles into a ``stages``-deep shared-memory ring), and ``consumer_warpgroups``
consumer warpgroups of 64 query rows each, so ``block_q = 64 · consumer_warpgroups``. A
consumer computes ``S = Q Kᵀ`` with wgmma (both operands in shared memory), the online
softmax on the accumulator registers, and ``O += P V`` with wgmma (P from registers).
``pingpong`` (two consumers only) alternates the two consumers' matmul phases with named
barriers, so one warpgroup's softmax runs while the other's matmuls occupy the tensor
cores. ``persistent`` launches one block per SM that walks the work tiles (query tile ×
head) in a stride, so the producer loads the next tile's Q and K while the consumers
normalise and store the last one; ``q_buffers`` 2 gives such a block a second Q tile (and
an O tile for TMA stores), so the next tile's Q is loaded during the current one.
``pack_group`` fills a tile of a short query (``Sq`` of 8 to 64 rows) with the rows of
``block_q / Sq`` query heads of one K/V head, so K and V are read once for all of them and
no tile rows are wasted (chunked prefill: 64 queries of 4 heads a K/V head, causal after
the KV cache or not).
``balanced`` (causal, persistent) hands a persistent grid its work tiles longest first
over all heads, each round in the other direction, so the blocks' shares even out.
``lazy_rescale`` moves a row's running max (and rescales O and the row sums) only when a
key tile raises it by more than ``LAZY_RESCALE_LOG2`` (a warp-uniform vote), so most key
tiles skip the O rescale and the quad's max shuffles. ``l2_prefetch`` has the producer ask L2 for
the K and V tiles that many key tiles past each one it loads (``cp.async.bulk.prefetch.tensor``), so
K/V streamed from DRAM (a chunked prefill's, read by few tiles each) is in L2 before its copy is
issued, a deeper pipeline than the shared-memory ring holds. ``row_sums_mma`` (8-bit operands) gives the
transposed V tile eight more rows of ones, so ``O += P V`` also accumulates each row's sum of the
(rounded) probabilities and the softmax adds none. ``poly_exp`` computes the exponentials of that
many of every four 8-key chunks of a score tile as a polynomial on the FMA pipe instead of the
SFU's ``ex2`` (the SFU, 16 lanes a clock, also converts P to 8 bits; its queue is the consumers'
softmax's critical path, between the two consumers' matmuls). The code
generator is :mod:`cherenkov.codegen.cuda.flash_attention_sm90a`.

This module holds only the schedule, its resource estimates and its validity rules; it
lives beside :mod:`cherenkov.rewrites.plan` (the ``mma.sync`` family) and reuses its
:class:`AttentionProblem`.
"""

from __future__ import annotations

from dataclasses import dataclass

from cherenkov.rewrites.plan import ATTENTION_DTYPES, ELEMENT_BYTES, TARGETS, AttentionProblem, Target

MAX_HEAD_DIM = 256
"""The widest head dim (of q·k or of v) of the sm_90a family: O is one wgmma of N = the v
tile's width, at most 256."""

HEAD_DIM_STEP = {2: 8, 1: 16}
"""Head dims of the sm_90a family are multiples of this, by element bytes: 8 at 16 bits (a row of 16 bytes,
the tensor maps' stride alignment; ``Q Kᵀ`` reads the box's zero columns up to its next 32-byte k step and
O's columns from them are dropped), 16 at 8 bits."""

SM90A = TARGETS["sm_90a"]
"""The Hopper target with its architecture-specific features (wgmma, setmaxnreg)."""

WARPGROUP_THREADS = 128
ROWS_PER_CONSUMER = 64  # one wgmma m64 tile of query rows per consumer warpgroup
SWIZZLE_ROW_BYTES = 128  # a TMA box row: 64 16-bit elements, the width of the 128-byte swizzle
NARROW_ROW_BYTES = 64  # a box row of the 64-byte swizzle: 32 16-bit elements
SWIZZLE_ALIGN = 1024  # one 128-byte-swizzle atom: 8 rows of 128 bytes (two 64-byte-swizzle atoms)
MBARRIER_BYTES = 8
ONES_ROWS = 8
"""Rows of ones a ``row_sums_mma`` V tile carries after its head-dim rows (the N granule of an
8-bit wgmma): O's columns past ``V_DIM`` are then the row sums."""
POLY_EXP_CHUNKS = 4
"""A ``poly_exp`` schedule's share is counted in 8-key chunks out of every ``POLY_EXP_CHUNKS``."""
LAZY_RESCALE_LOG2 = {2: 8.0, 1: 2.0}
"""By operand bytes: how far (log2 units of the scaled scores) a key tile may raise a row's max
before a ``lazy_rescale`` kernel moves it. Unmoved, probabilities reach ``2^threshold``: 16-bit
P holds 2⁸ easily; e4m3 P, already scaled by 2^``P_SHIFT`` to use its range (largest 448 ≈ 2^8.8),
gives up that much of the shift instead (P·2⁶, at most 2⁸)."""


def box_row_bytes(head_dim: int, v_dim: int, dtype: str = "bf16") -> int:
    """Bytes of a TMA box row, and of a row of every shared-memory tile, for a problem's head
    dims: 64 (the 64-byte swizzle) when neither head dim is wider, so a 32-wide 16-bit head
    dim reads no zero columns; else 128 (the 128-byte swizzle)."""
    elem = ELEMENT_BYTES[dtype]
    return NARROW_ROW_BYTES if max(head_dim, v_dim) * elem <= NARROW_ROW_BYTES else SWIZZLE_ROW_BYTES


def tile_columns(dim: int, dtype: str = "bf16", row_bytes: int = SWIZZLE_ROW_BYTES) -> int:
    """Columns a head dim occupies in shared memory: whole TMA boxes of ``row_bytes`` a row
    (:func:`box_row_bytes`). A head dim that is not a whole number of boxes (80, 96 in 16 bits)
    reads the last box's columns past its end as zeros (the tensor map's out-of-bounds fill),
    which add nothing to ``Q Kᵀ`` and give O columns that are never stored."""
    box = row_bytes // ELEMENT_BYTES[dtype]
    return -(-dim // box) * box


def problem_tile_columns(problem: AttentionProblem) -> tuple[int, int]:
    """The columns of a problem's q/k tiles and of its v/o tiles (:func:`tile_columns` at the
    problem's :func:`box_row_bytes`)."""
    row_bytes = box_row_bytes(problem.head_dim, problem.v_dim, problem.dtype)
    qk_columns = tile_columns(problem.head_dim, problem.dtype, row_bytes)
    return qk_columns, tile_columns(problem.v_dim, problem.dtype, row_bytes)

L2_PREFETCH_TILES = 4
"""Key tiles ahead of each load that an ``l2_prefetch`` schedule's producer asks L2 for: with the
3-stage ring's two tiles in flight, K/V reach L2 about six key tiles (~10 µs at head dim 128)
before the consumers read them; 128 blocks × 4 tiles of 64 KB stay well inside the L2."""

# setmaxnreg budgets (producer, consumer) by number of consumer warpgroups: the block's
# register file is 64K, and each warpgroup's share must be a multiple of 8.
REGISTER_SPLIT = {2: (40, 232), 3: (32, 160)}


@dataclass(frozen=True)
class HopperFlashSchedule:
    """Schedule knobs of the sm_90a flash-attention kernel.

    ``block_kv`` keys per main-loop step (the N of ``S = Q Kᵀ``, a multiple of 16 up to
    256); ``stages`` K/V tile buffers in the TMA ring (a consumer holds two at once: tile
    j's K and tile j-1's V, so 2 stages leave the copy engine no slack; measured on the
    H200, seed shape, 3 stages reach 626 TFLOP/s against 472 with 2);
    ``consumer_warpgroups`` (1–3) of 64 query rows each; ``pingpong`` alternates two
    consumers' matmul phases; ``persistent`` launches ``min(tiles, SMs)`` blocks that each
    walk many work tiles (otherwise one block a tile, each paying its own prologue and
    epilogue, exposed when a tile has few key tiles); ``q_buffers`` 2 (persistent only)
    double-buffers Q, so the producer loads the next work tile's Q while the current one
    still runs instead of after its last scores; ``pack_group`` packs the query rows of
    several heads of a GQA group into a tile (one TMA box of ``Sq`` rows × heads; non-causal
    short queries only); ``balanced`` (causal, persistent) orders the work tiles longest
    first over all heads and alternates each round's direction over the blocks, so every
    block's sum of key tiles is about the same (otherwise a block's share is whatever lengths
    its stride meets); ``l2_prefetch`` key tiles ahead of each load, the producer prefetches
    K and V into L2 (0: none; 16-bit operands); ``poly_exp`` of every four 8-key chunks of a
    score tile take their exponentials as polynomials on the FMA pipe (0: every one on the SFU).
    """

    block_kv: int = 128
    stages: int = 3
    consumer_warpgroups: int = 2
    pingpong: bool = True
    persistent: bool = False
    q_buffers: int = 1
    pack_group: bool = False
    balanced: bool = False
    lazy_rescale: bool = False
    row_sums_mma: bool = False
    l2_prefetch: int = 0
    poly_exp: int = 0

    @property
    def block_q(self) -> int:
        return ROWS_PER_CONSUMER * self.consumer_warpgroups

    @property
    def threads(self) -> int:
        return WARPGROUP_THREADS * (1 + self.consumer_warpgroups)

    @property
    def register_split(self) -> tuple[int, int] | None:
        """(producer, consumer) registers a thread after ``setmaxnreg``; None: no reallocation
        (one consumer: the block's 256 threads already get 255 registers)."""
        return REGISTER_SPLIT.get(self.consumer_warpgroups)

    @property
    def consumer_registers(self) -> int:
        split = self.register_split
        return split[1] if split else 255

    @property
    def split_release(self) -> bool:
        """K and V of a stage go back to the producer separately (K after the scores, V after
        P V): a 2-stage ring then refills K a whole key tile earlier. With 3 stages the joint
        release has the same slack and one arrival less a key tile (split: 1-3 % slower, H200)."""
        return self.stages == 2

    @property
    def o_through_smem(self) -> bool:
        """O goes out by TMA stores from shared memory (its own buffer with two Q buffers, the
        consumer's half of Q in a one-tile block) instead of from registers. A persistent
        block with one Q buffer keeps register stores: Q is released before the epilogue."""
        return self.q_buffers == 2 or not self.persistent

    def smem_bytes(self, head_dim: int, dtype: str = "bf16", v_dim: int = 0) -> int:
        """Dynamic shared memory of one block: ``q_buffers`` Q tiles, ``stages`` × (K tile +
        V tile), with two Q buffers an O tile, the mbarriers (Q full and Q empty per Q buffer;
        K full, V full and K/V empty per stage, or K empty and V empty with ``split_release``)
        and 1 KB to align the tiles to the 128-byte swizzle atom. Tiles are whole TMA boxes
        wide (:func:`tile_columns`); ``v_dim`` is v's head dim (0: ``head_dim``)."""
        elem, v_dim = ELEMENT_BYTES[dtype], v_dim or head_dim
        row_bytes = box_row_bytes(head_dim, v_dim, dtype)
        qk_columns, v_columns = tile_columns(head_dim, dtype, row_bytes), tile_columns(v_dim, dtype, row_bytes)
        tiles = self.q_buffers * self.block_q * qk_columns * elem
        tiles += self.stages * self.block_kv * (qk_columns + v_columns) * elem
        if self.row_sums_mma:
            tiles += self.stages * ONES_ROWS * row_bytes  # the ones rows after each transposed V tile
        if self.q_buffers == 2:
            tiles += self.block_q * v_columns * elem  # the O staging tile
        barriers = MBARRIER_BYTES * (2 * self.q_buffers + (4 if self.split_release else 3) * self.stages)
        return tiles + barriers + SWIZZLE_ALIGN

    def problem_smem_bytes(self, problem: AttentionProblem) -> int:
        """:meth:`smem_bytes` at a problem's head dims and dtype."""
        return self.smem_bytes(problem.head_dim, problem.dtype, problem.v_dim)

    def register_estimate(self, problem: AttentionProblem) -> int:
        """Registers a consumer thread needs: O and S accumulators (fp32, half a column each
        per thread of the m64 tile; O as wide as v's tile), packed P (16-bit pairs) and 32 for
        the rest (ptxas, nvcc 13.0: D128/kv176 fits 232 and D64/kv128 fits 160 without spills)."""
        ones = ONES_ROWS // 2 if self.row_sums_mma else 0
        return problem_tile_columns(problem)[1] // 2 + ones + self.block_kv // 2 + self.block_kv // 4 + 32

    def key(self) -> str:
        """A short stable name, e.g. ``q128_kv128_s2_c2_pp`` (``_ps``: persistent; ``_q2``: two
        Q buffers; ``_pk``: packed GQA group; ``_lpt``: balanced causal tiles; ``_lz``: lazy rescale;
        ``_rs``: row sums on the tensor cores; ``_pf4``: L2 prefetch 4 key tiles ahead; ``_px2``: two of
        every four chunks' exponentials as polynomials)."""
        return (
            f"q{self.block_q}_kv{self.block_kv}_s{self.stages}_c{self.consumer_warpgroups}"
            f"{'_pp' if self.pingpong else ''}{'_ps' if self.persistent else ''}"
            f"{f'_q{self.q_buffers}' if self.q_buffers != 1 else ''}{'_pk' if self.pack_group else ''}"
            f"{'_lpt' if self.balanced else ''}{'_lz' if self.lazy_rescale else ''}{'_rs' if self.row_sums_mma else ''}"
            f"{f'_pf{self.l2_prefetch}' if self.l2_prefetch else ''}{f'_px{self.poly_exp}' if self.poly_exp else ''}"
        )

    def tile_heads(self, problem: AttentionProblem) -> int:
        """Query heads a work tile serves: ``block_q / Sq`` packed, else 1."""
        return self.block_q // problem.seq_q if self.pack_group else 1

    def tiles(self, problem: AttentionProblem) -> int:
        """Work tiles of a problem: query tiles × heads × batch (packed: one query tile for
        every ``tile_heads`` heads)."""
        if self.pack_group:
            return problem.heads // self.tile_heads(problem) * problem.batch
        return -(-problem.seq_q // self.block_q) * problem.heads * problem.batch

    def grid_blocks(self, problem: AttentionProblem, sms: int) -> int:
        """Blocks launched on a GPU with ``sms`` multiprocessors (one a tile, or one an SM
        when persistent: the block's ring and registers fill an SM)."""
        tiles = self.tiles(problem)
        return min(tiles, sms) if self.persistent else tiles

    @property
    def name(self) -> str:
        return f"sm90a_{self.key()}"


HOPPER_SCHEDULES: tuple[HopperFlashSchedule, ...] = (
    HopperFlashSchedule(128, 3, 2, True),
    HopperFlashSchedule(128, 3, 2, True, persistent=True),
    HopperFlashSchedule(128, 4, 2, True, persistent=True),
    HopperFlashSchedule(192, 3, 2, True),
    HopperFlashSchedule(192, 3, 2, True, persistent=True),
    HopperFlashSchedule(128, 2, 2, True, persistent=True, q_buffers=2),
    HopperFlashSchedule(128, 3, 2, True, persistent=True, q_buffers=2),
    HopperFlashSchedule(192, 2, 2, True, persistent=True, q_buffers=2),
    HopperFlashSchedule(128, 2, 2, True),
    HopperFlashSchedule(128, 2, 2, False),
    HopperFlashSchedule(176, 2, 2, True),
    HopperFlashSchedule(128, 2, 1, False),
    HopperFlashSchedule(64, 2, 2, True),
    HopperFlashSchedule(64, 2, 2, True, persistent=True),
    HopperFlashSchedule(80, 2, 2, True),
    HopperFlashSchedule(80, 2, 2, True, persistent=True),
    HopperFlashSchedule(128, 3, 2, True, pack_group=True),
    HopperFlashSchedule(128, 3, 2, True, persistent=True, pack_group=True),
    HopperFlashSchedule(176, 2, 2, True, pack_group=True),
    HopperFlashSchedule(128, 3, 2, True, persistent=True, balanced=True),
    HopperFlashSchedule(128, 2, 2, True, persistent=True, q_buffers=2, balanced=True),
    HopperFlashSchedule(128, 2, 2, True, lazy_rescale=True),
    HopperFlashSchedule(128, 3, 2, True, lazy_rescale=True),
    HopperFlashSchedule(128, 3, 2, True, persistent=True, lazy_rescale=True),
    HopperFlashSchedule(128, 4, 2, True, persistent=True, lazy_rescale=True),
    HopperFlashSchedule(128, 2, 2, True, persistent=True, q_buffers=2, lazy_rescale=True),
    HopperFlashSchedule(128, 3, 2, True, persistent=True, q_buffers=2, lazy_rescale=True),
    HopperFlashSchedule(128, 3, 2, True, persistent=True, pack_group=True, lazy_rescale=True),
    HopperFlashSchedule(128, 3, 2, True, persistent=True, balanced=True, lazy_rescale=True),
    HopperFlashSchedule(128, 2, 2, True, persistent=True, q_buffers=2, balanced=True, lazy_rescale=True),
    HopperFlashSchedule(80, 2, 2, True, lazy_rescale=True),
    HopperFlashSchedule(128, 3, 2, True, pack_group=True, lazy_rescale=True),
    HopperFlashSchedule(128, 2, 2, True, lazy_rescale=True, row_sums_mma=True),
    HopperFlashSchedule(128, 3, 2, True, persistent=True, lazy_rescale=True, row_sums_mma=True),
    HopperFlashSchedule(128, 4, 2, True, persistent=True, lazy_rescale=True, row_sums_mma=True),
    HopperFlashSchedule(128, 3, 2, True, persistent=True, balanced=True, lazy_rescale=True, row_sums_mma=True),
    HopperFlashSchedule(128, 3, 2, True, lazy_rescale=True, l2_prefetch=L2_PREFETCH_TILES),
    HopperFlashSchedule(128, 3, 2, True, pack_group=True, lazy_rescale=True, l2_prefetch=L2_PREFETCH_TILES),
)
"""The schedules offered (each valid for some problems; see :func:`hopper_schedule_problems`).
No ``poly_exp`` schedule is offered: on the H100 (2026-12-07, ``benchmarks/NOTES.md``) each
measured 0.84-0.97x its base, 8-bit and 16-bit, one chunk in four or two.
Three consumer warpgroups (160 registers each) are valid but not offered: at head dim 64
they measured 0.7x two ping-ponging consumers on the H200, and with a query tail they spill.
Four stages fit 128-key tiles of 8-bit operands at head dim 128 (and 16-bit ones at 64). 80-key
tiles are the widest two stages of head dim 256 fit (224 KB). Two Q buffers beside three stages
or 192-key tiles fit head dims up to 64."""


HOPPER_EIGHT_BIT_DTYPES = ("fp8_e4m3",)
"""8-bit operands of the family: ``wgmma`` e4m3 for both products, V read transposed (the
8-bit wgmma takes K-major operands only; the launch writes V transposed first)."""


def _eight_bit_problems(s: HopperFlashSchedule, p: AttentionProblem) -> list[str]:
    """Why the 8-bit variant cannot run a schedule and problem: rows of 128 bytes (head dim 128
    or 256), 128-key tiles (the transposed V tile's 128-byte rows), one Q buffer and register
    stores of a 16-bit output, no bias, window or soft cap, 16-byte aligned strides."""
    reasons = []
    if p.head_dim not in (128, 256) or p.v_dim != p.head_dim:
        reasons.append(f"8-bit head dims {p.head_dim} and {p.v_dim} (valid: one of 128, 256: whole 128-byte rows)")
    if s.block_kv != 128:
        reasons.append(f"8-bit block_kv {s.block_kv} (valid: 128, the transposed V tile's 128-byte rows)")
    if s.q_buffers != 1:
        reasons.append("the 8-bit variant stores O from registers, beside one Q buffer")
    if p.output_dtype not in ATTENTION_DTYPES:
        reasons.append(f"8-bit output dtype {p.output_dtype} (valid: {', '.join(ATTENTION_DTYPES)})")
    if p.bias is not None or p.window:
        reasons.append("an additive bias or a sliding window with 8-bit operands")
    if p.softcap:
        reasons.append("a soft cap of the scores with 8-bit operands")
    if p.q_block_scales or p.k_block_scales:
        reasons.append("MX block scales (the block-scaled mma.sync of sm_120a runs them)")
    for role in ("q", "k", "v"):
        layout = p.layout(role)
        if any(v % 16 for v in (*layout.strides(), layout.offset)):
            reasons.append(f"{role}'s strides {layout.strides()} and offset {layout.offset} are not multiples of 16 "
                           "8-bit elements")  # fmt: skip
    return reasons


def _packing_problems(s: HopperFlashSchedule, p: AttentionProblem) -> list[str]:
    """Why a packed schedule cannot run a problem: a work tile is whole heads of ``Sq`` rows
    (a multiple of 8, the swizzle atom's rows, dividing a consumer's 64), all of one K/V
    head; no bias, and a causal mask or window only where the short-query kernels take it
    (``AttentionProblem.short_query_band``: a chunk after a KV cache); 16-bit operands."""
    reasons = []
    if p.seq_q % 8 or ROWS_PER_CONSUMER % p.seq_q:
        reasons.append(f"packing needs Sq {p.seq_q} to be 8, 16, 32 or 64 (whole heads a consumer's 64 rows)")
    elif p.group_size % (s.block_q // p.seq_q):
        reasons.append(f"packing {s.block_q // p.seq_q} heads a tile needs them to share a K/V head "
                       f"(group of {p.group_size})")
    if p.bias is not None:
        reasons.append("packing with an additive bias tensor (valid: none)")
    if not p.short_query_band:
        reasons.append(f"packing under a causal mask or window needs the last query to see the last key and every "
                       f"query half the keys (Sq {p.seq_q}, Skv {p.seq_kv}, window {p.window}, {p.upper_edge} keys "
                       f"ahead)")
    if p.dtype not in ATTENTION_DTYPES:
        reasons.append(f"packing with {p.dtype} operands (valid: {', '.join(ATTENTION_DTYPES)})")
    return reasons


def hopper_schedule_problems(
    schedule: HopperFlashSchedule, problem: AttentionProblem, target: Target = SM90A
) -> list[str]:
    """Why a schedule cannot run a problem on a target; empty when it can.

    Sequence lengths need not be multiples of the tiles: the kernel masks key tails and
    skips the stores of query rows past the end."""
    s, p = schedule, problem
    reasons = p.layout_problems() + p.softcap_problems()
    if target.family != "wgmma":
        reasons.append(f"{target.name} has no wgmma (the sm_90a family needs sm_90a)")
    if p.shares_kv_head:
        reasons.append("k or v shared by the K/V heads (a head stride of 0): a tensor map does not move by 0 "
                       "(the mma.sync family plans it)")
    if p.dtype not in (*ATTENTION_DTYPES, *HOPPER_EIGHT_BIT_DTYPES):
        reasons.append(f"dtype {p.dtype} (valid: {', '.join((*ATTENTION_DTYPES, *HOPPER_EIGHT_BIT_DTYPES))})")
    if p.dtype in HOPPER_EIGHT_BIT_DTYPES:
        reasons += _eight_bit_problems(s, p)
        if p.lse is not None:
            reasons.append("the rows' log-sum-exp output: 16-bit operands only")
        if s.row_sums_mma and problem_tile_columns(p)[1] + ONES_ROWS > MAX_HEAD_DIM:
            reasons.append(f"row sums on the tensor cores need O ({problem_tile_columns(p)[1]} columns) plus "
                           f"{ONES_ROWS} columns of sums within one wgmma's {MAX_HEAD_DIM}")
    elif p.factors:
        reasons.append("score and output factors come with 8-bit operands only")
    if s.row_sums_mma and p.dtype not in HOPPER_EIGHT_BIT_DTYPES:
        reasons.append("row sums on the tensor cores: 8-bit operands only (the ones rows follow the transposed V tile)")
    step = HEAD_DIM_STEP.get(ELEMENT_BYTES.get(p.dtype, 2), 8)
    dims_valid = all(d % step == 0 and step <= d <= MAX_HEAD_DIM for d in (p.head_dim, p.v_dim))
    if not dims_valid:
        reasons.append(f"head dims {p.head_dim} (q, k) and {p.v_dim} (v) (valid: multiples of {step} up to "
                       f"{MAX_HEAD_DIM} at {8 * ELEMENT_BYTES.get(p.dtype, 2)} bits)")
    if s.consumer_warpgroups not in (1, 2, 3):
        reasons.append(f"{s.consumer_warpgroups} consumer warpgroups (valid: 1, 2, 3)")
    if s.pingpong and s.consumer_warpgroups != 2:
        reasons.append("the pingpong alternates exactly two consumer warpgroups")
    if not (16 <= s.block_kv <= 256 and s.block_kv % 16 == 0):
        reasons.append(f"block_kv {s.block_kv} is not a multiple of 16 in 16..256 (the N of one wgmma)")
    if s.q_buffers not in (1, 2):
        reasons.append(f"{s.q_buffers} Q buffers (valid: 1, 2)")
    if s.q_buffers == 2 and not s.persistent:
        reasons.append("two Q buffers need a persistent grid (a block of one work tile loads one Q)")
    if s.stages < 2:
        reasons.append(f"{s.stages} stage(s): the consumers hold two K/V stages at once, so the ring needs 2 or more")
    if p.heads % p.kv_heads:
        reasons.append(f"kv_heads {p.kv_heads} does not divide heads {p.heads}")
    if s.pack_group:
        reasons += _packing_problems(s, p)
    if s.l2_prefetch < 0:
        reasons.append(f"l2_prefetch {s.l2_prefetch} (valid: key tiles ahead, 0 for none)")
    if s.l2_prefetch and p.dtype in HOPPER_EIGHT_BIT_DTYPES:
        reasons.append("L2 prefetch with 8-bit operands (V comes from its transposed copy)")
    if not 0 <= s.poly_exp <= POLY_EXP_CHUNKS:
        reasons.append(f"poly_exp {s.poly_exp} (valid: 0 to {POLY_EXP_CHUNKS} of every {POLY_EXP_CHUNKS} 8-key chunks)")
    if s.balanced and not (s.persistent and p.causal):
        reasons.append("balanced tile order is for causal problems on a persistent grid")
    if dims_valid and p.dtype in ELEMENT_BYTES:
        qk_columns, v_columns = problem_tile_columns(p)
        if s.block_kv < 128 and max(qk_columns, v_columns) < 192:
            reasons.append("64-key tiles only for head dims of 192 and more, where wider ones may not fit")
        if s.o_through_smem and s.q_buffers == 1 and v_columns > qk_columns:
            reasons.append(f"O ({v_columns} columns) is staged in the Q tile ({qk_columns} columns): v's head dim "
                           "must not be wider than q's in a one-tile block")
        smem = s.problem_smem_bytes(p)
        if smem > target.smem_per_block:
            reasons.append(f"shared memory {smem} B exceeds {target.name}'s {target.smem_per_block} B")
        regs = s.register_estimate(p)
        if regs > s.consumer_registers:
            reasons.append(f"about {regs} registers a consumer thread exceeds its {s.consumer_registers}")
    return reasons
