"""The N-stage cp.async ring that streams K and V tiles through shared memory.

Stage ``j % STAGES`` holds the K and V tiles of key tile ``j``. The Q tile is the first
cp.async group. Two choreographies (the ``kv_split`` knob):

* **split** — K and V tiles are separate groups, committed in the order
  ``K0 V0 K1 V1 … K(S−1) | V(S−1) K(S) | V(S) K(S+1) | …``. Step ``j``: wait for K_j and
  barrier (everyone also finished P·V of step j−1), start V_(j+S−1) into the stage step j−1
  used; compute scores and softmax while it lands; wait for V_j and barrier (everyone
  finished reading K_j), start K_(j+S) into K_j's buffer; then P·V. Both waits leave
  ``2S−2`` groups in flight. With one stage this is the classic "load K_(j+1) during P·V,
  V_j during QKᵀ" overlap.
* **joint** — one group per tile. With ``S ≥ 2``: wait for tile j (``S−2`` in flight),
  barrier, start tile ``j+S−1`` into the stage of step j−1, compute. With one stage there
  is no overlap: barrier, load tile j, wait, barrier, compute.

Tiles at or past ``n_tiles`` (the causal or sequence end) are never loaded; their groups are
committed empty so that the wait counts stay compile-time constants.

Two variants of the joint ring (``S ≥ 2``). **Late copy**: tile ``j+S−1`` is issued after
tile j's softmax (in ``pipeline_wait_v``) rather than after its wait. **mbarrier ring**
(:class:`MbarrierKvPipeline`): no block barrier and no commit groups; stage ``s`` has a
*full* mbarrier (count ``THREADS``: each thread arrives with ``cp.async.mbarrier.arrive.noinc``
once its copies into the stage have landed) and an *empty* one (count ``WARPS``: each warp
arrives once its P·V of the stage's tile is done, in ``pipeline_release``). Tile ``t`` is
use ``t / S`` of stage ``t % S``: readers wait for phase parity ``(t / S) & 1`` of *full*,
and a thread refilling the stage with tile ``t ≥ S`` first waits for parity
``(t / S − 1) & 1`` of *empty*. The Q tile's copies come before every thread's first
arrival, so tile 0's *full* phase also covers Q. Its **TMA** form fills a stage with the
boxes of K and V (thread 0, one ``expect_tx`` arrival, *full* counts 1) and waits for Q's
cp.async copies once in the prologue. With the **last warp's refill** the TMA ring has no
*empty* barriers: each warp's lane 0 counts itself out of a stage (a shared counter) after
its P·V, and the warp that completes the count starts tile ``t + S`` into the stage at
once, so no thread waits for the others; the prologue starts all ``S`` stages.
Tile ``j`` of the ring is key tile ``kv_tile(j)`` of the sequence (a key split's tiles are
counted from 0). Needs ``load_tile``, ``kv_tile``, the cp.async primitives and the
layout/problem constants.
"""

from __future__ import annotations

from dataclasses import dataclass

from cherenkov.codegen.cuda import cp_async, tma
from cherenkov.codegen.cuda.text import block

_SIGNATURE = "u32 smem, const elem_t* k_head, const elem_t* v_head, int j, int slot, int n_tiles"


def _emit_load_kv_tile() -> str:
    return block(
        """
        // Copy K or V tile `tile` of one head (rows ROW_STRIDE elements apart, CHUNKS 16-byte chunks
        // a row, DATA of them read, the rest zeros) into a stage buffer (no commit). kv_tile: the tile of
        // the sequence it is.
        template <int ROW_STRIDE, int CHUNKS, int DATA>
        __device__ __forceinline__ void load_kv_tile(u32 stage_tile, const elem_t* head, int tile) {
            load_tile<BLOCK_KV, KV_TAIL, ROW_STRIDE, CHUNKS, DATA>(stage_tile,
                                                                   head + size_t(kv_tile(tile)) * BLOCK_KV * ROW_STRIDE,
                                                                   SEQ_KV - kv_tile(tile) * BLOCK_KV);
        }
        """
    )


@dataclass(frozen=True)
class KvPipeline:
    """Wait counts and device functions of one (stages, kv_split, late_copy) choreography."""

    stages: int
    kv_split: bool
    late_copy: bool = False

    @property
    def groups_after_q(self) -> int:
        """Groups the prologue commits after Q's (in flight when Q alone must have landed)."""
        return 2 * self.stages - 1 if self.kv_split else self.stages - 1

    def emit(self) -> str:
        """Tile issuers plus ``pipeline_prologue``, ``pipeline_wait_q``, ``pipeline_wait_k`` and
        ``pipeline_wait_v`` (called before the scores and before P·V of each step)."""
        return "\n\n".join([self._emit_issuers(), self._emit_prologue(), self._emit_waits()])

    def _emit_issuers(self) -> str:
        copy = _emit_load_kv_tile()
        if self.kv_split:
            return copy + "\n\n" + block(
                """
                // Start copying K tile `tile` into stage `slot` as one cp.async group (empty past n_tiles).
                __device__ __forceinline__ void issue_k(u32 smem, const elem_t* k_head, int tile, int slot, int n_tiles) {
                    if (tile < n_tiles) {
                        load_kv_tile<K_ROW_STRIDE, CHUNKS_PER_ROW, QK_DATA_CHUNKS>(smem + K_SMEM + u32(slot) * STAGE_BYTES, k_head, tile);
                    }
                    cp_async_commit();
                }

                // The same for V tile `tile`.
                __device__ __forceinline__ void issue_v(u32 smem, const elem_t* v_head, int tile, int slot, int n_tiles) {
                    if (tile < n_tiles) {
                        load_kv_tile<V_ROW_STRIDE, V_CHUNKS, V_DATA_CHUNKS>(smem + V_SMEM + u32(slot) * STAGE_BYTES, v_head, tile);
                    }
                    cp_async_commit();
                }
                """
            )
        return copy + "\n\n" + block(
            """
            // Start copying K and V tile `tile` into stage `slot` as one cp.async group (empty past n_tiles).
            __device__ __forceinline__ void issue_kv(u32 smem, const elem_t* k_head, const elem_t* v_head,
                                                     int tile, int slot, int n_tiles) {
                if (tile < n_tiles) {
                    load_kv_tile<K_ROW_STRIDE, CHUNKS_PER_ROW, QK_DATA_CHUNKS>(smem + K_SMEM + u32(slot) * STAGE_BYTES, k_head, tile);
                    load_kv_tile<V_ROW_STRIDE, V_CHUNKS, V_DATA_CHUNKS>(smem + V_SMEM + u32(slot) * STAGE_BYTES, v_head, tile);
                }
                cp_async_commit();
            }
            """
        )

    def _emit_prologue(self) -> str:
        s = self.stages
        if self.kv_split:
            issues = []
            for t in range(s):
                issues.append(f"issue_k(smem, k_head, {t}, {t}, n_tiles);")
                if t < s - 1:
                    issues.append(f"issue_v(smem, v_head, {t}, {t}, n_tiles);")
            what = f"K tiles 0..{s - 1} and V tiles before {s - 1}"
        else:
            issues = [f"issue_kv(smem, k_head, v_head, {t}, {t}, n_tiles);" for t in range(s - 1)]
            what = f"K/V tiles 0..{s - 2}" if s > 1 else "nothing (one stage loads each tile when it is due)"
        body = "\n".join(f"    {line}" for line in issues) or "    // (no tile is prefetched)"
        return (
            f"// Prefetch before the main loop: {what}.\n"
            "__device__ __forceinline__ void pipeline_prologue(u32 smem, const elem_t* k_head, const elem_t* v_head,\n"
            "                                                  int n_tiles) {\n"
            f"{body}\n"
            "}\n\n"
            "// Wait until the Q tile (the first group) has landed for the whole block.\n"
            "__device__ __forceinline__ void pipeline_wait_q() {\n"
            f"    cp_async_wait<{self.groups_after_q}>();\n"
            "    __syncthreads();\n"
            "}"
        )

    def _emit_waits(self) -> str:
        s = self.stages
        prev_slot = "slot == 0 ? STAGES - 1 : slot - 1"
        if self.kv_split:
            return block(
                f"""
                // Before the scores of step j: K_j is in shared memory for every thread, and V_(j+S-1)
                // starts into the stage step j-1 used (all warps are past its P*V).
                __device__ __forceinline__ void pipeline_wait_k({_SIGNATURE}) {{
                    cp_async_wait<{2 * s - 2}>();
                    __syncthreads();
                    issue_v(smem, v_head, j + {s - 1}, {prev_slot}, n_tiles);
                }}

                // Before P*V of step j: V_j has landed, and K_(j+S) starts into K_j's buffer (all warps
                // are past their scores).
                __device__ __forceinline__ void pipeline_wait_v({_SIGNATURE}) {{
                    cp_async_wait<{2 * s - 2}>();
                    __syncthreads();
                    issue_k(smem, k_head, j + {s}, slot, n_tiles);
                }}
                """
            )
        if s == 1:
            wait_k = block(
                f"""
                // Before the scores of step j (one stage, no overlap): all warps are done with the
                // previous tile, then tile j is loaded and waited for.
                __device__ __forceinline__ void pipeline_wait_k({_SIGNATURE}) {{
                    __syncthreads();
                    issue_kv(smem, k_head, v_head, j, slot, n_tiles);
                    cp_async_wait<0>();
                    __syncthreads();
                }}
                """
            )
        elif self.late_copy:
            return block(
                f"""
                // Before the scores of step j: tile j (K and V) has landed for every thread (and all
                // warps are past step j-1, so the stage it used is free).
                __device__ __forceinline__ void pipeline_wait_k(u32, const elem_t*, const elem_t*, int, int, int) {{
                    cp_async_wait<{s - 2}>();
                    __syncthreads();
                }}

                // Before P*V of step j (late copy): V_j arrived with K_j; tile j+S-1 starts into the
                // stage step j-1 used, now that the scores' ldmatrix are done.
                __device__ __forceinline__ void pipeline_wait_v({_SIGNATURE}) {{
                    issue_kv(smem, k_head, v_head, j + {s - 1}, {prev_slot}, n_tiles);
                }}
                """
            )
        else:
            wait_k = block(
                f"""
                // Before the scores of step j: tile j (K and V) has landed for every thread, and tile
                // j+S-1 starts into the stage step j-1 used (all warps are past it).
                __device__ __forceinline__ void pipeline_wait_k({_SIGNATURE}) {{
                    cp_async_wait<{s - 2}>();
                    __syncthreads();
                    issue_kv(smem, k_head, v_head, j + {s - 1}, {prev_slot}, n_tiles);
                }}
                """
            )
        return wait_k + "\n\n" + block(
            """
            // Before P*V of step j: V_j arrived with K_j, nothing to wait for.
            __device__ __forceinline__ void pipeline_wait_v(u32, const elem_t*, const elem_t*, int, int, int) {}
            """
        )


def _emit_start_kv() -> str:
    return block(
        """
        // Start the TMA boxes of K and V tile `tile` into stage `slot` (= tile % STAGES), which
        // no warp reads any more; the stage's full barrier expects their bytes (rows past
        // SEQ_KV arrive as zeros and count too).
        __device__ __forceinline__ void start_kv(u32 smem, KvSource k_head, KvSource v_head, int tile, int slot) {
            const u32 full = full_barrier(slot);
            mbar_arrive_expect_tx(full, 2 * KV_BOXES * KV_BOX_BYTES);
            #pragma unroll
            for (int box = 0; box < KV_BOXES; ++box) {
                const u32 offset = u32(slot) * STAGE_BYTES + u32(box) * KV_BOX_BYTES;
                tma_load_4d(smem + K_SMEM + offset, k_head.map, full, 64 * box, kv_tile(tile) * BLOCK_KV, k_head.head, k_head.batch);
                tma_load_4d(smem + V_SMEM + offset, v_head.map, full, 64 * box, kv_tile(tile) * BLOCK_KV, v_head.head, v_head.batch);
            }
        }
        """
    )


@dataclass(frozen=True)
class MbarrierKvPipeline:
    """The joint ring synchronised by per-stage full/empty mbarriers (``stages ≥ 2``), with
    the next tile's copies issued before the scores or, ``late_copy``, before P·V; ``tma``:
    the copies are TMA boxes issued by thread 0 (see :meth:`emit`); ``last_warp_refill``
    (TMA): no *empty* barriers, the last warp to release a stage refills it."""

    stages: int
    late_copy: bool = False
    tma: bool = False
    last_warp_refill: bool = False

    @property
    def release_call(self) -> str:
        """The statement that ends a warp's tile step: it releases the stage (and, with the
        last warp's refill, may start the tile ``stages`` ahead into it)."""
        if self.last_warp_refill:
            return "pipeline_release(smem, k_head, v_head, j, slot, n_tiles, lane);"
        return "pipeline_release(slot, lane);"

    @property
    def source(self) -> str:
        """The C++ type the ring reads a head's K or V from: its first row (cp.async) or its
        ``KvSource`` (TMA: tensor map, K/V head and batch)."""
        return "KvSource" if self.tma else "const elem_t*"

    def emit(self) -> str:
        """Barrier primitives, ``issue_kv``, ``pipeline_prologue`` (initialises the barriers),
        ``pipeline_wait_q``, ``pipeline_wait_k`` and ``pipeline_wait_v``.

        With ``tma`` a stage's *full* barrier has one arrival (thread 0's ``expect_tx`` of
        both tiles' bytes) and completes when the copy engine has written them; the Q tile
        (cp.async) is waited for once, at the end of the prologue."""
        if self.last_warp_refill:
            return "\n\n".join(self._emit_refill_ring())
        ring = self._emit_tma_ring() if self.tma else self._emit_cp_async_ring()
        return "\n\n".join([*ring, self._emit_waits()])

    @staticmethod
    def _emit_barriers() -> str:
        return block(
            """
            // The ring's barriers: full[s] then empty[s], one 64-bit mbarrier each.
            __shared__ __align__(8) unsigned long long ring_barriers[2 * STAGES];

            __device__ __forceinline__ u32 full_barrier(int slot) {
                return u32(__cvta_generic_to_shared(&ring_barriers[slot]));
            }

            __device__ __forceinline__ u32 empty_barrier(int slot) {
                return u32(__cvta_generic_to_shared(&ring_barriers[STAGES + slot]));
            }
            """
        )

    def _emit_cp_async_ring(self) -> list[str]:
        return [
            tma.emit_mbarrier_basics(),
            _emit_load_kv_tile(),
            self._emit_barriers() + "\n\n" + cp_async.emit_cp_async_arrive() + "\n\n" + block(
                """
                // Start copying K and V tile `tile` into stage `slot` (= tile % STAGES) once every warp
                // has released the tile STAGES before it; the stage's full barrier counts the copies.
                // Tiles past n_tiles are never read, so they are neither copied nor counted.
                __device__ __forceinline__ void issue_kv(u32 smem, const elem_t* k_head, const elem_t* v_head,
                                                         int tile, int slot, int n_tiles) {
                    if (tile < n_tiles) {
                        if (tile >= STAGES) {
                            mbar_wait(empty_barrier(slot), (tile / STAGES - 1) & 1);
                        }
                        load_kv_tile<K_ROW_STRIDE, CHUNKS_PER_ROW, QK_DATA_CHUNKS>(smem + K_SMEM + u32(slot) * STAGE_BYTES, k_head, tile);
                        load_kv_tile<V_ROW_STRIDE, V_CHUNKS, V_DATA_CHUNKS>(smem + V_SMEM + u32(slot) * STAGE_BYTES, v_head, tile);
                        cp_async_arrive(full_barrier(slot));
                    }
                }
                """
            ),
            block(
                """
                // Thread 0 initialises the barriers; then the first STAGES - 1 tiles start.
                __device__ __forceinline__ void pipeline_prologue(u32 smem, const elem_t* k_head, const elem_t* v_head,
                                                                  int n_tiles) {
                    if (threadIdx.x == 0) {
                        #pragma unroll
                        for (int s = 0; s < STAGES; ++s) {
                            mbar_init(full_barrier(s), THREADS);
                            mbar_init(empty_barrier(s), WARPS);
                        }
                    }
                    __syncthreads();
                    #pragma unroll
                    for (int t = 0; t < STAGES - 1; ++t) {
                        issue_kv(smem, k_head, v_head, t, t, n_tiles);
                    }
                }

                // The Q tile has landed for the whole block: every thread copied its part of Q before
                // arriving on tile 0's full barrier.
                __device__ __forceinline__ void pipeline_wait_q() {
                    mbar_wait(full_barrier(0), 0);
                }
                """
            ),
        ]

    def _emit_tma_ring(self) -> list[str]:
        return [
            tma.emit_mbarrier(),
            tma.emit_tma_load(4),
            self._emit_barriers() + "\n\n" + _emit_start_kv() + "\n\n" + block(
                """
                // Thread 0 starts tile `tile` into stage `slot` once every warp has released the tile
                // STAGES before it. Tiles past n_tiles are never read, so they are neither copied nor
                // counted.
                __device__ __forceinline__ void issue_kv(u32 smem, KvSource k_head, KvSource v_head, int tile, int slot,
                                                         int n_tiles) {
                    if (threadIdx.x == 0 && tile < n_tiles) {
                        if (tile >= STAGES) {
                            mbar_wait(empty_barrier(slot), (tile / STAGES - 1) & 1);
                        }
                        start_kv(smem, k_head, v_head, tile, slot);
                    }
                }
                """
            ),
            block(
                """
                // Thread 0 fetches the tensor maps and initialises the barriers (full: its own arrival;
                // empty: one per warp), visible to the copy engine; the first STAGES - 1 tiles start,
                // then the block waits for its Q copies (cp.async).
                __device__ __forceinline__ void pipeline_prologue(u32 smem, KvSource k_head, KvSource v_head, int n_tiles) {
                    if (threadIdx.x == 0) {
                        tma_prefetch_map(k_head.map);
                        tma_prefetch_map(v_head.map);
                        #pragma unroll
                        for (int s = 0; s < STAGES; ++s) {
                            mbar_init(full_barrier(s), 1);
                            mbar_init(empty_barrier(s), WARPS);
                        }
                        fence_barrier_init();
                    }
                    __syncthreads();
                    #pragma unroll
                    for (int t = 0; t < STAGES - 1; ++t) {
                        issue_kv(smem, k_head, v_head, t, t, n_tiles);
                    }
                    cp_async_wait<0>();
                    __syncthreads();
                }

                // The Q tile has landed: the prologue waited for it.
                __device__ __forceinline__ void pipeline_wait_q() {}
                """
            ),
        ]

    def _emit_refill_ring(self) -> list[str]:
        return [
            tma.emit_mbarrier(),
            tma.emit_tma_load(4),
            block(
                """
                // The ring's full barriers and, per stage, how many warps are done with its tile.
                __shared__ __align__(8) unsigned long long ring_barriers[STAGES];
                __shared__ int ring_releases[STAGES];

                __device__ __forceinline__ u32 full_barrier(int slot) {
                    return u32(__cvta_generic_to_shared(&ring_barriers[slot]));
                }
                """
            ),
            _emit_start_kv(),
            block(
                """
                // Thread 0 fetches the tensor maps, initialises the barriers (one arrival: its
                // expect_tx) and the release counts, and starts the first STAGES tiles; then the block
                // waits for its Q copies (cp.async).
                __device__ __forceinline__ void pipeline_prologue(u32 smem, KvSource k_head, KvSource v_head, int n_tiles) {
                    if (threadIdx.x == 0) {
                        tma_prefetch_map(k_head.map);
                        tma_prefetch_map(v_head.map);
                        #pragma unroll
                        for (int s = 0; s < STAGES; ++s) {
                            mbar_init(full_barrier(s), 1);
                            ring_releases[s] = 0;
                        }
                        fence_barrier_init();
                        #pragma unroll
                        for (int t = 0; t < STAGES; ++t) {
                            if (t < n_tiles) {
                                start_kv(smem, k_head, v_head, t, t);
                            }
                        }
                    }
                    cp_async_wait<0>();
                    __syncthreads();
                }

                // The Q tile has landed: the prologue waited for it.
                __device__ __forceinline__ void pipeline_wait_q() {}

                // Before the scores of step j: tile j has landed.
                __device__ __forceinline__ void pipeline_wait_k(u32, KvSource, KvSource, int j, int slot, int) {
                    mbar_wait(full_barrier(slot), (j / STAGES) & 1);
                }

                // Before P*V of step j: V_j arrived with K_j, nothing to wait for.
                __device__ __forceinline__ void pipeline_wait_v(u32, KvSource, KvSource, int, int, int) {}
                """
            ),
        ]

    def _emit_waits(self) -> str:
        signature = _SIGNATURE.replace("const elem_t*", self.source)
        issue_next = f"issue_kv(smem, k_head, v_head, j + {self.stages - 1}, slot == 0 ? STAGES - 1 : slot - 1, n_tiles);"
        if self.late_copy:
            return block(
                f"""
                // Before the scores of step j: tile j has landed for every thread.
                __device__ __forceinline__ void pipeline_wait_k(u32, {self.source}, {self.source}, int j, int slot, int) {{
                    mbar_wait(full_barrier(slot), (j / STAGES) & 1);
                }}

                // Before P*V of step j (late copy): V_j arrived with K_j; tile j+S-1 starts into the
                // stage step j-1 used, now that the scores' ldmatrix are done.
                __device__ __forceinline__ void pipeline_wait_v({signature}) {{
                    {issue_next}
                }}
                """
            )
        return block(
            f"""
            // Before the scores of step j: tile j has landed for every thread; tile j+S-1 starts
            // into the stage step j-1 used.
            __device__ __forceinline__ void pipeline_wait_k({signature}) {{
                mbar_wait(full_barrier(slot), (j / STAGES) & 1);
                {issue_next}
            }}

            // Before P*V of step j: V_j arrived with K_j, nothing to wait for.
            __device__ __forceinline__ void pipeline_wait_v(u32, {self.source}, {self.source}, int, int, int) {{}}
            """
        )

    def emit_release(self) -> str:
        """``pipeline_release``: after its P·V of a stage's tile, the warp frees the stage."""
        if self.last_warp_refill:
            return block(
                """
                // After P*V of step j: this warp is done with stage `slot`. The warp that completes the
                // stage's count (fenced: every warp's reads of the stage come before its count, the
                // count before the copy engine's writes) resets it and starts tile j + STAGES.
                __device__ __forceinline__ void pipeline_release(u32 smem, KvSource k_head, KvSource v_head, int j, int slot,
                                                                 int n_tiles, int lane) {
                    __syncwarp();
                    if (lane == 0) {
                        __threadfence_block();
                        if (atomicAdd(&ring_releases[slot], 1) == WARPS - 1) {
                            __threadfence_block();
                            ring_releases[slot] = 0;
                            if (j + STAGES < n_tiles) {
                                start_kv(smem, k_head, v_head, j + STAGES, slot);
                            }
                        }
                    }
                }
                """
            )
        return block(
            """
            // After P*V of step j: this warp is done with stage `slot`.
            __device__ __forceinline__ void pipeline_release(int slot, int lane) {
                __syncwarp();
                if (lane == 0) {
                    mbar_arrive(empty_barrier(slot));
                }
            }
            """
        )


@dataclass(frozen=True)
class UnitPipeline:
    """The cp.async ring of the pingpong and overlap schedules: stage ``u % STAGES`` holds
    *unit* ``u``, the K tile ``u`` and the V tile ``u − 1`` (one cp.async group per unit).

    Both schedules run ``n_tiles + 1`` steps; step ``u`` computes ``O += P_(u−1) V_(u−1)``
    and ``S_u = Q K_uᵀ`` — exactly unit ``u``'s two tiles — and one block barrier opens it.
    Pingpong: group 0 runs step ``u``'s matmuls before the step's second barrier, group 1
    after it. Overlap: ``S_u`` is issued before the softmax of ``S_(u−1)``, whose ``P`` then
    feeds ``P V_(u−1)``. Either way every warp is done with unit ``u − 1`` once the barrier
    opening step ``u`` is passed: there unit ``u + S − 1`` starts into its stage. Unit 0 has
    no V tile, unit ``n_tiles`` no K tile; units past ``n_tiles`` are committed empty
    (constant wait counts).
    """

    stages: int

    @property
    def groups_after_q(self) -> int:
        return self.stages - 1

    def emit(self) -> str:
        s = self.stages
        issues = "\n".join(f"    issue_unit(smem, k_head, v_head, {u}, {u}, n_tiles);" for u in range(s - 1))
        return _emit_load_kv_tile() + "\n\n" + block(
            """
            // Start copying unit u (K tile u, V tile u - 1) into stage `slot` (= u % STAGES) as one
            // cp.async group.
            __device__ __forceinline__ void issue_unit(u32 smem, const elem_t* k_head, const elem_t* v_head,
                                                       int u, int slot, int n_tiles) {
                const u32 stage = smem + u32(slot) * STAGE_BYTES;
                if (u < n_tiles) {
                    load_kv_tile<K_ROW_STRIDE, CHUNKS_PER_ROW, QK_DATA_CHUNKS>(stage + K_SMEM, k_head, u);
                }
                if (u >= 1 && u <= n_tiles) {
                    load_kv_tile<V_ROW_STRIDE, V_CHUNKS, V_DATA_CHUNKS>(stage + V_SMEM, v_head, u - 1);
                }
                cp_async_commit();
            }
            """
        ) + "\n\n" + (
            f"// Prefetch before the main loop: units 0..{s - 2}.\n"
            "__device__ __forceinline__ void pipeline_prologue(u32 smem, const elem_t* k_head, const elem_t* v_head,\n"
            "                                                  int n_tiles) {\n"
            f"{issues}\n"
            "}\n\n"
            "// Wait until the Q tile (the first group) has landed for the whole block.\n"
            "__device__ __forceinline__ void pipeline_wait_q() {\n"
            f"    cp_async_wait<{self.groups_after_q}>();\n"
            "    __syncthreads();\n"
            "}\n\n"
        ) + block(
            f"""
            // Open step u (unit u in stage `slot`): unit u has landed for every thread and both groups
            // are past phase u - 1, so unit u + STAGES - 1 starts into the stage unit u - 1 used.
            __device__ __forceinline__ void pipeline_open_step(u32 smem, const elem_t* k_head, const elem_t* v_head,
                                                               int u, int slot, int n_tiles) {{
                cp_async_wait<{s - 2}>();
                __syncthreads();
                issue_unit(smem, k_head, v_head, u + {s - 1}, slot == 0 ? STAGES - 1 : slot - 1, n_tiles);
            }}
            """
        )
