"""Codegen-side plan data: concrete layouts and tilings of a plan, and compile records.

:class:`KernelPlan` (re-exported from :mod:`cherenkov.rewrites.plan`) says *what* to build.
This module derives *how*: :class:`FlashLayout` places the Q tile and each pipeline stage's
K and V tiles in shared memory (its total equals ``flash_smem_bytes``), :class:`FlashTiling`
splits the block's work over warps and mma tiles. :class:`ResourceReport` and
:class:`CompiledKernel` record what a compilation produced.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from cherenkov.rewrites.plan import (
    ELEMENT_BYTES,
    AttentionProblem,
    FlashSchedule,
    KernelPlan,
    TMA_ALIGN_BYTES,
    TMA_BOX_COLUMNS,
    Target,
    flash_register_estimate,
    flash_schedule_problems,
    key_tiles_per_split,
    padded_head_dim,
    query_tiles,
    tile_row_elements,
)
from cherenkov.rewrites.schedule import flash_schedules

__all__ = [
    "KernelPlan",
    "FlashLayout",
    "FlashTiling",
    "ResourceReport",
    "CompiledKernel",
    "valid_flash_plans",
]


def valid_flash_plans(problem: AttentionProblem, target: Target) -> list[KernelPlan]:
    """Every valid ``mma.sync`` flash-attention plan of a problem on a target: the schedules
    of the knob spaces (:func:`~cherenkov.rewrites.schedule.flash_schedules`, enumerated once
    a process) that fit the problem, in their order."""
    return [
        KernelPlan("flash_attention", problem, schedule, target)
        for schedule in flash_schedules(problem.head_dim, target, problem.value_dim)
        if not flash_schedule_problems(schedule, problem, target)
    ]

CHUNK_BYTES = 16
"""One cp.async / ldmatrix row / vector store: 16 bytes, eight 16-bit elements."""

SWIZZLE_ROWS = 8
"""The XOR swizzle permutes the 16-byte chunks of a row by ``row % 8``: 8 chunks = 128 B = all 32 banks."""

Q_REGISTER_BUDGET = 208
"""Q fragments stay in registers when the register estimate plus their registers fits this."""


@dataclass(frozen=True)
class FlashLayout:
    """Shared memory of one flash-attention block, in bytes from the dynamic smem base.

    ``[Q tile][stage 0: K tile, V tile][stage 1: K tile, V tile]...``. Every tile is ``rows ×
    head_dim`` elements (V and the staged O ``rows × value_dim``) at a row pitch of
    ``row_bytes``: :func:`~cherenkov.rewrites.plan.tile_row_elements` of the two head dims, so
    that rows narrower than a power of two of at least 128 bytes are padded. With
    ``swizzle`` the 16-byte chunk ``c`` of row ``r`` sits at chunk position
    ``c ^ (r % 8)`` of its row; without, at ``c``. The Q tile is reused to stage the
    output for 16-byte stores once the main loop is done.

    With ``tma_kv`` each K and V tile is ``kv_boxes`` TMA boxes of 64 columns instead: box
    ``b`` holds columns ``[64 b, 64 b + 64)`` as ``block_kv`` rows of 128 bytes with the
    copy engine's 128-byte swizzle (chunk ``c`` of row ``r`` at ``c ^ (r % 8)``), and the
    launch asks for ``TMA_ALIGN_BYTES`` more so that the kernel can align the base.
    """

    block_q: int
    block_kv: int
    head_dim: int
    stages: int
    element_bytes: int
    swizzle: bool
    tma_kv: bool = False
    value_dim: int = 0

    @classmethod
    def from_plan(cls, plan: KernelPlan) -> FlashLayout:
        s, p = plan.schedule, plan.problem
        return cls(s.block_q, s.block_kv, p.head_dim, s.stages, ELEMENT_BYTES[p.dtype], s.swizzle, s.tma_kv,
                   p.value_dim)  # fmt: skip

    @property
    def row_bytes(self) -> int:
        """The pitch of every tile row (padded past the head dims where they are narrower)."""
        return tile_row_elements(self.head_dim, self.value_dim) * self.element_bytes

    @property
    def chunks_per_row(self) -> int:
        """16-byte chunks of a Q or K tile row (:func:`padded_head_dim` columns)."""
        return padded_head_dim(self.head_dim) * self.element_bytes // CHUNK_BYTES

    @property
    def value_chunks(self) -> int:
        """16-byte chunks of a V or O tile row (:func:`padded_head_dim` columns)."""
        return padded_head_dim(self.value_dim or self.head_dim) * self.element_bytes // CHUNK_BYTES

    @property
    def data_chunks(self) -> int:
        """The chunks of a Q or K row that a copy reads (``head_dim`` elements); the rest are zero-filled."""
        return self.head_dim * self.element_bytes // CHUNK_BYTES

    @property
    def value_data_chunks(self) -> int:
        """The chunks of a V row that a copy reads and of an O row that a store writes (``value_dim`` elements)."""
        return (self.value_dim or self.head_dim) * self.element_bytes // CHUNK_BYTES

    @property
    def q_offset(self) -> int:
        return 0

    @property
    def q_tile_bytes(self) -> int:
        return self.block_q * self.row_bytes

    @property
    def kv_tile_bytes(self) -> int:
        return self.block_kv * self.row_bytes

    @property
    def kv_offset(self) -> int:
        """Start of stage 0 (its K tile)."""
        return self.q_offset + self.q_tile_bytes

    @property
    def stage_bytes(self) -> int:
        return 2 * self.kv_tile_bytes

    def k_offset(self, stage: int) -> int:
        return self.kv_offset + stage * self.stage_bytes

    def v_offset(self, stage: int) -> int:
        return self.k_offset(stage) + self.kv_tile_bytes

    @property
    def tiles_bytes(self) -> int:
        """The packed tiles, from the (aligned) base."""
        return self.kv_offset + self.stages * self.stage_bytes

    @property
    def align_slack(self) -> int:
        """Bytes the launch adds so that the kernel can align its base for TMA boxes."""
        return TMA_ALIGN_BYTES if self.tma_kv else 0

    @property
    def total_bytes(self) -> int:
        """Dynamic shared memory of one block (``flash_smem_bytes``)."""
        return self.tiles_bytes + self.align_slack

    @property
    def box_row_bytes(self) -> int:
        return TMA_BOX_COLUMNS * self.element_bytes

    @property
    def kv_boxes(self) -> int:
        """TMA boxes per K or V tile (``tma_kv``): one per 64 columns."""
        return self.head_dim // TMA_BOX_COLUMNS

    @property
    def kv_box_bytes(self) -> int:
        return self.block_kv * self.box_row_bytes

    @property
    def swizzle_pattern(self) -> str:
        return f"chunk ^ (row % {SWIZZLE_ROWS})" if self.swizzle else "linear"

    def chunk_offset(self, row: int, chunk: int) -> int:
        """Byte offset of 16-byte chunk ``chunk`` of row ``row`` inside a tile."""
        position = chunk ^ (row % SWIZZLE_ROWS) if self.swizzle else chunk
        return row * self.row_bytes + position * CHUNK_BYTES

    def kv_chunk_offset(self, row: int, chunk: int) -> int:
        """Byte offset of 16-byte chunk ``chunk`` of row ``row`` inside a K or V tile."""
        if not self.tma_kv:
            return self.chunk_offset(row, chunk)
        per_box = self.box_row_bytes // CHUNK_BYTES
        box, position = divmod(chunk, per_box)
        return box * self.kv_box_bytes + row * self.box_row_bytes + (position ^ (row % SWIZZLE_ROWS)) * CHUNK_BYTES


@dataclass(frozen=True)
class FlashTiling:
    """How a block's work is split: warps own ``rows_per_warp`` query rows (``m_tiles`` m16
    tiles); S is ``kv_ntiles`` n8 tiles wide, O ``d_ntiles``; QKᵀ takes ``d_steps`` k16 steps,
    PV ``kv_steps``. Q fragments live in registers when ``q_in_registers``, else they are
    re-read from shared memory each step. ``q_tiles`` counts the query tiles of one row space
    (a head, or a packed K/V head group), ``row_heads`` the row spaces of a batch element;
    with key splits each tile is folded by ``kv_splits`` blocks of ``tiles_per_split`` key
    tiles."""

    m_tiles: int
    kv_ntiles: int
    kv_steps: int
    d_ntiles: int
    d_steps: int
    q_tiles: int
    kv_tiles: int
    q_in_registers: bool
    row_heads: int = 1
    batch: int = 1
    kv_splits: int = 1
    tiles_per_split: int = 0
    block_q: int = 0
    value_dim: int = 0

    @classmethod
    def from_plan(cls, plan: KernelPlan) -> FlashTiling:
        s, p = plan.schedule, plan.problem
        m_tiles = s.rows_per_warp // 16
        return cls(
            m_tiles=m_tiles,
            kv_ntiles=s.keys_per_warp // 8,
            kv_steps=s.keys_per_warp // 16,
            d_ntiles=padded_head_dim(p.v_dim) // 8,
            d_steps=padded_head_dim(p.head_dim) // 16,
            q_tiles=query_tiles(s, p),
            kv_tiles=math.ceil(p.seq_kv / s.block_kv),
            q_in_registers=keeps_q_in_registers(s, p.head_dim, p.value_dim),
            row_heads=p.kv_heads if s.pack_group else p.heads,
            batch=p.batch,
            kv_splits=s.kv_splits,
            tiles_per_split=key_tiles_per_split(s, p),
            block_q=s.block_q,
            value_dim=padded_head_dim(p.v_dim),
        )

    @property
    def grid(self) -> tuple[int, int, int]:
        """The launch grid: (query tiles × key splits, heads or K/V heads, batch)."""
        return self.q_tiles * self.kv_splits, self.row_heads, self.batch

    @property
    def split_tiles(self) -> int:
        """Query tiles whose key splits meet in the workspace (0 without splits)."""
        return self.q_tiles * self.row_heads * self.batch if self.kv_splits > 1 else 0

    @property
    def workspace_floats(self) -> int:
        """fp32 words of the key splits' workspace: every split's normalised O rows and their
        log2-sum-exps, then one arrival counter per query tile (0 without splits)."""
        partials = self.split_tiles * self.kv_splits * self.block_q
        return partials * (self.value_dim + 1) + self.split_tiles


def keeps_q_in_registers(schedule: FlashSchedule, head_dim: int, value_dim: int = 0) -> bool:
    """Whether a warp's Q fragments (4 registers per m16×k16 tile) fit beside O and S."""
    q_registers = (schedule.rows_per_warp // 16) * (padded_head_dim(head_dim) // 16) * 4
    return flash_register_estimate(schedule, head_dim, value_dim) + q_registers <= Q_REGISTER_BUDGET


@dataclass(frozen=True)
class ResourceReport:
    """What ptxas reported for one kernel (``-Xptxas -v``), plus the launch's dynamic smem."""

    registers: int
    smem_static: int
    smem_dynamic: int
    spill_stores: int
    spill_loads: int
    stack_frame: int
    wgmma_serialized: bool = False
    """ptxas serialised the wgmma instructions of the module's kernels (its "Potential Performance
    Loss" notes): correct, but each waits for the one before."""
    wgmma_fenced: bool = False
    """ptxas injected ``warpgroup.arrive`` or ``warpgroup.wait`` into the module's kernels (its C7517
    and C7519 notes: registers of a wgmma used where the source did not fence them), waits the
    source did not ask for."""

    @property
    def spill_bytes(self) -> int:
        return self.spill_stores + self.spill_loads


@dataclass(frozen=True)
class CompiledKernel:
    """One plan compiled for one architecture: where its binary is and what it uses."""

    plan: KernelPlan
    arch: str
    kernel_name: str
    cubin_path: Path
    ptx_path: Path
    report: ResourceReport
    compile_seconds: float
    source_hash: str
    compiler: str
    cache_hit: bool = False
