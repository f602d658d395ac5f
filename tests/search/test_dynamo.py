"""The ``torch.compile`` backend on the CPU: registered by its entry point; an FX graph is
split into the regions cherenkov lowers (each a ``ck.Graph`` behind a compiled function)
and the ops it does not (left as ATen ops), and the split graph computes what the function
does; Dynamo's guards call the backend once per new shape and not for a shape seen before;
without a GPU the backend runs the graph through its fallback and says so once."""

from __future__ import annotations

import functools
import logging
import operator
import sys
from typing import Any

import pytest

import cherenkov as ck

torch = pytest.importorskip("torch")

from cherenkov.search.compiled import CompiledFunction  # noqa: E402
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
        # the function itself: the GPU machine runs the checkout without installing its entry point
        backend = functools.partial(cherenkov_backend, options={"budget_s": 30.0, "database": db})
        fn = torch.compile(mixed, backend=backend)
        got, expected = fn(x, w).float(), mixed(x.float(), w.float())
    assert float((got - expected).norm() / expected.norm()) <= 2e-2


def _gpt2(layers: int, dtype: Any, device: str, width: int = 64, heads: int = 4, vocab: int = 128) -> Any:
    """transformers' GPT-2 LM with random weights (SDPA attention, as it ships)."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=layers, n_embd=width, n_head=heads, n_positions=1024,
                                     vocab_size=vocab, attn_implementation="sdpa")  # fmt: skip
    return transformers.GPT2LMHeadModel(config).eval().to(device=device, dtype=dtype)


def test_an_aten_sdpa_kernel_lowers_with_its_attention_output_only():
    from torch.fx.experimental.proxy_tensor import make_fx

    from cherenkov.graph.torch_capture import lowers_node

    def attend(q, k, v):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True) * 2.0

    q, k, v = (torch.randn(1, 2, 8, 16) for _ in range(3))
    aten = make_fx(attend)(q, k, v)
    (kernel,) = [n for n in aten.graph.nodes if "scaled_dot_product" in str(n.target)]
    with aten.graph.inserting_after(kernel):
        lse = aten.graph.call_function(operator.getitem, (kernel, 1))
    assert not lowers_node(lse), "the log-sum-exp output is not lowered"
    aten.graph.erase_node(lse)
    first = next(n for n in kernel.users if n.target is operator.getitem)
    assert lowers_node(kernel) and lowers_node(first)
    split = split_supported(torch.fx.symbolic_trace(attend), [q, k, v])
    assert len(split.compiled) == 1, "the kernel, its getitem and the scaling are one region"
    assert torch.allclose(split.module(q, k, v), attend(q, k, v), rtol=1e-5, atol=1e-5)


def test_a_gpt2_model_is_one_region_behind_its_embeddings_and_matches_eager():
    model = _gpt2(layers=2, dtype=torch.float32, device="cpu")
    ids = torch.randint(0, 128, (2, 16))
    splits = []

    def recording(gm, example_inputs, **kwargs):
        split = split_supported(gm, example_inputs)
        splits.append(split)
        return split.module.forward

    torch._dynamo.reset()
    with torch.no_grad():
        got = torch.compile(model, backend=recording)(ids).logits
        expected = model(ids).logits
    assert torch.allclose(got, expected, rtol=1e-4, atol=1e-4)
    (split,) = splits
    assert len(split.compiled) == 1, "both layers, the final norm and the head: one region"
    left = {str(n.target) for n in split.module.graph.nodes if n.op == "call_function"}
    assert "aten.embedding.default" in left, "integer token ids stay outside the regions"
    assert not any("cat" in t or "scaled_dot_product" in t or "mm" in t for t in left), left
    ((_, call),) = split.compiled[0].prepared.items()
    assert all(spec.dtype == "fp32" for spec in call.graph.inputs.values())


def test_a_deep_model_lowers_past_the_default_recursion_limit():
    from cherenkov.rewrites.lower import lower

    g = ck.Graph("deep_chain")
    x = g.input("x", (4, 8), "fp32")
    for _ in range(300):  # 1200 ops: a walk down the chain takes several frames per op
        x = (x * 0.5 + 1.0).exp().log()
    g.output(x, "y")
    assert sys.getrecursionlimit() < 4 * 1200
    lowered = lower(g)
    assert set(lowered.roots) == {"y"}


@pytest.mark.gpu
def test_gpu_gpt2_small_forward_through_the_backend_matches_eager(tmp_path):
    """GPT-2 small at its real size (12 layers, d 768, T 1024, B 8), bf16: the backend's logits
    are as close to a float32 forward as eager bf16's are (within a bf16 tolerance), and the
    layers' attention runs on cherenkov's flash kernels (the layers are one region of 135
    kernels: its first round needs about 130 s of budget on the H200's 16 cores)."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    from cherenkov.search.database import TuningDatabase

    model = _gpt2(layers=12, dtype=torch.bfloat16, device="cuda", width=768, heads=12, vocab=50257)
    ids = torch.randint(0, 50257, (8, 1024), device="cuda")
    with TuningDatabase(tmp_path / "tuning.sqlite") as db, torch.no_grad():
        torch._dynamo.reset()
        forwards = []

        def backend(gm, example_inputs):
            forwards.append(cherenkov_backend(gm, example_inputs, options={"budget_s": 300.0, "database": db}))
            return forwards[-1]

        got = torch.compile(model, backend=backend)(ids, use_cache=False).logits.float()
        eager = model(ids, use_cache=False).logits.float()
        expected = model.float()(ids, use_cache=False).logits

    def error(x):
        return float((x - expected).norm() / expected.norm())

    assert error(got) <= max(2e-2, 2 * error(eager)), (error(got), error(eager))
    modules = [f.__self__ for f in forwards if isinstance(getattr(f, "__self__", None), torch.nn.Module)]
    searched = [m.function for module in modules for m in module.modules() if hasattr(m, "function")]
    flash = sum(k.kind == "flash_attention" for f in searched for call in f.prepared.values()
                if call.result is not None for k in call.result.partition)  # fmt: skip
    assert flash == 12, "the twelve layers' attention ran through cherenkov's flash kernels"


def test_a_region_that_cannot_be_prepared_runs_as_aten_ops_and_is_named(caplog, monkeypatch):
    original = CompiledFunction.prepare

    def failing_first(self, tensors):
        if not failing_first.failed:
            failing_first.failed = True
            raise ck.GraphError("injected: no kernel for this region")
        return original(self, tensors)

    failing_first.failed = False
    monkeypatch.setattr(CompiledFunction, "prepare", failing_first)
    x, w = torch.randn(8, 16), torch.randn(16, 16)
    with caplog.at_level(logging.WARNING, logger="cherenkov.search.dynamo"):
        split = split_supported(torch.fx.symbolic_trace(mixed), [x, w])
    assert len(split.compiled) == 1, "the other region still runs through cherenkov"
    assert any("runs as ATen ops" in r.getMessage() and "injected" in r.getMessage() for r in caplog.records)
    assert torch.allclose(split.module(x, w), mixed(x, w), rtol=1e-4, atol=1e-4)
