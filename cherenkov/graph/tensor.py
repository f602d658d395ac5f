"""The graph and its torch-like ``Tensor`` builder.

A :class:`Graph` is a DAG of primitive :class:`~cherenkov.graph.ops.Node` s with
structural hashing: building the same sub-expression twice yields the same node. A
:class:`Tensor` is a handle on one node; its operators and methods lower everything to
primitives (``a / b`` is ``a * recip(b)``, ``exp(x)`` is ``exp2(x * log2 e)``, ``x @ y``
is ``sum_reduce(expand(x) * expand(y))``), so ``g.ops() ⊆ PRIMITIVES`` always holds.

Python scalars become constants of the other operand's dtype. ``ck.arange`` and
``ck.constant`` without a graph make *free* tensors that join the graph of the first
tensor they are combined with.
"""

from __future__ import annotations

import hashlib
import math
from collections import Counter
from collections.abc import Iterable, Sequence

import numpy as np

from cherenkov.graph import shape as sh
from cherenkov.graph.errors import GraphError
from cherenkov.graph.fp8 import round_to_e8m0, round_to_fp8
from cherenkov.graph.ops import SPECS, Node, node_flops

LOG2E = math.log2(math.e)
LN2 = math.log(2.0)
MAX_GRAPH_NAME = 200

Scalar = int | float | bool


class Graph:
    """A computation over named inputs, built from primitive ops.

    ``Graph(name)`` takes any short printable name (it is shown in reports, never placed
    in generated source); input and output names must be identifiers.
    """

    def __init__(self, name: str = "graph", *, _free: bool = False) -> None:
        if not isinstance(name, str) or not name.isprintable() or not 0 < len(name) <= MAX_GRAPH_NAME:
            raise GraphError(f"Graph: name {name!r} must be a printable string of 1..{MAX_GRAPH_NAME} characters")
        self.name = name
        self._free = _free
        self._nodes: list[Node] = []
        self._ids: dict[tuple[Node, str], int] = {}
        self._inputs: dict[str, int] = {}
        self._outputs: dict[str, int] = {}
        self._examples: dict[str, np.ndarray] = {}
        self._sources: dict[str, str] = {}
        self._saved: dict[str, int] = {}
        self._attentions: list[tuple[int, int]] = []
        self.is_gradient = False
        """Set by ``ck.grad`` on the graphs it builds: their outputs read the forward's
        intermediates transposed, and the derivation looks through them (``Lowered.inlined``)."""

    # ---------------------------------------------------------------- construction

    def _add(self, node: Node) -> int:
        # repr tells -0.0 from 0.0, which compare equal as keys but are different constants
        key = (node, repr(node.attrs))
        existing = self._ids.get(key)
        if existing is not None:
            return existing
        self._nodes.append(node)
        self._ids[key] = len(self._nodes) - 1
        return len(self._nodes) - 1

    def _apply(self, op: str, operands: Sequence[Tensor], attrs: tuple = ()) -> Tensor:
        """Add ``op(operands)`` after checking it with the op's shape/dtype inference."""
        spec = SPECS[op]
        if len(operands) != spec.arity or spec.infer is None:
            raise GraphError(f"{op}: takes {spec.arity} operands, got {len(operands)}")
        nodes = tuple(t.node for t in operands)
        shape, dtype = spec.infer(nodes, attrs)
        return Tensor(self, self._add(Node(op, tuple(t.id for t in operands), attrs, shape, dtype)))

    def input(self, name: str, shape: Sequence[int], dtype: str = "fp32") -> Tensor:
        """Declare an input tensor. ``dtype`` is one of bf16, fp16, fp32, fp8_e4m3, fp8_e5m2."""
        if self._free:
            raise GraphError("input: free graphs (ck.arange, ck.constant) cannot have inputs")
        sh.check_identifier("input", name)
        if name in self._inputs or name in self._outputs:
            raise GraphError(f"input: name {name!r} is already used in graph {self.name!r}; names must be unique")
        shape = sh.check_stored_shape(f"input {name!r}", shape)
        dtype = sh.normalize_dtype(f"input {name!r}", dtype, sh.INPUT_DTYPES)
        tensor = Tensor(self, self._add(Node("input", (), (name,), shape, dtype)))
        self._inputs[name] = tensor.id
        return tensor

    def saved_input(self, name: str, value: Tensor) -> Tensor:
        """An input holding ``value`` — a tensor of this graph computed from its other inputs — as an
        earlier computation saved it (a forward pass's output, its rows' log-sum-exp).

        The outputs are still defined without it; a kernel may read it instead of computing
        ``value`` again (the attention backward's statistics, see ``ck.grad(..., saved=...)``), and
        ``ck.evaluate`` fills it from ``value`` where it is not given."""
        tensor = self._checked_saved_value(name, value)
        saved = self.input(name, tensor.shape, tensor.dtype)
        self._saved[name] = tensor.id
        return saved

    def mark_saved(self, input: Tensor, value: Tensor) -> None:
        """Declare that the existing input ``input`` holds ``value`` (see :meth:`saved_input`)."""
        if not isinstance(input, Tensor) or input.graph is not self or input.node.op != "input":
            raise GraphError(f"mark_saved: expected an input tensor of graph {self.name!r}, got {input!r}")
        name = input.node.attrs[0]
        tensor = self._checked_saved_value(name, value)
        if tensor.shape != input.shape or tensor.dtype != input.dtype:
            raise GraphError(f"mark_saved: input {name!r} is {input.shape} {input.dtype}, the value it holds "
                             f"{tensor.shape} {tensor.dtype}; valid when both agree")  # fmt: skip
        if input.id in self.ancestors([tensor.id]):
            raise GraphError(f"mark_saved: the value input {name!r} holds is computed from {name!r} itself")
        self._saved[name] = tensor.id

    def _checked_saved_value(self, name: str, value: object) -> Tensor:
        if not isinstance(value, Tensor) or value.graph is not self:
            raise GraphError(f"saved input {name!r}: its value must be a tensor of graph {self.name!r}, "
                             f"got {value!r}")  # fmt: skip
        if name in self._saved:
            raise GraphError(f"saved input {name!r}: already declared")
        if value.dtype not in sh.FLOAT_DTYPES:
            raise GraphError(f"saved input {name!r}: a {value.dtype} value; saved values are floating-point "
                             f"({', '.join(sorted(sh.FLOAT_DTYPES))})")  # fmt: skip
        return value

    def constant(self, value: Scalar, dtype: str = "fp32") -> Tensor:
        """A scalar constant (shape ``()``); NaN is rejected, ±inf is allowed (masks)."""
        dtype = sh.normalize_dtype("constant", dtype, tuple(d for d in sh.DTYPES if d not in sh.STORAGE_DTYPES))
        if isinstance(value, np.generic):
            value = value.item()
        if not isinstance(value, (int, float, bool)):
            raise GraphError(f"constant: value {value!r} is not an int, float or bool")
        if isinstance(value, float) and math.isnan(value):
            raise GraphError("constant: NaN is not a valid constant; use a finite value or ±inf")
        if dtype == "bool":
            value = bool(value)
        elif dtype == "int32":
            if isinstance(value, float) and (not value.is_integer() or not math.isfinite(value)):
                raise GraphError(f"constant: {value!r} is not an int32 value")
            value = int(value)
            if not -(2**31) <= value < 2**31:
                raise GraphError(f"constant: {value} does not fit in int32")
        else:
            value = float(value)
        return Tensor(self, self._add(Node("constant", (), (value,), (), dtype)))

    def arange(self, n: int) -> Tensor:
        """``0, 1, ..., n-1`` as int32 (the ``iota`` primitive)."""
        return self._apply("iota", (), (n,))

    def output(self, tensor: Tensor, name: str = "out") -> Tensor:
        """Mark ``tensor`` as the output ``name``."""
        sh.check_identifier("output", name)
        if not isinstance(tensor, Tensor):
            raise GraphError(f"output {name!r}: expected a Tensor, got {type(tensor).__name__}")
        tensor = self._lift(tensor, "output")
        sh.check_stored_shape(f"output {name!r}", tensor.shape)
        if name in self._outputs or name in self._inputs:
            raise GraphError(f"output: name {name!r} is already used in graph {self.name!r}; names must be unique")
        self._outputs[name] = tensor.id
        return tensor

    def _lift(self, tensor: Tensor, op: str) -> Tensor:
        """``tensor`` as a tensor of this graph: free tensors are copied in."""
        if tensor.graph is self:
            return tensor
        if not tensor.graph._free:
            raise GraphError(
                f"{op}: operands come from different graphs ({self.name!r} and {tensor.graph.name!r}); "
                "build each computation in one Graph"
            )
        mapping: dict[int, int] = {}
        for index in sorted(tensor.graph.ancestors([tensor.id])):
            node = tensor.graph._nodes[index]
            mapping[index] = self._add(
                Node(node.op, tuple(mapping[i] for i in node.inputs), node.attrs, node.shape, node.dtype)
            )
        return Tensor(self, mapping[tensor.id])

    # ---------------------------------------------------------------- inspection

    @property
    def nodes(self) -> tuple[Node, ...]:
        return tuple(self._nodes)

    @property
    def inputs(self) -> dict[str, Tensor]:
        return {name: Tensor(self, i) for name, i in self._inputs.items()}

    @property
    def outputs(self) -> dict[str, Tensor]:
        return {name: Tensor(self, i) for name, i in self._outputs.items()}

    def subgraph(self, outputs: dict[str, Tensor], name: str | None = None) -> Graph:
        """A new graph computing only ``outputs`` (name -> tensor of this graph) from the inputs
        they read (the values saved inputs hold, derived on their own), with those inputs'
        captured sources and examples and the attentions among the nodes it keeps."""
        graph = Graph(name or self.name)
        copied: dict[int, Tensor] = {}
        for index in sorted(self.ancestors([t.id for t in outputs.values()])):
            node = self._nodes[index]
            if node.op == "input":
                input_name = node.attrs[0]
                copied[index] = graph.input(input_name, node.shape, node.dtype)
                if input_name in self._sources:
                    graph._sources[input_name] = self._sources[input_name]
                if input_name in self._examples:
                    graph._examples[input_name] = self._examples[input_name]
            elif node.op == "constant":
                copied[index] = graph.constant(node.attrs[0], node.dtype)
            else:
                copied[index] = graph._apply(node.op, [copied[i] for i in node.inputs], node.attrs)
        for output, tensor in outputs.items():
            graph.output(copied[tensor.id], output)
        graph._attentions = [(copied[o].id, copied[s].id) for o, s in self._attentions if o in copied and s in copied]
        return graph

    @property
    def attentions(self) -> list[tuple[Tensor, Tensor]]:
        """Each attention ``ck.nn.attention`` built in this graph: its output and its scaled,
        masked scores (from which a training step saves the rows' log-sum-exp for the backward)."""
        return [(Tensor(self, o), Tensor(self, s)) for o, s in self._attentions]

    def note_attention(self, out: Tensor, scores: Tensor) -> None:
        """Record that ``out`` is the attention of ``scores`` (see :attr:`attentions`)."""
        if out.graph is not self or scores.graph is not self:
            raise GraphError(f"note_attention: tensors of another graph than {self.name!r}")
        if (out.id, scores.id) not in self._attentions:
            self._attentions.append((out.id, scores.id))

    @property
    def saved(self) -> dict[str, Tensor]:
        """Each saved input's name -> the tensor of this graph it holds (:meth:`saved_input`)."""
        return {name: Tensor(self, i) for name, i in self._saved.items()}

    def node(self, index: int) -> Node:
        return self._nodes[index]

    def ancestors(self, roots: Iterable[int]) -> set[int]:
        """Indices of the nodes ``roots`` (node indices) are computed from, ``roots`` included."""
        seen: set[int] = set()
        stack = list(roots)
        while stack:
            index = stack.pop()
            if index not in seen:
                seen.add(index)
                stack.extend(self._nodes[index].inputs)
        return seen

    def live_nodes(self) -> list[int]:
        """Indices (in topological order) of the nodes the outputs depend on."""
        roots = self._outputs.values() if self._outputs else range(len(self._nodes))
        return sorted(self.ancestors(roots))

    def ops(self) -> Counter[str]:
        """How often each primitive op occurs in the computation of the outputs."""
        return Counter(self._nodes[i].op for i in self.live_nodes())

    def flops(self) -> int:
        """Arithmetic operations to evaluate the outputs (a multiply-add counts two)."""
        return sum(
            node_flops(self._nodes[i], tuple(self._nodes[j] for j in self._nodes[i].inputs))
            for i in self.live_nodes()
        )

    def structural_hash(self) -> str:
        """SHA-256 of the graph's structure (nodes, input and output names), not its name."""
        from cherenkov.graph.serialize import canonical_structure

        return hashlib.sha256(canonical_structure(self).encode()).hexdigest()

    def to_json(self) -> str:
        """Lossless, versioned JSON (see :mod:`cherenkov.graph.serialize`)."""
        from cherenkov.graph.serialize import graph_to_json

        return graph_to_json(self)

    @classmethod
    def from_json(cls, text: str) -> Graph:
        """Rebuild a graph from :meth:`to_json` output, re-validating every node."""
        from cherenkov.graph.serialize import graph_from_json

        return graph_from_json(text)

    @property
    def captured_sources(self) -> dict[str, str]:
        """Where each input of a graph captured by :func:`~cherenkov.from_torch` comes from:
        ``"arg:I"`` for the I-th positional tensor argument, else the dotted name of the
        module's parameter, buffer or lifted constant (``"attn.c_attn.weight"``). Empty for a
        graph built by hand."""
        return dict(self._sources)

    def example_inputs(self) -> dict[str, np.ndarray]:
        """Example values per input: those captured by ``ck.from_torch``, else random normals."""
        from cherenkov.graph.evaluate import fill_saved_inputs

        rng = np.random.default_rng(0)
        examples = {}
        for name, t in self.inputs.items():
            if name in self._saved and name not in self._examples:
                continue  # computed below from the others: a saved input holds its value
            if name in self._examples:
                examples[name] = self._examples[name]
            else:  # an 8-bit input's values are those its dtype holds
                value = rng.standard_normal(t.shape)
                examples[name] = (round_to_fp8(value, t.dtype) if t.dtype in sh.FP8_DTYPES else
                                  round_to_e8m0(value) if t.dtype in sh.SCALE_DTYPES else value)  # fmt: skip
        return fill_saved_inputs(self, examples)

    def summary(self) -> dict:
        """Inputs, outputs, op counts and FLOPs, as plain data."""
        return {
            "name": self.name,
            "inputs": {n: {"shape": list(t.shape), "dtype": t.dtype} for n, t in self.inputs.items()},
            "outputs": {n: {"shape": list(t.shape), "dtype": t.dtype} for n, t in self.outputs.items()},
            "ops": dict(sorted(self.ops().items())),
            "nodes": len(self.live_nodes()),
            "flops": self.flops(),
        }

    def __repr__(self) -> str:
        return f"Graph({self.name!r}, inputs={list(self._inputs)}, outputs={list(self._outputs)}, nodes={len(self._nodes)})"


class Tensor:
    """A node of a graph with torch-like operators; every method adds primitives."""

    __slots__ = ("graph", "id")
    __array_priority__ = 1000  # NumPy scalars defer to our reflected operators

    def __init__(self, graph: Graph, index: int) -> None:
        self.graph = graph
        self.id = index

    @property
    def node(self) -> Node:
        return self.graph.node(self.id)

    @property
    def shape(self) -> tuple[int, ...]:
        return self.node.shape

    @property
    def dtype(self) -> str:
        return self.node.dtype

    @property
    def ndim(self) -> int:
        return len(self.node.shape)

    def __repr__(self) -> str:
        return f"Tensor({self.node.op}, shape={self.shape}, dtype={self.dtype})"

    def __bool__(self) -> bool:
        raise GraphError("Tensor: a symbolic tensor has no truth value; use ck.where for selection")

    # ------------------------------------------------------------- coercion

    def _coerce(self, other: object, op: str) -> Tensor:
        """``other`` as a tensor of this graph (scalars become constants)."""
        if isinstance(other, Tensor):
            return self.graph._lift(other, op)
        if isinstance(other, np.generic):
            other = other.item()
        if isinstance(other, bool):
            return self.graph.constant(other, "bool")
        if isinstance(other, int):
            return self.graph.constant(other, "int32" if self.dtype in ("int32", "bool") else self.dtype)
        if isinstance(other, float):
            return self.graph.constant(other, self.dtype if self.dtype in sh.FLOAT_DTYPES else "fp32")
        raise GraphError(f"{op}: cannot combine a Tensor with {type(other).__name__} {other!r}")

    def broadcast_to(self, shape: Sequence[int], op: str = "expand") -> Tensor:
        shape = tuple(shape)
        if shape == self.shape:
            return self
        return self.graph._apply("expand", (self,), (sh.expand_shape(op, self.shape, shape),))

    def _elementwise(self, op: str, others: Sequence[object], name: str) -> Tensor:
        home = _graph_of([self, *others], name).graph
        first = home._lift(self, name)
        operands = [first, *(first._coerce(o, name) for o in others)]
        shape = sh.broadcast_shapes(name, *(t.shape for t in operands))
        return home._apply(op, tuple(t.broadcast_to(shape, name) for t in operands))

    def _unary(self, op: str) -> Tensor:
        return self.graph._apply(op, (self,))

    # ------------------------------------------------------------- arithmetic

    def __add__(self, other: object) -> Tensor:
        return self._elementwise("add", [other], "add")

    def __radd__(self, other: object) -> Tensor:
        return self._coerce(other, "add")._elementwise("add", [self], "add")

    def __sub__(self, other: object) -> Tensor:
        return self._elementwise("add", [-self._coerce(other, "sub")], "sub")

    def __rsub__(self, other: object) -> Tensor:
        return self._coerce(other, "sub")._elementwise("add", [-self], "sub")

    def __mul__(self, other: object) -> Tensor:
        return self._elementwise("mul", [other], "mul")

    def __rmul__(self, other: object) -> Tensor:
        return self._coerce(other, "mul")._elementwise("mul", [self], "mul")

    def __truediv__(self, other: object) -> Tensor:
        if isinstance(other, (int, float)) and not isinstance(other, bool):
            if other == 0:
                raise GraphError(f"div: division of a tensor of shape {self.shape} by the constant 0")
            return self * (1.0 / other)
        return self._elementwise("mul", [self._coerce(other, "div").recip()], "div")

    def __rtruediv__(self, other: object) -> Tensor:
        numerator = self._coerce(other, "div")
        if numerator.node.op == "constant" and numerator.node.attrs[0] == 1:
            return self.recip()
        return numerator._elementwise("mul", [self.recip()], "div")

    def __neg__(self) -> Tensor:
        return self._unary("neg")

    def __mod__(self, other: object) -> Tensor:
        return self._elementwise("mod", [other], "mod")

    def __rmod__(self, other: object) -> Tensor:
        return self._coerce(other, "mod")._elementwise("mod", [self], "mod")

    def __pow__(self, exponent: object) -> Tensor:
        if not isinstance(exponent, (int, float)) or isinstance(exponent, bool):
            raise GraphError(f"pow: exponent must be a Python int or float, got {type(exponent).__name__}")
        if exponent == 0.5:
            return self.sqrt()
        if exponent == -0.5:
            return self.rsqrt()
        if float(exponent).is_integer() and abs(exponent) <= 64:
            return self._integer_power(int(exponent))
        return (self.log2() * float(exponent)).exp2()

    def _integer_power(self, exponent: int) -> Tensor:
        """``x ** n`` by square-and-multiply (exact for negative bases)."""
        if exponent == 0:
            return self._coerce(1, "pow").broadcast_to(self.shape, "pow")
        if exponent < 0:
            return self._integer_power(-exponent).recip()
        result, square = None, self
        while exponent:
            if exponent & 1:
                result = square if result is None else result * square
            exponent >>= 1
            if exponent:
                square = square * square
        assert result is not None
        return result

    def __matmul__(self, other: object) -> Tensor:
        return matmul(self, self._coerce(other, "matmul"))

    def __rmatmul__(self, other: object) -> Tensor:
        return matmul(self._coerce(other, "matmul"), self)

    def __lt__(self, other: object) -> Tensor:
        return self._elementwise("less_than", [other], "less_than")

    def __gt__(self, other: object) -> Tensor:
        return self._coerce(other, "greater_than")._elementwise("less_than", [self], "greater_than")

    def __le__(self, other: object) -> Tensor:
        return _not(self._coerce(other, "less_equal")._elementwise("less_than", [self], "less_equal"))

    def __ge__(self, other: object) -> Tensor:
        return _not(self._elementwise("less_than", [other], "greater_equal"))

    def maximum(self, other: object) -> Tensor:
        return self._elementwise("maximum", [other], "maximum")

    def minimum(self, other: object) -> Tensor:
        other = self._coerce(other, "minimum")
        sh.broadcast_shapes("minimum", self.shape, other.shape)
        return -((-self).maximum(-other))

    # ------------------------------------------------------------- unary math

    def exp2(self) -> Tensor:
        return self._unary("exp2")

    def exp(self) -> Tensor:
        return (self * LOG2E).exp2()

    def log2(self) -> Tensor:
        return self._unary("log2")

    def log(self) -> Tensor:
        return self.log2() * LN2

    def sqrt(self) -> Tensor:
        return self._unary("sqrt")

    def recip(self) -> Tensor:
        return self._unary("recip")

    def rsqrt(self) -> Tensor:
        return self.sqrt().recip()

    def sin(self) -> Tensor:
        return self._unary("sin")

    def cos(self) -> Tensor:
        return (self + math.pi / 2).sin()

    def abs(self) -> Tensor:
        return self.maximum(-self)

    def cast(self, dtype: str) -> Tensor:
        targets = tuple(d for d in sh.DTYPES if d not in sh.SCALE_DTYPES)
        name = str(dtype).removeprefix("torch.")
        if sh.DTYPE_ALIASES.get(name, name) in sh.SCALE_DTYPES:
            raise GraphError(f"cast: to {dtype} (an MX scale dtype, inputs only); valid: {', '.join(targets)}")
        dtype = sh.normalize_dtype("cast", dtype, targets)
        return self if dtype == self.dtype else self.graph._apply("cast", (self,), (dtype,))

    to = cast

    def float(self) -> Tensor:
        return self.cast("fp32")

    # ------------------------------------------------------------- reductions

    def _axes(self, name: str, axis: int | Sequence[int] | None) -> tuple[int, ...]:
        if axis is None:
            return tuple(range(self.ndim))
        if isinstance(axis, (tuple, list)):
            axes = tuple(sh.normalize_axis(name, a, self.ndim, self.shape) for a in axis)
        else:
            axes = (sh.normalize_axis(name, axis, self.ndim, self.shape),)
        if len(set(axes)) != len(axes):
            raise GraphError(f"{name}: axis {axis} repeats an axis of shape {self.shape}")
        return axes

    def _reduce(self, op: str, name: str, axis: int | Sequence[int] | None, keepdim: bool) -> Tensor:
        axes = self._axes(name, axis)
        result = self
        for a in sorted(axes, reverse=True):
            result = self.graph._apply(op, (result,), (a,))
        if keepdim:
            result = result.reshape(*(1 if i in axes else d for i, d in enumerate(self.shape)))
        return result

    def sum(self, axis: int | Sequence[int] | None = None, keepdim: bool = False) -> Tensor:
        return self._reduce("sum_reduce", "sum", axis, keepdim)

    def max(self, axis: int | Sequence[int] | None = None, keepdim: bool = False) -> Tensor:
        return self._reduce("max_reduce", "max", axis, keepdim)

    def min(self, axis: int | Sequence[int] | None = None, keepdim: bool = False) -> Tensor:
        return -((-self).max(axis, keepdim))

    def mean(self, axis: int | Sequence[int] | None = None, keepdim: bool = False) -> Tensor:
        count = math.prod(self.shape[a] for a in self._axes("mean", axis))
        return self.sum(axis, keepdim) * (1.0 / count)

    # ------------------------------------------------------------- views

    def permute(self, *dims: int | Sequence[int]) -> Tensor:
        perm = tuple(dims[0]) if len(dims) == 1 and isinstance(dims[0], (tuple, list)) else dims
        _, axes = sh.permute_shape("permute", self.shape, perm)  # type: ignore[arg-type]
        if axes == tuple(range(self.ndim)):
            return self
        return self.graph._apply("permute", (self,), (axes,))

    def transpose(self, a: int, b: int) -> Tensor:
        a = sh.normalize_axis("transpose", a, self.ndim, self.shape)
        b = sh.normalize_axis("transpose", b, self.ndim, self.shape)
        perm = list(range(self.ndim))
        perm[a], perm[b] = perm[b], perm[a]
        return self.permute(perm)

    @property
    def mT(self) -> Tensor:
        return self.transpose(-2, -1)

    def reshape(self, *shape: int | Sequence[int]) -> Tensor:
        target = tuple(shape[0]) if len(shape) == 1 and isinstance(shape[0], (tuple, list)) else shape
        resolved = sh.reshape_shape("reshape", self.shape, target)  # type: ignore[arg-type]
        if resolved == self.shape:
            return self
        return self.graph._apply("reshape", (self,), (resolved,))

    view = reshape

    def expand(self, *shape: int | Sequence[int]) -> Tensor:
        target = tuple(shape[0]) if len(shape) == 1 and isinstance(shape[0], (tuple, list)) else shape
        lead = len(target) - self.ndim
        if lead < 0:
            raise GraphError(f"expand: cannot expand shape {self.shape} to {target}, which has fewer axes")
        resolved = tuple(
            self.shape[i - lead] if d == -1 and i >= lead else d for i, d in enumerate(target)  # type: ignore[misc]
        )
        return self.broadcast_to(sh.check_shape("expand", resolved))

    def unsqueeze(self, dim: int) -> Tensor:
        axis = sh.normalize_axis("unsqueeze", dim, self.ndim + 1, self.shape)
        return self.reshape(*self.shape[:axis], 1, *self.shape[axis:])

    def squeeze(self, dim: int | None = None) -> Tensor:
        if dim is None:
            return self.reshape(*(d for d in self.shape if d != 1))
        axis = sh.normalize_axis("squeeze", dim, self.ndim, self.shape)
        if self.shape[axis] != 1:
            return self
        return self.reshape(*self.shape[:axis], *self.shape[axis + 1 :])

    def contiguous(self) -> Tensor:
        return self.graph._apply("contiguous", (self,))

    def slice(self, starts: Sequence[int], stops: Sequence[int]) -> Tensor:
        """``x[starts[0]:stops[0], ...]`` with unit step (a view)."""
        starts, stops = tuple(starts), tuple(stops)
        sh.slice_shape("slice", self.shape, starts, stops)
        if starts == (0,) * self.ndim and stops == self.shape:
            return self
        return self.graph._apply("slice", (self,), (starts, stops))

    def pad(self, pads: Sequence[Sequence[int]], value: float = 0.0) -> Tensor:
        """Pad ``(before, after)`` elements on each axis with ``value`` (NumPy ``pad`` order)."""
        pairs = tuple((int(lo), int(hi)) for lo, hi in pads)
        sh.pad_shape("pad", self.shape, pairs)
        if isinstance(value, float) and math.isnan(value):
            raise GraphError("pad: the fill value must not be NaN")
        return self.graph._apply("pad", (self,), (pairs, float(value)))

    def __getitem__(self, index: object) -> Tensor:
        items = index if isinstance(index, tuple) else (index,)
        if sum(1 for i in items if i is Ellipsis) > 1:
            raise GraphError("getitem: at most one ... in an index")
        explicit = sum(1 for i in items if i is not None and i is not Ellipsis)
        if explicit > self.ndim:
            raise GraphError(f"getitem: {explicit} indices for a tensor of shape {self.shape}")
        expanded: list[object] = []
        for item in items:
            if item is Ellipsis:
                expanded.extend([slice(None)] * (self.ndim - explicit))
            else:
                expanded.append(item)
        expanded.extend([slice(None)] * (self.ndim - sum(1 for i in expanded if i is not None)))
        starts, stops, out_shape = [], [], []
        axis = 0
        for item in expanded:
            if item is None:
                out_shape.append(1)
                continue
            size = self.shape[axis]
            if isinstance(item, slice):
                lo, hi, step = item.indices(size)
                if step != 1:
                    raise GraphError(f"getitem: step {step} on axis {axis} is not supported; use unit steps")
                if hi <= lo:
                    raise GraphError(f"getitem: slice {item} of axis {axis} (size {size}) is empty")
                starts.append(lo)
                stops.append(hi)
                out_shape.append(hi - lo)
            elif isinstance(item, int) and not isinstance(item, bool):
                if not -size <= item < size:
                    raise GraphError(f"getitem: index {item} is out of range for axis {axis} of size {size}")
                starts.append(item % size)
                stops.append(item % size + 1)
            else:
                raise GraphError(f"getitem: unsupported index {item!r}; use ints, unit-step slices, None or ...")
            axis += 1
        return self.slice(starts, stops).reshape(*out_shape)


def _not(condition: Tensor) -> Tensor:
    """Logical not of a bool tensor, as ``where(c, False, True)``."""
    return where(condition, False, True)


def _graph_of(values: Sequence[object], op: str) -> Tensor:
    """The first tensor among ``values`` that belongs to a user graph (else the first tensor)."""
    tensors = [v for v in values if isinstance(v, Tensor)]
    if not tensors:
        raise GraphError(f"{op}: needs at least one Tensor operand")
    return next((t for t in tensors if not t.graph._free), tensors[0])


def where(condition: object, a: object, b: object) -> Tensor:
    """``a`` where ``condition`` holds, else ``b`` (a select, never an arithmetic blend)."""
    anchor = _graph_of([condition, a, b], "where")
    cond = anchor._coerce(condition, "where")
    if cond.dtype != "bool":
        raise GraphError(f"where: condition of shape {cond.shape} has dtype {cond.dtype}; it must be bool")
    branches = [x for x in (a, b) if isinstance(x, Tensor)]
    like = anchor._coerce(branches[0], "where") if branches else cond
    ta, tb = like._coerce(a, "where"), like._coerce(b, "where")
    return cond._elementwise("where", [ta, tb], "where")


def matmul(a: Tensor, b: Tensor) -> Tensor:
    """``a @ b`` with NumPy semantics: batch axes broadcast, 1-D operands promoted."""
    anchor = _graph_of([a, b], "matmul")
    a, b = anchor._coerce(a, "matmul"), anchor._coerce(b, "matmul")
    if a.ndim == 0 or b.ndim == 0:
        raise GraphError(f"matmul: operands of shapes {a.shape} and {b.shape}; both need at least one axis")
    a2 = a.unsqueeze(0) if a.ndim == 1 else a
    b2 = b.unsqueeze(-1) if b.ndim == 1 else b
    (m, k), (k2, n) = a2.shape[-2:], b2.shape[-2:]
    if k != k2:
        raise GraphError(
            f"matmul: inner dimensions differ: {a.shape} @ {b.shape} ({k} != {k2}); "
            "valid when a.shape[-1] == b.shape[-2]"
        )
    batch = sh.broadcast_shapes("matmul", a2.shape[:-2], b2.shape[:-2])
    full = (*batch, m, n, k)
    left = a2.unsqueeze(-2).broadcast_to(full, "matmul")
    right = b2.transpose(-1, -2).unsqueeze(-3).broadcast_to(full, "matmul")
    out = (left * right).sum(axis=-1)
    if a.ndim == 1:
        out = out.squeeze(-2)
    if b.ndim == 1:
        out = out.squeeze(-1)
    return out


def arange(start: int, stop: int | None = None, *, graph: Graph | None = None) -> Tensor:
    """``start, ..., stop-1`` as int32; ``arange(n)`` counts from 0. Without ``graph`` the
    tensor is free and joins the graph of the first tensor it is combined with."""
    if stop is None:
        start, stop = 0, start
    for value in (start, stop):
        if not isinstance(value, int) or isinstance(value, bool):
            raise GraphError(f"arange: bounds must be ints, got {value!r}")
    if stop <= start:
        raise GraphError(f"arange: empty range [{start}, {stop}); stop must exceed start")
    home = graph if graph is not None else Graph("free", _free=True)
    counted = home.arange(stop - start)
    return counted + start if start else counted


def constant(value: Scalar, dtype: str = "fp32", *, graph: Graph | None = None) -> Tensor:
    """A scalar constant; free (joins the first graph it is combined with) without ``graph``."""
    home = graph if graph is not None else Graph("free", _free=True)
    return home.constant(value, dtype)


def cat(tensors: Sequence[Tensor], axis: int = 0) -> Tensor:
    """Concatenate along ``axis``: each piece is zero-padded to the full extent, then summed."""
    if not tensors:
        raise GraphError("cat: needs at least one tensor")
    first = tensors[0]
    axis = sh.normalize_axis("cat", axis, first.ndim, first.shape)
    for t in tensors[1:]:
        if t.ndim != first.ndim or any(t.shape[i] != first.shape[i] for i in range(first.ndim) if i != axis):
            raise GraphError(
                f"cat: shapes {[x.shape for x in tensors]} differ outside axis {axis}; all other axes must match"
            )
    total = sum(t.shape[axis] for t in tensors)
    offset, result = 0, None
    for t in tensors:
        pads = [(0, 0)] * t.ndim
        pads[axis] = (offset, total - offset - t.shape[axis])
        piece = t.pad(pads) if total != t.shape[axis] else t
        result = piece if result is None else result + piece
        offset += t.shape[axis]
    assert result is not None
    return result
