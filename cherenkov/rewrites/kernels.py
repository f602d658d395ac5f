"""Fused kernels: partitioning an extracted term into kernels that each write one tensor.

Each kernel has one *core* — a fused form (flash attention, a softmax or norm row, a
contraction) or a plain reduction — wrapped in the elementwise work around it (its
epilogue) and fed by elementwise work on tensors it reads (its prologue). Elementwise
terms with no core form elementwise kernels. Where a core's operand holds another core,
that operand is materialised by an earlier kernel into an intermediate buffer, and the
consumer reads the buffer instead. Flash attention reads q, k and v in place wherever they
are affine views of stored tensors (:mod:`cherenkov.rewrites.access`: heads split from a
projection, slices of a fused QKV, a K/V head repeated for its query heads); a computed
operand (RoPE) is materialised first, over the K/V heads where it is shared by a group.
A flash kernel's output read through a view by one consumer (the merge of heads before the
output projection) is laid out for that consumer (:func:`laid_out_for_consumers`). A
contraction may also *absorb* the RMSNorm kernel that feeds it, and an elementwise kernel
may absorb the contraction that feeds it — RoPE run in the q/k projection's epilogue, its
rotate-half partner read as the projection's own value a few columns on (``Shifted``)
(:func:`absorbed`): the search weighs each such form against the two kernels.

``("Shifted", axis, delta, x)`` is the value of ``x`` with ``axis`` read ``delta`` further
on (:func:`~cherenkov.rewrites.terms.shifted`); it appears only in absorbed kernels, where
a GEMM's epilogue finds it among its own accumulators.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Iterator, Mapping, Sequence, Set
from dataclasses import dataclass, field, replace

import numpy as np

from cherenkov.rewrites import dag
from cherenkov.rewrites import terms as t
from cherenkov.rewrites.access import StridedRead, strided_read
from cherenkov.rewrites.language import EXPR_CONSTRUCTORS
from cherenkov.rewrites.lower import Lowered
from cherenkov.rewrites.masks import sliding_window, stored_bias, window_parts, with_stored_bias
from cherenkov.graph.shape import SCALE_DTYPES
from cherenkov.rewrites.plan import (
    BIAS_DTYPES,
    AttentionBias,
    AttentionProblem,
    BlockScales,
    LseOutput,
    OperandLayout,
    ScaleFactor,
)
from cherenkov.rewrites.reference import axis_names as reference_axis_names
from cherenkov.rewrites.reference import evaluate_term
from cherenkov.rewrites.terms import Term

ELEMENTWISE = frozenset(
    {
        "Tensor", "Num", "Flag", "Iota", "Cast", "Exp2", "Exp", "Log2", "Sin", "Sqrt", "Recip", "Neg",
        "Add", "Mul", "Mod", "Lt", "Maximum", "Where", "PadAxis", "Shifted",
    }
)  # fmt: skip

KIND_OF_CORE = {
    "FlashAttention": "flash_attention",
    "FlashAttentionScaled": "flash_attention",
    "FlashAttentionGradQ": "flash_attention_backward",
    "FlashAttentionGradK": "flash_attention_backward",
    "FlashAttentionGradV": "flash_attention_backward",
    "FlashAttentionGradKGroup": "flash_attention_backward",
    "FlashAttentionGradVGroup": "flash_attention_backward",
    "AttentionLse": "attention_lse",
    "SoftmaxRow": "softmax_rows",
    "RmsNormRow": "rms_norm_rows",
    "LayerNormRow": "layer_norm_rows",
    "Contract": "contraction",
    "OnlineSoftmaxContract": "reduction",
    "SoftmaxFoldL": "reduction",
    "SoftmaxFoldAcc": "reduction",
    "Sum": "reduction",
    "Max": "reduction",
}


# Which core a kernel keeps when an elementwise region holds several (the rest are stored).
CORE_PRIORITY = (
    "FlashAttention", "FlashAttentionScaled", "FlashAttentionGradQ", "FlashAttentionGradK", "FlashAttentionGradV", "FlashAttentionGradKGroup",
    "FlashAttentionGradVGroup", "AttentionLse", "Contract", "LayerNormRow", "RmsNormRow", "SoftmaxRow",
    "OnlineSoftmaxContract", "SoftmaxFoldAcc", "SoftmaxFoldL", "Sum", "Max",
)  # fmt: skip


def _core_head(core: Term) -> str:
    return core[1][0] if core[0] == "Scheduled" else core[0]


FLASH_FORWARD = frozenset({"FlashAttention", "FlashAttentionScaled"})
ROW_FORMS = frozenset({"SoftmaxRow", "RmsNormRow", "LayerNormRow"})


def _row_widened(term: Term) -> tuple[str, str, Term] | None:
    """Where ``term`` holds a row form whose row is longer than its free axis (a softmax over scores
    with a column appended, read without it): that axis, a name of the row's own extent, and
    ``term`` over that name; else None."""
    for sub in t.subterms(term):
        if sub[0] in ROW_FORMS and t.extent(sub[1]) != sub[2]:
            axis, wide = sub[1], f"{sub[1].split(':')[0]}w:{sub[2]}"
            row = t.rename_free_axis(sub, axis, wide)
            return axis, wide, t.replace(t.rename_free_axis(term, axis, wide), row, (row[0], wide, *row[2:]))
    return None


Guard = tuple[str, int, int]
"""A guard over a term: ``(axis, start, size)``, the axis's range where the guarded value is used."""


def _narrowing_guard(term: Term, core: Term) -> Guard | None:
    """:func:`_pad_guard` of ``core`` in ``term`` where it narrows an axis ``core`` varies along, else None."""
    guard = _pad_guard(term, core)
    if guard is None or guard[0] not in t.free_axes(core) or guard[2] >= t.extent(guard[0]):
        return None
    return guard


def _guards_above(term: Term, targets: Set[Term], edges: bool = True) -> Iterator[tuple[Term, tuple[Guard, ...]]]:
    """Each place a node of ``targets`` is read in ``term``, with the guards ``(axis, start, size)`` (a plain
    axis) it lies under: a ``PadAxis`` guards its operand; with ``edges``, ``where(a < n, x, y)`` guards ``x`` by
    ``(a, 0, n)`` (an appended column's where). A node reached twice under the same guards is given once."""
    seen: set[tuple[Term, tuple[Guard, ...]]] = set()
    stack: list[tuple[Term, tuple[Guard, ...]]] = [(term, ())]
    while stack:
        node, guards = stack.pop()
        if (node, guards) in seen:
            continue
        seen.add((node, guards))
        if node in targets:
            yield node, guards
            continue
        if node[0] == "PadAxis" and node[1][0] == "Ax":
            stack.append((node[5], (*guards, (node[1][1], node[2], node[3]))))
            continue
        edge = _iota_edge(node[1]) if edges and node[0] == "Where" else None
        if edge is not None:
            stack += [(node[1], guards), (node[2], (*guards, (edge[0], 0, edge[1]))), (node[3], guards)]
            continue
        stack.extend((child, guards) for child in t.children(node))


def _pad_guard(term: Term, sub: Term) -> Guard | None:
    """The guard that every read of ``sub`` in ``term`` lies under (:func:`_guards_above`), or None: where no
    one guard is common to them all."""
    common: set[Guard] | None = None
    for _, guards in _guards_above(term, {sub}):
        common = set(guards) if common is None else common & set(guards)
    return min(common) if common else None


def _iota_edge(condition: Term) -> tuple[str, int] | None:
    """``(a, n)`` for the condition ``a < n`` (an axis below a whole number), else None."""
    if condition[0] != "Lt" or condition[1][0] != "Iota" or condition[1][1][0] != "Ax" or condition[2][0] != "Num":
        return None
    edge = condition[2][1]
    return (condition[1][1][1], int(edge)) if float(edge).is_integer() and edge >= 0 else None


def _uncast(term: Term) -> Term:
    """``term`` without the casts around it (a kernel's store rounds to its output's dtype)."""
    while term[0] == "Cast":
        term = term[2]
    return term


PAD_AXIS = ""  # a buffer axis of extent 1 that the stored term does not vary along

# Term positions of each backward form's tensor operands and mask (see the constructors).
GRADIENT_OPERANDS = {
    "FlashAttentionGradQ": (7, 8, 9, 10, 12, 13),
    "FlashAttentionGradK": (9, 10, 11, 12, 14, 15),
    "FlashAttentionGradV": (7, 8, 10, 11),
    "FlashAttentionGradKGroup": (11, 12, 13, 14, 16, 17),
    "FlashAttentionGradVGroup": (9, 10, 12, 13),
}


class KernelError(ValueError):
    """A fused form that no kernel of this kind can run (wrong layout, unsupported size)."""


@dataclass(frozen=True)
class BufferLayout:
    """How a kernel's output lies in its buffer when not row-major over the kernel's axes:
    the buffer's ``shape`` and the element stride of each axis (a producer that writes in
    the order its one consumer reads, e.g. attention's output as ``B, S, H·D``)."""

    shape: tuple[int, ...]
    strides: tuple[int, ...]


@dataclass(frozen=True)
class SideOutput:
    """A further buffer one kernel writes: ``term`` over ``axes``, row-major (the other
    gradients of an attention backward, which shares its work among them)."""

    output: str
    term: Term
    axes: tuple[str, ...]
    dtype: str = ""
    """The buffer's dtype (empty: as its tensor is stored), as :attr:`FusedKernel.dtype`."""

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(t.extent(a) for a in self.axes)


@dataclass(frozen=True)
class FusedKernel:
    """One kernel: computes ``term`` over ``axes`` and writes it to the buffer ``output``
    (row-major over ``axes``, or as ``buffer`` says), and each of ``side_outputs`` to its own."""

    kind: str
    term: Term
    output: str
    axes: tuple[str, ...]
    reads: tuple[str, ...]
    source: Term | None = field(default=None, compare=False)  # the core as extracted
    trace: tuple[str, ...] = field(default=(), compare=False)
    buffer: BufferLayout | None = None
    side_outputs: tuple[SideOutput, ...] = ()
    dtype: str = ""
    """The output's dtype where the partition fixes it (a flash kernel's computed bias: fp32, its
    full precision); empty: the derivation's buffer dtype."""

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(t.extent(a) for a in self.axes)

    @property
    def outputs(self) -> tuple[str, ...]:
        """Every buffer the kernel writes: ``output``, then the side outputs."""
        return (self.output, *(side.output for side in self.side_outputs))

    def evaluate_outputs(self, buffers: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Every buffer the kernel writes, by name, in float64 (see :meth:`evaluate`)."""
        values = {self.output: self.evaluate(buffers)}
        for side in self.side_outputs:
            extents = {a: t.extent(a) for a in side.axes}
            values[side.output] = evaluate_term(side.term, {n: buffers[n] for n in self.reads}, side.axes, extents)
        return values

    @property
    def stored_shape(self) -> tuple[int, ...]:
        """The shape of the output buffer as consumers read it."""
        return self.buffer.shape if self.buffer is not None else self.shape

    @property
    def core(self) -> Term | None:
        """The fused form or reduction at the heart of the kernel (None if elementwise)."""
        cores = _by_priority(_cores(self.term))
        return cores[0] if cores else None

    def evaluate(self, buffers: Mapping[str, np.ndarray]) -> np.ndarray:
        """The kernel's output buffer in float64, computed the way its fused form streams."""
        extents = {a: t.extent(a) for a in self.axes}
        values = evaluate_term(self.term, {n: buffers[n] for n in self.reads}, self.axes, extents)
        if self.buffer is None:
            return values
        stored = np.zeros(self.buffer.shape)
        view = np.lib.stride_tricks.as_strided(stored, self.shape, tuple(8 * s for s in self.buffer.strides))
        view[...] = values
        return stored

    def describe(self) -> str:
        return f"{self.kind} -> {self.output}{list(self.shape)}: {t.show(self.term)}"


def _cores(term: Term) -> list[Term]:
    """Maximal non-elementwise subterms reachable through elementwise constructors."""
    found: list[Term] = []
    stack = [term]
    seen: set[Term] = set()
    while stack:
        current = stack.pop()
        if current in seen or current[0] in ("Ax", "IxLit", "IxAdd", "IxDiv", "IxMod", "IxLin", "ICons", "INil"):
            continue
        seen.add(current)
        if current[0] == "Scheduled":
            stack.append(current[1])
        elif current[0] in ELEMENTWISE:
            stack.extend(t.children(current))
        else:
            found.append(current)
    return found


def _by_priority(cores: list[Term]) -> list[Term]:
    """``cores`` in ``CORE_PRIORITY`` order (the kernel keeps the first)."""
    return sorted(cores, key=lambda c: CORE_PRIORITY.index(_core_head(c)))


def _reads(term: Term) -> tuple[str, ...]:
    return tuple(sorted({s[1] for s in t.subterms(term) if s[0] == "Tensor"}))


def _kv_head_split(operand: Term, batch: set[str]) -> tuple[str, Term, str] | None:
    """``(h, h // G, fresh axis)`` when a k/v operand varies along the query-head axis ``h``
    only through ``h // G`` (a K/V head repeated for G query heads), else None: then the
    operand is materialised over the ``H / G`` K/V heads, not repeated for every query head."""
    divided = {s for s in t.subterms(operand) if s[0] == "IxDiv" and s[1][0] == "Ax" and s[1][1] in batch}
    if len(divided) != 1:
        return None
    (split,) = divided
    head, group = split[1][1], split[2]
    fresh = f"{head.rsplit(':', 1)[0]}_kv{group}:{-(-t.extent(head) // group)}"
    if head in t.free_axes(t.replace(operand, split, t.ax(fresh))):
        return None
    return head, split, fresh


def _axis_order(axes: frozenset[str], output_axes: tuple[str, ...]) -> tuple[str, ...]:
    """Output axes first, in output order, then the rest by name."""
    return tuple(a for a in output_axes if a in axes) + tuple(sorted(axes - set(output_axes)))


def _up_to_axis_names(term: Term, axes: tuple[str, ...]) -> tuple[Term, tuple[str, ...]]:
    """``term`` over ``axes`` with each free axis named by its position (``#0:64``, ...): equal for
    two terms that compute the same buffer whatever their binders call its axes."""
    names = {a: f"#{i}:{t.extent(a)}" for i, a in enumerate(axes) if a != PAD_AXIS}
    return t.substitute_axes(term, {a: t.ax(n) for a, n in names.items()}), tuple(names.get(a, a) for a in axes)


COMPUTED_BIAS_DTYPE = "fp32"
"""The dtype of a buffer an attention's computed bias is stored in: its full precision (ALiBi's slope
times a key position of thousands would lose its last units in 16 bits). A bias that only reads
stored values (a relative-position table gathered through a computed index, a rounding of one) is
stored in the buffer dtype, which holds them exactly."""


EXPR_HEADS = frozenset(c.name for c in EXPR_CONSTRUCTORS)


def bias_buffer_dtype(bias: Term) -> str:
    """The dtype a materialised bias is stored in (empty: the buffer dtype): ``COMPUTED_BIAS_DTYPE``
    where it computes anything but reads and casts of stored tensors."""
    computes = any(s[0] in EXPR_HEADS and s[0] not in ("Tensor", "Cast") for s in t.subterms(bias))
    return COMPUTED_BIAS_DTYPE if computes else ""


def _operand_head_axes() -> dict[str, dict[int, int]]:
    """For each backward form, the term position of each of its q, k, v and dO operands, mapped to
    the position of the axis it is contracted over (q and k: the head dim d; v and dO: theirs): the
    binders that scope over exactly two of a form's tensor operands."""
    axes: dict[str, dict[int, int]] = {}
    for constructor in EXPR_CONSTRUCTORS:
        if constructor.name in GRADIENT_OPERANDS:
            axes[constructor.name] = {operand + 1: axis + 1 for axis, operands in constructor.binds
                                      if len(operands) == 2 for operand in operands}  # fmt: skip
    return axes


OPERAND_HEAD_AXES = _operand_head_axes()
"""Backward form -> {operand's term position: its head axis's term position}."""


def gradient_tensors(core: Term) -> tuple[Term, ...]:
    """A backward form's tensor operands (q, k, v, dO, the operand read again): its masks left out."""
    operands = (core[p] for p in GRADIENT_OPERANDS[core[0]])
    return tuple(operand for operand in operands if operand[0] not in (*t.MASK_HEADS, "SoftcapMask"))


class _Partition:
    def __init__(self, lowered: Lowered) -> None:
        self.lowered = lowered
        self.kernels: list[FusedKernel] = []
        self.buffers: dict[tuple[Term, tuple[str, ...]], str] = {}  # materialised term, up to axis names -> its buffer
        self.taken = set(lowered.input_shapes) | set(lowered.roots)
        self.output_axes: tuple[str, ...] = ()

    def fresh_buffer(self) -> str:
        n = len(self.kernels)
        while f"t{n}" in self.taken:
            n += 1
        self.taken.add(f"t{n}")
        return f"t{n}"

    def materialise(self, term: Term, axes: tuple[str, ...] | None = None, dtype: str = "",
                    origin: Term | None = None) -> Term:  # fmt: skip
        """Compute ``term`` in its own kernel (its buffer in ``dtype``, empty: the buffer dtype);
        return the access that reads its buffer. ``origin``: the extracted core ``term`` renames
        (the kernel's :attr:`FusedKernel.source`, what the schedules of its form are keyed by).

        Axes of extent 1 (``PAD_AXIS``) pad the buffer's rank; reads index them with 0. A term
        materialised before under other names of its axes (a flash kernel and its log-sum-exp
        kernel name the head dim of the same RoPE'd q apart) reads the same buffer."""
        widened = _row_widened(term)
        if widened is not None:  # stored over the whole row, read over the axis's first entries
            axis, wide, term = widened
            access = self.materialise(term, tuple(wide if a == axis else a for a in axes) if axes else None, dtype)
            return t.substitute_axes(access, {wide: t.ax(axis)})
        if axes is None:
            axes = _axis_order(t.free_axes(term), self.output_axes)
        key = _up_to_axis_names(term, axes)
        if key not in self.buffers:
            self.buffers[key] = self.fresh_buffer()
            self.emit(term, self.buffers[key], tuple(f"u{i}:1" if a == PAD_AXIS else a for i, a in enumerate(axes)), dtype,
                      origin)  # fmt: skip
        return t.access(self.buffers[key], (t.ix_lit(0) if a == PAD_AXIS else t.ax(a) for a in axes))

    def materialise_guarded(self, core: Term, term: Term, dtype: str = "") -> Term:
        """:meth:`materialise` of a core of ``term``; where ``term`` reads it only under a guard that
        narrows one of its axes (:func:`_pad_guard`: a concatenation's piece, ``pad(x, (0, 32))`` along
        64; an appended column's ``where(j < n, x, y)``), it is stored over the guarded range alone, the axis renamed to one of that extent (and shifted by
        the guard's start), and read back at the guarded axis: its operands are then read over the
        range they hold, not past it."""
        guard = _narrowing_guard(term, core)
        if guard is None:
            return self.materialise(core, dtype=dtype)
        axis, start, size = guard
        narrow = next(name for k in itertools.count() if (name := f"{axis.split(':')[0]}p{k}:{size}")
                      not in t.axis_names(term))  # fmt: skip
        axes = tuple(narrow if a == axis else a for a in _axis_order(t.free_axes(core), self.output_axes))
        shifted = t.rename_free_axis(core, axis, narrow)
        if start:
            shifted = t.substitute_axes(shifted, {narrow: t.ix_add(t.ax(narrow), start)})
        access = self.materialise(shifted, axes, dtype, origin=core)
        return t.substitute_axes(access, {narrow: t.ix_add(t.ax(axis), -start)})

    def emit(self, term: Term, output: str, axes: tuple[str, ...], dtype: str = "", origin: Term | None = None) -> None:
        """Add the kernel(s) computing ``term`` into ``output``: the most valuable core
        stays in this kernel, every other core is materialised by an earlier one. A backward
        form does not stay under elementwise work (a backward kernel writes gradients only): the
        gradients of q, k and v stacked by pads (``torch.unbind``'s) are each their own buffer,
        and this kernel stacks them."""
        cores = _by_priority(_cores(term))
        stacked = bool(cores) and cores[0][0] in GRADIENT_OPERANDS and cores[0] != term
        # the flash kernels write their output as it is: elementwise work after one (an attention
        # sink's factor, which reads the kernel's own log-sum-exp) is a kernel of its own
        stacked |= bool(cores) and _core_head(cores[0]) in FLASH_FORWARD and _uncast(term) != cores[0]
        # a core read only below a guard's edge (a concatenation's piece, a row's appended column) is stored over
        # the guarded range: computed here over the whole axis, it would read its operands past their ends
        stacked |= bool(cores) and cores[0] != term and _narrowing_guard(term, cores[0]) is not None
        primary = None if stacked or not cores else cores[0]
        source = origin if origin is not None and primary is not None else primary
        extras = list(cores) if stacked else cores[1:]
        while extras:
            extra = extras.pop(0)
            # a flash kernel writes its rows' log-sum-exp in fp32 (an attention sink's factor reads it)
            access = self.materialise_guarded(extra, term, dtype="fp32" if extra[0] == "AttentionLse" else "")
            # a core nested in a later one (a contraction inside a sum) is read from its buffer there too
            term = t.replace(term, extra, access)
            primary = t.replace(primary, extra, access) if primary is not None else None
            extras = [t.replace(other, extra, access) for other in extras]
        if primary is not None and primary[0] in GRADIENT_OPERANDS and not dtype:
            half = self.half_dtype(gradient_tensors(primary), all_fp32=True)
            if half and self.lowered.root_dtypes.get(output) == "fp32":  # the kernels write 16-bit gradients
                term = t.replace(term, primary, self.materialise(primary, axes, dtype=half))
                primary = None
        if primary is not None:
            term = t.replace(term, primary, self.prepare(primary))
        kind = KIND_OF_CORE[_core_head(primary)] if primary is not None else "elementwise"
        self.kernels.append(FusedKernel(kind, term, output, axes, _reads(term), source, dtype=dtype))

    def prepare(self, core: Term) -> Term:
        """The core with each operand it cannot fuse replaced by a buffer access (its bound axes
        named by the counts they bind: :func:`~cherenkov.rewrites.terms.binders_named_by_count`)."""
        core = t.binders_named_by_count(core)
        head = core[0]
        if head == "Scheduled":
            return self.prepare(core[1])
        if head in ("FlashAttention", "FlashAttentionScaled"):
            return self.prepare_flash(core)
        if head in GRADIENT_OPERANDS:
            return self.prepare_flash_gradient(core)
        if head == "AttentionLse":  # q and k as flash attention reads them
            prepared = self.prepare_flash(lse_as_flash(core), statistics=True)
            return ("AttentionLse", *prepared[1:7], *prepared[8:10])
        operands = [i for i, a in enumerate(core[1:], start=1) if isinstance(a, tuple) and a[0] not in ("Ax",)]
        result = list(core)
        for position in operands:
            operand = core[position]
            nested = _cores(operand)
            if head == "Contract" and _stored_whole(operand, nested):
                result[position] = self.materialise(operand)
                continue
            for inner in nested:
                operand = t.replace(operand, inner, self.materialise_guarded(inner, operand))
            result[position] = operand
        return tuple(result)

    def prepare_flash(self, core: Term, statistics: bool = False) -> Term:
        """Flash attention reads q, k and v in place where they are affine views of stored
        tensors (:func:`~cherenkov.rewrites.access.strided_read`: transposes, head splits,
        slices of a fused projection, repeated K/V heads); anything else feeding them (a
        computation such as RoPE) is materialised in BHSD order — k and v over their K/V
        heads where they vary along the query head only as ``h // G``. An operand stored in fp32
        beside 16-bit ones is rounded into a 16-bit copy (:meth:`half_dtype`;
        ``statistics``: the core is a log-sum-exp's, its operand along the keys k again). A bias
        that is no affine view is materialised over its own axes, the key axis last."""
        core = canonical_flash(core)
        key, _, dim, _, q, k, v = core[1:8]
        batch = (t.free_axes(q) & t.free_axes(k)) - {dim, key}
        query = t.free_axes(q) - batch - {dim}
        values = t.free_axes(v) - batch - {key}
        order = functools.partial(_axis_order, output_axes=self.output_axes)
        # B and H of extent 1 have no name: pad the leading axes back to BHSD rank
        leading = (PAD_AXIS,) * max(0, 2 - len(batch)) + order(frozenset(batch))
        layouts = {
            5: (leading + order(frozenset(query)) + (dim,), q),
            6: (leading + (key, dim), k),
            7: (leading + (key,) + order(frozenset(values)), v),
        }
        cap, mask = t.soft_capped(core[9])
        bias = stored_bias(mask)  # a window: the kernel's own key range
        rounded = self.half_dtype((q, k) if statistics else (q, k, v), all_fp32=statistics)
        if bias is not None and not self.readable_along_axes(bias):
            axes = t.free_axes(bias)
            layouts[9] = (order(frozenset(axes - {key})) + ((key,) if key in axes else ()), bias)
        result = list(core)
        for position, (layout, operand) in layouts.items():
            if rounded and position < 8 and self.stored_dtype(operand) == "fp32":
                # an fp32 operand beside 16-bit ones (q and k after an fp32 rotary embedding): the
                # tensor cores round it anyway (rule contract-rounded-operand), so a copy rounds it first
                result[position] = self.rounded_copy(operand, rounded, layout[-1])
                continue
            # an 8-bit q or k times its MX scales is read in place too (the block-scaled mma)
            readable = self.readable_along_axes(operand) if position == 9 else (
                self.readable_in_place(operand) and self.steps_batch_as_one(operand, leading))
            if readable or (position < 7 and self.block_scaled_in_place(operand)):
                continue
            if position == 9:  # a computed bias, or one read through a computed index: stored over its axes, key last
                buffer = self.materialise(operand, layout, dtype=bias_buffer_dtype(operand))
                result[position] = t.with_soft_cap(cap, with_stored_bias(mask, buffer))
                continue
            split = _kv_head_split(operand, batch) if position > 5 else None
            if split is None:
                result[position] = self.materialise(operand, layout)
                continue
            head, divided, fresh = split
            per_kv_head = t.replace(operand, divided, t.ax(fresh))
            buffer = self.materialise(per_kv_head, tuple(fresh if a == head else a for a in layout))
            result[position] = t.replace(buffer, t.ax(fresh), divided)
        for position in range(10, len(core)):  # a scaled form's factors: products of stored reads
            factor = core[position]
            if not all(leaf[0] == "Num" or self.readable_in_place(leaf) for leaf in factor_leaves(factor)):
                result[position] = self.materialise(factor, order(t.free_axes(factor)))
        return tuple(result)

    def prepare_flash_gradient(self, core: Term) -> Term:
        """A backward form's tensor operands (q, k, v, dO, the operand read again, a bias) as
        reads of stored tensors: each that is not an affine view of one is materialised, and one
        stored in fp32 beside 16-bit ones (or, all in fp32, in a 16-bit graph) rounded into a
        16-bit copy with its head dim last, as :meth:`prepare_flash` does."""
        result = list(core)
        rounded = self.half_dtype(gradient_tensors(core), all_fp32=True)
        heads = OPERAND_HEAD_AXES[core[0]]
        for position in GRADIENT_OPERANDS[core[0]]:
            operand = core[position]
            if rounded and self.stored_dtype(operand) == "fp32":
                head = heads.get(position)
                result[position] = self.rounded_copy(operand, rounded, None if head is None else core[head])
            elif operand[0] in t.MASK_HEADS or operand[0] == "SoftcapMask":
                cap, mask = t.soft_capped(operand)
                bias = stored_bias(mask)
                if bias is not None and not self.readable_along_axes(bias):
                    buffer = self.materialise(bias, dtype=bias_buffer_dtype(bias))
                    result[position] = t.with_soft_cap(cap, with_stored_bias(mask, buffer))
            elif not self.readable_in_place(operand):
                result[position] = self.materialise(operand)
        return tuple(result)

    def stored_dtype(self, operand: Term) -> str:
        """The dtype a read's tensor is stored in (an input's, a root's), or "" for a computed operand."""
        if not self.readable_in_place(operand):
            return ""
        return self.lowered.stored_dtype(operand[1])

    def rounded_copy(self, operand: Term, dtype: str, innermost: str | None = None) -> Term:
        """``operand``, a read of a stored tensor, reading a ``dtype`` copy of the whole tensor (its
        shape, row-major) at the same indices: every form that reads the tensor, however it indexes
        it (a grouped gradient's query heads as K/V head and group), reads the one copy. Where the
        tensor stores the axis that ``operand`` reads by ``innermost`` (a head dim) elsewhere than
        last, the copy stores it last, the kernels reading a head dim contiguous (CUDA's math SDPA
        keeps kᵀ, scaled in fp32, for its backward)."""
        shape = self.stored_shapes()[operand[1]]
        reads = t.ix_items(operand[2])
        order = list(range(len(shape)))
        inner = [p for p, ix in enumerate(reads) if innermost is not None and ix == t.ax(innermost)]
        if len(inner) == 1 and inner[0] != len(shape) - 1:
            order = [p for p in order if p != inner[0]] + inner
        axes = tuple(f"i{p}:{shape[p]}" for p in range(len(shape)))
        copy = self.materialise(t.access(operand[1], (t.ax(a) for a in axes)), tuple(axes[p] for p in order),
                                dtype=dtype)  # fmt: skip
        return ("Tensor", copy[1], t.ix_list(reads[p] for p in order))

    def half_dtype(self, operands: tuple[Term, ...], all_fp32: bool = False) -> str:
        """The 16-bit dtype of attention operands (stored, or computed into the buffer dtype) beside
        which any stored in fp32 are rounded, the tensor cores rounding them anyway (rule
        ``contract-rounded-operand``), and gradients the graph keeps in fp32 widened: the one they
        have; where every one is in fp32 (``all_fp32``: a log-sum-exp's q and k, as the flash kernel
        that writes it as a side output rounds them; a backward form's, as CUDA's math SDPA keeps
        them for dv), the buffer dtype where it is 16-bit. Else ""."""
        stored = {self.stored_dtype(operand) or self.lowered.buffer_dtype for operand in operands}
        halves = stored & {"bf16", "fp16"}
        if all_fp32 and stored == {"fp32"} and self.lowered.buffer_dtype in ("bf16", "fp16"):
            return self.lowered.buffer_dtype
        return halves.pop() if len(halves) == 1 and stored <= halves | {"fp32"} else ""

    def block_scaled_in_place(self, operand: Term) -> bool:
        """Whether ``operand`` is a stored tensor read times a read of an input's MX scales (``e8m0``)."""
        dtypes = self.lowered.input_dtypes
        return (operand[0] == "Mul" and all(self.readable_in_place(leaf) for leaf in operand[1:])
                and any(leaf[1] in dtypes and dtypes[leaf[1]] in SCALE_DTYPES for leaf in operand[1:]))  # fmt: skip

    def stored_read(self, operand: Term) -> StridedRead | None:
        """``operand`` as a strided read of a stored tensor (input or buffer), or None."""
        if operand[0] != "Tensor":
            return None
        shape = self.stored_shapes().get(operand[1])
        return None if shape is None else strided_read(operand, shape)

    def readable_in_place(self, operand: Term) -> bool:
        """Whether ``operand`` is an affine view of a stored tensor (input or buffer)."""
        return self.stored_read(operand) is not None

    def steps_batch_as_one(self, operand: Term, leading: tuple[str, ...]) -> bool:
        """Whether a read of a stored tensor steps an attention's batch-like axes past two (``leading``,
        outermost first, the head last) as one batch axis, as the kernels read them
        (:func:`attention_problem`): each one's stride the next one's times its extent, the head aside.
        Hiera's k, read with its mask units inside the key axis, does not, and is stored in order."""
        if len(leading) <= 2:
            return True
        strides = self.stored_read(operand).strides
        return all(_read_as_one(strides, outer, inner) for outer, inner in zip(leading[:-2], leading[1:-1]))

    def readable_along_axes(self, operand: Term) -> bool:
        """Whether ``operand`` is an affine view of a stored tensor varying along whole axes only (a bias
        stored per K/V head and read at ``h // G`` is not: the kernels step a bias by the query head)."""
        read = self.stored_read(operand)
        return read is not None and all(atom[0] == "Ax" for atom in read.strides)

    def stored_shapes(self) -> dict[str, tuple[int, ...]]:
        """Shapes of the tensors kernels may read so far: inputs, roots and buffers."""
        shapes = {name: tuple(shape) for name, shape in self.lowered.input_shapes.items()}
        shapes.update((name, tuple(self.lowered.shape(name))) for name in self.lowered.roots)
        shapes.update((k.output, k.shape) for k in self.kernels)
        return shapes


def _stored_whole(operand: Term, nested: list[Term]) -> bool:
    """Whether a contraction operand that holds other cores is better stored whole.

    A contraction re-reads each operand element once per output tile, so elementwise work
    around a stored core (a bias and GELU, a norm's weight) runs once in the producer's
    epilogue instead of once per tile in this kernel's prologue — as long as storing the
    whole operand writes no more than storing the cores would (no broadcast axes added)."""
    if not nested or operand in nested:
        return False
    return t.free_axes(operand) == frozenset().union(*(t.free_axes(core) for core in nested))


INDEX_HEADS = frozenset({"Ax", "IxLit", "IxAdd", "IxDiv", "IxMod", "IxLin", "ICons", "INil"})


def _elements(axes: frozenset[str]) -> int:
    return int(np.prod([t.extent(a) for a in axes], dtype=np.int64)) if axes else 1


def _reads_at_least_two(term: Term, axes_memo: dict[Term, frozenset[str]], stored: Set[Term] = frozenset()) -> bool:
    """Whether ``term``'s elementwise closure reads two or more stored tensors, cores or ``stored``
    values, none of them over more elements than ``term`` itself has (storing it adds no broadcast)."""
    size = _elements(t.free_axes(term, axes_memo))
    reads, stack, seen = set(), [term], set()
    while stack:
        node = stack.pop()
        if node in seen or node[0] in INDEX_HEADS:
            continue
        seen.add(node)
        if node[0] == "Tensor" or node[0] not in ELEMENTWISE or (node in stored and node != term):
            if _elements(t.free_axes(node, axes_memo)) > size:
                return False
            reads.add(node[1] if node[0] == "Tensor" else node)
        else:
            stack.extend(t.children(node))
    return len(reads) >= 2


def shared_values(extracted: Mapping[str, Term]) -> list[tuple[Term, str]]:
    """Elementwise values that two or more kernels would each recompute, parents first, each
    with the first root (in ``extracted``'s order) whose term holds it.

    A kernel inlines the elementwise work that feeds its core, so a value read by several
    kernels is recomputed by each — and a residual stream ``h_k = h_{k-1} + f_k(h_{k-1})``
    inlined into every later norm makes layer ``k``'s norm re-read all ``k`` earlier
    terms. Such a value is stored once instead when it reads two or more tensors (a single
    read recomputes for free). A kernel here is a core's operands or a root; walking the
    terms parents first, a node's *owners* are the kernels that reach it through
    elementwise constructors, a value chosen to be stored owning what is beneath it.

    A stored value's own steps are then shared too (a GELU stored for the forward, whose erf
    polynomial's every step the backward reads again), each reading the GEMM and bias beneath:
    so the values chosen are revisited children first, and a value that reads only one thing
    once the values kept beneath it count as reads is recomputed, not stored."""
    order: list[Term] = []  # children before parents
    first_root: dict[Term, str] = {}  # node -> the first root reaching it (visited)
    for name, root in extracted.items():
        stack: list[tuple[Term, bool]] = [(root, False)]
        while stack:
            node, done = stack.pop()
            if done:
                order.append(node)
                continue
            if node in first_root or node[0] in INDEX_HEADS:
                continue
            first_root[node] = name
            stack.append((node, True))
            stack.extend((c, False) for c in t.children(node))
    owners: dict[Term, set] = {}
    for name, root in extracted.items():
        owners.setdefault(root, set()).add(name)
    roots = set(extracted.values())
    axes_memo: dict[Term, frozenset[str]] = {}
    chosen: list[tuple[Term, str]] = []
    for node in reversed(order):  # parents first
        mine = owners.get(node, set())
        is_value = node[0] in ELEMENTWISE and node[0] != "Tensor" and any(True for _ in t.children(node))
        stored = is_value and len(mine) >= 2 and node not in roots and _reads_at_least_two(node, axes_memo)
        if stored:
            chosen.append((node, first_root[node]))
        boundary = stored or not is_value  # a core, a stored value: the kernel owning what is beneath
        # a flash form and the log-sum-exp of its scores are one kernel (:func:`joined_statistics`)
        owner = _scores_key(node) if node[0] in ("FlashAttention", "AttentionLse") else node
        for child in t.children(node):
            if child[0] not in INDEX_HEADS:
                owners.setdefault(child, set()).update({owner} if boundary else mine)
    kept: set[Term] = set()
    for node, _ in reversed(chosen):  # children first
        if _reads_at_least_two(node, axes_memo, kept):
            kept.add(node)
    return [(node, root) for node, root in chosen if node in kept]


def _replaced(term: Term, mapping: Mapping[Term, Term], memo: dict[Term, Term]) -> Term:
    """``term`` with each subterm in ``mapping`` replaced (outermost first)."""
    if term in mapping:
        return mapping[term]
    if term in memo:
        return memo[term]
    result = term
    if any(isinstance(a, tuple) for a in term[1:]):
        result = tuple(_replaced(a, mapping, memo) if isinstance(a, tuple) else a for a in term)
    memo[term] = result
    return result


def partition(extracted: Mapping[str, Term], lowered: Lowered) -> list[FusedKernel]:
    """Kernels (in execution order) computing every output of an extracted graph; the
    :func:`shared_values` first, each by a kernel of its own (a contraction's epilogue where
    one feeds it)."""
    plan = _Partition(lowered)
    shared: dict[str, list[Term]] = {}  # by the first root holding them, children first
    for value, root in reversed(shared_values(extracted)):
        shared.setdefault(root, []).append(value)
    stored: dict[Term, Term] = {}
    memo: dict[Term, Term] = {}
    for name, term in extracted.items():  # roots in order: each reads only earlier ones
        plan.output_axes = lowered.root_axes[name]
        for value in shared.get(name, ()):
            stored[value] = plan.materialise(_replaced(value, stored, {}))
        plan.emit(_replaced(term, stored, memo), name, lowered.root_axes[name])
    return laid_out_for_consumers(plan.kernels, frozenset(lowered.outputs))


# ------------------------------------------------------------------ a flash kernel's log-sum-exp


def scale_key(scale: float) -> float:
    """An attention's scale as its kernels compare it: to 13 significant digits (its spellings differ
    in the last bits where a rule folded log2 e into it and out again)."""
    return float(f"{scale:.13g}")


def _scores_key(form: Term) -> tuple:
    """What a ``FlashAttention`` or ``AttentionLse`` form's scores are, whatever its binders call the
    key and head axes: the q and k reads (either order), the scale and the mask."""
    key, _, dim, _ = form[1:5]
    q, k = form[5], form[6]
    scale, mask = (form[8], form[9]) if form[0] == "FlashAttention" else (form[7], form[8])

    def renamed(term: Term) -> Term:
        return t.replace(t.replace(term, t.ax(key), t.ax("#key")), t.ax(dim), t.ax("#dim"))

    return frozenset((renamed(q), renamed(k))), scale_key(scale), renamed(mask)


def joined_statistics(kernels: list[FusedKernel]) -> list[FusedKernel]:
    """Each kernel computing just an ``AttentionLse`` (a forward's rows' log-sum-exp, saved for
    its backward) made a side output of the flash-attention kernel of the same scores: in the
    place of the earlier of the two where the later one reads nothing written between them, else
    of the later one where nothing between reads the earlier one's output; every other kernel as
    it is."""
    flash = {}
    for position, kernel in enumerate(kernels):
        if kernel.kind == "flash_attention" and kernel.core is not None and kernel.core[0] == "FlashAttention":
            flash.setdefault(_scores_key(kernel.core), position)
    result: list[FusedKernel | None] = list(kernels)
    for position, kernel in enumerate(kernels):
        if kernel.kind != "attention_lse" or kernel.term != kernel.core:
            continue
        target = flash.get(_scores_key(kernel.core))
        if target is None or result[target] is None:
            continue
        first, last = sorted((position, target))
        between = {name for k in kernels[first + 1 : last] for name in k.outputs}
        if not between & set(kernels[last].reads):
            place = first
        elif not any(set(kernels[first].outputs) & set(k.reads) for k in kernels[first + 1 : last]):
            place = last
        else:
            continue
        owner = kernels[target]
        joined = replace(owner, reads=tuple(sorted({*owner.reads, *kernel.reads})),
                         side_outputs=(*owner.side_outputs, SideOutput(kernel.output, kernel.term, kernel.axes, kernel.dtype)))  # fmt: skip
        result[position] = result[target] = None
        result[place] = joined
    return [k for k in result if k is not None]


def lse_as_flash(form: Term) -> Term:
    """An ``AttentionLse`` form as the ``FlashAttention`` of its scores, the operand along the keys
    in v's place: what reads and problems of flash attention are worked out on."""
    key, n_keys, dim, n_dim, q, k, scale, mask = form[1:]
    keys = k if key in t.free_axes(k) else q
    return ("FlashAttention", key, n_keys, dim, n_dim, q, k, keys, scale, mask)


def lse_output(side: SideOutput, shapes: Mapping[str, tuple[int, ...]]) -> LseOutput:
    """Where a flash kernel's ``AttentionLse`` side output puts each query row (its row-major
    buffer over its axes), or ``KernelError``."""
    form = side.term
    key, _, dim, _, q, k, *_ = form[1:]
    q_read, k_read = _flash_read(q, "q", shapes), _flash_read(k, "k", shapes)
    if t.ax(key) in q_read.strides and t.ax(key) not in k_read.strides:
        q_read, k_read = k_read, q_read
    batch, head, query = query_axis_roles(q_read, k_read, dim, key, t.soft_capped(form[8])[1])
    strides, stride = {}, 1
    for axis, size in reversed(list(zip(side.axes, side.shape))):
        strides[axis] = stride
        stride *= size
    stray = [a for a in side.axes if t.extent(a) > 1 and a not in (batch, head, query)]
    if stray:
        raise KernelError(f"flash attention: its log-sum-exp {side.output} varies along {stray}, which are not "
                          "rows of the attention")  # fmt: skip
    layout = OperandLayout(side.shape, strides.get(batch, 0) if batch else 0, strides.get(head, 0) if head else 0,
                           strides[query] if query else 0)  # fmt: skip
    return LseOutput(side.output, layout)


def query_axis_roles(q_read: StridedRead, k_read: StridedRead, dim: str, key: str,
                     mask: Term = ("NoMask",)) -> tuple[str | None, str | None, str | None]:  # fmt: skip
    """(batch, head, query) axis names of an attention whose q and k read one head each: of the
    axes q shares with k, the head is the one q strides least; where k shares no head with q
    (one K/V head for every query head, :func:`shared_kv_head`), q's head is its other axis. The
    query is None for one query row (a decoded token)."""
    q_axes = {atom[1] for atom in q_read.strides if atom[0] == "Ax"}
    k_axes = {atom[1] if atom[0] == "Ax" else atom[1][1] for atom in k_read.strides}  # h // G: GQA's head
    shared = sorted(q_axes & k_axes - {dim, key}, key=lambda a: -q_read.strides[t.ax(a)])
    query = sorted(q_axes - set(shared) - {dim})
    grouped = any(atom[0] == "IxDiv" for atom in k_read.strides)
    if len(query) == 2 and len(shared) <= 1 and not grouped:
        row, head = shared_kv_head(query, q_read, mask)
        return (shared[0] if shared else None), head, row
    if len(shared) > 2 or len(query) > 1:
        raise KernelError(f"flash attention: q ({q_read.tensor}) is read along {sorted(q_axes)}; "
                          "expected q[b, h, i, d]")  # fmt: skip
    head = shared[-1] if shared else None
    batch = shared[0] if len(shared) == 2 else None
    return batch, head, query[0] if query else None


def shared_kv_head(candidates: Sequence[str], q_read: StridedRead, mask: Term) -> tuple[str, str]:
    """(query row, head) of q's two axes that k and v do not vary along (multi-query attention:
    one K/V head for every query head): the causal mask's axis is the row, or the one whose position
    a band of the mask reads (a chunk after a KV cache: ``where(i + o < j, m, 0)``), else the one q
    strides least (without a mask either reading gives the same attention)."""
    axis = t.mask_causal_axis(mask)
    causal = axis[1] if axis is not None and axis[0] == "Ax" else None
    positions = {s for s in t.subterms(mask) if s[0] == "Iota"}
    banded = [a for a in candidates if ("Iota", t.ax(a)) in positions]
    if causal in candidates:
        row = causal
    elif len(banded) == 1:
        row = banded[0]
    else:
        row = min(candidates, key=lambda a: q_read.strides[t.ax(a)])
    return row, next(a for a in candidates if a != row)


# ------------------------------------------------------------------ output layouts

RELAID_KINDS = frozenset({"flash_attention"})
"""Kernels that write their output at any strides (the others write row-major)."""


def laid_out_for_consumers(kernels: list[FusedKernel], outputs: frozenset[str]) -> list[FusedKernel]:
    """Each intermediate buffer of a ``RELAID_KINDS`` producer that exactly one access of
    one consumer reads through a view (a permute, a merge of heads: attention's output as
    ``transpose(1, 2).reshape(B, S, H·D)``) is laid out in the order that consumer reads it:
    the producer writes at the view's strides and the consumer reads a plain tensor (the
    GEMM after attention a row-major matrix)."""
    result = list(kernels)
    producers = [(i, k) for i, k in enumerate(kernels)
                 if k.kind in RELAID_KINDS and k.output not in outputs and k.buffer is None]  # fmt: skip
    if not producers:
        return result
    kernel_graph = dag.kernel_dag(kernels)
    position_of = {k.output: i for i, k in enumerate(kernels)}
    for position, producer in producers:
        readers = dag.readers(kernel_graph, producer.output)
        if len(readers) != 1:
            continue
        index = position_of[readers[0]]
        consumer = result[index]
        accesses = {s for s in t.subterms(consumer.term) if s[0] == "Tensor" and s[1] == producer.output}
        if len(accesses) != 1:
            continue
        (access,) = accesses
        relaid = consumer_order(access, producer.axes)
        if relaid is None:
            continue
        layout, plain = relaid
        result[position] = replace(producer, buffer=layout)
        result[index] = replace(consumer, term=t.replace(consumer.term, access, plain))
    return result


def consumer_order(access: Term, axes: tuple[str, ...]) -> tuple[BufferLayout, Term] | None:
    """The buffer layout in which ``access`` (a consumer's read of a buffer written over
    ``axes``) is a plain read ``buffer[c₀, c₁, …]`` of its own axes, and that read; None
    when the access is not a permutation of whole axes and ``(x // n, x % n)`` splits, or is
    plain already.

    Each consumer axis ``c`` reads one buffer axis (``Ax c``) or two (``c // n`` the outer,
    ``c % n`` the inner, of extent ``n``); the new buffer has one dimension per consumer
    axis, ordered by the position of the last buffer axis each reads."""
    items = t.ix_items(access[2])
    if len(items) != len(axes):
        return None
    groups: dict[str, dict[str, int]] = {}  # consumer axis -> {"whole" | "outer" | "inner": buffer position}
    splits: dict[str, int] = {}
    for position, (ix, axis) in enumerate(zip(items, axes)):
        if ix == t.ix_lit(0) and t.extent(axis) == 1:
            continue
        if ix[0] == "Ax":
            part, name = "whole", ix[1]
        elif ix[0] in ("IxDiv", "IxMod") and ix[1][0] == "Ax":
            part, name = ("outer" if ix[0] == "IxDiv" else "inner"), ix[1][1]
            if splits.setdefault(name, ix[2]) != ix[2]:
                return None
        else:
            return None
        if part in groups.setdefault(name, {}):
            return None
        groups[name][part] = position
    for name, parts in groups.items():
        if set(parts) not in ({"whole"}, {"outer", "inner"}):
            return None
        if "inner" in parts and (t.extent(axes[parts["inner"]]) != splits[name] or parts["outer"] > parts["inner"]
                                 or t.extent(axes[parts["outer"]]) * splits[name] != t.extent(name)):  # fmt: skip
            return None
    order = sorted(groups, key=lambda name: max(groups[name].values()))
    if all(set(groups[n]) == {"whole"} for n in order) and [groups[n]["whole"] for n in order] == sorted(
        groups[n]["whole"] for n in order
    ):
        return None  # already a plain read in the buffer's own order
    shape = tuple(t.extent(name) for name in order)
    group_strides = [1] * len(shape)
    for k in range(len(shape) - 2, -1, -1):
        group_strides[k] = group_strides[k + 1] * shape[k + 1]
    strides = [0] * len(axes)
    for name, stride in zip(order, group_strides):
        parts = groups[name]
        if "whole" in parts:
            strides[parts["whole"]] = stride
        else:
            strides[parts["outer"]], strides[parts["inner"]] = stride * splits[name], stride
    return BufferLayout(shape, tuple(strides)), t.access(access[1], (t.ax(name) for name in order))


# ------------------------------------------------------------------ absorbing a producer

ABSORBABLE_PRODUCERS = {"contraction": frozenset({"rms_norm_rows"}), "elementwise": frozenset({"contraction"})}
"""Consumer kind -> the producer kinds it may absorb."""


def absorbed(consumer: FusedKernel, producer: FusedKernel) -> FusedKernel | None:
    """``consumer`` computing ``producer``'s output itself where it reads it, or None.

    A contraction whose operand is an RMSNorm kernel's output can run the norm in its
    main loop: ``Σ_k RmsNormRow_k(x, ε)·w_k·b = (Σ_k x²/n + ε)^{-1/2} · Σ_k x·w_k·b`` —
    the row scale does not depend on k, so it moves to the epilogue, and the sum of
    squares accumulates from the same tiles of x the GEMM streams anyway. An elementwise
    kernel reading a contraction's output becomes that contraction with the elementwise
    work as its epilogue (:func:`epilogue_absorbed`). The result has the consumer's output
    and axes and reads the producer's inputs instead of its buffer; whether a GEMM family
    can run it is the code generator's to say, whether it is faster than the two kernels
    the search's."""
    if producer.kind not in ABSORBABLE_PRODUCERS.get(consumer.kind, ()):
        return None
    if consumer.kind == "elementwise":
        return epilogue_absorbed(consumer, producer)
    accesses = {s for s in t.subterms(consumer.term) if s[0] == "Tensor" and s[1] == producer.output}
    if len(accesses) != 1:
        return None
    (access,) = accesses
    if t.ix_items(access[2]) != tuple(t.ax(a) for a in producer.axes):
        return None
    term = t.replace(consumer.term, access, producer.term)
    return FusedKernel(consumer.kind, term, consumer.output, consumer.axes, _reads(term), consumer.source,
                       consumer.trace, dtype=consumer.dtype)  # fmt: skip


def epilogue_absorbed(consumer: FusedKernel, producer: FusedKernel) -> FusedKernel | None:
    """An elementwise ``consumer`` of a contraction ``producer`` as one contraction kernel:
    each read of the producer's buffer becomes the producer's term at that index, or None.

    Every read must index the buffer alike (``p[0, s, h·D + d]``: the producer's axes
    through one affine map), except that a read may step one axis by a constant
    (``d + D/2``, RoPE's rotate-half partner) where a ``PadAxis`` guard on that axis keeps
    the step inside the axis (``d < D/2``): that read becomes ``Shifted(d, D/2, core)``, the
    same contraction one step on, which a GEMM holds in its own tile."""
    accesses = sorted({s for s in t.subterms(consumer.term) if s[0] == "Tensor" and s[1] == producer.output}, key=repr)
    if not accesses:
        return None
    steps = {access: _step(access) for access in accesses}
    if any(step is None for step in steps.values()) or len({base for base, _ in steps.values()}) != 1:
        return None
    base = next(iter(steps.values()))[0]
    items = t.ix_items(base[2])
    if len(items) != len(producer.axes) or any(ix[0] == "IxLit" and t.extent(a) > 1
                                               for ix, a in zip(items, producer.axes)):  # fmt: skip
        return None  # a broadcast of one column: the consumer is no epilogue of the whole GEMM
    bound = reference_axis_names(producer.term) - set(producer.axes)
    if any(bound & t.ix_names(ix) for ix in items):
        return None  # a reduction axis of the producer would capture a consumer axis
    core = t.substitute_axes(producer.term, dict(zip(producer.axes, items, strict=True)))
    if not _guarded(consumer.term, {a: s for a, s in steps.items() if s[1] is not None}):
        return None
    term = consumer.term
    for access, (_, step) in steps.items():
        term = t.replace(term, access, core if step is None else ("Shifted", step[0], step[1], core))
    trace = tuple(dict.fromkeys((*producer.trace, *consumer.trace)))
    return FusedKernel("contraction", term, consumer.output, consumer.axes, _reads(term), producer.source, trace,
                       dtype=consumer.dtype)  # fmt: skip


def _step(access: Term) -> tuple[Term, tuple[str, int] | None] | None:
    """``(base, step)`` of a read: the read with its one ``axis + c`` step undone, and
    ``(axis, c)`` (None without a step); None with steps on several axes."""
    steps = {(s[1][1], s[2]) for s in t.subterms(access) if s[0] == "IxAdd" and s[1][0] == "Ax"}
    if not steps:
        return access, None
    if len(steps) != 1:
        return None
    ((axis, delta),) = steps
    return t.replace(access, ("IxAdd", t.ax(axis), delta), t.ax(axis)), (axis, delta)


def _guarded(term: Term, steps: Mapping[Term, tuple[Term, tuple[str, int]]]) -> bool:
    """Whether every stepped read in ``term`` lies under a ``PadAxis`` on its axis that
    keeps ``axis + step`` inside ``[0, extent)``: only there is the neighbour's value used."""
    for node, guards in _guards_above(term, set(steps), edges=False):
        axis, delta = steps[node][1]
        lo, hi = 0, t.extent(axis)
        for guarded, start, size in guards:
            if guarded == axis:
                lo, hi = max(lo, start), min(hi, start + size)
        if lo + delta < 0 or hi + delta > t.extent(axis):
            return False
    return True


def absorptions(kernels: list[FusedKernel], outputs: frozenset[str]) -> dict[str, tuple[str, FusedKernel]]:
    """For each kernel that can absorb its producer: ``consumer output -> (producer output,
    absorbed kernel)``. Only producers whose buffer no other kernel reads and that are not
    graph outputs qualify: absorbing one must leave it with nothing to do."""
    producers = {k.output: k for k in kernels}
    pairs = [(consumer, producers[name]) for consumer in kernels for name in consumer.reads
             if name in producers and name not in outputs
             and producers[name].kind in ABSORBABLE_PRODUCERS.get(consumer.kind, ())]  # fmt: skip
    kernel_graph = dag.kernel_dag(kernels) if pairs else None  # only where there is something to ask
    result = {}
    for consumer, producer in pairs:
        if consumer.output in result or len(dag.readers(kernel_graph, producer.output)) != 1:
            continue
        fused = absorbed(consumer, producer)
        if fused is not None:
            result[consumer.output] = (producer.output, fused)
    return result


# ------------------------------------------------------------------ flash attention


def canonical_flash(form: Term) -> Term:
    """The flash form with q (the operand without the key axis) before k: ``q·k`` and
    ``k·q`` contract alike, and extraction may pick either order."""
    key, q, k = form[1], form[5], form[6]
    if key in t.free_axes(q) and key not in t.free_axes(k):
        return (*form[:5], k, q, *form[7:])
    return form


def _flash_read(term: Term, role: str, shapes: Mapping[str, tuple[int, ...]]) -> StridedRead:
    """A flash operand as a strided read of a stored tensor, or ``KernelError``."""
    if term[0] != "Tensor":
        raise KernelError(f"flash attention: {role} is computed ({t.show(term)[:300]}); it must be a stored tensor")
    shape = shapes.get(term[1])
    read = None if shape is None else strided_read(term, shape)
    if read is None:
        raise KernelError(f"flash attention: {role} is read as {t.show(term)}, not an affine view of a stored tensor")
    return read


def _head_atom(read: StridedRead, shared: set[str]) -> dict[str, Term]:
    """For each axis a k/v read shares with q: the atom it reads it through (``Ax h`` or ``h // G``)."""
    atoms: dict[str, Term] = {}
    for atom in read.strides:
        name = atom[1] if atom[0] == "Ax" else atom[1][1]
        if name in shared:
            if name in atoms:
                raise KernelError(f"flash attention: {read.tensor} reads axis {name} twice")
            atoms[name] = atom
    return atoms


def _batch_axes_read_as_one(k_heads: Mapping[str, Term], grouped: Sequence[str],
                            reads: Sequence[StridedRead]) -> tuple[str, str] | None:  # fmt: skip
    """Two of q's batch-like axes (k reads them plainly; not a group's head) that every read steps as one
    axis: the outer's stride the inner's times the inner's extent (timm's ``(B, windows)`` of Twins or
    Hiera, a contiguous pair). The outermost such pair by q's strides, or None."""
    q_read = reads[0]
    names = sorted((a for a, atom in k_heads.items() if atom[0] == "Ax" and a not in grouped),
                   key=lambda a: -q_read.strides.get(t.ax(a), 0))  # fmt: skip
    return next(((outer, inner) for outer, inner in zip(names, names[1:])
                 if all(_read_as_one(read.strides, outer, inner) for read in reads)), None)  # fmt: skip


def _read_as_one(strides: Mapping[Term, int], outer: str, inner: str) -> bool:
    """Whether ``outer·n + inner`` (``n`` the inner's extent) is one axis of these strides."""
    return strides.get(t.ax(outer), 0) == t.extent(inner) * strides.get(t.ax(inner), 0)


def _merged_strides(strides: Mapping[Term, int], outer: str, inner: str, name: str) -> dict[Term, int]:
    """``strides`` with ``outer`` and ``inner`` (read as one: :func:`_read_as_one`) as the axis ``name``."""
    kept = {atom: stride for atom, stride in strides.items() if atom not in (t.ax(outer), t.ax(inner))}
    return {**kept, t.ax(name): strides[t.ax(inner)]} if t.ax(inner) in strides else kept


MX_BLOCK = 32
"""Elements of the head dim one MX scale covers."""


def _split_block_scales(operand: Term, dtypes: Mapping[str, str]) -> tuple[Term, Term | None]:
    """An operand ``x·s`` with ``s`` a read of an ``e8m0`` tensor (MX scales) as ``(x, s)``;
    any other operand as ``(operand, None)``."""
    if operand[0] != "Mul":
        return operand, None
    for data, scales in ((operand[1], operand[2]), (operand[2], operand[1])):
        if scales[0] == "Tensor" and dtypes.get(scales[1]) in SCALE_DTYPES and data[0] == "Tensor":
            return data, scales
    return operand, None


def _block_scales(term: Term, role: str, roles: Mapping[str, str | None], dim: str, group: int,
                  shapes: Mapping[str, tuple[int, ...]]) -> BlockScales:  # fmt: skip
    """The :class:`BlockScales` of q's or k's MX scales: read along the batch, (K/V) head and
    sequence axes and ``d // 32``; or ``KernelError``."""
    read = _flash_read(term, f"{role}'s MX scales", shapes)
    sequence = roles["row"] if role == "q" else roles["key"]
    by_atom = {("IxDiv", t.ax(dim), MX_BLOCK): "block"}
    for name, axis in (("batch", roles["batch"]), ("row", sequence)):
        if axis is not None:
            by_atom[t.ax(axis)] = name
    if roles["head"] is not None:
        by_atom[t.ax(roles["head"]) if role == "q" or group == 1 else ("IxDiv", t.ax(roles["head"]), group)] = "head"
    stray = [t.show(atom) for atom in read.strides if atom not in by_atom]
    if stray or ("IxDiv", t.ax(dim), MX_BLOCK) not in read.strides:
        raise KernelError(f"flash attention: {role}'s MX scales {t.show(term)} must vary along the batch, head and "
                          f"sequence axes and {dim} // {MX_BLOCK} only")  # fmt: skip
    strides = {by_atom[atom]: stride for atom, stride in read.strides.items()}
    return BlockScales(term[1], read.shape, strides.get("batch", 0), strides.get("head", 0), strides.get("row", 0),
                       strides["block"], read.offset)  # fmt: skip


def factor_leaves(factor: Term) -> list[Term]:
    """The operands of a product ``a·b·…`` (a scaled attention form's factor)."""
    if factor[0] == "Mul":
        return factor_leaves(factor[1]) + factor_leaves(factor[2])
    return [factor]


def _scale_factors(factor: Term, roles: Mapping[str, str | None], group: int, shapes: Mapping[str, tuple[int, ...]],
                   dtypes: Mapping[str, str]) -> tuple[float, tuple[ScaleFactor, ...]]:  # fmt: skip
    """A factor of a scaled attention form as its constant and its :class:`ScaleFactor` reads:
    fp32 tensors read along the batch and (query or K/V) head axes only; or ``KernelError``."""
    constant, reads = 1.0, []
    allowed = {t.ax(roles["batch"]): "batch"} if roles["batch"] else {}
    if roles["head"]:
        allowed[t.ax(roles["head"])] = "head"
        allowed[("IxDiv", t.ax(roles["head"]), group)] = "kv_head"
    for leaf in factor_leaves(factor):
        if leaf[0] == "Num":
            constant *= leaf[1]
            continue
        read = _flash_read(leaf, "a scale factor", shapes)
        if dtypes[leaf[1]] != "fp32":
            raise KernelError(f"flash attention: the scale factor {t.show(leaf)} is {dtypes[leaf[1]]}; valid: fp32")
        stray = [t.show(atom) for atom in read.strides if atom not in allowed]
        kinds = {allowed[atom] for atom in read.strides if atom in allowed}
        if stray or {"head", "kv_head"} <= kinds:
            raise KernelError(f"flash attention: the scale factor {t.show(leaf)} varies along {stray or kinds}; "
                              "valid: the batch and head axes")  # fmt: skip
        strides = {allowed[atom]: stride for atom, stride in read.strides.items()}
        head = strides.get("head", strides.get("kv_head", 0))
        reads.append(ScaleFactor(leaf[1], read.shape, strides.get("batch", 0), head,
                                 group if "kv_head" in strides else 1, read.offset))  # fmt: skip
    return constant, tuple(reads)


def _attention_bias(term: Term, roles: Mapping[str, str | None], shapes: Mapping[str, tuple[int, ...]],
                    dtypes: Mapping[str, str]) -> AttentionBias:  # fmt: skip
    """The :class:`AttentionBias` of a mask's bias ``term``: an affine read of a stored tensor of a
    float dtype varying only along the batch, head, query and key axes (``roles``: role ->
    axis name, None where absent); or ``KernelError``."""
    read = _flash_read(term, "the bias", shapes)
    dtype = dtypes[term[1]]
    if dtype not in BIAS_DTYPES:
        raise KernelError(f"flash attention: the bias {t.show(term)} is {dtype}; valid: {', '.join(BIAS_DTYPES)}")
    by_atom = {t.ax(name): role for role, name in roles.items() if name is not None}
    stray = [t.show(atom) for atom in read.strides if atom not in by_atom]
    if stray:
        raise KernelError(f"flash attention: the bias {t.show(term)} varies along {stray}; valid: "
                          f"the batch, head, query and key axes {[n for n in roles.values() if n]}")  # fmt: skip
    strides = {by_atom[atom]: stride for atom, stride in read.strides.items()}
    return AttentionBias(term[1], dtype, read.shape, strides.get("batch", 0), strides.get("head", 0),
                         strides.get("row", 0), strides.get("key", 0), read.offset)  # fmt: skip


def attention_problem(
    form: Term, shapes: Mapping[str, tuple[int, ...]], dtypes: Mapping[str, str],
    output_axes: tuple[str, ...] | None = None, buffer: BufferLayout | None = None,
) -> AttentionProblem:
    """The :class:`AttentionProblem` a flash-attention form computes, or ``KernelError``.

    q, k and v must be affine views of stored tensors (:func:`~cherenkov.rewrites.access.strided_read`)
    with a contiguous head dimension: ``q[b, h, i, d]``, ``k[b, h // G, j, d]``,
    ``v[b, h // G, j, e]`` (``e`` of any extent: D_v) at any strides — BSHD, slices of one fused projection, a K/V
    head repeated for ``G`` query heads (GQA) — where ``b`` and ``h`` are the axes q shares
    with k (absent when of extent 1; with two, ``h`` is the one k divides by the group, or
    the one q strides least). One K/V head for all query heads (MQA: k and v vary along no
    axis of q but ``b``) is a group of all of them; of q's two other axes the causal mask's
    is the query row, else the one q strides least. The output is written over
    ``output_axes`` (the kernel's axes; default ``b, h, i, e``), row-major or as ``buffer``
    lays it out.
    """
    if form[0] == "Scheduled":
        form = form[1]
    key, n_keys, dim, n_dim, q, k, v, scale, capped_mask, *factors = canonical_flash(form)[1:]
    softcap, mask = t.soft_capped(capped_mask)
    (q, q_scales), (k, k_scales) = _split_block_scales(q, dtypes), _split_block_scales(k, dtypes)
    q_read, k_read, v_read = (_flash_read(term, role, shapes) for role, term in (("q", q), ("k", k), ("v", v)))
    if any(atom[0] != "Ax" for atom in q_read.strides):
        raise KernelError(f"flash attention: q is indexed {t.show(q)}; expected q[b, h, i, {dim}]")
    q_axes = {atom[1] for atom in q_read.strides}
    if q_read.strides.get(t.ax(dim)) != 1 or k_read.strides.get(t.ax(dim)) != 1:
        raise KernelError(f"flash attention: the head dimension {dim} of q and k must be contiguous (stride 1)")
    if t.ax(key) not in k_read.strides or t.ax(key) not in v_read.strides:
        raise KernelError(f"flash attention: k {t.show(k)} and v {t.show(v)} must both vary along the key axis {key}")
    shared = q_axes - {dim}
    k_heads, v_heads = _head_atom(k_read, shared), _head_atom(v_read, shared)
    # v may read one head for every K/V head k reads (DiffLlama's two halves of v, each one head
    # repeated): its head stride is then 0
    if not v_heads.items() <= k_heads.items():
        raise KernelError(f"flash attention: k and v use different heads ({t.show(k)} / {t.show(v)})")
    others = [a for a in k_read.strides if a != t.ax(key) and a != t.ax(dim) and a not in k_heads.values()]
    if others:
        raise KernelError(f"flash attention: k {t.show(k)} varies along {[t.show(a) for a in others]}, which q does not")
    values = [a for a in v_read.strides if a != t.ax(key) and a not in v_heads.values()]
    if len(values) != 1 or values[0][0] != "Ax" or v_read.strides[values[0]] != 1:
        raise KernelError(f"flash attention: v {t.show(v)} must have one contiguous value axis")
    value_axis = values[0][1]
    value_dim = t.extent(value_axis)
    query = sorted(q_axes - {dim} - set(k_heads))
    grouped = [name for name, atom in k_heads.items() if atom[0] == "IxDiv"]
    merged: list[tuple[str, str, str]] = []  # (outer, inner, their merged name): batch axes read as one
    while len(k_heads) > 2 and (pair := _batch_axes_read_as_one(k_heads, grouped, (q_read, k_read, v_read))):
        outer, inner = pair
        name = f"{outer.rsplit(':', 1)[0]}_{inner.rsplit(':', 1)[0]}:{t.extent(outer) * t.extent(inner)}"
        q_read, k_read, v_read = (replace(read, strides=_merged_strides(read.strides, outer, inner, name))
                                  for read in (q_read, k_read, v_read))  # fmt: skip
        k_heads = {**{a: atom for a, atom in k_heads.items() if a not in pair}, name: t.ax(name)}
        v_heads = {a: atom for a, atom in k_heads.items() if atom in v_read.strides}
        merged.append((outer, inner, name))
    shared_head = None  # MQA: a query axis of q that k and v do not vary along, its heads sharing one K/V head
    if len(query) == 2 and not grouped and len(k_heads) <= 1:
        row, shared_head = shared_kv_head(query, q_read, mask)
        query = [row]
    if len(query) > 1 or len(k_heads) > 2:
        raise KernelError(f"flash attention: q {t.show(q)} has more than one query axis and two batch/head axes")
    if len(grouped) > 1:
        raise KernelError("flash attention: k and v divide two axes by a group size")
    names = sorted(k_heads, key=lambda a: (a not in grouped, -q_read.strides[t.ax(a)]))
    if shared_head is not None:  # every query head reads K/V head 0: one group of all of them
        head, batch, group = shared_head, (names[0] if names else None), t.extent(shared_head)
    else:
        head = names[0] if grouped else (names[-1] if names else None)
        batch = next((a for a in names if a != head), None)
        group = k_heads[head][2] if grouped else 1
    heads = t.extent(head) if head else 1
    if heads % group:
        raise KernelError(f"flash attention: {heads} heads are not a multiple of the group size {group}")
    query_axis = query[0] if query else None
    causal = t.mask_causal_axis(mask)
    if causal is not None and (query_axis is None or causal != t.ax(query_axis)):
        raise KernelError("flash attention: the causal mask does not compare the query axis with the key axis")
    roles = {"batch": batch, "head": head, "row": query_axis, "key": key}
    (band, bias_term), (window, ahead) = window_parts(mask), sliding_window(mask) or (0, 0)
    if band is not None:  # the kernel bounds its key range itself (reading any other bias stored)
        row = t.ax(query_axis) if query_axis is not None else None
        keys = {s for s in t.subterms(band) if s[0] == "Iota" and s[1][0] == "Ax" and s[1] != row}
        if row is None or keys != {("Iota", t.ax(key))}:
            raise KernelError(f"flash attention: the window {t.show(band)} does not bound the key axis {key} "
                              f"by the query axis {query_axis}")
    if merged and (bias_term is not None or factors or q_scales is not None or k_scales is not None):
        raise KernelError(f"flash attention: {len(merged) + 2} batch/head axes with a bias, scale factors or block "
                          "scales (valid: two, or more without them, read as one)")  # fmt: skip
    bias = _attention_bias(bias_term, roles, shapes, dtypes) if bias_term is not None else None
    operand_dtypes = {dtypes[name] for name in (q[1], k[1], v[1])}
    if len(operand_dtypes) != 1:
        raise KernelError(f"flash attention: q, k, v have different dtypes {sorted(operand_dtypes)}")
    block_scales = {role: _block_scales(term, role, roles, dim, group, shapes)
                    for role, term in (("q", q_scales), ("k", k_scales)) if term is not None}  # fmt: skip
    score_factors: tuple[ScaleFactor, ...] = ()
    out_factors: tuple[ScaleFactor, ...] = ()
    if factors:
        for factor in factors[:2]:
            constant, reads = _scale_factors(factor, roles, group, shapes, dtypes)
            scale, score_factors = scale * constant, score_factors + reads
        out_constant, out_factors = _scale_factors(factors[2], roles, group, shapes, dtypes)
        if out_constant != 1.0:
            raise KernelError(f"flash attention: a constant output factor {out_constant} (valid: 1)")

    def layout(shape: tuple[int, ...], strides: Mapping[Term, int], offset: int, head_atom: Term | None,
               seq: str | None) -> OperandLayout:  # fmt: skip
        def stride(atom: Term | None) -> int:
            return strides.get(atom, 0) if atom is not None else 0

        return OperandLayout(tuple(shape), stride(batch and t.ax(batch)), stride(head_atom), stride(seq and t.ax(seq)),
                             offset)  # fmt: skip

    if output_axes is None:
        output_axes = tuple(a for a in (batch, head, query_axis, value_axis) if a is not None)
    if buffer is None:
        out_shape = tuple(t.extent(a) for a in output_axes)
        out_strides = strided_read(t.access("o", (t.ax(a) for a in output_axes)), out_shape).strides
    else:
        out_shape, out_strides = buffer.shape, {t.ax(a): stride for a, stride in zip(output_axes, buffer.strides)}
    for outer, inner, name in merged:
        if not _read_as_one(out_strides, outer, inner):
            raise KernelError(f"flash attention: the output does not step batch axes {outer} and {inner} as one")
        out_strides = _merged_strides(out_strides, outer, inner, name)
    if out_strides.get(t.ax(value_axis)) != 1:
        raise KernelError(f"flash attention: the output's innermost axis must be the value axis {value_axis}")
    head_atom = k_heads.get(head) if head else None
    q_head = t.ax(head) if head else None
    layouts = (
        layout(q_read.shape, q_read.strides, q_read.offset, q_head, query_axis),
        layout(k_read.shape, k_read.strides, k_read.offset, head_atom, key),
        layout(v_read.shape, v_read.strides, v_read.offset, head_atom, key),
        layout(out_shape, out_strides, 0, q_head, query_axis),
    )
    problem = AttentionProblem(
        batch=t.extent(batch) if batch else 1,
        heads=heads,
        kv_heads=heads // group,
        seq_q=t.extent(query_axis) if query_axis else 1,
        seq_kv=n_keys,
        head_dim=n_dim,
        dtype=operand_dtypes.pop(),
        causal=causal is not None,
        window=window,
        window_ahead=ahead,
        scale=scale,
        softcap=softcap,
        q=q[1],
        k=k[1],
        v=v[1],
        layouts=layouts,
        value_dim=value_dim if value_dim != n_dim else 0,
        bias=bias,
        score_factors=score_factors,
        out_factors=out_factors,
        q_block_scales=block_scales.get("q"),
        k_block_scales=block_scales.get("k"),
    )
    return problem if problem.strided else replace(problem, layouts=())  # contiguous: one canonical plan name
