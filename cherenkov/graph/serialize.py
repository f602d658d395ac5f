"""Lossless, versioned JSON for graphs (no pickle).

Floats are written as ``{"f": float.hex(x)}`` so every constant survives exactly (±inf
included); tuples are lists. Loading replays every node through the builder's own
validation, so a hand-edited file cannot produce an inconsistent graph.
"""

from __future__ import annotations

import json
from typing import Any

from cherenkov.graph.errors import GraphError
from cherenkov.graph.ops import PRIMITIVES
from cherenkov.graph.tensor import Graph, Tensor

FORMAT = "cherenkov.graph"
VERSION = 1


def _encode(value: Any) -> Any:
    if isinstance(value, float):
        return {"f": value.hex()}
    if isinstance(value, tuple):
        return [_encode(v) for v in value]
    return value


def _decode(value: Any) -> Any:
    if isinstance(value, dict):
        if set(value) != {"f"} or not isinstance(value["f"], str):
            raise GraphError(f"from_json: unexpected attribute object {value!r}")
        try:
            return float.fromhex(value["f"])
        except ValueError:
            raise GraphError(f"from_json: {value['f']!r} is not a hexadecimal float") from None
    if isinstance(value, list):
        return tuple(_decode(v) for v in value)
    return value


def _structure(graph: Graph) -> dict[str, Any]:
    marks = {"gradient": True} if graph.is_gradient else {}  # absent otherwise: older hashes stay
    if graph.saved:
        marks["saved"] = {name: t.id for name, t in graph.saved.items()}
    return {
        **marks,
        "nodes": [
            {
                "op": n.op,
                "inputs": list(n.inputs),
                "attrs": _encode(n.attrs),
                "shape": list(n.shape),
                "dtype": n.dtype,
            }
            for n in graph.nodes
        ],
        "inputs": {name: t.id for name, t in graph.inputs.items()},
        "outputs": {name: t.id for name, t in graph.outputs.items()},
    }


def canonical_structure(graph: Graph) -> str:
    """The structure as compact, key-sorted JSON: the input of ``structural_hash``."""
    return json.dumps(_structure(graph), sort_keys=True, separators=(",", ":"))


def graph_to_json(graph: Graph) -> str:
    return json.dumps({"format": FORMAT, "version": VERSION, "name": graph.name, **_structure(graph)})


def _load_node(graph: Graph, position: int, record: dict, mapping: list[int]) -> int:
    """Replay one node record through the builder; returns its index in ``graph``."""
    op = record.get("op")
    if op not in PRIMITIVES:
        raise GraphError(f"from_json: node {position} has unknown op {op!r}")
    attrs = _decode(record.get("attrs", []))
    shape, dtype = tuple(record.get("shape", ())), record.get("dtype")
    inputs = record.get("inputs", [])
    if not all(isinstance(i, int) and 0 <= i < position for i in inputs):
        raise GraphError(f"from_json: node {position} ({op}) refers to inputs {inputs} that are not earlier nodes")
    if op == "input":
        tensor = graph.input(attrs[0], shape, dtype)
    elif op == "constant":
        tensor = graph.constant(attrs[0], dtype)
    else:
        tensor = graph._apply(op, tuple(Tensor(graph, mapping[i]) for i in inputs), attrs)
    if tensor.shape != shape or tensor.dtype != dtype:
        raise GraphError(
            f"from_json: node {position} ({op}) records shape {shape} {dtype} but its operands give "
            f"{tensor.shape} {tensor.dtype}"
        )
    return tensor.id


def graph_from_json(text: str) -> Graph:
    try:
        data = json.loads(text)
    except (TypeError, json.JSONDecodeError) as error:
        raise GraphError(f"from_json: not valid JSON ({error})") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise GraphError(f"from_json: not a {FORMAT} document")
    if data.get("version") != VERSION:
        raise GraphError(f"from_json: version {data.get('version')!r} is not supported (this cherenkov reads {VERSION})")
    graph = Graph(data.get("name", "graph"))
    graph.is_gradient = data.get("gradient") is True
    mapping: list[int] = []
    for position, record in enumerate(data.get("nodes", [])):
        if not isinstance(record, dict):
            raise GraphError(f"from_json: node {position} is a {type(record).__name__}, not an object")
        try:
            mapping.append(_load_node(graph, position, record, mapping))
        except GraphError:
            raise
        except (TypeError, ValueError, IndexError, KeyError) as error:
            raise GraphError(f"from_json: node {position} ({record.get('op')}) is malformed: {error!r}") from None
    for name, index in data.get("inputs", {}).items():
        if index >= len(mapping) or graph.inputs.get(name) is None or graph.inputs[name].id != mapping[index]:
            raise GraphError(f"from_json: input {name!r} does not name an input node")
    for name, index in data.get("outputs", {}).items():
        if not isinstance(index, int) or not 0 <= index < len(mapping):
            raise GraphError(f"from_json: output {name!r} refers to missing node {index!r}")
        graph.output(Tensor(graph, mapping[index]), name)
    for name, index in data.get("saved", {}).items():
        if name not in graph.inputs or not isinstance(index, int) or not 0 <= index < len(mapping):
            raise GraphError(f"from_json: saved input {name!r} (value node {index!r}) names no input and node")
        graph.mark_saved(graph.inputs[name], Tensor(graph, mapping[index]))
    return graph
