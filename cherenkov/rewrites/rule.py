"""Rules and rulesets: declarative identities written as egglog patterns.

A :class:`Rule` states one identity: ``lhs`` (an egglog pattern) equals ``rhs`` whenever
the ``where`` facts hold. Its ``doc`` is the identity in one line; its ``example`` is a
small instance of ``lhs`` that the rule tests evaluate before and after rewriting. A
:class:`Ruleset` groups the rules of one concern and says how long they may run.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from cherenkov.rewrites.terms import Term


@dataclass(frozen=True)
class Example:
    """A small concrete instance of a rule's left-hand side (axis names carry extents)."""

    term: Term
    positive: tuple[str, ...] = ()  # inputs drawn positive (e.g. under a square root)
    eight_bit: tuple[str, ...] = ()  # inputs the example's graph stores in 8 bits (relation EightBit)


@dataclass(frozen=True)
class Rule:
    """``lhs = rhs`` when ``where`` holds; the e-class of ``lhs`` gains ``rhs``.

    With ``union=False`` the rule only creates ``rhs`` (schedule alternatives, which are
    plans about an expression rather than expressions equal to it). ``tolerance`` is how
    closely both sides agree on random inputs (relative): 1e-9 for an exact identity; a
    rule that drops a rounding the kernels do anyway states that rounding's size.
    """

    name: str
    doc: str
    lhs: str
    rhs: str
    where: tuple[str, ...] = ()
    example: Example | None = field(default=None, compare=False)
    union: bool = True
    tolerance: float = 1e-9

    def egglog(self, ruleset: str) -> str:
        facts = " ".join((f"(= __lhs {self.lhs})", *self.where))
        action = f"(union __lhs {self.rhs})" if self.union else self.rhs
        return f'(rule ({facts}) ({action}) :ruleset {ruleset} :name "{self.name}")'


@dataclass(frozen=True)
class Ruleset:
    """The rules of one concern. ``iterations`` bounds each run (``None``: saturating)."""

    name: str
    doc: str
    rules: tuple[Rule, ...]
    iterations: int | None = 1

    def egglog(self) -> str:
        return "\n".join([f"(ruleset {self.name})", *(rule.egglog(self.name) for rule in self.rules)])
