"""An analytic cost model: predicted run time of a plan on a GPU, without the GPU.

Used to rank candidates where they cannot be measured (no GPU, or a target that is not
the GPU at hand), to measure the most promising candidates first under a time budget,
and to predict RTX 5090 figures from H200 measurements. It is a roofline with four
derating factors, each a named term:

* occupancy — resident warps hide mma and shared-memory latency;
* shared-memory bandwidth — each warp reads the whole K and V tile, so the mma work per
  shared-memory byte is ``rows_per_warp`` FLOP/B; below the SM's ratio the kernel is
  bound by ldmatrix traffic, 8x worse when rows are not swizzled (bank conflicts);
* pipelining — a single stage exposes global-memory latency on every tile;
* waves — a last partial wave of blocks leaves SMs idle;
* schedule — the issue-6 knobs, each a factor fitted to H200 measurements
  (benchmarks/NOTES.md, sweeps of 2026-11-29): the lazy rescale saves the O rescale on most
  tiles, the head-major order balances causal grids, the overlap hides the softmax of
  16-row warps behind the next tile's QKᵀ, the pingpong concentrates shared-memory reads
  into half-steps, ``min_blocks`` caps registers below what the kernel needs, and the ring
  knobs (late copy, mbarriers, TMA, the TMA ring's step knobs and 256-row blocks) carry
  their same-process A/B ratios.

Occupancy matters less than a square root would say (H200: one 4-warp block per SM ran at
0.85 of two, not 0.71), so the occupancy term is a fourth root of the resident warps.

Its predictions are leads, not measurements: reports label them as modelled.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from cherenkov.rewrites.plan import (
    ELEMENT_BYTES,
    SMEM_RESERVED_PER_BLOCK,
    AttentionProblem,
    KernelPlan,
    flash_register_estimate,
    flash_smem_bytes,
    key_tiles_per_split,
    query_tiles,
)
from cherenkov.rewrites.plan_backward import main_work_items
from cherenkov.rewrites.plan_fp8 import Fp8FlashSchedule
from cherenkov.rewrites.plan_sm90a import HOPPER_EIGHT_BIT_DTYPES, HopperFlashSchedule, problem_tile_columns

LAUNCH_OVERHEAD_MS = 0.005

# Memory-bound flash attention (decode, short queries): a block keeps its ring's next
# stages of K/V in flight, so a grid of few blocks cannot draw the HBM bandwidth: about
# (blocks resident) x (bytes in flight a block) / latency. Query heads of one K/V head that
# are not packed into one block read its K/V each (partly from L2); key splits write and
# re-read their partial states.
MEMORY_LATENCY_S = 1.5e-6
UNPACKED_KV_REREAD = 0.3  # of one K/V read, per extra query head of a group
# Measured on the H200 (decode B16 H32/8 Skv 8192 and B1 Skv 65536, 2026-12-01): the larger
# the key tile, the closer a short-query kernel gets to the HBM bandwidth (kv128 with 3
# stages best; 6-10 stages of 32- or 64-key tiles 10 % slower); and a block's warps run on
# the SM's scheduler partitions in order, so a block of fewer than 4 warps reaches only
# that many of its 4 tensor-core partitions, however many blocks share the SM.
KV_TILE_BANDWIDTH = {32: 0.85, 64: 0.92, 128: 1.0}
SCHEDULER_PARTITIONS = 4

@dataclass(frozen=True)
class GpuSpec:
    """The ceilings of one GPU: dense ``mma.sync`` bf16/fp16 with fp32 accumulation."""

    name: str
    target: str
    sms: int
    mma_tflops: float
    hbm_tbps: float
    smem_per_sm: int
    clock_ghz: float
    max_threads_per_sm: int = 2048
    max_blocks_per_sm: int = 32
    smem_bytes_per_clock: int = 128
    wgmma_tflops: float = 0.0  # dense wgmma bf16 peak (Hopper), 0 where there is no wgmma
    l2_mb: float = 50.0  # the L2 cache

    @property
    def flop_per_smem_byte(self) -> float:
        """mma FLOPs an SM does per shared-memory byte it can read, per clock."""
        flop_per_clock = self.mma_tflops * 1e12 / (self.sms * self.clock_ghz * 1e9)
        return flop_per_clock / self.smem_bytes_per_clock


# The reference GPU of each target. H200: measured mma.sync peak (641 TFLOP/s,
# ../shared/DESIGN.md); others: vendor dense figures with fp32 accumulation.
GPUS: dict[str, GpuSpec] = {
    "sm_80": GpuSpec("NVIDIA A100-SXM4-80GB", "sm_80", 108, 312.0, 2.04, 164 * 1024, 1.41, l2_mb=40.0),
    "sm_86": GpuSpec("NVIDIA GeForce RTX 3090", "sm_86", 82, 71.0, 0.94, 100 * 1024, 1.70, 1536, 16, l2_mb=6.0),
    "sm_89": GpuSpec("NVIDIA GeForce RTX 4090", "sm_89", 128, 165.2, 1.01, 100 * 1024, 2.52, 1536, 24, l2_mb=72.0),
    "sm_90": GpuSpec("NVIDIA H200", "sm_90", 132, 641.0, 4.8, 228 * 1024, 1.98),
    "sm_90a": GpuSpec("NVIDIA H200", "sm_90a", 132, 641.0, 4.8, 228 * 1024, 1.98, wgmma_tflops=989.0),
    "sm_120": GpuSpec("NVIDIA GeForce RTX 5090", "sm_120", 170, 209.5, 1.79, 100 * 1024, 2.41, 1536, 24, l2_mb=96.0),
}

PIPELINE_EFFICIENCY = {1: 0.90, 2: 0.95, 3: 0.95}  # H200: s1 ran at 0.95-0.97 of s2 with 2 blocks/SM
UNSWIZZLED_SMEM_PENALTY = 8.0
LDMATRIX_X2_PENALTY = 1.06
BASE_EFFICIENCY = 0.77  # fitted: the best measured H200 schedules reach 0.77 of the model without it (issue, softmax, epilogue)
SHORT_HEAD_DIM_FACTOR = 0.68
"""The ``mma.sync`` family at head dims of 32 or less, where the softmax's per-score work weighs
twice what it does at 64: the best schedule of B2 H16 S2048 D32 measured 245 TFLOP/s on the H200
against 360 predicted without it (results/h200-2026-12-03-d32.json)."""
NARROW_HEAD_DIM_FACTOR = 0.83
"""The ``mma.sync`` family at head dims above 32 up to 64: B2 H16 S2048 D64 fp16's eight fastest
``mma.sync`` plans measured 0.79-0.86 of the prediction without it in three H200 runs
(results/h200-2026-12-03-issue22-e/f/g.json), where at 128 they measure about 1.0."""

# Fitted to the H200 sweeps (benchmarks/results/sweep-*-h200-2026-11-29.json): ratio of a
# schedule with the knob to the same schedule (or the best plain one) without it.
LAZY_RESCALE_GAIN = 1.04        # +3-6% non-causal D=128, about even causal and D=64
HEAD_MAJOR_GAIN = 1.08          # causal only: +10% (330 -> 365 TFLOP/s, B4 H16 4k causal)
OVERLAP_GAIN_16_ROWS = 1.15     # 16-row warps: 305 -> 353 TFLOP/s on the seed
PINGPONG_PENALTY = 0.85         # 297-326 against 354-389 plain on the seed
MIN_BLOCKS_PENALTY = 0.80       # 3 blocks of 4 warps at 168 registers: 230-301 against 350-389
# 32-key tiles, refitted in the sixth session (its two runs' eight fastest plans a shape): non-causal
# 32-key plans measured 0.87-0.97 of the prediction where 64-key ones measured 0.92-1.02 (seed, 4k,
# 1k); causal ones 0.96-1.01 against 0.91-0.98 with the 0.88 of the fourth session (315-322 against
# 360-367 TFLOP/s before the lazy rescale and the ring knobs).
KV32_PENALTY = 0.95
CAUSAL_KV32_PENALTY = 0.93
# K and V in one ring (joint) against separate rings (split): a joint ring has no barrier between
# the softmax and P V, so with the lazy rescale's one branch before the exponentials the compiler
# interleaves them (fifth session, same-process A/B of q128 kv64 s2 lazy: seed 385.2 joint vs 383.6
# split, 4k causal 381.8 vs 375.9 TFLOP/s); without the lazy rescale split rings lead.
JOINT_PLAIN_FACTOR = 0.98
JOINT_LAZY_FACTOR = 1.01
# The joint lazy ring's late copy and mbarrier ring, by key-tile size: (block_kv, late_copy,
# mbarrier_ring) -> ratio to the same plan with neither (sixth session, one process on the
# H200, five shapes each). 32-key tiles gain most from moving the copies out of the scores;
# 64-key tiles lose that way with a block barrier (ptxas schedules the scores worse) and gain
# with the mbarriers; 128-key tiles (D = 64) only with the mbarriers and early copies.
RING_FACTORS = {
    (32, True, False): 1.05, (32, False, True): 1.04, (32, True, True): 1.01,
    (64, True, False): 0.93, (64, False, True): 1.0, (64, True, True): 1.03,
    (128, True, False): 0.96, (128, False, True): 1.02, (128, True, True): 1.0,
}  # fmt: skip
# TMA boxes instead of every thread's cp.async copies on the mbarrier ring (seventh session,
# same-process A/B on the H200: 1.01-1.05 over six shapes, late or early copies alike).
TMA_KV_GAIN = 1.03
# The TMA ring's step knobs and its 256-row blocks (eighth session, same-process A/Bs on the H200;
# keys: late_copy). Row sums on the tensor cores: +4-5 % with early copies (seed 399 -> 417,
# b16h16s1k 391 -> 410), -1 % with late ones. A pre-scaled Q with the last warp's refill: +3 %
# over the row sums alone (q256 seed 443 -> 457); a pre-scaled Q alone -1 %. One 256-row block of 8
# warps an SM against two 128-row blocks (keys: block_kv, late_copy): +3-10 % with early copies
# (seed 399 -> 427, D = 64 362 -> 371), -2 % late; with 32-key tiles 0.87 of 64-key ones.
ROW_SUMS_MMA_FACTORS = {False: 1.045, True: 0.99}
Q_PRESCALED_FACTORS = {False: 0.99, True: 1.03}  # keys: last_warp_refill
TMA_BLOCK_256_FACTORS = {
    (32, False): 0.9, (32, True): 0.9, (64, False): 1.05, (64, True): 0.975, (128, False): 1.05, (128, True): 0.975,
}  # fmt: skip


@dataclass(frozen=True)
class Prediction:
    """A predicted time and the terms that produced it."""

    ms: float
    tflops: float
    blocks_per_sm: int
    occupancy: float
    smem_bound: float
    pipeline: float
    waves: float
    schedule: float = 1.0



def window_key_tiles(problem: AttentionProblem, block_q: int, block_kv: int, visited: float) -> float:
    """Key tiles a query tile visits on average, ``visited`` without a window; with one, at most
    those its rows' windows span (the window, its keys ahead and the tile's rows, plus a tile of
    misalignment)."""
    if not problem.window:
        return visited
    return min(visited, (problem.window + problem.window_ahead + block_q) / block_kv + 1)

def blocks_per_sm(plan: KernelPlan, gpu: GpuSpec, registers: int | None = None) -> int:
    """Resident blocks per SM, limited by shared memory, registers and threads."""
    schedule, problem = plan.schedule, plan.problem
    smem = flash_smem_bytes(schedule, problem.head_dim, problem.dtype, problem.value_dim)
    # Without a ptxas report: ptxas takes about 30% above the accumulator estimate (it uses
    # the slack to schedule), up to the launch bounds' cap.
    estimate = flash_register_estimate(schedule, problem.head_dim, problem.value_dim)
    regs = registers or min(schedule.register_cap, math.ceil(1.3 * estimate))
    regs = 8 * math.ceil(regs / 8)
    limits = (
        gpu.smem_per_sm // (smem + SMEM_RESERVED_PER_BLOCK),
        65536 // (regs * schedule.threads),
        gpu.max_threads_per_sm // schedule.threads,
        gpu.max_blocks_per_sm,
    )
    return max(1, min(limits))


def schedule_factor(plan: KernelPlan) -> float:
    """The product of the fitted issue-6 knob factors of a plan's schedule."""
    schedule = plan.schedule
    factor = 1.0
    if schedule.lazy_rescale:
        factor *= LAZY_RESCALE_GAIN
    if schedule.head_major and plan.problem.causal:
        factor *= HEAD_MAJOR_GAIN
    if schedule.overlap and schedule.rows_per_warp == 16:
        factor *= OVERLAP_GAIN_16_ROWS
    if schedule.pingpong:
        factor *= PINGPONG_PENALTY
    if schedule.min_blocks > 1:
        factor *= MIN_BLOCKS_PENALTY
    if schedule.block_kv == 32:
        factor *= CAUSAL_KV32_PENALTY if plan.problem.causal else KV32_PENALTY
    if schedule.late_copy or schedule.mbarrier_ring:
        factor *= RING_FACTORS.get((schedule.block_kv, schedule.late_copy, schedule.mbarrier_ring), 1.0)
    if schedule.tma_kv:
        factor *= TMA_KV_GAIN
        if schedule.block_q == 256:
            factor *= TMA_BLOCK_256_FACTORS[schedule.block_kv, schedule.late_copy]
    if schedule.row_sums_mma:
        factor *= ROW_SUMS_MMA_FACTORS[schedule.late_copy]
    if schedule.q_prescaled:
        factor *= Q_PRESCALED_FACTORS[schedule.last_warp_refill]
    return factor


# The sm_90a family (wgmma, TMA, warp roles), fitted to its H200 measurements (2026-11-29,
# interleaved with cuDNN): the key-tile loop of the default schedule reaches 0.75 of the
# wgmma peak (B16 H16 Sq 1024 with Skv 512..4096: time = loop + a work tile's overhead);
# 2 stages with split K/V release run 0.99 of 3 (a joint 2-stage ring ran 0.77). Head dim
# 64 runs at 0.67 of head dim 128 (its exp2 work per FLOP doubles), refitted to B2 H16
# S2048 D64 fp16: its eight fastest plans measured 1.05-1.15 of the first fit's 0.6 in three
# H200 runs (results/h200-2026-12-03-issue22-e/f/g.json), key tiles of 192 running like 128
# rather than the 6 % faster first fitted. A work tile also exposes its prologue (Q, the
# scores-only first key tile) and epilogue (the last P V, normalise, store O), in key tiles:
# 2.15 when every tile is its own block (O by TMA stores), 1.8 for a persistent block with
# one Q buffer (the next Q loads during the epilogue; O stored from registers), 1.0 with two
# Q buffers (Q in place ahead, O by TMA stores). Causal work tiles differ in length, and the
# persistent grid's static stride balances them worse (0.95).
HOPPER_BASE_EFFICIENCY = 0.75
HOPPER_STAGE_FACTOR = {2: 0.99, 3: 1.0, 4: 1.0}
HOPPER_CONSUMER_FACTOR = {1: 0.6, 2: 1.0, 3: 0.9}
HOPPER_NO_PINGPONG_FACTOR = 0.95
# by q's tile width (32: 64-byte-swizzled boxes; fitted on B2 H16 S2048 D32, 271 TFLOP/s measured);
# 192, 256: not measured yet
HOPPER_HEAD_DIM_FACTOR = {32: 0.5, 64: 0.67, 128: 1.0, 192: 1.0, 256: 1.0}
HOPPER_TILE_OVERHEAD = {"one tile": 2.15, "persistent": 1.8, "two Q buffers": 1.0}  # key tiles a work tile
HOPPER_PERSISTENT_CAUSAL_FACTOR = 0.95
# lazy_rescale and row_sums_mma (H200, 2026-12-04, same-run A/B of each schedule with and without):
# lazy rescale +5-8 % with 8-bit operands, +2-5 % at 16-bit head dim 128 (causal gains most), -3 to
# -6 % at head dim 64 (the vote costs about what its 32 FMULs a row pair saved); the 8-bit row sums
# on the tensor cores +1-2 % on top.
HOPPER_LAZY_RESCALE_FACTOR = {"8-bit": 1.06, "wide": 1.03, "narrow": 0.96}
HOPPER_ROW_SUMS_MMA_FACTOR = 1.015
# l2_prefetch (not yet measured): worth a little where K and V outgrow the L2 (they stream from
# DRAM, a chunked prefill's), a few wasted issue slots of the producer where they stay in it.
HOPPER_L2_PREFETCH_FACTOR = {"streamed": 1.01, "resident": 0.99}
# poly_exp, by P's width and the chunks of every four on the FMA pipe, as measured on the H100
# (2026-12-07, same process, each schedule against its base): 8-bit 0.97/0.90/0.89 for 1/2/3 chunks
# (the seed's four- and three-stage rings, Llama's balanced causal one), 16-bit 0.95/0.89 for 1/2
# (seed, packed chunked prefill, balanced causal, head dim 64). Four chunks were not timed: below three.
# The polynomials' FMAs and integer steps cost more issue slots than the SFU's queue they shorten.
HOPPER_POLY_EXP_FACTOR = {"8-bit": {1: 0.96, 2: 0.90, 3: 0.89, 4: 0.85},
                          "16-bit": {1: 0.94, 2: 0.88, 3: 0.85, 4: 0.82}}


def hopper_head_dim_factor(problem: AttentionProblem) -> float:
    """The family's efficiency at a problem's head dims: by q's tile width (whole 64-column
    boxes), times the share of the tensor-core work that is not on the zero columns a head dim
    short of whole boxes pads (D 96: O is 128 wide, so P V does 4/3 of its work)."""
    qk_columns, v_columns = problem_tile_columns(problem)
    useful = (problem.head_dim + problem.v_dim) / (problem.head_dim + v_columns)
    return HOPPER_HEAD_DIM_FACTOR.get(qk_columns, 1.0) * useful


def key_value_bytes(problem: AttentionProblem) -> int:
    """Bytes of a problem's K and V (every batch and K/V head)."""
    rows = problem.batch * problem.kv_heads * problem.seq_kv
    return rows * (problem.head_dim + problem.v_dim) * ELEMENT_BYTES[problem.dtype]


def hopper_tile_overhead(schedule: HopperFlashSchedule) -> float:
    """Key tiles' worth of exposed time a work tile of a Hopper schedule pays."""
    if not schedule.persistent:
        return HOPPER_TILE_OVERHEAD["one tile"]
    return HOPPER_TILE_OVERHEAD["two Q buffers" if schedule.q_buffers == 2 else "persistent"]


def predict_hopper_flash(plan: KernelPlan, gpu: GpuSpec | None = None) -> Prediction:
    """Predicted run time of an sm_90a flash-attention plan: one block per SM (its
    shared-memory ring fills the SM), the fitted family efficiency times the wave fill and
    the share of a work tile's time spent in its key-tile loop, and the share of the tiles'
    rows that hold query rows (a 64-row query fills half a 128-row tile unless packed)."""
    gpu = gpu or GPUS[plan.target.name]
    schedule, problem = plan.schedule, plan.problem
    blocks = schedule.tiles(problem)
    waves = blocks / (math.ceil(blocks / gpu.sms) * gpu.sms)
    waves *= problem.batch * problem.heads * problem.seq_q / (blocks * schedule.block_q)  # rows filled
    key_tiles = window_key_tiles(problem, schedule.block_q, schedule.block_kv,
                                 problem.seq_kv / schedule.block_kv / (2 if problem.causal else 1))
    pipeline = HOPPER_STAGE_FACTOR.get(schedule.stages, 1.0)
    pipeline *= key_tiles / (key_tiles + hopper_tile_overhead(schedule))
    knobs = HOPPER_CONSUMER_FACTOR.get(schedule.consumer_warpgroups, 0.5) * hopper_head_dim_factor(problem)
    if not schedule.pingpong:
        knobs *= HOPPER_NO_PINGPONG_FACTOR
    if schedule.persistent and problem.causal and not schedule.balanced:
        knobs *= HOPPER_PERSISTENT_CAUSAL_FACTOR
    if schedule.lazy_rescale:
        width = "8-bit" if problem.dtype in HOPPER_EIGHT_BIT_DTYPES else (
            "wide" if problem_tile_columns(problem)[1] >= 128 else "narrow")
        knobs *= HOPPER_LAZY_RESCALE_FACTOR[width]
    if schedule.row_sums_mma:
        knobs *= HOPPER_ROW_SUMS_MMA_FACTOR
    if schedule.poly_exp:
        width = "8-bit" if problem.dtype in HOPPER_EIGHT_BIT_DTYPES else "16-bit"
        knobs *= HOPPER_POLY_EXP_FACTOR[width][schedule.poly_exp]
    if schedule.l2_prefetch:
        knobs *= HOPPER_L2_PREFETCH_FACTOR["streamed" if key_value_bytes(problem) > gpu.l2_mb * 2**20 else "resident"]
    efficiency = HOPPER_BASE_EFFICIENCY * pipeline * knobs * waves
    rate = gpu.wgmma_tflops * (2.0 if problem.dtype in HOPPER_EIGHT_BIT_DTYPES else 1.0)  # e4m3: twice bf16's
    ms = problem.flops / (rate * 1e12 * efficiency) * 1e3 + LAUNCH_OVERHEAD_MS
    return Prediction(ms, problem.flops / (ms * 1e9), 1, 1.0, 1.0, pipeline, waves, knobs)


FP8_EFFICIENCY = 0.4
"""Fraction of the 8-bit ``mma.sync`` rate the e4m3 flash family runs at (not yet fitted)."""
FP8_MMA_SPEEDUP = {89: 2.0, 90: 1.0, 120: 2.0}
"""The e4m3 ``mma.sync`` rate over the bf16 one: twice on sm_89 and sm_120; on Hopper ptxas runs it
as two fp16 mma after unpacking the bytes (its 8-bit tensor-core rate is wgmma's)."""


def predict_fp8_flash(plan: KernelPlan, gpu: GpuSpec | None = None) -> Prediction:
    """Predicted run time of an 8-bit flash-attention plan: the fixed family efficiency of the
    target's e4m3 ``mma.sync`` rate times the wave fill."""
    gpu = gpu or GPUS[plan.target.name]
    schedule, problem = plan.schedule, plan.problem
    blocks = problem.batch * problem.heads * -(-problem.seq_q // schedule.block_q)
    waves = blocks / (math.ceil(blocks / gpu.sms) * gpu.sms)
    rate = gpu.mma_tflops * FP8_MMA_SPEEDUP.get(plan.target.compute_capability, 1.0)
    efficiency = FP8_EFFICIENCY * max(waves, 0.25)
    ms = problem.flops / (rate * 1e12 * efficiency) * 1e3 + LAUNCH_OVERHEAD_MS
    return Prediction(ms, problem.flops / (ms * 1e9), 1, 1.0, 1.0, 1.0, waves, 1.0)


def head_dim_factor(mean_dim: float) -> float:
    """The ``mma.sync`` family's efficiency at a mean head dim, relative to 128."""
    if mean_dim <= 32:
        return SHORT_HEAD_DIM_FACTOR
    return NARROW_HEAD_DIM_FACTOR if mean_dim <= 64 else 1.0


def predict_flash(plan: KernelPlan, gpu: GpuSpec | None = None, registers: int | None = None) -> Prediction:
    """Predicted run time of a flash-attention plan (FLOPs as ``AttentionProblem.flops``)."""
    if isinstance(plan.schedule, HopperFlashSchedule):
        return predict_hopper_flash(plan, gpu)
    if isinstance(plan.schedule, Fp8FlashSchedule):
        return predict_fp8_flash(plan, gpu)
    gpu = gpu or GPUS[plan.target.name]
    schedule, problem = plan.schedule, plan.problem
    resident = blocks_per_sm(plan, gpu, registers)
    warps = resident * schedule.warps
    occupancy = min(1.0, (warps / 16) ** 0.25)
    smem_ratio = schedule.rows_per_warp / gpu.flop_per_smem_byte
    if not schedule.swizzle:
        smem_ratio /= UNSWIZZLED_SMEM_PENALTY
    smem_bound = min(1.0, smem_ratio)
    joint = JOINT_LAZY_FACTOR if schedule.lazy_rescale else JOINT_PLAIN_FACTOR
    pipeline = PIPELINE_EFFICIENCY[schedule.stages] * (1.0 if schedule.kv_split else joint)
    if schedule.ldmatrix_x == 2:
        pipeline /= LDMATRIX_X2_PENALTY
    row_spaces = problem.batch * (problem.kv_heads if schedule.pack_group else problem.heads)
    blocks = row_spaces * query_tiles(schedule, problem) * schedule.kv_splits
    slots = gpu.sms * resident
    waves = blocks / (math.ceil(blocks / slots) * slots)
    # keys a query tile visits (causal: about half, plus the diagonal tile), and padding waste
    kv_tiles = key_tiles_per_split(schedule, problem)
    visited = kv_tiles if not problem.causal else min(kv_tiles, (kv_tiles + 1) / 2 + 0.5)
    visited = window_key_tiles(problem, schedule.block_q, schedule.block_kv, visited)
    mean_dim = (problem.head_dim + problem.v_dim) / 2
    padded_flops = 4.0 * blocks * schedule.block_q * visited * schedule.block_kv * mean_dim
    knobs = schedule_factor(plan) * head_dim_factor(mean_dim)
    partitions = min(SCHEDULER_PARTITIONS, schedule.warps) / SCHEDULER_PARTITIONS
    efficiency = min(BASE_EFFICIENCY, BASE_EFFICIENCY * occupancy * smem_bound * pipeline * waves * knobs * partitions)
    compute_ms = padded_flops / (gpu.mma_tflops * 1e12 * efficiency) * 1e3
    element = ELEMENT_BYTES[problem.dtype]
    q_bytes = problem.batch * problem.heads * problem.seq_q * (problem.head_dim + problem.v_dim) * element
    kv_bytes = key_value_bytes(problem)
    if not schedule.pack_group:
        kv_bytes *= 1 + UNPACKED_KV_REREAD * (problem.group_size - 1)
    partial_bytes = 2 * 4 * blocks * schedule.block_q * (problem.v_dim + 1) if schedule.kv_splits > 1 else 0
    in_flight = max(1, schedule.stages - 1) * schedule.block_kv * (problem.head_dim + problem.v_dim) * element
    bandwidth = min(gpu.hbm_tbps * 1e12 * KV_TILE_BANDWIDTH[schedule.block_kv],
                    min(blocks, slots) * in_flight / MEMORY_LATENCY_S)
    memory_ms = (q_bytes + kv_bytes + partial_bytes) / bandwidth * 1e3
    ms = max(compute_ms, memory_ms) + LAUNCH_OVERHEAD_MS
    return Prediction(ms, problem.flops / (ms * 1e9), resident, occupancy, smem_bound, pipeline, waves, knobs)


# ------------------------------------------------------------------ generic term kernels
# (issue 7: the pointwise, row-reduction and mma GEMM families of cherenkov.codegen.term_plan)

SIMT_FRACTION = 0.1  # fp32 FMA throughput of the CUDA cores relative to the mma.sync peak
MEMORY_EFFICIENCY = {"pointwise": 0.7, "pointwise_vector": 0.85, "warp": 0.8, "block": 0.75, "rows_vector": 0.85,
                     "thread": 0.25, "mma": 0.8}  # fmt: skip
MMA_TILE_EFFICIENCY = {64 * 64: 0.35, 128 * 64: 0.45, 128 * 128: 0.5, 128 * 256: 0.55}
MMA_PIPELINE_EFFICIENCY = {2: 0.8, 3: 1.0, 4: 1.0}  # a 2-stage ring leaves load latency partly exposed
# Fraction of the wgmma peak the sm_90a GEMM tiles reached at bf16 4096³ on the H200
# (benchmarks/results/gemm-sm90a-h200-2026-11-29.json): (block_m, block_n, warpgroups, stages).
WGMMA_TILE_EFFICIENCY = {(128, 256, 2, 4): 0.47, (256, 128, 2, 4): 0.45, (128, 128, 2, 5): 0.45,
                         (128, 128, 2, 3): 0.42, (128, 128, 1, 4): 0.38, (64, 256, 1, 4): 0.39,
                         (64, 128, 1, 6): 0.37, (64, 64, 1, 8): 0.24, (64, 64, 1, 4): 0.22}  # fmt: skip
# The warp-specialised TMA kernels (benchmarks/bench_gemm_sm90a.py, H200, bf16 4096³:
# results/gemm-sm90a-tma-stores-h200-2026-11-29.json): (block_m, block_n, stages,
# persistent, store_boxes).
TMA_TILE_EFFICIENCY = {
    (128, 256, 4, True, 0): 0.70, (128, 256, 4, False, 0): 0.68, (128, 128, 6, True, 0): 0.64,
    (128, 256, 4, True, 2): 0.76, (128, 256, 4, True, 1): 0.755, (128, 128, 6, True, 2): 0.73,
    (128, 256, 3, True, 4): 0.74, (128, 256, 3, True, 2): 0.74,  # the staged-source tiles (3 stages: guessed)
    (128, 192, 4, True, 1): 0.74,  # guessed
}
# Ping-pong tiles (a consumer warpgroup's own tile; TmaGemmSchedule.pingpong), keyed the
# same way: guessed a little above the cooperative 128x256, their epilogue being hidden.
PINGPONG_TILE_EFFICIENCY = {
    (128, 128, 6, True, 2): 0.77, (64, 256, 4, True, 2): 0.77, (128, 128, 4, True, 2): 0.76,
}
# An epilogue that loads M x N sources element by element (a residual, a gated product's
# other factor) after the last k step exposes their latency once a 64x64 box: about this
# many k steps' worth of time a tile (H200, Llama-3-8B MLP at S 8192: the gated GEMM at
# K 4096 ran at 0.71x the plain one, the down GEMM with two residuals at K 14336 at 0.91x);
# staged sources (TmaGemmSchedule.staged_sources) land during the k steps instead.
UNSTAGED_SOURCE_STEPS = 24
EVALUATED_OPERAND_PENALTY = 0.6  # a GEMM operand computed element by element instead of cp.async copies


def predict_term(plan, gpu: GpuSpec | None = None, registers: int | None = None) -> Prediction:
    """A bytes/FLOPs roofline for a :class:`~cherenkov.codegen.term_plan.TermKernelPlan`.

    Memory: every tensor read once and the output written once (row forms read their row
    twice unless the schedule keeps it in registers), at a schedule-dependent fraction of
    HBM bandwidth (one thread a row does not coalesce). Compute: the mma peak for the GEMM family, derated by tile size, by operands
    that are evaluated rather than copied and by the last wave; ``SIMT_FRACTION`` of it
    for everything else (a pointwise contraction re-reads its operands from cache and
    counts at a quarter of that). The larger of the two plus a launch overhead."""
    from cherenkov.codegen.cuda.term_kernels import term_grid
    from cherenkov.codegen.term_plan import (
        ROW_KINDS,
        WGMMA_BLOCK_K,
        RowSchedule,
        TmaGemmSchedule,
        epilogue_sources,
        gemm_layout,
        gemm_smem_bytes,
        wgmma_smem_bytes,
        wgmma_tiles,
    )

    gpu = gpu or GPUS[plan.target.name]
    schedule = plan.schedule
    family = plan.family
    flops = plan.flops
    moved = plan.bytes
    if plan.kind in ROW_KINDS and not (isinstance(schedule, RowSchedule) and schedule.cached):
        moved += sum(info.numel * ELEMENT_BYTES.get(info.dtype, 4) for info in plan.inputs)
    (gx, gy, gz), (threads, _, _) = term_grid(plan)
    blocks = gx * gy * gz
    resident = max(1, min(gpu.max_threads_per_sm // threads, gpu.max_blocks_per_sm))
    if registers:
        resident = max(1, min(resident, 65536 // (8 * math.ceil(registers / 8) * threads)))
    if family in ("mma", "wgmma"):
        smem = gemm_smem_bytes(schedule) if family == "mma" else wgmma_smem_bytes(schedule)
        resident = max(1, min(resident, gpu.smem_per_sm // (smem + SMEM_RESERVED_PER_BLOCK)))
    slots = gpu.sms * resident
    waves = blocks / (math.ceil(blocks / slots) * slots)
    occupancy = min(1.0, resident * threads / gpu.max_threads_per_sm)
    if family == "mma":
        layout = gemm_layout(plan.kernel, plan.tensor_map)
        efficiency = MMA_TILE_EFFICIENCY.get(schedule.block_m * schedule.block_n, 0.4) * waves
        efficiency *= MMA_PIPELINE_EFFICIENCY.get(schedule.stages, 1.0)
        efficiency *= (1.0 if layout.a_fast else EVALUATED_OPERAND_PENALTY) * (1.0 if layout.b_fast else EVALUATED_OPERAND_PENALTY)
        compute_ms = flops / (gpu.mma_tflops * 1e12 * efficiency) * 1e3
        memory = MEMORY_EFFICIENCY["mma"]
    elif family == "wgmma" and isinstance(schedule, TmaGemmSchedule):
        tile = (schedule.block_m, schedule.block_n, schedule.stages, schedule.persistent, schedule.store_boxes)
        table = PINGPONG_TILE_EFFICIENCY if schedule.pingpong else TMA_TILE_EFFICIENCY
        layout = gemm_layout(plan.kernel, plan.tensor_map)
        if schedule.persistent:  # min(tiles, SMs) blocks walk the tiles: the last round leaves SMs idle
            tiles = wgmma_tiles(layout, schedule)
            waves = tiles / (math.ceil(tiles / slots) * slots)
        efficiency = table.get(tile, 0.5) * waves
        if len(epilogue_sources(plan.kernel, layout, plan.tensor_map)) > schedule.staged_sources:
            steps = math.ceil(layout.k / WGMMA_BLOCK_K)
            efficiency *= steps / (steps + UNSTAGED_SOURCE_STEPS)
        compute_ms = flops / (gpu.wgmma_tflops * 1e12 * efficiency) * 1e3
        memory = MEMORY_EFFICIENCY["mma"]
    elif family == "wgmma":
        tile = (schedule.block_m, schedule.block_n, schedule.consumer_warpgroups, schedule.stages)
        efficiency = WGMMA_TILE_EFFICIENCY.get(tile, 0.35) * waves
        compute_ms = flops / (gpu.wgmma_tflops * 1e12 * efficiency) * 1e3
        memory = MEMORY_EFFICIENCY["mma"]
    else:
        efficiency = max(0.05, waves * (0.25 if plan.kind == "contraction" else 1.0))
        compute_ms = flops / (gpu.mma_tflops * SIMT_FRACTION * 1e12 * efficiency) * 1e3
        if family == "rows":
            memory = MEMORY_EFFICIENCY["rows_vector" if schedule.vector > 1 else schedule.mode]
        else:
            memory = MEMORY_EFFICIENCY["pointwise_vector" if schedule.vector > 1 else "pointwise"]
    memory_ms = moved / (gpu.hbm_tbps * 1e12 * memory * max(waves, 0.5)) * 1e3
    ms = max(compute_ms, memory_ms) + LAUNCH_OVERHEAD_MS
    return Prediction(ms, flops / (ms * 1e9), resident, occupancy, 1.0, 1.0, waves)


BACKWARD_EFFICIENCY = 0.35
"""Fraction of the ``mma.sync`` peak the backward's main pass runs at (not yet fitted: no
measurement of it exists; FlashAttention-2's backward reaches ~0.46 on the H200)."""
BACKWARD_BLOCK_FACTOR = {(64, 32): 0.85, (64, 64): 1.0, (128, 32): 0.9, (128, 64): 1.05}
"""Relative speed of the (BLOCK_KV, BLOCK_Q) tiles: larger tiles reuse each load for more mmas."""
WARP_PAIR_FACTOR = {64: 0.98, 128: 1.0}
"""The warp-pair main pass over the 16-key one of the same (BLOCK_KV, BLOCK_Q) tiles, by head dim (H100,
2026-12-05, ``results/backward-h100-2026-12-05-warp-pairs.json``: D 64 0.98x the 16-key q64 schedule; at D 128,
where the 16-key q64 tiles are not offered, 1.14-1.19x the q32 ones, as the tile factors above already say)."""
WGMMA_BACKWARD_FACTOR = 2.3
"""Speed of the ``wgmma`` backward (statistics and main pass) relative to the best ``mma.sync`` one
(H200, 2026-12-03, ``results/backward-h200-2026-12-03-wgmma-pipelined.json``: 2.6x seed, 2.4x
causal 4k, 2.4x GQA, 1.86x D 64)."""
WGMMA_PERSISTENT_FACTOR = {64: 1.09, 128: 1.0}
"""The persistent ``wgmma`` main pass over the one-block-a-key-tile one at equal wave fill, by head dim
(H200, 2026-12-04, ``results/backward-h200-2026-12-04-persistent.json`` and a same-process A/B: D 64
1.09x, the seed at D 128 0.97-1.01x: hiding a key tile's prologue and stores pays where steps are short)."""
WGMMA_PERSISTENT_CAUSAL_FACTOR = 0.87
"""The persistent walk's speed with a causal mask at equal fill, against the one-tile grid taking its slabs in
chunks, longest key tiles first (H200, 2026-12-04, ``results/backward-h200-2026-12-04-chunks.json``: B4 H16 4k
causal 0.86x, B2 H32/8 2k causal 0.89x)."""


def predict_backward(plan, gpu: GpuSpec | None = None) -> Prediction:
    """Predicted time of a flash-attention backward plan: its statistics pass (the forward's
    two products; with saved statistics a pass over O and dO at the memory bandwidth) and main
    pass (five; with head-dim parts the two score products once a part) at a fixed efficiency,
    scaled by the tiles and by how evenly its key blocks fill the GPU; reported TFLOP/s count the
    backward's convention (2.5× the forward)."""
    gpu = gpu or GPUS[plan.target.name]
    problem, schedule = plan.problem, plan.schedule
    a = problem.attention
    blocks = main_work_items(schedule, problem) if schedule.persistent else \
        a.batch * a.kv_heads * -(-a.seq_kv // schedule.block_kv) * schedule.dim_parts
    main_flops = problem.flops * (3 + 2 * schedule.dim_parts) / 5  # S and dP again for every part
    rounds = math.ceil(blocks / gpu.sms)
    waves = blocks / (rounds * gpu.sms)
    knobs = BACKWARD_BLOCK_FACTOR.get((schedule.block_kv, schedule.block_q), 1.0) * (1.0 if schedule.stages > 1 else 0.9)
    knobs *= WGMMA_BACKWARD_FACTOR if schedule.wgmma else 1.0
    knobs *= WARP_PAIR_FACTOR.get(a.head_dim, 1.0) if schedule.warp_pairs else 1.0
    if schedule.persistent:  # equal work items (causal: paired key tiles)
        knobs *= WGMMA_PERSISTENT_FACTOR.get(a.head_dim, 1.0) * (WGMMA_PERSISTENT_CAUSAL_FACTOR if a.causal else 1.0)
    efficiency = BACKWARD_EFFICIENCY * knobs * max(waves, 0.25)
    if schedule.saved_statistics:  # read O and dO, write D and LSE2, zero the dq accumulator
        rows = a.batch * a.heads * a.seq_q
        statistics_ms = rows * (2 * 2 * a.head_dim + 4 * a.head_dim + 12) / (gpu.hbm_tbps * 1e12) * 1e3
        flops = main_flops
    else:
        statistics_ms, flops = 0.0, main_flops + a.flops  # the forward recomputed, then the backward proper
    ms = flops / (gpu.mma_tflops * 1e12 * efficiency) * 1e3 + statistics_ms + 3 * LAUNCH_OVERHEAD_MS
    return Prediction(ms, problem.flops / (ms * 1e9), 1, 1.0, 1.0, 1.0, waves, knobs)


def predict_plan(plan, gpu: GpuSpec | None = None, registers: int | None = None) -> Prediction:
    """The prediction of any plan: flash attention (forward or backward) or a generic term kernel."""
    from cherenkov.codegen.term_plan import TermKernelPlan
    from cherenkov.rewrites.plan_backward import BackwardPlan

    if isinstance(plan, TermKernelPlan):
        return predict_term(plan, gpu, registers)
    if isinstance(plan, BackwardPlan):
        return predict_backward(plan, gpu)
    return predict_flash(plan, gpu, registers)
