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

With ``saved_statistics`` (``ck.compile(..., saved_statistics=True)``), where the captured
graph holds attentions (``ck.nn.attention``'s, SDPA's), a call that needs gradients runs the
*training forward* instead: the same graph with each attention's output and
rows' log-sum-exp as extra outputs (:func:`training_graph`; the flash kernels write the
log-sum-exp beside their output), which the call saves; the gradient graph then takes them as
saved inputs (``ck.grad(..., saved=...)``), so the fused backward reads them instead of running
the forward again.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from cherenkov.graph import nn
from cherenkov.graph.autodiff import grad
from cherenkov.graph.shape import FLOAT_DTYPES
from cherenkov.graph.tensor import Graph

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


@dataclass(frozen=True)
class TrainingForward:
    """A call's training forward: ``call`` (its graph the captured one with the saved values as
    further outputs) and the names of those outputs, which the backward's graph takes as saved
    inputs."""

    call: PreparedCall
    saved: tuple[str, ...]


SAVED_PREFIX = "ck_saved_"
"""How the training forward names the outputs it adds (an attention's output, its log-sum-exp)."""


def training_graph(graph: Graph) -> tuple[Graph, tuple[str, ...]] | None:
    """``graph`` with each attention its outputs depend on (:attr:`Graph.attentions`) giving its
    output and rows' log-sum-exp (fp32) as further outputs, and their names; None without one.
    An attention output that is a graph output already keeps its name."""
    copy = graph.subgraph(graph.outputs, graph.name)
    named = {t.id: name for name, t in copy.outputs.items()}
    live = set(copy.live_nodes())
    saved = []
    for position, (out, scores) in enumerate(copy.attentions):
        if out.id not in live or scores.dtype not in FLOAT_DTYPES:
            continue
        names = (named.get(out.id, f"{SAVED_PREFIX}{position}_o"), f"{SAVED_PREFIX}{position}_lse")
        if any(n in copy.inputs for n in names) or names[1] in copy.outputs:
            continue
        if out.id not in named:
            copy.output(out, names[0])
            named[out.id] = names[0]
        copy.output(nn.logsumexp(scores, axis=-1).cast("fp32"), names[1])
        saved += names
    return (copy, tuple(saved)) if saved else None


def _training_forward(function: CompiledFunction, call: PreparedCall) -> TrainingForward | None:
    """The call's training forward, prepared (and on CUDA searched) on first use; None where its
    graph holds no attention or the function does not save statistics."""
    from cherenkov.search.compiled import PreparedCall

    if not function.saved_statistics:
        return None
    if call.training is None:
        made = training_graph(call.graph)
        if made is None:
            call.training = False
        else:
            graph, saved = made
            result = None
            if call.result is not None:
                from cherenkov.search.optimize import optimize

                result = optimize(graph, **function.optimize_kwargs)
            call.training = TrainingForward(PreparedCall(graph, result), saved)
    return call.training or None


class CompiledGradient(torch.autograd.Function):
    """Forward: the compiled function's op. Backward: its gradient graph, for every argument and
    parameter that requires a gradient (``parameters``: their graph input names, in order)."""

    @staticmethod
    def forward(ctx: Any, function: CompiledFunction, call: PreparedCall, parameters: tuple[str, ...],
                count: int, *tensors: Any) -> tuple[Any, ...]:  # fmt: skip
        arguments = tensors[:count]
        ctx.function, ctx.call, ctx.parameters, ctx.count = function, call, parameters, count
        ctx.needs = tuple(t.requires_grad for t in tensors)
        training = _training_forward(function, call)
        if training is None:
            ctx.save_for_backward(*arguments)
            return tuple(function.op([t.detach() for t in arguments]))
        outputs = _run(function, training.call, [t.detach() for t in arguments])
        ctx.save_for_backward(*arguments, *(outputs[name] for name in training.saved))
        return tuple(outputs[name].contiguous() for name in call.graph.outputs)

    @staticmethod
    def backward(ctx: Any, *cotangents: Any) -> tuple[Any, ...]:
        arguments = ctx.saved_tensors[: ctx.count]
        graph = ctx.call.graph
        sources = graph.captured_sources
        wanted = [name for name in graph.inputs
                  if sources.get(name, "").startswith("arg:") and ctx.needs[int(sources[name][4:])]
                  and graph.inputs[name].dtype in FLOAT_DTYPES]  # fmt: skip
        wanted += [name for name, needed in zip(ctx.parameters, ctx.needs[ctx.count :]) if needed]
        training = ctx.call.training or None
        saved = dict(zip(training.saved, ctx.saved_tensors[ctx.count :])) if training is not None else {}
        values = gradients(ctx.function, ctx.call, arguments, cotangents, tuple(wanted), saved) if wanted else {}
        by_argument: list[Any] = [None] * ctx.count
        for name in graph.inputs:
            source = sources.get(name, "")
            if source.startswith("arg:") and name in values:
                by_argument[int(source[4:])] = values[name]
        return (None, None, None, None, *by_argument, *(values.get(name) for name in ctx.parameters))


def gradients(function: CompiledFunction, call: PreparedCall, arguments: Sequence[Any], cotangents: Sequence[Any],
              wrt: tuple[str, ...], saved: dict[str, Any] | None = None) -> dict[str, Any]:  # fmt: skip
    """The gradients of ``call``'s graph with respect to the inputs ``wrt`` (by graph input name),
    given the call's arguments, each output's cotangent (None: zeros) and the values its training
    forward saved (by name: the gradient graph's saved inputs)."""
    from cherenkov.codegen.launch import TORCH_DTYPES

    backward = call.backward.get(wrt)
    if backward is None:
        backward = call.backward[wrt] = _prepared_backward(function, call, wrt)
    inputs = {n: v for n, v in function._bind(call, arguments).items() if n in backward.graph.inputs}
    inputs.update((name, value.contiguous()) for name, value in (saved or {}).items())
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


def _run(function: CompiledFunction, call: PreparedCall, arguments: Sequence[Any]) -> dict[str, Any]:
    """Every output of a prepared call (its searched kernels, or on the CPU its graph's reference)."""
    inputs = {n: v for n, v in function._bind(call, arguments).items() if n in call.graph.inputs}
    if call.result is None:
        return function._evaluate_on_cpu(call.graph, inputs)
    return call.result.run(**inputs)


def _prepared_backward(function: CompiledFunction, call: PreparedCall, wrt: tuple[str, ...]) -> PreparedCall:
    """The gradient graph of ``call`` with respect to ``wrt`` (reading the values its training
    forward saves, where it has one), searched on CUDA (like the forward)."""
    from cherenkov.search.compiled import PreparedCall

    training = call.training or None
    if training is not None:
        gradient_graph = grad(training.call.graph, wrt=wrt, saved=training.saved, outputs=tuple(call.graph.outputs))
    else:
        gradient_graph = grad(call.graph, wrt=wrt)
    result = None
    if call.result is not None:
        from cherenkov.search.optimize import optimize

        result = optimize(gradient_graph, **function.optimize_kwargs)
    return PreparedCall(gradient_graph, result)
