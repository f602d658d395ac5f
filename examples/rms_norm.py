"""RMSNorm followed by a matmul: ``y = rms_norm(x, weight) @ w``.

The normalisation is a row reduction over the last axis feeding a contraction, the
pattern of every pre-norm transformer projection.

Run it with ``cherenkov optimize --example rms_norm [--shape M,D,N]``.
"""

from __future__ import annotations

from collections.abc import Sequence

import cherenkov as ck

DEFAULT_SHAPE: tuple[int, ...] = (4096, 4096, 4096)
EPS = 1e-6


def _dims(shape: Sequence[int] | None, count: int, doc: str) -> tuple[int, ...]:
    dims = DEFAULT_SHAPE if shape is None else tuple(shape)
    if len(dims) != count or not all(isinstance(d, int) and not isinstance(d, bool) and d > 0 for d in dims):
        raise ck.GraphError(f"rms_norm example: shape {shape!r} must be {doc} with positive ints")
    return dims


def build(shape: tuple[int, ...] | None = None, causal: bool = False, dtype: str = "bf16") -> ck.Graph:
    """RMSNorm (eps 1e-6) of ``x (M, D)`` scaled by ``weight (D,)``, then ``@ w (D, N)``; output ``y``.

    ``shape`` is ``(M, D, N)``, default ``(4096, 4096, 4096)``. ``causal`` is accepted for a
    uniform example signature and ignored. ``dtype`` is the inputs' dtype.
    """
    m, d, n = _dims(shape, 3, "(M, D, N)")
    g = ck.Graph("rms_norm")
    x = g.input("x", (m, d), dtype=dtype)
    weight = g.input("weight", (d,), dtype=dtype)
    w = g.input("w", (d, n), dtype=dtype)
    g.output(ck.nn.rms_norm(x, weight, eps=EPS) @ w, "y")
    return g
