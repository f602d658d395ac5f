"""Reads as strided index maps, and buffers laid out for their one consumer: each checked
against NumPy on the same tensors (the element a strided form names is the element the
index term reads)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from cherenkov.rewrites import terms as t
from cherenkov.rewrites.access import affine, strided_read
from cherenkov.rewrites.kernels import consumer_order
from cherenkov.rewrites.reference import evaluate_term

B, S, H, D = "b:2", "s:5", "h:4", "d:8"


def _elements(access: tuple, shape: tuple[int, ...], axes: tuple[str, ...]) -> np.ndarray:
    """What the access reads, at every point of ``axes``: by the reference evaluator."""
    data = np.arange(np.prod(shape), dtype=np.float64).reshape(shape)
    return evaluate_term(access, {access[1]: data}, axes, {a: t.extent(a) for a in axes})


def _by_strides(read, axes: tuple[str, ...]) -> np.ndarray:
    """The flat element offsets the strided form names, at every point of ``axes``."""
    result = np.zeros(tuple(t.extent(a) for a in axes))
    for point in itertools.product(*(range(t.extent(a)) for a in axes)):
        values = dict(zip(axes, point))
        offset = read.offset
        for atom, stride in read.strides.items():
            value = values[atom[1]] if atom[0] == "Ax" else values[atom[1][1]] // atom[2]
            offset += stride * value
        result[point] = offset
    return result


CASES = {
    # view(B, S, H, D).transpose(1, 2): q[b, h, s, d] of a (B, S, H*D) projection
    "heads split from a projection": (t.access("x", (t.ax(B), t.ax(S), t.ix_lin(t.ax(H), 8, t.ax(D)))), (2, 5, 32)),
    # the k slice of a fused QKV (B, S, 3*H*D): an offset of H*D
    "slice of a fused projection": (
        t.access("qkv", (t.ax(B), t.ax(S), t.ix_add(t.ix_lin(t.ax(H), 8, t.ax(D)), 32))), (2, 5, 96)),
    # repeat_kv: query head h reads K/V head h // 2 of a (B, S, 2*D) projection
    "repeated K/V head": (t.access("kv", (t.ax(B), t.ax(S), t.ix_lin(t.ix_div(t.ax(H), 2), 8, t.ax(D)))), (2, 5, 16)),
    # a reshape undone: (h*8 + d) split again and merged back
    "reshape undone": (
        t.access("y", (t.ax(B), ("IxLin", t.ix_div(t.ax("r:32"), 8), 8, t.ix_mod(t.ax("r:32"), 8)))), (2, 32)),
    "extent-1 batch": (t.access("z", (t.ix_lit(0), t.ax(H), t.ax(S), t.ax(D))), (1, 4, 5, 8)),
}  # fmt: skip


@pytest.mark.parametrize("name", CASES)
def test_strided_reads_name_the_elements_the_index_term_reads(name: str) -> None:
    access, shape = CASES[name]
    axes = tuple(sorted(t.free_axes(access)))
    read = strided_read(access, shape)
    assert read is not None and read.shape == shape
    np.testing.assert_array_equal(_by_strides(read, axes), _elements(access, shape, axes))


def test_the_repeated_head_is_an_atom_of_its_own() -> None:
    access, shape = CASES["repeated K/V head"]
    read = strided_read(access, shape)
    assert read.strides[t.ix_div(t.ax(H), 2)] == 8 and t.ax(H) not in read.strides


def test_reads_past_a_dimension_or_not_affine_are_refused() -> None:
    past = t.access("x", (t.ax(B), t.ax(S), t.ix_add(t.ix_lin(t.ax(H), 8, t.ax(D)), 8)))  # reads up to 39 of 32
    assert strided_read(past, (2, 5, 32)) is None
    modulo = t.access("x", (t.ax(B), t.ax(S), t.ix_mod(t.ax("r:40"), 32)))
    assert affine(t.ix_mod(t.ax("r:40"), 32)) is None and strided_read(modulo, (2, 5, 32)) is None
    assert strided_read(t.access("x", (t.ax(B), t.ax(S))), (2, 5, 32)) is None, "rank mismatch"


def test_a_buffer_read_through_a_merge_of_heads_is_laid_out_for_its_reader() -> None:
    """Attention's output (b, h, s, d) read as (b, s, h·d): the buffer becomes (B, S, H·D) and
    the read plain; writing at the returned strides and reading plainly gives the view."""
    axes = (B, H, S, D)
    r = "r:32"
    access = t.access("o", (t.ax(B), t.ix_div(t.ax(r), 8), t.ax(S), t.ix_mod(t.ax(r), 8)))
    layout, plain = consumer_order(access, axes)
    assert layout.shape == (2, 5, 32) and layout.strides == (160, 8, 32, 1)
    assert plain == t.access("o", (t.ax(B), t.ax(S), t.ax(r)))
    values = np.random.default_rng(0).standard_normal((2, 4, 5, 8))
    stored = np.zeros(layout.shape)
    np.lib.stride_tricks.as_strided(stored, values.shape, tuple(8 * s for s in layout.strides))[...] = values
    consumer_axes = (B, S, r)
    extents = {a: t.extent(a) for a in consumer_axes}
    through_view = evaluate_term(access, {"o": values}, consumer_axes, extents)
    np.testing.assert_array_equal(evaluate_term(plain, {"o": stored}, consumer_axes, extents), through_view)


def test_plain_reads_and_partial_splits_keep_their_layout() -> None:
    axes = (B, H, S, D)
    assert consumer_order(t.access("o", tuple(t.ax(a) for a in axes)), axes) is None, "already plain"
    half = t.access("o", (t.ax(B), t.ix_div(t.ax("r:32"), 8), t.ax(S), t.ax(D)))
    assert consumer_order(half, axes) is None, "an outer part without its inner part"


@pytest.mark.parametrize("stride", [2, 4, 8])
def test_merged_axes_split_further_out_are_the_outer_axes(stride: int) -> None:
    """``(a·c + b) // (m·c) = a // m`` and ``(a·c + b) % (m·c) = (a % m)·c + b`` for ``0 ≤ b < c``: the index
    a reshape merges (``B·W·H``) split again by a larger step (timm's ``(B·W·H) // (W·H)``) reads the outer
    axes, as NumPy's integer division says at every point."""
    a, b = "a:12", f"b:{stride}"
    merged = t.ix_lin(t.ax(a), stride, t.ax(b))
    for m in (1, 2, 3, 6):
        divided, remainder = t.ix_div(merged, m * stride), t.ix_mod(merged, m * stride)
        assert divided == t.ix_div(t.ax(a), m)
        assert remainder == t.ix_lin(t.ix_mod(t.ax(a), m), stride, t.ax(b))
        axes = (a, b)
        shape = (12 * stride,)
        for index, expected in ((divided, lambda x, y: (x * stride + y) // (m * stride)),
                                (remainder, lambda x, y: (x * stride + y) % (m * stride))):  # fmt: skip
            got = _elements(t.access("x", (index,)), shape, axes)
            want = np.fromfunction(expected, (12, stride), dtype=int).astype(np.float64)
            assert np.array_equal(got, want)
