"""Textbook scaled-dot-product attention: the seed graph of cherenkov.

``o = softmax(q kᵀ · D^-0.5 [+ causal mask]) v``, written from tensor operators exactly as
in DESIGN.md's API sketch (deliberately *not* via ``ck.nn.attention``): the rewrites must
find the flash-attention form in this naive spelling. ``causal`` masks with ``ck.where``
(query ``i`` sees keys ``j <= i``, top-left aligned when ``SQ != SKV``, as PyTorch SDPA's
``is_causal``). Grouped-query attention shares each K/V head between ``H // H_KV``
consecutive query heads by an ``expand`` of a new axis.

Run it with ``cherenkov optimize --example attention [--shape B,H,SQ,SKV,D] [--causal]``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import cherenkov as ck

DEFAULT_SHAPE: tuple[int, ...] = (1, 8, 4096, 8192, 128)
SHAPE_DOC = "(B, H, SQ, SKV, D) or (B, H, H_KV, SQ, SKV, D)"


def _dims(shape: Sequence[int] | None) -> tuple[int, int, int, int, int, int]:
    """``(B, H, H_KV, SQ, SKV, D)`` from a 5- or 6-tuple of positive ints."""
    dims = DEFAULT_SHAPE if shape is None else tuple(shape)
    if len(dims) not in (5, 6) or not all(isinstance(d, int) and not isinstance(d, bool) and d > 0 for d in dims):
        raise ck.GraphError(f"attention example: shape {shape!r} must be {SHAPE_DOC} with positive ints")
    if len(dims) == 5:
        batch, heads, seq_q, seq_kv, head_dim = dims
        return batch, heads, heads, seq_q, seq_kv, head_dim
    batch, heads, kv_heads, seq_q, seq_kv, head_dim = dims
    if heads % kv_heads:
        raise ck.GraphError(
            f"attention example: H={heads} query heads cannot share H_KV={kv_heads} K/V heads; "
            "H must be a multiple of H_KV"
        )
    return batch, heads, kv_heads, seq_q, seq_kv, head_dim


def build(shape: tuple[int, ...] | None = None, causal: bool = False, dtype: str = "bf16") -> ck.Graph:
    """Attention over inputs ``q (B, H, SQ, D)``, ``k`` and ``v (B, H_KV, SKV, D)``; output ``o``.

    ``shape`` is ``(B, H, SQ, SKV, D)`` (then ``H_KV = H``) or ``(B, H, H_KV, SQ, SKV, D)``
    for grouped-query attention; the default is the seed shape ``(1, 8, 4096, 8192, 128)``.
    ``causal`` adds the mask ``where(j <= i, s, -inf)``; ``dtype`` is the inputs' dtype.
    """
    batch, heads, kv_heads, seq_q, seq_kv, head_dim = _dims(shape)
    g = ck.Graph("attention_causal" if causal else "attention")
    q = g.input("q", (batch, heads, seq_q, head_dim), dtype=dtype)
    k = g.input("k", (batch, kv_heads, seq_kv, head_dim), dtype=dtype)
    v = g.input("v", (batch, kv_heads, seq_kv, head_dim), dtype=dtype)
    if kv_heads != heads:
        group = heads // kv_heads
        k = k.unsqueeze(2).expand(batch, kv_heads, group, seq_kv, head_dim).reshape(batch, heads, seq_kv, head_dim)
        v = v.unsqueeze(2).expand(batch, kv_heads, group, seq_kv, head_dim).reshape(batch, heads, seq_kv, head_dim)
    s = (q @ k.transpose(-2, -1)) * head_dim**-0.5
    if causal:
        i = ck.arange(seq_q, graph=g).unsqueeze(-1)
        j = ck.arange(seq_kv, graph=g)
        s = ck.where(j <= i, s, -math.inf)
    p = (s - s.max(axis=-1, keepdim=True)).exp()
    o = (p / p.sum(axis=-1, keepdim=True)) @ v
    g.output(o, "o")
    return g
