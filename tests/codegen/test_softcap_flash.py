"""Flash attention under a soft cap of its scores, ``c·tanh(s / c)`` before the mask (Gemma 2's
attention logit cap). On the CPU: the cap is derived from every spelling (``ck.nn.attention``'s
``softcap``, the exponential tanh, a captured PyTorch function with ``torch.tanh`` and an additive
mask), reaches both families' sources, compiles without spills for sm_80, sm_90, sm_90a and
sm_120, and emulated ``mma.sync`` kernels match the graph's float64 reference; the planners that
run no cap refuse it by name. On the GPU: plans of both families against float32 PyTorch."""

from __future__ import annotations

import math
import shutil
from dataclasses import replace

import numpy as np
import pytest

import cherenkov as ck
from cherenkov.codegen import CompileError, compile_plans, cuda_source, load_kernel
from cherenkov.codegen.launch import TORCH_DTYPES
from cherenkov.rewrites.plan import TARGETS, AttentionBias, AttentionProblem, FlashSchedule, flash_schedule_problems
from cherenkov.rewrites.plan_fp8 import Fp8FlashSchedule, fp8_schedule_problems
from cherenkov.rewrites.plan_sm90a import HopperFlashSchedule

from .emulator import rounded
from .flash_emulator import emulate_flash, supported

needs_gxx = pytest.mark.skipif(shutil.which("g++") is None, reason="no g++ to emulate kernels with")

TOLERANCE = 2e-2
CAP = 50.0  # Gemma 2's attention logit cap


def capped_graph(b: int, h: int, hkv: int, sq: int, skv: int, d: int, causal: bool = False, dtype: str = "bf16",
                 cap: float = CAP, scale: float | None = None, bias: bool = False) -> ck.Graph:  # fmt: skip
    """``ck.nn.attention`` with a soft cap; ``bias``: an additive ``(B, 1, Sq, Skv)`` mask input instead."""
    g = ck.Graph("capped")
    q = g.input("q", (b, h, sq, d), dtype)
    k, v = (g.input(n, (b, hkv, skv, d), dtype) for n in "kv")
    if not bias:
        g.output(ck.nn.attention(q, k, v, causal=causal, softcap=cap, scale=scale), "o")
        return g
    mask = g.input("mask", (b, 1, sq, skv), dtype)
    group = h // hkv
    k, v = (ck.nn.repeat_kv_heads(x, group) for x in (k, v))
    scores = ck.nn.tanh((q @ k.transpose(-2, -1)) * ((scale or d**-0.5) / cap)) * cap + mask
    g.output(ck.nn.softmax(scores, axis=-1) @ v, "o")
    return g


def test_the_soft_cap_is_derived_from_each_spelling() -> None:
    """No mask, causal (GQA, ragged) and an additive bias: one flash kernel whose problem carries the
    cap and the scale, the tanh recognised in its exponential spelling."""
    cases = {
        "plain": (capped_graph(1, 2, 2, 64, 64, 64), "flash-attention-softcap"),
        "causal": (capped_graph(2, 4, 2, 100, 130, 128, causal=True), "flash-attention-softcap-causal"),
        "bias": (capped_graph(2, 4, 4, 48, 80, 64, bias=True), "flash-attention-softcap-bias"),
    }
    for name, (g, rule) in cases.items():
        d = ck.derive(g)
        assert [k.kind for k in d.kernels] == ["flash_attention"], name
        assert "tanh-from-exp2" in d.trace and rule in d.trace, (name, d.trace)
        problem = d.plans("sm_90")[0].problem
        head_dim = g.inputs["q"].shape[-1]
        assert problem.softcap == pytest.approx(CAP) and problem.scale == pytest.approx(head_dim**-0.5), name
        assert problem.causal == (name == "causal") and (problem.bias is not None) == (name == "bias"), name


def test_a_captured_gemma2_style_function_derives_the_capped_flash_kernel() -> None:
    """PyTorch's spelling, as transformers' eager Gemma 2 writes it: scores times the scale, divided
    by the cap, ``torch.tanh``, times the cap, plus a finite causal mask, softmax in float32."""
    torch = pytest.importorskip("torch")

    def gemma2_attention(q, k, v):
        scores = torch.matmul(q, k.transpose(2, 3)) * 0.125
        scores = torch.tanh(scores / 30.0) * 30.0
        causal = torch.full((q.shape[2], k.shape[2]), torch.finfo(torch.bfloat16).min).triu(1)
        probabilities = torch.softmax(scores + causal, dim=-1, dtype=torch.float32).to(q.dtype)
        return torch.matmul(probabilities, v)

    q, k, v = (torch.randn(1, 2, 96, 64, dtype=torch.bfloat16) for _ in range(3))
    g = ck.from_torch(gemma2_attention, q, k, v)
    d = ck.derive(g)
    assert [kernel.kind for kernel in d.kernels] == ["flash_attention"], d.kernels
    problem = d.plans("sm_90a")[0].problem
    assert problem.softcap == pytest.approx(30.0) and problem.scale == pytest.approx(0.125) and problem.causal
    expected = gemma2_attention(q.double(), k.double(), v.double()).numpy()
    got = ck.evaluate(g, {n: x.float().numpy() for n, x in zip(g.inputs, (q, k, v))})
    assert np.abs(next(iter(got.values())) - expected).max() < 1e-2


def test_the_cap_reaches_both_families_sources() -> None:
    d = ck.derive(capped_graph(2, 4, 2, 100, 130, 128, causal=True))
    plans = d.plans("sm_90a")
    hopper = next(p for p in plans if isinstance(p.schedule, HopperFlashSchedule))
    mma = next(p for p in plans if not isinstance(p.schedule, HopperFlashSchedule))
    for plan in (hopper, mma):
        source = cuda_source(plan)
        assert "50 * tanh(scale * q k^T / 50)" in source and "float soft_cap(float s)" in source, plan.name
        assert source.count("soft_cap(s") >= 1, plan.name
    assert "cap_scores(s);\n" in cuda_source(hopper)
    plain = cuda_source(ck.derive(_uncapped()).plans("sm_90")[0])
    assert "soft_cap" not in plain and "tanh" not in plain


def _uncapped() -> ck.Graph:
    g = ck.Graph("plain")
    q, k, v = (g.input(n, (1, 2, 64, 64), "bf16") for n in "qkv")
    g.output(ck.nn.attention(q, k, v), "o")
    return g


def test_planners_without_a_cap_refuse_it_by_name() -> None:
    problem = AttentionProblem(1, 8, 8, 256, 256, 128, softcap=CAP)
    prescaled = FlashSchedule(128, 64, 4, 2, kv_split=False, lazy_rescale=True, mbarrier_ring=True, tma_kv=True,
                              row_sums_mma=True, q_prescaled=True)  # fmt: skip
    assert not flash_schedule_problems(prescaled, replace(problem, softcap=0.0), TARGETS["sm_90"])
    assert any("soft cap" in r for r in flash_schedule_problems(prescaled, problem, TARGETS["sm_90"]))
    eight_bit = AttentionProblem(1, 8, 8, 256, 256, 128, "fp8_e4m3", out_dtype="bf16", softcap=CAP)
    assert any("soft cap" in r for r in fp8_schedule_problems(Fp8FlashSchedule(), eight_bit, TARGETS["sm_90"]))
    for bad in (-1.0, math.inf, math.nan):
        reasons = flash_schedule_problems(FlashSchedule(), AttentionProblem(1, 8, 8, 256, 256, 128, softcap=bad),
                                          TARGETS["sm_90"])  # fmt: skip
        assert any("soft cap" in r for r in reasons), bad
    g = ck.Graph("bad")
    q, k, v = (g.input(n, (1, 2, 64, 64), "bf16") for n in "qkv")
    for bad in (0.0, -3.0, math.inf):
        with pytest.raises(ck.GraphError, match="softcap"):
            ck.nn.attention(q, k, v, softcap=bad)


@pytest.mark.slow
def test_capped_plans_compile_without_spills(compiler, kernel_cache) -> None:
    """The first ``mma.sync`` plan of each target and the first two Hopper ones (D128, causal GQA)."""
    d = ck.derive(capped_graph(2, 8, 2, 200, 333, 128, causal=True))
    chosen = []
    for target in ("sm_80", "sm_90", "sm_90a", "sm_120"):
        plans = d.plans(target)
        chosen += [p for p in plans if isinstance(p.schedule, HopperFlashSchedule)][:2]
        chosen += [p for p in plans if not isinstance(p.schedule, HopperFlashSchedule)][:1]
    for plan, result in zip(chosen, compile_plans(chosen, compiler=compiler, cache_dir=kernel_cache)):
        assert not isinstance(result, CompileError), f"{plan.name}: {result}"
        assert result.report.spill_bytes == 0, (plan.name, plan.target.name, result.report)


@needs_gxx
@pytest.mark.parametrize(("sizes", "causal", "dtype"), [
    ((2, 4, 2, 40, 70, 64), True, "bf16"),  # GQA, ragged, causal
    ((1, 2, 2, 100, 77, 32), False, "fp16"),  # Sq > Skv
], ids=["bf16_gqa_causal", "fp16_tails"])  # fmt: skip
def test_emulated_capped_kernels_match_the_graph(sizes, causal, dtype) -> None:
    """A cap of 2 at scale 0.5 (the cap bends most scores: without it the output differs by more
    than 100 %), three ``mma.sync`` schedules: o within bf16/fp16 rounding of float64."""
    g = capped_graph(*sizes, causal=causal, dtype=dtype, cap=2.0, scale=0.5)
    rng = np.random.default_rng(0)
    inputs = {n: rounded(rng.standard_normal(x.shape), dtype) for n, x in g.inputs.items()}
    expected = ck.evaluate(g, inputs)["o"]
    plans = [p for p in ck.derive(g).plans("sm_80") if supported(p)]
    assert plans and all(p.problem.softcap == 2.0 for p in plans)
    for plan in plans[:: max(1, len(plans) // 3)][:3]:
        got = emulate_flash(plan, inputs["q"], inputs["k"], inputs["v"])["o"]
        error = np.linalg.norm(got - expected) / np.linalg.norm(expected)
        assert error <= 1e-2, f"{plan.schedule.key()}: o differs by {error:.3g}"


# ------------------------------------------------------------------------------ GPU

GPU_CASES = {
    "d128_gqa_causal_ragged": dict(sizes=(2, 8, 2, 200, 333, 128), causal=True),
    "d64_fp16": dict(sizes=(1, 4, 4, 256, 512, 64), dtype="fp16"),
    "d64_bias": dict(sizes=(2, 4, 4, 130, 190, 64), bias=True),
    "decode_gqa": dict(sizes=(4, 8, 2, 1, 1000, 128)),
}


@pytest.mark.gpu
@pytest.mark.parametrize("case", list(GPU_CASES))
def test_gpu_capped_flash_kernels_match_float32(case: str, gpu) -> None:
    """Every Hopper schedule (sm_90a on an sm_90 device) and a sample of ``mma.sync`` ones, cap 20 at
    the default scale, against float32 PyTorch: ``softmax(20·tanh(s / 20) [+ mask]) v``, into NaN-poisoned
    outputs."""
    torch = gpu
    spec = dict(GPU_CASES[case])
    sizes = spec.pop("sizes")
    g = capped_graph(*sizes, cap=20.0, **spec)
    target = "sm_90a" if torch.cuda.get_device_capability() == (9, 0) else "sm_90"
    plans = ck.derive(g).plans(target)
    chosen = [p for p in plans if isinstance(p.schedule, HopperFlashSchedule)] + [
        p for p in plans if not isinstance(p.schedule, HopperFlashSchedule)][::25]  # fmt: skip
    problem = chosen[0].problem
    assert problem.softcap == 20.0
    dtype = getattr(torch, TORCH_DTYPES[problem.dtype])
    generator = torch.Generator(device="cuda").manual_seed(0)
    tensors = {n: (3 * torch.randn(s, generator=generator, device="cuda")).to(dtype)
               for n, s in problem.stored_shapes().items() if n != problem.out}  # fmt: skip
    q, k, v = (tensors[n].float() for n in "qkv")
    group = problem.group_size
    scores = q @ k.repeat_interleave(group, dim=1).transpose(-2, -1) * problem.head_dim**-0.5
    scores = 20.0 * torch.tanh(scores / 20.0)
    if problem.causal:
        scores = scores.masked_fill(torch.ones_like(scores, dtype=torch.bool).triu(1), -math.inf)
    if problem.bias is not None:
        scores = scores + tensors[problem.bias.tensor].float()
    reference = torch.softmax(scores, dim=-1) @ v.repeat_interleave(group, dim=1)
    failures = []
    for plan, result in zip(chosen, compile_plans(chosen)):
        assert not isinstance(result, CompileError), f"{plan.name}: {result}"
        out = torch.full(problem.layout("o").shape, math.nan, device="cuda", dtype=dtype)
        extra = [tensors[problem.bias.tensor]] if problem.bias is not None else []
        load_kernel(result)(tensors["q"], tensors["k"], tensors["v"], out, *extra)
        torch.cuda.synchronize()
        error = float((out.float() - reference).norm() / reference.norm())  # NaN (unwritten) fails
        if not error <= TOLERANCE:
            failures.append((plan.schedule.key(), error))
    assert not failures, failures
