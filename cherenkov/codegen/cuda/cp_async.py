"""Asynchronous global→shared copies (``cp.async``, sm_80+) and the cooperative tile loader.

Every copy moves 16 bytes and bypasses L1 (``.cg``). Rows past the end of a sequence are
zero-filled through the src-size operand (0 bytes read, 16 written as zero) with the
source address clamped to a valid row, so tails need no separate path and never feed
garbage (possibly NaN) into the mma. Copies are grouped with ``commit_group`` and waited
for with ``wait_group N`` (at most N groups still in flight).

The tile loader needs ``THREADS``, ``CHUNKS_PER_ROW``, ``QK_DATA_CHUNKS`` and ``smem_offset``.
"""

from __future__ import annotations

from cherenkov.codegen.cuda.text import block


def emit_cp_async() -> str:
    """The three cp.async primitives."""
    return block(
        """
        // Copy 16 bytes global -> shared without blocking; in_range = false writes 16 zero bytes.
        __device__ __forceinline__ void cp_async_16(u32 smem_addr, const void* gmem, bool in_range) {
            const int src_bytes = in_range ? 16 : 0;
            asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\\n"
                         :: "r"(smem_addr), "l"(gmem), "r"(src_bytes) : "memory");
        }

        // Close the current group of cp.async copies.
        __device__ __forceinline__ void cp_async_commit() {
            asm volatile("cp.async.commit_group;\\n" ::: "memory");
        }

        // Wait until at most N committed groups are still in flight.
        template <int N>
        __device__ __forceinline__ void cp_async_wait() {
            asm volatile("cp.async.wait_group %0;\\n" :: "n"(N) : "memory");
        }
        """
    )


def emit_cp_async_arrive() -> str:
    """``cp_async_arrive(bar)``: an arrival on an mbarrier once the thread's earlier copies have landed
    (``cp.async.mbarrier.arrive.noinc``: the barrier's count includes it)."""
    return block(
        """
        // One arrival on `bar` once every earlier cp.async of this thread has landed.
        __device__ __forceinline__ void cp_async_arrive(u32 bar) {
            asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\\n" :: "r"(bar) : "memory");
        }
        """
    )


def emit_tile_loader() -> str:
    """``load_tile<ROWS, GUARD, ROW_STRIDE, CHUNKS, DATA>``: the whole block copies a ``ROWS × 8·CHUNKS``
    tile whose rows lie ``ROW_STRIDE`` elements apart, coalesced, zero-filling each row's chunks from ``DATA``
    on (a head dim padded to a whole k16 step)."""
    return block(
        """
        // Copy rows [0, ROWS) of a ROWS x (8 CHUNKS) tile (CHUNKS 16-byte chunks a row: Q and K
        // rows by default, V rows with V_CHUNKS), rows ROW_STRIDE elements apart, into shared
        // memory. When the block's threads cover whole rows, thread t always copies chunk
        // t % CHUNKS of rows t / CHUNKS + i * ROWS_PER_PASS: consecutive threads read consecutive
        // 16 bytes of a row (coalesced), and every address is one per-thread base plus a
        // compile-time offset; otherwise (head dims 80 and 96, or a pass longer than the tile)
        // thread t copies chunks t + i * THREADS of the tile in row-major order. With GUARD, a
        // tile that ends past valid_rows takes a separate path that zero-fills the missing rows
        // (reading nothing; their source is clamped to row 0), so whole tiles pay nothing for
        // the tail. A row's chunks from DATA on are zero-filled too (the columns that pad a head dim to a
        // multiple of 16, which Q K^T's last k16 step and P V's last n8 pair read).
        template <int ROWS, bool GUARD, int ROW_STRIDE, int CHUNKS = CHUNKS_PER_ROW, int DATA = QK_DATA_CHUNKS>
        __device__ __forceinline__ void load_tile(u32 smem_tile, const elem_t* gmem_rows, int valid_rows) {
            constexpr int ROWS_PER_PASS = THREADS / CHUNKS;
            if constexpr (THREADS % CHUNKS != 0 || ROWS_PER_PASS == 0 || ROWS % ROWS_PER_PASS != 0) {
                constexpr int TILE_CHUNKS = ROWS * CHUNKS;
                #pragma unroll
                for (int i = 0; i < (TILE_CHUNKS + THREADS - 1) / THREADS; ++i) {
                    const int c = int(threadIdx.x) + i * THREADS;
                    const int row = c / CHUNKS;
                    const int chunk = c % CHUNKS;
                    const bool in_range = (!GUARD || row < valid_rows) && (DATA == CHUNKS || chunk < DATA);
                    if (TILE_CHUNKS % THREADS == 0 || c < TILE_CHUNKS) {
                        cp_async_16(smem_tile + smem_offset(row, chunk),
                                    in_range ? gmem_rows + row * ROW_STRIDE + 8 * chunk : gmem_rows, in_range);
                    }
                }
            } else {
                const int chunk = int(threadIdx.x) % CHUNKS;
                const int first_row = int(threadIdx.x) / CHUNKS;
                const bool data = DATA == CHUNKS || chunk < DATA;
                const elem_t* first_src = data ? gmem_rows + first_row * ROW_STRIDE + 8 * chunk : gmem_rows;
                if (GUARD && valid_rows < ROWS) {
                    #pragma unroll
                    for (int i = 0; i < ROWS / ROWS_PER_PASS; ++i) {
                        const int row = first_row + i * ROWS_PER_PASS;
                        const bool in_range = data && row < valid_rows;
                        const elem_t* src = in_range ? first_src + i * ROWS_PER_PASS * ROW_STRIDE : gmem_rows;
                        cp_async_16(smem_tile + smem_offset(row, chunk), src, in_range);
                    }
                } else {
                    #pragma unroll
                    for (int i = 0; i < ROWS / ROWS_PER_PASS; ++i) {
                        const int row = first_row + i * ROWS_PER_PASS;
                        cp_async_16(smem_tile + smem_offset(row, chunk),
                                    data ? first_src + i * ROWS_PER_PASS * ROW_STRIDE : gmem_rows, data);
                    }
                }
            }
        }
        """
    )
