"""Wall time of the seed attention search: local, and on a local Dask cluster of N GPUs.

One process runs the same search (``force=True``: every candidate compiled or taken from
the kernel cache, then verified and timed) on the local path and with ``--local-gpus``
restricted to N = 1, 2, ... GPUs through ``CUDA_VISIBLE_DEVICES``, checks that every
run picks the same winner, and writes ``benchmarks/results/distributed-<gpu>-<date>.json``.

    python benchmarks/search_scaling.py [--gpus 1,2] [--out DIR]
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import sys
import time
from pathlib import Path

import cherenkov as ck
from cherenkov.search.environment import visible_gpus

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "examples"))

log = logging.getLogger("benchmarks.search_scaling")


def seed_graph() -> ck.Graph:
    import attention  # examples/attention.py

    return attention.build()


def timed_search(label: str, out: Path, cluster: str | None) -> dict:
    start = time.perf_counter()
    result = ck.optimize(seed_graph(), out=out / label, force=True, cluster=cluster)
    wall = time.perf_counter() - start
    measured = sum(1 for c in result.candidates if c.status in ("ok", "stopped_early"))
    row = {
        "mode": label,
        "wall_s": round(wall, 2),
        "candidates": len(result.candidates),
        "measured": measured,
        "best": result.best.result.id,
        "best_tflops": round(result.best.tflops, 1),
    }
    log.warning("%s", row)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpus", default="1,2", help="GPU counts to try, comma-separated")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    gpus = visible_gpus()
    runs_dir = Path(os.environ.get("TMPDIR", "/tmp")) / "cherenkov-distributed"
    rows = [timed_search("local", runs_dir, None)]
    for count in (int(n) for n in args.gpus.split(",")):
        if count > len(gpus):
            log.warning("skipping N=%d: only %d GPUs visible", count, len(gpus))
            continue
        os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(str(g.index) for g in gpus[:count])
        rows.append(timed_search(f"dask-{count}gpu", runs_dir, "local-gpus"))
    os.environ.pop("CUDA_VISIBLE_DEVICES", None)
    date = datetime.date.today().isoformat()
    name = gpus[0].name.replace("NVIDIA ", "").replace(" ", "-").lower() if gpus else "cpu"
    document = {
        "gpu": gpus[0].name if gpus else None,
        "gpus": len(gpus),
        "date": date,
        "versions": {"cherenkov": ck.__version__},
        "same_best": len({r["best"] for r in rows}) == 1,
        "rows": rows,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"distributed-{name}x{len(gpus)}-{date}.json"
    path.write_text(json.dumps(document, indent=2) + "\n")
    print(json.dumps(document, indent=2))


if __name__ == "__main__":
    main()
