"""LayerNorm with an affine weight and bias: ``y = (x - mean) / sqrt(var + eps) * weight + bias``.

Two dependent row reductions (mean, then variance of the centred rows) and an elementwise
epilogue.

Run it with ``cherenkov optimize --example layer_norm [--shape M,D]``.
"""

from __future__ import annotations

from collections.abc import Sequence

import cherenkov as ck

DEFAULT_SHAPE: tuple[int, ...] = (4096, 4096)
EPS = 1e-5


def _dims(shape: Sequence[int] | None, count: int, doc: str) -> tuple[int, ...]:
    dims = DEFAULT_SHAPE if shape is None else tuple(shape)
    if len(dims) != count or not all(isinstance(d, int) and not isinstance(d, bool) and d > 0 for d in dims):
        raise ck.GraphError(f"layer_norm example: shape {shape!r} must be {doc} with positive ints")
    return dims


def build(shape: tuple[int, ...] | None = None, causal: bool = False, dtype: str = "bf16") -> ck.Graph:
    """LayerNorm (eps 1e-5) over the last axis of ``x (M, D)`` with ``weight``, ``bias (D,)``; output ``y``.

    ``shape`` is ``(M, D)``, default ``(4096, 4096)``. ``causal`` is accepted for a uniform
    example signature and ignored. ``dtype`` is the inputs' dtype.
    """
    m, d = _dims(shape, 2, "(M, D)")
    g = ck.Graph("layer_norm")
    x = g.input("x", (m, d), dtype=dtype)
    weight = g.input("weight", (d,), dtype=dtype)
    bias = g.input("bias", (d,), dtype=dtype)
    g.output(ck.nn.layer_norm(x, weight, bias, eps=EPS), "y")
    return g
