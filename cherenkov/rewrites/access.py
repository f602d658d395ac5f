"""Reads as strided index maps: the offset and per-axis strides an access term gives.

An access ``Tensor(name, [ix₀, ix₁, …])`` of a row-major stored tensor reads the element
at ``Σ_k ix_k · stride_k``. Where every index is affine in the kernel's axes — ``Ax``,
``IxLit``, ``IxAdd`` and ``IxLin`` (a reshape's ``outer·n + inner``) — the access is an
affine map: an element offset plus one stride per axis, which is what a kernel needs to
read the tensor in place (a cp.async row stride, a TMA descriptor's strides) instead of
having the view copied. Two non-affine index forms are kept as they are:

* ``IxDiv(Ax h, G)`` — a K/V head shared by ``G`` query heads (GQA, PyTorch's
  ``repeat_kv``): an *atom* with a stride of its own, which a flash kernel turns into its
  group size;
* ``IxLin(IxDiv(x, n), n, IxMod(x, n))``, a reshape undone, is ``x``.

Every index must stay inside its dimension for every value of the axes it names (interval
arithmetic over the axes' extents): a slice of a fused projection is an offset, never a
read past the slice.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from cherenkov.rewrites import terms as t
from cherenkov.rewrites.terms import Term

Atom = Term  # ("Ax", name) or ("IxDiv", ("Ax", name), group)


@dataclass(frozen=True)
class Affine:
    """``constant + Σ coefficient·atom`` over index atoms."""

    constant: int
    coefficients: Mapping[Atom, int]

    def scaled(self, factor: int) -> Affine:
        return Affine(self.constant * factor, {a: c * factor for a, c in self.coefficients.items()})

    def plus(self, other: Affine) -> Affine:
        merged = dict(self.coefficients)
        for atom, coefficient in other.coefficients.items():
            merged[atom] = merged.get(atom, 0) + coefficient
        return Affine(self.constant + other.constant, {a: c for a, c in merged.items() if c})

    def bounds(self) -> tuple[int, int]:
        """The smallest and largest value over every axis value."""
        low = high = self.constant
        for atom, coefficient in self.coefficients.items():
            top = atom_extent(atom) - 1
            low, high = low + min(0, coefficient * top), high + max(0, coefficient * top)
        return low, high


def atom_extent(atom: Atom) -> int:
    """How many values an atom takes: its axis's extent, divided by the group for a GQA head."""
    if atom[0] == "Ax":
        return t.extent(atom[1])
    return -(-t.extent(atom[1][1]) // atom[2])


def affine(ix: Term) -> Affine | None:
    """The index term as an affine form over atoms, or None."""
    head = ix[0]
    if head == "Ax":
        return Affine(0, {ix: 1})
    if head == "IxLit":
        return Affine(ix[1], {})
    if head == "IxAdd":
        inner = affine(ix[1])
        return None if inner is None else Affine(inner.constant + ix[2], dict(inner.coefficients))
    if head == "IxDiv" and ix[1][0] == "Ax":
        return Affine(0, {ix: 1})
    if head == "IxLin":
        outer, stride, inner = ix[1], ix[2], ix[3]
        if outer[0] == "IxDiv" and inner[0] == "IxMod" and outer[1] == inner[1] and outer[2] == inner[2] == stride:
            return affine(outer[1])
        parts = affine(outer), affine(inner)
        if parts[0] is None or parts[1] is None:
            return None
        return parts[0].scaled(stride).plus(parts[1])
    return None


@dataclass(frozen=True)
class StridedRead:
    """A read of a whole stored tensor's elements at ``offset + Σ strides[atom]·atom``."""

    tensor: str
    shape: tuple[int, ...]
    offset: int
    strides: Mapping[Atom, int]


def strided_read(access: Term, shape: tuple[int, ...]) -> StridedRead | None:
    """The strided form of ``Tensor(name, ixs)`` over a row-major tensor of ``shape``, or
    None when an index is not affine or may leave its dimension."""
    if access[0] != "Tensor":
        return None
    items = t.ix_items(access[2])
    if len(items) != len(shape):
        return None
    total = Affine(0, {})
    stride = 1
    for ix, size in reversed(list(zip(items, shape))):
        form = affine(ix)
        if form is None:
            return None
        low, high = form.bounds()
        if low < 0 or high >= size:
            return None
        total = total.plus(form.scaled(stride))
        stride *= size
    return StridedRead(access[1], tuple(shape), total.constant, dict(total.coefficients))
