"""Compiling plans: the seed plans on three archs (every pair of knob values), PTX contents, spills, cache,
errors."""

from __future__ import annotations

import dataclasses
import itertools
import time

import pytest

from cherenkov.codegen import (
    CompiledKernel,
    CompileError,
    FlashLayout,
    compile_plan,
    compile_plans,
    valid_flash_plans,
)
from cherenkov.codegen.compile import Nvcc
from cherenkov.codegen.report import parse_ptxas_report
from cherenkov.rewrites.plan import TARGETS, FlashSchedule, KernelPlan

ARCHS = ("sm_80", "sm_90", "sm_120")
DEFAULT_KEY = FlashSchedule().key()
TMA_SEED_WINNER_KEY = "q128_kv64_w4_s2_joint_swz_x4_lazy_late_mbar_tma"
# The H200 seed winner of the eighth session (256 rows, 129 KB of shared memory: not an sm_120
# plan) and its 128-row twin, which sm_120's 99 KB a block hold.
ROWS_SEED_WINNER_KEY = "q256_kv64_w8_s2_joint_swz_x4_lazy_mbar_tma_rs_qs_lwr"
ROWS_SM120_TWIN_KEY = "q128_kv64_w4_s2_joint_swz_x4_lazy_mbar_tma_rs_qs_lwr"

PTXAS_LOG = """\
ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function 'other' for 'sm_90'
ptxas info    : Function properties for other
    8 bytes stack frame, 4 bytes spill stores, 4 bytes spill loads
ptxas info    : Used 32 registers, used 0 barriers
ptxas info    : Compiling entry function 'flash_attention_x' for 'sm_90'
ptxas info    : Function properties for flash_attention_x
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 254 registers, used 1 barriers, 1024 bytes smem, 384 bytes cmem[0]
"""


class CountingCompiler:
    """Wraps a compiler and counts its invocations."""

    def __init__(self, inner):
        self.inner = inner
        self.name = inner.name
        self.flags = inner.flags
        self.calls = 0

    @property
    def version(self) -> str:
        return self.inner.version

    def compile(self, source: str, arch: str):
        self.calls += 1
        return self.inner.compile(source, arch)


class FailingCompiler:
    name = "failing"
    flags = ()
    version = "failing 1.0"

    def compile(self, source: str, arch: str):
        raise CompileError("refused", log="kernel.cu(1): error: nope", arch=arch)


def test_parse_ptxas_report_reads_the_named_entry():
    report = parse_ptxas_report(PTXAS_LOG, "flash_attention_x", smem_dynamic=4096)
    assert (report.registers, report.smem_static, report.smem_dynamic) == (254, 1024, 4096)
    assert (report.spill_stores, report.spill_loads, report.stack_frame, report.spill_bytes) == (0, 0, 0, 0)
    other = parse_ptxas_report(PTXAS_LOG, "other")
    assert (other.registers, other.spill_bytes, other.stack_frame) == (32, 8, 8)
    with pytest.raises(CompileError):
        parse_ptxas_report(PTXAS_LOG, "missing")
    assert not report.wgmma_serialized and not other.wgmma_serialized
    assert not report.wgmma_fenced and not other.wgmma_fenced


def test_parse_ptxas_report_notes_a_serialised_wgmma_pipeline_of_the_module():
    note = ("ptxas info    : (C7515) Potential Performance Loss: wgmma.mma_async instructions are serialized due to "
            "non wgmma instructions defining accumulator registers of a wgmma between start and end of the pipeline "
            "stage in the function '{}'\n")
    for function, serialized in (("flash_attention_x_statistics", True), ("flash_attention_x", True),
                                 ("other", False)):
        assert parse_ptxas_report(PTXAS_LOG + note.format(function), "flash_attention_x").wgmma_serialized \
            == serialized, function


def test_parse_ptxas_report_notes_injected_wgmma_fences():
    notes = ("ptxas info    : (C7519) warpgroup.arrive is injected in around line 755 by compiler to allow use of "
             "registers in GMMA in function '{}'\n",
             "ptxas info    : (C7517) warpgroup.wait is injected in around line 27304 by compiler to allow use of "
             "registers defined by GMMA in function '{}'\n")
    for note in notes:
        for function, fenced in (("flash_attention_x_dq", True), ("flash_attention_x", True), ("other", False)):
            report = parse_ptxas_report(PTXAS_LOG + note.format(function), "flash_attention_x")
            assert report.wgmma_fenced == fenced and not report.wgmma_serialized, (note, function)


def test_compile_plans_returns_errors_in_place(seed_problem, kernel_cache):
    plans = valid_flash_plans(seed_problem, TARGETS["sm_90"])[:3]
    results = compile_plans(plans, compiler=FailingCompiler(), cache_dir=kernel_cache, jobs=2)
    assert len(results) == 3 and all(isinstance(r, CompileError) for r in results)
    assert "error: nope" in results[0].log and plans[0].name in str(results[0])


def knob_pairs(plan: KernelPlan) -> set[tuple]:
    """Every pair of (knob, value) settings of the plan's schedule."""
    knobs = [(f.name, getattr(plan.schedule, f.name)) for f in dataclasses.fields(plan.schedule)]
    return set(itertools.combinations(knobs, 2))


def pairwise_cover(plans: list[KernelPlan]) -> list[KernelPlan]:
    """A few of ``plans`` (greedily, in their order) in which every pair of knob values that some plan sets
    together occurs at least once: a code path that only two knobs together reach is compiled, at a tenth
    of the cost of compiling every plan."""
    missing = set().union(*map(knob_pairs, plans))
    chosen = []
    while missing:
        best = max(plans, key=lambda plan: len(knob_pairs(plan) & missing))
        chosen.append(best)
        missing -= knob_pairs(best)
    return chosen


def test_pairwise_cover_holds_every_pair_of_knob_values(seed_problem):
    plans = valid_flash_plans(seed_problem, TARGETS["sm_90"])
    cover = pairwise_cover(plans)
    assert len(cover) < len(plans) / 5
    assert set().union(*map(knob_pairs, cover)) == set().union(*map(knob_pairs, plans))


def seed_plans(seed_problem, arch: str) -> list[KernelPlan]:
    """The pairwise cover of the seed's plans for ``arch``, with the plans the spill test names."""
    plans = valid_flash_plans(seed_problem, TARGETS[arch])
    named = [p for p in plans if p.schedule.key() in (DEFAULT_KEY, TMA_SEED_WINNER_KEY, ROWS_SEED_WINNER_KEY,
                                                      ROWS_SM120_TWIN_KEY)]
    return list({p.schedule.key(): p for p in pairwise_cover(plans) + named}.values())


@pytest.fixture(scope="module")
def seed_kernels(seed_problem, compiler) -> dict[tuple[str, str], CompiledKernel]:
    """The seed plans of ``seed_plans`` compiled for sm_80, sm_90 and sm_120 (in parallel)."""
    plans = [plan for arch in ARCHS for plan in seed_plans(seed_problem, arch)]
    start = time.perf_counter()
    results = compile_plans(plans, compiler=compiler)
    print(f"compiled {len(plans)} plans in {time.perf_counter() - start:.1f} s")
    failures = [str(r).splitlines()[0] for r in results if isinstance(r, CompileError)]
    assert not failures, failures
    return {(r.arch, r.plan.schedule.key()): r for r in results}


@pytest.mark.slow
def test_seed_plans_compile_with_mma_cp_async_ldmatrix(seed_kernels, seed_problem):
    for arch in ARCHS:
        assert sum(1 for a, _ in seed_kernels if a == arch) == len(seed_plans(seed_problem, arch))
    for (arch, key), kernel in seed_kernels.items():
        ptx = kernel.ptx_path.read_text()
        assert f".target {arch}" in ptx
        for instruction in ("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32", "cp.async.cg.shared.global",
                            "cp.async.wait_group", "ldmatrix.sync.aligned"):  # fmt: skip
            assert instruction in ptx, (arch, key, instruction)
        assert (".x4" in ptx) == (kernel.plan.schedule.ldmatrix_x == 4)
        assert kernel.report.registers <= 255
        assert kernel.report.smem_dynamic == FlashLayout.from_plan(kernel.plan).total_bytes


@pytest.mark.slow
@pytest.mark.parametrize(
    ("arch", "key"),
    [(arch, key) for arch in ("sm_90", "sm_120") for key in (DEFAULT_KEY, TMA_SEED_WINNER_KEY)]
    + [("sm_90", ROWS_SEED_WINNER_KEY), ("sm_120", ROWS_SM120_TWIN_KEY)],
)
def test_default_plan_and_the_seed_winners_do_not_spill(seed_kernels, arch, key):
    """No local memory: the default plan, the H200 seed winners of 2026-11-30 (the TMA ring,
    whose sm_120 build once spilled around a cluster-rank check of its TMA copies; the 256-row
    ring with the step knobs) and that one's 128-row twin on sm_120."""
    kernel = seed_kernels[(arch, key)]
    assert kernel.report.spill_bytes == 0 and kernel.report.stack_frame == 0, kernel.report
    if kernel.plan.schedule.tma_kv:
        assert "cp.async.bulk.tensor.4d" in kernel.ptx_path.read_text()  # (d, s, h, b) at the operand strides


def test_cache_hit_skips_the_compiler(seed_problem, compiler, kernel_cache):
    counting = CountingCompiler(compiler)
    plan = KernelPlan("flash_attention", seed_problem, FlashSchedule(block_q=64, block_kv=32), TARGETS["sm_90"])
    first = compile_plan(plan, compiler=counting, cache_dir=kernel_cache)
    second = compile_plan(plan, compiler=counting, cache_dir=kernel_cache)
    assert counting.calls == 1
    assert not first.cache_hit and second.cache_hit
    assert second.cubin_path == first.cubin_path and second.report == first.report
    assert second.source_hash == first.source_hash


def test_tampered_cache_entry_is_recompiled(seed_problem, compiler, kernel_cache):
    counting = CountingCompiler(compiler)
    plan = KernelPlan("flash_attention", seed_problem, FlashSchedule(block_q=64, block_kv=32), TARGETS["sm_90"])
    first = compile_plan(plan, compiler=counting, cache_dir=kernel_cache)
    original = first.cubin_path.read_bytes()
    first.cubin_path.write_bytes(original[:-16] + bytes(16))
    again = compile_plan(plan, compiler=counting, cache_dir=kernel_cache)
    assert counting.calls == 2 and not again.cache_hit
    assert again.cubin_path.read_bytes() == original


def test_compile_error_carries_the_log(compiler):
    if not isinstance(compiler, Nvcc):
        pytest.skip("needs nvcc")
    with pytest.raises(CompileError) as caught:
        compiler.compile('extern "C" __global__ void broken() { undefined_name = 1; }', "sm_90")
    assert "undefined_name" in caught.value.log and caught.value.arch == "sm_90"
