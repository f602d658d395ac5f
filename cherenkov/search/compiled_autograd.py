"""Gradients through a compiled function: its backward is ``ck.grad`` of the captured graph.

A call of a :class:`~cherenkov.search.compiled.CompiledFunction` on tensors that need a
gradient — a positional argument with ``requires_grad``, or a parameter of the compiled module
— goes through :class:`CompiledGradient`, a ``torch.autograd.Function``: its forward is the
function's own op (the searched forward kernels), its backward runs the gradient graph
``ck.grad(graph, wrt=…)`` of the signature's captured graph with respect to those inputs,
prepared once per signature and set of inputs like the forward: searched and launched on CUDA
(where the derivation finds an attention's fused backward, that kernel), its float64
reference on the CPU. Gradients of parameters reach ``param.grad`` as usual, so an optimiser
step after ``loss.backward()`` trains the module through cherenkov's kernels.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from cherenkov.graph.autodiff import grad
from cherenkov.graph.shape import FLOAT_DTYPES

if TYPE_CHECKING:
    from cherenkov.search.compiled import CompiledFunction, PreparedCall


def needs_gradient(function: CompiledFunction, tensors: Sequence[Any]) -> bool:
    """Whether a call builds a graph for autograd: grad mode on, and an argument or a
    parameter of the module requiring a gradient."""
    if not torch.is_grad_enabled():
        return False
    if any(t.requires_grad for t in tensors):
        return True
    return isinstance(function.fn, torch.nn.Module) and any(p.requires_grad for p in function.fn.parameters())


def apply(function: CompiledFunction, tensors: Sequence[Any]) -> list[Any]:
    """``function``'s outputs on ``tensors``, recorded for autograd (see :class:`CompiledGradient`)."""
    call = function.prepare([t.detach() for t in tensors])
    sources = call.graph.captured_sources
    parameters = []
    for name in call.graph.inputs:
        source = sources.get(name, "")
        if not source.startswith("arg:") and isinstance(function.fn, torch.nn.Module):
            try:
                parameter = function.fn.get_parameter(source)
            except AttributeError:  # a buffer or a lifted constant: no gradient
                continue
            if parameter.requires_grad:
                parameters.append((name, parameter))
    names = tuple(name for name, _ in parameters)
    return list(CompiledGradient.apply(function, call, names, len(tensors), *tensors, *(p for _, p in parameters)))


class CompiledGradient(torch.autograd.Function):
    """Forward: the compiled function's op. Backward: its gradient graph, for every argument and
    parameter that requires a gradient (``parameters``: their graph input names, in order)."""

    @staticmethod
    def forward(ctx: Any, function: CompiledFunction, call: PreparedCall, parameters: tuple[str, ...],
                count: int, *tensors: Any) -> tuple[Any, ...]:  # fmt: skip
        arguments = tensors[:count]
        ctx.function, ctx.call, ctx.parameters, ctx.count = function, call, parameters, count
        ctx.needs = tuple(t.requires_grad for t in tensors)
        ctx.save_for_backward(*arguments)
        return tuple(function.op([t.detach() for t in arguments]))

    @staticmethod
    def backward(ctx: Any, *cotangents: Any) -> tuple[Any, ...]:
        arguments = ctx.saved_tensors
        graph = ctx.call.graph
        sources = graph.captured_sources
        wanted = [name for name in graph.inputs
                  if sources.get(name, "").startswith("arg:") and ctx.needs[int(sources[name][4:])]
                  and graph.inputs[name].dtype in FLOAT_DTYPES]  # fmt: skip
        wanted += [name for name, needed in zip(ctx.parameters, ctx.needs[ctx.count :]) if needed]
        values = gradients(ctx.function, ctx.call, arguments, cotangents, tuple(wanted)) if wanted else {}
        by_argument: list[Any] = [None] * ctx.count
        for name in graph.inputs:
            source = sources.get(name, "")
            if source.startswith("arg:") and name in values:
                by_argument[int(source[4:])] = values[name]
        return (None, None, None, None, *by_argument, *(values.get(name) for name in ctx.parameters))


def gradients(function: CompiledFunction, call: PreparedCall, arguments: Sequence[Any], cotangents: Sequence[Any],
              wrt: tuple[str, ...]) -> dict[str, Any]:  # fmt: skip
    """The gradients of ``call``'s graph with respect to the inputs ``wrt`` (by graph input name),
    given the call's arguments and each output's cotangent (None: zeros)."""
    from cherenkov.codegen.launch import TORCH_DTYPES

    backward = call.backward.get(wrt)
    if backward is None:
        backward = call.backward[wrt] = _prepared_backward(function, call, wrt)
    inputs = function._bind(call, arguments)
    for (name, spec), cotangent in zip(call.graph.outputs.items(), cotangents):
        dtype = getattr(torch, TORCH_DTYPES[spec.dtype])
        device = arguments[0].device if arguments else "cpu"
        value = torch.zeros(spec.shape, dtype=dtype, device=device) if cotangent is None else cotangent.to(dtype)
        inputs[f"d_{name}"] = value.contiguous()
    if backward.result is None:
        outputs = function._evaluate_on_cpu(backward.graph, inputs)
    else:
        outputs = backward.result.run(**inputs)
    return {name: outputs[f"d_{name}"] for name in wrt}


def _prepared_backward(function: CompiledFunction, call: PreparedCall, wrt: tuple[str, ...]) -> PreparedCall:
    """The gradient graph of ``call`` with respect to ``wrt``, searched on CUDA (like the forward)."""
    from cherenkov.search.compiled import PreparedCall

    gradient_graph = grad(call.graph, wrt=wrt)
    result = None
    if call.result is not None:
        from cherenkov.search.optimize import optimize

        result = optimize(gradient_graph, **function.optimize_kwargs)
    return PreparedCall(gradient_graph, result)
