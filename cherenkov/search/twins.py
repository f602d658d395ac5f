"""Twin candidates: the same kernel source on other tensors, compiled and measured once.

A whole model repeats its layers: the twelve layers of GPT-2 give twelve kernels of each
kind with the same shapes, whose candidates differ only in the names of the tensors they
read and write (and the plan ids derived from them). Two candidates are twins when their
sources are equal after the plan's own id is renamed to one placeholder and every tensor
name to placeholders in order of first appearance (a consistent renaming of identifiers, so
equal sources compute the same thing on their own arguments). Kernels list their tensors by
name, so two layers whose names sort differently are not recognised as twins: each is then
searched on its own (a missed twin costs time, never correctness). The search compiles,
verifies and times one candidate of each twin group and gives its result to the others
(:func:`twin_result`).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Sequence

from cherenkov.codegen.cache import sha256_hex
from cherenkov.search.records import CandidateResult
from cherenkov.search.space import Candidate

IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
TENSOR_PARAMETER = "t_"
"""The prefix of a tensor's parameter in generated kernels (``t_<name>``)."""
OWN_ID = "__ck_self__"
"""What a candidate's own plan id becomes in its twin key."""


def twin_key(candidate: Candidate, names: frozenset[str]) -> str:
    """A digest of ``candidate``'s source with its plan id renamed to ``OWN_ID`` and each of
    ``names`` (or its ``t_`` parameter) to ``__ck_<n>__`` by order of first appearance: equal
    for twins, and only for them."""
    source = candidate.source.replace(candidate.id, OWN_ID)
    words = {w for w in set(IDENTIFIER.findall(source)) if w in names or w.removeprefix(TENSOR_PARAMETER) in names}
    if words:
        alternatives = "|".join(map(re.escape, sorted(words, key=lambda w: (-len(w), w))))
        renamed: dict[str, str] = {}
        source = re.sub(rf"(?<![A-Za-z0-9_])(?:{alternatives})(?![A-Za-z0-9_])",
                        lambda m: renamed.setdefault(m.group(), f"__ck_{len(renamed)}__"), source)  # fmt: skip
    return sha256_hex(source.encode())


def twin_groups(candidates: Sequence[Candidate], names: Iterable[str]) -> dict[str, tuple[Candidate, ...]]:
    """Each candidate's twin group (by id; the group lists every twin in ``candidates``'
    order, itself included; a candidate with no twin is a group of one)."""
    known = frozenset(names)
    by_schedule: dict[str, list[Candidate]] = {}
    for candidate in candidates:  # twins share a schedule: the plan id less its digest
        by_schedule.setdefault(candidate.id.rpartition("_")[0], []).append(candidate)
    groups: dict[str, tuple[Candidate, ...]] = {}
    for same_schedule in by_schedule.values():
        if len({c.kernel for c in same_schedule}) == 1:  # one kernel's candidates: no twin among them
            groups.update((c.id, (c,)) for c in same_schedule)
            continue
        by_key: dict[str, list[Candidate]] = {}
        for candidate in same_schedule:
            by_key.setdefault(twin_key(candidate, known), []).append(candidate)
        groups.update((c.id, tuple(group)) for group in by_key.values() for c in group)
    return {c.id: groups[c.id] for c in candidates}


def twin_result(result: CandidateResult, twin: Candidate) -> CandidateResult:
    """``result`` (of one twin) as ``twin``'s own: its id, kernel, source hash and parameters."""
    return dataclasses.replace(result, id=twin.id, kernel=twin.kernel, source_hash=twin.source_hash,
                               params=twin.plan.params())  # fmt: skip
