"""Kernel plans: what the derivation hands to code generation.

A plan is one fused kernel form (its problem: shapes, dtypes, attributes) times one
schedule (tile sizes, warps, pipeline, layout knobs) for one target. The schedule ruleset
enumerates schedules as e-graph alternatives and guards each with the resource estimates
defined here, so the e-graph never offers a plan the target cannot hold. The code
generator lays the plan out concretely (``cherenkov.codegen.plan``) and a test keeps its
shared-memory total equal to :func:`flash_smem_bytes`.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from typing import Literal

ELEMENT_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
ATTENTION_DTYPES = ("bf16", "fp16")
ATTENTION_HEAD_DIMS = (64, 128)
MAX_REGISTERS_PER_THREAD = 255


@dataclass(frozen=True)
class Target:
    """A CUDA compilation target and the per-block budgets its schedules must respect."""

    name: str
    compute_capability: int
    smem_per_block: int
    family: Literal["mma_sync", "wgmma"] = "mma_sync"
    regs_per_sm: int = 65536
    max_threads_per_sm: int = 2048

    @property
    def arch_flag(self) -> str:
        """The nvcc/NVRTC architecture flag (``sm_90``, ``sm_90a``, ...)."""
        return self.name


TARGETS: dict[str, Target] = {
    "sm_80": Target("sm_80", 80, 163 * 1024),
    "sm_86": Target("sm_86", 86, 99 * 1024, max_threads_per_sm=1536),
    "sm_89": Target("sm_89", 89, 99 * 1024, max_threads_per_sm=1536),
    "sm_90": Target("sm_90", 90, 227 * 1024),
    "sm_120": Target("sm_120", 120, 99 * 1024, max_threads_per_sm=1536),
}


@dataclass(frozen=True)
class AttentionProblem:
    """One flash-attention kernel: ``o = softmax(scale · q kᵀ [+ causal mask]) v``.

    Layout is BHSD contiguous for q, k, v and o. ``kv_heads`` divides ``heads``; query
    head ``h`` reads K/V head ``h // (heads // kv_heads)`` (GQA/MQA). Causal follows
    PyTorch's ``is_causal``: query ``i`` sees keys ``j <= i``. ``scale`` 0 means
    ``head_dim ** -0.5``; a negative scale is not supported. The tensor names are
    validated identifiers of the user's graph.
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

    @property
    def group_size(self) -> int:
        return self.heads // self.kv_heads

    @property
    def flops(self) -> float:
        """Matmul FLOPs, ``4·B·H·Sq·Skv·D``, halved for causal (the usual convention)."""
        full = 4.0 * self.batch * self.heads * self.seq_q * self.seq_kv * self.head_dim
        return full / 2 if self.causal else full

    def shapes(self) -> dict[str, tuple[int, ...]]:
        """Tensor name -> shape for the kernel's inputs and its output."""
        b, h, hk, d = self.batch, self.heads, self.kv_heads, self.head_dim
        return {
            self.q: (b, h, self.seq_q, d),
            self.k: (b, hk, self.seq_kv, d),
            self.v: (b, hk, self.seq_kv, d),
            self.out: (b, h, self.seq_q, d),
        }


@dataclass(frozen=True)
class FlashSchedule:
    """Schedule knobs of the ``mma.sync`` flash-attention kernel family.

    ``block_q`` query rows per thread block, split over ``warps`` (16 or 32 rows a warp);
    ``block_kv`` keys per main-loop step; ``stages`` K/V tile buffers in the cp.async ring;
    ``kv_split`` waits for K and V in separate cp.async groups (QKᵀ starts while V lands)
    instead of one group per stage; ``swizzle`` XOR-swizzles shared-memory rows (no bank
    conflicts for ldmatrix); ``ldmatrix_x`` loads 2 or 4 8x8 matrices per ldmatrix.
    """

    block_q: int = 128
    block_kv: int = 64
    warps: int = 4
    stages: int = 2
    kv_split: bool = True
    swizzle: bool = True
    ldmatrix_x: int = 4

    @property
    def threads(self) -> int:
        return 32 * self.warps

    @property
    def rows_per_warp(self) -> int:
        return self.block_q // self.warps

    def key(self) -> str:
        """A short stable name, e.g. ``q128_kv64_w4_s2_split_swz_x4``."""
        return (
            f"q{self.block_q}_kv{self.block_kv}_w{self.warps}_s{self.stages}"
            f"_{'split' if self.kv_split else 'joint'}_{'swz' if self.swizzle else 'lin'}"
            f"_x{self.ldmatrix_x}"
        )


FLASH_KNOBS: dict[str, tuple] = {
    "block_q": (64, 128),
    "block_kv": (32, 64, 128),
    "warps": (4, 8),
    "stages": (1, 2, 3),
    "kv_split": (True, False),
    "swizzle": (True, False),
    "ldmatrix_x": (2, 4),
}


def flash_smem_bytes(schedule: FlashSchedule, head_dim: int, dtype: str) -> int:
    """Shared memory of one block: the Q tile plus ``stages`` (K tile + V tile) buffers."""
    elem = ELEMENT_BYTES[dtype]
    q_tile = schedule.block_q * head_dim * elem
    kv_tiles = 2 * schedule.block_kv * head_dim * elem
    return q_tile + schedule.stages * kv_tiles


def flash_register_estimate(schedule: FlashSchedule, head_dim: int) -> int:
    """Registers a thread needs: O and S accumulators (fp32) plus addressing overhead.

    Each warp owns ``rows_per_warp / 16`` m16 tiles; an m16×n8 fp32 accumulator is four
    registers a thread. P reuses S's registers, Q fragments are reloaded from shared memory.
    """
    m_tiles = schedule.rows_per_warp // 16
    o_acc = m_tiles * (head_dim // 8) * 4
    s_acc = m_tiles * (schedule.block_kv // 8) * 4
    return o_acc + s_acc + 40


def flash_schedule_problems(schedule: FlashSchedule, problem: AttentionProblem, target: Target) -> list[str]:
    """Why a schedule is invalid for a problem on a target; empty when it is valid."""
    reasons = []
    if target.family != "mma_sync":
        reasons.append(f"{target.name} is not an mma.sync target")
    if problem.dtype not in ATTENTION_DTYPES:
        reasons.append(f"dtype {problem.dtype} (valid: {', '.join(ATTENTION_DTYPES)})")
    if problem.head_dim not in ATTENTION_HEAD_DIMS:
        reasons.append(f"head_dim {problem.head_dim} (valid: {ATTENTION_HEAD_DIMS})")
    if schedule.block_q % schedule.warps or schedule.rows_per_warp not in (16, 32):
        reasons.append(f"block_q {schedule.block_q} over {schedule.warps} warps is not 16 or 32 rows a warp")
    smem = flash_smem_bytes(schedule, problem.head_dim, problem.dtype)
    if smem > target.smem_per_block:
        reasons.append(f"shared memory {smem} B exceeds {target.name}'s {target.smem_per_block} B")
    regs = flash_register_estimate(schedule, problem.head_dim)
    if regs > MAX_REGISTERS_PER_THREAD:
        reasons.append(f"about {regs} registers a thread exceeds {MAX_REGISTERS_PER_THREAD}")
    return reasons


@dataclass(frozen=True)
class KernelPlan:
    """One fused kernel form × one schedule × one target: the unit the search measures."""

    kind: Literal["flash_attention"]
    problem: AttentionProblem
    schedule: FlashSchedule
    target: Target
    trace: tuple[str, ...] = field(default=(), compare=False)

    def params(self) -> dict:
        """Plain-JSON description (problem, schedule, target) for reports and databases."""
        return {
            "kind": self.kind,
            "problem": asdict(self.problem),
            "schedule": asdict(self.schedule),
            "target": self.target.name,
        }

    @property
    def name(self) -> str:
        """A stable identifier: kind, schedule key and a short hash of everything."""
        digest = hashlib.sha256(json.dumps(self.params(), sort_keys=True).encode()).hexdigest()[:10]
        return f"{self.kind}_{self.schedule.key()}_{digest}"
