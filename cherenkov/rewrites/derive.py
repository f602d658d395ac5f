"""Equality saturation: from a graph to its fused kernel forms and their plans.

``derive(g)`` lowers the graph to index-notation terms, runs the rulesets pass by pass
(the axes analysis saturated before each), and stops when a pass changes nothing or a
bound is hit. The result answers which fused forms exist (``found``), which cover the
graph best (``kernels``), which rules lead to them (``trace``), and which schedules each
admits on a target (``plans``).

A fused form that no kernel family can plan is not what the graph runs on: where a
flash-attention kernel has no plan (its q, k or v are not tensors a flash kernel reads, or
no schedule fits its head dimension on the target), the roots holding it take their terms
from the cheapest extraction *without* the streaming forms (``STREAMING_FORMS`` subsumed in a
scope of the e-graph): contraction, softmax rows, contraction. The other attentions keep their
flash kernels. ``kernels`` applies the first test, ``kernels_for(target)`` both.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import logging
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import egglog.bindings as egg
import numpy as np

from cherenkov.graph import Graph, GraphError, Tensor
from cherenkov.graph.evaluate import check_inputs
from cherenkov.graph.shape import FP8_DTYPES
from cherenkov.rewrites import terms as t
from cherenkov.rewrites.algebra import ALGEBRA
from cherenkov.rewrites.casts import CASTS
from cherenkov.rewrites.contraction import CONTRACTION
from cherenkov.rewrites.fusion import FUSION
from cherenkov.rewrites.gradients import GRADIENTS
from cherenkov.rewrites.attention_backward import (
    SavedAttention,
    attention_backward_problem,
    gradients_head_dim_last,
    joined_backward,
    saved_attentions,
    saved_statistics,
)
from cherenkov.rewrites.kernels import FLASH_FORWARD, FusedKernel, KernelError, attention_problem, joined_statistics, lse_output
from cherenkov.rewrites.kernels import partition as partition_kernels
from cherenkov.rewrites.language import EXPR_CONSTRUCTORS, prelude
from cherenkov.rewrites.lower import Lowered, fresh_name, lower
from cherenkov.rewrites.masks import MASKS
from cherenkov.rewrites.plan import TARGETS, AttentionProblem, KernelPlan, Target, flash_schedule_problems
from cherenkov.rewrites.rule import Ruleset
from cherenkov.rewrites.plan_backward import AttentionBackwardProblem, BackwardPlan, backward_plans
from cherenkov.rewrites.plan_fp8 import Fp8FlashSchedule, fp8_schedule_problems
from cherenkov.rewrites.plan_sm90a import HopperFlashSchedule, hopper_schedule_problems
from cherenkov.rewrites.scales import SCALES
from cherenkov.rewrites.schedule import SCHEDULE, schedule_facts, schedule_from_term
from cherenkov.rewrites.sinks import SINKS
from cherenkov.rewrites.softmax import SOFTMAX
from cherenkov.rewrites.streaming import STREAMING
from cherenkov.rewrites.terms import Term

log = logging.getLogger(__name__)

RULESETS: tuple[Ruleset, ...] = (ALGEBRA, CASTS, MASKS, SINKS, CONTRACTION, SOFTMAX, STREAMING, SCALES, FUSION, GRADIENTS)
MAX_PASSES = 24
MAX_ENODES = 200_000
MAX_ABLATIONS = 512
TRIAL_PASS_FACTOR = 2
"""A trace ablation's trial runs at most this many times the passes its form took with every rule."""

ABLATIONS: dict[str, tuple[str, ...]] = {}
"""The trace ablations of this process (:meth:`Derivation._needed_rules`), by a digest of all they
depend on: the root's egglog program, the rules, the pass each fired rule first fired in, the pass
limit and the form. A graph derived again (a session derives a module's gradient for its search,
its plans and its report) is not ablated again; the oldest go first past ``MAX_ABLATIONS``."""

# The one-pass streaming forms of attention: left out of the extraction where they cannot be planned.
STREAMING_FORMS = (
    "FlashAttention", "FlashAttentionScaled", "FlashAttentionSplitKv", "OnlineSoftmaxContract", "SoftmaxFoldAcc", "SoftmaxFoldL", "LogSumExp",
    "AttentionLse", "AttentionDs", "FlashAttentionGradQ", "FlashAttentionGradK", "FlashAttentionGradV", "FlashAttentionGradKGroup",
    "FlashAttentionGradVGroup",
)  # fmt: skip

# Fused-form names accepted by ``Derivation.found`` and the constructors behind them.
FORMS = {
    "flash_attention": "FlashAttention",
    "flash_attention_scaled": "FlashAttentionScaled",
    "online_softmax_contract": "OnlineSoftmaxContract",
    "softmax_row": "SoftmaxRow",
    "rms_norm_row": "RmsNormRow",
    "layer_norm_row": "LayerNormRow",
    "contraction": "Contract",
    "flash_attention_backward": "FlashAttentionGradQ",  # or GradK, GradV: see Derivation.found
    "attention_lse": "AttentionLse",
}


GRADIENT_FORMS = frozenset({
    "FlashAttentionGradQ", "FlashAttentionGradK", "FlashAttentionGradV", "FlashAttentionGradKGroup",
    "FlashAttentionGradVGroup",
})  # fmt: skip
"""The flash-attention backward's forms (one per gradient)."""

# Constructors whose kernels carry the rules that derive them.
TRACED_FORMS = frozenset(FORMS.values()) | GRADIENT_FORMS


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
    lines += [f"(EightBit {t.literal(name)})" for name, dtype in sorted(lowered.input_dtypes.items())
              if dtype in FP8_DTYPES]  # fmt: skip
    # a root's inlined alternative is the same value: the same e-class
    unions = [f"(union {roots[name]} {bind(term)})" for name, term in lowered.inlined.items()]
    return "\n".join(lines + unions), roots


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


_EXPR_NAMES = frozenset(c.name for c in EXPR_CONSTRUCTORS)


def _enode_count(egraph: egg.EGraph) -> int:
    """E-nodes of the expression sorts, from the function tables' sizes (cheap: no serialisation)."""
    sizes = egraph.parse_and_run_program("(print-size)")[-1].sizes
    return sum(count for name, count in sizes if name in _EXPR_NAMES)


def _holds(egraph: egg.EGraph, constructor: str) -> bool:
    """Whether the e-graph holds an e-node of ``constructor``."""
    return egraph.parse_and_run_program(f"(print-size {constructor})")[-1].size > 0


@dataclass
class Saturation:
    """An e-graph saturated from lowered terms: the program that built it, each root's
    global name in it, the pass in which each rule first fired, and the stats."""

    egraph: egg.EGraph
    roots: dict[str, str]
    program: str
    first_pass: dict[str, int]
    stats: DerivationStats

    def forms_of(self, constructor: str) -> list[Term]:
        """Every e-node of one constructor, each as a term (its children extracted)."""
        output = self.egraph.parse_and_run_program(f"(print-function {constructor} 1000000)")[-1]
        termdag, memo = output.termdag, {}  # each attribute read copies the DAG out of egglog: read it once
        return [t.from_termdag(termdag, key, memo) for key, _ in output.terms]


def saturate(lowered: Lowered, rulesets: tuple[Ruleset, ...], max_passes: int, max_enodes: int,
             name: str, until: str | None = None) -> Saturation:  # fmt: skip
    """Run ``rulesets`` pass by pass on ``lowered``'s terms until a pass changes nothing,
    ``max_passes`` ran, the e-graph holds over ``max_enodes`` e-nodes or (given ``until``) an
    e-node of that constructor."""
    start = time.perf_counter()
    lets, roots = program_for(lowered)
    rules = "\n".join(r.egglog() for r in (*rulesets, SCHEDULE))
    program = "\n".join([prelude(), rules, lets])
    egraph = egg.EGraph()
    egraph.parse_and_run_program(program)
    first_pass: dict[str, int] = {}
    matches: dict[str, int] = {}
    schedule = pass_schedule(rulesets)
    known = {rule.name for ruleset in rulesets for rule in ruleset.rules}
    saturated, passes = False, 0
    for passes in range(1, max_passes + 1):
        report = egraph.parse_and_run_program(schedule)[-1].report
        for rule, count in report.num_matches_per_rule.items():
            if count and rule in known:
                matches[rule] = matches.get(rule, 0) + count
                first_pass.setdefault(rule, passes)
        if not report.updated:
            saturated = True
            break
        if until is not None and _holds(egraph, until):
            break
        if _enode_count(egraph) > max_enodes:
            log.warning("derivation of %s stopped after %d passes: over %d e-nodes", name, passes, max_enodes)
            break
    program += "\n" + "\n".join([schedule] * passes)
    eclasses, enodes = _size(egraph)
    stats = DerivationStats(eclasses, enodes, passes, time.perf_counter() - start, dict(sorted(matches.items())),
                            saturated)  # fmt: skip
    return Saturation(egraph, roots, program, first_pass, stats)


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
        self.saturation = saturate(self.lowered, rulesets, max_passes, max_enodes, graph.name)
        self.egraph = self.saturation.egraph
        self.roots = self.saturation.roots
        self.egglog_program = self.saturation.program
        self.first_pass = self.saturation.first_pass
        self.stats = self.saturation.stats
        log.info("derived %s: %s", graph.name, self.stats)

    # ------------------------------------------------------------ reading the e-graph

    def _run(self, commands: str) -> list[Any]:
        return self.egraph.parse_and_run_program(commands)

    def forms_of(self, constructor: str) -> list[Term]:
        """Every e-node of one constructor, each as a term (its children extracted)."""
        return self.saturation.forms_of(constructor)

    @property
    def extracted(self) -> dict[str, Term]:
        """The cheapest term of each root (intermediate tensors first, then outputs)."""
        return self._extract(())

    def _extract(self, excluded: tuple[str, ...]) -> dict[str, Term]:
        """The cheapest term of each root with the e-nodes of the ``excluded`` constructors
        subsumed (in a pushed scope: the e-graph is unchanged afterwards)."""
        return self._extraction(excluded)[0]

    @functools.cache
    def _extraction(self, excluded: tuple[str, ...]) -> tuple[dict[str, Term], tuple[str, ...], dict[str, Term]]:
        """:meth:`_extract`'s terms, the recomputed intermediates they compute in place, and the
        cheapest term of every root the outputs could read (those computed in place left out): group
        by group (one attention's, one activation's), each kept where computing it in place too, as
        well as those kept before, gives a whole answer no costlier that holds a flash-attention
        backward form (an attention's probabilities and score gradient do; a GELU's exponentials,
        which every reader would recompute with the GEMM before them, do not)."""
        if excluded:
            rules = ["(push)", "(ruleset exclude)"]
            for constructor in (c for c in EXPR_CONSTRUCTORS if c.name in excluded):
                node = f"({constructor.name}{''.join(f' x{i}' for i in range(len(constructor.args)))})"
                rules.append(f"(rule ((= e {node})) ((subsume {node})) :ruleset exclude)")
            self._run("\n".join([*rules, "(run exclude 1)"]))
        try:
            every = self._best(self.roots)  # each root's, the outputs' reads or not
            chosen = _read_from_outputs(every, self.lowered.outputs)
            in_place: tuple[str, ...] = ()
            derivable = self.lowered.inlined and not GRADIENT_FORMS <= set(excluded)
            for group in self.lowered.recomputed if derivable else ():
                computed = self._computed_in_place((*in_place, *group), every)
                if computed is None:
                    continue
                trial = _read_from_outputs(computed, self.lowered.outputs)
                if _cost(trial) <= _cost(chosen) and _holds_fused_forms(trial, self.graph.is_gradient):
                    chosen, in_place, every = trial, (*in_place, *group), computed
            terms = {name: term for name, (term, _) in chosen.items()}
            return terms, in_place, {name: term for name, (term, _) in every.items()}
        finally:
            if excluded:
                self._run("(pop)")

    def _best(self, roots: Mapping[str, str]) -> dict[str, tuple[Term, int]]:
        """The cheapest term of each of ``roots`` (name -> global), with its extraction cost."""
        result = {}
        for name, root in roots.items():
            best = self._run(f"(extract {root})")[-1]
            result[name] = (t.from_termdag(best.termdag, best.term), best.cost)
        return result

    def _computed_in_place(self, unstored: tuple[str, ...],
                           known: Mapping[str, tuple[Term, int]]) -> dict[str, tuple[Term, int]] | None:  # fmt: skip
        """The cheapest terms of the roots but the ``unstored`` intermediates with no read of those
        (each computed where it is read, through the inlined alternatives), or None where a root has
        no such term. A root whose ``known`` cheapest term (with fewer intermediates unstored) reads
        none of them keeps it: hiding reads it does not make leaves it the cheapest, and only the
        attention's own roots are extracted again (a whole model's layers are one gradient graph).

        Extraction prices a read of a stored intermediate at a tensor access, not at the kernel
        that writes it; this is another whole answer — some of the recomputed intermediates
        (:attr:`~cherenkov.rewrites.lower.Lowered.recomputed`: an attention's probabilities and
        score gradient) never stored, as in the fused forms of its gradient, which still read the
        other intermediates (a projection q, k and v are slices of) — whose total cost
        :meth:`_extraction` weighs against the stored one's."""
        hidden = set(unstored)
        unread = {name: root for name, root in self.roots.items() if name not in hidden}
        stale = {name: root for name, root in unread.items()
                 if any(s[0] == "Tensor" and s[1] in hidden for s in t.subterms(known[name][0]))}  # fmt: skip
        with self._unstored(unstored):
            try:
                extracted = self._best(stale)
            except Exception:  # a root whose every term reads a recomputed intermediate: egglog finds none
                return None
        return {name: extracted.get(name, known[name]) for name in unread}

    @contextlib.contextmanager
    def _unstored(self, names: tuple[str, ...]) -> Iterator[None]:
        """A pushed scope of the e-graph in which no term reads the intermediates ``names`` (their
        reads subsumed): where :meth:`_computed_in_place` extracts, and where the forms of the
        chosen extraction's terms are looked up again (a flash form's schedules). No names: the
        e-graph as it is (no scope pushed: a forward graph's plans)."""
        if not names:
            yield
            return
        rules = ["(push)", "(ruleset unstored)"]
        for name in names:
            read = f"(Tensor {t.literal(name)} ix)"
            rules.append(f"(rule ((= e {read})) ((subsume {read})) :ruleset unstored)")
        self._run("\n".join([*rules, "(run unstored 1)"]))
        try:
            yield
        finally:
            self._run("(pop)")

    def found(self, kind: str) -> bool:
        """Whether a valid fused form of ``kind`` (e.g. ``"flash_attention"``) is in the e-graph."""
        if kind not in FORMS:
            raise GraphError(f"found: unknown fused form {kind!r}; known: {sorted(FORMS)}")
        if kind == "flash_attention_backward":
            kernels = self.partition(streaming=True)
            return any(self._backward_problem(k, kernels) is not None for k in kernels if k.kind == kind)
        if kind != "flash_attention":
            return bool(self.forms_of(FORMS[kind]))
        kernels = self.partition(streaming=True)
        flash = [k for k in kernels if k.kind == kind]
        return any(self._attention_problem(k.core, kernels, k) is not None for k in flash) or any(
            self._attention_problem(form, kernels) is not None for form in self.forms_of("FlashAttention")
        )

    def tensor_types(self, kernels: list[FusedKernel] | None = None) -> tuple[dict[str, tuple[int, ...]], dict[str, str]]:
        """Shapes and dtypes of every tensor kernels read: inputs and intermediate buffers
        (of ``kernels``, by default :attr:`kernels`)."""
        shapes = dict(self.lowered.input_shapes)
        dtypes = dict(self.lowered.input_dtypes)
        stored = self.lowered.stored_dtype
        for name in self.lowered.roots:
            shapes[name] = self.lowered.shape(name)
            dtypes[name] = stored(name)
        for kernel in self.kernels if kernels is None else kernels:
            shapes[kernel.output] = kernel.stored_shape
            dtypes[kernel.output] = kernel.dtype or stored(kernel.output)
            for side in kernel.side_outputs:
                shapes[side.output] = side.shape
                dtypes[side.output] = side.dtype or stored(side.output)
        return shapes, dtypes

    def _attention_problem(self, form: Term, kernels: list[FusedKernel],
                           kernel: FusedKernel | None = None) -> AttentionProblem | None:  # fmt: skip
        """The problem of a flash form (of ``kernel``, writing its output buffer), or None."""
        try:
            if kernel is None:
                return attention_problem(form, *self.tensor_types(kernels))
            shapes, dtypes = self.tensor_types(kernels)
            problem = attention_problem(form, shapes, dtypes, kernel.axes, kernel.buffer)
            statistics = [side for side in kernel.side_outputs if side.term[0] == "AttentionLse"]
            if statistics:
                problem = dataclasses.replace(problem, lse=lse_output(statistics[0], shapes))
        except KernelError:
            return None
        if problem.dtype in FP8_DTYPES:  # 8-bit operands write the output in its own dtype
            return dataclasses.replace(problem, out_dtype=dtypes[kernel.output])
        return problem

    def _backward_problem(self, kernel: FusedKernel, kernels: list[FusedKernel]) -> AttentionBackwardProblem | None:
        """The problem of a (joined) flash-attention backward kernel, or None."""
        try:
            return attention_backward_problem(kernel, *self.tensor_types(kernels))
        except KernelError:
            return None

    def partition(self, streaming: bool = True) -> list[FusedKernel]:
        """The kernels of the cheapest extraction, without their traces; ``streaming=False``
        leaves the streaming forms (flash attention, the online-softmax folds) out of it."""
        return list(self._partitioned(frozenset() if streaming else frozenset(self.roots)))

    @functools.cache
    def _partitioned(self, unfused: frozenset[str]) -> tuple[FusedKernel, ...]:
        """The kernels (untraced) of the cheapest extraction whose roots ``unfused`` are taken
        from the extraction without the streaming forms (:meth:`_mixed_extraction`)."""
        kernels = partition_kernels(self._mixed_extraction(unfused), self.lowered)
        kernels = gradients_head_dim_last(kernels, frozenset(self.lowered.outputs))
        return tuple(joined_backward(joined_statistics(kernels)))

    @functools.cache
    def _kernels_with(self, unfused: frozenset[str]) -> tuple[FusedKernel, ...]:
        """:meth:`_partitioned`'s kernels, each with its trace."""
        return tuple(self._traced(list(self._partitioned(unfused))))

    @functools.cache
    def _mixed_extraction(self, unfused: frozenset[str]) -> dict[str, Term]:
        """The cheapest term of each root the outputs read, where the roots ``unfused`` (and those
        only their terms read) take theirs from the extraction without the streaming forms: one
        attention without a flash plan runs as a contraction, softmax rows and a contraction while
        the others keep their flash kernels."""
        fused, _, fused_every = self._extraction(())
        if not unfused:
            return fused
        plain_every = self._extraction(STREAMING_FORMS)[2]
        every = {name: (plain if name in unfused or name not in fused_every else fused_every[name], 0)
                 for name, plain in plain_every.items()}  # fmt: skip
        return {name: term for name, (term, _) in _read_from_outputs(every, self.lowered.outputs).items()}

    def _unplanned(self, unfused: frozenset[str], target: Target | None) -> list[FusedKernel]:
        """The streaming kernels of :meth:`_partitioned` ``(unfused)`` that no kernel family runs:
        a flash kernel whose operands are no tensors a flash kernel reads, a log-sum-exp not
        written by its flash kernel, and (given ``target``) a flash kernel with no plan there."""
        kernels = list(self._partitioned(unfused))
        if target is not None:
            plans = (*self._plans(target, unfused), *self._backward_plans(target, unfused))
            planned = {plan.problem.out for plan in plans}
            return [k for k in kernels if k.kind in ("flash_attention", "flash_attention_backward")
                    and k.output not in planned]  # fmt: skip
        return [k for k in kernels if k.kind == "attention_lse"  # no family plans a log-sum-exp alone
                or k.kind == "flash_attention" and self._attention_problem(k.core, kernels, k) is None
                or k.kind == "flash_attention_backward" and self._backward_problem(k, kernels) is None]  # fmt: skip

    @functools.cache
    def _unfused_roots(self, target: Target | None) -> frozenset[str]:
        """The roots taken from the extraction without the streaming forms so that every
        streaming kernel left is one a family runs (on ``target``; None: on some target): those
        that hold, or read through unstored buffers, a kernel :meth:`_unplanned` names, round by
        round (every root, where a round adds none)."""
        unfused = frozenset() if target is None else self._unfused_roots(None)
        while unplanned := self._unplanned(unfused, target):
            kernels = self._partitioned(unfused)
            roots = frozenset().union(*(_roots_holding(k, kernels, frozenset(self.roots)) for k in unplanned))
            if roots <= unfused:
                return frozenset(self.roots)
            log.info("%s: %s run unfused (no flash plan%s)", self.graph.name, ", ".join(sorted(roots - unfused)),
                     f" on {target.name}" if target is not None else "")  # fmt: skip
            unfused |= roots
        return unfused

    @functools.cached_property
    def kernels(self) -> list[FusedKernel]:
        """The fused kernels covering the graph (from the cheapest extraction), each with
        the rules its fused form needs; an attention whose flash kernel's operands are not
        tensors any flash kernel reads runs on the unfused kernels (:meth:`_unfused_roots`)."""
        return list(self._kernels_with(self._unfused_roots(None)))

    @functools.cached_property
    def unfused_kernels(self) -> list[FusedKernel]:
        """The kernels of the cheapest extraction without the streaming forms (attention as
        a contraction, softmax rows and a contraction), each with its trace."""
        return list(self._kernels_with(frozenset(self.roots)))

    def kernels_for(self, target: str | Target) -> list[FusedKernel]:
        """The kernels the graph runs on ``target``: :attr:`kernels`, each attention whose flash
        kernel has no plan there on the unfused kernels."""
        target = TARGETS[target] if isinstance(target, str) else target
        return list(self._kernels_with(self._unfused_roots(target)))

    def _traced(self, kernels: list[FusedKernel]) -> list[FusedKernel]:
        """``kernels`` with the rules each one's forms need (a joined backward: all its gradients')."""
        def trace(kernel: FusedKernel) -> tuple[str, ...]:
            heads = ([kernel.source[0]] if kernel.source else []) + [side.term[0] for side in kernel.side_outputs]
            return tuple(dict.fromkeys(rule for head in heads for rule in self._needed_rules(head)))

        return [dataclasses.replace(k, trace=trace(k)) for k in kernels]

    @functools.cache
    def _needed_rules(self, constructor: str) -> tuple[str, ...]:
        """A minimal set of the rules that fired without which no ``constructor`` form
        arises, ordered by the pass in which each first fired (greedy ablation: :meth:`_ablate`),
        ablated once in a process for one root, rules and fired passes (:data:`ABLATIONS`)."""
        if constructor not in TRACED_FORMS:
            return ()
        lowered = self._root_holding(constructor)
        rules = "\n".join(r.egglog() for r in self.rulesets)
        fired = repr(sorted(self.first_pass.items()))
        text = "\n".join([program_for(lowered)[0], rules, fired, str(self.stats.iterations), constructor])
        key = hashlib.sha256(text.encode()).hexdigest()
        if key not in ABLATIONS:
            while len(ABLATIONS) >= MAX_ABLATIONS:
                ABLATIONS.pop(next(iter(ABLATIONS)))
            ABLATIONS[key] = self._ablate(lowered, constructor)
        return ABLATIONS[key]

    def _ablate(self, lowered: Lowered, constructor: str) -> tuple[str, ...]:
        """The greedy ablation behind :meth:`_needed_rules`, over ``lowered`` (the root whose
        extraction holds the form: its term reads the other roots as stored tensors — a whole
        model's layers are one graph, and re-deriving all of them per trial made the ablation the
        bulk of a search). A trial stops once the form arises, and the ablation starts from the
        rules that fired before it arose in a trial with them all: without the others those
        passes run the same. A trial without a rule runs at most :data:`TRIAL_PASS_FACTOR` times the passes
        the form took with them all: a trial whose form never arises otherwise runs to the e-graph's bound
        (seconds each, where constants multiply along e-classes such as ``x ≡ (x·log2 e)·ln 2``), and a rule
        the form could do without only by a route that long is kept."""
        with_all = self._trial(lowered, constructor, set(self.first_pass), self.stats.iterations)
        if not _holds(with_all.egraph, constructor):
            return ()
        order = [r.name for ruleset in self.rulesets for r in ruleset.rules]
        needed = sorted(with_all.first_pass, key=lambda r: (self.first_pass[r], order.index(r)))
        max_passes = min(self.stats.iterations, TRIAL_PASS_FACTOR * with_all.stats.iterations)
        for rule in list(needed):
            trial = [r for r in needed if r != rule]
            if _holds(self._trial(lowered, constructor, set(trial), max_passes).egraph, constructor):
                needed = trial
        return tuple(needed)

    def _root_holding(self, constructor: str) -> Lowered:
        """The lowered graph cut down to the first root whose extracted term (with or without
        the streaming forms) holds a ``constructor`` form; the whole graph if none does."""
        for excluded in ((), STREAMING_FORMS):
            for name, term in self._extract(excluded).items():
                if any(s[0] == constructor for s in t.subterms(term)):
                    axes = {name: self.lowered.root_axes[name]}
                    inlined = {n: x for n, x in self.lowered.inlined.items() if n == name}
                    return dataclasses.replace(self.lowered, roots={name: self.lowered.roots[name]}, root_axes=axes,
                                               outputs=(name,), inlined=inlined)  # fmt: skip
        return self.lowered

    def _trial(self, lowered: Lowered, constructor: str, rules: set[str], max_passes: int) -> Saturation:
        """``lowered`` saturated with ``rules`` alone for up to ``max_passes``, stopped once a ``constructor``
        form arises."""
        subset = tuple(
            dataclasses.replace(r, rules=tuple(x for x in r.rules if x.name in rules)) for r in self.rulesets
        )
        return saturate(lowered, subset, max_passes, MAX_ENODES, self.graph.name, until=constructor)

    def evaluate(self, inputs: Mapping[str, Any]) -> dict[str, np.ndarray]:
        """Run the fused kernels' float64 references in order: the derived program's value."""
        buffers: dict[str, np.ndarray] = dict(check_inputs(self.graph, inputs))
        for kernel in self.kernels:
            buffers.update(kernel.evaluate_outputs(buffers))
        return {name: buffers[name] for name in self.graph.outputs}

    @functools.cached_property
    def trace(self) -> tuple[str, ...]:
        """The rules each fused kernel needs, in the order they first fired."""
        return self.trace_of(self.kernels)

    @staticmethod
    def trace_of(kernels: list[FusedKernel] | tuple[FusedKernel, ...]) -> tuple[str, ...]:
        """The rules ``kernels`` need, each once, kernel by kernel in their order."""
        return tuple(dict.fromkeys(rule for kernel in kernels for rule in kernel.trace))

    def plans(self, target: str | Target = "sm_120") -> list[KernelPlan | BackwardPlan]:
        """Every valid (flash-attention form × schedule) for ``target``: the forward's, then the
        backward's."""
        target = TARGETS[target] if isinstance(target, str) else target
        unfused = self._unfused_roots(target)
        return [*self._plans(target, unfused), *self._backward_plans(target, unfused)]

    @functools.cache
    def _backward_plans(self, target: Target, unfused: frozenset[str]) -> tuple[BackwardPlan, ...]:
        plans = []
        kernels = list(self._kernels_with(unfused))
        for kernel in kernels:
            if kernel.kind == "flash_attention_backward":
                problem = self._backward_problem(kernel, kernels)
                if problem is not None:
                    problem = dataclasses.replace(problem, saved=saved_statistics(problem, list(self.saved_attentions)))
                    plans += backward_plans(problem, target, kernel.trace)
        return tuple(plans)

    @functools.cached_property
    def saved_attentions(self) -> tuple[SavedAttention, ...]:
        """The attentions whose output and log-sum-exp the graph's saved inputs hold: the values
        those inputs hold derived on their own (a flash attention and its ``AttentionLse``), reading
        the intermediates this graph stores (RoPE'd q and k, the projections) under this derivation's
        names, so that they compare with its backward's attention. A value may read an earlier saved
        input (the second layer's attention reads the first's saved output): the values are
        outputs under names of their own, given back the saved inputs' names after."""
        if not self.graph.saved:
            return ()
        lowered, recomputed = self.lowered, {n for group in self.lowered.recomputed for n in group}
        below = self.graph.ancestors([value.id for value in self.graph.saved.values()])
        stored = {name: Tensor(self.graph, index) for name, index in lowered.nodes.items()
                  if name not in lowered.outputs and name not in recomputed and index in below}  # fmt: skip
        taken = {*self.graph.inputs, *lowered.nodes}
        holder: dict[str, str] = {}  # a value's output name -> the saved input holding it
        for name in self.graph.saved:
            holder[fresh_name(f"{name}_value", taken, bare_first=True)] = name
        outputs = {output: self.graph.saved[name] for output, name in holder.items()}
        values = self.graph.subgraph({**outputs, **stored}, f"saved values of {self.graph.name}"[:200])
        derivation = Derivation(values, self.rulesets, self.stats.iterations, MAX_ENODES)
        lowered = derivation.lowered
        extracted = {holder[name]: term for name, term in derivation.extracted.items() if name in holder}
        root_axes = {holder.get(name, name): axes for name, axes in lowered.root_axes.items()}
        shapes = {**lowered.input_shapes, **{holder.get(name, name): lowered.shape(name) for name in lowered.roots}}
        dtypes = {**lowered.input_dtypes, **{holder.get(n, n): dtype for n, dtype in lowered.root_dtypes.items()},
                  **{name: x.dtype for name, x in self.graph.saved.items()}}  # fmt: skip
        return tuple(saved_attentions(extracted, root_axes, shapes, dtypes))

    @functools.cache
    def _plans(self, target: Target, unfused: frozenset[str]) -> tuple[KernelPlan, ...]:
        problems = {}
        kernels = list(self._kernels_with(unfused))
        for kernel in kernels:
            if kernel.kind == "flash_attention":
                problem = self._attention_problem(kernel.core, kernels, kernel)
                if problem is not None:
                    problems[kernel.output] = dataclasses.replace(problem, out=kernel.output)
        if not problems:
            return ()
        dims = tuple(sorted({(p.head_dim, p.value_dim) for p in problems.values()}))
        # the forms as the kernels' extraction saw them: in its scope, where it computed in place
        with self._unstored(self._extraction(())[1]):
            self._run("(push)")
            try:
                self._run(schedule_facts(target, dims) + "\n(run-schedule (run schedule))")
                rows = self.forms_of("Scheduled")
            finally:
                self._run("(pop)")
        schedules: dict[Term, list[Any]] = {}  # by the flash form they schedule
        for row in rows:
            schedules.setdefault(row[1], []).append(schedule_from_term(row[2]))
        plans = []
        for kernel in kernels:
            problem = problems.get(kernel.output)
            if problem is None:
                continue
            # key splits come from the split-KV form of the same e-class (rule flash-split-kv)
            split_trace = (*kernel.trace, "flash-split-kv")
            for schedule in schedules.get(kernel.source, ()):
                fits = (hopper_schedule_problems if isinstance(schedule, HopperFlashSchedule) else
                        fp8_schedule_problems if isinstance(schedule, Fp8FlashSchedule) else flash_schedule_problems)
                if not fits(schedule, problem, target):
                    trace = split_trace if getattr(schedule, "kv_splits", 1) > 1 else kernel.trace
                    plans.append(KernelPlan("flash_attention", problem, schedule, target, trace))
        return tuple(sorted(set(plans), key=lambda p: p.name))


def _holds_fused_forms(extracted: Mapping[str, tuple[Term, int]], gradient: bool) -> bool:
    """Whether any extracted term holds a flash-attention backward form (``gradient``), or else a
    flash-attention form: what computing the intermediates in place is for (in a forward graph, a
    softmax that two products read)."""
    forms = GRADIENT_FORMS if gradient else FLASH_FORWARD
    return any(s[0] in forms for term, _ in extracted.values() for s in t.subterms(term))


def _cost(extracted: Mapping[str, tuple[Term, int]]) -> int:
    return sum(cost for _, cost in extracted.values())


def _read_from_outputs(extracted: dict[str, tuple[Term, int]],
                       outputs: tuple[str, ...]) -> dict[str, tuple[Term, int]]:  # fmt: skip
    """The extracted roots the outputs read, directly or through other roots (in their order): an
    intermediate that every reader computes in place (a fused form of an inlined alternative)
    is not stored."""
    needed, stack = set(outputs), list(outputs)
    while stack:
        for sub in t.subterms(extracted[stack.pop()][0]):
            if sub[0] == "Tensor" and sub[1] in extracted and sub[1] not in needed:
                needed.add(sub[1])
                stack.append(sub[1])
    return {name: term for name, term in extracted.items() if name in needed}


def _roots_holding(kernel: FusedKernel, kernels: tuple[FusedKernel, ...], roots: frozenset[str]) -> frozenset[str]:
    """The roots ``kernel`` writes, and those whose kernels read what it writes through buffers
    that are no roots (a flash kernel a projection's partition materialised)."""
    found, seen, stack = set(), set(), list(kernel.outputs)
    while stack:
        name = stack.pop()
        if name in seen:
            continue
        seen.add(name)
        if name in roots:
            found.add(name)
        else:
            stack += [output for k in kernels if name in k.reads for output in k.outputs]
    return frozenset(found)


def derive(graph: Graph, **options: Any) -> Derivation:
    """Saturate ``graph``'s e-graph with the fusion rulesets; see :class:`Derivation`."""
    if not isinstance(graph, Graph):
        raise GraphError(f"derive: expected a ck.Graph, got {type(graph).__name__}")
    if not graph.outputs:
        raise GraphError(f"derive: graph {graph.name!r} has no outputs; mark one with g.output(tensor, name)")
    return Derivation(graph, **options)
