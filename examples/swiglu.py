"""A SwiGLU feed-forward block (LLaMA style): ``y = (silu(x @ w_gate) * (x @ w_up)) @ w_down``.

Two contractions sharing their left operand, a gated elementwise product, and a third
contraction.

Run it with ``cherenkov optimize --example swiglu [--shape M,D,F]``.
"""

from __future__ import annotations

from collections.abc import Sequence

import cherenkov as ck

DEFAULT_SHAPE: tuple[int, ...] = (4096, 1024, 2816)


def _dims(shape: Sequence[int] | None, count: int, doc: str) -> tuple[int, ...]:
    dims = DEFAULT_SHAPE if shape is None else tuple(shape)
    if len(dims) != count or not all(isinstance(d, int) and not isinstance(d, bool) and d > 0 for d in dims):
        raise ck.GraphError(f"swiglu example: shape {shape!r} must be {doc} with positive ints")
    return dims


def build(shape: tuple[int, ...] | None = None, causal: bool = False, dtype: str = "bf16") -> ck.Graph:
    """SwiGLU over ``x (M, D)`` with ``w_gate``, ``w_up (D, F)`` and ``w_down (F, D)``; output ``y``.

    ``shape`` is ``(M, D, F)`` (tokens, model width, hidden width), default
    ``(4096, 1024, 2816)`` (F ≈ 8/3·D rounded to a multiple of 256). ``causal`` is accepted
    for a uniform example signature and ignored. ``dtype`` is the inputs' dtype.
    """
    m, d, f = _dims(shape, 3, "(M, D, F)")
    g = ck.Graph("swiglu")
    x = g.input("x", (m, d), dtype=dtype)
    w_gate = g.input("w_gate", (d, f), dtype=dtype)
    w_up = g.input("w_up", (d, f), dtype=dtype)
    w_down = g.input("w_down", (f, d), dtype=dtype)
    g.output((ck.nn.silu(x @ w_gate) * (x @ w_up)) @ w_down, "y")
    return g
