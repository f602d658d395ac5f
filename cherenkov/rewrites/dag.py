"""The kernel DAG: which kernel reads which buffer, as a ``networkx`` DiGraph.

Nodes are buffers: the graph's inputs and each kernel's output (a kernel is named by its
output); an edge ``u → v`` says the kernel writing ``v`` reads ``u``. A kernel's side outputs
(an attention backward writes dq, dk and dv at once) hang off its output by an edge each, so
whatever needs one needs the kernel. Kernels are in execution order, so the DAG's topological order is theirs.
Questions about producers and consumers are graph queries here rather than walks over
kernel lists: how many kernels read a buffer (:func:`readers`: a producer that one consumer
alone reads may join it or be laid out for it), which kernels the outputs need
(:func:`needed`: a producer whose consumer absorbed it drops out), and after which kernel a
buffer is dead (:func:`last_readers`: when an intermediate can be freed).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import networkx as nx


class Kernel(Protocol):
    output: str
    reads: tuple[str, ...]
    side_outputs: tuple[Any, ...]  # each with an ``output`` name


def kernel_dag(kernels: Iterable[Kernel], reads: Callable[[Kernel], Iterable[str]] | None = None) -> nx.DiGraph:
    """The DAG of ``kernels`` (each node ``kernel`` attribute: the kernel writing it);
    ``reads`` gives the buffers a kernel reads (default: its ``reads``). networkx is
    imported here, on first use (it takes a noticeable part of a second), so a derivation
    that asks the DAG nothing — a remembered answer of plain attention — never loads it."""
    import networkx

    dag = networkx.DiGraph()
    for kernel in kernels:
        dag.add_node(kernel.output, kernel=kernel)
        dag.add_edges_from((name, kernel.output) for name in (reads(kernel) if reads else kernel.reads))
        for side in getattr(kernel, "side_outputs", ()):
            dag.add_node(side.output, kernel=kernel)
            dag.add_edge(kernel.output, side.output)
    return dag


def readers(dag: nx.DiGraph, buffer: str) -> list[str]:
    """The kernels (by output) that read ``buffer``."""
    return list(dag.successors(buffer)) if buffer in dag else []


def needed(dag: nx.DiGraph, outputs: Iterable[str]) -> set[str]:
    """Every buffer the ``outputs`` depend on, themselves included."""
    import networkx

    result = set(outputs)
    for output in list(result):
        result |= networkx.ancestors(dag, output)
    return result


def last_readers(dag: nx.DiGraph, order: Sequence[str]) -> dict[str, str]:
    """For each buffer some kernel of ``order`` (kernel outputs, in launch order) reads, the
    last of them to read it: after that kernel the buffer is dead."""
    position = {name: i for i, name in enumerate(order)}
    result = {}
    for buffer in dag.nodes:
        reading = [r for r in dag.successors(buffer) if r in position]
        if reading:
            result[buffer] = max(reading, key=position.__getitem__)
    return result
