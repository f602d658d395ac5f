"""8-bit floats in the graph: storage dtypes that round as PyTorch's casts do, quantised and
dequantised with their scales by a cast and a multiply, read by attention with descale
factors, captured from PyTorch; arithmetic on them is refused."""

from __future__ import annotations

import numpy as np
import pytest

import cherenkov as ck
from cherenkov.graph.fp8 import round_to_fp8

torch = pytest.importorskip("torch")
TORCH_FP8 = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


def edge_values(dtype: str) -> np.ndarray:
    """Gaussians at several scales, subnormals, ties, the largest values and past them."""
    rng = np.random.default_rng(0)
    largest = 448.0 if dtype == "fp8_e4m3" else 57344.0
    smallest = 2.0**-9 if dtype == "fp8_e4m3" else 2.0**-16
    spread = np.concatenate([rng.standard_normal(4000) * scale for scale in (1e-3, 1.0, 30.0, largest / 4)])
    ties = np.array([1.0625, 1.1875, 3.5 * smallest, 0.5 * smallest, 1.5 * smallest, largest * 1.03, largest * 1.1])
    special = np.array([0.0, -0.0, largest, -largest, np.inf, -np.inf, 1e9, -1e9, np.nan])
    return np.concatenate([spread, ties, -ties, special])


@pytest.mark.parametrize("dtype", ["fp8_e4m3", "fp8_e5m2"])
def test_rounding_matches_pytorchs_casts(dtype: str) -> None:
    values = edge_values(dtype)
    expected = torch.from_numpy(values.astype(np.float32)).to(TORCH_FP8[dtype]).double().numpy()
    np.testing.assert_array_equal(round_to_fp8(values, dtype), expected)


def test_arithmetic_on_8_bit_values_is_refused_and_says_how_to_use_them() -> None:
    g = ck.Graph("fp8_arithmetic")
    x = g.input("x", (4, 8), "fp8_e4m3")
    with pytest.raises(ck.GraphError, match=r"mul: operands of dtype fp8_e4m3 are storage only; cast them"):
        x * 2.0
    with pytest.raises(ck.GraphError, match="storage only"):
        x @ g.input("w", (8, 3), "fp8_e4m3")
    viewed = x.transpose(0, 1).reshape(2, 16)  # views keep the dtype
    assert viewed.dtype == "fp8_e4m3" and viewed.cast("bf16").dtype == "bf16"


@pytest.mark.parametrize("dtype", ["fp8_e4m3", "fp8_e5m2"])
def test_quantize_then_dequantize_recovers_values_to_the_formats_precision(dtype: str) -> None:
    g = ck.Graph("quantize_round_trip")
    x, scale = g.input("x", (16, 64), "fp32"), g.input("scale", (), "fp32")
    q = ck.nn.quantize(x, scale, dtype)
    g.output(ck.nn.dequantize(q, scale), "y")
    assert q.dtype == dtype
    values = np.random.default_rng(1).standard_normal((16, 64)) * 40.0
    amax = float(np.abs(values).max())
    chosen = amax / (448.0 if dtype == "fp8_e4m3" else 57344.0)
    y = ck.evaluate(g, {"x": values, "scale": chosen})["y"]
    relative = np.abs(y - values) / np.maximum(np.abs(values), 1e-3 * amax)
    assert relative.max() <= 2.0 ** -(4 if dtype == "fp8_e4m3" else 3) + 1e-12


def test_block_scales_repeat_over_their_blocks_and_are_checked() -> None:
    g = ck.Graph("mx_blocks")
    x = g.input("x", (4, 64), "fp8_e4m3")
    scales = g.input("scales", (4, 2), "fp32")
    g.output(ck.nn.dequantize(x, scales, block=32), "y")
    xs = round_to_fp8(np.random.default_rng(2).standard_normal((4, 64)), "fp8_e4m3")
    s = np.array([[1.0, 2.0], [0.5, 4.0], [8.0, 1.0], [0.25, 0.125]])
    np.testing.assert_array_equal(ck.evaluate(g, {"x": xs, "scales": s})["y"], xs * np.repeat(s, 32, axis=1))
    with pytest.raises(ck.GraphError, match="block 32 scales of shape"):
        ck.nn.dequantize(x, g.input("wrong", (4, 3), "fp32"), block=32)


def test_attention_on_8_bit_inputs_is_the_attention_of_their_dequantised_values() -> None:
    g = ck.Graph("fp8_attention")
    q = g.input("q", (1, 2, 16, 32), "fp8_e4m3")
    k, v = g.input("k", (1, 2, 24, 32), "fp8_e4m3"), g.input("v", (1, 2, 24, 32), "fp8_e4m3")
    scales = [g.input(n, (), "fp32") for n in ("sq", "sk", "sv")]
    g.output(ck.nn.attention(q, k, v, causal=True, descale=tuple(scales)), "o")
    rng = np.random.default_rng(3)
    inputs = {n: round_to_fp8(rng.standard_normal(t.shape) * 3.0, "fp8_e4m3") for n, t in g.inputs.items()
              if t.dtype == "fp8_e4m3"}  # fmt: skip
    inputs.update(sq=0.5, sk=0.25, sv=2.0)
    got = ck.evaluate(g, inputs)["o"]
    qd, kd, vd = (torch.from_numpy(inputs[n] * inputs[s]) for n, s in (("q", "sq"), ("k", "sk"), ("v", "sv")))
    expected = torch.nn.functional.scaled_dot_product_attention(qd, kd, vd, is_causal=True).numpy()
    np.testing.assert_allclose(got, expected, rtol=1e-9, atol=1e-12)
    with pytest.raises(ck.GraphError, match=r"attention: q, k, v of dtype fp8_e4m3 need descale"):
        ck.nn.attention(q, k, v)


def test_8_bit_tensors_are_captured_from_pytorch_and_serialised() -> None:
    def scaled_matmul(x8, scale, w):
        return (x8.float() * scale) @ w

    x8 = torch.randn(8, 16).to(torch.float8_e4m3fn)
    scale, w = torch.tensor(0.5), torch.randn(16, 4)
    g = ck.from_torch(scaled_matmul, x8, scale, w)
    assert [t.dtype for t in g.inputs.values()] == ["fp8_e4m3", "fp32", "fp32"]
    (name,) = [n for n, t in g.inputs.items() if t.dtype == "fp8_e4m3"]
    got = ck.evaluate(g, dict(zip(g.inputs, (x8.double().numpy(), scale.double().numpy(), w.double().numpy()))))
    expected = (x8.double() * 0.5) @ w.double()
    np.testing.assert_allclose(got["out"], expected.numpy(), rtol=1e-12)
    again = ck.Graph.from_json(g.to_json())
    assert again.inputs[name].dtype == "fp8_e4m3" and again.structural_hash() == g.structural_hash()


def test_mx_scales_are_e8m0_inputs_rounded_as_pytorch_casts_and_never_a_cast_target() -> None:
    from cherenkov.graph.fp8 import round_to_e8m0

    values = np.concatenate([[2.0**-127, 0.3, 0.75, 1.5, 2.5, 3.0, 1e30, 2.0**127],
                             np.exp(np.random.default_rng(4).uniform(-80, 80, 2000))])  # fmt: skip
    values = values.astype(np.float32).astype(np.float64)
    expected = torch.from_numpy(values.astype(np.float32)).to(torch.float8_e8m0fnu).double().numpy()
    np.testing.assert_array_equal(round_to_e8m0(values), expected)
    g = ck.Graph("mx")
    x = g.input("x", (2, 64), "fp8_e4m3")
    scales = g.input("s", (2, 2), "e8m0")
    g.output(ck.nn.dequantize(x, scales, block=32), "y")
    xs = round_to_fp8(np.random.default_rng(1).standard_normal((2, 64)), "fp8_e4m3")
    s = np.array([[0.5, 4.0], [2.0**-10, 1.0]])
    np.testing.assert_array_equal(ck.evaluate(g, {"x": xs, "s": s})["y"], xs * np.repeat(s, 32, axis=1))
    with pytest.raises(ck.GraphError, match="cast: to e8m0"):
        x.cast("e8m0")
    with pytest.raises(ck.GraphError, match="storage only"):
        scales * 2.0


def test_the_fp8_error_floor_script_splits_the_error_of_rounded_attention(tmp_path, monkeypatch) -> None:
    """``benchmarks/fp8_error_floor.py`` on a small head: rounding the Gaussian inputs to e4m3 costs
    a few percent against float32 attention by itself, and rounding P as well costs more."""
    import importlib.util
    import json
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "benchmarks" / "fp8_error_floor.py"
    spec = importlib.util.spec_from_file_location("fp8_error_floor", script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setattr(sys, "argv", ["fp8_error_floor.py", "--queries", "64", "--keys", "512", "--out", str(tmp_path)])
    module.main()
    (written,) = tmp_path.glob("fp8-error-floor-*.json")
    errors = json.loads(written.read_text())["errors"]
    assert 0.01 < errors["inputs_rounded"] < errors["all"] < 0.1
    assert 0.01 < errors["p_rounded"] < 0.05 and 0.01 < errors["all_vs_attention_of_rounded_inputs"] < 0.05
