"""Real modules, end to end (issue 21): transformers' Llama attention (SDPA and eager paths)
and decoder layer, timm's ViT block and nanoGPT's attention, captured with ``ck.from_torch``.

On the CPU, at small sizes: the captured graph (fp32) evaluates to the module's output; in
bf16, flash attention is derived, planned on sm_90, sm_90a and sm_120 (the Hopper family
too), ``found`` agrees with ``kernels``, and no view of q, k, v or o is a kernel of its own:
q, k and v are read in place (heads split from a projection, slices of a fused QKV, a K/V
head repeated for its query heads) and the output is laid out for the projection after it.
On the GPU, at small sizes: each module's ``res.run`` matches the module in bf16.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

import cherenkov as ck
from cherenkov.rewrites import terms as t
from cherenkov.rewrites.plan import TARGETS, OperandLayout
from cherenkov.rewrites.plan_sm90a import HopperFlashSchedule
from cherenkov.search.compiled_autograd import training_graph
from cherenkov.search.measure import fill_saved_statistics
from cherenkov.search.space import stored_plan

torch = pytest.importorskip("torch")
real_modules = pytest.importorskip("real_modules")
pytest.importorskip("transformers")
pytest.importorskip("timm")

NAMES = sorted(real_modules.BUILDERS)


def build(name: str, **options) -> real_modules.RealModule:
    torch.manual_seed(0)
    return real_modules.BUILDERS[name](**options)


def views(kernels) -> list:
    """Kernels that only move data: an elementwise kernel whose term is one read."""
    return [k for k in kernels if k.kind == "elementwise" and k.term[0] == "Tensor"]


@pytest.mark.parametrize("name", NAMES)
def test_captured_fp32_graph_evaluates_to_the_module(name: str) -> None:
    real = build(name)
    graph = ck.from_torch(real.module, *real.inputs)
    with torch.no_grad():
        expected = real.module(*real.inputs).double().numpy()
    (got,) = ck.evaluate(graph, graph.example_inputs()).values()
    assert np.linalg.norm(got - expected) / np.linalg.norm(expected) <= 1e-5


@pytest.mark.parametrize("name", NAMES)
def test_bf16_modules_derive_planned_flash_attention_reading_views_in_place(name: str) -> None:
    real = build(name, dtype=torch.bfloat16)
    d = ck.derive(ck.from_torch(real.module, *real.inputs))
    kinds = [k.kind for k in d.kernels]
    assert d.found("flash_attention") and kinds.count("flash_attention") == 1, kinds
    assert d.found("flash_attention") == ("flash_attention" in kinds)
    assert not views(d.kernels), [k.describe()[:200] for k in views(d.kernels)]
    (flash,) = (k for k in d.kernels if k.kind == "flash_attention")
    readers = [k for k in d.kernels if flash.output in k.reads]
    assert [k.kind for k in readers] == ["contraction"], "the output projection reads attention's output"
    (read,) = {s for s in t.subterms(readers[0].term) if s[0] == "Tensor" and s[1] == flash.output}
    assert all(ix[0] in ("Ax", "IxLit") for ix in t.ix_items(read[2])), "a plain matrix"
    for target in ("sm_90", "sm_90a", "sm_120"):
        plans = d.plans(target)
        assert plans and all(p.problem.causal == real.causal for p in plans), target
        assert [k.kind for k in d.kernels_for(target)] == kinds
    assert any(isinstance(p.schedule, HopperFlashSchedule) for p in d.plans("sm_90a"))


# ------------------------------------------------------------------------------ GPU


@pytest.mark.gpu
@pytest.mark.parametrize("name", NAMES)
def test_gpu_modules_run_through_cherenkov_like_the_module(gpu, tmp_path, name: str) -> None:
    from cherenkov.search.database import TuningDatabase

    real = build(name, dtype=torch.bfloat16, device="cuda")
    graph = ck.from_torch(real.module, *real.inputs)
    with TuningDatabase(tmp_path / "tuning.sqlite") as db:
        result = ck.optimize(graph, out=tmp_path, database=db, budget_s=30.0)
    assert "flash_attention" in [k.kind for k in result.partition]
    inputs = {n: torch.from_numpy(a).to("cuda", torch.bfloat16) for n, a in graph.example_inputs().items()}
    (got,) = result.run(**inputs).values()
    with torch.no_grad():
        expected = real.module(*real.inputs).float()
    error = float((got.float() - expected).norm() / expected.norm())
    assert error <= 2e-2, f"{name}: relative error {error:.3g} against the module"


def test_a_stored_strided_flash_plan_comes_back_equal() -> None:
    """A database hit rebuilds a flash plan whose q, k, v are views (slices of one fused
    QKV) with its operand layouts as layouts, not as the JSON dicts they were stored as."""
    real = real_modules.nanogpt_attention(dtype=torch.bfloat16)
    derivation = ck.derive(ck.from_torch(real.module, *real.inputs))
    kernels = derivation.kernels_for("sm_90a")
    plan = next(p for p in derivation.plans("sm_90a") if p.problem.strided)
    rebuilt = stored_plan(json.loads(json.dumps(plan.params())), kernels, derivation, TARGETS["sm_90a"])
    assert rebuilt == plan and rebuilt.name == plan.name
    assert all(isinstance(layout, OperandLayout) for layout in rebuilt.problem.layouts)


GRADIENT_MODULES = ["nanogpt_attention", "llama_attention_sdpa", "llama_attention_eager", "llama_decoder_layer",
                    "vit_block"]


def gradient_of(real: real_modules.RealModule) -> ck.Graph:
    """``ck.grad`` of a captured module for its input and every parameter."""
    graph = ck.from_torch(real.module, *real.inputs)
    return ck.grad(graph, wrt=tuple(graph.inputs))


@pytest.mark.parametrize("name", [n for n in GRADIENT_MODULES if n != "llama_attention_sdpa"])  # in the decoder layer
def test_module_gradients_recompute_the_scores_in_one_flash_forward_and_one_flash_backward(name: str) -> None:
    """The gradient graph of a captured module (q, k and v from projections: slices of nanoGPT's
    fused one, unbound from timm's, Llama's three with RoPE and GQA; their gradients concatenated,
    stacked or summed back) never
    stores an attention's probabilities or score gradient: one flash forward (attention's output,
    which the output projection's gradient reads) and one flash backward writing dq, dk and dv (GQA:
    dk and dv summed over the group), the derived program equal to the gradient graph in float64;
    in bf16 both flash kernels are planned on both backward families' targets (``mma.sync``: sm_120;
    ``wgmma``: sm_90a)."""
    graph = gradient_of(build(name))
    d = ck.derive(graph)
    kinds = [k.kind for k in d.kernels]
    assert kinds.count("flash_attention") == 1 and kinds.count("flash_attention_backward") == 1, kinds
    assert "softmax_rows" not in kinds
    inputs = graph.example_inputs()
    expected, got = ck.evaluate(graph, inputs), ck.evaluate(d, inputs)
    for output, value in expected.items():
        assert np.linalg.norm(got[output] - value) <= 1e-9 * np.linalg.norm(value), output
    d = ck.derive(gradient_of(build(name, dtype=torch.bfloat16)))
    for target in ("sm_90a", "sm_120"):
        assert {p.kind for p in d.plans(target)} == {"flash_attention", "flash_attention_backward"}, target
        assert [k.kind for k in d.kernels_for(target)] == [k.kind for k in d.kernels], target


def training_gradient_of(real: real_modules.RealModule) -> tuple[ck.Graph, ck.Graph]:
    """A captured module's training forward (its attention's output and log-sum-exp as further
    outputs, as ``ck.compile(..., saved_statistics=True)`` runs it) and the gradient graph for its
    input and every parameter that reads them as saved inputs."""
    graph = ck.from_torch(real.module, *real.inputs)
    made = training_graph(graph)
    assert made is not None, f"{real.name}: the capture notes no attention"
    training, saved = made
    return training, ck.grad(training, wrt=tuple(graph.inputs), saved=saved, outputs=tuple(graph.outputs))


def assert_program_is_graph(graph: ck.Graph) -> None:
    """The derived program of ``graph`` equals the graph in float64 (≤ 1e-9 relative, each output)."""
    inputs = graph.example_inputs()
    expected, got = ck.evaluate(graph, inputs), ck.evaluate(ck.derive(graph), inputs)
    for output, value in expected.items():
        assert np.linalg.norm(got[output] - value) <= 1e-9 * np.linalg.norm(value), output


@pytest.mark.parametrize("name", ["nanogpt_attention", "llama_attention_eager", "vit_block"])  # SDPA: the GPT-2 stack's
def test_module_training_forward_saves_what_its_flash_backward_reads(name: str) -> None:
    """Training with saved statistics: the capture notes each module's attention (SDPA's, and
    ``softmax(scores) @ v`` spelled out as nanoGPT and transformers' eager path write it); the
    training forward writes the attention's output and log-sum-exp from one flash kernel (q and k
    RoPE'd once for both); the gradient graph runs one flash backward that reads them, planned from
    saved statistics on every target, and no flash forward (the output projection's weight gradient
    reads the saved output)."""
    training, gradient = training_gradient_of(build(name, dtype=torch.bfloat16))
    forward = ck.derive(training)
    (flash,) = [k for k in forward.kernels if k.kind == "flash_attention"]
    assert [side.output for side in flash.side_outputs] == [n for n in gradient.saved if n.endswith("_lse")]
    backward = ck.derive(gradient)
    kinds = [k.kind for k in backward.kernels]
    assert kinds.count("flash_attention_backward") == 1 and "flash_attention" not in kinds, kinds
    for target in ("sm_80", "sm_90", "sm_90a", "sm_120"):
        assert {p.kind for p in forward.plans(target)} == {"flash_attention"}, target
        plans = backward.plans(target)
        assert plans and all(p.problem.saved is not None for p in plans), target
        assert any(p.schedule.saved_statistics for p in plans), target
        assert backward.kernels_for(target) == backward.kernels, target


@pytest.mark.parametrize("implementation", ["sdpa"])  # the eager spelling: nanoGPT's and Llama's tests
def test_each_layer_of_a_model_trains_from_its_saved_statistics(implementation: str) -> None:
    """Two GPT-2 blocks (transformers): the training forward writes each attention's output and
    log-sum-exp from its flash kernel; in the gradient graph the second layer reads the first one's
    saved output, and each layer's flash backward is planned from its own saved statistics, with
    no flash forward left."""
    real = real_modules.gpt2_blocks(layers=2, implementation=implementation, dtype=torch.bfloat16)
    training, gradient = training_gradient_of(real)
    first, second = (n for n in gradient.saved if n.endswith("_o"))
    assert gradient.inputs[first].id in gradient.ancestors([gradient.saved[second].id])
    forward = ck.derive(training)
    assert [len(k.side_outputs) for k in forward.kernels if k.kind == "flash_attention"] == [1, 1]
    backward = ck.derive(gradient)
    kinds = [k.kind for k in backward.kernels]
    assert kinds.count("flash_attention_backward") == 2 and "flash_attention" not in kinds, kinds
    plans = [p for p in backward.plans("sm_90a") if p.schedule.saved_statistics]
    assert len({(p.problem.saved.o, p.problem.saved.lse) for p in plans}) == 2


@pytest.mark.parametrize("name", ["nanogpt_attention", "llama_attention_eager"])
def test_module_training_programs_equal_their_graphs(name: str) -> None:
    """A spelled-out attention's training forward and the gradient graph reading what it saves (RoPE,
    GQA and a float32 softmax in Llama's eager path): each derived program equals its graph in
    float64."""
    for graph in training_gradient_of(build(name)):
        assert_program_is_graph(graph)


def test_nanogpt_gradient_reads_q_k_v_in_the_fused_projection() -> None:
    """nanoGPT's attention gradient: the probabilities and score gradient are the two recomputed
    intermediates; the flash backward reads q, k and v at their offsets in the fused projection's
    output, and writes dq, dk and dv with the head dim last (dv, which the capture gives as
    ``(B, H, D, T)``, laid out for the kernel)."""
    width, heads, tokens = 128, 2, 16
    real = real_modules.nanogpt_attention(dims=(width, heads, tokens), dtype=torch.bfloat16)
    d = ck.derive(gradient_of(real))
    assert [tuple(d.lowered.shape(n) for n in group) for group in d.lowered.recomputed] == \
        [((2, heads, tokens, tokens),) * 2]  # fmt: skip
    problem = next(p for p in d.plans("sm_90a") if p.kind == "flash_attention_backward").problem
    attention = problem.attention
    assert attention.q == attention.k == attention.v, "one projection buffer"
    assert [layout.offset for layout in attention.layouts[:3]] == [0, width, 2 * width]
    assert attention.layouts[0].shape == (2, tokens, 3 * width) and attention.layouts[0].seq == 3 * width
    assert [g.role for g in problem.gradients] == ["dq", "dk", "dv"]
    assert all(g.layout.shape == (2, heads, tokens, width // heads) for g in problem.gradients)


@pytest.mark.skipif(shutil.which("g++") is None, reason="no g++ to emulate kernels with")
@pytest.mark.parametrize(("name", "saved"), [("nanogpt_attention", False), ("llama_attention_sdpa", False),
                                             ("nanogpt_attention", True)])  # fmt: skip
def test_emulated_module_backward_reads_its_operands_in_place_like_float64(name: str, saved: bool) -> None:
    """A captured module's flash backward, its ``mma.sync`` kernels run on the CPU on the buffers
    the kernels before it write (rounded as stored): q, k and v read in place (nanoGPT: at
    their offsets in the fused projection; Llama: RoPE'd q and k, v through its heads view, K/V
    heads shared by a group) and dO through the heads view of the output projection's gradient;
    dq, dk and dv (nanoGPT's dv laid out with its head dim last; Llama's dk and dv summed over the
    group) within 1e-2 of the derived program's float64 buffers. ``saved``: the gradient graph of the
    training forward, its statistics pass reading the output and log-sum-exp that forward saves."""
    from tests.codegen.backward_emulator import emulate_backward
    from tests.codegen.emulator import rounded

    options = {"dims": (128, 2, 40)} if name == "nanogpt_attention" else {}
    real = build(name, dtype=torch.bfloat16, **options)
    graph = training_gradient_of(real)[1] if saved else gradient_of(real)
    d = ck.derive(graph)
    buffers = {n: rounded(value, graph.inputs[n].dtype) for n, value in graph.example_inputs().items()}
    (backward,) = (k for k in d.kernels if k.kind == "flash_attention_backward")
    for kernel in d.kernels[: d.kernels.index(backward)]:  # the buffers it reads, rounded as stored
        buffers.update({n: rounded(v, "bf16") for n, v in kernel.evaluate_outputs(buffers).items()})
    expected = backward.evaluate_outputs(buffers)
    plan = next(p for p in d.plans("sm_90") if p.kind == "flash_attention_backward" and p.schedule.saved_statistics == saved)
    problem = plan.problem
    a = problem.attention
    statistics = {}
    if saved:  # what the training forward's flash kernel writes, from the q, k and v stored in bf16
        stored = {n: torch.from_numpy(buffers[n]).float() for n in {a.q, a.k, a.v, problem.saved.o, problem.saved.lse}}
        fill_saved_statistics(problem, stored)
        statistics = {"o": rounded(stored[problem.saved.o].numpy(), "bf16"), "lse": stored[problem.saved.lse].numpy()}
    got = emulate_backward(plan, buffers[a.q], buffers[a.k], buffers[a.v], buffers[problem.grad_output], **statistics)
    assert set(got) == {"dq", "dk", "dv"}
    for gradient in problem.gradients:
        reference = expected[gradient.tensor]
        error = np.linalg.norm(got[gradient.role] - reference) / np.linalg.norm(reference)
        assert error <= 1e-2, f"{gradient.role} differs by {error:.3g}"


def training_losses(real: real_modules.RealModule, saved: bool, steps: int, tmp_path,
                    budget_s: float = 30.0) -> dict[str, list[float]]:  # fmt: skip
    """The losses of ``steps`` SGD steps on a fixed target of the module under ``ck.compile`` (the
    forward and ``ck.grad`` of it searched and run on the GPU, ``budget_s`` each; ``saved``: with
    saved statistics) and of a copy run eagerly."""
    import copy

    from cherenkov.search.database import TuningDatabase

    eager = copy.deepcopy(real.module)
    target = torch.randn_like(real.module(*real.inputs).float())
    losses: dict[str, list[float]] = {"cherenkov": [], "eager": []}
    with TuningDatabase(tmp_path / "tuning.sqlite") as db:
        compiled = ck.compile(real.module, *real.inputs, budget_s=budget_s, database=db, out=tmp_path / "run",
                              saved_statistics=saved)  # fmt: skip
        for model, parameters, key in ((compiled, real.module.parameters(), "cherenkov"),
                                       (eager, eager.parameters(), "eager")):  # fmt: skip
            optimiser = torch.optim.SGD(parameters, lr=0.05)
            for _ in range(steps):
                optimiser.zero_grad()
                loss = ((model(*real.inputs).float() - target) ** 2).mean()
                loss.backward()
                optimiser.step()
                losses[key].append(loss.item())
    return losses


@pytest.mark.gpu
@pytest.mark.parametrize("saved", [False, True], ids=["recomputed", "saved_statistics"])
def test_gpu_nanogpt_attention_trains_through_ck_compile_like_eager(saved, gpu, tmp_path) -> None:
    """20 SGD steps of nanoGPT's causal self-attention (width 128, 2 heads of 64, T 256, B 4,
    bf16) under ``ck.compile``: the forward and ``ck.grad`` of it searched and run on the GPU
    give eager's losses within bf16 tolerance (``saved``: the training forward saves the
    attention's output and log-sum-exp, which the backward reads)."""
    torch.manual_seed(0)
    real = real_modules.nanogpt_attention(small=True, batch=4, dtype=torch.bfloat16, device="cuda", dims=(128, 2, 256))
    losses = training_losses(real, saved, 20, tmp_path)
    for got, expected in zip(losses["cherenkov"], losses["eager"]):
        assert abs(got - expected) <= 2e-2 * abs(expected), losses


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["llama_decoder_layer", "vit_block"])
def test_gpu_modules_train_from_saved_statistics_through_ck_compile_like_eager(name, gpu, tmp_path) -> None:
    """Five SGD steps of transformers' Llama decoder layer (RoPE, GQA, SwiGLU, RMSNorm) and of timm's
    ViT block (erf GELU, q, k, v unbound from one projection) under ``ck.compile`` with saved
    statistics, in bf16 on the GPU, give eager's losses within bf16 tolerance."""
    real = build(name, dtype=torch.bfloat16, device="cuda")
    losses = training_losses(real, True, 5, tmp_path, budget_s=60.0)  # a gradient graph of ~50 kernels
    for got, expected in zip(losses["cherenkov"], losses["eager"]):
        assert abs(got - expected) <= 2e-2 * abs(expected), losses
    assert losses["eager"][-1] < losses["eager"][0], losses
