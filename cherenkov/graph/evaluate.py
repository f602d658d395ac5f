"""The float64 NumPy reference evaluator.

Every value is computed in float64 (integers as int64, masks as bool) whatever the
declared dtype; only an explicit ``cast`` rounds (to bf16, fp16 or fp32). A contraction
``sum_reduce(mul(expand a, expand b))`` is evaluated with ``einsum`` on the unexpanded
operands, so ``q @ kᵀ`` never materialises its broadcast product.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

import numpy as np

from cherenkov.graph.errors import GraphError
from cherenkov.graph.fp8 import round_to_e8m0, round_to_fp8
from cherenkov.graph.ops import Node
from cherenkov.graph.shape import FP8_DTYPES, SCALE_DTYPES
from cherenkov.graph.tensor import Graph


class Evaluable(Protocol):
    """Anything with a float64 reference of its own (fused kernel forms, derivations)."""

    def evaluate(self, inputs: Mapping[str, Any]) -> dict[str, np.ndarray]: ...


def round_to_dtype(values: np.ndarray, dtype: str) -> np.ndarray:
    """Round float64 values to ``dtype`` and back (bf16 rounds to nearest even)."""
    if dtype == "fp32":
        return values.astype(np.float32).astype(np.float64)
    if dtype == "fp16":
        return values.astype(np.float16).astype(np.float64)
    if dtype == "bf16":
        bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32).astype(np.uint64)
        rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000).astype(np.uint32)
        finite = np.isfinite(values)
        return np.where(finite, rounded.view(np.float32), values).astype(np.float64)
    if dtype in FP8_DTYPES:
        return round_to_fp8(values, dtype)
    if dtype in SCALE_DTYPES:
        return round_to_e8m0(values)
    if dtype == "int32":
        return np.trunc(values).astype(np.int64)
    return values != 0


def as_float64(value: Any) -> np.ndarray:
    """A NumPy float64 copy of an array-like (torch tensors of any dtype included)."""
    if hasattr(value, "detach"):
        value = value.detach().cpu().double().numpy()
    return np.array(value, dtype=np.float64)


def check_inputs(graph: Graph, inputs: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """Inputs as float64 arrays, after checking names and shapes against the graph; a saved input
    not given is computed from the value it holds (:meth:`~cherenkov.graph.tensor.Graph.saved_input`)."""
    expected = graph.inputs
    missing = sorted(set(expected) - set(inputs) - set(graph.saved))
    if missing:
        raise GraphError(f"evaluate: missing inputs {missing}; graph {graph.name!r} needs {sorted(expected)}")
    unknown = sorted(set(inputs) - set(expected))
    if unknown:
        raise GraphError(f"evaluate: unknown inputs {unknown}; graph {graph.name!r} has {sorted(expected)}")
    arrays = {}
    for name, tensor in expected.items():
        if name not in inputs:
            continue
        array = as_float64(inputs[name])
        if array.shape != tensor.shape:
            raise GraphError(f"evaluate: input {name!r} has shape {array.shape}; the graph declares {tensor.shape}")
        arrays[name] = array
    return fill_saved_inputs(graph, arrays)


def fill_saved_inputs(graph: Graph, arrays: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """``arrays`` with each saved input it lacks computed from the value that input holds, in the
    order they were declared (a saved value may read an earlier saved input)."""
    filled = dict(arrays)
    for name, value in graph.saved.items():
        if name not in filled:
            filled[name] = np.array(_values(graph, filled, [value.id])[value.id], dtype=np.float64)
    return filled


def _contract(a: np.ndarray, b: np.ndarray, axis: int) -> np.ndarray:
    """``(a * b).sum(axis)`` for equal-shape operands, skipping their broadcast axes."""
    letters = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"[: a.ndim]

    def squeeze(x: np.ndarray) -> tuple[np.ndarray, str]:
        keep = [i for i in range(x.ndim) if not (x.strides[i] == 0 and x.shape[i] > 1)]
        index = tuple(slice(None) if i in keep else 0 for i in range(x.ndim))
        return x[index], "".join(letters[i] for i in keep)

    (xa, sa), (xb, sb) = squeeze(a), squeeze(b)
    out = letters[:axis] + letters[axis + 1 :]
    missing = set(letters) - set(sa) - set(sb) - {letters[axis]}
    result = np.einsum(f"{sa},{sb}->{''.join(c for c in out if c not in missing)}", xa, xb, optimize=True)
    if letters[axis] not in sa + sb:
        result = result * a.shape[axis]
    target = tuple(a.shape[i] for i in range(a.ndim) if i != axis)
    view_shape = tuple(1 if letters[i] in missing else a.shape[i] for i in range(a.ndim) if i != axis)
    return np.broadcast_to(result.reshape(view_shape), target)


def _apply(node: Node, args: list[np.ndarray]) -> np.ndarray:
    op, attrs = node.op, node.attrs
    match op:
        case "constant":
            return np.array(attrs[0], dtype=bool if node.dtype == "bool" else np.float64)
        case "iota":
            return np.arange(attrs[0], dtype=np.int64)
        case "cast":
            return round_to_dtype(np.asarray(args[0], dtype=np.float64), attrs[0])
        case "exp2":
            return np.exp2(args[0])
        case "log2":
            return np.log2(args[0])
        case "sin":
            return np.sin(args[0])
        case "sqrt":
            return np.sqrt(args[0])
        case "recip":
            return 1.0 / args[0]
        case "neg":
            return -args[0]
        case "add":
            return args[0] + args[1]
        case "mul":
            return args[0] * args[1]
        case "mod":
            return np.mod(args[0], args[1])
        case "maximum":
            return np.maximum(args[0], args[1])
        case "less_than":
            return np.less(args[0], args[1])
        case "where":
            return np.where(args[0], args[1], args[2])
        case "sum_reduce":
            return args[0].sum(axis=attrs[0])
        case "max_reduce":
            return args[0].max(axis=attrs[0])
        case "permute":
            return np.transpose(args[0], attrs[0])
        case "expand":
            return np.broadcast_to(args[0], attrs[0])
        case "reshape":
            return np.reshape(args[0], attrs[0])
        case "slice":
            return args[0][tuple(slice(lo, hi) for lo, hi in zip(*attrs))]
        case "pad":
            return np.pad(args[0], attrs[0], constant_values=attrs[1])
        case "contiguous":
            return np.ascontiguousarray(args[0])
    raise GraphError(f"evaluate: op {op!r} has no reference implementation")  # pragma: no cover


def evaluate(graph: Graph | Evaluable, inputs: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """Evaluate every output of ``graph`` in float64; returns ``{output name: ndarray}``.

    Fused kernel forms and derivations are accepted too: they evaluate themselves.
    """
    if not isinstance(graph, Graph):
        if hasattr(graph, "evaluate"):
            return graph.evaluate(inputs)
        raise GraphError(f"evaluate: expected a Graph or a fused form, got {type(graph).__name__}")
    arrays = check_inputs(graph, inputs)
    roots = [t.id for t in graph.outputs.values()]
    values = _values(graph, arrays, roots)
    return {name: np.array(values[t.id], dtype=np.float64) for name, t in graph.outputs.items()}


def _values(graph: Graph, arrays: Mapping[str, np.ndarray], roots: list[int]) -> dict[int, np.ndarray]:
    """The value of every node ``roots`` depend on, from the input ``arrays``."""
    live = sorted(graph.ancestors(roots))
    consumers: dict[int, list[int]] = {i: [] for i in live}
    for i in live:
        for j in graph.node(i).inputs:
            consumers[j].append(i)
    outputs = set(roots)
    contracted = {
        i
        for i in live
        if graph.node(i).op == "mul"
        and i not in outputs
        and consumers[i]
        and all(graph.node(c).op == "sum_reduce" for c in consumers[i])
    }
    values: dict[int, np.ndarray] = {}
    with np.errstate(all="ignore"):
        for i in live:
            node = graph.node(i)
            if i in contracted:
                continue
            if node.op == "input":
                values[i] = arrays[node.attrs[0]]
            elif node.op == "sum_reduce" and node.inputs[0] in contracted:
                a, b = (values[j] for j in graph.node(node.inputs[0]).inputs)
                values[i] = _contract(a, b, node.attrs[0])
            else:
                values[i] = _apply(node, [values[j] for j in node.inputs])
    return values
