"""The flash-attention backward is derived from ``ck.grad`` of attention in every spelling the
forward derives from: one kernel writing dq, dk and dv, its program equal to the gradient
graph in float64, the chain of identities that leads there listed."""

from __future__ import annotations

import numpy as np
import pytest

import cherenkov as ck
from cherenkov.rewrites.plan import SMEM_RESERVED_PER_BLOCK, TARGETS
from cherenkov.rewrites.plan_backward import backward_smem_bytes

from cherenkov.rewrites import terms as t
from tests.rewrites.test_derive import SPELLINGS, assert_derived_program_matches, attention_graph, random_inputs, sink_graph

# The spellings of the acceptance and the rules each one's backward needs beyond the
# common chain (quotient VJP, shift gradient, D = rowsum(dO∘O), P from the LSE, the three forms).
BACKWARD_SPELLINGS = {
    "textbook": ("softmax-shift-gradient", "flash-attention", "attention-ds"),
    "scale_on_q": ("softmax-shift-gradient", "flash-attention", "attention-ds"),
    "exp2_folded": ("softmax-shift-gradient-scaled", "flash-attention", "attention-ds"),
    "no_max": ("softmax-row-unshifted", "flash-attention", "attention-ds"),
    "causal_where": ("masked-softmax-gradient", "flash-attention-causal", "attention-ds-causal"),
    "gqa_expand": ("flash-grad-k-group", "flash-grad-v-group", "attention-ds"),
    "nn_attention": ("softmax-shift-gradient", "flash-attention", "attention-ds"),
}
COMMON_CHAIN = ("quotient-vjp", "sum-swap", "softmax-from-logsumexp", "online-softmax-contract", "flash-grad-q")


@pytest.mark.parametrize("spelling", BACKWARD_SPELLINGS)
def test_flash_attention_backward_is_derived_from_the_gradient_graph(spelling: str) -> None:
    spell, kv_heads, causal = SPELLINGS[spelling]
    gg = ck.grad(attention_graph(spell, kv_heads), wrt=("q", "k", "v"))
    d = ck.derive(gg)
    assert d.found("flash_attention_backward")
    (kernel,) = d.kernels
    assert kernel.kind == "flash_attention_backward" and kernel.outputs == ("d_q", "d_k", "d_v")
    assert_derived_program_matches(gg, d)
    trace = d.trace
    for rule in (*COMMON_CHAIN, *BACKWARD_SPELLINGS[spelling]):
        assert rule in trace, f"{spelling}: {rule} missing from {trace}"
    assert trace.index("quotient-vjp") < trace.index("attention-ds" + ("-causal" if causal else ""))
    plans = d.plans("sm_90")
    assert plans and {p.kind for p in plans} == {"flash_attention_backward"}
    problem = plans[0].problem
    assert problem.roles == ("dq", "dk", "dv") and problem.attention.causal == causal
    assert problem.attention.group_size == 4 // kv_heads
    assert [g.layout.shape for g in problem.gradients] == [gg.inputs["q"].shape, gg.inputs["k"].shape,
                                                             gg.inputs["v"].shape]  # fmt: skip


@pytest.mark.parametrize("wrt", [("q",), ("k", "v"), ("v",), ("q", "v")])
def test_a_subset_of_the_gradients_is_one_kernel_writing_those(wrt: tuple[str, ...]) -> None:
    gg = ck.grad(attention_graph(SPELLINGS["causal_where"][0]), wrt=wrt)
    d = ck.derive(gg)
    (kernel,) = d.kernels
    assert kernel.kind == "flash_attention_backward" and kernel.outputs == tuple(f"d_{n}" for n in wrt)
    assert_derived_program_matches(gg, d)
    assert d.plans("sm_90")[0].problem.roles == tuple(f"d{n}" for n in wrt)


@pytest.mark.parametrize("target", ["sm_80", "sm_90", "sm_90a", "sm_120"])
def test_backward_plans_fit_each_targets_shared_memory(target: str) -> None:
    """At head dim 128 the 128-key double-buffered tiles (115 KB) fit the H100/H200 and A100, not sm_120's 99 KB."""
    g = ck.Graph("attention")
    q, k, v = (g.input(n, (1, 2, 64, 128), "bf16") for n in "qkv")
    g.output(ck.nn.attention(q, k, v), "o")
    plans = ck.derive(ck.grad(g, wrt=("q", "k", "v"))).plans(target)
    budget = TARGETS[target].smem_per_block - SMEM_RESERVED_PER_BLOCK
    assert plans and all(backward_smem_bytes(p.schedule, p.problem) <= budget for p in plans)
    largest = {p.schedule.key() for p in plans} >= {"kv128_q32_s2"}
    assert largest == (target != "sm_120")


def test_a_head_dim_the_backward_does_not_plan_runs_on_the_unfused_kernels() -> None:
    g = ck.Graph("attention")
    q, k, v = (g.input(n, (1, 2, 9 if n != "q" else 5, 40), "bf16") for n in "qkv")  # 40: no whole k16 steps
    g.output(ck.nn.attention(q, k, v), "o")
    gg = ck.grad(g, wrt=("q", "k", "v"))
    d = ck.derive(gg)
    assert d.found("flash_attention_backward") and d.plans("sm_90") == []
    kinds = {k.kind for k in d.kernels_for("sm_90")}
    assert "flash_attention_backward" not in kinds and "contraction" in kinds
    inputs = random_inputs(gg)
    expected = ck.evaluate(gg, inputs)
    buffers = dict(inputs)
    for kernel in d.kernels_for("sm_90"):
        buffers.update(kernel.evaluate_outputs(buffers))
    for name in expected:
        np.testing.assert_allclose(buffers[name], expected[name], rtol=1e-9, atol=1e-12)


def test_a_backward_without_a_plan_leaves_the_other_attentions_backward_flash() -> None:
    """Two attentions' gradients, one at a head dim no backward plans (40: no whole k16 steps):
    that one runs on the unfused kernels, the other's backward stays one flash kernel."""
    g = ck.Graph("two_attentions")
    planned = [g.input(n, (1, 2, 32, 64), "bf16") for n in ("q", "k", "v")]
    unplanned = [g.input(n, (1, 2, 32, 40), "bf16") for n in ("q2", "k2", "v2")]
    g.output(ck.nn.attention(*planned), "o")
    g.output(ck.nn.attention(*unplanned), "o2")
    gg = ck.grad(g, wrt=("q", "k", "v", "q2", "k2", "v2"))
    d = ck.derive(gg)
    assert sum(k.kind == "flash_attention_backward" for k in d.kernels) == 2
    kernels = d.kernels_for("sm_90")
    backward = [k for k in kernels if k.kind == "flash_attention_backward"]
    assert len(backward) == 1 and {"contraction", "softmax_rows"} <= {k.kind for k in kernels}
    assert {p.problem.out for p in d.plans("sm_90")} <= {k.output for k in kernels}
    inputs = random_inputs(gg)
    expected = ck.evaluate(gg, inputs)
    buffers = dict(inputs)
    for kernel in kernels:
        buffers.update(kernel.evaluate_outputs(buffers))
    for name in expected:
        np.testing.assert_allclose(buffers[name], expected[name], rtol=1e-9, atol=1e-12)


def test_a_gradient_graph_keeps_its_mark_through_json() -> None:
    """``ck.grad`` marks its graphs: the derivation looks through their stored intermediates (a
    forward graph's stay stored), and the mark survives serialisation and changes the hash."""
    g = attention_graph(SPELLINGS["textbook"][0])
    gg = ck.grad(g, wrt=("q", "k", "v"))
    back = ck.Graph.from_json(gg.to_json())
    assert gg.is_gradient and back.is_gradient and not g.is_gradient
    assert ck.derive(back).found("flash_attention_backward")
    unmarked = ck.Graph.from_json(gg.to_json())
    unmarked.is_gradient = False
    assert not ck.derive(unmarked).lowered.inlined
    from cherenkov.graph.serialize import canonical_structure

    assert canonical_structure(back) != canonical_structure(unmarked)


@pytest.mark.parametrize("lse_shape", ["rows", "cudnn"])
def test_a_saved_log_sum_exp_pairs_with_its_attention_in_either_sdpa_layout(lse_shape: str) -> None:
    """A gradient graph whose saved inputs hold an attention's output and its log-sum-exp, laid out
    as FlashAttention-2 saves it, ``(B, H, S)``, or as cuDNN does, ``(B, H, S, 1)``: the backward is
    planned reading them (saved statistics) either way."""
    from cherenkov.graph.autodiff import vjp

    b, h, s, d = 1, 2, 128, 64
    g = ck.Graph("saved_backward")
    q, k, v, do = (g.input(name, (b, h, s, d), "bf16") for name in ("q", "k", "v", "do"))
    out = g.input("o", (b, h, s, d), "bf16")
    lse = g.input("lse", (b, h, s) if lse_shape == "rows" else (b, h, s, 1), "fp32")
    gradients = vjp(lambda q, k, v: ck.nn.attention(q, k, v, causal=True), (q, k, v), do)
    g.is_gradient = True
    value, statistics = ck.nn.attention(q, k, v, causal=True, return_lse=True)
    g.mark_saved(out, value)
    g.mark_saved(lse, statistics.reshape(*lse.shape))
    for name, gradient in zip(("dq", "dk", "dv"), gradients):
        g.output(gradient, name)
    d = ck.derive(g)
    plans = [p for p in d.plans("sm_90a") if p.kind == "flash_attention_backward"]
    assert [k.kind for k in d.kernels] == ["flash_attention_backward"]
    assert plans and all(p.problem.saved is not None and p.problem.saved.lse == "lse" for p in plans)


def test_a_bert_layer_under_a_padding_mask_derives_one_flash_backward_reading_the_mask() -> None:
    """transformers' BERT layer captured with its additive 4-D mask (SDPA's safe softmax: a row without a
    live score gives 0): its gradient graph is one flash forward and one flash backward reading the mask
    as a bias tensor (rules ``safe-softmax-gradient`` and ``flash-grad-v-bias-safe`` see through the safe
    softmax's where), the program equal to the gradient graph in float64 under padding keys at −∞ and at
    transformers' min value, and a row wholly at it; in bf16 the backward is planned."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.BertConfig(hidden_size=128, num_attention_heads=4, intermediate_size=256,
                                     hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                                     attn_implementation="sdpa")  # fmt: skip
    layer = transformers.models.bert.modeling_bert.BertLayer(config).eval()
    hidden, mask = torch.randn(2, 64, 128), torch.zeros(2, 1, 64, 64)
    graph = ck.from_torch(layer, hidden, mask)
    gg = ck.grad(graph, wrt=tuple(n for n in graph.inputs if n != "attention_mask"))
    d = ck.derive(gg)
    kinds = [k.kind for k in d.kernels]
    assert kinds.count("flash_attention") == 1 and kinds.count("flash_attention_backward") == 1, kinds
    assert "softmax_rows" not in kinds
    assert {"safe-softmax-gradient", "flash-grad-v-bias-safe", "attention-ds-bias"} <= set(d.trace), d.trace
    padded = np.where(np.arange(64) >= 48, -np.inf, 0.0) * np.ones((2, 1, 64, 64))
    padded[1, ..., 40:] = -3.4e38
    padded[0, :, 5, :] = -3.4e38
    inputs = {**gg.example_inputs(), "attention_mask": padded}
    expected, got = ck.evaluate(gg, inputs), ck.evaluate(d, inputs)
    scale = np.linalg.norm(expected["d_hidden_states"])  # the key bias's gradient is 0: its error is against this
    for output, value in expected.items():
        assert np.linalg.norm(got[output] - value) <= 1e-9 * max(np.linalg.norm(value), scale), output
    bf16 = ck.from_torch(layer.to(torch.bfloat16), hidden.bfloat16(), mask.bfloat16())
    plans = ck.derive(ck.grad(bf16, wrt=tuple(n for n in bf16.inputs if n != "attention_mask"))).plans("sm_90a")
    backward = [p for p in plans if p.kind == "flash_attention_backward"]
    assert backward and all(p.problem.attention.bias is not None and not p.schedule.wgmma for p in backward)


def test_a_product_read_below_a_guards_edge_is_computed_once_over_the_keys_there_are() -> None:
    """The gradient of GPT-OSS's sinks reads the scores under ``where(j < n, ·, sink)`` and ``dO·vᵀ`` under
    ``pad(·, (0, 1))`` along the n + 1 columns: each product is stored over the n keys there are and read
    under its guard, so no kernel reads k or v past its rows, and q·kᵀ is computed once."""
    gg = ck.grad(sink_graph(False), wrt=("q", "k", "v", "sinks"))
    d = ck.derive(gg)
    kernels = d.kernels_for("sm_90a")
    for kernel in kernels:
        for read in (s for s in t.subterms(kernel.term) if s[0] == "Tensor" and s[1] in gg.inputs):
            extents = [t.extent(ix[1]) if ix[0] == "Ax" else 1 for ix in t.ix_items(read[2])]
            assert all(e <= n for e, n in zip(extents, gg.inputs[read[1]].shape)), (kernel.output, t.show(read))
    scores = [k for k in kernels if k.core is not None and k.core[0] == "Contract" and {"q", "k"} == set(k.reads)]
    assert len(scores) == 1, [k.describe()[:200] for k in scores]
    assert_derived_program_matches(gg, d)
