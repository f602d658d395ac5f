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
* waves — a last partial wave of blocks leaves SMs idle.

Its predictions are leads, not measurements: reports label them as modelled.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from cherenkov.rewrites.plan import ELEMENT_BYTES, KernelPlan, flash_register_estimate, flash_smem_bytes

LAUNCH_OVERHEAD_MS = 0.005


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

    @property
    def flop_per_smem_byte(self) -> float:
        """mma FLOPs an SM does per shared-memory byte it can read, per clock."""
        flop_per_clock = self.mma_tflops * 1e12 / (self.sms * self.clock_ghz * 1e9)
        return flop_per_clock / self.smem_bytes_per_clock


# The reference GPU of each target. H200: measured mma.sync peak (641 TFLOP/s,
# ../shared/DESIGN.md); others: vendor dense figures with fp32 accumulation.
GPUS: dict[str, GpuSpec] = {
    "sm_80": GpuSpec("NVIDIA A100-SXM4-80GB", "sm_80", 108, 312.0, 2.04, 164 * 1024, 1.41),
    "sm_86": GpuSpec("NVIDIA GeForce RTX 3090", "sm_86", 82, 71.0, 0.94, 100 * 1024, 1.70, 1536, 16),
    "sm_89": GpuSpec("NVIDIA GeForce RTX 4090", "sm_89", 128, 165.2, 1.01, 100 * 1024, 2.52, 1536, 24),
    "sm_90": GpuSpec("NVIDIA H200", "sm_90", 132, 641.0, 4.8, 228 * 1024, 1.98),
    "sm_120": GpuSpec("NVIDIA GeForce RTX 5090", "sm_120", 170, 209.5, 1.79, 100 * 1024, 2.41, 1536, 24),
}

PIPELINE_EFFICIENCY = {1: 0.72, 2: 0.93, 3: 0.97}
UNSWIZZLED_SMEM_PENALTY = 8.0
LDMATRIX_X2_PENALTY = 1.06
BASE_EFFICIENCY = 0.88  # what a perfectly fed mma.sync kernel reaches (issue, softmax, epilogue)


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


def blocks_per_sm(plan: KernelPlan, gpu: GpuSpec, registers: int | None = None) -> int:
    """Resident blocks per SM, limited by shared memory, registers and threads."""
    schedule, problem = plan.schedule, plan.problem
    smem = flash_smem_bytes(schedule, problem.head_dim, problem.dtype)
    regs = registers or flash_register_estimate(schedule, problem.head_dim)
    regs = 8 * math.ceil(regs / 8)
    limits = (
        gpu.smem_per_sm // max(smem, 1),
        65536 // (regs * schedule.threads),
        gpu.max_threads_per_sm // schedule.threads,
        gpu.max_blocks_per_sm,
    )
    return max(1, min(limits))


def predict_flash(plan: KernelPlan, gpu: GpuSpec | None = None, registers: int | None = None) -> Prediction:
    """Predicted run time of a flash-attention plan (FLOPs as ``AttentionProblem.flops``)."""
    gpu = gpu or GPUS[plan.target.name]
    schedule, problem = plan.schedule, plan.problem
    resident = blocks_per_sm(plan, gpu, registers)
    warps = resident * schedule.warps
    occupancy = min(1.0, math.sqrt(warps / 16))
    smem_ratio = schedule.rows_per_warp / gpu.flop_per_smem_byte
    if not schedule.swizzle:
        smem_ratio /= UNSWIZZLED_SMEM_PENALTY
    smem_bound = min(1.0, smem_ratio)
    pipeline = PIPELINE_EFFICIENCY[schedule.stages] * (1.0 if schedule.kv_split else 0.98)
    if schedule.ldmatrix_x == 2:
        pipeline /= LDMATRIX_X2_PENALTY
    q_tiles = math.ceil(problem.seq_q / schedule.block_q)
    blocks = problem.batch * problem.heads * q_tiles
    slots = gpu.sms * resident
    waves = blocks / (math.ceil(blocks / slots) * slots)
    # keys a query tile visits (causal: about half, plus the diagonal tile), and padding waste
    kv_tiles = math.ceil(problem.seq_kv / schedule.block_kv)
    visited = kv_tiles if not problem.causal else min(kv_tiles, (kv_tiles + 1) / 2 + 0.5)
    padded_flops = 4.0 * blocks * schedule.block_q * visited * schedule.block_kv * problem.head_dim
    efficiency = BASE_EFFICIENCY * occupancy * smem_bound * pipeline * waves
    compute_ms = padded_flops / (gpu.mma_tflops * 1e12 * efficiency) * 1e3
    element = ELEMENT_BYTES[problem.dtype]
    q_bytes = problem.batch * problem.heads * problem.seq_q * problem.head_dim * element
    kv_bytes = 2 * problem.batch * problem.kv_heads * problem.seq_kv * problem.head_dim * element
    memory_ms = (2 * q_bytes + kv_bytes) / (gpu.hbm_tbps * 1e12) * 1e3
    ms = max(compute_ms, memory_ms) + LAUNCH_OVERHEAD_MS
    return Prediction(ms, problem.flops / (ms * 1e9), resident, occupancy, smem_bound, pipeline, waves)
