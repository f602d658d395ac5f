"""The ``cherenkov`` command line.

``cherenkov graph --example attention`` prints a graph's inputs, outputs, op counts and
FLOPs. Graphs come from a built-in example (``examples/NAME.py`` of the source tree) or
from ``path/to/file.py:function``; the function builds or returns a ``ck.Graph`` and is
called with ``shape=`` and ``causal=`` when those options are given.
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
from rich.table import Table

import cherenkov as ck

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
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(message)s")
    console = Console()
    try:
        return args.handler(args, console)
    except ck.GraphError as error:
        console.print(f"[red]error:[/red] {error}", highlight=False)
        return 2


if __name__ == "__main__":
    sys.exit(main())
