"""cherenkov's derived flash-attention backward against PyTorch SDPA's backward, in one process.

For each shape, this builds ``ck.grad`` of ``ck.nn.attention`` (dq, dk, dv from q, k, v and the
output gradient dO; by default with the forward's output and log-sum-exp saved, as a training
step has them: ``ck.grad(..., saved=("o", "lse"))``), derives it (one ``flash_attention_backward``
kernel), compiles every plan the target admits, times each briefly and keeps the fastest (a
small exhaustive search: at most 20 schedules, those reading the saved statistics and those
recomputing them), checks its every gradient against float32 autograd through SDPA's math path
(relative L2 ≤ 2e-2), then times it and the backward of SDPA's flash (FlashAttention-2) and
cuDNN backends on the same inputs: CUDA events, L2 flushed before every sample, contenders
interleaved round-robin, median of ``--samples``. SDPA's backward is timed as
``torch.autograd.grad`` of an output its forward already computed (its saved O and
log-sum-exp); cherenkov's time includes its statistics pass (reading the saved O and
log-sum-exp, computed here by a float32 forward; ``--statistics recomputed``: the forward run
again, as a gradient graph without saved values must) and its dq conversion.

    python3 benchmarks/attention_backward.py [--shapes seed,...] [--target sm_90|sm_90a]
                                             [--statistics saved|recomputed] [--out DIR]

``--target sm_90a`` adds the Hopper ``wgmma`` schedule to the ``mma.sync`` ones. Each row also
records the winner's three launches timed alone (``cherenkov_launch_ms``).

TFLOP/s count the backward as 2.5× the forward's ``4·B·H·Sq·Skv·D`` (halved for causal; with a
window, those of the scores it keeps), as FlashAttention's benchmarks do. The default runs issue
24's rows; ``mistral_window4k_s8k`` is a causal sliding window, which SDPA takes as a bool band with
K/V repeated over the query heads (as transformers hands it). Writes ``<out>/backward-<gpu>-<date><suffix>.json``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import cherenkov as ck  # noqa: E402
from cherenkov.codegen import compile_plans, load_kernel  # noqa: E402
from gpu_label import gpu_label  # noqa: E402
from timing import L2Flush, time_interleaved  # noqa: E402

TOLERANCE = 2e-2
# name: (B, H, H_kv, Sq, Skv, D, causal[, window]) — the issue's rows, and a causal sliding window (no issue)
SHAPES = {
    "seed": (1, 8, 8, 4096, 8192, 128, False),
    "b4h16s4k_causal": (4, 16, 16, 4096, 4096, 128, True),
    "seed_d64": (1, 8, 8, 4096, 8192, 64, False),
    "b2h32_8_s2k_causal_gqa": (2, 32, 8, 2048, 2048, 128, True),
    "mistral_window4k_s8k": (1, 32, 8, 8192, 8192, 128, True, 4096),
}
ISSUE_24 = ("seed", "b4h16s4k_causal", "seed_d64", "b2h32_8_s2k_causal_gqa")
BACKENDS = {"sdpa_flash": "FLASH_ATTENTION", "sdpa_cudnn": "CUDNN_ATTENTION"}


def gradient_graph(b: int, h: int, hkv: int, sq: int, skv: int, d: int, causal: bool, saved: bool,
                   window: int | None = None) -> ck.Graph:  # fmt: skip
    g = ck.Graph("attention")
    q = g.input("q", (b, h, sq, d), "bf16")
    k, v = (g.input(n, (b, hkv, skv, d), "bf16") for n in "kv")
    if not saved:
        g.output(ck.nn.attention(q, k, v, causal=causal, window=window), "o")
        return ck.grad(g, wrt=("q", "k", "v"))
    o, lse = ck.nn.attention(q, k, v, causal=causal, window=window, return_lse=True)
    g.output(o, "o")
    g.output(lse, "lse")
    return ck.grad(g, wrt=("q", "k", "v"), saved=("o", "lse"), outputs=("o",))


def run_shape(name: str, torch, flush, args) -> dict:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from cherenkov.search.measure import backward_reference, fill_saved_statistics

    b, h, hkv, sq, skv, d, causal, *window = SHAPES[name]
    window = window[0] if window else None
    derivation = ck.derive(gradient_graph(b, h, hkv, sq, skv, d, causal, args.statistics == "saved", window))
    plans = [p for p in derivation.plans(args.target) if p.kind == "flash_attention_backward"]
    if not plans:
        raise RuntimeError(f"no backward plan on {args.target}")
    problem = plans[0].problem
    if (problem.saved is not None) != (args.statistics == "saved"):
        raise RuntimeError(f"the derivation found {'no' if problem.saved is None else ''} saved statistics")
    gen = torch.Generator(device="cuda").manual_seed(1234)
    stored = {n: torch.randn(s, generator=gen, device="cuda").to(torch.bfloat16) for n, s in problem.stored_shapes().items()}
    q, k, v, do = (stored[n] for n in ("q", "k", "v", "d_o"))
    saved = {}
    if problem.saved is not None:
        stored[problem.saved.lse] = stored[problem.saved.lse].float()
        fill_saved_statistics(problem, stored)
        saved = {"o": stored[problem.saved.o], "lse": stored[problem.saved.lse]}
    kernels = {}
    for plan, build in zip(plans, compile_plans(plans)):
        if isinstance(build, Exception):
            print(f"  {plan.schedule.key()} did not compile: {str(build).splitlines()[0]}")
            continue
        kernel = load_kernel(build)
        kernels[plan.schedule.key()] = (plan, kernel, build, saved if plan.schedule.saved_statistics else {})
    quick = time_interleaved(torch, {key: (lambda kern=kern, extra=extra: kern(q, k, v, do, **extra))
                                     for key, (_, kern, _, extra) in kernels.items()}, flush, 5,
                             args.hide_launch_gaps)  # fmt: skip
    best = min(quick, key=quick.get)
    plan, kernel, build, extra = kernels[best]
    grads = kernel(q, k, v, do, **extra)
    torch.cuda.synchronize()
    reference = backward_reference(problem, stored)
    errors = {role: float((grads[role].float() - reference[role]).norm() / reference[role].norm()) for role in grads}
    del reference
    if not max(errors.values()) <= TOLERANCE:
        raise RuntimeError(f"{name}: cherenkov's gradients are wrong ({errors})")

    launches = {"cherenkov": lambda: kernel(q, k, v, do, **extra)}
    # SDPA takes a window as its bool band, with K/V repeated over the query heads (as transformers hands it)
    band, operands = None, (q, k, v)
    if window:
        ones = torch.ones(sq, skv, dtype=torch.bool, device="cuda")
        band, operands = ones.tril(0) & ~ones.tril(-window), (q, *(x.repeat_interleave(h // hkv, dim=1) for x in (k, v)))
    leaves = [x.detach().requires_grad_(True) for x in operands]
    for key, backend in BACKENDS.items():
        try:
            with sdpa_kernel(getattr(SDPBackend, backend)):
                o = torch.nn.functional.scaled_dot_product_attention(*leaves, attn_mask=band, is_causal=causal and band is None,
                                                                     enable_gqa=h != hkv and band is None)  # fmt: skip

            def launch(o=o):
                return torch.autograd.grad(o, leaves, do, retain_graph=True)

            launch()
            torch.cuda.synchronize()
            launches[key] = launch
        except RuntimeError as error:
            print(f"  {key} unavailable: {str(error).splitlines()[0]}")
    ms = time_interleaved(torch, launches, flush, args.samples, args.hide_launch_gaps)
    steps = ("statistics", "main", "dq")
    launch_ms = time_interleaved(torch, {step: (lambda step=step: kernel(q, k, v, do, grads, steps=(step,), **extra))
                                         for step in steps}, flush, args.samples, args.hide_launch_gaps)  # fmt: skip
    tflops = {key: problem.flops / (t * 1e9) for key, t in ms.items()}
    return {
        "name": name,
        "shape": {"B": b, "H": h, "H_KV": hkv, "SQ": sq, "SKV": skv, "D": d, "causal": causal, "window": window,
                  "dtype": "bf16"},
        "ms": ms,
        "tflops": tflops,
        "ratios": {f"cherenkov/{key}": tflops["cherenkov"] / tflops[key] for key in tflops if key != "cherenkov"},
        "rel_error": errors,
        "cherenkov_plan": {"key": best, "target": args.target, "registers": build.report.registers,
                           "spill_bytes": build.report.spill_bytes, "trace": list(plan.trace),
                           "statistics": "saved" if plan.schedule.saved_statistics else "recomputed"},
        "schedules_ms": quick,
        "cherenkov_launch_ms": launch_ms,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default=",".join(ISSUE_24), help=f"comma-separated, of: {', '.join(SHAPES)}")
    parser.add_argument("--target", default="sm_90",
                        help="the backward's target: sm_90 the mma.sync family on an H200, sm_90a with the wgmma main pass")
    parser.add_argument("--statistics", choices=("saved", "recomputed"), default="saved",
                        help="saved: the forward's o and log-sum-exp are inputs (a training step); recomputed: not")
    parser.add_argument("--samples", type=int, default=20)
    parser.add_argument("--hide-launch-gaps", action="store_true",
                        help="spin the GPU ~0.2 ms before each sample's start event, so that host-side launch work "
                             "(cherenkov's Python call, SDPA's autograd) is not timed")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    parser.add_argument("--suffix", default="")
    args = parser.parse_args()
    names = [s for s in args.shapes.split(",") if s]
    unknown = [s for s in names if s not in SHAPES]
    if unknown:
        parser.error(f"unknown shapes {unknown}; valid: {', '.join(SHAPES)}")

    import torch

    if not torch.cuda.is_available():
        sys.exit("benchmarks/attention_backward.py needs a CUDA GPU")
    flush = L2Flush(torch)
    rows = []
    for name in names:
        try:
            row = run_shape(name, torch, flush, args)
        except Exception as error:  # noqa: BLE001 - report the shape and go on
            rows.append({"name": name, "error": f"{type(error).__name__}: {error}"})
            print(f"{name}: FAILED {rows[-1]['error']}", flush=True)
            continue
        rows.append(row)
        print(f"{name}: " + ", ".join(f"{k} {v:.1f}" for k, v in row["tflops"].items()) + " TFLOP/s; "
              + ", ".join(f"{k} {v:.2f}x" for k, v in row["ratios"].items()), flush=True)  # fmt: skip
    gpu = torch.cuda.get_device_name(0)
    date = datetime.date.today().isoformat()
    report = {
        "benchmark": "attention_backward",
        "gpu": gpu,
        "date": date,
        "versions": {"torch": torch.__version__, "cuda": torch.version.cuda, "cherenkov": ck.__version__,
                     "cudnn": torch.backends.cudnn.version()},
        "method": "CUDA events, L2 flushed (read) before each sample, contenders round-robin, median of "
                  f"{args.samples}; cherenkov: the fastest of its target's backward schedules (5 quick samples each), "
                  f"statistics pass included ({args.statistics}), each launch also timed alone; SDPA: autograd.grad of a "
                  "computed output" + ("; GPU spin before each start event" if args.hide_launch_gaps else ""),
        "rows": rows,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"backward-{gpu_label(gpu)}-{date}{args.suffix}.json"
    path.write_text(json.dumps(report, indent=1) + "\n")
    print(f"\n{'shape':26} {'cherenkov':>10} {'flash':>7} {'cudnn':>7} {'vs flash':>9} {'vs cudnn':>9}  plan")
    for row in rows:
        if "error" in row:
            print(f"{row['name']:26} {row['error']}")
            continue
        t, r = row["tflops"], row["ratios"]
        print(f"{row['name']:26} {t['cherenkov']:10.1f} {t.get('sdpa_flash', math.nan):7.1f} "
              f"{t.get('sdpa_cudnn', math.nan):7.1f} {r.get('cherenkov/sdpa_flash', math.nan):9.2f} "
              f"{r.get('cherenkov/sdpa_cudnn', math.nan):9.2f}  {row['cherenkov_plan']['key']}")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
