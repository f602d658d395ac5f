"""The primitive op set and its nodes.

Every graph is built from these ops alone; ``@``, ``exp``, ``softmax``, norms and
attention are compositions (``graph/tensor.py``, ``graph/nn.py``). Each op has a spec
whose ``infer`` checks its operands and attributes and returns the result's shape and
dtype, so the builder and the JSON loader validate the same way.

Attribute conventions (``Node.attrs``, always a tuple of JSON-able scalars or tuples):

========================  =====================================================
``input``                 ``(name,)``
``constant``              ``(value,)``, a scalar; shape ``()``
``iota``                  ``(n,)``: ``0, 1, ..., n-1`` as int32, shape ``(n,)``
``cast``                  ``(dtype,)``
``sum_reduce/max_reduce`` ``(axis,)``; the axis is removed
``permute``               ``(perm,)``
``expand``                ``(shape,)``: NumPy ``broadcast_to``
``reshape``               ``(shape,)``
``slice``                 ``(starts, stops)``: unit step
``pad``                   ``(pads, value)``: ``pads`` is ``((before, after), ...)``
========================  =====================================================

Binary and ternary ops take operands of equal shape: the builder inserts ``expand``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from cherenkov.graph import shape as sh
from cherenkov.graph.errors import GraphError

UNARY = ("exp2", "log2", "sin", "sqrt", "recip", "neg")
BINARY = ("add", "mul", "mod", "less_than", "maximum")
TERNARY = ("where",)
REDUCE = ("sum_reduce", "max_reduce")
DATA = ("input", "constant", "iota", "cast")
VIEW = ("permute", "expand", "reshape", "slice", "pad")
MATERIALIZE = ("contiguous",)

PRIMITIVES: frozenset[str] = frozenset(UNARY + BINARY + TERNARY + REDUCE + DATA + VIEW + MATERIALIZE)


@dataclass(frozen=True)
class Node:
    """One primitive op application; ``inputs`` are indices of earlier nodes of the graph."""

    op: str
    inputs: tuple[int, ...]
    attrs: tuple
    shape: sh.Shape
    dtype: str

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


Infer = Callable[[tuple[Node, ...], tuple], tuple[sh.Shape, str]]


@dataclass(frozen=True)
class OpSpec:
    """A primitive: its name, operand count and shape/dtype inference.

    Leaves created with an explicit shape and dtype (``input``, ``constant``) infer nothing.
    """

    name: str
    arity: int
    infer: Infer | None


def _same_shapes(op: str, operands: tuple[Node, ...]) -> sh.Shape:
    shapes = {n.shape for n in operands}
    if len(shapes) != 1:
        listed = ", ".join(str(n.shape) for n in operands)
        raise GraphError(f"{op}: operands must have equal shapes after broadcasting, got {listed}")
    return operands[0].shape


def _unary(op: str) -> Infer:
    def infer(xs: tuple[Node, ...], attrs: tuple) -> tuple[sh.Shape, str]:
        (x,) = xs
        if x.dtype == "bool":
            raise GraphError(f"{op}: operand of shape {x.shape} has dtype bool; valid: fp32, fp16, bf16, int32")
        if op != "neg" and x.dtype == "int32":
            return x.shape, "fp32"
        return x.shape, x.dtype

    return infer


def _binary(op: str) -> Infer:
    def infer(xs: tuple[Node, ...], attrs: tuple) -> tuple[sh.Shape, str]:
        shape = _same_shapes(op, xs)
        if op == "less_than":
            return shape, "bool"
        dtype = sh.promote(op, *(x.dtype for x in xs))
        if dtype == "bool":
            raise GraphError(f"{op}: operands of shape {shape} are bool; cast them to a number type first")
        return shape, dtype

    return infer


def _where(xs: tuple[Node, ...], attrs: tuple) -> tuple[sh.Shape, str]:
    cond, a, b = xs
    shape = _same_shapes("where", xs)
    if cond.dtype != "bool":
        raise GraphError(f"where: condition of shape {cond.shape} has dtype {cond.dtype}; it must be bool")
    return shape, sh.promote("where", a.dtype, b.dtype)


def _reduce(op: str) -> Infer:
    def infer(xs: tuple[Node, ...], attrs: tuple) -> tuple[sh.Shape, str]:
        (x,) = xs
        (axis,) = attrs
        if not isinstance(axis, int) or not 0 <= axis < len(x.shape):
            raise GraphError(f"{op}: axis {axis!r} is not a non-negative axis of shape {x.shape}")
        if x.dtype == "bool":
            raise GraphError(f"{op}: operand of shape {x.shape} is bool; cast it to a number type first")
        return x.shape[:axis] + x.shape[axis + 1 :], x.dtype

    return infer


def _iota(xs: tuple[Node, ...], attrs: tuple) -> tuple[sh.Shape, str]:
    (n,) = attrs
    return sh.check_shape("iota", (n,)), "int32"


def _cast(xs: tuple[Node, ...], attrs: tuple) -> tuple[sh.Shape, str]:
    (x,) = xs
    return x.shape, sh.normalize_dtype("cast", attrs[0])


def _permute(xs: tuple[Node, ...], attrs: tuple) -> tuple[sh.Shape, str]:
    (x,) = xs
    shape, axes = sh.permute_shape("permute", x.shape, attrs[0])
    if axes != tuple(attrs[0]):
        raise GraphError(f"permute: stored permutation {attrs[0]} must use non-negative axes")
    return shape, x.dtype


def _expand(xs: tuple[Node, ...], attrs: tuple) -> tuple[sh.Shape, str]:
    (x,) = xs
    return sh.expand_shape("expand", x.shape, sh.check_shape("expand", attrs[0])), x.dtype


def _reshape(xs: tuple[Node, ...], attrs: tuple) -> tuple[sh.Shape, str]:
    (x,) = xs
    target = sh.reshape_shape("reshape", x.shape, attrs[0])
    if target != tuple(attrs[0]):
        raise GraphError(f"reshape: stored shape {attrs[0]} must be fully resolved")
    return target, x.dtype


def _slice(xs: tuple[Node, ...], attrs: tuple) -> tuple[sh.Shape, str]:
    (x,) = xs
    return sh.slice_shape("slice", x.shape, attrs[0], attrs[1]), x.dtype


def _pad(xs: tuple[Node, ...], attrs: tuple) -> tuple[sh.Shape, str]:
    (x,) = xs
    value = attrs[1]
    if not isinstance(value, (int, float)) or isinstance(value, bool) or math.isnan(value):
        raise GraphError(f"pad: fill value {value!r} must be a number and not NaN")
    return sh.pad_shape("pad", x.shape, attrs[0]), x.dtype


def _identity(xs: tuple[Node, ...], attrs: tuple) -> tuple[sh.Shape, str]:
    (x,) = xs
    return x.shape, x.dtype


SPECS: dict[str, OpSpec] = {
    **{op: OpSpec(op, 1, _unary(op)) for op in UNARY},
    **{op: OpSpec(op, 2, _binary(op)) for op in BINARY},
    "where": OpSpec("where", 3, _where),
    **{op: OpSpec(op, 1, _reduce(op)) for op in REDUCE},
    "input": OpSpec("input", 0, None),
    "constant": OpSpec("constant", 0, None),
    "iota": OpSpec("iota", 0, _iota),
    "cast": OpSpec("cast", 1, _cast),
    "permute": OpSpec("permute", 1, _permute),
    "expand": OpSpec("expand", 1, _expand),
    "reshape": OpSpec("reshape", 1, _reshape),
    "slice": OpSpec("slice", 1, _slice),
    "pad": OpSpec("pad", 1, _pad),
    "contiguous": OpSpec("contiguous", 1, _identity),
}
assert set(SPECS) == PRIMITIVES


def node_flops(node: Node, operands: tuple[Node, ...]) -> int:
    """Arithmetic operations of one node: an element of work per output element, or per
    input element for a reduction; views and data movement count zero."""
    if node.op in UNARY + BINARY + TERNARY:
        return node.numel
    if node.op in REDUCE:
        return operands[0].numel
    return 0
