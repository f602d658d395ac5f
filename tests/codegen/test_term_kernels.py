"""The generic kernel families (issue 7) on the CPU: plans for every fused-kernel kind,
sources that compile with nvcc for sm_80 / sm_90 / sm_120, determinism, identifier safety,
and numerics — every family's generated kernel run by the CPU emulator (``emulator.py``:
the same source as host C++, CUDA threads as threads, warp collectives emulated) against
the float64 reference of its fused kernel."""

from __future__ import annotations

import re
import shutil
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

import cherenkov as ck
from cherenkov.codegen import (
    CodegenError,
    GemmSchedule,
    PointwiseSchedule,
    RowSchedule,
    TermKernelPlan,
    compile_plan,
    compile_plans,
    cuda_source,
    term_plans,
)
from cherenkov.codegen.cuda.term_expr import TensorInfo, float_constant
from cherenkov.codegen.cuda.term_kernels import term_dynamic_smem
from cherenkov.codegen.term_plan import (
    GEMM_SCHEDULES,
    ROW_SCHEDULES,
    gemm_layout,
    gemm_smem_bytes,
    kernel_tensors,
    term_plan_problems,
)
from cherenkov.rewrites.kernels import absorptions
from cherenkov.rewrites.plan import TARGETS
from cherenkov.search.cost_model import predict_term

from .emulator import emulate, rounded
from .rotary_graphs import rope_projection_graph

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
ARCHS = ("sm_80", "sm_90", "sm_120")
needs_gxx = pytest.mark.skipif(shutil.which("g++") is None, reason="no g++ to emulate kernels with")


# ------------------------------------------------------------------------------ graphs


def softmax_graph(dtype="bf16", shape=(6, 100)) -> ck.Graph:
    g = ck.Graph("softmax")
    g.output(ck.nn.softmax(g.input("x", shape, dtype), axis=-1), "y")
    return g


def softmax_times_input_graph() -> ck.Graph:
    """The epilogue reads the softmax's own operand (kept rows must keep the values)."""
    g = ck.Graph("softmax_x")
    x = g.input("x", (3, 512), "bf16")
    g.output(ck.nn.softmax(x, axis=-1) * x, "y")
    return g


def rms_matmul_graph(dtype="bf16") -> ck.Graph:
    g = ck.Graph("rms_matmul")
    x, w, proj = g.input("x", (40, 96), dtype), g.input("w", (96,), dtype), g.input("proj", (96, 72), dtype)
    g.output(ck.nn.rms_norm(x, w) @ proj, "y")
    return g


def layer_norm_graph(dtype="fp32") -> ck.Graph:
    g = ck.Graph("layer_norm")
    x, w, b = g.input("x", (9, 130), dtype), g.input("w", (130,), dtype), g.input("b", (130,), dtype)
    g.output(ck.nn.layer_norm(x, w, b), "y")
    return g


def reductions_graph() -> ck.Graph:
    g = ck.Graph("reductions")
    x, c = g.input("x", (7, 300), "fp32"), g.input("c", (300, 7), "fp32")
    g.output(x.sum(axis=-1) + x.max(axis=-1), "rows")
    g.output(c.sum(axis=0), "columns")
    return g


def batched_dots_graph() -> ck.Graph:
    """Dot products of two tensors' rows (what a norm's backward sums): a contraction whose every
    free axis is a batch axis."""
    g = ck.Graph("batched_dots")
    x, y = g.input("x", (4, 17, 128), "bf16"), g.input("y", (4, 17, 128), "bf16")
    g.output((x * y).sum(axis=-1), "dots")
    return g


def matmul_graph(ta: bool, tb: bool, m: int, n: int, k: int, dtype="bf16") -> ck.Graph:
    g = ck.Graph("matmul")
    a = g.input("a", (k, m) if ta else (m, k), dtype)
    b = g.input("b", (n, k) if tb else (k, n), dtype)
    g.output((a.transpose(0, 1) if ta else a) @ (b.transpose(0, 1) if tb else b), "y")
    return g


def mlp_graph() -> ck.Graph:
    sys.path.insert(0, str(EXAMPLES))
    import mlp

    return mlp.build((40, 32, 72))


def transformer_graph() -> ck.Graph:
    sys.path.insert(0, str(EXAMPLES))
    import transformer_block

    return transformer_block.build((1, 40, 2, 16, 48))


def odd_ops_graph() -> ck.Graph:
    """Mod, where/less-than, iota, sqrt, log2, sin, maximum, a bf16 cast, pad, slice,
    concatenation and reshapes through a transpose: every elementwise constructor."""
    g = ck.Graph("odd")
    x, y = g.input("x", (6, 20), "fp32"), g.input("y", (6, 20), "fp32")
    a = ck.where(x < y, (x % 0.7) * g.arange(20), y.abs().sqrt().log2())
    b = a.maximum(x.sin()).cast("bf16").float() + x.pad(((0, 0), (2, 0)), value=-1.5).slice((0, 0), (6, 20))
    joined = ck.cat([x.slice((0, 0), (6, 10)), y.slice((0, 10), (6, 20))], axis=1)
    g.output(b.reshape(12, 10).transpose(0, 1).reshape(20, 6) + joined.reshape(20, 6), "out")
    return g


def activations_graph() -> ck.Graph:
    """The activations built on ``e^x − 1`` and ``ln(1 + x)`` (their series branches near 0), softplus past its
    threshold, mish, ELU and hardsigmoid, in one elementwise kernel."""
    g = ck.Graph("activations")
    x = g.input("x", (6, 20), "fp32") * 4.0
    g.output(ck.nn.expm1(x) + ck.nn.log1p(x.abs()) + ck.nn.softplus(x, 2.0, 5.0) + ck.nn.mish(x)
             + ck.nn.elu(x, 0.5) + ck.nn.hardsigmoid(x), "out")  # fmt: skip
    return g


def hostile_names_graph() -> ck.Graph:
    g = ck.Graph("names")
    x = g.input("int", (4, 32), "bf16")
    f = g.input("float", (32,), "bf16")
    z = g.input("__global__x", (4, 32), "bf16")
    w = g.input("return", (32, 16), "bf16")
    g.output((ck.nn.silu(x * f) + z) @ w, "out")
    return g


def plans_of(graph: ck.Graph, target: str = "sm_90") -> list[tuple[object, list[TermKernelPlan]]]:
    d = ck.derive(graph)
    shapes, dtypes = d.tensor_types()
    return [(k, term_plans(k, shapes, dtypes, TARGETS[target])) for k in d.kernels]


# ------------------------------------------------------------------------------ plans


def test_every_kind_gets_its_families() -> None:
    ((softmax, plans),) = plans_of(softmax_graph())
    assert softmax.kind == "softmax_rows"
    uncached = {RowSchedule("warp", 128), RowSchedule("block", 256), RowSchedule("block", 512), RowSchedule("thread", 128)}
    assert {p.schedule for p in plans} == uncached | {s for s in ROW_SCHEDULES if s.cached}, "rows of 100 fit"
    ((_, long_rows),) = plans_of(softmax_graph(shape=(6, 4096)))
    cached = {p.schedule for p in long_rows if p.schedule.cached}
    blocks = {RowSchedule("block", threads, True) for threads in (256, 512, 1024)}
    assert cached == blocks | {replace(s, vector=8) for s in blocks}, "16-byte runs where rows are multiples of 8"
    assert all("kept in registers" in cuda_source(p) for p in long_rows if p.schedule.cached)
    vectorised = [cuda_source(p) for p in long_rows if p.schedule.vector > 1]
    assert all("ck_load_bf16x8(" in src and "ck_store_bf16x8(" in src for src in vectorised)
    by_kind = {k.kind: ps for k, ps in plans_of(rms_matmul_graph())}
    families = [p.family for p in by_kind["contraction"]]
    assert families.count("mma") == len(GEMM_SCHEDULES) and families.count("pointwise") == 1
    small = {k.kind: ps for k, ps in plans_of(rms_matmul_graph(), "sm_120")}["contraction"]
    fitting = {p.schedule for p in small if p.family == "mma"}
    assert fitting == {s for s in GEMM_SCHEDULES if gemm_smem_bytes(s) <= TARGETS["sm_120"].smem_per_block}
    assert len(fitting) < len(GEMM_SCHEDULES), "sm_120's 99 KB leaves out the deepest rings"
    assert {p.family for p in by_kind["rms_norm_rows"]} == {"rows"}
    fp32 = {k.kind: ps for k, ps in plans_of(rms_matmul_graph("fp32"))}
    assert {p.family for p in fp32["contraction"]} == {"pointwise"}, "fp32 contractions take the exact path"
    columns = {k.output: ps for k, ps in plans_of(reductions_graph())}
    assert {p.family for p in columns["columns"]} == {"rows", "pointwise"}
    assert RowSchedule("block", 256) not in {p.schedule for p in columns["columns"]}, "not contiguous"
    g = ck.Graph("elementwise")
    g.output(ck.nn.silu(g.input("x", (40, 32), "bf16")) * 2.0, "y")
    ((kernel, elementwise),) = plans_of(g)
    assert kernel.kind == "elementwise" and {p.schedule.vector for p in elementwise} == {1, 8}


@pytest.mark.parametrize("target", ["sm_90", "sm_90a"])
def test_a_contraction_without_rows_or_columns_runs_pointwise_not_as_a_gemm(target: str) -> None:
    """Every free axis a batch axis: a GEMM tile would hold one element (and its epilogue had no
    row or column to read the accumulator at: it did not compile), so only pointwise plans."""
    ((kernel, plans),) = plans_of(batched_dots_graph(), target)
    assert kernel.kind == "contraction" and plans and {p.family for p in plans} == {"pointwise"}
    assert _check_graph(batched_dots_graph()) == len(plans)


def test_flash_attention_without_a_flash_plan_falls_back_to_pointwise() -> None:
    g = ck.Graph("attention32")
    q, k, v = (g.input(n, (1, 2, 10, 32), "fp32") for n in "qkv")
    g.output(ck.nn.attention(q, k, v), "o")
    d = ck.derive(g)
    assert d.plans("sm_90") == [], "head dim 32 in fp32 has no flash plan"
    ((kernel, plans),) = plans_of(g)
    assert kernel.kind == "flash_attention" and [p.family for p in plans] == ["pointwise"]


def test_invalid_plans_are_refused() -> None:
    ((kernel, plans),) = plans_of(softmax_graph())
    plan = plans[0]
    bad = TermKernelPlan(plan.kind, kernel, GemmSchedule(), plan.target, plan.tensors)
    assert term_plan_problems(bad) and "contraction" in " ".join(term_plan_problems(bad))
    with pytest.raises(CodegenError, match="invalid plan"):
        cuda_source(bad)
    vector = TermKernelPlan(plan.kind, kernel, PointwiseSchedule(256, 8), plan.target, plan.tensors)
    with pytest.raises(CodegenError):
        cuda_source(vector)


def test_gemm_layouts_follow_memory_order() -> None:
    cases = {(False, False): (True, False), (True, False): (False, False), (True, True): (False, True),
             (False, True): (True, True)}  # fmt: skip
    for (ta, tb), (a_kmajor, b_kmajor) in cases.items():
        d = ck.derive(matmul_graph(ta, tb, 48, 40, 64))
        shapes, dtypes = d.tensor_types()
        (kernel,) = d.kernels
        layout = gemm_layout(kernel, {i.name: i for i in kernel_tensors(kernel, shapes, dtypes)})
        assert (layout.a_kmajor, layout.b_kmajor) == (a_kmajor, b_kmajor), (ta, tb)
        assert layout.a_fast and layout.b_fast and (layout.m, layout.n, layout.k) == (48, 40, 64)


# ------------------------------------------------------------------------------ source


def test_source_is_deterministic_and_every_schedule_differs() -> None:
    first = [p for _, ps in plans_of(transformer_graph()) for p in ps]
    again = [p for _, ps in plans_of(transformer_graph()) for p in ps]
    assert [p.name for p in first] == [p.name for p in again]
    sources = [cuda_source(p) for p in first]
    assert sources == [cuda_source(p) for p in again]
    assert len(set(sources)) == len(sources)
    assert len({p.name for p in first}) == len(first)


def test_source_is_commented_and_indented() -> None:
    for _, plans in plans_of(rms_matmul_graph()):
        for plan in plans:
            source = cuda_source(plan)
            assert source.startswith("// Generated by cherenkov")
            assert "// ---- kernel" in source and "// ---- types and helpers" in source
            assert "\t" not in source and not any(line != line.rstrip() for line in source.splitlines())


def test_user_names_only_appear_as_prefixed_identifiers() -> None:
    plans = [p for _, ps in plans_of(hostile_names_graph()) for p in ps]
    assert plans
    for plan in plans:
        source = cuda_source(plan)
        for name in ("int", "float", "__global__x", "return"):
            if name in {i.name for i in plan.tensors}:
                assert f"t_{name}" in source
        params = re.findall(r"\* __restrict__ (\w+)", source)
        assert params and all(p.startswith("t_") for p in params)
    with pytest.raises(CodegenError):
        TensorInfo("x; }", (4,), "fp32")
    with pytest.raises(CodegenError):
        TensorInfo("x", (4,), "fp64")


def test_float_constants() -> None:
    assert float_constant(float("inf")) == "CK_INF" and float_constant(-float("inf")) == "(-CK_INF)"
    assert float_constant(1e300) == "CK_INF" and float_constant(1e-300) == "0.0f"
    assert float_constant(0.5) == "5.000000000e-01f" and float_constant(-2.0) == "(-2.000000000e+00f)"


def _one_per_schedule(graphs, target: str) -> list[TermKernelPlan]:
    chosen: dict[tuple, TermKernelPlan] = {}
    for graph in graphs:
        for _, plans in plans_of(graph, target):
            for plan in plans:
                chosen.setdefault((plan.kind, plan.schedule), plan)
    return list(chosen.values())


@pytest.mark.parametrize("arch", ARCHS)
def test_sources_compile_without_spills(arch, compiler, kernel_cache) -> None:
    graphs = [softmax_graph(), layer_norm_graph(), reductions_graph(), transformer_graph(), hostile_names_graph(),
              matmul_graph(True, False, 48, 40, 64, "fp16"), odd_ops_graph(), batched_dots_graph()]  # fmt: skip
    plans = _one_per_schedule(graphs, arch)
    assert {p.family for p in plans} == {"pointwise", "rows", "mma"} and len(plans) >= 15
    results = compile_plans(plans, compiler=compiler, cache_dir=kernel_cache)
    for plan, result in zip(plans, results):
        assert not isinstance(result, Exception), f"{plan.name}: {result}"
        assert result.report.spill_bytes == 0, (plan.name, result.report)
        assert result.report.registers <= 255 and result.arch == arch


@pytest.mark.parametrize("arch", ARCHS)
def test_gemms_that_absorb_the_rms_norm_compile_without_spills(arch, compiler, kernel_cache) -> None:
    d = ck.derive(rms_matmul_graph())
    shapes, dtypes = d.tensor_types()
    ((_, fused),) = absorptions(d.kernels, frozenset({"y"})).values()
    plans = [p for p in term_plans(fused, shapes, dtypes, TARGETS[arch]) if p.family == "mma"]
    assert len(plans) == len([s for s in GEMM_SCHEDULES if gemm_smem_bytes(s) <= TARGETS[arch].smem_per_block])
    for plan, result in zip(plans, compile_plans(plans, compiler=compiler, cache_dir=kernel_cache)):
        assert not isinstance(result, Exception), f"{plan.name}: {result}"
        assert result.report.spill_bytes == 0, (plan.name, result.report)


def test_gemm_tiles_live_in_dynamic_shared_memory(compiler, kernel_cache) -> None:
    plans = [p for _, ps in plans_of(rms_matmul_graph()) for p in ps if isinstance(p.schedule, GemmSchedule)]
    for plan in (plans[0], plans[-1]):
        compiled = compile_plan(plan, compiler=compiler, cache_dir=kernel_cache)
        assert compiled.report.smem_static == 0 and "extern __shared__" in cuda_source(plan)
        assert term_dynamic_smem(plan) == gemm_smem_bytes(plan.schedule) > 0
        assert compiled.kernel_name == f"ck_contraction_{plan.schedule.key()}"
    norm = next(p for _, ps in plans_of(rms_matmul_graph()) for p in ps if p.schedule == RowSchedule("block", 256))
    compiled = compile_plan(norm, compiler=compiler, cache_dir=kernel_cache)
    assert compiled.report.smem_static > 0 and term_dynamic_smem(norm) == 0, "block reductions: static partials"


def test_cost_model_ranks_gemm_families() -> None:
    d = ck.derive(matmul_graph(False, False, 4096, 4096, 4096))
    shapes, dtypes = d.tensor_types()
    plans = term_plans(d.kernels[0], shapes, dtypes, TARGETS["sm_90"])
    predictions = {p.schedule.key(): predict_term(p).ms for p in plans}
    assert all(np.isfinite(v) and v > 0 for v in predictions.values())
    assert min(predictions, key=predictions.get).startswith("mma")
    assert predictions["pw_b256_v1"] > 5 * min(predictions.values())


def test_cost_model_prefers_rows_kept_in_registers() -> None:
    ((kernel, plans),) = plans_of(softmax_graph(shape=(4096, 8192)))
    predicted = {p.schedule: predict_term(p).ms for p in plans}
    assert predicted[RowSchedule("block", 256, True)] < predicted[RowSchedule("block", 256)], "one read, not two"
    assert min(predicted, key=predicted.get).cached
    g = ck.Graph("rms_norm")
    g.output(ck.nn.rms_norm(g.input("x", (8192, 4096), "bf16"), g.input("w", (4096,), "bf16")), "y")
    ((kernel, plans),) = plans_of(g)
    predicted = {p.schedule: predict_term(p).ms for p in plans}
    runs = RowSchedule("block", 256, True, vector=8)
    assert predicted[runs] < predicted[replace(runs, vector=1)], "16-byte accesses move bytes faster"


# ------------------------------------------------------------------------------ numerics


def _check_graph(graph: ck.Graph, families: set[str] | None = None, seed: int = 0) -> int:
    """Emulate every plan of every kernel (of ``families``) against its kernel's reference."""
    rng = np.random.default_rng(seed)
    d = ck.derive(graph)
    shapes, dtypes = d.tensor_types()
    buffers = {n: rounded(rng.standard_normal(t.shape), dtypes[n]) for n, t in graph.inputs.items()}
    checked = 0
    for kernel in d.kernels:
        reference = kernel.evaluate(buffers)
        out_dtype = dtypes[kernel.output]
        for plan in term_plans(kernel, shapes, dtypes, TARGETS["sm_90"]):
            if families is not None and plan.family not in families:
                continue
            got = emulate(plan, buffers)
            assert not np.isnan(got).any(), f"{plan.name}: unwritten elements"
            error = np.linalg.norm(got - reference) / np.linalg.norm(reference)
            tolerance = 1e-5 if out_dtype == "fp32" else 1e-2
            assert error <= tolerance, f"{plan.name}: relative error {error:.3g}"
            checked += 1
        buffers[kernel.output] = rounded(reference, out_dtype)
    return checked


def fp8_graphs() -> list[ck.Graph]:
    """Kernels reading 8-bit floats (a softmax row of dequantised e4m3 values) and writing
    them (e5m2 quantised from bf16)."""
    read = ck.Graph("fp8_read")
    x, scale = read.input("x", (6, 100), "fp8_e4m3"), read.input("scale", (), "fp32")
    read.output(ck.nn.softmax(ck.nn.dequantize(x, scale), axis=-1).cast("bf16"), "y")
    write = ck.Graph("fp8_write")
    write.output(ck.nn.quantize(write.input("x", (6, 100), "bf16").cast("fp32"), 4.0, "fp8_e5m2"), "y")
    return [read, write]


@needs_gxx
@pytest.mark.parametrize("graph", fp8_graphs(), ids=["fp8_read", "fp8_write"])
def test_emulated_kernels_read_and_write_8_bit_floats(graph) -> None:
    assert _check_graph(graph) >= 2


@pytest.mark.parametrize("arch", ARCHS)
def test_8_bit_reads_and_writes_compile_without_spills(arch, compiler, kernel_cache) -> None:
    plans = [p for graph in fp8_graphs() for _, ps in plans_of(graph, arch) for p in ps]
    assert {p.family for p in plans} >= {"pointwise", "rows"}
    for plan, result in zip(plans, compile_plans(plans, compiler=compiler, cache_dir=kernel_cache)):
        assert not isinstance(result, Exception), f"{plan.name}: {result}"
        assert result.report.spill_bytes == 0, (plan.name, result.report)


@needs_gxx
@pytest.mark.parametrize("dtype", ["fp8_e4m3", "fp8_e5m2"])
def test_emulated_8_bit_stores_round_as_pytorch_casts(dtype: str) -> None:
    """Every bit of a kernel's 8-bit store equals PyTorch's cast of the same float32 values:
    ties to even, subnormals, e4m3 saturating at ±448 (±∞ too), e5m2 overflowing to ±∞, NaN."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(5)
    largest = 448.0 if dtype == "fp8_e4m3" else 57344.0
    values = np.concatenate([rng.standard_normal(3000) * scale for scale in (1e-3, 1.0, largest / 3)]
                            + [[largest * 1.1, -largest * 1.2, np.inf, -np.inf, np.nan, 0.0, 2.0**-12, 1.0625]])
    g = ck.Graph("fp8_store")
    g.output(g.input("x", (values.size,), "fp32").cast(dtype), "y")
    d = ck.derive(g)
    shapes, dtypes = d.tensor_types()
    (kernel,) = d.kernels
    fp8 = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}[dtype]
    expected = torch.from_numpy(values.astype(np.float32)).to(fp8).double().numpy()
    plans = term_plans(kernel, shapes, dtypes, TARGETS["sm_90"])
    assert plans
    for plan in plans:
        np.testing.assert_array_equal(emulate(plan, {"x": values}), expected, err_msg=plan.name)


@needs_gxx
@pytest.mark.parametrize(
    "graph",
    [softmax_graph(), softmax_graph("fp32", (5, 77)), softmax_graph("fp16", (4, 2048)), softmax_times_input_graph(),
     rms_matmul_graph(), layer_norm_graph(), reductions_graph(), odd_ops_graph(), activations_graph(),
     hostile_names_graph()],
    ids=["softmax_bf16", "softmax_fp32", "softmax_fp16_runs_of_8", "softmax_times_input", "rms_matmul", "layer_norm",
         "reductions", "odd_ops", "activations", "names"],
)  # fmt: skip
def test_emulated_kernels_match_the_reference(graph) -> None:
    assert _check_graph(graph) >= 4


@needs_gxx
def test_emulated_rope_loads_its_partner_columns_as_vectors() -> None:
    """RoPE after a projection split into heads (``t[s, h·D + d]`` and its partner
    ``t[s, h·D + d ± D/2]``, clamped where the guard discards it): the vectorised kernel
    loads all three reads 8 at a time, and every pointwise plan matches the reference."""
    graph = rope_projection_graph(seq=24, heads=4, dim=64, hidden=40)
    d = ck.derive(graph)
    shapes, dtypes = d.tensor_types()
    rope = next(k for k in d.kernels if k.kind == "elementwise")
    (vector,) = [p for p in term_plans(rope, shapes, dtypes, TARGETS["sm_90"])
                 if p.schedule == PointwiseSchedule(128, 8)]  # fmt: skip
    text = cuda_source(vector).split("__global__")[1]  # the kernel, past the helpers
    assert text.count("ck_load_bf16x8(") == 5 and "ck_from_bf16(" not in text
    assert "int(ck_clamp((a0 * 64 + (a2 + 32)), 0, 248))" in text, "the partner's vector stays inside the row"
    assert _check_graph(graph, {"pointwise"}) >= 6


@needs_gxx
@pytest.mark.parametrize(
    "transposes, m, n, k",
    [((False, False), 40, 48, 64), ((True, False), 48, 40, 64), ((True, True), 33, 17, 19),
     ((False, True), 70, 24, 24), ((True, False), 31, 45, 77)],
)  # fmt: skip
def test_emulated_gemm_layouts_and_tails(transposes, m, n, k) -> None:
    """Every operand layout ([row][k] / [k][row], cp.async or evaluated) with tails in M, N and K."""
    assert _check_graph(matmul_graph(*transposes, m, n, k), {"mma"}) == len(GEMM_SCHEDULES)


@needs_gxx
def test_emulated_batched_fp16_gemm() -> None:
    g = ck.Graph("bmm")
    a, b = g.input("a", (3, 37, 24), "fp16"), g.input("b", (3, 50, 24), "fp16")
    g.output(a @ b.transpose(-1, -2), "y")
    assert _check_graph(g, {"mma"}) == len(GEMM_SCHEDULES)


@needs_gxx
@pytest.mark.slow
@pytest.mark.parametrize("build", [mlp_graph, transformer_graph], ids=["mlp", "transformer_block"])
def test_emulated_fused_graphs(build) -> None:
    """Prologues (norm weight, bias + GELU), epilogues (residuals), head split/merge
    reshapes, flash attention's pointwise fallback: every plan of every kernel."""
    assert _check_graph(build()) >= 8


@needs_gxx
@pytest.mark.parametrize("dtype, weight", [("bf16", True), ("fp16", False)])
def test_emulated_gemms_that_absorb_the_rms_norm(dtype: str, weight: bool) -> None:
    """Every mma GEMM schedule running the RMSNorm feeding it (K 96: a tail in K) against
    the absorbed kernel's reference."""
    g = ck.Graph("rms_matmul")
    x, proj = g.input("x", (40, 96), dtype), g.input("proj", (96, 72), dtype)
    g.output(ck.nn.rms_norm(x, g.input("w", (96,), dtype) if weight else None) @ proj, "y")
    d = ck.derive(g)
    shapes, dtypes = d.tensor_types()
    ((_, fused),) = absorptions(d.kernels, frozenset(g.outputs)).values()
    rng = np.random.default_rng(4)
    buffers = {n: rounded(rng.standard_normal(t.shape), dtypes[n]) for n, t in g.inputs.items()}
    reference = fused.evaluate(buffers)
    plans = [p for p in term_plans(fused, shapes, dtypes, TARGETS["sm_90"]) if p.family == "mma"]
    assert len(plans) == len(GEMM_SCHEDULES)
    for plan in plans:
        assert "add_squares(row_ss" in cuda_source(plan) and ("= scale_pair(" in cuda_source(plan)) == weight
        got = emulate(plan, buffers)
        error = np.linalg.norm(got - reference) / np.linalg.norm(reference)
        assert error <= 1e-2, f"{plan.name}: relative error {error:.3g}"


@needs_gxx
def test_verification_accepts_the_kernel_and_rejects_unwritten_outputs() -> None:
    torch = pytest.importorskip("torch")
    from cherenkov.search.measure import verify_term

    ((kernel, plans),) = plans_of(layer_norm_graph())
    plan = plans[0]

    def emulated(inputs, out):
        values = emulate(plan, {n: x.double().numpy() for n, x in inputs.items()})
        return torch.tensor(values, dtype=out.dtype)

    error, failure, _, _ = verify_term(emulated, plan, seed=3, device="cpu")
    assert failure is None and error < 1e-6
    error, failure, _, _ = verify_term(lambda inputs, out: out, plan, seed=3, device="cpu")
    assert failure is not None and "NaN" in failure
