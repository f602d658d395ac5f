"""Flash attention on views (issue 21): both families read q, k and v and write o at the
strides their layouts give — BSHD projections, slices of a fused QKV, a K/V head repeated
for its group — instead of BHSD tensors of their own. On the CPU: the strides reach the
source, misaligned layouts are refused, and the sources compile without spills for sm_80,
sm_90, sm_90a and sm_120. On the GPU: every family and ring against SDPA on the same views
(float32), ragged lengths included, every output element written."""

from __future__ import annotations

import dataclasses
import math

import pytest

from cherenkov.codegen import CompileError, compile_plans, cuda_source, load_kernel
from cherenkov.codegen.launch import operand_view
from cherenkov.rewrites.plan import TARGETS, FlashSchedule, KernelPlan, OperandLayout, flash_schedule_problems
from cherenkov.rewrites.plan_sm90a import HopperFlashSchedule, hopper_schedule_problems
from tests.codegen.strided_problems import PROBLEMS

TOLERANCE = 2e-2
PLAIN = FlashSchedule()
JOINT = FlashSchedule(128, 64, 4, 2, False, lazy_rescale=True, mbarrier_ring=True)
TMA_RING = FlashSchedule(128, 64, 4, 2, False, lazy_rescale=True, mbarrier_ring=True, tma_kv=True, row_sums_mma=True,
                         q_prescaled=True, last_warp_refill=True)  # fmt: skip
PINGPONG = FlashSchedule(128, 64, 8, 2, False, pingpong=True)
HOPPER = HopperFlashSchedule(block_kv=128, stages=3, consumer_warpgroups=2, pingpong=True)
HOPPER_PERSISTENT = HopperFlashSchedule(128, 2, 2, True, persistent=True, q_buffers=2)
SCHEDULES = {"sm_80": (PLAIN, JOINT), "sm_90": (PLAIN, JOINT, TMA_RING, PINGPONG), "sm_120": (PLAIN, TMA_RING),
             "sm_90a": (HOPPER, HOPPER_PERSISTENT)}  # fmt: skip


def valid(schedule, problem, target: str) -> bool:
    fits = hopper_schedule_problems if isinstance(schedule, HopperFlashSchedule) else flash_schedule_problems
    return not fits(schedule, problem, TARGETS[target])


def plans(targets=tuple(SCHEDULES), problems=tuple(PROBLEMS)) -> list[KernelPlan]:
    return [
        KernelPlan("flash_attention", PROBLEMS[name], schedule, TARGETS[target])
        for target in targets
        for name in problems
        for schedule in SCHEDULES[target]
        if valid(schedule, PROBLEMS[name], target)
    ]


def test_the_layouts_reach_the_source() -> None:
    problem = PROBLEMS["fused_qkv_gqa"]
    source = cuda_source(KernelPlan("flash_attention", problem, PLAIN, TARGETS["sm_90"]))
    k = problem.layout("k")
    assert f"constexpr int K_ROW_STRIDE = {k.seq};" in source and f"constexpr size_t K_OFFSET = {k.offset};" in source
    assert "load_tile<BLOCK_Q, Q_TAIL, Q_ROW_STRIDE>" in source and "o_block + size_t(row) * O_ROW_STRIDE" in source
    assert problem.strided and not dataclasses.replace(problem, layouts=()).strided


def test_misaligned_layouts_are_refused() -> None:
    problem = PROBLEMS["bshd_sq_ne_skv"]
    odd = OperandLayout(problem.layout("q").shape, *problem.layout("q").strides(), offset=4)
    shifted = dataclasses.replace(problem, layouts=(odd, *problem.layouts[1:]))
    for schedule, target in ((PLAIN, "sm_90"), (HOPPER, "sm_90a")):
        fits = hopper_schedule_problems if isinstance(schedule, HopperFlashSchedule) else flash_schedule_problems
        assert any("multiples of 8" in reason for reason in fits(schedule, shifted, TARGETS[target]))


def test_a_value_shared_by_the_kv_heads_is_read_at_head_stride_0_by_the_mma_sync_family(compiler, kernel_cache) -> None:
    """v one head for every K/V head (DiffLlama's): the ``mma.sync`` family reads it at head stride 0 (its
    cp.async loads) and compiles for sm_80, sm_90 and sm_120; TMA copies (the Hopper family, the TMA ring)
    refuse it, no tensor map moving by 0."""
    problem = PROBLEMS["gqa_shared_v"]
    assert problem.shares_kv_head and not PROBLEMS["gqa_v_only"].shares_kv_head
    assert "constexpr size_t V_HEAD_STRIDE = 0;" in cuda_source(KernelPlan("flash_attention", problem, PLAIN,
                                                                            TARGETS["sm_90"]))
    for schedule, target in ((TMA_RING, "sm_90"), (HOPPER, "sm_90a")):
        fits = hopper_schedule_problems if isinstance(schedule, HopperFlashSchedule) else flash_schedule_problems
        assert any("shared by the K/V heads" in reason for reason in fits(schedule, problem, TARGETS[target]))
    chosen = [KernelPlan("flash_attention", problem, PLAIN, TARGETS[target]) for target in ("sm_80", "sm_90", "sm_120")]
    for plan, result in zip(chosen, compile_plans(chosen, compiler=compiler, cache_dir=kernel_cache)):
        assert not isinstance(result, CompileError), f"{plan.name}: {result}"


SPILL_SLACK = 16  # bytes: ptxas places the 64-bit operand bases a little differently


@pytest.mark.slow
def test_strided_sources_compile_and_cost_no_registers(compiler, kernel_cache) -> None:
    """Every strided plan compiles; each spills no more than the same plan on BHSD tensors
    of its own (the 255-register D = 128 schedules spill a little on some problems either
    way: ptxas 13.0 puts 0-128 B there for causal GQA on sm_80/sm_90)."""
    chosen = plans(problems=("bshd_gqa_causal", "fused_qkv_causal"))
    assert {p.target.name for p in chosen} == set(SCHEDULES) and len(chosen) >= 12
    contiguous = [dataclasses.replace(p, problem=dataclasses.replace(p.problem, layouts=())) for p in chosen]
    results = compile_plans(chosen + contiguous, compiler=compiler, cache_dir=kernel_cache)
    for plan, result, plain in zip(chosen, results, results[len(chosen):]):
        assert not isinstance(result, CompileError), f"{plan.name}: {result}"
        assert result.report.spill_bytes <= plain.report.spill_bytes + SPILL_SLACK, (plan.name, result.report)


# ------------------------------------------------------------------------------ GPU


def _run(kernel, problem, torch):
    """The kernel on fresh stored tensors (output poisoned with NaN): its output view, and
    SDPA's on the input views."""
    dtype = torch.bfloat16
    stored = {}
    for role in "qkv":
        name = problem.name(role)
        stored.setdefault(name, torch.randn(problem.layout(role).shape, device="cuda", dtype=torch.float32).to(dtype))
    out = torch.full(problem.layout("o").shape, math.nan, device="cuda", dtype=dtype)
    kernel(*(stored[problem.name(role)] for role in "qkv"), out)
    torch.cuda.synchronize()
    q, k, v = (operand_view(problem, role, stored[problem.name(role)]).float() for role in "qkv")
    group = problem.group_size
    reference = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1), is_causal=problem.causal
    )
    return operand_view(problem, "o", out), reference


@pytest.mark.gpu
def test_gpu_strided_flash_attention_matches_sdpa(gpu) -> None:
    torch = gpu
    targets = ["sm_90"] + (["sm_90a"] if torch.cuda.get_device_capability() == (9, 0) else [])
    chosen = plans(targets)
    failures = []
    for plan, result in zip(chosen, compile_plans(chosen)):
        assert not isinstance(result, CompileError), f"{plan.name}: {result}"
        view, reference = _run(load_kernel(result), plan.problem, torch)
        error = float((view.float() - reference).norm() / reference.norm())  # NaN (unwritten) fails
        if not error <= TOLERANCE:
            failures.append((plan.name, plan.target.name, error, int(view.isnan().sum())))
    assert not failures, failures
