"""Flash attention and the other fused forms are derived from every reasonable spelling,
never from the wrong ones, and every derived program evaluates equal to its graph."""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import pytest

import cherenkov as ck
from cherenkov.rewrites.derive import Derivation
from cherenkov.rewrites.kernels import absorbed, absorptions, bias_buffer_dtype
from cherenkov.rewrites.plan import TARGETS, flash_smem_bytes
from cherenkov.rewrites.plan_sm90a import HopperFlashSchedule, hopper_schedule_problems
from cherenkov.rewrites import terms as t
from tests.codegen.rotary_graphs import rope_projection_graph

B, H, SQ, SKV, D = 2, 4, 5, 9, 64
SCALE = D**-0.5


def attention_graph(spell: Callable, kv_heads: int = H) -> ck.Graph:
    g = ck.Graph("attention")
    q = g.input("q", (B, H, SQ, D), "bf16")
    k = g.input("k", (B, kv_heads, SKV, D), "bf16")
    v = g.input("v", (B, kv_heads, SKV, D), "bf16")
    g.output(spell(q, k, v), "o")
    return g


def normalised(p: ck.Tensor, v: ck.Tensor) -> ck.Tensor:
    return (p / p.sum(axis=-1, keepdim=True)) @ v


def textbook(q, k, v):
    s = (q @ k.transpose(-2, -1)) * SCALE
    return normalised((s - s.max(axis=-1, keepdim=True)).exp(), v)


def scale_on_q(q, k, v):
    s = (q * SCALE) @ k.transpose(-2, -1)
    return normalised((s - s.max(axis=-1, keepdim=True)).exp(), v)


def exp2_folded(q, k, v):
    s = (q @ k.transpose(-2, -1)) * (SCALE * math.log2(math.e))
    return normalised((s - s.max(axis=-1, keepdim=True)).exp2(), v)


def no_max(q, k, v):
    return normalised(((q @ k.transpose(-2, -1)) * SCALE).exp(), v)


def causal_where(q, k, v):
    s = (q @ k.transpose(-2, -1)) * SCALE
    q_idx, k_idx = ck.arange(SQ).unsqueeze(-1), ck.arange(SKV)
    s = ck.where(k_idx <= q_idx, s, -math.inf)
    return normalised((s - s.max(axis=-1, keepdim=True)).exp(), v)


def causal_additive(q, k, v):
    s = (q @ k.transpose(-2, -1)) * SCALE
    q_idx, k_idx = ck.arange(SQ).unsqueeze(-1), ck.arange(SKV)
    s = s + ck.where(q_idx < k_idx, -math.inf, 0.0)
    return normalised((s - s.max(axis=-1, keepdim=True)).exp(), v)


def causal_finite(q, k, v):
    """The additive mask PyTorch's cuDNN attention path makes of a bool one: −2¹⁶, not −∞."""
    s = (q @ k.transpose(-2, -1)) * SCALE
    q_idx, k_idx = ck.arange(SQ).unsqueeze(-1), ck.arange(SKV)
    s = s + ck.where(q_idx < k_idx, -65536.0, 0.0)
    return normalised((s - s.max(axis=-1, keepdim=True)).exp(), v)


def gqa_expand(q, k, v):
    groups = q.shape[1] // k.shape[1]
    k, v = (x.unsqueeze(2).expand(B, H // groups, groups, SKV, D).reshape(B, H, SKV, D) for x in (k, v))
    return textbook(q, k, v)


def nn_attention(q, k, v):
    return ck.nn.attention(q, k, v)


def times_reciprocal(q, k, v):
    s = (q @ k.transpose(-2, -1)) * SCALE
    p = (s - s.max(axis=-1, keepdim=True)).exp()
    return (p * (1 / p.sum(axis=-1, keepdim=True))) @ v


def log_sum_exp(q, k, v):
    """``exp(s − logsumexp(s))``: the softmax a forward that saves its log-sum-exp writes."""
    s = (q @ k.transpose(-2, -1)) * SCALE
    m = s.max(axis=-1, keepdim=True)
    return (s - (m + (s - m).exp().sum(axis=-1, keepdim=True).log())).exp() @ v


def shifted_twice(q, k, v):
    """Scores shifted by their row's max before a softmax that shifts them again (GPT-OSS's)."""
    s = (q @ k.transpose(-2, -1)) * SCALE
    return ck.nn.softmax(s - s.max(axis=-1, keepdim=True), axis=-1) @ v


SPELLINGS = {
    "textbook": (textbook, H, False),
    "scale_on_q": (scale_on_q, H, False),
    "exp2_folded": (exp2_folded, H, False),
    "no_max": (no_max, H, False),
    "causal_where": (causal_where, H, True),
    "causal_additive": (causal_additive, H, True),
    "causal_finite": (causal_finite, H, True),
    "gqa_expand": (gqa_expand, H // 2, False),
    "nn_attention": (nn_attention, H, False),
    "times_reciprocal": (times_reciprocal, H, False),
    "log_sum_exp": (log_sum_exp, H, False),
    "shifted_twice": (shifted_twice, H, False),
}


def random_inputs(g: ck.Graph, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {name: rng.standard_normal(t.shape) for name, t in g.inputs.items()}


def assert_derived_program_matches(g: ck.Graph, d: Derivation) -> None:
    inputs = random_inputs(g)
    expected, got = ck.evaluate(g, inputs), ck.evaluate(d, inputs)
    for name in expected:
        error = np.linalg.norm(got[name] - expected[name]) / np.linalg.norm(expected[name])
        assert error <= 1e-9, f"{name}: derived program differs by {error:.2e}"


@pytest.mark.parametrize("spelling", SPELLINGS)
def test_flash_attention_is_found_in_every_spelling(spelling: str) -> None:
    spell, kv_heads, causal = SPELLINGS[spelling]
    g = attention_graph(spell, kv_heads)
    d = ck.derive(g)
    assert d.found("flash_attention")
    assert [k.kind for k in d.kernels] == ["flash_attention"]
    assert_derived_program_matches(g, d)
    trace = d.trace
    final = "flash-attention-causal" if causal else "flash-attention"
    assert trace[-1] == final
    for before in ("contraction", "online-softmax-contract"):
        assert trace.index(before) < trace.index(final)
    plans = d.plans("sm_90")
    assert plans and all(p.problem.causal == causal and p.problem.group_size == H // kv_heads for p in plans)


def sink_graph(causal: bool, kv_heads: int = H, offset: int = 0, key_offset: int = 0, seq_q: int = SQ) -> ck.Graph:
    """GPT-OSS's attention sinks as transformers spells them: a learned logit a head concatenated to
    the (masked) scores of ``seq_q`` queries, the row shifted by its max, softmaxed, and the sink's column dropped."""
    g = ck.Graph("sinks")
    q = g.input("q", (B, H, seq_q, D), "bf16")
    k, v = g.input("k", (B, kv_heads, SKV, D), "bf16"), g.input("v", (B, kv_heads, SKV, D), "bf16")
    sinks = g.input("sinks", (H,), "bf16")
    k, v = ck.nn.repeat_kv_heads(k, H // kv_heads), ck.nn.repeat_kv_heads(v, H // kv_heads)
    s = (q @ k.transpose(-2, -1)) * SCALE
    if causal:  # transformers' additive causal mask, bf16's lowest for the masked scores
        q_idx = ck.arange(seq_q).unsqueeze(-1) + offset  # + 0: rule add-zero
        k_idx = ck.arange(SKV) + key_offset if key_offset else ck.arange(SKV)
        s = s + ck.where(q_idx < k_idx, -3.3895313892515355e38, 0.0)
    column = sinks.reshape(1, H, 1, 1).expand(B, H, seq_q, 1)
    c = ck.cat([s, column], axis=-1)
    p = ck.nn.softmax(c - c.max(axis=-1, keepdim=True), axis=-1)
    g.output(p[..., :SKV] @ v, "o")
    return g


@pytest.mark.parametrize(("causal", "kv_heads"), [(False, H), (True, H // 2)])
def test_attention_sinks_are_flash_attention_times_a_sigmoid_of_its_log_sum_exp(causal: bool, kv_heads: int) -> None:
    g = sink_graph(causal, kv_heads)
    d = ck.derive(g)
    kernels = d.kernels
    assert [k.kind for k in kernels] == ["flash_attention", "elementwise"]
    flash, factor = kernels
    assert [side.term[0] for side in flash.side_outputs] == ["AttentionLse"]  # the kernel's own statistic
    assert {flash.output, flash.side_outputs[0].output, "sinks"} == set(factor.reads)
    assert d.tensor_types()[1][flash.side_outputs[0].output] == "fp32"  # as the flash kernels write it
    for rule in ("appended-column", "sum-over-appended-column", "sum-before-appended-column", "sink-normaliser",
                 "online-softmax-shift", "logsumexp-shift"):
        assert rule in d.trace
    assert_derived_program_matches(g, d)
    for target in ("sm_80", "sm_90a", "sm_120"):
        problems = {p.problem for p in d.plans(target)}
        assert problems and all(p.lse is not None and p.causal == causal and p.bias is None for p in problems)


def test_sinks_of_one_decoded_token_are_flash_attention() -> None:
    """GPT-OSS decoding: one query row, so q and the rows' log-sum-exp have no query axis. The flash kernel writes
    that statistic at row stride 0 (its layout was refused, and the attention ran unfused)."""
    g = sink_graph(False, H // 2, seq_q=1)
    d = ck.derive(g)
    assert [k.kind for k in d.kernels] == ["flash_attention", "elementwise"]
    assert_derived_program_matches(g, d)
    problems = {p.problem for p in d.plans("sm_90a")}
    assert problems and all(p.seq_q == 1 and p.lse is not None and p.lse.layout.seq == 0 for p in problems)


def test_a_softmax_row_read_without_its_appended_column_is_stored_whole() -> None:
    """Sinks under a mask no flash kernel takes (keys 3 ahead of the query, spelled on the key's side,
    ``i < j − 3``): the softmax row of ``n + 1`` entries is a buffer of its own extent, which the product with
    v reads ``n`` of."""
    g = sink_graph(True, key_offset=-3)
    d = ck.derive(g)
    rows = [k for k in d.kernels if k.kind == "softmax_rows"]
    assert len(rows) == 1 and rows[0].stored_shape[-1] == SKV + 1
    assert_derived_program_matches(g, d)


@pytest.mark.parametrize("offset", [3, -3])
def test_sinks_under_keys_ahead_of_the_query_are_flash_attention(offset: int) -> None:
    """Sinks under ``i + o < j`` masked: 3 keys ahead, the kernel's own window over every key; 3 behind (the first
    rows see no key, only their sink), a stored bias the flash kernel reads (its rows' factor σ(LSE − sink)
    is 0 where every key is masked)."""
    g = sink_graph(True, offset=offset)
    d = ck.derive(g)
    assert [k.kind for k in d.kernels if k.kind != "elementwise"] == ["flash_attention"]
    problems = {p.problem for p in d.plans("sm_90a")}
    assert {(p.window, p.window_ahead, p.bias is None) for p in problems} == (
        {(SQ + SKV, 3, True)} if offset > 0 else {(0, 0, False)})
    assert_derived_program_matches(g, d)


def test_elementwise_work_after_flash_attention_is_a_kernel_of_its_own() -> None:
    """The flash kernels write their output as it is: a scale and a shift after one run in an
    elementwise kernel reading it, not dropped from a flash kernel's term."""
    g = attention_graph(lambda q, k, v: ck.nn.attention(q, k, v) * 2.0 + 1.0)
    d = ck.derive(g)
    flash, after = d.kernels
    assert (flash.kind, after.kind) == ("flash_attention", "elementwise")
    assert flash.term == flash.core and after.reads == (flash.output,)
    assert d.plans("sm_90")
    assert_derived_program_matches(g, d)


def test_attentions_concatenated_along_the_value_dim_read_their_operands_in_place() -> None:
    """One softmax read by two products whose outputs are concatenated along the value dim (DiffLlama's
    eager attention once Dynamo shares its two softmaxes): two flash kernels reading q, k and each v in
    place. The concatenation's axis, 2·D wide, can name a flash form's head dim (it binds D entries)
    and its value dim (read under the pad's guard, D entries): neither operand is copied 2·D wide,
    which would read past each row of q, k and v."""
    g = ck.Graph("concatenated")
    q, k = g.input("q", (B, H, SQ, D), "bf16"), g.input("k", (B, H, SKV, D), "bf16")
    v1, v2 = g.input("v1", (B, H, SKV, D), "bf16"), g.input("v2", (B, H, SKV, D), "bf16")
    p = ck.nn.softmax((q @ k.transpose(-2, -1)) * SCALE, axis=-1)
    g.output(ck.cat([p @ v1, p @ v2], axis=-1), "o")
    d = ck.derive(g)
    kernels = d.kernels_for("sm_90a")
    assert [k.kind for k in kernels] == ["flash_attention", "flash_attention", "elementwise"]
    shapes, _ = d.tensor_types(kernels)
    for flash in kernels[:2]:
        assert set(flash.reads) <= {"q", "k", "v1", "v2"} and shapes[flash.output] == (B, H, SQ, D)
    assert {p.problem.v for p in d.plans("sm_90a")} == {"v1", "v2"}
    assert_derived_program_matches(g, d)


def mask_graph(mask_heads: int, kv_heads: int = H, seq_q: int = SQ) -> ck.Graph:
    """Attention with a bias ``(B, mask_heads, Sq, Skv)`` as SDPA's capture spells an additive
    mask: ``softmax(s + mask)`` in PyTorch's safe softmax ``where(max s > −∞, ·, 0)``."""
    g = ck.Graph("masked")
    q = g.input("q", (B, H, seq_q, D), "bf16")
    k, v = g.input("k", (B, kv_heads, SKV, D), "bf16"), g.input("v", (B, kv_heads, SKV, D), "bf16")
    mask = g.input("mask", (B, mask_heads, seq_q, SKV), "bf16")
    if kv_heads != H:
        k, v = ck.nn.repeat_kv_heads(k, H // kv_heads), ck.nn.repeat_kv_heads(v, H // kv_heads)
    s = (q @ k.transpose(-2, -1)) * SCALE
    s = s + mask
    p = ck.where(s.max(axis=-1, keepdim=True) > -math.inf, ck.nn.softmax(s, axis=-1), 0.0)
    g.output(p @ v, "o")
    return g


@pytest.mark.parametrize(("mask_heads", "kv_heads", "seq_q"), [
    (1, H, SQ),  # a mask shared by the heads (transformers' causal + padding mask)
    (H, H // 2, SQ),  # per head, GQA
    (1, H // 2, 1),  # decoding: one query over a static cache's mask row
])  # fmt: skip
def test_flash_attention_with_a_bias_tensor_reads_it_in_place(mask_heads: int, kv_heads: int, seq_q: int) -> None:
    g = mask_graph(mask_heads, kv_heads, seq_q)
    d = ck.derive(g)
    assert [k.kind for k in d.kernels] == ["flash_attention"]  # the safe softmax's where is the form
    assert_derived_program_matches(g, d)
    assert {"flash-attention-bias", "sum-where-invariant", "where-zero-factor"} <= set(d.trace), d.trace
    plans = d.plans("sm_90")
    assert plans and {p.problem.bias for p in plans} == {plans[0].problem.bias}
    bias = plans[0].problem.bias
    assert (bias.tensor, bias.dtype, bias.shape) == ("mask", "bf16", (B, mask_heads, seq_q, SKV))
    assert (bias.batch, bias.head, bias.row, bias.key) == (
        mask_heads * seq_q * SKV, seq_q * SKV if mask_heads > 1 else 0, SKV if seq_q > 1 else 0, 1)
    assert not plans[0].problem.causal and plans[0].problem.group_size == H // kv_heads
    assert any(isinstance(p.schedule, HopperFlashSchedule) for p in d.plans("sm_90a"))


@pytest.mark.parametrize("offset", [0, 4])
def test_a_causal_mask_filled_into_a_bias_is_the_causal_edge_beside_the_bias(offset: int) -> None:
    """``s + where(i + o < j, m, b)`` (Doge's dynamic mask, bf16's lowest filled in causally): the edge is the
    kernel's (causal, or its window aligned to the last key), the bias ``b`` read in place."""
    g = ck.Graph("fill_bias")
    q = g.input("q", (B, H, SQ, D), "bf16")
    k, v = g.input("k", (B, H, SKV, D), "bf16"), g.input("v", (B, H, SKV, D), "bf16")
    bias = g.input("bias", (B, H, 1, SKV), "bf16")
    ahead = ck.where(ck.arange(SQ).unsqueeze(-1) + offset < ck.arange(SKV), -3.3895313892515355e38, bias)
    g.output(ck.nn.softmax((q @ k.transpose(-2, -1)) * SCALE + ahead, axis=-1) @ v, "o")
    d = ck.derive(g)
    assert [k.kind for k in d.kernels_for("sm_90a")] == ["flash_attention"]
    assert any(rule.startswith("softmax-finite-") and rule.endswith("-fill-bias") for rule in d.trace), d.trace
    problem = d.plans("sm_90a")[0].problem
    assert problem.bias.tensor == "bias" and (problem.causal or problem.window_ahead == offset), problem
    assert_derived_program_matches(g, d)


def test_scores_times_a_band_plus_a_fill_where_it_is_0_are_causal_flash_attention() -> None:
    """GPT-1's mask, ``w·b − 10⁴·(1 − b)`` for its causal buffer's 0/1 band ``b``, as the capture hands it (the
    buffer folded: ``w·where(i < j, 0, 1) + where(i < j, −10⁴, 0)``): rule ``product-with-band`` and the where
    rules make it ``where(i < j, −10⁴, w)``, a causal fill below the mask floor −2¹³."""
    g = ck.Graph("band_product")
    q = g.input("q", (B, H, SQ, D), "bf16")
    k, v = g.input("k", (B, H, SKV, D), "bf16"), g.input("v", (B, H, SKV, D), "bf16")
    above = ck.arange(SQ).unsqueeze(-1) < ck.arange(SKV)
    w = (q @ k.transpose(-2, -1)) * SCALE
    g.output(ck.nn.softmax(w * ck.where(above, 0.0, 1.0) + ck.where(above, -1e4, 0.0), axis=-1) @ v, "o")
    d = ck.derive(g)
    assert [k.kind for k in d.kernels_for("sm_90a")] == ["flash_attention"]
    assert "product-with-band" in d.trace, d.trace
    assert all(p.problem.causal and p.problem.bias is None for p in d.plans("sm_90a"))
    assert_derived_program_matches(g, d)


def test_a_bias_stored_per_kv_head_is_copied_per_query_head_for_flash_attention() -> None:
    """A bias the query heads read at their K/V head ``h // G`` (Doge's dynamic mask, repeated like K and V): the
    kernels step a bias by the query head, so an elementwise kernel stores it per query head and the flash kernel
    reads that copy in place."""
    g = ck.Graph("kv_head_bias")
    q = g.input("q", (B, H, SQ, D), "bf16")
    k, v = g.input("k", (B, H // 2, SKV, D), "bf16"), g.input("v", (B, H // 2, SKV, D), "bf16")
    mask = g.input("mask", (B, H // 2, SQ, SKV), "bf16")
    k, v, mask = (ck.nn.repeat_kv_heads(x, 2) for x in (k, v, mask))
    g.output(ck.nn.softmax((q @ k.transpose(-2, -1)) * SCALE + mask, axis=-1) @ v, "o")
    d = ck.derive(g)
    copy, flash = d.kernels_for("sm_90a")
    assert (copy.kind, flash.kind, copy.reads) == ("elementwise", "flash_attention", ("mask",))
    bias = d.plans("sm_90")[0].problem.bias
    assert (bias.tensor, bias.shape, bias.head) == (copy.output, (B, H, SQ, SKV), SQ * SKV)
    assert_derived_program_matches(g, d)


def test_cosine_attention_is_flash_attention_over_normalised_operands() -> None:
    """Swin V2's cosine attention: q and k divided by their norms (``F.normalize``), the scores times a learned
    scale a head (exp of a clamped logit) plus a bias. The factors the product leaves outside its sum (the key's
    norm, the head's scale) move into k's operand, so flash attention reads a normalised q and a normalised, scaled
    k (each stored by the kernel that computes its norm) with the bias."""
    g = ck.Graph("cosine")
    q, k, v = (g.input(n, (B, H, SQ if n == "q" else SKV, D), "bf16") for n in "qkv")
    logit, table = g.input("logit_scale", (H, 1, 1), "bf16"), g.input("table", (H, SQ, SKV), "bf16")

    def normalised(x: ck.Tensor) -> ck.Tensor:
        return x / (x * x).sum(axis=-1, keepdim=True).sqrt().maximum(1e-12)

    scale = logit.minimum(math.log(100.0)).exp()
    s = (normalised(q) @ normalised(k).transpose(-2, -1)) * scale + ck.nn.sigmoid(table) * 16.0
    g.output(ck.nn.softmax(s, axis=-1) @ v, "o")
    d = ck.derive(g)
    assert [k.kind for k in d.kernels_for("sm_90a")] == ["contraction", "contraction", "elementwise", "flash_attention"]
    assert d.found("flash_attention") and "contract-factor-into-right" in d.trace
    assert d.plans("sm_90a") and d.plans("sm_80")
    assert_derived_program_matches(g, d)


def test_attention_over_windows_reads_its_two_batch_axes_as_one() -> None:
    """timm's Twins, NesT and Hiera attend over ``(B, windows, heads, N, d)``, q, k and v unbound from one
    projection: the batch and window axes, which every tensor steps as one (the batch's stride the window's
    times the windows), are the problem's batch; an operand that does not step them as one is stored in the
    kernels' order first."""
    windows, n, heads, dim = 3, 16, 2, 32
    g = ck.Graph("windows")
    x = g.input("x", (B, windows, n, 3 * heads * dim), "bf16")
    q, k, v = (x.reshape((B, windows, n, 3, heads, dim)).permute((3, 0, 1, 4, 2, 5))[i] for i in range(3))
    g.output(ck.nn.softmax((q @ k.transpose(-2, -1)) * dim**-0.5, axis=-1) @ v, "o")
    d = ck.derive(g)
    assert [k.kind for k in d.kernels_for("sm_90a")] == ["flash_attention"]
    for target in ("sm_90a", "sm_80"):
        problem = d.plans(target)[0].problem
        assert (problem.batch, problem.heads, problem.seq_q) == (B * windows, heads, n)
        q_layout = problem.layout("q")
        assert (q_layout.batch, q_layout.head, q_layout.seq) == (n * 3 * heads * dim, dim, 3 * heads * dim)
    assert_derived_program_matches(g, d)

    # Hiera's mask units: each token's unit u inside its position n (token n·U + u), so no tensor steps (b, u) as
    # one; q, k and v are stored in the kernels' order first
    g = ck.Graph("mask_units")
    x = g.input("x", (B, n * windows, 3 * heads * dim), "bf16")
    q, k, v = (x.reshape((B, n, windows, 3, heads, dim)).permute((3, 0, 2, 4, 1, 5))[i] for i in range(3))
    g.output(ck.nn.softmax((q @ k.transpose(-2, -1)) * dim**-0.5, axis=-1) @ v, "o")
    d = ck.derive(g)
    kinds = [k.kind for k in d.kernels_for("sm_90a")]
    assert kinds.count("flash_attention") == 1 and kinds.count("elementwise") == 3, kinds
    assert d.plans("sm_90a")[0].problem.batch == B * windows
    assert_derived_program_matches(g, d)

    # the windows outermost in storage, the batch read inside them: the output's (b, w) order is not the input's,
    # so the input is copied in that order and read as one batch axis with the output
    g = ck.Graph("windows_outer")
    x = g.input("x", (windows, B, heads, n, dim), "bf16")
    q = x.permute((1, 0, 2, 3, 4))
    g.output(ck.nn.softmax((q @ q.transpose(-2, -1)) * dim**-0.5, axis=-1) @ q, "o")
    d = ck.derive(g)
    assert [k.kind for k in d.kernels_for("sm_90a")] == ["elementwise", "flash_attention"]
    assert d.plans("sm_90a")[0].problem.batch == B * windows
    assert_derived_program_matches(g, d)


def alibi_graph(causal: bool) -> ck.Graph:
    """ALiBi attention as MPT and Bloom spell it with 4-D tensors: each head's slope times each key's
    position added to the scores (computed, not a stored tensor), then (``causal``) the causal mask
    as a large finite negative."""
    g = ck.Graph("alibi")
    q, k, v = (g.input(n, (B, H, SQ if n == "q" else SKV, D), "bf16") for n in "qkv")
    slopes, positions = g.input("slopes", (H,), "fp32"), g.input("positions", (B, SKV), "fp32")
    alibi = slopes.reshape((1, H, 1, 1)) * positions.reshape((B, 1, 1, SKV))
    s = (q @ k.transpose(-2, -1)) * SCALE + alibi.broadcast_to((B, H, SQ, SKV))
    if causal:
        rows = g.arange(SQ).reshape((SQ, 1)).broadcast_to((SQ, SKV))
        keys = g.arange(SKV).reshape((1, SKV)).broadcast_to((SQ, SKV))
        s = s + ck.where(rows < keys, -3.0e38, 0.0).broadcast_to((B, H, SQ, SKV))
    g.output(ck.nn.softmax(s, axis=-1) @ v, "o")
    return g


@pytest.mark.parametrize("causal", [False, True])
def test_a_computed_bias_is_stored_by_an_elementwise_kernel_and_read_by_flash_attention(causal: bool) -> None:
    g = alibi_graph(causal)
    d = ck.derive(g)
    assert [k.kind for k in d.kernels] == ["elementwise", "flash_attention"], [k.describe() for k in d.kernels]
    assert_derived_program_matches(g, d)
    assert ("flash-attention-causal-bias-product" if causal else "flash-attention-bias-product") in d.trace, d.trace
    for target in ("sm_80", "sm_90a", "sm_120"):
        plans = d.plans(target)
        assert plans, target
        problem = plans[0].problem
        assert problem.causal is causal and problem.bias is not None
        assert (problem.bias.dtype, problem.bias.shape) == ("fp32", (B, H, SKV)), problem.bias
        assert (problem.bias.row, problem.bias.key) == (0, 1), "one bias row a head, broadcast over the queries"
    shapes, dtypes = d.tensor_types()
    assert dtypes[d.kernels[0].output] == "fp32", "the computed bias keeps its precision"


WINDOW_MASKS = {
    # name: (the mask transformers builds for a sliding window, from torch and the window's bool band; whether
    # the query's later keys are hidden)
    "additive_inf": (lambda torch, band: torch.where(band, 0.0, -math.inf), True),
    "additive_finite": (lambda torch, band: torch.where(band, 0.0, torch.finfo(torch.bfloat16).min), True),  # eager's
    "sdpa_bool": (lambda torch, band: band, True),
    "symmetric": (lambda torch, band: torch.where(band | band.transpose(-2, -1), 0.0, -math.inf), False),  # ModernBERT's
}


@pytest.mark.parametrize("mask", WINDOW_MASKS)
def test_a_sliding_window_is_the_kernels_own(mask: str) -> None:
    """A sliding window's mask buffer (keys ``i − 3 < j <= i``; ``symmetric``: ``|i − j| < 3``), spelled
    as transformers does for eager attention (−∞ or bf16's lowest) and for SDPA (a bool mask), is
    captured as a band and derives one flash kernel, equal to the graph in float64. A causal window is
    the problem's ``window``: the kernel skips the tiles past the diagonal and below the window and
    reads no bias; a symmetric one's (no causal mask) keys ahead of the query bound it too."""
    torch = pytest.importorskip("torch")
    spell, causal = WINDOW_MASKS[mask]
    ones = torch.ones(SQ, SQ, dtype=torch.bool)
    band = spell(torch, ones.tril(0) & ~ones.tril(-3))
    band = band if band.dtype == torch.bool else band.to(torch.bfloat16)

    class Windowed(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("mask", band.view(1, 1, SQ, SQ))

        def forward(self, q, k, v):
            if self.mask.dtype == torch.bool:
                return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=self.mask)
            s = q @ k.transpose(-2, -1) * SCALE + self.mask
            return torch.softmax(s, dim=-1) @ v

    q, k, v = (torch.randn(B, H, SQ, D, dtype=torch.bfloat16) for _ in "qkv")
    g = ck.from_torch(Windowed(), q, k, v)
    assert "mask" not in g.inputs, "a band, not an input"
    d = ck.derive(g)
    assert [k.kind for k in d.kernels] == ["flash_attention"], [k.describe() for k in d.kernels]
    assert_derived_program_matches(g, d)
    for target in ("sm_80", "sm_90a", "sm_120"):
        problem = d.plans(target)[0].problem
        window = (problem.causal, problem.window, problem.window_ahead, problem.bias)
        assert window == ((True, 3, 0, None) if causal else (False, 3, 2, None)), (target, problem)


def test_only_a_bias_that_computes_is_stored_in_fp32() -> None:
    """ALiBi's product needs fp32; a table gathered through a computed index, or a rounding of stored
    values, is exact in the buffer dtype (a relative-position bias read per score: half the bytes)."""
    table = t.access("table", (t.ix_mod(t.ax("j:8"), 4), t.ax("i:8")))
    assert bias_buffer_dtype(("Mul", t.tensor("slope", "h:4"), ("Iota", t.ax("j:8")))) == "fp32"
    assert bias_buffer_dtype(table) == "" and bias_buffer_dtype(("Cast", "bf16", table)) == ""


def test_the_safe_softmax_alone_is_the_flash_form() -> None:
    """Without a mask tensor, ``where(max s > −∞, softmax(s), 0) @ v`` is plain flash attention."""
    g = ck.Graph("safe")
    q, k, v = (g.input(n, (B, H, SQ if n == "q" else SKV, D), "bf16") for n in "qkv")
    s = (q @ k.transpose(-2, -1)) * SCALE
    g.output(ck.where(s.max(axis=-1, keepdim=True) > -math.inf, ck.nn.softmax(s, axis=-1), 0.0) @ v, "o")
    d = ck.derive(g)
    assert [k.kind for k in d.kernels] == ["flash_attention"] and d.plans("sm_90")[0].problem.bias is None
    assert_derived_program_matches(g, d)


def test_an_fp32_key_stored_transposed_is_rounded_into_a_copy_with_its_head_dim_last() -> None:
    """CUDA's math SDPA (a 16-bit training step) scales q and kᵀ in fp32 and saves both for its
    backward: the region stores kᵀ as ``(B, H, D, S)``. The flash kernel reads a 16-bit copy of it
    (rule ``contract-rounded-operand``), stored with the head dim last as every flash plan reads k;
    a copy in kᵀ's own layout had left the kernel without a plan, and the region unfused."""
    g = ck.Graph("math_sdpa")
    q, k, v = (g.input(n, (B, H, SQ if n == "q" else SKV, D), "bf16") for n in "qkv")
    root = math.sqrt(SCALE)
    q32, kt32 = q.cast("fp32") * root, k.cast("fp32").transpose(-2, -1) * root
    s = q32 @ kt32
    p = ck.where(s.max(axis=-1, keepdim=True) > -math.inf, ck.nn.softmax(s, axis=-1), 0.0)
    g.output((p @ v.cast("fp32")).cast("bf16"), "o")
    g.output(q32, "q_scaled")
    g.output(kt32, "kt_scaled")
    d = ck.derive(g)
    assert "flash_attention" in [kernel.kind for kernel in d.kernels]
    plans = d.plans("sm_90a")
    assert plans and not hopper_schedule_problems(HopperFlashSchedule(), plans[0].problem)
    inputs = random_inputs(g)
    expected, got = ck.evaluate(g, inputs), ck.evaluate(d, inputs)
    for name in g.outputs:  # the scale √s, an fp32 constant in the graph, a float64 literal in the forms
        np.testing.assert_allclose(got[name], expected[name], rtol=1e-6, atol=1e-9)


def test_constants_a_graph_also_outputs_are_read_as_literals() -> None:
    """A region that hands its constants to later ops (transformers' decode step: the safe
    softmax's −∞ and 0 are outputs too) still derives flash attention: a stored constant is
    read as its literal, where the identities can see it."""
    g = ck.Graph("decode_region")
    q = g.input("q", (B, H, 1, D), "bf16")
    k, v = g.input("k", (B, H, SKV, D), "bf16"), g.input("v", (B, H, SKV, D), "bf16")
    mask = g.input("mask", (B, 1, 1, SKV), "bf16")
    neg_inf, zero = g.constant(-math.inf, "bf16"), g.constant(0.0, "bf16")
    s = (q @ k.transpose(-2, -1)) * SCALE + mask
    g.output(ck.where(s.max(axis=-1, keepdim=True) > neg_inf, ck.nn.softmax(s, axis=-1), zero) @ v, "o")
    g.output(neg_inf, "lowest")
    g.output(zero, "zero")
    d = ck.derive(g)
    assert sorted(k.kind for k in d.kernels) == ["elementwise", "elementwise", "flash_attention"]
    assert d.plans("sm_90")[0].problem.bias.tensor == "mask"
    inputs = random_inputs(g)
    expected, got = ck.evaluate(g, inputs), ck.evaluate(d, inputs)
    assert got["lowest"] == -math.inf and got["zero"] == 0.0
    np.testing.assert_allclose(got["o"], expected["o"], rtol=1e-9, atol=1e-12)


def test_a_mask_that_varies_along_another_axis_is_no_flash_mask() -> None:
    """A mask read along the head dimension is no score mask: no flash plan reads it."""
    g = ck.Graph("odd")
    q, k, v = (g.input(n, (B, H, SQ if n == "q" else SKV, D), "bf16") for n in "qkv")
    m = g.input("m", (B, 1, SQ, D), "bf16")
    s = ((q + m) @ k.transpose(-2, -1)) * SCALE
    g.output(ck.nn.softmax(s, axis=-1) @ v, "o")
    d = ck.derive(g)
    assert all(p.problem.bias is None for p in d.plans("sm_90"))
    assert_derived_program_matches(g, d)


def wrong_axis(q, k, v):
    s = (q @ k.transpose(-2, -1)) * SCALE
    p = (s - s.max(axis=-2, keepdim=True)).exp()
    return (p / p.sum(axis=-2, keepdim=True)) @ v


def max_over_other_axis(q, k, v):
    s = (q @ k.transpose(-2, -1)) * SCALE
    return normalised((s - s.max(axis=-2, keepdim=True)).exp(), v)


def softmax_without_v(q, k, v):
    return ck.nn.softmax((q @ k.transpose(-2, -1)) * SCALE)


def unnormalised(q, k, v):
    return ((q @ k.transpose(-2, -1)) * SCALE).exp() @ v


@pytest.mark.parametrize("spell", [wrong_axis, max_over_other_axis, softmax_without_v, unnormalised])
def test_no_flash_attention_from_wrong_spellings(spell: Callable) -> None:
    g = attention_graph(spell)
    d = ck.derive(g)
    assert not d.found("flash_attention")
    assert "flash_attention" not in {k.kind for k in d.kernels}
    # a softmax over the queries contracted over the keys is no attention; it is dv's streaming
    # product Pᵀ·dO with the roles of q and k swapped, which the backward family may plan
    assert [p for p in d.plans("sm_90") if p.kind == "flash_attention"] == []
    assert_derived_program_matches(g, d)


def test_the_trace_ablation_saturates_only_the_root_holding_the_form(monkeypatch) -> None:
    """Each ablation trial re-derives the one root whose extraction holds the fused form, not
    the whole graph (a model's layers are one graph): two attention layers give the trace
    one layer gives, from trials over one root each."""
    from cherenkov.rewrites import derive as derive_module

    g = ck.Graph("two_layers")
    for layer in ("a", "b"):
        q, k, v = (g.input(f"{x}_{layer}", (B, H, SQ if x == "q" else SKV, D), "bf16") for x in "qkv")
        g.output(textbook(q, k, v), f"o_{layer}")
    derivation = ck.derive(g)
    monkeypatch.setattr(derive_module, "ABLATIONS", {})  # ablated here, not read from an earlier test's
    trials = []
    saturate = derive_module.saturate

    def recording(lowered, *args, **kwargs):
        trials.append(set(lowered.roots))
        return saturate(lowered, *args, **kwargs)

    monkeypatch.setattr(derive_module, "saturate", recording)
    assert derivation.trace == ck.derive(attention_graph(textbook)).trace
    assert trials and all(len(roots) == 1 for roots in trials), trials


def test_a_graph_derived_again_is_not_ablated_again(monkeypatch) -> None:
    """The trace ablation runs once a process for one root, rules and fired passes: a second
    derivation of the same graph saturates once (its own e-graph) and reads the first one's trace."""
    from cherenkov.rewrites import derive as derive_module

    monkeypatch.setattr(derive_module, "ABLATIONS", {})
    first = ck.derive(attention_graph(textbook)).trace
    saturations = []
    saturate = derive_module.saturate

    def recording(*args, **kwargs):
        saturations.append(kwargs.get("until"))
        return saturate(*args, **kwargs)

    monkeypatch.setattr(derive_module, "saturate", recording)
    assert ck.derive(attention_graph(textbook)).trace == first and first
    assert saturations == [None], "no trial: the derivation's own saturation only"


def test_a_saturation_until_a_form_stops_in_the_pass_the_form_arises() -> None:
    """The ablation's trials stop once the form arises: in that pass, not before, not after."""
    from cherenkov.rewrites.derive import MAX_ENODES, saturate

    d = ck.derive(attention_graph(textbook))
    stopped = saturate(d.lowered, d.rulesets, d.stats.iterations, MAX_ENODES, "t", until="FlashAttention")
    assert stopped.forms_of("FlashAttention") and stopped.stats.iterations < d.stats.iterations
    earlier = saturate(d.lowered, d.rulesets, stopped.stats.iterations - 1, MAX_ENODES, "t")
    assert not earlier.forms_of("FlashAttention")


def test_softmax_rows_are_one_fused_kernel() -> None:
    g = ck.Graph("softmax")
    g.output(ck.nn.softmax(g.input("x", (6, 50))), "y")
    d = ck.derive(g)
    assert d.found("softmax_row") and [k.kind for k in d.kernels] == ["softmax_rows"]
    assert_derived_program_matches(g, d)


def test_rms_norm_then_matmul_applies_the_weight_in_the_norm_kernel() -> None:
    g = ck.Graph("rms")
    x, w, m = g.input("x", (6, 32)), g.input("w", (32,)), g.input("m", (32, 16))
    g.output(ck.nn.rms_norm(x, w) @ m, "y")
    d = ck.derive(g)
    assert d.found("rms_norm_row")
    assert [k.kind for k in d.kernels] == ["rms_norm_rows", "contraction"]
    norm, matmul = d.kernels
    assert set(norm.reads) == {"x", "w"} and set(matmul.reads) == {norm.output, "m"}, "the weight: norm epilogue"
    assert_derived_program_matches(g, d)


@pytest.mark.parametrize("weight", [True, False])
def test_a_matmul_can_absorb_the_rms_norm_feeding_it(weight: bool) -> None:
    """Σ_k RmsNormRow_k(x)·w_k·m = (Σ_k x²/n + ε)^{-1/2} · Σ_k x·w_k·m, numerically: the absorbed
    kernel reads x, w and m and equals the norm kernel followed by the matmul."""
    g = ck.Graph("rms")
    x, w, m = g.input("x", (6, 32)), g.input("w", (32,)), g.input("m", (32, 16))
    g.output(ck.nn.rms_norm(x, w if weight else None) @ m, "y")
    d = ck.derive(g)
    norm, matmul = d.kernels
    ((consumer, (producer, fused)),) = absorptions(d.kernels, frozenset(g.outputs)).items()
    assert (consumer, producer) == (matmul.output, norm.output)
    assert set(fused.reads) == ({"x", "w", "m"} if weight else {"x", "m"}) and fused.output == "y"
    inputs = random_inputs(g, seed=3)
    np.testing.assert_allclose(fused.evaluate(inputs), d.evaluate(inputs)["y"], rtol=1e-12, atol=1e-12)


def test_rope_joins_the_projection_that_feeds_it() -> None:
    """q·cos + rotate_half(q)·sin with q = x·wᵀ, numerically: the absorbed kernel is the
    projection with RoPE as its epilogue — the rotate-half partner the same contraction
    D/2 columns on (``Shifted``, under the guard that keeps it inside the head) — reads
    x, w, cos and sin, and equals the projection followed by the RoPE kernel."""
    g = rope_projection_graph(seq=12, heads=2, dim=8, hidden=16, dtype="fp32")
    d = ck.derive(g)
    assert [k.kind for k in d.kernels] == ["contraction", "elementwise"]
    projection, rope = d.kernels
    ((consumer, (producer, fused)),) = absorptions(d.kernels, frozenset(g.outputs)).items()
    assert (consumer, producer) == (rope.output, projection.output)
    assert fused.kind == "contraction" and fused.axes == rope.axes and set(fused.reads) == {"x", "w", "cos", "sin"}
    shifted = sorted(s[2] for s in t.subterms(fused.term) if s[0] == "Shifted")
    assert shifted == [-4, 4] and fused.core == projection_core(fused)
    inputs = random_inputs(g, seed=5)
    np.testing.assert_allclose(fused.evaluate(inputs), d.evaluate(inputs)["y"], rtol=1e-12, atol=1e-12)


def test_a_matmul_read_through_a_merge_of_its_rows_is_computed_where_it_is_read() -> None:
    """An LM head's logits: ``(x.reshape(B·T, K) @ wᵀ).reshape(B, T, N)`` reads the matmul over
    merged rows ``b·T + t``, which the reshape below it splits back: the matmul is not stored and
    copied into the output's view but computed as the output, one contraction whose operand read
    ``x[(b·T + t) // T, (b·T + t) % T, k]`` is ``x[b, t, k]`` (a plain matrix of ``B·T`` rows)."""
    g = ck.Graph("lm_head")
    x, w = g.input("x", (2, 6, 16)), g.input("w", (9, 16))
    g.output((x.reshape(12, 16) @ w.transpose(0, 1)).reshape(2, 6, 9), "y")
    d = ck.derive(g)
    assert [k.kind for k in d.kernels] == ["contraction"]
    (read,) = [s for s in t.subterms(d.kernels[0].term) if s[0] == "Tensor" and s[1] == "x"]
    assert t.ix_items(read[2]) == tuple(t.ax(a) for a in ("i0:2", "i1:6", "r0:16"))
    assert_derived_program_matches(g, d)


def test_substituted_index_terms_are_canonical() -> None:
    """Axes replaced by index terms rebuild the index terms around them: a split of a merged
    index is its parts, steps add up, a split of anything else stays."""
    merged = t.ix_lin(t.ax("b:2"), 6, t.ax("t:6"))
    split = t.access("x", (t.ix_div(t.ax("i:12"), 6), t.ix_mod(t.ax("i:12"), 6), t.ax("k:4")))
    assert t.substitute_axes(split, {"i:12": merged}) == t.access("x", (t.ax("b:2"), t.ax("t:6"), t.ax("k:4")))
    assert t.shifted(t.access("y", (t.ix_add(t.ax("d:8"), 1),)), "d:8", 2) == t.access("y", (t.ix_add(t.ax("d:8"), 3),))
    other = t.substitute_axes(split, {"i:12": t.ax("j:12")})
    assert other == t.access("x", (t.ix_div(t.ax("j:12"), 6), t.ix_mod(t.ax("j:12"), 6), t.ax("k:4")))


def projection_core(kernel) -> tuple:
    """The one contraction of an absorbed kernel that is not shifted."""
    (core,) = {s for s in t.subterms(kernel.term) if s[0] == "Contract"}
    return core


def test_a_neighbour_read_without_a_guard_is_not_absorbed() -> None:
    """``p[s, n] + p[s, n + 1]`` over n < N − 1: the neighbour of the last column is no
    column of the consumer's GEMM, so the sum stays a kernel of its own."""
    g = ck.Graph("neighbours")
    p = g.input("x", (12, 16)) @ g.input("w", (16, 8))
    g.output(p[:, :7] + p[:, 1:], "y")
    d = ck.derive(g)
    assert [k.kind for k in d.kernels] == ["contraction", "elementwise"]
    assert absorptions(d.kernels, frozenset(g.outputs)) == {}


def test_a_producer_others_need_is_not_absorbed() -> None:
    g = ck.Graph("rms_twice")
    x, w, m = g.input("x", (6, 32)), g.input("w", (32,)), g.input("m", (32, 16))
    normed = ck.nn.rms_norm(x, w)
    g.output(normed @ m, "y")
    g.output(normed, "normed")
    d = ck.derive(g)
    assert [k.kind for k in d.kernels] == ["rms_norm_rows", "contraction"]
    assert absorptions(d.kernels, frozenset(g.outputs)) == {}, "the norm is an output: it must run anyway"
    assert absorbed(d.kernels[0], d.kernels[1]) is None, "a norm kernel absorbs nothing"


def test_layer_norm_with_weight_and_bias_is_one_kernel() -> None:
    g = ck.Graph("ln")
    x, w, b = g.input("x", (6, 32)), g.input("w", (32,)), g.input("b", (32,))
    g.output(ck.nn.layer_norm(x, w, b), "y")
    d = ck.derive(g)
    assert d.found("layer_norm_row") and [k.kind for k in d.kernels] == ["layer_norm_rows"]
    assert_derived_program_matches(g, d)


def test_mlp_fuses_bias_and_gelu_into_the_first_matmul_epilogue() -> None:
    g = ck.Graph("mlp")
    x, w1, b1, w2 = g.input("x", (6, 32)), g.input("w1", (32, 64)), g.input("b1", (64,)), g.input("w2", (64, 32))
    g.output(ck.nn.gelu(x @ w1 + b1) @ w2, "y")
    d = ck.derive(g)
    assert [k.kind for k in d.kernels] == ["contraction", "contraction"]
    first, second = d.kernels
    assert set(first.reads) == {"x", "w1", "b1"} and "Exp" in str(first.term), "bias and GELU: first epilogue"
    assert set(second.reads) == {first.output, "w2"} and "Exp" not in str(second.term)
    assert_derived_program_matches(g, d)


def seed_graph() -> ck.Graph:
    g = ck.Graph("seed")
    q = g.input("q", (1, 8, 4096, 128), "bf16")
    k = g.input("k", (1, 8, 8192, 128), "bf16")
    v = g.input("v", (1, 8, 8192, 128), "bf16")
    g.output(textbook(q, k, v), "o")
    return g


def test_seed_plans_fit_each_targets_budget() -> None:
    d = ck.derive(seed_graph())
    counts = {}
    for name in ("sm_80", "sm_90", "sm_120"):
        plans = d.plans(name)
        counts[name] = len(plans)
        assert all(
            flash_smem_bytes(p.schedule, 128, "bf16") <= TARGETS[name].smem_per_block for p in plans
        )
        assert len({p.schedule for p in plans}) == len(plans)
    assert counts["sm_120"] >= 24
    assert counts["sm_90"] > counts["sm_120"], "sm_90's larger shared memory admits more schedules"
    assert counts["sm_80"] != counts["sm_90"]


def test_saturation_is_bounded_and_small() -> None:
    d = ck.derive(seed_graph())
    assert d.stats.saturated and d.stats.enodes < 400 and d.stats.iterations <= 10
    g = ck.Graph("layers")
    h = g.input("x", (1, 4, 64, 64), "bf16")
    for _ in range(4):
        h = ck.nn.attention(h, h, h, causal=True)
    g.output(h, "y")
    d = ck.derive(g)
    assert d.stats.saturated and d.stats.enodes < 1500 and not d.lowered.inlined, "a forward graph inlines nothing"
    assert [k.kind for k in d.kernels] == ["flash_attention"] * 4


def test_hopper_schedules_are_alternatives_on_sm90a_only() -> None:
    d = ck.derive(seed_graph())
    sm90a = TARGETS["sm_90a"]
    plans = d.plans(sm90a)
    hopper = [p for p in plans if isinstance(p.schedule, HopperFlashSchedule)]
    assert HopperFlashSchedule() in {p.schedule for p in hopper}
    assert all(not hopper_schedule_problems(p.schedule, p.problem, sm90a) for p in hopper)
    assert len(plans) == len(d.plans("sm_90")) + len(hopper), "sm_90a offers both kernel families"
    for name in ("sm_80", "sm_90", "sm_120"):
        assert not any(isinstance(p.schedule, HopperFlashSchedule) for p in d.plans(name))
    g = ck.Graph("tail")
    q, k, v = (g.input(n, (1, 2, 1000, 128), "bf16") for n in "qkv")
    g.output(textbook(q, k, v), "o")
    tail_plans = ck.derive(g).plans(sm90a)
    assert any(isinstance(p.schedule, HopperFlashSchedule) for p in tail_plans), "tails have Hopper plans"


def test_two_outputs_of_one_tensor_each_get_a_kernel_and_its_values() -> None:
    g = ck.Graph("twice")
    x = g.input("x", (4, 8), "fp32")
    y = (x * 2.0).exp()
    g.output(y, "first")
    g.output(y, "second")
    g.output(g.constant(-1.5), "scalar")
    g.output(g.constant(-1.5), "scalar_again")
    d = ck.derive(g)
    assert sorted(k.output for k in d.partition()) == ["first", "scalar", "scalar_again", "second"]
    inputs = {"x": np.random.default_rng(0).standard_normal((4, 8))}
    expected, got = ck.evaluate(g, inputs), ck.evaluate(d, inputs)
    for name in g.outputs:
        np.testing.assert_allclose(got[name], expected[name], rtol=1e-12)


def test_outputs_are_stored_in_their_own_dtype_when_the_inputs_mix_dtypes() -> None:
    """With fp32 and bf16 inputs intermediates are fp32, but each output keeps the dtype its graph
    gives it: a caller (inductor, after a backend region) reads the bytes as that dtype."""
    from cherenkov.codegen.term_plan import term_plans

    g = ck.Graph("mixed")
    x, y = g.input("x", (4, 64), "fp32"), g.input("y", (4, 64), "bf16")
    g.output((x * y.cast("fp32")).exp().cast("bf16"), "out")
    g.output(x.sum(axis=-1), "total")
    d = ck.derive(g)
    shapes, dtypes = d.tensor_types()
    assert d.lowered.buffer_dtype == "fp32" and (dtypes["out"], dtypes["total"]) == ("bf16", "fp32")
    for kernel in d.kernels:
        plans = term_plans(kernel, shapes, dtypes, TARGETS["sm_90"])
        assert plans and {p.output.dtype for p in plans} == {g.outputs[kernel.output].dtype}


def test_intermediates_of_a_mixed_dtype_graph_are_stored_as_its_activations():
    """A bf16 graph reading a small float32 table (a Llama layer's rotary frequencies) stores
    its intermediates in bf16, as eager PyTorch does, not float32: the flash and GEMM plans
    are for 16-bit operands."""
    g = ck.Graph("mixed_dtypes")
    x = g.input("x", (64, 128), "bf16")
    w = g.input("w", (128, 128), "bf16")
    table = g.input("table", (128,), "fp32")
    h = (x.cast("fp32") * table).cast("bf16")
    g.output(ck.nn.softmax(h @ w, axis=-1), "out")
    d = ck.derive(g)
    _, dtypes = d.tensor_types()
    (contraction,) = [k for k in d.kernels if k.kind == "contraction"]
    assert dtypes[contraction.output] == "bf16" and dtypes["out"] == "bf16"


def residual_stream_graph(layers: int) -> ck.Graph:
    """A pre-norm stack as GPT-2 spells it: ``h = h + (layer_norm(h) as B·T rows @ w_l) as
    (B, T, C)`` for each layer, then a final norm."""
    g = ck.Graph(f"residual_stream_{layers}")
    h = g.input("x", (2, 16, 64), "bf16")
    for layer in range(layers):
        h = h + (ck.nn.layer_norm(h).reshape(32, 64) @ g.input(f"w{layer}", (64, 64), "bf16")).reshape(2, 16, 64)
    g.output(ck.nn.layer_norm(h), "out")
    return g


@pytest.mark.parametrize("layers", [2, 6])
def test_a_residual_stream_is_stored_once_not_recomputed_by_every_later_norm(layers: int) -> None:
    """Each residual sum read by the next norm and the next sum is stored once, as the epilogue
    of the GEMM before it (the GEMM over merged B·T rows is read through their split, so it is
    computed where the sum reads it), and every norm reads one stored tensor (the last sum, read
    by the final norm only, stays inlined there): the reads grow linearly with depth instead of
    quadratically; the program is unchanged."""
    g = residual_stream_graph(layers)
    d = ck.derive(g)
    norms = [k for k in d.kernels if k.kind == "layer_norm_rows"]
    assert len(norms) == layers + 1 and [k.kind for k in d.kernels].count("elementwise") == 0
    assert [len(k.reads) for k in norms] == [1] * layers + [2], [k.reads for k in norms]
    assert sum(len(k.reads) for k in d.kernels) <= 5 * layers + 2
    assert_derived_program_matches(g, d)


def test_the_steps_of_a_gelu_the_gradient_reads_again_are_recomputed_not_stored() -> None:
    """The gradient of an erf GELU after a GEMM reads every step of the erf polynomial again. The
    GEMM with its bias is stored once; the forward's GELU and its gradient both recompute the steps
    from it (each step was a kernel of its own: a dozen of them); the program is unchanged."""
    g = ck.Graph("erf_gelu_mlp")
    x, w1 = g.input("x", (32, 64), "float32"), g.input("w1", (64, 128), "float32")
    b1, w2 = g.input("b1", (128,), "float32"), g.input("w2", (128, 64), "float32")
    g.output(ck.nn.gelu(x @ w1 + b1, approximate="none") @ w2, "out")
    gradient = ck.grad(g, wrt=("x", "w1", "b1", "w2"))
    d = ck.derive(gradient)
    elementwise = [k for k in d.kernels if k.kind == "elementwise"]
    assert len(elementwise) <= 2 and all(len(k.reads) == 1 for k in elementwise), [
        k.describe()[:120] for k in elementwise]
    assert_derived_program_matches(gradient, d)


def test_a_value_one_kernel_reads_stays_inlined() -> None:
    """An elementwise value read twice inside one kernel (GELU's ``x``, ``x³`` and ``0.5·x``)
    is not stored: only values two kernels read are."""
    from cherenkov.rewrites.kernels import shared_values

    g = ck.Graph("gelu_after_gemm")
    x, w, b = g.input("x", (32, 64), "bf16"), g.input("w", (64, 64), "bf16"), g.input("b", (64,), "bf16")
    g.output(ck.nn.gelu(x @ w + b), "out")
    d = ck.derive(g)
    assert not shared_values(d._extract(()))


@pytest.mark.parametrize(("batch", "causal"), [(1, True), (2, False)], ids=["causal", "batched"])
def test_multi_query_attention_is_one_flash_kernel_of_one_kv_head(batch: int, causal: bool) -> None:
    """One K/V head for every query head (MQA: Falcon-7B, Gemma 2B): k and v vary along no axis of q
    but the batch, so the query head is read as the group of one K/V head (the causal mask names the
    query row; without one the axis q strides least), forward and backward, and each derived program
    equals its graph."""
    g = ck.Graph("mqa")
    q = g.input("q", (batch, 4, 48, 32), "bf16")
    k, v = (g.input(n, (batch, 1, 80, 32), "bf16") for n in "kv")
    g.output(ck.nn.attention(q, k, v, causal=causal), "o")
    d = ck.derive(g)
    assert [k.kind for k in d.kernels] == ["flash_attention"]
    assert_derived_program_matches(g, d)
    problem = d.plans("sm_90")[0].problem
    assert (problem.batch, problem.heads, problem.kv_heads, problem.seq_q, problem.causal) == (batch, 4, 1, 48, causal)
    # its gradients: one flash backward whose dk and dv sum every query head (the group of the one K/V head)
    gg = ck.grad(g, wrt=("q", "k", "v"))
    d = ck.derive(gg)
    assert [k.kind for k in d.kernels] == ["flash_attention_backward"]
    assert_derived_program_matches(gg, d)
    backward = d.plans("sm_90")[0].problem
    assert backward.attention.kv_heads == 1 and {g.role: g.layout.head for g in backward.gradients}["dk"] == 0


def test_fp32_operands_beside_16_bit_ones_are_rounded_into_copies() -> None:
    """ModernBERT's rotary embedding runs in fp32: its training forward keeps q and k in fp32 (saved for
    the backward) and rounds them for the attention. The flash kernel reads 16-bit copies of them
    (its log-sum-exp too, a side output), and the gradient of the attention of fp32 q and k (the
    backward graph) is one flash backward reading those copies, whose 16-bit dq and dk a copy widens
    to the fp32 gradients the graph keeps."""
    g = ck.Graph("fp32_rotary")
    q, k, v = (g.input(n, (B, H, SQ, D), "bf16") for n in "qkv")
    cos = g.input("cos", (SQ, D), "fp32")
    q32, k32 = q.cast("fp32") * cos, k.cast("fp32") * cos
    o, lse = ck.nn.attention(q32.cast("bf16"), k32.cast("bf16"), v, return_lse=True)
    for value, name in ((q32, "q32"), (k32, "k32"), (o, "o"), (lse, "lse")):
        g.output(value, name)
    d = ck.derive(g)
    flash = [kernel for kernel in d.kernels if kernel.kind == "flash_attention"]
    assert len(flash) == 1 and [side.output for side in flash[0].side_outputs] == ["lse"], d.kernels
    problem = d.plans("sm_90a")[0].problem
    assert problem.dtype == "bf16" and {problem.q, problem.k}.isdisjoint({"q32", "k32"}), problem
    dtypes = d.tensor_types()[1]
    assert dtypes[problem.q] == dtypes[problem.k] == "bf16"

    b = ck.Graph("fp32_rotary_backward")
    q32, k32 = (b.input(n, (B, H, SQ, D), "fp32") for n in ("q32", "k32"))
    v = b.input("v", (B, H, SQ, D), "bf16")
    b.output(ck.nn.attention(q32.cast("bf16"), k32.cast("bf16"), v), "o")
    backward = ck.derive(ck.grad(b, wrt=("q32", "k32", "v")))
    assert [kernel.kind for kernel in backward.kernels].count("flash_attention_backward") == 1, backward.kernels
    gradient = backward.plans("sm_90a")[0].problem
    dtypes = backward.tensor_types()[1]
    assert {dtypes[gradient.attention.q], dtypes[gradient.attention.k]} == {"bf16"}, gradient
    assert {dtypes[output.tensor] for output in gradient.gradients} == {"bf16"}, gradient
