"""The float32 attention a candidate kernel is checked against (``measure.float32_attention``), on the
CPU: a soft cap (which SDPA lacks) and a causal mask beside a bias tensor (SDPA takes one or the other),
against the attention written out in float64."""

from __future__ import annotations

import pytest

from cherenkov.rewrites.plan import AttentionProblem

torch = pytest.importorskip("torch")


def written_out(problem: AttentionProblem, q, k, v, mask):
    """softmax(cap·tanh(scale·q kᵀ / cap) + mask, causal) v in float64, K/V heads repeated for GQA."""
    q, k, v = q.double(), k.double().repeat_interleave(problem.group_size, 1), v.double().repeat_interleave(
        problem.group_size, 1)
    scores = (q @ k.transpose(-1, -2)) * problem.head_dim**-0.5
    if problem.softcap:
        scores = problem.softcap * torch.tanh(scores / problem.softcap)
    if mask is not None:
        scores = scores + mask.double()
    if problem.causal:
        scores = scores.masked_fill(torch.ones(scores.shape[-2:], dtype=torch.bool).triu(1), -torch.inf)
    return torch.softmax(scores, -1) @ v


@pytest.mark.parametrize(("softcap", "causal", "biased"), [(2.0, True, False), (2.0, False, True), (0.0, True, True),
                                                           (3.0, True, True)])  # fmt: skip
def test_float32_attention_applies_the_cap_the_bias_and_the_causal_mask(softcap, causal, biased) -> None:
    from cherenkov.search.measure import float32_attention

    problem = AttentionProblem(2, 4, 2, 24, 24, 16, causal=causal, softcap=softcap)
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, h, 24, 16, generator=generator) for h in (4, 2, 2))
    mask = torch.randn(2, 1, 24, 24, generator=generator) if biased else None
    got = float32_attention(problem, q, k, v, mask)
    expected = written_out(problem, q, k, v, mask)
    assert float((got.double() - expected).norm() / expected.norm()) < 1e-5
    # the cap bends these unit-spread scores: uncapped attention is far off
    if softcap:
        uncapped = written_out(AttentionProblem(2, 4, 2, 24, 24, 16, causal=causal), q, k, v, mask)
        assert float((uncapped - expected).norm() / expected.norm()) > 1e-2
