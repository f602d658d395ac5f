"""Kernel plans: what the derivation hands to code generation.

A plan is one fused kernel form (its problem: shapes, dtypes, attributes) times one
schedule (tile sizes, warps, pipeline, layout knobs) for one target. The schedule ruleset
enumerates schedules as e-graph alternatives and guards each with the resource estimates
defined here, so the e-graph never offers a plan the target cannot hold. The code
generator lays the plan out concretely (``cherenkov.codegen.plan``) and a test keeps its
shared-memory total equal to :func:`flash_smem_bytes`.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from cherenkov.rewrites.plan_sm90a import HopperFlashSchedule
    from cherenkov.rewrites.plan_fp8 import Fp8FlashSchedule

ELEMENT_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4, "fp8_e4m3": 1, "fp8_e5m2": 1}
ATTENTION_DTYPES = ("bf16", "fp16")
ATTENTION_HEAD_DIMS = tuple(range(8, 257, 8))
"""Head dims (of q·k and of v) the ``mma.sync`` flash family plans: multiples of 8 (16-byte rows) up to 256,
each held as :func:`padded_head_dim` columns (a whole k16 step of ``Q Kᵀ``, whole pairs of n8 tiles of
``P V``); the Hopper family plans the same at 16 bits (:mod:`cherenkov.rewrites.plan_sm90a`)."""


def padded_head_dim(dim: int) -> int:
    """The columns an ``mma.sync`` flash tile holds for a head dim: ``dim`` rounded up to a multiple of 16, the
    columns past it zeros (Stable Diffusion's 40 is held as 48: ``Q Kᵀ``'s third k16 step reads zeros)."""
    return -(-dim // 16) * 16
MAX_REGISTERS_PER_THREAD = 255


@dataclass(frozen=True)
class Target:
    """A CUDA compilation target and the per-block budgets its schedules must respect.

    ``family`` is its newest tensor-core instruction family: every target runs the
    ``mma.sync`` kernels, a ``wgmma`` target (``sm_90a``) the Hopper kernels as well."""

    name: str
    compute_capability: int
    smem_per_block: int
    family: Literal["mma_sync", "wgmma"] = "mma_sync"
    regs_per_sm: int = 65536
    max_threads_per_sm: int = 2048
    smem_per_sm: int = 0  # shared memory of one SM (0: smem_per_block + 1 KB)
    block_scale: bool = False  # mma.sync with MX block scales (kind::mxf8f6f4.block_scale: sm_120a)

    @property
    def smem_per_multiprocessor(self) -> int:
        return self.smem_per_sm or self.smem_per_block + 1024

    @property
    def has_tma(self) -> bool:
        """The target has the tensor memory accelerator (``cp.async.bulk.tensor``: sm_90 and later)."""
        return self.compute_capability >= 90

    @property
    def arch_flag(self) -> str:
        """The nvcc/NVRTC architecture flag (``sm_90``, ``sm_90a``, ...)."""
        return self.name


TARGETS: dict[str, Target] = {
    "sm_80": Target("sm_80", 80, 163 * 1024, smem_per_sm=164 * 1024),
    "sm_86": Target("sm_86", 86, 99 * 1024, max_threads_per_sm=1536, smem_per_sm=100 * 1024),
    "sm_89": Target("sm_89", 89, 99 * 1024, max_threads_per_sm=1536, smem_per_sm=100 * 1024),
    "sm_90": Target("sm_90", 90, 227 * 1024, smem_per_sm=228 * 1024),
    # Hopper with its architecture-specific features (wgmma, TMA, setmaxnreg): both families
    "sm_90a": Target("sm_90a", 90, 227 * 1024, family="wgmma", smem_per_sm=228 * 1024),
    "sm_120": Target("sm_120", 120, 99 * 1024, max_threads_per_sm=1536, smem_per_sm=100 * 1024),
    # Blackwell GeForce with its architecture-specific features: block-scaled (MX) mma.sync
    "sm_120a": Target("sm_120a", 120, 99 * 1024, max_threads_per_sm=1536, smem_per_sm=100 * 1024, block_scale=True),
}

SMEM_RESERVED_PER_BLOCK = 1024
"""Shared memory the driver reserves per resident block (sm_80 and later)."""


ATTENTION_ROLES = ("q", "k", "v", "o")
LAYOUT_ALIGN = 8
"""Elements (16 bytes of 16-bit data) every operand stride and offset is a multiple of: the
unit of a cp.async copy and of a TMA descriptor's strides."""


@dataclass(frozen=True)
class OperandLayout:
    """Where one attention operand lives in its stored tensor (of ``shape``, row-major):
    element ``(b, h, s, d)`` at ``offset + b·batch + h·head + s·seq + d`` — the head
    dimension contiguous, every other axis at any stride. A slice of a fused QKV
    projection is an offset, ``view(B, S, H, D).transpose(1, 2)`` a head stride of ``D``
    and a sequence stride of ``H·D``; for k and v, ``h`` is the K/V head."""

    shape: tuple[int, ...]
    batch: int
    head: int
    seq: int
    offset: int = 0

    @classmethod
    def contiguous(cls, shape: tuple[int, int, int, int]) -> OperandLayout:
        """The layout of a contiguous ``(B, H, S, D)`` tensor."""
        _, heads, seq, dim = shape
        return cls(tuple(shape), heads * seq * dim, seq * dim, dim)

    def strides(self) -> tuple[int, int, int]:
        return self.batch, self.head, self.seq

    def addresses_like(self, other: OperandLayout, logical: tuple[int, int, int, int]) -> bool:
        """Whether both place every element of a ``logical`` (B, H, S, D) operand at the same
        offset in tensors of as many elements (strides of axes of extent 1 do not matter)."""
        same = all(mine == theirs or size == 1
                   for mine, theirs, size in zip(self.strides(), other.strides(), logical[:3]))  # fmt: skip
        return same and self.offset == other.offset and math.prod(self.shape) == math.prod(other.shape)


@dataclass(frozen=True)
class LseOutput:
    """A flash-attention kernel's second output: each query row's log-sum-exp of the scaled,
    masked scores (natural log, fp32; what a forward pass saves for its backward), row
    ``(b, h, s)`` at ``offset + b·batch + h·head + s·seq`` of the tensor ``tensor`` of ``shape``
    (:class:`OperandLayout`'s fields, the head dim absent)."""

    tensor: str
    layout: OperandLayout

    @classmethod
    def from_json(cls, data: dict) -> LseOutput:
        layout = data["layout"]
        return cls(data["tensor"], OperandLayout(**{**layout, "shape": tuple(layout["shape"])}))


BIAS_DTYPES = ("bf16", "fp16", "fp32")
"""Dtypes of an additive attention bias."""


@dataclass(frozen=True)
class AttentionBias:
    """The bias tensor of a flash-attention problem (an additive mask), read in place: score
    ``(b, h, i, j)`` gains ``tensor[offset + b·batch + h·head + i·row + j·key]`` (``−∞``
    masks it). A stride of 0 broadcasts (a mask shared by the heads); ``h`` is the query
    head. A row whose every score is masked attends to nothing and gives 0 (PyTorch's safe
    softmax)."""

    tensor: str
    dtype: str
    shape: tuple[int, ...]
    batch: int
    head: int
    row: int
    key: int
    offset: int = 0

    @classmethod
    def from_json(cls, data: dict) -> AttentionBias:
        return cls(**{**data, "shape": tuple(data["shape"])})


@dataclass(frozen=True)
class ScaleFactor:
    """A per-tensor, per-batch or per-head fp32 factor of an attention problem (an 8-bit
    operand's descale), read once a block: ``tensor[offset + b·batch + (h // group)·head]``
    for batch ``b`` and query head ``h`` (a stride of 0: the same factor for every one)."""

    tensor: str
    shape: tuple[int, ...]
    batch: int = 0
    head: int = 0
    group: int = 1
    offset: int = 0

    @classmethod
    def from_json(cls, data: dict) -> ScaleFactor:
        return cls(**{**data, "shape": tuple(data["shape"])})


@dataclass(frozen=True)
class BlockScales:
    """The MX scales of an 8-bit q or k (``e8m0``, one per 32 elements of the head dim): the
    scale of element ``(b, h, s, d)`` is ``tensor[offset + b·batch + h·head + s·row + (d // 32)·block]``
    (``h`` the query head for q, the K/V head for k)."""

    tensor: str
    shape: tuple[int, ...]
    batch: int
    head: int
    row: int
    block: int
    offset: int = 0

    @classmethod
    def from_json(cls, data: dict) -> BlockScales:
        return cls(**{**data, "shape": tuple(data["shape"])})


@dataclass(frozen=True)
class AttentionProblem:
    """One flash-attention kernel: ``o = softmax(scale · q kᵀ [+ bias] [+ causal mask]) v``.

    ``kv_heads`` divides ``heads``; query head ``h`` reads K/V head ``h // (heads //
    kv_heads)`` (GQA/MQA). Causal follows PyTorch's ``is_causal``: query ``i`` sees keys
    ``j <= i``; with a sliding ``window`` W > 0 it sees keys ``i − W < j ≤ i``, or without ``causal`` (a
    window about the query, ModernBERT's local attention) ``i − W < j ≤ i + window_ahead``; the kernels
    skip the key tiles outside it (``window`` 0: none). ``scale`` 0 means ``head_dim ** -0.5``; a
    negative scale is not supported.
    ``head_dim`` is the extent of the q·k contraction, ``value_dim`` that of v and o (0: the
    same as ``head_dim``; MLA-style models use 192 and 128).
    The tensor names are validated identifiers of the user's graph (q, k and v may name
    one tensor: slices of a fused projection). ``layouts`` places q, k, v and o in their
    stored tensors (:class:`OperandLayout`, in ``ATTENTION_ROLES`` order); empty: each is
    a contiguous BHSD tensor of its own. ``bias`` is a tensor added to the scores
    (:class:`AttentionBias`; with ``causal``, the causal mask applies after it: ALiBi). ``score_factors`` multiply the
    scores and ``out_factors`` the output (:class:`ScaleFactor`: 8-bit operands' descales, moved
    out of the contractions by the ``scales`` rules); ``out_dtype`` is o's dtype when it is not
    the operands' (8-bit operands write a 16- or 32-bit output); ``lse``, where the graph wants
    it, the rows' log-sum-exp the kernel also writes (:class:`LseOutput`). ``softcap`` > 0 caps
    the scaled scores before the mask or bias: ``softcap·tanh(scale·q kᵀ / softcap)`` (Gemma 2's
    logit soft cap); 0: none.
    """

    batch: int
    heads: int
    kv_heads: int
    seq_q: int
    seq_kv: int
    head_dim: int
    dtype: str = "bf16"
    causal: bool = False
    scale: float = 0.0
    q: str = "q"
    k: str = "k"
    v: str = "v"
    out: str = "o"
    layouts: tuple[OperandLayout, ...] = ()
    value_dim: int = 0
    bias: AttentionBias | None = None
    score_factors: tuple[ScaleFactor, ...] = ()
    out_factors: tuple[ScaleFactor, ...] = ()
    out_dtype: str = ""
    q_block_scales: BlockScales | None = None
    k_block_scales: BlockScales | None = None
    lse: LseOutput | None = None
    softcap: float = 0.0
    window: int = 0
    window_ahead: int = 0

    def __post_init__(self) -> None:
        if self.window < 0 or self.window_ahead < 0 or (self.window_ahead and (self.causal or not self.window)):
            raise ValueError(f"a sliding window of {self.window} keys, {self.window_ahead} ahead (valid: 0 for "
                             "none, or a positive window; keys ahead only in a window without the causal mask)")

    @property
    def upper_edge(self) -> int | None:
        """The last key query ``i`` sees is ``i`` plus this (0: causal; a window's keys ahead), None
        where every key is (no causal mask, no window)."""
        if self.causal:
            return 0
        return self.window_ahead if self.window else None

    @property
    def short_query_band(self) -> bool:
        """Whether the short-query kernels (packed rows, key splits) take the problem's causal mask or window:
        none, or one whose last query sees the last key (the first sees key 0 under any band, and each query's band
        is the last one's moved a key back: every key is some query's) and every query at least half the keys (the
        kernels visit every key tile; a narrower band would waste more than half their work). So: a chunk of
        queries after a KV cache, causal against the last key (``j ≤ i + Skv − Sq``) or under a sliding window over
        its full cache."""
        upper = self.upper_edge
        if upper is None:
            return True
        fewest = min(self.seq_kv, upper + 1)  # the first query's keys
        if self.window:  # the last query's, between its window's lower edge and its upper one
            fewest = min(fewest, min(self.seq_kv - 1, self.seq_q - 1 + upper) - max(0, self.seq_q - self.window) + 1)
        return self.seq_q - 1 + upper >= self.seq_kv - 1 and 2 * fewest >= self.seq_kv

    @property
    def output_dtype(self) -> str:
        """o's dtype (``out_dtype``, or the operands' when it is empty)."""
        return self.out_dtype or self.dtype

    @property
    def factors(self) -> tuple[ScaleFactor, ...]:
        """The score factors, then the output factors: the tensors a kernel reads after q, k, v, o."""
        return self.score_factors + self.out_factors

    @property
    def v_dim(self) -> int:
        """The head dim of v and o (``value_dim``, or ``head_dim`` when it is 0)."""
        return self.value_dim or self.head_dim

    @property
    def group_size(self) -> int:
        return self.heads // self.kv_heads

    @property
    def strided(self) -> bool:
        """Whether any operand is other than a contiguous BHSD tensor of its own."""
        return any(
            not self.layout(role).addresses_like(OperandLayout.contiguous(self.logical_shape(role)), self.logical_shape(role))
            for role in ATTENTION_ROLES
        )

    def logical_shape(self, role: str) -> tuple[int, int, int, int]:
        """The ``(B, H, S, D)`` shape of an operand (``H`` the K/V heads for k and v)."""
        dim = self.v_dim if role in ("v", "o") else self.head_dim
        if role in ("k", "v"):
            return self.batch, self.kv_heads, self.seq_kv, dim
        return self.batch, self.heads, self.seq_q, dim

    def name(self, role: str) -> str:
        """The tensor holding the operand ``role`` (``q``, ``k``, ``v`` or ``o``)."""
        return {"q": self.q, "k": self.k, "v": self.v, "o": self.out}[role]

    def layout(self, role: str) -> OperandLayout:
        """Where the operand ``role`` lives in its stored tensor."""
        if self.layouts:
            return self.layouts[ATTENTION_ROLES.index(role)]
        return OperandLayout.contiguous(self.logical_shape(role))

    def stored_shapes(self) -> dict[str, tuple[int, ...]]:
        """Stored tensor name -> shape, inputs and output (one entry for a shared tensor), the
        bias tensor among them."""
        shapes = {self.name(role): self.layout(role).shape for role in ATTENTION_ROLES}
        if self.bias is not None:
            shapes[self.bias.tensor] = self.bias.shape
        for factor in self.factors:
            shapes[factor.tensor] = factor.shape
        for scales in (self.q_block_scales, self.k_block_scales):
            if scales is not None:
                shapes[scales.tensor] = scales.shape
        if self.lse is not None:
            shapes[self.lse.tensor] = self.lse.layout.shape
        return shapes

    @property
    def shares_kv_head(self) -> bool:
        """Whether k or v is one head read for every K/V head (a head stride of 0 over several: DiffLlama's
        halves of v)."""
        return self.kv_heads > 1 and any(self.layout(role).head == 0 for role in ("k", "v"))

    def layout_problems(self) -> list[str]:
        """Why the layouts cannot be read with 16-byte copies; empty when they can."""
        return list(self._layout_problems)

    @functools.cached_property
    def _layout_problems(self) -> tuple[str, ...]:
        # once a problem: the schedule enumeration asks it for hundreds of thousands of schedules
        reasons = []
        for role in ATTENTION_ROLES:
            layout = self.layout(role)
            if any(v % LAYOUT_ALIGN for v in (*layout.strides(), layout.offset)):
                reasons.append(f"{role}'s strides {layout.strides()} and offset {layout.offset} are not multiples of "
                               f"{LAYOUT_ALIGN} elements (16-byte copies)")
        return tuple(reasons)

    def softcap_problems(self) -> list[str]:
        """Why the soft cap is not one a kernel applies; empty when it is (or there is none)."""
        if math.isfinite(self.softcap) and self.softcap >= 0:
            return []
        return [f"soft cap {self.softcap} (valid: a finite positive cap, or 0 for none)"]

    @classmethod
    def from_json(cls, data: dict) -> AttentionProblem:
        """The problem of its ``asdict`` JSON form (as a plan's ``params`` record it)."""
        values = dict(data)
        values["layouts"] = tuple(
            OperandLayout(**{**layout, "shape": tuple(layout["shape"])}) for layout in values.get("layouts", ())
        )
        if values.get("bias") is not None:
            values["bias"] = AttentionBias.from_json(values["bias"])
        for key in ("score_factors", "out_factors"):
            values[key] = tuple(ScaleFactor.from_json(f) for f in values.get(key, ()))
        for key in ("q_block_scales", "k_block_scales"):
            if values.get(key) is not None:
                values[key] = BlockScales.from_json(values[key])
        if values.get("lse") is not None:
            values["lse"] = LseOutput.from_json(values["lse"])
        return cls(**values)

    @property
    def window_scores(self) -> int:
        """The scores a window keeps, over every row of one head: keys ``i − W < j ≤ i + ahead`` of the
        sequence (0 without a window): ``Σ_i min(Skv, i + ahead + 1) − Σ_i max(0, i − W + 1)``."""
        if not self.window:
            return 0
        short = min(max(self.seq_kv - self.window_ahead, 0), self.seq_q)  # rows whose last key is i + ahead
        ends = short * (short - 1) // 2 + short * (self.window_ahead + 1) + (self.seq_q - short) * self.seq_kv
        cut = max(0, self.seq_q - self.window + 1)  # rows whose window starts past key 0
        return ends - cut * (cut - 1) // 2

    @property
    def flops(self) -> float:
        """Matmul FLOPs, ``2·B·H·Sq·Skv·(D + D_v)`` (``4·B·H·Sq·Skv·D`` when ``D_v = D``), halved
        for causal (the usual convention); with a window, those of the scores it keeps."""
        full = 2.0 * self.batch * self.heads * self.seq_q * self.seq_kv * (self.head_dim + self.v_dim)
        if self.window:  # the scores a window keeps
            return full * self.window_scores / (self.seq_q * self.seq_kv)
        return full / 2 if self.causal else full

    def shapes(self) -> dict[str, tuple[int, ...]]:
        """Tensor name -> logical BHSD shape of the kernel's inputs and its output."""
        return {self.name(role): self.logical_shape(role) for role in ATTENTION_ROLES}


@dataclass(frozen=True)
class FlashSchedule:
    """Schedule knobs of the ``mma.sync`` flash-attention kernel family.

    ``block_q`` query rows per thread block, split over ``warps`` (16 or 32 rows a warp);
    ``block_kv`` keys per main-loop step; ``stages`` K/V tile buffers in the cp.async ring;
    ``kv_split`` waits for K and V in separate cp.async groups (QKᵀ starts while V lands)
    instead of one group per stage; ``swizzle`` XOR-swizzles shared-memory rows (no bank
    conflicts for ldmatrix); ``ldmatrix_x`` loads 2 or 4 8x8 matrices per ldmatrix.

    ``overlap`` issues the next key tile's ``Q Kᵀ`` before the current tile's softmax (two S
    register tiles, one block barrier a tile, so the tensor cores work while the softmax
    runs); ``min_blocks`` is ``__launch_bounds__``' minimum resident blocks per SM (1: no
    register cap below 255; more caps registers at ``65536 / (min_blocks · threads)``).
    ``pingpong`` splits the block's 8 warps into two groups whose matmul phases alternate
    (warps ``w`` and ``w + 4`` share a scheduler partition: one issues ``P_(j-1)V_(j-1) +
    Q K_jᵀ`` on the tensor cores while the other runs its softmax), separated by block
    barriers; ``lazy_rescale`` keeps a stale row max while a tile raises it by at most
    2^8 (skips the O rescale, exact after the final normalisation); ``head_major`` orders
    the grid heads-fastest so that every head's longest causal tile runs first.

    Two knobs of the joint K/V ring (lazy rescale, at least 2 stages): ``late_copy`` issues
    the copy of tile ``j + stages − 1`` after tile ``j``'s softmax instead of before its
    scores (the scores' ldmatrix no longer queue behind the copies); ``mbarrier_ring``
    replaces the block barrier of every tile by per-stage mbarriers — a stage is *full*
    when every thread's copies into it have landed (``cp.async.mbarrier.arrive``) and
    *empty* when every warp has done its P·V with it — so warps wait only for the data they
    read and the stage they refill. ``tma_kv`` (mbarrier ring, sm_90 and later) fills each stage
    with TMA boxes issued by one thread (K and V tiles stored as 64-column boxes with the
    128-byte swizzle; one ``expect_tx`` arrival a stage) instead of every thread's cp.async
    copies.

    Three knobs of the TMA ring's tile step: ``row_sums_mma`` sums each row's probabilities
    on the tensor cores (P, already the A operand of P·V, times a B operand of ones: one more
    mma per m16 tile and k16 step instead of an FADD per probability); ``q_prescaled`` (with
    ``row_sums_mma``, early copies) multiplies the Q tile by ``scale·log2 e`` once, in shared
    memory, and starts each tile's first QKᵀ mma from the rows' negated offsets, so the
    scores arrive as exponents (no FMA per score); ``last_warp_refill`` (with
    ``q_prescaled``) drops the *empty* barriers: the last warp to release a stage starts the
    tile ``stages`` ahead into it at once, so no thread waits for the others to refill the
    ring. On the TMA ring a block may also hold 256 rows (8 warps of 32).

    Two knobs for short queries (decode, speculative decoding, chunked prefill), where one
    head's few query rows leave an mma tile and the GPU empty: ``pack_group`` packs the
    query rows of every query head of a K/V head into the block's rows (packed row ``r`` is
    query ``r / G`` of the group's head ``r % G``), so one block serves the whole GQA group
    with one pass over its K/V; ``kv_splits`` splits the keys over that many blocks, each
    folding its share into a partial state (its normalised O and log-sum-exp, written to a
    workspace), and the last block of a query tile to finish combines the partial states
    into the output (the fold's associativity, rule ``flash-split-kv``). Short-query blocks
    may hold 16 or 32 rows (1 or 2 warps), or 16 rows folded by 2 or 4 warps that split each
    key tile's keys between them (``warp_keys``: a decode block's few rows cost a whole m16
    tile of mma work per key, so its warps divide the keys instead of the rows; their
    partial states meet in shared memory at the end). Hopper places a block's warps on its
    four scheduler partitions in order, so only a block of 4 warps reaches all of an SM's
    tensor cores.
    """

    block_q: int = 128
    block_kv: int = 64
    warps: int = 4
    stages: int = 2
    kv_split: bool = True
    swizzle: bool = True
    ldmatrix_x: int = 4
    pingpong: bool = False
    lazy_rescale: bool = False
    head_major: bool = False
    overlap: bool = False
    min_blocks: int = 1
    late_copy: bool = False
    mbarrier_ring: bool = False
    tma_kv: bool = False
    row_sums_mma: bool = False
    q_prescaled: bool = False
    last_warp_refill: bool = False
    kv_splits: int = 1
    pack_group: bool = False
    warp_keys: bool = False

    @property
    def threads(self) -> int:
        return 32 * self.warps

    @property
    def rows_per_warp(self) -> int:
        return self.block_q if self.warp_keys else self.block_q // self.warps

    @property
    def short_query(self) -> bool:
        """Whether a short-query knob is on: a packed group, key splits, fewer than 4 warps or
        warps that split the keys."""
        return self.pack_group or self.kv_splits > 1 or self.warps < 4 or self.warp_keys

    @property
    def keys_per_warp(self) -> int:
        """Keys of each key tile one warp folds (all of them unless ``warp_keys``)."""
        return self.block_kv // self.warps if self.warp_keys else self.block_kv

    @property
    def plain(self) -> bool:
        """No knob of issue 6 (pingpong, lazy rescale, head-major grid, overlap, min_blocks, late
        copy, mbarrier ring, TMA copies and the ring's step knobs) is on."""
        return not (self.pingpong or self.lazy_rescale or self.head_major or self.overlap or self.min_blocks > 1
                    or self.late_copy or self.mbarrier_ring or self.tma_kv or self.row_sums_mma
                    or self.q_prescaled or self.last_warp_refill)

    @property
    def register_cap(self) -> int:
        """Registers a thread may use under ``__launch_bounds__(threads, min_blocks)``."""
        return min(MAX_REGISTERS_PER_THREAD, 8 * (65536 // (self.min_blocks * self.threads) // 8))

    def key(self) -> str:
        """A short stable name, e.g. ``q128_kv64_w4_s2_split_swz_x4`` (``_pp``, ``_lazy``, ``_hm``,
        ``_ov``, ``_mb3``, ``_late``, ``_mbar``, ``_tma``, ``_rs``, ``_qs``, ``_lwr`` appended for
        pingpong, lazy rescale, head-major order, overlap, a minimum of 3 blocks per SM, late
        copies, the mbarrier ring, TMA copies, row sums on the tensor cores, a pre-scaled Q,
        the last warp's refill; ``_sk8``, ``_pack`` and ``_wk`` for 8 key splits, a packed GQA
        group and warps that split the keys)."""
        return (
            f"q{self.block_q}_kv{self.block_kv}_w{self.warps}_s{self.stages}"
            f"_{'split' if self.kv_split else 'joint'}_{'swz' if self.swizzle else 'lin'}"
            f"_x{self.ldmatrix_x}{'_pp' if self.pingpong else ''}{'_lazy' if self.lazy_rescale else ''}"
            f"{'_hm' if self.head_major else ''}{'_ov' if self.overlap else ''}"
            f"{f'_mb{self.min_blocks}' if self.min_blocks > 1 else ''}"
            f"{'_late' if self.late_copy else ''}{'_mbar' if self.mbarrier_ring else ''}"
            f"{'_tma' if self.tma_kv else ''}{'_rs' if self.row_sums_mma else ''}"
            f"{'_qs' if self.q_prescaled else ''}{'_lwr' if self.last_warp_refill else ''}"
            f"{f'_sk{self.kv_splits}' if self.kv_splits > 1 else ''}{'_pack' if self.pack_group else ''}"
            f"{'_wk' if self.warp_keys else ''}"
        )


FLASH_KNOBS: dict[str, tuple] = {
    "block_q": (64, 128, 256),
    "block_kv": (32, 64, 128),
    "warps": (4, 8),
    "stages": (1, 2, 3),
    "kv_split": (True, False),
    "swizzle": (True, False),
    "ldmatrix_x": (2, 4),
    "pingpong": (False, True),
    "lazy_rescale": (False, True),
    "head_major": (False, True),
    "overlap": (False, True),
    "min_blocks": (1, 3),
    "late_copy": (False, True),
    "mbarrier_ring": (False, True),
    "tma_kv": (False, True),
    "row_sums_mma": (False, True),
    "q_prescaled": (False, True),
    "last_warp_refill": (False, True),
}
"""The knob space of long queries (prefill); :data:`SHORT_QUERY_KNOBS` adds the short-query one."""

SHORT_QUERY_KNOBS: dict[str, tuple] = {
    "rows": ((16, 1, False), (32, 2, False), (64, 4, False), (16, 2, True), (16, 4, True)),
    "block_kv": (32, 64, 128),
    "stages": (2, 3),
    "ring": ("split", "mbarrier", "tma"),
    "kv_splits": (1, 2, 4, 8, 16, 32, 64),
    "pack_group": (False, True),
}
"""Short-query schedules (packed rows at most ``SHORT_QUERY_ROWS``): ``rows`` is (block_q, warps,
warp_keys) — 16 rows a warp, or 16 rows whose keys 2 or 4 warps split — with one of three rings — cp.async with split K/V groups, the cp.async mbarrier ring, the TMA ring (both
with the lazy rescale) — crossed with the key splits and the group packing."""

SHORT_QUERY_ROWS = 256
"""Rows (queries, times the group when packed) up to which a problem is a short query: the
short-query knobs apply, and a prefill block of 128 rows would leave the GPU nearly idle."""

MIN_TILES_PER_SPLIT = 2
"""Key tiles each split folds at least (fewer: the partial states cost more than they save)."""

SPLIT_GRID_BLOCKS = 528
"""Key splits only for grids below this many blocks unsplit (4 waves of a 132-SM H200): a
larger grid already fills the GPU."""

RING_STEP_KNOBS = ("row_sums_mma", "q_prescaled", "last_warp_refill")
"""The knobs of the TMA ring's tile step (all False elsewhere)."""

TMA_BOX_COLUMNS = 64
"""Elements of one TMA box row: 128 bytes, the widest the 128-byte swizzle allows."""

TMA_ALIGN_BYTES = 1024
"""Alignment of a 128-byte-swizzled TMA box in shared memory (one swizzle atom of 8 rows);
a TMA flash kernel rounds its dynamic shared-memory base up to it, so it asks for that
much more."""

def tile_row_elements(head_dim: int, value_dim: int = 0) -> int:
    """Elements of one shared-memory tile row (Q, K, V and the staged O alike): the wider of
    the two head dims, rounded up to a power of two of at least 64 (128 bytes), so that the
    XOR swizzle permutes whole 128-byte rows and an ldmatrix step's offset is an XOR
    (:mod:`cherenkov.codegen.cuda.ldmatrix`); head dims 32, 80, 96 and 192 pad their rows."""
    return max(64, 1 << (max(head_dim, value_dim) - 1).bit_length())


def flash_smem_bytes(schedule: FlashSchedule, head_dim: int, dtype: str, value_dim: int = 0) -> int:
    """Shared memory of one block: the Q tile plus ``stages`` (K tile + V tile) buffers, rows
    of :func:`tile_row_elements` (and, with TMA copies, the slack that aligns the base to a
    swizzle atom)."""
    row = tile_row_elements(head_dim, value_dim) * ELEMENT_BYTES[dtype]
    q_tile = schedule.block_q * row
    kv_tiles = 2 * schedule.block_kv * row
    return q_tile + schedule.stages * kv_tiles + (TMA_ALIGN_BYTES if schedule.tma_kv else 0)


def flash_register_estimate(schedule: FlashSchedule, head_dim: int, value_dim: int = 0) -> int:
    """Registers a thread needs: O and S accumulators (fp32) plus addressing overhead.

    Each warp owns ``rows_per_warp / 16`` m16 tiles; an m16×n8 fp32 accumulator is four
    registers a thread. P reuses S's registers (not in the pingpong, see below), Q fragments
    are reloaded from shared memory unless they fit (``keeps_q_in_registers``).
    """
    m_tiles = schedule.rows_per_warp // 16
    o_acc = m_tiles * (padded_head_dim(value_dim or head_dim) // 8) * 4
    s_acc = m_tiles * (schedule.keys_per_warp // 8) * 4
    # The pingpong keeps P (packed, half of S) across the barrier into the next matmul phase,
    # next to O and the S being accumulated (ptxas: q256/kv64 spills 356 B, q256/kv32 none).
    p_packed = s_acc // 2 if schedule.pingpong else 0
    # The overlap keeps the next tile's S beside the current one.
    s_next = s_acc if schedule.overlap else 0
    return o_acc + s_acc + p_packed + s_next + 40


def flash_schedule_problems(schedule: FlashSchedule, problem: AttentionProblem, target: Target) -> list[str]:
    """Why a schedule is invalid for a problem on a target; empty when it is valid.

    Besides the hard limits (dtype, head dim, rows a warp, shared memory, registers) this
    prunes combinations that can never win, so that the search (and CI, which compiles every
    seed plan for three targets) does not spend time on them:

    * the unswizzled layout and ldmatrix x2 are baselines: the first costs 8-way bank
      conflicts on every ldmatrix, the second twice the ldmatrix instructions for the same
      bytes (H200: 87 TFLOP/s unswizzled, x2 no better than x4), so each is kept at 2 split
      stages only and never crossed with the issue-6 knobs;
    * one stage with joint K/V groups loads each tile while nothing computes; the split
      choreography of one stage overlaps K_(j+1) with P·V and V_j with QKᵀ, so it wins;
    * a 256-row block runs as a pingpong of two 4-warp groups or on the TMA ring: with block
      barriers or the cp.async mbarrier ring it is two q128/w4 blocks fused by barriers, with
      the same residency and no gain (H200, sixth session: 398 against 407 TFLOP/s); on the
      TMA ring, one block an SM whose K/V tiles serve 8 warps, it gains 3-10 % with early
      copies (eighth session: seed 427 against 399);
    * the pingpong needs 8 warps (two per scheduler partition, one of each group) and at
      least 2 stages (its ring buffers K_j with V_(j-1)); its pipeline has no separate K/V
      groups, so ``kv_split`` is fixed to False there (one plan, not two identical ones).
      Measured on the H200 it loses 8-20% to the best plain schedule on every shape (the
      matmul half-steps of the four partitions' active warps read shared memory at once,
      benchmarks/NOTES.md), so only its best measured forms are kept: 2 stages (3 measured
      the same), 64-key tiles at 16 rows a warp and 32-key tiles at 32 rows (128-key tiles
      spill: ptxas 116 B with P and S live together; 32 rows with 64 keys spill 356 B), and
      no lazy rescale (it spills 32-56 B there);
    * the head-major grid only for causal problems: without a mask every block costs the
      same, and the q-major order keeps one head's K/V in L2 for all its query tiles;
    * the overlap (two S tiles) only at 16 rows a warp: with 32 rows O alone is 128
      registers and ptxas spills 108-248 B (measured 8-12% slower than the plain 32-row
      schedule); it runs on the unit ring of the pingpong (joint groups, at least 2 stages);
    * ``min_blocks`` above 1 only for 4-warp blocks, where it caps registers below 255 (else
      it is the same kernel) and the blocks fit the SM's shared memory and threads; 8-warp
      blocks at 2 per SM get 128 registers and spill (ptxas: 96 B);
    * ``late_copy`` and ``mbarrier_ring`` only on the joint ring (one copy group a tile, at
      least 2 stages) with the lazy rescale, the form of every joint winner they were
      measured with (H200: each of the four combinations wins on some tile size);
    * ``tma_kv`` only on the mbarrier ring (its full barrier counts the boxes' bytes) and on
      targets with TMA (sm_90 and later), with a head dim that is a whole number of 64-column
      boxes;
    * the three step knobs only on the TMA ring, where they were measured (H200, eighth
      session): ``row_sums_mma`` there; ``q_prescaled`` with ``row_sums_mma`` (its softmax
      form is written for it) and early copies (late: no gain); ``last_warp_refill`` with
      ``q_prescaled`` (a late copy has no place in it anyway) — alone it measured 1 % under
      the empty barriers, and ``q_prescaled`` without it 1 % under the plain ring (its bare
      exponentials burst on the SFU while the empty barrier keeps the warps in step), while
      the two together gain 3 %.
    """
    reasons = problem.layout_problems() + problem.softcap_problems()
    if problem.dtype not in ATTENTION_DTYPES:
        reasons.append(f"dtype {problem.dtype} (valid: {', '.join(ATTENTION_DTYPES)})")
    if problem.head_dim not in ATTENTION_HEAD_DIMS or problem.v_dim not in ATTENTION_HEAD_DIMS:
        reasons.append(f"head dims {problem.head_dim} (q, k) and {problem.v_dim} (v) (valid: multiples of 8 up to "
                       f"{ATTENTION_HEAD_DIMS[-1]})")
    if schedule.block_q % schedule.warps or schedule.rows_per_warp not in (16, 32):
        reasons.append(f"block_q {schedule.block_q} over {schedule.warps} warps is not 16 or 32 rows a warp")
    reasons += _short_query_problems(schedule, problem)
    if (not schedule.swizzle or schedule.ldmatrix_x == 2) and (
        schedule.stages != 2 or not schedule.kv_split or not schedule.plain
    ):
        reasons.append("the unswizzled layout and ldmatrix x2 are baselines: 2 stages, split, no issue-6 knob")
    if schedule.stages == 1 and not schedule.kv_split:
        reasons.append("one stage with joint K/V groups overlaps no copy with compute (split does)")
    if schedule.block_q == 256 and not (schedule.pingpong or schedule.tma_kv):
        reasons.append("a 256-row block needs the pingpong or the TMA ring")
    if schedule.pingpong and (schedule.warps != 8 or schedule.stages != 2 or schedule.kv_split
                              or schedule.block_kv != 1024 // schedule.rows_per_warp or schedule.overlap
                              or schedule.min_blocks > 1 or schedule.lazy_rescale):
        reasons.append("the pingpong runs with 8 warps, 2 stages, joint groups, "
                       "block_kv = 1024 / rows a warp (64 or 32), no other knob")
    if schedule.head_major and not problem.causal:
        reasons.append("the head-major grid order is for causal problems only")
    if schedule.overlap and (schedule.pingpong or schedule.stages < 2 or schedule.kv_split
                             or schedule.rows_per_warp != 16):
        reasons.append("the overlap needs 16 rows a warp, at least 2 stages and joint K/V groups")
    if (schedule.late_copy or schedule.mbarrier_ring) and (
        schedule.kv_split or schedule.stages < 2 or schedule.pingpong or schedule.overlap or not schedule.lazy_rescale
    ):
        reasons.append("late copies and the mbarrier ring need the joint ring (2+ stages, no pingpong or overlap) "
                       "with the lazy rescale")
    if schedule.tma_kv and not schedule.mbarrier_ring:
        reasons.append("TMA copies need the mbarrier ring")
    if schedule.tma_kv and not target.has_tma:
        reasons.append(f"TMA copies need sm_90 or later ({target.name} has no TMA)")
    if schedule.tma_kv and (problem.v_dim != problem.head_dim
                            or tile_row_elements(problem.head_dim) != problem.head_dim):
        reasons.append(f"TMA copies need one head dim of 64, 128 or 256 for q, k and v (got {problem.head_dim}"
                       f" and {problem.v_dim})")
    if schedule.tma_kv and problem.shares_kv_head:
        reasons.append("TMA copies of k or v shared by the K/V heads (a head stride of 0: no tensor map moves by 0)")
    if schedule.row_sums_mma and not schedule.tma_kv:
        reasons.append("row sums on the tensor cores need the TMA ring")
    if schedule.q_prescaled and not (schedule.row_sums_mma and not schedule.late_copy):
        reasons.append("a pre-scaled Q needs row sums on the tensor cores and early copies")
    if schedule.q_prescaled and problem.softcap:
        reasons.append("a pre-scaled Q starts the scores from the row max, which a soft cap (tanh) cannot follow")
    if schedule.last_warp_refill and not schedule.q_prescaled:
        reasons.append("the last warp's refill needs a pre-scaled Q")
    if schedule.min_blocks > 1 and schedule.warps != 4:
        reasons.append("min_blocks above 1 only for 4-warp blocks (8-warp blocks get 128 registers and spill)")
    smem = flash_smem_bytes(schedule, problem.head_dim, problem.dtype, problem.v_dim)
    if smem > target.smem_per_block:
        reasons.append(f"shared memory {smem} B exceeds {target.name}'s {target.smem_per_block} B")
    regs = flash_register_estimate(schedule, problem.head_dim, problem.v_dim)
    if regs > schedule.register_cap:
        reasons.append(f"about {regs} registers a thread exceeds {schedule.register_cap}")
    if schedule.min_blocks > 1:
        if schedule.register_cap >= MAX_REGISTERS_PER_THREAD:
            reasons.append(f"min_blocks {schedule.min_blocks} does not cap {schedule.threads}-thread blocks "
                           "(the same kernel as min_blocks 1)")
        resident = schedule.min_blocks * (smem + SMEM_RESERVED_PER_BLOCK)
        if resident > target.smem_per_multiprocessor:
            reasons.append(f"{schedule.min_blocks} blocks of {smem} B do not fit {target.name}'s shared memory")
        if schedule.min_blocks * schedule.threads > target.max_threads_per_sm:
            reasons.append(f"{schedule.min_blocks} blocks of {schedule.threads} threads exceed {target.name}'s threads")
    return reasons


def packed_rows(schedule: FlashSchedule, problem: AttentionProblem) -> int:
    """Query rows of one block row space: ``Sq`` per query head, ``Sq·G`` per K/V head when packed."""
    return problem.seq_q * problem.group_size if schedule.pack_group else problem.seq_q


def query_tiles(schedule: FlashSchedule, problem: AttentionProblem) -> int:
    """Query tiles of one row space (a head, or a K/V head's packed group)."""
    return math.ceil(packed_rows(schedule, problem) / schedule.block_q)


def key_tiles_per_split(schedule: FlashSchedule, problem: AttentionProblem) -> int:
    """Key tiles each split folds (the last split may fold fewer)."""
    return math.ceil(math.ceil(problem.seq_kv / schedule.block_kv) / schedule.kv_splits)


def _short_query_problems(schedule: FlashSchedule, problem: AttentionProblem) -> list[str]:
    """Why the short-query knobs (packing, key splits, 1- and 2-warp blocks) do not apply."""
    reasons = []
    if not schedule.short_query:
        return reasons
    if schedule.warp_keys and (schedule.block_q != 16 or schedule.warps not in (2, 4) or schedule.keys_per_warp < 16):
        reasons.append("warps split a key tile's keys in 16-row blocks of 2 or 4 warps, at least 16 keys a warp")
    if schedule.warp_keys:
        merge = schedule.warps * schedule.block_q * (padded_head_dim(problem.v_dim) + 1) * 4
        stages = schedule.stages * 2 * schedule.block_kv * tile_row_elements(problem.head_dim, problem.value_dim) \
            * ELEMENT_BYTES.get(problem.dtype, 2)
        if merge > stages:
            reasons.append(f"the warps' partial states ({merge} B) do not fit the ring's stages ({stages} B)")
    if packed_rows(schedule, problem) > SHORT_QUERY_ROWS:
        reasons.append(f"packing, key splits and blocks under 4 warps are for short queries "
                       f"(at most {SHORT_QUERY_ROWS} rows a head or packed group)")
    if not problem.short_query_band:
        reasons.append(f"packing, key splits and blocks under 4 warps take a causal mask or window only where the last "
                       f"query sees the last key and every query half the keys (Sq {problem.seq_q}, Skv "
                       f"{problem.seq_kv}, window {problem.window}, {problem.upper_edge} keys ahead: a chunk after a KV "
                       f"cache)")
    if schedule.rows_per_warp != 16 or schedule.pingpong or schedule.overlap or schedule.min_blocks > 1 \
            or schedule.head_major or any(getattr(schedule, knob) for knob in RING_STEP_KNOBS):
        reasons.append("short-query schedules run 16 rows a warp on the plain loop without step knobs")
    if schedule.pack_group and problem.group_size == 1:
        reasons.append("packing needs a GQA group (heads > kv_heads)")
    if schedule.kv_splits > 1:
        key_tiles = math.ceil(problem.seq_kv / schedule.block_kv)
        per_split = key_tiles_per_split(schedule, problem)
        if per_split < MIN_TILES_PER_SPLIT or (schedule.kv_splits - 1) * per_split >= key_tiles:
            reasons.append(f"{schedule.kv_splits} key splits of {key_tiles} key tiles: each split needs at least "
                           f"{MIN_TILES_PER_SPLIT} tiles and none may be empty")
        row_spaces = problem.batch * (problem.kv_heads if schedule.pack_group else problem.heads)
        if row_spaces * query_tiles(schedule, problem) >= SPLIT_GRID_BLOCKS:
            reasons.append(f"key splits only for grids under {SPLIT_GRID_BLOCKS} blocks unsplit")
    return reasons


@dataclass(frozen=True)
class KernelPlan:
    """One fused kernel form × one schedule × one target: the unit the search measures."""

    kind: Literal["flash_attention"]
    problem: AttentionProblem
    schedule: FlashSchedule | HopperFlashSchedule | Fp8FlashSchedule
    target: Target
    trace: tuple[str, ...] = field(default=(), compare=False)

    def params(self) -> dict:
        """Plain-JSON description (problem, schedule, target) for reports and databases."""
        problem = asdict(self.problem)
        if not problem["value_dim"]:
            del problem["value_dim"]  # one D for q, k and v: the names plans had before D_v
        if problem["bias"] is None:
            del problem["bias"]  # no bias: the names plans had before biases
        for key in ("window", "window_ahead"):
            if not problem[key]:
                del problem[key]  # no window: the names plans had before windows
        for key in ("score_factors", "out_factors", "out_dtype", "q_block_scales", "k_block_scales"):
            if not problem[key]:
                del problem[key]  # 16-bit operands: the names plans had before 8-bit ones
        schedule = asdict(self.schedule)
        for knob, plain in (("kv_splits", 1), ("pack_group", False), ("warp_keys", False)):
            if schedule.get(knob, plain) == plain:
                schedule.pop(knob, None)  # the names long-query plans had before these knobs
        return {
            "kind": self.kind,
            "problem": problem,
            "schedule": schedule,
            "target": self.target.name,
        }

    @functools.cached_property
    def name(self) -> str:
        """A stable identifier: kind, schedule key and a short hash of everything."""
        digest = hashlib.sha256(json.dumps(self.params(), sort_keys=True).encode()).hexdigest()[:10]
        return f"{self.kind}_{self.schedule.key()}_{digest}"
