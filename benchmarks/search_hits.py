"""How fast a remembered search answers: a budgeted search, then the same call again.

One process runs ``ck.optimize`` on the seed attention graph (and the transformer-block
example) under a budget — the first round, then the rest shared by kernel — and then
repeats the call: in the same (warm) process, and as ``cherenkov optimize`` commands
(interpreter start included). A repeat must be answered from the tuning database, with
no candidate generated or compiled. Writes ``benchmarks/results/search-hits-<gpu>-<date>.json``
with the wall times and what each first search measured.

    python benchmarks/search_hits.py [--budget 40] [--repeats 3] [--out DIR]
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import cherenkov as ck
from cherenkov.search.environment import detect
from gpu_label import gpu_label

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "examples"))

log = logging.getLogger("benchmarks.search_hits")


def graphs() -> dict[str, tuple[ck.Graph, list[str]]]:
    """Each graph and the CLI arguments that build the same one."""
    import attention  # examples/attention.py
    import transformer_block

    return {
        "attention": (attention.build(), ["--example", "attention"]),
        "transformer_block": (transformer_block.build(), ["--example", "transformer_block"]),
    }


def measure(name: str, graph: ck.Graph, cli_args: list[str], budget: float, repeats: int, out: Path) -> dict:
    start = time.perf_counter()
    first = ck.optimize(graph, out=out / name, budget_s=budget)
    first_s = time.perf_counter() - start
    warm = []
    for _ in range(repeats):
        start = time.perf_counter()
        again = ck.optimize(graph, out=out / f"{name}-again", budget_s=budget)
        warm.append(time.perf_counter() - start)
        assert again.from_database, f"{name}: a repeated search must be answered from the database"
    cli = []
    command = [sys.executable, "-m", "cherenkov", "optimize", *cli_args, "--budget", str(budget),
               "--out", str(out / f"{name}-cli")]  # fmt: skip
    for _ in range(repeats):
        start = time.perf_counter()
        done = subprocess.run(command, capture_output=True, text=True, check=True)
        cli.append(time.perf_counter() - start)
        assert "answered from the tuning database" in done.stdout, done.stdout[-2000:]
    summary = first.summary
    row = {
        "graph": name,
        "budget_s": budget,
        "first_search_s": round(first_s, 2),
        "candidates": len(summary.candidates),
        "measured": summary.measured,
        "partial": summary.partial,
        "winners": {k: w.result.id for k, w in first.kernels.items()},
        "warm_hit_s": {"median": round(statistics.median(warm), 4), "all": [round(t, 4) for t in warm]},
        "cli_hit_s": {"median": round(statistics.median(cli), 3), "all": [round(t, 3) for t in cli]},
    }
    log.warning("%s", json.dumps(row))
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget", type=float, default=40.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--graphs", default="attention,transformer_block")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    env = detect().environment
    rows = []
    with tempfile.TemporaryDirectory() as runs:
        for name in args.graphs.split(","):
            graph, cli_args = graphs()[name]
            rows.append(measure(name, graph, cli_args, args.budget, args.repeats, Path(runs)))
    today = datetime.date.today().isoformat()
    gpu = gpu_label(env.gpu or "cpu")
    document = {
        "benchmark": "search_hits",
        "date": today,
        "environment": env.to_json(),
        "rows": rows,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"search-hits-{gpu}-{today}.json"
    path.write_text(json.dumps(document, indent=2) + "\n")
    print(f"wrote {path}")
    for row in rows:
        print(f"{row['graph']}: first {row['first_search_s']} s ({row['measured']} of {row['candidates']} measured), "
              f"warm hit {row['warm_hit_s']['median']} s, CLI hit {row['cli_hit_s']['median']} s")


if __name__ == "__main__":
    main()
