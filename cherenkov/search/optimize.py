"""``ck.optimize``: from a graph to its fastest correct kernels, with a report.

derive → (a remembered answer?) → enumerate candidates → compile (all cores) → verify
and time in worker processes (or rank by the cost model where nothing can be measured) →
rank → store in the tuning database → write ``report.json`` and ``report.html``. A
repeated search on the same GPU, toolkit and code answers from the database: the winners'
plans are rebuilt from their records and their sources read back, so no candidate is
enumerated, generated or compiled. Candidates the database already knows (failures
included) are not compiled or measured again, which is how a partial (budgeted) search
resumes. Under a budget every kernel gets a first round before anything else
(:mod:`cherenkov.search.budget`), so a budgeted search always ends with a winner for
every kernel.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import os
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import platformdirs

from cherenkov.codegen import CompileError, compile_plans, load_kernel
from cherenkov.codegen.cache import sha256_hex
from cherenkov.codegen.plan import CompiledKernel
from cherenkov.codegen.term_plan import TermKernelPlan
from cherenkov.graph import Graph, GraphError
from cherenkov.rewrites import dag
from cherenkov.rewrites.derive import Derivation, derive
from cherenkov.rewrites.kernels import FusedKernel
from cherenkov.rewrites.plan import TARGETS, KernelPlan
from cherenkov.rewrites.plan_backward import AttentionBackwardProblem
from cherenkov.rewrites.plan_sm90a import HopperFlashSchedule
from cherenkov.search import budget
from cherenkov.search.cost_model import GPUS, predict_plan
from cherenkov.search.database import CandidateKey, TuningDatabase, WinnerKey
from cherenkov.search.distributed import DaskExecutor
from cherenkov.search.environment import Capabilities, detect
from cherenkov.search.faults import inject_fault
from cherenkov.search.measure import MeasurementPool, MeasureTask
from cherenkov.search.records import CandidateResult, Environment, Timing
from cherenkov.search.report import SearchSummary, write_html, write_json
from cherenkov.search.space import Candidate, SearchSpace, generator_digest, search_space, stored_plan
from cherenkov.search.twins import twin_groups, twin_result

log = logging.getLogger(__name__)

MIN_NOISE = 0.005  # medians closer than 0.5% always tie
# Medians more than 2% apart never tie: a candidate's median - min spread also holds clock
# changes (a GPU left idle by the compiles boosts for its first samples), 8% on a 5 ms kernel
# of the 2026-11-30 H200 run, where an uncapped band let a candidate 7.7% slower than the
# fastest win on its id.
MAX_NOISE = 0.02
FRESH_TAIL_KERNELS = 4  # kernels a CapturedRun may launch after its replay to write fresh outputs
Progress = Callable[..., None]


def _no_progress(event: str, **info: Any) -> None:
    log.debug("%s %s", event, info)


def input_signature(graph: Graph) -> str:
    """``name:dtype[shape];...`` of the graph's inputs: part of every database key."""
    return ";".join(f"{n}:{t.dtype}[{','.join(map(str, t.shape))}]" for n, t in sorted(graph.inputs.items()))


@dataclass(frozen=True)
class BestKernel:
    """The winning candidate of one kernel of the graph."""

    kernel: str
    result: CandidateResult
    plan: KernelPlan | TermKernelPlan
    source: str

    @property
    def target(self) -> str:
        return self.plan.target.name

    @property
    def time_ms(self) -> float | None:
        return self.result.time_ms

    @property
    def tflops(self) -> float | None:
        return self.result.tflops


class OptimizeResult:
    """What a search found: the winners, every candidate, the reports.

    ``partition`` holds the kernels the graph runs on for the search's target (the
    derivation's, or its unfused kernels where flash attention has no plan there);
    ``kernels`` maps each to its winner."""

    def __init__(
        self, graph: Graph, derivation: Derivation, partition: list[FusedKernel], summary: SearchSummary,
        winners: dict[str, BestKernel], report_json: Path, report_html: Path, from_database: bool,
    ) -> None:
        self.graph = graph
        self.derivation = derivation
        self.partition = partition
        self.summary = summary
        self.kernels = winners
        self.report_json = report_json
        self.report_html = report_html
        self.from_database = from_database
        self._loaded: dict[int, list[tuple[FusedKernel, Any, Any]]] = {}

    @property
    def environment(self) -> Environment:
        return self.summary.environment

    @property
    def candidates(self) -> list[CandidateResult]:
        return list(self.summary.candidates)

    @property
    def best(self) -> BestKernel:
        """The winner of the graph's costliest kernel (for attention, the only one)."""
        return max(self.kernels.values(), key=lambda w: w.result.flops)

    def dump(self, path: str | os.PathLike[str]) -> Path:
        """Write the best kernel's CUDA source to ``path``."""
        target = Path(path)
        target.write_text(self.best.source)
        return target

    def run(self, **tensors: Any) -> dict[str, Any]:
        """Run the graph with the winning kernels: torch CUDA tensors in, ``{output: tensor}`` out.

        Every kernel of ``partition`` runs in order on the current stream (except a
        producer whose consumer's winner absorbed it: :func:`launched_kernels`); the
        intermediate buffers they write stay in device memory and are freed when the last
        kernel reading them is done. Inputs must be contiguous CUDA tensors of the graph's
        dtypes and shapes. Each call checks the tensors and launches every kernel from
        Python; for repeated calls on the same buffers, :meth:`capture` removes that host work."""
        buffers = self._checked_inputs(tensors)
        self._launch(buffers, range(len(self.launched)))
        return {name: buffers[name] for name in self.graph.outputs}

    def capture(self, **tensors: Any) -> CapturedRun:
        """Record :meth:`run` on these tensors as one CUDA graph and return it as a callable.

        ``captured()`` replays every kernel with no Python work per kernel and returns the
        same output tensors each time; to run on new data, copy it into the captured input
        tensors (``x.copy_(new_x)``) — they must stay alive and in place."""
        return self._capture(tensors, tail_start=len(self.launched))

    def capture_fresh(self, **tensors: Any) -> CapturedRun:
        """:meth:`capture`, except that the kernels from the first one writing a graph output on
        (at most ``FRESH_TAIL_KERNELS`` of them) are launched by each call instead of replayed,
        into new tensors: the outputs they write are the call's own (``captured.fresh``), so a
        caller that must hand out unshared outputs need not copy them (GPT-2's logits: 0.8 GB).
        With a longer tail, every kernel is replayed and ``fresh`` is empty."""
        outputs, count = set(self.graph.outputs), len(self.launched)
        writers = [p for p, k in enumerate(self.launched) if outputs & set(k.outputs)]
        short = writers and count - writers[0] <= FRESH_TAIL_KERNELS
        return self._capture(tensors, tail_start=writers[0] if short else count)

    def _capture(self, tensors: dict[str, Any], tail_start: int) -> CapturedRun:
        """The kernels before ``tail_start`` recorded as one CUDA graph on ``tensors``; the
        rest launched by each call of the returned run, after the replay."""
        import torch

        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # load the kernels and warm the allocator outside the capture
            self.run(**tensors)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        buffers = self._checked_inputs(tensors)
        with torch.cuda.graph(graph):
            self._launch(buffers, range(tail_start))
        tail = range(tail_start, len(self.launched))
        fresh = tuple(n for n in self.graph.outputs if any(n in self.launched[p].outputs for p in tail))
        held = dict(buffers)  # the inputs and the recorded buffers the tail reads

        def run_tail() -> dict[str, Any]:
            values = dict(held)
            self._launch(values, tail)
            return {name: values[name] for name in fresh}

        recorded = {name: buffers[name] for name in self.graph.outputs if name not in fresh}
        return CapturedRun(graph, recorded, dict(tensors), run_tail if tail else None, fresh)

    def _checked_inputs(self, tensors: Mapping[str, Any]) -> dict[str, Any]:
        missing = sorted(set(self.graph.inputs) - set(tensors))
        if missing:
            raise GraphError(f"run: missing inputs {missing}; graph {self.graph.name!r} needs {sorted(self.graph.inputs)}")
        return dict(tensors)

    def _launch(self, buffers: dict[str, Any], positions: Iterable[int]) -> None:
        """Launch the kernels at ``positions`` of :attr:`launched` on ``buffers`` (which gain
        their outputs and lose the intermediates no later kernel reads)."""
        import torch

        launchers = self._launchers(torch.cuda.current_device())
        for position in positions:
            kernel, launcher, problem = launchers[position]
            if problem is None:
                buffers[kernel.output] = launcher.launch(buffers)
            elif isinstance(problem, AttentionBackwardProblem):  # several outputs: the gradients
                stored = problem.stored_shapes()
                a = problem.attention
                saved = (problem.saved.o, problem.saved.lse) if problem.saved is not None else ()
                bias = (a.bias.tensor,) if a.bias is not None else ()
                reads = {n: viewed_as(buffers[n], stored[n], n)
                         for n in (a.q, a.k, a.v, problem.grad_output, *saved, *bias)}  # fmt: skip
                buffers.update(launcher.launch(reads))
            else:
                stored = problem.stored_shapes()
                q, k, v = (viewed_as(buffers[n], stored[n], n) for n in (problem.q, problem.k, problem.v))
                bias = None if problem.bias is None else viewed_as(buffers[problem.bias.tensor], problem.bias.shape,
                                                                   problem.bias.tensor)  # fmt: skip
                extra = {"factors": tuple(viewed_as(buffers[f.tensor], f.shape, f.tensor) for f in problem.factors)
                         } if problem.factors else {}  # fmt: skip
                if problem.lse is not None:  # the rows' log-sum-exp, a second output
                    extra["lse"] = buffers[problem.lse.tensor] = torch.empty(
                        problem.lse.layout.shape, dtype=torch.float32, device=q.device)
                buffers[kernel.output] = viewed_as(launcher(q, k, v, bias=bias, **extra), kernel.stored_shape,
                                                   kernel.output)  # fmt: skip
            for name in self._dead_after[position]:
                del buffers[name]

    def _launchers(self, device: int) -> list[tuple[FusedKernel, Any, Any]]:
        """(kernel, loaded launcher, attention problem or None) for each kernel in order,
        loaded onto ``device`` on first use."""
        cached = self._loaded.get(device)
        if cached is not None:
            return cached
        winners = []
        for kernel in self.launched:
            winner = self.kernels.get(kernel.output)
            if winner is None:
                raise GraphError(
                    f"run: kernel {kernel.output} ({kernel.kind}) has no winning CUDA kernel; the search report "
                    f"({self.report_json}) says why (no plan fits, or every candidate failed)"
                )
            winners.append(winner)
        # one parallel compile: a twin's winner (measured through its twin) is not in the cache yet
        compiled = compile_plans([w.plan for w in winners], sources=[w.source for w in winners])
        launchers = []
        for kernel, winner, build in zip(self.launched, winners, compiled):
            if isinstance(build, CompileError):
                raise GraphError(f"run: the winner of kernel {kernel.output} ({winner.result.id}) no longer "
                                 f"compiles: {build}")  # fmt: skip
            problem = None if isinstance(winner.plan, TermKernelPlan) else winner.plan.problem
            launchers.append((kernel, load_kernel(build, device), problem))
        self._loaded[device] = launchers
        return launchers

    @functools.cached_property
    def launched(self) -> list[FusedKernel]:
        """The kernels :meth:`run` launches, in order: the partition's, less any producer
        that its consumer's winner absorbed (:func:`launched_kernels`)."""
        return launched_kernels(self.partition, frozenset(self.graph.outputs), self.kernels)

    @functools.cached_property
    def _dead_after(self) -> list[list[str]]:
        """For each launched kernel's position, the intermediate buffers no later kernel reads."""
        kernel_graph = dag.kernel_dag(self.launched, lambda k: winner_reads(k, self.kernels.get(k.output)))
        order = [k.output for k in self.launched]
        keep = set(self.graph.outputs) | set(self.graph.inputs)
        dead = [[] for _ in order]
        for buffer, reader in sorted(dag.last_readers(kernel_graph, order).items()):
            if buffer not in keep:
                dead[order.index(reader)].append(buffer)
        return dead


def viewed_as(tensor: Any, shape: tuple[int, ...], name: str) -> Any:
    """``tensor`` viewed at ``shape``: the same row-major bytes under the shape the next kernel
    reads them at (a decode step's query stored as ``(1, 1, H·D)`` is its flash problem's
    ``(1, H, 1, D)``; the flash output ``(1, H, 1, D)`` is the output projection's
    ``(H·D,)``); a ``GraphError`` where the element counts differ or it is not contiguous."""
    shape = tuple(shape)
    if tuple(tensor.shape) == shape:
        return tensor
    if tensor.numel() != math.prod(shape) or not tensor.is_contiguous():
        raise GraphError(f"run: buffer {name} is {tuple(tensor.shape)}; the kernel reading it needs {shape}")
    return tensor.view(shape)


class CapturedRun:
    """The graph's kernels recorded as one CUDA graph on fixed tensors (:meth:`OptimizeResult.capture`).

    Calling it replays the graph on the current stream and returns ``{output: tensor}``: the
    same tensors every call, except those named in ``fresh``, which a tail of kernels launched
    after the replay writes into new tensors (:meth:`OptimizeResult.capture_fresh`).
    ``inputs`` are the captured input tensors: copy new data into them to run on it."""

    def __init__(self, graph: Any, outputs: dict[str, Any], inputs: dict[str, Any],
                 tail: Callable[[], dict[str, Any]] | None = None, fresh: tuple[str, ...] = ()) -> None:  # fmt: skip
        self._graph = graph
        self.outputs = outputs
        self.inputs = inputs
        self._tail = tail
        self.fresh = fresh

    def __call__(self) -> dict[str, Any]:
        self._graph.replay()
        return self.outputs if self._tail is None else {**self.outputs, **self._tail()}


# ------------------------------------------------------------------------------ search


def _rank(results: list[CandidateResult], credit: Mapping[str, float] | None = None) -> CandidateResult | None:
    """Fastest usable candidate; medians within the winner's noise (its median − min spread,
    between ``MIN_NOISE`` and ``MAX_NOISE``) tie, and among them the cost model's favourite
    (smallest ``predicted_ms``, then the smallest id) wins: where the samples cannot order
    two plans, the model fitted to same-process A/Bs can, and the same measurements always
    pick the same winner. ``credit`` (by id): time a candidate saves elsewhere — the
    producer kernel it absorbs."""
    usable = [r for r in results if r.status in ("ok", "modelled") and r.time_ms]
    if not usable:
        return None
    credit = credit or {}

    def cost(r: CandidateResult) -> float:
        return r.time_ms - credit.get(r.id, 0.0)

    fastest = min(usable, key=lambda r: (cost(r), r.id))
    noise = MIN_NOISE
    if fastest.timing is not None:
        spread = (fastest.timing.median_ms - fastest.timing.min_ms) / fastest.timing.median_ms
        noise = min(MAX_NOISE, max(MIN_NOISE, spread))
    tied = [r for r in usable if cost(r) <= cost(fastest) + fastest.time_ms * noise]
    return min(tied, key=lambda r: (math.inf if r.predicted_ms is None else r.predicted_ms, r.id))


def _peak(plan: KernelPlan | TermKernelPlan) -> float:
    """The peak a plan's instruction family can reach on its target's reference GPU."""
    gpu = GPUS[plan.target.name]
    hopper = isinstance(plan, KernelPlan) and isinstance(plan.schedule, HopperFlashSchedule)
    return gpu.wgmma_tflops if hopper else gpu.mma_tflops


def _flops(plan: KernelPlan | TermKernelPlan) -> float:
    return plan.flops if isinstance(plan, TermKernelPlan) else plan.problem.flops


def _base_result(candidate: Candidate, status: str, **values: Any) -> CandidateResult:
    plan = candidate.plan
    return CandidateResult(
        id=candidate.id, kernel=candidate.kernel, kind=plan.kind, params=plan.params(),
        source_hash=candidate.source_hash, status=status, flops=_flops(plan),
        peak_tflops=_peak(plan), **values,
    )  # fmt: skip


def _compiled_values(compiled: CompiledKernel) -> dict[str, Any]:
    report = compiled.report
    return {
        "registers": report.registers,
        "smem_bytes": report.smem_static + report.smem_dynamic,
        "spill_bytes": report.spill_bytes,
        "compile_seconds": compiled.compile_seconds,
        "predicted_ms": predict_plan(compiled.plan, registers=report.registers).ms,
    }


class _Search:
    """One search: the state shared by its steps.

    :meth:`evaluate` gives every candidate a result: those the tuning database knows keep
    theirs; the rest are compiled (in parallel chunks, most promising first), then verified
    and timed in worker processes (or ranked by the cost model where nothing can be
    measured) — under a budget in the rounds of :mod:`cherenkov.search.budget`."""

    def __init__(self, graph: Graph, caps: Capabilities, budget_s: float | None, progress: Progress,
                 timeout_s: float, faults: Mapping[str, str], cluster: DaskExecutor | None = None) -> None:  # fmt: skip
        self.graph = graph
        self.cluster = cluster
        self.caps = caps
        self.env = caps.environment
        self.start = time.monotonic()
        self.budget_s = budget_s
        self.deadline = None if budget_s is None else self.start + budget_s
        self.progress = progress
        self.timeout_s = timeout_s
        self.faults = faults
        self.notes = list(caps.limitations)
        self.references: dict[str, float] = {}
        self.pool: MeasurementPool | None = None
        self.counts = {"compiled": 0, "measured": 0}
        self.totals = {"compiled": 0, "measured": 0}
        self.twins: dict[str, tuple[Candidate, ...]] = {}
        self.credit: Credit | None = None  # the space's predicted savings, set by evaluate

    @property
    def chunk(self) -> int:
        """Candidates compiled together: two per core keep every core busy."""
        return 2 * (os.cpu_count() or 1)

    def evaluate(self, space: SearchSpace, known: Mapping[str, CandidateResult]) -> dict[str, CandidateResult]:
        """A result for every candidate of ``space`` (by id): ``known`` ones as they are."""
        results = dict(known)
        fresh = [c for c in space.all() if c.id not in results]
        if self.env.toolkit == "none":
            for c in fresh:
                results[c.id] = _base_result(c, "modelled", predicted_ms=predict_plan(c.plan).ms,
                                             reason="not compiled: no CUDA compiler")  # fmt: skip
            return results
        names = set(self.graph.inputs) | {n for k in space.kernels for n in (k.output, *k.reads)}
        self.twins = twin_groups([c for c in space.all() if c.id not in self.faults], names)
        self._share_with_twins([c for c in space.all() if c.id in results], results)
        fresh = [c for c in fresh if c.id not in results]
        distinct = len({self._lead(c) for c in fresh})
        self.totals = {"compiled": distinct, "measured": distinct if self.env.measured else 0}
        credit = self.credit = Credit.of_space(space)
        ordered = {k: sorted(group, key=lambda c: (credit.net(c), c.id)) for k, group in space.candidates.items()}
        first = [c for group in ordered.values() for c in budget.first_round(group, credit.net) if c.id not in results]
        if self.deadline is not None:
            self._check_first_round(first)
            self.progress("first_round", candidates=len(first), kernels=len(ordered), total=len(fresh))
        with self._measurement_pool():
            self._run(first, results, deadline=None)
            for kernel, group in ordered.items():  # a kernel whose first picks all failed: its next ones
                rest = [c for c in group if c.id not in results]
                while rest and not any(_usable(results[c.id]) for c in group if c.id in results):
                    self._run(rest[: self.chunk], results, deadline=None)
                    rest = rest[self.chunk :]
            if self.deadline is None:
                self._run([c for group in ordered.values() for c in group if c.id not in results], results, None)
            else:
                self._share_the_rest(ordered, results)
            self._measure_references(space, results)
        for c in fresh:
            if c.id not in results:
                results[c.id] = _base_result(c, "unmeasured", reason="time budget spent before compiling")
        unmeasured = sum(1 for c in fresh if results[c.id].status == "unmeasured")
        if unmeasured:
            self.notes.append(f"partial: {unmeasured} of {len(space.all())} candidates left unmeasured when the "
                              f"time budget ran out (resume=True or --resume measures them)")
        return results

    def _check_first_round(self, first: list[Candidate]) -> None:
        """Refuse, before starting, a budget that cannot cover the first round."""
        cores = os.cpu_count() or 1
        distinct = len({self._lead(c) for c in first})  # twins are compiled and measured once
        need = budget.first_round_seconds(distinct, distinct if self.env.measured else 0, cores)
        if need > self.budget_s:
            kernels = len({c.kernel for c in first})
            raise GraphError(
                f"optimize: a budget of {self.budget_s:g} s cannot cover the first round of {self.graph.name!r}: "
                f"{distinct} candidates (each of {kernels} kernels' cost-model favourite and safest plan, twins "
                f"once) to "
                f"compile on {cores} cores{' and verify on the GPU' if self.env.measured else ''} need about "
                f"{need:.0f} s here; give budget_s >= {math.ceil(need)} or None (no budget)"
            )

    def _share_the_rest(self, ordered: Mapping[str, list[Candidate]], results: dict[str, CandidateResult]) -> None:
        """The budget left after the first round, shared by the kernels' predicted time."""
        rest = {k: [c for c in group if c.id not in results] for k, group in ordered.items()}
        times = {k: _kernel_ms(group, results) for k, group in ordered.items() if rest[k]}
        for kernel, share in budget.shares(times):
            left = self.deadline - time.monotonic()
            if left <= 0:
                break
            self._run(rest[kernel], results, deadline=time.monotonic() + share * left)

    @contextlib.contextmanager
    def _measurement_pool(self) -> Iterator[None]:
        """One pool of measurement workers for the whole search (none on a cluster or
        where nothing is measured)."""
        if not self.env.measured or self.cluster is not None:
            yield
            return
        with MeasurementPool(self.caps.devices, self.timeout_s) as pool:
            self.pool = pool
            try:
                yield
            finally:
                self.pool = None

    def _run(self, candidates: list[Candidate], results: dict[str, CandidateResult], deadline: float | None) -> None:
        """Compile ``candidates`` chunk by chunk, measuring (or modelling) each chunk, until
        done or ``deadline``; results land in ``results``."""
        for start in range(0, len(candidates), self.chunk):
            if deadline is not None and time.monotonic() >= deadline:
                return
            group, leads = [], set()
            for candidate in candidates[start : start + self.chunk]:  # one of each twin group not yet known
                lead = self._lead(candidate)
                if candidate.id not in results and lead not in leads:
                    leads.add(lead)
                    group.append(candidate)
            if not group:
                continue
            ready = []
            for candidate, outcome in zip(group, self._compile(group)):
                if isinstance(outcome, CompileError):
                    reason = f"{outcome}: {(outcome.log or '').strip()[:600]}"
                    results[candidate.id] = _base_result(candidate, "compile_error", reason=reason)
                elif self.env.measured:
                    ready.append((candidate, outcome))
                else:
                    results[candidate.id] = _base_result(candidate, "modelled", **_compiled_values(outcome))
            if ready:
                results.update(self._measure(ready, deadline, results))
            self._share_with_twins(group, results)

    def _lead(self, candidate: Candidate) -> str:
        """The id of the first candidate of ``candidate``'s twin group (:mod:`cherenkov.search.twins`)."""
        return self.twins.get(candidate.id, (candidate,))[0].id

    def _share_with_twins(self, done: Iterable[Candidate], results: dict[str, CandidateResult]) -> None:
        """Each twin of a candidate in ``done`` (with a result) gets that result as its own."""
        for candidate in done:
            if candidate.id in results:
                for twin in self.twins.get(candidate.id, ()):
                    if twin.id not in results:
                        results[twin.id] = twin_result(results[candidate.id], twin)

    def _compile(self, group: list[Candidate]) -> list[CompiledKernel | CompileError]:
        sources = [inject_fault(c.source, self.faults[c.id]) if c.id in self.faults else None for c in group]
        plans = [c.plan for c in group]
        outputs = self.cluster.compile(plans, sources) if self.cluster is not None else compile_plans(plans, sources=sources)
        self.counts["compiled"] += len(group)
        self.progress("compiled", done=self.counts["compiled"], total=self.totals["compiled"])
        return outputs

    def _measure(self, ready: list[tuple[Candidate, CompiledKernel]], deadline: float | None,
                 known: Mapping[str, CandidateResult]) -> dict[str, CandidateResult]:  # fmt: skip
        """Verify and time the compiled candidates. One that absorbs a producer is credited
        with the producer's best time when compared with its kernel's best, so the candidates
        that absorb nothing go first (a producer in the same batch is then measured before
        its absorber); a producer not measured at all is credited with the cost model's
        best prediction for it (crediting nothing stops a GEMM that runs a GELU in its
        epilogue as "slower" than the GELU kernel alone, and it never wins)."""
        plain = [(c, k) for c, k in ready if not c.absorbs]
        absorbing = [(c, k) for c, k in ready if c.absorbs]
        measured = self._measure_batch(plain, deadline, known) if plain else {}
        if absorbing:
            measured.update(self._measure_batch(absorbing, deadline, {**known, **measured}))
        return measured

    def _measure_batch(self, ready: list[tuple[Candidate, CompiledKernel]], deadline: float | None,
                       known: Mapping[str, CandidateResult]) -> dict[str, CandidateResult]:  # fmt: skip
        ordered = sorted(ready, key=lambda ck: (_compiled_values(ck[1])["predicted_ms"], ck[0].id))
        seed = self.counts["measured"]
        producers = {c.absorbs for c, _ in ready if c.absorbs}
        best = {p: min((r.time_ms for r in known.values() if r.kernel == p and _usable(r)), default=None)
                for p in producers}  # fmt: skip

        def credit_ms(candidate: Candidate) -> float:
            if not candidate.absorbs:
                return 0.0
            if best[candidate.absorbs] is not None:
                return best[candidate.absorbs]
            return self.credit.saving(candidate) if self.credit is not None else 0.0

        tasks = [MeasureTask(c.id, k, seed=seed + i + 1, group=c.kernel, credit_ms=credit_ms(c))
                 for i, (c, k) in enumerate(ordered)]  # fmt: skip

        def done(measurement: Any) -> None:
            self.counts["measured"] += 1
            times = sorted(measurement.times_ms)
            median = times[len(times) // 2] if times else None
            self.progress("measured", candidate=measurement.candidate, status=measurement.status,
                          time_ms=median, done=self.counts["measured"], total=self.totals["measured"])  # fmt: skip

        if self.cluster is not None:
            measurements = self.cluster.measure(tasks, self.timeout_s)
            for measurement in measurements.values():
                done(measurement)
            note = "measured on the Dask cluster's GPU workers; SDPA references not measured"
            if note not in self.notes:
                self.notes.append(note)
        else:
            assert self.pool is not None, "measuring needs the search's measurement pool"
            measurements = self.pool.measure_all(tasks, done, deadline)
        return {c.id: _measured_result(c, k, measurements.get(c.id)) for c, k in ready}

    def _measure_references(self, space: SearchSpace, results: Mapping[str, CandidateResult]) -> None:
        """Time PyTorch's SDPA backends on each measured attention problem (time permitting)."""
        if self.pool is None or (self.deadline is not None and time.monotonic() >= self.deadline):
            return
        problems = {c.plan.problem for c in space.all()
                    if isinstance(c.plan, KernelPlan) and c.id in results and results[c.id].status == "ok"}  # fmt: skip
        for problem in problems:
            for name, ms in self.pool.references(problem).items():
                self.references[f"{name}:{problem.out}" if len(problems) > 1 else name] = problem.flops / (ms * 1e9)


def _predicted(candidate: Candidate) -> float:
    return predict_plan(candidate.plan).ms


@dataclass(frozen=True)
class Credit:
    """What each candidate saves elsewhere — one that absorbs a producer kernel, that
    kernel's best predicted time (it would not run) — and the predicted times net of it,
    by which the search orders and shares its work."""

    predicted: Mapping[str, float]
    saved: Mapping[str, float]

    @classmethod
    def of_space(cls, space: SearchSpace) -> Credit:
        predicted = {c.id: _predicted(c) for c in space.all()}
        saved = {kernel: min(predicted[c.id] for c in group) for kernel, group in space.candidates.items() if group}
        return cls(predicted, saved)

    def saving(self, candidate: Candidate) -> float:
        return self.saved.get(candidate.absorbs, 0.0) if candidate.absorbs else 0.0

    def net(self, candidate: Candidate) -> float:
        return self.predicted[candidate.id] - self.saving(candidate)


def _usable(result: CandidateResult) -> bool:
    return result.status in ("ok", "modelled") and bool(result.time_ms)


def _kernel_ms(group: list[Candidate], results: Mapping[str, CandidateResult]) -> float:
    """A kernel's time as the search knows it: its best result so far, else the model's
    best prediction."""
    times = [results[c.id].time_ms for c in group if c.id in results and _usable(results[c.id])]
    return min(times) if times else min(_predicted(c) for c in group)


def _measured_result(candidate: Candidate, compiled: CompiledKernel, measurement: Any) -> CandidateResult:
    values = _compiled_values(compiled)
    if measurement is None:
        return _base_result(candidate, "unmeasured", reason="time budget spent", **values)
    timing = None
    if measurement.times_ms:
        ordered = sorted(measurement.times_ms)
        timing = Timing(ordered[0], ordered[len(ordered) // 2], ordered[-1], len(ordered))
    return _base_result(candidate, measurement.status, reason=measurement.reason, rel_error=measurement.rel_error,
                        timing=timing, **values)  # fmt: skip


def _answers(summary: SearchSummary, budget_s: float | None, resume: bool) -> bool:
    """Whether a stored search answers this one: a complete search always; a partial one
    for the same or a smaller budget, unless resumed."""
    if not summary.partial:
        return True
    if resume or budget_s is None or summary.budget_s is None:
        return False
    return budget_s <= summary.budget_s


def _stored_answer(summary: SearchSummary, derivation: Derivation, target: str) -> tuple[list[FusedKernel], dict[str, BestKernel]] | None:
    """The kernels and winners a stored search names, rebuilt from its records without
    enumerating or generating the search space: None unless the derivation partitions the
    graph into the same kernels and every winner's plan rebuilds under its recorded id with
    its recorded source."""
    recorded = [(k.name, k.kind, tuple(k.shape)) for k in summary.kernels]
    partitions = (lambda: derivation.partition(True), lambda: derivation.partition(False),
                  lambda: derivation.kernels_for(target))  # the last: some attentions unfused, planning on the target
    for partition in partitions:
        kernels = partition()
        if [(k.output, k.kind, k.shape) for k in kernels] == recorded:
            break
    else:
        return None
    results = {r.id: r for r in summary.candidates}
    winners = {}
    for kernel, winner in summary.winners.items():
        result, source = results.get(winner or ""), summary.sources.get(kernel)
        if result is None or source is None or sha256_hex(source.encode()) != result.source_hash:
            return None
        try:
            plan = stored_plan(result.params, kernels, derivation, TARGETS[target])
        except (KeyError, TypeError, ValueError) as error:
            log.info("stored winner %s does not rebuild: %s", winner, error)
            return None
        if plan.name != winner:
            return None
        winners[kernel] = BestKernel(kernel, result, plan, source)
    return kernels, winners


def _default_out(graph: Graph) -> Path:
    return Path(platformdirs.user_cache_dir("cherenkov")) / "runs" / graph.structural_hash()[:16]


def _winners(space_candidates: Mapping[str, tuple[Candidate, ...]], results: list[CandidateResult]) -> dict[str, BestKernel]:
    """The best candidate of each kernel, in the derivation's order: a candidate that absorbs
    an earlier kernel is credited with that kernel's winning time (it would not run)."""
    by_id = {r.id: r for r in results}
    winners: dict[str, BestKernel] = {}
    for kernel, candidates in space_candidates.items():
        credit = {
            c.id: winners[c.absorbs].time_ms
            for c in candidates
            if c.absorbs in winners and winners[c.absorbs].time_ms is not None
        }
        best = _rank([by_id[c.id] for c in candidates if c.id in by_id], credit)
        if best is not None:
            candidate = next(c for c in candidates if c.id == best.id)
            winners[kernel] = BestKernel(kernel, best, candidate.plan, candidate.source)
    return winners


def winner_reads(kernel: FusedKernel, winner: BestKernel | None) -> tuple[str, ...]:
    """The buffers a kernel's winner reads: its plan's (an absorbing plan reads the absorbed
    producer's inputs instead of its output), else the kernel's."""
    if winner is not None and isinstance(winner.plan, TermKernelPlan):
        return winner.plan.kernel.reads
    return kernel.reads


def launched_kernels(kernels: list[FusedKernel], outputs: frozenset[str],
                     winners: Mapping[str, BestKernel]) -> list[FusedKernel]:  # fmt: skip
    """The kernels a run launches: those whose output the graph's outputs need through the
    winners' reads (a producer absorbed by its consumer's winner drops out)."""
    kernel_graph = dag.kernel_dag(kernels, lambda k: winner_reads(k, winners.get(k.output)))
    needed = dag.needed(kernel_graph, outputs)
    return [k for k in kernels if k.output in needed]


def _summary(graph: Graph, derivation: Derivation, search: _Search, space: SearchSpace,
             results: list[CandidateResult], winners: dict[str, BestKernel]) -> SearchSummary:  # fmt: skip
    notes = list(search.notes)
    flash = ("flash_attention", "flash_attention_backward")
    unfused = [k for k in derivation.kernels if k.kind in flash and k not in space.kernels]
    kinds = ", ".join(k.kind for k in space.kernels if k not in derivation.kernels)
    for kernel in unfused:
        notes.append(f"kernel {kernel.output} ({kernel.kind}, shape {list(kernel.shape)}) has no flash plan on "
                     f"{search.env.target}: its attention runs on unfused kernels (new in the partition: {kinds})")
    absorbed_by = {
        c.absorbs: kernel
        for kernel, candidates in space.candidates.items()
        for c in candidates
        if c.absorbs is not None and kernel in winners and winners[kernel].result.id == c.id
    }
    for producer, consumer in sorted(absorbed_by.items()):
        notes.append(f"kernel {producer} is not launched: the winner of {consumer} computes it in its main loop")
    return SearchSummary(
        graph_name=graph.name,
        graph_hash=graph.structural_hash(),
        environment=search.env,
        kernels=[{"name": k.output, "kind": k.kind, "shape": list(k.shape)} for k in space.kernels],
        trace=derivation.trace_of(space.kernels),
        stats={
            "eclasses": derivation.stats.eclasses, "enodes": derivation.stats.enodes,
            "iterations": derivation.stats.iterations, "seconds": derivation.stats.seconds,
            "saturated": derivation.stats.saturated,
        },  # fmt: skip
        candidates=results,
        winners={k: (winners[k].result.id if k in winners else None) for k in space.candidates},
        sources={k: w.source for k, w in winners.items()},
        references=search.references,
        wall_seconds=time.monotonic() - search.start,
        unmeasured=sum(1 for r in results if r.status == "unmeasured"),
        notes=notes,
        inputs={name: f"{t.dtype}[{','.join(map(str, t.shape))}]" for name, t in graph.inputs.items()},
        budget_s=search.budget_s,
    )


def optimize(
    graph: Graph,
    target: str = "auto",
    out: str | os.PathLike[str] | None = None,
    budget_s: float | None = None,
    force: bool = False,
    *,
    resume: bool = False,
    database: TuningDatabase | None = None,
    progress: Progress | None = None,
    timeout_s: float = 30.0,
    cluster: Any = None,
    _faults: Mapping[str, str] | None = None,
) -> OptimizeResult:
    """Search for the fastest correct kernels of ``graph`` on ``target`` (``auto``: the local
    GPU, else sm_120). ``out`` receives report.json and report.html.

    ``budget_s`` bounds the wall time: every kernel's cost-model favourite and safest plan
    are compiled and verified first (a ``GraphError`` names the minimum when the budget
    cannot cover that), the rest is shared by the kernels' predicted share of the graph's
    time (:mod:`cherenkov.search.budget`). The tuning database remembers every search, a
    budgeted one as ``partial`` while candidates are left unmeasured: the same call again
    (the same or a smaller budget) answers from it without generating or compiling any
    candidate; a larger budget, no budget, or ``resume`` measures only the candidates not
    yet measured; ``force`` measures everything again.
    ``cluster`` (a Dask scheduler address, a ``distributed.Client`` or ``"local-gpus"``)
    compiles on the cluster's workers and measures on its GPU workers.
    ``_faults`` (tests only) maps candidate ids to a fault to inject into their source.

    Every kernel of the returned result has a winner: where a kernel has no candidate, or
    every candidate failed, ``GraphError`` names it and why."""
    if not isinstance(graph, Graph):
        raise GraphError(f"optimize: expected a ck.Graph, got {type(graph).__name__}")
    if budget_s is not None and not budget_s > 0:
        raise GraphError(f"optimize: budget_s must be a positive number of seconds, got {budget_s!r}")
    progress = progress or _no_progress
    caps = detect(target)
    executor = DaskExecutor(cluster) if cluster is not None else None
    search = _Search(graph, caps, budget_s, progress, timeout_s, _faults or {}, executor)
    derivation = derive(graph)
    progress("derived", stats=derivation.stats, kernels=[k.kind for k in derivation.partition()])
    out_dir = Path(out) if out is not None else _default_out(graph)
    out_dir.mkdir(parents=True, exist_ok=True)
    signature = input_signature(graph)
    owned = database is None
    db = TuningDatabase() if owned else database
    try:
        winner_key = WinnerKey.from_environment(graph.structural_hash(), signature, search.env, generator_digest())
        stored = None if force else db.lookup_winner(winner_key)
        if stored is not None:
            summary = SearchSummary.from_json(stored)
            answer = _stored_answer(summary, derivation, search.env.target) if _answers(summary, budget_s, resume) else None
            if answer is not None:
                progress("answered", source="database", partial=summary.partial)
                kernels, winners = answer
                return _finish(graph, derivation, kernels, summary, winners, out_dir, from_database=True)
        space = search_space(derivation, search.env.target)
        _check_generated(space, search.env.target)
        keys = {c.id: CandidateKey.from_environment(c.source_hash, signature, search.env) for c in space.all()}
        stored_results = {} if force else db.lookup_candidates(list(keys.values()))
        known = {i: stored_results[k] for i, k in keys.items() if k in stored_results and i not in search.faults}
        by_id = search.evaluate(space, known)
        if not search.faults:  # injected faults (tests) must never reach the database
            db.record_candidates((keys[i], r) for i, r in by_id.items() if i not in known and r.status != "unmeasured")
        results = [by_id[c.id] for c in space.all()]
        winners = _winners(space.candidates, results)
        summary = _summary(graph, derivation, search, space, results, winners)
        missing = [k for k in launched_kernels(list(space.kernels), frozenset(graph.outputs), winners)
                   if k.output not in winners]  # fmt: skip
        if not search.faults and not missing:
            db.record_winner(winner_key, summary.to_json())
        result = _finish(graph, derivation, list(space.kernels), summary, winners, out_dir, from_database=False)
        if missing:
            raise GraphError(_no_winner_message(missing[0], space, by_id, result.report_json))
        return result
    finally:
        if owned:
            db.close()
        if executor is not None:
            executor.close()


def _check_generated(space: SearchSpace, target: str) -> None:
    """``GraphError`` for a kernel that no family can generate: the graph could not run."""
    if space.ungenerated:
        kernel = space.ungenerated[0]
        raise GraphError(
            f"optimize: kernel {kernel.output} ({kernel.kind}, shape {list(kernel.shape)}) has no CUDA plan on "
            f"{target}: no kernel family generates {kernel.describe()[:300]}"
        )


def _no_winner_message(kernel: FusedKernel, space: SearchSpace, results: Mapping[str, CandidateResult],
                       report: Path) -> str:  # fmt: skip
    """Why a kernel has no winner: its candidates' outcomes, counted by status, and a reason."""
    outcomes = [results[c.id] for c in space.candidates.get(kernel.output, ())]
    counts = ", ".join(f"{n} {status}" for status, n in sorted(Counter(r.status for r in outcomes).items()))
    reason = " ".join(next((r.reason for r in outcomes if r.reason), "no reason recorded").split())
    return (
        f"optimize: kernel {kernel.output} ({kernel.kind}, shape {list(kernel.shape)}) has no correct CUDA kernel: "
        f"of its {len(outcomes)} candidates {counts}; first reason: {reason[:300]}; report: {report}"
    )


def _finish(graph: Graph, derivation: Derivation, kernels: list[FusedKernel], summary: SearchSummary,
            winners: dict[str, BestKernel], out_dir: Path, from_database: bool) -> OptimizeResult:  # fmt: skip
    report_json, report_html = out_dir / "report.json", out_dir / "report.html"
    write_json(summary, report_json)
    write_html(summary, report_html)
    return OptimizeResult(graph, derivation, kernels, summary, winners, report_json, report_html, from_database)


