"""Row softmax: ``y = softmax(x, axis=-1)``, a max reduction, an exp and a sum reduction.

Run it with ``cherenkov optimize --example softmax [--shape M,N]``.
"""

from __future__ import annotations

from collections.abc import Sequence

import cherenkov as ck

DEFAULT_SHAPE: tuple[int, ...] = (4096, 8192)


def _dims(shape: Sequence[int] | None, count: int, doc: str) -> tuple[int, ...]:
    dims = DEFAULT_SHAPE if shape is None else tuple(shape)
    if len(dims) != count or not all(isinstance(d, int) and not isinstance(d, bool) and d > 0 for d in dims):
        raise ck.GraphError(f"softmax example: shape {shape!r} must be {doc} with positive ints")
    return dims


def build(shape: tuple[int, ...] | None = None, causal: bool = False, dtype: str = "bf16") -> ck.Graph:
    """Softmax over the last axis of ``x (M, N)``; output ``y (M, N)``.

    ``shape`` is ``(M, N)`` (rows, row length), default ``(4096, 8192)``. ``causal`` is
    accepted for a uniform example signature and ignored. ``dtype`` is the input's dtype.
    """
    m, n = _dims(shape, 2, "(M, N)")
    g = ck.Graph("softmax")
    x = g.input("x", (m, n), dtype=dtype)
    g.output(ck.nn.softmax(x, axis=-1), "y")
    return g
