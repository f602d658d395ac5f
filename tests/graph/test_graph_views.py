"""View ops (permute, transpose, expand, reshape, unsqueeze, squeeze, slicing, pad), contiguous
and cat, compared element for element with the same NumPy operations."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest

import cherenkov as ck

from .helpers import evaluate_one

SHAPE = (2, 3, 4, 5)


def _view(fn: Callable[[ck.Tensor], ck.Tensor], xs: np.ndarray) -> tuple[ck.Tensor, np.ndarray]:
    g = ck.Graph("view")
    result = fn(g.input("x", xs.shape))
    g.output(result)
    return result, evaluate_one(g, x=xs)


def _check(fn: Callable[[ck.Tensor], ck.Tensor], ref: Callable[[np.ndarray], np.ndarray], xs: np.ndarray) -> None:
    result, out = _view(fn, xs)
    expected = ref(xs)
    assert result.shape == expected.shape
    np.testing.assert_array_equal(out, expected)


@pytest.fixture
def xs(rng: np.random.Generator) -> np.ndarray:
    return rng.standard_normal(SHAPE)


@pytest.mark.parametrize("perm", [(0, 1, 2, 3), (3, 2, 1, 0), (1, 3, 0, 2), (-1, 0, -2, 1)], ids=str)
def test_permute(xs: np.ndarray, perm: tuple[int, ...]) -> None:
    _check(lambda x: x.permute(*perm), lambda a: np.transpose(a, perm), xs)
    _check(lambda x: x.permute(perm), lambda a: np.transpose(a, perm), xs)


def test_permute_identity_adds_no_node(xs: np.ndarray) -> None:
    result, _ = _view(lambda x: x.permute(0, 1, 2, 3), xs)
    assert result.node.op == "input"


@pytest.mark.parametrize("a,b", [(0, 1), (-2, -1), (3, 0), (1, 1)])
def test_transpose(xs: np.ndarray, a: int, b: int) -> None:
    _check(lambda x: x.transpose(a, b), lambda arr: np.swapaxes(arr, a, b), xs)


def test_mT_swaps_the_last_two_axes(xs: np.ndarray) -> None:
    _check(lambda x: x.mT, lambda a: np.swapaxes(a, -1, -2), xs)


@pytest.mark.parametrize(
    "source,target",
    [((3, 1), (3, 4)), ((1, 4), (2, 3, 4)), ((1,), (5,)), ((), (2, 2)), ((2, 1, 1), (2, 3, 4))],
    ids=str,
)
def test_expand(rng: np.random.Generator, source: tuple[int, ...], target: tuple[int, ...]) -> None:
    arr = rng.standard_normal(source)
    _check(lambda x: x.expand(*target), lambda a: np.broadcast_to(a, target), arr)
    _check(lambda x: x.expand(target), lambda a: np.broadcast_to(a, target), arr)


def test_expand_with_minus_one_keeps_the_size(rng: np.random.Generator) -> None:
    arr = rng.standard_normal((3, 1))
    _check(lambda x: x.expand(2, -1, 4), lambda a: np.broadcast_to(a, (2, 3, 4)), arr)


@pytest.mark.parametrize("target", [(6, 20), (-1,), (2, -1, 5), (120,), (1, 2, 3, 1, 20), (5, 4, 3, 2)], ids=str)
def test_reshape(xs: np.ndarray, target: tuple[int, ...]) -> None:
    _check(lambda x: x.reshape(*target), lambda a: np.reshape(a, target), xs)
    _check(lambda x: x.view(target), lambda a: np.reshape(a, target), xs)


def test_reshape_of_a_permuted_view_uses_logical_order(xs: np.ndarray) -> None:
    _check(lambda x: x.permute(3, 1, 0, 2).reshape(5, -1), lambda a: np.transpose(a, (3, 1, 0, 2)).reshape(5, -1), xs)


@pytest.mark.parametrize("dim", [0, 2, 4, -1, -5])
def test_unsqueeze(xs: np.ndarray, dim: int) -> None:
    _check(lambda x: x.unsqueeze(dim), lambda a: np.expand_dims(a, dim), xs)


@pytest.mark.parametrize("dim", [None, 0, 2, -2, 1])
def test_squeeze(rng: np.random.Generator, dim: int | None) -> None:
    arr = rng.standard_normal((1, 3, 1, 4))
    ref = (lambda a: np.squeeze(a)) if dim is None else (lambda a: np.squeeze(a, dim) if a.shape[dim] == 1 else a)
    _check(lambda x: x.squeeze(dim), ref, arr)


INDICES: list[object] = [
    0,
    -1,
    (1, 2),
    slice(1, 3),
    (slice(None), slice(1, None)),
    (Ellipsis, 2),
    (Ellipsis, slice(1, 4)),
    (0, Ellipsis, -2),
    (None, 1),
    (slice(None), None, 2, None),
    (Ellipsis, None),
    (None, Ellipsis, None),
    (1, -1, slice(0, 2), 3),
    (slice(-3, -1), slice(None, 100)),
    Ellipsis,
    (slice(None, None, 1), slice(2, 3)),
]


@pytest.mark.parametrize("index", INDICES, ids=repr)
def test_getitem(xs: np.ndarray, index: object) -> None:
    _check(lambda x: x[index], lambda a: a[index], xs)


def test_slice_method_is_a_unit_step_box(xs: np.ndarray) -> None:
    _check(lambda x: x.slice((1, 0, 2, 1), (2, 3, 4, 5)), lambda a: a[1:2, 0:3, 2:4, 1:5], xs)


def test_full_slice_adds_no_node(xs: np.ndarray) -> None:
    result, _ = _view(lambda x: x[:, :, :, :], xs)
    assert result.node.op == "input"


@pytest.mark.parametrize("value", [0.0, -1.5, float("-inf")])
@pytest.mark.parametrize("pads", [((0, 0), (1, 2), (0, 0), (3, 0)), ((1, 1),) * 4, ((0, 0),) * 4], ids=str)
def test_pad(xs: np.ndarray, pads: tuple[tuple[int, int], ...], value: float) -> None:
    _check(lambda x: x.pad(pads, value), lambda a: np.pad(a, pads, constant_values=value), xs)


def test_contiguous_materialises_the_same_values(xs: np.ndarray) -> None:
    result, out = _view(lambda x: x.permute(2, 0, 3, 1).contiguous(), xs)
    assert result.node.op == "contiguous"
    np.testing.assert_array_equal(out, np.transpose(xs, (2, 0, 3, 1)))


@pytest.mark.parametrize("axis", [0, 1, -1])
def test_cat(rng: np.random.Generator, axis: int) -> None:
    shapes = [(2, 3, 4), (2, 3, 4), (2, 3, 4)]
    sizes = (1, 2, 5)
    shapes = [tuple(sizes[i] if j == axis % 3 else s for j, s in enumerate(shape)) for i, shape in enumerate(shapes)]
    arrays = [rng.standard_normal(s) for s in shapes]
    g = ck.Graph("cat")
    parts = [g.input(f"x{i}", s) for i, s in enumerate(shapes)]
    g.output(ck.cat(parts, axis=axis))
    out = evaluate_one(g, **{f"x{i}": a for i, a in enumerate(arrays)})
    np.testing.assert_array_equal(out, np.concatenate(arrays, axis=axis))


def test_cat_keeps_infinities(rng: np.random.Generator) -> None:
    g = ck.Graph("cat")
    a, b = g.input("a", (2,)), g.input("b", (3,))
    g.output(ck.cat([a, b]))
    av, bv = np.array([-np.inf, 1.0]), np.array([np.inf, 2.0, -np.inf])
    np.testing.assert_array_equal(evaluate_one(g, a=av, b=bv), np.concatenate([av, bv]))


def test_cat_of_one_tensor_is_that_tensor() -> None:
    g = ck.Graph("cat")
    a = g.input("a", (2, 3))
    assert ck.cat([a], axis=1) is a


def test_views_compose_with_arithmetic(xs: np.ndarray) -> None:
    def fn(x: ck.Tensor) -> ck.Tensor:
        return x[0].transpose(0, 2) * x[1, :, None, 1, :].expand(3, 4, 5).permute(2, 1, 0)

    def ref(a: np.ndarray) -> np.ndarray:
        return np.swapaxes(a[0], 0, 2) * np.transpose(np.broadcast_to(a[1, :, None, 1, :], (3, 4, 5)), (2, 1, 0))

    result, out = _view(fn, xs)
    assert result.shape == (5, 4, 3)
    np.testing.assert_allclose(out, ref(xs), rtol=1e-15, atol=0)
