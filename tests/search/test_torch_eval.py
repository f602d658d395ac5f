"""The torch evaluator of terms (the GPU measurement's reference for generic kernels) against
the float64 NumPy reference, on the CPU; and the search space covering every kernel."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

import cherenkov as ck
from cherenkov.search.space import search_space
from cherenkov.search.database import TuningDatabase

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def graphs() -> list[ck.Graph]:
    sys.path.insert(0, str(EXAMPLES))
    import mlp
    import transformer_block

    result = [transformer_block.build((1, 40, 2, 16, 48)), transformer_block.build((1, 40, 2, 16, 48), causal=True),
              mlp.build((40, 32, 72))]  # fmt: skip
    g = ck.Graph("rows")
    x = g.input("x", (6, 100), "fp32")
    g.output(
        ck.nn.softmax(x, axis=-1)
        + ck.nn.layer_norm(x, x.slice((0, 0), (1, 100)).reshape(100), x.slice((1, 0), (2, 100)).reshape(100)),
        "y",
    )
    g.output(x.max(axis=-1) * x.sum(axis=-1), "r")
    result.append(g)
    g = ck.Graph("odd")
    a, b = g.input("a", (6, 20), "fp32"), g.input("b", (6, 20), "fp32")
    c = ck.where(a < b, (a % 0.7) * g.arange(20), b.abs().sqrt().log2()).maximum(a.sin()).cast("bf16").float()
    g.output(c + a.pad(((0, 0), (3, 0)), value=-2.0).slice((0, 1), (6, 21)), "out")
    result.append(g)
    return result


@pytest.mark.parametrize("graph", graphs(), ids=lambda g: g.name)
def test_torch_evaluator_matches_the_float64_reference(graph) -> None:
    torch = pytest.importorskip("torch")
    from cherenkov.search.torch_eval import evaluate_kernel_torch

    rng = np.random.default_rng(0)
    buffers = {n: rng.standard_normal(t.shape) for n, t in graph.inputs.items()}
    for kernel in ck.derive(graph).kernels:
        reference = kernel.evaluate(buffers)
        inputs = {n: torch.tensor(buffers[n]) for n in kernel.reads}
        got = evaluate_kernel_torch(kernel, inputs, torch.float64).numpy()
        assert got.shape == reference.shape
        np.testing.assert_allclose(got, reference, rtol=1e-10, atol=1e-10, err_msg=kernel.describe()[:200])
        in_fp32 = evaluate_kernel_torch(kernel, {n: x.float() for n, x in inputs.items()}).numpy()
        assert in_fp32.dtype == np.float32
        assert np.linalg.norm(in_fp32 - reference) <= 1e-5 * np.linalg.norm(reference)
        buffers[kernel.output] = reference


def test_term_error_finds_unwritten_and_unmatched_elements() -> None:
    torch = pytest.importorskip("torch")
    from cherenkov.search.measure import term_error

    reference = torch.tensor([1.0, 2.0, float("inf"), float("nan")], dtype=torch.float64)
    error, failure = term_error(torch.tensor([1.0, 2.0, float("inf"), float("nan")]), reference)
    assert failure is None and error == 0
    _, failure = term_error(torch.tensor([1.0, float("nan"), float("inf"), float("nan")]), reference)
    assert "NaN" in failure
    _, failure = term_error(torch.tensor([1.0, 2.0, 3.0, float("nan")]), reference)
    assert "not matched" in failure
    error, failure = term_error(torch.tensor([1.1, 2.0, float("inf"), float("nan")]), reference)
    assert failure is None and abs(error - 0.1 / 5**0.5) < 1e-6


def test_search_space_covers_every_kernel() -> None:
    sys.path.insert(0, str(EXAMPLES))
    import transformer_block

    d = ck.derive(transformer_block.build((1, 40, 2, 12, 48)))
    space = search_space(d, "sm_90")
    assert not space.ungenerated
    assert set(space.candidates) == {k.output for k in d.kernels_for("sm_90")}
    assert "flash_attention" in {k.kind for k in d.kernels}, "head dim 12: flash is derived but has no plan"
    unfused = [k.kind for k in space.kernels]
    assert "flash_attention" not in unfused and "softmax_rows" in unfused
    assert unfused.count("contraction") == [k.kind for k in d.kernels].count("contraction") + 2
    families = {c.plan.params().get("family", "flash") for c in space.all()}
    assert {"mma", "rows"} <= families and "pointwise" not in families, "no reduction is searched as a pointwise loop"


def test_cpu_search_models_and_ranks_every_kernel(tmp_path) -> None:
    g = ck.Graph("rms_matmul")
    x, w, proj = g.input("x", (64, 256), "bf16"), g.input("w", (256,), "bf16"), g.input("proj", (256, 128), "bf16")
    g.output(ck.nn.rms_norm(x, w) @ proj, "y")
    with TuningDatabase(tmp_path / "tuning.sqlite") as db:
        result = ck.optimize(g, target="sm_120", out=tmp_path / "run", database=db)
        if result.environment.measured:
            pytest.skip("a GPU of this target is present: the CPU path is not taken")
        assert set(result.kernels) == {k.output for k in result.derivation.kernels}
        assert all(c.status == "modelled" and c.predicted_ms > 0 for c in result.candidates)
        assert result.best.kernel == "y" and result.best.plan.kind == "contraction"
        again = ck.optimize(g, target="sm_120", out=tmp_path / "again", database=db)
        assert again.from_database and again.best.result.id == result.best.result.id
    assert "rms_norm_rows" in result.report_html.read_text()
