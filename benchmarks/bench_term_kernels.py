"""Generic kernels (issue 7) against PyTorch, one process: a bf16 matmul, softmax rows,
LayerNorm rows and a GELU epilogue, each searched by ``ck.optimize`` and timed beside the
PyTorch op on the same inputs (CUDA events, median). Prints a table; ``--json PATH``
writes it. Shapes are small enough for a short run: ``--quick`` shrinks them further."""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import cherenkov as ck
from cherenkov.search.database import TuningDatabase


def _median_ms(fn, repeats: int = 30) -> float:
    import torch

    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def cases(quick: bool):
    import torch
    import torch.nn.functional as F

    n = 2048 if quick else 4096
    g = ck.Graph("matmul")
    a, b = g.input("a", (n, n), "bf16"), g.input("b", (n, n), "bf16")
    g.output(a @ b, "y")
    yield "matmul bf16", g, lambda t: t["a"] @ t["b"], 2.0 * n**3

    g = ck.Graph("gelu_linear")
    x, w, bias = g.input("x", (n, n), "bf16"), g.input("w", (n, n), "bf16"), g.input("bias", (n,), "bf16")
    g.output(ck.nn.gelu(x @ w + bias), "y")
    yield "gelu(x@w+b) bf16", g, lambda t: F.gelu(t["x"] @ t["w"] + t["bias"], approximate="tanh"), 2.0 * n**3

    g = ck.Graph("softmax")
    g.output(ck.nn.softmax(g.input("x", (n, 2 * n), "bf16"), axis=-1), "y")
    yield "softmax bf16", g, lambda t: torch.softmax(t["x"], dim=-1), 0.0

    g = ck.Graph("layer_norm")
    x, w, bias = g.input("x", (n, n), "bf16"), g.input("w", (n,), "bf16"), g.input("b", (n,), "bf16")
    g.output(ck.nn.layer_norm(x, w, bias), "y")
    yield "layer_norm bf16", g, lambda t: F.layer_norm(t["x"], (n,), t["w"], t["b"]), 0.0


def main() -> None:
    import torch

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, graph, reference, flops in cases(args.quick):
            start = time.monotonic()
            with TuningDatabase(Path(tmp) / f"{graph.name}.sqlite") as db:
                result = ck.optimize(graph, out=Path(tmp) / graph.name, database=db)
            search_s = time.monotonic() - start
            inputs = {n: torch.randn(t.shape, device="cuda", dtype=torch.bfloat16) for n, t in graph.inputs.items()}
            ours = _median_ms(lambda: result.run(**inputs))
            theirs = _median_ms(lambda: reference(inputs))
            kernels = {k: w.plan.name for k, w in result.kernels.items()}
            kernel_ms = {k: w.time_ms for k, w in result.kernels.items()}
            rows.append({"case": name, "run_ms": ours, "torch_ms": theirs, "kernel_ms": kernel_ms, "winners": kernels,
                         "tflops": flops / (ours * 1e9) if flops else None, "search_s": search_s})  # fmt: skip
            print(
                f"{name:20} cherenkov {ours:8.3f} ms (kernels {sum(kernel_ms.values()):.3f} ms)  torch {theirs:8.3f} ms  "
                f"ratio {theirs / ours:5.2f}  search {search_s:5.1f} s  {list(kernels.values())}",
                flush=True,
            )
    if args.json:
        info = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "date": time.strftime("%Y-%m-%d")}
        args.json.write_text(json.dumps({"environment": info, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
