"""Hypothesis: random chains of views (permute, transpose, reshape, expand, slicing, int
indexing, unsqueeze, squeeze, pad) give exactly the values of the same chain in NumPy."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import array_shapes

import cherenkov as ck

from .helpers import evaluate_one

Shape = tuple[int, ...]
MAX_RANK = 5
MAX_ELEMENTS = 2048


@dataclass(frozen=True)
class Step:
    """One view: ``kind`` and its arguments, applied the same way to a Tensor and an array."""

    kind: str
    args: tuple

    def tensor(self, x: ck.Tensor) -> ck.Tensor:
        match self.kind:
            case "permute":
                return x.permute(*self.args)
            case "transpose":
                return x.transpose(*self.args)
            case "reshape":
                return x.reshape(*self.args)
            case "expand":
                return x.expand(*self.args[0])
            case "index":
                return x[self.args]
            case "unsqueeze":
                return x.unsqueeze(*self.args)
            case "squeeze":
                return x.squeeze(*self.args)
            case "pad":
                return x.pad(*self.args)
        raise AssertionError(self.kind)

    def array(self, a: np.ndarray) -> np.ndarray:
        match self.kind:
            case "permute":
                return np.transpose(a, self.args)
            case "transpose":
                return np.swapaxes(a, *self.args)
            case "reshape":
                return np.reshape(a, self.args)
            case "expand":
                return np.broadcast_to(a, self.args[1])
            case "index":
                return a[self.args]
            case "unsqueeze":
                return np.expand_dims(a, self.args[0])
            case "squeeze":
                return np.squeeze(a, self.args[0]) if a.shape[self.args[0]] == 1 else a
            case "pad":
                pads, value = self.args
                return np.pad(a, pads, constant_values=value)
        raise AssertionError(self.kind)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@st.composite
def steps(draw: st.DrawFn, shape: Shape) -> Step:
    """One view step valid for ``shape`` that keeps the rank and size small."""
    rank, size = len(shape), math.prod(shape)
    kinds = ["reshape", "expand", "index"]
    if rank >= 1:
        kinds += ["permute", "transpose", "squeeze", "pad"]
    if rank < MAX_RANK:
        kinds.append("unsqueeze")
    kind = draw(st.sampled_from(kinds))
    if kind == "permute":
        perm = draw(st.permutations(range(rank)))
        negate = draw(st.lists(st.booleans(), min_size=rank, max_size=rank))
        return Step(kind, tuple(p - rank if neg else p for p, neg in zip(perm, negate)))
    if kind == "transpose":
        return Step(kind, (draw(st.integers(-rank, rank - 1)), draw(st.integers(-rank, rank - 1))))
    if kind == "reshape":
        dims: list[int] = []
        remaining = size
        while remaining > 1 and len(dims) < MAX_RANK - 1:
            dims.append(draw(st.sampled_from(_divisors(remaining))))
            remaining //= dims[-1]
        dims.append(remaining)
        if draw(st.booleans()):
            dims[draw(st.integers(0, len(dims) - 1))] = -1
        return Step(kind, tuple(dims))
    if kind == "expand":
        lead = draw(st.integers(0, MAX_RANK - rank))
        target = [draw(st.integers(1, 3)) for _ in range(lead)]
        target += [draw(st.integers(1, 3)) if d == 1 else draw(st.sampled_from([d, -1])) for d in shape]
        resolved = tuple(d if d != -1 else shape[i - lead] for i, d in enumerate(target))
        if math.prod(resolved) > MAX_ELEMENTS:
            return Step(kind, (shape, shape))
        return Step(kind, (tuple(target), resolved))
    if kind == "index":
        items: list[object] = []
        for d in shape:
            choice = draw(st.sampled_from(["all", "slice", "int"] if d > 1 else ["all", "int"]))
            if choice == "all":
                items.append(slice(None))
            elif choice == "int":
                items.append(draw(st.integers(-d, d - 1)))
            else:
                lo = draw(st.integers(0, d - 1))
                items.append(slice(lo, draw(st.integers(lo + 1, d + 2))))
        if rank < MAX_RANK and draw(st.booleans()):
            items.insert(draw(st.integers(0, len(items))), None)
        if draw(st.booleans()):
            # Replace a run (possibly empty) of full slices by an Ellipsis.
            start = draw(st.integers(0, len(items)))
            run = 0
            while start + run < len(items) and items[start + run] == slice(None):
                run += 1
            length = draw(st.integers(0, run))
            items = [*items[:start], Ellipsis, *items[start + length :]]
        return Step(kind, tuple(items))
    if kind == "unsqueeze":
        return Step(kind, (draw(st.integers(-rank - 1, rank)),))
    if kind == "squeeze":
        return Step(kind, (draw(st.integers(-rank, rank - 1)),))
    pads = tuple((draw(st.integers(0, 1)), draw(st.integers(0, 1))) for _ in shape)
    grown = math.prod(d + lo + hi for d, (lo, hi) in zip(shape, pads))
    if grown > MAX_ELEMENTS:
        pads = tuple((0, 0) for _ in shape)
    return Step(kind, (pads, draw(st.sampled_from([0.0, -2.5, -math.inf]))))


@st.composite
def chains(draw: st.DrawFn) -> tuple[Shape, list[Step]]:
    shape: Shape = draw(array_shapes(min_dims=0, max_dims=4, min_side=1, max_side=4))
    chain: list[Step] = []
    probe = np.broadcast_to(np.float64(0.0), shape)
    for _ in range(draw(st.integers(1, 6))):
        step = draw(steps(probe.shape))
        chain.append(step)
        probe = step.array(probe)
    return shape, chain


@settings(max_examples=150, deadline=None)
@given(chain=chains(), seed=st.integers(0, 2**32 - 1))
def test_random_view_chain_matches_numpy(chain: tuple[Shape, list[Step]], seed: int) -> None:
    shape, chain_steps = chain
    values = np.random.default_rng(seed).standard_normal(shape)
    g = ck.Graph("views")
    tensor = g.input("x", shape)
    expected = values
    for step in chain_steps:
        tensor, expected = step.tensor(tensor), step.array(expected)
        assert tensor.shape == expected.shape, f"after {step}: {tensor.shape} != {expected.shape}"
    g.output(tensor)
    assert set(g.ops()) <= ck.PRIMITIVES
    np.testing.assert_array_equal(evaluate_one(g, x=values), expected)


@settings(max_examples=50, deadline=None)
@given(chain=chains(), seed=st.integers(0, 2**32 - 1))
def test_random_view_chain_then_contiguous_and_reduction(chain: tuple[Shape, list[Step]], seed: int) -> None:
    shape, chain_steps = chain
    values = np.random.default_rng(seed).standard_normal(shape)
    g = ck.Graph("views")
    tensor = g.input("x", shape)
    expected = values
    for step in chain_steps:
        tensor, expected = step.tensor(tensor), step.array(expected)
    g.output(tensor.contiguous().max(axis=None) if tensor.ndim else tensor.contiguous())
    assert evaluate_one(g, x=values) == np.max(expected)
