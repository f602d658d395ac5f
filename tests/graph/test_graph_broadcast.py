"""Broadcasting of every binary (and the ternary) op, fixed cases and Hypothesis-generated
shapes; incompatible shapes must raise ``ck.GraphError`` naming the op and the shapes."""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import array_shapes, mutually_broadcastable_shapes

import cherenkov as ck

from .helpers import evaluate_one

Shape = tuple[int, ...]
BinaryFn = Callable[[object, object], object]

# name: (cherenkov builder, NumPy reference); the reference uses operands with b != 0.
BINARY_OPS: dict[str, tuple[BinaryFn, BinaryFn]] = {
    "add": (lambda a, b: a + b, np.add),
    "sub": (lambda a, b: a - b, np.subtract),
    "mul": (lambda a, b: a * b, np.multiply),
    "div": (lambda a, b: a / b, np.divide),
    "mod": (lambda a, b: a % b, np.mod),
    "maximum": (lambda a, b: a.maximum(b), np.maximum),
    "minimum": (lambda a, b: a.minimum(b), np.minimum),
    "less_than": (lambda a, b: a < b, np.less),
    "less_equal": (lambda a, b: a <= b, np.less_equal),
    "greater_than": (lambda a, b: a > b, np.greater),
    "greater_equal": (lambda a, b: a >= b, np.greater_equal),
}

# Op names the error message must carry, per builder.
ERROR_NAMES = {name: name for name in BINARY_OPS}

FIXED_PAIRS: list[tuple[Shape, Shape]] = [
    ((3, 1), (1, 4)),
    ((2, 3, 4), (4,)),
    ((5, 1, 3), (2, 1)),
    ((), (2, 3)),
    ((1,), (3, 1, 1)),
    ((2, 3), (2, 3)),
]


def _operands(rng: np.random.Generator, a_shape: Shape, b_shape: Shape) -> tuple[np.ndarray, np.ndarray]:
    """Small integers (so comparisons tie) plus a fraction; ``b`` never zero."""
    a = rng.integers(-3, 4, a_shape) + rng.choice([0.0, 0.5], a_shape)
    b = rng.integers(1, 4, b_shape) * rng.choice([-1.0, 1.0], b_shape) + rng.choice([0.0, 0.5], b_shape)
    return np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)


def _check_binary(name: str, a_shape: Shape, b_shape: Shape, rng: np.random.Generator) -> None:
    fn, ref = BINARY_OPS[name]
    g = ck.Graph("broadcast")
    result = fn(g.input("a", a_shape), g.input("b", b_shape))
    g.output(result)
    av, bv = _operands(rng, a_shape, b_shape)
    expected = np.asarray(ref(av, bv), dtype=np.float64)
    assert result.shape == expected.shape
    np.testing.assert_allclose(evaluate_one(g, a=av, b=bv), expected, rtol=1e-15, atol=0)


@pytest.mark.parametrize("shapes", FIXED_PAIRS, ids=str)
@pytest.mark.parametrize("name", sorted(BINARY_OPS))
def test_binary_op_broadcasts_like_numpy(rng: np.random.Generator, name: str, shapes: tuple[Shape, Shape]) -> None:
    _check_binary(name, *shapes, rng)
    _check_binary(name, shapes[1], shapes[0], rng)


@pytest.mark.parametrize("shapes", [((3, 1), (1, 4), (4,)), ((2, 1, 3), (), (5, 1)), ((1,), (2, 2), (1, 2))], ids=str)
def test_where_broadcasts_three_operands(rng: np.random.Generator, shapes: tuple[Shape, Shape, Shape]) -> None:
    g = ck.Graph("where")
    c, a, b = (g.input(n, s) for n, s in zip("cab", shapes))
    result = ck.where(c > 0.0, a, b)
    g.output(result)
    cv, av, bv = (rng.standard_normal(s) for s in shapes)
    expected = np.where(cv > 0, av, bv)
    assert result.shape == expected.shape
    np.testing.assert_array_equal(evaluate_one(g, c=cv, a=av, b=bv), expected)


@pytest.mark.parametrize(
    "a_shape,b_shape",
    [((2, 1, 3, 4), (5, 4, 6)), ((4,), (2, 4, 3)), ((2, 3, 4), (4,)), ((4,), (4,)), ((1, 3, 4), (2, 1, 4, 2))],
    ids=str,
)
def test_matmul_broadcasts_batch_axes_like_numpy(rng: np.random.Generator, a_shape: Shape, b_shape: Shape) -> None:
    g = ck.Graph("matmul")
    result = g.input("a", a_shape) @ g.input("b", b_shape)
    g.output(result)
    av, bv = rng.standard_normal(a_shape), rng.standard_normal(b_shape)
    expected = np.matmul(av, bv)
    assert result.shape == expected.shape
    np.testing.assert_allclose(evaluate_one(g, a=av, b=bv), expected, rtol=1e-12, atol=1e-14)


# ------------------------------------------------------------------ Hypothesis


@settings(max_examples=60, deadline=None)
@given(
    name=st.sampled_from(sorted(BINARY_OPS)),
    shapes=mutually_broadcastable_shapes(num_shapes=2, min_dims=0, max_dims=4, min_side=1, max_side=4),
    seed=st.integers(0, 2**32 - 1),
)
def test_random_compatible_shapes_broadcast_like_numpy(name: str, shapes, seed: int) -> None:
    a_shape, b_shape = shapes.input_shapes
    _check_binary(name, a_shape, b_shape, np.random.default_rng(seed))


@st.composite
def incompatible_shapes(draw: st.DrawFn) -> tuple[Shape, Shape]:
    """Two shapes that NumPy refuses to broadcast: one aligned axis has sizes m != n, both > 1."""
    a = list(draw(array_shapes(min_dims=1, max_dims=4, min_side=1, max_side=4)))
    b = list(draw(array_shapes(min_dims=1, max_dims=4, min_side=1, max_side=4)))
    offset = draw(st.integers(1, min(len(a), len(b))))
    m = draw(st.integers(2, 5))
    n = draw(st.integers(2, 5).filter(lambda v: v != m))
    a[-offset], b[-offset] = m, n
    return tuple(a), tuple(b)


@settings(max_examples=60, deadline=None)
@given(name=st.sampled_from(sorted(BINARY_OPS)), shapes=incompatible_shapes(), swap=st.booleans())
def test_random_incompatible_shapes_raise_graph_error(name: str, shapes: tuple[Shape, Shape], swap: bool) -> None:
    a_shape, b_shape = shapes[::-1] if swap else shapes
    with pytest.raises(ValueError):
        np.broadcast_shapes(a_shape, b_shape)
    fn, _ = BINARY_OPS[name]
    g = ck.Graph("broadcast")
    a, b = g.input("a", a_shape), g.input("b", b_shape)
    nodes_before = len(g.nodes)
    with pytest.raises(ck.GraphError) as info:
        fn(a, b)
    message = str(info.value)
    assert ERROR_NAMES[name] in message
    assert str(a_shape) in message and str(b_shape) in message
    assert "must match or be 1" in message
    assert all(n.op != "expand" for n in g.nodes[nodes_before:]), "a failed op must not leave a broadcast behind"


@settings(max_examples=30, deadline=None)
@given(shapes=incompatible_shapes())
def test_random_incompatible_where_raises_graph_error(shapes: tuple[Shape, Shape]) -> None:
    g = ck.Graph("where")
    a, b = g.input("a", shapes[0]), g.input("b", shapes[1])
    with pytest.raises(ck.GraphError, match=r"where: shapes .* do not broadcast"):
        ck.where(a > 0.0, a, b)


def test_broadcast_keeps_minus_inf_operands() -> None:
    g = ck.Graph("mask")
    s = g.input("s", (2, 3))
    g.output(s + ck.where(ck.arange(3, graph=g) < 1, -math.inf, 0.0))
    out = evaluate_one(g, s=np.ones((2, 3)))
    np.testing.assert_array_equal(out, [[-np.inf, 1.0, 1.0], [-np.inf, 1.0, 1.0]])
