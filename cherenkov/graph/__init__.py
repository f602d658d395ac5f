"""The graph layer: primitive ops, the builder, shapes, the float64 reference evaluator."""

from cherenkov.graph import nn
from cherenkov.graph.autodiff import grad
from cherenkov.graph.errors import GraphError
from cherenkov.graph.evaluate import evaluate
from cherenkov.graph.ops import PRIMITIVES, Node
from cherenkov.graph.tensor import Graph, Tensor, arange, cat, constant, matmul, where
from cherenkov.graph.torch_capture import from_torch

__all__ = [
    "PRIMITIVES",
    "Graph",
    "GraphError",
    "Node",
    "Tensor",
    "arange",
    "cat",
    "constant",
    "evaluate",
    "from_torch",
    "grad",
    "matmul",
    "nn",
    "where",
]
