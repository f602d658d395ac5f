"""Time every valid sm_90 flash-attention plan on the seed shape against SDPA's flash backend.

Run on a GPU machine: ``python3 tests/codegen/bench_flash_seed.py [--json PATH] [--shape B,H,SQ,SKV,D]
[--causal]``. Each plan is checked (relative L2 error against SDPA in float32), then timed
with CUDA events: warm-up, L2 flushed before every run, median of ``--reps``. Prints a table
of the best and worst plans and SDPA flash; ``--json`` writes every number.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from cherenkov.codegen import CompileError, compile_plans, load_kernel, valid_flash_plans
from cherenkov.rewrites.plan import TARGETS, AttentionProblem

log = logging.getLogger("bench_flash_seed")


def median_ms(fn, reps: int, flush: torch.Tensor) -> float:
    """Median time of ``fn`` in ms over ``reps`` runs, L2 flushed before each."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        flush.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="1,8,4096,8192,128")
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--json")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    b, h, sq, skv, d = (int(x) for x in args.shape.split(","))
    problem = AttentionProblem(b, h, h, sq, skv, d, causal=args.causal)
    plans = valid_flash_plans(problem, TARGETS["sm_90"])
    start = time.perf_counter()
    results = compile_plans(plans)
    log.info("compiled %d plans in %.1f s", len(plans), time.perf_counter() - start)

    device = torch.device("cuda", 0)
    shapes = problem.shapes()
    q, k, v = (torch.randn(shapes[name], device=device, dtype=torch.bfloat16) for name in (problem.q, problem.k, problem.v))
    reference = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=args.causal)
    flush = torch.empty(256 * 1024 * 1024, dtype=torch.uint8, device=device)
    tflops = lambda ms: problem.flops / (ms * 1e-3) / 1e12  # noqa: E731

    rows = []
    for plan, result in zip(plans, results):
        row = {"plan": plan.schedule.key()}
        if isinstance(result, CompileError):
            rows.append({**row, "error": str(result).splitlines()[0]})
            continue
        row.update(registers=result.report.registers, spill_bytes=result.report.spill_bytes)
        kernel = load_kernel(result)
        out = torch.full_like(q, float("nan"))
        kernel(q, k, v, out)
        torch.cuda.synchronize()
        row["rel_err"] = ((out.float() - reference).norm() / reference.norm()).item()
        ms = median_ms(lambda: kernel(q, k, v, out), args.reps, flush)
        rows.append({**row, "ms": ms, "tflops": tflops(ms)})

    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        sdpa_ms = median_ms(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=args.causal), args.reps, flush)
    timed = sorted((r for r in rows if "ms" in r), key=lambda r: r["ms"])
    failed = [r for r in rows if "ms" not in r or r["rel_err"] > 2e-2 or r["rel_err"] != r["rel_err"]]
    summary = {
        "gpu": torch.cuda.get_device_name(device),
        "torch": torch.__version__,
        "shape": args.shape,
        "causal": args.causal,
        "sdpa_flash": {"ms": sdpa_ms, "tflops": tflops(sdpa_ms)},
        "plans": rows,
    }
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=1)

    print(f"\n{'plan':34s} {'ms':>8s} {'TFLOP/s':>8s} {'regs':>5s} {'spill':>6s} {'rel_err':>9s}")
    for r in timed[:10] + [None] + timed[-5:]:
        if r is None:
            print("...")
            continue
        print(f"{r['plan']:34s} {r['ms']:8.3f} {r['tflops']:8.1f} {r['registers']:5d} {r['spill_bytes']:6d} {r['rel_err']:9.2e}")
    print(f"{'SDPA flash (FA2)':34s} {sdpa_ms:8.3f} {tflops(sdpa_ms):8.1f}")
    print(f"best {timed[0]['plan']} {timed[0]['tflops']:.1f} TFLOP/s, worst {timed[-1]['plan']} "
          f"{timed[-1]['tflops']:.1f} TFLOP/s, {len(timed)} timed, {len(failed)} failed or wrong")  # fmt: skip
    for r in failed:
        print("FAILED", r)


if __name__ == "__main__":
    main()
