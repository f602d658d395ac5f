"""Flash attention under a sliding window (causal, query ``i`` sees keys ``i − W < j ≤ i``; or about the
query, ModernBERT's, ``i − W < j ≤ i + ahead``): the window is the problem's own, no bias tensor (under
Gemma 2's soft cap too), and the kernels bound their key (or query) tile ranges by it. The
``mma.sync`` forward runs emulated on the CPU against the graph's float64 values (windows narrower
than a tile, wider than the sequence, and between), plans of every family (forward and backward)
compile without spills for sm_80, sm_90, sm_90a and sm_120, and on the GPU the forward plans of both
families match float32 attention under the band. A chunk of queries after a KV cache (causal against
the last key, or under a sliding window's full cache) runs the short-query kernels too: packed GQA rows,
key splits, Hopper's packed tiles. The backward's own tests are in ``test_window_backward``."""

from __future__ import annotations

import dataclasses
import math
import shutil

import numpy as np
import pytest

import cherenkov as ck
from cherenkov.codegen import compile_plans, cuda_source, load_kernel
from cherenkov.graph.nn import repeat_kv_heads
from cherenkov.graph.tensor import where
from cherenkov.rewrites.plan import AttentionProblem
from cherenkov.rewrites.plan_sm90a import HopperFlashSchedule

from .emulator import rounded
from .flash_emulator import assert_emulated_output_and_lse, emulate_flash, knob_family_plans, supported

needs_gxx = pytest.mark.skipif(shutil.which("g++") is None, reason="no g++ to emulate kernels with")


def window_graph(batch: int, heads: int, kv_heads: int, seq: int | tuple[int, int], dim: int, window: int | None,
                 softcap: float | None = None, gradients: bool = False, lse: bool = False,
                 ahead: int | None = None) -> ck.Graph:  # fmt: skip
    """``ck.nn.attention`` under a causal window of ``window`` keys, its scores soft-capped at ``softcap``
    (Gemma 2's sliding layers; None: not capped); ``gradients``: ``ck.grad`` of it; ``lse``: the rows'
    log-sum-exp a second output (what a training forward saves). ``ahead``: no causal mask, a window about
    the query instead (ModernBERT's local attention: keys ``i − window < j ≤ i + ahead``), as a bias band;
    without ``window``, that band's upper edge alone (``seq`` = (queries, keys), ``ahead`` = keys − queries: a
    causal mask aligned to the last key, a chunk of queries after cached keys)."""
    seq_q, seq_kv = seq if isinstance(seq, tuple) else (seq, seq)
    g = ck.Graph("windowed")
    q = g.input("q", (batch, heads, seq_q, dim), "bf16")
    k, v = (g.input(n, (batch, kv_heads, seq_kv, dim), "bf16") for n in "kv")
    band = None
    if ahead is not None:
        query, key = ck.arange(seq_q, graph=g).unsqueeze(-1), ck.arange(seq_kv, graph=g)
        hidden, live = g.constant(-math.inf, "bf16"), g.constant(0.0, "bf16")
        behind = live if window is None else where(key < query + float(1 - window), hidden, live)
        band = where(query + float(ahead) < key, hidden, behind)
    causal = ahead is None
    attention = ck.nn.attention(q, k, v, causal=causal, window=window if causal else None, softcap=softcap,
                                return_lse=lse, bias=band)  # fmt: skip
    for name, value in zip(("o", "lse"), attention if lse else (attention,)):
        g.output(value, name)
    return ck.grad(g, wrt=("q", "k", "v")) if gradients else g


def keys_ahead_filled(seq_q: int, seq_kv: int) -> ck.Graph:
    """Attention whose scores a causal mask aligned to the last key fills with −∞ (``where(i + o < j, −∞, s)``,
    ``o = S_kv − S_q``), as a chunk of queries after cached keys masks them."""
    g = ck.Graph("keys_ahead")
    q = g.input("q", (1, 4, seq_q, 64), "bf16")
    k, v = (g.input(n, (1, 4, seq_kv, 64), "bf16") for n in "kv")
    scores = (q @ k.transpose(-2, -1)) * 0.125
    query, key = ck.arange(seq_q, graph=g).unsqueeze(-1) + float(seq_kv - seq_q), ck.arange(seq_kv, graph=g)
    g.output(ck.nn.softmax(where(query < key, -math.inf, scores), axis=-1) @ v, "o")
    return g


BF16_LOWEST = -3.3895313892515355e38
"""``torch.finfo(torch.bfloat16).min``: the fill of transformers' eager masks."""


def alibi_after_cached_keys(batch: int, heads: int, kv_heads: int, seq_q: int, seq_kv: int, dim: int,
                            spelling: str) -> ck.Graph:  # fmt: skip
    """ALiBi attention of a chunk of queries after cached keys: the scores plus a stored bias a head and key
    (slope times position, fp32), under a causal mask aligned to the last key of bf16's lowest value, added after
    the bias (``"added"``, Bloom's) or filling the biased scores (``"filled"``, MPT's masked_fill)."""
    g = ck.Graph(f"alibi_{spelling}")
    q = g.input("q", (batch, heads, seq_q, dim), "bf16")
    k, v = (repeat_kv_heads(g.input(n, (batch, kv_heads, seq_kv, dim), "bf16"), heads // kv_heads) for n in "kv")
    alibi = g.input("alibi", (1, heads, 1, seq_kv), "fp32")
    scores = ((q @ k.transpose(-2, -1)).cast("fp32") * dim**-0.5) + alibi
    query, key = ck.arange(seq_q, graph=g).unsqueeze(-1) + float(seq_kv - seq_q), ck.arange(seq_kv, graph=g)
    if spelling == "added":
        scores = scores + where(query < key, g.constant(BF16_LOWEST, "fp32"), g.constant(0.0, "fp32"))
    else:
        scores = where(query < key, BF16_LOWEST, scores)
    g.output((ck.nn.softmax(scores, axis=-1).cast("bf16") @ v), "o")
    return g


def _inputs(g: ck.Graph) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {n: rounded(rng.standard_normal(x.shape), "bf16") for n, x in g.inputs.items()}


def test_a_window_is_the_problems_own_in_every_family() -> None:
    """One flash kernel forward and one flash backward, each problem with the window and no bias
    tensor; the backward plans every main pass on sm_90a (no row is wholly masked: each sees its own
    key), and the 8-bit families say why they take no window."""
    for softcap, ahead in ((None, None), (30.0, None), (None, 20)):
        forward = ck.derive(window_graph(1, 4, 2, 200, 64, 50, softcap, ahead=ahead))
        assert [k.kind for k in forward.kernels] == ["flash_attention"], (softcap, ahead)
        expected = {(ahead is None, 50, ahead or 0, None, softcap or 0.0)}
        for target in ("sm_80", "sm_90a", "sm_120"):
            problems = {p.problem for p in forward.plans(target)}
            assert {(p.causal, p.window, p.window_ahead, p.bias, p.softcap) for p in problems} == expected, target
            assert not any(getattr(p.schedule, "short_query", False) for p in forward.plans(target))
    backward = ck.derive(window_graph(1, 4, 2, 200, 64, 50, gradients=True))
    assert [k.kind for k in backward.kernels] == ["flash_attention_backward"]
    plans = backward.plans("sm_90a")
    assert {p.problem.attention.window for p in plans} == {50}
    assert any(p.schedule.wgmma for p in plans) and any(p.schedule.warp_pairs for p in plans)
    from cherenkov.rewrites.plan_fp8 import Fp8FlashSchedule, fp8_schedule_problems

    eight_bit = AttentionProblem(1, 4, 2, 200, 200, 128, "fp8_e4m3", causal=True, window=50, out_dtype="bf16")
    assert any("window" in r for r in fp8_schedule_problems(Fp8FlashSchedule(), eight_bit, plans[0].target))


def test_a_causal_mask_aligned_to_the_last_key_is_a_window_over_every_key() -> None:
    """70 queries after 130 cached keys, masked ``j ≤ i + 130`` as a −∞ fill or an added band: one flash kernel
    forward and one flash backward on every target, the window the problem's own (as many keys as queries and
    keys, so none is cut behind; 130 ahead) and no bias tensor."""
    sizes, _, _, ahead = KEYS_AHEAD
    expected = {(False, 270, 130, None)}
    for g, kind, targets in ((keys_ahead_filled(70, 200), "flash_attention", ("sm_80", "sm_120")),
                             (window_graph(*sizes, None, ahead=ahead), "flash_attention", ("sm_90", "sm_90a")),
                             (window_graph(*sizes, None, ahead=ahead, gradients=True), "flash_attention_backward",
                              ("sm_80", "sm_90a"))):  # fmt: skip
        d = ck.derive(g)
        assert [k.kind for k in d.kernels] == [kind], g.name
        for target in targets:
            plans = d.plans(target)
            problems = {getattr(p.problem, "attention", p.problem) for p in plans}
            assert plans and {(p.causal, p.window, p.window_ahead, p.bias) for p in problems} == expected, target
        if g.name == "keys_ahead":
            assert "keys-ahead-additive" in d.trace


@needs_gxx
@pytest.mark.parametrize("spelling", ["added", "filled"])
def test_alibi_after_cached_keys_is_a_window_beside_its_stored_bias(spelling: str) -> None:
    """Bloom's and MPT's attention with a KV cache: a stored ALiBi bias under a causal mask aligned to the last key
    (16 queries after 185 cached keys). The mask is the kernel's own window (as many keys as queries and keys, 185
    ahead) and the kernel reads the stored bias beside it (rule ``keys-ahead-beside-bias``, bias form
    ``-beside-ahead``; they derived no flash kernel before); packed and unpacked short-query ``mma.sync`` plans and
    a prefill one run emulated within bf16 rounding of the graph's float64 output."""
    g = alibi_after_cached_keys(1, 8, 2, 16, 201, 64, spelling)
    d = ck.derive(g)
    assert [k.kind for k in d.kernels] == ["flash_attention"]
    plans = d.plans("sm_80")
    assert {(p.problem.window, p.problem.window_ahead, p.problem.bias.tensor) for p in plans} == {(217, 185, "alibi")}
    assert d.plans("sm_90a") and "keys-ahead-beside-bias" in d.trace
    inputs = _inputs(g)
    inputs["alibi"] = -0.5 * np.arange(201.0) * (2.0 ** -np.arange(1.0, 9.0))[None, :, None, None]
    expected = ck.evaluate(g, inputs)["o"]
    picked: dict[tuple, object] = {}
    for plan in plans:
        if supported(plan):
            picked.setdefault((plan.schedule.short_query, plan.schedule.pack_group), plan)
    assert set(picked) >= {(True, True), (True, False), (False, False)}, list(picked)
    for plan in picked.values():
        got = emulate_flash(plan, inputs["q"], inputs["k"], inputs["v"], inputs["alibi"])["o"]
        error = np.linalg.norm(got - expected) / np.linalg.norm(expected)
        assert error <= 1e-2, (plan.schedule.key(), error)


SHORT_CHUNKS = [(4, 300), (16, 201), (64, 8192)]
"""(queries, keys) of short chunks after a KV cache: speculative drafts (ragged key tails) and chunked prefill."""


def _short_query(plan) -> bool:
    s = plan.schedule
    return s.pack_group or (not isinstance(s, HopperFlashSchedule) and s.short_query)


@pytest.mark.parametrize(("seq_q", "seq_kv"), SHORT_CHUNKS)
def test_a_short_chunk_after_cached_keys_gets_packed_and_split_plans(seq_q: int, seq_kv: int) -> None:
    """A few causal queries after a KV cache (GQA group of 4): the short-query schedules (packed groups, key
    splits, warps that split a key tile) plan it in both families, the window the problem's own, and so under a
    sliding window over its full cache. A band whose last query does not see the last key does not get them:
    causal from the first key (top-left) with fewer queries than keys, with a sliding window or not."""
    forward = ck.derive(window_graph(2, 8, 2, (seq_q, seq_kv), 128, None, ahead=seq_kv - seq_q))
    for target in ("sm_80", "sm_90a", "sm_120"):
        plans = forward.plans(target)
        assert {(p.problem.window, p.problem.window_ahead) for p in plans} == {(seq_q + seq_kv, seq_kv - seq_q)}
        short = [p.schedule for p in plans if _short_query(p)]
        assert any(s.pack_group for s in short), target
        if seq_kv > 1000 and target != "sm_90a":
            assert any(s.kv_splits > 1 for s in short), target
    if seq_q == 64:  # a Hopper tile packs 128 rows: 64 queries of two heads of the group
        assert any(isinstance(p.schedule, HopperFlashSchedule) and p.schedule.pack_group
                   for p in forward.plans("sm_90a"))  # fmt: skip
    for window in (None, seq_q // 2):  # causal from the first key (a sliding window too), more keys than queries
        assert not AttentionProblem(2, 8, 2, seq_q, seq_kv, 128, causal=True, window=window or 0).short_query_band
        plans = ck.derive(window_graph(2, 8, 2, (seq_q, seq_kv), 128, window)).plans("sm_80")
        assert plans and not any(_short_query(p) for p in plans), window
    # a sliding window of seq_kv - seq_q + 1 keys over its full cache: the last query sees the last key
    sliding = ck.derive(window_graph(2, 8, 2, (seq_q, seq_kv), 128, 1, ahead=seq_kv - seq_q)).plans("sm_80")
    assert any(p.schedule.pack_group for p in sliding if _short_query(p))


def test_packed_hopper_plans_of_a_chunk_after_cached_keys_compile_without_spills(compiler, kernel_cache) -> None:
    """Every packed Hopper schedule of a chunked prefill's 64 causal queries after 8128 cached keys builds for sm_90a
    without spills."""
    seq_q, seq_kv = SHORT_CHUNKS[2]
    plans = [p for p in ck.derive(window_graph(2, 8, 2, (seq_q, seq_kv), 128, None, ahead=seq_kv - seq_q)).plans("sm_90a")
             if isinstance(p.schedule, HopperFlashSchedule) and p.schedule.pack_group]  # fmt: skip
    assert len(plans) >= 4
    for plan, build in zip(plans, compile_plans(plans, compiler=compiler, cache_dir=kernel_cache)):
        assert not isinstance(build, Exception), f"{plan.name}: {build}"
        assert build.report.spill_bytes == 0, (plan.name, build.report)


@needs_gxx
@pytest.mark.parametrize(("seq_q", "seq_kv", "window"), [(*SHORT_CHUNKS[0], None), (*SHORT_CHUNKS[1], None),
                                                         (*SHORT_CHUNKS[1], 1)], ids=["drafts", "sixteen", "sliding"])
def test_emulated_short_query_kernels_after_cached_keys_match_the_graph(seq_q: int, seq_kv: int, window) -> None:
    """Packed and unpacked short-query ``mma.sync`` plans (one key split: the emulator's) within bf16 rounding
    of the graph's float64 output: a packed row's query is its row over the group, so each 16-row tile holds
    four queries of four heads (or sixteen of one); and under a sliding window over its full cache (query ``i``
    sees keys ``i ≤ j ≤ i + 185``), every tile masked."""
    g = window_graph(1, 8, 2, (seq_q, seq_kv), 64, window, ahead=seq_kv - seq_q)
    inputs = _inputs(g)
    expected = ck.evaluate(g, inputs)["o"]
    picked: dict[tuple, object] = {}
    for plan in ck.derive(g).plans("sm_80"):
        if _short_query(plan) and supported(plan):
            picked.setdefault((plan.schedule.pack_group, plan.schedule.warps), plan)
    assert {pack for pack, _ in picked} == {False, True}, list(picked)
    for plan in picked.values():
        got = emulate_flash(plan, inputs["q"], inputs["k"], inputs["v"])["o"]
        error = np.linalg.norm(got - expected) / np.linalg.norm(expected)
        assert error <= 1e-2, (plan.schedule.key(), error)


def test_a_multi_query_chunk_reads_its_rows_from_the_band() -> None:
    """GPT-BigCode's multi-query attention after its KV cache: q laid out (B, S, H, D) and read transposed, so q's
    head axis strides less than its row axis, and one K/V head for every query head. The row is the axis whose
    position the band reads (it was taken by the strides: the heads, and the window then bounded nothing)."""
    g = ck.Graph("multi_query_chunk")
    q = g.input("q", (2, 16, 4, 32), "bf16").permute(0, 2, 1, 3)
    k, v = (g.input(n, (2, 1, 64, 32), "bf16").expand(2, 4, 64, 32) for n in "kv")
    query, key = ck.arange(16, graph=g).unsqueeze(-1), ck.arange(64, graph=g)
    band = where(query + 48.0 < key, g.constant(-math.inf, "bf16"), g.constant(0.0, "bf16"))
    g.output(ck.nn.attention(q, k, v, bias=band), "o")
    plans = ck.derive(g).plans("sm_90a")
    assert {(p.problem.heads, p.problem.kv_heads, p.problem.seq_q, p.problem.window, p.problem.window_ahead)
            for p in plans} == {(4, 1, 16, 80, 48)}  # fmt: skip


def test_keys_ahead_need_a_window_without_the_causal_mask() -> None:
    with pytest.raises(ValueError, match="window"):
        AttentionProblem(1, 4, 4, 64, 64, 64, causal=True, window=8, window_ahead=2)
    with pytest.raises(ValueError, match="window"):
        AttentionProblem(1, 4, 4, 64, 64, 64, window_ahead=2)
    g = ck.Graph("bad")
    q, k, v = (g.input(n, (1, 2, 16, 32), "bf16") for n in "qkv")
    with pytest.raises(ck.GraphError, match="window"):
        ck.nn.attention(q, k, v, window=4)
    with pytest.raises(ck.GraphError, match="window"):
        ck.nn.attention(q, k, v, causal=True, window=0)


def test_the_flops_of_a_window_count_its_live_scores() -> None:
    for seq, window, ahead in ((200, 50, 0), (100, 300, 0), (64, 1, 0), (200, 50, 20), (90, 10, 200)):
        problem = AttentionProblem(2, 4, 2, seq, seq, 64, causal=not ahead, window=window, window_ahead=ahead)
        ones = np.ones((seq, seq))
        live = np.tril(ones, ahead) - np.tril(ones, -window)
        assert problem.flops == pytest.approx(2 * 2 * 4 * live.sum() * 128), (seq, window, ahead)


def test_the_window_reaches_every_source() -> None:
    """The window's constant, the forward's first key tile and the backward's tile ranges."""
    forward = ck.derive(window_graph(1, 4, 2, 200, 64, 50)).plans("sm_90a")
    hopper = next(p for p in forward if isinstance(p.schedule, HopperFlashSchedule))
    warps = next(p for p in forward if not isinstance(p.schedule, HopperFlashSchedule))
    for plan in (hopper, warps):
        source = cuda_source(plan)
        assert "constexpr int WINDOW = 50;" in source and "window=50" in source, plan.name
    assert "w.kv_first = WINDOW > 0" in cuda_source(hopper) and "const int rotated = tile + w.lower_end - w.first;" in cuda_source(warps)
    backward = ck.derive(window_graph(1, 4, 2, 200, 64, 50, gradients=True)).plans("sm_90a")
    for plan in {p.schedule.wgmma: p for p in backward}.values():
        source = cuda_source(plan)
        assert "constexpr int WINDOW = 50;" in source and "query_tiles_end(" in source, plan.name
    plain = cuda_source(ck.derive(window_graph(1, 4, 2, 200, 64, 50)).plans("sm_80")[0])
    assert "const bias_t" not in plain, "no bias tensor"


WINDOWS = [
    ((2, 4, 2, 200, 64), 7, None, None),  # narrower than any key tile: most tiles skipped, every visited one masked
    ((1, 2, 2, 333, 128), 180, None, None),  # between: tiles below it skipped, those inside every row's unmasked
    ((1, 2, 1, 150, 64), 400, None, None),  # wider than the sequence: the causal mask alone, the window's path
    ((1, 4, 2, 260, 64), 90, 2.0, None),  # Gemma 2's sliding layers: scores soft-capped (at 2: the cap bends them)
    ((1, 4, 2, 300, 64), 65, None, 64),  # ModernBERT's local attention: 64 keys either side, no causal mask
]
WINDOW_IDS = ["narrow_gqa", "d128_ragged", "wide_mqa", "soft_capped_gqa", "about_the_query"]
KEYS_AHEAD = ((1, 2, 1, (70, 200), 64), None, None, 130)  # 70 queries after 130 cached keys, ragged last tiles


@needs_gxx
@pytest.mark.parametrize(("sizes", "window", "softcap", "ahead"), WINDOWS, ids=WINDOW_IDS)
def test_emulated_forward_kernels_match_the_graph(sizes, window, softcap, ahead) -> None:
    """``mma.sync`` plans of three knob families (of plain, lazy rescale, head-major, pingpong,
    overlap, 32-row warps; each window starts two families further on, so that every family meets
    windows) within bf16 rounding of the graph's float64 output, the rows' log-sum-exp (the side
    output a training forward saves) within 1e-5."""
    g = window_graph(*sizes, window, softcap, lse=True, ahead=ahead)
    inputs = _inputs(g)
    expected = ck.evaluate(g, inputs)
    families = knob_family_plans(ck.derive(g).plans("sm_80"))
    assert len(families) >= 4
    start = 2 * [w[0] for w in WINDOWS].index(sizes)
    for plan in (families * 3)[start % len(families):][:3]:
        assert_emulated_output_and_lse(plan, inputs, expected)


@needs_gxx
def test_emulated_forward_under_a_causal_mask_aligned_to_the_last_key_matches_the_graph() -> None:
    """Two ``mma.sync`` knob families' plans (one for soft-capped scores) within bf16 rounding of the graph's
    float64 output and log-sum-exp, 70 queries after 130 cached keys (the last query and key tiles ragged, the
    key tiles past each row's last key skipped)."""
    sizes, window, _, ahead = KEYS_AHEAD
    for softcap, families in ((None, 2), (2.0, 1)):  # and Gemma 2's capped scores (with its KV cache)
        g = window_graph(*sizes, window, softcap, lse=True, ahead=ahead)
        inputs = _inputs(g)
        expected = ck.evaluate(g, inputs)
        plans = ck.derive(g).plans("sm_80")
        assert {(p.problem.window, p.problem.window_ahead, p.problem.softcap) for p in plans} == {
            (270, 130, softcap or 0.0)}
        for plan in knob_family_plans(plans)[:families]:
            assert_emulated_output_and_lse(plan, inputs, expected)


FULL_SLIDING_CACHE = ((1, 4, 2, (70, 133), 64), 1, None, 63)
"""70 queries after a full sliding cache of 63 keys (window 64): query ``i`` sees keys ``i ≤ j ≤ i + 63``, the window's
lower edge ``j < i + 0`` (folded to ``j < i``) one key behind."""


@needs_gxx
def test_emulated_forward_after_a_full_sliding_cache_matches_the_graph() -> None:
    """A sliding window over its full KV cache is the kernels' own window about the query (one key behind, 63 ahead;
    it was a stored bias): two ``mma.sync`` knob families' plans within bf16 rounding of the graph's float64 output
    and log-sum-exp."""
    sizes, window, _, ahead = FULL_SLIDING_CACHE
    g = window_graph(*sizes, window, lse=True, ahead=ahead)
    inputs = _inputs(g)
    expected = ck.evaluate(g, inputs)
    plans = ck.derive(g).plans("sm_80")
    assert {(p.problem.window, p.problem.window_ahead, p.problem.bias) for p in plans} == {(1, 63, None)}
    for plan in knob_family_plans(plans)[:2]:
        assert_emulated_output_and_lse(plan, inputs, expected)


def _without_window(plan):
    """The same plan for the problem without the window."""
    if plan.kind == "flash_attention":
        return dataclasses.replace(plan, problem=dataclasses.replace(plan.problem, window=0, window_ahead=0))
    attention = dataclasses.replace(plan.problem.attention, window=0, window_ahead=0)
    return dataclasses.replace(plan, problem=dataclasses.replace(plan.problem, attention=attention))


@pytest.mark.slow
@pytest.mark.parametrize("target", ["sm_80", "sm_90", "sm_90a", "sm_120"])
def test_window_plans_compile_without_spills(target: str, compiler, kernel_cache) -> None:
    """One forward plan of each knob family (every Hopper schedule on sm_90a) and one backward plan of
    each main pass build for the target, causal windows and windows about the query; none spills where
    the same schedule without the window keeps under 240 registers (32-row warps over 128-key tiles sit
    at 255 either way, and ptxas's spills there vary with any change)."""
    picked: dict[tuple, object] = {}
    for ahead in (None, 40):
        for plan in ck.derive(window_graph(2, 4, 2, 300, 64, 100, ahead=ahead)).plans(target):
            s = plan.schedule
            key = ((type(s).__name__, s.key()) if isinstance(s, HopperFlashSchedule) else
                   (s.tma_kv, s.mbarrier_ring, s.pingpong, s.overlap, s.lazy_rescale, s.q_prescaled, s.rows_per_warp))
            picked.setdefault((ahead, key), plan)
        for plan in ck.derive(window_graph(2, 4, 2, 300, 64, 100, gradients=True, ahead=ahead)).plans(target):
            picked.setdefault((ahead, plan.schedule.wgmma, plan.schedule.warp_pairs), plan)
    plans = list(picked.values())
    builds = compile_plans(plans, compiler=compiler, cache_dir=kernel_cache)
    for plan, build in zip(plans, builds):
        assert not isinstance(build, Exception), f"{plan.name}: {build}"
    spilling = [(plan, build) for plan, build in zip(plans, builds) if build.report.spill_bytes]
    twins = compile_plans([_without_window(p) for p, _ in spilling], compiler=compiler, cache_dir=kernel_cache)
    for (plan, build), twin in zip(spilling, twins):
        assert twin.report.registers >= 240, (plan.name, build.report, twin.report)


# ------------------------------------------------------------------------------ GPU

GPU_WINDOWS = [((2, 8, 2, 1000, 128), 256, None, None), ((1, 4, 4, 777, 64), 33, None, None),
               ((2, 4, 2, 300, 64), 1000, None, None), ((2, 8, 4, 700, 128), 200, 2.0, None),
               ((2, 8, 8, 900, 64), 129, None, 128)]  # fmt: skip
GPU_WINDOWS.append(((2, 8, 2, (200, 2248), 128), None, None, 2048))  # a chunk of 200 queries after 2048 cached keys
GPU_WINDOWS.append(((2, 8, 2, (200, 2247), 128), 1, None, 2047))  # 200 after a full sliding cache of 2047 (window 2048)
GPU_IDS = ["d128_gqa", "d64_narrow_ragged", "wide", "soft_capped_d128_gqa", "about_the_query", "keys_ahead",
           "full_sliding_cache"]


@pytest.mark.gpu
@pytest.mark.parametrize(("sizes", "window", "softcap", "ahead"), GPU_WINDOWS, ids=GPU_IDS)
def test_gpu_window_forward_matches_float32_attention(sizes, window, softcap, ahead, cuda_device,
                                                      kernel_cache) -> None:  # fmt: skip
    """Every Hopper schedule and a sample of ``mma.sync`` ones (sm_90a on an H100/H200, else sm_90), into
    NaN-poisoned outputs, against float32 attention under the band."""
    import torch

    target = "sm_90a" if torch.cuda.get_device_capability() == (9, 0) else "sm_90"
    plans = ck.derive(window_graph(*sizes, window, softcap, ahead=ahead)).plans(target)
    chosen = [p for p in plans if isinstance(p.schedule, HopperFlashSchedule)] + [
        p for p in plans if not isinstance(p.schedule, HopperFlashSchedule)][::25]  # fmt: skip
    _assert_plans_match_float32_attention(chosen, cuda_device, kernel_cache)


GPU_CHUNKS = [((2, 32, 8, (4, 4101), 128), None, 4097), ((1, 8, 2, (16, 777), 64), None, 761),
              ((2, 32, 8, (64, 2100), 128), None, 2036), ((2, 32, 8, (4, 4099), 128), 1, 4095),
              ((2, 32, 8, (64, 4159), 128), 1, 4095)]  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize(("sizes", "window", "ahead"), GPU_CHUNKS,
                         ids=["drafts_d128", "sixteen_d64", "chunk_of_64", "drafts_sliding", "chunk_of_64_sliding"])
def test_gpu_short_chunks_after_cached_keys_match_float32_attention(sizes, window, ahead, cuda_device,
                                                                    kernel_cache) -> None:  # fmt: skip
    """A few causal queries after a KV cache (or a sliding window's full cache of 4095 keys): every packed Hopper
    schedule and one ``mma.sync`` short-query plan of each kind (packed or not, key splits or not, warps splitting
    the keys or not, each ring) against float32 attention under the band."""
    import torch

    target = "sm_90a" if torch.cuda.get_device_capability() == (9, 0) else "sm_90"
    picked: dict[tuple, object] = {}
    for plan in ck.derive(window_graph(*sizes, window, ahead=ahead)).plans(target):
        s = plan.schedule
        if isinstance(s, HopperFlashSchedule):
            if s.pack_group:
                picked[s.key()] = plan
        elif s.short_query:
            picked.setdefault((s.pack_group, s.kv_splits > 1, s.warp_keys, s.tma_kv, s.mbarrier_ring), plan)
    assert len(picked) >= 4, list(picked)
    _assert_plans_match_float32_attention(list(picked.values()), cuda_device, kernel_cache)


def _assert_plans_match_float32_attention(chosen, cuda_device, kernel_cache) -> None:
    """Each plan's kernel (one problem), into a NaN-poisoned output, within bf16 tolerance of float32 attention."""
    import torch

    from cherenkov.codegen.launch import operand_view
    from cherenkov.search.measure import TOLERANCE, float32_attention

    problem = chosen[0].problem
    generator = torch.Generator(device=cuda_device).manual_seed(0)
    stored = {n: torch.randn(s, generator=generator, device=cuda_device).to(torch.bfloat16)
              for n, s in problem.stored_shapes().items()}  # fmt: skip
    reference = float32_attention(problem, *(operand_view(problem, r, stored[problem.name(r)]) for r in "qkv"))
    failures = []
    for plan, build in zip(chosen, compile_plans(chosen, cache_dir=kernel_cache)):
        assert not isinstance(build, Exception), build
        out = torch.full(problem.layout("o").shape, float("nan"), dtype=torch.bfloat16, device=cuda_device)
        load_kernel(build, 0)(stored["q"], stored["k"], stored["v"], out)
        torch.cuda.synchronize()
        error = float((out.float() - reference).norm() / reference.norm())
        if not error <= TOLERANCE["bf16"]:
            failures.append((plan.name, error))
    assert not failures, failures
