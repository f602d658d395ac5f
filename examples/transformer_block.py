"""A pre-norm transformer block.

``h = x + attention(rms_norm(x, norm1) @ wq, … @ wk, … @ wv) @ wo`` then
``y = h + gelu(rms_norm(h, norm2) @ w1 + b1) @ w2``: RMSNorm, multi-head attention with
an output projection, a residual, RMSNorm, a GELU MLP and a second residual. Heads are
split from the model width as ``(B, S, H·D_HEAD) -> (B, H, S, D_HEAD)``.

Run it with ``cherenkov optimize --example transformer_block [--shape B,S,H,D_HEAD,F] [--causal]``.
"""

from __future__ import annotations

from collections.abc import Sequence

import cherenkov as ck

DEFAULT_SHAPE: tuple[int, ...] = (1, 1024, 8, 128, 4096)
EPS = 1e-6


def _dims(shape: Sequence[int] | None, count: int, doc: str) -> tuple[int, ...]:
    dims = DEFAULT_SHAPE if shape is None else tuple(shape)
    if len(dims) != count or not all(isinstance(d, int) and not isinstance(d, bool) and d > 0 for d in dims):
        raise ck.GraphError(f"transformer_block example: shape {shape!r} must be {doc} with positive ints")
    return dims


def build(shape: tuple[int, ...] | None = None, causal: bool = False, dtype: str = "bf16") -> ck.Graph:
    """One block over ``x (B, S, H·D_HEAD)``; output ``y`` of the same shape.

    ``shape`` is ``(B, S, H, D_HEAD, F)`` (batch, sequence, heads, head dim, MLP hidden
    width), default ``(1, 1024, 8, 128, 4096)``, so the model width is ``H·D_HEAD = 1024``.
    Weights are inputs: ``norm1``, ``norm2 (H·D_HEAD,)``, ``wq``, ``wk``, ``wv``, ``wo``
    ``(H·D_HEAD, H·D_HEAD)``, ``w1 (H·D_HEAD, F)``, ``b1 (F,)``, ``w2 (F, H·D_HEAD)``.
    ``causal`` masks the attention; ``dtype`` is the inputs' dtype.
    """
    batch, seq, heads, head_dim, hidden = _dims(shape, 5, "(B, S, H, D_HEAD, F)")
    width = heads * head_dim
    g = ck.Graph("transformer_block_causal" if causal else "transformer_block")
    x = g.input("x", (batch, seq, width), dtype=dtype)
    norm1 = g.input("norm1", (width,), dtype=dtype)
    wq = g.input("wq", (width, width), dtype=dtype)
    wk = g.input("wk", (width, width), dtype=dtype)
    wv = g.input("wv", (width, width), dtype=dtype)
    wo = g.input("wo", (width, width), dtype=dtype)
    norm2 = g.input("norm2", (width,), dtype=dtype)
    w1 = g.input("w1", (width, hidden), dtype=dtype)
    b1 = g.input("b1", (hidden,), dtype=dtype)
    w2 = g.input("w2", (hidden, width), dtype=dtype)

    def split_heads(t: ck.Tensor) -> ck.Tensor:
        return t.reshape(batch, seq, heads, head_dim).transpose(1, 2)

    normed = ck.nn.rms_norm(x, norm1, eps=EPS)
    q, k, v = (split_heads(normed @ w) for w in (wq, wk, wv))
    attended = ck.nn.attention(q, k, v, causal=causal)
    merged = attended.transpose(1, 2).reshape(batch, seq, width)
    h = x + merged @ wo
    y = h + ck.nn.gelu(ck.nn.rms_norm(h, norm2, eps=EPS) @ w1 + b1) @ w2
    g.output(y, "y")
    return g
