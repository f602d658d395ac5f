"""The float32 attention a candidate kernel is checked against (``measure.float32_attention``), on the
CPU: a soft cap (which SDPA lacks), a causal mask beside a bias tensor (SDPA takes one or the other) and
sliding windows (which SDPA lacks too: causal ones, and ModernBERT's about the query), against the
attention written out in float64."""

from __future__ import annotations

import pytest

from cherenkov.rewrites.plan import AttentionProblem

torch = pytest.importorskip("torch")


def written_out(problem: AttentionProblem, q, k, v, mask):
    """softmax(cap·tanh(scale·q kᵀ / cap) + mask, causal, window) v in float64, K/V heads repeated for
    GQA."""
    q, k, v = q.double(), k.double().repeat_interleave(problem.group_size, 1), v.double().repeat_interleave(
        problem.group_size, 1)
    scores = (q @ k.transpose(-1, -2)) * problem.head_dim**-0.5
    if problem.softcap:
        scores = problem.softcap * torch.tanh(scores / problem.softcap)
    if mask is not None:
        scores = scores + mask.double()
    query, key = torch.arange(scores.shape[-2]).unsqueeze(-1), torch.arange(scores.shape[-1])
    if problem.causal or problem.window:
        scores = scores.masked_fill(key > query + problem.window_ahead, -torch.inf)
    if problem.window:
        scores = scores.masked_fill(key <= query - problem.window, -torch.inf)
    return torch.softmax(scores, -1) @ v


CASES = [(2.0, True, False, 0, 0), (2.0, False, True, 0, 0), (0.0, True, True, 0, 0), (3.0, True, True, 0, 0),
         (0.0, True, False, 5, 0), (0.0, True, True, 7, 0), (2.0, True, False, 6, 0), (0.0, False, False, 5, 4),
         (0.0, False, True, 9, 3)]  # fmt: skip


@pytest.mark.parametrize(("softcap", "causal", "biased", "window", "ahead"), CASES)
def test_float32_attention_applies_the_cap_the_bias_the_causal_mask_and_the_window(softcap, causal, biased, window,
                                                                                    ahead) -> None:  # fmt: skip
    from cherenkov.search.measure import float32_attention

    problem = AttentionProblem(2, 4, 2, 24, 24, 16, causal=causal, softcap=softcap, window=window, window_ahead=ahead)
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, h, 24, 16, generator=generator) for h in (4, 2, 2))
    mask = torch.randn(2, 1, 24, 24, generator=generator) if biased else None
    got = float32_attention(problem, q, k, v, mask)
    expected = written_out(problem, q, k, v, mask)
    assert float((got.double() - expected).norm() / expected.norm()) < 1e-5
    # the cap bends these unit-spread scores: uncapped attention is far off
    if softcap:
        uncapped = written_out(AttentionProblem(2, 4, 2, 24, 24, 16, causal=causal, window=window), q, k, v, mask)
        assert float((uncapped - expected).norm() / expected.norm()) > 1e-2


def test_an_fp32_term_kernel_is_checked_against_the_graphs_own_fp32_arithmetic() -> None:
    """A kernel computing ``cos(500·x·y)`` in fp32, as the graph (and eager) does, is within the 1e-5 of an
    fp32 output: the product's fp32 rounding, times arguments in the hundreds (RoPE's cosines of positions
    times frequencies), moves the cosine by ~1e-4, which a float64 reference counted as the kernel's error."""
    import cherenkov as ck
    from cherenkov.codegen.term_plan import term_plans
    from cherenkov.rewrites.plan import TARGETS
    from cherenkov.search.measure import TERM_TOLERANCE, verify_term

    g = ck.Graph("rotary_cosines")
    x, y = g.input("x", (64, 1), "fp32"), g.input("y", (1, 32), "fp32")
    g.output((x * 500.0 * y).cos(), "c")
    d = ck.derive(g)
    (kernel,) = d.kernels
    plan = term_plans(kernel, *d.tensor_types(), TARGETS["sm_90"])[0]

    def in_fp32(inputs, out):
        return torch.cos(inputs["x"] * 500.0 * inputs["y"]).to(out.dtype)

    error, failure, inputs, _ = verify_term(in_fp32, plan, seed=3, device="cpu")
    assert failure is None and error <= TERM_TOLERANCE["fp32"], error
    exact = torch.cos(inputs["x"].double() * 500.0 * inputs["y"].double())
    assert float((in_fp32(inputs, exact) - exact).norm() / exact.norm()) > TERM_TOLERANCE["fp32"]


def test_a_measuring_worker_computes_its_float32_references_without_tf32(monkeypatch) -> None:
    """A worker sets IEEE float32 matmuls before serving, whatever precision its process started with (TF32
    moves a float32 matmul by ~1e-3, past an fp32 term's tolerance)."""
    from cherenkov.search import measure

    class Stopping:
        def send(self, message) -> None:
            pass

        def recv(self):
            return "stop", None

    previous = torch.get_float32_matmul_precision()
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    monkeypatch.setattr(measure, "L2Flush", lambda torch, device: None)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device: "a GPU")
    try:
        torch.set_float32_matmul_precision("high")
        measure.worker_main(Stopping(), 0)
        assert torch.get_float32_matmul_precision() == "highest"
    finally:
        torch.set_float32_matmul_precision(previous)
