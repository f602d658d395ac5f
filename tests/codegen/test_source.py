"""Generated CUDA source: deterministic, every knob real, names validated, invalid plans refused."""

from __future__ import annotations

import dataclasses
import re

import pytest

from cherenkov.codegen import CodegenError, KernelPlan, cuda_source, valid_flash_plans
from cherenkov.codegen.cuda.text import comment_text, identifier
from cherenkov.rewrites.plan import FLASH_KNOBS, TARGETS, AttentionProblem, FlashSchedule


def plan_of(problem: AttentionProblem, schedule: FlashSchedule = FlashSchedule(), target: str = "sm_90") -> KernelPlan:
    return KernelPlan("flash_attention", problem, schedule, TARGETS[target])


def test_source_is_deterministic(seed_problem):
    for plan in valid_flash_plans(seed_problem, TARGETS["sm_120"])[::7]:
        again = KernelPlan("flash_attention", plan.problem, plan.schedule, plan.target, trace=("some", "rules"))
        assert cuda_source(plan) == cuda_source(again)


def test_every_valid_plan_has_distinct_source(seed_problem):
    sources = [cuda_source(p) for p in valid_flash_plans(seed_problem, TARGETS["sm_90"])]
    assert len(set(sources)) == len(sources)


@pytest.mark.parametrize("knob", list(FLASH_KNOBS))
def test_every_knob_changes_the_kernel(knob):
    """Each value of each knob gives a different kernel (the header comment aside): for every
    value there is a valid plan, pairs of valid plans that differ in this knob alone have
    different bodies, and such pairs exist for at least two values. (Some knobs are guarded —
    256-row blocks need the pingpong, the head-major order a causal problem — so the pairs are
    looked up among the valid plans of a causal problem.)"""
    problem = AttentionProblem(1, 8, 8, 4096, 8192, 64, causal=True)
    valid = {plan.schedule: plan for plan in valid_flash_plans(problem, TARGETS["sm_90"])}
    covered = set()
    for schedule, plan in valid.items():
        for value in FLASH_KNOBS[knob]:
            other = dataclasses.replace(schedule, **{knob: value})
            if other == schedule or other not in valid or value in covered:
                continue
            body = cuda_source(plan).split("// ---- types", 1)[1]
            assert body != cuda_source(valid[other]).split("// ---- types", 1)[1], (schedule.key(), other.key())
            covered |= {value, getattr(schedule, knob)}
    assert len(covered) >= 2
    assert {getattr(schedule, knob) for schedule in valid} == set(FLASH_KNOBS[knob])


def test_knob_specific_code(seed_problem):
    swz_x4 = cuda_source(plan_of(seed_problem, FlashSchedule(swizzle=True, ldmatrix_x=4)))
    lin_x2 = cuda_source(plan_of(seed_problem, FlashSchedule(swizzle=False, ldmatrix_x=2)))
    assert "chunk ^ (row & 7)" in swz_x4 and "chunk ^ (row & 7)" not in lin_x2
    assert "ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16" in swz_x4
    assert "ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16" in lin_x2 and ".x4." not in lin_x2
    pingpong = cuda_source(plan_of(seed_problem, FlashSchedule(256, 32, 8, 2, False, pingpong=True)))
    assert "pipeline_open_step" in pingpong and "pipeline_open_step" not in swz_x4
    assert "__any_sync" in cuda_source(plan_of(seed_problem, FlashSchedule(lazy_rescale=True)))
    assert "__any_sync" not in swz_x4
    causal = dataclasses.replace(seed_problem, causal=True)
    assert "HEAD_MAJOR = true" in cuda_source(plan_of(causal, FlashSchedule(head_major=True)))
    assert "HEAD_MAJOR = false" in swz_x4
    ring = FlashSchedule(128, 64, 4, 2, False, lazy_rescale=True)
    plain_ring, late, mbar = (cuda_source(plan_of(seed_problem, dataclasses.replace(ring, **knobs)))
                              for knobs in ({}, {"late_copy": True}, {"mbarrier_ring": True}))
    wait_v = "void pipeline_wait_v("
    assert "issue_kv" in late.split(wait_v)[1].split("}")[0]  # the late copy is issued before P V
    assert "issue_kv" not in plain_ring.split(wait_v)[1].split("}")[0]
    assert "cp.async.mbarrier.arrive.noinc" in mbar and "pipeline_release(slot, lane);" in mbar
    assert "__syncthreads" not in mbar.split("void attend_tile")[0].split("void pipeline_wait_k")[1]
    assert "mbarrier.arrive" not in plain_ring and "mbarrier.arrive" not in late
    tma = cuda_source(plan_of(seed_problem, dataclasses.replace(ring, mbarrier_ring=True, tma_kv=True)))
    assert "cp.async.bulk.tensor.4d" in tma and "cp.async.bulk.tensor" not in mbar
    assert "cp.async.mbarrier.arrive" not in tma and "mbar_arrive_expect_tx(full, 2 * KV_BOXES * KV_BOX_BYTES)" in tma
    assert "const __grid_constant__ TensorMap k_map" in tma and "KV_BOXES = 2;" in tma
    fp16 = cuda_source(plan_of(dataclasses.replace(seed_problem, dtype="fp16")))
    assert "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32" in fp16
    assert "cvt.rn.f16x2.f32" in fp16


def test_ring_step_knobs_change_the_step_they_name(seed_problem):
    """Row sums on the tensor cores, a pre-scaled Q and the last warp's refill, each against
    the TMA ring without it."""
    tma = FlashSchedule(128, 64, 4, 2, False, lazy_rescale=True, mbarrier_ring=True, tma_kv=True)
    base, rows, scaled, refill = (cuda_source(plan_of(seed_problem, dataclasses.replace(tma, **knobs))) for knobs in (
        {}, {"row_sums_mma": True}, {"row_sums_mma": True, "q_prescaled": True},
        {"row_sums_mma": True, "q_prescaled": True, "last_warp_refill": True}))
    softmax = "void online_softmax("
    assert "sum += p;" in base.split(softmax)[1] and "sum += p;" not in rows.split(softmax)[1]
    assert "mma_16816(row_sum[m], p[m][kk], ONE_PAIR, ONE_PAIR);" in rows and "ONE_PAIR" not in base
    assert "constexpr u32 ONE_PAIR = 0x3f803f80u;" in rows
    assert "quad_sum(row_sum" in base and "const float total = row_sum[m][2 * h];" in rows
    assert "SCALE_LOG2" in rows.split(softmax)[1].split("\n}\n")[0]
    assert "SCALE_LOG2" not in scaled.split(softmax)[1].split("\n}\n")[0]  # scores arrive as exponents
    assert "scale_q_rows(smem + Q_SMEM, warp_row0, lane);" in scaled and "scale_q_rows" not in rows
    assert "mma_16816_from(s[m][2 * np], a[m], b[0], b[1], start[m][0], start[m][1]);" in scaled
    assert "empty_barrier" in scaled and "empty_barrier" not in refill and "ring_releases" not in scaled
    assert "atomicAdd(&ring_releases[slot], 1) == WARPS - 1" in refill
    assert "pipeline_release(smem, k_head, v_head, j, slot, n_tiles, lane);" in refill
    assert "for (int t = 0; t < STAGES; ++t)" in refill and "for (int t = 0; t < STAGES - 1; ++t)" in scaled
    fp16 = cuda_source(plan_of(dataclasses.replace(seed_problem, dtype="fp16"), dataclasses.replace(
        tma, row_sums_mma=True, q_prescaled=True)))
    assert "constexpr u32 ONE_PAIR = 0x3c003c00u;" in fp16 and "cvt.f32.f16" in fp16


def test_256_row_blocks_run_on_the_tma_ring(seed_problem):
    schedule = FlashSchedule(256, 64, 8, 2, False, lazy_rescale=True, mbarrier_ring=True, tma_kv=True)
    source = cuda_source(plan_of(seed_problem, schedule))
    assert "constexpr int WARPS = 8;" in source and "ROWS_PER_WARP = 32;" in source
    with pytest.raises(CodegenError, match="256-row block"):
        cuda_source(plan_of(seed_problem, dataclasses.replace(schedule, tma_kv=False)))


def test_problem_values_are_compile_time_constants():
    problem = AttentionProblem(3, 32, 8, 1000, 3000, 64, causal=True, scale=0.25)
    source = cuda_source(plan_of(problem))
    for line in ("HEADS = 32;", "KV_HEADS = 8;", "GROUP = 4;", "SEQ_Q = 1000;", "SEQ_KV = 3000;",
                 "HEAD_DIM = 64;", "CAUSAL = true;"):  # fmt: skip
        assert f"constexpr int {line}" in source or f"constexpr bool {line}" in source
    scale_log2 = float(re.search(r"SCALE_LOG2 = ([0-9.e+-]+)f;", source)[1])
    assert scale_log2 == pytest.approx(0.25 * 1.4426950408889634, rel=1e-8)


def test_tensor_names_only_in_comments():
    problem = AttentionProblem(1, 2, 2, 64, 64, 64, q="query_tensor", k="key_tensor", v="value_tensor", out="result")
    source = cuda_source(plan_of(problem))
    for name in ("query_tensor", "key_tensor", "value_tensor", "result"):
        lines = [line for line in source.splitlines() if name in line]
        assert lines and all(line.lstrip().startswith("//") for line in lines)


@pytest.mark.parametrize("bad", ["q; asm(\"trap;\")", "1q", "q k", "q*/", ""])
def test_bad_tensor_names_are_refused(bad):
    with pytest.raises(CodegenError):
        cuda_source(plan_of(AttentionProblem(1, 2, 2, 64, 64, 64, q=bad)))


def test_identifier_and_comment_helpers():
    assert identifier("q_1") == "q_1"
    with pytest.raises(CodegenError):
        comment_text("ends */ here")
    with pytest.raises(CodegenError):
        comment_text("new\nline")


@pytest.mark.parametrize(
    "problem, schedule",
    [
        (AttentionProblem(1, 2, 2, 64, 64, 36), FlashSchedule()),  # head dim (no multiple of 8)
        (AttentionProblem(1, 2, 2, 64, 64, 64, dtype="fp32"), FlashSchedule()),  # dtype
        (AttentionProblem(1, 2, 2, 64, 64, 64), FlashSchedule(block_q=64, warps=8)),  # 8 rows a warp
        (AttentionProblem(1, 2, 2, 64, 64, 64), FlashSchedule(pingpong=True)),  # pingpong with 4 warps
        (AttentionProblem(1, 2, 2, 64, 64, 64), FlashSchedule(head_major=True)),  # head-major, not causal
        (AttentionProblem(1, 2, 2, 64, 64, 64), FlashSchedule(lazy_rescale=True, late_copy=True)),  # split ring
        (AttentionProblem(1, 2, 2, 64, 64, 64), FlashSchedule(kv_split=False, mbarrier_ring=True)),  # not lazy
        (AttentionProblem(1, 2, 2, 64, 64, 64), FlashSchedule(kv_split=False, lazy_rescale=True, tma_kv=True)),  # no ring
        (AttentionProblem(1, 2, 2, 64, 64, 64),
         FlashSchedule(kv_split=False, lazy_rescale=True, mbarrier_ring=True, row_sums_mma=True)),  # cp.async ring
        (AttentionProblem(1, 2, 2, 64, 64, 64),
         FlashSchedule(kv_split=False, lazy_rescale=True, mbarrier_ring=True, tma_kv=True, q_prescaled=True)),  # no rs
        (AttentionProblem(1, 2, 2, 64, 64, 64),
         FlashSchedule(kv_split=False, lazy_rescale=True, late_copy=True, mbarrier_ring=True, tma_kv=True,
                       row_sums_mma=True, q_prescaled=True)),  # pre-scaled Q with a late copy
        (AttentionProblem(1, 2, 2, 64, 64, 64),
         FlashSchedule(kv_split=False, lazy_rescale=True, mbarrier_ring=True, tma_kv=True, row_sums_mma=True,
                       last_warp_refill=True)),  # refill without the pre-scaled Q
        (AttentionProblem(1, 6, 4, 64, 64, 64), FlashSchedule()),  # kv_heads does not divide heads
        (AttentionProblem(1, 2, 2, 0, 64, 64), FlashSchedule()),  # empty sequence
        (AttentionProblem(1, 2, 2, 64, 64, 64, scale=-1.0), FlashSchedule()),  # negative scale
    ],
)
def test_invalid_plans_are_refused(problem, schedule):
    with pytest.raises(CodegenError):
        cuda_source(plan_of(problem, schedule))


def test_tma_copies_need_a_target_with_tma(seed_problem):
    schedule = FlashSchedule(kv_split=False, lazy_rescale=True, mbarrier_ring=True, tma_kv=True)
    assert cuda_source(KernelPlan("flash_attention", seed_problem, schedule, TARGETS["sm_90"]))
    with pytest.raises(CodegenError, match="no TMA"):
        cuda_source(KernelPlan("flash_attention", seed_problem, schedule, TARGETS["sm_80"]))


def test_other_kinds_are_refused(seed_problem):
    plan = dataclasses.replace(plan_of(seed_problem), kind="matmul")
    with pytest.raises(CodegenError):
        cuda_source(plan)
