"""``ck.optimize``: from a graph to its fastest correct kernels, with a report.

derive → enumerate candidates → compile (all cores) → verify and time in worker
processes (or rank by the cost model where nothing can be measured) → rank → store in
the tuning database → write ``report.json`` and ``report.html``. A repeated search on
the same GPU and toolkit answers from the database without compiling; candidates the
database already knows (including failures) are not compiled or measured again.
"""

from __future__ import annotations

import functools
import logging
import math
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import platformdirs

from cherenkov.codegen import CompileError, compile_plan, compile_plans, load_kernel
from cherenkov.codegen.plan import CompiledKernel
from cherenkov.codegen.term_plan import TermKernelPlan
from cherenkov.graph import Graph, GraphError
from cherenkov.rewrites.derive import Derivation, derive
from cherenkov.rewrites.kernels import FusedKernel
from cherenkov.rewrites.plan import KernelPlan
from cherenkov.rewrites.plan_sm90a import HopperFlashSchedule
from cherenkov.search.cost_model import GPUS, predict_plan
from cherenkov.search.database import CandidateKey, TuningDatabase, WinnerKey
from cherenkov.search.distributed import DaskExecutor
from cherenkov.search.environment import Capabilities, detect
from cherenkov.search.faults import inject_fault
from cherenkov.search.measure import MeasurementPool, MeasureTask
from cherenkov.search.records import CandidateResult, Environment, Timing
from cherenkov.search.report import SearchSummary, write_html, write_json
from cherenkov.search.space import Candidate, SearchSpace, search_space

log = logging.getLogger(__name__)

MIN_NOISE = 0.005  # medians closer than 0.5% always tie
# Medians more than 2% apart never tie: a candidate's median - min spread also holds clock
# changes (a GPU left idle by the compiles boosts for its first samples), 8% on a 5 ms kernel
# of the 2026-11-30 H200 run, where an uncapped band let a candidate 7.7% slower than the
# fastest win on its id.
MAX_NOISE = 0.02
# Of a measured search's time budget, the share after which no new compile chunk starts: the
# rest is the GPU's (on a cold compile cache the compiles alone could take the whole budget).
COMPILE_SHARE = 0.6
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
    """What a search found: the winners, every candidate, the reports."""

    def __init__(
        self, graph: Graph, derivation: Derivation, summary: SearchSummary, winners: dict[str, BestKernel],
        report_json: Path, report_html: Path, from_database: bool,
    ) -> None:
        self.graph = graph
        self.derivation = derivation
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
    def best(self) -> BestKernel | None:
        """The winner of the graph's costliest searched kernel (for attention, the only one)."""
        if not self.kernels:
            return None
        return max(self.kernels.values(), key=lambda w: w.result.flops)

    def dump(self, path: str | os.PathLike[str]) -> Path:
        """Write the best kernel's CUDA source to ``path``."""
        if self.best is None:
            raise GraphError(f"dump: the search of {self.graph.name!r} produced no kernel")
        target = Path(path)
        target.write_text(self.best.source)
        return target

    def run(self, **tensors: Any) -> dict[str, Any]:
        """Run the graph with the winning kernels: torch CUDA tensors in, ``{output: tensor}`` out.

        Every kernel of ``derivation.kernels`` runs in order on the current stream (except a
        producer whose consumer's winner absorbed it: :func:`launched_kernels`); the
        intermediate buffers they write stay in device memory and are freed when the last
        kernel reading them is done. Inputs must be contiguous CUDA tensors of the graph's
        dtypes and shapes. Each call checks the tensors and launches every kernel from
        Python; for repeated calls on the same buffers, :meth:`capture` removes that host work."""
        import torch

        buffers = dict(tensors)
        missing = sorted(set(self.graph.inputs) - set(buffers))
        if missing:
            raise GraphError(f"run: missing inputs {missing}; graph {self.graph.name!r} needs {sorted(self.graph.inputs)}")
        for position, (kernel, launcher, problem) in enumerate(self._launchers(torch.cuda.current_device())):
            if problem is None:
                buffers[kernel.output] = launcher.launch(buffers)
            else:
                buffers[kernel.output] = launcher(buffers[problem.q], buffers[problem.k], buffers[problem.v])
            for name in self._dead_after[position]:
                del buffers[name]
        return {name: buffers[name] for name in self.graph.outputs}

    def capture(self, **tensors: Any) -> CapturedRun:
        """Record :meth:`run` on these tensors as one CUDA graph and return it as a callable.

        ``captured()`` replays every kernel with no Python work per kernel and returns the
        same output tensors each time; to run on new data, copy it into the captured input
        tensors (``x.copy_(new_x)``) — they must stay alive and in place."""
        import torch

        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # load the kernels and warm the allocator outside the capture
            self.run(**tensors)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outputs = self.run(**tensors)
        return CapturedRun(graph, outputs, dict(tensors))

    def _launchers(self, device: int) -> list[tuple[FusedKernel, Any, Any]]:
        """(kernel, loaded launcher, attention problem or None) for each kernel in order,
        loaded onto ``device`` on first use."""
        cached = self._loaded.get(device)
        if cached is not None:
            return cached
        launchers = []
        for kernel in self.launched:
            winner = self.kernels.get(kernel.output)
            if winner is None:
                raise GraphError(
                    f"run: kernel {kernel.output} ({kernel.kind}) has no winning CUDA kernel; the search report "
                    f"({self.report_json}) says why (no plan fits, or every candidate failed)"
                )
            launcher = load_kernel(compile_plan(winner.plan), device)
            problem = None if isinstance(winner.plan, TermKernelPlan) else winner.plan.problem
            launchers.append((kernel, launcher, problem))
        self._loaded[device] = launchers
        return launchers

    @functools.cached_property
    def launched(self) -> list[FusedKernel]:
        """The kernels :meth:`run` launches, in order: the derivation's, less any producer
        that its consumer's winner absorbed (:func:`launched_kernels`)."""
        return launched_kernels(self.derivation.kernels, frozenset(self.graph.outputs), self.kernels)

    @functools.cached_property
    def _dead_after(self) -> list[list[str]]:
        """For each launched kernel's position, the intermediate buffers no later kernel reads."""
        reads = [winner_reads(k, self.kernels.get(k.output)) for k in self.launched]
        last_use = {name: i for i, names in enumerate(reads) for name in names}
        keep = set(self.graph.outputs) | set(self.graph.inputs)
        return [
            sorted({name for name in names if last_use[name] == position and name not in keep})
            for position, names in enumerate(reads)
        ]


class CapturedRun:
    """The graph's kernels recorded as one CUDA graph on fixed tensors (:meth:`OptimizeResult.capture`).

    Calling it replays the graph on the current stream and returns ``{output: tensor}``
    (the same tensors every call). ``inputs`` are the captured input tensors: copy new
    data into them to run on it."""

    def __init__(self, graph: Any, outputs: dict[str, Any], inputs: dict[str, Any]) -> None:
        self._graph = graph
        self.outputs = outputs
        self.inputs = inputs

    def __call__(self) -> dict[str, Any]:
        self._graph.replay()
        return self.outputs


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
    """One search: the state shared by its steps."""

    def __init__(self, graph: Graph, caps: Capabilities, budget_s: float | None, progress: Progress,
                 timeout_s: float, faults: Mapping[str, str], cluster: DaskExecutor | None = None) -> None:  # fmt: skip
        self.graph = graph
        self.cluster = cluster
        self.caps = caps
        self.env = caps.environment
        self.start = time.monotonic()
        self.deadline = None if budget_s is None else self.start + budget_s
        self.progress = progress
        self.timeout_s = timeout_s
        self.faults = faults
        self.notes = list(caps.limitations)
        self.references: dict[str, float] = {}

    def out_of_time(self) -> bool:
        return self.deadline is not None and time.monotonic() >= self.deadline

    def compile(self, candidates: list[Candidate]) -> dict[str, CompiledKernel | CompileError]:
        """Compile in parallel, most promising first, in chunks so the budget can stop it:
        where candidates will be measured, no chunk after the first starts once
        ``COMPILE_SHARE`` of the budget is spent."""
        ordered = sorted(candidates, key=lambda c: (predict_plan(c.plan).ms, c.id))
        chunk = 2 * (os.cpu_count() or 1)
        compiled: dict[str, CompiledKernel | CompileError] = {}
        stop = None  # the time after which no further chunk starts, where the GPU needs the rest
        if self.deadline is not None and self.env.measured:
            stop = self.start + COMPILE_SHARE * (self.deadline - self.start)
        for start in range(0, len(ordered), chunk):
            if self.out_of_time():
                break
            if compiled and stop is not None and time.monotonic() >= stop:
                self.notes.append(f"compiled {len(compiled)} of {len(ordered)} candidates, the most promising, "
                                  f"leaving the rest of the time budget to measuring")
                break
            group = ordered[start : start + chunk]
            sources = {c.id: inject_fault(c.source, self.faults[c.id]) for c in group if c.id in self.faults}
            plans, group_sources = [c.plan for c in group], [sources.get(c.id) for c in group]
            if self.cluster is not None:
                outputs = self.cluster.compile(plans, group_sources)
            else:
                outputs = compile_plans(plans, sources=group_sources)
            compiled.update(zip((c.id for c in group), outputs))
            self.progress("compiled", done=len(compiled), total=len(ordered))
        return compiled

    def evaluate(self, candidates: list[Candidate]) -> list[CandidateResult]:
        """Compile, then verify and time (or model) every candidate not yet known."""
        if not candidates:
            return []
        if self.env.toolkit == "none":
            return [
                _base_result(c, "modelled", predicted_ms=predict_plan(c.plan).ms,
                             reason="not compiled: no CUDA compiler")  # fmt: skip
                for c in candidates
            ]
        compiled = self.compile(candidates)
        results: dict[str, CandidateResult] = {}
        ready: list[tuple[Candidate, CompiledKernel]] = []
        for candidate in candidates:
            outcome = compiled.get(candidate.id)
            if outcome is None:
                results[candidate.id] = _base_result(candidate, "unmeasured", reason="time budget spent before compiling")
            elif isinstance(outcome, CompileError):
                reason = f"{outcome}: {(outcome.log or '').strip()[:600]}"
                results[candidate.id] = _base_result(candidate, "compile_error", reason=reason)
            elif self.env.measured:
                ready.append((candidate, outcome))
            else:
                results[candidate.id] = _base_result(candidate, "modelled", **_compiled_values(outcome))
        if ready:
            results.update(self.measure(ready))
        return [results[c.id] for c in candidates]

    def measure(self, ready: list[tuple[Candidate, CompiledKernel]]) -> dict[str, CandidateResult]:
        by_id = {c.id: (c, k) for c, k in ready}
        ordered = sorted(ready, key=lambda ck: (_compiled_values(ck[1])["predicted_ms"], ck[0].id))
        tasks = [MeasureTask(c.id, k, seed=i + 1, group=c.kernel) for i, (c, k) in enumerate(ordered)]
        results: dict[str, CandidateResult] = {}

        finished = 0

        def done(measurement: Any) -> None:
            nonlocal finished
            finished += 1
            times = sorted(measurement.times_ms)
            median = times[len(times) // 2] if times else None
            self.progress("measured", candidate=measurement.candidate, status=measurement.status,
                          time_ms=median, done=finished, total=len(tasks))  # fmt: skip

        if self.cluster is not None:
            measurements = self.cluster.measure(tasks, self.timeout_s)
            for measurement in measurements.values():
                done(measurement)
            self.notes.append("measured on the Dask cluster's GPU workers; SDPA references not measured")
        else:
            measurements = self._measure_locally(tasks, done, ready)
        self._record(by_id, measurements, results)
        unmeasured = sum(1 for r in results.values() if r.status == "unmeasured")
        if unmeasured:
            self.notes.append(f"{unmeasured} candidates left unmeasured when the time budget ran out")
        return results

    def _measure_locally(self, tasks: list[MeasureTask], done: Callable[[Any], None],
                         ready: list[tuple[Candidate, CompiledKernel]]) -> dict[str, Any]:  # fmt: skip
        """Measure in local worker processes, then time PyTorch's SDPA backends as references."""
        with MeasurementPool(self.caps.devices, self.timeout_s) as pool:
            measurements = pool.measure_all(tasks, done, self.deadline)
            problems = {k.plan.problem for _, k in ready if isinstance(k.plan, KernelPlan)}
            for problem in problems:
                for name, ms in pool.references(problem).items():
                    self.references[f"{name}:{problem.out}" if len(problems) > 1 else name] = problem.flops / (ms * 1e9)
        return measurements

    @staticmethod
    def _record(by_id: dict[str, tuple[Candidate, CompiledKernel]], measurements: Mapping[str, Any],
                results: dict[str, CandidateResult]) -> None:  # fmt: skip
        for candidate_id, (candidate, compiled) in by_id.items():
            m = measurements.get(candidate_id)
            values = _compiled_values(compiled)
            if m is None:
                results[candidate_id] = _base_result(candidate, "unmeasured", reason="time budget spent", **values)
                continue
            timing = None
            if m.times_ms:
                ordered_times = sorted(m.times_ms)
                timing = Timing(ordered_times[0], ordered_times[len(ordered_times) // 2], ordered_times[-1],
                                len(ordered_times))  # fmt: skip
            results[candidate_id] = _base_result(
                candidate, m.status, reason=m.reason, rel_error=m.rel_error, timing=timing, **values
            )


def _stored_answer(summary: SearchSummary, space: SearchSpace) -> tuple[SearchSummary, dict[str, BestKernel]] | None:
    """The winners a stored search names, if this search space still holds exactly the same
    candidates (new knobs or generators make an old answer incomplete: search again)."""
    candidates = {c.id: c for c in space.all()}
    if {r.id for r in summary.candidates} != set(candidates):
        return None
    results = {r.id: r for r in summary.candidates}
    winners = {
        kernel: BestKernel(kernel, results[i], candidates[i].plan, candidates[i].source)
        for kernel, i in summary.winners.items()
        if i is not None
    }
    return summary, winners


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
    needed = set(outputs)
    for kernel in reversed(kernels):
        if kernel.output in needed:
            needed.update(winner_reads(kernel, winners.get(kernel.output)))
    return [k for k in kernels if k.output in needed]


def _summary(graph: Graph, derivation: Derivation, search: _Search, space: SearchSpace,
             results: list[CandidateResult], winners: dict[str, BestKernel]) -> SearchSummary:  # fmt: skip
    notes = list(search.notes)
    for kernel in space.ungenerated:
        notes.append(f"kernel {kernel.output} ({kernel.kind}) has no CUDA generator yet; it was not searched")
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
        kernels=[{"name": k.output, "kind": k.kind, "shape": list(k.shape)} for k in derivation.kernels],
        trace=derivation.trace,
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
    )


def optimize(
    graph: Graph,
    target: str = "auto",
    out: str | os.PathLike[str] | None = None,
    budget_s: float | None = None,
    force: bool = False,
    *,
    database: TuningDatabase | None = None,
    progress: Progress | None = None,
    timeout_s: float = 30.0,
    cluster: Any = None,
    _faults: Mapping[str, str] | None = None,
) -> OptimizeResult:
    """Search for the fastest correct kernels of ``graph`` on ``target`` (``auto``: the local
    GPU, else sm_120). ``out`` receives report.json and report.html; ``budget_s`` bounds the
    wall time (compiling, most promising first, stops starting at ``COMPILE_SHARE`` of it
    when candidates are measured, leaving the rest to the GPU); ``force`` searches again
    even when the tuning database knows the answer.
    ``cluster`` (a Dask scheduler address, a ``distributed.Client`` or ``"local-gpus"``)
    compiles on the cluster's workers and measures on its GPU workers.
    ``_faults`` (tests only) maps candidate ids to a fault to inject into their source."""
    if not isinstance(graph, Graph):
        raise GraphError(f"optimize: expected a ck.Graph, got {type(graph).__name__}")
    if budget_s is not None and not budget_s > 0:
        raise GraphError(f"optimize: budget_s must be a positive number of seconds, got {budget_s!r}")
    progress = progress or _no_progress
    caps = detect(target)
    executor = DaskExecutor(cluster) if cluster is not None else None
    search = _Search(graph, caps, budget_s, progress, timeout_s, _faults or {}, executor)
    derivation = derive(graph)
    progress("derived", stats=derivation.stats, kernels=[k.kind for k in derivation.kernels])
    space = search_space(derivation, search.env.target)
    out_dir = Path(out) if out is not None else _default_out(graph)
    out_dir.mkdir(parents=True, exist_ok=True)
    signature = input_signature(graph)
    owned = database is None
    db = TuningDatabase() if owned else database
    try:
        winner_key = WinnerKey.from_environment(graph.structural_hash(), signature, search.env)
        stored = None if force else db.lookup_winner(winner_key)
        answer = None if stored is None else _stored_answer(SearchSummary.from_json(stored), space)
        if answer is not None:
            progress("answered", source="database")
            return _finish(graph, derivation, answer[0], answer[1], out_dir, from_database=True)
        keys = {c.id: CandidateKey.from_environment(c.source_hash, signature, search.env) for c in space.all()}
        known = db.lookup_candidates(list(keys.values()))
        fresh = [c for c in space.all() if keys[c.id] not in known or force or c.id in search.faults]
        new_results = search.evaluate(fresh)
        if not search.faults:  # injected faults (tests) must never reach the database
            db.record_candidates((keys[r.id], r) for r in new_results if r.status != "unmeasured")
        by_id = {r.id: r for r in new_results}
        results = [by_id.get(c.id) or known[keys[c.id]] for c in space.all()]
        winners = _winners(space.candidates, results)
        summary = _summary(graph, derivation, search, space, results, winners)
        if not search.faults and not summary.unmeasured:
            db.record_winner(winner_key, summary.to_json())
        return _finish(graph, derivation, summary, winners, out_dir, from_database=False)
    finally:
        if owned:
            db.close()
        if executor is not None:
            executor.close()


def _finish(graph: Graph, derivation: Derivation, summary: SearchSummary, winners: dict[str, BestKernel],
            out_dir: Path, from_database: bool) -> OptimizeResult:  # fmt: skip
    report_json, report_html = out_dir / "report.json", out_dir / "report.html"
    write_json(summary, report_json)
    write_html(summary, report_html)
    return OptimizeResult(graph, derivation, summary, winners, report_json, report_html, from_database)


