"""The kernel DAG's queries against the kernel lists they replace, on a transformer block."""

from __future__ import annotations

import sys
from pathlib import Path

import cherenkov as ck
from cherenkov.rewrites import dag

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def block_kernels():
    sys.path.insert(0, str(EXAMPLES))
    import transformer_block

    graph = transformer_block.build((1, 64, 2, 64, 128))
    return graph, ck.derive(graph).kernels


def test_readers_needed_and_last_readers_follow_the_kernel_reads() -> None:
    graph, kernels = block_kernels()
    kernel_graph = dag.kernel_dag(kernels)
    for kernel in kernels:
        expected = [k.output for k in kernels if kernel.output in k.reads]
        assert sorted(dag.readers(kernel_graph, kernel.output)) == sorted(expected)
    assert dag.needed(kernel_graph, graph.outputs) >= {k.output for k in kernels}, "every kernel feeds the output"
    order = [k.output for k in kernels]
    last = dag.last_readers(kernel_graph, order)
    for buffer, reader in last.items():
        later = [k.output for k in kernels[order.index(reader) + 1 :] if buffer in k.reads]
        assert buffer in dict(zip(order, kernels))[reader].reads and not later
    assert dag.readers(kernel_graph, "not-a-buffer") == []


def test_a_consumer_that_reads_around_a_producer_drops_it_from_what_is_needed() -> None:
    graph, kernels = block_kernels()
    norm = next(k for k in kernels if k.kind == "rms_norm_rows")
    inputs = {name for name in norm.reads}

    def reads(kernel):  # as if every reader of the norm computed it from the norm's inputs
        return tuple(inputs) if norm.output in kernel.reads else kernel.reads

    kernel_graph = dag.kernel_dag([k for k in kernels if k is not norm], reads)
    assert norm.output not in dag.needed(kernel_graph, graph.outputs)
