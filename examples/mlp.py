"""A two-layer GELU MLP: ``y = gelu(x @ w1 + b1) @ w2``.

GELU is the tanh approximation (``ck.nn.gelu``'s default, as in GPT-2). Two contractions
with an elementwise epilogue between them.

Run it with ``cherenkov optimize --example mlp [--shape M,D,F]``.
"""

from __future__ import annotations

from collections.abc import Sequence

import cherenkov as ck

DEFAULT_SHAPE: tuple[int, ...] = (4096, 1024, 4096)


def _dims(shape: Sequence[int] | None, count: int, doc: str) -> tuple[int, ...]:
    dims = DEFAULT_SHAPE if shape is None else tuple(shape)
    if len(dims) != count or not all(isinstance(d, int) and not isinstance(d, bool) and d > 0 for d in dims):
        raise ck.GraphError(f"mlp example: shape {shape!r} must be {doc} with positive ints")
    return dims


def build(shape: tuple[int, ...] | None = None, causal: bool = False, dtype: str = "bf16") -> ck.Graph:
    """MLP over ``x (M, D)`` with ``w1 (D, F)``, ``b1 (F,)``, ``w2 (F, D)``; output ``y (M, D)``.

    ``shape`` is ``(M, D, F)`` (tokens, model width, hidden width), default
    ``(4096, 1024, 4096)``. ``causal`` is accepted for a uniform example signature and
    ignored. ``dtype`` is the inputs' dtype.
    """
    m, d, f = _dims(shape, 3, "(M, D, F)")
    g = ck.Graph("mlp")
    x = g.input("x", (m, d), dtype=dtype)
    w1 = g.input("w1", (d, f), dtype=dtype)
    b1 = g.input("b1", (f,), dtype=dtype)
    w2 = g.input("w2", (f, d), dtype=dtype)
    g.output(ck.nn.gelu(x @ w1 + b1) @ w2, "y")
    return g
