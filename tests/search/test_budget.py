"""Searches that always answer: budgets, the first round, partial answers remembered and
resumed, fast database hits, and graphs whose fused form has no plan (issue 20).

On the CPU the ranking is modelled: "measuring" a candidate is compiling it (nvcc or NVRTC)
and asking the cost model. A fake clock (``Clock``) makes budgets deterministic: each chunk
of compiles advances it by a fixed number of seconds whatever the machine's speed, while the
compiles themselves are real.
"""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

import cherenkov as ck
from cherenkov.rewrites.plan import TARGETS, FlashSchedule
from cherenkov.search import budget
from cherenkov.search import optimize as optimize_module
from cherenkov.search import space as space_module
from cherenkov.search.database import TuningDatabase
from cherenkov.search.environment import toolkit
from cherenkov.search.report import read_json
from cherenkov.search.space import search_space

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
needs_compiler = pytest.mark.skipif(toolkit() == "none", reason="no CUDA compiler (nvcc or NVRTC)")


def transformer_block() -> ck.Graph:
    sys.path.insert(0, str(EXAMPLES))
    import transformer_block as example

    return example.build((1, 128, 2, 64, 256))


def rms_matmul() -> ck.Graph:
    g = ck.Graph("rms_matmul")
    x, w, proj = g.input("x", (64, 256), "bf16"), g.input("w", (256,), "bf16"), g.input("proj", (256, 128), "bf16")
    g.output(ck.nn.rms_norm(x, w) @ proj, "y")
    return g


def attention(head_dim: int, dtype: str = "bf16", causal: bool = False) -> ck.Graph:
    g = ck.Graph(f"attention_d{head_dim}")
    q, k, v = (g.input(n, (1, 2, 192, head_dim), dtype) for n in "qkv")
    g.output(ck.nn.attention(q, k, v, causal=causal), "o")
    return g


class Counts:
    """Counts the candidate sources generated and the plans compiled by a search."""

    def __init__(self, monkeypatch) -> None:
        self.sources = self.compiled = 0
        real_source, real_compile = space_module.cuda_source, optimize_module.compile_plans

        def source(plan):
            self.sources += 1
            return real_source(plan)

        def compile_plans(plans, **options):
            self.compiled += len(plans)
            return real_compile(plans, **options)

        monkeypatch.setattr(space_module, "cuda_source", source)
        monkeypatch.setattr(optimize_module, "compile_plans", compile_plans)

    def reset(self) -> None:
        self.sources = self.compiled = 0


class Clock:
    """The search's clock: real compiles, but each chunk of them takes ``per_chunk`` s."""

    def __init__(self, monkeypatch, per_chunk: float) -> None:
        self.now = 1000.0
        monkeypatch.setattr(optimize_module, "time", SimpleNamespace(monotonic=lambda: self.now))
        real = optimize_module.compile_plans

        def compile_plans(plans, **options):
            self.now += per_chunk
            return real(plans, **options)

        monkeypatch.setattr(optimize_module, "compile_plans", compile_plans)


# ------------------------------------------------------------------------------ the rules


def test_shares_follow_each_kernels_time_and_apply_to_what_is_left() -> None:
    shares = budget.shares({"gemm": 4.0, "norm": 1.0, "attention": 5.0})
    assert [k for k, _ in shares] == ["attention", "gemm", "norm"]
    left, given = 100.0, {}
    for kernel, share in shares:  # each kernel spends all it is given
        given[kernel] = share * left
        left -= given[kernel]
    assert given == pytest.approx({"attention": 50.0, "gemm": 40.0, "norm": 10.0})
    assert budget.shares({"a": 0.0, "b": 0.0}) == [("a", 0.5), ("b", 1.0)]


def test_first_round_is_the_favourite_of_each_family_class_and_the_safest_plan() -> None:
    space = search_space(ck.derive(attention(64)), "sm_90a")
    (group,) = space.candidates.values()
    first = budget.first_round(group, optimize_module._predicted)
    favourite = min(group, key=lambda c: (optimize_module._predicted(c), c.id))
    assert first[0] is favourite and len(first) == 3
    rival = min((c for c in group if budget.is_hopper(c) != budget.is_hopper(favourite)),
                key=lambda c: (optimize_module._predicted(c), c.id))
    assert first[1] is rival, "the other family class's favourite is measured in the first round too"
    assert first[2].plan.schedule == FlashSchedule(), "the default mma.sync schedule is the safest"
    portable = [c for c in group if not budget.is_hopper(c)]
    assert all(not budget.is_hopper(c) for c in budget.first_round(portable, optimize_module._predicted))
    assert budget.first_round_seconds(4, 0, 2) == 2 * budget.COMPILE_ESTIMATE_S
    assert budget.first_round_seconds(4, 4, 2) > budget.WORKER_START_S


@pytest.mark.parametrize(
    "partial, stored, asked, resume, answers",
    [(False, None, 5.0, False, True), (False, 5.0, None, True, True), (True, 10.0, 10.0, False, True),
     (True, 10.0, 5.0, False, True), (True, 10.0, 20.0, False, False), (True, 10.0, None, False, False),
     (True, 10.0, 5.0, True, False)],
)  # fmt: skip
def test_which_stored_searches_answer(partial, stored, asked, resume, answers) -> None:
    summary = SimpleNamespace(partial=partial, budget_s=stored)
    assert optimize_module._answers(summary, asked, resume) is answers


# ------------------------------------------------------------------------------ CPU searches


@needs_compiler
def test_a_budget_below_the_first_round_is_refused_before_starting(tmp_path, monkeypatch) -> None:
    counts = Counts(monkeypatch)
    with TuningDatabase(tmp_path / "tuning.sqlite") as db:
        with pytest.raises(ck.GraphError, match=r"cannot cover the first round .* give budget_s >= \d+"):
            ck.optimize(transformer_block(), target="sm_90a", out=tmp_path, database=db, budget_s=0.5)
    assert counts.compiled == 0


@needs_compiler
@pytest.mark.slow
def test_a_small_budget_still_gives_every_kernel_of_a_transformer_block_a_winner(tmp_path, monkeypatch) -> None:
    """Four chunks of compiles fit the budget: the first round and a little more, of 600+."""
    Clock(monkeypatch, per_chunk=5.0)
    graph = transformer_block()
    with TuningDatabase(tmp_path / "tuning.sqlite") as db:
        result = ck.optimize(graph, target="sm_90a", out=tmp_path, database=db, budget_s=40.0)
    summary = result.summary
    assert summary.partial and summary.measured < len(result.candidates) // 4
    assert len(result.partition) >= 8
    for kernel in result.partition:
        winner = result.kernels[kernel.output]
        assert winner.result.status == "modelled" and winner.plan.kind == kernel.kind, kernel.describe()
        assert getattr(winner.plan, "family", "flash") != "pointwise" or kernel.kind == "elementwise"
    report = read_json(result.report_json)
    assert report["partial"] == {"measured": summary.measured, "of": len(result.candidates)}
    assert report["budget_s"] == 40.0 and any(n.startswith("partial:") for n in report["notes"])
    assert f"measured {summary.measured} of {len(result.candidates)}" in result.report_html.read_text()


@needs_compiler
def test_a_repeated_budgeted_search_is_answered_at_once_and_resumes_the_rest(tmp_path, monkeypatch) -> None:
    counts = Counts(monkeypatch)
    clock = Clock(monkeypatch, per_chunk=3.0)
    graph = rms_matmul()
    with TuningDatabase(tmp_path / "tuning.sqlite") as db:
        first = ck.optimize(graph, target="sm_90a", out=tmp_path / "a", database=db, budget_s=7.0)
        assert first.summary.partial and not first.from_database
        measured = {c.id for c in first.candidates if c.status != "unmeasured"}
        assert counts.compiled == len(measured) and counts.sources == len(first.candidates)

        for asked in (7.0, 5.0):  # the same or a smaller budget: from the database, nothing generated
            counts.reset()
            again = ck.optimize(ck.Graph.from_json(graph.to_json()), target="sm_90a", out=tmp_path / "b",
                                database=db, budget_s=asked)  # fmt: skip
            assert again.from_database and again.summary.partial
            assert (counts.sources, counts.compiled) == (0, 0)
            assert {k: w.result.id for k, w in again.kernels.items()} == {k: w.result.id for k, w in first.kernels.items()}
            assert [w.source for w in again.kernels.values()] == [w.source for w in first.kernels.values()]
            assert [w.plan for w in again.kernels.values()] == [w.plan for w in first.kernels.values()]

        counts.reset()
        clock.now += 100.0
        resumed = ck.optimize(graph, target="sm_90a", out=tmp_path / "c", database=db, resume=True)
        assert not resumed.from_database and not resumed.summary.partial
        assert counts.compiled == len(first.candidates) - len(measured), "only the rest is compiled"
        assert {c.id for c in resumed.candidates if c.from_database} == measured

        counts.reset()
        done = ck.optimize(graph, target="sm_90a", out=tmp_path / "d", database=db, budget_s=1.0)
        assert done.from_database and not done.summary.partial and counts.compiled == 0, "complete: any budget"
        forced = ck.optimize(graph, target="sm_90a", out=tmp_path / "e", database=db, force=True)
        assert counts.compiled == len(forced.candidates)


def test_a_larger_budget_resumes_a_partial_search(tmp_path, monkeypatch) -> None:
    from cherenkov.search import environment

    monkeypatch.setattr(environment, "toolkit", lambda: "none")  # modelled without compiling: instant
    with TuningDatabase(tmp_path / "tuning.sqlite") as db:
        first = ck.optimize(rms_matmul(), target="sm_90a", out=tmp_path / "a", database=db, budget_s=5.0)
        assert not first.summary.partial, "without a compiler every candidate is modelled at once"
        again = ck.optimize(rms_matmul(), target="sm_90a", out=tmp_path / "b", database=db, budget_s=50.0)
        assert again.from_database


# ------------------------------------------------------------------------------ no flash plan


@pytest.mark.parametrize("head_dim", [36, 20, 512])  # no multiple of 8 (MobileViT's 36 and 20), too wide
def test_attention_without_a_flash_plan_runs_on_the_unfused_kernels(head_dim) -> None:
    d = ck.derive(attention(head_dim, causal=head_dim == 20))
    assert d.found("flash_attention") and [k.kind for k in d.kernels] == ["flash_attention"]
    for target in ("sm_80", "sm_90", "sm_90a", "sm_120"):
        assert d.plans(target) == []
        kernels = d.kernels_for(target)
        assert [k.kind for k in kernels] == ["contraction", "softmax_rows", "contraction"]
        space = search_space(d, target)
        assert space.kernels == tuple(kernels) and not space.ungenerated
        families = {c.plan.family for c in space.all()}
        assert "pointwise" not in families and {"mma", "rows"} <= families
    rng = np.random.default_rng(1)
    buffers = {n: rng.standard_normal(t.shape) for n, t in d.graph.inputs.items()}
    expected = ck.evaluate(d.graph, buffers)["o"]
    for kernel in d.unfused_kernels:  # the unfused kernels' own float64 references, in order
        buffers[kernel.output] = kernel.evaluate(buffers)
    np.testing.assert_allclose(buffers["o"], expected, rtol=1e-10, atol=1e-12)


def test_attention_with_a_flash_plan_keeps_it() -> None:
    d = ck.derive(attention(128))
    assert [k.kind for k in d.kernels_for("sm_120")] == ["flash_attention"] and d.plans("sm_120")


def test_an_attention_without_a_flash_plan_leaves_the_others_theirs() -> None:
    """Two attentions of one graph, one at a head dim no flash family plans (36: no multiple of 8): that one
    runs unfused and the other keeps its flash kernel."""
    g = ck.Graph("two_attentions")
    planned = [g.input(n, (1, 2, 192, 64), "bf16") for n in ("q", "k", "v")]
    unplanned = [g.input(n, (1, 2, 192, 36), "bf16") for n in ("q2", "k2", "v2")]
    g.output(ck.nn.attention(*planned), "o")
    g.output(ck.nn.attention(*unplanned, causal=True), "o2")
    d = ck.derive(g)
    assert [k.kind for k in d.kernels] == ["flash_attention", "flash_attention"]
    kernels = d.kernels_for("sm_90")
    assert sorted(k.kind for k in kernels) == ["contraction", "contraction", "flash_attention", "softmax_rows"]
    assert [k.output for k in kernels if k.kind == "flash_attention"] == ["o"]
    assert {p.problem.out for p in d.plans("sm_90")} == {"o"}
    space = search_space(d, "sm_90")
    assert space.kernels == tuple(kernels) and not space.ungenerated
    rng = np.random.default_rng(2)
    buffers = {n: rng.standard_normal(t.shape) for n, t in g.inputs.items()}
    expected = ck.evaluate(g, buffers)
    for kernel in kernels:  # the mixed kernels' own float64 references, in order
        buffers.update(kernel.evaluate_outputs(buffers))
    for name in ("o", "o2"):
        np.testing.assert_allclose(buffers[name], expected[name], rtol=1e-10, atol=1e-12)


def test_the_unfused_search_says_why_in_its_notes(tmp_path, monkeypatch) -> None:
    from cherenkov.search import environment

    monkeypatch.setattr(environment, "toolkit", lambda: "none")
    with TuningDatabase(tmp_path / "tuning.sqlite") as db:
        result = ck.optimize(attention(512), target="sm_90", out=tmp_path, database=db)
    assert [k.kind for k in result.partition] == ["contraction", "softmax_rows", "contraction"]
    assert set(result.kernels) == {k.output for k in result.partition}
    assert any("no flash plan on sm_90" in note for note in result.summary.notes)


def test_a_kernel_no_family_generates_is_a_graph_error(tmp_path, monkeypatch) -> None:
    real = optimize_module.search_space

    def nothing_for_the_softmax(derivation, target):
        space = real(derivation, target)
        kept = {k: group for k, group in space.candidates.items() if group[0].plan.kind != "softmax_rows"}
        dropped = tuple(k for k in space.kernels if k.output not in kept)
        return optimize_module.SearchSpace(space.kernels, kept, dropped)

    monkeypatch.setattr(optimize_module, "search_space", nothing_for_the_softmax)
    with TuningDatabase(tmp_path / "tuning.sqlite") as db:
        with pytest.raises(ck.GraphError, match=r"kernel t\d+ \(softmax_rows, shape \[2, 192, 192\]\) has no CUDA plan"):
            ck.optimize(attention(512), target="sm_90", out=tmp_path, database=db)


@needs_compiler
def test_a_kernel_whose_every_candidate_fails_is_a_graph_error(tmp_path) -> None:
    graph = rms_matmul()
    space = search_space(ck.derive(graph), "sm_90")
    norm = next(k for k in space.kernels if k.kind == "rms_norm_rows")
    faults = {c.id: "compile_error" for c in space.candidates[norm.output]}
    with TuningDatabase(tmp_path / "tuning.sqlite") as db:
        with pytest.raises(ck.GraphError, match=rf"kernel {norm.output} \(rms_norm_rows.*\d+ compile_error.*report"):
            ck.optimize(graph, target="sm_90", out=tmp_path, database=db, _faults=faults)
    assert (tmp_path / "report.json").is_file(), "the report is written before the error"


# ------------------------------------------------------------------------------ GPU


@pytest.mark.gpu
def test_gpu_budgeted_transformer_block_runs_with_a_verified_winner_per_kernel(gpu, tmp_path) -> None:
    torch = gpu
    graph = transformer_block()
    with TuningDatabase(tmp_path / "tuning.sqlite") as db:
        result = ck.optimize(graph, out=tmp_path / "run", database=db, budget_s=45.0)
        assert result.environment.measured
        for kernel in result.partition:
            assert result.kernels[kernel.output].result.status == "ok", kernel.describe()
        again = ck.optimize(graph, out=tmp_path / "again", database=db, budget_s=45.0)
        assert again.from_database
    scale = {"wq": 0.06, "wk": 0.06, "wv": 0.06, "wo": 0.06, "w1": 0.06, "b1": 0.5, "w2": 0.05}
    generator = torch.Generator(device="cuda").manual_seed(0)
    inputs = {
        n: (torch.randn(t.shape, generator=generator, device="cuda") * scale.get(n, 1.0)).bfloat16()
        for n, t in graph.inputs.items()
    }
    expected = ck.evaluate(graph, {n: x.double().cpu().numpy() for n, x in inputs.items()})["y"]
    for answer in (result, again):
        got = answer.run(**inputs)["y"].double().cpu().numpy()
        assert np.linalg.norm(got - expected) / np.linalg.norm(expected) <= 2e-2


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim, causal", [(512, False), (120, True), (40, False)])
def test_gpu_attention_without_a_flash_plan_is_correct_through_the_unfused_kernels(gpu, tmp_path, head_dim, causal) -> None:
    torch = gpu
    g = ck.Graph(f"attention_d{head_dim}")
    q, k, v = (g.input("q", (2, 4, 300, head_dim), "bf16"), g.input("k", (2, 4, 333, head_dim), "bf16"),
               g.input("v", (2, 4, 333, head_dim), "bf16"))  # fmt: skip
    g.output(ck.nn.attention(q, k, v, causal=causal), "o")
    with TuningDatabase(tmp_path / "tuning.sqlite") as db:
        result = ck.optimize(g, out=tmp_path, database=db, budget_s=60.0)
    assert [k.kind for k in result.partition] == ["contraction", "softmax_rows", "contraction"]
    assert all(w.plan.family != "pointwise" and w.result.status == "ok" for w in result.kernels.values())
    inputs = {n: torch.randn(t.shape, device="cuda").bfloat16() for n, t in g.inputs.items()}
    out = result.run(**inputs)["o"].float()
    expected = torch.nn.functional.scaled_dot_product_attention(*(inputs[n].float() for n in "qkv"), is_causal=causal)
    assert float((out - expected).norm() / expected.norm()) <= 2e-2


@pytest.mark.gpu
def test_gpu_an_attention_without_a_flash_plan_runs_unfused_beside_a_flash_one(gpu, tmp_path) -> None:
    """Head dim 40 has no flash plan on any family, 64 has: one flash kernel and the unfused three, each
    output like SDPA's."""
    torch = gpu
    g = ck.Graph("two_attentions")
    for suffix, dim in (("", 64), ("2", 40)):
        q, k, v = (g.input(f"{n}{suffix}", (2, 4, 300 if n == "q" else 333, dim), "bf16") for n in "qkv")
        g.output(ck.nn.attention(q, k, v, causal=not suffix), f"o{suffix}")
    with TuningDatabase(tmp_path / "tuning.sqlite") as db:
        result = ck.optimize(g, out=tmp_path, database=db, budget_s=60.0)
    assert sorted(k.kind for k in result.partition) == ["contraction", "contraction", "flash_attention", "softmax_rows"]
    inputs = {n: torch.randn(t.shape, device="cuda").bfloat16() for n, t in g.inputs.items()}
    got = result.run(**inputs)
    for suffix in ("", "2"):
        expected = torch.nn.functional.scaled_dot_product_attention(
            *(inputs[f"{n}{suffix}"].float() for n in "qkv"), is_causal=not suffix)
        out = got[f"o{suffix}"].float()
        assert float((out - expected).norm() / expected.norm()) <= 2e-2, suffix
