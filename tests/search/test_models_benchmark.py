"""``benchmarks/models.py``'s summaries of a whole model's searches (CPU, on recorded
results): where the kernel time goes, how much of each slow kernel's space was measured,
and the fused candidates that competed for a kernel."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[2]


def _models_benchmark():
    spec = importlib.util.spec_from_file_location("cherenkov_benchmark_models", ROOT / "benchmarks" / "models.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _record(kernel: str, kind: str, ms: float | None, status: str = "ok") -> SimpleNamespace:
    return SimpleNamespace(kernel=kernel, kind=kind, time_ms=ms, id=f"{kind}_{kernel}_{ms}", status=status,
                           reason=None)  # fmt: skip


def _result() -> SimpleNamespace:
    """A region of a GEMM (t4) and its GELU (t3): the GELU's pointwise winner, measured
    against one vectorised variant and a GEMM that absorbs t4, which was slower."""
    gemm, gelu = SimpleNamespace(output="t4", kind="contraction"), SimpleNamespace(output="t3", kind="elementwise")
    candidates = [
        _record("t4", "contraction", 0.060), _record("t4", "contraction", None, "unmeasured"),
        _record("t3", "elementwise", 0.081), _record("t3", "elementwise", 0.090),
        _record("t3", "contraction", 0.150), _record("t3", "contraction", None, "unmeasured"),
    ]  # fmt: skip
    tile = SimpleNamespace(key=lambda: "wgmma_tma_m128_n128_k64_wg2_s6_p_pp_o2")
    winners = {
        "t4": SimpleNamespace(time_ms=0.060, plan=SimpleNamespace(family="wgmma", schedule=tile), result=candidates[0]),
        "t3": SimpleNamespace(time_ms=0.081, plan=SimpleNamespace(family="pointwise"), result=candidates[2]),
    }
    return SimpleNamespace(launched=[gemm, gelu], partition=[gemm, gelu], kernels=winners, candidates=candidates)


def test_winner_times_sum_by_kind_and_count_what_was_measured():
    models = _models_benchmark()
    summary = models.winner_times([_result(), _result()])
    assert summary["by_kind"] == {"contraction:wgmma": 0.12, "elementwise:pointwise": 0.162}
    assert summary["by_gemm_schedule"] == {"wgmma_tma_m128_n128_k64_wg2_s6_p_pp_o2": {"count": 2, "ms": 0.12}}
    slowest = summary["slowest"]
    assert [(s["kernel"], s["ms"], s["measured"]) for s in slowest[:2]] == [("t3", 0.081, 3), ("t3", 0.081, 3)]
    assert slowest[-1]["kernel"] == "t4" and slowest[-1]["measured"] == 1


def test_absorbing_candidates_show_the_fused_form_a_kernel_kept_apart():
    best = _models_benchmark().absorbing_candidates(_result())
    assert set(best) == {"t3"} and best["t3"]["ms"] == 0.150 and best["t3"]["status"] == "ok"


def _generated(tokens: list[int], logits: list[list[float]]) -> SimpleNamespace:
    """What ``generate(..., return_dict_in_generate=True, output_logits=True)`` returns: the
    prompt and new tokens, and one ``(1, vocab)`` logits row a new token."""
    import torch

    return SimpleNamespace(sequences=torch.tensor([tokens]), logits=[torch.tensor([row]) for row in logits])


def test_first_difference_reports_the_step_and_eagers_logit_gap():
    first_difference = _models_benchmark().first_difference
    eager = _generated([7, 7, 2, 0, 1], [[0.0, 0.0, 5.0], [3.0, 2.5, 0.0], [1.0, 4.0, 3.96875]])
    assert first_difference(_generated([7, 7, 2, 0, 1], []), eager) is True
    assert first_difference(_generated([7, 7, 2, 0, 2], []), eager) == {
        "first_differing_token": 2, "eager_top2_logit_gap": 0.03125}  # fmt: skip
    assert first_difference(_generated([7, 7, 2, 1, 1], []), eager)["eager_top2_logit_gap"] == 0.5


def test_a_training_row_names_a_modules_row_or_a_trained_whole_model():
    import pytest

    models = _models_benchmark()
    assert models.row_spec("train:llama_decoder_layer_s2048") == models.row_spec("llama_decoder_layer_s2048")
    assert models.row_spec("train:vit_block") == ("vit_block", {"small": False, "batch": 32})
    assert models.row_spec("train:gpt2_small") == ("gpt2_small", {})  # a training step through the backend
    with pytest.raises(SystemExit, match="no training row"):
        models.row_spec("train:llama_decode")
