"""The sm_90a flash-attention family: descriptors, schedules, source, nvcc/ptxas/SASS checks
(CPU), and the kernel against PyTorch SDPA on random inputs (GPU)."""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest

from cherenkov.codegen.cuda import softmax, tma, wgmma
from cherenkov.codegen.cuda.flash_attention_sm90a import emit_flash_attention_sm90a, kernel_name
from cherenkov.codegen.cuda.text import float_literal
from cherenkov.codegen.errors import CodegenError
from cherenkov.codegen import HopperFlashKernel, compile_plan, cuda_source, load_kernel
from cherenkov.codegen.tensor_map import encode_tiled
from cherenkov.rewrites.plan import TARGETS, AttentionProblem, KernelPlan, ScaleFactor
from cherenkov.rewrites.plan_sm90a import (
    HOPPER_SCHEDULES,
    HopperFlashSchedule,
    box_row_bytes,
    hopper_schedule_problems,
    problem_tile_columns,
)

TOLERANCE = 2e-2
DEFAULT = HopperFlashSchedule()
SEED = AttentionProblem(1, 8, 8, 4096, 8192, 128)

# Problems that together give every offered schedule a valid one (three consumers and key
# tiles of 192 fit head dim 64 only, 64-key tiles head dims 192 and 256, row sums on the tensor
# cores 8-bit operands only), some with tails.
COMPILE_PROBLEMS = [
    AttentionProblem(1, 8, 8, 4224, 2816, 128),
    AttentionProblem(1, 8, 8, 4224, 2816, 64, causal=True),
    AttentionProblem(2, 8, 2, 768, 1536, 64, dtype="fp16"),
    AttentionProblem(1, 4, 4, 2048, 2048, 128, causal=True, dtype="fp16"),
    AttentionProblem(1, 8, 8, 1536, 3072, 64),
    AttentionProblem(1, 8, 8, 1024, 2048, 256, causal=True),
    AttentionProblem(2, 8, 2, 1000, 1500, 96, causal=True),  # q, k, v rows of 1.5 boxes
    AttentionProblem(1, 8, 8, 1024, 2048, 192, value_dim=128),
    AttentionProblem(8, 32, 8, 64, 8192, 128),  # chunked prefill: packed GQA groups
    AttentionProblem(2, 8, 2, 1000, 1500, 32, causal=True),  # 64-byte-swizzled rows of 32 columns
    AttentionProblem(2, 8, 2, 1000, 3000, 128, dtype="fp8_e4m3", causal=True, out_dtype="bf16",  # 8-bit: row sums
                     score_factors=(ScaleFactor("sq", ()), ScaleFactor("sk", ())), out_factors=(ScaleFactor("sv", ()),)),
]
PACKED = HopperFlashSchedule(128, 3, 2, True, pack_group=True)
LAZY = HopperFlashSchedule(128, 3, 2, True, lazy_rescale=True)
PERSISTENT = HopperFlashSchedule(persistent=True)
TWO_Q = HopperFlashSchedule(128, 2, 2, True, persistent=True, q_buffers=2)


def hopper_plan(problem: AttentionProblem, schedule: HopperFlashSchedule) -> KernelPlan:
    return KernelPlan("flash_attention", problem, schedule, TARGETS["sm_90a"])


def _variants() -> list[tuple[AttentionProblem, HopperFlashSchedule]]:
    pairs = []
    for schedule in HOPPER_SCHEDULES:
        valid = [p for p in COMPILE_PROBLEMS if not hopper_schedule_problems(schedule, p)]
        assert valid, f"no test problem for {schedule.key()}"
        pairs += [(p, schedule) for p in valid]
    return pairs


# ---- descriptors and primitives ---------------------------------------------------------


def test_descriptor_k_major_tile_matches_hand_encoding():
    # a K-major tile at shared address 0x2400: start 0x240, LBO 16 -> 1, SBO 1024 -> 64, 128B swizzle
    desc = wgmma.smem_descriptor(0x2400, 16, 1024)
    assert desc == 0x240 | 1 << 16 | 64 << 32 | 1 << 62
    assert desc == 0x4000_0040_0001_0240
    # one k16 step (32 bytes) further along the swizzled rows: start field + 2
    assert wgmma.smem_descriptor(0x2400 + 32, 16, 1024) == desc + 2


def test_descriptor_mn_major_tile_matches_hand_encoding():
    # V tile: 64-column boxes of 128 rows (16 KiB apart, LBO), groups of 8 rows 1024 apart (SBO)
    desc = wgmma.smem_descriptor(0x10000, 128 * 128, 1024)
    assert desc == (0x10000 >> 4) | (16384 >> 4) << 16 | (1024 >> 4) << 32 | 1 << 62
    assert desc == 0x4000_0040_0400_1000
    assert wgmma.smem_descriptor(0, 0, 0, swizzle="none") == 0
    assert wgmma.smem_descriptor(0x400, 16, 1024, swizzle="32B", base_offset=5) >> 49 == 5 | 3 << 13


@pytest.mark.parametrize("bad", [dict(address=8), dict(lbo=1 << 18), dict(swizzle="256B"), dict(base_offset=8)])
def test_descriptor_rejects_invalid_fields(bad):
    args = dict(address=0x400, lbo=16, sbo=1024) | bad
    with pytest.raises(CodegenError):
        wgmma.smem_descriptor(**args)


def test_wgmma_wrappers_name_their_operands():
    ss = wgmma.emit_wgmma(128, "bf16", False, False)
    assert "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16" in ss and "p, 1, 1, 0, 0;" in ss
    assert ss.count('"+f"(d[') == 64
    rs = wgmma.emit_wgmma(64, "fp16", True, True)
    assert "m64n64k16.f32.f16.f16" in rs and "{%32,%33,%34,%35}, %36, p, 1, 1, 1;" in rs
    with pytest.raises(CodegenError):
        wgmma.emit_wgmma(12, "bf16", False, False)
    load = tma.emit_tma_load(3)
    assert '"cp.async.bulk.tensor.3d." TMA_LOAD_DST ".global.mbarrier::complete_tx::bytes "' in load
    assert '#define TMA_LOAD_DST "shared::cta"' in load and '#define TMA_LOAD_DST "shared::cluster"' in load
    with pytest.raises(CodegenError):
        tma.emit_tma_load(6)


def test_tensor_map_arguments_are_checked_before_the_driver():
    with pytest.raises(CodegenError, match="dtype"):
        encode_tiled(0, "fp32", (64, 64), (128,), (64, 64))
    with pytest.raises(CodegenError, match="128 bytes"):
        encode_tiled(0, "bf16", (128, 64), (256,), (128, 64))
    with pytest.raises(CodegenError, match="aligned"):
        encode_tiled(8, "bf16", (64, 64), (128,), (64, 64))


# ---- schedules and source ---------------------------------------------------------------


def test_schedule_resources_and_names():
    assert DEFAULT.block_q == 128 and DEFAULT.threads == 384 and DEFAULT.register_split == (40, 232)
    # Q 128x128 + 3 stages x (K + V) 128x128, bf16; 11 mbarriers; 1 KiB alignment slack
    assert DEFAULT.smem_bytes(128) == 32768 + 6 * 32768 + 11 * 8 + 1024
    assert DEFAULT.key() == "q128_kv128_s3_c2_pp" and kernel_name(DEFAULT) == "flash_attention_sm90a_q128_kv128_s3_c2_pp"
    assert not hopper_schedule_problems(DEFAULT, SEED)


@pytest.mark.parametrize(
    "schedule, problem, reason",
    [
        (HopperFlashSchedule(consumer_warpgroups=1, pingpong=True), SEED, "pingpong"),
        (HopperFlashSchedule(block_kv=120), SEED, "multiple of 16"),
        (HopperFlashSchedule(stages=1), SEED, "stage"),
        (HopperFlashSchedule(block_kv=256), SEED, "shared memory"),
        (HopperFlashSchedule(consumer_warpgroups=3, pingpong=False), AttentionProblem(1, 8, 8, 768, 1024, 128),
         "registers"),
        (DEFAULT, AttentionProblem(1, 8, 8, 4096, 8192, 76), "multiples of 8"),
        (DEFAULT, replace(SEED, head_dim=72, dtype="fp8_e4m3", out_dtype="bf16"), "multiples of 16"),
        (DEFAULT, AttentionProblem(1, 8, 8, 4096, 8192, 64, value_dim=128), "staged in the Q tile"),
        (HopperFlashSchedule(64, 2, 2, True), AttentionProblem(1, 8, 8, 4096, 8192, 128), "64-key tiles"),
        (HopperFlashSchedule(balanced=True), AttentionProblem(1, 8, 8, 4096, 4096, 128, causal=True), "balanced"),
        (replace(PERSISTENT, balanced=True), SEED, "balanced"),
        (HopperFlashSchedule(l2_prefetch=-1), SEED, "l2_prefetch"),
        (HopperFlashSchedule(poly_exp=5), SEED, "poly_exp 5"),
        (HopperFlashSchedule(l2_prefetch=4), replace(SEED, dtype="fp8_e4m3", out_dtype="bf16"), "L2 prefetch"),
    ],
)
def test_invalid_schedules_say_why(schedule, problem, reason):
    problems = hopper_schedule_problems(schedule, problem)
    assert any(reason in p for p in problems), problems
    with pytest.raises(CodegenError, match="invalid sm_90a"):
        emit_flash_attention_sm90a(problem, schedule)


def test_persistent_grid_has_a_block_an_sm_at_most():
    short = AttentionProblem(16, 16, 16, 1024, 1024, 128)
    assert PERSISTENT.tiles(short) == 8 * 16 * 16 == DEFAULT.grid_blocks(short, 132)
    assert PERSISTENT.grid_blocks(short, 132) == 132
    assert PERSISTENT.grid_blocks(AttentionProblem(1, 2, 2, 1024, 1024, 128), 132) == 16
    assert PERSISTENT.key() == "q128_kv128_s3_c2_pp_ps"
    source = emit_flash_attention_sm90a(short, PERSISTENT)
    assert "grid (min(2048, SMs),)" in source and "constexpr int TILES = Q_TILES * (HEADS / TILE_HEADS) * BATCH;" in source
    # one Q buffer: a persistent block stores O from registers (Q is released before the epilogue),
    # a one-tile block through its Q tile and TMA stores
    one_tile = emit_flash_attention_sm90a(short, DEFAULT)
    assert "O_THROUGH_SMEM = false" in source and "tma_store_4d(o_map" not in source and "out_row[" in source
    assert "O_THROUGH_SMEM = true" in one_tile and "tma_store_4d(o_map" in one_tile and "out_row[" not in one_tile


def test_two_q_buffers_need_a_persistent_grid_and_split_the_two_stage_ring():
    assert TWO_Q.key() == "q128_kv128_s2_c2_pp_ps_q2" and TWO_Q.split_release and TWO_Q.o_through_smem
    assert not DEFAULT.split_release and not PERSISTENT.o_through_smem
    # 2 Q tiles + 2 stages x (K + V) + the O tile, 128x128 bf16 each; 12 mbarriers; 1 KiB alignment slack
    assert TWO_Q.smem_bytes(128) == 7 * 32768 + 12 * 8 + 1024 <= TARGETS["sm_90a"].smem_per_block
    assert not hopper_schedule_problems(TWO_Q, SEED)
    one_tile = HopperFlashSchedule(128, 2, 2, True, persistent=False, q_buffers=2)
    assert any("persistent" in p for p in hopper_schedule_problems(one_tile, SEED))
    source = emit_flash_attention_sm90a(SEED, TWO_Q)
    assert "constexpr int Q_BUFFERS = 2;" in source and "SPLIT_RELEASE = true" in source
    assert "O_THROUGH_SMEM = true" in source and "bulk_wait_read<0>()" in source


def test_source_is_deterministic_and_specialised():
    a = emit_flash_attention_sm90a(SEED, DEFAULT)
    assert a == emit_flash_attention_sm90a(SEED, DEFAULT)
    assert a != emit_flash_attention_sm90a(SEED, HopperFlashSchedule(pingpong=False))
    assert "constexpr int SEQ_KV = 8192;" in a and "reg_alloc<CONSUMER_REGS>" in a
    assert "wgmma_m64n128k16_rs_bf16_tb" in a and "wgmma_m64n128k16_ss_bf16" in a
    for line in a.splitlines():
        assert line == line.rstrip() and "\t" not in line


def test_packed_groups_fill_a_tile_with_the_heads_of_one_kv_head():
    chunk = AttentionProblem(8, 32, 8, 64, 8192, 128)
    assert PACKED.key() == "q128_kv128_s3_c2_pp_pk" and PACKED.tile_heads(chunk) == 2
    assert PACKED.tiles(chunk) == 8 * 16 and HopperFlashSchedule().tiles(chunk) == 8 * 32
    assert not hopper_schedule_problems(PACKED, chunk)
    source = emit_flash_attention_sm90a(chunk, PACKED)
    assert "constexpr bool PACK = true;" in source and "constexpr int TILES = Q_TILES * (HEADS / TILE_HEADS) * BATCH;" in source
    assert "row_head(w, consumer * 64)" in source
    for problem, reason in [
        (replace(chunk, causal=True), "the last key"),
        (replace(chunk, kv_heads=32), "share a K/V head"),
        (replace(chunk, seq_q=48), "8, 16, 32 or 64"),
        (replace(chunk, seq_q=128), "8, 16, 32 or 64"),
    ]:
        assert any(reason in r for r in hopper_schedule_problems(PACKED, problem)), problem


def test_l2_prefetch_asks_for_the_key_tiles_ahead_of_each_load():
    chunk = AttentionProblem(8, 32, 8, 64, 8192, 128)
    ahead = replace(PACKED, l2_prefetch=4)
    assert ahead.key() == "q128_kv128_s3_c2_pp_pk_pf4" and ahead.smem_bytes(128) == PACKED.smem_bytes(128)
    source = emit_flash_attention_sm90a(chunk, ahead)
    assert "constexpr int L2_PREFETCH = 4;" in source
    assert "cp.async.bulk.prefetch.tensor.4d.L2.global.tile" in source
    assert "for (int ahead = j == 0 ? 1 : L2_PREFETCH; ahead <= L2_PREFETCH; ++ahead)" in source
    assert "if (j >= w.kv_tiles) return;" in source  # never past the work tile's last key tile
    assert "prefetch.tensor." not in emit_flash_attention_sm90a(chunk, PACKED)


POLY_EXP2_HOST = r"""
#include <cstdio>
#include <cstring>
#include <cmath>
#define __device__
#define __forceinline__ inline
static inline float __int_as_float(int x) { float f; std::memcpy(&f, &x, 4); return f; }
static inline int __float_as_int(float f) { int x; std::memcpy(&x, &f, 4); return x; }
static inline float __fadd_rn(float a, float b) { return a + b; }
static inline float __fsub_rn(float a, float b) { return a - b; }
@POLY_EXP2@
int main() {  // float32s in on stdin, their poly_exp2 out on stdout
    float x;
    while (std::fread(&x, 4, 1, stdin) == 1) {
        const float y = poly_exp2(x);
        std::fwrite(&y, 4, 1, stdout);
    }
}
"""


def _emitted_poly_exp2(x: np.ndarray, degree: int) -> np.ndarray:
    """``poly_exp2`` as the kernels emit it, compiled as host C++ (g++, the CPU emulator's compiler) and run."""
    import subprocess

    from .emulator import host_binary

    source = POLY_EXP2_HOST.replace("@POLY_EXP2@", softmax.emit_poly_exp2(degree))
    binary = host_binary(source, f"poly-exp2-{degree}", f"poly_exp2 degree {degree}")
    out = subprocess.run([str(binary)], input=x.astype(np.float32).tobytes(), capture_output=True, check=True).stdout
    return np.frombuffer(out, dtype=np.float32)


@pytest.mark.parametrize("degree, bound", [(2, 2.1e-3), (3, 1.1e-4)])
def test_poly_exp2_is_exp2_within_its_degree_bound(degree, bound):
    import shutil

    if shutil.which("g++") is None:
        pytest.skip("no g++ to run the emitted function with")
    x = np.concatenate([np.linspace(-126.0, 9.0, 200001), np.arange(-126, 10), [-np.inf, -1e30, -127.0, -126.7]])
    got = _emitted_poly_exp2(x, degree).astype(np.float64)
    expected = np.exp2(x.astype(np.float32).astype(np.float64))
    normal = x >= -126
    assert np.all(np.abs(got[normal] / expected[normal] - 1) <= bound)
    assert np.all(got[np.isin(x, np.arange(-126, 10))] == expected[np.isin(x, np.arange(-126, 10))])  # 2^j exact
    assert np.all(got[~normal] >= 0) and np.all(got[~normal] < 2.0**-125) and not np.isnan(got).any()
    assert got[x == -np.inf][0] == 0.0  # a masked score: +0 exactly
    source = softmax.emit_poly_exp2(degree)
    assert all(float_literal(c) in source for c in softmax.POLY_EXP2_COEFFICIENTS[degree])
    assert source.count("fmaf(") == degree


def test_poly_exp_schedules_take_some_chunks_exponentials_off_the_sfu():
    twin = replace(LAZY, poly_exp=2)
    assert twin.key() == "q128_kv128_s3_c2_pp_lz_px2" and twin.smem_bytes(128) == LAZY.smem_bytes(128)
    source = emit_flash_attention_sm90a(SEED, twin)
    assert "return c % 4 < 2 ? poly_exp2(x) : fast_exp2(x);" in source
    assert "score_exp2(c, fmaf(s[4 * c + 2 * r], scale_log2, -shifted))" in source
    assert source.count("fmaf(p, f,") == 3  # 16-bit P: degree 3
    eight_bit = AttentionProblem(1, 8, 8, 4096, 8192, 128, dtype="fp8_e4m3", out_dtype="bf16")
    assert emit_flash_attention_sm90a(eight_bit, twin).count("fmaf(p, f,") == 2  # e4m3 P: degree 2
    plain = emit_flash_attention_sm90a(SEED, LAZY)
    assert "poly_exp2" not in plain and "fast_exp2(fmaf(s[4 * c + 2 * r], scale_log2, -shifted))" in plain


def test_head_dims_short_of_whole_boxes_pad_to_the_next_box():
    # D 96: q and k rows of 1.5 boxes, 6 k steps of Q K^T (the zero columns are not multiplied);
    # O is 128 wide (V's last box reads zeros past column 96) and only 96 columns are stored
    d96 = AttentionProblem(2, 16, 16, 1024, 1024, 96)
    assert DEFAULT.smem_bytes(96) == DEFAULT.smem_bytes(128)
    source = emit_flash_attention_sm90a(d96, PERSISTENT)
    assert "constexpr int QK_BOXES = (HEAD_DIM + BOX_COLUMNS - 1) / BOX_COLUMNS;" in source
    assert "constexpr int HEAD_DIM = 96;" in source and "constexpr int V_DIM = 96;" in source
    assert "wgmma_m64n128k16_rs_bf16_tb" in source and "for (int c = 0; c < V_DIM / 8; ++c)" in source
    # D_qk 192, D_v 128: K tiles of three boxes, V tiles of two; O is one wgmma of N = 128
    mla = AttentionProblem(1, 8, 8, 1024, 2048, 192, value_dim=128)
    kv128 = HopperFlashSchedule(128, 2, 2, True)
    assert kv128.smem_bytes(192, "bf16", 128) == 128 * 192 * 2 + 2 * 128 * (192 + 128) * 2 + 10 * 8 + 1024
    dims = {d: AttentionProblem(1, 8, 8, 1024, 1024, 128, value_dim=d) for d in (96, 128, 192)}
    assert kv128.register_estimate(dims[128]) == kv128.register_estimate(dims[96]) < kv128.register_estimate(dims[192])
    assert not hopper_schedule_problems(kv128, mla)
    assert "wgmma_m64n128k16_rs_bf16_tb" in emit_flash_attention_sm90a(mla, kv128)


def test_head_dims_of_eights_read_the_zero_columns_of_their_last_k_step(nvcc, tmp_path):
    # 16-bit head dims need rows of 16 bytes (the tensor maps' strides); Q K^T's k steps are 16 columns,
    # so 40 takes three, the last reading columns 40..47 of the box, zeros past the tensor's end
    for dim in (8, 24, 40, 72, 200):
        assert not hopper_schedule_problems(DEFAULT if dim < 200 else HopperFlashSchedule(64, 2, 2, True),
                                            AttentionProblem(1, 8, 8, 1024, 1024, dim)), dim
    d40 = AttentionProblem(2, 8, 8, 1024, 1024, 40)
    assert problem_tile_columns(d40) == (64, 64)
    source = emit_flash_attention_sm90a(d40, DEFAULT)
    assert "constexpr int QK_STEPS = (HEAD_DIM * ELEM_BYTES + 31) / 32" in source
    assert "constexpr int HEAD_DIM = 40;" in source and "wgmma_m64n64k16_rs_bf16_tb" in source
    compiled = compile_plan(hopper_plan(replace(d40, causal=True), TWO_Q), compiler=nvcc, cache_dir=tmp_path)
    assert compiled.report.spill_bytes == 0


def test_head_dim_32_tiles_are_64_byte_swizzled_boxes_of_32_columns():
    # the 64-byte swizzle only where neither head dim is wider than 64 bytes: no zero columns
    assert box_row_bytes(32, 32, "bf16") == box_row_bytes(16, 32, "fp16") == 64
    assert box_row_bytes(32, 64, "bf16") == box_row_bytes(64, 64, "bf16") == box_row_bytes(128, 128, "fp8_e4m3") == 128
    d32 = AttentionProblem(2, 16, 16, 2048, 2048, 32)
    assert problem_tile_columns(d32) == (32, 32)
    assert problem_tile_columns(replace(d32, value_dim=64)) == (64, 64)
    barriers = 8 * (2 + 3 * 3)  # Q full/empty, 3 stages of K full, V full, K/V empty
    assert DEFAULT.smem_bytes(32) - 1024 - barriers == (DEFAULT.smem_bytes(64) - 1024 - barriers) // 2
    source = emit_flash_attention_sm90a(d32, TWO_Q)
    assert "constexpr u32 ROW_BYTES = 64;" in source and "| 2ull << 62;" in source  # descriptor: 64-byte swizzle
    assert "make_smem_desc(smem + K_SMEM, 16, 8 * ROW_BYTES)" in source  # SBO: 8 rows of 64 bytes
    assert "wgmma_m64n32k16_rs_bf16_tb" in source  # O: one wgmma of N = 32
    assert "| 1ull << 62;" in emit_flash_attention_sm90a(SEED, TWO_Q)


# ---- nvcc for sm_90a: every variant compiles; the default spills nothing; SASS ------------


@pytest.mark.parametrize("problem, schedule", _variants(), ids=lambda x: getattr(x, "key", lambda: "")() or None)
def test_every_schedule_compiles_for_sm90a(nvcc, problem, schedule, tmp_path):
    plan = hopper_plan(problem, schedule)
    compiled = compile_plan(plan, compiler=nvcc, cache_dir=tmp_path)
    assert compiled.arch == "sm_90a" and compiled.kernel_name == kernel_name(schedule)
    assert cuda_source(plan) == emit_flash_attention_sm90a(problem, schedule)
    assert compiled.cubin_path.stat().st_size > 0
    assert compiled.report.spill_bytes == 0, compiled.report
    assert not compiled.report.wgmma_serialized, compiled.report  # ptxas kept the wgmma pipeline
    assert not compiled.report.wgmma_fenced, compiled.report  # and added no fence of its own


# The schedules the search picked on the H200 benchmark shapes (results/h200-2026-11-29-sm90a.json).
BENCHMARK_WINNERS = [
    (SEED, TWO_Q, "HGMMA.64x128x16.F32.BF16"),  # also B4 H16 4k and B16 H16 1k
    (AttentionProblem(4, 16, 16, 4096, 4096, 128, causal=True), HopperFlashSchedule(128, 2, 2, False),
     "HGMMA.64x128x16.F32.BF16"),  # also B1 H32 16k causal
    (AttentionProblem(1, 8, 8, 4096, 8192, 64), HopperFlashSchedule(192, 3, 2, True, persistent=True),
     "HGMMA.64x192x16.F32.BF16"),
]


@pytest.mark.parametrize(
    "problem, schedule, hgmma", BENCHMARK_WINNERS, ids=lambda x: getattr(x, "key", lambda: "")() or None
)
def test_chosen_schedules_sass_has_wgmma_and_tma_and_no_local_memory(nvcc, sass, problem, schedule, hgmma, tmp_path):
    compiled = compile_plan(hopper_plan(problem, schedule), compiler=nvcc, cache_dir=tmp_path)
    assert compiled.report.spill_bytes == 0 and compiled.report.stack_frame == 0
    if sass is None:
        pytest.skip("cuobjdump is not installed")
    code = sass(compiled.cubin_path)
    assert hgmma in code and ".tnspB" in code  # S = Q K^T and O += P V (V MN-major)
    assert "UTMALDG" in code
    assert ("UTMASTG" in code) == schedule.o_through_smem  # O by TMA stores
    assert "USETMAXREG" in code
    assert " LDL" not in code and " STL" not in code


# ---- GPU: against PyTorch SDPA (float32 reference) ------------------------------------------

GPU_CASES = [
    (SEED, DEFAULT),
    (AttentionProblem(1, 4, 4, 2048, 2048, 128, causal=True), DEFAULT),
    (AttentionProblem(2, 8, 2, 1024, 2048, 128), HopperFlashSchedule(128, 2, 2, True)),
    (AttentionProblem(1, 8, 8, 2048, 4096, 64), DEFAULT),
    (AttentionProblem(1, 8, 2, 1024, 1024, 64, causal=True, dtype="fp16"), HopperFlashSchedule(pingpong=False)),
    (AttentionProblem(1, 4, 4, 1024, 2048, 128, dtype="fp16"), HopperFlashSchedule(128, 2, 2, False)),
    (AttentionProblem(1, 4, 4, 1024, 2048, 128, causal=True), HopperFlashSchedule(128, 2, 1, False)),
    (AttentionProblem(1, 4, 4, 1536, 1536, 64, causal=True), HopperFlashSchedule(128, 2, 3, False)),
    # persistent: several work tiles a block (ring and Q phases carried across tiles)
    (AttentionProblem(4, 16, 16, 1024, 1024, 128), PERSISTENT),
    (AttentionProblem(2, 16, 4, 2048, 2048, 128, causal=True), PERSISTENT),
    (AttentionProblem(4, 16, 16, 1024, 128, 128, dtype="fp16"), PERSISTENT),  # one key tile a work tile
    (AttentionProblem(1, 2, 2, 1024, 1024, 128), PERSISTENT),  # fewer tiles than SMs
    (AttentionProblem(1, 8, 8, 2048, 3072, 64), HopperFlashSchedule(192, 3, 2, True)),
    (AttentionProblem(2, 16, 16, 1536, 1536, 64, causal=True), HopperFlashSchedule(192, 3, 2, True, persistent=True)),
    # tails: rows past Sq not stored, keys past Skv masked (also shorter than one tile)
    (AttentionProblem(2, 8, 2, 1000, 1500, 128), DEFAULT),
    (AttentionProblem(3, 8, 8, 777, 333, 128, causal=True), PERSISTENT),
    (AttentionProblem(1, 4, 4, 100, 90, 64, dtype="fp16"), DEFAULT),
    (AttentionProblem(1, 8, 8, 4096, 8192, 64), HopperFlashSchedule(128, 3, 3, False, persistent=True)),
    (AttentionProblem(2, 4, 4, 1000, 1000, 64, causal=True), HopperFlashSchedule(128, 3, 3, False)),
    # two Q buffers: Q slots and phases carried across work tiles, next to a 2-stage split K/V ring
    (AttentionProblem(4, 16, 16, 1024, 1024, 128), TWO_Q),
    (AttentionProblem(2, 16, 4, 2048, 2048, 128, causal=True), TWO_Q),
    (AttentionProblem(4, 16, 16, 1024, 128, 128, dtype="fp16"), TWO_Q),  # one key tile a work tile
    (AttentionProblem(1, 2, 2, 1024, 1024, 128), TWO_Q),  # fewer tiles than SMs
    (AttentionProblem(3, 8, 8, 777, 333, 128, causal=True), TWO_Q),
    (AttentionProblem(2, 16, 16, 1536, 1536, 64, causal=True), HopperFlashSchedule(192, 3, 2, True, True, 2)),
    # head dims 192 and 256: three and four boxes a row, one wgmma of N = head dim for O, 64-key tiles
    (AttentionProblem(2, 8, 2, 1000, 1500, 192), HopperFlashSchedule(64, 2, 2, True)),
    (AttentionProblem(1, 8, 8, 1024, 2048, 192, causal=True), HopperFlashSchedule(128, 2, 1, False)),
    (AttentionProblem(2, 8, 8, 1024, 1024, 256), HopperFlashSchedule(64, 2, 2, True, persistent=True)),
    (AttentionProblem(1, 8, 2, 777, 1333, 256, causal=True, dtype="fp16"), HopperFlashSchedule(64, 2, 2, True)),
    # head dims short of whole boxes (the last box's columns past the end read as zeros, O's are
    # dropped) and D_v != D_qk: O through the Q tile, from registers, through its own tile
    (AttentionProblem(2, 16, 16, 1024, 1024, 96), DEFAULT),
    (AttentionProblem(2, 8, 2, 1000, 1500, 96, causal=True), PERSISTENT),
    (AttentionProblem(2, 8, 8, 777, 1024, 80, dtype="fp16"), TWO_Q),
    (AttentionProblem(2, 8, 2, 1000, 1500, 192, value_dim=128), HopperFlashSchedule(128, 2, 2, True)),
    (AttentionProblem(1, 8, 8, 1024, 2048, 192, causal=True, value_dim=128), HopperFlashSchedule(64, 2, 2, True, True)),
    (AttentionProblem(1, 8, 8, 1024, 1024, 128, value_dim=64), TWO_Q),
    (AttentionProblem(2, 8, 2, 700, 900, 64, causal=True, value_dim=128), PERSISTENT),
    # packed GQA groups: a tile of Sq rows of each of 128 / Sq heads; O through shared memory
    # (a box of 64 / Sq heads) or from registers
    (AttentionProblem(8, 32, 8, 64, 2048, 128), PACKED),
    (AttentionProblem(2, 16, 4, 32, 1000, 96), replace(PACKED, persistent=True)),
    (AttentionProblem(2, 16, 2, 16, 700, 128, dtype="fp16"), PACKED),
    (AttentionProblem(3, 8, 2, 64, 333, 64), replace(PACKED, persistent=True)),
    (AttentionProblem(2, 8, 4, 64, 1500, 128), HopperFlashSchedule(176, 2, 2, True, pack_group=True)),
    # head dim 32: 64-byte-swizzled boxes of 32 columns (O from registers, through the Q tile,
    # through its own tile; packed heads; one consumer)
    (AttentionProblem(1, 8, 8, 1024, 1024, 32), DEFAULT),
    (AttentionProblem(2, 8, 2, 1000, 1500, 32, causal=True), PERSISTENT),
    (AttentionProblem(2, 16, 16, 777, 1024, 32, dtype="fp16"), TWO_Q),
    (AttentionProblem(2, 16, 4, 1024, 1024, 32, causal=True), replace(TWO_Q, balanced=True)),
    (AttentionProblem(8, 32, 8, 64, 2048, 32), PACKED),
    (AttentionProblem(1, 4, 4, 1000, 1000, 32), HopperFlashSchedule(192, 3, 2, True)),
    (AttentionProblem(1, 4, 4, 1024, 1024, 32, causal=True), HopperFlashSchedule(128, 2, 1, False)),
    # two Q buffers beside a 3-stage ring or 192-key tiles (head dims up to 64)
    (AttentionProblem(2, 16, 4, 1000, 1500, 32, causal=True), HopperFlashSchedule(128, 3, 2, True, True, 2)),
    (AttentionProblem(2, 16, 16, 1024, 2048, 64, dtype="fp16"), HopperFlashSchedule(128, 3, 2, True, True, 2)),
    (AttentionProblem(2, 8, 2, 777, 1333, 64, causal=True), HopperFlashSchedule(192, 2, 2, True, True, 2)),
    (AttentionProblem(2, 16, 16, 2048, 2048, 32), HopperFlashSchedule(192, 2, 2, True, True, 2)),
    # balanced causal tiles: longest first over all heads, rounds alternating over the blocks
    (AttentionProblem(2, 16, 4, 2048, 2048, 128, causal=True), replace(PERSISTENT, balanced=True)),
    (AttentionProblem(3, 8, 8, 777, 333, 128, causal=True), replace(TWO_Q, balanced=True)),
    (AttentionProblem(1, 32, 8, 4096, 4096, 128, causal=True), replace(TWO_Q, balanced=True)),
    (AttentionProblem(2, 4, 4, 1000, 1000, 96, causal=True), replace(PERSISTENT, balanced=True)),
    # head dim 256 with 80-key tiles (the widest two stages fit)
    (AttentionProblem(2, 8, 8, 1000, 1000, 256), HopperFlashSchedule(80, 2, 2, True)),
    (AttentionProblem(1, 8, 2, 777, 1333, 256, causal=True), HopperFlashSchedule(80, 2, 2, True, persistent=True)),
    # lazy rescale: O and the row sums move with the row max only when a tile raises it by more than 2^8
    (AttentionProblem(2, 8, 2, 1000, 1500, 128), LAZY),
    (AttentionProblem(3, 8, 8, 777, 333, 128, causal=True), replace(LAZY, persistent=True)),
    (AttentionProblem(2, 16, 4, 2048, 2048, 128, causal=True), replace(TWO_Q, balanced=True, lazy_rescale=True)),
    (AttentionProblem(2, 8, 8, 777, 1024, 64, dtype="fp16"), replace(TWO_Q, lazy_rescale=True)),
    (AttentionProblem(8, 32, 8, 64, 2048, 128), replace(PACKED, lazy_rescale=True)),
    (AttentionProblem(1, 8, 2, 777, 1333, 256, causal=True), HopperFlashSchedule(80, 2, 2, True, lazy_rescale=True)),
    # L2 prefetch ahead of the loads: packed, causal with tails (work tiles of different lengths),
    # fewer key tiles than the prefetch distance
    (AttentionProblem(8, 32, 8, 64, 2048, 128), replace(PACKED, lazy_rescale=True, l2_prefetch=4)),
    (AttentionProblem(2, 8, 2, 1000, 1500, 128, causal=True), replace(LAZY, l2_prefetch=4)),
    (AttentionProblem(1, 4, 4, 1024, 300, 96), replace(DEFAULT, l2_prefetch=4)),
    # exponentials as polynomials for some chunks of each score tile: tails, causal diagonals, packed rows
    (AttentionProblem(2, 8, 2, 1000, 1500, 128, causal=True), replace(TWO_Q, balanced=True, lazy_rescale=True,
                                                                      poly_exp=1)),
    (AttentionProblem(8, 32, 8, 64, 2048, 128), replace(PACKED, lazy_rescale=True, poly_exp=2)),
    (AttentionProblem(2, 8, 8, 777, 1024, 64, dtype="fp16"), replace(TWO_Q, poly_exp=4)),
    # head dims that are multiples of 8, not 16 (Stable Diffusion's 40): Q K^T's last k step reads the
    # box's zero columns; 200 (a last box of 8 columns), 8 and 24 (64-byte rows), D_v != D_qk
    (AttentionProblem(2, 8, 8, 777, 1024, 40), DEFAULT),
    (AttentionProblem(2, 8, 2, 1000, 1500, 40, causal=True), replace(TWO_Q, balanced=True)),
    (AttentionProblem(2, 8, 8, 333, 700, 72, dtype="fp16"), PERSISTENT),
    (AttentionProblem(1, 4, 4, 500, 900, 200), HopperFlashSchedule(64, 2, 2, True)),
    (AttentionProblem(2, 4, 4, 300, 500, 24), TWO_Q),
    (AttentionProblem(2, 4, 4, 300, 500, 8, causal=True), DEFAULT),
    (AttentionProblem(2, 8, 2, 64, 1000, 40), PACKED),
    (AttentionProblem(1, 8, 8, 500, 700, 40, value_dim=64), PERSISTENT),
]

# Scores that rise along the keys (keys scaled by up to RISE), so later key tiles raise the row
# max by more than the lazy threshold and the lazy schedules take their rescale path too.
RISE = 12.0
RISING_CASES = [
    (AttentionProblem(2, 8, 2, 1000, 1500, 128), LAZY),
    (AttentionProblem(2, 8, 2, 1000, 1500, 128, causal=True), replace(TWO_Q, balanced=True, lazy_rescale=True)),
    (AttentionProblem(2, 8, 2, 1000, 1500, 128), DEFAULT),
    (AttentionProblem(2, 8, 2, 1000, 1500, 128), replace(LAZY, poly_exp=2)),
]


def _reference(torch, p: AttentionProblem, q, k, v):
    group = p.heads // p.kv_heads
    k32 = k.float().repeat_interleave(group, dim=1)
    v32 = v.float().repeat_interleave(group, dim=1)
    return torch.nn.functional.scaled_dot_product_attention(q.float(), k32, v32, is_causal=p.causal)


def _assert_matches_reference(torch, problem: AttentionProblem, q, k, v, out) -> None:
    """``out`` has no NaN and is within TOLERANCE (relative L2) of float32 SDPA on q, k, v."""
    ref = _reference(torch, problem, q, k, v)
    assert not torch.isnan(out).any()
    error = ((out.float() - ref).norm() / ref.norm()).item()
    assert error <= TOLERANCE, f"relative L2 error {error:.3g}"


@pytest.mark.gpu
@pytest.mark.parametrize("problem, schedule", GPU_CASES, ids=lambda x: getattr(x, "key", lambda: "")() or None)
def test_kernel_matches_sdpa(gpu, problem, schedule, tmp_path):
    torch = gpu
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("sm_90a kernels need a Hopper GPU")
    kernel = load_kernel(compile_plan(hopper_plan(problem, schedule), cache_dir=tmp_path))
    assert isinstance(kernel, HopperFlashKernel)
    dtype = torch.bfloat16 if problem.dtype == "bf16" else torch.float16
    torch.manual_seed(0)
    shapes = problem.shapes()
    q, k, v = (torch.randn(shapes[name], device="cuda", dtype=dtype) for name in (problem.q, problem.k, problem.v))
    out = torch.full(shapes[problem.out], math.nan, device="cuda", dtype=dtype)
    kernel(q, k, v, out)
    torch.cuda.synchronize()
    _assert_matches_reference(torch, problem, q, k, v, out)


@pytest.mark.gpu
@pytest.mark.parametrize("problem, schedule", RISING_CASES, ids=lambda x: getattr(x, "key", lambda: "")() or None)
def test_kernel_matches_sdpa_on_scores_rising_along_the_keys(gpu, problem, schedule, tmp_path):
    torch = gpu
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("sm_90a kernels need a Hopper GPU")
    kernel = load_kernel(compile_plan(hopper_plan(problem, schedule), cache_dir=tmp_path))
    torch.manual_seed(1)
    shapes = problem.shapes()
    q, k, v = (torch.randn(shapes[name], device="cuda") for name in (problem.q, problem.k, problem.v))
    k = k * torch.linspace(0.25, RISE, problem.seq_kv, device="cuda").view(1, 1, -1, 1)
    q, k, v = (x.to(torch.bfloat16) for x in (q, k, v))
    out = kernel(q, k, v)
    torch.cuda.synchronize()
    _assert_matches_reference(torch, problem, q, k, v, out)
