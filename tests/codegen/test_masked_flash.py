"""Flash attention with a bias tensor (an additive mask), as models hand it to SDPA: shared
by the heads or per head, bf16/fp16/fp32, GQA, ragged lengths and decoding (a packed group,
key splits), and under a causal mask (ALiBi's one row a head, broadcast over the queries) or a window
aligned to the last key (ALiBi after a KV cache). On the CPU: the strides and the reader reach the source, and representative
plans of every ring compile without spills for sm_80, sm_90, sm_90a and sm_120. On the GPU:
every such plan against SDPA with the same mask (float32), and rows the mask hides entirely
(with -inf: 0, PyTorch's safe softmax; with bf16's lowest value, as transformers adds: the
keys' average, as PyTorch's math gives)."""

from __future__ import annotations

import math

import pytest

from cherenkov.codegen import CompileError, compile_plans, cuda_source, load_kernel, valid_flash_plans
from cherenkov.codegen.launch import TORCH_DTYPES, mask_view
from cherenkov.rewrites.plan import TARGETS, AttentionBias, AttentionProblem, KernelPlan
from cherenkov.rewrites.plan_sm90a import HopperFlashSchedule, hopper_schedule_problems

TOLERANCE = 2e-2
HOPPER_SCHEDULES = (HopperFlashSchedule(), HopperFlashSchedule(128, 2, 2, True, persistent=True, q_buffers=2))


def masked(b: int, h: int, hkv: int, sq: int, skv: int, d: int, dtype: str = "bf16", *, per_head: bool = False,
           bias_dtype: str = "bf16") -> AttentionProblem:  # fmt: skip
    """A BHSD problem with a bias ``(B, H or 1, Sq, Skv)`` named ``mask``."""
    heads = h if per_head else 1
    bias = AttentionBias("mask", bias_dtype, (b, heads, sq, skv), heads * sq * skv, sq * skv if per_head else 0,
                         skv, 1)  # fmt: skip
    return AttentionProblem(b, h, hkv, sq, skv, d, dtype, bias=bias)


PROBLEMS = {
    "shared_bias": masked(2, 4, 4, 256, 256, 64),
    "per_head_fp32_gqa_ragged": masked(1, 8, 2, 200, 333, 128, per_head=True, bias_dtype="fp32"),
    "fp16_ragged": masked(2, 4, 4, 130, 190, 64, "fp16", bias_dtype="fp16"),
    "decode_gqa": masked(4, 8, 2, 1, 1000, 128),
    # ALiBi under a causal mask: one fp32 row of biases a head (slope times key position), every query's
    "causal_alibi_ragged": AttentionProblem(2, 4, 4, 200, 200, 64, causal=True,
                                            bias=AttentionBias("mask", "fp32", (2, 4, 200), 4 * 200, 200, 0, 1)),
    # ALiBi after a KV cache (Bloom's, MPT's): 16 queries after 284 cached keys under the kernel's window aligned to
    # the last key, the slopes' row a head read beside it; a GQA group of 4 (packed rows, key splits)
    "alibi_after_cache_gqa": AttentionProblem(2, 8, 2, 16, 300, 64, window=316, window_ahead=284,
                                              bias=AttentionBias("mask", "fp32", (8, 300), 0, 300, 0, 1)),
}

FEATURES = ("pack_group", "warp_keys", "tma_kv", "pingpong", "overlap", "q_prescaled", "mbarrier_ring", "kv_split")


def representative(problem: AttentionProblem, target: str) -> list[KernelPlan]:
    """The first valid plan and the first one using each ring and short-query knob (key splits
    among them); for sm_90a the Hopper schedules that fit."""
    if target == "sm_90a":
        return [KernelPlan("flash_attention", problem, s, TARGETS[target]) for s in HOPPER_SCHEDULES
                if not hopper_schedule_problems(s, problem, TARGETS[target])]  # fmt: skip
    valid = valid_flash_plans(problem, TARGETS[target])
    chosen = {"first": valid[0]} if valid else {}
    for plan in valid:
        used = [f for f in FEATURES if getattr(plan.schedule, f)] + (["splits"] if plan.schedule.kv_splits > 1 else [])
        for feature in used:
            chosen.setdefault(feature, plan)
    return list(dict.fromkeys(chosen.values()))


def chosen_plans(targets: tuple[str, ...]) -> list[KernelPlan]:
    return [plan for target in targets for problem in PROBLEMS.values() for plan in representative(problem, target)]


def test_the_bias_reaches_the_source() -> None:
    problem = PROBLEMS["per_head_fp32_gqa_ragged"]
    plan = representative(problem, "sm_90")[0]
    source = cuda_source(plan)
    assert "constexpr bool BIAS = true;" in source and "typedef float bias_t;" in source
    assert f"constexpr size_t BIAS_HEAD_STRIDE = {200 * 333};" in source
    assert "const bias_t* __restrict__ bias" in source and "state.bias_rows = bias + BIAS_OFFSET" in source
    assert "+ mask) v" in source and "then the bias tensor" in source
    half = cuda_source(representative(PROBLEMS["fp16_ragged"], "sm_80")[0])
    assert "const float b = half_bits_to_float(raw);" in half
    plain = cuda_source(KernelPlan("flash_attention", AttentionProblem(2, 4, 4, 256, 256, 64), plan.schedule,
                                   TARGETS["sm_90"]))  # fmt: skip
    assert "constexpr bool BIAS = false;" in plain and "bias_t" not in plain


def test_every_ring_and_short_query_knob_is_covered() -> None:
    """The representatives exercise each code path that masks scores."""
    used = {f for plan in chosen_plans(("sm_90",)) for f in FEATURES if getattr(plan.schedule, f)}
    assert {"pack_group", "tma_kv", "mbarrier_ring", "q_prescaled"} <= used, used
    assert any(plan.schedule.kv_splits > 1 for plan in chosen_plans(("sm_90",)))
    assert chosen_plans(("sm_90a",)), "no Hopper plan for a masked problem"


@pytest.mark.slow
def test_masked_sources_compile_without_spills(compiler, kernel_cache) -> None:
    chosen = chosen_plans(("sm_80", "sm_90", "sm_90a", "sm_120"))
    assert {p.target.name for p in chosen} == {"sm_80", "sm_90", "sm_90a", "sm_120"}
    for plan, result in zip(chosen, compile_plans(chosen, compiler=compiler, cache_dir=kernel_cache)):
        assert not isinstance(result, CompileError), f"{plan.name}: {result}"
        assert result.report.spill_bytes == 0 or plan.problem.head_dim == 128, (plan.name, result.report)


# ------------------------------------------------------------------------------ GPU


def _inputs(problem: AttentionProblem, torch, mask=None) -> dict:
    dtype = getattr(torch, TORCH_DTYPES[problem.dtype])
    tensors = {role: torch.randn(problem.logical_shape(role), device="cuda").to(dtype) for role in "qkv"}
    bias = problem.bias
    mask = torch.randn(bias.shape, device="cuda") if mask is None else mask
    tensors["mask"] = mask.to(getattr(torch, TORCH_DTYPES[bias.dtype]))
    return tensors


def _run(kernel, problem: AttentionProblem, tensors: dict, torch):
    """The kernel's output (poisoned with NaN first) and SDPA's in float32 on the same mask."""
    out = torch.full(problem.layout("o").shape, math.nan, device="cuda", dtype=tensors["q"].dtype)
    kernel(tensors["q"], tensors["k"], tensors["v"], out, tensors["mask"])
    torch.cuda.synchronize()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from cherenkov.search.measure import sdpa_masking

    group = problem.group_size
    q, k, v = (tensors[role].float() for role in "qkv")
    # the causal edge (query i sees keys j <= i) or the window hides scores beside the bias
    mask, _ = sdpa_masking(problem, mask_view(problem, tensors["mask"]).float(), q, k, fold_causal=True)

    with sdpa_kernel(SDPBackend.MATH):  # its safe softmax: a row without a live score is 0
        reference = torch.nn.functional.scaled_dot_product_attention(
            q, k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1), attn_mask=mask
        )
    return out, reference


def _failures(plans: list[KernelPlan], torch, mask_of=None) -> list:
    failures = []
    for plan, result in zip(plans, compile_plans(plans)):
        assert not isinstance(result, CompileError), f"{plan.name}: {result}"
        tensors = _inputs(plan.problem, torch, mask_of(plan.problem, torch) if mask_of else None)
        out, reference = _run(load_kernel(result), plan.problem, tensors, torch)
        error = float((out.float() - reference).norm() / reference.norm())  # NaN (unwritten) fails
        if not error <= TOLERANCE:
            failures.append((plan.name, plan.target.name, error, int(out.isnan().sum())))
    return failures


def _targets(torch) -> tuple[str, ...]:
    return ("sm_90",) + (("sm_90a",) if torch.cuda.get_device_capability() == (9, 0) else ())


@pytest.mark.gpu
def test_gpu_masked_flash_attention_matches_sdpa(gpu) -> None:
    failures = _failures(chosen_plans(_targets(gpu)), gpu)
    assert not failures, failures


def _hidden_rows(lowest: float):
    """A mask hiding every key from the first 40 query rows and 30 % of the keys elsewhere
    with ``lowest``; a standard-normal bias on the rest."""
    def mask(problem: AttentionProblem, torch):
        shape = problem.bias.shape
        hidden = torch.rand(shape, device="cuda") < 0.3
        hidden[:, :, :40, :] = True
        return torch.where(hidden, lowest, torch.randn(shape, device="cuda"))

    return mask


@pytest.mark.gpu
@pytest.mark.parametrize("lowest", [-math.inf, -3.3895313892515355e38])  # -inf; bf16's lowest finite value
def test_gpu_rows_the_mask_hides_entirely_follow_pytorch(gpu, lowest: float) -> None:
    """With -inf those rows are 0 (SDPA's safe softmax); with a finite lowest value, the
    average of their keys (PyTorch's math)."""
    plans = [plan for target in _targets(gpu) for name in ("fp16_ragged", "shared_bias")
             for plan in representative(PROBLEMS[name], target)]  # fmt: skip
    failures = _failures(plans, gpu, mask_of=_hidden_rows(lowest))
    assert not failures, failures
