"""``ck.compile``: a PyTorch module or function as a callable that runs cherenkov's kernels.

``compile(fn, *example_tensors, dynamic=(), **optimize_kwargs)`` returns a
:class:`CompiledFunction` with ``fn``'s positional signature: tensors in, ``fn``'s result
(one tensor or a tuple) out. A call on inputs of a shape, dtype and device it has not seen
captures ``fn`` there (:func:`~cherenkov.from_torch`) and, for CUDA tensors, searches its
kernels (:func:`~cherenkov.optimize`, with ``optimize_kwargs``: a repeated shape is a
tuning-database hit); every later call with that signature goes straight to the kernels.
``dynamic`` lists more signatures (tuples of input shapes) to prepare at once.

Parameters and buffers are bound, not copied: each call reads the module's tensors by
their dotted names (``Graph.captured_sources``), so in-place updates (an optimiser step,
``load_state_dict``) reach the next call. Lifted constants keep their captured values.
Without a GPU (CPU tensors) a call evaluates the captured graph with the float64
reference and says so once in the log: slow, for checking bindings and semantics.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from cherenkov.codegen.launch import TORCH_DTYPES
from cherenkov.graph import GraphError, evaluate, from_torch
from cherenkov.graph.tensor import Graph

log = logging.getLogger(__name__)

Signature = tuple[tuple[tuple[int, ...], str, str], ...]
"""One prepared call: (shape, torch dtype name, device type) of each positional input."""


def signature_of(tensors: Sequence[Any]) -> Signature:
    """The signature a call's tensors prepare or look up."""
    return tuple((tuple(t.shape), str(t.dtype).removeprefix("torch."), t.device.type) for t in tensors)


@dataclass
class PreparedCall:
    """One signature's captured graph and (on CUDA) its searched kernels."""

    graph: Graph
    result: Any | None  # OptimizeResult on CUDA, None on the CPU


@dataclass
class CompiledFunction:
    """``fn`` compiled by :func:`compile`; call it like ``fn``. ``prepared`` maps each
    signature seen (or listed in ``dynamic``) to its :class:`PreparedCall`; ``searches``
    counts the captures (one per new signature)."""

    fn: Callable[..., Any]
    optimize_kwargs: dict[str, Any] = field(default_factory=dict)
    prepared: dict[Signature, PreparedCall] = field(default_factory=dict)
    searches: int = 0
    _warned_cpu: bool = False

    def __call__(self, *tensors: Any) -> Any:
        _check_tensors(tensors)
        call = self.prepare(tensors)
        inputs = self._bind(call.graph, tensors)
        if call.result is None:
            outputs = self._evaluate_on_cpu(call.graph, inputs)
        else:
            outputs = call.result.run(**inputs)
        values = [outputs[name] for name in call.graph.outputs]
        return values[0] if len(values) == 1 else tuple(values)

    def prepare(self, tensors: Sequence[Any]) -> PreparedCall:
        """The prepared call of these tensors' signature: captured (and searched) on first use."""
        key = signature_of(tensors)
        if key not in self.prepared:
            graph = from_torch(self.fn, *tensors)
            result = None
            if all(t.device.type == "cuda" for t in tensors):
                from cherenkov.search.optimize import optimize

                result = optimize(graph, **self.optimize_kwargs)
            self.prepared[key] = PreparedCall(graph, result)
            self.searches += 1
            log.info("ck.compile: prepared %s for %s", graph.name, key)
        return self.prepared[key]

    def _bind(self, graph: Graph, tensors: Sequence[Any]) -> dict[str, Any]:
        """Every graph input: a positional argument, the module's live parameter or buffer of
        that dotted name, or (a lifted constant) its captured value."""
        import torch

        sources = graph.captured_sources
        inputs: dict[str, Any] = {}
        device = tensors[0].device if tensors else torch.device("cpu")
        for name, spec in graph.inputs.items():
            source = sources.get(name)
            if source is None:
                raise GraphError(f"ck.compile: input {name!r} of {graph.name!r} has no recorded source")
            if source.startswith("arg:"):
                value = tensors[int(source[4:])]
            else:
                value = self._state_tensor(source)
                if value is None:  # a lifted constant: the value it was captured with
                    example = graph.example_inputs()[name]
                    value = torch.from_numpy(np.asarray(example)).to(getattr(torch, TORCH_DTYPES[spec.dtype]))
                value = value.to(device)
            inputs[name] = value if value.is_contiguous() else value.contiguous()
        return inputs

    def _state_tensor(self, dotted: str) -> Any | None:
        """The module's parameter or buffer named ``dotted`` (None for a lifted constant)."""
        import torch

        if not isinstance(self.fn, torch.nn.Module):
            return None
        for getter in (self.fn.get_parameter, self.fn.get_buffer):
            try:
                return getter(dotted).detach()
            except AttributeError:
                continue
        return None

    def _evaluate_on_cpu(self, graph: Graph, inputs: dict[str, Any]) -> dict[str, Any]:
        import torch

        if not self._warned_cpu:
            log.warning("ck.compile: no CUDA tensors; %s runs as the captured graph's float64 reference on the CPU "
                        "(for checking: slow)", graph.name)  # fmt: skip
            self._warned_cpu = True
        values = evaluate(graph, {n: v.detach().double().cpu().numpy() for n, v in inputs.items()})
        outputs = {}
        for name, value in values.items():
            dtype = getattr(torch, TORCH_DTYPES.get(graph.outputs[name].dtype, "float32"))
            # contiguous, as the kernels' outputs are (ATen kernels after a region may need a unit inner stride)
            outputs[name] = torch.from_numpy(np.ascontiguousarray(value)).to(dtype)
        return outputs


def _check_tensors(tensors: Sequence[Any]) -> None:
    import torch

    for i, value in enumerate(tensors):
        if not isinstance(value, torch.Tensor):
            raise GraphError(f"ck.compile: argument {i} is a {type(value).__name__}; the compiled function takes "
                             "tensors only (bind other arguments with functools.partial)")  # fmt: skip
    devices = {t.device for t in tensors}
    if len(devices) > 1:
        raise GraphError(f"ck.compile: the arguments are on {sorted(map(str, devices))}; put them on one device")


def compile(  # noqa: A001 - the public name, as torch.compile
    fn: Callable[..., Any], *example_tensors: Any, dynamic: Iterable[Sequence[Sequence[int]]] = (),
    **optimize_kwargs: Any,
) -> CompiledFunction:
    """``fn`` (an ``nn.Module`` or a function of tensors) as a :class:`CompiledFunction`,
    prepared for ``example_tensors`` and for each shape tuple in ``dynamic`` (the examples'
    dtypes and device); ``optimize_kwargs`` go to every search (``target``, ``budget_s``,
    ``database``, ...)."""
    import torch

    if not callable(fn):
        raise GraphError(f"ck.compile: expected an nn.Module or a function, got {type(fn).__name__}")
    _check_tensors(example_tensors)
    compiled = CompiledFunction(fn, dict(optimize_kwargs))
    if example_tensors:
        compiled.prepare(example_tensors)
    for shapes in dynamic:
        shapes = [tuple(s) for s in shapes]
        if len(shapes) != len(example_tensors):
            raise GraphError(f"ck.compile: dynamic signature {shapes} has {len(shapes)} shapes for "
                             f"{len(example_tensors)} example tensors")  # fmt: skip
        compiled.prepare([torch.randn(s, dtype=t.dtype, device=t.device) for s, t in zip(shapes, example_tensors)])
    return compiled
