"""The 8-bit flash-attention family: derived from ``ck.nn.attention`` on e4m3 operands (the
scale rules move the descales into the form), planned for sm_89 and later, compiled for every
such target with the e4m3 mma in its SASS, and on the GPU against float32 attention of the
dequantised values (ragged lengths, causal, GQA, per-head scales)."""

from __future__ import annotations

import numpy as np
import pytest

import cherenkov as ck
from cherenkov.codegen import compile_plan, load_kernel
from cherenkov.graph.fp8 import round_to_fp8
from cherenkov.rewrites.plan import TARGETS, AttentionProblem, KernelPlan, ScaleFactor
from cherenkov.rewrites.plan_fp8 import FP8_SCHEDULES, Fp8FlashSchedule, fp8_schedule_problems
from cherenkov.rewrites.plan_sm90a import HopperFlashSchedule

EIGHT_BIT_TARGETS = ("sm_89", "sm_90", "sm_90a", "sm_120")


def fp8_graph(heads: int = 8, kv_heads: int = 8, causal: bool = False, per_head: bool = False, out: str = "fp32",
              seq_q: int = 256, seq_kv: int = 512, dim: int = 128) -> ck.Graph:  # fmt: skip
    g = ck.Graph("fp8_attention")
    q = g.input("q", (1, heads, seq_q, dim), "fp8_e4m3")
    k, v = g.input("k", (1, kv_heads, seq_kv, dim), "fp8_e4m3"), g.input("v", (1, kv_heads, seq_kv, dim), "fp8_e4m3")

    def scale(name: str, h: int) -> ck.Tensor:
        return g.input(name, (1, h, 1, 1) if per_head else (), "fp32")

    o = ck.nn.attention(q, k, v, causal=causal, descale=(scale("sq", heads), scale("sk", kv_heads), scale("sv", kv_heads)))
    g.output(o if out == "fp32" else o.cast(out), "o")
    return g


@pytest.mark.parametrize("case", [{}, {"causal": True, "kv_heads": 2, "per_head": True, "out": "bf16"}],
                         ids=["plain", "causal-gqa-per-head-bf16"])  # fmt: skip
def test_8_bit_attention_derives_the_scaled_flash_form_and_plans_it_on_sm89_and_later(case: dict) -> None:
    d = ck.derive(fp8_graph(**case))
    (kernel,) = d.kernels
    assert kernel.kind == "flash_attention" and kernel.source[0] == "FlashAttentionScaled"
    assert "attention-value-factor" in kernel.trace and any(r.startswith("flash-attention") for r in kernel.trace)
    for target in EIGHT_BIT_TARGETS:
        plans = d.plans(target)
        hopper = [p for p in plans if isinstance(p.schedule, HopperFlashSchedule)]
        assert any(isinstance(p.schedule, Fp8FlashSchedule) for p in plans), target
        # the wgmma variant on sm_90a writes a 16-bit output from registers
        assert bool(hopper) == (target == "sm_90a" and case.get("out", "fp32") != "fp32"), target
        problem = plans[0].problem
        assert problem.dtype == "fp8_e4m3" and problem.output_dtype == case.get("out", "fp32")
        assert sorted(f.tensor for f in problem.score_factors) == ["sk", "sq"]
        assert [f.tensor for f in problem.out_factors] == ["sv"]
    assert d.plans("sm_80") == []  # no 8-bit mma before sm_89
    inputs = {n: round_to_fp8(np.random.default_rng(0).standard_normal(t.shape), "fp8_e4m3")
              for n, t in d.graph.inputs.items() if t.dtype == "fp8_e4m3"}  # fmt: skip
    inputs.update({n: np.full(t.shape, s) for (n, t), s in zip(((n, d.graph.inputs[n]) for n in ("sq", "sk", "sv")),
                                                                (0.5, 2.0, 0.25))})  # fmt: skip
    np.testing.assert_allclose(d.evaluate(inputs)["o"], ck.evaluate(d.graph, inputs)["o"], rtol=1e-9, atol=1e-12)


def test_a_16_bit_operand_keeps_its_factor_where_the_16_bit_kernels_read_it() -> None:
    g = ck.Graph("scaled_bf16")
    q, k, v = (g.input(n, (1, 2, 64, 64), "bf16") for n in "qkv")
    s = g.input("s", (), "fp32")
    g.output(ck.nn.attention(q * s, k, v), "o")
    d = ck.derive(g)
    assert not d.forms_of("FlashAttentionScaled")
    assert any(k.kind == "flash_attention" and k.source[0] == "FlashAttention" for k in d.kernels)


def test_fp8_schedules_are_refused_with_reasons() -> None:
    problem = AttentionProblem(1, 8, 8, 256, 512, 128, dtype="fp8_e4m3", out_dtype="bf16")
    reasons = fp8_schedule_problems(Fp8FlashSchedule(128, 128, 2), problem, TARGETS["sm_120"])
    assert any("shared memory" in r for r in reasons) and any("registers" in r for r in reasons)
    assert any("sm_89" in r for r in fp8_schedule_problems(Fp8FlashSchedule(), problem, TARGETS["sm_80"]))
    bf16 = AttentionProblem(1, 8, 8, 256, 512, 128)
    assert any("dtype bf16" in r for r in fp8_schedule_problems(Fp8FlashSchedule(), bf16, TARGETS["sm_90"]))


def _plans(target: str) -> list[KernelPlan]:
    problem = AttentionProblem(2, 8, 2, 1000, 3000, 128, dtype="fp8_e4m3", causal=True, out_dtype="bf16",
                               score_factors=(ScaleFactor("sq", (2, 8), 8, 1), ScaleFactor("sk", (), 0, 0)),
                               out_factors=(ScaleFactor("sv", (2, 2), 2, 1, group=4),))  # fmt: skip
    return [KernelPlan("flash_attention", problem, s, TARGETS[target]) for s in FP8_SCHEDULES
            if not fp8_schedule_problems(s, problem, TARGETS[target])]  # fmt: skip


# Hopper has no 8-bit mma.sync: ptxas runs each m16n8k32 e4m3 mma as two fp16 m16n8k16 mma after
# unpacking the bytes (its fp8 tensor-core rate is wgmma's); sm_89 and sm_120 run it natively.
EXPECTED_MMA = {"sm_89": "QMMA.16832.F32.E4M3.E4M3", "sm_120": "QMMA.16832.F32.E4M3.E4M3",
                "sm_90": "F2FP.F16.E4M3.UNPACK", "sm_90a": "F2FP.F16.E4M3.UNPACK"}  # fmt: skip


@pytest.mark.parametrize("target", EIGHT_BIT_TARGETS)
def test_fp8_plans_compile_without_spills_with_the_e4m3_mma_in_sass(target: str, nvcc, sass, kernel_cache) -> None:
    plans = _plans(target)
    assert plans
    for plan in plans:
        compiled = compile_plan(plan, compiler=nvcc, cache_dir=kernel_cache)
        assert compiled.report.spill_bytes == 0, (plan.name, compiled.report)
        if sass is not None:
            text = sass(compiled.cubin_path)
            assert EXPECTED_MMA[target] in text and "F2FP.SATFINITE.E4M3.F32.PACK" in text, plan.name


GPU_CASES = [
    AttentionProblem(1, 8, 8, 4096, 8192, 128, dtype="fp8_e4m3", out_dtype="bf16",
                     score_factors=(ScaleFactor("sq", ()), ScaleFactor("sk", ())), out_factors=(ScaleFactor("sv", ()),)),
    AttentionProblem(2, 8, 2, 1000, 3000, 128, dtype="fp8_e4m3", causal=True, out_dtype="fp32",
                     score_factors=(ScaleFactor("sq", (2, 8), 8, 1), ScaleFactor("sk", (2, 2), 2, 1, group=4)),
                     out_factors=(ScaleFactor("sv", (2, 2), 2, 1, group=4),)),
    AttentionProblem(2, 4, 4, 77, 333, 64, dtype="fp8_e4m3", out_dtype="fp16",
                     score_factors=(ScaleFactor("sq", ()),), out_factors=()),
]  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("problem", GPU_CASES, ids=["seed-bf16", "ragged-causal-gqa-per-head-fp32", "d64-fp16"])
def test_fp8_kernels_match_float32_attention_of_the_dequantised_values(problem: AttentionProblem, cuda_device,
                                                                       kernel_cache) -> None:  # fmt: skip
    import torch

    from cherenkov.search.measure import _inputs, _reference, factor_products

    target = TARGETS["sm_90"] if torch.cuda.get_device_capability(cuda_device) == (9, 0) else None
    if target is None:
        major, minor = torch.cuda.get_device_capability(cuda_device)
        target = TARGETS.get(f"sm_{major}{minor}")
    if target is None or target.compute_capability < 89:
        pytest.skip("no 8-bit mma.sync on this GPU")
    stored = _inputs(problem, 0, cuda_device.index or 0)
    expected = _reference(problem, *(stored[problem.name(r)] for r in "qkv"), None, factor_products(problem, stored))
    assert torch.isfinite(expected).all()
    for schedule in FP8_SCHEDULES:
        plan = KernelPlan("flash_attention", problem, schedule, target)
        if fp8_schedule_problems(schedule, problem, target):
            continue
        kernel = load_kernel(compile_plan(plan, cache_dir=kernel_cache))
        out = kernel(*(stored[problem.name(r)] for r in "qkv"), factors=tuple(stored[f.tensor] for f in problem.factors))
        torch.cuda.synchronize()
        got = out.float()
        assert not torch.isnan(got).any(), plan.name
        error = float((got - expected).norm() / expected.norm())
        assert error <= 5e-2, (plan.name, error)


EMULATED_CASES = [
    (AttentionProblem(1, 2, 1, 40, 100, 64, dtype="fp8_e4m3", causal=True, out_dtype="bf16",
                      score_factors=(ScaleFactor("sq", (1, 2, 1, 1), 2, 1), ScaleFactor("sk", ())),
                      out_factors=(ScaleFactor("sv", (1, 1, 1, 1), 1, 1, group=2),)), Fp8FlashSchedule(64, 64, 2)),
    (AttentionProblem(1, 1, 1, 70, 150, 32, dtype="fp8_e4m3", out_dtype="fp32",
                      score_factors=(ScaleFactor("sq", ()),)), Fp8FlashSchedule(128, 128, 2)),
]  # fmt: skip


@pytest.mark.parametrize(("problem", "schedule"), EMULATED_CASES, ids=["causal-gqa-per-head-bf16", "d32-tails-fp32"])
def test_emulated_fp8_kernel_matches_attention_of_the_dequantised_values(problem: AttentionProblem,
                                                                         schedule: Fp8FlashSchedule) -> None:  # fmt: skip
    import shutil

    if shutil.which("g++") is None:
        pytest.skip("no g++ to emulate kernels with")
    from .fp8_flash_emulator import emulate_fp8_flash

    plan = KernelPlan("flash_attention", problem, schedule, TARGETS["sm_90"])
    assert not fp8_schedule_problems(schedule, problem, plan.target)
    rng = np.random.default_rng(5)
    stored = {r: round_to_fp8(rng.standard_normal(problem.layout(r).shape) * 2.0, "fp8_e4m3") for r in "qkv"}
    for f in problem.factors:
        stored[f.tensor] = 0.5 + rng.random(f.shape)
    got = emulate_fp8_flash(plan, stored)
    assert not np.isnan(got).any()
    b_, h_ = np.arange(problem.batch)[:, None], np.arange(problem.heads)[None, :]

    def product(factors) -> np.ndarray:
        total = np.ones((problem.batch, problem.heads))
        for f in factors:
            total = total * np.asarray(stored[f.tensor]).reshape(-1)[f.offset + b_ * f.batch + (h_ // f.group) * f.head]
        return total[:, :, None, None]

    q, k, v = stored["q"], np.repeat(stored["k"], problem.group_size, 1), np.repeat(stored["v"], problem.group_size, 1)
    scores = q @ k.transpose(0, 1, 3, 2) * problem.head_dim**-0.5 * product(problem.score_factors)
    if problem.causal:
        scores = np.where(np.arange(problem.seq_q)[:, None] < np.arange(problem.seq_kv)[None, :], -np.inf, scores)
    p = np.exp(scores - scores.max(-1, keepdims=True))
    expected = product(problem.out_factors) * (p / p.sum(-1, keepdims=True)) @ v
    error = np.linalg.norm(got - expected) / np.linalg.norm(expected)
    assert error <= 3e-2, error


HOPPER_CASES = [
    AttentionProblem(1, 8, 8, 4096, 8192, 128, dtype="fp8_e4m3", out_dtype="bf16",
                     score_factors=(ScaleFactor("sq", ()), ScaleFactor("sk", ())), out_factors=(ScaleFactor("sv", ()),)),
    AttentionProblem(2, 8, 2, 1000, 3000, 128, dtype="fp8_e4m3", causal=True, out_dtype="fp16",
                     score_factors=(ScaleFactor("sq", (2, 8), 8, 1), ScaleFactor("sk", (2, 2), 2, 1, group=4)),
                     out_factors=(ScaleFactor("sv", (2, 2), 2, 1, group=4),)),
]  # fmt: skip


def _hopper_plans(problem: AttentionProblem) -> list[KernelPlan]:
    from cherenkov.rewrites.plan_sm90a import HOPPER_SCHEDULES, hopper_schedule_problems

    target = TARGETS["sm_90a"]
    return [KernelPlan("flash_attention", problem, s, target) for s in HOPPER_SCHEDULES
            if not hopper_schedule_problems(s, problem, target)]  # fmt: skip


def test_hopper_fp8_plans_compile_with_e4m3_wgmma_in_sass(nvcc, sass, kernel_cache) -> None:
    plans = _hopper_plans(HOPPER_CASES[1])
    assert len(plans) >= 3
    for plan in plans:
        compiled = compile_plan(plan, compiler=nvcc, cache_dir=kernel_cache)
        assert compiled.report.spill_bytes == 0, (plan.name, compiled.report)
        assert not compiled.report.wgmma_serialized and not compiled.report.wgmma_fenced, (plan.name, compiled.report)
        if sass is not None:
            text = sass(compiled.cubin_path)
            assert "QGMMA.64x128x32.F32.E4M3.E4M3" in text and "F2FP.SATFINITE.E4M3.F32.PACK" in text, plan.name


@pytest.mark.gpu
@pytest.mark.parametrize("problem", HOPPER_CASES, ids=["seed-bf16", "ragged-causal-gqa-per-head-fp16"])
def test_hopper_fp8_kernels_match_float32_attention_of_the_dequantised_values(problem: AttentionProblem, cuda_device,
                                                                              kernel_cache) -> None:  # fmt: skip
    import torch

    from cherenkov.search.measure import _inputs, _reference, factor_products

    if torch.cuda.get_device_capability(cuda_device) != (9, 0):
        pytest.skip("the wgmma family needs a Hopper GPU")
    stored = _inputs(problem, 0, cuda_device.index or 0)
    expected = _reference(problem, *(stored[problem.name(r)] for r in "qkv"), None, factor_products(problem, stored))
    for plan in _hopper_plans(problem):
        kernel = load_kernel(compile_plan(plan, cache_dir=kernel_cache))
        out = kernel(*(stored[problem.name(r)] for r in "qkv"), factors=tuple(stored[f.tensor] for f in problem.factors))
        torch.cuda.synchronize()
        got = out.float()
        assert not torch.isnan(got).any(), plan.name
        error = float((got - expected).norm() / expected.norm())
        assert error <= 5e-2, (plan.name, error)


@pytest.mark.gpu
def test_hopper_fp8_kernels_follow_scores_rising_along_the_keys(cuda_device, kernel_cache) -> None:
    """Keys scaled by up to 12 along the sequence: later key tiles raise the row max by more than
    the 8-bit lazy threshold (2^2), so the lazy schedules rescale O and the row sums mid-row."""
    import torch

    from cherenkov.search.measure import _inputs, _reference, factor_products

    if torch.cuda.get_device_capability(cuda_device) != (9, 0):
        pytest.skip("the wgmma family needs a Hopper GPU")
    problem = HOPPER_CASES[1]
    stored = _inputs(problem, 1, cuda_device.index or 0)
    rise = torch.linspace(0.25, 12.0, problem.seq_kv, device=cuda_device).view(1, 1, -1, 1)
    stored[problem.k] = (stored[problem.k].float() * rise).to(torch.float8_e4m3fn)
    expected = _reference(problem, *(stored[problem.name(r)] for r in "qkv"), None, factor_products(problem, stored))
    plans = [p for p in _hopper_plans(problem) if p.schedule.lazy_rescale]
    assert plans
    for plan in plans:
        kernel = load_kernel(compile_plan(plan, cache_dir=kernel_cache))
        got = kernel(*(stored[problem.name(r)] for r in "qkv"), factors=tuple(stored[f.tensor] for f in problem.factors))
        torch.cuda.synchronize()
        error = float((got.float() - expected).norm() / expected.norm())
        assert not torch.isnan(got).any() and error <= 5e-2, (plan.name, error)


def mx_graph(heads: int = 8, kv_heads: int = 2, seq_q: int = 256, seq_kv: int = 512, dim: int = 128) -> ck.Graph:
    """Causal attention of e4m3 q and k with MX scales (``e8m0``, one per 32 head-dim elements) and an e4m3 v
    with a per-tensor descale."""
    g = ck.Graph("mx_attention")
    q = g.input("q", (1, heads, seq_q, dim), "fp8_e4m3")
    k, v = g.input("k", (1, kv_heads, seq_kv, dim), "fp8_e4m3"), g.input("v", (1, kv_heads, seq_kv, dim), "fp8_e4m3")
    sq, sk = g.input("sq", (1, heads, seq_q, dim // 32), "e8m0"), g.input("sk", (1, kv_heads, seq_kv, dim // 32), "e8m0")
    group = heads // kv_heads
    k, sk, v = (ck.nn.repeat_kv_heads(x, group) for x in (k, sk, v))
    o = ck.nn.attention(ck.nn.dequantize(q, sq, block=32), ck.nn.dequantize(k, sk, block=32),
                        ck.nn.dequantize(v, g.input("sv", (), "fp32")), causal=True)  # fmt: skip
    g.output(o.cast("bf16"), "o")
    return g


def test_mx_attention_plans_the_block_scaled_mma_on_sm120a_only(nvcc, sass, kernel_cache) -> None:
    d = ck.derive(mx_graph())
    (kernel,) = d.kernels
    assert kernel.source[0] == "FlashAttentionScaled"
    for target in ("sm_89", "sm_90", "sm_90a", "sm_120"):
        assert d.plans(target) == [], target  # the MX scales need the block-scaled mma
    plans = d.plans("sm_120a")
    assert plans and all(p.problem.q_block_scales and p.problem.k_block_scales for p in plans)
    for plan in plans:
        compiled = compile_plan(plan, compiler=nvcc, cache_dir=kernel_cache)
        assert compiled.report.spill_bytes == 0, (plan.name, compiled.report)
        if sass is not None:
            assert "QMMA.SF.16832.F32.E4M3.E4M3.E8" in sass(compiled.cubin_path), plan.name


def test_emulated_block_scaled_kernel_matches_attention_of_the_dequantised_values() -> None:
    import shutil

    if shutil.which("g++") is None:
        pytest.skip("no g++ to emulate kernels with")
    from .fp8_flash_emulator import emulate_fp8_flash

    d = ck.derive(mx_graph(heads=4, kv_heads=2, seq_q=40, seq_kv=100, dim=64))
    plan = next(p for p in d.plans("sm_120a") if p.schedule.block_q == 64)
    rng = np.random.default_rng(6)
    inputs = {n: round_to_fp8(rng.standard_normal(t.shape) * 2.0, "fp8_e4m3")
              for n, t in d.graph.inputs.items() if t.dtype == "fp8_e4m3"}  # fmt: skip
    inputs.update(sq=np.exp2(rng.integers(-3, 4, d.graph.inputs["sq"].shape)),
                  sk=np.exp2(rng.integers(-3, 4, d.graph.inputs["sk"].shape)), sv=np.array(0.75))  # fmt: skip
    expected = ck.evaluate(d.graph, inputs)["o"].astype(np.float64)
    got = emulate_fp8_flash(plan, inputs)
    assert not np.isnan(got).any()
    error = np.linalg.norm(got - expected) / np.linalg.norm(expected)
    assert error <= 3e-2, error
