"""A search spread over Dask workers ranks exactly like the single-process search."""

from __future__ import annotations

import pytest

import cherenkov as ck
from cherenkov.search import environment

distributed = pytest.importorskip("distributed")


def small_graph() -> ck.Graph:
    """Two kernels (a GEMM, softmax rows) and 19 candidates: the spread search compiles and
    ranks each as the local one does (an attention's ~900 flash plans would take minutes twice)."""
    g = ck.Graph("projection_softmax")
    x, w = g.input("x", (64, 128), "bf16"), g.input("w", (128, 256), "bf16")
    g.output(ck.nn.softmax(x @ w, axis=-1), "y")
    return g


@pytest.fixture(scope="module")
def client():
    with distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None) as cluster:
        with distributed.Client(cluster) as dask_client:
            yield dask_client


def test_dask_compile_and_model_ranking_match_the_local_search(client, tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(environment, "visible_gpus", lambda: [])
    graph = small_graph()
    local = ck.optimize(graph, target="sm_90", out=tmp_path / "local", force=True)
    spread = ck.optimize(graph, target="sm_90", out=tmp_path / "dask", force=True, cluster=client)

    def ranking(result):
        return [c.id for c in sorted(result.candidates, key=lambda c: (c.time_ms, c.id))]

    assert ranking(spread) == ranking(local)
    assert spread.best.result.id == local.best.result.id
    assert {c.registers for c in spread.candidates} == {c.registers for c in local.candidates}
    assert client.status == "running", "a caller's client is left open"


def test_bad_cluster_arguments_are_graph_errors(tmp_path) -> None:
    with pytest.raises(ck.GraphError, match="scheduler address"):
        ck.optimize(small_graph(), target="sm_90", out=tmp_path, cluster="not-a-cluster")
