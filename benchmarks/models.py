"""Real modules and whole models through cherenkov against the module itself and ``torch.compile``, one process.

For each module (``tests/search/real_modules.py``: transformers' ``LlamaAttention`` on its
SDPA and eager paths and ``LlamaDecoderLayer`` at Llama-3-8B dims, timm's ViT-B/16
``Block``, nanoGPT's ``CausalSelfAttention``), in bf16 with random weights:

1. capture it with ``ck.from_torch`` and search it with ``ck.optimize`` (``--budget`` per
   module, a private tuning database unless ``--database`` names one);
2. check ``res.run`` against the module (relative L2 error, float32 comparison);
3. time four contenders on the same inputs — the module eager, ``torch.compile(module)``
   (default mode: inductor), cherenkov's ``res.run`` and its CUDA-graph replay
   (``res.capture``) — with CUDA events, round-robin, L2 flushed before every sample,
   median of ``--samples``, the host's launch work hidden behind a GPU spin (device time).

Whole models (``real_modules.gpt2_lm``, ``real_modules.llama_lm``: GPT-2 small forward at
B8 T1024, the integration issue's 4-layer Llama prefill at B1 S2048 and its greedy decode
with a static cache) go through ``torch.compile(model, backend=cherenkov)`` (``--budget``
per region) against eager and ``torch.compile`` (inductor): forwards timed as above but
end to end (host work included, no spin), decode as tokens per second of ``generate``
(32 new tokens less 1, wall clock, median of 3).

Writes ``<out>/models-<gpu>-<date>.json``: per row ``name``, ``ms`` {``cherenkov``
(the CUDA-graph replay), ``cherenkov_run``, ``eager``, ``inductor``}, ``speedup``
{``vs_eager``, ``vs_inductor``} (baseline ms / cherenkov ms), ``rel_error``, ``winners``
(kernel -> candidate id and kind), ``absorbing`` (the best fused candidate that competed
for a kernel: see :func:`absorbing_candidates`) and the search's wall time; a whole-model
row has ``ms`` {``cherenkov``, ``eager``, ``inductor``} or ``tokens_per_s``, the count of
its regions and of their launched kernels by kind, the searched winners' measured ms by kind
and by GEMM schedule, and the five slowest with how many of their candidates were measured
(``winners_ms``: where the model's kernel time goes), the best fused candidate of each
kernel that had one (``absorbing``: why a GELU or a residual add stayed a kernel of its
own), whether its tokens equal eager's (else the first that differs and eager's gap between
its two best logits there), and the row's wall time (searches and compiles included); and
prints a table.

    python3 benchmarks/models.py [--rows llama_attention_sdpa_s2048,vit_block,gpt2_small,train:vit_block,...]
                                 [--budget 120] [--samples 30] [--saved-statistics] [--out DIR]

A Llama row names its sequence length (``_s2048``); the JSON is rewritten after every row,
so a run cut short keeps the rows it finished.

A whole model's row prefixed ``train:`` (``train:gpt2_small``, ``train:llama_prefill_s2048``) times
one training step through the backend instead: the model (eval mode: no dropout, which the
backend does not lower) called with ``labels`` and its loss's ``backward()``, the parameters'
gradients cleared first, eager, under inductor and under the cherenkov backend (AOTAutograd's
forward and backward graphs split and searched, ``--budget`` per region), end to end; its
``grad_rel_error`` is the largest relative L2 error of a parameter's gradient against eager's.

A module's row prefixed ``train:`` (``train:vit_block``, ``train:llama_decoder_layer_s2048``) times one
training step of the module instead — the forward and ``backward()`` of a fixed output gradient,
the parameters' gradients cleared first — eager, under ``torch.compile`` (inductor) and under
``ck.compile`` (its forward and ``ck.grad`` of it searched, ``--budget`` each; ``--saved-statistics``:
the forward saves each attention's output and log-sum-exp for the backward), end to end (host work
included, no spin). Such a row has ``ms``, ``speedup``, ``grad_rel_error`` (the largest relative
L2 error of a parameter's gradient against eager's, and which parameter it was), ``search_s`` (the
forward's search) and ``first_steps_s`` (eager's first step and ck.compile's, which searches the
backward).
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import math
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "tests" / "search"))

import cherenkov as ck  # noqa: E402
import real_modules  # noqa: E402
from cherenkov.search.database import TuningDatabase  # noqa: E402
from gpu_label import gpu_label  # noqa: E402
from timing import L2Flush, time_interleaved  # noqa: E402

log = logging.getLogger("benchmarks.models")

# (builder, options) per row: the real sizes of the table.
ROWS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama_attention_sdpa": ("llama_attention_sdpa", {"small": False, "batch": 1}),
    "llama_attention_eager": ("llama_attention_eager", {"small": False, "batch": 1}),
    "llama_decoder_layer": ("llama_decoder_layer", {"small": False, "batch": 1}),
    "vit_block": ("vit_block", {"small": False, "batch": 32}),
    "nanogpt_attention": ("nanogpt_attention", {"small": False, "batch": 8}),
}
SEQUENCED = ("llama_attention_sdpa", "llama_attention_eager", "llama_decoder_layer")
DEFAULT_ROWS = ",".join([f"{name}_s{seq}" for name in SEQUENCED for seq in (2048, 8192)] + ["vit_block",
                                                                                            "nanogpt_attention"])


WHOLE_MODELS = ("gpt2_small", "llama_prefill_s2048", "llama_decode")
"""Whole-model rows: through the ``torch.compile`` backend (:func:`benchmark_whole_model`)."""
TRAINED_WHOLE_MODELS = ("gpt2_small", "llama_prefill_s2048")
"""Whole models with a ``train:`` row (a training step through the backend)."""


TRAINING = "train:"
"""The prefix of a training-step row (:func:`benchmark_training`)."""


def row_spec(label: str) -> tuple[str, dict[str, Any]]:
    """``llama_decoder_layer_s8192`` -> its builder and options (the sequence length set);
    ``train:<row>`` -> those of ``<row>`` (a module's, or a whole model's but decoding)."""
    training, label = label.startswith(TRAINING), label.removeprefix(TRAINING)
    if training and label in WHOLE_MODELS and label not in TRAINED_WHOLE_MODELS:
        raise SystemExit(f"no training row for {label!r}: train: takes a module's row or one of "
                         f"{', '.join(TRAINED_WHOLE_MODELS)}")  # fmt: skip
    name, _, seq = label.rpartition("_s")
    if name in SEQUENCED and seq.isdigit():
        builder, options = ROWS[name]
        return builder, dict(options, seq=int(seq))
    if label in WHOLE_MODELS:
        return label, {}
    if label not in ROWS or label in SEQUENCED:
        raise SystemExit(f"unknown row {label!r}: Llama rows end in _s<sequence length>; others: "
                         f"{', '.join([*(n for n in ROWS if n not in SEQUENCED), *WHOLE_MODELS])}")  # fmt: skip
    return ROWS[label]


def benchmark(label: str, builder: str, options: dict[str, Any], args: argparse.Namespace, db: TuningDatabase,
              torch: Any, flush: Any) -> dict[str, Any]:  # fmt: skip
    torch.manual_seed(0)
    real = real_modules.BUILDERS[builder](dtype=torch.bfloat16, device="cuda", **options)
    graph = ck.from_torch(real.module, *real.inputs)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as out:
        result = ck.optimize(graph, out=out, database=db, budget_s=args.budget)
    search_s = time.perf_counter() - start
    inputs = {n: torch.from_numpy(a).to("cuda", torch.bfloat16) for n, a in graph.example_inputs().items()}
    with torch.no_grad():
        expected = real.module(*real.inputs).float()
        (got,) = result.run(**inputs).values()
        error = float((got.float() - expected).norm() / expected.norm())
        captured = result.capture(**inputs)
        compiled = torch.compile(real.module)
        compiled(*real.inputs)  # compile outside the timing
        launches = {
            "eager": lambda: real.module(*real.inputs),
            "inductor": lambda: compiled(*real.inputs),
            "cherenkov_run": lambda: result.run(**inputs),
            "cherenkov": captured,
        }
        ms = time_interleaved(torch, launches, flush, args.samples, spin=True)
    winners = {k: {"id": w.result.id, "kind": w.result.kind, "ms": w.time_ms} for k, w in result.kernels.items()}
    absorbing = absorbing_candidates(result)
    row = {
        "name": label,
        "module": real.name,
        "options": options,
        "ms": {name: round(value, 4) for name, value in ms.items()},
        "speedup": {"vs_eager": round(ms["eager"] / ms["cherenkov"], 3),
                    "vs_inductor": round(ms["inductor"] / ms["cherenkov"], 3)},  # fmt: skip
        "rel_error": error,
        "kernels": [k.kind for k in result.partition],
        "winners": winners,
        "absorbing": absorbing,
        "search_s": round(search_s, 1),
        "partial": result.summary.partial,
        "measured": result.summary.measured,
        "candidates": len(result.candidates),
    }
    log.warning("%s", json.dumps(row))
    return row


def benchmark_training(label: str, builder: str, options: dict[str, Any], args: argparse.Namespace,
                       db: TuningDatabase, torch: Any, flush: Any) -> dict[str, Any]:  # fmt: skip
    """One training-step row: forward and backward of the module eager, under inductor and under
    ``ck.compile``, the parameters' gradients checked against eager's."""
    torch.manual_seed(0)
    real = real_modules.BUILDERS[builder](dtype=torch.bfloat16, device="cuda", **options)
    module, inputs = real.module, real.inputs
    parameters = dict(module.named_parameters())
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as out:
        ours = ck.compile(module, *inputs, budget_s=args.budget, database=db, out=Path(out),
                          saved_statistics=args.saved_statistics)  # fmt: skip
        search_s = time.perf_counter() - start  # the forward's search (the backward's comes with the first step)
        grad_output = torch.randn_like(module(*inputs))
        inductor = torch.compile(module)

        def step(fn: Any) -> Any:
            def run() -> None:
                for p in parameters.values():
                    p.grad = None
                fn(*inputs).backward(grad_output)

            return run

        gradients = {}
        for name, fn in (("eager", module), ("cherenkov", ours)):
            step(fn)()
            gradients[name] = {n: p.grad.float().clone() for n, p in parameters.items() if p.grad is not None}
        errors = {n: float((gradients["cherenkov"][n] - g).norm() / g.norm().clamp_min(1e-30))
                  for n, g in gradients["eager"].items()}  # fmt: skip
        first_step_s = time.perf_counter() - start - search_s
        launches = {"eager": step(module), "inductor": step(inductor), "cherenkov": step(ours)}
        ms = time_interleaved(torch, launches, flush, args.samples, spin=False)
    worst = max(errors, key=errors.get)
    row = {
        "name": label,
        "module": real.name,
        "options": options,
        "saved_statistics": args.saved_statistics,
        "ms": {name: round(value, 4) for name, value in ms.items()},
        "speedup": {"vs_eager": round(ms["eager"] / ms["cherenkov"], 3),
                    "vs_inductor": round(ms["inductor"] / ms["cherenkov"], 3)},  # fmt: skip
        "grad_rel_error": {"max": errors[worst], "parameter": worst},
        "searches": ours.searches,
        "search_s": round(search_s, 1),
        "first_steps_s": round(first_step_s, 1),
    }
    log.warning("%s", json.dumps(row))
    return row


def benchmark_whole_model(label: str, args: argparse.Namespace, db: TuningDatabase, torch: Any,
                          flush: Any) -> dict[str, Any]:  # fmt: skip
    """One whole-model row: the model eager, under inductor and under the cherenkov backend (a
    ``train:`` row: a training step of each)."""
    import functools

    from cherenkov.search import dynamo

    splits: list[Any] = []
    original = dynamo.split_supported

    def recording(*a: Any, **kw: Any) -> Any:
        splits.append(original(*a, **kw))
        return splits[-1]

    dynamo.split_supported = recording
    backend = functools.partial(dynamo.cherenkov_backend, options={"budget_s": args.budget, "database": db})
    start = time.perf_counter()
    training, model_label = label.startswith(TRAINING), label.removeprefix(TRAINING)
    try:
        if model_label == "llama_decode":
            row = _decode_row(real_modules.llama_lm(small=False, dtype=torch.bfloat16, device="cuda"), backend, torch)
        else:
            if model_label == "gpt2_small":
                model = real_modules.gpt2_lm(small=False, dtype=torch.bfloat16, device="cuda")
                ids = torch.randint(0, 50257, (8, 1024), device="cuda")
            else:
                model = real_modules.llama_lm(small=False, dtype=torch.bfloat16, device="cuda")
                ids = torch.randint(0, 32000, (1, int(model_label.rpartition("_s")[2])), device="cuda")
            row = (_training_row if training else _forward_row)(model, ids, backend, args, torch, flush)
    finally:
        dynamo.split_supported = original
    regions = [f for split in splits for f in split.compiled]
    results = [call.result for f in regions for call in f.prepared.values() if call.result is not None]
    kernels = [k.kind for result in results for k in result.launched]
    absorbing = {kernel: best for result in results for kernel, best in absorbing_candidates(result).items()}
    row.update(name=label, row_s=round(time.perf_counter() - start, 1), regions=len(regions),
               kernels=dict(sorted(Counter(kernels).items())), winners_ms=winner_times(results),
               absorbing=absorbing)  # fmt: skip
    log.warning("%s", json.dumps(row))
    return row


def _forward_row(model: Any, ids: Any, backend: Any, args: argparse.Namespace, torch: Any,
                 flush: Any) -> dict[str, Any]:  # fmt: skip
    torch._dynamo.reset()
    with torch.no_grad():
        ours = torch.compile(model, backend=backend, dynamic=False)
        got = ours(ids, use_cache=False).logits.float()
        inductor = torch.compile(model, dynamic=False)
        inductor(ids, use_cache=False)
        expected = model(ids, use_cache=False).logits.float()
        launches = {
            "eager": lambda: model(ids, use_cache=False),
            "inductor": lambda: inductor(ids, use_cache=False),
            "cherenkov": lambda: ours(ids, use_cache=False),
        }
        ms = time_interleaved(torch, launches, flush, args.samples, spin=False)
    return {
        "shape": list(ids.shape),
        "ms": {name: round(value, 4) for name, value in ms.items()},
        "speedup": {"vs_eager": round(ms["eager"] / ms["cherenkov"], 3),
                    "vs_inductor": round(ms["inductor"] / ms["cherenkov"], 3)},  # fmt: skip
        "rel_error_vs_eager": float((got - expected).norm() / expected.norm()),
    }


def _training_row(model: Any, ids: Any, backend: Any, args: argparse.Namespace, torch: Any,
                  flush: Any) -> dict[str, Any]:  # fmt: skip
    """A training step (loss from ``labels``, ``backward()``) eager, under inductor and under
    ``backend``, the parameters' gradients checked against eager's."""
    torch._dynamo.reset()
    parameters = dict(model.named_parameters())

    def step(fn: Any) -> Any:
        def run() -> None:
            for p in parameters.values():
                p.grad = None
            fn(ids, labels=ids, use_cache=False).loss.backward()

        return run

    ours = torch.compile(model, backend=backend, dynamic=False)
    inductor = torch.compile(model, dynamic=False)
    gradients = {}
    for name, fn in (("eager", model), ("cherenkov", ours), ("inductor", inductor)):
        step(fn)()  # the backends compile (and search) their forward and backward here
        gradients[name] = {n: p.grad.float().clone() for n, p in parameters.items() if p.grad is not None}
    errors = {n: float((gradients["cherenkov"][n] - g).norm() / g.norm().clamp_min(1e-30))
              for n, g in gradients["eager"].items()}  # fmt: skip
    launches = {"eager": step(model), "inductor": step(inductor), "cherenkov": step(ours)}
    ms = time_interleaved(torch, launches, flush, args.samples, spin=False)
    worst = max(errors, key=errors.get)
    return {
        "shape": list(ids.shape),
        "ms": {name: round(value, 4) for name, value in ms.items()},
        "speedup": {"vs_eager": round(ms["eager"] / ms["cherenkov"], 3),
                    "vs_inductor": round(ms["inductor"] / ms["cherenkov"], 3)},  # fmt: skip
        "grad_rel_error": {"max": errors[worst], "parameter": worst},
    }


def _decode_row(model: Any, backend: Any, torch: Any, prompt: int = 64, tokens: int = 32) -> dict[str, Any]:
    ids = torch.randint(0, model.config.vocab_size, (1, prompt), device="cuda")
    forward = model.forward

    def generate(new: int, logits: bool = False) -> Any:
        with torch.no_grad():
            return model.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                                  cache_implementation="static", return_dict_in_generate=logits,
                                  output_logits=logits)  # fmt: skip

    def wall(new: int) -> float:
        times = []
        for _ in range(3):
            torch.cuda.synchronize()
            start = time.perf_counter()
            generate(new)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        return sorted(times)[1]

    rates, generated = {}, {}
    for name, compiler in (("eager", None), ("inductor", "inductor"), ("cherenkov", backend)):
        torch._dynamo.reset()
        model.forward = forward if compiler is None else torch.compile(forward, backend=compiler, dynamic=False)
        try:
            generated[name] = generate(tokens, logits=True)  # compiles the prefill and the decode step
            rates[name] = round((tokens - 1) / (wall(tokens) - wall(1)), 1)
        finally:
            model.forward = forward
    return {
        "shape": [1, prompt],
        "new_tokens": tokens,
        "tokens_per_s": rates,
        "speedup": {"vs_eager": round(rates["cherenkov"] / rates["eager"], 3),
                    "vs_inductor": round(rates["cherenkov"] / rates["inductor"], 3)},  # fmt: skip
        "same_tokens_as_eager": first_difference(generated["cherenkov"], generated["eager"]),
        "inductor_same_tokens_as_eager": first_difference(generated["inductor"], generated["eager"]),
    }


def first_difference(got: Any, eager: Any) -> bool | dict[str, Any]:
    """True where ``got`` generated eager's tokens; else the first new token that differs and
    the gap between eager's two best logits there (a gap within the dtype's rounding is a
    tie that greedy decoding breaks either way)."""
    a, b = got.sequences[0].tolist(), eager.sequences[0].tolist()
    if a == b:
        return True
    step = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y) - (len(b) - len(eager.logits))
    best, second = eager.logits[step][0].float().topk(2).values.tolist()
    return {"first_differing_token": step, "eager_top2_logit_gap": round(best - second, 5)}


def winner_times(results: list[Any]) -> dict[str, Any]:
    """Where a whole model's kernel time goes, by the search's own measurements: the launched
    winners' measured ms summed per kind and family (one region's result per prepared
    signature), the same per GEMM schedule (``by_gemm_schedule``: which tiles the GEMMs
    chose, ``count`` kernels, ``ms`` in all), and the five slowest winners (kernel, candidate
    id, ms, and how many of the kernel's candidates the search measured)."""
    by_kind: Counter[str] = Counter()
    by_schedule: dict[str, dict[str, float]] = {}
    slowest = []
    for result in results:
        for kernel in result.launched:
            winner = result.kernels.get(kernel.output)
            if winner is None or winner.time_ms is None:
                continue
            family = getattr(winner.plan, "family", "flash")
            by_kind[f"{kernel.kind}:{family}"] += winner.time_ms
            if family in ("mma", "wgmma"):
                entry = by_schedule.setdefault(winner.plan.schedule.key(), {"count": 0, "ms": 0.0})
                entry["count"] += 1
                entry["ms"] = round(entry["ms"] + winner.time_ms, 4)
            measured = sum(1 for r in result.candidates if r.kernel == kernel.output and r.time_ms is not None)
            slowest.append((winner.time_ms, kernel.output, winner.result.id, measured))
    top = [{"kernel": k, "id": i, "ms": round(ms, 4), "measured": n}
           for ms, k, i, n in sorted(slowest, reverse=True)[:5]]  # fmt: skip
    return {"by_kind": {k: round(v, 4) for k, v in sorted(by_kind.items())},
            "by_gemm_schedule": dict(sorted(by_schedule.items())), "slowest": top}  # fmt: skip


def absorbing_candidates(result: Any) -> dict[str, dict[str, Any]]:
    """Per kernel that a candidate of another kind could run (one that absorbs its producer:
    RoPE in the projection's epilogue, a norm in the GEMM's main loop), the best of those
    candidates — id, status, measured ms (before the producer's time is credited) and the
    reason a measurement stopped — so a row shows why the search kept or dropped the fused form."""
    kinds = {k.output: k.kind for k in result.partition}
    found: dict[str, dict[str, Any]] = {}
    for r in sorted(result.candidates, key=lambda r: (r.time_ms is None, r.time_ms or 0.0, r.id)):
        if r.kernel in kinds and r.kind != kinds[r.kernel] and r.kernel not in found:
            found[r.kernel] = {"id": r.id, "status": r.status, "ms": r.time_ms, "reason": (r.reason or "")[:300]}
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default=DEFAULT_ROWS)
    parser.add_argument("--budget", type=float, default=120.0, help="search budget per module, seconds")
    parser.add_argument("--samples", type=int, default=30)
    parser.add_argument("--database", type=Path, help="a tuning database to reuse (default: a private one)")
    parser.add_argument("--saved-statistics", action="store_true",
                        help="train: rows: the forward saves each attention's output and log-sum-exp")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    import torch
    import timm
    import transformers

    flush = L2Flush(torch)
    specs = {label: row_spec(label) for label in args.rows.split(",")}
    today = datetime.date.today().isoformat()
    gpu = torch.cuda.get_device_name(0)
    document = {
        "benchmark": "models",
        "date": today,
        "gpu": gpu,
        "versions": {"cherenkov": ck.__version__, "torch": torch.__version__, "transformers": transformers.__version__,
                     "timm": timm.__version__, "cuda": torch.version.cuda},  # fmt: skip
        "budget_s": args.budget,
        "samples": args.samples,
        "timing": "CUDA events, contenders round-robin, L2 flushed, median, host launch hidden behind a GPU spin",
        "rows": [],
    }
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"models-{gpu_label(gpu)}-{today}.json"
    rows = document["rows"]
    with tempfile.TemporaryDirectory() as scratch:
        db_path = args.database or Path(scratch) / "tuning.sqlite"
        with TuningDatabase(db_path) as db:
            for label, (builder, options) in specs.items():
                try:
                    if label.removeprefix(TRAINING) in WHOLE_MODELS:
                        rows.append(benchmark_whole_model(label, args, db, torch, flush))
                    elif label.startswith(TRAINING):
                        rows.append(benchmark_training(label, builder, options, args, db, torch, flush))
                    else:
                        rows.append(benchmark(label, builder, options, args, db, torch, flush))
                except Exception as error:  # noqa: BLE001 - a failing row is reported, the rest still run
                    log.warning("%s failed: %s", label, error)
                    rows.append({"name": label, "error": f"{type(error).__name__}: {error}"[:2000]})
                torch.cuda.empty_cache()
                path.write_text(json.dumps(document, indent=2) + "\n")
    print(f"wrote {path}")
    print(f"{'row':32} {'cherenkov':>10} {'eager':>8} {'inductor':>9} {'x eager':>8} {'x ind.':>7} {'error':>8}")
    for row in rows:
        if "error" in row:
            print(f"{row['name']:32} failed: {row['error'][:120]}")
            continue
        figures, speedup = row.get("ms") or row["tokens_per_s"], row["speedup"]
        error = row.get("rel_error", row.get("rel_error_vs_eager", row.get("grad_rel_error", {}).get("max", math.nan)))
        unit = "" if "ms" in row else " tok/s"
        print(f"{row['name']:32} {figures['cherenkov']:10.3f} {figures['eager']:8.3f} {figures['inductor']:9.3f} "
              f"{speedup['vs_eager']:8.2f} {speedup['vs_inductor']:7.2f} {error:8.2e}{unit}")  # fmt: skip


if __name__ == "__main__":
    main()
