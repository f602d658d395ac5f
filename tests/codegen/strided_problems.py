"""Attention problems whose operands are views, as real models hand them over: heads split
from a projection (BSHD), q, k and v sliced from one fused QKV projection, K/V heads
repeated for their query heads (GQA), and the output written as ``(B, S, H·D)`` for the
projection after it. Shared by the CPU (compile) and GPU (against SDPA) tests."""

from __future__ import annotations

from cherenkov.rewrites.plan import AttentionProblem, OperandLayout


def bshd(batch: int, heads: int, seq: int, dim: int, width: int | None = None, offset: int = 0) -> OperandLayout:
    """Heads ``(B, S, H, D)`` of a ``(B, S, width)`` tensor (default width ``H·D``), from
    column ``offset`` on: ``view(B, S, H, D).transpose(1, 2)`` of a projection's slice."""
    width = width or heads * dim
    return OperandLayout((batch, seq, width), seq * width, dim, width, offset)


def strided(kind: str, b: int, h: int, hkv: int, sq: int, skv: int, d: int, **kw) -> AttentionProblem:
    """One problem whose operands are laid out as ``kind`` says:

    * ``bshd``: q, k, v and o each a ``(B, S, H·D)`` projection output;
    * ``fused``: q, k and v slices of one ``(B, S, (H + 2·Hkv)·D)`` fused QKV tensor (Sq = Skv),
      o ``(B, S, H·D)``;
    * ``gqa_v``: q and o BHSD, k BHSD of the K/V heads, v a ``(B, S, Hkv·D)`` projection read
      by every query head of its group;
    * ``shared_v``: q, k and o BHSD, v the second head of a ``(B, 2, S, D)`` tensor read for every
      K/V head (head stride 0: DiffLlama's halves of v).
    """
    if kind == "bshd":
        layouts = (bshd(b, h, sq, d), bshd(b, hkv, skv, d), bshd(b, hkv, skv, d), bshd(b, h, sq, d))
        names = {"q": "q", "k": "k", "v": "v"}
    elif kind == "fused":
        assert sq == skv
        width = (h + 2 * hkv) * d
        layouts = (bshd(b, h, sq, d, width), bshd(b, hkv, skv, d, width, h * d),
                   bshd(b, hkv, skv, d, width, (h + hkv) * d), bshd(b, h, sq, d))  # fmt: skip
        names = {"q": "qkv", "k": "qkv", "v": "qkv"}
    elif kind == "gqa_v":
        layouts = (OperandLayout.contiguous((b, h, sq, d)), OperandLayout.contiguous((b, hkv, skv, d)),
                   bshd(b, hkv, skv, d), OperandLayout.contiguous((b, h, sq, d)))  # fmt: skip
        names = {"q": "q", "k": "k", "v": "v"}
    elif kind == "shared_v":
        layouts = (OperandLayout.contiguous((b, h, sq, d)), OperandLayout.contiguous((b, hkv, skv, d)),
                   OperandLayout((b, 2, skv, d), 2 * skv * d, 0, d, skv * d), OperandLayout.contiguous((b, h, sq, d)))  # fmt: skip
        names = {"q": "q", "k": "k", "v": "v"}
    else:
        raise ValueError(kind)
    return AttentionProblem(b, h, hkv, sq, skv, d, layouts=layouts, **names, **kw)


PROBLEMS = {
    "bshd_gqa_causal": strided("bshd", 2, 8, 2, 300, 300, 128, causal=True),
    "bshd_sq_ne_skv": strided("bshd", 1, 4, 4, 200, 333, 64),
    "fused_qkv_causal": strided("fused", 2, 4, 4, 257, 257, 64, causal=True),
    "fused_qkv_gqa": strided("fused", 1, 8, 2, 384, 384, 128),
    "gqa_v_only": strided("gqa_v", 2, 8, 4, 130, 500, 64),
    "gqa_shared_v": strided("shared_v", 2, 8, 2, 130, 257, 64, causal=True),
}
