"""FlashLayout and FlashTiling: shared-memory placement, swizzle properties, tiling numbers."""

from __future__ import annotations

import itertools

import pytest

from cherenkov.codegen.plan import CHUNK_BYTES, FlashLayout, FlashTiling, valid_flash_plans
from cherenkov.rewrites.plan import (
    TARGETS,
    AttentionProblem,
    KernelPlan,
    flash_schedule_problems,
    flash_smem_bytes,
    tile_row_elements,
)
from cherenkov.rewrites.schedule import flash_schedules

PROBLEMS = [
    AttentionProblem(1, 8, 8, 4096, 8192, d, dtype=dtype, causal=causal)
    for d, dtype, causal in itertools.product((64, 128), ("bf16", "fp16"), (False, True))
]


@pytest.mark.parametrize("target", ["sm_80", "sm_90", "sm_120"])
@pytest.mark.parametrize("problem", PROBLEMS, ids=lambda p: f"d{p.head_dim}_{p.dtype}_c{int(p.causal)}")
def test_layout_total_equals_flash_smem_bytes(problem, target):
    plans = valid_flash_plans(problem, TARGETS[target])
    assert plans
    for plan in plans:
        layout = FlashLayout.from_plan(plan)
        assert layout.total_bytes == flash_smem_bytes(plan.schedule, problem.head_dim, problem.dtype)
        assert layout.total_bytes <= plan.target.smem_per_block


@pytest.mark.parametrize("target", ["sm_80", "sm_120"])
@pytest.mark.parametrize("dims", [(32, 0), (80, 0), (96, 0), (192, 0), (256, 0), (192, 128), (64, 128)])
def test_padded_rows_and_value_dims_keep_the_layout_total(dims, target):
    """Head dims narrower than a power-of-two row are padded to one; V and O rows are as wide
    as the tile rows; every short-query schedule's layout totals flash_smem_bytes too."""
    head_dim, value_dim = dims
    problems = [AttentionProblem(2, 8, 2, sq, 4096, head_dim, value_dim=value_dim) for sq in (1, 1000)]
    for schedule in flash_schedules(head_dim, TARGETS[target], value_dim):
        for problem in problems:
            if flash_schedule_problems(schedule, problem, TARGETS[target]):
                continue
            plan = KernelPlan("flash_attention", problem, schedule, TARGETS[target])
            layout = FlashLayout.from_plan(plan)
            assert layout.total_bytes == flash_smem_bytes(schedule, head_dim, problem.dtype, value_dim)
            assert layout.row_bytes == 2 * tile_row_elements(head_dim, value_dim) >= 2 * max(head_dim, value_dim)
            assert layout.row_bytes & (layout.row_bytes - 1) == 0, "a power of two: the ldmatrix steps are XORs"
            assert layout.value_chunks * 8 == problem.v_dim
            tiling = FlashTiling.from_plan(plan)
            assert tiling.d_ntiles * 8 == problem.v_dim and tiling.d_steps * 16 == head_dim
            assert tiling.grid[0] == tiling.q_tiles * schedule.kv_splits


def test_tiles_are_contiguous_and_disjoint(seed_problem):
    for plan in valid_flash_plans(seed_problem, TARGETS["sm_90"]):
        layout = FlashLayout.from_plan(plan)
        spans = [(layout.q_offset, layout.q_tile_bytes)]
        for stage in range(layout.stages):
            spans += [(layout.k_offset(stage), layout.kv_tile_bytes), (layout.v_offset(stage), layout.kv_tile_bytes)]
        position = 0
        for start, size in spans:
            assert start == position and start % 128 == 0
            position += size
        assert position == layout.tiles_bytes
        assert layout.total_bytes == layout.tiles_bytes + layout.align_slack
        if plan.schedule.tma_kv:  # every box on a 1024-byte swizzle atom
            assert layout.align_slack == 1024
            assert all(start % 1024 == 0 for start, _ in spans[1:]) and layout.kv_box_bytes % 1024 == 0


def tma_swizzle_128b(offset: int) -> int:
    """The copy engine's 128-byte swizzle inside a 1024-byte aligned atom: address bits 4-6 XOR bits 7-9."""
    return offset ^ (((offset >> 7) & 7) << 4)


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("block_kv", [32, 64, 128])
def test_kv_boxes_are_the_tma_128_byte_swizzle(head_dim, block_kv):
    """K/V chunk offsets of a TMA layout: box c // 8, inside it the hardware's 128-byte swizzle."""
    layout = FlashLayout(128, block_kv, head_dim, 2, 2, True, tma_kv=True)
    assert layout.kv_boxes == head_dim // 64 and layout.kv_box_bytes == block_kv * 128
    offsets = set()
    for row, chunk in itertools.product(range(block_kv), range(layout.chunks_per_row)):
        box, column = divmod(chunk, 8)
        offset = layout.kv_chunk_offset(row, chunk)
        assert offset == box * layout.kv_box_bytes + tma_swizzle_128b(row * 128 + column * CHUNK_BYTES)
        offsets.add(offset)
    assert offsets == set(range(0, layout.kv_tile_bytes, CHUNK_BYTES))  # a permutation of the tile
    if head_dim == 64:  # one box: the cp.async layout, read by the plain loaders
        assert all(layout.kv_chunk_offset(r, c) == layout.chunk_offset(r, c) for r in range(block_kv) for c in range(8))


@pytest.mark.parametrize("head_dim", [64, 128])
def test_boxed_k_steps_are_a_box_offset_and_the_same_xor(head_dim):
    """The boxed loaders reach chunk c + 2·kk (K: k-step kk; V: dims 16·kk) as box kk / 4 plus the
    first offset XOR (kk % 4) << 5, and an ldmatrix phase (8 rows, one chunk) hits 8 bank groups."""
    layout = FlashLayout(128, 64, head_dim, 2, 2, True, tma_kv=True)
    for row, chunk, kk in itertools.product(range(64), (0, 1), range(head_dim // 16)):
        expected = (kk >> 2) * layout.kv_box_bytes + (layout.kv_chunk_offset(row, chunk) ^ ((kk & 3) << 5))
        assert layout.kv_chunk_offset(row, chunk + 2 * kk) == expected
    for first_row, chunk in itertools.product(range(0, 64, 8), range(layout.chunks_per_row)):
        rows = range(first_row, first_row + 8)
        assert len({(layout.kv_chunk_offset(r, chunk) // CHUNK_BYTES) % 8 for r in rows}) == 8


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("swizzle", [True, False])
def test_chunk_offsets_permute_each_row(head_dim, swizzle):
    layout = FlashLayout(128, 64, head_dim, 2, 2, swizzle)
    for row in range(16):
        offsets = {layout.chunk_offset(row, c) for c in range(layout.chunks_per_row)}
        expected = {row * layout.row_bytes + c * CHUNK_BYTES for c in range(layout.chunks_per_row)}
        assert offsets == expected


@pytest.mark.parametrize("head_dim", [64, 128])
def test_swizzle_spreads_an_ldmatrix_phase_over_all_banks(head_dim):
    """8 consecutive rows, same chunk: 8 distinct 16-byte bank groups when swizzled, one when linear."""
    swizzled = FlashLayout(128, 64, head_dim, 2, 2, True)
    linear = FlashLayout(128, 64, head_dim, 2, 2, False)
    for first_row, chunk in itertools.product(range(0, 64, 8), range(swizzled.chunks_per_row)):
        rows = range(first_row, first_row + 8)
        assert len({(swizzled.chunk_offset(r, chunk) // CHUNK_BYTES) % 8 for r in rows}) == 8
        assert len({(linear.chunk_offset(r, chunk) // CHUNK_BYTES) % 8 for r in rows}) == 1


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("swizzle", [True, False])
def test_k_steps_are_xor_of_the_first_offset(head_dim, swizzle):
    """The fragment loaders reach chunk c + 2·kk of a row by XOR-ing kk << 5 into chunk c's offset."""
    layout = FlashLayout(128, 64, head_dim, 2, 2, swizzle)
    for row, chunk, kk in itertools.product(range(16), (0, 1), range(head_dim // 16)):
        assert layout.chunk_offset(row, chunk) ^ (kk << 5) == layout.chunk_offset(row, chunk + 2 * kk)


def test_tiling_of_the_default_plan(seed_problem):
    plans = valid_flash_plans(seed_problem, TARGETS["sm_90"])
    plan = next(p for p in plans if p.schedule.key() == "q128_kv64_w4_s2_split_swz_x4")
    tiling = FlashTiling.from_plan(plan)
    assert (tiling.m_tiles, tiling.kv_ntiles, tiling.kv_steps, tiling.d_ntiles, tiling.d_steps) == (2, 8, 4, 16, 8)
    assert (tiling.q_tiles, tiling.kv_tiles) == (32, 128)
    assert not tiling.q_in_registers
