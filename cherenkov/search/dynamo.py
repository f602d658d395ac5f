"""``torch.compile(model, backend="cherenkov")``: a Dynamo backend.

Dynamo hands the backend an FX graph and example inputs per guarded specialisation (a new
shape or dtype is a new call; a shape seen before reuses Dynamo's compiled code, so no new
search). The backend traces the graph to ATen ops (``make_fx``), partitions it into the
largest regions whose every op :func:`~cherenkov.graph.torch_capture.lowers_node` (``torch.fx``'s
capability partitioner), and replaces each region by a :class:`~cherenkov.search.compiled.
CompiledFunction` of it — a ``ck.Graph`` searched for the GPU at hand. Ops outside those
regions run as the ATen ops they are. Without a GPU (or with CPU inputs) the whole graph
runs the fallback way (``options={"fallback": "inductor"}``, the default, or ``"eager"``) and
the backend says so once. Registered through the ``torch_dynamo_backends`` entry point;
other ``options`` go to every search (``budget_s``, ``target``, ``database``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from cherenkov.graph.errors import GraphError
from cherenkov.graph.torch_capture import lowers_node, takes_as_input
from cherenkov.search.compiled import CompiledFunction

log = logging.getLogger(__name__)

FALLBACKS = ("inductor", "eager")
_said: set[str] = set()


def _say_once(message: str) -> None:
    if message not in _said:
        _said.add(message)
        log.warning("%s", message)


@dataclass(frozen=True)
class SplitGraph:
    """An ATen graph whose supported regions are :class:`CompiledFunction` submodules
    (``module``), with those regions' functions in order (``compiled``)."""

    module: Any
    compiled: tuple[CompiledFunction, ...]


def split_supported(gm: Any, example_inputs: Sequence[Any], **optimize_kwargs: Any) -> SplitGraph:
    """``gm`` traced to ATen ops, each maximal region of ops cherenkov lowers made a
    :class:`CompiledFunction` (prepared for the region's example inputs); the other ops stay
    ATen nodes of the returned module, as does a region whose capture or search fails (the
    log names it and the error)."""
    import torch
    from torch.fx.experimental.proxy_tensor import make_fx
    from torch.fx.passes.infra.partitioner import CapabilityBasedPartitioner
    from torch.fx.passes.operator_support import OperatorSupport

    class Lowerable(OperatorSupport):
        def is_node_supported(self, submodules: Any, node: Any) -> bool:
            return lowers_node(node) and _graph_holds(node)

    aten = _drop_empty_concatenations(make_fx(gm)(*example_inputs))
    partitioner = CapabilityBasedPartitioner(aten, Lowerable(), allows_single_node_partition=False)
    fused = partitioner.fuse_partitions(partitioner.propose_partitions())
    region_inputs = _region_inputs(fused, example_inputs)
    class Region(torch.nn.Module):
        """A fused region's place in the split module: calls its compiled function."""

        def __init__(self, function: CompiledFunction) -> None:
            super().__init__()
            self.function = function

        def forward(self, *tensors: Any) -> Any:
            return self.function(*tensors)

    compiled = []
    for node in list(fused.graph.nodes):
        if not _is_region(node):
            continue
        region = getattr(fused, node.target)
        function = CompiledFunction(region, dict(optimize_kwargs))
        try:
            function.prepare(region_inputs[node.name])
        except Exception as error:  # noqa: BLE001 - any failure leaves the region to ATen, said in the log
            log.warning("cherenkov backend: region %s (%d ops) runs as ATen ops: %s: %s", node.target,
                        sum(n.op == "call_function" for n in region.graph.nodes), type(error).__name__, error)  # fmt: skip
            continue
        setattr(fused, node.target, Region(function))
        compiled.append(function)
    fused.recompile()
    return SplitGraph(fused, tuple(compiled))


def _drop_empty_concatenations(aten: Any) -> Any:
    """``aten`` with the empty operands of every ``cat`` removed (a ``cat`` left with one operand
    is that operand): an empty key/value cache's first concatenation is then no op, and the
    attention it fed joins a region."""
    import torch

    for node in list(aten.graph.nodes):
        if node.op != "call_function" or node.target is not torch.ops.aten.cat.default:
            continue
        pieces = [p for p in node.args[0] if not _is_empty(p)]
        if not pieces or len(pieces) == len(node.args[0]):
            continue
        if len(pieces) == 1 and tuple(pieces[0].meta["val"].shape) == tuple(node.meta["val"].shape):
            node.replace_all_uses_with(pieces[0])
        else:
            node.args = (pieces, *node.args[1:])
    aten.graph.eliminate_dead_code()
    aten.recompile()
    return aten


def _is_empty(node: Any) -> bool:
    value = node.meta.get("val") if hasattr(node, "meta") else None
    return value is not None and value.numel() == 0


def _graph_holds(node: Any) -> bool:
    """Whether every tensor ``node`` reads and writes is one a ``ck.Graph`` input can be
    (integer index tensors, bool masks and empty constants stay outside the regions)."""
    import torch

    values = [node.meta.get("val")] + [a.meta.get("val") for a in node.all_input_nodes]
    return all(takes_as_input(v) for v in values if isinstance(v, torch.Tensor))


def _is_region(node: Any) -> bool:
    """Whether ``node`` calls a region the partitioner fused (a ``fused_*`` submodule)."""
    return node.op == "call_module" and str(node.target).startswith("fused_")


def _region_inputs(fused: Any, example_inputs: Sequence[Any]) -> dict[str, list[Any]]:
    """The tensors each fused region (``call_module`` node ``fused_*``) receives when the
    split module runs on ``example_inputs``: real values (index tensors stay valid) on the
    inputs' device."""
    import torch

    recorded: dict[str, list[Any]] = {}

    class Recorder(torch.fx.Interpreter):
        def run_node(self, node: Any) -> Any:
            if _is_region(node):
                recorded[node.name] = list(self.map_nodes_to_values(node.args, node))
            return super().run_node(node)

    with torch.no_grad():
        Recorder(fused).run(*example_inputs)
    return recorded


def _fallback(gm: Any, example_inputs: Sequence[Any], fallback: str) -> Callable[..., Any]:
    if fallback == "eager":
        return gm.forward
    from torch._inductor.compile_fx import compile_fx

    return compile_fx(gm, list(example_inputs))


def cherenkov_backend(gm: Any, example_inputs: Sequence[Any], **kwargs: Any) -> Callable[..., Any]:
    """The Dynamo backend: ``torch.compile(model, backend="cherenkov", options={...})``."""
    import torch

    options = dict(kwargs.get("options") or {})
    fallback = options.pop("fallback", "inductor")
    if fallback not in FALLBACKS:
        raise GraphError(f"cherenkov backend: fallback {fallback!r} (valid: {', '.join(FALLBACKS)})")
    tensors = [x for x in example_inputs if isinstance(x, torch.Tensor)]
    if not torch.cuda.is_available() or not tensors or not all(t.is_cuda for t in tensors):
        _say_once(f"cherenkov backend: no CUDA inputs; the graph runs through {fallback} instead")
        return _fallback(gm, example_inputs, fallback)
    split = split_supported(gm, example_inputs, **options)
    if not split.compiled:
        _say_once(f"cherenkov backend: no op of this graph lowers to cherenkov; it runs through {fallback}")
        return _fallback(gm, example_inputs, fallback)
    return split.module.forward
