"""``ck.grad``: reverse-mode automatic differentiation of a graph, in primitives.

``grad(g, wrt)`` returns a new :class:`~cherenkov.graph.tensor.Graph` that recomputes
``g``'s nodes, takes one cotangent input ``d_<output>`` per output of ``g`` (its shape and
dtype; ``outputs=`` names fewer), and outputs ``d_<input>`` for each input named in ``wrt``:
the sum over those outputs of the vector-Jacobian products. ``saved=`` names outputs of ``g``
that the forward pass keeps (its attention output, its rows' log-sum-exp): each becomes a
saved input of the gradient graph (:meth:`~cherenkov.graph.tensor.Graph.mark_saved`), which
every op after it reads (the output projection's weight gradient reads the saved attention
output), and which kernels may read instead of recomputing it — the flash-attention backward's
statistics. Every primitive's VJP is written in primitives
(:data:`VJPS`): views transpose to views (``slice`` to ``pad``, ``expand`` to a sum over the
broadcast axes), reductions to broadcasts, ``where`` to ``where``, ``max_reduce`` through
the mask of its maxima (shared equally by ties, as ``torch.amax``'s gradient), ``maximum``
the same way. Integer and bool tensors carry no gradient. The result is an ordinary graph:
it evaluates, derives, optimises and runs like any other.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence

from cherenkov.graph.errors import GraphError
from cherenkov.graph.ops import Node
from cherenkov.graph.shape import FLOAT_DTYPES
from cherenkov.graph.tensor import MAX_GRAPH_NAME, Graph, Tensor, where

Vjp = Callable[["_Backward", Node, Sequence[Tensor], Tensor, Tensor], Sequence[Tensor | None]]
"""(backward, node, its operands, its value, the cotangent) -> a cotangent per operand (None: none)."""


def grad(graph: Graph, wrt: Iterable[str], saved: Iterable[str] = (), outputs: Iterable[str] | None = None) -> Graph:
    """The gradient graph of ``graph`` with respect to the inputs named in ``wrt``: cotangents
    ``d_<output>`` of the floating-point ``outputs`` (default: all), and the outputs named in
    ``saved`` as saved inputs of the same names."""
    if not isinstance(graph, Graph):
        raise GraphError(f"grad: expected a ck.Graph, got {type(graph).__name__}")
    names = tuple(wrt)
    if not names:
        raise GraphError(f"grad: wrt names no input; inputs of {graph.name!r}: {sorted(graph.inputs)}")
    for name in names:
        if name not in graph.inputs:
            raise GraphError(f"grad: {name!r} is not an input of {graph.name!r}; inputs: {sorted(graph.inputs)}")
        if graph.inputs[name].dtype not in FLOAT_DTYPES:
            raise GraphError(f"grad: input {name!r} has dtype {graph.inputs[name].dtype}; only floating-point "
                             f"inputs ({', '.join(sorted(FLOAT_DTYPES))}) have gradients")  # fmt: skip
    differentiated = tuple(n for n, x in graph.outputs.items() if x.dtype in FLOAT_DTYPES) if outputs is None \
        else tuple(outputs)
    kept = tuple(saved)
    for kind, chosen in (("outputs", differentiated), ("saved", kept)):
        for name in chosen:
            if name not in graph.outputs:
                raise GraphError(f"grad: {kind} names {name!r}, which is not an output of {graph.name!r}; "
                                 f"outputs: {sorted(graph.outputs)}")  # fmt: skip
    if not differentiated:
        raise GraphError(f"grad: no output of {graph.name!r} to differentiate; its outputs: {sorted(graph.outputs)}")
    for name in differentiated:
        if graph.outputs[name].dtype not in FLOAT_DTYPES:
            raise GraphError(f"grad: output {name!r} has dtype {graph.outputs[name].dtype}; only floating-point "
                             "outputs take a cotangent")  # fmt: skip
        if f"d_{name}" in graph.inputs or f"d_{name}" in kept:
            raise GraphError(f"grad: the cotangent input d_{name} of output {name!r} is already an input name")
    if len(set(kept)) != len(kept):
        raise GraphError(f"grad: saved names an output twice: {list(kept)}")
    for name in kept:
        if graph.outputs[name].dtype not in FLOAT_DTYPES:
            raise GraphError(f"grad: saved output {name!r} is a {graph.outputs[name].dtype} value; saved values are "
                             f"floating-point ({', '.join(sorted(FLOAT_DTYPES))})")  # fmt: skip
    return _Backward(graph).run(names, differentiated, kept)


def vjp(fn: Callable[..., Tensor], primals: Sequence[Tensor], cotangent: Tensor,
        constants: Sequence[Tensor] = ()) -> list[Tensor]:  # fmt: skip
    """The vector-Jacobian product of ``fn`` at ``primals`` with ``cotangent`` (tensors of one
    graph), as primitives added to that graph: ``fn`` is applied to the inputs of a scratch
    graph, differentiated by :func:`grad`, and the gradient graph copied in with its inputs
    bound to the primals and the cotangent. One gradient a primal, of its shape and dtype.
    ``constants`` (tensors of the same graph) are ``fn``'s further arguments, not differentiated."""
    graph = cotangent.graph
    if any(p.graph is not graph for p in (*primals, *constants)):
        raise GraphError("vjp: the primals, constants and the cotangent must be tensors of one graph")
    scratch = Graph("vjp")
    names = [f"x{i}" for i in range(len(primals))]
    fixed = [f"c{i}" for i in range(len(constants))]
    arguments = [scratch.input(n, p.shape, p.dtype) for n, p in zip([*names, *fixed], [*primals, *constants])]
    output = fn(*arguments)
    if output.shape != cotangent.shape:
        raise GraphError(f"vjp: the cotangent's shape {cotangent.shape} is not the output's {output.shape}")
    scratch.output(output, "y")
    gradient = grad(scratch, wrt=names)
    bound = {**dict(zip(names, primals)), **dict(zip(fixed, constants)), "d_y": cotangent.cast(output.dtype)}
    copied: dict[int, Tensor] = {}
    for index, node in enumerate(gradient.nodes):
        if node.op == "input":
            copied[index] = bound[node.attrs[0]]
        elif node.op == "constant":
            copied[index] = graph.constant(node.attrs[0], node.dtype)
        else:
            copied[index] = graph._apply(node.op, [copied[i] for i in node.inputs], node.attrs)
    return [copied[gradient.outputs[f"d_{n}"].id] for n in names]


class _Backward:
    """One differentiation: ``graph``'s nodes copied into ``out`` (``value``), then the
    cotangents accumulated from the outputs back (``cotangent``)."""

    def __init__(self, graph: Graph) -> None:
        self.graph = graph
        self.out = Graph(f"grad_{graph.name}"[:MAX_GRAPH_NAME])
        self.out.is_gradient = True
        self.value: dict[int, Tensor] = {}

    def run(self, wrt: tuple[str, ...], outputs: tuple[str, ...], saved: tuple[str, ...]) -> Graph:
        self._copy_reading_saved(saved)
        cotangent: dict[int, Tensor] = {}
        for name in outputs:
            tensor = self.graph.outputs[name]
            seed = self.out.input(f"d_{name}", tensor.shape, tensor.dtype)
            self._accumulate(cotangent, tensor.id, seed)
        needed = self._downstream({self.graph.inputs[name].id for name in wrt})
        for index in sorted(needed, reverse=True):
            node = self.graph.node(index)
            if index not in cotangent or node.op in ("input", "constant", "iota"):
                continue
            operands = [self.value[i] for i in node.inputs]
            for position, operand_cotangent in enumerate(VJPS[node.op](self, node, operands, self.value[index],
                                                                     cotangent[index])):  # fmt: skip
                source = node.inputs[position]
                if operand_cotangent is not None and self.graph.node(source).dtype in FLOAT_DTYPES:
                    self._accumulate(cotangent, source, operand_cotangent)
        for name in wrt:
            index = self.graph.inputs[name].id
            spec = self.graph.node(index)
            value = cotangent.get(index)
            if value is None:  # no output depends on it
                value = self.out.constant(0.0, spec.dtype).broadcast_to(spec.shape)
            self.out.output(value, f"d_{name}")
        return self.out

    def _copy_reading_saved(self, saved: tuple[str, ...]) -> None:
        """Copy the graph's nodes: its inputs, then an input for each ``saved`` output, then the
        rest, each saved value held by its input and every later node reading that input in its
        place (the output projection after an attention reads the saved output instead of
        recomputing it)."""
        for index, node in enumerate(self.graph.nodes):
            if node.op == "input":
                self.value[index] = self._copy(node)
        holders: dict[int, list[Tensor]] = {}
        for name in saved:
            value = self.graph.outputs[name]
            holders.setdefault(value.id, []).append(self.out.input(name, value.shape, value.dtype))
        for index, node in enumerate(self.graph.nodes):
            if node.op == "input":
                continue
            self.value[index] = self._copy(node)
            for holder in holders.get(index, ()):
                self.out.mark_saved(holder, self.value[index])
            if index in holders:
                self.value[index] = holders[index][0]

    def _copy(self, node: Node) -> Tensor:
        if node.op == "input":
            return self.out.input(node.attrs[0], node.shape, node.dtype)
        if node.op == "constant":
            return self.out.constant(node.attrs[0], node.dtype)
        return self.out._apply(node.op, [self.value[i] for i in node.inputs], node.attrs)

    def _downstream(self, wanted: set[int]) -> set[int]:
        """The ``wanted`` inputs and every node that depends on one: the only nodes whose
        cotangents the gradients need."""
        reaches: set[int] = set(wanted)
        for index, node in enumerate(self.graph.nodes):
            if any(i in reaches for i in node.inputs):
                reaches.add(index)
        return reaches

    def _accumulate(self, cotangent: dict[int, Tensor], index: int, value: Tensor) -> None:
        value = value.cast(self.graph.node(index).dtype)
        cotangent[index] = cotangent[index] + value if index in cotangent else value

    # ------------------------------------------------------------------ builders

    def scalar(self, value: float, like: Tensor) -> Tensor:
        return self.out.constant(value, like.dtype).broadcast_to(like.shape)

    def zeros_like(self, x: Tensor) -> Tensor:
        return self.scalar(0.0, x)

    def restore_axis(self, reduced: Tensor, axis: int, shape: tuple[int, ...]) -> Tensor:
        """A reduction's result broadcast back over its ``axis`` of ``shape``."""
        keep = shape[:axis] + (1,) + shape[axis + 1 :]
        return self.out._apply("expand", [self.out._apply("reshape", [reduced], (keep,))], (shape,))

    def tie_share(self, mine: Tensor, other: Tensor) -> Tensor:
        """1 where ``mine > other``, ½ where equal, 0 where smaller (as a float of ``mine``'s dtype)."""
        one, half, zero = self.scalar(1.0, mine), self.scalar(0.5, mine), self.zeros_like(mine)
        return where(other < mine, one, where(mine < other, zero, half))


# ---------------------------------------------------------------------- the VJPs


def _exp2(b: _Backward, node: Node, xs: Sequence[Tensor], y: Tensor, g: Tensor) -> list[Tensor | None]:
    return [g * y * math.log(2.0)]


def _log2(b: _Backward, node: Node, xs: Sequence[Tensor], y: Tensor, g: Tensor) -> list[Tensor | None]:
    return [g * xs[0].recip() * (1.0 / math.log(2.0))]


def _sin(b: _Backward, node: Node, xs: Sequence[Tensor], y: Tensor, g: Tensor) -> list[Tensor | None]:
    return [g * (xs[0] + math.pi / 2).sin()]  # cos x = sin(x + π/2)


def _sqrt(b: _Backward, node: Node, xs: Sequence[Tensor], y: Tensor, g: Tensor) -> list[Tensor | None]:
    return [g * y.recip() * 0.5]


def _recip(b: _Backward, node: Node, xs: Sequence[Tensor], y: Tensor, g: Tensor) -> list[Tensor | None]:
    return [-(g * y * y)]


def _neg(b: _Backward, node: Node, xs: Sequence[Tensor], y: Tensor, g: Tensor) -> list[Tensor | None]:
    return [-g]


def _add(b: _Backward, node: Node, xs: Sequence[Tensor], y: Tensor, g: Tensor) -> list[Tensor | None]:
    return [g, g]


def _mul(b: _Backward, node: Node, xs: Sequence[Tensor], y: Tensor, g: Tensor) -> list[Tensor | None]:
    return [g * xs[1], g * xs[0]]


def _mod(b: _Backward, node: Node, xs: Sequence[Tensor], y: Tensor, g: Tensor) -> list[Tensor | None]:
    a, d = xs  # a mod d = a − d·floor(a / d)
    return [g, -(g * (a - y) * d.recip())]


def _no_gradient(b: _Backward, node: Node, xs: Sequence[Tensor], y: Tensor, g: Tensor) -> list[Tensor | None]:
    return [None] * len(xs)


def _maximum(b: _Backward, node: Node, xs: Sequence[Tensor], y: Tensor, g: Tensor) -> list[Tensor | None]:
    first, second = xs
    return [g * b.tie_share(first, second), g * b.tie_share(second, first)]


def _where(b: _Backward, node: Node, xs: Sequence[Tensor], y: Tensor, g: Tensor) -> list[Tensor | None]:
    condition = xs[0]
    return [None, where(condition, g, b.zeros_like(g)), where(condition, b.zeros_like(g), g)]


def _sum_reduce(b: _Backward, node: Node, xs: Sequence[Tensor], y: Tensor, g: Tensor) -> list[Tensor | None]:
    return [b.restore_axis(g, node.attrs[0], xs[0].shape)]


def _max_reduce(b: _Backward, node: Node, xs: Sequence[Tensor], y: Tensor, g: Tensor) -> list[Tensor | None]:
    (x,), axis = xs, node.attrs[0]
    peak = b.restore_axis(y, axis, x.shape)
    at_peak = where(x < peak, b.zeros_like(x), b.scalar(1.0, x))
    count = b.restore_axis(b.out._apply("sum_reduce", [at_peak], (axis,)), axis, x.shape)
    return [b.restore_axis(g, axis, x.shape) * at_peak * count.recip()]


def _cast(b: _Backward, node: Node, xs: Sequence[Tensor], y: Tensor, g: Tensor) -> list[Tensor | None]:
    return [g.cast(xs[0].dtype)]


def _identity(b: _Backward, node: Node, xs: Sequence[Tensor], y: Tensor, g: Tensor) -> list[Tensor | None]:
    return [g]


def _permute(b: _Backward, node: Node, xs: Sequence[Tensor], y: Tensor, g: Tensor) -> list[Tensor | None]:
    perm = node.attrs[0]
    inverse = tuple(sorted(range(len(perm)), key=perm.__getitem__))
    return [b.out._apply("permute", [g], (inverse,))]


def _expand(b: _Backward, node: Node, xs: Sequence[Tensor], y: Tensor, g: Tensor) -> list[Tensor | None]:
    source, target = xs[0].shape, node.shape
    lead = len(target) - len(source)
    summed = g
    for axis in reversed(range(len(target))):  # the broadcast axes, last first (indices stay valid)
        if axis < lead or (source[axis - lead] == 1 and target[axis] != 1):
            summed = b.out._apply("sum_reduce", [summed], (axis,))
    return [b.out._apply("reshape", [summed], (tuple(source),))]


def _reshape(b: _Backward, node: Node, xs: Sequence[Tensor], y: Tensor, g: Tensor) -> list[Tensor | None]:
    return [b.out._apply("reshape", [g], (tuple(xs[0].shape),))]


def _slice(b: _Backward, node: Node, xs: Sequence[Tensor], y: Tensor, g: Tensor) -> list[Tensor | None]:
    starts, stops = node.attrs
    pads = tuple((start, size - stop) for start, stop, size in zip(starts, stops, xs[0].shape))
    return [b.out._apply("pad", [g], (pads, 0.0))]


def _pad(b: _Backward, node: Node, xs: Sequence[Tensor], y: Tensor, g: Tensor) -> list[Tensor | None]:
    pads = node.attrs[0]
    starts = tuple(before for before, _ in pads)
    stops = tuple(before + size for (before, _), size in zip(pads, xs[0].shape))
    return [b.out._apply("slice", [g], (starts, stops))]


VJPS: dict[str, Vjp] = {
    "exp2": _exp2, "log2": _log2, "sin": _sin, "sqrt": _sqrt, "recip": _recip, "neg": _neg,
    "add": _add, "mul": _mul, "mod": _mod, "less_than": _no_gradient, "maximum": _maximum,
    "where": _where, "sum_reduce": _sum_reduce, "max_reduce": _max_reduce, "cast": _cast,
    "contiguous": _identity, "permute": _permute, "expand": _expand, "reshape": _reshape,
    "slice": _slice, "pad": _pad,
}  # fmt: skip
"""Each differentiable primitive's vector-Jacobian product (``input``, ``constant`` and
``iota`` are leaves)."""
