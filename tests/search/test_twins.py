"""Twin candidates (the same kernel source on other tensors, as a model's repeated layers
give) are grouped across kernels and never across shapes, and the search compiles one of
each group, giving its result to the others."""

from __future__ import annotations

from pathlib import Path

import cherenkov as ck
from cherenkov.codegen.plan import CompiledKernel, ResourceReport
from cherenkov.search import optimize as optimize_module
from cherenkov.search.database import TuningDatabase
from cherenkov.search.environment import Capabilities
from cherenkov.search.records import Environment
from cherenkov.search.space import search_space
from cherenkov.search.twins import twin_groups


def two_layers_and_a_wider_one() -> ck.Graph:
    """Two identical GEMM + bias + GELU layers on their own tensors, and a third of another width."""
    g = ck.Graph("layers")
    for name, width in (("a", 64), ("b", 64), ("c", 128)):
        x = g.input(f"x_{name}", (32, 64), "bf16")
        w = g.input(f"w_{name}", (64, width), "bf16")
        bias = g.input(f"bias_{name}", (width,), "bf16")
        g.output(ck.nn.gelu(x @ w + bias), f"y_{name}")
    return g


def names_of(graph: ck.Graph, space) -> set[str]:
    return set(graph.inputs) | {n for k in space.kernels for n in (k.output, *k.reads)}


def test_twins_pair_the_repeated_layers_and_not_the_other_width():
    graph = two_layers_and_a_wider_one()
    space = search_space(ck.derive(graph), "sm_90a")
    twins = twin_groups(space.all(), names_of(graph, space))
    assert {k.output for k in space.kernels} >= {"y_a", "y_b", "y_c"}
    for candidate in space.candidates["y_a"]:
        assert {t.kernel for t in twins[candidate.id]} == {"y_a", "y_b"}
    wide = space.candidates["y_c"]
    assert all(len(twins[c.id]) == 1 for c in wide), "a different width is a different kernel"


def test_the_search_compiles_one_candidate_of_each_twin_group(tmp_path, monkeypatch):
    calls = {"plans": 0}

    def fake_compile(plans, sources=None):  # what the search hands the compiler, counted
        calls["plans"] += len(plans)
        report = ResourceReport(registers=96, smem_static=0, smem_dynamic=0, spill_stores=0, spill_loads=0,
                                stack_frame=0)  # fmt: skip
        return [CompiledKernel(p, p.target.name, "k", Path("k.cubin"), Path("k.ptx"), report, 0.1, "", "fake")
                for p in plans]  # fmt: skip

    monkeypatch.setattr(optimize_module, "compile_plans", fake_compile)
    monkeypatch.setattr(optimize_module, "detect", lambda target: Capabilities(
        Environment(target, toolkit="13.0", measured=False), (), ()))  # fmt: skip
    graph = two_layers_and_a_wider_one()
    space = search_space(ck.derive(graph), "sm_90a")
    twins = twin_groups(space.all(), names_of(graph, space))
    with TuningDatabase(tmp_path / "tuning.sqlite") as db:
        result = ck.optimize(graph, target="sm_90a", out=tmp_path / "run", database=db)
    assert calls["plans"] == len({group[0].id for group in twins.values()}) < len(space.all())
    by_id = {r.id: r for r in result.candidates}
    for candidate in space.all():
        lead = by_id[twins[candidate.id][0].id]
        mine = by_id[candidate.id]
        assert (mine.kernel, mine.source_hash) == (candidate.kernel, candidate.source_hash)
        assert (mine.status, mine.registers, mine.predicted_ms) == (lead.status, lead.registers, lead.predicted_ms)
