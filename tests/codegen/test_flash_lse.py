"""A forward attention that also returns its rows' log-sum-exp (what a training step saves for the
backward): one flash kernel writes both, in both families. The derivation joins the
``AttentionLse`` to its flash kernel; the ``mma.sync`` kernels are emulated on the CPU against the
graph's float64 reference, every family compiles for its targets, and on the GPU both families'
outputs are checked against float32."""

from __future__ import annotations

import re
import shutil

import numpy as np
import pytest

import cherenkov as ck
from cherenkov.codegen import compile_plans, cuda_source, load_kernel
from cherenkov.rewrites.plan_sm90a import HopperFlashSchedule

from .emulator import rounded
from .flash_emulator import assert_emulated_output_and_lse, knob_family_plans, supported

needs_gxx = pytest.mark.skipif(shutil.which("g++") is None, reason="no g++ to emulate kernels with")


def forward_graph(batch: int, heads: int, kv_heads: int, seq_q: int, seq_kv: int, dim: int, causal: bool,
                  dtype: str = "bf16", lse: bool = True) -> ck.Graph:  # fmt: skip
    """``ck.nn.attention`` at these sizes, its rows' log-sum-exp a second output (``lse``)."""
    g = ck.Graph("attention")
    q = g.input("q", (batch, heads, seq_q, dim), dtype)
    k, v = (g.input(n, (batch, kv_heads, seq_kv, dim), dtype) for n in "kv")
    if not lse:
        g.output(ck.nn.attention(q, k, v, causal=causal), "o")
        return g
    o, statistics = ck.nn.attention(q, k, v, causal=causal, return_lse=True)
    g.output(o, "o")
    g.output(statistics, "lse")
    return g


def test_the_log_sum_exp_is_a_side_output_of_the_flash_kernel() -> None:
    d = ck.derive(forward_graph(2, 4, 2, 100, 130, 64, causal=True))
    (kernel,) = d.kernels
    assert kernel.kind == "flash_attention" and [s.output for s in kernel.side_outputs] == ["lse"]
    assert "attention-lse-causal" in d.trace and "logsumexp-fold" in d.trace
    for target in ("sm_80", "sm_90a", "sm_120"):
        plans = d.plans(target)
        assert plans and all(p.problem.lse is not None and p.problem.lse.tensor == "lse" for p in plans)
        layout = plans[0].problem.lse.layout
        assert (layout.shape, layout.strides()) == ((2, 4, 100), (400, 100, 1))
    assert any(isinstance(p.schedule, HopperFlashSchedule) for p in d.plans("sm_90a"))
    inputs = forward_graph(2, 4, 2, 100, 130, 64, causal=True).example_inputs()
    expected, got = ck.evaluate(d.graph, inputs), ck.evaluate(d, inputs)
    np.testing.assert_allclose(got["lse"], expected["lse"], rtol=1e-6)


def test_computed_operands_are_stored_once_for_the_output_and_the_log_sum_exp() -> None:
    """q and k computed from inputs (a rotary factor on each) are each stored once, by an elementwise
    kernel, and read by the one flash kernel that writes the output and the log-sum-exp (the two
    forms name the head dim apart, which does not make their operands two buffers)."""
    g = ck.Graph("rotated attention")
    q = g.input("q", (2, 4, 64, 64), "bf16")
    k, v = (g.input(n, (2, 2, 64, 64), "bf16") for n in "kv")
    c = g.input("c", (2, 64, 64), "bf16")
    o, statistics = ck.nn.attention(q * c.unsqueeze(1), k * c.unsqueeze(1), v, causal=True, return_lse=True)
    g.output(o, "o")
    g.output(statistics, "lse")
    d = ck.derive(g)
    assert [k.kind for k in d.kernels] == ["elementwise", "elementwise", "flash_attention"]
    assert [s.output for s in d.kernels[-1].side_outputs] == ["lse"]
    assert {p.kind for p in d.plans("sm_90a")} == {"flash_attention"}
    inputs = g.example_inputs()
    expected, got = ck.evaluate(g, inputs), ck.evaluate(d, inputs)
    for name in ("o", "lse"):
        np.testing.assert_allclose(got[name], expected[name], rtol=1e-6)  # the log-sum-exp rounds to fp32


def test_short_query_schedules_write_the_log_sum_exp() -> None:
    """Decode-shaped problems (4 queries, a GQA group of 4) with the log-sum-exp wanted keep every short-query
    schedule: packed groups, key splits and warps splitting the keys, whose merges of partial states write the
    merged rows' statistic (it was prefill schedules only: GPT-OSS's sinks decoded on 64-row tiles holding one row)."""
    plain = ck.derive(forward_graph(4, 8, 2, 4, 512, 64, causal=False, lse=False)).plans("sm_90")
    plans = ck.derive(forward_graph(4, 8, 2, 4, 512, 64, causal=False)).plans("sm_90")
    short = {p.schedule for p in plain if getattr(p.schedule, "short_query", False)}
    assert short and short <= {p.schedule for p in plans}
    assert any(s.pack_group for s in short) and any(s.kv_splits > 1 for s in short) and any(s.warp_keys for s in short)


@needs_gxx
@pytest.mark.parametrize("seq_q", [1, 4])
def test_emulated_short_query_kernels_write_the_log_sum_exp(seq_q: int) -> None:
    """Packed and unpacked short-query ``mma.sync`` plans (a decoded token, or 4 drafts, after 300 keys; GQA 8/2):
    o within bf16 rounding, the log-sum-exp within 1e-5, each packed row's at its own query and head."""
    g = forward_graph(2, 8, 2, seq_q, 300, 64, causal=False)
    rng = np.random.default_rng(0)
    inputs = {n: rounded(rng.standard_normal(x.shape), "bf16") for n, x in g.inputs.items()}
    expected = ck.evaluate(g, inputs)
    picked: dict[bool, object] = {}
    for plan in ck.derive(g).plans("sm_80"):
        if plan.schedule.short_query and supported(plan):
            picked.setdefault(plan.schedule.pack_group, plan)
    assert set(picked) == {False, True}
    for plan in picked.values():
        assert_emulated_output_and_lse(plan, inputs, expected)


def test_sources_without_a_log_sum_exp_do_not_change() -> None:
    """The log-sum-exp text appears only where the problem wants it."""
    d = ck.derive(forward_graph(1, 2, 2, 64, 64, 64, causal=False))
    plain = ck.derive(forward_graph(1, 2, 2, 64, 64, 64, causal=False, lse=False))
    for target in ("sm_80", "sm_90a"):
        with_lse, without = d.plans(target)[0], plain.plans(target)[0]
        assert re.search(r"\blse\b", cuda_source(with_lse)) and "LSE_" in cuda_source(with_lse)
        assert not re.search(r"\blse\b", cuda_source(without)) and "LSE_" not in cuda_source(without)


@pytest.mark.parametrize("target", ["sm_80", "sm_90", "sm_90a", "sm_120"])
def test_log_sum_exp_plans_compile_and_spill_where_plain_ones_do(target: str, compiler, kernel_cache) -> None:
    """One plan of each knob family (and every Hopper schedule on sm_90a) builds for the target, and
    spills at most a register more than the same schedule without the log-sum-exp (the 16-row
    overlap at D 128 sits at 255 registers: 4 bytes)."""
    d = ck.derive(forward_graph(2, 4, 2, 100, 130, 128, causal=True))
    plain = {p.schedule: p for p in ck.derive(forward_graph(2, 4, 2, 100, 130, 128, causal=True, lse=False)).plans(target)}
    picked: dict[tuple, object] = {}
    for plan in d.plans(target):
        s = plan.schedule
        key = ((type(s).__name__, s.key()) if isinstance(s, HopperFlashSchedule) else
               (s.tma_kv, s.mbarrier_ring, s.pingpong, s.overlap, s.lazy_rescale, s.row_sums_mma, s.q_prescaled,
                s.rows_per_warp))  # fmt: skip
        picked.setdefault(key, plan)
    plans = list(picked.values())
    builds = compile_plans(plans, compiler=compiler, cache_dir=kernel_cache)
    for plan, build in zip(plans, builds):
        assert not isinstance(build, Exception), f"{plan.name}: {build}"
    spilling = [(plan, build) for plan, build in zip(plans, builds) if build.report.spill_bytes]
    references = compile_plans([plain[p.schedule] for p, _ in spilling], compiler=compiler, cache_dir=kernel_cache)
    for (plan, build), reference in zip(spilling, references):
        assert build.report.spill_bytes <= reference.report.spill_bytes + 8 or reference.report.spill_bytes > 0, \
            f"{plan.name}: {build.report}"


@needs_gxx
@pytest.mark.parametrize(("sizes", "causal", "dtype"), [
    ((2, 4, 2, 40, 70, 64), True, "bf16"),  # GQA, ragged, causal
    ((1, 2, 2, 100, 77, 32), False, "fp16"),  # Sq > Skv
], ids=["bf16_gqa_causal", "fp16_tails"])  # fmt: skip
def test_emulated_kernels_write_the_output_and_the_log_sum_exp(sizes, causal, dtype) -> None:
    """Emulated ``mma.sync`` kernels of several knob families (plain, lazy rescale, head-major,
    pingpong, overlap, 32-row warps): o within bf16/fp16 rounding, the log-sum-exp within 1e-5."""
    g = forward_graph(*sizes, causal=causal, dtype=dtype)
    rng = np.random.default_rng(0)
    inputs = {n: rounded(rng.standard_normal(x.shape), dtype) for n, x in g.inputs.items()}
    expected = ck.evaluate(g, inputs)
    families = knob_family_plans(ck.derive(g).plans("sm_80"))
    assert len(families) >= 6
    for plan in families[:6]:
        assert_emulated_output_and_lse(plan, inputs, expected)


# ------------------------------------------------------------------------------ GPU

GPU_CASES = [((2, 8, 2, 200, 333, 128), True), ((1, 4, 4, 256, 512, 64), False), ((2, 4, 4, 130, 70, 96), True),
             ((2, 32, 8, 1, 4100, 128), False), ((2, 32, 8, 4, 2000, 64), False)]  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize(("sizes", "causal"), GPU_CASES,
                         ids=["d128_gqa_causal_ragged", "d64", "d96_causal", "decode_gqa", "drafts_gqa"])
def test_gpu_flash_kernels_write_the_log_sum_exp(sizes, causal, cuda_device, kernel_cache) -> None:
    """Every Hopper schedule, a sample of ``mma.sync`` ones and one short-query plan of each kind (packed or not, key
    splits or not, warps splitting the keys or not, each ring; decoding, drafts) on sm_90a: o against float32 SDPA,
    the log-sum-exp within ``LSE_TOLERANCE`` of float32's (the merged one where partial states merge), both into
    NaN-poisoned outputs."""
    import torch

    from cherenkov.codegen.launch import operand_view
    from cherenkov.search.measure import LSE_TOLERANCE, TOLERANCE, attention_statistics, lse_difference

    plans = ck.derive(forward_graph(*sizes, causal=causal)).plans("sm_90a")
    chosen = [p for p in plans if isinstance(p.schedule, HopperFlashSchedule)] + [
        p for p in plans if not isinstance(p.schedule, HopperFlashSchedule)][::40]  # fmt: skip
    short: dict[tuple, object] = {}
    for plan in plans:
        s = plan.schedule
        if getattr(s, "short_query", False):
            short.setdefault((s.pack_group, s.kv_splits > 1, s.warp_keys, s.tma_kv, s.mbarrier_ring), plan)
    chosen += [p for p in short.values() if p not in chosen]
    problem = chosen[0].problem
    generator = torch.Generator(device=cuda_device).manual_seed(0)
    stored = {n: torch.randn(s, generator=generator, device=cuda_device).to(torch.bfloat16)
              for n, s in problem.stored_shapes().items() if n != "lse"}  # fmt: skip
    views = [operand_view(problem, role, stored[problem.name(role)]) for role in "qkv"]
    reference, lse_reference = attention_statistics(problem, *views)
    for plan, build in zip(chosen, compile_plans(chosen, cache_dir=kernel_cache)):
        assert not isinstance(build, Exception), build
        kernel = load_kernel(build, 0)
        out = torch.full(problem.layout("o").shape, float("nan"), dtype=torch.bfloat16, device=cuda_device)
        lse = torch.full(problem.lse.layout.shape, float("nan"), dtype=torch.float32, device=cuda_device)
        kernel(stored["q"], stored["k"], stored["v"], out, lse=lse)
        torch.cuda.synchronize()
        error = float((out.float() - reference).norm() / reference.norm())
        assert error <= TOLERANCE["bf16"], f"{plan.name}: o differs by {error:.3g}"
        assert lse_difference(lse, lse_reference) <= LSE_TOLERANCE, plan.name
