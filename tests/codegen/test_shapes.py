"""Attention for every shape the benchmark names (issue 22, and its sliding windows), on the CPU: decode, short
queries, head dims 32-256 and D_v != D derive flash-attention plans — never the unfused
kernels, never a pointwise loop — on sm_80, sm_90, sm_90a and sm_120; decode gets split-KV
plans through the rule ``flash-split-kv``; the plan the cost model ranks first compiles
without spills, and each short-query kind compiles for every mma.sync architecture. Multi-query
attention (one K/V head for every query head) gets the same kernels, emulated."""

from __future__ import annotations

import functools
import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest

import cherenkov as ck
from cherenkov.codegen import CompileError, compile_plans
from cherenkov.rewrites.plan import TARGETS, AttentionProblem, KernelPlan, flash_schedule_problems
from cherenkov.rewrites.plan_sm90a import hopper_schedule_problems
from cherenkov.rewrites.schedule import flash_schedules
from cherenkov.search.cost_model import predict_flash
from tests.codegen.emulator import rounded
from tests.codegen.flash_emulator import emulate_flash, supported
from tests.codegen.test_flash_gpu import case_id
from tests.codegen.test_flash_backward import needs_gxx

ROOT = Path(__file__).resolve().parents[2]
FLASH_TARGETS = ("sm_80", "sm_90", "sm_90a", "sm_120")


@functools.cache
def benchmark():
    """``benchmarks/attention.py`` as a module (its folder on the path, as when it runs): its
    SHAPES are the rows this test covers."""
    if str(ROOT / "benchmarks") not in sys.path:
        sys.path.append(str(ROOT / "benchmarks"))
    spec = importlib.util.spec_from_file_location("cherenkov_benchmark_attention", ROOT / "benchmarks" / "attention.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


ROWS = ("seed", *benchmark().ISSUE_22, *benchmark().WINDOWS, *benchmark().HEAD_DIMS)


@functools.cache
def derivation(name: str) -> ck.Derivation:
    bench = benchmark()
    return ck.derive(bench.row_graph(bench.SHAPES[name], bench.load_example()))


@pytest.mark.parametrize("name", ROWS)
def test_every_row_has_flash_plans_on_every_target(name):
    d = derivation(name)
    assert [k.kind for k in d.kernels] == ["flash_attention"]
    for target in FLASH_TARGETS:
        plans = d.plans(target)
        assert plans, f"{name}: no flash plan on {target}"
        assert [k.kind for k in d.kernels_for(target)] == ["flash_attention"]
        assert all(not flash_schedule_problems(p.schedule, p.problem, p.target) for p in plans
                   if not hasattr(p.schedule, "consumer_warpgroups"))  # fmt: skip


def test_value_dims_reach_the_problem():
    problem = derivation("b2h16s2k_d192_dv128").plans("sm_90")[0].problem
    assert (problem.head_dim, problem.value_dim, problem.v_dim) == (192, 128, 128)
    assert problem.logical_shape("v")[-1] == problem.logical_shape("o")[-1] == 128
    assert problem.flops == 2.0 * 2 * 16 * 2048 * 2048 * (192 + 128)


@pytest.mark.parametrize("name", ["b2h16s2k_d96", "b2h16s2k_d192_dv128", "b2h16s2k_d256"])
def test_head_dims_off_whole_boxes_and_value_dims_get_hopper_plans(name):
    hopper = [p for p in derivation(name).plans("sm_90a") if hasattr(p.schedule, "consumer_warpgroups")]
    assert hopper, f"{name}: no sm_90a plan"
    shape = benchmark().SHAPES[name]
    assert all(not hopper_schedule_problems(p.schedule, p.problem, p.target) for p in hopper)
    assert {(p.problem.head_dim, p.problem.v_dim) for p in hopper} == {(shape.D, shape.DV or shape.D)}


@pytest.mark.parametrize("name", ["decode_b16_8k", "decode_b1_64k"])
def test_decode_gets_split_kv_plans_derived_by_their_rule(name):
    plans = derivation(name).plans("sm_120")
    split = [p for p in plans if p.schedule.kv_splits > 1]
    assert split and all(p.trace[-1] == "flash-split-kv" for p in split)
    assert all("flash-split-kv" not in p.trace for p in plans if p.schedule.kv_splits == 1)
    assert any(p.schedule.pack_group and p.schedule.warp_keys for p in split)
    ranked = min(plans, key=lambda p: (predict_flash(p).ms, p.name))
    assert ranked.schedule.pack_group, "the cost model ranks a packed GQA group first for decode"


def test_long_queries_get_no_short_query_plans():
    for plan in derivation("seed").plans("sm_90"):
        s = plan.schedule
        assert s.kv_splits == 1 and not s.pack_group and not s.warp_keys and s.warps >= 4


@pytest.mark.slow
@pytest.mark.parametrize("name", ROWS)
def test_the_first_ranked_sm120_plan_compiles_without_spills(name, compiler, kernel_cache):
    plans = derivation(name).plans("sm_120")
    best = min(plans, key=lambda p: (predict_flash(p).ms, p.name))
    (kernel,) = compile_plans([best], compiler=compiler, cache_dir=kernel_cache)
    assert not isinstance(kernel, CompileError), str(kernel)
    assert kernel.report.spill_bytes == 0, f"{name}: {best.schedule.key()} spills {kernel.report.spill_bytes} B"


# a problem of each short-query kind and padded head dim, with what its schedule must have
KINDS = [
    (AttentionProblem(3, 32, 8, 1, 8191, 128), lambda s: s.warp_keys and s.pack_group and s.kv_splits > 1),
    (AttentionProblem(2, 32, 4, 1, 5000, 128), lambda s: s.tma_kv and s.kv_splits > 1),
    (AttentionProblem(2, 8, 2, 1, 3000, 192, value_dim=128), lambda s: s.pack_group and s.kv_splits > 1),
    (AttentionProblem(2, 16, 4, 4, 3001, 96), lambda s: s.pack_group),
    (AttentionProblem(1, 4, 2, 257, 513, 80), lambda s: True),
    (AttentionProblem(2, 4, 4, 300, 700, 32, causal=True), lambda s: True),
    (AttentionProblem(2, 8, 2, 1, 3000, 40), lambda s: s.pack_group and s.kv_splits > 1),  # zero-filled to 48
    (AttentionProblem(4, 8, 2, 1, 2048, 64, dtype="fp16"), lambda s: s.kv_splits > 1),
    # four causal drafts after 4093 cached keys (a KV cache's chunk: query i sees keys j <= i + 4093)
    (AttentionProblem(2, 32, 8, 4, 4097, 128, window=4101, window_ahead=4093),
     lambda s: s.pack_group and s.warp_keys and s.kv_splits > 1),
]


@pytest.mark.parametrize("arch", ["sm_80", "sm_90", "sm_120"])
def test_short_query_kinds_compile_for_every_mma_sync_arch(arch, compiler, kernel_cache):
    """The first-ranked valid schedule of each kind on each architecture (none for TMA on sm_80);
    the short-query ones do not spill."""
    target, plans = TARGETS[arch], []
    for problem, wanted in KINDS:
        schedules = [s for s in flash_schedules(problem.head_dim, target, problem.value_dim)
                     if wanted(s) and not flash_schedule_problems(s, problem, target)]  # fmt: skip
        if schedules:
            candidates = [KernelPlan("flash_attention", problem, s, target) for s in schedules]
            plans.append(min(candidates, key=lambda p: (predict_flash(p).ms, p.name)))
    assert len(plans) >= len(KINDS) - (1 if arch == "sm_80" else 0), [case_id(p) for p in plans]
    for plan, kernel in zip(plans, compile_plans(plans, compiler=compiler, cache_dir=kernel_cache)):
        assert not isinstance(kernel, CompileError), f"{case_id(plan)}: {kernel}"
        assert "mma.sync.aligned.m16n8k16" in kernel.ptx_path.read_text()
        if plan.schedule.kv_splits > 1 or plan.schedule.pack_group:
            assert kernel.report.spill_bytes == 0, f"{case_id(plan)} spills {kernel.report.spill_bytes} B"


@needs_gxx
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_emulated_multi_query_kernels_read_one_kv_head_for_every_query_head(causal: bool) -> None:
    """MQA (one K/V head, four query heads), ragged lengths: the derived plans' ``mma.sync`` kernels,
    a packed short-query one among them where offered, within bf16 rounding of float64."""
    g = ck.Graph("mqa")
    q = g.input("q", (2, 4, 40, 64), "bf16")
    k, v = (g.input(n, (2, 1, 70, 64), "bf16") for n in "kv")
    g.output(ck.nn.attention(q, k, v, causal=causal), "o")
    rng = np.random.default_rng(1)
    inputs = {n: rounded(rng.standard_normal(x.shape), "bf16") for n, x in g.inputs.items()}
    expected = ck.evaluate(g, inputs)["o"]
    plans = [p for p in ck.derive(g).plans("sm_80") if supported(p)]
    assert plans and all(p.problem.kv_heads == 1 and p.problem.heads == 4 for p in plans)
    for plan in plans[:: max(1, len(plans) // 3)][:3]:
        got = emulate_flash(plan, inputs["q"], inputs["k"], inputs["v"])["o"]
        error = np.linalg.norm(got - expected) / np.linalg.norm(expected)
        assert error <= 1e-2, f"{plan.schedule.key()}: o differs by {error:.3g}"


@needs_gxx
def test_emulated_kernels_read_attention_over_windows_as_one_batch_axis() -> None:
    """Attention over ``(B, windows, heads, N, d)`` (timm's Twins), q, k and v unbound from one projection: the
    ``mma.sync`` kernel reads batch and windows as one batch axis at the window's stride, within bf16 rounding
    of float64, ragged N."""
    batch, windows, n, heads, dim = 2, 3, 37, 2, 32
    g = ck.Graph("windows")
    x = g.input("x", (batch, windows, n, 3 * heads * dim), "bf16")
    q, k, v = (x.reshape((batch, windows, n, 3, heads, dim)).permute((3, 0, 1, 4, 2, 5))[i] for i in range(3))
    g.output(ck.nn.softmax((q @ k.transpose(-2, -1)) * dim**-0.5, axis=-1) @ v, "o")
    inputs = {"x": rounded(np.random.default_rng(2).standard_normal(x.shape), "bf16")}
    expected = ck.evaluate(g, inputs)["o"]
    plan = next(p for p in ck.derive(g).plans("sm_80") if supported(p))
    assert plan.problem.batch == batch * windows and plan.problem.layout("q").batch == n * 3 * heads * dim
    got = emulate_flash(plan, inputs["x"], inputs["x"], inputs["x"])["o"]
    error = np.linalg.norm(got.reshape(expected.shape) - expected) / np.linalg.norm(expected)
    assert error <= 1e-2, f"{plan.schedule.key()}: o differs by {error:.3g}"


@needs_gxx
@pytest.mark.parametrize(("dim", "value_dim"), [(160, 112), (24, 72)])
def test_emulated_kernels_take_head_dims_off_the_benchmark_rows(dim: int, value_dim: int) -> None:
    """Head dims none of the benchmark's tables has: a multiple of 16 (Stable Diffusion's 160, beside a value dim of
    112) in rows padded to a power of two, and of 8 (24, beside 72) in rows zero-filled to a multiple of 16: the
    ``mma.sync`` kernels within bf16 rounding of float64, and flash plans of both families on every target."""
    g = ck.Graph("head_dims")
    q = g.input("q", (1, 2, 37, dim), "bf16")
    k = g.input("k", (1, 2, 70, dim), "bf16")
    v = g.input("v", (1, 2, 70, value_dim), "bf16")
    g.output(ck.nn.attention(q, k, v, causal=True), "o")
    rng = np.random.default_rng(3)
    inputs = {n: rounded(rng.standard_normal(x.shape), "bf16") for n, x in g.inputs.items()}
    expected = ck.evaluate(g, inputs)["o"]
    d = ck.derive(g)
    for target in FLASH_TARGETS:
        assert [k.kind for k in d.kernels_for(target)] == ["flash_attention"], target
    assert any(hasattr(p.schedule, "consumer_warpgroups") for p in d.plans("sm_90a"))
    plan = next(p for p in d.plans("sm_80") if supported(p))
    got = emulate_flash(plan, inputs["q"], inputs["k"], inputs["v"])["o"]
    error = np.linalg.norm(got - expected) / np.linalg.norm(expected)
    assert error <= 1e-2, f"{plan.schedule.key()}: o differs by {error:.3g}"


@pytest.mark.parametrize(("device", "label"), [("NVIDIA H200", "h200"), ("NVIDIA H100 80GB HBM3", "h100"),
                                               ("NVIDIA GeForce RTX 5090", "5090"), ("cpu", "gpu")])  # fmt: skip
def test_results_files_are_named_by_the_card(device: str, label: str) -> None:
    """The benchmark's results file names the card that ran it (an H100's run was once ``h200-…``)."""
    assert benchmark().gpu_label(device) == label
