"""``ck.nn`` and hand-written spellings against independent NumPy (and PyTorch CPU) formulas.

Every comparison is in float64 with ``‖out − ref‖/‖ref‖ ≤ 1e-12``, except the erf-based
GELU whose polynomial erf is itself an approximation (|error| ≤ 1.5e-7).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import cherenkov as ck

from .helpers import (
    assert_rel,
    evaluate_one,
    np_attention,
    np_erf,
    np_gelu_erf,
    np_gelu_tanh,
    np_layer_norm,
    np_rms_norm,
    np_silu,
    np_softmax,
)

# (B, H, H_KV, SQ, SKV, D): square, Sq != Skv both ways, GQA, MQA, odd sizes, one query.
ATTENTION_SHAPES = [
    (1, 2, 2, 7, 7, 8),
    (2, 3, 3, 7, 13, 5),
    (1, 4, 2, 13, 7, 16),
    (1, 4, 1, 7, 33, 8),
    (2, 2, 2, 33, 13, 3),
    (1, 6, 3, 1, 7, 4),
]


def _attention_inputs(rng: np.random.Generator, shape: tuple[int, ...]) -> dict[str, np.ndarray]:
    b, h, h_kv, sq, skv, d = shape
    return {
        "q": rng.standard_normal((b, h, sq, d)),
        "k": rng.standard_normal((b, h_kv, skv, d)),
        "v": rng.standard_normal((b, h_kv, skv, d)),
    }


def _attention_graph(shape: tuple[int, ...]) -> tuple[ck.Graph, ck.Tensor, ck.Tensor, ck.Tensor]:
    b, h, h_kv, sq, skv, d = shape
    g = ck.Graph("attention")
    q = g.input("q", (b, h, sq, d))
    k = g.input("k", (b, h_kv, skv, d))
    v = g.input("v", (b, h_kv, skv, d))
    return g, q, k, v


def _torch_sdpa(inputs: dict[str, np.ndarray], causal: bool, scale: float | None = None) -> np.ndarray:
    q, k, v = (torch.from_numpy(inputs[n]) for n in "qkv")
    out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale, enable_gqa=q.shape[1] != k.shape[1])
    return out.numpy()


# ------------------------------------------------------------------ attention


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", ATTENTION_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_nn_attention_matches_numpy_and_torch_sdpa(
    rng: np.random.Generator, shape: tuple[int, ...], causal: bool
) -> None:
    g, q, k, v = _attention_graph(shape)
    g.output(ck.nn.attention(q, k, v, causal=causal), "o")
    inputs = _attention_inputs(rng, shape)
    out = ck.evaluate(g, inputs)["o"]
    assert_rel(out, np_attention(inputs["q"], inputs["k"], inputs["v"], causal=causal))
    assert_rel(out, _torch_sdpa(inputs, causal))


def test_nn_attention_explicit_scale(rng: np.random.Generator) -> None:
    shape = (1, 2, 2, 5, 9, 4)
    g, q, k, v = _attention_graph(shape)
    g.output(ck.nn.attention(q, k, v, causal=True, scale=0.3), "o")
    inputs = _attention_inputs(rng, shape)
    out = ck.evaluate(g, inputs)["o"]
    assert_rel(out, np_attention(inputs["q"], inputs["k"], inputs["v"], causal=True, scale=0.3))
    assert_rel(out, _torch_sdpa(inputs, True, scale=0.3))


@pytest.mark.parametrize("mask_heads", [1, 2], ids=["shared", "per_head"])
def test_nn_attention_adds_a_bias_as_torch_sdpa_adds_a_float_mask(rng: np.random.Generator, mask_heads: int) -> None:
    shape = (2, 2, 1, 5, 9, 4)
    g, q, k, v = _attention_graph(shape)
    mask = g.input("mask", (2, mask_heads, 5, 9))
    g.output(ck.nn.attention(q, k, v, bias=mask), "o")
    inputs = _attention_inputs(rng, shape)
    inputs["mask"] = rng.standard_normal((2, mask_heads, 5, 9))
    inputs["mask"][..., 7:] = -np.inf  # padding keys
    q_, k_, v_, m_ = (torch.from_numpy(inputs[n]) for n in ("q", "k", "v", "mask"))
    expected = F.scaled_dot_product_attention(q_, k_, v_, attn_mask=m_, enable_gqa=True).numpy()
    assert_rel(ck.evaluate(g, inputs)["o"], expected)
    with pytest.raises(ck.GraphError):
        ck.nn.attention(q, k, v, bias=g.input("bad", (2, 1, 5, 8)))


def test_nn_attention_on_unbatched_2d_operands(rng: np.random.Generator) -> None:
    g = ck.Graph("attention2d")
    q, k, v = g.input("q", (7, 5)), g.input("k", (13, 5)), g.input("v", (13, 3))
    g.output(ck.nn.attention(q, k, v, causal=True))
    arrays = {"q": rng.standard_normal((7, 5)), "k": rng.standard_normal((13, 5)), "v": rng.standard_normal((13, 3))}
    out = evaluate_one(g, **arrays)
    ref = np_attention(arrays["q"][None], arrays["k"][None], arrays["v"][None], causal=True)[0]
    assert_rel(out, ref)


def _textbook(q: ck.Tensor, k: ck.Tensor, v: ck.Tensor, causal: bool) -> ck.Tensor:
    """DESIGN.md's sketch: scale on S, max subtraction, exp, divide; mask via where(j <= i)."""
    s = (q @ k.transpose(-2, -1)) * q.shape[-1] ** -0.5
    if causal:
        i = ck.arange(q.shape[-2], graph=q.graph).unsqueeze(-1)
        j = ck.arange(k.shape[-2], graph=q.graph)
        s = ck.where(j <= i, s, -math.inf)
    p = (s - s.max(axis=-1, keepdim=True)).exp()
    return (p / p.sum(axis=-1, keepdim=True)) @ v


def _exp2_scale_on_q(q: ck.Tensor, k: ck.Tensor, v: ck.Tensor, causal: bool) -> ck.Tensor:
    """Scale folded into q with log2 e, exp2, additive mask built from less_than."""
    s = (q * (q.shape[-1] ** -0.5 * math.log2(math.e))) @ k.mT
    if causal:
        i = ck.arange(q.shape[-2], graph=q.graph)[:, None]
        j = ck.arange(k.shape[-2], graph=q.graph)[None, :]
        s = s + ck.where(i < j, -math.inf, 0.0)
    p = (s - s.max(axis=-1, keepdim=True)).exp2()
    return (p @ v) / p.sum(axis=-1, keepdim=True)


def _no_max(q: ck.Tensor, k: ck.Tensor, v: ck.Tensor, causal: bool) -> ck.Tensor:
    """No max subtraction (shift invariance): exp of the raw scores, mask as where(j > i)."""
    s = ck.matmul(q, k.permute(0, 1, 3, 2)) / math.sqrt(q.shape[-1])
    if causal:
        i = ck.arange(q.shape[-2], graph=q.graph).reshape(q.shape[-2], 1)
        j = ck.arange(k.shape[-2], graph=q.graph)
        s = ck.where(j > i, -math.inf, s)
    p = s.exp()
    return (p @ v) * p.sum(axis=-1, keepdim=True).recip()


@pytest.mark.parametrize("spelling", [_textbook, _exp2_scale_on_q, _no_max], ids=lambda f: f.__name__.strip("_"))
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", [(1, 2, 2, 7, 13, 8), (2, 3, 3, 13, 7, 5), (1, 1, 1, 33, 33, 3)])
def test_hand_written_attention_matches_numpy(
    rng: np.random.Generator, shape: tuple[int, ...], causal: bool, spelling
) -> None:
    g, q, k, v = _attention_graph(shape)
    g.output(spelling(q, k, v, causal), "o")
    inputs = _attention_inputs(rng, shape)
    assert_rel(ck.evaluate(g, inputs)["o"], np_attention(inputs["q"], inputs["k"], inputs["v"], causal=causal))


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_hand_written_gqa_with_expand_matches_numpy(rng: np.random.Generator, causal: bool) -> None:
    shape = (2, 6, 2, 7, 13, 4)
    b, h, h_kv, sq, skv, d = shape
    g, q, k, v = _attention_graph(shape)
    group = h // h_kv
    k_full = k[:, :, None].expand(b, h_kv, group, skv, d).reshape(b, h, skv, d)
    v_full = v.unsqueeze(2).expand(-1, -1, group, -1, -1).reshape(b, h, skv, d)
    g.output(_textbook(q, k_full, v_full, causal), "o")
    inputs = _attention_inputs(rng, shape)
    out = ck.evaluate(g, inputs)["o"]
    assert_rel(out, np_attention(inputs["q"], inputs["k"], inputs["v"], causal=causal))
    assert_rel(out, _torch_sdpa(inputs, causal))


@pytest.mark.parametrize("window", [None, 3], ids=["causal", "window"])
def test_causal_attention_aligned_to_the_last_key_matches_torchs_causal_lower_right(rng: np.random.Generator,
                                                                                   window: int | None) -> None:
    """``causal="lower_right"``: 5 queries after 8 cached keys (GQA) see keys ``j ≤ i + 8`` (and, with a window
    of 3, none before ``i + 6``), as PyTorch's ``causal_lower_right`` bias (and that band) masks them."""
    from torch.nn.attention.bias import causal_lower_right

    shape = (2, 4, 2, 5, 13, 8)
    g, q, k, v = _attention_graph(shape)
    g.output(ck.nn.attention(q, k, v, causal="lower_right", window=window), "o")
    inputs = _attention_inputs(rng, shape)
    q_t, k_t, v_t = (torch.from_numpy(inputs[n]).repeat_interleave(2 if n != "q" else 1, dim=1) for n in "qkv")
    mask = causal_lower_right(5, 13) if window is None else torch.ones(5, 13, dtype=torch.bool).tril(8).triu(8 - 2)
    expected = F.scaled_dot_product_attention(q_t, k_t, v_t, attn_mask=mask).numpy()
    assert_rel(ck.evaluate(g, inputs)["o"], expected)


def test_causal_attention_aligned_to_the_last_key_needs_a_key_for_every_query() -> None:
    g, q, k, v = _attention_graph((1, 2, 2, 6, 4, 8))
    with pytest.raises(ck.GraphError, match="first 2 queries would see no key"):
        ck.nn.attention(q, k, v, causal="lower_right")
    with pytest.raises(ck.GraphError, match="causal='bottom'"):
        ck.nn.attention(q, k, v, causal="bottom")


def test_causal_attention_first_query_copies_first_value(rng: np.random.Generator) -> None:
    shape = (1, 2, 2, 7, 13, 4)
    g, q, k, v = _attention_graph(shape)
    g.output(ck.nn.attention(q, k, v, causal=True), "o")
    inputs = _attention_inputs(rng, shape)
    out = ck.evaluate(g, inputs)["o"]
    np.testing.assert_allclose(out[..., 0, :], inputs["v"][..., 0, :], rtol=0, atol=1e-15)


# ------------------------------------------------------------------ softmax and norms


@pytest.mark.parametrize("axis", [0, 1, -1, -2])
def test_softmax_matches_numpy_and_torch(rng: np.random.Generator, axis: int) -> None:
    g = ck.Graph("softmax")
    x = g.input("x", (3, 7, 13))
    g.output(ck.nn.softmax(x, axis=axis))
    xs = rng.standard_normal((3, 7, 13)) * 4.0
    out = evaluate_one(g, x=xs)
    assert_rel(out, np_softmax(xs, axis=axis))
    assert_rel(out, torch.softmax(torch.from_numpy(xs), dim=axis).numpy())


def test_softmax_is_stable_for_large_logits(rng: np.random.Generator) -> None:
    g = ck.Graph("softmax")
    x = g.input("x", (4, 9))
    g.output(ck.nn.softmax(x))
    xs = rng.standard_normal((4, 9)) + 1000.0
    assert_rel(evaluate_one(g, x=xs), np_softmax(xs))


@pytest.mark.parametrize("with_weight", [False, True], ids=["plain", "weight"])
def test_rms_norm_matches_numpy_and_torch(rng: np.random.Generator, with_weight: bool) -> None:
    g = ck.Graph("rms_norm")
    x = g.input("x", (2, 5, 13))
    w = g.input("w", (13,)) if with_weight else None
    g.output(ck.nn.rms_norm(x, w, eps=1e-5))
    arrays = {"x": rng.standard_normal((2, 5, 13))}
    if with_weight:
        arrays["w"] = rng.standard_normal(13)
    out = evaluate_one(g, **arrays)
    assert_rel(out, np_rms_norm(arrays["x"], arrays.get("w"), eps=1e-5))
    weight = torch.from_numpy(arrays["w"]) if with_weight else None
    assert_rel(out, F.rms_norm(torch.from_numpy(arrays["x"]), (13,), weight, eps=1e-5).numpy())


@pytest.mark.parametrize("with_bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("with_weight", [False, True], ids=["noweight", "weight"])
def test_layer_norm_matches_numpy_and_torch(rng: np.random.Generator, with_weight: bool, with_bias: bool) -> None:
    g = ck.Graph("layer_norm")
    x = g.input("x", (3, 4, 7))
    w = g.input("w", (7,)) if with_weight else None
    b = g.input("b", (7,)) if with_bias else None
    g.output(ck.nn.layer_norm(x, w, b))
    arrays = {"x": rng.standard_normal((3, 4, 7)) * 3.0 + 1.5}
    if with_weight:
        arrays["w"] = rng.standard_normal(7)
    if with_bias:
        arrays["b"] = rng.standard_normal(7)
    out = evaluate_one(g, **arrays)
    assert_rel(out, np_layer_norm(arrays["x"], arrays.get("w"), arrays.get("b")))
    tw = torch.from_numpy(arrays["w"]) if with_weight else None
    tb = torch.from_numpy(arrays["b"]) if with_bias else None
    assert_rel(out, F.layer_norm(torch.from_numpy(arrays["x"]), (7,), tw, tb, eps=1e-5).numpy())


# ------------------------------------------------------------------ activations


def _activation_inputs(rng: np.random.Generator) -> np.ndarray:
    """Normals plus large magnitudes, to exercise the saturated tails."""
    return np.concatenate([rng.standard_normal(61) * 2.0, [-40.0, -9.0, -1e-3, 0.0, 1e-3, 9.0, 40.0]])


def _unary_graph(fn, n: int) -> ck.Graph:
    g = ck.Graph("activation")
    g.output(fn(g.input("x", (n,))))
    return g


def test_gelu_tanh_is_the_default_and_matches_numpy_and_torch(rng: np.random.Generator) -> None:
    xs = _activation_inputs(rng)
    out = evaluate_one(_unary_graph(ck.nn.gelu, xs.size), x=xs)
    assert_rel(out, np_gelu_tanh(xs))
    assert_rel(out, F.gelu(torch.from_numpy(xs), approximate="tanh").numpy())


def test_gelu_erf_is_within_the_erf_approximation_bound(rng: np.random.Generator) -> None:
    xs = np.concatenate([_activation_inputs(rng), np.linspace(-6.0, 6.0, 241)])
    out = evaluate_one(_unary_graph(lambda x: ck.nn.gelu(x, approximate="none"), xs.size), x=xs)
    # |gelu - exact| = |x|/2 · |erf error| <= |x|/2 · 1.5e-7 < 1e-7 · |x|.
    bound = 1e-7 * np.abs(xs)
    assert np.all(np.abs(out - np_gelu_erf(xs)) <= bound)
    exact = F.gelu(torch.from_numpy(xs), approximate="none").numpy()
    assert np.all(np.abs(out - exact) <= bound)
    # And it is not the tanh variant in disguise (they differ by ~1e-4 near |x| = 2).
    assert np.max(np.abs(out - np_gelu_tanh(xs))) > 1e-5


def test_erf_is_within_abramowitz_stegun_bound(rng: np.random.Generator) -> None:
    xs = np.concatenate([np.linspace(-5.0, 5.0, 401), rng.standard_normal(50)])
    out = evaluate_one(_unary_graph(ck.nn.erf, xs.size), x=xs)
    assert np.max(np.abs(out - np_erf(xs))) <= 2e-7


def test_erf_is_odd(rng: np.random.Generator) -> None:
    xs = np.abs(rng.standard_normal(40)) + 1e-3
    both = np.concatenate([xs, -xs])
    out = evaluate_one(_unary_graph(ck.nn.erf, both.size), x=both)
    np.testing.assert_array_equal(out[40:], -out[:40])


def test_silu_matches_numpy_and_torch(rng: np.random.Generator) -> None:
    xs = _activation_inputs(rng)
    out = evaluate_one(_unary_graph(ck.nn.silu, xs.size), x=xs)
    assert_rel(out, np_silu(xs))
    assert_rel(out, F.silu(torch.from_numpy(xs)).numpy())


def test_sigmoid_and_tanh_match_numpy(rng: np.random.Generator) -> None:
    xs = _activation_inputs(rng)
    assert_rel(evaluate_one(_unary_graph(ck.nn.sigmoid, xs.size), x=xs), 1.0 / (1.0 + np.exp(-xs)))
    assert_rel(evaluate_one(_unary_graph(ck.nn.tanh, xs.size), x=xs), np.tanh(xs))


# ------------------------------------------------------------------ linear


@pytest.mark.parametrize("with_bias", [False, True], ids=["nobias", "bias"])
def test_linear_matches_numpy_and_torch(rng: np.random.Generator, with_bias: bool) -> None:
    g = ck.Graph("linear")
    x = g.input("x", (2, 5, 7))
    w = g.input("w", (3, 7))
    b = g.input("b", (3,)) if with_bias else None
    g.output(ck.nn.linear(x, w, b))
    arrays = {"x": rng.standard_normal((2, 5, 7)), "w": rng.standard_normal((3, 7))}
    if with_bias:
        arrays["b"] = rng.standard_normal(3)
    out = evaluate_one(g, **arrays)
    ref = arrays["x"] @ arrays["w"].T + (arrays["b"] if with_bias else 0.0)
    assert_rel(out, ref)
    tb = torch.from_numpy(arrays["b"]) if with_bias else None
    assert_rel(out, F.linear(torch.from_numpy(arrays["x"]), torch.from_numpy(arrays["w"]), tb).numpy())
