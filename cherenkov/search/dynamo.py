"""``torch.compile(model, backend="cherenkov")``: a Dynamo backend.

Dynamo hands the backend an FX graph and example inputs per guarded specialisation (a new
shape or dtype is a new call; a shape seen before reuses Dynamo's compiled code, so no new
search). The backend traces the graph to ATen ops (``make_fx``), partitions it into the
largest regions whose every op :func:`~cherenkov.graph.torch_capture.lowers` (``torch.fx``'s
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
from cherenkov.graph.torch_capture import lowers
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
    ATen nodes of the returned module."""
    import torch
    from torch.fx.experimental.proxy_tensor import make_fx
    from torch.fx.passes.infra.partitioner import CapabilityBasedPartitioner
    from torch.fx.passes.operator_support import OperatorSupport
    from torch.fx.passes.shape_prop import ShapeProp

    class Lowerable(OperatorSupport):
        def is_node_supported(self, submodules: Any, node: Any) -> bool:
            return node.op == "call_function" and lowers(node.target)

    aten = make_fx(gm)(*example_inputs)
    partitioner = CapabilityBasedPartitioner(aten, Lowerable(), allows_single_node_partition=False)
    fused = partitioner.fuse_partitions(partitioner.propose_partitions())
    ShapeProp(fused).propagate(*example_inputs)
    device = next((x.device for x in example_inputs if isinstance(x, torch.Tensor)), torch.device("cpu"))
    class Region(torch.nn.Module):
        """A fused region's place in the split module: calls its compiled function."""

        def __init__(self, function: CompiledFunction) -> None:
            super().__init__()
            self.function = function

        def forward(self, *tensors: Any) -> Any:
            return self.function(*tensors)

    compiled = []
    for node in list(fused.graph.nodes):
        if node.op != "call_module" or not str(node.target).startswith("fused_"):
            continue
        region = getattr(fused, node.target)
        function = CompiledFunction(region, dict(optimize_kwargs))
        function.prepare([_example(arg, device) for arg in node.args])
        setattr(fused, node.target, Region(function))
        compiled.append(function)
    fused.recompile()
    return SplitGraph(fused, tuple(compiled))


def _example(arg: Any, device: Any) -> Any:
    """A random tensor on ``device`` of the shape and dtype of the FX node ``arg``'s propagated
    value (``tensor_meta`` records no device: the graph's inputs share one)."""
    import torch

    meta = arg.meta.get("tensor_meta") if hasattr(arg, "meta") else None
    if meta is None:
        raise GraphError(f"cherenkov backend: region input {arg} has no tensor metadata")
    return torch.randn(tuple(meta.shape), dtype=meta.dtype, device=device)


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
