"""Every graph runs (issue 7): ``ck.optimize`` finds a verified kernel for every fused kernel
of a graph — softmax rows, norms, contractions with fused prologues and epilogues, flash
attention next to generic kernels — and ``res.run`` chains them on the GPU with the
intermediate buffers in device memory (or, where a matmul's winner absorbed the norm
feeding it, skips the norm). Each output is compared with ``ck.evaluate``
(float64) on the same (rounded) inputs: bf16 within 2e-2, fp32 within 1e-5.

Flash-attention kernels are searched over two schedules only here (their own search is
tested elsewhere): these tests are about covering every graph, not tuning attention.
Skipped without a GPU, torch or cupy.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

import cherenkov as ck
from cherenkov.codegen.term_plan import GEMM_SCHEDULES
from cherenkov.rewrites.plan import FlashSchedule, KernelPlan
from cherenkov.search import optimize as optimize_module
from cherenkov.search.database import TuningDatabase
from cherenkov.search.space import SearchSpace

pytestmark = pytest.mark.gpu

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
TOLERANCE = {"bf16": 2e-2, "fp16": 2e-2, "fp32": 1e-5}
FLASH_CANDIDATES = 2


@pytest.fixture(autouse=True)
def few_flash_schedules(monkeypatch):
    """Keep the default flash schedule (and one more) of each flash-attention kernel."""
    real = optimize_module.search_space

    def limited(derivation, target):
        space = real(derivation, target)
        candidates = {}
        for kernel, group in space.candidates.items():
            if group and isinstance(group[0].plan, KernelPlan):
                default = [c for c in group if c.plan.schedule == FlashSchedule()]
                group = tuple((default + [c for c in group if c not in default])[:FLASH_CANDIDATES])
            candidates[kernel] = group
        return SearchSpace(space.kernels, candidates, space.ungenerated)

    monkeypatch.setattr(optimize_module, "search_space", limited)


def optimize_and_run(graph: ck.Graph, tmp_path, torch, scale: dict[str, float] | None = None, seed: int = 0):
    """Search, check every kernel has a verified winner, run, and compare every output with
    ``ck.evaluate``; returns the result and the errors by output."""
    with TuningDatabase(tmp_path / "tuning.sqlite") as db:
        result = ck.optimize(graph, out=tmp_path / "run", database=db)
    assert result.environment.measured
    for kernel in result.derivation.kernels:
        winner = result.kernels.get(kernel.output)
        assert winner is not None, f"no winner for {kernel.describe()[:200]}: {result.summary.notes}"
        assert winner.result.status == "ok", winner.result
    failures = [c for c in result.candidates if c.status in ("wrong", "crash", "timeout", "compile_error")]
    assert not failures, [(c.id, c.status, c.reason) for c in failures]
    generator = torch.Generator(device="cuda").manual_seed(seed)
    dtypes = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
    inputs = {}
    for name, tensor in graph.inputs.items():
        factor = (scale or {}).get(name, 1.0)
        x = torch.randn(tensor.shape, generator=generator, device="cuda", dtype=torch.float32) * factor
        inputs[name] = x.to(dtypes[tensor.dtype])
    outputs = result.run(**inputs)
    expected = ck.evaluate(graph, {n: x.double().cpu().numpy() for n, x in inputs.items()})
    errors = {}
    for name, reference in expected.items():
        got = outputs[name].double().cpu().numpy()
        assert got.shape == reference.shape
        errors[name] = float(np.linalg.norm(got - reference) / np.linalg.norm(reference))
        tolerance = TOLERANCE[graph.outputs[name].dtype]
        assert errors[name] <= tolerance, f"{name}: relative error {errors[name]:.3g} > {tolerance}"  # NaN fails
    return result, errors


def kinds(result) -> list[str]:
    return [k.kind for k in result.derivation.kernels]


def test_softmax_rows_of_1000_4096_and_50257(gpu, tmp_path) -> None:
    g = ck.Graph("softmaxes")
    for name, (rows, width) in {"a": (64, 1000), "b": (48, 4096), "c": (16, 50257)}.items():
        g.output(ck.nn.softmax(g.input(name, (rows, width), "bf16"), axis=-1), f"y_{name}")
    result, errors = optimize_and_run(g, tmp_path, gpu, scale={"c": 3.0})
    assert kinds(result) == ["softmax_rows"] * 3


def test_rms_norm_then_matmul(gpu, tmp_path) -> None:
    g = ck.Graph("rms_matmul")
    x = g.input("x", (200, 512), "bf16")
    w = g.input("w", (512,), "bf16")
    proj = g.input("proj", (512, 384), "bf16")
    g.output(ck.nn.rms_norm(x, w) @ proj, "y")
    result, _ = optimize_and_run(g, tmp_path, gpu, scale={"proj": 0.05})
    assert sorted(kinds(result)) == ["contraction", "rms_norm_rows"]


def test_rms_norm_absorbed_by_its_matmul_runs_as_one_kernel(gpu, tmp_path, monkeypatch) -> None:
    """Only the candidates that absorb the norm are offered for the matmul: its winner runs the
    norm in its main loop, and the norm kernel is not launched."""
    if gpu.cuda.get_device_capability() != (9, 0):
        pytest.skip("the absorbing GEMM is an sm_90a kernel")
    real = optimize_module.search_space

    def absorbing_only(derivation, target):
        space = real(derivation, target)
        candidates = {k: tuple(c for c in group if c.absorbs or c.plan.kind != "contraction")
                      for k, group in space.candidates.items()}  # fmt: skip
        return SearchSpace(space.kernels, candidates, space.ungenerated)

    monkeypatch.setattr(optimize_module, "search_space", absorbing_only)
    g = ck.Graph("rms_matmul")
    x, w, proj = g.input("x", (200, 512), "bf16"), g.input("w", (512,), "bf16"), g.input("proj", (512, 384), "bf16")
    g.output(ck.nn.rms_norm(x, w) @ proj, "y")
    result, _ = optimize_and_run(g, tmp_path, gpu, scale={"proj": 0.05})
    assert [k.kind for k in result.launched] == ["contraction"]
    assert set(result.kernels["y"].plan.kernel.reads) == {"x", "w", "proj"}
    assert any("not launched" in note for note in result.summary.notes)


def test_layer_norm_bf16_and_fp32(gpu, tmp_path) -> None:
    g = ck.Graph("layer_norms")
    for dtype, shape in (("bf16", (300, 1000)), ("fp32", (70, 777))):
        x = g.input(f"x_{dtype}", shape, dtype)
        w = g.input(f"w_{dtype}", shape[-1:], dtype)
        b = g.input(f"b_{dtype}", shape[-1:], dtype)
        g.output(ck.nn.layer_norm(x, w, b), f"y_{dtype}")
    result, _ = optimize_and_run(g, tmp_path, gpu)
    assert kinds(result).count("layer_norm_rows") == 2


def test_fp32_graph_within_1e_5(gpu, tmp_path) -> None:
    """fp32 kernels take the exact paths (no 16-bit rounding of mma operands)."""
    g = ck.Graph("fp32_mix")
    x = g.input("x", (96, 160), "fp32")
    w = g.input("w", (160,), "fp32")
    proj = g.input("proj", (160, 72), "fp32")
    z = g.input("z", (33, 2000), "fp32")
    g.output(ck.nn.gelu(ck.nn.rms_norm(x, w) @ proj), "y")
    g.output(ck.nn.softmax(z, axis=-1), "p")
    g.output(z.max(axis=-1) + z.sum(axis=-1) * 0.01, "r")
    result, _ = optimize_and_run(g, tmp_path, gpu, scale={"proj": 0.1})
    assert {"rms_norm_rows", "contraction", "softmax_rows", "reduction"} <= set(kinds(result))


def test_gelu_mlp(gpu, tmp_path) -> None:
    sys.path.insert(0, str(EXAMPLES))
    import mlp

    g = mlp.build((200, 256, 384))
    result, _ = optimize_and_run(g, tmp_path, gpu, scale={"w1": 0.06, "b1": 0.5, "w2": 0.05})
    assert kinds(result) == ["contraction", "contraction"]
    mma = [c for c in result.candidates if c.params["family"] == "mma" and c.status in ("ok", "stopped_early")]
    assert len(mma) == 2 * len(GEMM_SCHEDULES) and all(c.rel_error < 2e-2 for c in mma), "tensor-core GEMMs verified"


def test_swiglu(gpu, tmp_path) -> None:
    """SwiGLU with the gate and up projections in one weight (``w13``, as LLaMA code often
    fuses them): ``(silu(x @ w13[:, :F]) * (x @ w13[:, F:])) @ w_down``."""
    m, d, f = 200, 256, 320
    g = ck.Graph("swiglu_w13")
    x = g.input("x", (m, d), "bf16")
    w13 = g.input("w13", (d, 2 * f), "bf16")
    w_down = g.input("w_down", (f, d), "bf16")
    h = x @ w13
    g.output((ck.nn.silu(h.slice((0, 0), (m, f))) * h.slice((0, f), (m, 2 * f))) @ w_down, "y")
    result, _ = optimize_and_run(g, tmp_path, gpu, scale={"w13": 0.06, "w_down": 0.05})
    assert kinds(result) == ["contraction", "contraction"]


def test_attention_then_output_projection(gpu, tmp_path) -> None:
    g = ck.Graph("attention_projection")
    q = g.input("q", (1, 4, 200, 64), "bf16")
    k = g.input("k", (1, 4, 200, 64), "bf16")
    v = g.input("v", (1, 4, 200, 64), "bf16")
    wo = g.input("wo", (256, 256), "bf16")
    attended = ck.nn.attention(q, k, v, causal=True)
    g.output(attended.transpose(1, 2).reshape(1, 200, 256) @ wo, "y")
    result, _ = optimize_and_run(g, tmp_path, gpu, scale={"wo": 0.06})
    assert kinds(result) == ["flash_attention", "contraction"]
    assert isinstance(result.kernels[result.derivation.kernels[0].output].plan, KernelPlan)


def test_transformer_block(gpu, tmp_path) -> None:
    sys.path.insert(0, str(EXAMPLES))
    import transformer_block

    g = transformer_block.build((1, 128, 2, 64, 256))
    weights = {"wq": 0.06, "wk": 0.06, "wv": 0.06, "wo": 0.06, "w1": 0.06, "b1": 0.5, "w2": 0.05}
    result, errors = optimize_and_run(g, tmp_path, gpu, scale=weights)
    assert {"flash_attention", "contraction", "rms_norm_rows"} <= set(kinds(result))
    assert result.best is not None and result.best.source

    # the same kernels recorded as one CUDA graph: replays match run(), also on new data
    torch = gpu
    inputs = {n: torch.randn(t.shape, device="cuda").mul(weights.get(n, 1.0)).bfloat16() for n, t in g.inputs.items()}
    captured, fresh = result.capture(**inputs), result.capture_fresh(**inputs)
    assert fresh.fresh == tuple(g.outputs) and not captured.fresh
    for step in range(2):
        if step:
            for x in captured.inputs.values():
                x.copy_(torch.randn_like(x, dtype=torch.float32).mul(0.05))
        (replayed,) = captured().values()
        (direct,) = result.run(**captured.inputs).values()
        (tail,) = fresh().values()  # the last kernel after the replay, into a new tensor
        torch.cuda.synchronize()
        assert torch.isfinite(replayed).all()
        assert torch.equal(replayed, direct), f"replay {step} differs from run()"
        assert torch.equal(tail, direct) and tail.data_ptr() != replayed.data_ptr()


def test_captured_nanogpt_attention_derives_flash_and_matches_the_module(gpu, tmp_path) -> None:
    import real_modules

    torch = gpu
    torch.manual_seed(0)
    real = real_modules.nanogpt_attention(batch=2, dtype=torch.bfloat16, dims=(256, 4, 128))
    module, (x,) = real.module, real.inputs
    graph = ck.from_torch(module, x)
    derivation = ck.derive(graph)
    assert derivation.found("flash_attention") and "flash_attention" in [k.kind for k in derivation.kernels]
    with TuningDatabase(tmp_path / "tuning.sqlite") as db:
        result = ck.optimize(graph, out=tmp_path / "run", database=db)
    inputs = {n: torch.from_numpy(a).to("cuda", torch.bfloat16) for n, a in graph.example_inputs().items()}
    (got,) = result.run(**inputs).values()
    with torch.no_grad():
        expected = module.cuda().float()(x.cuda().float())
    error = float((got.float() - expected).norm() / expected.norm())
    assert error <= 2e-2, f"relative error {error:.3g} against the PyTorch module"
