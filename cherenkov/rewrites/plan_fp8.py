"""Plans of the 8-bit ``mma.sync`` flash-attention family (e4m3, sm_89 and later).

The kernel (:mod:`cherenkov.codegen.cuda.flash_attention_fp8`) runs ``m16n8k32`` e4m3 mma
for both products: QKᵀ from 8-bit q and k tiles, PV with the probabilities rounded to e4m3
(times 2⁸, so that they stay normal numbers down to 2⁻¹⁴; the factor cancels in the
normalisation) and V transposed in shared memory. Its schedule is the query rows of a block
(16 a warp), the keys of a main-loop step, and the cp.async stages; the problem's score
factors (the descales of q and k) multiply the softmax scale once a block, the output
factors (the descale of v) the output.

Shared-memory rows are padded by ``FP8_PAD`` bytes, so the eight row addresses of an
ldmatrix phase fall in eight different bank groups.
"""

from __future__ import annotations

from dataclasses import dataclass

from cherenkov.rewrites.plan import MAX_REGISTERS_PER_THREAD, AttentionProblem, Target

FP8_ATTENTION_DTYPES = ("fp8_e4m3",)
"""Operand dtypes of the family (``mma.sync`` takes e4m3 and e5m2; the probabilities are e4m3)."""

FP8_OUTPUT_DTYPES = ("bf16", "fp16", "fp32")
FP8_MIN_CAPABILITY = 89
"""``mma.sync`` with 8-bit floats and ``cvt`` to e4m3: sm_89 (Ada) and later."""

FP8_PAD = 16
FP8_COPY_BYTES = 16
"""One cp.async copy: 16 bytes, sixteen 8-bit elements (every stride a multiple of it)."""


@dataclass(frozen=True)
class Fp8FlashSchedule:
    """``block_q`` query rows a block (16 a warp), ``block_kv`` keys a main-loop step,
    ``stages`` K/V buffers of the cp.async ring."""

    block_q: int = 128
    block_kv: int = 64
    stages: int = 2

    @property
    def warps(self) -> int:
        return self.block_q // 16

    @property
    def threads(self) -> int:
        return 32 * self.warps

    def key(self) -> str:
        """A short stable name, e.g. ``e4m3_q128_kv64_s2``."""
        return f"e4m3_q{self.block_q}_kv{self.block_kv}_s{self.stages}"


FP8_SCHEDULES = tuple(
    Fp8FlashSchedule(block_q, block_kv, 2) for block_q in (64, 128) for block_kv in (64, 128)
)
"""The family's schedules (each checked against a problem by :func:`fp8_schedule_problems`)."""


def fp8_smem_bytes(schedule: Fp8FlashSchedule, head_dim: int) -> int:
    """The Q tile, ``stages`` K and V tiles (rows of ``head_dim`` bytes plus the pad) and the
    transposed V tile (``head_dim`` rows of ``block_kv`` bytes plus the pad)."""
    row = head_dim + FP8_PAD
    return (schedule.block_q + 2 * schedule.stages * schedule.block_kv) * row + head_dim * (schedule.block_kv + FP8_PAD)


def fp8_register_estimate(schedule: Fp8FlashSchedule, head_dim: int) -> int:
    """O and S accumulators, S once more (the scores and the packed probabilities beside them),
    the Q fragments (4 registers a 32-byte step) and addressing: ptxas (sm_90) gives 195-201
    registers at 64 keys and D 128 and spills 408 B at 128 keys, which this estimate excludes."""
    return head_dim // 8 * 4 + 2 * (schedule.block_kv // 8 * 4) + head_dim // 32 * 4 + 56


def fp8_schedule_problems(schedule: Fp8FlashSchedule, problem: AttentionProblem, target: Target) -> list[str]:
    """Why a schedule cannot run a problem on a target; empty when it can."""
    reasons = []
    if target.compute_capability < FP8_MIN_CAPABILITY:
        reasons.append(f"8-bit mma.sync needs sm_89 or later ({target.name})")
    if problem.dtype not in FP8_ATTENTION_DTYPES:
        reasons.append(f"dtype {problem.dtype} (valid: {', '.join(FP8_ATTENTION_DTYPES)})")
    if problem.output_dtype not in FP8_OUTPUT_DTYPES:
        reasons.append(f"output dtype {problem.output_dtype} (valid: {', '.join(FP8_OUTPUT_DTYPES)})")
    if problem.head_dim % 32 or not 32 <= problem.head_dim <= 256 or problem.v_dim != problem.head_dim:
        reasons.append(f"head dims {problem.head_dim} and {problem.v_dim}: one head dim, a multiple of 32 up to 256")
    if problem.bias is not None or problem.window:
        reasons.append("an additive bias or a sliding window (the 8-bit family runs no mask or the causal one)")
    if problem.lse is not None:
        reasons.append("the rows' log-sum-exp output (the 8-bit family writes o only)")
    if problem.softcap:
        reasons.append("a soft cap of the scores (the 8-bit family runs none)")
    blocks = (problem.q_block_scales, problem.k_block_scales)
    if any(blocks) and not target.block_scale:
        reasons.append(f"MX block scales of q and k need the block-scaled mma.sync (sm_120a; {target.name} has none)")
    if any(blocks) and not all(blocks):
        reasons.append("MX block scales on one of q and k only (the block-scaled QK^T scales both)")
    for role in ("q", "k", "v"):
        layout = problem.layout(role)
        if any(v % FP8_COPY_BYTES for v in (*layout.strides(), layout.offset)):
            reasons.append(f"{role}'s strides {layout.strides()} and offset {layout.offset} are not multiples of "
                           f"{FP8_COPY_BYTES} elements (16-byte copies)")  # fmt: skip
    out = problem.layout("o")
    if any(v % 2 for v in (*out.strides(), out.offset)):
        reasons.append(f"o's strides {out.strides()} and offset {out.offset} are not even (paired stores)")
    smem = fp8_smem_bytes(schedule, problem.head_dim)
    if smem > target.smem_per_block:
        reasons.append(f"shared memory {smem} B exceeds {target.name}'s {target.smem_per_block} B")
    registers = fp8_register_estimate(schedule, problem.head_dim)
    if registers > MAX_REGISTERS_PER_THREAD:
        reasons.append(f"about {registers} registers a thread exceeds {MAX_REGISTERS_PER_THREAD}")
    return reasons
