"""cherenkov's searched kernels for the common transformer pieces against PyTorch eager and
``torch.compile`` (inductor), in one process, on the same bf16 inputs.

Cases (issue 7): softmax rows, RMSNorm, LayerNorm, RMSNorm followed by a matmul, and the
MLP ``gelu(x @ W1 + b1) @ W2`` — the matmul cases at a prefill-sized and a decode-sized
token count. For each case the graph is built with ``ck.nn``, searched by ``ck.optimize``
(fresh private database), its output checked against eager in float32 (relative error ≤
2e-2), and then three contenders are timed on the same tensors:

- ``eager``: the PyTorch formula (``F.rms_norm``, ``F.layer_norm``, ``F.gelu``, ``@``);
- ``inductor``: the same function through ``torch.compile`` (default mode);
- ``cherenkov``: the graph's winning kernels, recorded once as a CUDA graph
  (``OptimizeResult.capture``) and replayed.

Two times per contender (CUDA events, L2 flushed before every sample, contenders
interleaved round-robin, median of ``--samples``): ``device_ms`` with the host's launch
work hidden behind a GPU spin (the kernels' own time) and ``call_ms`` without it (what a
caller waits for, host launch overhead included). Writes ``<out>/pieces-h200-<date>.json``.

    python3 benchmarks/transformer_pieces.py [--cases softmax,rms_norm,...] [--out DIR]
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import cherenkov as ck  # noqa: E402
from cherenkov.search.database import TuningDatabase  # noqa: E402
from timing import L2Flush, time_interleaved  # noqa: E402

TOLERANCE = 2e-2
EPS = 1e-6


@dataclass(frozen=True)
class Case:
    """One benchmark case: the cherenkov graph, the PyTorch formula, input scales, FLOPs."""

    name: str
    graph: ck.Graph
    torch_fn: Callable[..., Any]
    scales: dict[str, float]
    flops: float


def softmax_case(rows: int, cols: int) -> Case:
    g = ck.Graph("softmax")
    g.output(ck.nn.softmax(g.input("x", (rows, cols), "bf16"), axis=-1), "y")
    return Case(f"softmax {rows}x{cols}", g, lambda torch, F, x: torch.softmax(x, dim=-1), {}, 0.0)


def rms_norm_case(rows: int, dim: int) -> Case:
    g = ck.Graph("rms_norm")
    x, w = g.input("x", (rows, dim), "bf16"), g.input("w", (dim,), "bf16")
    g.output(ck.nn.rms_norm(x, w, eps=EPS), "y")
    return Case(f"rms_norm {rows}x{dim}", g, lambda torch, F, x, w: F.rms_norm(x, (dim,), w, eps=EPS), {}, 0.0)


def layer_norm_case(rows: int, dim: int) -> Case:
    g = ck.Graph("layer_norm")
    x, w, b = g.input("x", (rows, dim), "bf16"), g.input("w", (dim,), "bf16"), g.input("b", (dim,), "bf16")
    g.output(ck.nn.layer_norm(x, w, b), "y")
    return Case(f"layer_norm {rows}x{dim}", g, lambda torch, F, x, w, b: F.layer_norm(x, (dim,), w, b), {}, 0.0)


def rms_norm_matmul_case(tokens: int, dim: int, out_dim: int) -> Case:
    g = ck.Graph("rms_norm_matmul")
    x, w = g.input("x", (tokens, dim), "bf16"), g.input("w", (dim,), "bf16")
    proj = g.input("proj", (dim, out_dim), "bf16")
    g.output(ck.nn.rms_norm(x, w, eps=EPS) @ proj, "y")
    return Case(f"rms_norm+matmul {tokens}x{dim}x{out_dim}", g,
                lambda torch, F, x, w, proj: F.rms_norm(x, (dim,), w, eps=EPS) @ proj,
                {"proj": dim**-0.5}, 2.0 * tokens * dim * out_dim)  # fmt: skip


def mlp_case(tokens: int, dim: int, hidden: int) -> Case:
    g = ck.Graph("mlp")
    x = g.input("x", (tokens, dim), "bf16")
    w1, b1 = g.input("w1", (dim, hidden), "bf16"), g.input("b1", (hidden,), "bf16")
    w2 = g.input("w2", (hidden, dim), "bf16")
    g.output(ck.nn.gelu(x @ w1 + b1) @ w2, "y")
    return Case(f"mlp {tokens}x{dim}x{hidden}", g,
                lambda torch, F, x, w1, b1, w2: F.gelu(x @ w1 + b1, approximate="tanh") @ w2,
                {"w1": dim**-0.5, "w2": hidden**-0.5}, 4.0 * tokens * dim * hidden)  # fmt: skip


CASES: dict[str, Callable[[], list[Case]]] = {
    "softmax": lambda: [softmax_case(4096, 8192)],
    "rms_norm": lambda: [rms_norm_case(8192, 4096)],
    "layer_norm": lambda: [layer_norm_case(8192, 4096)],
    "rms_norm_matmul": lambda: [rms_norm_matmul_case(4096, 4096, 4096), rms_norm_matmul_case(64, 4096, 4096)],
    "mlp": lambda: [mlp_case(4096, 2048, 8192), mlp_case(64, 2048, 8192)],
}


def run_case(case: Case, torch: Any, flush: Any, samples: int, workdir: Path) -> dict[str, Any]:
    """Search, check, capture and time one case; returns its results row."""
    import torch.nn.functional as F

    started = time.monotonic()
    with TuningDatabase(workdir / f"{case.name.replace(' ', '_').replace('+', '_')}.sqlite") as db:
        result = ck.optimize(case.graph, out=workdir / case.graph.name, database=db)
    search_s = time.monotonic() - started
    generator = torch.Generator(device="cuda").manual_seed(0)
    inputs = {
        name: (torch.randn(t.shape, generator=generator, device="cuda") * case.scales.get(name, 1.0)).bfloat16()
        for name, t in case.graph.inputs.items()
    }
    order = list(case.graph.inputs)

    def eager() -> Any:
        return case.torch_fn(torch, F, *(inputs[n] for n in order))

    compiled_fn = torch.compile(lambda *xs: case.torch_fn(torch, F, *xs))
    started = time.monotonic()
    compiled_fn(*(inputs[n] for n in order))
    torch.cuda.synchronize()
    inductor_compile_s = time.monotonic() - started
    captured = result.capture(**inputs)

    expected = eager().float()
    got = next(iter(captured().values())).float()
    error = float((got - expected).norm() / expected.norm())
    if not error <= TOLERANCE:  # NaN fails too
        raise RuntimeError(f"{case.name}: cherenkov output differs from eager (relative error {error:.3g})")
    launches = {
        "eager": eager,
        "inductor": lambda: compiled_fn(*(inputs[n] for n in order)),
        "cherenkov": captured,
    }
    device_ms = time_interleaved(torch, launches, flush, samples, spin=True)
    call_ms = time_interleaved(torch, launches, flush, samples, spin=False)
    row: dict[str, Any] = {
        "case": case.name,
        "inputs": {n: {"shape": list(t.shape), "dtype": t.dtype} for n, t in case.graph.inputs.items()},
        "device_ms": device_ms,
        "call_ms": call_ms,
        "ratios": {
            "device eager/cherenkov": device_ms["eager"] / device_ms["cherenkov"],
            "device inductor/cherenkov": device_ms["inductor"] / device_ms["cherenkov"],
            "call eager/cherenkov": call_ms["eager"] / call_ms["cherenkov"],
            "call inductor/cherenkov": call_ms["inductor"] / call_ms["cherenkov"],
        },
        "relative_error_vs_eager": error,
        "kernels": [
            {"kernel": k.kind, "plan": result.kernels[k.output].plan.name, "ms": result.kernels[k.output].time_ms}
            for k in result.launched
        ],
        "search_s": round(search_s, 1),
        "inductor_compile_s": round(inductor_compile_s, 1),
    }
    if case.flops:
        row["tflops"] = {name: case.flops / (ms * 1e9) for name, ms in device_ms.items()}
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of: {', '.join(CASES)}")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    parser.add_argument("--samples", type=int, default=30)
    args = parser.parse_args()
    names = [c for c in args.cases.split(",") if c]
    unknown = [c for c in names if c not in CASES]
    if unknown:
        parser.error(f"unknown cases {unknown}; valid: {', '.join(CASES)}")

    import torch

    if not torch.cuda.is_available():
        sys.exit("benchmarks/transformer_pieces.py needs a CUDA GPU")
    flush = L2Flush(torch)
    rows = []
    with tempfile.TemporaryDirectory(prefix="cherenkov-pieces-") as work:
        for name in names:
            for case in CASES[name]():
                try:
                    row = run_case(case, torch, flush, args.samples, Path(work))
                except Exception as error:  # noqa: BLE001 - report the case and go on
                    rows.append({"case": case.name, "error": f"{type(error).__name__}: {error}"})
                    print(f"{case.name}: FAILED {rows[-1]['error']}", flush=True)
                    continue
                rows.append(row)
                d, r = row["device_ms"], row["ratios"]
                print(f"{case.name}: device ms cherenkov {d['cherenkov']:.4f} eager {d['eager']:.4f} inductor "
                      f"{d['inductor']:.4f}; {', '.join(f'{k} {v:.2f}' for k, v in r.items())}", flush=True)

    date = datetime.date.today().isoformat()
    report = {
        "gpu": torch.cuda.get_device_name(0),
        "date": date,
        "versions": {"torch": torch.__version__, "cuda": torch.version.cuda, "cherenkov": ck.__version__,
                     "python": sys.version.split()[0]},
        "method": "CUDA events, L2 flushed before each sample, contenders interleaved round-robin, median of "
                  f"{args.samples}; device_ms: GPU spin before each start event (host launch work hidden); "
                  "call_ms: no spin; cherenkov replays its kernels as one CUDA graph (OptimizeResult.capture); "
                  "inductor: torch.compile default mode",
        "rows": rows,
    }
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"pieces-h200-{date}.json"
    path.write_text(json.dumps(report, indent=1) + "\n")

    print(f"\n{'case':34} {'cherenkov':>10} {'eager':>8} {'inductor':>9} {'vs eager':>9} {'vs induct':>10}"
          f" {'call vs eager':>14} {'call vs ind':>12}   (device ms; ratios = theirs / ours)")
    for row in rows:
        if "error" in row:
            print(f"{row['case']:34} {row['error']}")
            continue
        d, r = row["device_ms"], row["ratios"]
        print(f"{row['case']:34} {d['cherenkov']:10.4f} {d['eager']:8.4f} {d['inductor']:9.4f} "
              f"{r['device eager/cherenkov']:9.2f} {r['device inductor/cherenkov']:10.2f} "
              f"{r['call eager/cherenkov']:14.2f} {r['call inductor/cherenkov']:12.2f}")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
