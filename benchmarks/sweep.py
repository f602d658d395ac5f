"""Time chosen flash-attention schedules side by side on the local GPU (a development tool).

``python3 benchmarks/sweep.py --set NAME [--shapes A,B] [--out DIR]`` compiles every (shape,
schedule) of the named set (``hopper``: every sm_90a schedule valid for each shape) with all
cores, checks each kernel against SDPA in float32 (relative error ≤ 2e-2, output poisoned
with NaN first), times a shape's kernels and SDPA's flash and cuDNN backends interleaved
sample by sample with CUDA events (L2 flushed and a GPU spin before each sample, median of
``--samples``), and writes ``sweep-NAME.json`` (schedule, registers, spills, TFLOP/s, ratio
to cuDNN, error) under ``--out``. The search (``ck.optimize``) is not involved: this
measures knobs one at a time, for NOTES.md.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from cherenkov.codegen import CompileError, compile_plans, load_kernel  # noqa: E402
from cherenkov.rewrites.plan import TARGETS, AttentionProblem, FlashSchedule, KernelPlan  # noqa: E402
from cherenkov.rewrites.plan_sm90a import HOPPER_SCHEDULES, HopperFlashSchedule, hopper_schedule_problems  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from attention import SHAPES  # noqa: E402  (the benchmark's shape table, one definition)
from timing import L2Flush, time_interleaved  # noqa: E402


PLAIN = ["q128 kv64 w4 s2 split", "q128 kv64 w4 s1 split", "q128 kv64 w4 s3 split", "q128 kv64 w4 s2 joint",
         "q128 kv32 w4 s2 split", "q128 kv32 w4 s3 split", "q64 kv64 w4 s2 split", "q64 kv128 w4 s2 split",
         "q128 kv64 w8 s2 split", "q128 kv128 w8 s2 split"]
LAZY = ["q128 kv64 w4 s2 split lazy", "q128 kv64 w4 s1 split lazy", "q128 kv32 w4 s3 split lazy",
        "q64 kv128 w4 s2 split lazy"]
PINGPONG = ["q256 kv32 w8 s2 joint pp", "q256 kv32 w8 s3 joint pp", "q256 kv32 w8 s2 joint pp lazy",
            "q128 kv64 w8 s2 joint pp", "q128 kv64 w8 s3 joint pp", "q128 kv32 w8 s2 joint pp",
            "q128 kv32 w8 s3 joint pp", "q128 kv64 w8 s2 joint pp lazy"]
SECOND_SEED = ["q128 kv64 w4 s2 split", "q128 kv64 w4 s2 split lazy", "q128 kv64 w4 s2 joint lazy",
               "q64 kv64 w4 s2 joint ov", "q64 kv64 w4 s2 joint lazy ov", "q64 kv64 w4 s3 joint lazy ov",
               "q64 kv32 w4 s2 joint lazy ov mb3", "q64 kv32 w4 s3 joint lazy ov mb3", "q128 kv64 w8 s2 joint lazy ov",
               "q128 kv64 w8 s3 joint lazy ov", "q128 kv32 w8 s2 joint lazy ov", "q128 kv32 w4 s2 joint lazy ov",
               "q128 kv32 w4 s3 joint lazy ov", "q64 kv32 w4 s2 split lazy mb3", "q64 kv64 w4 s1 split lazy mb3",
               "q64 kv32 w4 s3 split lazy mb3", "q128 kv32 w8 s2 split lazy mb2", "q256 kv32 w8 s2 joint pp lazy",
               "q128 kv32 w4 s2 split lazy", "q128 kv64 w4 s1 split lazy"]
SECOND_CAUSAL = ["q128 kv64 w4 s2 split hm", "q128 kv64 w4 s2 split lazy hm", "q128 kv64 w4 s2 joint lazy hm",
                 "q64 kv64 w4 s2 joint lazy ov hm", "q128 kv64 w8 s2 joint lazy ov hm", "q64 kv32 w4 s2 joint lazy ov mb3 hm",
                 "q128 kv32 w4 s2 joint lazy ov hm", "q64 kv64 w4 s1 split lazy mb3 hm", "q128 kv32 w4 s2 split lazy hm"]
SECOND_D64 = ["q128 kv128 w4 s2 split", "q128 kv128 w4 s2 split lazy", "q128 kv64 w4 s2 joint lazy ov",
              "q128 kv64 w4 s3 joint lazy ov", "q64 kv128 w4 s2 joint lazy ov",
              "q128 kv64 w4 s2 split lazy", "q64 kv64 w4 s2 split lazy mb3", "q128 kv128 w8 s2 joint lazy ov"]
SECOND_OTHER = ["q128 kv64 w4 s2 split lazy", "q128 kv64 w4 s2 joint lazy", "q64 kv64 w4 s2 joint lazy ov",
                "q128 kv64 w8 s2 joint lazy ov", "q64 kv32 w4 s2 joint lazy ov mb3"]

SETS = {
    "first": [("seed", k) for k in PLAIN + LAZY + PINGPONG + ["q128 kv64 w4 s2 split lin", "q128 kv64 w4 s2 split x2"]]
    + [("b4h16s4k_causal", k) for k in ["q128 kv64 w4 s2 split", "q128 kv64 w4 s2 split hm", "q128 kv32 w4 s3 split",
                                        "q128 kv32 w4 s3 split hm", "q64 kv64 w4 s2 split", "q128 kv64 w4 s2 split lazy hm",
                                        "q256 kv32 w8 s2 joint pp", "q256 kv32 w8 s2 joint pp hm",
                                        "q256 kv32 w8 s3 joint pp hm", "q128 kv64 w8 s2 joint pp hm",
                                        "q128 kv32 w8 s2 joint pp hm"]]
    + [("seed_d64", k) for k in ["q128 kv64 w4 s2 split", "q128 kv128 w4 s2 split", "q64 kv128 w4 s2 split",
                                 "q128 kv64 w4 s2 split lazy", "q256 kv64 w8 s2 joint pp", "q256 kv64 w8 s3 joint pp",
                                 "q256 kv32 w8 s2 joint pp", "q128 kv64 w8 s2 joint pp", "q256 kv64 w8 s2 joint pp lazy"]],
    "second": [("seed", k) for k in SECOND_SEED] + [("b4h16s4k_causal", k) for k in SECOND_CAUSAL]
    + [("seed_d64", k) for k in SECOND_D64] + [("b4h16s4k", k) for k in SECOND_OTHER]
    + [("b16h16s1k", k) for k in SECOND_OTHER]
    + [("b1h32s16k_causal", k + " hm") for k in SECOND_OTHER] + [("b1h32s16k_causal", "q128 kv64 w4 s2 split")],
}


def hopper_key(schedule: HopperFlashSchedule) -> str:
    """The sweep's text for a Hopper schedule, e.g. ``"sm90a kv128 s3 c2 pp ps"`` (``q2``: two Q buffers)."""
    s = schedule
    return " ".join(["sm90a", f"kv{s.block_kv}", f"s{s.stages}", f"c{s.consumer_warpgroups}"]
                    + ["pp"] * s.pingpong + ["ps"] * s.persistent + ["q2"] * (s.q_buffers == 2))


def schedule_of(text: str) -> FlashSchedule | HopperFlashSchedule:
    """``"q128 kv64 w4 s2 split [lin] [x2] [pp] [lazy] [hm] [ov] [mb3] [late] [mbar] [tma] [rs] [qs] [lwr]"`` →
    FlashSchedule
    (swz x4 unless said); ``"sm90a kv128 s3 c2 [pp] [ps] [q2]"`` → HopperFlashSchedule."""
    if text.startswith("sm90a "):
        _, kv, s, c, *flags = text.split()
        return HopperFlashSchedule(int(kv[2:]), int(s[1:]), int(c[1:]), "pp" in flags, "ps" in flags,
                                   2 if "q2" in flags else 1)
    q, kv, w, s, split, *flags = text.split()
    min_blocks = next((int(f[2:]) for f in flags if f[:2] == "mb" and f[2:].isdigit()), 1)
    return FlashSchedule(int(q[1:]), int(kv[2:]), int(w[1:]), int(s[1:]), split == "split", "lin" not in flags,
                         2 if "x2" in flags else 4, "pp" in flags, "lazy" in flags, "hm" in flags, "ov" in flags,
                         min_blocks, "late" in flags, "mbar" in flags, "tma" in flags, "rs" in flags, "qs" in flags,
                         "lwr" in flags)


def problem_of(shape: str) -> AttentionProblem:
    s = SHAPES[shape]
    return AttentionProblem(s.B, s.H, s.H_KV, s.SQ, s.SKV, s.D, dtype=s.dtype, causal=s.causal, scale=s.D**-0.5,
                            value_dim=s.dv)  # fmt: skip


SETS["hopper"] = [
    (shape, hopper_key(schedule))
    for shape in SHAPES
    for schedule in HOPPER_SCHEDULES
    if not hopper_schedule_problems(schedule, problem_of(shape))
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--set", default="first", choices=sorted(SETS))
    parser.add_argument("--shapes", default="", help="comma-separated shapes to keep (default: the set's all)")
    parser.add_argument("--out", default=".")
    parser.add_argument("--samples", type=int, default=20)
    args = parser.parse_args()

    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    entries = [(shape, key) for shape, key in SETS[args.set] if not args.shapes or shape in args.shapes.split(",")]
    plans = []
    for shape, key in entries:
        schedule = schedule_of(key)
        target = TARGETS["sm_90a" if isinstance(schedule, HopperFlashSchedule) else "sm_90"]
        plans.append(KernelPlan("flash_attention", problem_of(shape), schedule, target))
    start = time.time()
    compiled = compile_plans(plans)
    print(f"compiled {len(plans)} plans in {time.time() - start:.1f} s", flush=True)
    flush = L2Flush(torch)
    rows, refs = [], {}
    for shape in dict.fromkeys(shape for shape, _ in entries):
        group = [(key, plan, kernel) for (s, key), plan, kernel in zip(entries, plans, compiled) if s == shape]
        p = group[0][1].problem
        gen = torch.Generator(device="cuda").manual_seed(1)
        q, k, v = (torch.randn(s, generator=gen, device="cuda").to(torch.bfloat16)
                   for s in (p.shapes()["q"], p.shapes()["k"], p.shapes()["v"]))
        with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION]):
            ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=p.causal)
        launches = {}
        for name, backend in (("sdpa_flash", SDPBackend.FLASH_ATTENTION), ("sdpa_cudnn", SDPBackend.CUDNN_ATTENTION)):
            def launch(backend=backend):
                with sdpa_kernel(backend):
                    return F.scaled_dot_product_attention(q, k, v, is_causal=p.causal)
            launches[name] = launch
        shape_rows = []
        for key, plan, kernel in group:
            row = {"shape": shape, "schedule": plan.schedule.key()}
            shape_rows.append(row)
            if isinstance(kernel, CompileError):
                row["error"] = str(kernel).splitlines()[0]
                continue
            row.update(registers=kernel.report.registers, spill_bytes=kernel.report.spill_bytes)
            try:
                fn = load_kernel(kernel)
                out = torch.full_like(q, math.nan)
                fn(q, k, v, out)
                torch.cuda.synchronize()
                row["rel_error"] = float((out.float() - ref).norm() / ref.norm())
                if row["rel_error"] <= 2e-2:
                    launches[row["schedule"]] = lambda fn=fn, out=out: fn(q, k, v, out)
            except Exception as error:  # noqa: BLE001 - report and go on
                row["error"] = f"{type(error).__name__}: {error}".splitlines()[0]
        # every plan and both references interleaved sample by sample: clock drift hits all alike
        ms = time_interleaved(torch, launches, flush, args.samples, spin=True)
        refs[shape] = {name: p.flops / (ms[name] * 1e9) for name in ("sdpa_flash", "sdpa_cudnn")}
        print(f"{shape}: flash {refs[shape]['sdpa_flash']:.1f} cudnn {refs[shape]['sdpa_cudnn']:.1f} TFLOP/s", flush=True)
        for row in shape_rows:
            if row["schedule"] in ms:
                row["tflops"] = p.flops / (ms[row["schedule"]] * 1e9)
                row["x_cudnn"] = row["tflops"] / refs[shape]["sdpa_cudnn"]
            print(f"{shape:18} {row['schedule']:40} regs {row.get('registers', '-'):>3} "
                  f"spill {row.get('spill_bytes', '-'):>4} err {row.get('rel_error', float('nan')):.2e} "
                  f"{row.get('tflops', 0):7.1f} TFLOP/s x{row.get('x_cudnn', 0):.3f} cuDNN {row.get('error', '')}",
                  flush=True)
        rows += shape_rows
    out = Path(args.out) / f"sweep-{args.set}.json"
    out.write_text(json.dumps({"gpu": torch.cuda.get_device_name(0), "references": refs, "rows": rows}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
