"""A projection followed by a rotary embedding (RoPE, rotate-half convention), written in
cherenkov's ops the way transformers' Llama spells it: ``y = q·cos + rotate_half(q)·sin``
with ``q = (x @ wᵀ)`` split into heads. Shared by the derivation tests (the RoPE joins its
projection's epilogue) and the GEMM tests (the kernel that runs it)."""

from __future__ import annotations

import cherenkov as ck


def rope_projection_graph(seq: int = 200, heads: int = 4, dim: int = 64, hidden: int = 136,
                          dtype: str = "bf16") -> ck.Graph:  # fmt: skip
    """``x (seq, hidden) @ wᵀ (hidden, heads·dim)``, heads split to ``(heads, seq, dim)``,
    then RoPE with ``cos``, ``sin`` of shape ``(seq, dim)``."""
    g = ck.Graph("rope_projection")
    x, w = g.input("x", (seq, hidden), dtype), g.input("w", (heads * dim, hidden), dtype)
    cos, sin = g.input("cos", (seq, dim), dtype), g.input("sin", (seq, dim), dtype)
    q = (x @ w.transpose(0, 1)).reshape(seq, heads, dim).transpose(0, 1)
    half = dim // 2
    rotated = ck.cat([-q[:, :, half:], q[:, :, :half]], axis=-1)
    g.output(q * cos + rotated * sin, "y")
    return g


def rope_reference(torch, x: dict):
    """The same in float32 torch."""
    seq, dim = x["cos"].shape
    q = (x["x"].float() @ x["w"].float().T).reshape(seq, -1, dim).transpose(0, 1)
    rotated = torch.cat([-q[..., dim // 2:], q[..., : dim // 2]], dim=-1)
    return q * x["cos"].float() + rotated * x["sin"].float()
