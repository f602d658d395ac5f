"""Neural-network building blocks, each composed of primitives only.

``ck.nn.attention`` follows PyTorch's ``scaled_dot_product_attention``: K/V with fewer
heads are shared by groups of query heads (GQA/MQA) and ``causal`` lets query ``i`` see
keys ``j <= i`` (top-left aligned when the lengths differ; ``causal="lower_right"`` aligns it to
the last key, as a chunk after a KV cache is masked). 8-bit tensors are quantised and
dequantised with their scales (``quantize``, ``dequantize``: a cast and a multiply), and
``attention`` takes 8-bit q, k, v with their ``descale`` factors.
"""

from __future__ import annotations

import math

from cherenkov.graph.errors import GraphError
from cherenkov.graph.shape import FP8_DTYPES, SCALE_DTYPES
from cherenkov.graph.tensor import Tensor, arange, where

# Abramowitz & Stegun 7.1.26: |erf(x) - approximation| <= 1.5e-7 for all x.
_ERF_P = 0.3275911
_ERF_A = (0.254829592, -0.284496736, 1.421413741, -1.453152027, 1.061405429)


def softmax(x: Tensor, axis: int = -1) -> Tensor:
    """``exp(x - max) / sum(exp(x - max))`` along ``axis``."""
    shifted = (x - x.max(axis=axis, keepdim=True)).exp()
    return shifted / shifted.sum(axis=axis, keepdim=True)


def logsumexp(x: Tensor, axis: int = -1) -> Tensor:
    """``log Σ exp(x)`` along ``axis`` (which it removes), as ``max + log Σ exp(x − max)``."""
    return x.max(axis=axis) + (x - x.max(axis=axis, keepdim=True)).exp().sum(axis=axis).log()


def tanh(x: Tensor) -> Tensor:
    """``1 - 2 / (exp(2x) + 1)``: saturates cleanly to ±1."""
    return 1.0 - 2.0 / ((x * 2.0).exp() + 1.0)


def sigmoid(x: Tensor) -> Tensor:
    return 1.0 / ((-x).exp() + 1.0)


def erf(x: Tensor) -> Tensor:
    """The error function to within 1.5e-7 (Abramowitz & Stegun 7.1.26, odd extension)."""
    magnitude = x.abs()
    t = 1.0 / (magnitude * _ERF_P + 1.0)
    poly = t * _ERF_A[4]
    for coefficient in reversed(_ERF_A[:4]):
        poly = (poly + coefficient) * t
    positive = 1.0 - poly * (-(magnitude * magnitude)).exp()
    return where(x < 0.0, -positive, positive)


def gelu(x: Tensor, approximate: str = "tanh") -> Tensor:
    """GELU: the tanh approximation by default; ``approximate="none"`` uses :func:`erf`."""
    if approximate == "tanh":
        inner = (x + x * x * x * 0.044715) * math.sqrt(2.0 / math.pi)
        return x * 0.5 * (tanh(inner) + 1.0)
    if approximate == "none":
        return x * 0.5 * (erf(x * (1.0 / math.sqrt(2.0))) + 1.0)
    raise GraphError(f"gelu: approximate={approximate!r} is not valid; use 'tanh' or 'none'")


def silu(x: Tensor) -> Tensor:
    """``x * sigmoid(x)``."""
    return x * sigmoid(x)


# |x| below which expm1 and log1p take their Taylor series: the series' first dropped term is then
# below 2^-24 of the value (fp32's rounding), where exp(x) − 1 and log(1 + x) would cancel
_SERIES_BOUND = 2.0**-4


def expm1(x: Tensor) -> Tensor:
    """``e^x − 1``, without the cancellation near 0 (Taylor series to x⁵ for |x| < 2⁻⁴)."""
    series = x * (1.0 + x * (1.0 / 2.0) * (1.0 + x * (1.0 / 3.0) * (1.0 + x * (1.0 / 4.0) * (1.0 + x * (1.0 / 5.0)))))
    return where(x.abs() < _SERIES_BOUND, series, x.exp() - 1.0)


def log1p(x: Tensor) -> Tensor:
    """``ln(1 + x)``, without the cancellation near 0 (Taylor series to x⁶ for |x| < 2⁻⁴)."""
    series = x * (1.0 - x * (1.0 / 2.0 - x * (1.0 / 3.0 - x * (1.0 / 4.0 - x * (1.0 / 5.0 - x * (1.0 / 6.0))))))
    return where(x.abs() < _SERIES_BOUND, series, (x + 1.0).log())


def softplus(x: Tensor, beta: float = 1.0, threshold: float = 20.0) -> Tensor:
    """``ln(1 + e^{βx}) / β``, and ``x`` itself where ``βx > threshold`` (PyTorch's)."""
    if beta == 0:
        raise GraphError(f"softplus of {x.shape}: beta=0 is not valid (it divides by beta); any other number is")
    scaled = x * beta if beta != 1.0 else x
    smooth = log1p(scaled.minimum(threshold).exp())
    return where(scaled > threshold, x, smooth * (1.0 / beta) if beta != 1.0 else smooth)


def elu(x: Tensor, alpha: float = 1.0, scale: float = 1.0, input_scale: float = 1.0) -> Tensor:
    """``scale·x`` for ``x > 0``, else ``scale·α·(e^{x·input_scale} − 1)`` (ELU; SELU and CELU are its cases)."""
    negative = expm1((x * input_scale).minimum(0.0)) * (alpha * scale)
    return where(x > 0.0, x * scale, negative)


def hardsigmoid(x: Tensor) -> Tensor:
    """``clamp(x/6 + 1/2, 0, 1)``."""
    return (x / 6.0 + 0.5).maximum(0.0).minimum(1.0)


def mish(x: Tensor) -> Tensor:
    """``x·tanh(softplus(x))``."""
    return x * tanh(softplus(x))


def rms_norm(x: Tensor, weight: Tensor | None = None, eps: float = 1e-6) -> Tensor:
    """``x / sqrt(mean(x²) + eps) * weight`` over the last axis."""
    normed = x * ((x * x).mean(axis=-1, keepdim=True) + eps).rsqrt()
    return normed if weight is None else normed * weight


def layer_norm(x: Tensor, weight: Tensor | None = None, bias: Tensor | None = None, eps: float = 1e-5) -> Tensor:
    """``(x - mean) / sqrt(var + eps) * weight + bias`` over the last axis."""
    centred = x - x.mean(axis=-1, keepdim=True)
    normed = centred * ((centred * centred).mean(axis=-1, keepdim=True) + eps).rsqrt()
    if weight is not None:
        normed = normed * weight
    return normed if bias is None else normed + bias


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """``x @ weightᵀ + bias`` with ``weight`` of shape ``(out, in)`` as in ``torch.nn.Linear``."""
    out = x @ weight.transpose(-2, -1)
    return out if bias is None else out + bias


def repeat_kv_heads(x: Tensor, groups: int) -> Tensor:
    """``(..., Hkv, S, D) -> (..., Hkv·groups, S, D)``, each K/V head shared by ``groups``
    consecutive query heads (an ``expand`` of a new axis, then a merge)."""
    if groups == 1:
        return x
    *lead, heads, seq, dim = x.shape
    grouped = x.unsqueeze(-3).expand(*lead, heads, groups, seq, dim)
    return grouped.reshape(*lead, heads * groups, seq, dim)


def quantize(x: Tensor, scale: Tensor | float, dtype: str = "fp8_e4m3", block: int = 1) -> Tensor:
    """``cast(x / scale, dtype)``: ``x`` stored in 8 bits with its ``scale`` — a number, a
    tensor broadcasting to ``x`` (per tensor, per head), or with ``block`` > 1 one scale per
    ``block`` consecutive elements of the last axis (MX: 32), shaped ``x``'s with that axis
    divided by ``block``."""
    if dtype not in FP8_DTYPES:
        raise GraphError(f"quantize: dtype {dtype!r}; valid: {', '.join(FP8_DTYPES)}")
    per = _per_element(x, scale, block, "quantize")
    return (x * (1.0 / per if isinstance(per, float) else per.recip())).cast(dtype)


def dequantize(x: Tensor, scale: Tensor | float, dtype: str = "fp32", block: int = 1) -> Tensor:
    """``cast(x, dtype) · scale`` (``scale`` as in :func:`quantize`, or ``e8m0`` MX scales with
    ``block=32``): an 8-bit tensor's values."""
    return x.cast(dtype) * _per_element(x, scale, block, "dequantize")


def _per_element(x: Tensor, scale: Tensor | float, block: int, op: str) -> Tensor | float:
    """``scale`` broadcasting to ``x``: a block scale repeated over its ``block`` elements."""
    if not isinstance(scale, Tensor):
        if not (isinstance(scale, (int, float)) and math.isfinite(scale) and scale > 0):
            raise GraphError(f"{op}: scale {scale!r} must be a positive finite number or a tensor")
        return float(scale)
    widened = scale.cast("fp32") if scale.dtype in SCALE_DTYPES else scale  # MX scales: powers of two
    if block == 1:
        return widened
    *lead, last = x.shape
    if block < 1 or last % block or tuple(scale.shape) != (*lead, last // block):
        raise GraphError(f"{op}: block {block} scales of shape {scale.shape} for x {x.shape}; valid: a block that "
                         f"divides the last axis and scales shaped {(*lead, last // max(block, 1))}")  # fmt: skip
    # repeated before the widening cast: a view of a stored tensor, not a computed copy
    repeated = scale.unsqueeze(-1).expand(*lead, last // block, block).reshape(*lead, last)
    return repeated.cast("fp32") if scale.dtype in SCALE_DTYPES else repeated


def _dequantized_operands(operands: tuple[Tensor, Tensor, Tensor],
                          descale: tuple[Tensor | float, Tensor | float, Tensor | float]) -> tuple[Tensor, ...]:  # fmt: skip
    """q, k, v dequantised with their scales; K/V heads shared by a GQA group are repeated
    in 8 bits (with per-head scales) before, so that attention reads the stored 8-bit tensors
    through the repeat (a view of an input) instead of a computed copy."""
    q, k, v = operands
    if len(descale) != 3:
        raise GraphError(f"attention: descale has {len(descale)} entries; valid: (s_q, s_k, s_v)")
    s_q, s_k, s_v = descale
    if min(q.ndim, k.ndim, v.ndim) >= 3 and q.shape[-3] != k.shape[-3] and k.shape[-3] == v.shape[-3] \
            and q.shape[-3] % k.shape[-3] == 0:
        groups = q.shape[-3] // k.shape[-3]

        def repeated(scale: Tensor | float) -> Tensor | float:
            per_head = isinstance(scale, Tensor) and scale.ndim >= 3 and scale.shape[-3] == k.shape[-3] > 1
            return repeat_kv_heads(scale, groups) if per_head else scale

        k, v, s_k, s_v = repeat_kv_heads(k, groups), repeat_kv_heads(v, groups), repeated(s_k), repeated(s_v)
    return tuple(dequantize(x, s) for x, s in ((q, s_q), (k, s_k), (v, s_v)))


LOWER_RIGHT = "lower_right"
"""``attention``'s ``causal`` aligned to the last key (PyTorch's ``causal_lower_right``, FlashAttention's causal):
query ``i`` of ``S_q`` sees keys ``j ≤ i + S_kv − S_q``, as a chunk of queries after a KV cache is masked."""


def attention(q: Tensor, k: Tensor, v: Tensor, causal: bool | str = False, scale: float | None = None,
              descale: tuple[Tensor | float, Tensor | float, Tensor | float] | None = None,
              return_lse: bool = False, softcap: float | None = None,
              bias: Tensor | None = None, window: int | None = None) -> Tensor | tuple[Tensor, Tensor]:  # fmt: skip
    """``softmax(q kᵀ · scale [+ bias] [causal mask]) v`` over tensors shaped ``(..., heads, seq, dim)``.

    ``causal=True`` lets query ``i`` see keys ``j ≤ i`` (PyTorch's ``is_causal``, aligned to the first
    key); ``causal="lower_right"`` aligns the mask to the last key instead, ``j ≤ i + S_kv − S_q``
    (:data:`LOWER_RIGHT`: a chunk of ``S_q`` queries after ``S_kv − S_q`` cached keys). ``window = W``
    (with ``causal``) is a sliding window: query ``i`` sees keys ``i − W < j ≤ i`` (Mistral's and Gemma's
    local attention; shifted as the causal edge is), the keys before it masked as the causal mask masks
    the later ones.

    ``softcap = c`` caps the scaled scores before the mask, ``c·tanh(s / c)`` (Gemma 2's
    attention logit soft cap). ``bias`` is added to the (capped) scores, broadcast over them
    (``(..., heads or 1, seq_q, seq_kv)``), as SDPA's float ``attn_mask``: ``−∞`` masks a score,
    and a padding mask of a batch is one.

    8-bit ``q``, ``k``, ``v`` (``fp8_e4m3``, ``fp8_e5m2``) need ``descale = (s_q, s_k, s_v)``,
    their :func:`quantize` scales: the attention of their dequantised values (float32).
    ``return_lse=True`` also returns each query row's log-sum-exp of the scaled (masked) scores,
    ``(..., heads, seq_q)`` in fp32 — what a forward pass saves for its backward, as SDPA does."""
    stored = [name for name, x in (("q", q), ("k", k), ("v", v)) if x.dtype in FP8_DTYPES]
    if descale is not None:
        q, k, v = _dequantized_operands((q, k, v), descale)
    elif stored:
        raise GraphError(f"attention: {', '.join(stored)} of dtype {q.dtype if 'q' in stored else k.dtype} need "
                         "descale=(s_q, s_k, s_v), the scales they were quantised with")  # fmt: skip
    if min(q.ndim, k.ndim, v.ndim) < 2:
        raise GraphError(f"attention: q {q.shape}, k {k.shape}, v {v.shape} need (..., seq, dim) shapes")
    if q.shape[-1] != k.shape[-1] or k.shape[-2] != v.shape[-2]:
        raise GraphError(
            f"attention: q {q.shape}, k {k.shape}, v {v.shape}: valid when q and k share the last axis "
            "and k and v share the sequence axis"
        )
    if q.ndim >= 3 and k.ndim >= 3 and q.shape[-3] != k.shape[-3]:
        heads, kv_heads = q.shape[-3], k.shape[-3]
        if heads % kv_heads or k.shape[-3] != v.shape[-3]:
            raise GraphError(
                f"attention: {heads} query heads cannot share {kv_heads} K/V heads (k {k.shape}, v {v.shape}); "
                "the query head count must be a multiple of the K/V head count"
            )
        k, v = repeat_kv_heads(k, heads // kv_heads), repeat_kv_heads(v, heads // kv_heads)
    if softcap is not None and not (math.isfinite(softcap) and softcap > 0):
        raise GraphError(f"attention: softcap {softcap}; valid: a finite positive cap (or None for none)")
    if causal not in (False, True, LOWER_RIGHT):
        raise GraphError(f"attention: causal={causal!r}; valid: False, True (aligned to the first key) or "
                         f"{LOWER_RIGHT!r} (aligned to the last key)")
    if causal == LOWER_RIGHT and q.shape[-2] > k.shape[-2]:
        raise GraphError(f"attention: causal={LOWER_RIGHT!r} with q {q.shape} and k {k.shape}: the first "
                         f"{q.shape[-2] - k.shape[-2]} queries would see no key; valid: at most as many queries as keys")
    if window is not None and (not causal or isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise GraphError(f"attention: window {window!r} with causal={causal}; valid: a whole number of keys "
                         f"W >= 1 with causal=True or {LOWER_RIGHT!r} (or None for none)")
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    scores = (q @ k.transpose(-2, -1)) * scale
    if softcap is not None:
        scores = tanh(scores * (1.0 / softcap)) * softcap
    if bias is not None:
        scores = scores + bias
    if causal:
        seq_q, seq_kv = q.shape[-2], k.shape[-2]
        query_index = arange(seq_q, graph=q.graph).unsqueeze(-1)
        if causal == LOWER_RIGHT and seq_kv > seq_q:  # query i stands at key i + S_kv − S_q
            query_index = query_index + float(seq_kv - seq_q)
        key_index = arange(seq_kv, graph=q.graph)
        if window is None:
            scores = where(query_index < key_index, -math.inf, scores)
        else:  # a band in the scores' dtype: the causal edge, and the window's lower one (keys j < i − (W − 1))
            hidden, live = (q.graph.constant(value, scores.dtype) for value in (-math.inf, 0.0))
            lower = where(key_index < query_index + float(1 - window), hidden, live)
            scores = scores + where(query_index < key_index, hidden, lower)
    out = softmax(scores, axis=-1) @ v
    out.graph.note_attention(out, scores)
    return (out, logsumexp(scores, axis=-1).cast("fp32")) if return_lse else out
