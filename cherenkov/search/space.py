"""The search space: every candidate implementation of every kernel of a graph.

A candidate is one plan (fused form × schedule × target) for one kernel of the
derivation's partition on the target (:meth:`~cherenkov.rewrites.derive.Derivation.kernels_for`:
an attention whose flash kernel no flash plan fits runs on unfused kernels, the others on theirs).
Flash-attention kernels take the flash plans the e-graph's schedule rules admit; every
other kernel takes the generic plans of :func:`cherenkov.codegen.term_plan.term_plans`
(pointwise, row-reduction and GEMM families, schedules enumerated in Python). A pointwise
plan — one thread an output, a serial loop over the reduced axis — is searched only for
elementwise kernels and for kernels no other family can run. Kernels with no plan at all
are listed as such, so the search says what cannot run rather than silently skipping it.

A contraction that can absorb the RMSNorm kernel feeding it
(:func:`cherenkov.rewrites.kernels.absorptions`) also takes the plans of the absorbed
form — the GEMM that runs the norm in its main loop — as candidates that *absorb* that
producer: if one wins, the producer is not launched, so the search weighs it against the
other candidates plus the producer's own time.

:func:`stored_plan` rebuilds a plan from the ``params`` a report or the tuning database
recorded (the inverse of naming it), so a remembered winner runs without enumerating or
generating the space again; :func:`generator_digest` names the code that enumerates and
generates candidates, which a remembered answer must match.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Mapping
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from typing import Any

from cherenkov.codegen import cuda_source
from cherenkov.codegen.cache import sha256_hex
from cherenkov.codegen.errors import CodegenError
from cherenkov.codegen.term_plan import (
    GemmSchedule,
    PointwiseSchedule,
    RowSchedule,
    TermKernelPlan,
    TmaGemmSchedule,
    WgmmaGemmSchedule,
    kernel_tensors,
    term_digest,
    term_plans,
)
from cherenkov.rewrites.derive import Derivation
from cherenkov.rewrites.kernels import FusedKernel, absorptions
from cherenkov.rewrites.plan import TARGETS, AttentionProblem, FlashSchedule, KernelPlan, Target
from cherenkov.rewrites.plan_backward import AttentionBackwardProblem, BackwardPlan, BackwardSchedule
from cherenkov.rewrites.plan_sm90a import HopperFlashSchedule

GENERATED_KINDS = frozenset(
    {"flash_attention", "flash_attention_backward", "elementwise", "reduction", "contraction", "softmax_rows", "rms_norm_rows", "layer_norm_rows"}
)

Plan = KernelPlan | TermKernelPlan | BackwardPlan


@dataclass(frozen=True)
class Candidate:
    """One plan for one kernel, with its generated source; ``absorbs``: the producer kernel
    (by output) whose work this plan does itself, making it unnecessary."""

    kernel: str
    plan: Plan
    source: str = field(repr=False)
    absorbs: str | None = None

    @property
    def id(self) -> str:
        return self.plan.name

    @property
    def source_hash(self) -> str:
        return sha256_hex(self.source.encode())


@dataclass(frozen=True)
class SearchSpace:
    """Candidates per kernel (by output name) and the kernels nothing can generate yet."""

    kernels: tuple[FusedKernel, ...]
    candidates: Mapping[str, tuple[Candidate, ...]]
    ungenerated: tuple[FusedKernel, ...]

    def all(self) -> list[Candidate]:
        return [c for group in self.candidates.values() for c in group]


def search_space(derivation: Derivation, target: str) -> SearchSpace:
    """Enumerate candidates: flash-attention kernels × the schedules their plans offer,
    every other kernel × its generic plans."""
    kernels = derivation.kernels_for(target)
    plans_by_kernel: dict[str, list[Plan]] = {}
    for plan in derivation.plans(target):
        plans_by_kernel.setdefault(plan.problem.out, []).append(plan)
    shapes, dtypes = derivation.tensor_types(kernels)
    candidates, ungenerated = {}, []
    for kernel in kernels:
        plans = plans_by_kernel.get(kernel.output, [])
        if kernel.kind in GENERATED_KINDS and not plans:
            try:
                plans = searched(term_plans(kernel, shapes, dtypes, TARGETS[target], kernel.trace))
            except CodegenError:
                plans = []
        if plans:
            candidates[kernel.output] = tuple(Candidate(kernel.output, p, cuda_source(p)) for p in plans)
        else:
            ungenerated.append(kernel)
    for consumer, (producer, fused) in absorptions(kernels, frozenset(derivation.graph.outputs)).items():
        if consumer not in candidates:
            continue
        try:
            plans = term_plans(fused, shapes, dtypes, TARGETS[target], fused.trace)
            plans = [p for p in plans if p.family != "pointwise"]  # absorbing is worth it only in a GEMM
        except CodegenError:
            plans = []
        absorbing = tuple(Candidate(consumer, p, cuda_source(p), absorbs=producer) for p in plans)
        candidates[consumer] = candidates[consumer] + absorbing
    return SearchSpace(tuple(kernels), candidates, tuple(ungenerated))


def searched(plans: list[TermKernelPlan]) -> list[TermKernelPlan]:
    """The generic plans worth searching: a pointwise plan of a kernel that reduces (a serial
    loop over the reduced axis in every thread) only where no other family can run it."""
    structured = [p for p in plans if p.family != "pointwise"]
    return structured if structured and plans[0].kind != "elementwise" else plans


# ------------------------------------------------------------------ remembered plans

SCHEDULE_TYPES = (PointwiseSchedule, RowSchedule, GemmSchedule, WgmmaGemmSchedule, TmaGemmSchedule)


def _dataclass_of(kinds: tuple[type, ...], values: Mapping[str, Any]) -> Any:
    """The one of ``kinds`` whose fields are ``values``' keys, built from them; fields left out
    must have defaults (plan parameters omit knobs at their defaults, see ``KernelPlan.params``)."""
    def fits(kind: type) -> bool:
        names = {f.name for f in fields(kind)}
        required = {f.name for f in fields(kind) if f.default is MISSING and f.default_factory is MISSING}
        return set(values) <= names and required <= set(values)

    matching = [kind for kind in kinds if fits(kind)]
    if len(matching) != 1:
        raise ValueError(f"no single schedule type of {[k.__name__ for k in kinds]} has the fields {sorted(values)}")
    return matching[0](**values)


def stored_plan(params: Mapping[str, Any], kernels: list[FusedKernel], derivation: Derivation,
                target: Target) -> Plan:  # fmt: skip
    """The plan a candidate's recorded ``params`` describe, among ``kernels`` (and the forms
    that absorb a producer): ``ValueError`` when they describe none. The caller checks the
    rebuilt plan's name against the recorded id, which hashes every parameter."""
    if params.get("target") != target.name:
        raise ValueError(f"recorded for target {params.get('target')!r}, not {target.name}")
    if params.get("kind") == "flash_attention" and "problem" in params:
        schedule = _dataclass_of((FlashSchedule, HopperFlashSchedule), params["schedule"])
        problem = AttentionProblem.from_json(params["problem"])
        kernel = next((k for k in kernels if k.output == problem.out), None)
        if kernel is None:
            raise ValueError(f"no flash-attention kernel writes {problem.out}")
        return KernelPlan("flash_attention", problem, schedule, target, kernel.trace)
    if params.get("kind") == "flash_attention_backward":
        problem = AttentionBackwardProblem.from_json(params["problem"])
        kernel = next((k for k in kernels if k.output == problem.out), None)
        if kernel is None:
            raise ValueError(f"no flash-attention backward kernel writes {problem.out}")
        return BackwardPlan("flash_attention_backward", problem, BackwardSchedule(**params["schedule"]), target,
                            kernel.trace)  # fmt: skip
    wanted = params["kernel"]
    absorbed = [fused for _, fused in absorptions(kernels, frozenset(derivation.graph.outputs)).values()]
    for kernel in (*kernels, *absorbed):
        if kernel.output == wanted["output"] and term_digest(kernel) == wanted["term_sha256"]:
            schedule = dict(params["schedule"])
            family = schedule.pop("family")
            schedule = _dataclass_of(tuple(k for k in SCHEDULE_TYPES if k.family == family), schedule)
            tensors = kernel_tensors(kernel, *derivation.tensor_types(kernels))
            return TermKernelPlan(kernel.kind, kernel, schedule, target, tensors, kernel.trace)
    raise ValueError(f"no kernel writing {wanted['output']} has the recorded term")


@functools.cache
def generator_digest() -> str:
    """sha256 (16 hex digits) of cherenkov's own source files: any change to how candidates
    are derived, enumerated or generated gives new digests, and remembered answers of the
    old code are not served (their candidates' measurements still are, by source hash)."""
    root = Path(__file__).resolve().parents[1]
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        digest.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]
