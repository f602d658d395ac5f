"""Tensor-memory-accelerator copies, mbarriers and warp-specialisation primitives (sm_90).

* ``TensorMap``: the 128-byte, 64-byte-aligned ``CUtensorMap`` encoded on the host
  (:mod:`cherenkov.codegen.tensor_map`), passed by value as a ``const __grid_constant__``
  kernel parameter; the copy engine reads it from the parameter space.
* mbarriers (64-bit, in shared memory): ``mbar_init`` (arrival count),
  ``mbar_arrive_expect_tx`` (one arrival that also announces the bytes the copy engine
  will deliver; the phase completes when every arrival and every byte are in),
  ``mbar_arrive`` and ``mbar_wait`` (spin on ``try_wait.parity`` until the phase of the
  given parity has completed; a fresh barrier counts its phase of parity 1 as complete, so
  a producer's first wait on an "empty" barrier passes at once). The init, arrive and wait
  alone (:func:`emit_mbarrier_basics`) also serve the sm_80+ cp.async ring of the
  ``mma.sync`` flash kernel, where the wait polls with ``test_wait`` below sm_90.
* ``tma_load_{rank}d``: ``cp.async.bulk.tensor.{rank}d.shared::cluster.global.mbarrier::complete_tx::bytes``
  (``.shared::cta`` in sm_120 builds),
  one box of the tensor map at the given coordinates (innermost first) into shared memory,
  completing on an mbarrier; ``tma_store_{rank}d`` the other way, from shared memory, tracked
  as bulk async-groups of the issuing thread.
* ``fence_proxy_async``, ``fence_barrier_init``; ``reg_alloc<N>`` / ``reg_dealloc<N>``
  (``setmaxnreg``, sm_90a: a warpgroup's per-thread register budget); named barriers
  (``bar.sync`` / ``bar.arrive`` with a thread count) for the consumer pingpong.

Every address here is a 32-bit shared-window address (``smem_u32``).
"""

from __future__ import annotations

from cherenkov.codegen.cuda.text import block
from cherenkov.codegen.errors import CodegenError

TENSOR_MAP_BYTES = 128
TENSOR_MAP_ALIGN = 64


def emit_tensor_map_type() -> str:
    """``TensorMap``: an opaque 128-byte, 64-byte-aligned CUtensorMap (no CUDA header needed)."""
    return block(
        f"""
        // The CUtensorMap the host encoded (cuTensorMapEncodeTiled); opaque here.
        struct alignas({TENSOR_MAP_ALIGN}) TensorMap {{
            unsigned long long words[{TENSOR_MAP_BYTES // 8}];
        }};

        // 32-bit shared-window address of a generic pointer into shared memory.
        __device__ __forceinline__ u32 smem_u32(const void* ptr) {{
            return static_cast<u32>(__cvta_generic_to_shared(ptr));
        }}
        """
    )


def emit_mbarrier_basics() -> str:
    """mbarrier init / arrive / parity wait (sm_80 and later: the wait polls with ``try_wait``
    from sm_90, ``test_wait`` before)."""
    return block(
        """
        __device__ __forceinline__ void mbar_init(u32 bar, u32 arrivals) {
            asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\\n" :: "r"(bar), "r"(arrivals) : "memory");
        }

        __device__ __forceinline__ void mbar_arrive(u32 bar) {
            asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\\n" :: "r"(bar) : "memory");
        }

        // Spin until the barrier's phase of parity `parity` has completed: try_wait (which may
        // suspend the thread for a while) from sm_90, test_wait before.
        #if __CUDA_ARCH__ >= 900
        #define MBAR_POLL "mbarrier.try_wait.parity.shared::cta.b64"
        #else
        #define MBAR_POLL "mbarrier.test_wait.parity.shared::cta.b64"
        #endif
        __device__ __forceinline__ void mbar_wait(u32 bar, u32 parity) {
            asm volatile(
                "{\\n"
                ".reg .pred done;\\n"
                "WAIT:\\n"
                MBAR_POLL " done, [%0], %1;\\n"
                "@!done bra WAIT;\\n"
                "}\\n"
                :: "r"(bar), "r"(parity) : "memory");
        }
        """
    )


def emit_mbarrier() -> str:
    """:func:`emit_mbarrier_basics`, ``mbar_arrive_expect_tx`` and the init fence (sm_90)."""
    return emit_mbarrier_basics() + "\n\n" + block(
        """
        // Make the initialised barriers visible to the other threads and to the async proxy.
        __device__ __forceinline__ void fence_barrier_init() {
            asm volatile("fence.mbarrier_init.release.cluster;\\n" ::: "memory");
        }

        // One arrival that also expects `bytes` more bytes from the copy engine in this phase.
        __device__ __forceinline__ void mbar_arrive_expect_tx(u32 bar, u32 bytes) {
            asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\\n" :: "r"(bar), "r"(bytes) : "memory");
        }
        """
    )


def _coordinates(rank: int, first_operand: int) -> tuple[str, str, str]:
    """A TMA copy's ``rank`` coordinates ``c0, ...``: the C++ parameters, the PTX operand
    list (from ``%first_operand``) and the asm inputs."""
    if not 1 <= rank <= 5:
        raise CodegenError(f"TMA tensor rank {rank} (valid: 1..5)")
    return (", ".join(f"int c{i}" for i in range(rank)), ", ".join(f"%{first_operand + i}" for i in range(rank)),
            ", ".join(f'"r"(c{i})' for i in range(rank)))


def emit_tma_load(rank: int = 3) -> str:
    """``tma_load_{rank}d(dst, map, bar, c0, ...)``: one box into shared memory, completing on ``bar``."""
    coords, braces, inputs = _coordinates(rank, 3)
    return block(
        f"""
        // The destination is this block's shared memory. sm_120 builds say so (.shared::cta, PTX
        // 8.6, which every sm_120 toolkit has): with .shared::cluster ptxas guards each copy there
        // with a cluster-rank check and a call (stack stores, spills); sm_90 compiles both alike.
        #if __CUDA_ARCH__ >= 1200
        #define TMA_LOAD_DST "shared::cta"
        #else
        #define TMA_LOAD_DST "shared::cluster"
        #endif

        // Copy one box of `map` at coordinates (c0 innermost, ...) to shared memory at `dst`;
        // the bytes are counted on mbarrier `bar`.
        __device__ __forceinline__ void tma_load_{rank}d(u32 dst, const TensorMap* map, u32 bar, {coords}) {{
            asm volatile(
                "cp.async.bulk.tensor.{rank}d." TMA_LOAD_DST ".global.mbarrier::complete_tx::bytes "
                "[%0], [%1, {{{braces}}}], [%2];\\n"
                :: "r"(dst), "l"(reinterpret_cast<unsigned long long>(map)), "r"(bar), {inputs}
                : "memory");
        }}

        // Fetch a tensor map into the copy engine's descriptor cache ahead of its first use.
        __device__ __forceinline__ void tma_prefetch_map(const TensorMap* map) {{
            asm volatile("prefetch.tensormap [%0];\\n" :: "l"(reinterpret_cast<unsigned long long>(map)) : "memory");
        }}
        """
    )


def emit_tma_prefetch_l2(rank: int = 4) -> str:
    """``tma_prefetch_l2_{rank}d(map, c0, ...)``: ask L2 for one box of a tensor map
    (``cp.async.bulk.prefetch.tensor``, sm_90); nothing is written to shared memory and no
    barrier counts it, so a later ``tma_load`` of the box reads it from L2."""
    coords, braces, inputs = _coordinates(rank, 1)
    return block(
        f"""
        // Prefetch one box of `map` at coordinates (c0 innermost, ...) into L2.
        __device__ __forceinline__ void tma_prefetch_l2_{rank}d(const TensorMap* map, {coords}) {{
            asm volatile(
                "cp.async.bulk.prefetch.tensor.{rank}d.L2.global.tile [%0, {{{braces}}}];\\n"
                :: "l"(reinterpret_cast<unsigned long long>(map)), {inputs}
                : "memory");
        }}
        """
    )


def emit_st_shared() -> str:
    """``st_shared_u32``: one 32-bit word into shared memory (a staging box)."""
    return block(
        """
        __device__ __forceinline__ void st_shared_u32(u32 addr, u32 value) {
            asm volatile("st.shared.b32 [%0], %1;\\n" :: "r"(addr), "r"(value) : "memory");
        }
        """
    )


def emit_tma_store(rank: int) -> str:
    """``tma_store_{rank}d(map, src, c0, ...)``: one box from shared memory into global memory
    as a bulk async-group of the calling thread; ``bulk_commit``, ``bulk_wait_read<N>`` (at
    most the N latest groups may still be reading their shared memory), ``bulk_wait_all``
    (every group has written), and ``st_shared_u32`` to fill the box."""
    coords, braces, inputs = _coordinates(rank, 2)
    return emit_st_shared() + "\n\n" + block(
        f"""
        // Store one box of `map` at coordinates (c0 innermost, ...) from shared memory at `src`
        // (a bulk async-group of this thread; what lies outside the tensor is not written).
        __device__ __forceinline__ void tma_store_{rank}d(const TensorMap* map, u32 src, {coords}) {{
            asm volatile(
                "cp.async.bulk.tensor.{rank}d.global.shared::cta.bulk_group [%0, {{{braces}}}], [%1];\\n"
                :: "l"(reinterpret_cast<unsigned long long>(map)), "r"(src), {inputs}
                : "memory");
        }}

        """
    ) + "\n\n" + emit_bulk_group()


def emit_bulk_group() -> str:
    """``bulk_commit``, ``bulk_wait_read<N>`` and ``bulk_wait_all``: a thread's bulk async-groups
    (TMA stores, bulk reductions)."""
    return block(
        """
        __device__ __forceinline__ void bulk_commit() {
            asm volatile("cp.async.bulk.commit_group;\\n" ::: "memory");
        }

        // Wait until at most the N latest bulk groups of this thread still read shared memory.
        template <int N>
        __device__ __forceinline__ void bulk_wait_read() {
            asm volatile("cp.async.bulk.wait_group.read %0;\\n" :: "n"(N) : "memory");
        }

        // Wait until every bulk group of this thread has completed its writes.
        __device__ __forceinline__ void bulk_wait_all() {
            asm volatile("cp.async.bulk.wait_group 0;\\n" ::: "memory");
        }
        """
    )


def emit_ld_shared() -> str:
    """``ld_shared_u32``: one 32-bit word of shared memory (a box the copy engine filled)."""
    return block(
        """
        __device__ __forceinline__ u32 ld_shared_u32(u32 addr) {
            u32 value;
            asm volatile("ld.shared.b32 %0, [%1];\\n" : "=r"(value) : "r"(addr) : "memory");
            return value;
        }
        """
    )


def emit_fence_proxy_async() -> str:
    """``fence_proxy_async``: order this thread's generic-proxy shared-memory accesses with
    later async-proxy ones (copy engine, wgmma)."""
    return block(
        """
        __device__ __forceinline__ void fence_proxy_async() {
            asm volatile("fence.proxy.async.shared::cta;\\n" ::: "memory");
        }
        """
    )


def emit_setmaxnreg() -> str:
    """``reg_alloc<N>`` / ``reg_dealloc<N>``: raise / lower the calling warpgroup's registers
    a thread to N (a multiple of 8 in 24..256; every warp of the warpgroup must call it)."""
    return block(
        """
        template <int N>
        __device__ __forceinline__ void reg_alloc() {
            asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\\n" :: "n"(N));
        }

        template <int N>
        __device__ __forceinline__ void reg_dealloc() {
            asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\\n" :: "n"(N));
        }
        """
    )


def emit_named_barriers() -> str:
    """``named_barrier_sync(id, threads)`` (arrive and wait) and ``named_barrier_arrive``
    (arrive only): hardware barriers 1..15 over a subset of the block's warps."""
    return block(
        """
        __device__ __forceinline__ void named_barrier_sync(int id, int threads) {
            asm volatile("bar.sync %0, %1;\\n" :: "r"(id), "r"(threads) : "memory");
        }

        __device__ __forceinline__ void named_barrier_arrive(int id, int threads) {
            asm volatile("bar.arrive %0, %1;\\n" :: "r"(id), "r"(threads) : "memory");
        }
        """
    )
