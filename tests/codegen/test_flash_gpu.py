"""Flash-attention kernels on the GPU against PyTorch SDPA (float32): every knob value,
causal, GQA/MQA, fp16, tails and Sq ≠ Skv; every head dim, D_v ≠ D, packed GQA groups and
key splits (decode, short queries). Skipped without a GPU, torch or cupy."""

from __future__ import annotations

import math

import pytest

from cherenkov.codegen import CompileError, compile_plan, compile_plans, load_kernel
from cherenkov.codegen.compile import Nvrtc
from cherenkov.rewrites.plan import (
    ATTENTION_HEAD_DIMS,
    FLASH_KNOBS,
    SHORT_QUERY_KNOBS,
    TARGETS,
    AttentionProblem,
    FlashSchedule,
    KernelPlan,
    flash_schedule_problems,
)

pytestmark = pytest.mark.gpu

TOLERANCE = 2e-2


def schedule(key: str) -> FlashSchedule:
    """``"q64 kv128 w4 s2 split lin x2"`` → FlashSchedule; optional trailing flags ``pp`` (pingpong),
    ``lazy`` (lazy rescale), ``hm`` (head-major grid order), ``ov`` (overlap), ``mb3`` (min_blocks 3),
    ``late`` (late copy), ``mbar`` (mbarrier ring), ``tma`` (TMA K/V copies), ``rs`` (row sums on the
    tensor cores), ``qs`` (pre-scaled Q), ``lwr`` (the last warp refills the ring), ``pack`` (packed
    GQA group), ``sk8`` (8 key splits), ``wk`` (the warps split each key tile's keys)."""
    q, kv, w, s, split, layout, x, *flags = key.split()
    splits = next((int(f[2:]) for f in flags if f.startswith("sk")), 1)
    flags = [f for f in flags if not f.startswith("sk")]
    assert set(flags) <= {"pp", "lazy", "hm", "ov", "mb3", "late", "mbar", "tma", "rs", "qs", "lwr", "pack", "wk"}, flags
    return FlashSchedule(int(q[1:]), int(kv[2:]), int(w[1:]), int(s[1:]), split == "split", layout == "swz", int(x[1:]),
                         pingpong="pp" in flags, lazy_rescale="lazy" in flags, head_major="hm" in flags,
                         overlap="ov" in flags, min_blocks=3 if "mb3" in flags else 1, late_copy="late" in flags,
                         mbarrier_ring="mbar" in flags, tma_kv="tma" in flags, row_sums_mma="rs" in flags,
                         q_prescaled="qs" in flags, last_warp_refill="lwr" in flags, kv_splits=splits,
                         pack_group="pack" in flags, warp_keys="wk" in flags)


def problem(b, h, hkv, sq, skv, d, **kw) -> AttentionProblem:
    return AttentionProblem(b, h, hkv, sq, skv, d, **kw)


SEED = problem(1, 8, 8, 4096, 8192, 128)
CASES = [
    (SEED, "q128 kv64 w4 s2 split swz x4"),
    (SEED, "q64 kv128 w4 s2 split lin x2"),
    (SEED, "q128 kv32 w8 s1 split swz x4"),
    (SEED, "q128 kv128 w8 s2 split swz x2"),
    (problem(2, 16, 16, 1000, 3000, 64), "q128 kv64 w4 s2 split swz x4"),
    (problem(2, 16, 16, 1000, 3000, 64), "q64 kv32 w4 s2 split lin x4"),
    (problem(2, 16, 16, 1000, 3000, 64), "q128 kv128 w4 s2 split swz x2"),
    (problem(2, 16, 16, 1000, 3000, 64), "q128 kv64 w8 s2 split lin x2"),
    (problem(1, 32, 32, 2048, 2048, 128, causal=True), "q128 kv64 w4 s2 split swz x4"),
    (problem(1, 32, 32, 2048, 2048, 128, causal=True), "q64 kv64 w4 s3 split swz x4"),
    (problem(1, 32, 32, 2048, 2048, 128, causal=True), "q128 kv128 w8 s2 split lin x4"),
    (problem(1, 32, 32, 2048, 2048, 128, causal=True), "q128 kv32 w4 s2 split swz x2"),
    (problem(2, 32, 8, 512, 1536, 128), "q128 kv64 w4 s2 split swz x4"),
    (problem(2, 32, 8, 512, 1536, 128), "q64 kv128 w4 s2 joint swz x4"),
    (problem(1, 32, 8, 777, 777, 64, causal=True), "q128 kv64 w8 s2 split lin x2"),
    (problem(1, 8, 8, 1024, 2048, 128, dtype="fp16"), "q128 kv64 w4 s2 split swz x4"),
    (problem(1, 8, 8, 1024, 2048, 128, dtype="fp16"), "q64 kv32 w4 s2 split lin x2"),
    (problem(2, 4, 4, 513, 1000, 64, dtype="fp16", causal=True), "q128 kv128 w4 s1 split swz x4"),
    (problem(1, 2, 2, 1, 1, 64), "q128 kv64 w4 s2 split swz x4"),
    (problem(1, 3, 3, 77, 1, 128, causal=True), "q128 kv64 w4 s2 split swz x4"),
    (problem(2, 2, 2, 100, 37, 128, causal=True), "q64 kv32 w4 s3 joint swz x4"),
    (problem(1, 2, 2, 37, 100, 64, causal=True), "q128 kv128 w8 s2 split lin x2"),
    (problem(1, 4, 4, 300, 301, 64), "q64 kv64 w4 s2 split swz x2"),
    (problem(3, 2, 2, 129, 255, 128, causal=True), "q128 kv32 w8 s3 split swz x4"),
    (problem(1, 1, 1, 65, 4097, 128), "q64 kv128 w4 s3 split swz x4"),
    (problem(1, 4, 4, 256, 256, 64, scale=0.3), "q128 kv64 w4 s2 split swz x4"),
    (problem(1, 8, 1, 200, 333, 128, causal=True), "q64 kv64 w4 s2 split lin x4"),
    # issue 6: pingpong warp groups, lazy rescale, head-major grid order, overlap, min_blocks
    (SEED, "q256 kv32 w8 s2 joint swz x4 pp"),
    (SEED, "q128 kv64 w8 s2 joint swz x4 pp"),
    (SEED, "q128 kv64 w4 s1 split swz x4 lazy"),
    (SEED, "q128 kv64 w4 s2 joint swz x4 lazy"),
    (SEED, "q64 kv64 w4 s2 joint swz x4 ov"),
    (SEED, "q128 kv32 w8 s3 joint swz x4 lazy ov"),
    (SEED, "q64 kv32 w4 s2 split swz x4 lazy mb3"),
    (problem(2, 16, 16, 1000, 3000, 64), "q256 kv32 w8 s2 joint swz x4 pp"),
    (problem(2, 16, 16, 1000, 3000, 64), "q64 kv128 w4 s2 joint swz x4 lazy ov"),
    (problem(2, 16, 16, 1000, 3000, 64), "q64 kv64 w4 s1 split swz x4 mb3"),
    (problem(1, 32, 32, 2048, 2048, 128, causal=True), "q256 kv32 w8 s2 joint swz x4 pp hm"),
    (problem(1, 32, 32, 2048, 2048, 128, causal=True), "q128 kv64 w4 s2 split swz x4 lazy hm"),
    (problem(1, 32, 32, 2048, 2048, 128, causal=True), "q64 kv64 w4 s3 joint swz x4 lazy ov hm"),
    (problem(1, 32, 8, 777, 777, 64, causal=True), "q128 kv64 w8 s2 joint swz x4 pp hm"),
    (problem(1, 32, 8, 777, 777, 64, causal=True), "q128 kv64 w8 s2 joint swz x4 lazy ov hm"),
    (problem(1, 8, 8, 1024, 2048, 128, dtype="fp16"), "q128 kv64 w4 s2 split swz x4 lazy"),
    (problem(2, 4, 4, 513, 1000, 64, dtype="fp16", causal=True), "q64 kv32 w4 s2 joint swz x4 lazy ov mb3 hm"),
    (problem(1, 3, 3, 77, 1, 128, causal=True), "q256 kv32 w8 s2 joint swz x4 pp"),
    (problem(1, 3, 3, 77, 1, 128, causal=True), "q64 kv32 w4 s2 joint swz x4 ov"),
    (problem(2, 2, 2, 100, 37, 128, causal=True), "q128 kv64 w8 s2 joint swz x4 pp hm"),
    (problem(1, 2, 2, 37, 100, 64, causal=True), "q128 kv32 w8 s2 joint swz x4 lazy ov"),
    (problem(3, 2, 2, 129, 255, 128, causal=True), "q64 kv64 w4 s3 split swz x4 lazy hm"),
    (problem(1, 1, 1, 65, 4097, 128), "q128 kv64 w8 s3 joint swz x4 lazy ov"),
    (problem(2, 32, 8, 512, 1536, 128), "q64 kv64 w4 s2 joint swz x4 lazy ov"),
    (problem(1, 8, 1, 200, 333, 128, causal=True), "q128 kv32 w4 s2 split swz x4 lazy hm"),
    # sixth session: late copies and the mbarrier ring (joint lazy rings)
    (SEED, "q128 kv64 w4 s2 joint swz x4 lazy late mbar"),
    (SEED, "q128 kv32 w4 s3 joint swz x4 lazy late"),
    (SEED, "q128 kv32 w4 s3 joint swz x4 lazy mbar"),
    (problem(2, 16, 16, 1000, 3000, 64), "q128 kv128 w4 s2 joint swz x4 lazy mbar"),
    (problem(2, 16, 16, 1000, 3000, 64), "q128 kv64 w4 s3 joint swz x4 lazy late mbar"),
    (problem(1, 32, 32, 2048, 2048, 128, causal=True), "q128 kv64 w4 s2 joint swz x4 lazy hm late mbar"),
    (problem(1, 32, 8, 777, 777, 64, causal=True), "q64 kv32 w4 s3 joint swz x4 lazy hm late"),
    (problem(2, 4, 4, 513, 1000, 64, dtype="fp16", causal=True), "q128 kv64 w4 s2 joint swz x4 lazy mbar"),
    (problem(1, 3, 3, 77, 1, 128, causal=True), "q128 kv64 w4 s3 joint swz x4 lazy late mbar"),
    (problem(3, 2, 2, 129, 255, 128, causal=True), "q128 kv32 w4 s2 joint swz x4 lazy late"),
    (problem(1, 8, 1, 200, 333, 128, causal=True), "q128 kv32 w8 s2 joint swz x4 lazy late mbar"),
    # seventh session: the mbarrier ring fed by TMA boxes (tails read as zeros, GQA planes, fp16 maps)
    (SEED, "q128 kv64 w4 s2 joint swz x4 lazy late mbar tma"),
    (SEED, "q128 kv64 w4 s2 joint swz x4 lazy mbar tma"),
    (SEED, "q128 kv32 w4 s3 joint swz x4 lazy mbar tma"),
    (problem(2, 16, 16, 1000, 3000, 64), "q128 kv128 w4 s2 joint swz x4 lazy mbar tma"),
    (problem(1, 32, 32, 2048, 2048, 128, causal=True), "q128 kv64 w4 s2 joint swz x4 lazy hm late mbar tma"),
    (problem(2, 32, 8, 512, 1536, 128), "q64 kv64 w4 s3 joint swz x4 lazy late mbar tma"),
    (problem(2, 4, 4, 513, 1000, 64, dtype="fp16", causal=True), "q128 kv64 w4 s2 joint swz x4 lazy late mbar tma"),
    (problem(1, 3, 3, 77, 1, 128, causal=True), "q128 kv64 w4 s3 joint swz x4 lazy mbar tma"),
    (problem(3, 2, 2, 129, 255, 128, causal=True), "q128 kv32 w8 s2 joint swz x4 lazy late mbar tma"),
    (problem(1, 8, 1, 200, 333, 128, causal=True), "q64 kv32 w4 s2 joint swz x4 lazy hm mbar tma"),
    # The TMA ring's step knobs (row sums on the tensor cores, pre-scaled Q, the last warp's
    # refill) and its 256-row blocks: tails, causal, GQA, fp16, D = 64, Q in registers, a
    # sequence shorter than the ring.
    (SEED, "q256 kv64 w8 s2 joint swz x4 lazy mbar tma rs qs lwr"),
    (SEED, "q256 kv64 w8 s3 joint swz x4 lazy mbar tma rs"),
    (problem(16, 16, 16, 1024, 1024, 128), "q128 kv64 w4 s2 joint swz x4 lazy mbar tma rs"),
    (problem(4, 16, 16, 4096, 4096, 128, causal=True), "q256 kv64 w8 s2 joint swz x4 lazy hm mbar tma rs qs lwr"),
    (problem(2, 16, 16, 1000, 3000, 64), "q256 kv128 w8 s2 joint swz x4 lazy mbar tma rs qs lwr"),
    (problem(1, 32, 32, 2048, 2048, 128, causal=True), "q256 kv64 w8 s3 joint swz x4 lazy hm mbar tma rs qs lwr"),
    (problem(2, 4, 4, 513, 1000, 64, dtype="fp16", causal=True), "q128 kv64 w4 s2 joint swz x4 lazy mbar tma rs qs lwr"),
    (problem(1, 8, 1, 200, 333, 128, causal=True), "q128 kv32 w4 s2 joint swz x4 lazy late mbar tma rs"),
    (problem(1, 3, 3, 77, 1, 128, causal=True), "q256 kv64 w8 s2 joint swz x4 lazy mbar tma rs qs lwr"),
    (problem(3, 2, 2, 129, 255, 128), "q64 kv64 w4 s3 joint swz x4 lazy mbar tma rs qs"),
    (problem(2, 8, 2, 1024, 777, 128, dtype="fp16"), "q256 kv32 w8 s3 joint swz x4 lazy mbar tma rs qs"),
]
PLANS = [KernelPlan("flash_attention", p, schedule(key), TARGETS["sm_90"]) for p, key in CASES]

# issue 22: head dims 32-256 (rows padded to 64, 128 or 256 elements), D_v != D, and short
# queries: packed GQA groups, key splits (ragged key counts, a last split with fewer tiles),
# 1- and 2-warp blocks, on all three rings
SHAPE_CASES = [
    (problem(2, 4, 4, 300, 700, 32), "q128 kv64 w4 s2 split swz x4"),
    (problem(1, 4, 2, 257, 513, 80), "q64 kv64 w4 s2 split swz x4"),
    (problem(1, 4, 2, 257, 513, 80, causal=True), "q128 kv32 w8 s3 joint swz x4 lazy mbar"),
    (problem(2, 4, 4, 200, 999, 96), "q128 kv64 w8 s2 joint swz x4 lazy mbar"),
    (problem(1, 4, 4, 333, 333, 96, causal=True), "q64 kv32 w4 s2 split swz x4"),
    (problem(1, 4, 4, 300, 700, 192), "q64 kv64 w4 s2 split swz x4"),
    (problem(1, 4, 2, 300, 700, 256), "q64 kv64 w4 s2 split swz x4"),
    (problem(1, 4, 2, 300, 700, 256, causal=True), "q64 kv32 w4 s2 joint swz x4 lazy mbar tma"),
    (problem(1, 4, 4, 300, 700, 192, value_dim=128), "q64 kv64 w4 s2 split swz x4"),
    (problem(1, 4, 4, 129, 250, 64, value_dim=128), "q128 kv64 w4 s2 split swz x4"),
    (problem(2, 8, 8, 1, 4000, 128), "q16 kv64 w1 s2 split swz x4 sk8"),
    (problem(2, 8, 8, 1, 4000, 128), "q16 kv128 w1 s2 joint swz x4 lazy mbar tma sk8"),
    (problem(3, 32, 8, 1, 8191, 128), "q16 kv64 w1 s3 joint swz x4 lazy mbar sk16 pack"),
    (problem(2, 32, 4, 1, 5000, 128), "q16 kv32 w1 s2 joint swz x4 lazy mbar tma sk32 pack"),
    (problem(2, 16, 4, 4, 3000, 64), "q16 kv64 w1 s2 split swz x4 pack"),
    (problem(2, 16, 4, 4, 3000, 64), "q16 kv64 w1 s2 split swz x4 sk4 pack"),
    (problem(1, 8, 2, 64, 2048, 128), "q64 kv64 w4 s2 joint swz x4 lazy mbar tma sk2 pack"),
    (problem(1, 12, 4, 37, 1500, 128), "q32 kv64 w2 s2 split swz x4 sk2 pack"),
    (problem(2, 8, 2, 1, 3000, 192, value_dim=128), "q16 kv64 w1 s2 split swz x4 sk4 pack"),
    (problem(1, 8, 8, 1, 65536, 256), "q16 kv32 w1 s3 joint swz x4 lazy mbar tma sk64"),
    (problem(4, 8, 2, 1, 2048, 64, dtype="fp16"), "q16 kv32 w1 s2 joint swz x4 lazy mbar sk8 pack"),
    (problem(3, 32, 8, 1, 8191, 128), "q16 kv64 w4 s3 joint swz x4 lazy mbar tma pack wk"),
    (problem(2, 32, 8, 1, 5000, 128), "q16 kv128 w4 s2 split swz x4 sk8 pack wk"),
    (problem(2, 16, 4, 4, 3001, 96), "q16 kv64 w2 s2 joint swz x4 lazy mbar sk4 pack wk"),
    (problem(2, 8, 8, 1, 999, 64), "q16 kv64 w4 s2 split swz x4 wk"),
    (problem(1, 8, 2, 1, 4000, 192, value_dim=128), "q16 kv64 w4 s2 joint swz x4 lazy mbar sk4 pack wk"),
    # head dims off the benchmark's: multiples of 16 (LeViT's 16, Stable Diffusion's 160) in rows padded to
    # a power of two, and of 8 (Stable Diffusion's 40) padded to 16 with zero-filled columns, through the
    # long-query ring, the mbarrier ring, key splits, packed groups and warps on keys
    (problem(2, 4, 4, 300, 700, 16), "q128 kv64 w4 s2 split swz x4"),
    (problem(2, 4, 2, 300, 700, 48, causal=True), "q128 kv64 w4 s2 joint swz x4 lazy mbar"),
    (problem(1, 4, 4, 257, 513, 112), "q64 kv64 w4 s2 split swz x4"),
    (problem(1, 4, 2, 300, 700, 160), "q64 kv64 w4 s2 split swz x4"),
    (problem(1, 4, 4, 300, 700, 224, causal=True), "q64 kv32 w4 s2 split swz x4"),
    (problem(2, 4, 4, 300, 700, 40), "q128 kv64 w4 s2 split swz x4"),
    (problem(2, 4, 2, 333, 333, 40, causal=True), "q128 kv32 w8 s3 joint swz x4 lazy mbar"),
    (problem(1, 4, 4, 300, 700, 8, dtype="fp16"), "q128 kv64 w4 s2 split swz x4"),
    (problem(1, 4, 4, 300, 700, 200, value_dim=40), "q64 kv32 w4 s2 split swz x4"),
    (problem(2, 8, 2, 1, 3000, 40), "q16 kv64 w1 s2 split swz x4 sk8 pack"),
    (problem(2, 8, 8, 1, 999, 72), "q16 kv64 w4 s2 split swz x4 wk"),
    (problem(2, 16, 4, 4, 3001, 24, value_dim=40), "q16 kv64 w2 s2 joint swz x4 lazy mbar sk4 pack wk"),
]
SHAPE_PLANS = [KernelPlan("flash_attention", p, schedule(key), TARGETS["sm_90"]) for p, key in SHAPE_CASES]


def case_id(plan: KernelPlan) -> str:
    p = plan.problem
    return (
        f"b{p.batch}h{p.heads}g{p.group_size}_{p.seq_q}x{p.seq_kv}_d{p.head_dim}"
        f"{f'_dv{p.value_dim}' if p.value_dim else ''}_{p.dtype}"
        f"{'_causal' if p.causal else ''}-{plan.schedule.key()}"
    )


def test_cases_cover_every_knob_value():
    for knob, values in FLASH_KNOBS.items():
        assert {getattr(plan.schedule, knob) for plan in PLANS} == set(values), knob


def test_shape_cases_are_valid_and_cover_the_short_query_knobs():
    for plan in SHAPE_PLANS:
        assert not flash_schedule_problems(plan.schedule, plan.problem, plan.target), case_id(plan)
    dims = {p.problem.head_dim for p in SHAPE_PLANS}
    assert set(ATTENTION_HEAD_DIMS) >= dims >= {32, 64, 80, 96, 128, 192, 256} and {d % 16 for d in dims} == {0, 8}
    rows = {(p.schedule.block_q, p.schedule.warps, p.schedule.warp_keys) for p in SHAPE_PLANS}
    assert rows >= set(SHORT_QUERY_KNOBS["rows"])
    for knob, values in SHORT_QUERY_KNOBS.items():
        if knob not in ("ring", "rows"):
            assert {getattr(p.schedule, knob) for p in SHAPE_PLANS} >= set(values), knob


@pytest.fixture(scope="module")
def compiled(cuda_device, tmp_path_factory):
    plans = PLANS + SHAPE_PLANS
    results = compile_plans(plans, cache_dir=tmp_path_factory.mktemp("kernels"))
    return {plan: result for plan, result in zip(plans, results)}


def reference(q, k, v, p: AttentionProblem):
    """SDPA in float32, K/V heads repeated for GQA."""
    import torch.nn.functional as F

    k = k.float().repeat_interleave(p.group_size, dim=1)
    v = v.float().repeat_interleave(p.group_size, dim=1)
    return F.scaled_dot_product_attention(q.float(), k, v, is_causal=p.causal, scale=p.scale or None)


def run_plan(kernel, p: AttentionProblem, device, shift: float = 0.0):
    """One launch on fresh Gaussian inputs (``shift`` added to q: another score scale), over a
    NaN-poisoned output; the output and its float32 reference."""
    import torch

    dtype = torch.bfloat16 if p.dtype == "bf16" else torch.float16
    shapes = p.shapes()
    q, k, v = (torch.randn(shapes[name], device=device, dtype=dtype) for name in (p.q, p.k, p.v))
    q = q + shift
    out = torch.full(shapes[p.out], math.nan, device=device, dtype=dtype)
    kernel(q, k, v, out)
    torch.cuda.synchronize()
    return out, reference(q, k, v, p)


def relative_error(out, ref) -> float:
    return ((out.float() - ref).norm() / ref.norm()).item()


@pytest.mark.parametrize("plan", PLANS, ids=case_id)
def test_matches_sdpa(plan, compiled, cuda_device):
    result = compiled[plan]
    assert not isinstance(result, CompileError), str(result)
    out, ref = run_plan(load_kernel(result), plan.problem, cuda_device)
    assert not out.isnan().any(), f"{out.isnan().sum().item()} output elements unwritten or NaN"
    assert relative_error(out, ref) <= TOLERANCE


@pytest.mark.parametrize("plan", SHAPE_PLANS, ids=case_id)
def test_every_shape_matches_sdpa(plan, compiled, cuda_device):
    """Head dims, D_v != D, packing and key splits; split kernels are launched twice (the last
    split of each tile resets its arrival counter for the next launch)."""
    result = compiled[plan]
    assert not isinstance(result, CompileError), str(result)
    kernel = load_kernel(result)
    for shift in (0.0, 0.5) if plan.schedule.kv_splits > 1 else (0.0,):
        out, ref = run_plan(kernel, plan.problem, cuda_device, shift)
        assert not out.isnan().any(), f"{out.isnan().sum().item()} output elements unwritten or NaN"
        assert relative_error(out, ref) <= TOLERANCE


def test_nvrtc_build_matches(cuda_device, tmp_path):
    """The NVRTC path (through cupy) builds a working kernel too."""
    plan = PLANS[8]
    kernel = compile_plan(plan, compiler=Nvrtc(), cache_dir=tmp_path)
    assert "mma.sync.aligned.m16n8k16" in kernel.ptx_path.read_text()
    out, ref = run_plan(load_kernel(kernel), plan.problem, cuda_device)
    assert not out.isnan().any() and relative_error(out, ref) <= TOLERANCE


def test_launch_on_a_side_stream(compiled, cuda_device):
    """The kernel runs on torch's current stream: ordered after the inputs are written and
    before the comparison, all on one non-default stream with no synchronisation between."""
    import torch

    plan = PLANS[4]
    kernel = load_kernel(compiled[plan])
    shapes = plan.problem.shapes()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        q, k, v = (torch.randn(shapes[name], device=cuda_device, dtype=torch.bfloat16) for name in "qkv")
        out = torch.full(shapes["o"], math.nan, device=cuda_device, dtype=torch.bfloat16)
        kernel(q, k, v, out)
        ref = reference(q, k, v, plan.problem)
        error = (out.float() - ref).norm() / ref.norm()
    stream.synchronize()
    assert error.item() <= TOLERANCE


def test_wrong_inputs_are_refused(compiled, cuda_device):
    import torch

    from cherenkov.codegen import CodegenError

    plan = PLANS[4]
    kernel = load_kernel(compiled[plan])
    shapes = plan.problem.shapes()
    q = torch.randn(shapes["q"], device=cuda_device, dtype=torch.bfloat16)
    k = torch.randn(shapes["k"], device=cuda_device, dtype=torch.bfloat16)
    with pytest.raises(CodegenError, match="dtype"):
        kernel(q.half(), k, k)
    with pytest.raises(CodegenError, match="contiguous"):
        kernel(q.transpose(1, 2).contiguous().transpose(1, 2), k, k)
