"""cherenkov's searched flash attention against PyTorch SDPA's backends, in one process.

For each shape (``SHAPES``: issue 6's, issue 22's decode, short-query, head-dim, ``D_V ≠
D`` and fp16 rows, Stable Diffusion 1.5's self-attention at head dims 40 and 160, two causal sliding windows, which SDPA takes as a band mask and
FlashAttention-4 as its ``window_size``, and a causal chunk after cached keys, a band for SDPA and FlashAttention-4's
own causal mask; the default runs issue 6's), this builds the textbook attention graph of
``examples/attention.py`` (loaded by path), runs ``ck.optimize`` on it (a fresh search
with a per-shape time budget, measured on the local GPU; a private tuning database so that
nothing stale answers), checks the graph's output against SDPA in float32 (relative error
≤ 2e-2, output poisoned with NaN first), then times it and SDPA's flash, cuDNN and
memory-efficient backends — and FlashAttention-4 where its wheels are installed
(``../shared/device/fa4-wheels.sh``) — on the same inputs: CUDA events, L2 flushed before
every sample (``--flush``: by reading a buffer, so no dirty lines are written back during
the sample; see ``timing.py``), samples of all of them interleaved round-robin (so clock drift hits all
alike), median of ``--samples``. A shape whose search found no flash plan runs (and is
timed) through the unfused kernels as a CUDA graph, and says so (``cherenkov_kernels``).
Prints a table (TFLOP/s, ratios) and writes ``<out>/<gpu>-<date><suffix>.json`` (``h200-…``; ``gpu``,
``date``, ``versions``, ``copy_tbps`` — a device-to-device copy's bytes read and written a
second, the bandwidth a memory-bound row can reach — and ``rows``, with % of the 641 TFLOP/s
mma.sync and 989 TFLOP/s wgmma peaks, and each contender's ``tbps``: q, k, v and o bytes
moved a second). ``--target auto`` searches both kernel families on a Hopper GPU (sm_90a),
``--target sm_90`` the mma.sync family only.

    python3 benchmarks/attention.py [--shapes seed,...|issue22|head_dims|windows] [--out DIR] [--budget S] [--target T]
                                    [--suffix S]

FLOPs are ``4·B·H·Sq·Skv·D``, halved for causal (the convention of FlashAttention's and
PyTorch's benchmarks; with a window, those of the scores it keeps). The budget bounds each search (compile + measure), so the winner is
the best of the candidates the cost model ranked first and the search reached in time.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import importlib.util
import json
import math
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import cherenkov as ck  # noqa: E402
from cherenkov.codegen import compile_plan, load_kernel  # noqa: E402
from cherenkov.graph.tensor import where  # noqa: E402
from cherenkov.search.database import TuningDatabase  # noqa: E402
from gpu_label import gpu_label  # noqa: E402
from timing import FLUSHES, L2Flush, time_interleaved  # noqa: E402

MMA_SYNC_PEAK = 641.0  # TFLOP/s, register-only mma.sync bf16 on the H200 (../shared/device/mma_peak.cu)
WGMMA_PEAK = 989.0  # TFLOP/s, dense bf16 wgmma on the H200 (NVIDIA's figure)
TOLERANCE = 2e-2
CAUSAL_BUDGET_FACTOR = 2.0  # causal problems: about twice the schedules (head-major order) and slower samples
BACKENDS = {"sdpa_flash": "FLASH_ATTENTION", "sdpa_cudnn": "CUDNN_ATTENTION", "sdpa_efficient": "EFFICIENT_ATTENTION"}
DTYPES = {"bf16": "bfloat16", "fp16": "float16"}


@dataclass(frozen=True)
class Shape:
    """One benchmark row's problem: q ``(B, H, SQ, D)``, k ``(B, H_KV, SKV, D)``, v ``(B,
    H_KV, SKV, DV)`` (``DV`` defaults to ``D``)."""

    B: int
    H: int
    H_KV: int
    SQ: int
    SKV: int
    D: int
    causal: bool = False
    dtype: str = "bf16"
    DV: int | None = None
    window: int | None = None  # causal: query i sees keys i - window < j <= i
    last_key: bool = False  # causal aligned to the last key: query i sees keys j <= i + SKV - SQ (FA4's causal)

    @property
    def dv(self) -> int:
        return self.D if self.DV is None else self.DV

    @property
    def flops(self) -> float:
        """``2·B·H·SQ·SKV·(D + DV)``, halved for causal (``4·…·D`` when ``DV = D``); with a window,
        those of the scores it keeps."""
        full = 2.0 * self.B * self.H * self.SQ * self.SKV * (self.D + self.dv)
        if self.window:
            kept = min(self.SQ, self.window)
            return full * (kept * (kept + 1) / 2 + (self.SQ - kept) * self.window) / (self.SQ * self.SKV)
        if self.last_key:  # every cached key, then a causal triangle over the chunk
            return full * (self.SQ * (self.SKV - self.SQ) + self.SQ * (self.SQ + 1) / 2) / (self.SQ * self.SKV)
        return full / 2 if self.causal else full

    @property
    def bytes(self) -> float:
        """q, k, v read once and o written once."""
        elements = self.B * (self.H * self.SQ * (self.D + self.dv) + self.H_KV * self.SKV * (self.D + self.dv))
        return 2.0 * elements


SHAPES = {
    # issue 6
    "seed": Shape(1, 8, 8, 4096, 8192, 128),
    "b4h16s4k": Shape(4, 16, 16, 4096, 4096, 128),
    "b4h16s4k_causal": Shape(4, 16, 16, 4096, 4096, 128, True),
    "seed_d64": Shape(1, 8, 8, 4096, 8192, 64),
    "b16h16s1k": Shape(16, 16, 16, 1024, 1024, 128),
    "b1h32s16k_causal": Shape(1, 32, 32, 16384, 16384, 128, True),
    # issue 22: decode, short queries, other head dims, D_V != D, fp16, Llama-3-8B prefill
    "decode_b16_8k": Shape(16, 32, 8, 1, 8192, 128),
    "decode_b1_64k": Shape(1, 32, 8, 1, 65536, 128),
    "speculative_sq4": Shape(16, 32, 8, 4, 8192, 128),
    "chunked_prefill_sq64": Shape(8, 32, 8, 64, 8192, 128),
    "b2h16s2k_d32": Shape(2, 16, 16, 2048, 2048, 32),
    "b2h16s2k_d96": Shape(2, 16, 16, 2048, 2048, 96),
    "b2h16s2k_d256": Shape(2, 16, 16, 2048, 2048, 256),
    "b2h16s2k_d192_dv128": Shape(2, 16, 16, 2048, 2048, 192, DV=128),
    "llama3_8b_prefill_8k_causal": Shape(1, 32, 8, 8192, 8192, 128, True),
    "b2h16s2k_d64_fp16": Shape(2, 16, 16, 2048, 2048, 64, dtype="fp16"),
    # sliding windows (no issue): Mistral-7B's 4k window over 16k tokens, a 1k one (Gemma 3's) over 8k
    "mistral_7b_window4k_16k": Shape(1, 32, 8, 16384, 16384, 128, True, window=4096),
    "b2h32s8k_window1k": Shape(2, 32, 8, 8192, 8192, 128, True, window=1024),
    # a causal chunk after cached keys (no issue): 1k queries after 7k, Llama-3-8B's heads; speculative
    # decoding's four drafts and a chunked prefill's 64 queries, each causal over its chunk
    "chunk_1k_after_7k_causal": Shape(4, 32, 8, 1024, 8192, 128, True, last_key=True),
    "speculative_sq4_causal": Shape(16, 32, 8, 4, 8192, 128, True, last_key=True),
    "chunked_prefill_sq64_causal": Shape(8, 32, 8, 64, 8192, 128, True, last_key=True),
    # head dims off the usual (no issue): Stable Diffusion 1.5's U-Net self-attention over a 64x64 latent
    # (8 heads of 40) and over 16x16 (8 of 160), two images (classifier-free guidance)
    "sd15_latent64_d40": Shape(2, 8, 8, 4096, 4096, 40),
    "sd15_latent16_d160": Shape(2, 8, 8, 256, 256, 160),
}
ISSUE_6 = ("seed", "b4h16s4k", "b4h16s4k_causal", "seed_d64", "b16h16s1k", "b1h32s16k_causal")
WINDOWS = ("mistral_7b_window4k_16k", "b2h32s8k_window1k", "chunk_1k_after_7k_causal", "speculative_sq4_causal",
           "chunked_prefill_sq64_causal")  # fmt: skip
HEAD_DIMS = ("sd15_latent64_d40", "sd15_latent16_d160")
ISSUE_22 = tuple(name for name in SHAPES if name not in ISSUE_6 + WINDOWS + HEAD_DIMS)


def load_example():
    """``examples/attention.py`` as a module (it is not a package)."""
    spec = importlib.util.spec_from_file_location("cherenkov_example_attention", ROOT / "examples" / "attention.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def row_graph(shape: Shape, example) -> ck.Graph:
    """A row's graph: the example's textbook attention where its contract covers the row, else
    :func:`nn_attention_graph`."""
    if shape.DV is None and shape.window is None and not shape.last_key:
        return example.build(shape=(shape.B, shape.H, shape.H_KV, shape.SQ, shape.SKV, shape.D), causal=shape.causal,
                             dtype=shape.dtype)  # fmt: skip
    return nn_attention_graph(shape)


def nn_attention_graph(shape: Shape) -> ck.Graph:
    """Attention spelled with ``ck.nn.attention``, for what the example's contract lacks: values of
    their own head dim (``D_V ≠ D``, as in MLA), a sliding window, or a causal mask aligned to the last key
    (an added band, as transformers builds it for a chunk after cached keys)."""
    g = ck.Graph("attention_value_dim" if shape.DV is not None else "attention_window")
    q = g.input("q", (shape.B, shape.H, shape.SQ, shape.D), shape.dtype)
    k = g.input("k", (shape.B, shape.H_KV, shape.SKV, shape.D), shape.dtype)
    v = g.input("v", (shape.B, shape.H_KV, shape.SKV, shape.dv), shape.dtype)
    group = shape.H // shape.H_KV
    if group > 1:
        k, v = ck.nn.repeat_kv_heads(k, group), ck.nn.repeat_kv_heads(v, group)
    band = None
    if shape.last_key:
        query, key = ck.arange(shape.SQ, graph=g).unsqueeze(-1), ck.arange(shape.SKV, graph=g)
        hidden, live = g.constant(-math.inf, shape.dtype), g.constant(0.0, shape.dtype)
        band = where(query + float(shape.SKV - shape.SQ) < key, hidden, live)
    causal = shape.causal and not shape.last_key
    g.output(ck.nn.attention(q, k, v, causal=causal, window=shape.window, bias=band), "o")
    return g


def copy_bandwidth(torch, flush, samples: int) -> float:
    """TB/s of a 1 GiB device-to-device copy (bytes read plus bytes written), median."""
    src = torch.empty(2**30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = time_interleaved(torch, {"copy": lambda: dst.copy_(src)}, flush, samples)["copy"]
    return 2 * src.numel() / (ms * 1e9)


def flash_attention_4():
    """FlashAttention-4's ``flash_attn_func`` where its wheels are installed, else None."""
    try:
        from flash_attn.cute import flash_attn_func
    except ImportError:
        return None
    return flash_attn_func


def fa4_version() -> str | None:
    try:
        return importlib.metadata.version("flash-attn-4")
    except importlib.metadata.PackageNotFoundError:
        return None


def run_shape(name: str, example, torch, flush, args, db) -> dict:
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    shape = SHAPES[name]
    b, h, hkv, sq, skv, d, causal = shape.B, shape.H, shape.H_KV, shape.SQ, shape.SKV, shape.D, shape.causal
    graph = row_graph(shape, example)
    budget = args.budget * (CAUSAL_BUDGET_FACTOR if causal else 1.0)
    started = time.monotonic()
    result = ck.optimize(graph, target=args.target, out=Path(args.workdir) / name, budget_s=budget, database=db)
    search_s = time.monotonic() - started
    best = result.best
    flash = [k for k in result.launched if k.kind == "flash_attention"]

    dtype = getattr(torch, DTYPES[shape.dtype])
    gen = torch.Generator(device="cuda").manual_seed(1234)
    q = torch.randn((b, h, sq, d), generator=gen, device="cuda").to(dtype)
    k = torch.randn((b, hkv, skv, d), generator=gen, device="cuda").to(dtype)
    v = torch.randn((b, hkv, skv, shape.dv), generator=gen, device="cuda").to(dtype)
    gqa = h != hkv
    # SDPA takes no window: the band as its bool mask (True: attended), the causal flag folded in, and
    # K/V repeated over the query heads (as transformers does; SDPA's fused kernels take a mask only so)
    band, k_sdpa, v_sdpa = None, k, v
    if shape.window or shape.last_key:
        ones = torch.ones(sq, skv, dtype=torch.bool, device="cuda")
        band = ones.tril(skv - sq) if shape.last_key else ones.tril(0) & ~ones.tril(-shape.window)
        k_sdpa, v_sdpa = (x.repeat_interleave(h // hkv, dim=1) for x in (k, v))
    sdpa_causal, sdpa_gqa = causal and band is None, gqa and band is None

    if flash:  # the flash kernel alone, into a NaN-poisoned output
        kernel = load_kernel(compile_plan(best.plan))
        out = torch.full((b, h, sq, shape.dv), math.nan, dtype=dtype, device="cuda")
        kernel(q, k, v, out)

        def ours() -> None:
            kernel(q, k, v, out)
    else:  # no flash plan: the unfused kernels, replayed as one CUDA graph
        captured = result.capture(q=q, k=k, v=v)
        out = captured()["o"]
        ours = captured
    torch.cuda.synchronize()
    with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]):
        ref = F.scaled_dot_product_attention(q.float(), k_sdpa.float(), v_sdpa.float(), attn_mask=band,
                                             is_causal=sdpa_causal, enable_gqa=sdpa_gqa)  # fmt: skip
    rel_error = float((out.float() - ref).norm() / ref.norm())
    del ref
    torch.cuda.empty_cache()  # the float32 reference's blocks: the next search's worker needs them
    if not rel_error <= TOLERANCE:
        raise RuntimeError(f"{name}: cherenkov's output is wrong (relative error {rel_error:.3g})")

    launches = {"cherenkov": ours}
    for key, backend in BACKENDS.items():
        def launch(backend=getattr(SDPBackend, backend)):
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, k_sdpa, v_sdpa, attn_mask=band, is_causal=sdpa_causal,
                                                      enable_gqa=sdpa_gqa)  # fmt: skip
        try:
            launch()
            torch.cuda.synchronize()
        except RuntimeError as error:  # a backend that does not take this problem
            print(f"  {key} unavailable: {str(error).splitlines()[0]}")
            continue
        launches[key] = launch
    fa4 = flash_attention_4()
    if fa4 is not None:  # FlashAttention-4 takes B, S, H, D tensors
        q_bshd, k_bshd, v_bshd = (x.transpose(1, 2).contiguous() for x in (q, k, v))

        window = (shape.window - 1, 0) if shape.window else (None, None)  # FA4's: keys i - left <= j <= i + right

        def launch_fa4():
            return fa4(q_bshd, k_bshd, v_bshd, causal=causal, window_size=window)

        try:
            launch_fa4()
            torch.cuda.synchronize()
            launches["fa4"] = launch_fa4
        except Exception as error:  # noqa: BLE001 - a head dim or dtype FlashAttention-4 does not take
            print(f"  fa4 unavailable: {str(error).splitlines()[0] if str(error) else type(error).__name__}")
    ms = time_interleaved(torch, launches, flush, args.samples, args.hide_launch_gaps)
    tflops = {key: shape.flops / (t * 1e9) for key, t in ms.items()}
    tbps = {key: shape.bytes / (t * 1e9) for key, t in ms.items()}
    ratios = {f"cherenkov/{key}": tflops["cherenkov"] / tflops[key] for key in tflops if key != "cherenkov"}
    measured = [c for c in result.candidates if c.timing is not None]
    predicted_order = sorted(result.candidates, key=lambda c: (c.predicted_ms or math.inf, c.id))
    leaders = sorted(measured, key=lambda c: c.time_ms)[:8]
    schedule = dict(best.result.params["schedule"])
    return {
        "name": name,
        "shape": {**asdict(shape), "DV": shape.dv},
        "cherenkov_kernels": [k.kind for k in result.launched],
        "tflops": tflops,
        "tbps": tbps,
        "ratios": ratios,
        "percent_of_mma_sync_peak": {key: 100 * t / MMA_SYNC_PEAK for key, t in tflops.items()},
        "percent_of_wgmma_peak": {key: 100 * t / WGMMA_PEAK for key, t in tflops.items()},
        "ms": ms,
        "cherenkov_plan": {**schedule, "key": best.plan.schedule.key(), "target": best.target,
                           "registers": best.result.registers, "spill_bytes": best.result.spill_bytes},
        "cherenkov_rel_error": rel_error,
        "search": {"budget_s": budget, "wall_s": round(search_s, 1), "candidates": len(result.candidates),
                   "measured": len(measured), "from_database": result.from_database,
                   "search_tflops": best.tflops,
                   "winner_rank_in_cost_model_order": next(
                       (i for i, c in enumerate(predicted_order) if c.id == best.result.id), None),
                   "leaders": [{"id": c.id, "tflops": round(c.tflops, 1), "registers": c.registers,
                                "spill_bytes": c.spill_bytes,
                                "predicted_tflops": round(c.flops / (c.predicted_ms * 1e9), 1) if c.predicted_ms else None}
                               for c in leaders]},
    }


def quantized(x, torch) -> tuple:
    """``x`` as e4m3 with a per-tensor scale (its largest magnitude maps to 448) and that scale."""
    scale = x.abs().amax().float().clamp(min=1e-12) / 448.0
    return (x.float() / scale).to(torch.float8_e4m3fn), scale.reshape(())


def hadamard(n: int, torch) -> object:
    """The orthonormal ``n × n`` Hadamard matrix (Sylvester's construction; ``n`` a power of two)."""
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / n**0.5


def fp8_graph(shape: Shape) -> ck.Graph:
    """Attention of e4m3 q, k, v with per-tensor descales (``ck.nn.attention(..., descale=...)``)."""
    g = ck.Graph("attention_fp8")
    q = g.input("q", (shape.B, shape.H, shape.SQ, shape.D), "fp8_e4m3")
    k = g.input("k", (shape.B, shape.H_KV, shape.SKV, shape.D), "fp8_e4m3")
    v = g.input("v", (shape.B, shape.H_KV, shape.SKV, shape.dv), "fp8_e4m3")
    scales = tuple(g.input(name, (), "fp32") for name in ("s_q", "s_k", "s_v"))
    g.output(ck.nn.attention(q, k, v, causal=shape.causal, descale=scales).cast("bf16"), "o")
    return g


def run_fp8_shape(name: str, torch, flush, args, db) -> dict:
    """One shape in 8 bits: cherenkov's e4m3 kernel against its own bf16 kernel (the same target's
    search), SDPA cuDNN and FlashAttention-4 in bf16, on the same values; errors against float32
    attention of the unquantised values and of the dequantised ones."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    shape = SHAPES[name]
    b, h, hkv, sq, skv, d, causal = shape.B, shape.H, shape.H_KV, shape.SQ, shape.SKV, shape.D, shape.causal
    gen = torch.Generator(device="cuda").manual_seed(1234)
    q, k, v = (torch.randn(dims, generator=gen, device="cuda").to(torch.bfloat16)
               for dims in ((b, h, sq, d), (b, hkv, skv, d), (b, hkv, skv, shape.dv)))  # fmt: skip
    (q8, s_q), (k8, s_k), (v8, s_v) = (quantized(x, torch) for x in (q, k, v))
    tensors = {"q": q8, "k": k8, "v": v8, "s_q": s_q, "s_k": s_k, "s_v": s_v}
    gqa = h != hkv
    launches, plans = {}, {}
    for label, graph, inputs in (("cherenkov_fp8", fp8_graph(shape), tensors),
                                 ("cherenkov_bf16", load_example().build(shape=(b, h, hkv, sq, skv, d), causal=causal),
                                  {"q": q, "k": k, "v": v})):  # fmt: skip
        result = ck.optimize(graph, target=args.target, out=Path(args.workdir) / f"{name}-{label}",
                             budget_s=args.budget * (CAUSAL_BUDGET_FACTOR if causal else 1.0), database=db)
        best = result.best
        if not any(k.kind == "flash_attention" for k in result.launched):
            raise RuntimeError(f"{name}: no flash kernel for {label}")
        kernel = load_kernel(compile_plan(best.plan))
        problem = best.plan.problem
        extra = {"factors": tuple(inputs[f.tensor] for f in problem.factors)} if problem.factors else {}
        operands = tuple(inputs[problem.name(role)] for role in "qkv")
        out = torch.empty(problem.layout("o").shape, dtype=torch.bfloat16, device="cuda")
        launches[label] = lambda kernel=kernel, operands=operands, out=out, extra=extra: kernel(*operands, out, **extra)
        if label == "cherenkov_fp8":
            fp8_kernel = (kernel, problem)
        plans[label] = {"key": best.plan.schedule.key(), "target": best.target, "registers": best.result.registers}
    out8 = launches["cherenkov_fp8"]().float()
    with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]):
        exact = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=causal, enable_gqa=gqa)
        dequantised = F.scaled_dot_product_attention(q8.float() * s_q, k8.float() * s_k, v8.float() * s_v,
                                                     is_causal=causal, enable_gqa=gqa)  # fmt: skip
    errors = {"vs_float32_attention": float((out8 - exact).norm() / exact.norm()),
              "vs_float32_of_dequantised": float((out8 - dequantised).norm() / dequantised.norm())}  # fmt: skip
    # incoherent processing: q H (k H)^T = q k^T for an orthonormal Hadamard H; quantising the rotated
    # q and k spreads an outlier over the head dim. The same kernel on the rotated, re-quantised inputs.
    rotation = hadamard(d, torch).to(q.device)
    rotated_inputs = dict(tensors)
    for role, x in (("q", q), ("k", k)):
        rotated_inputs[role], rotated_inputs[f"s_{role}"] = quantized((x.float() @ rotation).to(torch.bfloat16), torch)
    kernel8, problem8 = fp8_kernel
    rotated = kernel8(*(rotated_inputs[problem8.name(role)] for role in "qkv"),
                      factors=tuple(rotated_inputs[f.tensor] for f in problem8.factors)).float()
    errors["vs_float32_attention_incoherent"] = float((rotated - exact).norm() / exact.norm())
    errors["nan"] = bool(torch.isnan(out8).any() or torch.isnan(rotated).any())
    del exact, dequantised

    def cudnn():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa)

    try:
        cudnn()
        launches["sdpa_cudnn_bf16"] = cudnn
    except RuntimeError as error:  # cuDNN does not take this problem
        print(f"  sdpa_cudnn unavailable: {str(error).splitlines()[0]}")
    fa4 = flash_attention_4()
    if fa4 is not None:
        q_bshd, k_bshd, v_bshd = (x.transpose(1, 2).contiguous() for x in (q, k, v))
        launches["fa4_bf16"] = lambda: fa4(q_bshd, k_bshd, v_bshd, causal=causal)
    ms = time_interleaved(torch, launches, flush, args.samples, args.hide_launch_gaps)
    tflops = {key: shape.flops / (t * 1e9) for key, t in ms.items()}
    return {"name": name, "dtype": "fp8_e4m3", "shape": {**asdict(shape), "DV": shape.dv}, "tflops": tflops, "ms": ms,
            "ratios": {f"cherenkov_fp8/{key}": tflops["cherenkov_fp8"] / t for key, t in tflops.items()
                       if key != "cherenkov_fp8"},
            "errors": errors, "plans": plans,
            "incoherent_processing": "q and k rotated by a normalised Hadamard matrix before quantisation"}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default=",".join(ISSUE_6),
                        help=f"comma-separated, of: {', '.join(SHAPES)}; issue22, head_dims and windows stand for their rows")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    parser.add_argument("--budget", type=float, default=35.0,
                        help="seconds per search (compile + measure); causal shapes get twice it")
    parser.add_argument("--hide-launch-gaps", action="store_true",
                        help="spin the GPU ~0.2 ms before each sample's start event, so that host-side launch "
                             "work is not timed (not used for the 2026-11-29 results)")
    parser.add_argument("--samples", type=int, default=30)
    parser.add_argument("--flush", default="read", choices=FLUSHES,
                        help="how L2 is flushed before a sample: read (left clean) or zero (the dirty lines' "
                             "write-back then runs in the sample: the method before 2026-12-03)")
    parser.add_argument("--target", default="auto", help="search target (auto: the local GPU, sm_90a on Hopper; "
                                                         "sm_90: the mma.sync family only)")
    parser.add_argument("--suffix", default="", help="results file <gpu>-<date><suffix>.json (h200-...)")
    parser.add_argument("--dtype", default="bf16", choices=("bf16", "fp8"),
                        help="fp8: each shape in e4m3 (per-tensor scales) against cherenkov's bf16 kernel, cuDNN "
                             "and FlashAttention-4 in bf16, with its error against float32 attention")
    args = parser.parse_args()
    groups = {"issue22": ISSUE_22, "windows": WINDOWS, "head_dims": HEAD_DIMS}
    names = [n for s in args.shapes.split(",") if s for n in groups.get(s, (s,))]
    unknown = [s for s in names if s not in SHAPES]
    if unknown:
        parser.error(f"unknown shapes {unknown}; valid: {', '.join(SHAPES)}")

    import torch

    if not torch.cuda.is_available():
        sys.exit("benchmarks/attention.py needs a CUDA GPU")
    example = load_example()
    flush = L2Flush(torch, how=args.flush)
    copy_tbps = copy_bandwidth(torch, flush, args.samples)
    print(f"device-to-device copy: {copy_tbps:.2f} TB/s", flush=True)
    rows = []
    with tempfile.TemporaryDirectory(prefix="cherenkov-bench-") as work:
        args.workdir = work
        with TuningDatabase(Path(work) / "tuning.sqlite") as db:
            for name in names:
                started = time.monotonic()
                try:
                    if args.dtype == "fp8":
                        row = run_fp8_shape(name, torch, flush, args, db)
                        rows.append(row)
                        print(f"{name} fp8: {', '.join(f'{k} {v:.1f}' for k, v in row['tflops'].items())} TFLOP/s, "
                              f"error {row['errors']}, plans {row['plans']}", flush=True)
                        continue
                    row = run_shape(name, example, torch, flush, args, db)
                except Exception as error:  # noqa: BLE001 - report the shape and go on
                    rows.append({"name": name, "shape": asdict(SHAPES[name]),
                                 "error": f"{type(error).__name__}: {error}"})
                    print(f"{name}: FAILED {rows[-1]['error']}", flush=True)
                    continue
                rows.append(row)
                t, r = row["tflops"], row["ratios"]
                print(f"{name}: cherenkov {t['cherenkov']:.1f} TFLOP/s ({row['cherenkov_plan']['key']}, "
                      f"search {row['search']['wall_s']} s, {row['search']['measured']} measured), "
                      f"{', '.join(f'{k} {v:.2f}x' for k, v in r.items())} [{time.monotonic() - started:.0f} s]",
                      flush=True)

    date = datetime.date.today().isoformat()
    cudnn = torch.backends.cudnn.version()
    report = {
        "gpu": torch.cuda.get_device_name(0),
        "date": date,
        "versions": {"torch": torch.__version__, "cuda": torch.version.cuda, "cherenkov": ck.__version__,
                     "cudnn": cudnn, "python": sys.version.split()[0], "flash_attn_4": fa4_version()},
        "copy_tbps": copy_tbps,
        "mma_sync_peak_tflops": MMA_SYNC_PEAK,
        "wgmma_peak_tflops": WGMMA_PEAK,
        "target": args.target,
        "method": f"CUDA events, L2 flushed ({args.flush}) before each sample, backends interleaved round-robin, "
                  f"median of {args.samples}; cherenkov: ck.optimize fresh search, budget {args.budget} s a shape "
                  f"({args.budget * CAUSAL_BUDGET_FACTOR:.0f} s causal), best of what the search measured in time"
                  + ("; GPU spin before each start event" if args.hide_launch_gaps else ""),
        "budget_s": args.budget,
        "rows": rows,
    }
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{gpu_label(report['gpu'])}-{date}{args.suffix}.json"
    path.write_text(json.dumps(report, indent=1) + "\n")

    if args.dtype == "fp8":
        print(f"wrote {path}")
        return
    header = (f"{'shape':28} {'cherenkov':>10} {'TB/s':>6} {'flash':>7} {'cudnn':>7} {'effic':>7} {'fa4':>7} "
              f"{'vs flash':>9} {'vs cudnn':>9} {'vs fa4':>7}  plan")
    print("\n" + header)
    for row in rows:
        if "error" in row:
            print(f"{row['name']:28} {row['error']}")
            continue
        t, r = row["tflops"], row["ratios"]
        print(f"{row['name']:28} {t['cherenkov']:10.1f} {row['tbps']['cherenkov']:6.2f} {t.get('sdpa_flash', math.nan):7.1f} "
              f"{t.get('sdpa_cudnn', math.nan):7.1f} {t.get('sdpa_efficient', math.nan):7.1f} "
              f"{t.get('fa4', math.nan):7.1f} {r.get('cherenkov/sdpa_flash', math.nan):9.2f} "
              f"{r.get('cherenkov/sdpa_cudnn', math.nan):9.2f} {r.get('cherenkov/fa4', math.nan):7.2f}  "
              f"{row['cherenkov_plan']['target']} {row['cherenkov_plan']['key']}")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
