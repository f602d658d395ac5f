"""The ``torch.compile`` backend on the CPU: registered by its entry point; an FX graph is
split into the regions cherenkov lowers (each a ``ck.Graph`` behind a compiled function)
and the ops it does not (left as ATen ops), and the split graph computes what the function
does; Dynamo's guards call the backend once per new shape and not for a shape seen before;
without a GPU the backend runs the graph through its fallback and says so once."""

from __future__ import annotations

import logging

import pytest

import cherenkov as ck

torch = pytest.importorskip("torch")

from cherenkov.search.dynamo import cherenkov_backend, split_supported  # noqa: E402


def mixed(x, w):
    """Lowerable matmul + softmax, a cumulative sum cherenkov has no lowering for, then
    lowerable elementwise + matmul."""
    h = torch.softmax(x @ w, dim=-1)
    s = torch.cumsum(h, dim=-1)
    return (s * 2.0 + 1.0) @ w.t()


def test_the_backend_is_registered_by_its_entry_point():
    assert "cherenkov" in torch._dynamo.list_backends()


def test_a_graph_is_split_into_lowered_regions_and_the_rest():
    x, w = torch.randn(8, 16), torch.randn(16, 16)
    gm = torch.fx.symbolic_trace(mixed)
    split = split_supported(gm, [x, w])
    assert len(split.compiled) == 2
    for function in split.compiled:
        ((signature, call),) = function.prepared.items()
        assert isinstance(call.graph, ck.Graph) and call.graph.outputs
        assert {device for _, _, device in signature} == {"cpu"}, "prepared on the inputs' device"
    left = [n.target for n in split.module.graph.nodes if n.op == "call_function"]
    assert any("cumsum" in str(t) for t in left) and not any("mm" in str(t) or "softmax" in str(t) for t in left)
    assert torch.allclose(split.module(x, w), mixed(x, w), rtol=1e-4, atol=1e-4)
    assert all(len(function.prepared) == 1 for function in split.compiled), "no second capture on the first call"


def test_guards_call_the_backend_once_per_new_shape():
    calls = []

    def counting(gm, example_inputs, **kwargs):
        calls.append(tuple(tuple(t.shape) for t in example_inputs))
        return cherenkov_backend(gm, example_inputs, options={"fallback": "eager"})

    torch._dynamo.reset()
    fn = torch.compile(mixed, backend=counting, dynamic=False)
    w = torch.randn(16, 16)
    for rows in (8, 8, 4, 8, 4):
        x = torch.randn(rows, 16)
        assert torch.allclose(fn(x, w), mixed(x, w), rtol=1e-5, atol=1e-5)
    assert len(calls) == 2 and {c[0][0] for c in calls} == {8, 4}


def test_without_a_gpu_the_fallback_runs_and_says_so_once(caplog, monkeypatch):
    from cherenkov.search import dynamo

    if torch.cuda.is_available():
        pytest.skip("the fallback path is the no-GPU one")
    monkeypatch.setattr(dynamo, "_said", set())
    torch._dynamo.reset()
    fn = torch.compile(mixed, backend="cherenkov", options={"fallback": "eager"})
    w = torch.randn(16, 16)
    with caplog.at_level(logging.WARNING, logger="cherenkov.search.dynamo"):
        for rows in (8, 4):
            x = torch.randn(rows, 16)
            assert torch.allclose(fn(x, w), mixed(x, w), rtol=1e-5, atol=1e-5)
    messages = [r.getMessage() for r in caplog.records if "no CUDA inputs" in r.getMessage()]
    assert len(messages) == 1, "said once"


def test_an_unknown_fallback_is_a_graph_error():
    gm = torch.fx.symbolic_trace(mixed)
    with pytest.raises(ck.GraphError, match="fallback"):
        cherenkov_backend(gm, [torch.randn(8, 16), torch.randn(16, 16)], options={"fallback": "tensorrt"})


@pytest.mark.gpu
def test_gpu_backend_runs_the_lowered_regions_with_searched_kernels(tmp_path):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    from cherenkov.search.database import TuningDatabase

    torch.manual_seed(0)
    x = torch.randn(128, 256, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(256, 256, device="cuda", dtype=torch.bfloat16) * 0.06
    with TuningDatabase(tmp_path / "tuning.sqlite") as db:
        torch._dynamo.reset()
        fn = torch.compile(mixed, backend="cherenkov", options={"budget_s": 30.0, "database": db})
        got, expected = fn(x, w).float(), mixed(x.float(), w.float())
    assert float((got - expected).norm() / expected.norm()) <= 2e-2
