"""cherenkov: a search-based kernel superoptimiser.

Write a computation from a dozen primitive tensor ops; e-graph rewrites derive fused
kernel forms (flash attention from naive ``softmax(q kᵀ) v``) and their schedules; each
candidate becomes CUDA C++, is compiled, checked and timed; the fastest correct one wins.
This module is the public API; everything else is an implementation detail.
"""

__version__ = "0.1.0"

from cherenkov import codegen
from cherenkov.graph import (
    PRIMITIVES,
    Graph,
    GraphError,
    Tensor,
    arange,
    cat,
    constant,
    evaluate,
    from_torch,
    grad,
    matmul,
    nn,
    where,
)

from cherenkov.rewrites.derive import Derivation, derive
from cherenkov.search.compiled import CompiledFunction, compile
from cherenkov.search.optimize import CapturedRun, OptimizeResult, optimize

__all__ = [
    "PRIMITIVES",
    "CapturedRun",
    "CompiledFunction",
    "Derivation",
    "Graph",
    "OptimizeResult",
    "GraphError",
    "Tensor",
    "__version__",
    "arange",
    "cat",
    "compile",
    "codegen",
    "constant",
    "derive",
    "evaluate",
    "from_torch",
    "grad",
    "matmul",
    "nn",
    "optimize",
    "where",
]
