"""Faulty candidates on purpose (tests only): each way a generated kernel can fail.

``inject_fault(source, kind)`` returns the source of a candidate that fails to compile
(``compile_error``), writes out of bounds (``crash``: an illegal address poisons the
CUDA context), never finishes (``hang``) or leaves part of its output unwritten
(``wrong``: the poisoned NaNs survive). The search must record each with its reason and
carry on.
"""

from __future__ import annotations

import re

FAULTS: dict[str, str] = {
    "crash": "if (threadIdx.x == 0) { reinterpret_cast<volatile float*>(16)[blockIdx.x] = 1.0f; }",
    "hang": "for (;;) { if (clock64() < 0) { break; } }",
    "wrong": "if (blockIdx.x == 0 && blockIdx.y == 0 && blockIdx.z == 0) { return; }",
}


def inject_fault(source: str, kind: str) -> str:
    """``source`` with fault ``kind`` injected at the top of its ``__global__`` function."""
    if kind == "compile_error":
        return source + "\n#error injected fault: this candidate must not compile\n"
    if kind not in FAULTS:
        raise ValueError(f"unknown fault {kind!r}; known: compile_error, {', '.join(FAULTS)}")
    match = re.search(r"__global__[^{]*\{", source)
    if match is None:
        raise ValueError("no __global__ function in the source")
    return source[: match.end()] + f"\n  /* injected fault: {kind} */ {FAULTS[kind]}\n" + source[match.end() :]
