"""Every error a user can cause raises ``ck.GraphError`` (a ``ValueError``) whose message names
the op, the shapes or dtypes involved, and what would be valid."""

from __future__ import annotations

import math
import re

import numpy as np
import pytest

import cherenkov as ck


def _raises(*fragments: str) -> pytest.RaisesContext:
    """``pytest.raises(ck.GraphError)`` whose message contains every fragment literally."""
    return pytest.raises(ck.GraphError, match="(?s)" + "".join(f"(?=.*{re.escape(f)})" for f in fragments))


def test_graph_error_is_a_value_error() -> None:
    assert issubclass(ck.GraphError, ValueError)
    g = ck.Graph("g")
    with pytest.raises(ValueError):
        g.input("x", (0,))


# ------------------------------------------------------------------ matmul


def test_matmul_inner_dimension_mismatch() -> None:
    g = ck.Graph("g")
    a, b = g.input("a", (2, 3, 4)), g.input("b", (5, 6))
    with _raises("matmul", "(2, 3, 4)", "(5, 6)", "4 != 5", "a.shape[-1] == b.shape[-2]"):
        a @ b


def test_matmul_batch_axes_that_do_not_broadcast() -> None:
    g = ck.Graph("g")
    a, b = g.input("a", (2, 3, 4)), g.input("b", (3, 4, 5))
    with _raises("matmul", "(2,)", "(3,)", "do not broadcast", "must match or be 1"):
        a @ b


def test_matmul_of_a_scalar() -> None:
    g = ck.Graph("g")
    a, b = g.input("a", ()), g.input("b", (3,))
    with _raises("matmul", "()", "(3,)", "at least one axis"):
        ck.matmul(a, b)


# ------------------------------------------------------------------ broadcasting and shapes


def test_broadcast_failure_names_op_and_shapes() -> None:
    g = ck.Graph("g")
    a, b = g.input("a", (2, 3)), g.input("b", (4,))
    with _raises("add", "(2, 3)", "(4,)", "axis -1", "[3, 4]", "must match or be 1"):
        a + b
    with _raises("mul", "(2, 3)", "(4,)"):
        a * b
    with _raises("less_than", "(2, 3)", "(4,)"):
        a < b
    with _raises("maximum", "(2, 3)", "(4,)"):
        a.maximum(b)


def test_minimum_broadcast_failure_names_minimum() -> None:
    g = ck.Graph("g")
    a, b = g.input("a", (2, 3)), g.input("b", (4,))
    with _raises("minimum", "(2, 3)", "(4,)", "must match or be 1"):
        a.minimum(b)


@pytest.mark.parametrize("shape", [(2, 0), (0,), (-1, 3), (3, -2)], ids=str)
def test_input_with_zero_or_negative_dimension(shape: tuple[int, ...]) -> None:
    g = ck.Graph("g")
    with _raises("input 'x'", str(shape), "zero or negative", ">= 1"):
        g.input("x", shape)


def test_input_shape_that_is_not_ints() -> None:
    g = ck.Graph("g")
    with _raises("input 'x'", "must contain only ints"):
        g.input("x", (2, 2.5))
    with _raises("input 'x'", "not a sequence of positive ints"):
        g.input("x", 3)


def test_input_with_more_elements_than_32_bit_indexing_addresses() -> None:
    g = ck.Graph("g")
    with _raises("input 'x'", "(65536, 65536)", "2147483647"):
        g.input("x", (65536, 65536))


def test_views_may_exceed_32_bit_indexing_but_outputs_may_not() -> None:
    g = ck.Graph("g")
    x = g.input("x", (65536, 1))
    wide = x.expand(65536, 65536)
    assert wide.shape == (65536, 65536)
    with _raises("output 'out'", "(65536, 65536)", "2147483647"):
        g.output(wide)


def test_reshape_to_a_different_element_count() -> None:
    g = ck.Graph("g")
    x = g.input("x", (2, 3))
    with _raises("reshape", "(2, 3)", "(4, 2)", "element count"):
        x.reshape(4, 2)
    with _raises("reshape", "more than one -1"):
        x.reshape(-1, -1)
    with _raises("reshape", "(2, 3)", "(4, -1)"):
        x.reshape(4, -1)
    with _raises("reshape", "zero or negative"):
        x.reshape(0, 6)


def test_expand_of_an_axis_that_is_not_one() -> None:
    g = ck.Graph("g")
    x = g.input("x", (2, 3))
    with _raises("expand", "(2, 3)", "(2, 4)", "only size-1 axes"):
        x.expand(2, 4)
    with _raises("expand", "(2, 3)", "fewer axes"):
        x.expand(3)
    with _raises("expand", "zero or negative"):
        x[:, :1].expand(2, 0)


# ------------------------------------------------------------------ axes


@pytest.mark.parametrize(
    "call,op",
    [
        (lambda x: x.sum(axis=2), "sum"),
        (lambda x: x.max(axis=-3), "max"),
        (lambda x: x.mean(axis=(0, 5)), "mean"),
        (lambda x: x.transpose(0, 2), "transpose"),
        (lambda x: x.squeeze(2), "squeeze"),
        (lambda x: ck.nn.softmax(x, axis=2), "max"),
    ],
    ids=["sum", "max", "mean", "transpose", "squeeze", "softmax"],
)
def test_axis_out_of_range(call, op: str) -> None:
    g = ck.Graph("g")
    x = g.input("x", (2, 3))
    with _raises(f"{op}: axis", "out of range", "(2, 3)", "valid axes: -2..1"):
        call(x)


def test_unsqueeze_axis_out_of_range_lists_the_valid_positions() -> None:
    g = ck.Graph("g")
    x = g.input("x", (2, 3))
    with _raises("unsqueeze: axis 3", "valid axes: -3..2"):
        x.unsqueeze(3)


def test_axis_that_is_not_an_int() -> None:
    g = ck.Graph("g")
    x = g.input("x", (2, 3))
    with _raises("sum: axis 1.0", "valid axes"):
        x.sum(axis=1.0)


def test_repeated_reduction_axis() -> None:
    g = ck.Graph("g")
    x = g.input("x", (2, 3))
    with _raises("sum", "repeats an axis", "(2, 3)"):
        x.sum(axis=(1, -1))


def test_permute_that_is_not_a_permutation() -> None:
    g = ck.Graph("g")
    x = g.input("x", (2, 3, 4))
    with _raises("permute", "(0, 0, 1)", "not a permutation", "(2, 3, 4)"):
        x.permute(0, 0, 1)
    with _raises("permute", "not a permutation"):
        x.permute(0, 1)


def test_cat_with_mismatched_shapes_and_bad_axis() -> None:
    g = ck.Graph("g")
    a, b = g.input("a", (2, 3)), g.input("b", (3, 3))
    with _raises("cat", "(2, 3)", "(3, 3)", "outside axis 1", "must match"):
        ck.cat([a, b], axis=1)
    with _raises("cat: axis 2", "valid axes"):
        ck.cat([a, b], axis=2)
    with _raises("cat", "at least one tensor"):
        ck.cat([])


# ------------------------------------------------------------------ dtypes


@pytest.mark.parametrize("dtype", ["fp8", "float64", "int32", "bool", None])
def test_input_with_unknown_dtype(dtype: object) -> None:
    g = ck.Graph("g")
    with _raises("input 'x'", f"unknown dtype {dtype!r}", "valid dtypes: bf16, fp16, fp32"):
        g.input("x", (2,), dtype)


def test_cast_and_constant_with_unknown_dtype() -> None:
    g = ck.Graph("g")
    x = g.input("x", (2,))
    with _raises("cast", "'e4m3'", "bf16, fp16, fp32, fp8_e4m3, fp8_e5m2, int32, bool"):
        x.cast("e4m3")
    with _raises("constant", "'double'", "bf16, fp16, fp32, int32, bool"):
        g.constant(1.0, "double")


def test_arithmetic_on_bool_tensors() -> None:
    g = ck.Graph("g")
    mask = g.input("x", (2,)) < 0.0
    with _raises("add", "(2,)", "bool", "cast"):
        mask + mask
    with _raises("exp2", "(2,)", "bool", "valid: fp32, fp16, bf16, int32"):
        mask.exp2()
    with _raises("sum_reduce", "(2,)", "bool", "cast"):
        mask.sum()


def test_where_condition_must_be_bool() -> None:
    g = ck.Graph("g")
    x = g.input("x", (2,))
    with _raises("where", "condition", "(2,)", "fp32", "must be bool"):
        ck.where(x, x, 0.0)


# ------------------------------------------------------------------ names


@pytest.mark.parametrize("name", ["1x", "a-b", "", "x y", "q\n", "é", "x" * 65, 3, None])
def test_input_name_that_is_not_an_identifier(name: object) -> None:
    g = ck.Graph("g")
    with _raises("input", repr(name), "[A-Za-z_][A-Za-z0-9_]*", "64"):
        g.input(name, (2,))


def test_output_name_that_is_not_an_identifier() -> None:
    g = ck.Graph("g")
    x = g.input("x", (2,))
    with _raises("output", "'o;'", "[A-Za-z_][A-Za-z0-9_]*"):
        g.output(x, "o;")


def test_duplicated_names() -> None:
    g = ck.Graph("g")
    x = g.input("x", (2,))
    with _raises("input", "'x'", "already used", "unique"):
        g.input("x", (3,))
    g.output(x * 2.0, "y")
    with _raises("output", "'y'", "already used", "unique"):
        g.output(x, "y")
    with _raises("output", "'x'", "already used"):
        g.output(x, "x")
    with _raises("input", "'y'", "already used"):
        g.input("y", (2,))


def test_graph_name_must_be_printable() -> None:
    with _raises("Graph", "printable"):
        ck.Graph("bad\nname")
    with _raises("Graph", "printable"):
        ck.Graph("")


# ------------------------------------------------------------------ evaluate


def _qk_graph() -> ck.Graph:
    g = ck.Graph("qk")
    q, k = g.input("q", (2, 3)), g.input("k", (4, 3))
    g.output(q @ k.mT, "s")
    return g


def test_evaluate_with_missing_input() -> None:
    with _raises("evaluate", "missing inputs ['k']", "'qk'", "['k', 'q']"):
        ck.evaluate(_qk_graph(), {"q": np.zeros((2, 3))})


def test_evaluate_with_unknown_input() -> None:
    with _raises("evaluate", "unknown inputs ['v']", "['k', 'q']"):
        ck.evaluate(_qk_graph(), {"q": np.zeros((2, 3)), "k": np.zeros((4, 3)), "v": np.zeros(1)})


def test_evaluate_with_mis_shaped_input() -> None:
    with _raises("evaluate", "'k'", "(3, 4)", "(4, 3)"):
        ck.evaluate(_qk_graph(), {"q": np.zeros((2, 3)), "k": np.zeros((3, 4))})


def test_evaluate_of_something_that_is_not_a_graph() -> None:
    with _raises("evaluate", "Graph", "str"):
        ck.evaluate("attention", {})


# ------------------------------------------------------------------ constants


def test_nan_constants_are_rejected() -> None:
    g = ck.Graph("g")
    x = g.input("x", (2,))
    for build in (
        lambda: g.constant(math.nan),
        lambda: x + math.nan,
        lambda: math.nan * x,
        lambda: ck.where(x < 0.0, math.nan, x),
        lambda: ck.constant(np.float64("nan")),
    ):
        with _raises("constant", "NaN", "finite value or ±inf"):
            build()
    with _raises("pad", "NaN"):
        x.pad([(1, 0)], math.nan)


def test_infinite_constants_are_allowed() -> None:
    g = ck.Graph("g")
    assert g.constant(-math.inf).node.attrs == (-math.inf,)


def test_int32_constants_must_fit() -> None:
    g = ck.Graph("g")
    with _raises("constant", "int32"):
        g.constant(2**31, "int32")
    with _raises("constant", "int32"):
        g.constant(0.5, "int32")


def test_division_by_constant_zero() -> None:
    g = ck.Graph("g")
    x = g.input("x", (2, 3))
    with _raises("div", "(2, 3)", "constant 0"):
        x / 0


def test_pow_with_tensor_exponent() -> None:
    g = ck.Graph("g")
    x = g.input("x", (2,))
    with _raises("pow", "Python int or float", "Tensor"):
        x**x


def test_tensor_has_no_truth_value() -> None:
    g = ck.Graph("g")
    x = g.input("x", (2,))
    with _raises("truth value", "ck.where"):
        bool(x > 0.0)


def test_unsupported_operand_type() -> None:
    g = ck.Graph("g")
    x = g.input("x", (2,))
    with _raises("add", "str", "'a'"):
        x + "a"


# ------------------------------------------------------------------ indexing and padding


def test_getitem_errors() -> None:
    g = ck.Graph("g")
    x = g.input("x", (2, 3))
    with _raises("getitem", "index 3", "axis 1", "size 3"):
        x[:, 3]
    with _raises("getitem", "index -3", "axis 0", "size 2"):
        x[-3]
    with _raises("getitem", "step 2", "unit steps"):
        x[::2]
    with _raises("getitem", "empty"):
        x[1:1]
    with _raises("getitem", "3 indices", "(2, 3)"):
        x[0, 0, 0]
    with _raises("getitem", "at most one ..."):
        x[..., 0, ...]
    with _raises("getitem", "unsupported index", "ints, unit-step slices, None or ..."):
        x[[0, 1]]


def test_slice_method_out_of_range() -> None:
    g = ck.Graph("g")
    x = g.input("x", (2, 3))
    with _raises("slice", "axis 1", "[1, 4)", "(2, 3)"):
        x.slice((0, 1), (2, 4))
    with _raises("slice", "one start and one stop per axis"):
        x.slice((0,), (2,))


def test_pad_errors() -> None:
    g = ck.Graph("g")
    x = g.input("x", (2, 3))
    with _raises("pad", "non-negative"):
        x.pad([(0, 0), (-1, 0)])
    with _raises("pad", "one (before, after) pair per axis", "(2, 3)"):
        x.pad([(1, 1)])


def test_arange_errors() -> None:
    with _raises("arange", "empty range [3, 3)"):
        ck.arange(3, 3)
    with _raises("arange", "ints", "2.5"):
        ck.arange(2.5)


# ------------------------------------------------------------------ two graphs


def test_tensors_from_two_graphs_do_not_combine() -> None:
    g1, g2 = ck.Graph("first"), ck.Graph("second")
    a, b = g1.input("a", (2, 2)), g2.input("b", (2, 2))
    for build, op in (
        (lambda: a + b, "add"),
        (lambda: a * b, "mul"),
        (lambda: ck.where(a < 0.0, a, b), "where"),
        (lambda: a @ b, "matmul"),
        (lambda: g1.output(b), "output"),
    ):
        with _raises(op, "different graphs", "'first'", "'second'", "one Graph"):
            build()


def test_matmul_function_on_two_graphs_names_matmul() -> None:
    g1, g2 = ck.Graph("first"), ck.Graph("second")
    a, b = g1.input("a", (2, 2)), g2.input("b", (2, 2))
    with _raises("matmul", "different graphs", "'first'", "'second'"):
        ck.matmul(a, b)


# ------------------------------------------------------------------ ck.nn


def test_gelu_with_unknown_approximation() -> None:
    g = ck.Graph("g")
    with _raises("gelu", "'exact'", "'tanh' or 'none'"):
        ck.nn.gelu(g.input("x", (2,)), approximate="exact")


def test_attention_with_incompatible_shapes() -> None:
    g = ck.Graph("g")
    q, k, v = g.input("q", (1, 6, 4, 8)), g.input("k", (1, 4, 5, 8)), g.input("v", (1, 4, 5, 8))
    with _raises("attention", "6 query heads", "4 K/V heads", "multiple"):
        ck.nn.attention(q, k, v)
    k2 = g.input("k2", (1, 6, 5, 7))
    with _raises("attention", "(1, 6, 4, 8)", "(1, 6, 5, 7)", "share the last axis"):
        ck.nn.attention(q, k2, g.input("v2", (1, 6, 5, 8)))
    with _raises("attention", "(..., seq, dim)"):
        ck.nn.attention(g.input("q1", (8,)), k, v)
