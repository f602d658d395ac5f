"""Measuring candidates in worker processes that may die without taking the search down.

One worker process per GPU loads a compiled kernel, runs it on fresh random inputs into
a NaN-poisoned output, checks it against a float32 PyTorch reference, and only then
times it with CUDA events (warm-up, L2 flushed before every sample, median of many).
Flash-attention candidates are checked against PyTorch's SDPA, backward candidates each of
their gradients against float32 autograd through SDPA's math path; every other kernel (a
:class:`~cherenkov.codegen.term_plan.TermKernelPlan`) against its own term evaluated by
:mod:`cherenkov.search.torch_eval` on the same random inputs (one per tensor it reads) —
in float32 for bf16/fp16 outputs (relative L2 error ≤ 2e-2), in float64 for fp32 outputs
(≤ 1e-5, so that the reference's own rounding does not eat the margin). A
candidate that crashes the worker (an illegal address poisons the CUDA context), hangs
past the timeout, or is wrong is recorded with its reason; the worker is replaced and
the search goes on. The parent never imports torch or cupy.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import queue
import sys
import threading
import time
import traceback
import types
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, replace
from multiprocessing.connection import Connection
from typing import Any

from cherenkov.codegen.launch import TORCH_DTYPES, mask_view, operand_view
from cherenkov.codegen.plan import CompiledKernel
from cherenkov.codegen.term_plan import TermKernelPlan
from cherenkov.rewrites.plan import AttentionProblem
from cherenkov.rewrites.plan_backward import AttentionBackwardProblem, BackwardPlan

log = logging.getLogger(__name__)

TOLERANCE = {"bf16": 2e-2, "fp16": 1e-2, "fp8_e4m3": 5e-2}
"""Relative error of a flash kernel against float32 attention on the same stored operands (8-bit:
the probabilities are rounded to e4m3 for the PV product)."""
TERM_TOLERANCE = {"bf16": 2e-2, "fp16": 2e-2, "fp32": 1e-5, "int32": 1e-5, "bool": 1e-5}
SAMPLES = 30
WARMUP = 3
EARLY_STOP_AFTER = 5
EARLY_STOP_FACTOR = 1.3
SPIN_CYCLES = 400_000
"""~0.2 ms of GPU spin queued before each sample's start event: the host enqueues the launch
while the GPU spins, so a sample is device time (what a CUDA-graph replay runs), not the
launcher's host cost (ctypes ``cuLaunchKernel`` with tensor maps costs more than cupy's
launch, which ranked short Hopper kernels below slower ``mma.sync`` ones)."""
FLUSHES = ("read", "zero")
STARTUP_TIMEOUT_S = 180.0
CANDIDATE_TIMEOUT_S = 30.0
UNREACHABLE_EXIT_S = 10.0  # how long a worker that closed its end gets to exit before it is killed
SDPA_BACKENDS = {"sdpa_flash": "FLASH_ATTENTION", "sdpa_cudnn": "CUDNN_ATTENTION", "sdpa_efficient": "EFFICIENT_ATTENTION"}


@dataclass(frozen=True)
class MeasureTask:
    """Verify then time one compiled candidate; ``group`` (the kernel it implements) scopes
    the best time that stops clearly slower candidates early; ``credit_ms``: the time the
    candidate saves elsewhere (the producer kernel it absorbs), counted off its own before
    it is compared."""

    candidate: str
    compiled: CompiledKernel
    best_ms: float | None = None
    samples: int = SAMPLES
    seed: int = 0
    group: str = ""
    credit_ms: float = 0.0


@dataclass(frozen=True)
class Measurement:
    """What a worker found: ``status`` ok / stopped_early / wrong / crash / timeout."""

    candidate: str
    status: str
    reason: str | None = None
    rel_error: float | None = None
    times_ms: tuple[float, ...] = ()


# --------------------------------------------------------------------- in the worker


def _inputs(problem: AttentionProblem, seed: int, device: int) -> dict[str, Any]:
    """Standard-normal stored tensors of q, k and v (one for a name they share) and of the
    bias, by name."""
    import torch

    generator = torch.Generator(device=f"cuda:{device}").manual_seed(seed)
    dtype = getattr(torch, TORCH_DTYPES[problem.dtype])
    stored = {}
    for role in ("q", "k", "v"):
        name = problem.name(role)
        if name not in stored:
            shape = problem.layout(role).shape
            stored[name] = torch.randn(shape, generator=generator, device=f"cuda:{device}").to(dtype)
    bias = problem.bias
    if bias is not None:
        values = torch.randn(bias.shape, generator=generator, device=f"cuda:{device}")
        stored[bias.tensor] = values.to(getattr(torch, TORCH_DTYPES[bias.dtype]))
    for factor in problem.factors:  # descales: positive, around 1
        values = torch.rand(factor.shape, generator=generator, device=f"cuda:{device}")
        stored[factor.tensor] = 0.5 + values
    return stored


def factor_products(problem: AttentionProblem, stored: Mapping[str, Any]) -> tuple[Any, Any]:
    """The products of the score factors and of the output factors for each (batch, query
    head), shaped ``(B, H, 1, 1)`` (float32)."""
    import torch

    device = next(iter(stored.values())).device
    b = torch.arange(problem.batch, device=device).view(-1, 1)
    h = torch.arange(problem.heads, device=device).view(1, -1)

    def product(factors) -> Any:
        total = torch.ones(problem.batch, problem.heads, device=device)
        for f in factors:
            index = f.offset + b * f.batch + torch.div(h, f.group, rounding_mode="floor") * f.head
            total = total * stored[f.tensor].reshape(-1).float()[index]
        return total.view(problem.batch, problem.heads, 1, 1)

    return product(problem.score_factors), product(problem.out_factors)


def _sdpa_mask(problem: AttentionProblem, stored: Mapping[str, Any], dtype: Any) -> Any:
    """The problem's bias as SDPA's ``attn_mask``, in ``dtype`` (None without a bias)."""
    if problem.bias is None:
        return None
    return mask_view(problem, stored[problem.bias.tensor]).to(dtype)


def hidden_scores(problem: AttentionProblem, rows: int, keys: int, device: Any) -> Any:
    """The scores a problem's causal mask or window hides, a ``(rows, keys)`` bool tensor: keys after
    the query (more than ``window_ahead`` after it), and with a window, keys at least ``window``
    before it."""
    import torch

    ones = torch.ones(rows, keys, dtype=torch.bool, device=device)
    above = ones.triu(1 + problem.window_ahead)
    return above | ones.tril(-problem.window) if problem.window else above


def sdpa_masking(problem: AttentionProblem, mask: Any, q: Any, k: Any, fold_causal: bool = False) -> tuple[Any, bool]:
    """SDPA's ``(attn_mask, is_causal)`` for a problem with the additive ``mask`` (None: none) on BHSD
    ``q`` and ``k``: the causal edge and any window folded into a mask (of q's dtype where there was
    none) where SDPA's causal flag cannot stand for them (it takes a mask or the flag, and no window;
    ``fold_causal``: always), else the flag."""
    import torch

    if not (problem.window or problem.causal and (mask is not None or fold_causal)):
        return mask, problem.causal
    hidden = hidden_scores(problem, q.shape[-2], k.shape[-2], q.device)
    base = torch.zeros(hidden.shape, dtype=q.dtype, device=q.device) if mask is None else mask
    return base.masked_fill(hidden, -torch.inf), False


def float32_attention(problem: AttentionProblem, q: Any, k: Any, v: Any, mask: Any = None,
                      backends: tuple[str, ...] = ("EFFICIENT_ATTENTION", "MATH")) -> Any:  # fmt: skip
    """softmax(scale·q kᵀ [soft-capped] [+ mask] [causal] [window]) v in float32 from BHSD views
    (``mask``: SDPA's additive one): SDPA on ``backends``, the causal edge and any window as
    :func:`sdpa_masking` folds them; with a soft cap, which SDPA lacks, the scores materialised."""
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    scale = problem.scale or problem.head_dim**-0.5
    q, k, v = q.float(), k.float(), v.float()
    if problem.softcap:
        mask, _ = sdpa_masking(problem, mask, q, k, fold_causal=True)
        if problem.group_size > 1:
            k, v = (x.repeat_interleave(problem.group_size, dim=1) for x in (k, v))
        scores = problem.softcap * torch.tanh((q @ k.transpose(-1, -2)) * (scale / problem.softcap))
        return torch.softmax(scores if mask is None else scores + mask, dim=-1) @ v
    mask, causal = sdpa_masking(problem, mask, q, k)
    grouped = problem.group_size > 1
    if grouped and problem.window and problem.bias is None:
        # SDPA's memory-efficient kernel takes the band only with K/V repeated (its math path would
        # hold every head's scores: 64 GiB for Mistral's 16k), and each row sees its own key
        k, v = (x.repeat_interleave(problem.group_size, dim=1) for x in (k, v))
        grouped = False
    with sdpa_kernel([getattr(SDPBackend, b) for b in backends]):
        return torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=grouped,
        )


def _reference(problem: AttentionProblem, q: Any, k: Any, v: Any, mask: Any = None,
               factors: tuple[Any, Any] | None = None) -> Any:  # fmt: skip
    """g·softmax(q kᵀ·scale·f [soft-capped] [+ bias]) v in float32 (:func:`float32_attention`);
    ``factors`` are (f, g) per batch and head (:func:`factor_products`), 1 without."""
    score_factor, out_factor = factors if factors is not None else (1.0, 1.0)
    return out_factor * float32_attention(problem, q.float() * score_factor, k, v, mask)


class L2Flush:
    """What runs before every timed sample: a buffer twice the L2's size read whole (a sum
    into a scalar), which evicts everything a kernel left in L2 and leaves no dirty lines —
    or, ``how="zero"`` (the method before 2026-12-03, kept to reproduce its figures), zeroed,
    which leaves ~2× L2 of dirty lines whose write-back then runs during the sample: on the
    H200 about 8 µs of DRAM time charged to the timed kernel (decode B1 with 64k keys read
    K/V at 3.52 TB/s after a zeroing flush, 3.99 after a reading one)."""

    def __init__(self, torch: Any, device: int | None = None, how: str = "read") -> None:
        if how not in FLUSHES:
            raise ValueError(f"L2 flush {how!r}: one of {FLUSHES}")
        device = torch.cuda.current_device() if device is None else device
        words = torch.cuda.get_device_properties(device).L2_cache_size // 2  # 2x L2 in 4-byte words
        self.how = how
        self.torch = torch
        self.buffer = torch.zeros(words, dtype=torch.int32, device=f"cuda:{device}")
        self.sink = torch.empty((), dtype=torch.int64, device=f"cuda:{device}")

    def __call__(self) -> None:
        if self.how == "zero":
            self.buffer.zero_()
        else:
            self.torch.sum(self.buffer, dim=(0,), out=self.sink)


def _time(launch: Callable[[], Any], flush: L2Flush, samples: int, best_ms: float | None,
          credit_ms: float = 0.0) -> tuple[list[float], bool]:  # fmt: skip
    """CUDA-event device times of ``launch``, L2 flushed before each (and the GPU kept busy
    while the host launches: :data:`SPIN_CYCLES`); stops early when clearly slower than
    ``best_ms`` after its first samples (net of ``credit_ms``)."""
    import torch

    for _ in range(WARMUP):
        launch()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times: list[float] = []
    for sample in range(samples):
        flush()
        torch.cuda._sleep(SPIN_CYCLES)
        start.record()
        launch()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
        if best_ms and sample + 1 == EARLY_STOP_AFTER and min(times) - credit_ms > EARLY_STOP_FACTOR * best_ms:
            return times, True
    return times, False


def term_inputs(plan: TermKernelPlan, seed: int, device: str) -> dict[str, Any]:
    """One random tensor per tensor the kernel reads (standard normal; int32 in [-8, 8),
    bool fair coins), of its dtype and shape, on ``device`` (e.g. ``"cuda:0"``)."""
    import torch

    from cherenkov.codegen.launch import TORCH_DTYPES

    generator = torch.Generator(device=device).manual_seed(seed)
    inputs = {}
    for info in plan.inputs:
        if info.dtype == "int32":
            x = torch.randint(-8, 8, info.shape, generator=generator, device=device, dtype=torch.int32)
        elif info.dtype == "bool":
            x = torch.rand(info.shape, generator=generator, device=device) < 0.5
        else:
            x = torch.randn(info.shape, generator=generator, device=device, dtype=torch.float32)
            x = x.to(getattr(torch, TORCH_DTYPES[info.dtype]))
        inputs[info.name] = x
    return inputs


def term_error(out: Any, reference: Any) -> tuple[float, str | None]:
    """Relative L2 error of ``out`` against ``reference`` over the reference's finite
    elements, and why it fails regardless of the error (None if it does not): a NaN or
    infinity where the reference is finite, or a non-finite reference value not matched."""
    import torch

    out = out.to(reference.dtype)
    finite = torch.isfinite(reference)
    bad = int((~torch.isfinite(out) & finite).sum())
    if bad:
        return float("nan"), f"{bad} output elements NaN or infinite where the reference is finite (unwritten or invalid)"
    special = ~finite
    matched = (torch.isnan(reference) & torch.isnan(out)) | (reference == out)
    mismatched = int((special & ~matched).sum())
    if mismatched:
        return float("nan"), f"{mismatched} non-finite reference elements not matched"
    diff = (out - reference)[finite]
    norm = reference[finite].norm()
    error = float(diff.norm() / norm) if float(norm) > 0 else float(diff.norm())
    return error, None


def verify_term(launch: Callable[[dict[str, Any], Any], Any], plan: TermKernelPlan, seed: int,
                device: str) -> tuple[float, str | None, dict[str, Any], Any]:  # fmt: skip
    """Run ``launch(inputs, out)`` on fresh random inputs into a poisoned output and compare
    with the term's torch reference: ``(error, failure or None, inputs, out)``. The
    reference runs in float32 for floating outputs, without TF32 in a measuring worker (an fp32
    one: the graph's own arithmetic, as eager runs it; in float64, the cosine of an fp32 product
    of positions and frequencies, RoPE's, differs from it by the argument's fp32 rounding, ~3e-5
    at position 512) and in float64 for integer and bool ones."""
    import torch

    from cherenkov.codegen.launch import TORCH_DTYPES
    from cherenkov.search.torch_eval import evaluate_kernel_torch

    inputs = term_inputs(plan, seed, device)
    dtype = getattr(torch, TORCH_DTYPES[plan.output.dtype])
    poison = float("nan") if plan.output.dtype in ("bf16", "fp16", "fp32") else -12345
    out = torch.full(plan.output.shape, poison, dtype=dtype, device=device)
    out = launch(inputs, out)
    if out.is_cuda:
        torch.cuda.synchronize(out.device)
    working = torch.float32 if plan.output.dtype in ("bf16", "fp16", "fp32") else torch.float64
    reference = evaluate_kernel_torch(plan.kernel, {n: x.to(working) for n, x in inputs.items()}, working)
    error, failure = term_error(out, reference)
    return error, failure, inputs, out


def _measure_term(task: MeasureTask, device: int, flush: L2Flush) -> Measurement:
    from cherenkov.codegen.launch import load_kernel

    plan = task.compiled.plan
    kernel = load_kernel(task.compiled, device)
    error, failure, inputs, out = verify_term(kernel.launch, plan, task.seed, f"cuda:{device}")
    tolerance = TERM_TOLERANCE[plan.output.dtype]
    if failure is not None or not error <= tolerance:  # NaN fails too
        reason = failure or f"relative error {error:.3g} > {tolerance}"
        return Measurement(task.candidate, "wrong", reason, error if error == error else None)
    run, _ = kernel.bind(inputs, out)
    times, stopped = _time(run, flush, task.samples, task.best_ms, task.credit_ms)
    reason = f"slower than {EARLY_STOP_FACTOR}x the best after {len(times)} samples" if stopped else None
    return Measurement(task.candidate, "stopped_early" if stopped else "ok", reason, error, tuple(times))


def _strided(tensor: Any, layout: Any, shape: tuple[int, int, int, int]) -> Any:
    """The ``(B, H, S, D)`` view of an operand in its stored tensor (its layout's strides)."""
    import torch

    return torch.as_strided(tensor, shape, (*layout.strides(), 1), layout.offset)


def backward_reference(problem: AttentionBackwardProblem, stored: Mapping[str, Any]) -> dict[str, Any]:
    """The problem's gradients by float32 autograd through PyTorch's math attention (plus its bias
    tensor, a constant; soft-capped where the problem is), by role."""
    import torch

    a = problem.attention
    leaves = {role: operand_view(a, role, stored[a.name(role)]).float().detach().requires_grad_(True) for role in "qkv"}
    grad_output = _strided(stored[problem.grad_output], problem.grad_output_layout, a.logical_shape("o")).float()
    mask = _sdpa_mask(a, stored, torch.float32)
    with torch.enable_grad():
        o = float32_attention(a, leaves["q"], leaves["k"], leaves["v"], mask, backends=("MATH",))
        grads = torch.autograd.grad(o, [leaves[r] for r in "qkv"], grad_output)
    return dict(zip(("dq", "dk", "dv"), grads))


def attention_statistics(a: AttentionProblem, q: Any, k: Any, v: Any, mask: Any = None,
                         with_output: bool = True) -> tuple[Any, Any]:  # fmt: skip
    """The attention's output (``with_output``; else None) and each query row's log-sum-exp of the
    scaled (soft-capped), masked scores, in float32, from BHSD views of q, k, v (and ``mask``, SDPA's additive
    one): one head's scores at a time (the seed shape's are 128 MB each)."""
    import torch

    q, k, v = q.float(), k.float(), v.float()
    if a.group_size > 1:
        k, v = (x.repeat_interleave(a.group_size, dim=1) for x in (k, v))
    scale = a.scale or a.head_dim**-0.5
    lse = torch.empty(a.logical_shape("q")[:3], dtype=torch.float32, device=q.device)
    out = torch.empty((*a.logical_shape("q")[:3], a.v_dim), dtype=torch.float32, device=q.device) if with_output \
        else None
    for b in range(a.batch):
        for h in range(a.heads):
            scores = (q[b, h] @ k[b, h].T) * scale
            if a.softcap:
                scores = a.softcap * torch.tanh(scores / a.softcap)
            if mask is not None:
                scores += mask[b, h].float()
            if a.causal or a.window:
                scores.masked_fill_(hidden_scores(a, *scores.shape, scores.device), -torch.inf)
            lse[b, h] = torch.logsumexp(scores, dim=-1)
            if out is not None:
                out[b, h] = torch.softmax(scores, dim=-1) @ v[b, h]
    return out, lse


def _lse_view(tensor: Any, layout: Any, shape: tuple[int, int, int]) -> Any:
    """The ``(B, H, S)`` view of a log-sum-exp output in its stored tensor."""
    import torch

    return torch.as_strided(tensor, shape, layout.strides(), layout.offset)


def fill_saved_statistics(problem: AttentionBackwardProblem, stored: Mapping[str, Any]) -> None:
    """Write the forward's output and rows' log-sum-exp (float32 math, then the stored dtypes) into
    the problem's saved ``o`` and ``lse`` tensors in ``stored``, from its q, k and v there: the inputs
    a saved-statistics backward reads are then those its forward would have saved."""
    a, saved = problem.attention, problem.saved
    out, lse = attention_statistics(a, *(operand_view(a, role, stored[a.name(role)]) for role in "qkv"))
    _strided(stored[saved.o], saved.o_layout, a.logical_shape("o")).copy_(out)
    _lse_view(stored[saved.lse], saved.lse_layout, a.logical_shape("q")[:3]).copy_(lse)


def _measure_backward(task: MeasureTask, device: int, flush: L2Flush) -> Measurement:
    """Verify a flash-attention backward plan's every gradient against float32 autograd, then time it."""
    import torch

    from cherenkov.codegen.launch import load_kernel

    problem = task.compiled.plan.problem
    a = problem.attention
    kernel = load_kernel(task.compiled, device)
    generator = torch.Generator(device=f"cuda:{device}").manual_seed(task.seed)
    dtype = getattr(torch, TORCH_DTYPES[a.dtype])
    dtypes = {a.bias.tensor: getattr(torch, TORCH_DTYPES[a.bias.dtype])} if a.bias is not None else {}
    stored = {name: torch.randn(shape, generator=generator, device=f"cuda:{device}").to(dtypes.get(name, dtype))
              for name, shape in problem.stored_shapes().items()}  # fmt: skip
    out = {g.role: torch.full(g.layout.shape, float("nan"), dtype=dtype, device=f"cuda:{device}")
           for g in problem.gradients}  # fmt: skip
    q, k, v, grad_output = (stored[n] for n in (a.q, a.k, a.v, problem.grad_output))
    keywords = {}  # the saved statistics, the bias tensor
    if task.compiled.plan.schedule.saved_statistics:
        stored[problem.saved.lse] = stored[problem.saved.lse].float()
        fill_saved_statistics(problem, stored)
        keywords = {"o": stored[problem.saved.o], "lse": stored[problem.saved.lse]}
    if a.bias is not None:
        keywords["bias"] = stored[a.bias.tensor]
    kernel(q, k, v, grad_output, out, **keywords)
    torch.cuda.synchronize()
    reference = backward_reference(problem, stored)
    errors = {}
    for gradient in problem.gradients:
        shape = a.logical_shape("q" if gradient.role == "dq" else "k")
        got = _strided(out[gradient.role], gradient.layout, shape).float()
        expected = reference[gradient.role]
        errors[gradient.role] = float((got - expected).norm() / expected.norm())
    error = max(errors.values())
    if not error <= TOLERANCE[a.dtype]:  # NaN fails too
        reason = "relative errors " + ", ".join(f"{role} {e:.3g}" for role, e in errors.items())
        return Measurement(task.candidate, "wrong", reason + f" (tolerance {TOLERANCE[a.dtype]})", error)
    times, stopped = _time(lambda: kernel(q, k, v, grad_output, out, **keywords), flush, task.samples, task.best_ms)
    reason = f"slower than {EARLY_STOP_FACTOR}x the best after {len(times)} samples" if stopped else None
    return Measurement(task.candidate, "stopped_early" if stopped else "ok", reason, error, tuple(times))


def _measure(task: MeasureTask, device: int, flush: L2Flush) -> Measurement:
    import torch

    from cherenkov.codegen.launch import load_kernel

    if isinstance(task.compiled.plan, TermKernelPlan):
        return _measure_term(task, device, flush)
    if isinstance(task.compiled.plan, BackwardPlan):
        return _measure_backward(task, device, flush)
    problem = task.compiled.plan.problem
    kernel = load_kernel(task.compiled, device)
    stored = _inputs(problem, task.seed, device)
    q, k, v = (stored[problem.name(role)] for role in ("q", "k", "v"))
    bias = stored[problem.bias.tensor] if problem.bias is not None else None
    out_dtype = getattr(torch, TORCH_DTYPES[problem.output_dtype])
    out = torch.full(problem.layout("o").shape, float("nan"), dtype=out_dtype, device=q.device)
    extra = {"factors": tuple(stored[f.tensor] for f in problem.factors)} if problem.factors else {}
    if problem.lse is not None:
        extra["lse"] = torch.full(problem.lse.layout.shape, float("nan"), dtype=torch.float32, device=q.device)
    kernel(q, k, v, out, bias, **extra)
    torch.cuda.synchronize()
    views = [operand_view(problem, role, stored[problem.name(role)]) for role in "qkv"]
    reference = _reference(problem, *views, _sdpa_mask(problem, stored, torch.float32),
                           factor_products(problem, stored) if problem.factors else None)  # fmt: skip
    got = operand_view(problem, "o", out)
    error = float((got.float() - reference).norm() / reference.norm())
    if not error <= TOLERANCE[problem.dtype]:  # NaN fails too
        unwritten = int(torch.isnan(got).sum())
        reason = f"relative error {error:.3g} > {TOLERANCE[problem.dtype]}" + (
            f"; {unwritten} output elements NaN (unwritten or invalid)" if unwritten else ""
        )
        return Measurement(task.candidate, "wrong", reason, error)
    if problem.lse is not None:
        _, expected = attention_statistics(problem, *views, _sdpa_mask(problem, stored, torch.float32), False)
        lse_error = lse_difference(_lse_view(extra["lse"], problem.lse.layout, problem.logical_shape("q")[:3]),
                                   expected)  # fmt: skip
        if not lse_error <= LSE_TOLERANCE:
            return Measurement(task.candidate, "wrong", f"log-sum-exp off by {lse_error:.3g} > {LSE_TOLERANCE}", error)
    times, stopped = _time(lambda: kernel(q, k, v, out, bias, **extra), flush, task.samples, task.best_ms)
    reason = f"slower than {EARLY_STOP_FACTOR}x the best after {len(times)} samples" if stopped else None
    return Measurement(task.candidate, "stopped_early" if stopped else "ok", reason, error, tuple(times))


LSE_TOLERANCE = 1e-2
"""Largest absolute difference of a kernel's log-sum-exp from the float32 one: P = e^(s − LSE) then
differs by at most 1 %, half the gradients' 2e-2. Schedules that pre-scale Q round q·c to 16 bits,
which moves a score s by up to ~|s|·2⁻⁹ (3.4e-3 measured on the H200 with Gaussian inputs), so
1e-3 would reject correct kernels; a wrong row, base or scale is off by far more. A NaN, or an
infinity where the reference has none, fails."""


def lse_difference(got: Any, expected: Any) -> float:
    """The largest absolute difference of two log-sum-exps (rows of −∞ must agree exactly)."""
    import torch

    finite = torch.isfinite(expected)
    if bool((got[~finite] != expected[~finite]).any()) or bool(torch.isnan(got).any()):
        return float("nan")
    return float((got[finite] - expected[finite]).abs().max()) if bool(finite.any()) else 0.0


def _references(problem: AttentionProblem, device: int, flush: L2Flush) -> dict[str, float]:
    """Median milliseconds of PyTorch's SDPA backends on the same problem."""
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if problem.factors or problem.dtype not in ("bf16", "fp16"):
        return {}  # SDPA takes no 8-bit operands
    stored = _inputs(problem, 0, device)
    q, k, v = (operand_view(problem, role, stored[problem.name(role)]).contiguous() for role in "qkv")
    mask, causal = sdpa_masking(problem, _sdpa_mask(problem, stored, q.dtype), q, k)
    result = {}
    for name, backend in SDPA_BACKENDS.items():
        def launch(backend=backend):
            with sdpa_kernel(getattr(SDPBackend, backend)):
                return torch.nn.functional.scaled_dot_product_attention(
                    q, k, v, attn_mask=mask, is_causal=causal, scale=problem.scale,
                    enable_gqa=problem.group_size > 1,
                )
        try:
            times, _ = _time(launch, flush, SAMPLES, None)
        except RuntimeError as error:  # a backend that does not support this problem
            log.info("%s unavailable: %s", name, str(error).splitlines()[0])
            continue
        result[name] = sorted(times)[len(times) // 2]
    return result


def worker_main(conn: Connection, device: int) -> None:
    """Serve measurement requests on ``conn`` until told to stop (runs in the child)."""
    import torch

    torch.cuda.set_device(device)
    # the float32 references are IEEE float32, whatever the environment asks of cuBLAS (TF32 would
    # move a matmul's reference by ~1e-3, past an fp32 term's tolerance)
    torch.set_float32_matmul_precision("highest")
    flush = L2Flush(torch, device)
    conn.send(("ready", torch.cuda.get_device_name(device)))
    while True:
        kind, payload = conn.recv()
        if kind == "stop":
            return
        try:
            answer = _measure(payload, device, flush) if kind == "measure" else _references(payload, device, flush)
        except Exception as error:  # noqa: BLE001 - everything a kernel can do wrong is reported
            message = f"{type(error).__name__}: {error}".splitlines()[0]
            if "CUDA" in message or isinstance(error, torch.cuda.OutOfMemoryError):
                # the CUDA context is poisoned: say so, leave at once (finalisers would only fail
                # again) and let the parent start a fresh worker
                conn.send(("fatal", message))
                conn.close()
                os._exit(70)
            conn.send(("error", message))
            log.debug("worker error: %s", traceback.format_exc())
            continue
        conn.send((kind, answer))


# --------------------------------------------------------------------- in the parent


@contextlib.contextmanager
def _main_script_hidden(target: Callable) -> Iterator[None]:
    """While a worker process starts: ``__main__`` replaced by an empty module, unless ``target`` is defined
    there. A spawned child imports the parent's ``__main__`` again; a user's script that calls ``ck.compile``
    at its top level (no ``if __name__ == "__main__"`` guard) would run again in the child and fail there
    ("before the current process has finished its bootstrapping phase"). A target from an importable module
    needs nothing of that script."""
    if getattr(target, "__module__", None) == "__main__":
        yield
        return
    main = sys.modules["__main__"]
    sys.modules["__main__"] = types.ModuleType("__main__")
    try:
        yield
    finally:
        sys.modules["__main__"] = main


class _Worker:
    """A worker process bound to one GPU, serving requests with ``target`` (:func:`worker_main`)."""

    def __init__(self, device: int, target: Callable[[Connection, int], None] = worker_main) -> None:
        context = multiprocessing.get_context("spawn")
        self.device = device
        self.conn, child = context.Pipe()
        self.process = context.Process(target=target, args=(child, device), daemon=True)
        with _main_script_hidden(target):
            self.process.start()
        child.close()
        if not self.conn.poll(STARTUP_TIMEOUT_S):
            self.kill()
            raise RuntimeError(f"measurement worker on GPU {device} did not start in {STARTUP_TIMEOUT_S:.0f} s")
        try:
            _, self.gpu_name = self.conn.recv()
        except (EOFError, OSError):
            self.process.join(5)
            raise RuntimeError(f"measurement worker on GPU {device} exited as it started (exit code "
                               f"{self.process.exitcode}); its error is above") from None

    def request(self, kind: str, payload: Any, timeout_s: float) -> tuple[str, Any]:
        """Send one request; ("timeout", seconds) or ("crash", reason) when it goes wrong (a worker
        that answers "fatal", its CUDA context poisoned, is gone once this returns), and
        ("unreachable", reason) when the worker had already closed its end: the request never ran,
        and the process is gone once this returns."""
        try:
            self.conn.send((kind, payload))
        except (BrokenPipeError, OSError) as error:
            self.process.join(UNREACHABLE_EXIT_S)
            if self.alive:
                self.kill()
            return "unreachable", f"worker unreachable: {error}"
        if not self.conn.poll(timeout_s):
            self.kill()
            return "timeout", f"no answer within {timeout_s:.0f} s (a kernel that never finishes)"
        try:
            answer = self.conn.recv()
        except (EOFError, OSError):
            self.process.join(5)
            return "crash", f"worker process died (exit code {self.process.exitcode})"
        if answer[0] == "fatal":  # the worker is leaving: wait for it, so that the next request starts a fresh one
            self.process.join(UNREACHABLE_EXIT_S)
            if self.alive:
                self.kill()
            return "crash", answer[1]
        return answer

    @property
    def alive(self) -> bool:
        return self.process.is_alive()

    def kill(self) -> None:
        self.process.kill()
        self.process.join(10)

    def stop(self) -> None:
        if self.alive:
            try:
                self.conn.send(("stop", None))
            except (BrokenPipeError, OSError):
                pass
            self.process.join(10)
        if self.alive:
            self.kill()


class MeasurementPool:
    """One worker per GPU; tasks run concurrently across GPUs, one at a time per GPU."""

    def __init__(self, devices: Iterable[int] = (0,), timeout_s: float = CANDIDATE_TIMEOUT_S,
                 worker: Callable[[Connection, int], None] = worker_main) -> None:  # fmt: skip
        self.devices = tuple(devices)
        self.timeout_s = timeout_s
        self.worker = worker  # what each worker process runs
        self._workers: dict[int, _Worker] = {}
        self._lock = threading.Lock()
        self.best_ms: dict[str, float] = {}  # per task group (kernel)

    def _worker(self, device: int) -> _Worker:
        worker = self._workers.get(device)
        if worker is None or not worker.alive:
            worker = self._workers[device] = _Worker(device, self.worker)
        return worker

    def gpu_name(self) -> str:
        return self._worker(self.devices[0]).gpu_name

    def measure(self, task: MeasureTask, device: int | None = None) -> Measurement:
        """Verify and time one candidate; failures come back as a Measurement too."""
        device = self.devices[0] if device is None else device
        kind, answer = self._request(device, "measure", task, self.timeout_s)
        if kind == "measure":
            if answer.status == "ok":
                median = sorted(answer.times_ms)[len(answer.times_ms) // 2]
                with self._lock:
                    best, net = self.best_ms.get(task.group), median - task.credit_ms
                    self.best_ms[task.group] = net if best is None else min(best, net)
            return answer
        status = {"timeout": "timeout", "crash": "crash"}.get(kind, "crash")
        return Measurement(task.candidate, status, str(answer))

    def measure_all(
        self, tasks: list[MeasureTask], on_result: Callable[[Measurement], None] | None = None,
        deadline: float | None = None,
    ) -> dict[str, Measurement]:
        """Measure every task (spread over the GPUs) until ``deadline`` (time.monotonic)."""
        pending: queue.Queue[MeasureTask] = queue.Queue()
        for task in tasks:
            pending.put(task)
        results: dict[str, Measurement] = {}

        def drain(device: int) -> None:
            while deadline is None or time.monotonic() < deadline:
                try:
                    task = pending.get_nowait()
                except queue.Empty:
                    return
                with self._lock:
                    best = self.best_ms.get(task.group)
                try:
                    result = self.measure(replace(task, best_ms=best), device)
                except Exception as error:  # noqa: BLE001 - a worker that cannot even start
                    result = Measurement(task.candidate, "crash", f"measurement failed: {error}")
                with self._lock:
                    results[task.candidate] = result
                if on_result is not None:
                    on_result(result)

        threads = [threading.Thread(target=drain, args=(d,), daemon=True) for d in self.devices]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        return results

    def references(self, problem: AttentionProblem) -> dict[str, float]:
        """Median ms of PyTorch's SDPA backends on ``problem`` (on the first GPU)."""
        kind, answer = self._request(self.devices[0], "references", problem, 10 * self.timeout_s)
        return answer if kind == "references" else {}

    def _request(self, device: int, kind: str, payload: Any, timeout_s: float) -> tuple[str, Any]:
        """One request to the device's worker; where that worker had already closed its end (the
        last request poisoned its CUDA context), once more to a fresh one: this request never ran."""
        answer = self._worker(device).request(kind, payload, timeout_s)
        if answer[0] == "unreachable":
            log.info("GPU %d: %s; starting a fresh worker", device, answer[1])
            answer = self._worker(device).request(kind, payload, timeout_s)
        return answer

    def close(self) -> None:
        for worker in self._workers.values():
            worker.stop()
        self._workers.clear()

    def __enter__(self) -> MeasurementPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
