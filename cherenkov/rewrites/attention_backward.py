"""Attention backward kernels: the gradient forms of one attention joined into one kernel, and its problem.

The derivation gives each gradient its own form (``FlashAttentionGradQ``, ``…GradK``,
``…GradV``: one per root of the gradient graph). The three share their work — the recomputed
probabilities, the score gradient — so :func:`joined_backward` makes one kernel of the forms
of one attention: the first gradient's kernel with the others as side outputs.
:func:`attention_backward_problem` reads what it computes off the forms: q, k, v and dO as
strided reads of stored tensors (the forward's rules: a contiguous head dim, any other
strides), the scale, the mask, and where each gradient is written.

A gradient graph may hold the forward's output and log-sum-exp as saved inputs
(``ck.grad(..., saved=...)``); :func:`saved_attentions` reads, from the derived forms of the
values those inputs hold (a ``FlashAttention`` and an ``AttentionLse``), which attention they
belong to, and :func:`saved_statistics` gives a backward problem of the same attention its
:class:`~cherenkov.rewrites.plan_backward.SavedStatistics`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace

from cherenkov.rewrites import terms as t
from cherenkov.rewrites.access import StridedRead
from cherenkov.rewrites.kernels import (
    FusedKernel,
    KernelError,
    SideOutput,
    _flash_read,
    attention_problem,
    lse_as_flash,
    lse_output,
    query_axis_roles,
    scale_key,
)
from cherenkov.rewrites.plan import AttentionProblem, OperandLayout
from cherenkov.rewrites.plan_backward import GRADIENT_ROLES, AttentionBackwardProblem, GradientOutput, SavedStatistics
from cherenkov.rewrites.terms import Term

ROLE_OF_FORM = {
    "FlashAttentionGradQ": "dq", "FlashAttentionGradK": "dk", "FlashAttentionGradV": "dv",
    "FlashAttentionGradKGroup": "dk", "FlashAttentionGradVGroup": "dv",
}  # fmt: skip


@dataclass(frozen=True)
class GradientForm:
    """The parts of one backward form: the key axis, the head dim (and value dim, absent for
    dv), q and k (q the operand without the key axis), v (None for dv), dO, the scale, the mask
    and the operand read again (k for dq, q for dk, dO for dv) with its own head axis."""

    role: str
    key: str
    n_keys: int
    dim: str
    n_dim: int
    q: Term
    k: Term
    v: Term | None
    grad_output: Term
    scale: float
    mask: Term
    again: Term


def gradient_form(form: Term) -> GradientForm:
    """The :class:`GradientForm` of a ``FlashAttentionGrad*`` term."""
    head, args = form[0], form[1:]
    if head.endswith("Group"):  # the sum over a K/V head's query heads: the same parts, q read per group member
        head, args = head.removesuffix("Group"), args[2:]
    if head == "FlashAttentionGradQ":
        key, n_keys, dim, n_dim, _, _, q, k, v, do, scale, mask, again = args
    elif head == "FlashAttentionGradK":
        _, _, key, n_keys, dim, n_dim, _, _, q, k, v, do, scale, mask, again = args
    else:
        _, _, key, n_keys, dim, n_dim, q, k, scale, mask, again = args
        v, do = None, again
    if key in t.free_axes(q) and key not in t.free_axes(k):
        q, k = k, q  # q·k and k·q contract alike
    return GradientForm(ROLE_OF_FORM[head], key, n_keys, dim, n_dim, q, k, v, do, scale, mask, again)


def _tensor_name(term: Term | None) -> str | None:
    return term[1] if term is not None and term[0] == "Tensor" else None


def _attention_key(form: GradientForm) -> tuple:
    """What the forms of one attention share: the tensors q, k and dO are read from, the scale
    and the kind of mask."""
    return _tensor_name(form.q), _tensor_name(form.k), _tensor_name(form.grad_output), scale_key(form.scale), form.mask[0]


def joined_backward(kernels: list[FusedKernel]) -> list[FusedKernel]:
    """The backward kernels of one attention as one kernel, in the place of the last of them, the
    others its side outputs (in ``GRADIENT_ROLES`` order). The kernels between them that read one
    of their outputs, directly or through one another (RoPE's backward of dk, before dq's forms),
    move after the joined kernel — unless one of the forms reads them, which leaves the forms
    apart; every other kernel stays as it is."""
    groups: dict[tuple, list[FusedKernel]] = {}
    for kernel in kernels:
        if kernel.kind == "flash_attention_backward" and kernel.term == kernel.core:
            groups.setdefault(_attention_key(gradient_form(kernel.core)), []).append(kernel)
    result = list(kernels)
    for members in groups.values():
        if len(members) < 2:
            continue
        positions = [next(p for p, k in enumerate(result) if k is m) for m in members]
        written, moved, moved_outputs = {m.output for m in members}, [], set()
        for kernel in result[positions[0] + 1 : positions[-1]]:
            if all(kernel is not m for m in members) and (written | moved_outputs) & set(kernel.reads):
                moved.append(kernel)
                moved_outputs |= {kernel.output, *(side.output for side in kernel.side_outputs)}
        if any(moved_outputs & set(m.reads) for m in members):
            continue
        ordered = sorted(members, key=lambda m: GRADIENT_ROLES.index(gradient_form(m.core).role))
        first, rest = ordered[0], ordered[1:]
        reads = tuple(sorted({name for m in members for name in m.reads}))
        sides = tuple(SideOutput(m.output, m.term, m.axes, m.dtype) for m in rest)
        trace = tuple(dict.fromkeys(rule for m in ordered for rule in m.trace))
        joined = replace(first, reads=reads, side_outputs=sides, trace=trace)
        between = [k for k in result[positions[0] : positions[-1]]
                   if all(k is not x for x in (*members, *moved))]  # fmt: skip
        result = [*result[: positions[0]], *between, joined, *moved, *result[positions[-1] + 1 :]]
    return result


def gradient_head_dim(form: Term) -> str | None:
    """The head-dim axis of a ``FlashAttentionGrad*`` form's gradient: the one free axis it has only
    through the operand read again (k for dq, q for dk, dO for dv); the batch, head and sequence
    axes come through q, k and dO as well. None where that is not one axis."""
    again = gradient_form(form).again
    dims = t.free_axes(form) - t.free_axes(t.replace(form, again, ("Num", 0.0)))
    return next(iter(dims)) if len(dims) == 1 else None


def gradients_head_dim_last(kernels: list[FusedKernel], outputs: frozenset[str]) -> list[FusedKernel]:
    """Each backward kernel's intermediate gradient buffer laid out with its head dim last (the rows
    a backward kernel writes), its readers' accesses permuted to match. The gradient of a view
    (``v.transpose(-2, -1)`` inside ``q @ k.T``, a matmul's operand) comes out over the view's axes,
    e.g. ``(B, H, D, S)``; the kernel that reads it back into place (a concatenation of q, k and v's
    gradients) reads it as well in either order. A graph output keeps its layout."""
    moved: dict[str, tuple[int, ...]] = {}  # buffer -> the old position of each new axis
    result = []
    for kernel in kernels:
        if kernel.kind == "flash_attention_backward" and kernel.term == kernel.core and kernel.output not in outputs \
                and kernel.buffer is None and not kernel.side_outputs:  # fmt: skip
            dim = gradient_head_dim(kernel.core)
            if dim is not None and dim in kernel.axes and kernel.axes[-1] != dim:
                order = tuple(i for i, a in enumerate(kernel.axes) if a != dim) + (kernel.axes.index(dim),)
                moved[kernel.output] = order
                kernel = replace(kernel, axes=tuple(kernel.axes[i] for i in order))
        result.append(kernel)
    if not moved:
        return result

    def permuted(term: Term) -> Term:
        for access in {s for s in t.subterms(term) if s[0] == "Tensor" and s[1] in moved}:
            items = t.ix_items(access[2])
            term = t.replace(term, access, t.access(access[1], (items[i] for i in moved[access[1]])))
        return term

    return [replace(k, term=permuted(k.term),
                    side_outputs=tuple(replace(s, term=permuted(s.term)) for s in k.side_outputs))
            if moved.keys() & set(k.reads) else k for k in result]  # fmt: skip


def _kv_axis_roles(k_read: StridedRead, dim: str, key: str, batch: str | None) -> tuple[str | None, str | None]:
    """(batch, head) axis names of a k read: of its axes other than the key and head dim, the
    head is the one it strides least (the K/V head); with one K/V head for every query head
    (multi-query attention) its one such axis is ``batch``, q's batch axis."""
    axes = sorted((atom[1] for atom in k_read.strides if atom[0] == "Ax" and atom[1] not in (dim, key)),
                  key=lambda a: -k_read.strides[t.ax(a)])  # fmt: skip
    if len(axes) > 2 or any(atom[0] != "Ax" for atom in k_read.strides):
        raise KernelError(f"flash attention backward: k ({k_read.tensor}) is not read per K/V head")
    if axes == [batch]:
        return batch, None
    return (axes[0] if len(axes) == 2 else None), (axes[-1] if axes else None)


def _layout(read: StridedRead, batch: str | None, head: str | None, seq: str, dim: str, role: str) -> OperandLayout:
    """An operand's (B, H, S, D) placement in its stored tensor; ``KernelError`` unless its
    head dim is contiguous and it varies along nothing else."""
    roles = {t.ax(a) for a in (batch, head, seq, dim) if a is not None}
    stray = [t.show(atom) for atom in read.strides if atom not in roles]
    if stray or read.strides.get(t.ax(dim)) != 1:
        raise KernelError(f"flash attention backward: {role} is read along {[t.show(a) for a in read.strides]}; "
                          f"expected (batch, head, {seq}, {dim}) with {dim} contiguous")  # fmt: skip

    def stride(name: str | None) -> int:
        return read.strides.get(t.ax(name), 0) if name is not None else 0

    return OperandLayout(read.shape, stride(batch), stride(head), stride(seq), read.offset)


def _output_layout(axes: tuple[str, ...], batch: str | None, head: str | None, seq: str, role: str) -> OperandLayout:
    """A gradient's placement in its row-major buffer over the kernel's ``axes``: the head dim is
    the one axis that is not batch, head or ``seq``, and must be the last."""
    shape = tuple(t.extent(a) for a in axes)
    strides, stride = {}, 1
    for axis, size in reversed(list(zip(axes, shape))):
        strides[axis] = stride
        stride *= size
    rest = [a for a in axes if a not in (batch, head, seq) and t.extent(a) > 1]
    if len(rest) != 1 or axes[-1] != rest[0]:
        raise KernelError(f"flash attention backward: {role} is written over {list(axes)}; expected its head dim last")
    return OperandLayout(shape, strides.get(batch, 0) if batch else 0, strides.get(head, 0) if head else 0,
                         strides[seq] if seq in strides else 0)  # fmt: skip


def attention_backward_problem(kernel: FusedKernel, shapes: Mapping[str, tuple[int, ...]],
                               dtypes: Mapping[str, str]) -> AttentionBackwardProblem:  # fmt: skip
    """The :class:`AttentionBackwardProblem` a (joined) backward kernel computes, or ``KernelError``."""
    outputs = [(kernel.output, kernel.term, kernel.axes), *((s.output, s.term, s.axes) for s in kernel.side_outputs)]
    forms = []
    for name, term, axes in outputs:
        if term[0] not in ROLE_OF_FORM:
            raise KernelError(f"flash attention backward: {name} computes more than its gradient ({t.show(term)[:200]})")
        forms.append((name, gradient_form(term), axes))
    keys = {_attention_key(form) for _, form, _ in forms}
    if len(keys) != 1:
        raise KernelError(f"flash attention backward: the gradients of {[n for n, _, _ in forms]} are of different attentions")
    by_role = {form.role: (name, form, axes) for name, form, axes in forms}
    if len(by_role) != len(forms):
        raise KernelError("flash attention backward: one gradient written twice")
    _, lead, _ = next(by_role[r] for r in GRADIENT_ROLES if r in by_role)
    values = next((f.v for _, f, _ in forms if f.v is not None), lead.k)  # dv alone reads no v
    flash = ("FlashAttention", lead.key, lead.n_keys, lead.dim, lead.n_dim, lead.q, lead.k, values, lead.scale, lead.mask)
    attention = attention_problem(flash, shapes, dtypes)
    if attention.shares_kv_head:
        raise KernelError("flash attention backward: k or v is one head shared by the K/V heads (its gradient sums "
                          "them all; valid: k and v per K/V head)")
    q_read, k_read = _flash_read(lead.q, "q", shapes), _flash_read(lead.k, "k", shapes)
    batch, head, query = query_axis_roles(q_read, k_read, lead.dim, lead.key, t.soft_capped(lead.mask)[1])
    if query is None:
        raise KernelError("flash attention backward: one query row (valid: a query axis)")
    do_read = _flash_read(lead.grad_output, "dO", shapes)
    value_dim = next(iter(set(t.free_axes(lead.grad_output)) - {a for a in (batch, head, query) if a}), None)
    if value_dim is None:
        raise KernelError("flash attention backward: dO has no head dim")
    grad_output_layout = _layout(do_read, batch, head, query, value_dim, "dO")
    if dtypes[lead.grad_output[1]] != attention.dtype:
        raise KernelError(f"flash attention backward: dO is {dtypes[lead.grad_output[1]]}, q {attention.dtype}")
    gradients = []
    for role in GRADIENT_ROLES:
        if role not in by_role:
            continue
        name, form, axes = by_role[role]
        if dtypes.get(name, attention.dtype) != attention.dtype:
            raise KernelError(f"flash attention backward: {role} is stored as {dtypes[name]}, q is {attention.dtype}")
        if role == "dq":
            layout = _output_layout(axes, batch, head, query, role)
        else:  # over the K/V heads (a grouped form has summed its query heads)
            kv_batch, kv_head = _kv_axis_roles(_flash_read(form.k, "k", shapes), form.dim, form.key, batch)
            layout = _output_layout(axes, kv_batch, kv_head, form.key, role)
        gradients.append(GradientOutput(role, name, layout))
    return AttentionBackwardProblem(replace(attention, out=kernel.output), lead.grad_output[1], grad_output_layout,
                                    tuple(gradients))  # fmt: skip


@dataclass(frozen=True)
class SavedAttention:
    """An attention whose output and rows' log-sum-exp two saved inputs hold: ``attention`` is the
    forward's problem (its ``out`` the saved output), ``scores`` that of the log-sum-exp's scores (v
    unset: k in its place), ``lse`` the saved log-sum-exp's name and where its rows lie."""

    attention: AttentionProblem
    scores: AttentionProblem
    lse: str
    lse_layout: OperandLayout


def _without_output(a: AttentionProblem, values: bool = True) -> tuple:
    """What an attention computes apart from where its output goes (``values=False``: its scores alone)."""
    reads = tuple(a.layout(role) for role in (("q", "k", "v") if values else ("q", "k")))
    kept = replace(a, out="", layouts=(), out_dtype="", scale=scale_key(a.scale))
    return replace(kept, v="", value_dim=0) if not values else kept, reads


def saved_attentions(extracted: Mapping[str, Term], root_axes: Mapping[str, tuple[str, ...]],
                     shapes: Mapping[str, tuple[int, ...]], dtypes: Mapping[str, str]) -> list[SavedAttention]:  # fmt: skip
    """The attentions whose output and log-sum-exp saved inputs hold, from the derivation of the
    values they hold (``extracted``: each saved input's name -> the cheapest term of its value).
    A flash-attention output and an ``AttentionLse`` (in fp32, perhaps cast to it) of the same
    scores pair up."""
    outputs, statistics = [], []
    for name, term in extracted.items():
        body = term[2] if term[0] == "Cast" and term[1] == "fp32" else term
        try:
            if body[0] == "FlashAttention" and term[0] != "Cast" and dtypes.get(name) in (None, dtypes.get(body[5][1])):
                problem = attention_problem(body, shapes, dtypes, root_axes[name])
                outputs.append(replace(problem, out=name))
            elif body[0] == "AttentionLse" and dtypes.get(name) == "fp32":
                scores = attention_problem(lse_as_flash(body), shapes, dtypes)
                layout = lse_output(SideOutput(name, body, root_axes[name]), shapes).layout
                statistics.append((name, scores, layout))
        except KernelError:
            continue
    return [SavedAttention(o, scores, lse, layout) for o in outputs for lse, scores, layout in statistics
            if _without_output(o, values=False) == _without_output(scores, values=False)]  # fmt: skip


def saved_statistics(problem: AttentionBackwardProblem, saved: list[SavedAttention]) -> SavedStatistics | None:
    """The saved output and log-sum-exp of ``problem``'s attention, if ``saved`` holds them."""
    for candidate in saved:
        if _without_output(candidate.attention) == _without_output(problem.attention):
            o = candidate.attention
            return SavedStatistics(o.out, o.layout("o"), candidate.lse, candidate.lse_layout)
    return None
