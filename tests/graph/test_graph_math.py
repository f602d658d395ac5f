"""Elementwise math, reductions, comparisons, ``where``, ``arange`` and casts against NumPy/torch."""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import pytest
import torch

import cherenkov as ck

from .helpers import assert_rel, evaluate_one


def _unary(fn: Callable[[ck.Tensor], ck.Tensor], xs: np.ndarray, dtype: str = "fp32") -> np.ndarray:
    g = ck.Graph("unary")
    g.output(fn(g.input("x", xs.shape, dtype)))
    return evaluate_one(g, x=xs)


# ------------------------------------------------------------------ unary math

UNARY_CASES: dict[str, tuple[Callable[[ck.Tensor], ck.Tensor], Callable[[np.ndarray], np.ndarray], bool]] = {
    # name: (cherenkov, numpy, needs positive inputs)
    "exp": (lambda x: x.exp(), np.exp, False),
    "exp2": (lambda x: x.exp2(), np.exp2, False),
    "log": (lambda x: x.log(), np.log, True),
    "log2": (lambda x: x.log2(), np.log2, True),
    "sqrt": (lambda x: x.sqrt(), np.sqrt, True),
    "rsqrt": (lambda x: x.rsqrt(), lambda a: 1.0 / np.sqrt(a), True),
    "recip": (lambda x: x.recip(), np.reciprocal, False),
    "sin": (lambda x: x.sin(), np.sin, False),
    "cos": (lambda x: x.cos(), np.cos, False),
    "abs": (lambda x: x.abs(), np.abs, False),
    "neg": (lambda x: -x, np.negative, False),
}


@pytest.mark.parametrize("name", sorted(UNARY_CASES))
def test_unary_op_matches_numpy(rng: np.random.Generator, name: str) -> None:
    fn, ref, positive = UNARY_CASES[name]
    xs = rng.standard_normal((3, 7)) * 3.0
    if positive:
        xs = np.abs(xs) + 0.05
    assert_rel(_unary(fn, xs), ref(xs))


@pytest.mark.parametrize("name", ["sin", "cos"])
def test_trig_matches_numpy_over_several_periods(name: str) -> None:
    fn, ref, _ = UNARY_CASES[name]
    xs = np.linspace(-20.0, 20.0, 257)
    np.testing.assert_allclose(_unary(fn, xs), ref(xs), rtol=0, atol=1e-14)


def test_log_of_zero_is_minus_inf_and_of_negative_is_nan() -> None:
    out = _unary(lambda x: x.log(), np.array([0.0, -1.0, 1.0]))
    assert out[0] == -np.inf and np.isnan(out[1]) and out[2] == 0.0


@pytest.mark.parametrize("exponent", [0.5, -0.5, 1, 2, 3, 8, -1, 1.5, -2.25, 2.0])
def test_pow_of_positive_base_matches_numpy(rng: np.random.Generator, exponent: float) -> None:
    xs = np.abs(rng.standard_normal(23)) + 0.1
    assert_rel(_unary(lambda x: x**exponent, xs), np.power(xs, exponent))


@pytest.mark.parametrize("exponent", [2, 3, 2.0, 3.0, -1, -2, 9])
def test_pow_with_integral_exponent_accepts_negative_base(exponent: float) -> None:
    xs = np.array([-2.5, -1.0, -0.5, 0.5, 1.0, 2.5])
    np.testing.assert_allclose(_unary(lambda x: x**exponent, xs), np.power(xs, exponent), rtol=1e-12, atol=0)


def test_pow_zero_is_one_everywhere() -> None:
    xs = np.array([-3.0, 0.0, 2.0])
    np.testing.assert_array_equal(_unary(lambda x: x**0, xs), np.ones(3))


def test_integer_input_to_transcendental_gives_fp32() -> None:
    g = ck.Graph("promote")
    x = g.input("x", (4,))
    i = ck.arange(4, graph=g)
    assert i.dtype == "int32"
    assert i.sqrt().dtype == "fp32"
    assert (-i).dtype == "int32"
    g.output(i.sqrt() + x * 0.0)
    np.testing.assert_allclose(evaluate_one(g, x=np.ones(4)), np.sqrt(np.arange(4)), rtol=1e-15)


# ------------------------------------------------------------------ binary arithmetic

BINARY_CASES: dict[str, tuple[Callable[[object, object], object], Callable[[np.ndarray, np.ndarray], np.ndarray]]] = {
    "add": (lambda a, b: a + b, np.add),
    "sub": (lambda a, b: a - b, np.subtract),
    "mul": (lambda a, b: a * b, np.multiply),
    "div": (lambda a, b: a / b, np.divide),
    "mod": (lambda a, b: a % b, np.mod),
    "maximum": (lambda a, b: a.maximum(b), np.maximum),
    "minimum": (lambda a, b: a.minimum(b), np.minimum),
}


@pytest.mark.parametrize("name", sorted(BINARY_CASES))
def test_binary_op_with_python_scalar_on_either_side(rng: np.random.Generator, name: str) -> None:
    fn, ref = BINARY_CASES[name]
    xs = rng.standard_normal((2, 5)) * 3.0
    scalar = 1.75
    assert_rel(_unary(lambda x: fn(x, scalar), xs), ref(xs, scalar))
    if name not in ("maximum", "minimum", "mod"):
        assert_rel(_unary(lambda x: fn(scalar, x), xs), ref(scalar, xs))


def test_python_scalar_mod_tensor_is_reflected(rng: np.random.Generator) -> None:
    """``2.5 % x`` works like ``2.5 - x`` and ``2.5 / x`` do (``Tensor.__rmod__``)."""
    xs = rng.standard_normal(7) + 3.0
    assert_rel(_unary(lambda x: 2.5 % x, xs), np.mod(2.5, xs))


def test_mod_follows_floor_semantics_for_negative_operands() -> None:
    g = ck.Graph("mod")
    a, b = g.input("a", (4,)), g.input("b", (4,))
    g.output(a % b)
    av, bv = np.array([7.0, -7.0, 7.0, -7.0]), np.array([3.0, 3.0, -3.0, -3.0])
    np.testing.assert_array_equal(evaluate_one(g, a=av, b=bv), np.mod(av, bv))
    np.testing.assert_array_equal(evaluate_one(g, a=av, b=bv), torch.remainder(torch.tensor(av), torch.tensor(bv)))


def test_division_by_python_int_and_numpy_scalars(rng: np.random.Generator) -> None:
    xs = rng.standard_normal(9)
    assert_rel(_unary(lambda x: x / 3, xs), xs / 3)
    assert_rel(_unary(lambda x: x / np.float32(3.0), xs), xs / 3)
    assert_rel(_unary(lambda x: np.float64(2.0) * x - np.int64(1), xs), 2.0 * xs - 1)


def test_dtype_promotion_of_arithmetic() -> None:
    g = ck.Graph("promote")
    b16, h16, f32 = g.input("a", (2,), "bf16"), g.input("b", (2,), "fp16"), g.input("c", (2,), "fp32")
    i32 = ck.arange(2, graph=g)
    assert (b16 + h16).dtype == "fp32"
    assert (b16 * 2).dtype == "bf16"
    assert (b16 * 0.5).dtype == "bf16"
    assert (i32 + b16).dtype == "bf16"
    assert (i32 + 1).dtype == "int32"
    assert (i32 * 0.5).dtype == "fp32"
    assert (f32 < b16).dtype == "bool"
    assert ck.where(b16 < 0.0, h16, f32).dtype == "fp32"


# ------------------------------------------------------------------ reductions

AXES = [None, 0, -1, 1, (0, 2), (-1, 0), (0, 1, 2), ()]


@pytest.mark.parametrize("keepdim", [False, True], ids=["drop", "keep"])
@pytest.mark.parametrize("axis", AXES, ids=str)
@pytest.mark.parametrize("name", ["sum", "mean", "max", "min"])
def test_reduction_matches_numpy(rng: np.random.Generator, name: str, axis: object, keepdim: bool) -> None:
    xs = rng.standard_normal((3, 4, 5))
    out = _unary(lambda x: getattr(x, name)(axis=axis, keepdim=keepdim), xs)
    np_axis = tuple(axis) if isinstance(axis, tuple) else axis
    ref = getattr(np, name)(xs, axis=np_axis, keepdims=keepdim)
    assert_rel(out, ref)


def test_reduction_without_axis_gives_a_scalar() -> None:
    g = ck.Graph("total")
    x = g.input("x", (2, 3))
    assert x.sum().shape == ()
    assert x.max(keepdim=True).shape == (1, 1)


def test_reduction_lowers_to_one_primitive_per_axis() -> None:
    g = ck.Graph("reduce")
    x = g.input("x", (2, 3, 4, 5))
    g.output(x.sum(axis=(0, 2, 3)))
    assert g.ops()["sum_reduce"] == 3
    assert g.ops()["max_reduce"] == 0


def test_max_and_min_of_minus_inf_masked_rows() -> None:
    xs = np.array([[-np.inf, 1.0, -2.0], [-np.inf, -np.inf, 3.0]])
    np.testing.assert_array_equal(_unary(lambda x: x.max(axis=-1), xs), [1.0, 3.0])
    np.testing.assert_array_equal(_unary(lambda x: x.min(axis=-1), xs), [-np.inf, -np.inf])


# ------------------------------------------------------------------ comparisons and where

COMPARISONS: dict[str, tuple[Callable[[object, object], object], Callable[[np.ndarray, np.ndarray], np.ndarray]]] = {
    "lt": (lambda a, b: a < b, np.less),
    "le": (lambda a, b: a <= b, np.less_equal),
    "gt": (lambda a, b: a > b, np.greater),
    "ge": (lambda a, b: a >= b, np.greater_equal),
}


@pytest.mark.parametrize("name", sorted(COMPARISONS))
def test_comparison_of_tensors_with_ties(rng: np.random.Generator, name: str) -> None:
    fn, ref = COMPARISONS[name]
    g = ck.Graph("compare")
    a, b = g.input("a", (4, 6)), g.input("b", (6,))
    result = fn(a, b)
    assert result.dtype == "bool"
    g.output(result)
    av, bv = rng.integers(-2, 3, (4, 6)).astype(float), rng.integers(-2, 3, 6).astype(float)
    assert np.any(av == bv), "ties must be exercised"
    np.testing.assert_array_equal(evaluate_one(g, a=av, b=bv), ref(av, bv).astype(float))


@pytest.mark.parametrize("name", sorted(COMPARISONS))
def test_comparison_with_scalar_on_either_side(name: str) -> None:
    fn, ref = COMPARISONS[name]
    xs = np.array([-1.0, 0.0, 0.5, 1.0, 2.0])
    np.testing.assert_array_equal(_unary(lambda x: fn(x, 0.5), xs), ref(xs, 0.5).astype(float))
    np.testing.assert_array_equal(_unary(lambda x: fn(0.5, x), xs), ref(0.5, xs).astype(float))


def test_where_with_scalar_branches() -> None:
    xs = np.array([-2.0, -0.5, 0.0, 0.5, 3.0])
    np.testing.assert_array_equal(_unary(lambda x: ck.where(x > 0, 1.0, -1.0), xs), np.where(xs > 0, 1.0, -1.0))
    np.testing.assert_array_equal(_unary(lambda x: ck.where(x < 0, 0.0, x), xs), np.where(xs < 0, 0.0, xs))
    np.testing.assert_array_equal(_unary(lambda x: ck.where(x >= 0, x, -math.inf), xs), np.where(xs >= 0, xs, -np.inf))


def test_where_broadcasts_condition_and_branches(rng: np.random.Generator) -> None:
    g = ck.Graph("where")
    c, a, b = g.input("c", (4, 1)), g.input("a", (1, 5)), g.input("b", (5,))
    g.output(ck.where(c > 0.0, a, b))
    cv, av, bv = rng.standard_normal((4, 1)), rng.standard_normal((1, 5)), rng.standard_normal(5)
    np.testing.assert_array_equal(evaluate_one(g, c=cv, a=av, b=bv), np.where(cv > 0, av, bv))


def test_where_select_masks_without_nan() -> None:
    """A select never blends: exp of a -inf masked score is exactly 0, never NaN."""
    xs = np.array([1.0, 2.0, 3.0])
    out = _unary(lambda x: ck.where(x > 1.5, -math.inf, x).exp(), xs)
    np.testing.assert_array_equal(out, [math.e, 0.0, 0.0])


def test_where_with_python_bool_condition(rng: np.random.Generator) -> None:
    xs = rng.standard_normal(3)
    np.testing.assert_array_equal(_unary(lambda x: ck.where(True, x, 0.0), xs), xs)
    np.testing.assert_array_equal(_unary(lambda x: ck.where(False, x, 0.0), xs), np.zeros(3))


# ------------------------------------------------------------------ arange


def test_arange_counts_from_zero_and_from_start() -> None:
    g = ck.Graph("arange")
    x = g.input("x", (5,))
    g.output(x * 0.0 + ck.arange(5), "zero")
    g.output(x * 0.0 + ck.arange(3, 8), "start")
    g.output(x * 0.0 + g.arange(5), "method")
    out = ck.evaluate(g, {"x": np.ones(5)})
    np.testing.assert_array_equal(out["zero"], np.arange(5))
    np.testing.assert_array_equal(out["start"], np.arange(3, 8))
    np.testing.assert_array_equal(out["method"], np.arange(5))
    assert ck.arange(5).dtype == "int32" and ck.arange(5).node.op == "iota"


def test_free_arange_and_constant_join_the_graph_from_the_left() -> None:
    """Free tensors join the first graph they meet, whichever side of the operator they are on."""
    g = ck.Graph("user")
    x = g.input("x", (4,))
    g.output(ck.arange(4) + x, "left")
    g.output(ck.constant(2.0) * x, "scaled")
    g.output(ck.where(ck.arange(4) < x, 1.0, 0.0), "compare")
    out = ck.evaluate(g, {"x": np.full(4, 1.5)})
    np.testing.assert_array_equal(out["left"], np.arange(4) + 1.5)
    np.testing.assert_array_equal(out["scaled"], np.full(4, 3.0))
    np.testing.assert_array_equal(out["compare"], [1.0, 1.0, 0.0, 0.0])


def test_free_tensors_from_different_arange_calls_combine() -> None:
    g = ck.Graph("mask")
    s = g.input("s", (3, 4))
    mask = ck.arange(4) <= ck.arange(3).unsqueeze(-1)
    g.output(ck.where(mask, s, -math.inf))
    out = evaluate_one(g, s=np.ones((3, 4)))
    np.testing.assert_array_equal(out, np.where(np.tri(3, 4, dtype=bool), 1.0, -np.inf))


# ------------------------------------------------------------------ casts


def _cast_values(rng: np.random.Generator) -> np.ndarray:
    """Random magnitudes from subnormal to overflow, bf16/fp16 half-way points, specials."""
    spread = rng.standard_normal(2000) * 10.0 ** rng.integers(-42, 40, 2000)
    halfway = 1.0 + (2 * rng.integers(0, 128, 64) + 1) * 2.0**-8  # exactly between two bf16 values
    near_halfway = halfway + rng.choice([-1.0, 1.0], 64) * 2.0**-30
    specials = [0.0, -0.0, np.inf, -np.inf, 3.4e38, 3.3e38, 65504.0, 65520.0, 6e-8, 1e-45]
    return np.concatenate([spread, halfway, -halfway, near_halfway, specials])


def test_cast_to_bf16_matches_torch(rng: np.random.Generator) -> None:
    xs = _cast_values(rng)
    out = _unary(lambda x: x.cast("bf16"), xs)
    ref = torch.from_numpy(xs).to(torch.bfloat16).double().numpy()
    np.testing.assert_array_equal(out, ref)


def test_cast_to_bf16_from_fp32_values_matches_torch(rng: np.random.Generator) -> None:
    with np.errstate(over="ignore"):
        xs = _cast_values(rng).astype(np.float32)
    out = _unary(lambda x: x.cast("bfloat16"), xs.astype(np.float64))
    ref = torch.from_numpy(xs).to(torch.bfloat16).double().numpy()
    np.testing.assert_array_equal(out, ref)


def test_cast_to_bf16_rounds_halfway_to_even() -> None:
    xs = np.array([1.0 + 2.0**-8, 1.0 + 3 * 2.0**-8, -(1.0 + 2.0**-8)])
    np.testing.assert_array_equal(_unary(lambda x: x.cast("bf16"), xs), [1.0, 1.0 + 2.0**-6, -1.0])


def test_cast_to_fp16_matches_numpy_float16(rng: np.random.Generator) -> None:
    xs = _cast_values(rng)
    out = _unary(lambda x: x.cast("fp16"), xs)
    with np.errstate(over="ignore"):
        ref = xs.astype(np.float16).astype(np.float64)
    np.testing.assert_array_equal(out, ref)


def test_cast_to_fp32_matches_numpy_float32(rng: np.random.Generator) -> None:
    xs = rng.standard_normal(50) / 3.0
    out = _unary(lambda x: x.float(), xs, dtype="fp16")
    np.testing.assert_array_equal(out, xs.astype(np.float32).astype(np.float64))


def test_cast_keeps_nan_inputs_nan() -> None:
    out = _unary(lambda x: x.cast("bf16"), np.array([np.nan, 1.0]))
    assert np.isnan(out[0]) and out[1] == 1.0


def test_cast_to_int32_truncates_and_to_bool_tests_nonzero() -> None:
    xs = np.array([-2.7, -0.5, 0.0, 0.5, 2.7])
    np.testing.assert_array_equal(_unary(lambda x: x.cast("int32") * 1.0, xs), np.trunc(xs))
    np.testing.assert_array_equal(_unary(lambda x: x.cast("bool"), xs), xs != 0)


def test_cast_to_own_dtype_adds_no_node_and_aliases_normalise() -> None:
    g = ck.Graph("cast")
    x = g.input("x", (2,), "bfloat16")
    assert x.dtype == "bf16"
    assert x.cast("bf16") is x
    assert x.to("torch.float16").dtype == "fp16"
    assert x.to("half").dtype == "fp16"


def test_declared_input_dtype_does_not_round_the_reference() -> None:
    """The evaluator is float64 throughout; only an explicit cast rounds."""
    xs = np.array([1.0 + 2.0**-20])
    np.testing.assert_array_equal(_unary(lambda x: x * 1.0, xs, dtype="bf16"), xs)
