"""The reference evaluator itself: its einsum shortcut for contractions, its input handling
(float64 copies, torch tensors), and outputs that are inputs or free tensors."""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import array_shapes

import cherenkov as ck

from .helpers import evaluate_one


@st.composite
def contraction_cases(draw: st.DrawFn) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...], int]:
    """A full shape, two operand shapes that broadcast to it (size-1 or absent leading axes),
    and a reduction axis."""
    full = draw(array_shapes(min_dims=1, max_dims=4, min_side=1, max_side=4))

    def operand() -> tuple[int, ...]:
        lead = draw(st.integers(0, len(full)))
        return tuple(1 if draw(st.booleans()) else d for d in full[lead:])

    return full, operand(), operand(), draw(st.integers(-len(full), len(full) - 1))


@settings(max_examples=80, deadline=None)
@given(case=contraction_cases(), seed=st.integers(0, 2**32 - 1))
def test_sum_of_broadcast_product_matches_numpy(case, seed: int) -> None:
    """``sum_reduce(mul(expand a, expand b))`` takes the einsum path; it must equal the
    direct product-then-sum, including axes broadcast in both operands."""
    full, a_shape, b_shape, axis = case
    rng = np.random.default_rng(seed)
    av, bv = rng.standard_normal(a_shape), rng.standard_normal(b_shape)
    g = ck.Graph("contract")
    a, b = g.input("a", a_shape), g.input("b", b_shape)
    product = a.expand(*full) * b.expand(*full)
    g.output(product.sum(axis=axis), "contracted")
    ref = np.sum(np.broadcast_to(av, full) * np.broadcast_to(bv, full), axis=axis)
    out = ck.evaluate(g, {"a": av, "b": bv})["contracted"]
    assert out.shape == ref.shape
    np.testing.assert_allclose(out, ref, rtol=1e-12, atol=1e-12)


def test_contraction_whose_product_is_also_an_output(rng: np.random.Generator) -> None:
    g = ck.Graph("contract")
    a, b = g.input("a", (3, 1, 4)), g.input("b", (5, 4))
    product = a * b
    g.output(product, "product")
    g.output(product.sum(axis=-1), "sum")
    av, bv = rng.standard_normal((3, 1, 4)), rng.standard_normal((5, 4))
    out = ck.evaluate(g, {"a": av, "b": bv})
    np.testing.assert_allclose(out["product"], av * bv, rtol=1e-15)
    np.testing.assert_allclose(out["sum"], (av * bv).sum(-1), rtol=1e-12)


def test_product_used_by_a_reduction_and_an_elementwise_op(rng: np.random.Generator) -> None:
    g = ck.Graph("contract")
    a, b = g.input("a", (3, 4)), g.input("b", (3, 4))
    product = a * b
    g.output(product.sum(axis=0) + product.exp().sum(axis=0))
    av, bv = rng.standard_normal((3, 4)), rng.standard_normal((3, 4))
    ref = (av * bv).sum(0) + np.exp(av * bv).sum(0)
    np.testing.assert_allclose(evaluate_one(g, a=av, b=bv), ref, rtol=1e-12)


def test_evaluate_returns_float64_copies_and_does_not_alias_inputs(rng: np.random.Generator) -> None:
    g = ck.Graph("identity")
    x = g.input("x", (2, 3), "bf16")
    g.output(x, "same")
    g.output(x < 0.0, "mask")
    xs = rng.standard_normal((2, 3)).astype(np.float32)
    out = ck.evaluate(g, {"x": xs})
    assert out["same"].dtype == np.float64 and out["mask"].dtype == np.float64
    np.testing.assert_array_equal(out["same"], xs)
    np.testing.assert_array_equal(out["mask"], (xs < 0).astype(float))
    out["same"][0, 0] = 123.0
    assert xs[0, 0] != 123.0


def test_evaluate_accepts_torch_tensors_and_lists(rng: np.random.Generator) -> None:
    g = ck.Graph("torch_in")
    x, y = g.input("x", (2, 3), "bf16"), g.input("y", (3,))
    g.output(x * y)
    xt = torch.from_numpy(rng.standard_normal((2, 3))).to(torch.bfloat16)
    out = evaluate_one(g, x=xt, y=[1.0, 2.0, 3.0])
    np.testing.assert_array_equal(out, xt.double().numpy() * np.array([1.0, 2.0, 3.0]))


def test_free_tensor_as_output_joins_the_graph() -> None:
    g = ck.Graph("free_out")
    g.input("x", (2,))
    g.output(ck.arange(2, 5) * 2, "counted")
    np.testing.assert_array_equal(ck.evaluate(g, {"x": np.zeros(2)})["counted"], [4.0, 6.0, 8.0])


def test_evaluate_of_graph_without_outputs_returns_nothing() -> None:
    g = ck.Graph("empty")
    g.input("x", (2,))
    assert ck.evaluate(g, {"x": np.zeros(2)}) == {}


def test_evaluate_delegates_to_objects_with_their_own_reference() -> None:
    class Fused:
        def evaluate(self, inputs: dict) -> dict[str, np.ndarray]:
            return {"o": np.asarray(inputs["q"]) * 2.0}

    out = ck.evaluate(Fused(), {"q": np.ones(2)})
    np.testing.assert_array_equal(out["o"], [2.0, 2.0])
