"""Compiled functions as ``torch.library`` custom ops: one op per function, ``cherenkov::<name>``.

:func:`register_op` defines ``cherenkov::<name>(Tensor[] inputs) -> Tensor[]`` for a
:class:`~cherenkov.search.compiled.CompiledFunction`: its CPU and CUDA kernels call the
function (which reads the module's bound parameters itself), its fake implementation gives
the outputs' shapes and dtypes from the prepared ``ck.Graph`` of the inputs' signature
(preparing it, as a first call would, for a signature not seen yet). So a compiled function
is one op in ``torch.profiler`` traces, Dynamo traces through it (``fullgraph=True``), and
inductor or a CUDA-graph capture around it treats it as an opaque kernel.

Op names are built from the function's name reduced to ``[a-z0-9_]`` plus a process-wide
counter (no user text reaches the schema unchecked, and two functions never share an op).
"""

from __future__ import annotations

import itertools
import re
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from cherenkov.search.compiled import CompiledFunction

NAMESPACE = "cherenkov"
_counter = itertools.count()
_library: Any = None


def op_name(base: str) -> str:
    """A fresh op name from ``base``: lower case, ``[a-z0-9_]`` only, a unique numeric suffix."""
    stem = re.sub(r"[^a-z0-9_]+", "_", base.lower()).strip("_")[:48] or "function"
    if stem[0].isdigit():
        stem = f"f_{stem}"
    return f"{stem}_{next(_counter)}"


def register_op(function: CompiledFunction, base: str) -> Any:
    """Define ``cherenkov::<op_name(base)>`` running ``function``; returns its OpOverload."""
    import torch

    global _library
    if _library is None:
        _library = torch.library.Library(NAMESPACE, "FRAGMENT")
    name = op_name(base)
    _library.define(f"{name}(Tensor[] inputs) -> Tensor[]")

    def kernel(inputs: list[Any]) -> list[Any]:
        return _unaliased(function.outputs_of(inputs), inputs)

    def fake(inputs: list[Any]) -> list[Any]:
        return [torch.empty(shape, dtype=dtype, device=inputs[0].device if inputs else "cpu")
                for shape, dtype in function.output_specs(inputs)]  # fmt: skip

    _library.impl(name, kernel, "CPU")
    _library.impl(name, kernel, "CUDA")
    torch.library.register_fake(f"{NAMESPACE}::{name}", fake, lib=_library)
    return getattr(getattr(torch.ops, NAMESPACE), name).default


def _unaliased(outputs: list[Any], inputs: list[Any]) -> list[Any]:
    """``outputs`` with any that shares an input's storage (a region output that is one of its
    inputs) copied: a custom op's outputs must not alias its inputs."""
    held = {t.untyped_storage().data_ptr() for t in inputs}
    return [o.clone() if o.untyped_storage().data_ptr() in held else o for o in outputs]
