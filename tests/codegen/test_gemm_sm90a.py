"""The sm_90a ``wgmma`` GEMM family of contraction kernels: which plans are offered (CPU),
every schedule compiled for sm_90a with no spills, HGMMA in its SASS and no local memory
(CPU, nvcc), and every schedule against torch's float32 matmul on random inputs (GPU):
tails in M, N and K, A and B in both memory orders, odd N (unpaired stores), a fused
bias + GELU epilogue, batched fp16 matmuls, and split-K on few-tile problems (launched
twice: the arrival counters reset, and the result is the same bits). A matmul that absorbs
the RMSNorm feeding it runs in the TMA kernel (A from registers: CPU, nvcc, SASS) and the
mma kernel, and matches torch's norm and matmul with and without a weight, with tails, in
fp16 (GPU). TMA GEMMs that store through shared memory (checked on CPU: valid outputs,
the tensor map, UTMASTG) run in the same GPU cases; where the output's rows are not 16-byte
aligned (odd N) the threads copy the staged boxes out (``copy_out``: the copy checked on the
CPU by running its generated C++ on the host, every element once and every 4-byte store
aligned). An LM head's logits viewed as ``(B, T, V)`` absorb the matmul into one TMA GEMM
whose rows are the merged tokens (CPU: plans, nvcc; GPU: against torch)."""

from __future__ import annotations

import math
import re
import shutil
import subprocess
from dataclasses import replace

import numpy as np

import pytest

import cherenkov as ck
from cherenkov.codegen import compile_plans, cuda_source, load_kernel, term_plans
from cherenkov.codegen.cuda.term_kernels import term_dynamic_smem
from cherenkov.codegen.errors import CodegenError
from cherenkov.codegen.report import parse_ptxas_report
from cherenkov.codegen.cuda.gemm_sm90a_tma import OperandMap, copy_out_lambda, tensor_maps, tma_stores
from cherenkov.codegen.term_plan import (
    TMA_GEMM_SCHEDULES,
    GemmSchedule,
    WGMMA_GEMM_SCHEDULES,
    WGMMA_SPLIT_K_TILES,
    TermKernelPlan,
    TmaGemmSchedule,
    WgmmaGemmSchedule,
    epilogue_sources,
    gemm_layout,
    term_plan_problems,
    wgmma_schedules,
    wgmma_smem_bytes,
    shifted_cores,
)
from cherenkov.rewrites.kernels import absorptions
from cherenkov.rewrites.plan import TARGETS
from cherenkov.search.cost_model import predict_term
from tests.codegen.emulator import PRELUDE, launch_blocks
from tests.codegen.rotary_graphs import rope_projection_graph, rope_reference

SM90A = TARGETS["sm_90a"]
TOLERANCE = 2e-2


# ------------------------------------------------------------------------------ graphs


def matmul_graph(ta: bool, tb: bool, m: int, n: int, k: int, dtype: str = "bf16") -> ck.Graph:
    """``y = a @ b`` with ``a`` stored ``(k, m)`` when ``ta`` and ``b`` stored ``(n, k)`` when ``tb``."""
    g = ck.Graph("matmul")
    a = g.input("a", (k, m) if ta else (m, k), dtype)
    b = g.input("b", (n, k) if tb else (k, n), dtype)
    g.output((a.transpose(0, 1) if ta else a) @ (b.transpose(0, 1) if tb else b), "y")
    return g


def bias_gelu_graph(m: int = 200, n: int = 328, k: int = 136) -> ck.Graph:
    g = ck.Graph("bias_gelu")
    a, b, bias = g.input("a", (m, k), "bf16"), g.input("b", (k, n), "bf16"), g.input("bias", (n,), "bf16")
    g.output(ck.nn.gelu(a @ b + bias), "y")
    return g


def batched_graph(batch: int = 3, m: int = 200, n: int = 328, k: int = 136) -> ck.Graph:
    g = ck.Graph("bmm")
    g.output(g.input("a", (batch, m, k), "fp16") @ g.input("b", (batch, k, n), "fp16"), "y")
    return g


def batched_bias_gelu_graph(batch: int = 2, m: int = 72, n: int = 200, k: int = 1032) -> ck.Graph:
    """Few tiles and a long K (split-K), batched fp16, with a bias + GELU epilogue."""
    g = ck.Graph("bmm_bias_gelu")
    a, b = g.input("a", (batch, m, k), "fp16"), g.input("b", (batch, k, n), "fp16")
    g.output(ck.nn.gelu(a @ b + g.input("bias", (n,), "fp16")), "y")
    return g


def gated_graph(m: int = 200, n: int = 328, k: int = 136) -> ck.Graph:
    """A SwiGLU half: ``silu(a @ b) * u``, ``u`` an ``M × N`` source the epilogue reads."""
    g = ck.Graph("gated")
    a, b, u = g.input("a", (m, k), "bf16"), g.input("b", (k, n), "bf16"), g.input("u", (m, n), "bf16")
    g.output(ck.nn.silu(a @ b) * u, "y")
    return g


def residuals_graph(m: int = 200, n: int = 328, k: int = 136) -> ck.Graph:
    """A down projection and a decoder layer's two residuals: ``a @ b + r + s``."""
    g = ck.Graph("residuals")
    a, b = g.input("a", (m, k), "bf16"), g.input("b", (k, n), "bf16")
    g.output(a @ b + g.input("r", (m, n), "bf16") + g.input("s", (m, n), "bf16"), "y")
    return g


def merged_tokens_graph(batch: int = 2, tokens: int = 100, n: int = 328, k: int = 136) -> ck.Graph:
    """GPT-2's projections: ``x (B, T, K)`` as ``B·T`` rows (read ``x[i // T, i % T, k]``) by a
    ``(K, N)`` weight, plus a residual of the output's shape read the same way."""
    g = ck.Graph("merged_tokens")
    x, w = g.input("x", (batch, tokens, k), "bf16"), g.input("w", (k, n), "bf16")
    rows = x.reshape(batch * tokens, k) @ w
    g.output(rows + g.input("r", (batch, tokens, n), "bf16").reshape(batch * tokens, n), "y")
    return g


def lm_head_graph(batch: int = 2, tokens: int = 100, vocab: int = 327, k: int = 136) -> ck.Graph:
    """GPT-2's LM head: ``x (B, T, K)`` as ``B·T`` rows by a tied ``(V, K)`` embedding, the
    ``(B·T, V)`` logits viewed as ``(B, T, V)`` (a vocabulary of odd size: rows of the output
    not 16-byte aligned)."""
    g = ck.Graph("lm_head")
    x, w = g.input("x", (batch, tokens, k), "bf16"), g.input("w", (vocab, k), "bf16")
    g.output((x.reshape(batch * tokens, k) @ w.transpose(0, 1)).reshape(batch, tokens, vocab), "y")
    return g


def prologue_graph() -> ck.Graph:
    """A contraction whose A operand is evaluated (a scale and SiLU prologue)."""
    g = ck.Graph("prologue")
    x, w, proj = g.input("x", (40, 96), "bf16"), g.input("w", (96,), "bf16"), g.input("proj", (96, 72), "bf16")
    g.output(ck.nn.silu(x * w) @ proj, "y")
    return g


def rms_matmul_graph(m: int, k: int, n: int, weight: bool = True, dtype: str = "bf16") -> ck.Graph:
    g = ck.Graph("rms_matmul")
    x, proj = g.input("x", (m, k), dtype), g.input("proj", (k, n), dtype)
    g.output(ck.nn.rms_norm(x, g.input("w", (k,), dtype) if weight else None, eps=1e-5) @ proj, "y")
    return g


def absorbed_plans(graph: ck.Graph) -> list[TermKernelPlan]:
    """The plans of the matmul that absorbs the graph's RMSNorm kernel."""
    d = ck.derive(graph)
    shapes, dtypes = d.tensor_types()
    ((_, fused),) = absorptions(d.kernels, frozenset(graph.outputs)).values()
    return term_plans(fused, shapes, dtypes, SM90A)


def view_plans(graph: ck.Graph) -> list[TermKernelPlan]:
    """The plans of a matmul over merged rows that the graph reads through their split (an LM head):
    its one kernel, which computes the view itself."""
    d = ck.derive(graph)
    shapes, dtypes = d.tensor_types()
    (kernel,) = d.kernels
    return term_plans(kernel, shapes, dtypes, SM90A)


def rope_plans(graph: ck.Graph, target=SM90A) -> list[TermKernelPlan]:
    """The plans of the projection that runs the graph's RoPE in its epilogue."""
    d = ck.derive(graph)
    shapes, dtypes = d.tensor_types()
    ((_, fused),) = absorptions(d.kernels, frozenset(graph.outputs)).values()
    return term_plans(fused, shapes, dtypes, target)


ROPE_GRAPHS = {
    "d64_tails": lambda: rope_projection_graph(200, 4, 64, 136),
    "d128_llama_heads": lambda: rope_projection_graph(1000, 8, 128, 512),
}


NORM_GRAPHS = {
    "weight_1024x1536x2048": lambda: rms_matmul_graph(1024, 1536, 2048),
    "no_weight_tails_200x1024x328": lambda: rms_matmul_graph(200, 1024, 328, weight=False),
    "fp16_130x512x136": lambda: rms_matmul_graph(130, 512, 136, dtype="fp16"),
}

GRAPHS = {
    "nn_4096": lambda: matmul_graph(False, False, 4096, 4096, 4096),
    **{f"{'t' if ta else 'n'}{'t' if tb else 'n'}_tails": (lambda ta=ta, tb=tb: matmul_graph(ta, tb, 200, 328, 136))
       for ta in (False, True) for tb in (False, True)},
    "bias_gelu": bias_gelu_graph,
    "bmm_fp16": batched_graph,
    "split_tails": lambda: matmul_graph(False, False, 72, 328, 1000),
    "split_nt_odd_n": lambda: matmul_graph(False, True, 72, 327, 1000),
    "split_bmm_bias_gelu": batched_bias_gelu_graph,
    "gated_tails": gated_graph,
    "residuals_tails": residuals_graph,
    "merged_tokens": merged_tokens_graph,
}  # fmt: skip


def contraction_plans(graph: ck.Graph, target=SM90A) -> list[TermKernelPlan]:
    d = ck.derive(graph)
    shapes, dtypes = d.tensor_types()
    (kernel,) = [k for k in d.kernels if k.kind == "contraction"]
    return term_plans(kernel, shapes, dtypes, target)


def wgmma_plans(graph: ck.Graph) -> list[TermKernelPlan]:
    return [p for p in contraction_plans(graph) if p.family == "wgmma"]


# ------------------------------------------------------------------------------ plans


def test_every_schedule_is_offered_first_on_sm90a() -> None:
    for name, build in GRAPHS.items():
        plans = contraction_plans(build())
        layout = gemm_layout(plans[0].kernel, plans[0].tensor_map)
        offered = wgmma_schedules(layout)
        valid = [p.schedule for p in plans if p.family == "wgmma"]
        assert [p.schedule for p in plans[: len(valid)]] == valid, name
        assert valid == [s for s in offered if s in valid], name
        assert [s for s in valid if isinstance(s, WgmmaGemmSchedule)][: len(WGMMA_GEMM_SCHEDULES)] == list(
            WGMMA_GEMM_SCHEDULES
        ), name
        tma_offered = [s for s in valid if isinstance(s, TmaGemmSchedule)]
        stores = layout.n % 8 == 0  # 16-byte output rows: TMA stores; else the threads copy the boxes out
        sources = len(epilogue_sources(plans[0].kernel, layout, plans[0].tensor_map))
        expected = [s for s in TMA_GEMM_SCHEDULES
                    if (not s.store_boxes or stores != s.copy_out) and s.staged_sources <= sources]  # fmt: skip
        assert tma_offered == ([] if layout.batch_size > 1 else expected), name
        assert {p.family for p in plans} == {"wgmma", "mma", "pointwise"}, name


def test_tma_needs_plain_matrices_and_says_why() -> None:
    plan = next(p for p in contraction_plans(batched_graph()) if p.family == "wgmma")
    bad = TermKernelPlan(plan.kind, plan.kernel, TMA_GEMM_SCHEDULES[0], SM90A, plan.tensors)
    assert any("no batch" in reason for reason in term_plan_problems(bad))
    plain, staged = TmaGemmSchedule(128, 256, 64, 2, 4, True), TmaGemmSchedule(128, 256, 64, 2, 4, True, 2)
    assert plain.threads == 384 and plain.key() == "wgmma_tma_m128_n256_k64_wg2_s4_p"
    assert wgmma_smem_bytes(plain) == 4 * (128 + 256) * 64 * 2 + 1024 + 2 * 4 * 8
    assert staged.key() == "wgmma_tma_m128_n256_k64_wg2_s4_p_o2"
    assert wgmma_smem_bytes(staged) == wgmma_smem_bytes(plain) + 2 * 2 * 64 * 128 <= SM90A.smem_per_block


@pytest.mark.parametrize(
    "graph, schedule, reason",
    [
        ("split_nt_odd_n", TmaGemmSchedule(128, 256, 64, 2, 4, True, 2), "multiple of 16 bytes"),
        ("nn_tails", TmaGemmSchedule(128, 256, 64, 2, 4, True, 3), "store_boxes 3"),
        ("nn_tails", TmaGemmSchedule(128, 64, 64, 2, 6, True, 2), "whole number of rounds"),
    ],
)
def test_tma_stores_need_a_plain_output_and_say_why(graph, schedule, reason) -> None:
    plan = wgmma_plans(GRAPHS[graph]())[0]
    bad = TermKernelPlan(plan.kind, plan.kernel, schedule, SM90A, plan.tensors)
    assert any(reason in p for p in term_plan_problems(bad)), term_plan_problems(bad)
    good = TermKernelPlan(plan.kind, plan.kernel, TmaGemmSchedule(128, 256, 64, 2, 4, True), SM90A, plan.tensors)
    assert not term_plan_problems(good)


def test_tma_tensor_maps_follow_the_layouts() -> None:
    for ta, tb, expected in (
        (False, False, (OperandMap("a", (136, 200), 272, (64, 128)), OperandMap("b", (328, 136), 656, (64, 64)))),
        (True, True, (OperandMap("a", (200, 136), 400, (64, 64)), OperandMap("b", (136, 328), 272, (64, 256)))),
    ):
        plans = {p.schedule.store_boxes: p for p in wgmma_plans(matmul_graph(ta, tb, 200, 328, 136))
                 if isinstance(p.schedule, TmaGemmSchedule) and p.schedule.block_n == 256 and p.schedule.persistent
                 and not p.schedule.pingpong}
        assert tensor_maps(plans[0]) == expected
        assert tensor_maps(plans[2]) == (*expected, OperandMap("y", (328, 200), 656, (64, 64))), "the output's"
    pingpong = next(p for p in wgmma_plans(matmul_graph(False, False, 200, 328, 136))
                    if isinstance(p.schedule, TmaGemmSchedule) and p.schedule.pingpong and p.schedule.block_m == 64)
    assert tensor_maps(pingpong)[0] == OperandMap("a", (136, 200), 272, (64, 64)), "a warpgroup's own 64 rows"


def test_a_batch_of_one_is_a_plain_matrix_for_tma() -> None:
    """A projection of ``x (1, S, K)`` (a captured module's input, read ``x[0, s, k]``) by an
    ``nn.Linear`` weight ``(N, K)``: TMA maps of the matrices without the unit batch, and TMA
    stores of the ``(1, S, N)`` output."""
    g = ck.Graph("projection")
    x, w = g.input("x", (1, 200, 136), "bf16"), g.input("w", (328, 136), "bf16")
    g.output(x @ w.transpose(0, 1), "y")
    plans = {p.schedule.store_boxes: p for p in wgmma_plans(g)
             if isinstance(p.schedule, TmaGemmSchedule) and p.schedule.block_n == 256 and p.schedule.persistent}  # fmt: skip
    assert set(plans) == {0, 1, 2}
    maps = tensor_maps(plans[2])
    assert {m.tensor for m in maps} == {"x", "w", "y"} and all(len(m.dims) == 2 for m in maps)
    assert sorted(m.dims for m in maps) == sorted([(136, 200), (136, 328), (328, 200)])


def test_tokens_of_a_batch_merged_into_rows_are_a_plain_matrix_for_tma() -> None:
    """``x (B, T, K)`` read as ``B·T`` rows (``x[i // T, i % T, k]``: a contiguous buffer's
    rows) is a plain matrix: TMA plans with 2-D maps of ``B·T`` rows, and the residual read
    the same way is a staged source."""
    plans = [p for p in wgmma_plans(merged_tokens_graph()) if isinstance(p.schedule, TmaGemmSchedule)]
    assert plans, "the TMA kernel reads the merged rows"
    staged = next(p for p in plans if p.schedule.staged_sources)
    assert sorted(m.dims for m in tensor_maps(staged)) == sorted([(136, 200), (328, 136), (328, 200), (328, 200)])


def test_copy_out_is_for_output_rows_tma_stores_cannot_write() -> None:
    """Odd N (rows of 654 bytes): the staged schedules copy their boxes out by threads (no
    tensor map of the output, no TMA store, the odd N's last column read in range), and say
    why not where TMA stores can, without staging boxes, or with staged sources."""
    plans = {p.schedule: p for p in wgmma_plans(GRAPHS["split_nt_odd_n"]()) if isinstance(p.schedule, TmaGemmSchedule)}
    copied = TmaGemmSchedule(128, 256, 64, 2, 4, True, 2, copy_out=True)
    assert copied.key() == "wgmma_tma_m128_n256_k64_wg2_s4_p_o2_copy"
    assert {s for s in plans if s.store_boxes} == {s for s in TMA_GEMM_SCHEDULES if s.copy_out}
    plan = plans[copied]
    assert [m.tensor for m in tensor_maps(plan)] == ["a", "b"], "no tensor map of the output"
    text = cuda_source(plan)
    assert "y_map" not in text and "tma_store_2d" not in text and "copy_out(box, " in text
    assert "min(n + 1, N - 1)" in text, "column n + 1 past the odd N is read in range (its value is not stored)"
    aligned = wgmma_plans(GRAPHS["nn_tails"]())[0]
    for base, schedule, reason in (
        (aligned, copied, "TMA stores write them"),
        (plan, replace(copied, store_boxes=0), "copy_out copies the staging boxes out"),
        (plan, replace(copied, staged_sources=1), "not with copy_out"),
    ):  # fmt: skip
        problems = term_plan_problems(replace(base, schedule=schedule))
        assert any(reason in p for p in problems), (schedule, problems)


COPY_OUT_HARNESS = r"""
typedef unsigned int u32;
constexpr int M = {m}, N = {n}, STORE_BOX = 64;
constexpr u32 ROW_BYTES = 128;
alignas(16) static unsigned char emu_box[STORE_BOX * ROW_BYTES];
static inline u32 ld_shared_u32(u32 addr) {{ u32 v; std::memcpy(&v, emu_box + addr, 4); return v; }}
static inline u32 __shfl_up_sync(unsigned, u32 v, int delta) {{
    EmuWarp& w = emu_warp();
    const int lane = emu_lane();
    w.words[lane][0] = v;
    w.bar.arrive_and_wait();
    const u32 r = w.words[lane >= delta ? lane - delta : lane][0];
    w.bar.arrive_and_wait();
    return r;
}}
// byte i of the result is byte (s >> 4i) & 7 of the eight bytes y:x (x the low four)
static inline u32 __byte_perm(u32 x, u32 y, u32 s) {{
    const unsigned long long v = x | static_cast<unsigned long long>(y) << 32;
    u32 r = 0;
    for (int i = 0; i < 4; ++i) r |= u32((v >> (8 * ((s >> (4 * i)) & 7))) & 0xffu) << (8 * i);
    return r;
}}
static inline void st_global_b32(void* at, u32 value) {{
    if (reinterpret_cast<std::uintptr_t>(at) % 4) std::abort();  // a misaligned 4-byte store faults on a GPU
    std::memcpy(at, &value, 4);
}}
static inline void st_global_b16(void* at, u32 value) {{
    const unsigned short half = static_cast<unsigned short>(value);
    std::memcpy(at, &half, 2);
}}
void copy_box(unsigned short* y, int row0, int col0) {{
    const int warp = threadIdx.x / 32, lane = threadIdx.x & 31;
{copy_out}
    copy_out(0, row0, col0);
}}
int main(int argc, char** argv) {{
    const int row0 = std::atoi(argv[1]), col0 = std::atoi(argv[2]);
    for (int r = 0; r < STORE_BOX; ++r)  // element (r, c) is 64 r + c; chunk c / 8 of row r at chunk (c / 8) ^ (r % 8)
        for (int c = 0; c < STORE_BOX; ++c) {{
            const unsigned short value = static_cast<unsigned short>(STORE_BOX * r + c);
            std::memcpy(emu_box + r * ROW_BYTES + (((c / 8) ^ (r % 8)) << 4) + 2 * (c % 8), &value, 2);
        }}
    std::vector<unsigned short> y(static_cast<size_t>(M) * N, 0xffff);
    {launch}
    std::fwrite(y.data(), 2, y.size(), stdout);
}}
"""


@pytest.mark.parametrize(
    "m, n, row0, col0",
    [
        (130, 327, 64, 256),  # a whole box, odd N: rows start at even and odd elements in turn
        (130, 327, 128, 320),  # two rows and seven columns left
        (70, 319, 64, 256),  # 63 columns: an odd row's last pair and column 63 past N
        (130, 330, 0, 256),  # even N (rows of 660 bytes): every row starts at an even element
    ],
)
def test_copy_out_stores_every_element_of_a_box_once_with_aligned_words(tmp_path, m, n, row0, col0) -> None:
    """The generated ``copy_out`` run on the host (a CUDA thread a fiber, warp
    shuffles through the emulator's warp buffers): the box's elements in range land at their
    output elements, nothing else is written, and every 4-byte store is 4-byte aligned."""
    compiler = shutil.which("g++")
    if compiler is None:
        pytest.skip("no g++ to run the copy on the host")
    launch = launch_blocks("copy_box", (1, 1, 1), 128, "y.data(), row0, col0")
    lambda_text = "\n".join("    " + line for line in copy_out_lambda("y", "int"))
    harness = COPY_OUT_HARNESS.format(m=m, n=n, copy_out=lambda_text, launch=launch)
    source = "#define CK_EMU_MMA_FP16 0\n" + PRELUDE + harness  # the prelude's scale_pair names the macro
    (tmp_path / "copy_out.cpp").write_text(source)
    binary = tmp_path / "copy_out"
    build = subprocess.run([compiler, "-std=c++20", "-O1", "-pthread", "-w", "-o", str(binary),
                            str(tmp_path / "copy_out.cpp")], capture_output=True, text=True)  # fmt: skip
    assert build.returncode == 0, build.stderr[:4000]
    run = subprocess.run([str(binary), str(row0), str(col0)], capture_output=True, timeout=120)
    assert run.returncode == 0, "a misaligned 4-byte store (or a crash)"
    got = np.frombuffer(run.stdout, dtype=np.uint16).reshape(m, n)
    expected = np.full((m, n), 0xFFFF, dtype=np.uint16)
    rows, cols = min(64, m - row0), min(64, n - col0)
    expected[row0:row0 + rows, col0:col0 + cols] = 64 * np.arange(rows)[:, None] + np.arange(cols)[None, :]
    np.testing.assert_array_equal(got, expected)


def test_a_view_of_a_matmul_runs_in_the_tma_gemm() -> None:
    """An LM head's ``(B·T, V)`` logits viewed as ``(B, T, V)``: one matmul computes the view,
    its operand ``x`` read as a plain matrix of ``B·T`` rows; with an odd vocabulary the staged
    schedules copy their boxes out."""
    plans = view_plans(lm_head_graph())
    tma = [p for p in plans if isinstance(p.schedule, TmaGemmSchedule)]
    assert [p.schedule for p in tma] == [s for s in TMA_GEMM_SCHEDULES if not s.store_boxes or s.copy_out]
    assert tma[0].kernel.axes == ("i0:2", "i1:100", "i2:327") and tma[0].output.shape == (2, 100, 327)
    assert sorted(m.dims for m in tensor_maps(tma[0])) == [(136, 200), (136, 327)]


def test_epilogue_sources_are_output_shaped_reads() -> None:
    """A residual or a gated product's other factor read at the output's own element is a
    source; a bias vector, a transposed matrix or an operand of the contraction is not."""

    def sources(graph: ck.Graph) -> list[str]:
        plan = wgmma_plans(graph)[0]
        return [r[1] for r in epilogue_sources(plan.kernel, gemm_layout(plan.kernel, plan.tensor_map),
                                               plan.tensor_map)]  # fmt: skip

    assert sources(gated_graph()) == ["u"]
    assert sources(residuals_graph()) == ["r", "s"]
    assert sources(bias_gelu_graph()) == [] and sources(matmul_graph(False, False, 200, 328, 136)) == []
    g = ck.Graph("transposed_residual")
    a, b, r = g.input("a", (200, 136), "bf16"), g.input("b", (136, 328), "bf16"), g.input("r", (328, 200), "bf16")
    g.output(a @ b + r.transpose(0, 1), "y")
    assert sources(g) == []


@pytest.mark.parametrize(
    "graph, schedule, reason",
    [
        ("nn_tails", TmaGemmSchedule(128, 256, 64, 2, 4, True, 2, 1), "reads 0 M x N source"),
        ("gated_tails", TmaGemmSchedule(128, 256, 64, 2, 3, True, 2, 2), "reads 1 M x N source"),
        ("gated_tails", TmaGemmSchedule(128, 256, 64, 2, 4, True, 0, 1), "store_boxes > 0"),
        ("residuals_tails", TmaGemmSchedule(128, 256, 64, 2, 4, True, 2, 2), "shared memory"),
    ],
)
def test_staged_sources_need_sources_staging_and_room(graph, schedule, reason) -> None:
    plan = wgmma_plans(GRAPHS[graph]())[0]
    bad = TermKernelPlan(plan.kind, plan.kernel, schedule, SM90A, plan.tensors)
    assert any(reason in p for p in term_plan_problems(bad)), term_plan_problems(bad)


def test_staged_sources_have_their_boxes_maps_and_loads() -> None:
    one, two = TmaGemmSchedule(128, 256, 64, 2, 4, True, 2, 1), TmaGemmSchedule(128, 256, 64, 2, 3, True, 2, 2)
    assert one.key() == "wgmma_tma_m128_n256_k64_wg2_s4_p_o2_src1" and one.staging_boxes == 2
    assert wgmma_smem_bytes(one) == wgmma_smem_bytes(replace(one, staged_sources=0)) + 2 * 2 * 8
    assert wgmma_smem_bytes(two) == 3 * 384 * 64 * 2 + 1024 + 2 * 3 * 8 + 2 * 2 * 2 * 64 * 128 + 2 * 2 * 8
    plans = {p.schedule: p for p in wgmma_plans(residuals_graph())}
    y, r, s = (OperandMap(name, (328, 200), 656, (64, 64)) for name in "yrs")
    assert tensor_maps(plans[one])[2:] == (y, r) and tensor_maps(plans[two])[2:] == (y, r, s)
    text = cuda_source(plans[two])
    assert "TensorMap s0_map" in text and "TensorMap s1_map" in text and "constexpr int SOURCES = 2;" in text
    assert "tma_load_2d(source_box(1, buffer), &s1_map, bar, column, row);" in text
    assert "unpack_lo(src0)" in text and "unpack_hi(src1)" in text
    assert "ck_from_bf16(t_" not in text, "the staged sources are not read from global memory"
    once = cuda_source(plans[one])
    assert "unpack_lo(src0)" in once and "ck_from_bf16(t_s[" in once, "the second source is read as before"


def test_rope_runs_in_the_tma_gemm_epilogue_and_says_where_not() -> None:
    """The projection with its RoPE epilogue: TMA GEMMs that store from registers (the
    output is the heads-first ``(H, S, D)`` of the RoPE kernel, not an M x N matrix), with
    tiles of whole heads; the partner is the accumulator D/2 columns on."""
    plans = rope_plans(ROPE_GRAPHS["d64_tails"]())
    assert {p.family for p in plans} == {"wgmma", "pointwise"}
    assert [p.schedule for p in plans if p.family == "wgmma"] == [
        s for s in TMA_GEMM_SCHEDULES if not s.store_boxes and not s.staged_sources]
    text = cuda_source(plans[0])
    assert "acc[mi][(4 * c + e + 16 + ACC) % ACC]" in text and "acc[mi][(4 * c + e + -15 + ACC) % ACC]" in text
    assert "t_t0" not in text, "the projection's buffer is not read: its values are the accumulators"
    layout = gemm_layout(plans[0].kernel, plans[0].tensor_map)
    assert shifted_cores(plans[0].kernel, layout) and layout.n_axes[-1].endswith(":64")
    assert not term_plan_problems(replace(plans[0], schedule=TmaGemmSchedule(128, 64, 64, 2, 6, True))), "D 64"
    d128 = rope_plans(ROPE_GRAPHS["d128_llama_heads"]())[0]
    for plan, schedule, reason in (
        (plans[0], GemmSchedule(), "TMA wgmma GEMM only"), (plans[0], WgmmaGemmSchedule(), "TMA wgmma GEMM only"),
        (d128, TmaGemmSchedule(128, 64, 64, 2, 6, True), "whole periods of 128"),
        (plans[0], TmaGemmSchedule(128, 256, 64, 2, 4, True, 2), "not a row-major M x N"),
    ):  # fmt: skip
        bad = replace(plan, schedule=schedule)
        assert any(reason in p for p in term_plan_problems(bad)), (schedule, term_plan_problems(bad))


def test_split_k_only_for_few_tiles() -> None:
    def splits(m: int, n: int, k: int) -> dict[tuple[int, int], int]:
        plans = wgmma_plans(matmul_graph(False, False, m, n, k))
        return {(p.schedule.block_m, p.schedule.block_n): p.schedule.split_k for p in plans if p.schedule.split_k > 1}

    assert splits(4096, 4096, 4096) == {}, "512 tiles or more fill the GPU"
    assert splits(200, 328, 136) == {}, "3 k steps cannot be split"
    # decode-sized: 64 tokens, K 8192 -> at least 128 blocks, at least 4 k steps a split
    assert splits(64, 2048, 8192) == {(64, 128): 8, (64, 64): 4, (128, 128): 8}
    assert splits(64, 8192, 2048) == {(64, 128): 2, (128, 128): 2}, "64x64: 128 tiles already"


def test_every_offered_schedule_runs_in_a_gpu_case() -> None:
    covered = {p.schedule for build, _ in GPU_CASES.values() for p in wgmma_plans(build())}
    assert set(WGMMA_GEMM_SCHEDULES) | set(TMA_GEMM_SCHEDULES) <= covered
    assert {(s.block_m, s.block_n, s.consumer_warpgroups, s.stages) for s in covered if s.split_k > 1} == {
        (s.block_m, s.block_n, s.consumer_warpgroups, s.stages) for s in WGMMA_SPLIT_K_TILES
    }


def test_not_offered_for_other_targets() -> None:
    for arch in ("sm_80", "sm_90", "sm_120"):
        assert not [p for p in contraction_plans(GRAPHS["nn_tails"](), TARGETS[arch]) if p.family == "wgmma"]
    plan = wgmma_plans(GRAPHS["nn_tails"]())[0]
    wrong = TermKernelPlan(plan.kind, plan.kernel, plan.schedule, TARGETS["sm_90"], plan.tensors)
    assert any("sm_90a" in reason for reason in term_plan_problems(wrong))
    with pytest.raises(CodegenError, match="sm_90a"):
        cuda_source(wrong)


def test_not_offered_for_evaluated_operands() -> None:
    plans = contraction_plans(prologue_graph())
    assert plans and not [p for p in plans if p.family == "wgmma"]
    assert [p for p in plans if p.family == "mma"], "the mma.sync family still runs the prologue"
    mma = next(p for p in plans if p.family == "mma")
    forced = TermKernelPlan(mma.kind, mma.kernel, WGMMA_GEMM_SCHEDULES[0], SM90A, mma.tensors)
    assert any("evaluated" in reason for reason in term_plan_problems(forced))


def test_an_absorbed_rms_norm_runs_in_the_tma_and_mma_families() -> None:
    plans = absorbed_plans(NORM_GRAPHS["weight_1024x1536x2048"]())
    # the weight (3 KiB of static shared memory) leaves room for one staging box a warpgroup beside the
    # largest rings, two beside the ping-pong 64x256's
    fits = [s for s in TMA_GEMM_SCHEDULES if not s.staged_sources and not s.copy_out
            and wgmma_smem_bytes(s) + 2 * 1536 <= SM90A.smem_per_block]
    assert [s for s in fits if s.store_boxes == 2] == [TmaGemmSchedule(64, 256, 64, 2, 4, True, 2, pingpong=True)]
    assert [p.schedule for p in plans if p.family == "wgmma"] == fits
    assert {p.family for p in plans} == {"wgmma", "mma", "pointwise"}
    layout = gemm_layout(plans[0].kernel, plans[0].tensor_map)
    assert layout.norm is not None and layout.norm_operand == "a" and layout.a == layout.norm.x
    assert plans[0].flops == 2.0 * 1024 * 1536 * 2048, "the norm's work is counted once a row, not once an output"
    forced = TermKernelPlan(plans[0].kind, plans[0].kernel, WGMMA_GEMM_SCHEDULES[0], SM90A, plans[0].tensors)
    assert any("TMA wgmma GEMM or the mma.sync GEMM only" in reason for reason in term_plan_problems(forced))
    assert not term_plan_problems(TermKernelPlan(plans[0].kind, plans[0].kernel, GemmSchedule(), SM90A,
                                                 plans[0].tensors))  # fmt: skip
    ragged = absorbed_plans(rms_matmul_graph(128, 1000, 256))
    assert not [p for p in ragged if p.family == "wgmma"], "K 1000: the weight is read whole k steps at a time"
    assert [p for p in ragged if p.family == "mma"], "the mma GEMM clamps the weight's tail"


@pytest.mark.parametrize(
    "schedule, reason",
    [
        (WgmmaGemmSchedule(block_k=32), "block_k"),
        (WgmmaGemmSchedule(256, 256, 64, 2, 3), "accumulators"),
        (WgmmaGemmSchedule(128, 256, 64, 2, 5), "shared memory"),
        (WgmmaGemmSchedule(128, 96, 64, 2, 4), "block_n"),
        (WgmmaGemmSchedule(192, 128, 64, 1, 4), "m64"),
        (WgmmaGemmSchedule(128, 128, 64, 2, 2), "stages"),
        (WgmmaGemmSchedule(64, 128, 64, 1, 6, 0), "split_k 0"),
        (WgmmaGemmSchedule(64, 128, 64, 1, 6, 2), "k steps"),
        (WgmmaGemmSchedule(64, 64, 64, 1, 8, 64), "grids of fewer than"),
        (TmaGemmSchedule(128, 256, 64, 2, 4, True, 2, pingpong=True), "256 fp32 accumulators"),
        (TmaGemmSchedule(128, 128, 64, 2, 6, False, 2, pingpong=True), "pingpong takes a persistent block"),
        (TmaGemmSchedule(128, 128, 64, 1, 6, True, 2, pingpong=True), "two consumer warpgroups"),
    ],
)
def test_invalid_schedules_say_why(schedule, reason) -> None:
    plan = wgmma_plans(GRAPHS["nn_tails"]())[0]  # 200x328x136: 3 k steps; 64x64 tiles: 24
    bad = TermKernelPlan(plan.kind, plan.kernel, schedule, SM90A, plan.tensors)
    assert any(reason in p for p in term_plan_problems(bad)), term_plan_problems(bad)


def test_schedules_and_shared_memory() -> None:
    default = WgmmaGemmSchedule()
    assert default.threads == 256 and default.accumulators == 128 and default.key() == "wgmma_m128_n256_k64_wg2_s4"
    assert wgmma_smem_bytes(default) == 4 * (128 + 256) * 64 * 2 + 1024
    for plan in wgmma_plans(GRAPHS["nn_tails"]()):
        assert term_dynamic_smem(plan) == wgmma_smem_bytes(plan.schedule) <= SM90A.smem_per_block
        producer = isinstance(plan.schedule, TmaGemmSchedule)  # one more warpgroup
        assert plan.schedule.threads == 128 * (plan.schedule.consumer_warpgroups + producer)


def test_pingpong_warpgroups_own_whole_tiles_and_take_turns() -> None:
    """A ping-pong consumer multiplies a whole tile (its A box spans the tile's rows), only
    its four warps release a ring buffer, and two turn mbarriers (16 bytes more shared memory)
    order the warpgroups' k steps; the cooperative kernel has none of that."""
    pingpong = TmaGemmSchedule(128, 128, 64, 2, 6, True, 2, pingpong=True)
    cooperative = replace(pingpong, pingpong=False)
    assert pingpong.warpgroup_m == 128 and cooperative.warpgroup_m == 64
    assert pingpong.accumulators == 128 and pingpong.key() == "wgmma_tma_m128_n128_k64_wg2_s6_p_pp_o2"
    assert wgmma_smem_bytes(pingpong) == wgmma_smem_bytes(cooperative) + 16
    plans = {p.schedule: p for p in wgmma_plans(GRAPHS["nn_tails"]())}
    turns, split = cuda_source(plans[pingpong]), cuda_source(plans[cooperative])
    assert "constexpr int WG_M = 128;" in turns and "constexpr int WG_M = 64;" in split
    assert "RELEASING_WARPS = 4;" in turns and "RELEASING_WARPS = 4 * CONSUMERS;" in split
    assert "turn = warpgroup" in turns and "TURN_BARRIERS" in turns and "TURN_BARRIERS" not in split
    assert turns.count("mbar_arrive(smem + TURN_BARRIERS") == 1 and turns.count("mbar_wait(smem + TURN_BARRIERS") == 1
    assert "const int wg_row = 0;" in turns and "const int wg_row = warpgroup * WG_M;" in split
    assert term_dynamic_smem(plans[pingpong]) == wgmma_smem_bytes(pingpong)


def test_the_cost_model_counts_a_persistent_grids_idle_last_round() -> None:
    """GPT-2's 8192 x 768 projection: 192 tiles of 128x256 on 132 SMs leave 72 SMs idle in
    the second round (192 / 264 of the time used), 384 ping-pong tiles of 128x128 fill three
    rounds but for 12 SMs (384 / 396) — the tiles the search measured fastest there."""
    plans = {p.schedule: p for p in wgmma_plans(matmul_graph(False, False, 8192, 768, 768))}
    wide = TmaGemmSchedule(128, 256, 64, 2, 4, True, 2)
    narrow = TmaGemmSchedule(128, 128, 64, 2, 6, True, 2, pingpong=True)
    assert predict_term(plans[wide]).waves == pytest.approx(192 / 264)
    assert predict_term(plans[narrow]).waves == pytest.approx(384 / 396)
    assert predict_term(plans[narrow]).ms < predict_term(plans[wide]).ms
    one_round = {p.schedule: p for p in wgmma_plans(matmul_graph(False, False, 1024, 1024, 1024))}
    assert predict_term(one_round[wide]).waves == pytest.approx(32 / 132), "32 tiles, one round"


def test_source_is_deterministic_and_follows_the_layouts() -> None:
    for name, build in GRAPHS.items():
        plans = wgmma_plans(build())
        sources = [cuda_source(p) for p in plans]
        assert sources == [cuda_source(p) for p in wgmma_plans(build())], name
        assert len(set(sources)) == len(sources), name
        layout = gemm_layout(plans[0].kernel, plans[0].tensor_map)
        suffix = ("_ta" if not layout.a_kmajor else "") + ("_tb" if not layout.b_kmajor else "")
        assert f"k16_ss_{layout.dtype}{suffix}(acc[mi]" in sources[0], name
        for line in sources[0].splitlines():
            assert line == line.rstrip() and "\t" not in line


def test_layouts_cover_both_memory_orders() -> None:
    orders = set()
    for ta in (False, True):
        for tb in (False, True):
            plan = wgmma_plans(matmul_graph(ta, tb, 200, 328, 136))[0]
            layout = gemm_layout(plan.kernel, plan.tensor_map)
            assert layout.a_fast and layout.b_fast
            orders.add((layout.a_kmajor, layout.b_kmajor))
    assert orders == {(True, True), (True, False), (False, True), (False, False)}


# ------------------------------------------------------------------------------ nvcc and SASS


def compiled_sass(nvcc, sass, plan: TermKernelPlan, tmp_path) -> str | None:
    """Compile ``plan`` for sm_90a, check ptxas's report (no spills, no stack frame, the
    wgmma pipeline not serialised) and return its SASS (None without ``cuobjdump``)."""
    output = nvcc.compile(cuda_source(plan), SM90A.arch_flag)
    report = parse_ptxas_report(output.log, f"ck_contraction_{plan.schedule.key()}", term_dynamic_smem(plan))
    assert report.spill_bytes == 0 and report.stack_frame == 0, (plan.name, report)
    assert "serialized" not in output.log, (plan.name, output.log)  # ptxas: wgmma pipeline broken
    if sass is None:
        return None
    cubin = tmp_path / f"{plan.schedule.key()}.cubin"
    cubin.write_bytes(output.cubin)
    return sass(cubin)


@pytest.mark.parametrize("graph", list(GRAPHS))
def test_every_schedule_compiles_without_spills_to_hgmma(nvcc, sass, graph, tmp_path) -> None:
    for plan in wgmma_plans(GRAPHS[graph]()):
        code = compiled_sass(nvcc, sass, plan, tmp_path)
        if code is None:
            continue
        layout = gemm_layout(plan.kernel, plan.tensor_map)
        shape = (
            f"HGMMA.64x{plan.schedule.block_n}x16.F32{'.BF16' if layout.dtype == 'bf16' else ' '}"  # fp16: no suffix
        )
        assert shape in code, plan.name
        assert (".tnspA" in code) != layout.a_kmajor and (".tnspB" in code) != layout.b_kmajor, plan.name
        assert " LDL" not in code and " STL" not in code, plan.name
        assert ("UTMALDG" in code) == isinstance(plan.schedule, TmaGemmSchedule), plan.name
        tma_stored = isinstance(plan.schedule, TmaGemmSchedule) and tma_stores(plan.schedule)
        assert ("UTMASTG" in code) == tma_stored, plan.name
        if getattr(plan.schedule, "copy_out", False):  # coalesced 4-byte stores of the copied boxes
            assert re.search(r"STG\.E desc", code) and "SHFL.UP" in code, plan.name
    if sass is None:
        pytest.skip("cuobjdump is not installed: compiled and ptxas-checked only")


@pytest.mark.parametrize("graph", list(NORM_GRAPHS))
def test_absorbed_norm_compiles_to_register_a_hgmma_without_spills(nvcc, sass, graph, tmp_path) -> None:
    for plan in [p for p in absorbed_plans(NORM_GRAPHS[graph]()) if p.family == "wgmma"]:
        code = compiled_sass(nvcc, sass, plan, tmp_path)
        if code is None:
            pytest.skip("cuobjdump is not installed: compiled and ptxas-checked only")
        assert re.search(rf"HGMMA\.64x{plan.schedule.block_n}x16\.F32\S* R\d+, R\d+, gdesc", code), plan.name
        assert "LDSM.16.M88.4" in code and "UTMALDG" in code and " LDL" not in code and " STL" not in code
        assert ("UTMASTG" in code) == bool(plan.schedule.store_boxes), plan.name


def test_a_view_of_a_matmul_compiles_without_spills(nvcc, sass, tmp_path) -> None:
    for plan in [p for p in view_plans(lm_head_graph()) if isinstance(p.schedule, TmaGemmSchedule)]:
        code = compiled_sass(nvcc, sass, plan, tmp_path)
        if code is not None:
            assert "UTMALDG" in code and "UTMASTG" not in code and " LDL" not in code, plan.name


@pytest.mark.parametrize("graph", list(ROPE_GRAPHS))
def test_rope_epilogue_compiles_without_spills(nvcc, sass, graph, tmp_path) -> None:
    for plan in [p for p in rope_plans(ROPE_GRAPHS[graph]()) if p.family == "wgmma"]:
        code = compiled_sass(nvcc, sass, plan, tmp_path)
        if code is not None:
            assert "UTMALDG" in code and f"HGMMA.64x{plan.schedule.block_n}x16" in code and " LDL" not in code


# ------------------------------------------------------------------------------ GPU


def _matmul_reference(ta: bool, tb: bool):
    def reference(torch, x: dict):
        a, b = x["a"].float(), x["b"].float()
        return (a.T if ta else a) @ (b.T if tb else b)

    return reference


# graph, and its float32 torch reference (inputs by name -> output)
GPU_CASES = {
    "nn_1024x1536x2048": (lambda: matmul_graph(False, False, 1024, 1536, 2048), _matmul_reference(False, False)),
    **{name: (GRAPHS[name], _matmul_reference(name[0] == "t", name[1] == "t"))
       for name in ("nn_tails", "nt_tails", "tn_tails", "tt_tails")},
    "bias_gelu": (bias_gelu_graph, lambda torch, x: torch.nn.functional.gelu(
        x["a"].float() @ x["b"].float() + x["bias"].float(), approximate="tanh")),
    "bmm_fp16": (batched_graph, lambda torch, x: x["a"].float() @ x["b"].float()),
    "split_tails": (GRAPHS["split_tails"], _matmul_reference(False, False)),
    "split_nt_odd_n": (GRAPHS["split_nt_odd_n"], _matmul_reference(False, True)),
    "split_bmm_bias_gelu": (batched_bias_gelu_graph, lambda torch, x: torch.nn.functional.gelu(
        x["a"].float() @ x["b"].float() + x["bias"].float(), approximate="tanh")),
    "decode_64x2048x8192": (lambda: matmul_graph(False, False, 64, 2048, 8192), _matmul_reference(False, False)),
    # 256 tiles of 128x256: persistent blocks take two, the staging boxes and the ring run on across them
    "nn_2048x4096x512": (lambda: matmul_graph(False, False, 2048, 4096, 512), _matmul_reference(False, False)),
    # staged sources: tails, and rounds of the source buffers running on across a block's tiles
    "gated_tails": (gated_graph, lambda torch, x: torch.nn.functional.silu(x["a"].float() @ x["b"].float())
                    * x["u"].float()),
    "gated_2048x4096x512": (lambda: gated_graph(2048, 4096, 512), lambda torch, x: torch.nn.functional.silu(
        x["a"].float() @ x["b"].float()) * x["u"].float()),
    "merged_tokens": (merged_tokens_graph, lambda torch, x: (x["x"].float().reshape(200, 136) @ x["w"].float()
                                                             + x["r"].float().reshape(200, 328))),
    "residuals_tails": (residuals_graph, lambda torch, x: x["a"].float() @ x["b"].float() + x["r"].float()
                        + x["s"].float()),
    "residuals_2048x4096x512": (lambda: residuals_graph(2048, 4096, 512), lambda torch, x: x["a"].float()
                                @ x["b"].float() + x["r"].float() + x["s"].float()),
}  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("case", list(GPU_CASES))
def test_every_schedule_matches_torch(gpu, case, tmp_path) -> None:
    torch = gpu
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("sm_90a kernels need a Hopper GPU")
    build, reference_of = GPU_CASES[case]
    graph = build()
    generator = torch.Generator(device="cuda").manual_seed(0)
    dtypes = {"bf16": torch.bfloat16, "fp16": torch.float16}
    inputs = {
        name: torch.randn(t.shape, generator=generator, device="cuda").to(dtypes[t.dtype])
        for name, t in graph.inputs.items()
    }
    reference = reference_of(torch, inputs)
    plans = wgmma_plans(graph)
    assert len(plans) >= len(WGMMA_GEMM_SCHEDULES)
    for plan, compiled in zip(plans, compile_plans(plans, cache_dir=tmp_path), strict=True):
        assert not isinstance(compiled, Exception), f"{plan.name}: {compiled}"
        kernel = load_kernel(compiled)
        out = torch.full(plan.output.shape, math.nan, device="cuda", dtype=dtypes[plan.output.dtype])
        kernel.launch(inputs, out)
        torch.cuda.synchronize()
        error = ((out.float() - reference).norm() / reference.norm()).item()
        assert error <= TOLERANCE, f"{plan.name}: relative L2 error {error:.3g}"  # NaN fails too
        if plan.schedule.split_k > 1:  # the counters were reset, and the partials add up in split order
            again = torch.full_like(out, math.nan)
            kernel.launch(inputs, again)
            torch.cuda.synchronize()
            assert torch.equal(again, out), f"{plan.name}: a second launch differs"


@pytest.mark.gpu
@pytest.mark.parametrize("case", list(NORM_GRAPHS))
def test_absorbed_rms_norm_matches_torch(gpu, case, tmp_path) -> None:
    """The TMA and mma GEMMs that run the RMSNorm in their main loops against torch's float32
    norm and matmul."""
    torch = gpu
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("sm_90a kernels need a Hopper GPU")
    graph = NORM_GRAPHS[case]()
    generator = torch.Generator(device="cuda").manual_seed(1)
    dtypes = {"bf16": torch.bfloat16, "fp16": torch.float16}
    inputs = {
        name: (torch.randn(t.shape, generator=generator, device="cuda") * (0.05 if name == "proj" else 1.0)).to(
            dtypes[t.dtype])
        for name, t in graph.inputs.items()
    }  # fmt: skip
    x = inputs["x"].float()
    normed = x * torch.rsqrt((x * x).mean(-1, keepdim=True) + 1e-5)
    reference = (normed * inputs["w"].float() if "w" in inputs else normed) @ inputs["proj"].float()
    plans = [p for p in absorbed_plans(graph) if p.family in ("wgmma", "mma")]
    assert {p.family for p in plans} == {"wgmma", "mma"}
    for plan, compiled in zip(plans, compile_plans(plans, cache_dir=tmp_path), strict=True):
        assert not isinstance(compiled, Exception), f"{plan.name}: {compiled}"
        out = torch.full(plan.output.shape, math.nan, device="cuda", dtype=dtypes[plan.output.dtype])
        load_kernel(compiled).launch(inputs, out)
        torch.cuda.synchronize()
        error = ((out.float() - reference).norm() / reference.norm()).item()
        assert error <= TOLERANCE, f"{plan.name}: relative L2 error {error:.3g}"


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(2, 100, 327, 136), (4, 256, 2053, 768)])
def test_a_view_of_a_matmul_matches_torch(gpu, shape, tmp_path) -> None:
    """The LM head's absorbed matmul (every TMA schedule, the boxes copied out by threads
    among them, odd vocabularies) against torch's float32 logits."""
    torch = gpu
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("sm_90a kernels need a Hopper GPU")
    batch, tokens, vocab, k = shape
    graph = lm_head_graph(batch, tokens, vocab, k)
    generator = torch.Generator(device="cuda").manual_seed(3)
    inputs = {name: torch.randn(t.shape, generator=generator, device="cuda").to(torch.bfloat16)
              for name, t in graph.inputs.items()}  # fmt: skip
    reference = (inputs["x"].float().reshape(batch * tokens, k) @ inputs["w"].float().T).reshape(batch, tokens, vocab)
    plans = [p for p in view_plans(graph) if isinstance(p.schedule, TmaGemmSchedule)]
    assert any(p.schedule.copy_out for p in plans)
    _assert_plans_match(torch, plans, inputs, reference, tmp_path)


def _assert_plans_match(torch, plans, inputs, reference, tmp_path) -> None:
    """Each plan compiled, launched on ``inputs`` into a NaN-filled output, within
    ``TOLERANCE`` of the float32 ``reference``."""
    for plan, compiled in zip(plans, compile_plans(plans, cache_dir=tmp_path), strict=True):
        assert not isinstance(compiled, Exception), f"{plan.name}: {compiled}"
        out = torch.full(plan.output.shape, math.nan, device="cuda", dtype=torch.bfloat16)
        load_kernel(compiled).launch(inputs, out)
        torch.cuda.synchronize()
        error = ((out.float() - reference).norm() / reference.norm()).item()
        assert error <= TOLERANCE, f"{plan.name}: relative L2 error {error:.3g}"


@pytest.mark.gpu
@pytest.mark.parametrize("case", list(ROPE_GRAPHS))
def test_rope_epilogue_matches_torch(gpu, case, tmp_path) -> None:
    """The projection that runs RoPE in its epilogue (every TMA schedule that can) against
    the float32 projection and rotary embedding."""
    torch = gpu
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("sm_90a kernels need a Hopper GPU")
    graph = ROPE_GRAPHS[case]()
    generator = torch.Generator(device="cuda").manual_seed(2)
    inputs = {name: torch.randn(t.shape, generator=generator, device="cuda").to(torch.bfloat16)
              for name, t in graph.inputs.items()}  # fmt: skip
    reference = rope_reference(torch, inputs)
    plans = [p for p in rope_plans(graph) if p.family == "wgmma"]
    assert len(plans) == 3
    _assert_plans_match(torch, plans, inputs, reference, tmp_path)
