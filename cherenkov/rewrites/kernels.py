"""Fused kernels: partitioning an extracted term into kernels that each write one tensor.

Each kernel has one *core* — a fused form (flash attention, a softmax or norm row, a
contraction) or a plain reduction — wrapped in the elementwise work around it (its
epilogue) and fed by elementwise work on tensors it reads (its prologue). Elementwise
terms with no core form elementwise kernels. Where a core's operand holds another core,
that operand is materialised by an earlier kernel into an intermediate buffer, and the
consumer reads the buffer instead. Flash attention reads plain BHSD tensors only, so
anything else feeding it is materialised first. A contraction may also *absorb* the
RMSNorm kernel that feeds it (:func:`absorbed`): the search weighs that form against the
two kernels.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from cherenkov.rewrites import terms as t
from cherenkov.rewrites.lower import Lowered
from cherenkov.rewrites.plan import AttentionProblem
from cherenkov.rewrites.reference import evaluate_term
from cherenkov.rewrites.terms import Term

ELEMENTWISE = frozenset(
    {
        "Tensor", "Num", "Flag", "Iota", "Cast", "Exp2", "Exp", "Log2", "Sin", "Sqrt", "Recip", "Neg",
        "Add", "Mul", "Mod", "Lt", "Maximum", "Where", "PadAxis",
    }
)  # fmt: skip

KIND_OF_CORE = {
    "FlashAttention": "flash_attention",
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
    "FlashAttention", "Contract", "LayerNormRow", "RmsNormRow", "SoftmaxRow",
    "OnlineSoftmaxContract", "SoftmaxFoldAcc", "SoftmaxFoldL", "Sum", "Max",
)  # fmt: skip


def _core_head(core: Term) -> str:
    return core[1][0] if core[0] == "Scheduled" else core[0]


PAD_AXIS = ""  # a buffer axis of extent 1 that the stored term does not vary along


class KernelError(ValueError):
    """A fused form that no kernel of this kind can run (wrong layout, unsupported size)."""


@dataclass(frozen=True)
class FusedKernel:
    """One kernel: computes ``term`` over ``axes`` and writes it to the buffer ``output``."""

    kind: str
    term: Term
    output: str
    axes: tuple[str, ...]
    reads: tuple[str, ...]
    source: Term | None = field(default=None, compare=False)  # the core as extracted
    trace: tuple[str, ...] = field(default=(), compare=False)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(t.extent(a) for a in self.axes)

    @property
    def core(self) -> Term | None:
        """The fused form or reduction at the heart of the kernel (None if elementwise)."""
        cores = _cores(self.term)
        return cores[0] if cores else None

    def evaluate(self, buffers: Mapping[str, np.ndarray]) -> np.ndarray:
        """The kernel's output in float64, computed the way its fused form streams."""
        extents = {a: t.extent(a) for a in self.axes}
        return evaluate_term(self.term, {n: buffers[n] for n in self.reads}, self.axes, extents)

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


def _reads(term: Term) -> tuple[str, ...]:
    return tuple(sorted({s[1] for s in t.subterms(term) if s[0] == "Tensor"}))


def _is_bhsd_read(term: Term, query: bool) -> bool:
    """A read of a whole stored tensor by plain axes (k and v may index heads by h // G)."""
    if term[0] != "Tensor":
        return False
    items = t.ix_items(term[2])
    heads_ok = len(items) == 4 and (query or items[1][0] != "IxDiv" or items[1][1][0] == "Ax")
    plain = all(ix[0] == "Ax" or ix == t.ix_lit(0) for i, ix in enumerate(items) if i != 1 or query)
    return heads_ok and plain and (query or items[1][0] in ("Ax", "IxLit", "IxDiv"))


def _axis_order(axes: frozenset[str], output_axes: tuple[str, ...]) -> tuple[str, ...]:
    """Output axes first, in output order, then the rest by name."""
    return tuple(a for a in output_axes if a in axes) + tuple(sorted(axes - set(output_axes)))


class _Partition:
    def __init__(self, lowered: Lowered) -> None:
        self.lowered = lowered
        self.kernels: list[FusedKernel] = []
        self.buffers: dict[Term, Term] = {}  # materialised term -> access of its buffer
        self.taken = set(lowered.input_shapes) | set(lowered.roots)
        self.output_axes: tuple[str, ...] = ()

    def fresh_buffer(self) -> str:
        n = len(self.kernels)
        while f"t{n}" in self.taken:
            n += 1
        self.taken.add(f"t{n}")
        return f"t{n}"

    def materialise(self, term: Term, axes: tuple[str, ...] | None = None) -> Term:
        """Compute ``term`` in its own kernel; return the access that reads its buffer.

        Axes of extent 1 (``PAD_AXIS``) pad the buffer's rank; reads index them with 0."""
        if axes is None:
            axes = _axis_order(t.free_axes(term), self.output_axes)
        key = (term, axes)
        if key not in self.buffers:
            name = self.fresh_buffer()
            self.emit(term, name, tuple(f"u{i}:1" if a == PAD_AXIS else a for i, a in enumerate(axes)))
            self.buffers[key] = t.access(name, (t.ix_lit(0) if a == PAD_AXIS else t.ax(a) for a in axes))
        return self.buffers[key]

    def emit(self, term: Term, output: str, axes: tuple[str, ...]) -> None:
        """Add the kernel(s) computing ``term`` into ``output``: the most valuable core
        stays in this kernel, every other core is materialised by an earlier one."""
        cores = sorted(_cores(term), key=lambda c: CORE_PRIORITY.index(_core_head(c)))
        source = cores[0] if cores else None
        primary = source
        for extra in cores[1:]:
            access = self.materialise(extra)
            term, primary = t.replace(term, extra, access), t.replace(primary, extra, access)
        if primary is not None:
            term = t.replace(term, primary, self.prepare(primary))
        kind = KIND_OF_CORE[_core_head(primary)] if primary is not None else "elementwise"
        self.kernels.append(FusedKernel(kind, term, output, axes, _reads(term), source))

    def prepare(self, core: Term) -> Term:
        """The core with each operand it cannot fuse replaced by a buffer access."""
        head = core[0]
        if head == "Scheduled":
            return self.prepare(core[1])
        if head == "FlashAttention":
            return self.prepare_flash(core)
        operands = [i for i, a in enumerate(core[1:], start=1) if isinstance(a, tuple) and a[0] not in ("Ax",)]
        result = list(core)
        for position in operands:
            operand = core[position]
            nested = _cores(operand)
            if head == "Contract" and _stored_whole(operand, nested):
                result[position] = self.materialise(operand)
                continue
            for inner in nested:
                operand = t.replace(operand, inner, self.materialise(inner))
            result[position] = operand
        return tuple(result)

    def prepare_flash(self, core: Term) -> Term:
        """Flash attention reads whole BHSD tensors: anything else feeding q, k or v
        (a computation, a reshaped or transposed read) is materialised in BHSD order."""
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
        result = list(core)
        for position, (layout, operand) in layouts.items():
            if not _is_bhsd_read(operand, position == 5):
                result[position] = self.materialise(operand, layout)
        return tuple(result)


def _stored_whole(operand: Term, nested: list[Term]) -> bool:
    """Whether a contraction operand that holds other cores is better stored whole.

    A contraction re-reads each operand element once per output tile, so elementwise work
    around a stored core (a bias and GELU, a norm's weight) runs once in the producer's
    epilogue instead of once per tile in this kernel's prologue — as long as storing the
    whole operand writes no more than storing the cores would (no broadcast axes added)."""
    if not nested or operand in nested:
        return False
    return t.free_axes(operand) == frozenset().union(*(t.free_axes(core) for core in nested))


def partition(extracted: Mapping[str, Term], lowered: Lowered) -> list[FusedKernel]:
    """Kernels (in execution order) computing every output of an extracted graph."""
    plan = _Partition(lowered)
    for name, term in extracted.items():
        plan.output_axes = lowered.root_axes[name]
        plan.emit(term, name, lowered.root_axes[name])
    return plan.kernels


# ------------------------------------------------------------------ absorbing a producer

ABSORBABLE_PRODUCERS = frozenset({"rms_norm_rows"})


def absorbed(consumer: FusedKernel, producer: FusedKernel) -> FusedKernel | None:
    """``consumer`` computing ``producer``'s output itself where it reads it, or None.

    A contraction whose operand is an RMSNorm kernel's output can run the norm in its
    main loop: ``Σ_k RmsNormRow_k(x, ε)·w_k·b = (Σ_k x²/n + ε)^{-1/2} · Σ_k x·w_k·b`` —
    the row scale does not depend on k, so it moves to the epilogue, and the sum of
    squares accumulates from the same tiles of x the GEMM streams anyway. The result has
    the consumer's output and axes and reads the norm's inputs instead of its buffer;
    whether a GEMM family can run it is the code generator's to say, whether it is faster
    than the two kernels the search's."""
    if consumer.kind != "contraction" or producer.kind not in ABSORBABLE_PRODUCERS:
        return None
    accesses = {s for s in t.subterms(consumer.term) if s[0] == "Tensor" and s[1] == producer.output}
    if len(accesses) != 1:
        return None
    (access,) = accesses
    if t.ix_items(access[2]) != tuple(t.ax(a) for a in producer.axes):
        return None
    term = t.replace(consumer.term, access, producer.term)
    return FusedKernel(consumer.kind, term, consumer.output, consumer.axes, _reads(term), consumer.source,
                       consumer.trace)  # fmt: skip


def absorptions(kernels: list[FusedKernel], outputs: frozenset[str]) -> dict[str, tuple[str, FusedKernel]]:
    """For each kernel that can absorb its producer: ``consumer output -> (producer output,
    absorbed kernel)``. Only producers whose buffer no other kernel reads and that are not
    graph outputs qualify: absorbing one must leave it with nothing to do."""
    readers: dict[str, int] = {}
    for kernel in kernels:
        for name in kernel.reads:
            readers[name] = readers.get(name, 0) + 1
    producers = {k.output: k for k in kernels}
    result = {}
    for consumer in kernels:
        for name in consumer.reads:
            producer = producers.get(name)
            if producer is None or readers[name] != 1 or name in outputs:
                continue
            fused = absorbed(consumer, producer)
            if fused is not None:
                result[consumer.output] = (name, fused)
                break
    return result


# ------------------------------------------------------------------ flash attention


def canonical_flash(form: Term) -> Term:
    """The flash form with q (the operand without the key axis) before k: ``q·k`` and
    ``k·q`` contract alike, and extraction may pick either order."""
    key, q, k = form[1], form[5], form[6]
    if key in t.free_axes(q) and key not in t.free_axes(k):
        return (*form[:5], k, q, *form[7:])
    return form


def _simple(ix: Term) -> bool:
    """A named axis, or the index 0 of an axis of extent 1."""
    return ix[0] == "Ax" or ix == t.ix_lit(0)


def _plain_axes(term: Term, role: str) -> tuple[str, ...]:
    if term[0] != "Tensor":
        raise KernelError(f"flash attention: {role} is computed ({t.show(term)}); it must be a stored tensor")
    items = t.ix_items(term[2])
    if len(items) != 4:
        raise KernelError(f"flash attention: {role} {term[1]} has {len(items)} axes; the kernel reads BHSD tensors")
    return items


def attention_problem(
    form: Term, shapes: Mapping[str, tuple[int, ...]], dtypes: Mapping[str, str]
) -> AttentionProblem:
    """The :class:`AttentionProblem` a flash-attention form computes, or ``KernelError``.

    q must be ``q[b, h, i, d]``, k ``k[b, h // G, j, d]`` and v ``v[b, h // G, j, e]`` with
    ``e`` of the head dimension's extent, all whole stored tensors of ``shapes``.
    """
    if form[0] == "Scheduled":
        form = form[1]
    key, n_keys, dim, n_dim, q, k, v, scale, mask = canonical_flash(form)[1:]
    qb, qh, qi, qd = _plain_axes(q, "q")
    kb, kh, kj, kd = _plain_axes(k, "k")
    vb, vh, vj, ve = _plain_axes(v, "v")
    if qi[0] != "Ax" or qd != t.ax(dim) or not all(_simple(ix) for ix in (qb, qh)):
        raise KernelError(f"flash attention: q is indexed {t.show(q)}; expected q[b, h, i, {dim}]")
    if kb != qb or vb != qb or kj != t.ax(key) or vj != t.ax(key) or kd != t.ax(dim):
        raise KernelError(f"flash attention: k {t.show(k)} / v {t.show(v)} do not match q {t.show(q)}")
    if kh != vh:
        raise KernelError("flash attention: k and v use different heads")
    q_shape, k_shape, v_shape = shapes.get(q[1]), shapes.get(k[1]), shapes.get(v[1])
    if q_shape is None or len(q_shape) != 4 or any(
        ix[0] == "Ax" and t.extent(ix[1]) != size for ix, size in zip((qb, qh, qi, qd), q_shape)
    ):
        raise KernelError(f"flash attention: q {q[1]} of shape {q_shape} is not read whole")
    batch, heads, seq_q = q_shape[:3]
    group = 1
    if kh != qh:
        if kh[0] != "IxDiv" or kh[1] != qh:
            raise KernelError(f"flash attention: k's head index {t.show(kh)} is not h or h // group")
        group = kh[2]
    if ve[0] != "Ax" or t.extent(ve[1]) != n_dim or ve in (qb, qh, qi):
        raise KernelError("flash attention: v's last axis must be an output axis of the head dimension")
    if mask[0] == "CausalMask" and mask[1] != qi:
        raise KernelError("flash attention: the causal mask does not compare the query axis with the key axis")
    kv_shape = (batch, heads // group, n_keys, n_dim)
    if heads % group or k_shape != kv_shape or v_shape != kv_shape:
        raise KernelError(f"flash attention: k {k_shape} / v {v_shape} are not {kv_shape}")
    operand_dtypes = {dtypes[name] for name in (q[1], k[1], v[1])}
    if len(operand_dtypes) != 1:
        raise KernelError(f"flash attention: q, k, v have different dtypes {sorted(operand_dtypes)}")
    return AttentionProblem(
        batch=batch,
        heads=heads,
        kv_heads=heads // group,
        seq_q=seq_q,
        seq_kv=n_keys,
        head_dim=n_dim,
        dtype=operand_dtypes.pop(),
        causal=mask[0] == "CausalMask",
        scale=scale,
        q=q[1],
        k=k[1],
        v=v[1],
    )
