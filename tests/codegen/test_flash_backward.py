"""The flash-attention backward family: sources, builds for every ``mma.sync`` target, the
kernels emulated on the CPU against ``ck.grad``'s float64 gradients, and on the GPU against
float32 autograd (each gradient, bf16 and fp16, causal, GQA, ragged lengths, D 32–128)."""

from __future__ import annotations

import shutil

import numpy as np
import pytest

import cherenkov as ck
from cherenkov.codegen import compile_plans, cuda_source, load_kernel
from cherenkov.graph.evaluate import fill_saved_inputs

from .backward_emulator import emulate_backward
from .emulator import rounded

needs_gxx = pytest.mark.skipif(shutil.which("g++") is None, reason="no g++ to emulate kernels with")


def gradient_graph(batch: int, heads: int, kv_heads: int, seq_q: int, seq_kv: int, dim: int, causal: bool,
                   dtype: str = "bf16", wrt: tuple[str, ...] = ("q", "k", "v"), saved: bool = False,
                   value_dim: int | None = None) -> ck.Graph:  # fmt: skip
    """``ck.grad`` of ``ck.nn.attention`` at these sizes (``saved``: its output and log-sum-exp saved;
    ``value_dim``: v's head dim, where it differs from q's and k's)."""
    g = ck.Graph("attention")
    q = g.input("q", (batch, heads, seq_q, dim), dtype)
    k = g.input("k", (batch, kv_heads, seq_kv, dim), dtype)
    v = g.input("v", (batch, kv_heads, seq_kv, value_dim or dim), dtype)
    if not saved:
        g.output(ck.nn.attention(q, k, v, causal=causal), "o")
        return ck.grad(g, wrt=wrt)
    o, lse = ck.nn.attention(q, k, v, causal=causal, return_lse=True)
    g.output(o, "o")
    g.output(lse, "lse")
    return ck.grad(g, wrt=wrt, saved=("o", "lse"), outputs=("o",))


def biased_gradient_graph(batch: int, heads: int, kv_heads: int, seq_q: int, seq_kv: int, dim: int,
                          mask_heads: int, dtype: str = "bf16", wrt: tuple[str, ...] = ("q", "k", "v")) -> ck.Graph:  # fmt: skip
    """``ck.grad`` of ``ck.nn.attention`` plus a bias tensor ``mask`` ``(B, mask_heads, Sq, Skv)`` (1: shared
    by the heads, as a padding mask is)."""
    g = ck.Graph("attention")
    q = g.input("q", (batch, heads, seq_q, dim), dtype)
    k, v = (g.input(n, (batch, kv_heads, seq_kv, dim), dtype) for n in "kv")
    mask = g.input("mask", (batch, mask_heads, seq_q, seq_kv), dtype)
    g.output(ck.nn.attention(q, k, v, bias=mask), "o")
    return ck.grad(g, wrt=wrt)


def alibi_gradient_graph(batch: int, heads: int, kv_heads: int, seq: int, dim: int, dtype: str = "bf16") -> ck.Graph:
    """``ck.grad`` of causal ``ck.nn.attention`` under ALiBi: a bias of each head's slope (input ``slopes``,
    ``(H, 1, 1)``) times each key's position, computed in the graph."""
    g = ck.Graph("alibi")
    q = g.input("q", (batch, heads, seq, dim), dtype)
    k, v = (g.input(n, (batch, kv_heads, seq, dim), dtype) for n in "kv")
    slopes = g.input("slopes", (heads, 1, 1), dtype)
    g.output(ck.nn.attention(q, k, v, causal=True, bias=slopes * ck.arange(seq, graph=g)), "o")
    return ck.grad(g, wrt=("q", "k", "v"))


def capped_gradient_graph(batch: int, heads: int, kv_heads: int, seq: int, dim: int, softcap: float,
                          dtype: str = "bf16", bias: bool = False) -> ck.Graph:  # fmt: skip
    """``ck.grad`` of causal ``ck.nn.attention`` with its scores soft-capped at ``softcap`` (Gemma 2's cap);
    ``bias``: not causal, a bias tensor ``mask`` ``(B, 1, S, S)`` added after the cap instead."""
    g = ck.Graph("capped")
    q = g.input("q", (batch, heads, seq, dim), dtype)
    k, v = (g.input(n, (batch, kv_heads, seq, dim), dtype) for n in "kv")
    mask = g.input("mask", (batch, 1, seq, seq), dtype) if bias else None
    g.output(ck.nn.attention(q, k, v, causal=not bias, bias=mask, softcap=softcap), "o")
    return ck.grad(g, wrt=("q", "k", "v"))


def alibi_slopes(heads: int) -> np.ndarray:
    """ALiBi's geometric slopes ``2^(−8(h+1)/H)``, shaped ``(H, 1, 1)``."""
    return 2.0 ** (-8.0 * np.arange(1, heads + 1) / heads).reshape(heads, 1, 1)


MIN_VALUES = {"bf16": -3.38e38, "fp16": -65504.0}
"""transformers' masking value (``torch.finfo(dtype).min``): a bf16 one is below the kernels' −2^100 floor."""


def padding_mask(values: np.ndarray, padded_keys: int, masked_row: int, dtype: str) -> np.ndarray:
    """``values`` with the last ``padded_keys`` keys masked (−∞) and one row wholly at transformers'
    min value (bf16: every key at the kernels' −2^100 floor, so the row averages its keys)."""
    mask = values.copy()
    mask[..., -padded_keys:] = -np.inf
    mask[..., masked_row, :] = MIN_VALUES[dtype]
    return mask


def backward_plans(gg: ck.Graph, target: str = "sm_90"):
    plans = ck.derive(gg).plans(target)
    assert plans and {p.kind for p in plans} == {"flash_attention_backward"}
    return plans


def test_sources_are_deterministic_and_differ_by_schedule() -> None:
    plans = backward_plans(gradient_graph(1, 2, 2, 100, 77, 64, causal=True))
    sources = [cuda_source(p) for p in plans]
    assert sources == [cuda_source(p) for p in plans]
    assert len(set(sources)) == len(plans)
    assert all("_statistics(" in s and "_dq(" in s for s in sources)
    # dq: four floats a red.global.add.v4.f32 on sm_90 and later, one float an atomic add before
    assert all("reduce_add_v4_f32(rows + r * D + d" in s and "atomicAdd" not in s for s in sources)
    older = [cuda_source(p) for p in backward_plans(gradient_graph(1, 2, 2, 100, 77, 64, causal=True), "sm_80")]
    assert all("atomicAdd(rows + r * D + d" in s and "red.global.add" not in s for s in older)


@pytest.mark.slow
@pytest.mark.parametrize("target", ["sm_80", "sm_90", "sm_120"])
def test_every_plan_compiles_without_spills(target: str, compiler, kernel_cache) -> None:
    gg = gradient_graph(2, 8, 2, 200, 333, 128, causal=True)  # the register-heaviest head dim, GQA
    from dataclasses import replace

    biased = biased_gradient_graph(2, 8, 2, 200, 333, 128, 1)  # a bias tensor: the 16-key main pass
    plans = backward_plans(gg, target) + backward_plans(biased, target)
    # soft-capped scores: warp pairs at head dim 64, their one capped head dim
    pairs = [p for p in backward_plans(gradient_graph(2, 8, 2, 200, 333, 64, causal=True), target) if p.schedule.warp_pairs]
    plans += [replace(p, problem=replace(p.problem, attention=replace(p.problem.attention, softcap=50.0))) for p in pairs]
    plans += backward_plans(gradient_graph(2, 8, 2, 200, 333, 16, causal=True), target)  # one k16 step
    for plan, build in zip(plans, compile_plans(plans, compiler=compiler, cache_dir=kernel_cache)):
        assert not isinstance(build, Exception), build
        # with a bias, ptxas 13.0 spills the head-dim-128 main pass on sm_120 (60-124 bytes; nvcc 13.0, 2026-12-05)
        if not (target == "sm_120" and plan.problem.attention.bias is not None):
            assert build.report.spill_bytes == 0, f"{plan.name} spills on {target}: {build.report}"


def test_wgmma_main_pass_is_offered_on_sm90a_only() -> None:
    """The Hopper main pass: one schedule on sm_90a for head dims 64 and 128, with the reasons it is not
    offered elsewhere."""
    from cherenkov.rewrites.plan import TARGETS
    from cherenkov.rewrites.plan_backward import BackwardSchedule, backward_schedule_problems

    wgmma = BackwardSchedule(128, 64, 2, wgmma=True)
    for dim in (64, 128):
        keys = [p.schedule.key() for p in backward_plans(gradient_graph(2, 8, 2, 200, 333, dim, causal=True), "sm_90a")]
        assert {"kv128_q64_s2_wg", "kv128_q64_s3_wg"} <= set(keys) and len(keys) > 2  # the mma.sync schedules stay
        problem = backward_plans(gradient_graph(2, 8, 2, 200, 333, dim, causal=True), "sm_90a")[0].problem
        assert any("no wgmma" in r for r in backward_schedule_problems(wgmma, problem, TARGETS["sm_90"]))
    problem = backward_plans(gradient_graph(1, 2, 2, 64, 64, 96, causal=False), "sm_90a")[0].problem
    assert any("head dim 96" in r for r in backward_schedule_problems(wgmma, problem, TARGETS["sm_90a"]))
    assert any("2 or 3 stages" in r for r in backward_schedule_problems(BackwardSchedule(128, 32, 2, wgmma=True), problem,
                                                                    TARGETS["sm_90a"]))  # fmt: skip


def test_persistent_main_pass_walks_paired_key_tiles() -> None:
    """The persistent wgmma main pass: two stages only, the wgmma family only; its work items are a key
    tile each, or with a causal mask key tiles p and n - 1 - p (a middle one alone); one block an SM at
    most, two K/V buffers."""
    from cherenkov.codegen.cuda.flash_attention_backward import grids
    from cherenkov.rewrites.plan import TARGETS
    from cherenkov.rewrites.plan_backward import BackwardSchedule, backward_schedule_problems, main_work_items

    causal = next(p for p in backward_plans(gradient_graph(2, 8, 2, 200, 1333, 128, causal=True), "sm_90a")
                  if p.schedule.persistent)  # fmt: skip
    assert causal.schedule.key() == "kv128_q64_s2_wg_ps" and causal.schedule.stages == 2
    assert main_work_items(causal.schedule, causal.problem) == 2 * 2 * 6  # 11 key tiles: 5 pairs and a middle one
    assert grids(causal, 132)["main"][0] == (24, 1, 1) and grids(causal, 10)["main"][0] == (10, 1, 1)
    plain = next(p for p in backward_plans(gradient_graph(2, 8, 2, 200, 1333, 128, causal=False), "sm_90a")
                 if p.schedule.persistent)  # fmt: skip
    assert main_work_items(plain.schedule, plain.problem) == 2 * 2 * 11
    source = cuda_source(causal)
    assert "constexpr int KV_BUFFERS = 2;" in source and "KeyTile key_tile(int n)" in source
    one_tile = cuda_source(next(p for p in backward_plans(gradient_graph(2, 8, 2, 200, 1333, 128, causal=True), "sm_90a")
                                if p.schedule.wgmma and not p.schedule.persistent))  # fmt: skip
    assert "KV_BUFFERS" not in one_tile and "KeyTile key_tile(" not in one_tile
    # both drivers run the same step (the one-tile one refills a stage within it, the walk before it)
    step = source[source.index("const u32 tq = "):source.index("fence_operands(dv);")]
    refill = "if (step + STAGES - 1 < steps) copy_step(step + STAGES - 1);  // into the last step's stage"
    assert refill in one_tile and refill not in source
    assert " ".join(step.split()) in " ".join(one_tile.replace(refill, "").split())
    problem = causal.problem
    three = BackwardSchedule(128, 64, 3, wgmma=True, persistent=True)
    assert any("two stages" in r for r in backward_schedule_problems(three, problem, TARGETS["sm_90a"]))
    warps = BackwardSchedule(128, 64, 2, persistent=True)
    assert any("wgmma family only" in r for r in backward_schedule_problems(warps, problem, TARGETS["sm_90"]))


@pytest.mark.slow
def test_every_wgmma_plan_compiles_without_spills_or_a_serialised_pipeline(compiler, kernel_cache) -> None:
    """Head dims 64 and 128, with and without saved statistics, and at 128 under a soft cap (255 registers)."""
    from dataclasses import replace

    for dim in (64, 128):
        for saved in (False, True):
            gg = gradient_graph(2, 8, 2, 200, 333, dim, causal=True, saved=saved)
            plans = [p for p in backward_plans(gg, "sm_90a") if p.schedule.wgmma]
            assert len(plans) == (6 if saved else 3)  # (with saved statistics: both kinds)
            if dim == 128 and not saved:
                plans += [replace(p, problem=replace(p.problem, attention=replace(p.problem.attention, softcap=50.0)))
                          for p in plans]  # fmt: skip
            for plan, build in zip(plans, compile_plans(plans, compiler=compiler, cache_dir=kernel_cache)):
                assert not isinstance(build, Exception), build
                assert build.report.spill_bytes == 0, (plan.name, build.report)
                assert not build.report.wgmma_serialized and not build.report.wgmma_fenced, (plan.name, build.report)


@pytest.mark.parametrize("dim", [64, 128])
def test_wgmma_main_pass_source(dim: int) -> None:
    """Its five products are the three wgmma shapes (scores ss K-major; dv, dk rs with B MN-major; dq ss with
    both MN-major), its copies swizzled; the statistics pass is wgmma too; the dq launch that of the mma.sync
    family."""
    plan = next(p for p in backward_plans(gradient_graph(2, 8, 2, 200, 333, dim, causal=True), "sm_90a")
                if p.schedule.wgmma)  # fmt: skip
    source = cuda_source(plan)
    assert source == cuda_source(plan)
    for name in (f"wgmma_m64n64k16_ss_bf16(", f"wgmma_m64n{dim}k16_rs_bf16_tb(", "wgmma_m64n64k16_ss_bf16_ta_tb("):
        assert name in source
    assert "load_swizzled<BLOCK_KV>" in source and "fence.proxy.async.shared::cta" in source
    assert "reduce_add_v4_f32(part + (m * 128 + tau) * 4, " in source and "atomicAdd" not in source
    assert source.index("wgmma_m64n64k16_ss_bf16_ta_tb(dq, ") < source.index("(dk, dsa[4 * kk]")  # dq issued first
    assert f"DQ_SPLIT_KEYS = {'true' if dim == 64 else 'false'}" in source
    # descriptors made once per tile, their k steps added; the probabilities on the SFU
    assert "make_smem_desc(tq + kk" not in source and "q_desc + ((kk * K_STEP_ROWS_BYTES) >> 4)" in source
    assert "fast_exp2(s[i] * SCALE_LOG2 - tlse[column])" in source and "exp2f(s[i]" not in source
    assert "_statistics(" in source and "_dq(" in source
    assert "head_dim_product_n128<STAT_Q_BOX_BYTES, STAT_KV_BOX_BYTES>(\n" in source  # statistics' S
    assert "wgmma_m64n128k16_ss_bf16(acc, " in source


@pytest.mark.slow
@pytest.mark.parametrize("dim", [64, 128])
def test_wgmma_passes_compile_to_hgmma_without_spills(dim: int, compiler, kernel_cache, sass) -> None:
    plan = next(p for p in backward_plans(gradient_graph(2, 8, 2, 200, 333, dim, causal=True), "sm_90a")
                if p.schedule.wgmma)  # fmt: skip
    (build,) = compile_plans([plan], compiler=compiler, cache_dir=kernel_cache)
    assert not isinstance(build, Exception), build
    assert build.report.spill_bytes == 0, build.report
    # ptxas kept each pass's wgmma pipeline: nothing serialised, no fence of its own
    assert not build.report.wgmma_serialized and not build.report.wgmma_fenced, build.report
    if sass is None:
        pytest.skip("no cuobjdump to read SASS with")
    code = sass(build.cubin_path)
    # main pass: Sᵀ, dPᵀ (N 64) D/16 k16 steps each, dv, dk (N D) 4 each, dq (N 64) 8 (D 64: 4, its own keys);
    # statistics: S (N 128) D/16, O (N D) 8 in its loop and 8 for the last step's
    steps = dim // 16
    counts = {64: 2 * steps + (8 if dim == 128 else 4), 128: steps}
    counts[dim] += 8 + 16
    for n, count in counts.items():
        assert code.count(f"HGMMA.64x{n}x16.F32.BF16") == count, n
    assert "REDG.E.ADD.F32x4" in code and "UBLKRED" not in code  # dq added four floats a reduction
    assert code.count("STSM.16.M88.4") == 4  # dSᵀ: four stmatrix.x4 a warp and step


def assert_gradients_match(got: dict[str, np.ndarray], expected: dict[str, np.ndarray], wrt: tuple[str, ...],
                           label: str) -> None:  # fmt: skip
    """An emulated plan's gradients (``dq``, ...) are exactly those of ``wrt``, each within 1e-2 (relative L2)
    of the gradient graph's float64 ``d_q``, ..."""
    assert set(got) == {f"d{n}" for n in wrt}
    for role, values in got.items():
        reference = expected[f"d_{role[1]}"]
        error = np.linalg.norm(values - reference) / np.linalg.norm(reference)
        assert error <= 1e-2, f"{label}: {role} differs by {error:.3g}"


def _inputs(gg: ck.Graph, dtype: str = "bf16", seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {n: rounded(rng.standard_normal(t.shape), dtype) for n, t in gg.inputs.items()}


BIAS_CASES = [
    ((2, 4, 2, 37, 70, 64), 1, ("q", "k", "v"), ("kv64_q32_s2", "kv128_q64_s1"), "bf16"),  # GQA, tails, shared
    ((1, 2, 2, 40, 100, 32), 2, ("k", "v"), ("kv64_q64_s2",), "fp16"),  # a bias per head, no dq
]


@needs_gxx
@pytest.mark.parametrize(("sizes", "mask_heads", "wrt", "schedules", "dtype"), BIAS_CASES,
                         ids=["shared_gqa_tails", "per_head_fp16"])
def test_emulated_backward_adds_the_bias_tensor(sizes, mask_heads, wrt, schedules, dtype) -> None:
    """Padding keys at −∞ and a row wholly at transformers' min value: in bf16 every key of that row is
    at the kernels' floor, and its probabilities are ``1 / Skv`` in the float64 gradient graph too, which
    the row's max and log2 sum kept apart give back (their sum would round to the max, the
    probabilities to 1)."""
    gg = biased_gradient_graph(*sizes, mask_heads, dtype, wrt)
    inputs = _inputs(gg, dtype)
    inputs["mask"] = padding_mask(inputs["mask"], padded_keys=10, masked_row=3, dtype=dtype)
    expected = ck.evaluate(gg, inputs)
    plans = {p.schedule.key(): p for p in backward_plans(gg)}
    for key in schedules:
        got = emulate_backward(plans[key], inputs["q"], inputs["k"], inputs["v"], inputs["d_o"], bias=inputs["mask"])
        assert_gradients_match(got, expected, wrt, key)


def test_backward_with_a_bias_plans_the_16_key_main_pass_only() -> None:
    plans = ck.derive(biased_gradient_graph(1, 8, 2, 256, 256, 128, 1)).plans("sm_90a")
    assert plans and all(p.problem.attention.bias is not None for p in plans)
    assert not any(p.schedule.wgmma or p.schedule.warp_pairs or p.schedule.saved_statistics for p in plans)
    from cherenkov.rewrites.plan_backward import BackwardSchedule, backward_schedule_problems

    wgmma = BackwardSchedule(128, 64, 2, wgmma=True)
    assert any("bias" in r for r in backward_schedule_problems(wgmma, plans[0].problem, plans[0].target))
    source = cuda_source(plans[0])
    assert "constexpr int ROW_SLOTS = 3;" in source and source.count("const bias_t* __restrict__ bias)") == 2


def test_alibi_gradient_is_one_flash_backward_reading_the_stored_bias() -> None:
    """ALiBi's gradient graph (causal, GQA): the probabilities are never stored; an elementwise kernel
    stores the computed bias and one flash backward writes dq, dk and dv, the program equal to the
    graph in float64; in bf16 the backward reads that bias in fp32 on every target."""
    gg = alibi_gradient_graph(2, 4, 2, 70, 32, "fp32")
    d = ck.derive(gg)
    kinds = [k.kind for k in d.kernels]
    assert kinds.count("flash_attention_backward") == 1 and set(kinds) == {"elementwise", "flash_attention_backward"}
    inputs = gg.example_inputs()
    expected, got = ck.evaluate(gg, inputs), ck.evaluate(d, inputs)
    for output, value in expected.items():
        assert np.linalg.norm(got[output] - value) <= 1e-9 * np.linalg.norm(value), output
    d = ck.derive(alibi_gradient_graph(2, 4, 2, 70, 32))
    for target in ("sm_80", "sm_90a", "sm_120"):
        (problem,) = {p.problem for p in d.plans(target)}
        assert problem.attention.causal and problem.attention.bias.dtype == "fp32", target
        assert problem.attention.bias.shape == (4, 70), target  # a head's slope times a key's position


@needs_gxx
def test_emulated_alibi_backward_matches_the_gradient_graph() -> None:
    gg = alibi_gradient_graph(2, 4, 2, 70, 32)
    inputs = _inputs(gg)
    inputs["slopes"] = rounded(alibi_slopes(4), "bf16")
    expected = ck.evaluate(gg, inputs)
    plans = {p.schedule.key(): p for p in backward_plans(gg)}
    bias = (inputs["slopes"] * np.arange(70)).reshape(4, 70)
    for key in ("kv64_q32_s2", "kv128_q64_s1"):
        got = emulate_backward(plans[key], inputs["q"], inputs["k"], inputs["v"], inputs["d_o"], bias=bias)
        assert_gradients_match(got, expected, ("q", "k", "v"), key)


def test_soft_capped_gradient_is_one_flash_backward() -> None:
    """The gradient of soft-capped attention (the cap's chain rule through tanh's exponential spelling,
    rule ``soft-cap-vjp``) derives one flash backward, the program equal to the graph in float64; its
    plans are every main pass's (16-key warps, warp pairs, and wgmma on sm_90a), with the cap in both passes. (The
    causal graph is the emulated test's: its derivation, ~17 s on 2 cores, is done once.)"""
    gg = capped_gradient_graph(2, 4, 2, 70, 32, 2.0, "fp32", bias=True)
    d = ck.derive(gg)
    assert [k.kind for k in d.kernels] == ["flash_attention_backward"]
    inputs = gg.example_inputs()
    expected, got = ck.evaluate(gg, inputs), ck.evaluate(d, inputs)
    for output, value in expected.items():
        assert np.linalg.norm(got[output] - value) <= 1e-9 * np.linalg.norm(value), output
    d = ck.derive(capped_gradient_graph(2, 4, 2, 70, 64, 2.0))
    assert [k.kind for k in d.kernels] == ["flash_attention_backward"]
    for target in ("sm_80", "sm_90a", "sm_120"):
        plans = d.plans(target)
        assert any(p.schedule.warp_pairs for p in plans) and any(p.schedule.wgmma for p in plans) == (target == "sm_90a")
        assert {(p.problem.attention.softcap, p.problem.attention.causal) for p in plans} == {(2.0, True)}, target
        if target == "sm_90a":
            source = cuda_source(next(p for p in plans if p.schedule.wgmma))
            assert "soft_cap(s[i]) * SCALE_LOG2" in source and "s[e] = p[c] * soft_cap_slope(capped)" in source
    source = cuda_source(next(p for p in plans if not (p.schedule.warp_pairs or p.schedule.wgmma)))
    assert source.count("soft_cap(s[n][e])") == 2 and "* slope[n][e]" in source and "soft_cap_slope(s[n][e])" in source
    source = cuda_source(next(p for p in plans if p.schedule.warp_pairs))
    assert "soft_cap(s[i][n][2 * h + c])" in source and "const u32 p = *reinterpret_cast<const u32*>(sDs + " in source


@needs_gxx
@pytest.mark.parametrize("bias", [False, True], ids=["causal_gqa", "bias_tensor"])
def test_emulated_soft_capped_backward_matches_the_gradient_graph(bias: bool) -> None:
    """A cap of 2 on scores of unit spread: without the cap's slope in dS, dq and dk are 40 % off. The 16-key main
    pass, and warp pairs (no bias tensor there), whose dS reads P times the slope back from the dS tile."""
    gg = capped_gradient_graph(2, 4, 2, 70, 64, 2.0, bias=bias)
    inputs = _inputs(gg)
    expected = ck.evaluate(gg, inputs)
    plans = {p.schedule.key(): p for p in backward_plans(gg)}
    mask = inputs["mask"][:, 0] if bias else None
    for key in ("kv64_q32_s2", "kv128_q64_s1", *(() if bias else ("kv128_q64_s2_wp",))):
        got = emulate_backward(plans[key], inputs["q"], inputs["k"], inputs["v"], inputs["d_o"], bias=mask)
        assert_gradients_match(got, expected, ("q", "k", "v"), key)


@needs_gxx
@pytest.mark.parametrize(("sizes", "causal", "wrt", "schedules", "dtype"), [
    ((1, 2, 2, 40, 70, 32), False, ("q", "k", "v"), ("kv64_q32_s1", "kv128_q64_s2"), "bf16"),
    ((2, 4, 2, 37, 70, 32), True, ("q", "k", "v"), ("kv64_q32_s2",), "bf16"),  # GQA, Sq < Skv, batch strides
    ((1, 2, 2, 100, 77, 64), True, ("k", "v"), ("kv64_q64_s2",), "bf16"),  # Sq > Skv, no dq
    ((2, 4, 2, 37, 150, 64), True, ("q", "k", "v"), ("kv128_q64_s2_wp",), "bf16"),  # warp pairs: GQA, ragged
    ((1, 2, 2, 70, 150, 128), False, ("q", "v"), ("kv128_q64_s1_wp",), "bf16"),  # warp pairs: D 128, no dk
    ((1, 2, 2, 90, 64, 64), True, ("q", "k", "v"), ("kv128_q64_s1_wp", "kv64_q32_s2"), "fp16"),
    ((2, 4, 2, 37, 70, 80), True, ("q", "k", "v"), ("kv64_q64_s2",), "bf16"),  # D 80: 5 k16 steps, one dq column group
    ((1, 2, 2, 50, 90, 48), False, ("q", "k", "v"), ("kv64_q64_s1",), "fp16"),
    ((1, 4, 2, 40, 64, 112), True, ("q", "k", "v"), ("kv64_q64_s2",), "bf16"),
    ((2, 4, 1, 37, 70, 64), True, ("q", "k", "v"), ("kv64_q32_s2", "kv128_q64_s2_wp"), "bf16"),  # MQA: one K/V head
    # past head dim 128: a block holds half of dk's, dv's and dq's columns (two head-dim parts)
    ((2, 4, 2, 37, 70, 256), True, ("q", "k", "v"), ("kv64_q32_s2_dp2",), "bf16"),  # Gemma's D 256, GQA, ragged
    ((1, 2, 2, 50, 90, 192), False, ("q", "k", "v"), ("kv64_q64_s1_dp2", "kv128_q64_s2_dp2"), "fp16"),
    ((1, 2, 2, 40, 70, 160), True, ("k", "v"), ("kv64_q64_s1_dp2",), "bf16"),  # parts of 5 k16 steps, no dq
    ((2, 4, 2, 37, 70, 16), True, ("q", "k", "v"), ("kv64_q64_s1", "kv64_q64_s2"), "bf16"),  # one k16 step (Swin's)
], ids=["tails", "causal_gqa", "dk_dv_only", "warp_pairs_causal_gqa", "warp_pairs_d128", "fp16", "d80", "d48_fp16",
        "d112", "mqa", "d256_parts", "d192_parts_fp16", "d160_parts", "d16_causal_gqa"])  # fmt: skip
def test_emulated_backward_matches_the_gradient_graph(sizes, causal, wrt, schedules, dtype) -> None:
    """bf16 and fp16; causal plans also run as launched on a device of 5 multiprocessors: chunks of 2 or 3
    slabs, the last one short (its blocks past the last slab return at once)."""
    gg = gradient_graph(*sizes, causal=causal, wrt=wrt, dtype=dtype)
    inputs = _inputs(gg, dtype)
    expected = ck.evaluate(gg, inputs)
    plans = {p.schedule.key(): p for p in backward_plans(gg)}
    for key, sms in [(key, sms) for key in schedules for sms in ((None, 5) if causal else (None,))]:
        got = emulate_backward(plans[key], inputs["q"], inputs["k"], inputs["v"], inputs["d_o"], sms=sms)
        assert_gradients_match(got, expected, wrt, f"{key} ({sms} SMs)")


@needs_gxx
@pytest.mark.parametrize(("sizes", "value_dim", "causal", "schedules"), [
    ((2, 4, 2, 37, 70, 64), 32, True, ("kv64_q32_s2", "kv128_q64_s1")),  # GQA, ragged: V narrower than q, k
    ((1, 2, 2, 50, 90, 192), 128, False, ("kv64_q32_s1_dp2",)),  # MLA's 192/128: two head-dim parts of each
    ((1, 2, 2, 40, 70, 48), 32, True, ("kv64_q64_s2",)),  # DeepSeek's small 48/32
    ((1, 2, 2, 40, 64, 64), 128, False, ("kv64_q32_s1",)),  # V wider than q, k
], ids=["d64_v32_gqa_causal", "mla_192_128_parts", "d48_v32", "d64_v128"])  # fmt: skip
def test_emulated_backward_with_its_own_value_dim_matches_the_gradient_graph(sizes, value_dim, causal,
                                                                            schedules) -> None:  # fmt: skip
    """v's head dim apart from q's and k's (the 16-key main pass: dv and dP over Dv, dk, dq and S over D)."""
    gg = gradient_graph(*sizes, causal=causal, value_dim=value_dim)
    inputs = _inputs(gg)
    expected = ck.evaluate(gg, inputs)
    plans = {p.schedule.key(): p for p in backward_plans(gg)}
    assert not any(p.schedule.wgmma or p.schedule.warp_pairs for p in backward_plans(gg, "sm_90a"))
    for key in schedules:
        got = emulate_backward(plans[key], inputs["q"], inputs["k"], inputs["v"], inputs["d_o"])
        assert_gradients_match(got, expected, ("q", "k", "v"), key)


def test_warp_pair_main_pass_is_offered_where_its_tiles_fit() -> None:
    """Warp pairs take head dims 64 and 128 on every target whose shared memory holds 128 keys, two 64-query
    stages (sm_80 at D 128: one) and the Pᵀ and dSᵀ tiles; sm_120's 99 KB only D 64's one-stage schedule."""

    def offered(dim: int, target: str) -> set[str]:
        gg = gradient_graph(1, 2, 2, 100, 77, dim, causal=True)
        return {p.schedule.key() for p in backward_plans(gg, target) if p.schedule.warp_pairs}

    assert offered(128, "sm_90") == offered(128, "sm_90a") == {"kv128_q64_s1_wp", "kv128_q64_s2_wp"}
    assert offered(64, "sm_80") == {"kv128_q64_s1_wp", "kv128_q64_s2_wp"}
    assert offered(128, "sm_80") == {"kv128_q64_s1_wp"}
    assert offered(64, "sm_120") == {"kv128_q64_s1_wp"} and not offered(128, "sm_120")
    assert not offered(32, "sm_90") and not offered(96, "sm_90")
    source = cuda_source(next(p for p in backward_plans(gradient_graph(1, 2, 2, 100, 77, 128, causal=True))
                              if p.schedule.warp_pairs))  # fmt: skip
    assert "pair_rows_times_rows<HALF_Q>(s, sK, kr0, tq, qc0, lane)" in source and "sP = sDs + BLOCK_KV * DS_ROW" in source


def test_warp_pairs_take_a_soft_cap_at_head_dim_64_only() -> None:
    """Capped scores: warp pairs at head dim 64 (174 registers); at 128 they spill, and the plan says so."""
    from dataclasses import replace

    from cherenkov.rewrites.plan import TARGETS
    from cherenkov.rewrites.plan_backward import backward_schedule_problems

    for dim, fits in ((64, True), (128, False)):
        plan = next(p for p in backward_plans(gradient_graph(1, 2, 2, 100, 77, dim, causal=True)) if p.schedule.warp_pairs)
        capped = replace(plan.problem, attention=replace(plan.problem.attention, softcap=50.0))
        problems = backward_schedule_problems(plan.schedule, capped, TARGETS["sm_90"])
        assert (not problems) == fits and all("soft cap" in p for p in problems), problems


def test_causal_one_tile_grid_takes_slabs_in_chunks() -> None:
    """A one-tile causal main pass launches chunks of about one block an SM (round(SMs / key tiles)
    slabs, 1 to all of them), key tile by key tile; without a mask or a device count, a slab a chunk."""
    from dataclasses import replace

    from cherenkov.codegen.cuda.flash_attention_backward import chunk_slabs, grids

    causal = next(p for p in backward_plans(gradient_graph(4, 16, 16, 4096, 4096, 128, causal=True), "sm_90a")
                  if p.schedule.key() == "kv128_q64_s2_wg")  # fmt: skip

    def variant(**attention):  # the plan for another attention shape (the grid reads only these)
        return replace(causal, problem=replace(causal.problem, attention=replace(causal.problem.attention, **attention)))

    assert chunk_slabs(causal, 132) == 4 and grids(causal, 132)["main"][0] == (4 * 32, 16, 1)
    assert grids(causal)["main"][0] == (32, 64, 1)
    assert chunk_slabs(causal, 10_000) == 64  # at most every slab
    gqa = variant(batch=2, heads=32, kv_heads=8, seq_q=2048, seq_kv=2048)
    assert grids(gqa, 132)["main"][0] == (8 * 16, 2, 1)
    assert grids(gqa, 100)["main"][0] == (6 * 16, 3, 1)  # 16 slabs: chunks of 6, 6 and 4
    assert grids(variant(causal=False), 132)["main"][0] == (32, 64, 1)


@needs_gxx
@pytest.mark.parametrize(("sizes", "causal", "wrt", "schedule"), [
    ((2, 4, 2, 37, 70, 32), True, ("q", "k", "v"), "kv64_q32_s2_saved"),  # GQA, Sq < Skv, batch strides
    ((1, 2, 2, 100, 77, 64), False, ("q", "k"), "kv128_q64_s2_saved"),  # Sq > Skv, no dv
], ids=["causal_gqa", "no_dv"])  # fmt: skip
def test_emulated_backward_reads_the_saved_statistics(sizes, causal, wrt, schedule) -> None:
    """The statistics pass that reads the forward's saved output and log-sum-exp gives the gradients
    of the graph (its saved inputs filled from the values they hold)."""
    gg = gradient_graph(*sizes, causal=causal, wrt=wrt, saved=True)
    assert set(gg.saved) == {"o", "lse"}
    inputs = fill_saved_inputs(gg, {n: x for n, x in _inputs(gg).items() if n not in gg.saved})
    inputs["o"] = rounded(inputs["o"], "bf16")  # the forward stores o in its dtype
    expected = ck.evaluate(gg, inputs)
    plans = {p.schedule.key(): p for p in backward_plans(gg)}
    assert {key for key in plans if key.endswith("_saved")} == {key + "_saved" for key in plans if "_saved" not in key}
    got = emulate_backward(plans[schedule], *(inputs[n] for n in ("q", "k", "v", "d_o", "o", "lse")))
    assert_gradients_match(got, expected, wrt, schedule)


# ------------------------------------------------------------------------------ GPU

GPU_CASES = [
    ((2, 8, 2, 200, 333, 64), True, "bf16"),  # GQA, ragged, causal
    ((1, 8, 8, 512, 512, 128), False, "bf16"),
    ((2, 4, 4, 77, 129, 32), False, "fp16"),
    ((1, 4, 4, 300, 200, 96), True, "bf16"),  # Sq > Skv, D 96
    ((1, 3, 3, 77, 129, 64), True, "bf16"),  # B·H·Sq odd: the dq accumulator still 16-byte aligned
    ((2, 4, 2, 90, 150, 64), True, "fp16"),  # fp16 warp pairs
    ((2, 4, 2, 77, 129, 80), True, "bf16"),  # head dims 48, 80 and 112: the 4-warp, 64-query schedules
    ((1, 4, 4, 100, 200, 48), False, "fp16"),
    ((1, 2, 2, 130, 70, 112), True, "bf16"),
    ((2, 8, 1, 200, 333, 128), True, "bf16"),  # MQA: one K/V head for all eight query heads
    ((2, 8, 2, 200, 333, 256), True, "bf16"),  # Gemma's head dim 256: two head-dim parts, GQA, ragged
    ((1, 4, 4, 150, 260, 192), False, "fp16"),
    ((2, 4, 2, 77, 129, 16), True, "bf16"),  # head dim 16: one k16 step
]


@pytest.mark.gpu
@pytest.mark.parametrize(("sizes", "causal", "dtype"), GPU_CASES, ids=["gqa_causal_ragged", "d128", "fp16_d32", "d96", "odd_rows",
                                                                      "fp16_d64_gqa", "d80", "fp16_d48", "d112",
                                                                      "mqa_causal_ragged", "d256_parts_gqa_causal",
                                                                      "fp16_d192_parts", "d16_gqa_causal"])
def test_gpu_backward_plans_match_float32_autograd(sizes, causal, dtype, cuda_device, kernel_cache) -> None:
    """Every ``mma.sync`` schedule, every gradient ≤ 2e-2 (bf16) or 1e-2 (fp16) relative to float32
    autograd through SDPA's math path, on fresh normal inputs into NaN-poisoned outputs, launched
    twice (the workspace is reused)."""
    _check_against_autograd(backward_plans(gradient_graph(*sizes, causal=causal, dtype=dtype)), dtype, cuda_device,
                            kernel_cache)  # fmt: skip


WGMMA_GPU_CASES = [
    ((2, 8, 2, 200, 333, 128), True, ("q", "k", "v")),  # GQA, ragged, causal
    ((1, 8, 8, 512, 512, 128), False, ("q", "k", "v")),
    ((2, 8, 2, 200, 333, 64), True, ("q", "k", "v")),  # D 64: dq over each warpgroup's keys
    ((1, 4, 4, 300, 200, 64), True, ("k", "v")),  # Sq > Skv, no dq
]


@pytest.mark.gpu
@pytest.mark.parametrize(("sizes", "value_dim", "causal"), [((2, 8, 2, 200, 333, 192), 128, True),
                                                          ((1, 4, 4, 150, 260, 64), 32, False)],
                         ids=["mla_192_128_gqa_causal", "d64_v32"])  # fmt: skip
def test_gpu_backward_with_its_own_value_dim_matches_float32_autograd(sizes, value_dim, causal, cuda_device,
                                                                     kernel_cache) -> None:  # fmt: skip
    """v's head dim apart from q's and k's, every schedule, every gradient against float32 autograd."""
    plans = backward_plans(gradient_graph(*sizes, causal=causal, value_dim=value_dim))
    _check_against_autograd(plans, "bf16", cuda_device, kernel_cache)


@pytest.mark.gpu
@pytest.mark.parametrize(("sizes", "causal", "wrt"), WGMMA_GPU_CASES,
                         ids=["d128_gqa_causal_ragged", "d128", "d64_gqa_causal_ragged", "d64_dk_dv_only"])  # fmt: skip
def test_gpu_wgmma_main_pass_matches_float32_autograd(sizes, causal, wrt, cuda_device, kernel_cache) -> None:
    """The Hopper passes (sm_90a), two and three q/dO buffers and the persistent walk, every gradient against
    float32 autograd as above."""
    plans = [p for p in backward_plans(gradient_graph(*sizes, causal=causal, wrt=wrt), "sm_90a") if p.schedule.wgmma]
    assert sorted((p.schedule.stages, p.schedule.persistent) for p in plans) == [(2, False), (2, True), (3, False)]
    _check_against_autograd(plans, "bf16", cuda_device, kernel_cache)


SAVED_GPU_CASES = [
    ((2, 8, 2, 200, 333, 128), True, "bf16"),  # GQA, ragged, causal
    ((1, 4, 4, 300, 200, 64), True, "bf16"),  # Sq > Skv
    ((2, 4, 4, 77, 129, 32), False, "fp16"),
]


@pytest.mark.gpu
@pytest.mark.parametrize(("sizes", "causal", "dtype"), SAVED_GPU_CASES, ids=["d128_gqa_causal_ragged", "d64_causal",
                                                                            "fp16_d32"])  # fmt: skip
def test_gpu_saved_statistics_plans_match_float32_autograd(sizes, causal, dtype, cuda_device, kernel_cache) -> None:
    """Every schedule that reads the forward's saved output and log-sum-exp (both families on sm_90a),
    every gradient against float32 autograd, o and lse computed by the float32 forward."""
    plans = [p for p in backward_plans(gradient_graph(*sizes, causal=causal, dtype=dtype, saved=True), "sm_90a")
             if p.schedule.saved_statistics]  # fmt: skip
    assert any(p.schedule.wgmma for p in plans) == (sizes[-1] in (64, 128))
    _check_against_autograd(plans, dtype, cuda_device, kernel_cache)


@pytest.mark.gpu
@pytest.mark.parametrize(("sizes", "mask_heads", "dtype"), [((2, 8, 2, 200, 333, 64), 1, "bf16"),
                                                           ((1, 4, 4, 256, 256, 128), 4, "fp16")],
                         ids=["padding_gqa_ragged", "per_head_d128_fp16"])  # fmt: skip
def test_gpu_backward_with_a_bias_matches_float32_autograd(sizes, mask_heads, dtype, cuda_device, kernel_cache) -> None:
    """A bias tensor with padding keys at −∞ and a row wholly at the floor, every gradient ≤ the family's
    tolerance against float32 autograd through SDPA's math path with the same float mask."""
    plans = backward_plans(biased_gradient_graph(*sizes, mask_heads, dtype))

    def padded(stored) -> None:
        stored["mask"].copy_(torch_from(padding_mask(stored["mask"].float().cpu().numpy(), 10, 3, dtype), stored["mask"]))

    _check_against_autograd(plans, dtype, cuda_device, kernel_cache, prepare=padded)


@pytest.mark.gpu
@pytest.mark.parametrize(("sizes", "bias"), [((2, 8, 2, 200, 64), False), ((1, 4, 4, 256, 128), True),
                                             ((2, 8, 2, 200, 128), False)],
                         ids=["causal_gqa_ragged", "bias_d128", "d128_causal_gqa_ragged"])  # fmt: skip
def test_gpu_soft_capped_backward_matches_float32_autograd(sizes, bias, cuda_device, kernel_cache) -> None:
    """Scores soft-capped at 2 (so the cap's slope in dS matters), every schedule on sm_90a (16-key warps, warp
    pairs at D 64, wgmma but with a bias tensor), every gradient against float32 autograd of the same capped
    attention."""
    plans = backward_plans(capped_gradient_graph(*sizes, 2.0, bias=bias), "sm_90a")
    _check_against_autograd(plans, "bf16", cuda_device, kernel_cache)


def torch_from(values: np.ndarray, like):
    """``values`` as a tensor of ``like``'s dtype and device."""
    import torch

    return torch.from_numpy(values).to(device=like.device, dtype=like.dtype)


def _check_against_autograd(plans, dtype: str, cuda_device, kernel_cache, prepare=None) -> None:
    import torch

    from cherenkov.search.measure import TOLERANCE, backward_reference, fill_saved_statistics

    builds = compile_plans(plans, cache_dir=kernel_cache)
    torch_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    problem = plans[0].problem
    generator = torch.Generator(device=cuda_device).manual_seed(0)
    stored = {n: torch.randn(s, generator=generator, device=cuda_device).to(torch_dtype)
              for n, s in problem.stored_shapes().items()}  # fmt: skip
    if prepare is not None:
        prepare(stored)
    saved = {}
    if problem.saved is not None:
        stored[problem.saved.lse] = stored[problem.saved.lse].float()
        fill_saved_statistics(problem, stored)
        saved = {"o": stored[problem.saved.o], "lse": stored[problem.saved.lse]}
    bias = {} if problem.attention.bias is None else {"bias": stored[problem.attention.bias.tensor]}
    reference = backward_reference(problem, stored)
    for plan, build in zip(plans, builds):
        assert not isinstance(build, Exception), build
        kernel = load_kernel(build, 0)
        for _ in range(2):
            out = {g.role: torch.full(g.layout.shape, float("nan"), dtype=torch_dtype, device=cuda_device)
                   for g in problem.gradients}  # fmt: skip
            kernel(stored["q"], stored["k"], stored["v"], stored["d_o"], out,
                   **(saved if plan.schedule.saved_statistics else {}), **bias)  # fmt: skip
            torch.cuda.synchronize()
            for role, value in out.items():
                error = float((value.float() - reference[role]).norm() / reference[role].norm())
                assert error <= TOLERANCE[dtype], f"{plan.name}: {role} differs by {error:.3g}"


def assert_matches_autograd(got: dict, o, leaves: dict, d_o) -> None:
    """``res.run``'s ``d_q``, ``d_k``, ``d_v`` each within 2e-2 (relative L2) of the float32 autograd
    gradients of ``o`` with respect to ``leaves`` (q, k, v) given ``d_o``."""
    import torch

    grads = torch.autograd.grad(o, [leaves[n] for n in "qkv"], d_o.float())
    for name, expected in zip(("d_q", "d_k", "d_v"), grads):
        error = float((got[name].float() - expected).norm() / expected.norm())
        assert error <= 2e-2, f"{name}: {error:.3g}"


def optimized_on_gpu(gg: ck.Graph, target: str, cuda_device, tmp_path) -> tuple[object, dict[str, object]]:
    """``gg`` through ``ck.optimize`` (a 60 s search) and fresh bf16 normal values of its inputs but the
    saved ones, on ``cuda_device``."""
    import torch

    from cherenkov.search.database import TuningDatabase

    with TuningDatabase(tmp_path / "tuning.sqlite") as db:
        res = ck.optimize(gg, target=target, out=tmp_path / "run", database=db, budget_s=60)
    generator = torch.Generator(device=cuda_device).manual_seed(1)
    tensors = {n: torch.randn(t.shape, generator=generator, device=cuda_device).to(torch.bfloat16)
               for n, t in gg.inputs.items() if n not in gg.saved}  # fmt: skip
    return res, tensors


@pytest.mark.gpu
def test_gpu_optimize_runs_the_derived_backward(cuda_device, tmp_path) -> None:
    """The gradient graph through ``ck.optimize``: the backward kernel is searched, verified and
    run by ``res.run``, giving every gradient in one launch sequence."""
    import torch

    res, tensors = optimized_on_gpu(gradient_graph(2, 4, 2, 256, 256, 64, causal=True), "sm_90", cuda_device, tmp_path)
    assert [k.kind for k in res.partition] == ["flash_attention_backward"]
    got = res.run(**tensors)
    leaves = {n: tensors[n].float().requires_grad_(True) for n in "qkv"}
    o = torch.nn.functional.scaled_dot_product_attention(leaves["q"], leaves["k"], leaves["v"], is_causal=True,
                                                         enable_gqa=True)  # fmt: skip
    assert_matches_autograd(got, o, leaves, tensors["d_o"])


@pytest.mark.gpu
def test_gpu_optimize_runs_the_alibi_backward(cuda_device, tmp_path) -> None:
    """ALiBi's gradient graph through ``ck.optimize``: the bias kernel and the flash backward, every
    gradient against float32 autograd of the same causal, biased attention."""
    import torch

    res, tensors = optimized_on_gpu(alibi_gradient_graph(2, 8, 2, 300, 64), "sm_90", cuda_device, tmp_path)
    assert [k.kind for k in res.partition].count("flash_attention_backward") == 1
    tensors["slopes"] = torch.from_numpy(alibi_slopes(8)).to(device=cuda_device, dtype=torch.bfloat16)
    got = res.run(**tensors)
    leaves = {n: tensors[n].float().requires_grad_(True) for n in "qkv"}
    positions = torch.arange(300, device=cuda_device, dtype=torch.float32)
    bias = (tensors["slopes"].float() * positions).masked_fill(
        torch.ones(300, 300, dtype=torch.bool, device=cuda_device).triu(1), -torch.inf)
    o = torch.nn.functional.scaled_dot_product_attention(leaves["q"], leaves["k"], leaves["v"], attn_mask=bias,
                                                         enable_gqa=True)  # fmt: skip
    assert_matches_autograd(got, o, leaves, tensors["d_o"])


@pytest.mark.gpu
def test_gpu_optimize_runs_the_soft_capped_backward(cuda_device, tmp_path) -> None:
    """Soft-capped attention's gradient graph (cap 2, so the cap's slope matters) through ``ck.optimize``,
    every gradient against float32 autograd of the same capped, causal attention."""
    import torch

    res, tensors = optimized_on_gpu(capped_gradient_graph(2, 8, 2, 300, 64, 2.0), "sm_90", cuda_device, tmp_path)
    assert [k.kind for k in res.partition] == ["flash_attention_backward"]
    got = res.run(**tensors)
    leaves = {n: tensors[n].float().requires_grad_(True) for n in "qkv"}
    k, v = (leaves[n].repeat_interleave(4, dim=1) for n in "kv")
    scores = 2.0 * torch.tanh((leaves["q"] @ k.transpose(-1, -2)) * 64**-0.5 / 2.0)
    scores = scores.masked_fill(torch.ones(300, 300, dtype=torch.bool, device=cuda_device).triu(1), -torch.inf)
    assert_matches_autograd(got, torch.softmax(scores, dim=-1) @ v, leaves, tensors["d_o"])


@pytest.mark.gpu
def test_gpu_optimize_runs_the_backward_from_saved_statistics(cuda_device, tmp_path) -> None:
    """A gradient graph with the forward's output and log-sum-exp saved, through ``ck.optimize``:
    ``res.run`` takes them as inputs (here from a float32 forward) and every gradient matches."""
    import torch

    gg = gradient_graph(2, 4, 2, 256, 256, 64, causal=True, saved=True)
    res, tensors = optimized_on_gpu(gg, "sm_90a", cuda_device, tmp_path)
    assert [k.kind for k in res.partition] == ["flash_attention_backward"]
    leaves = {n: tensors[n].float().requires_grad_(True) for n in "qkv"}
    k, v = (leaves[n].repeat_interleave(2, dim=1) for n in "kv")
    scores = (leaves["q"] @ k.transpose(-1, -2)) * 64**-0.5
    scores = scores.masked_fill(torch.ones(256, 256, dtype=torch.bool, device=cuda_device).triu(1), -torch.inf)
    o = torch.softmax(scores, dim=-1) @ v
    tensors["o"], tensors["lse"] = o.detach().to(torch.bfloat16), torch.logsumexp(scores, dim=-1).detach()
    got = res.run(**tensors)
    assert_matches_autograd(got, o, leaves, tensors["d_o"])
