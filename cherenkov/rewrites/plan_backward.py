"""Flash-attention backward plans: the gradients of one attention, and the schedules computing them.

An :class:`AttentionBackwardProblem` is one attention — its forward :class:`AttentionProblem`
(q, k, v, the scale, the causal mask or a bias tensor, their layouts) — with the gradient of its
output, dO, and the gradients wanted: any of dq, dk and dv, each written to a buffer of its own
layout.
The derivation reaches it from ``ck.grad`` of the forward (:mod:`cherenkov.rewrites.gradients`):
``dS = P∘(dP − D)`` with ``P = e^{s − LSE}`` recomputed and ``D = rowsum(dO∘O)``, and three
streaming contractions ``dq = c·Σ_j dS·k``, ``dk = c·Σ_i dS·q``, ``dv = Σ_i P·dO``.

The backward runs in three launches: a statistics pass over the keys per query tile (the
forward once more: each row's log-sum-exp and ``D``, with ``O`` kept in registers; or, where the
forward saved its output and log-sum-exp (:class:`SavedStatistics`), a pass that reads them
and computes only ``D``), the main
pass — one block per key tile, holding dk and dv for its keys while the query tiles stream
past (dq accumulates in fp32: by atomic adds, four floats a reduction in the ``wgmma`` pass) —
and dq's conversion to its dtype. The main
pass is either ``mma.sync`` (warps of 16 keys; every target) or, with ``wgmma`` (sm_90a),
two warpgroups of 64 keys whose five products are Hopper ``wgmma`` instructions on
128-byte-swizzled shared-memory tiles; its statistics pass is then ``wgmma`` too (two
warpgroups of 64 query rows). A :class:`BackwardSchedule` picks the key and query
tiles, whether the streamed tiles are double-buffered, and the main pass's instructions;
:func:`backward_schedule_problems` says why a schedule does not fit a problem on a target.
"""

from __future__ import annotations

import functools
import hashlib
import json
from dataclasses import asdict, dataclass, field
from typing import Literal

from cherenkov.rewrites.plan import (
    LAYOUT_ALIGN,
    MAX_REGISTERS_PER_THREAD,
    SMEM_RESERVED_PER_BLOCK,
    AttentionProblem,
    OperandLayout,
    Target,
)
from cherenkov.rewrites.plan_sm90a import SWIZZLE_ALIGN

GRADIENT_ROLES = ("dq", "dk", "dv")
BACKWARD_HEAD_DIMS = (16, 32, 48, 64, 80, 96, 112, 128, 160, 192, 256)
"""Head dims (one for q, k and v) the backward family plans: whole k16 steps up to 128 (16, 48, 80 and 112
split a dq tile into 16-column parts only on the 4-warp, 64-query schedules); past 128 a block holds
half of dk's, dv's and dq's columns (``dim_parts`` 2)."""
MAX_WHOLE_HEAD_DIM = 128
"""The widest head dim whose dk and dv (all columns) a 16-key warp holds; wider ones are split in
``dim_parts``."""
BACKWARD_DTYPES = ("bf16", "fp16")
PAD = 8
"""Elements each shared-memory row is padded by: 16 bytes, so that the 8 rows an ldmatrix phase
reads start in 8 different bank groups."""
STATISTICS_ROWS = 64
"""Query rows of one block of the statistics pass (4 warps of 16)."""
STATISTICS_KEYS = 64
"""Keys of one step of the statistics pass."""


@dataclass(frozen=True)
class GradientOutput:
    """One gradient the problem writes: ``role`` (dq, dk or dv), the buffer, and where each
    element ``(b, h, s, d)`` lies in it (``h`` the query head for dq, the K/V head for dk, dv)."""

    role: str
    tensor: str
    layout: OperandLayout

    @classmethod
    def from_json(cls, data: dict) -> GradientOutput:
        layout = data["layout"]
        return cls(data["role"], data["tensor"], OperandLayout(**{**layout, "shape": tuple(layout["shape"])}))


@dataclass(frozen=True)
class SavedStatistics:
    """What the forward pass saved for its backward: its output ``o`` (placed like q, with the value
    dim) and each query row's log-sum-exp ``lse`` of the scaled, masked scores (natural log, fp32;
    ``lse_layout`` gives the row ``(b, h, s)`` its batch, head and sequence strides; its shape is the
    stored tensor's)."""

    o: str
    o_layout: OperandLayout
    lse: str
    lse_layout: OperandLayout

    @classmethod
    def from_json(cls, data: dict) -> SavedStatistics:
        def layout(d: dict) -> OperandLayout:
            return OperandLayout(**{**d, "shape": tuple(d["shape"])})

        return cls(data["o"], layout(data["o_layout"]), data["lse"], layout(data["lse_layout"]))


@dataclass(frozen=True)
class AttentionBackwardProblem:
    """The gradients of ``o = softmax(scale · q kᵀ [causal mask]) v`` given ``dO``.

    ``attention`` places q, k and v (its ``o`` layout is unused); ``grad_output`` names dO and
    ``grad_output_layout`` places it like q; ``gradients`` lists the wanted gradients in
    ``GRADIENT_ROLES`` order, each with its buffer; ``saved``, where the graph holds them, the
    forward's output and log-sum-exp. Tensor names are validated identifiers."""

    attention: AttentionProblem
    grad_output: str
    grad_output_layout: OperandLayout
    gradients: tuple[GradientOutput, ...]
    saved: SavedStatistics | None = None

    @property
    def out(self) -> str:
        """The kernel's first output (the buffer it is named by)."""
        return self.attention.out

    @property
    def roles(self) -> tuple[str, ...]:
        return tuple(g.role for g in self.gradients)

    def gradient(self, role: str) -> GradientOutput | None:
        return next((g for g in self.gradients if g.role == role), None)

    @property
    def outputs(self) -> tuple[str, ...]:
        """The buffers written, in ``GRADIENT_ROLES`` order."""
        return tuple(g.tensor for g in self.gradients)

    def stored_shapes(self) -> dict[str, tuple[int, ...]]:
        """Stored tensor name -> shape of every tensor read or written (one entry for a shared one)."""
        a = self.attention
        shapes = {a.name(role): a.layout(role).shape for role in ("q", "k", "v")}
        shapes[self.grad_output] = self.grad_output_layout.shape
        shapes.update((g.tensor, g.layout.shape) for g in self.gradients)
        if self.saved is not None:
            shapes[self.saved.o] = self.saved.o_layout.shape
            shapes[self.saved.lse] = self.saved.lse_layout.shape
        if a.bias is not None:
            shapes[a.bias.tensor] = a.bias.shape
        return shapes

    def layout_problems(self) -> list[str]:
        """Why a layout cannot be read or written with 16-byte accesses; empty when all can."""
        reasons = [r for r in self.attention.layout_problems() if not r.startswith("o'")]
        saved = ((self.saved.o, self.saved.o_layout),) if self.saved is not None else ()
        for name, layout in ((self.grad_output, self.grad_output_layout), *((g.role, g.layout) for g in self.gradients),
                             *saved):  # fmt: skip
            if any(v % LAYOUT_ALIGN for v in (*layout.strides(), layout.offset)):
                reasons.append(f"{name}'s strides {layout.strides()} and offset {layout.offset} are not multiples of "
                               f"{LAYOUT_ALIGN} elements")  # fmt: skip
        return reasons

    @property
    def flops(self) -> float:
        """The backward's matmul FLOPs by the usual convention, 2.5× the forward's (five products
        of the forward's size: S, dP, dv, dk, dq), halved for causal."""
        return 2.5 * self.attention.flops

    @classmethod
    def from_json(cls, data: dict) -> AttentionBackwardProblem:
        layout = data["grad_output_layout"]
        saved = data.get("saved")
        return cls(AttentionProblem.from_json(data["attention"]), data["grad_output"],
                   OperandLayout(**{**layout, "shape": tuple(layout["shape"])}),
                   tuple(GradientOutput.from_json(g) for g in data["gradients"]),
                   SavedStatistics.from_json(saved) if saved else None)  # fmt: skip


@dataclass(frozen=True)
class BackwardSchedule:
    """One way to run the backward: ``block_kv`` keys a block of the main pass, ``block_q``
    queries a step, ``stages`` buffers of the streamed q/dO tiles (2: the next tile loads while
    this one is used); ``wgmma``: the main pass's products are Hopper warpgroup MMAs (a
    warpgroup of 128 threads per 64 keys) instead of ``mma.sync`` (a warp per 16 keys);
    ``saved_statistics``: the statistics pass reads the forward's saved output and log-sum-exp
    (:class:`SavedStatistics`) instead of running the forward again; ``persistent`` (``wgmma``, two
    stages): the main pass launches one block an SM, each walking work items of key tiles (causal:
    key tiles ``p`` and ``n − 1 − p`` together, so every item is as long) and loading the next
    key tile's K and V into a second buffer while the current one's last step runs, so a key tile's
    prologue and its dk, dv stores no longer stand alone on the SM; ``warp_pairs`` (``mma.sync``,
    ``WARP_PAIR_TILES``): two warps a 32-key group, the score products split between them by queries and
    dk, dv by head-dim halves, Pᵀ and dSᵀ exchanged through shared memory, so every warp's mma tiles
    have 32 rows (:mod:`cherenkov.codegen.cuda.flash_attention_backward_pairs`); ``dim_parts`` (the
    16-key ``mma.sync`` pass, head dims past ``MAX_WHOLE_HEAD_DIM``): a block holds dk's, dv's and
    dq's columns of one of that many head-dim parts, its scores and dP recomputed for each part (a
    grid of that many times the blocks), so dk and dv of 16 keys fit a warp's registers."""

    block_kv: int = 64
    block_q: int = 64
    stages: int = 2
    wgmma: bool = False
    saved_statistics: bool = False
    persistent: bool = False
    warp_pairs: bool = False
    dim_parts: int = 1

    @property
    def warps(self) -> int:
        return self.block_kv // 16

    @property
    def threads(self) -> int:
        return 32 * self.warps

    def key(self) -> str:
        return (f"kv{self.block_kv}_q{self.block_q}_s{self.stages}{'_wg' if self.wgmma else ''}"
                f"{'_ps' if self.persistent else ''}{'_wp' if self.warp_pairs else ''}"
                f"{f'_dp{self.dim_parts}' if self.dim_parts != 1 else ''}"
                f"{'_saved' if self.saved_statistics else ''}")  # fmt: skip


WARP_PAIR_TILES = (128, 64)
"""(keys, queries) of a warp-pair main pass: four pairs of 32 keys, the queries in two halves of 32."""
WARP_PAIR_HEAD_DIMS = (64, 128)
"""Head dims of the warp-pair main pass: dk, dv in head-dim halves and dq in quarters of whole ldmatrix pairs."""
WGMMA_BLOCK_KV = 128
"""Keys of a ``wgmma`` main-pass block: two warpgroups of one m64 tile each."""
WGMMA_BLOCK_Q = 64
"""Queries of a ``wgmma`` main-pass step: one 128-byte swizzle row of dSᵀ, the N of the score products."""
WGMMA_HEAD_DIMS = (64, 128)
"""Head dims of the ``wgmma`` main pass: whole 64-column boxes, dq's columns split over the two warpgroups (128)
or its keys (64)."""
BACKWARD_SCHEDULES = tuple(
    schedule
    for saved in (False, True)
    for schedule in (
        *(BackwardSchedule(block_kv, block_q, stages, saved_statistics=saved)
          for block_kv in (64, 128) for block_q in (32, 64) for stages in (1, 2)),
        *(BackwardSchedule(WGMMA_BLOCK_KV, WGMMA_BLOCK_Q, stages, wgmma=True, saved_statistics=saved)
          for stages in (2, 3)),
        BackwardSchedule(WGMMA_BLOCK_KV, WGMMA_BLOCK_Q, 2, wgmma=True, saved_statistics=saved, persistent=True),
        *(BackwardSchedule(*WARP_PAIR_TILES, stages, saved_statistics=saved, warp_pairs=True) for stages in (1, 2)),
        *(BackwardSchedule(block_kv, block_q, stages, saved_statistics=saved, dim_parts=2)
          for block_kv in (64, 128) for block_q in (32, 64) for stages in (1, 2)),
    )
)  # fmt: skip
"""Every schedule; those reading saved statistics fit only problems whose forward saved them."""


def row_elements(head_dim: int) -> int:
    """Elements of one padded shared-memory row of a head-dim-wide tile."""
    return head_dim + PAD


def backward_smem_bytes(schedule: BackwardSchedule, problem: AttentionBackwardProblem) -> int:
    """Dynamic shared memory of the main pass: K and V (the block's keys; persistent: two of each),
    ``stages`` q and dO tiles, their rows' log-sum-exps (with a bias: maxima and log2 sums) and D, and
    dSᵀ (keys × queries) for dq's
    product (warp pairs: and Pᵀ; ``wgmma``: unpadded swizzled tiles, plus slack to align them; a one-tile block keeps two
    dSᵀ tiles, by step parity, and an mbarrier a stage that its copies arrive on)."""
    d, dv = problem.attention.head_dim, problem.attention.v_dim
    element = 2
    if schedule.wgmma:
        kv_buffers, ds_buffers = (2, 1) if schedule.persistent else (1, 2)
        barriers = 0 if schedule.persistent else 8 * schedule.stages
        tiles = (2 * kv_buffers * schedule.block_kv + 2 * schedule.stages * schedule.block_q) * d * element
        return tiles + ds_buffers * schedule.block_kv * schedule.block_q * element \
            + 2 * 4 * schedule.stages * schedule.block_q + barriers + SWIZZLE_ALIGN
    kv = schedule.block_kv * (row_elements(d) + row_elements(dv)) * element
    row_floats = 3 if problem.attention.bias is not None else 2  # log-sum-exp (bias: max and log2 sum), D
    streamed = schedule.stages * (schedule.block_q * (row_elements(d) + row_elements(dv)) * element
                                  + row_floats * 4 * schedule.block_q)
    ds = schedule.block_kv * (schedule.block_q + PAD) * element
    return kv + streamed + (2 if schedule.warp_pairs else 1) * ds


WGMMA_STATISTICS_ROWS = 128
"""Query rows of a ``wgmma`` statistics block (two warpgroups of 64)."""
WGMMA_STATISTICS_KEYS = 128
"""Keys of one step of the ``wgmma`` statistics pass (the N of its score product)."""
WGMMA_STATISTICS_BUFFERS = 3
"""K and V buffers of the ``wgmma`` statistics pass: a step's scores read its own, the last step's ``O += P V``
(still running during the step's softmax) the one before, and the next step's copies fill the third."""


def main_work_items(schedule: BackwardSchedule, problem: AttentionBackwardProblem) -> int:
    """Work items of a persistent main pass: per (batch, K/V head), its key tiles, paired
    ``(p, n − 1 − p)`` when causal (a middle tile of an odd count alone)."""
    a = problem.attention
    key_tiles = -(-a.seq_kv // schedule.block_kv)
    return a.batch * a.kv_heads * (-(-key_tiles // 2) if a.causal else key_tiles)


def statistics_rows(schedule: BackwardSchedule) -> int:
    """Query rows of one block of the statistics pass."""
    return WGMMA_STATISTICS_ROWS if schedule.wgmma else STATISTICS_ROWS


def statistics_smem_bytes(problem: AttentionBackwardProblem, schedule: BackwardSchedule) -> int:
    """Dynamic shared memory of the statistics pass: a q and a dO tile, one K and one V tile
    (``wgmma``: a swizzled q tile and ``WGMMA_STATISTICS_BUFFERS`` buffers of K and V, plus slack
    to align them)."""
    d, dv = problem.attention.head_dim, problem.attention.v_dim
    if schedule.wgmma:
        return (WGMMA_STATISTICS_ROWS + 2 * WGMMA_STATISTICS_BUFFERS * WGMMA_STATISTICS_KEYS) * d * 2 + SWIZZLE_ALIGN
    return (STATISTICS_ROWS + STATISTICS_KEYS) * (row_elements(d) + row_elements(dv)) * 2


def backward_register_estimate(schedule: BackwardSchedule, problem: AttentionBackwardProblem) -> int:
    """Registers a thread of the main pass holds: dk and dv (16 keys × D and × Dv, or a head-dim part of each, over 32 lanes),
    Sᵀ and dPᵀ (16 keys × block_q), and ~64 for addresses and fragments (D 128 with 64-query
    tiles spills: 256). ``wgmma``: the same per 64 keys over a warpgroup's 128 threads, and ~48
    more (D 128: 240, no spills). Warp pairs: dk and dv of 32 keys × D/2, Sᵀ and dPᵀ of 32 keys × 32
    queries, and ~48 more."""
    d = problem.attention.head_dim
    if schedule.wgmma:
        return 2 * 64 * d // 128 + 2 * 64 * schedule.block_q // 128 + 48
    if schedule.warp_pairs:
        return 2 * 32 * (d // 2) // 32 + 2 * 32 * (schedule.block_q // 2) // 32 + 48
    dk_dv = (d + problem.attention.v_dim) // schedule.dim_parts
    return 16 * dk_dv // 32 + 2 * 16 * schedule.block_q // 32 + 64


def backward_schedule_problems(schedule: BackwardSchedule, problem: AttentionBackwardProblem,
                               target: Target) -> list[str]:  # fmt: skip
    """Why ``schedule`` cannot run ``problem`` on ``target``; empty when it can."""
    a = problem.attention
    reasons = []
    if a.head_dim not in BACKWARD_HEAD_DIMS or a.v_dim not in BACKWARD_HEAD_DIMS:
        reasons.append(f"head dims {a.head_dim}/{a.v_dim}: the backward plans head dims of {BACKWARD_HEAD_DIMS}")
    if a.value_dim and (schedule.wgmma or schedule.warp_pairs):
        reasons.append(f"v's head dim {a.v_dim} apart from q's {a.head_dim}: the 16-key mma.sync main pass only")
    if a.dtype not in BACKWARD_DTYPES:
        reasons.append(f"dtype {a.dtype}: the backward plans {BACKWARD_DTYPES}")
    if a.bias is not None and (schedule.wgmma or schedule.warp_pairs or schedule.saved_statistics):
        reasons.append("a bias tensor: only the 16-key mma.sync main pass reads one, after a statistics pass that "
                       "runs the forward again (a saved log-sum-exp loses a row the bias masks wholly)")
    if a.softcap and schedule.warp_pairs and a.head_dim > 64:
        reasons.append(f"a soft cap of the scores at head dim {a.head_dim}: warp pairs spill (255 registers and 16-60 "
                       f"bytes of spills on sm_80 and sm_90; head dim 64: 174 registers)")
    reasons += _dim_part_problems(schedule, problem)
    if schedule.saved_statistics and problem.saved is None:
        reasons.append("saved statistics: the graph holds no saved output and log-sum-exp of this attention")
    if schedule.wgmma:
        reasons += _wgmma_problems(schedule, problem, target)
    elif schedule.persistent:
        reasons.append("a persistent main pass: the wgmma family only")
    if schedule.warp_pairs:
        reasons += _warp_pair_problems(schedule, problem)
    row_tiles = schedule.block_q // 16  # the 16-key main pass's dq grid (warp pairs check their own above)
    if not schedule.warp_pairs and (not schedule.wgmma and schedule.warps % row_tiles
                                    or (a.head_dim // schedule.dim_parts // max(1, schedule.warps // row_tiles)) % 16):  # fmt: skip
        reasons.append(f"{schedule.warps} warps do not split a {schedule.block_q} x {a.head_dim} dq tile into 16-column parts")
    reasons += problem.layout_problems()
    smem = backward_smem_bytes(schedule, problem)
    if smem + SMEM_RESERVED_PER_BLOCK > target.smem_per_block:
        reasons.append(f"{smem} bytes of shared memory over {target.name}'s {target.smem_per_block}")
    registers = backward_register_estimate(schedule, problem)
    if registers > MAX_REGISTERS_PER_THREAD:
        reasons.append(f"~{registers} registers a thread over {MAX_REGISTERS_PER_THREAD}")
    if not schedule.saved_statistics and \
            statistics_smem_bytes(problem, schedule) + SMEM_RESERVED_PER_BLOCK > target.smem_per_block:
        reasons.append(f"the statistics pass's shared memory over {target.name}'s {target.smem_per_block}")
    return reasons


def _dim_part_problems(schedule: BackwardSchedule, problem: AttentionBackwardProblem) -> list[str]:
    """Why ``schedule``'s head-dim parts do not fit ``problem``: one part up to ``MAX_WHOLE_HEAD_DIM``,
    two past it (whole k16 steps each), on the 16-key ``mma.sync`` main pass only."""
    d, dv, parts = problem.attention.head_dim, problem.attention.v_dim, schedule.dim_parts
    wanted = 1 if max(d, dv) <= MAX_WHOLE_HEAD_DIM else 2
    if parts != wanted:
        return [f"{parts} head-dim part(s) at head dims {d}/{dv} (valid: {wanted}: a 16-key warp holds dk and dv of "
                f"{MAX_WHOLE_HEAD_DIM} columns at most, and narrower head dims are not split)"]
    reasons = []
    if parts > 1 and (schedule.wgmma or schedule.warp_pairs):
        reasons.append("head-dim parts: the 16-key mma.sync main pass only")
    for dim in {d, dv}:
        if dim % parts or (dim // parts) % 16:
            reasons.append(f"head dim {dim} in {parts} parts of whole k16 steps")
    return reasons


def _warp_pair_problems(schedule: BackwardSchedule, problem: AttentionBackwardProblem) -> list[str]:
    """Why the warp-pair ``mma.sync`` main pass cannot take ``schedule`` and ``problem``."""
    reasons = []
    if schedule.wgmma:
        reasons.append("warp pairs are a layout of the mma.sync main pass, not the wgmma one")
    if (schedule.block_kv, schedule.block_q) != WARP_PAIR_TILES:
        reasons.append(f"the warp-pair main pass takes {WARP_PAIR_TILES[0]} keys and {WARP_PAIR_TILES[1]} queries")
    if problem.attention.head_dim not in WARP_PAIR_HEAD_DIMS:
        reasons.append(f"head dim {problem.attention.head_dim}: the warp-pair main pass plans {WARP_PAIR_HEAD_DIMS}")
    return reasons


def _wgmma_problems(schedule: BackwardSchedule, problem: AttentionBackwardProblem, target: Target) -> list[str]:
    """Why the ``wgmma`` main pass cannot take ``schedule`` and ``problem`` on ``target``."""
    reasons = []
    if target.family != "wgmma":
        reasons.append(f"{target.name} has no wgmma (the Hopper main pass needs sm_90a)")
    if problem.attention.head_dim not in WGMMA_HEAD_DIMS:
        reasons.append(f"head dim {problem.attention.head_dim}: the wgmma main pass plans {WGMMA_HEAD_DIMS}")
    if (schedule.block_kv, schedule.block_q) != (WGMMA_BLOCK_KV, WGMMA_BLOCK_Q) or schedule.stages not in (2, 3):
        reasons.append(f"the wgmma main pass takes {WGMMA_BLOCK_KV} keys, {WGMMA_BLOCK_Q} queries and 2 or 3 stages")
    if schedule.persistent and schedule.stages != 2:
        reasons.append("a persistent main pass loads a key tile's K and V one step ahead: two stages (with three, "
                       "a one-step key tile would let them overwrite the buffer still in use)")
    return reasons


@dataclass(frozen=True)
class BackwardPlan:
    """One attention backward × one schedule × one target: the unit the search measures."""

    kind: Literal["flash_attention_backward"]
    problem: AttentionBackwardProblem
    schedule: BackwardSchedule
    target: Target
    trace: tuple[str, ...] = field(default=(), compare=False)

    def params(self) -> dict:
        """Plain-JSON description (problem, schedule, target) for reports and databases."""
        return {"kind": self.kind, "problem": asdict(self.problem), "schedule": asdict(self.schedule),
                "target": self.target.name}  # fmt: skip

    @functools.cached_property
    def name(self) -> str:
        digest = hashlib.sha256(json.dumps(self.params(), sort_keys=True).encode()).hexdigest()[:10]
        return f"{self.kind}_{self.schedule.key()}_{digest}"

    @property
    def flops(self) -> float:
        return self.problem.flops


def backward_plans(problem: AttentionBackwardProblem, target: Target,
                   trace: tuple[str, ...] = ()) -> list[BackwardPlan]:  # fmt: skip
    """Every schedule of ``BACKWARD_SCHEDULES`` that fits ``problem`` on ``target``."""
    return [BackwardPlan("flash_attention_backward", problem, schedule, target, trace)
            for schedule in BACKWARD_SCHEDULES if not backward_schedule_problems(schedule, problem, target)]  # fmt: skip
