"""From the primitive graph to index-notation terms (the e-graph's border).

Each graph output of rank ``r`` gets axes ``i0 .. i{r-1}``; translation walks down from
the output carrying one index term per positional axis. Views vanish: ``permute``
reorders the index terms, ``expand`` drops the broadcast ones, ``reshape`` splits and
merges them with ``//``, ``%`` and ``a·c + b``, ``slice`` offsets them, ``pad`` guards
them. A reduction binds a name for the axis it removes.

Every axis name carries its extent (``i2:4096``), so two axes of different lengths never
share a name; an axis of extent 1 is indexed by the literal 0. Bound names are chosen so that the same tensor gets the same term
wherever it is used:
a reduction whose result is broadcast back along an axis (``x.max(-1, keepdim=True)``
subtracted from ``x``) reuses that axis's name — lexical scoping makes this sound, and
``softmax`` rows and norms then read ``x[i, j]`` identically inside and outside the
reduction. Otherwise it takes the first ``r0:n, r1:n, ...`` not free in its result.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field

from cherenkov.graph import Graph
from cherenkov.graph.ops import Node
from cherenkov.rewrites import terms as t
from cherenkov.rewrites.terms import Term

Hint = tuple[str, int]  # an axis name dropped by an enclosing expand, and its extent


@dataclass(frozen=True)
class Lowered:
    """The term of each root: the graph's outputs, preceded (in dependency order) by the
    intermediate tensors the graph uses in more than one way (see :func:`lower`).

    A root's axes are named ``i0:n0 .. i{r-1}:n{r-1}``. A term is a function of its free
    axis names; bound axes carry their extents in their binders.
    """

    roots: dict[str, Term]
    root_axes: dict[str, tuple[str, ...]]
    outputs: tuple[str, ...]
    input_dtypes: dict[str, str]
    input_shapes: dict[str, tuple[int, ...]]
    root_dtypes: dict[str, str] = field(default_factory=dict)
    """Each root's dtype: that of the graph node it holds."""
    inlined: dict[str, Term] = field(default_factory=dict)
    """For a root whose term reads a :attr:`recomputed` intermediate: the same value with each of
    them computed in place (an equal alternative the e-graph holds in the root's e-class, so that
    identities can see across a stored intermediate: an attention gradient's probabilities and
    score gradient, which its three gradients read transposed). See :func:`lower`."""
    recomputed: tuple[tuple[str, ...], ...] = ()
    """The intermediate roots the :attr:`inlined` alternatives compute where they are read, in
    groups (:func:`recomputed_intermediates`: an attention's probabilities, row sums and score
    gradient). Every other intermediate (a projection q, k and v are slices of, dO) stays a read
    in them too."""
    nodes: dict[str, int] = field(default_factory=dict)
    """Each root's graph node (an output naming another output's node: that node)."""

    @property
    def buffer_dtype(self) -> str:
        """Dtype of intermediate buffers: that of the inputs when they agree; else the 16-bit
        float dtype holding most of the inputs' elements (a model's weights and activations,
        beside a Llama layer's float32 rotary frequencies), as eager PyTorch stores them; else
        fp32."""
        dtypes = set(self.input_dtypes.values())
        if len(dtypes) == 1:
            return dtypes.pop()
        elements: dict[str, int] = {}
        for name, dtype in self.input_dtypes.items():
            elements[dtype] = elements.get(dtype, 0) + math.prod(self.input_shapes[name])
        most = max(elements, key=lambda d: elements[d])
        return most if most in ("bf16", "fp16") else "fp32"

    def shape(self, root: str) -> tuple[int, ...]:
        return tuple(t.extent(a) for a in self.root_axes[root])

    def stored_dtype(self, name: str) -> str:
        """The dtype tensor ``name`` is stored in: an input's; a root's, its graph node's (what a
        caller, or inductor after a region, reads an output as); else, an intermediate buffer a
        kernel writes, :attr:`buffer_dtype`."""
        return self.input_dtypes.get(name) or self.root_dtypes.get(name) or self.buffer_dtype


def root_axes(shape: tuple[int, ...]) -> tuple[str, ...]:
    return tuple(f"i{k}:{size}" for k, size in enumerate(shape))


def root_indices(names: tuple[str, ...]) -> tuple[Term, ...]:
    """Index terms for a root's axes: the name, or 0 for an axis of extent 1."""
    return tuple(t.ax(n) if t.extent(n) > 1 else t.ix_lit(0) for n in names)


def constant_nodes(graph: Graph) -> list[bool]:
    """Per node: whether it is a constant, or a view or cast of one. Such a node is read as
    its literal wherever it is used, also where it is stored (an output): ``where(m > −∞, ·, 0)``
    must meet the literals ``−∞`` and ``0`` that the identities are stated with, not a tensor
    that happens to hold them (a region that also hands its constants to later ops)."""
    flags: list[bool] = []
    for node in graph.nodes:
        flags.append(node.op == "constant" or (node.op in CONSTANT_PRESERVING and flags[node.inputs[0]]))
    return flags


class _Lowering:
    """One lowering pass; nodes in ``split`` are read as stored tensors of those names."""

    def __init__(self, graph: Graph, split: dict[int, str], limit: int | None = None) -> None:
        self.graph = graph
        self.split = split
        self.limit = limit  # memoised subterms past which define() gives up (raises _TooLarge)
        self.memo: dict[tuple, Term] = {}
        # each node's indexings: (index terms, the same with bound axes named by binder depth)
        self.uses: dict[int, set[tuple[tuple[Term, ...], tuple[Term, ...]]]] = {}
        self.reads: dict[int, set[tuple[tuple[Term, ...], tuple[Term, ...]]]] = {}  # the same, of stored nodes
        self.bound: list[str] = []  # the axis names the enclosing reductions bind, innermost last
        self.reduces_below = self._reductions_below()
        self.constant = constant_nodes(graph)

    def _reductions_below(self) -> list[bool]:
        flags: list[bool] = []
        for node in self.graph.nodes:
            flags.append(node.op in ("sum_reduce", "max_reduce") or any(flags[i] for i in node.inputs))
        return flags

    def lower(self, index: int, ixs: tuple[Term, ...], hints: tuple[Hint, ...]) -> Term:
        if index in self.split and not self.constant[index]:
            self.reads.setdefault(index, set()).add((ixs, tuple(self._canonical(ix) for ix in ixs)))
            return t.access(self.split[index], ixs)
        return self.define(index, ixs, hints)

    def define(self, index: int, ixs: tuple[Term, ...], hints: tuple[Hint, ...] = ()) -> Term:
        """The term computing node ``index`` (not a read of its stored tensor)."""
        if not self.reduces_below[index]:
            hints = ()
        self.uses.setdefault(index, set()).add((ixs, tuple(self._canonical(ix) for ix in ixs)))
        key = (index, ixs, hints)
        if key not in self.memo:
            if self.limit is not None and len(self.memo) >= self.limit:
                raise _TooLarge
            self.memo[key] = self._lower(self.graph.node(index), ixs, hints)
        return self.memo[key]

    def _canonical(self, ix: Term) -> Term:
        """``ix`` with each axis an enclosing reduction binds named by its binder's depth (see
        :func:`_one_indexing`)."""
        if ix[0] == "Ax":
            if ix[1] in self.bound:
                return ("Ax", f"#{self.bound[::-1].index(ix[1])}")
            return ix
        return (ix[0], *(self._canonical(a) if isinstance(a, tuple) else a for a in ix[1:]))

    def needs_own_tensor(self) -> int | None:
        """The last compute node used under several indexings or a reshaped one, if any:
        it must be stored so that every use reads one tensor."""
        for index in sorted(self.uses, reverse=True):
            if self.graph.node(index).op not in STORED_OR_VIEW and index not in self.split \
                    and _needs_own_tensor(self.uses[index]):  # fmt: skip
                return index
        return None

    def _operand(self, node: Node, position: int, ixs: tuple[Term, ...], hints: tuple[Hint, ...]) -> Term:
        return self.lower(node.inputs[position], ixs, hints)

    def _lower(self, node: Node, ixs: tuple[Term, ...], hints: tuple[Hint, ...]) -> Term:
        op, attrs = node.op, node.attrs
        if op == "input":
            return t.access(attrs[0], ixs)
        if op == "constant":
            value = attrs[0]
            return ("Flag", value) if node.dtype == "bool" else ("Num", float(value))
        if op == "iota":
            return ("Iota", ixs[0])
        if op == "cast":
            return ("Cast", attrs[0], self._operand(node, 0, ixs, hints))
        if op in ("contiguous",):
            return self._operand(node, 0, ixs, hints)
        if op in UNARY_TERMS:
            return (UNARY_TERMS[op], self._operand(node, 0, ixs, hints))
        if op in BINARY_TERMS:
            # operands in a list, not a generator: a generator resumed from C costs a C stack
            # frame per op, and C recursion has a fixed limit a deep model's graph exceeds
            return (BINARY_TERMS[op], *[self._operand(node, p, ixs, hints) for p in range(2)])
        if op == "where":
            return ("Where", *[self._operand(node, p, ixs, hints) for p in range(3)])
        if op in ("sum_reduce", "max_reduce"):
            return self._reduction(node, ixs, hints)
        if op == "permute":
            inner: list[Term] = [t.ix_lit(0)] * len(ixs)
            for position, source in enumerate(attrs[0]):
                inner[source] = ixs[position]
            return self._operand(node, 0, tuple(inner), hints)
        if op == "expand":
            return self._expand(node, ixs, hints)
        if op == "reshape":
            source = self.graph.node(node.inputs[0]).shape
            return self._operand(node, 0, reshape_indices(source, node.shape, ixs), hints)
        if op == "slice":
            starts = attrs[0]
            return self._operand(node, 0, tuple(t.ix_add(ix, lo) for ix, lo in zip(ixs, starts)), hints)
        if op == "pad":
            return self._pad(node, ixs, hints)
        raise AssertionError(f"no lowering for primitive {op}")  # every primitive is handled above

    def _reduction(self, node: Node, ixs: tuple[Term, ...], hints: tuple[Hint, ...]) -> Term:
        axis = node.attrs[0]
        extent = self.graph.node(node.inputs[0]).shape[axis]
        taken = set().union(*(t.ix_names(ix) for ix in ixs)) if ixs else set()
        name = next((h for h, size in reversed(hints) if size == extent and h not in taken), None)
        if name is None:
            name = next(f"r{k}:{extent}" for k in range(len(taken) + 1) if f"r{k}:{extent}" not in taken)
        remaining = tuple(h for h in hints if h[0] != name)
        self.bound.append(name)
        try:
            body = self._operand(node, 0, ixs[:axis] + (t.ax(name),) + ixs[axis:], remaining)
        finally:
            self.bound.pop()
        return ("Sum" if node.op == "sum_reduce" else "Max", name, extent, body)

    def _expand(self, node: Node, ixs: tuple[Term, ...], hints: tuple[Hint, ...]) -> Term:
        source = self.graph.node(node.inputs[0]).shape
        lead = len(node.shape) - len(source)
        dropped = [(ixs[p], node.shape[p]) for p in range(lead)]
        inner = []
        for axis, size in enumerate(source):
            if size == 1 and node.shape[lead + axis] != 1:
                dropped.append((ixs[lead + axis], node.shape[lead + axis]))
                inner.append(t.ix_lit(0))
            else:
                inner.append(ixs[lead + axis])
        new_hints = tuple((ix[1], size) for ix, size in dropped if ix[0] == "Ax")
        return self._operand(node, 0, tuple(inner), hints + new_hints)

    def _pad(self, node: Node, ixs: tuple[Term, ...], hints: tuple[Hint, ...]) -> Term:
        pads, value = node.attrs
        source = self.graph.node(node.inputs[0]).shape
        inner = tuple(t.ix_add(ix, -lo) for ix, (lo, _) in zip(ixs, pads))
        term = self._operand(node, 0, inner, hints)
        for ix, (lo, hi), size in zip(ixs, pads, source):
            if lo or hi:
                term = ("PadAxis", ix, lo, size, float(value), term)
        return term


def _needs_own_tensor(uses: set[tuple[tuple[Term, ...], tuple[Term, ...]]]) -> bool:
    """Whether a node read with these indexings must be stored: under several, or a reshaped one
    that does more than merge whole axes into one of its leading axes (Bloom's ``(batch·head)``
    scores read as ``batch, head``, split back by the reshapes below them; an LM head's ``B·T``
    rows). Its last axis must be read plain: a projection read as heads (``h·D + d``) is stored,
    a plain matrix the attention reads through its strides."""
    return not _one_indexing(uses) or not all(
        ixs[-1][0] in ("Ax", "IxLit") and all(_merged_axes(ix) for ix in ixs[:-1]) for ixs, _ in uses if ixs)


def _merged_axes(ix: Term) -> bool:
    """Whether an index term is an axis, a literal, or axes merged whole (``a·n + b`` with ``b`` an
    axis of extent ``n``)."""
    if ix[0] in ("Ax", "IxLit"):
        return True
    return ix[0] == "IxLin" and ix[3][0] == "Ax" and t.extent(ix[3][1]) == ix[2] and _merged_axes(ix[1])


def _one_indexing(uses: set[tuple[tuple[Term, ...], tuple[Term, ...]]]) -> bool:
    """Whether a node's uses index it one way: linked by equal index terms (a softmax's
    exponentials inside and outside their row sum, the sum rebinding the row's axis name) or by
    index terms that differ only in what their reductions call an axis (the q·k product of an
    attention's output and of its log-sum-exp)."""
    groups: list[tuple[set, set]] = []
    for raw, canonical in uses:
        linked = [g for g in groups if raw in g[0] or canonical in g[1]]
        merged = ({raw}, {canonical})
        for group in linked:
            groups.remove(group)
            merged[0].update(group[0])
            merged[1].update(group[1])
        groups.append(merged)
    return len(groups) <= 1


class _TooLarge(Exception):
    """An inlined alternative outgrew its limit (see :data:`INLINE_LIMIT`)."""


UNARY_TERMS = {"exp2": "Exp2", "log2": "Log2", "sin": "Sin", "sqrt": "Sqrt", "recip": "Recip", "neg": "Neg"}
BINARY_TERMS = {"add": "Add", "mul": "Mul", "mod": "Mod", "less_than": "Lt", "maximum": "Maximum"}


def reshape_indices(source: tuple[int, ...], target: tuple[int, ...], ixs: tuple[Term, ...]) -> tuple[Term, ...]:
    """Index terms of ``source`` axes given index terms of the reshaped ``target`` axes.

    Axes are grouped into runs with equal element counts; within a run the target
    indices form a linear index (``a·c + b``) that is split again with ``//`` and ``%``.
    """
    result: list[Term] = []
    si = ti = 0
    while si < len(source) or ti < len(target):
        group_s, group_t = [si], [ti]
        count_s = source[si] if si < len(source) else 1
        count_t = target[ti] if ti < len(target) else 1
        while count_s != count_t:
            if count_s < count_t:
                si += 1
                group_s.append(si)
                count_s *= source[si]
            else:
                ti += 1
                group_t.append(ti)
                count_t *= target[ti]
        linear = t.ix_lit(0)
        for axis in group_t:
            if axis < len(target) and target[axis] != 1:
                linear = t.ix_lin(linear, target[axis], ixs[axis])
        for axis in group_s:
            if axis >= len(source):
                continue
            stride = math.prod(source[a] for a in group_s if axis < a < len(source))
            if source[axis] == 1:
                result.append(t.ix_lit(0))
            else:
                result.append(t.ix_mod(t.ix_div(linear, stride), source[axis]) if stride * source[axis] != count_s
                              else t.ix_div(linear, stride))
        si, ti = max(group_s) + 1, max(group_t) + 1
    return tuple(result)


CONSTANT_PRESERVING = frozenset({"cast", "contiguous", "permute", "expand", "reshape", "slice"})
"""Ops whose result is a constant when their operand is one."""

STORED_OR_VIEW = frozenset({"input", "constant", "iota", "permute", "expand", "reshape", "slice", "pad", "contiguous"})


INLINE_LIMIT = 400
"""New subterms one inlined alternative may add to the e-graph; a larger one is not offered."""

FRAMES_PER_NODE = 8
"""Python frames the lowering's walk spends per graph node it passes (define, _lower,
_operand and lower, with a margin)."""


@contextlib.contextmanager
def recursion_for(graph: Graph) -> Iterator[None]:
    """Python's recursion limit raised, for the block, to what a walk down ``graph``'s longest
    chain may take: a whole model's graph (a dozen decoder layers) is thousands of ops deep."""
    previous = sys.getrecursionlimit()
    sys.setrecursionlimit(max(previous, FRAMES_PER_NODE * len(graph.nodes) + 1000))
    try:
        yield
    finally:
        sys.setrecursionlimit(previous)


def lower(graph: Graph) -> Lowered:
    """Translate every output of ``graph`` into an index-notation term.

    A computed tensor used under two different indexings (the output of one attention
    layer read as q, k and v of the next) or through a reshape that splits its axes becomes
    a root of its own, read by its consumers like an input: the e-graph holds each such
    tensor once, and kernels store it once. One read only through merges of whole axes into
    its leading axes (Bloom's ``(batch·head)`` scores viewed as ``batch, head``) is computed
    where it is read: the reshapes below it split the merge back. An output naming the node
    another output names is a root that copies the first one's tensor (each output its own
    buffer).
    """
    outputs = {name: tensor.id for name, tensor in graph.outputs.items()}
    taken = set(graph.inputs) | set(outputs)
    split: dict[int, str] = {}
    for name, index in outputs.items():
        split.setdefault(index, name)
    copies = {name: split[index] for name, index in outputs.items() if split[index] != name}
    split.update(_intermediates(graph, split, taken))
    lowering = _Lowering(graph, split)
    roots: dict[str, Term] = {}
    axes: dict[str, tuple[str, ...]] = {}
    with recursion_for(graph):
        for index, name in sorted(split.items()):
            axes[name] = root_axes(graph.node(index).shape)
            roots[name] = lowering.define(index, root_indices(axes[name]))
        for name, original in copies.items():  # an output naming a node another output names: a copy
            axes[name] = axes[original]
            roots[name] = t.access(original, root_indices(axes[name]))
    unstored = lowering.needs_own_tensor()
    if unstored is not None:
        raise AssertionError(f"node {unstored} of {graph.name!r} is read under several indexings but not stored")
    inputs = graph.inputs
    recomputed = recomputed_intermediates(graph, split, roots, axes)
    if not graph.is_gradient:
        recomputed = tuple(g for g in recomputed if _shared_probabilities(g, roots))
    return Lowered(
        roots=roots,
        root_axes=axes,
        outputs=tuple(graph.outputs),
        input_dtypes={n: x.dtype for n, x in inputs.items()},
        input_shapes={n: x.shape for n, x in inputs.items()},
        root_dtypes={**{name: graph.node(index).dtype for index, name in split.items()},
                     **{name: graph.outputs[name].dtype for name in copies}},  # fmt: skip
        inlined=_inlined(graph, split, roots, axes, tuple(n for group in recomputed for n in group)),
        recomputed=recomputed,
        nodes={**{name: index for index, name in split.items()}, **{name: outputs[name] for name in copies}},
    )


def _intermediates(graph: Graph, outputs: dict[int, str], taken: set[str]) -> dict[int, str]:
    """The intermediate tensors ``graph`` stores (node -> name, ``t0, t1, ...`` skipping ``taken``,
    from the last node back): each node its readers use under several indexings or a reshaped
    one, given which of the nodes after it are stored.

    Whether a node needs a tensor of its own depends only on which of its descendants are stored
    (its readers' terms reach it through them). So every computing node starts stored, undecided;
    each round decides the undecided nodes with no undecided descendant, by the indexings the
    terms of the stored nodes that reach them read them with (lowering only those terms, which
    the stored nodes around keep small), and stores those that need it. This stores what storing
    the last node that needs a tensor, one lowering of the whole graph at a time, stores — which
    took a gradient graph of a few layers minutes, its first lowerings inlining nearly everything."""
    readers: dict[int, list[int]] = {}
    for index, node in enumerate(graph.nodes):
        for source in node.inputs:
            readers.setdefault(source, []).append(index)
    constant = constant_nodes(graph)
    undecided = {index for index, node in enumerate(graph.nodes)
                 if node.op not in STORED_OR_VIEW and index not in outputs}  # fmt: skip
    stored: set[int] = set()
    while undecided:
        # a constant's view or cast is read as its literal, stored or not: its uses decide it
        split = {**outputs, **{index: f"#{index}" for index in stored | undecided if not constant[index]}}
        decided = undecided - graph.ancestors(source for index in undecided for source in graph.node(index).inputs)
        lowering = _Lowering(graph, split)
        with recursion_for(graph):
            for index in sorted(_stored_readers(decided, readers, split, constant)):
                lowering.define(index, root_indices(root_axes(graph.node(index).shape)))
        for index in decided:
            if _needs_own_tensor((lowering.uses if constant[index] else lowering.reads).get(index, set())):
                stored.add(index)
        undecided -= decided
    names: dict[int, str] = {}
    for index in sorted(stored, reverse=True):
        names[index] = fresh_name("t", taken)
    return names


def fresh_name(stem: str, taken: set[str], *, bare_first: bool = False) -> str:
    """The first of ``stem`` (when ``bare_first``), ``stem0`` (else), ``stem1``, ``stem2``, ...
    that is not in ``taken``; added to it."""
    numbered = (f"{stem}{k}" for k in itertools.count(1 if bare_first else 0))
    name = next(n for n in itertools.chain([stem] if bare_first else [], numbered) if n not in taken)
    taken.add(name)
    return name


def _stored_readers(nodes: set[int], readers: dict[int, list[int]], split: dict[int, str],
                    constant: list[bool]) -> set[int]:  # fmt: skip
    """The stored nodes whose terms read ``nodes``: their readers, through the readers of those
    computed where they are read."""
    found: set[int] = set()
    seen, stack = set(nodes), list(nodes)
    while stack:
        for reader in readers.get(stack.pop(), ()):
            if reader in seen:
                continue
            seen.add(reader)
            if reader in split:
                found.add(reader)
            if reader not in split or constant[reader]:  # a constant is computed where it is read
                stack.append(reader)
    return found


EXPONENTIALS = frozenset({"Exp2", "Exp"})
"""The constructors of a softmax's exponentials (base 2 or e)."""


def recomputed_intermediates(graph: Graph, split: dict[int, str], roots: dict[str, Term],
                             axes: dict[str, tuple[str, ...]]) -> tuple[tuple[str, ...], ...]:  # fmt: skip
    """The intermediate roots (those the outputs do not name) that an attention's streaming forms
    may recompute rather than read stored, in groups (one attention's each).

    The softmax's parts first: an intermediate that sums exponentials alone (the row sums, the
    probabilities), the exponentials it sums, or one that exponentiates scores less their row
    maximum; a GELU's or SiLU's exponentials are none of these. An elementwise function of the
    inputs (``q·c``, a rounding of q, a norm's normalised input) is recomputed too, but nothing
    grows from it (else a model's residual stream, read at its own indices, would join every
    layer's attention in one group). Then, to a fixed point: one that reads recomputed
    intermediates and nothing else (no input either: in a backward graph of its own,
    AOTAutograd's, q is an input, and the product of the score gradient with it is dk), one that
    reads a recomputed one element by element at its own indices (a score gradient from stored
    probabilities), and one that a recomputed one reads so (the scores under the exponential). Last, a gradient per query head that its readers only sum over the GQA group
    (the grouped form is derived where each sum reads it). One that reduces a recomputed
    intermediate together with another tensor (attention's output, read by the output
    projection's gradient; q's gradient, read by the concatenation into the projection's) is what
    a streaming form computes: it stays a read, as does every other intermediate."""
    outputs = set(graph.outputs)
    order = [name for _, name in sorted(split.items()) if name not in outputs]  # every root after those it reads
    subterms = {name: list(t.subterms(term)) for name, term in roots.items()}
    reads = {name: [s for s in subterms[name] if s[0] == "Tensor" and s[1] in order] for name in order}
    readers: dict[str, set[str]] = {}
    for reader, parts in subterms.items():
        for s in parts:
            if s[0] == "Tensor" and s[1] in reads:
                readers.setdefault(s[1], set()).add(reader)

    def summed_by_its_readers(name: str) -> bool:
        """Whether the roots that read ``name`` read it only as the body of a sum over one axis (a
        GQA group's): the one root that sums it, or those that sum it again where they read it
        twice (RoPE's backward, a product with the cosines and one with the sines)."""
        for reader in readers.get(name) or ():
            term = roots[reader]
            sums = [s for s in subterms[reader] if s[0] == "Sum" and s[3][0] == "Tensor" and s[3][1] == name]
            for summed in sums:
                term = t.replace(term, summed, ("Num", 0.0))
            if not sums or any(s[0] == "Tensor" and s[1] == name for s in t.subterms(term)):
                return False
        return bool(readers.get(name))

    def at_own_indices(reader: str, read: Term) -> bool:
        return t.free_axes(read) <= set(axes[reader])

    exponential = {name for name in order if any(s[0] in EXPONENTIALS for s in subterms[name])}

    def softmax_parts(name: str) -> set[str]:
        """``name`` and the intermediate it sums, where its term normalises or shifts exponentials:
        a sum of exponentials alone (the row sums), or an exponential of an argument less a row
        maximum; a GELU's or SiLU's exponentials are neither."""
        parts = set()
        for s in subterms[name]:
            body = s[3] if s[0] == "Sum" else None
            if body is not None and body[0] in EXPONENTIALS:
                parts.add(name)
            elif body is not None and body[0] == "Tensor" and body[1] in exponential:
                parts |= {name, body[1]}
            elif s[0] in EXPONENTIALS and any(x[0] == "Max" for x in t.subterms(s[1])):
                parts.add(name)
        return parts

    recomputed: set[str] = set()  # the softmax's: what the rules below grow from
    leaves: set[str] = set()  # elementwise functions of the inputs: no reader grows from them
    for name in order:
        recomputed |= softmax_parts(name)
        if not (reads[name] or any(s[0] in t.BINDERS for s in subterms[name])):  # elementwise, of the inputs
            leaves.add(name)
    leaves -= recomputed
    recomputed |= leaves
    while True:
        grown = {name for name in order if name not in recomputed and (
            (reads[name] and {s[1] for s in subterms[name] if s[0] == "Tensor"} <= recomputed - leaves)
            or any(s[1] in recomputed - leaves and at_own_indices(name, s) for s in reads[name])
            or any(s[1] == name and at_own_indices(other, s) for other in recomputed for s in reads[other]))}  # fmt: skip
        if not grown:
            break
        recomputed |= grown
    grouped = {name for name in order if name not in recomputed and summed_by_its_readers(name)
               and any(s[1] in recomputed for s in reads[name])}  # fmt: skip
    chosen = [name for name in order if name in recomputed | grouped]
    tensors = {name: {s[1] for s in parts if s[0] == "Tensor"} for name, parts in subterms.items()}
    return _linked_groups(chosen, tensors, set(order))


def _shared_probabilities(group: tuple[str, ...], roots: dict[str, Term]) -> bool:
    """Whether two roots outside ``group`` (a forward graph's softmax) each sum a member over its
    row (its last axis): one softmax read by two products with values under different indexings
    (DiffLlama's two attentions sharing q, k and the mask, their outputs concatenated), stored
    unless computed where each reads it."""
    for name in group:
        if sum(_sums_rows_of(name, term) for reader, term in roots.items() if reader not in group) >= 2:
            return True
    return False


def _sums_rows_of(name: str, term: Term) -> bool:
    """Whether ``term`` sums the tensor ``name`` over its last axis (a product of probabilities with values)."""
    for s in t.subterms(term):
        if s[0] in ("Sum", "Contract"):
            row = t.ax(s[1])
            if any(r[0] == "Tensor" and r[1] == name and t.ix_items(r[2])[-1] == row for r in t.subterms(s)):
                return True
    return False


def _linked_groups(names: list[str], tensors: dict[str, set[str]],
                   intermediates: set[str]) -> tuple[tuple[str, ...], ...]:  # fmt: skip
    """``names`` in groups (in their order): two are linked where one reads the other, a root reads
    both (``tensors``: the tensors each root reads), or both read one of the ``intermediates`` (the
    projection q and k are slices of)."""
    parent = {name: name for name in names}

    def find(name: str) -> str:
        while parent[name] != name:
            name = parent[name]
        return name

    def link(linked: list[str]) -> None:
        members = [name for name in linked if name in parent]
        for other in members[1:]:
            parent[find(other)] = find(members[0])

    for name in names:
        link([name, *sorted(tensors[name])])
    for read in tensors.values():
        link(sorted(read))
    for first, second in itertools.combinations(names, 2):
        if tensors[first] & tensors[second] & intermediates:
            link([first, second])
    groups: dict[str, list[str]] = {}
    for name in names:
        groups.setdefault(find(name), []).append(name)
    return tuple(tuple(members) for members in groups.values())


def _inlined(graph: Graph, split: dict[int, str], roots: dict[str, Term], axes: dict[str, tuple[str, ...]],
             recomputed: tuple[str, ...]) -> dict[str, Term]:  # fmt: skip
    """Each root that reads a ``recomputed`` intermediate, lowered again with every recomputed one
    computed where it is read (reading an intermediate is the same as computing it there) and
    every other intermediate still read. Only gradient graphs (``ck.grad``'s, whose gradients
    read the forward's intermediates transposed; a whole model's layers too, each attention's
    intermediates a group) get ``recomputed`` ones, and an alternative adds at most
    ``INLINE_LIMIT`` new subterms: a forward graph is derived over its stored intermediates only
    (its e-graph stays small)."""
    if not recomputed:
        return {}
    named = {index: name for index, name in split.items() if name not in recomputed}
    inliner = _Lowering(graph, named)
    result: dict[str, Term] = {}
    with recursion_for(graph):
        for index, name in sorted(split.items()):
            if not any(s[0] == "Tensor" and s[1] in recomputed for s in t.subterms(roots[name])):
                continue
            inliner.limit = len(inliner.memo) + INLINE_LIMIT
            try:
                result[name] = inliner.define(index, root_indices(axes[name]))
            except _TooLarge:
                continue
    return result
