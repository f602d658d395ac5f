"""The sm_90a wgmma GEMM family against torch.matmul (cuBLAS) and the mma.sync family.

For each case, every wgmma plan and every mma.sync plan of ``y = a @ b`` (bf16, both
row-major; ``bias_gelu`` cases: ``y = gelu(a @ b + bias)``, the MLP's first GEMM) is
compiled, checked against torch's float32 result (relative L2 error), and timed with the
other plans and torch (``torch.matmul``, or eager ``F.gelu(a @ b + bias)``) interleaved (CUDA events, L2 flushed, a
GPU spin before each start event, median of ``--samples``). Prints TFLOP/s; ``--out``
also writes them as JSON. ``--without-proxy-fence`` adds, as an experiment, each wgmma
plan with the per-step ``fence.proxy.async`` deleted from its source (the PTX memory model
asks for it between the cp.async writes and the wgmma reads; ptxas turns it into a
``MEMBAR.ALL.CTA``), to measure what the fence costs.

Cases: the prefill shapes 4096³ and 4096×8192×2048, the MLP's 4096×8192×2048 with bias +
GELU, and the decode shapes of 64 tokens (64×4096×4096, 64×8192×2048, 64×2048×8192: the
split-K plans). ``--cases`` picks some by name (``4096x4096x4096``, ``bias_gelu_4096x8192x2048``, ...).

Usage: ``python benchmarks/bench_gemm_sm90a.py [--samples 20] [--cases A,B] [--out results.json]
[--without-proxy-fence]`` (needs an sm_90 GPU, torch and cupy).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

import cherenkov as ck
from cherenkov.codegen import compile_plans, cuda_source, load_kernel, term_plans
from cherenkov.rewrites.plan import TARGETS

sys.path.insert(0, str(Path(__file__).resolve().parent))
from timing import L2Flush, time_interleaved  # noqa: E402

log = logging.getLogger("bench_gemm_sm90a")

# name -> (M, N, K, epilogue): a (M, K) @ b (K, N), then "none" or "bias_gelu"
CASES = {
    f"{e + '_' if e != 'none' else ''}{m}x{n}x{k}": (m, n, k, e)
    for m, n, k, e in (
        (4096, 4096, 4096, "none"), (4096, 8192, 2048, "none"), (4096, 8192, 2048, "bias_gelu"),
        (64, 4096, 4096, "none"), (64, 8192, 2048, "none"), (64, 2048, 8192, "none"),
    )
}  # fmt: skip
PROXY_FENCE = "fence_proxy_async();"


def matmul_plans(m: int, n: int, k: int, epilogue: str = "none") -> list:
    g = ck.Graph("matmul")
    y = g.input("a", (m, k), "bf16") @ g.input("b", (k, n), "bf16")
    g.output(ck.nn.gelu(y + g.input("bias", (n,), "bf16")) if epilogue == "bias_gelu" else y, "y")
    d = ck.derive(g)
    shapes, dtypes = d.tensor_types()
    (kernel,) = d.kernels
    return [p for p in term_plans(kernel, shapes, dtypes, TARGETS["sm_90a"]) if p.family in ("wgmma", "mma")]


def bench_shape(torch, m: int, n: int, k: int, epilogue: str, samples: int, flush,
                without_fence: bool) -> dict[str, dict]:  # fmt: skip
    plans = matmul_plans(m, n, k, epilogue)
    sources: list[str | None] = [None] * len(plans)
    keys = [p.schedule.key() for p in plans]
    if without_fence:
        fenced = [p for p in plans if p.family == "wgmma"]
        for plan in fenced:
            source = cuda_source(plan)
            assert PROXY_FENCE in source
            sources.append("\n".join(line for line in source.splitlines() if not line.strip().startswith(PROXY_FENCE)))
        plans += fenced
        keys += [f"{p.schedule.key()}_nofence" for p in fenced]
    compiled = compile_plans(plans, sources=sources)
    generator = torch.Generator(device="cuda").manual_seed(0)
    a = torch.randn((m, k), generator=generator, device="cuda").to(torch.bfloat16)
    b = (torch.randn((k, n), generator=generator, device="cuda") * k**-0.5).to(torch.bfloat16)
    bias = torch.randn((n,), generator=generator, device="cuda").to(torch.bfloat16)
    gelu = torch.nn.functional.gelu
    if epilogue == "bias_gelu":
        reference = gelu(a.float() @ b.float() + bias.float(), approximate="tanh")
        launches = {"torch": lambda: gelu(torch.matmul(a, b) + bias, approximate="tanh")}
    else:
        reference = a.float() @ b.float()
        launches = {"torch": lambda: torch.matmul(a, b)}
    errors = {"torch": ((launches["torch"]().float() - reference).norm() / reference.norm()).item()}
    for key, result in zip(keys, compiled, strict=True):
        if isinstance(result, Exception):
            log.warning("%s did not compile: %s", key, str(result).splitlines()[0])
            continue
        run, out = load_kernel(result).bind({"a": a, "b": b, "bias": bias})
        out.fill_(float("nan"))
        run()
        torch.cuda.synchronize()
        errors[key] = ((out.float() - reference).norm() / reference.norm()).item()
        launches[key] = run
    times = time_interleaved(torch, launches, flush, samples, spin=True)
    flops = 2.0 * m * n * k
    return {key: {"ms": ms, "tflops": flops / (ms * 1e9), "rel_error": errors[key]} for key, ms in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=20)
    parser.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of: {', '.join(CASES)}")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--without-proxy-fence", action="store_true")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    import torch

    flush = L2Flush(torch)
    names = [c for c in args.cases.split(",") if c]
    unknown = [c for c in names if c not in CASES]
    if unknown:
        parser.error(f"unknown cases {unknown}; valid: {', '.join(CASES)}")
    results = {}
    for shape in names:
        m, n, k, epilogue = CASES[shape]
        results[shape] = bench_shape(torch, m, n, k, epilogue, args.samples, flush, args.without_proxy_fence)
        ranked = sorted(results[shape].items(), key=lambda item: item[1]["ms"])
        cublas = results[shape]["torch"]["tflops"]
        for key, r in ranked:
            log.info("%s %-32s %8.3f ms %7.1f TFLOP/s (%.2fx torch)  rel. error %.2e", shape, key, r["ms"],
                     r["tflops"], r["tflops"] / cublas, r["rel_error"])  # fmt: skip
    if args.out:
        args.out.write_text(json.dumps({"gpu": torch.cuda.get_device_name(), "results": results}, indent=2))


if __name__ == "__main__":
    main()
