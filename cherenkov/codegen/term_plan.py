"""Plans of the generic kernel families: any fused kernel of a derivation, with a schedule.

:class:`TermKernelPlan` is one :class:`~cherenkov.rewrites.kernels.FusedKernel` (its
index-notation term over its output axes) × one schedule × one target, plus the shapes and
dtypes of the tensors it reads and writes. Three families generate CUDA for it:

* ``pointwise`` (:class:`PointwiseSchedule`): one thread per output element (or
  ``vector`` consecutive elements of the innermost axis, with vector loads and stores);
  every binder of the term becomes a serial loop. It runs any term: elementwise kernels,
  and the fallback of reductions, contractions and flash attention.
* ``rows`` (:class:`RowSchedule`): one thread, one warp or one block per row of a row form
  (softmax / RMSNorm / LayerNorm rows) or per output element of a reduction; the row is
  read once for its statistics (online max and sum, Welford's mean and variance, plain
  sums), combined with warp shuffles and shared memory, then the fused epilogue writes
  the row (kept in registers and moved in 16-byte runs where the schedule says so).
* ``mma`` (:class:`GemmSchedule`): a tiled ``mma.sync`` bf16/fp16 GEMM with fp32
  accumulators for a ``Contract`` whose operands read 16-bit tensors (elementwise
  prologues are computed while loading the tiles), fused elementwise epilogue, correct
  tails for any M, N, K.
* ``wgmma`` (sm_90a targets only): the same contractions on Hopper's warpgroup
  ``wgmma.mma_async`` from 128-byte-swizzled shared-memory tiles, plain 16-bit operand
  reads only (no prologues): :class:`WgmmaGemmSchedule` copies them with ``cp.async``
  (m64 tiles and split-K for few-token GEMMs), :class:`TmaGemmSchedule` with TMA from a
  producer warpgroup (plain row-major matrices, persistent blocks). The one prologue the
  TMA kernel runs (as does the mma GEMM) is an absorbed RMSNorm (:class:`NormPrologue`).

Schedules of these families are enumerated here in Python (:func:`term_plans`), not as
e-graph alternatives: they are few, and each is valid for any problem the family accepts
(what a family does not accept, :func:`term_plan_problems` says).
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, replace
from typing import ClassVar, Literal

from cherenkov.codegen.cuda.term_expr import DTYPE_BYTES, TensorInfo, vector_reads
from cherenkov.codegen.cuda.text import identifier
from cherenkov.codegen.errors import CodegenError
from cherenkov.rewrites import terms as t
from cherenkov.rewrites.kernels import ELEMENTWISE, FusedKernel
from cherenkov.rewrites.plan import Target
from cherenkov.rewrites.terms import Term

TERM_KINDS = (
    "elementwise", "reduction", "contraction", "softmax_rows", "rms_norm_rows", "layer_norm_rows", "flash_attention",
)  # fmt: skip
ROW_KINDS = frozenset({"softmax_rows", "rms_norm_rows", "layer_norm_rows"})
ROW_CORES = frozenset({"SoftmaxRow", "RmsNormRow", "LayerNormRow"})
REDUCTION_CORES = frozenset({"Sum", "Max", "SoftmaxFoldL", "SoftmaxFoldAcc", "OnlineSoftmaxContract"})
MMA_DTYPES = ("bf16", "fp16")
MAX_GRID_YZ = 65535


# ------------------------------------------------------------------------ schedules


@dataclass(frozen=True)
class PointwiseSchedule:
    """One thread per ``vector`` consecutive output elements, ``block`` threads a block."""

    family: ClassVar[str] = "pointwise"
    block: int = 256
    vector: int = 1

    @property
    def threads(self) -> int:
        return self.block

    def key(self) -> str:
        return f"pw_b{self.block}_v{self.vector}"


@dataclass(frozen=True)
class RowSchedule:
    """Rows per ``thread`` (one thread a row), ``warp`` (one warp a row, ``threads / 32``
    rows a block) or ``block`` (one block of ``threads`` a row). ``cached``: each lane keeps
    the row values it reads in registers (at most ``MAX_CACHED_ITEMS``), so the second pass
    writes the row without reading it again. ``vector`` (cached rows only): a lane handles
    ``vector`` consecutive elements at a time, read and written with 16-byte accesses
    instead of one element a lane."""

    family: ClassVar[str] = "rows"
    mode: Literal["thread", "warp", "block"] = "warp"
    threads: int = 128
    cached: bool = False
    vector: int = 1

    @property
    def lanes(self) -> int:
        """Threads sharing one row."""
        return {"thread": 1, "warp": 32, "block": self.threads}[self.mode]

    @property
    def rows_per_block(self) -> int:
        return {"thread": self.threads, "warp": self.threads // 32, "block": 1}[self.mode]

    def key(self) -> str:
        vector = f"_v{self.vector}" if self.vector > 1 else ""
        return f"row_{self.mode}_t{self.threads}{'_cached' if self.cached else ''}{vector}"


@dataclass(frozen=True)
class GemmSchedule:
    """A ``block_m × block_n`` output tile per block, ``warps_m × warps_n`` warps each owning
    a ``block_m / warps_m × block_n / warps_n`` tile of m16n8k16 mma tiles; ``block_k`` of
    K per shared-memory stage and ``stages`` stages in a cp.async ring (``stages - 1`` tiles
    load while one multiplies)."""

    family: ClassVar[str] = "mma"
    block_m: int = 128
    block_n: int = 64
    block_k: int = 32
    warps_m: int = 2
    warps_n: int = 2
    stages: int = 2

    @property
    def warps(self) -> int:
        return self.warps_m * self.warps_n

    @property
    def threads(self) -> int:
        return 32 * self.warps

    @property
    def warp_m(self) -> int:
        return self.block_m // self.warps_m

    @property
    def warp_n(self) -> int:
        return self.block_n // self.warps_n

    def key(self) -> str:
        return f"mma_m{self.block_m}_n{self.block_n}_k{self.block_k}_w{self.warps_m}x{self.warps_n}_s{self.stages}"


GEMM_SMEM_PAD = 8  # elements of padding per shared-memory tile row (16 bytes: conflict-free ldmatrix)


def gemm_smem_bytes(schedule: GemmSchedule) -> int:
    """Dynamic shared memory of a GEMM plan: ``stages`` A and B tiles, each padded by 16 bytes
    a row — ``[rows][BK + pad]`` or ``[BK][rows + pad]``, whichever is larger."""
    s = schedule
    a = max(s.block_m * (s.block_k + GEMM_SMEM_PAD), s.block_k * (s.block_m + GEMM_SMEM_PAD))
    b = max(s.block_n * (s.block_k + GEMM_SMEM_PAD), s.block_k * (s.block_n + GEMM_SMEM_PAD))
    return s.stages * (a + b) * 2  # 16-bit mma operands


WARPGROUP_THREADS = 128
WGMMA_M = 64  # rows of one wgmma.mma_async tile
WGMMA_MAX_N = 256
WGMMA_BLOCK_K = 64  # 64 16-bit elements: one 128-byte swizzle row
WGMMA_MAX_ACCUMULATORS = 128  # fp32 accumulators a thread may hold without spilling
SWIZZLE_ALIGN = 1024  # one 128-byte-swizzle atom (8 rows of 128 bytes); tiles start on it
SWIZZLE_ROW_BYTES = 128  # one 128-byte-swizzled row: WGMMA_BLOCK_K 16-bit elements
GROUP_M = 8  # row tiles a rasterisation group of the wgmma GEMMs spans (consecutive tiles share B)


@dataclass(frozen=True)
class WgmmaTile:
    """The output tile of the sm_90a ``wgmma`` GEMMs: ``block_m × block_n`` per block,
    ``consumer_warpgroups`` warpgroups of 128 threads each owning ``block_m /
    consumer_warpgroups`` rows (one or two m64 wgmma tiles) across all ``block_n`` columns;
    ``block_k`` = 64 16-bit elements (one 128-byte swizzle row) of K per stage, ``stages``
    buffers in the operand ring."""

    family: ClassVar[str] = "wgmma"
    block_m: int = 128
    block_n: int = 256
    block_k: int = WGMMA_BLOCK_K
    consumer_warpgroups: int = 2
    stages: int = 4

    @property
    def warpgroup_m(self) -> int:
        """Rows of the output tile one warpgroup owns."""
        return self.block_m // self.consumer_warpgroups

    @property
    def accumulators(self) -> int:
        """fp32 accumulator registers a thread holds (``N / 2`` per m64 tile)."""
        return (self.warpgroup_m // WGMMA_M) * self.block_n // 2

    def tile_key(self) -> str:
        return f"m{self.block_m}_n{self.block_n}_k{self.block_k}_wg{self.consumer_warpgroups}_s{self.stages}"


@dataclass(frozen=True)
class WgmmaGemmSchedule(WgmmaTile):
    """The cp.async ``wgmma`` GEMM: every thread copies, two ring buffers are held by the
    wgmmas in flight and ``stages - 2`` load ahead. ``split_k`` > 1 splits K over that many
    blocks a tile (for grids of few tiles): each adds its share into fp32 partial sums, the
    last of a tile to finish adds the partials in split order and runs the epilogue."""

    split_k: int = 1

    @property
    def threads(self) -> int:
        return WARPGROUP_THREADS * self.consumer_warpgroups

    def key(self) -> str:
        return f"wgmma_{self.tile_key()}{f'_sk{self.split_k}' if self.split_k > 1 else ''}"


@dataclass(frozen=True)
class TmaGemmSchedule(WgmmaTile):
    """The warp-specialised ``wgmma`` GEMM (another kernel of the same family): a producer
    warpgroup whose one thread loads the operand tiles with TMA into the ring (mbarriers),
    the consumers multiplying as in the cp.async kernel. ``persistent``: one block per SM
    (at most ``PERSISTENT_BLOCKS``) walks the output tiles, so a tile's epilogue runs while
    the producer loads the next tile's operands; else one block a tile. The launch passes
    TMA tensor maps of both operands (plain row-major matrices, no batch).

    ``store_boxes`` > 0: the epilogue stages the output in that many ``STORE_BOX`` ×
    ``STORE_BOX`` boxes of shared memory a consumer warpgroup, each stored by the copy engine
    (a TMA store) while the warpgroup goes on to the next box and tile; the output must be
    a plain row-major matrix too. 0: every thread stores its accumulators itself.

    ``staged_sources`` > 0 (with ``store_boxes``): the first that many of the epilogue's
    source matrices (:func:`epilogue_sources`: ``M × N`` tensors the epilogue reads at the
    output's own element, a residual or the other half of a gated product) come into
    staging boxes of their own by TMA loads — issued when a tile starts, so they land while
    its k steps run — instead of one global load per element after the last k step; the
    result is written over the first source's box and stored from there.

    ``copy_out`` (with ``store_boxes``, for an output whose rows are not 16-byte aligned,
    which no TMA store can write: an LM head's vocabulary of 50257 columns): the
    warpgroup's threads copy each staged box to the output themselves, a warp a row of the
    box at a time — one coalesced 4-byte store a lane where the row's element pairs are
    4-byte aligned, a 2-byte store at a row's odd start or end — instead of the copy engine.

    ``pingpong`` (persistent, two consumer warpgroups): each consumer warpgroup owns whole
    ``block_m × block_n`` tiles, the two taking the block's tiles in turn, so that one runs
    its epilogue while the other's wgmmas keep the tensor cores busy (the ring's order
    keeps their k steps apart: a tile's operands are loaded after the previous tile's). Else
    the two split each tile's rows and both run the epilogue at once."""

    persistent: bool = True
    store_boxes: int = 0
    staged_sources: int = 0
    copy_out: bool = False
    pingpong: bool = False
    split_k: ClassVar[int] = 1  # no split-K: one block owns a tile

    @property
    def threads(self) -> int:
        return WARPGROUP_THREADS * (self.consumer_warpgroups + 1)

    @property
    def warpgroup_m(self) -> int:
        """Rows of a tile one consumer warpgroup multiplies: all of them with ``pingpong``."""
        return self.block_m if self.pingpong else self.block_m // self.consumer_warpgroups

    @property
    def staging_boxes(self) -> int:
        """``STORE_BOX × STORE_BOX`` boxes of shared memory a consumer warpgroup stages in: one
        set of ``store_boxes`` for the output, or one a staged source (the output overwrites
        the first source's)."""
        return self.store_boxes * max(1, self.staged_sources)

    def key(self) -> str:
        stores = f"_o{self.store_boxes}{'_copy' if self.copy_out else ''}" if self.store_boxes else ""
        sources = f"_src{self.staged_sources}" if self.staged_sources else ""
        turns = "_pp" if self.pingpong else ""
        return f"wgmma_tma_{self.tile_key()}{'_p' if self.persistent else ''}{turns}{stores}{sources}"


PERSISTENT_BLOCKS = 132  # SMs of an H100 SXM / H200: a persistent GEMM's grid (launch caps it at the device's)
MBARRIER_BYTES = 8
STORE_BOX = 64  # rows and columns of a TMA GEMM's output staging box: 64 swizzled rows of 128 bytes
STORE_BOX_BYTES = STORE_BOX * SWIZZLE_ROW_BYTES


def wgmma_smem_bytes(schedule: WgmmaGemmSchedule | TmaGemmSchedule) -> int:
    """Dynamic shared memory of a wgmma GEMM plan: ``stages`` A and B tiles (16-bit, no
    padding: the 128-byte swizzle keeps the accesses conflict-free), plus slack to align
    the ring to a swizzle atom, plus (TMA kernels) a full and an empty mbarrier a stage and
    the output staging boxes (and, ping-pong, a turn mbarrier a consumer warpgroup)."""
    s = schedule
    ring = s.stages * (s.block_m + s.block_n) * s.block_k * 2 + SWIZZLE_ALIGN
    if not isinstance(s, TmaGemmSchedule):
        return ring
    source_barriers = s.store_boxes * s.consumer_warpgroups * MBARRIER_BYTES if s.staged_sources else 0
    turn_barriers = s.consumer_warpgroups * MBARRIER_BYTES if s.pingpong else 0
    return (ring + 2 * s.stages * MBARRIER_BYTES + s.staging_boxes * s.consumer_warpgroups * STORE_BOX_BYTES
            + source_barriers + turn_barriers)  # fmt: skip


Schedule = PointwiseSchedule | RowSchedule | GemmSchedule | WgmmaGemmSchedule | TmaGemmSchedule

POINTWISE_BLOCKS = (128, 256, 512)
ROW_SCHEDULES = (
    RowSchedule("warp", 128),
    RowSchedule("block", 256),
    RowSchedule("block", 512),
    RowSchedule("thread", 128),
    RowSchedule("warp", 128, cached=True),
    RowSchedule("block", 256, cached=True),
    RowSchedule("block", 512, cached=True),
    RowSchedule("block", 1024, cached=True),
)
MAX_CACHED_ITEMS = 32  # row values a lane may keep in registers
ROW_VECTORS = (8,)  # consecutive row elements a lane moves at once (16 bytes of 16-bit floats)
GEMM_SCHEDULES = (
    GemmSchedule(64, 64, 32, 2, 2, 2),
    GemmSchedule(128, 64, 32, 2, 2, 3),
    GemmSchedule(128, 128, 32, 2, 4, 3),
    GemmSchedule(128, 128, 32, 2, 4, 4),
    GemmSchedule(128, 256, 32, 2, 4, 3),
    GemmSchedule(256, 128, 32, 4, 2, 3),
    GemmSchedule(128, 128, 64, 2, 4, 3),
)
# Best measured first (H200, bf16 4096³ and 4096×8192×2048); 128×256 with 3 stages was 30 %
# slower than with 4 on both and is left out. The m64 tiles of one warpgroup, with deeper
# rings, serve few-token GEMMs (M = 64: a 128-row tile would compute half zeros).
WGMMA_GEMM_SCHEDULES = (
    WgmmaGemmSchedule(128, 256, 64, 2, 4),
    WgmmaGemmSchedule(128, 128, 64, 2, 5),
    WgmmaGemmSchedule(256, 128, 64, 2, 4),
    WgmmaGemmSchedule(128, 128, 64, 2, 3),
    WgmmaGemmSchedule(128, 128, 64, 1, 4),
    WgmmaGemmSchedule(64, 256, 64, 1, 4),
    WgmmaGemmSchedule(64, 128, 64, 1, 6),
    WgmmaGemmSchedule(64, 64, 64, 1, 8),
    WgmmaGemmSchedule(64, 64, 64, 1, 4),
)
# Split-K: offered for these tiles when the output has fewer than SPLIT_K_BLOCKS of them,
# with the smallest power-of-two split that reaches SPLIT_K_BLOCKS blocks (one wave of the
# H200's 132 SMs) while every split keeps at least SPLIT_K_MIN_STEPS k steps.
WGMMA_SPLIT_K_TILES = (
    WgmmaGemmSchedule(64, 64, 64, 1, 8),
    WgmmaGemmSchedule(64, 64, 64, 1, 4),
    WgmmaGemmSchedule(64, 128, 64, 1, 6),
    WgmmaGemmSchedule(128, 128, 64, 2, 5),
)
SPLIT_K_BLOCKS = 128
SPLIT_K_MIN_STEPS = 4
# The TMA kernels (plain row-major matrix operands, no batch): 128x256 with 4 stages fills
# the shared memory (193 KiB); 6 stages of 128x128 hold as many bytes in flight. Two
# staging boxes a warpgroup (32 KiB) still fit beside either ring; one box leaves room for
# an absorbed norm's weight. The ping-pong tiles (a warpgroup's own 128x128 or 64x256,
# as many accumulators as a cooperative 128x256) hide the epilogue behind the other
# warpgroup's k steps: what counts where K is short (GPT-2's K 768: 12 k steps a tile).
TMA_GEMM_SCHEDULES = (
    TmaGemmSchedule(128, 256, 64, 2, 4, True, 2),
    TmaGemmSchedule(128, 256, 64, 2, 4, True, 1),
    TmaGemmSchedule(128, 256, 64, 2, 4, True),
    TmaGemmSchedule(128, 256, 64, 2, 4, False),
    TmaGemmSchedule(128, 128, 64, 2, 6, True, 2),
    TmaGemmSchedule(128, 128, 64, 2, 6, True),
    # 128x192: 8192 x 768 (a GPT-2 projection) in 256 tiles, 1.94 rounds on 132 SMs (128x256: 192, 1.45)
    TmaGemmSchedule(128, 192, 64, 2, 4, True, 1),
    TmaGemmSchedule(128, 128, 64, 2, 6, True, 2, pingpong=True),
    TmaGemmSchedule(64, 256, 64, 2, 4, True, 2, pingpong=True),
    # epilogues that read M x N sources (valid only where the kernel has them)
    TmaGemmSchedule(128, 256, 64, 2, 4, True, 2, 1),
    TmaGemmSchedule(128, 256, 64, 2, 3, True, 4, 1),
    TmaGemmSchedule(128, 256, 64, 2, 3, True, 2, 2),
    TmaGemmSchedule(128, 128, 64, 2, 6, True, 2, 1),
    TmaGemmSchedule(128, 192, 64, 2, 4, True, 1, 1),
    TmaGemmSchedule(128, 128, 64, 2, 4, True, 2, 1, pingpong=True),
    # outputs whose rows no TMA store can write (not 16-byte aligned): boxes copied out by threads
    TmaGemmSchedule(128, 256, 64, 2, 4, True, 2, copy_out=True),
    TmaGemmSchedule(128, 128, 64, 2, 6, True, 2, copy_out=True),
    TmaGemmSchedule(128, 128, 64, 2, 6, True, 2, copy_out=True, pingpong=True),
)


# ------------------------------------------------------------------------ the plan


@dataclass(frozen=True)
class TermKernelPlan:
    """One fused kernel × one schedule × one target: the unit the search measures.

    ``tensors`` are the kernel's reads (by name) followed by its output, each with its
    shape and dtype; the kernel's parameters are their device pointers in this order.
    """

    kind: str
    kernel: FusedKernel
    schedule: Schedule
    target: Target
    tensors: tuple[TensorInfo, ...]
    trace: tuple[str, ...] = field(default=(), compare=False)

    @property
    def family(self) -> str:
        return self.schedule.family

    @property
    def inputs(self) -> tuple[TensorInfo, ...]:
        return self.tensors[:-1]

    @property
    def output(self) -> TensorInfo:
        return self.tensors[-1]

    @property
    def tensor_map(self) -> dict[str, TensorInfo]:
        return {info.name: info for info in self.tensors}

    @property
    def flops(self) -> float:
        """Arithmetic of the kernel (a contraction counts ``2·K`` per output)."""
        return float(self.output.numel) * term_flops(self.kernel.term)

    @property
    def bytes(self) -> float:
        """Bytes the kernel must move at least: each read tensor once, the output once."""
        return float(sum(info.numel * DTYPE_BYTES[info.dtype] for info in self.tensors))

    def params(self) -> dict:
        """Plain-JSON description (kernel, schedule, tensors, target) for reports and databases."""
        return {
            "kind": self.kind,
            "family": self.family,
            "kernel": {
                "output": self.kernel.output,
                "axes": list(self.kernel.axes),
                "term": t.show(self.kernel.term)[:2000],
                "term_sha256": term_digest(self.kernel),
            },
            "schedule": {"family": self.family, **asdict(self.schedule)},
            "tensors": {info.name: {"shape": list(info.shape), "dtype": info.dtype} for info in self.tensors},
            "target": self.target.name,
        }

    @functools.cached_property
    def name(self) -> str:
        """A stable identifier: kind, schedule key and a short hash of everything."""
        digest = hashlib.sha256(json.dumps(self.params(), sort_keys=True).encode()).hexdigest()[:10]
        return f"{self.kind}_{self.schedule.key()}_{digest}"


def term_digest(kernel: FusedKernel) -> str:
    """16 hex digits of sha256 over the kernel's term: what a plan's ``params`` record of it."""
    return hashlib.sha256(repr(kernel.term).encode()).hexdigest()[:16]


def term_flops(term: Term) -> float:
    """Arithmetic operations to compute one element of ``term`` (binders multiply their body
    by their extent; a subterm that occurs several times is counted once, as the emitters
    compute it once — a GELU epilogue names its matmul five times)."""
    counted: set[Term] = set()

    def operand(x: Term, k_axis: str) -> float:
        norm = norm_prologue(x, k_axis)  # once an element of x, not once an output: negligible
        return count(x) if norm is None else count(norm.x)

    def count(x: Term) -> float:
        if x in counted:
            return 0.0
        counted.add(x)
        head = x[0]
        if head in ("Tensor", "Num", "Flag", "Iota") or head in ("Ax", "IxLit", "IxAdd", "IxDiv", "IxMod", "IxLin"):
            result = 0.0
        elif head in ("Sum", "Max"):
            result = x[2] * (1 + count(x[3]))
        elif head == "Contract":
            result = x[2] * (2 + operand(x[3], x[1]) + operand(x[4], x[1]))
        elif head in ("SoftmaxFoldL", "SoftmaxFoldAcc", "OnlineSoftmaxContract"):
            result = x[2] * (6 + sum(count(a) for a in x[3:] if isinstance(a, tuple)))
        elif head in ROW_CORES:
            result = 2 * (5 + count(x[3]))
        elif head == "FlashAttention":
            result = x[2] * (x[4] * (2 + count(x[5]) + count(x[6])) + 8 + count(x[7]))
        else:
            result = 1 + sum(count(a) for a in x[1:] if isinstance(a, tuple))
        return result

    return count(term)


# ------------------------------------------------------------------------ analysis


def core_of(kernel: FusedKernel) -> Term | None:
    core = kernel.core
    if core is not None and core[0] == "Scheduled":
        core = core[1]
    return core


def _ordered(axes: set[str] | frozenset[str], order: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(a for a in order if a in axes) + tuple(sorted(set(axes) - set(order)))


def _last_item(read: Term) -> Term | None:
    items = t.ix_items(read[2])
    return items[-1] if items else None


def _reads(term: Term) -> list[Term]:
    return [s for s in t.subterms(term) if s[0] == "Tensor"]


@dataclass(frozen=True)
class RowLayout:
    """A row form or reduction: ``core`` over ``axis`` (``extent``), one row per value of
    ``outer`` (the kernel's axes but the row axis); ``writes_row``: the kernel writes every
    element of the row (row forms), else one element per row (reductions)."""

    core: Term
    axis: str
    extent: int
    outer: tuple[str, ...]
    writes_row: bool
    contiguous: bool  # some read's innermost index is the row axis itself

    @property
    def operands(self) -> tuple[Term, ...]:
        return tuple(a for a in self.core[3:] if isinstance(a, tuple))


def row_layout(kernel: FusedKernel) -> RowLayout | None:
    """The row structure of a row-form or reduction kernel (None for other kernels)."""
    core = core_of(kernel)
    if core is None or core[0] not in ROW_CORES | REDUCTION_CORES:
        return None
    axis, extent = core[1], core[2]
    if core[0] in ROW_CORES:
        if axis not in kernel.axes:
            return None
        outer = tuple(a for a in kernel.axes if a != axis)
    else:
        outer = kernel.axes
    operands = [a for a in core[3:] if isinstance(a, tuple)]
    contiguous = any(_last_item(r) == t.ax(axis) for op in operands for r in _reads(op))
    return RowLayout(core, axis, extent, outer, core[0] in ROW_CORES, contiguous)


@dataclass(frozen=True)
class NormPrologue:
    """A contraction operand ``RmsNormRow_k(x, ε)`` or ``RmsNormRow_k(x, ε)·w`` (``w`` a
    vector along k) — an RMSNorm a GEMM absorbed (:func:`cherenkov.rewrites.kernels.absorbed`):
    the GEMM reads ``x`` as the operand, scales its k columns by ``w`` as it loads them,
    sums ``x²`` per row on the way, and multiplies each accumulator row by
    ``(Σ_k x²/K + ε)^{-1/2}`` in its epilogue."""

    x: Term
    weight: Term | None
    eps: float


def norm_prologue(operand: Term, k_axis: str) -> NormPrologue | None:
    """The operand as a :class:`NormPrologue` over ``k_axis``, or None."""
    core, weight = operand, None
    if operand[0] == "Mul":
        pairs = ((operand[1], operand[2]), (operand[2], operand[1]))
        match = next(((c, w) for c, w in pairs if c[0] == "RmsNormRow" and w[0] == "Tensor"
                      and t.ix_items(w[2]) == (t.ax(k_axis),)), None)  # fmt: skip
        if match is None:
            return None
        core, weight = match
    if core[0] != "RmsNormRow" or core[1] != k_axis or core[3][0] != "Tensor":
        return None
    return NormPrologue(core[3], weight, core[4])


@dataclass(frozen=True)
class GemmLayout:
    """A contraction ``Σ_k a·b`` as a batched GEMM: ``a`` varies along the ``m`` axes (and
    k), ``b`` along the ``n`` axes (and k); ``batch`` holds every other kernel axis (axes
    both operands vary along, and axes only the epilogue uses). M, N and BATCH flatten
    their axes row-major. ``*_kmajor``: the operand's innermost memory order follows k
    (tiles stored ``[row][k]``), else its row axes (tiles stored ``[k][row]``); ``*_fast``:
    the operand is a plain read that 16-byte ``cp.async`` copies can load. ``norm``: one
    operand is an absorbed RMSNorm of the read in ``a`` or ``b`` (``norm_operand``)."""

    core: Term
    k_axis: str
    k: int
    a: Term
    b: Term
    m_axes: tuple[str, ...]
    n_axes: tuple[str, ...]
    batch: tuple[str, ...]
    a_kmajor: bool
    b_kmajor: bool
    a_fast: bool
    b_fast: bool
    dtype: str
    norm: NormPrologue | None = None
    norm_operand: str = ""

    @property
    def m(self) -> int:
        return math.prod(t.extent(a) for a in self.m_axes)

    @property
    def n(self) -> int:
        return math.prod(t.extent(a) for a in self.n_axes)

    @property
    def batch_size(self) -> int:
        return math.prod(t.extent(a) for a in self.batch)


def _kmajor(operand: Term, k_axis: str, rows: tuple[str, ...]) -> bool:
    """Whether the operand's reads move fastest along k (else along its row axes)."""
    for read in sorted(_reads(operand), key=repr):
        last = _last_item(read)
        if last is None:
            continue
        names = t.ix_names(last)
        if k_axis in names:
            return True
        if names & set(rows):
            return False
    return True


def _fast(operand: Term, contiguous_axis: str | None, tensors: Mapping[str, TensorInfo], dtype: str) -> bool:
    """A plain read whose innermost index is ``contiguous_axis`` over the tensor's whole
    innermost extent (a multiple of 8), that axis used nowhere else: 16-byte chunks of 8
    consecutive elements are 16-byte aligned and either wholly in range or wholly out."""
    if operand[0] != "Tensor" or contiguous_axis is None:
        return False
    info = tensors[operand[1]]
    items = t.ix_items(operand[2])
    extent = t.extent(contiguous_axis)
    return (
        info.dtype == dtype
        and bool(items)
        and items[-1] == t.ax(contiguous_axis)
        and info.shape[-1] == extent
        and extent % 8 == 0
        and not any(contiguous_axis in t.ix_names(ix) for ix in items[:-1])
    )


def gemm_layout(kernel: FusedKernel, tensors: Mapping[str, TensorInfo]) -> GemmLayout | None:
    """The GEMM shape of a contraction kernel, or None when its core is not a Contract."""
    core = core_of(kernel)
    if core is None or core[0] != "Contract":
        return None
    k_axis, k = core[1], core[2]
    a, b = core[3], core[4]
    norm_a, norm_b = norm_prologue(a, k_axis), norm_prologue(b, k_axis)
    norm = norm_a or norm_b
    norm_operand = "a" if norm_a else ("b" if norm_b else "")
    a, b = (norm_a.x if norm_a else a), (norm_b.x if norm_b and not norm_a else b)
    free_a, free_b = t.free_axes(a) - {k_axis}, t.free_axes(b) - {k_axis}
    shared = free_a & free_b
    batch_set = shared | (set(kernel.axes) - free_a - free_b)
    m_set, n_set = free_a - batch_set, free_b - batch_set
    innermost = next((x for x in reversed(kernel.axes) if t.extent(x) > 1), None)
    if innermost in m_set:  # the output's innermost axis goes along N (coalesced stores)
        a, b, m_set, n_set = b, a, n_set, m_set
        norm_operand = {"a": "b", "b": "a", "": ""}[norm_operand]
    m_axes, n_axes = _ordered(m_set, kernel.axes), _ordered(n_set, kernel.axes)
    batch = _ordered(batch_set, kernel.axes)
    read_dtypes = {tensors[r[1]].dtype for op in (a, b) for r in _reads(op)}
    dtype = "fp16" if read_dtypes == {"fp16"} else "bf16"
    a_kmajor, b_kmajor = _kmajor(a, k_axis, m_axes), _kmajor(b, k_axis, n_axes)
    a_contig = k_axis if a_kmajor else (m_axes[-1] if m_axes else None)
    b_contig = k_axis if b_kmajor else (n_axes[-1] if n_axes else None)
    return GemmLayout(
        core=core, k_axis=k_axis, k=k, a=a, b=b, m_axes=m_axes, n_axes=n_axes, batch=batch,
        a_kmajor=a_kmajor, b_kmajor=b_kmajor,
        a_fast=_fast(a, a_contig, tensors, dtype), b_fast=_fast(b, b_contig, tensors, dtype),
        dtype=dtype, norm=norm, norm_operand=norm_operand,
    )  # fmt: skip


def mma_problems(plan_kernel: FusedKernel, tensors: Mapping[str, TensorInfo], output: TensorInfo) -> list[str]:
    """Why the mma GEMM family cannot run a kernel; empty when it can."""
    layout = gemm_layout(plan_kernel, tensors)
    if layout is None:
        return ["the kernel's core is not a contraction"]
    reasons = []
    if output.dtype not in MMA_DTYPES:
        reasons.append(
            f"output dtype {output.dtype} (the mma path rounds operands to 16 bits; fp32 needs the exact path)"
        )
    bad = sorted({tensors[r[1]].dtype for op in (layout.a, layout.b) for r in _reads(op)} - set(MMA_DTYPES))
    if bad:
        reasons.append(f"operands read {', '.join(bad)} tensors (mma operands are bf16/fp16)")
    if layout.batch_size > MAX_GRID_YZ:
        reasons.append(f"batch {layout.batch_size} exceeds the grid's z limit {MAX_GRID_YZ}")
    if layout.m == 1 and layout.n == 1:
        reasons.append("no row or column axis (every free axis is a batch axis: a dot product per output element, "
                       "one element of a GEMM tile)")  # fmt: skip
    index_heads = ("Ax", "IxLit", "IxAdd", "IxDiv", "IxMod", "IxLin", "ICons", "INil")
    for op in (layout.a, layout.b):
        if any(s[0] not in ELEMENTWISE and s[0] not in index_heads for s in t.subterms(op)):
            reasons.append("an operand holds a nested reduction")
            break
    return reasons


def wgmma_problems(plan: TermKernelPlan) -> list[str]:
    """Why the sm_90a wgmma GEMM family cannot run a plan; empty when it can."""
    s, target = plan.schedule, plan.target
    if target.family != "wgmma":
        return [f"wgmma GEMMs need an sm_90a target (target {target.name} has the {target.family} family)"]
    reasons = mma_problems(plan.kernel, plan.tensor_map, plan.output)
    layout = gemm_layout(plan.kernel, plan.tensor_map)
    if layout is not None:
        for role, fast in (("A", layout.a_fast), ("B", layout.b_fast)):
            if not fast:
                reasons.append(
                    f"operand {role} is evaluated (a prologue, or not a contiguous {layout.dtype} read whose innermost "
                    "extent is a multiple of 8); the wgmma family copies plain 16-bit reads only"
                )
        if math.ceil(layout.m / s.block_m) > MAX_GRID_YZ:
            reasons.append(f"M {layout.m} needs more than {MAX_GRID_YZ} row tiles")
    if s.block_k != WGMMA_BLOCK_K:
        reasons.append(f"block_k {s.block_k}: one 128-byte swizzle row of 16-bit elements is {WGMMA_BLOCK_K}")
    if s.consumer_warpgroups not in (1, 2):
        reasons.append(f"consumer warpgroups {s.consumer_warpgroups} (1 or 2)")
    elif s.block_m % s.consumer_warpgroups or s.warpgroup_m not in (WGMMA_M, 2 * WGMMA_M):
        reasons.append(f"block_m {s.block_m} over {s.consumer_warpgroups} warpgroups is not one or two m64 tiles each")
    if s.block_n % 64 or not 64 <= s.block_n <= WGMMA_MAX_N:
        reasons.append(f"block_n {s.block_n} is not a multiple of 64 (one swizzle box) in 64..{WGMMA_MAX_N}")
    if s.accumulators > WGMMA_MAX_ACCUMULATORS:
        reasons.append(f"{s.accumulators} fp32 accumulators a thread exceed {WGMMA_MAX_ACCUMULATORS} (they would spill)")
    if s.stages < 3:
        reasons.append(f"stages {s.stages}: two buffers are held by the wgmmas in flight, the ring needs at least 3")
    if wgmma_smem_bytes(s) > target.smem_per_block:
        reasons.append(f"tile {s.key()} needs {wgmma_smem_bytes(s)} B of shared memory, over the target's "
                       f"{target.smem_per_block} B")
    if s.split_k < 1:
        reasons.append(f"split_k {s.split_k} (at least 1)")
    elif s.split_k > 1 and layout is not None and isinstance(s, WgmmaGemmSchedule):
        tiles = wgmma_tiles(layout, s)
        steps = math.ceil(layout.k / s.block_k)
        if tiles >= SPLIT_K_BLOCKS or tiles * s.split_k > 2 * SPLIT_K_BLOCKS:
            reasons.append(f"split_k {s.split_k} over {tiles} output tiles: split-K is for grids of fewer than "
                           f"{SPLIT_K_BLOCKS} tiles, to at most {2 * SPLIT_K_BLOCKS} blocks")
        if math.ceil(steps / s.split_k) < SPLIT_K_MIN_STEPS:
            reasons.append(f"split_k {s.split_k} leaves fewer than {SPLIT_K_MIN_STEPS} of the {steps} k steps a split")
        if layout.batch_size * s.split_k > MAX_GRID_YZ:
            reasons.append(f"batch {layout.batch_size} x split_k {s.split_k} exceeds the grid's z limit {MAX_GRID_YZ}")
    return reasons


def tma_matrix(operand: Term, rows: tuple[str, ...], k_axis: str, kmajor: bool,
               tensors: Mapping[str, TensorInfo]) -> tuple[int, int] | None:  # fmt: skip
    """``(inner, outer)`` extents of an operand read as a plain row-major matrix — its index
    is exactly its row axes then k (K-major) or k then its row axes (MN-major), over the
    tensor's whole shape, where dimensions of extent 1 read at 0 do not count (a batch of
    one: ``x[0, s, k]``) — for a 2-D TMA tensor map; None for any other read."""
    if operand[0] != "Tensor":
        return None
    order = (*rows, k_axis) if kmajor else (k_axis, *rows)
    kept = matrix_items(operand, tensors[operand[1]])
    if [ix for ix, _ in kept] != [t.ax(x) for x in order] or [size for _, size in kept] != [t.extent(x) for x in order]:
        return None
    rows_extent = math.prod(t.extent(x) for x in rows)
    k = t.extent(k_axis)
    return (k, rows_extent) if kmajor else (rows_extent, k)


def matrix_items(read: Term, info: TensorInfo) -> list[tuple[Term, int]]:
    """A read's index items with the extent of the dimension each indexes, as a row-major
    matrix sees them: dimensions of extent 1 read at 0 (or along an axis of extent 1) left
    out, and a dimension read ``a·n + b`` (``b`` an axis of extent ``n``: heads split off a
    projection's columns) counted as the two dimensions ``a`` and ``b``; two dimensions read
    ``a // n`` and ``a % n`` (tokens of a batch merged into one row axis: ``x[i // T, i % T]``)
    count as the one dimension ``a``."""
    kept: list[tuple[Term, int]] = []
    items = list(zip(t.ix_items(read[2]), info.shape))
    for position, (ix, size) in enumerate(items):
        if size == 1 and (ix == t.ix_lit(0) or (ix[0] == "Ax" and t.extent(ix[1]) == 1)):
            continue
        if ix[0] == "IxMod" and kept and kept[-1] == (("IxDiv", ix[1], ix[2]), items[position - 1][1]) and \
                ix[1][0] == "Ax" and size == ix[2] and kept[-1][1] * size == t.extent(ix[1][1]):  # fmt: skip
            kept[-1] = (ix[1], t.extent(ix[1][1]))
            continue
        if ix[0] == "IxLin" and ix[1][0] == "Ax" and ix[3][0] == "Ax" and t.extent(ix[3][1]) == ix[2] and \
                size == t.extent(ix[1][1]) * ix[2]:  # fmt: skip
            kept += [(ix[1], t.extent(ix[1][1])), (ix[3], ix[2])]
            continue
        kept.append((ix, size))
    return kept


def tma_problems(plan: TermKernelPlan, layout: GemmLayout | None) -> list[str]:
    """What the TMA kernel asks beyond the cp.async one (see :class:`TmaGemmSchedule`)."""
    s, reasons = plan.schedule, []
    if s.pingpong and not (s.persistent and s.consumer_warpgroups == 2):
        reasons.append("pingpong takes a persistent block of two consumer warpgroups (they take its tiles in turn)")
    if layout is None:
        return reasons
    if layout.batch_size != 1:
        reasons.append(f"batch {layout.batch_size}: the TMA kernel reads plain matrices (no batch)")
    for role, op, rows, kmajor in (("A", layout.a, layout.m_axes, layout.a_kmajor),
                                   ("B", layout.b, layout.n_axes, layout.b_kmajor)):  # fmt: skip
        if tma_matrix(op, rows, layout.k_axis, kmajor, plan.tensor_map) is None:
            reasons.append(f"operand {role} is not a plain row-major matrix read (the TMA kernel's tensor maps are 2-D)")
    return reasons + tma_store_problems(plan, layout)


def tma_store_problems(plan: TermKernelPlan, layout: GemmLayout) -> list[str]:
    """Why a TMA GEMM plan cannot stage its output for TMA stores (none without
    ``store_boxes``): the output must be a row-major ``M × N`` matrix with 16-byte rows,
    and a tile's boxes a whole number of rounds of the staging buffers; or, ``copy_out``,
    a row-major ``M × N`` matrix whose rows are not 16-byte aligned (where TMA stores can,
    they do), with no staged sources (TMA loads, which need the aligned rows too)."""
    s = plan.schedule
    if not s.store_boxes:
        reasons = ["staged sources go through the output's staging boxes (store_boxes > 0)"] if s.staged_sources else []
        return reasons + (["copy_out copies the staging boxes out (store_boxes > 0)"] if s.copy_out else [])
    reasons = []
    if s.store_boxes not in (1, 2, 4):
        reasons.append(f"store_boxes {s.store_boxes} (0, 1, 2 or 4 staging boxes a warpgroup)")
    elif (s.warpgroup_m // WGMMA_M) * (s.block_n // STORE_BOX) % s.store_boxes:
        reasons.append(f"a warpgroup's {s.warpgroup_m}x{s.block_n} tile is not a whole number of rounds of "
                       f"{s.store_boxes} {STORE_BOX}x{STORE_BOX} staging boxes")
    if tuple(a for a in plan.kernel.axes if t.extent(a) > 1) != tuple(a for a in (*layout.m_axes, *layout.n_axes)
                                                                  if t.extent(a) > 1):  # fmt: skip
        reasons.append("the output is not a row-major M x N matrix (TMA stores write a 2-D tensor map)")
    aligned = layout.n * DTYPE_BYTES[plan.output.dtype] % 16 == 0
    if not aligned and not s.copy_out:
        reasons.append(f"output rows of N {layout.n} are not a multiple of 16 bytes (a TMA store's row stride)")
    if aligned and s.copy_out:
        reasons.append(f"output rows of N {layout.n} are 16-byte aligned: TMA stores write them (copy_out is for "
                       "rows they cannot)")
    if s.copy_out and s.staged_sources:
        reasons.append("staged sources come by TMA loads, which need 16-byte rows: not with copy_out")
    sources = epilogue_sources(plan.kernel, layout, plan.tensor_map)
    if s.staged_sources > len(sources):
        reasons.append(f"{s.staged_sources} staged sources, but the epilogue reads {len(sources)} M x N source "
                       "matrices of the output's dtype")
    return reasons


def epilogue_sources(kernel: FusedKernel, layout: GemmLayout, tensors: Mapping[str, TensorInfo]) -> tuple[Term, ...]:
    """The reads of a GEMM kernel's epilogue that are whole row-major ``M × N`` matrices read
    at the output's own element (``r[m, n]``; unit dimensions read at 0 do not count) in the
    output's dtype — a residual, the other factor of a gated product — in a stable order:
    what a TMA kernel can load as boxes shaped like its output's (``staged_sources``)."""
    inside = set(t.subterms(layout.core))
    order = [t.ax(x) for x in (*layout.m_axes, *layout.n_axes) if t.extent(x) > 1]
    sizes = [t.extent(x) for x in (*layout.m_axes, *layout.n_axes) if t.extent(x) > 1]
    output_dtype = tensors[identifier(kernel.output)].dtype
    found = []
    for read in _reads(kernel.term):
        if read in inside or read in found:
            continue
        info = tensors[read[1]]
        kept = matrix_items(read, info)
        if ([ix for ix, _ in kept] == order and [size for _, size in kept] == sizes and info.dtype == output_dtype
                and info.dtype in ("bf16", "fp16")):  # fmt: skip
            found.append(read)
    return tuple(sorted(found, key=repr))


def shifted_cores(kernel: FusedKernel, layout: GemmLayout) -> dict[Term, int]:
    """Each ``Shifted(axis, δ, core)`` in a GEMM kernel's epilogue (an absorbed consumer's
    read of the contraction a few columns on: RoPE's partner) and its offset along the
    flattened N: ``δ`` times the extents of the N axes inside ``axis``."""
    result = {}
    for node in t.subterms(kernel.term):
        if node[0] == "Shifted" and node[1] in layout.n_axes:
            inner = layout.n_axes[layout.n_axes.index(node[1]) + 1:]
            result[node] = node[2] * math.prod(t.extent(a) for a in inner)
    return result


def shifted_problems(plan: TermKernelPlan, layout: GemmLayout | None) -> list[str]:
    """Why a GEMM plan cannot find its epilogue's shifted contractions among its own
    accumulators (none without any): only the TMA wgmma GEMM, whose thread holds whole
    rows of its tile's columns, can — where the offset is whole n8 fragments, the tile
    spans whole periods of the shifted axis (so the neighbour the guard admits is in the
    same tile), and the columns are stored in pairs."""
    shifted = [node for node in t.subterms(plan.kernel.term) if node[0] == "Shifted"]
    if not shifted or layout is None:
        return []
    s = plan.schedule
    if not isinstance(s, TmaGemmSchedule):
        return ["a contraction read a few columns on (an absorbed RoPE's partner) runs in the TMA wgmma GEMM only, "
                "whose threads hold whole rows of the tile"]
    reasons = []
    offsets = shifted_cores(plan.kernel, layout)
    for node in shifted:
        if node[3] != layout.core or node not in offsets:
            reasons.append(f"Shifted({node[1]}, {node[2]}) is not the kernel's contraction along an N axis")
            continue
        axis = node[1]
        period = math.prod(t.extent(a) for a in layout.n_axes[layout.n_axes.index(axis):])
        if offsets[node] % 8 or s.block_n % period:
            reasons.append(f"the contraction {node[2]:+d} along {axis} ({offsets[node]:+d} columns) is not whole n8 "
                           f"fragments inside tiles of {s.block_n} columns spanning whole periods of {period}")
    innermost = next((x for x in reversed(plan.kernel.axes) if t.extent(x) > 1), None)
    if plan.output.dtype not in ("bf16", "fp16") or innermost != layout.n_axes[-1] or t.extent(innermost) % 2:
        reasons.append("shifted contractions need the output's columns stored in 16-bit pairs")
    return reasons


def norm_problems(plan: TermKernelPlan, layout: GemmLayout | None) -> list[str]:
    """Why a GEMM plan cannot run its layout's absorbed RMSNorm (none without one): the mma
    GEMM does on the A operand; the TMA kernel on a K-major A, whole k steps, the weight in
    shared memory; the weight has the operands' dtype."""
    if layout is None or layout.norm is None:
        return []
    tma = isinstance(plan.schedule, TmaGemmSchedule)
    if not tma and not isinstance(plan.schedule, GemmSchedule):
        return ["an absorbed RMSNorm operand runs in the TMA wgmma GEMM or the mma.sync GEMM only"]
    reasons = []
    if layout.norm_operand != "a" or (tma and not layout.a_kmajor):
        reasons.append("the absorbed RMSNorm must normalise the rows of the A operand (K-major for TMA)")
    if tma and layout.k % WGMMA_BLOCK_K:
        reasons.append(f"K {layout.k} is not a multiple of {WGMMA_BLOCK_K} (the norm's weight is read a whole k step "
                       "at a time)")
    weight = layout.norm.weight
    if weight is not None and plan.tensor_map[weight[1]].dtype != layout.dtype:
        reasons.append(f"the norm's weight is {plan.tensor_map[weight[1]].dtype}, the operands {layout.dtype}")
    if tma and weight is not None and wgmma_smem_bytes(plan.schedule) + 2 * layout.k > plan.target.smem_per_block:
        reasons.append(f"the tile ring and the norm's weight ({2 * layout.k} B, static shared memory) exceed the "
                       f"target's {plan.target.smem_per_block} B")
    return reasons


def wgmma_tiles(layout: GemmLayout, schedule: WgmmaGemmSchedule | TmaGemmSchedule) -> int:
    """Output tiles of a wgmma GEMM (all batch entries)."""
    return math.ceil(layout.m / schedule.block_m) * math.ceil(layout.n / schedule.block_n) * layout.batch_size


def wgmma_schedules(layout: GemmLayout) -> list[WgmmaGemmSchedule | TmaGemmSchedule]:
    """The wgmma schedules offered for a GEMM: ``TMA_GEMM_SCHEDULES``,
    ``WGMMA_GEMM_SCHEDULES``, then each tile of ``WGMMA_SPLIT_K_TILES`` that has fewer than
    ``SPLIT_K_BLOCKS`` tiles with its split-K factor (see there); validity is still
    :func:`term_plan_problems`'s to say."""
    schedules: list[WgmmaGemmSchedule | TmaGemmSchedule] = [*TMA_GEMM_SCHEDULES, *WGMMA_GEMM_SCHEDULES]
    steps = math.ceil(layout.k / WGMMA_BLOCK_K)
    for tile in WGMMA_SPLIT_K_TILES:
        tiles, split = wgmma_tiles(layout, tile), 1
        while tiles * split < SPLIT_K_BLOCKS and math.ceil(steps / (2 * split)) >= SPLIT_K_MIN_STEPS:
            split *= 2
        if split > 1:
            schedules.append(replace(tile, split_k=split))
    return schedules


def term_plan_problems(plan: TermKernelPlan) -> list[str]:
    """Why a plan is invalid; empty when it is valid."""
    s, kernel = plan.schedule, plan.kernel
    reasons = []
    if plan.kind not in TERM_KINDS:
        reasons.append(f"unknown kernel kind {plan.kind!r}")
    if plan.output.shape != kernel.stored_shape:
        reasons.append(f"output {plan.output.name} has shape {plan.output.shape}, the kernel writes {kernel.stored_shape}")
    missing = sorted(set(kernel.reads) - {i.name for i in plan.inputs})
    if missing:
        reasons.append(f"no shape/dtype for tensors {missing}")
    if kernel.buffer is not None and not (isinstance(s, PointwiseSchedule) and s.vector == 1):
        reasons.append("a buffer laid out for its consumer is written by the unvectorised pointwise family only")
    if isinstance(s, PointwiseSchedule):
        if s.block not in (32, 64, 128, 256, 512, 1024):
            reasons.append(f"block {s.block}")
        if s.vector > 1:
            inner = kernel.axes[-1] if kernel.axes else None
            if plan.kind != "elementwise":
                reasons.append("vectorised pointwise kernels are elementwise only")
            elif inner is None or t.extent(inner) % s.vector:
                reasons.append(f"innermost extent is not a multiple of vector {s.vector}")
            elif plan.output.dtype not in ("bf16", "fp16", "fp32") or s.vector * DTYPE_BYTES[plan.output.dtype] > 16:
                reasons.append(f"vector {s.vector} of {plan.output.dtype}")
    elif isinstance(s, RowSchedule):
        layout = row_layout(kernel)
        if layout is None:
            reasons.append("the kernel has no row form or reduction at its core")
        if s.threads % 32 or not 32 <= s.threads <= 1024:
            reasons.append(f"threads {s.threads} is not a multiple of 32 in [32, 1024]")
        if s.cached and layout is not None:
            if not layout.writes_row or s.mode == "thread":
                reasons.append("a cached row needs a row form written by a warp or a block")
            elif math.ceil(layout.extent / (s.lanes * s.vector)) * s.vector > MAX_CACHED_ITEMS:
                reasons.append(f"a row of {layout.extent} is over {MAX_CACHED_ITEMS} values a lane for {s.lanes} lanes")
        if s.vector > 1 and layout is not None:
            reasons.extend(row_vector_problems(plan, layout))
    elif isinstance(s, GemmSchedule):
        reasons.extend(mma_problems(kernel, plan.tensor_map, plan.output))
        layout = gemm_layout(kernel, plan.tensor_map)
        reasons.extend(norm_problems(plan, layout))
        reasons.extend(shifted_problems(plan, layout))
        if s.block_k % 16 or s.warp_m % 16 or s.warp_n % 16 or s.block_m % s.warps_m or s.block_n % s.warps_n:
            reasons.append(f"tile {s.key()} does not split into m16n8k16 tiles (warp tiles multiples of 16)")
        if s.stages < 2:
            reasons.append(f"stages {s.stages}: the ring needs at least 2")
        if gemm_smem_bytes(s) > plan.target.smem_per_block:
            reasons.append(f"tile {s.key()} needs {gemm_smem_bytes(s)} B of shared memory, over the target's "
                           f"{plan.target.smem_per_block} B")
        if layout is not None and math.ceil(layout.m / s.block_m) > MAX_GRID_YZ:
            reasons.append(f"M {layout.m} needs more than {MAX_GRID_YZ} row tiles")
    elif isinstance(s, WgmmaGemmSchedule):
        layout = gemm_layout(kernel, plan.tensor_map)
        reasons.extend(wgmma_problems(plan))
        reasons.extend(norm_problems(plan, layout))
        reasons.extend(shifted_problems(plan, layout))
    elif isinstance(s, TmaGemmSchedule):
        layout = gemm_layout(kernel, plan.tensor_map)
        reasons.extend(wgmma_problems(plan))
        reasons.extend(tma_problems(plan, layout))
        reasons.extend(norm_problems(plan, layout))
        reasons.extend(shifted_problems(plan, layout))
    else:
        reasons.append(f"unknown schedule {type(s).__name__}")
    return reasons


def row_vector_problems(plan: TermKernelPlan, layout: RowLayout) -> list[str]:
    """Why a row plan cannot move ``vector`` consecutive row elements a lane at a time."""
    s, kernel = plan.schedule, plan.kernel
    reasons = []
    if not s.cached:
        reasons.append("vectorised rows keep their values in registers (cached)")
    if s.vector not in ROW_VECTORS:
        reasons.append(f"vector {s.vector} (one of {ROW_VECTORS})")
    if layout.extent % s.vector:
        reasons.append(f"row extent {layout.extent} is not a multiple of vector {s.vector}")
    if not kernel.axes or kernel.axes[-1] != layout.axis or plan.output.dtype not in ("bf16", "fp16", "fp32"):
        reasons.append("vectorised rows store along the output's innermost axis, which must be the row axis (floats)")
    if not any(r in t.subterms(layout.operands[0]) for r in row_vector_reads(plan, layout)):
        reasons.append("no read of the row's operand is contiguous along the row axis")
    return reasons


def row_vector_reads(plan: TermKernelPlan, layout: RowLayout) -> list[Term]:
    """The reads of a row kernel's term that vector accesses load along the row axis."""
    return vector_reads(plan.kernel.term, layout.axis, plan.tensor_map)


def kernel_tensors(
    kernel: FusedKernel, shapes: Mapping[str, tuple[int, ...]], dtypes: Mapping[str, str]
) -> tuple[TensorInfo, ...]:
    """The kernel's reads (sorted by name) and its output, with their shapes and dtypes."""
    missing = [n for n in (*kernel.reads, kernel.output) if n not in shapes or n not in dtypes]
    if missing:
        raise CodegenError(f"kernel {kernel.output}: no shape/dtype for {missing}")
    names = sorted(kernel.reads)
    infos = [TensorInfo(identifier(n), tuple(shapes[n]), dtypes[n]) for n in names]
    infos.append(TensorInfo(identifier(kernel.output), tuple(kernel.stored_shape), dtypes[kernel.output]))
    return tuple(infos)


def term_plans(
    kernel: FusedKernel,
    shapes: Mapping[str, tuple[int, ...]],
    dtypes: Mapping[str, str],
    target: Target,
    trace: tuple[str, ...] = (),
) -> list[TermKernelPlan]:
    """Every generic plan of one fused kernel on a target, best guesses first.

    elementwise: pointwise × block {128, 256, 512} × vector {1, 16 B} (vector where the
    innermost extent allows); row forms: one warp a row, one block of 256 or 512 a row
    (where the row axis is contiguous in memory), one thread a row; reductions: the same
    where the reduced axis is contiguous, and pointwise (one thread an output); contractions:
    on sm_90a targets the wgmma GEMM at each schedule of :func:`wgmma_schedules` that fits
    (plain 16-bit operands only; split-K for grids of few tiles), then the mma GEMM at each tile shape and pipeline depth of
    ``GEMM_SCHEDULES`` that fits, and pointwise (one thread an output, a serial loop over
    k); flash attention (when no flash plan fits): pointwise."""
    tensors = kernel_tensors(kernel, shapes, dtypes)
    output = tensors[-1]
    schedules: list[Schedule] = []
    if kernel.kind == "elementwise":
        vector = 16 // DTYPE_BYTES[output.dtype] if output.dtype in ("bf16", "fp16", "fp32") else 1
        vectors = (1, vector) if vector > 1 and kernel.axes and t.extent(kernel.axes[-1]) % vector == 0 else (1,)
        schedules = [PointwiseSchedule(b, v) for v in reversed(vectors) for b in POINTWISE_BLOCKS]
    elif kernel.kind in ROW_KINDS or kernel.kind == "reduction":
        layout = row_layout(kernel)
        if layout is not None:
            schedules = (
                [*ROW_SCHEDULES, *(replace(r, vector=v) for v in ROW_VECTORS for r in ROW_SCHEDULES if r.cached)]
                if layout.contiguous
                else [RowSchedule("thread", 128), RowSchedule("warp", 128)]
            )
        if kernel.kind == "reduction" or layout is None:
            schedules += [PointwiseSchedule(256), PointwiseSchedule(128)]
    elif kernel.kind == "contraction":
        info = {i.name: i for i in tensors}
        if not mma_problems(kernel, info, output):
            schedules = list(GEMM_SCHEDULES) + [PointwiseSchedule(256)]
            if target.family == "wgmma":
                schedules = [*wgmma_schedules(gemm_layout(kernel, info)), *schedules]
        else:
            schedules = [PointwiseSchedule(256), PointwiseSchedule(128)]
    else:
        schedules = [PointwiseSchedule(128)]
    plans = [TermKernelPlan(kernel.kind, kernel, s, target, tensors, trace) for s in schedules]
    return [p for p in plans if not term_plan_problems(p)]
