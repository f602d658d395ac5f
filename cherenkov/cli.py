"""The ``cherenkov`` command line.

``graph`` summarises a graph, ``optimize`` searches its kernels (progress while
candidates compile, verify and time; a table of the best at the end), ``dump`` and
``report`` read a finished search's directory, ``db`` moves tuning records between
machines. Graphs come from a built-in example (``examples/NAME.py`` of the source tree)
or from ``path/to/file.py:function``; the function builds or returns a ``ck.Graph`` and
is called with ``shape=`` and ``causal=`` when those options are given.
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import re
import sys
from collections.abc import Sequence
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

import cherenkov as ck
from cherenkov.search.database import DatabaseError
from cherenkov.search.report import ReportError

EXAMPLES_DIR = Path(__file__).resolve().parent.parent / "examples"
_SOURCE = re.compile(r"(?P<path>.+\.py):(?P<function>[A-Za-z_][A-Za-z0-9_]*)")

log = logging.getLogger("cherenkov")


def example_names() -> list[str]:
    """Names of the built-in examples (``examples/*.py`` of the source tree)."""
    return sorted(p.stem for p in EXAMPLES_DIR.glob("*.py") if not p.stem.startswith("_"))


def parse_shape(text: str) -> tuple[int, ...]:
    """``"1,8,4096,8192,128"`` -> ``(1, 8, 4096, 8192, 128)``."""
    try:
        dims = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--shape {text!r}: expected comma-separated integers") from None
    if not dims or any(d <= 0 for d in dims):
        raise argparse.ArgumentTypeError(f"--shape {text!r}: every dimension must be a positive integer")
    return dims


def load_graph(source: str | None, example: str | None, shape: tuple[int, ...] | None, causal: bool) -> ck.Graph:
    """Build the graph named by ``--example NAME`` or ``path/to/file.py:function``."""
    if example is not None:
        if example not in example_names():
            raise ck.GraphError(f"--example {example!r} is not a built-in example; choose one of {example_names()}")
        path, function = EXAMPLES_DIR / f"{example}.py", "build"
    elif source is not None:
        match = _SOURCE.fullmatch(source)
        if match is None:
            raise ck.GraphError(f"{source!r} is not of the form path/to/file.py:function")
        path, function = Path(match["path"]), match["function"]
        if not path.is_file():
            raise ck.GraphError(f"{source!r}: no such file {str(path)!r}")
    else:
        raise ck.GraphError("name a graph: --example NAME or path/to/file.py:function")
    spec = importlib.util.spec_from_file_location(f"cherenkov_user_{path.stem}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    builder = getattr(module, function, None)
    if not callable(builder):
        raise ck.GraphError(f"{path}: has no function {function!r}")
    options = {}
    if shape is not None:
        options["shape"] = shape
    if causal:
        options["causal"] = True
    graph = builder(**options)
    if not isinstance(graph, ck.Graph):
        raise ck.GraphError(f"{path}:{function} returned {type(graph).__name__}, not a ck.Graph")
    return graph


def _add_graph_source(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("source", nargs="?", help="path/to/file.py:function that builds or returns a ck.Graph")
    parser.add_argument("--example", help=f"a built-in example: {', '.join(example_names()) or 'none found'}")
    parser.add_argument("--shape", type=parse_shape, help="comma-separated sizes passed to the builder as shape=")
    parser.add_argument("--causal", action="store_true", help="pass causal=True to the builder")


def command_graph(args: argparse.Namespace, console: Console) -> int:
    graph = load_graph(args.source, args.example, args.shape, args.causal)
    summary = graph.summary()
    console.print(f"[bold]graph[/bold] {summary['name']}: {summary['nodes']} nodes, {summary['flops'] / 1e9:.3f} GFLOP")
    table = Table("kind", "name", "shape", "dtype")
    for kind in ("inputs", "outputs"):
        for name, info in summary[kind].items():
            table.add_row(kind[:-1], name, "x".join(map(str, info["shape"])), info["dtype"])
    console.print(table)
    ops = Table("op", "count")
    for op, count in summary["ops"].items():
        ops.add_row(op, str(count))
    console.print(ops)
    return 0


class _SearchProgress:
    """Renders optimize's progress events: compile and measure bars, best so far."""

    def __init__(self, console: Console) -> None:
        self.bars = Progress(
            TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
            TextColumn("{task.fields[best]}"), console=console, transient=False,
        )
        self.tasks: dict[str, int] = {}
        self.best: float | None = None
        self.console = console

    def __call__(self, event: str, **info: object) -> None:
        if event == "derived":
            stats = info["stats"]
            self.console.print(
                f"derived {', '.join(map(str, info['kernels']))} "  # type: ignore[call-overload]
                f"({stats.enodes} e-nodes, {stats.iterations} passes, {stats.seconds:.2f} s)"  # type: ignore[attr-defined]
            )
        elif event == "first_round":
            self.console.print(
                f"budget: first {info['candidates']} candidates (each of {info['kernels']} kernels' favourite and "
                f"safest plan), then the rest of {info['total']} shared by each kernel's share of the time"
            )
        elif event == "answered":
            how = ("a partial search's answer (--resume or a larger --budget measures the rest, --force starts over)"
                   if info.get("partial") else "use --force to search again")
            self.console.print(f"answered from the tuning database ({how})")
        elif event in ("compiled", "measured"):
            if not self.tasks:
                self.bars.start()
            name = "compile" if event == "compiled" else "verify+time"
            if name not in self.tasks:
                self.tasks[name] = self.bars.add_task(name, total=info["total"], best="")
            time_ms = info.get("time_ms")
            if info.get("status") == "ok" and isinstance(time_ms, float):
                self.best = time_ms if self.best is None else min(self.best, time_ms)
            best = f"best {self.best:.3f} ms" if self.best is not None else ""
            self.bars.update(self.tasks[name], completed=info["done"], best=best)

    def close(self) -> None:
        if self.tasks:
            self.bars.stop()


def command_optimize(args: argparse.Namespace, console: Console) -> int:
    from cherenkov.search.optimize import optimize

    graph = load_graph(args.source, args.example, args.shape, args.causal)
    out = args.out or Path("runs") / (args.example or Path(args.source.split(":")[0]).stem)
    progress = _SearchProgress(console)
    try:
        cluster = "local-gpus" if args.local_gpus else args.cluster
        result = optimize(graph, target=args.target, out=out, budget_s=args.budget, force=args.force,
                          resume=args.resume, progress=progress, cluster=cluster)  # fmt: skip
    finally:
        progress.close()
    env = result.environment
    for note in result.summary.notes:
        console.print(f"[yellow]note:[/yellow] {note}", highlight=False)
    how = f"measured on {env.gpu}" if env.measured else "[bold]modelled[/bold] by the cost model (not measured)"
    summary = result.summary
    partial = f" (partial: measured {summary.measured} of them)" if summary.partial else ""
    console.print(f"target {env.target}, {how}; {len(result.candidates)} candidates{partial}")
    table = Table("rank", "status", "ms", "TFLOP/s", "% peak", "regs", "smem KB")
    table.add_column("candidate", overflow="fold")  # whole keys, folded over lines where the console is narrow
    ranked = sorted(result.candidates, key=lambda r: (r.status not in ("ok", "modelled"), r.time_ms or 1e9, r.id))
    for rank, r in enumerate(ranked[: args.top], start=1):
        table.add_row(
            str(rank), r.status, f"{r.time_ms:.4f}" if r.time_ms else "-",
            f"{r.tflops:.1f}" if r.tflops else "-", f"{r.percent_of_peak:.0f}" if r.percent_of_peak else "-",
            str(r.registers or "-"), f"{r.smem_bytes / 1024:.0f}" if r.smem_bytes else "-", r.id,
        )  # fmt: skip
    console.print(table)
    for name, tflops in result.summary.references.items():
        console.print(f"  reference {name}: {tflops:.1f} TFLOP/s (same run)")
    console.print(f"report: {result.report_html}", soft_wrap=True)
    return 0


def _read_report(directory: Path) -> dict:
    from cherenkov.search.report import read_json

    path = directory / "report.json"
    if not path.is_file():
        raise ck.GraphError(f"{directory}: no report.json here; run `cherenkov optimize --out {directory}` first")
    return read_json(path)


def command_dump(args: argparse.Namespace, console: Console) -> int:
    report = _read_report(args.directory)
    sources = report.get("sources", {})
    if not sources:
        raise ck.GraphError(f"{args.directory}: the search found no kernel to dump")
    kernel = max(sources, key=lambda k: len(sources[k]))
    if args.out is None:
        sys.stdout.write(sources[kernel])
    else:
        args.out.write_text(sources[kernel])
        console.print(f"wrote {args.out}", soft_wrap=True)  # a path whole, never wrapped
    return 0


def command_report(args: argparse.Namespace, console: Console) -> int:
    from cherenkov.search.report import write_csv

    report = _read_report(args.directory)
    if args.csv is not None:
        path = args.directory / "candidates.csv" if args.csv == "" else Path(args.csv)
        write_csv(report, path)
        console.print(f"wrote {path}", soft_wrap=True)
    console.print(str((args.directory / "report.html").resolve()), soft_wrap=True)
    return 0


def command_db(args: argparse.Namespace, console: Console) -> int:
    from cherenkov.search.database import TuningDatabase

    with TuningDatabase() as db:
        if args.action == "export":
            db.export(args.file)
            console.print(f"exported tuning records to {args.file}")
        elif args.action == "import":
            winners, candidates = db.import_(args.file)
            console.print(f"imported {winners} winners and {candidates} candidate records")
        else:
            stats = db.stats().to_json()
            table = Table("field", "value")
            for field, value in stats.items():
                table.add_row(field, str(value))
            console.print(table)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="cherenkov",
        description="Search-based kernel superoptimiser: derive fused kernels with e-graph rewrites, "
        "generate CUDA, measure, keep the fastest correct one.",
    )
    parser.add_argument("--version", action="version", version=f"cherenkov {ck.__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress details")
    commands = parser.add_subparsers(dest="command", required=True)
    graph = commands.add_parser("graph", help="summarise a graph: inputs, outputs, op counts, FLOPs")
    _add_graph_source(graph)
    graph.set_defaults(handler=command_graph)

    search = commands.add_parser("optimize", help="search the fastest correct kernels of a graph")
    _add_graph_source(search)
    search.add_argument("--target", default="auto",
                        help="auto (the local GPU: sm_90a on Hopper; else sm_120), sm_80, sm_86, sm_89, sm_90, sm_90a, sm_120")
    search.add_argument("--out", type=Path, help="directory for report.json and report.html (default runs/NAME)")
    search.add_argument("--budget", type=float,
                        help="wall-time budget in seconds: every kernel's favourite and safest plan first, the rest "
                             "shared by each kernel's share of the graph's time; the answer is remembered as partial")
    search.add_argument("--resume", action="store_true",
                        help="continue a partial (budgeted) search: measure only the candidates not yet measured")
    search.add_argument("--force", action="store_true",
                        help="search again, measuring every candidate, even if the tuning database knows the answer")
    search.add_argument("--top", type=int, default=10, help="rows of the final table")
    spread = search.add_mutually_exclusive_group()
    spread.add_argument("--cluster", help="Dask scheduler address (tcp://host:8786): compile and measure on its workers")
    spread.add_argument("--local-gpus", action="store_true", help="start a local Dask cluster with one worker per GPU")
    search.set_defaults(handler=command_optimize)

    dump = commands.add_parser("dump", help="write the best kernel's CUDA source of a finished search")
    dump.add_argument("directory", type=Path)
    dump.add_argument("--out", type=Path, help="file to write (default: standard output)")
    dump.set_defaults(handler=command_dump)

    report = commands.add_parser("report", help="print the path of a search's HTML report")
    report.add_argument("directory", type=Path)
    report.add_argument("--csv", nargs="?", const="", help="also write the candidates table as CSV (default DIR/candidates.csv)")
    report.set_defaults(handler=command_report)

    db = commands.add_parser("db", help="the tuning database: stats, export, import")
    db.add_argument("action", nargs="?", choices=("stats", "export", "import"), default="stats")
    db.add_argument("file", nargs="?", type=Path)
    db.set_defaults(handler=command_db)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "action", None) in ("export", "import") and args.file is None:
        parser.error(f"db {args.action} needs a FILE")
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(message)s")
    console = Console()
    try:
        return args.handler(args, console)
    except (ck.GraphError, DatabaseError, ReportError) as error:
        console.print(f"[red]error:[/red] {error}", highlight=False)
        return 2


if __name__ == "__main__":
    sys.exit(main())
