"""Index-notation terms: the Python side of the e-graph language.

A term is a tuple ``(constructor, *args)``; args are terms or literals (str, int, float,
bool). Tensor axes carry names (``Ax("i0")``), as in einsum: a permute renames axes, an
expand drops one, a reduction names the axis it removes. Index expressions (``IxDiv``,
``IxMod``, ``IxLin``, ``IxAdd``, ``IxLit``) express reshapes and slices of named axes.

``sexpr`` writes a term as egglog text; ``from_termdag`` reads one back from an egglog
extraction. Smart constructors (``ix_div``, ``ix_mod``, ``ix_lin``, ``ix_add``) keep
index expressions canonical at the border so equal indexings are equal terms.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Iterator
from typing import Any

from cherenkov.rewrites.language import EXPR_CONSTRUCTORS

Term = tuple


# ----------------------------------------------------------------------- index terms


def ax(name: str) -> Term:
    return ("Ax", name)


def ix_lit(value: int) -> Term:
    return ("IxLit", value)


def ix_add(ix: Term, offset: int) -> Term:
    """``ix + offset``."""
    if offset == 0:
        return ix
    if ix[0] == "IxAdd":
        return ix_add(ix[1], ix[2] + offset)
    if ix[0] == "IxLit":
        return ix_lit(ix[1] + offset)
    return ("IxAdd", ix, offset)


def ix_div(ix: Term, divisor: int) -> Term:
    """``ix // divisor``; ``(a·c + b) // c`` is ``a`` since ``0 <= b < c``, and ``(a·c + b) // (m·c)`` is
    ``a // m`` (a reshape's merged axes split again further out: timm's ``(B·W·H) // (W·H)``)."""
    if divisor == 1:
        return ix
    if ix[0] == "IxLin" and ix[2] == divisor:
        return ix[1]
    if ix[0] == "IxLin" and divisor % ix[2] == 0:
        return ix_div(ix[1], divisor // ix[2])
    if ix[0] == "IxLit":
        return ix_lit(ix[1] // divisor)
    return ("IxDiv", ix, divisor)


def ix_mod(ix: Term, modulus: int) -> Term:
    """``ix % modulus``; ``(a·c + b) % c`` is ``b``, and ``(a·c + b) % (m·c)`` is ``(a % m)·c + b``."""
    if modulus == 1:
        return ix_lit(0)
    if ix[0] == "IxLin" and ix[2] == modulus:
        return ix[3]
    if ix[0] == "IxLin" and modulus % ix[2] == 0:
        return ix_lin(ix_mod(ix[1], modulus // ix[2]), ix[2], ix[3])
    if ix[0] == "IxLit":
        return ix_lit(ix[1] % modulus)
    return ("IxMod", ix, modulus)


def ix_lin(outer: Term, stride: int, inner: Term) -> Term:
    """``outer·stride + inner`` with ``0 <= inner < stride``; undoes a div/mod split."""
    if outer == ix_lit(0):
        return inner
    if inner[0] == "IxMod" and outer[0] == "IxDiv" and inner[1:] == (outer[1], stride) and outer[2] == stride:
        return outer[1]
    return ("IxLin", outer, stride, inner)


def ix_list(ixs: Iterable[Term]) -> Term:
    """A cons list of index terms (egglog's ``IxList``)."""
    result: Term = ("INil",)
    for ix in reversed(list(ixs)):
        result = ("ICons", ix, result)
    return result


def ix_items(ixlist: Term) -> tuple[Term, ...]:
    items = []
    while ixlist[0] == "ICons":
        items.append(ixlist[1])
        ixlist = ixlist[2]
    return tuple(items)


def ix_names(ix: Term) -> set[str]:
    """Axis names an index term mentions."""
    if ix[0] == "Ax":
        return {ix[1]}
    return set().union(*(ix_names(a) for a in ix[1:] if isinstance(a, tuple)))


def access(name: str, ixs: Iterable[Term]) -> Term:
    """Element access ``name[ixs...]`` of a materialised tensor."""
    return ("Tensor", name, ix_list(ixs))


def tensor(name: str, *axes: str) -> Term:
    """``name[a, b, ...]`` indexed by plain axis names, e.g. ``tensor("q", "i:4", "d:8")``."""
    return access(name, (ax(a) for a in axes))


def extent(axis: str) -> int:
    """The extent an axis name carries: ``extent("i2:4096") == 4096``."""
    return int(axis.rsplit(":", 1)[1])


def soft_capped(mask: Term) -> tuple[float, Term]:
    """A flash-attention form's soft cap (0.0: none) and the mask applied after the cap."""
    if mask[0] == "SoftcapMask":
        return float(mask[1]), mask[2]
    return 0.0, mask


def with_soft_cap(cap: float, mask: Term) -> Term:
    """``mask`` applied after a soft cap ``cap`` (none when 0): :func:`soft_capped`'s inverse."""
    return ("SoftcapMask", cap, mask) if cap else mask


MASK_HEADS = frozenset({"NoMask", "CausalMask", "BiasMask", "CausalBiasMask"})
"""The flash-attention masks applied after any soft cap."""


def mask_causal_axis(mask: Term) -> Term | None:
    """The query index a flash-attention mask (after any soft cap) compares with the key, or None."""
    return mask[1] if mask[0] in ("CausalMask", "CausalBiasMask") else None


def mask_bias(mask: Term) -> Term | None:
    """The bias term a flash-attention mask (after any soft cap) adds to the scores, or None."""
    return mask[1] if mask[0] == "BiasMask" else mask[2] if mask[0] == "CausalBiasMask" else None


# ----------------------------------------------------------------------- traversal


def children(term: Term) -> Iterator[Term]:
    return (a for a in term[1:] if isinstance(a, tuple))


def subterms(term: Term) -> Iterator[Term]:
    """Every distinct subterm (pre-order, each once)."""
    seen: set[Term] = set()
    stack = [term]
    while stack:
        t = stack.pop()
        if t in seen:
            continue
        seen.add(t)
        yield t
        stack.extend(children(t))


def free_axes(term: Term, _memo: dict[Term, frozenset[str]] | None = None) -> frozenset[str]:
    """Axis names a term varies along (binders remove the axis they reduce)."""
    memo = {} if _memo is None else _memo
    if term in memo:
        return memo[term]
    head = term[0]
    if head in ("Ax", "IxLit", "IxAdd", "IxDiv", "IxMod", "IxLin"):
        result = frozenset(ix_names(term))
    else:
        constructor = CONSTRUCTORS.get(head)
        parts = []
        for position, arg in enumerate(term[1:]):
            if isinstance(arg, tuple):
                bound = constructor.bound_over(position) if constructor else ()
                parts.append(free_axes(arg, memo) - {term[1 + b] for b in bound})
        result = frozenset().union(*parts)
    memo[term] = result
    return result


CONSTRUCTORS = {c.name: c for c in EXPR_CONSTRUCTORS}
# Term positions of the axis names each binding constructor introduces.
BINDERS: dict[str, tuple[int, ...]] = {
    c.name: tuple(name + 1 for name, _ in c.binds) for c in EXPR_CONSTRUCTORS if c.binds
}


def rename_free_axis(term: Term, old: str, new: str) -> Term:
    """``term`` with its free axis ``old`` called ``new``: every ``Ax old`` outside a binder of
    ``old`` (a sum over a bound axis of the same name keeps it)."""
    if term[0] == "Ax":
        return ax(new) if term[1] == old else term
    constructor = CONSTRUCTORS.get(term[0])
    parts: list[Any] = []
    for position, arg in enumerate(term[1:]):
        shadowed = constructor is not None and any(term[1 + b] == old for b in constructor.bound_over(position))
        parts.append(rename_free_axis(arg, old, new) if isinstance(arg, tuple) and not shadowed else arg)
    return (term[0], *parts)


def axis_names(term: Term) -> frozenset[str]:
    """Every axis name ``term`` mentions, free or bound."""
    names = set()
    for sub in subterms(term):
        if sub[0] == "Ax":
            names.add(sub[1])
        constructor = CONSTRUCTORS.get(sub[0])
        for position, _ in constructor.binds if constructor else ():
            names.add(sub[1 + position])
    return frozenset(names)


def binders_named_by_count(term: Term) -> Term:
    """``term`` with each axis its head binds renamed, where the name's extent is not the count of
    entries it binds, to a fresh name of that extent. Alpha-renaming changes no value; it keeps an
    operand read under the binder, when stored over its free axes, as wide as the bound range (a
    concatenation's output axis, 64 wide, can name a head dim of 32 that a flash form binds: its q
    copied 64 wide would read past q's rows)."""
    constructor = CONSTRUCTORS.get(term[0])
    if constructor is None or not constructor.binds:
        return term
    parts, used = list(term[1:]), set(axis_names(term))
    for position, scope in constructor.binds:
        name, count = parts[position], parts[position + 1]
        if extent(name) == count:
            continue
        bases = {a.split(":")[0] for a in used}
        fresh = next(f"r{k}:{count}" for k in range(len(used) + 1) if f"r{k}" not in bases)
        used.add(fresh)
        parts[position] = fresh
        for operand in scope:
            if isinstance(parts[operand], tuple):
                parts[operand] = rename_free_axis(parts[operand], name, fresh)
    return (term[0], *parts)


# ----------------------------------------------------------------------- egglog text


def replace(term: Term, old: Term, new: Term) -> Term:
    """``term`` with every occurrence of the subterm ``old`` replaced by ``new``."""
    if term == old:
        return new
    if not any(isinstance(a, tuple) for a in term[1:]):
        return term
    return tuple(replace(a, old, new) if isinstance(a, tuple) else a for a in term)


def substitute_axes(term: Term, mapping: dict[str, Term]) -> Term:
    """``term`` with each free ``Ax a`` of ``mapping`` replaced by ``mapping[a]`` at once
    (an index term), so that no replacement is itself replaced again; each index term
    around a replacement is rebuilt by its smart constructor (:func:`canonical_index`), so
    that a row split ``(i // T, i % T)`` read at a merged index ``b·T + t`` is ``(b, t)``."""
    if term[0] == "Ax":
        return mapping.get(term[1], term)
    if not any(isinstance(a, tuple) for a in term[1:]):
        return term
    result = tuple(substitute_axes(a, mapping) if isinstance(a, tuple) else a for a in term)
    return canonical_index(result) if result != term else result


def canonical_index(ix: Term) -> Term:
    """An index term rebuilt by the smart constructor of its head (its operands canonical
    already): ``(a·c + b) // c`` is ``a``, ``(a·c + b) % c`` is ``b``, ``(x + 1) + 2`` is
    ``x + 3``; any other term is returned as it is."""
    head = ix[0]
    if head == "IxAdd":
        return ix_add(ix[1], ix[2])
    if head == "IxDiv":
        return ix_div(ix[1], ix[2])
    if head == "IxMod":
        return ix_mod(ix[1], ix[2])
    if head == "IxLin":
        return ix_lin(ix[1], ix[2], ix[3])
    return ix


def shifted(term: Term, axis: str, delta: int) -> Term:
    """``term`` read ``delta`` further along ``axis``: every ``Ax axis`` in its indices
    becomes ``axis + delta`` (the value of the term at that neighbour)."""
    return substitute_axes(term, {axis: ("IxAdd", ax(axis), delta)})


def literal(value: Any) -> str:
    """An egglog literal for a Python scalar."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            raise ValueError("NaN has no place in the e-graph")
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        text = repr(value)
        return text if any(c in text for c in ".e") else text + ".0"
    if isinstance(value, str):
        return json.dumps(value)
    raise TypeError(f"no egglog literal for {value!r}")


def sexpr(term: Term) -> str:
    """The egglog s-expression of a term (tree-shaped; use ``Program.bind`` for DAGs)."""
    if not isinstance(term, tuple):
        return literal(term)
    if len(term) == 1:
        return f"({term[0]})"
    return "(" + term[0] + " " + " ".join(sexpr(a) for a in term[1:]) + ")"


def from_termdag(termdag: Any, root: int, memo: dict[int, Any] | None = None) -> Term:
    """Convert an egglog ``TermDag`` node (and below) into a term tuple; ``memo`` (node index
    -> term) may be shared by the roots of one ``TermDag``, which then convert shared
    subterms once."""
    memo = {} if memo is None else memo

    def convert(index: int) -> Any:
        if index in memo:
            return memo[index]
        node = termdag.get(index)
        if type(node).__name__ == "TermLit":
            value = node.value.value
            result = float(value) if type(node.value).__name__ == "Float" else value
        else:
            result = (node.name, *(convert(a) for a in node.args))
        memo[index] = result
        return result

    return convert(root)


def show(term: Term) -> str:
    """A compact human-readable form, e.g. ``Sum_r0(q[i0,r0]·k[i1,r0])``."""
    head = term[0]
    if head == "Tensor":
        return f"{term[1]}[{','.join(show(i) for i in ix_items(term[2]))}]"
    if head == "Ax":
        return term[1]
    if head == "IxLit":
        return str(term[1])
    if head == "Num":
        return repr(term[1])
    if head == "Mul":
        return f"({show(term[1])}·{show(term[2])})"
    if head == "Add":
        return f"({show(term[1])} + {show(term[2])})"
    args = ", ".join(show(a) if isinstance(a, tuple) else repr(a) for a in term[1:])
    return f"{head}({args})"
