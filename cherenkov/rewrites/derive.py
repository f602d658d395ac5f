"""Equality saturation: from a graph to its fused kernel forms and their plans.

``derive(g)`` lowers the graph to index-notation terms, runs the rulesets pass by pass
(the axes analysis saturated before each), and stops when a pass changes nothing or a
bound is hit. The result answers which fused forms exist (``found``), which cover the
graph best (``kernels``), which rules lead to them (``trace``), and which schedules each
admits on a target (``plans``).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import egglog.bindings as egg
import numpy as np

from cherenkov.graph import Graph, GraphError
from cherenkov.graph.evaluate import check_inputs
from cherenkov.rewrites import terms as t
from cherenkov.rewrites.algebra import ALGEBRA
from cherenkov.rewrites.contraction import CONTRACTION
from cherenkov.rewrites.fusion import FUSION
from cherenkov.rewrites.kernels import FusedKernel, KernelError, attention_problem, partition
from cherenkov.rewrites.language import prelude
from cherenkov.rewrites.lower import Lowered, lower
from cherenkov.rewrites.masks import MASKS
from cherenkov.rewrites.plan import TARGETS, AttentionProblem, KernelPlan, Target, flash_schedule_problems
from cherenkov.rewrites.rule import Ruleset
from cherenkov.rewrites.plan_sm90a import HopperFlashSchedule, hopper_schedule_problems
from cherenkov.rewrites.schedule import SCHEDULE, schedule_facts, schedule_from_term
from cherenkov.rewrites.softmax import SOFTMAX
from cherenkov.rewrites.streaming import STREAMING
from cherenkov.rewrites.terms import Term

log = logging.getLogger(__name__)

RULESETS: tuple[Ruleset, ...] = (ALGEBRA, MASKS, CONTRACTION, SOFTMAX, STREAMING, FUSION)
MAX_PASSES = 24
MAX_ENODES = 200_000

# Fused-form names accepted by ``Derivation.found`` and the constructors behind them.
FORMS = {
    "flash_attention": "FlashAttention",
    "online_softmax_contract": "OnlineSoftmaxContract",
    "softmax_row": "SoftmaxRow",
    "rms_norm_row": "RmsNormRow",
    "layer_norm_row": "LayerNormRow",
    "contraction": "Contract",
}


@dataclass(frozen=True)
class DerivationStats:
    """Size and cost of the saturation."""

    eclasses: int
    enodes: int
    iterations: int
    seconds: float
    matches: dict[str, int] = field(default_factory=dict)
    saturated: bool = False


def program_for(lowered: Lowered) -> tuple[str, dict[str, str]]:
    """Egglog ``let`` bindings for every distinct subterm of the outputs (a DAG, not a
    tree) and the global name of each output's root."""
    names: dict[Term, str] = {}
    lines: list[str] = []

    def bind(term: Term) -> str:
        stack = [(term, False)]
        while stack:
            current, expanded = stack.pop()
            if current in names:
                continue
            kids = [c for c in t.children(current) if c not in names]
            if kids and not expanded:
                stack.append((current, True))
                stack.extend((c, False) for c in kids)
                continue
            args = " ".join(names[a] if isinstance(a, tuple) else t.literal(a) for a in current[1:])
            names[current] = f"$t{len(names)}"
            lines.append(f"(let {names[current]} ({current[0]}{' ' + args if args else ''}))")
        return names[term]

    roots = {name: bind(term) for name, term in lowered.roots.items()}
    return "\n".join(lines), roots


def pass_schedule(rulesets: tuple[Ruleset, ...]) -> str:
    """One pass: each ruleset once, with the axes analysis saturated before it."""
    steps = " ".join(f"(saturate analysis) (repeat {r.iterations or 1} (run {r.name}))" for r in rulesets)
    return f"(run-schedule (seq {steps} (saturate analysis)))"


def _size(egraph: egg.EGraph) -> tuple[int, int]:
    """(e-classes, e-nodes) of the expression sorts, from a serialisation."""
    import json

    serialized = json.loads(egraph.serialize([]).to_json())
    nodes = serialized.get("nodes", {})
    classes = {n["eclass"] for n in nodes.values()}
    return len(classes), len(nodes)


class Derivation:
    """The saturated e-graph of one graph, and what can be read from it."""

    def __init__(
        self,
        graph: Graph,
        rulesets: tuple[Ruleset, ...] = RULESETS,
        max_passes: int = MAX_PASSES,
        max_enodes: int = MAX_ENODES,
    ) -> None:
        self.graph = graph
        self.rulesets = rulesets
        self.lowered = lower(graph)
        start = time.perf_counter()
        lets, self.roots = program_for(self.lowered)
        rules = "\n".join(r.egglog() for r in (*rulesets, SCHEDULE))
        self.egglog_program = "\n".join([prelude(), rules, lets])
        self.egraph = egg.EGraph()
        self.egraph.parse_and_run_program(self.egglog_program)
        self.first_pass: dict[str, int] = {}
        matches: dict[str, int] = {}
        schedule = pass_schedule(rulesets)
        known = {rule.name for ruleset in rulesets for rule in ruleset.rules}
        saturated, passes = False, 0
        for passes in range(1, max_passes + 1):
            report = self.egraph.parse_and_run_program(schedule)[-1].report
            for rule, count in report.num_matches_per_rule.items():
                if count and rule in known:
                    matches[rule] = matches.get(rule, 0) + count
                    self.first_pass.setdefault(rule, passes)
            if not report.updated:
                saturated = True
                break
            if _size(self.egraph)[1] > max_enodes:
                log.warning("derivation of %s stopped after %d passes: over %d e-nodes", graph.name, passes, max_enodes)
                break
        self.egglog_program += "\n" + "\n".join([schedule] * passes)
        eclasses, enodes = _size(self.egraph)
        self.stats = DerivationStats(
            eclasses, enodes, passes, time.perf_counter() - start, dict(sorted(matches.items())), saturated
        )
        log.info("derived %s: %s", graph.name, self.stats)

    # ------------------------------------------------------------ reading the e-graph

    def _run(self, commands: str) -> list[Any]:
        return self.egraph.parse_and_run_program(commands)

    def forms_of(self, constructor: str) -> list[Term]:
        """Every e-node of one constructor, each as a term (its children extracted)."""
        output = self._run(f"(print-function {constructor} 1000000)")[-1]
        return [t.from_termdag(output.termdag, key) for key, _ in output.terms]

    @functools.cached_property
    def extracted(self) -> dict[str, Term]:
        """The cheapest term of each root (intermediate tensors first, then outputs)."""
        result = {}
        for name, root in self.roots.items():
            best = self._run(f"(extract {root})")[-1]
            result[name] = t.from_termdag(best.termdag, best.term)
        return result

    def found(self, kind: str) -> bool:
        """Whether a valid fused form of ``kind`` (e.g. ``"flash_attention"``) is in the e-graph."""
        if kind not in FORMS:
            raise GraphError(f"found: unknown fused form {kind!r}; known: {sorted(FORMS)}")
        if kind != "flash_attention":
            return bool(self.forms_of(FORMS[kind]))
        candidates = self.forms_of("FlashAttention") + [k.core for k in self.kernels if k.kind == kind]
        return any(self._attention_problem(form) is not None for form in candidates)

    def tensor_types(self) -> tuple[dict[str, tuple[int, ...]], dict[str, str]]:
        """Shapes and dtypes of every tensor kernels read: inputs and intermediate buffers."""
        shapes = dict(self.lowered.input_shapes)
        dtypes = dict(self.lowered.input_dtypes)
        for name in self.lowered.roots:
            shapes[name] = self.lowered.shape(name)
            dtypes[name] = self.lowered.buffer_dtype
        for kernel in self.kernels:
            shapes[kernel.output] = kernel.shape
            dtypes[kernel.output] = self.lowered.buffer_dtype
        return shapes, dtypes

    def _attention_problem(self, form: Term) -> AttentionProblem | None:
        try:
            return attention_problem(form, *self.tensor_types())
        except KernelError:
            return None

    @functools.cached_property
    def kernels(self) -> list[FusedKernel]:
        """The fused kernels covering the graph (from the cheapest extraction), each with
        the rules its fused form needs."""
        return [
            dataclasses.replace(k, trace=self._needed_rules(k.source[0]) if k.source else ())
            for k in partition(self.extracted, self.lowered)
        ]

    @functools.cache
    def _needed_rules(self, constructor: str) -> tuple[str, ...]:
        """A minimal set of the rules that fired without which no ``constructor`` form
        arises, ordered by the pass in which each first fired (greedy ablation)."""
        order = [r.name for ruleset in self.rulesets for r in ruleset.rules]
        needed = sorted(self.first_pass, key=lambda r: (self.first_pass[r], order.index(r)))
        if constructor not in FORMS.values() or not self._derives(constructor, needed):
            return ()
        for rule in list(needed):
            trial = [r for r in needed if r != rule]
            if self._derives(constructor, trial):
                needed = trial
        return tuple(needed)

    def _derives(self, constructor: str, rules: list[str]) -> bool:
        subset = tuple(
            dataclasses.replace(r, rules=tuple(x for x in r.rules if x.name in rules)) for r in self.rulesets
        )
        trial = Derivation(self.graph, rulesets=subset, max_passes=self.stats.iterations)
        return bool(trial.forms_of(constructor))

    def evaluate(self, inputs: Mapping[str, Any]) -> dict[str, np.ndarray]:
        """Run the fused kernels' float64 references in order: the derived program's value."""
        buffers: dict[str, np.ndarray] = dict(check_inputs(self.graph, inputs))
        for kernel in self.kernels:
            buffers[kernel.output] = kernel.evaluate(buffers)
        return {name: buffers[name] for name in self.graph.outputs}

    @functools.cached_property
    def trace(self) -> tuple[str, ...]:
        """The rules each fused kernel needs, in the order they first fired."""
        ordered: list[str] = []
        for kernel in self.kernels:
            ordered.extend(rule for rule in kernel.trace if rule not in ordered)
        return tuple(ordered)

    def plans(self, target: str | Target = "sm_120") -> list[KernelPlan]:
        """Every valid (flash-attention form × schedule) for ``target``."""
        target = TARGETS[target] if isinstance(target, str) else target
        self._run("(push)")
        try:
            self._run(schedule_facts(target) + "\n(run-schedule (run schedule))")
            rows = self.forms_of("Scheduled")
        finally:
            self._run("(pop)")
        plans = []
        for kernel in self.kernels:
            if kernel.kind != "flash_attention":
                continue
            problem = self._attention_problem(kernel.core)
            if problem is None:
                continue
            problem = dataclasses.replace(problem, out=kernel.output)
            for form, schedule_term in ((row[1], row[2]) for row in rows):
                schedule = schedule_from_term(schedule_term)
                fits = hopper_schedule_problems if isinstance(schedule, HopperFlashSchedule) else flash_schedule_problems
                if form == kernel.source and not fits(schedule, problem, target):
                    plans.append(KernelPlan("flash_attention", problem, schedule, target, kernel.trace))
        return sorted(set(plans), key=lambda p: p.name)


def derive(graph: Graph, **options: Any) -> Derivation:
    """Saturate ``graph``'s e-graph with the fusion rulesets; see :class:`Derivation`."""
    if not isinstance(graph, Graph):
        raise GraphError(f"derive: expected a ck.Graph, got {type(graph).__name__}")
    if not graph.outputs:
        raise GraphError(f"derive: graph {graph.name!r} has no outputs; mark one with g.output(tensor, name)")
    return Derivation(graph, **options)
