"""Shared-memory tiles: the XOR-swizzled or linear address function, and 32/128-bit accesses.

Tiles are ``rows × HEAD_DIM`` 16-bit elements, ``ROW_BYTES`` a row, addressed in 16-byte
chunks. An ldmatrix phase reads one chunk from each of 8 consecutive rows; with a row
pitch of 128 or 256 bytes those 8 chunks would share banks (8-way conflict). The swizzle
stores chunk ``c`` of row ``r`` at position ``c ^ (r % 8)``, spreading the 8 rows over
all 32 banks. Mirrors :meth:`cherenkov.codegen.plan.FlashLayout.chunk_offset`.

Needs the constant ``ROW_BYTES``.
"""

from __future__ import annotations

from cherenkov.codegen.cuda.text import block
from cherenkov.codegen.plan import SWIZZLE_ROWS


def emit_tile_addressing(swizzle: bool) -> str:
    """``smem_offset(row, chunk)``: byte offset of a 16-byte chunk inside a tile."""
    if swizzle:
        return block(
            f"""
            // Byte offset of 16-byte chunk `chunk` of row `row` in a tile. XOR swizzle: the chunk
            // index is permuted by row % {SWIZZLE_ROWS}, so 8 consecutive rows hit 8 distinct bank groups.
            __device__ __forceinline__ u32 smem_offset(int row, int chunk) {{
                return u32(row) * ROW_BYTES + (u32(chunk ^ (row & {SWIZZLE_ROWS - 1})) << 4);
            }}
            """
        )
    return block(
        """
        // Byte offset of 16-byte chunk `chunk` of row `row` in a tile (linear layout, no swizzle).
        __device__ __forceinline__ u32 smem_offset(int row, int chunk) {
            return u32(row) * ROW_BYTES + (u32(chunk) << 4);
        }
        """
    )


def emit_shared_access() -> str:
    """``st_shared_b32`` and ``ld_shared_v4``: plain accesses at 32-bit shared addresses."""
    return block(
        """
        __device__ __forceinline__ void st_shared_b32(u32 addr, u32 value) {
            asm volatile("st.shared.b32 [%0], %1;\\n" :: "r"(addr), "r"(value) : "memory");
        }

        __device__ __forceinline__ uint4 ld_shared_v4(u32 addr) {
            uint4 r;
            asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];\\n"
                         : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "r"(addr) : "memory");
            return r;
        }
        """
    )
