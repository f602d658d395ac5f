"""Tensor-memory-accelerator copies, mbarriers and warp-specialisation primitives (sm_90).

* ``TensorMap``: the 128-byte, 64-byte-aligned ``CUtensorMap`` encoded on the host
  (:mod:`cherenkov.codegen.tensor_map`), passed by value as a ``const __grid_constant__``
  kernel parameter; the copy engine reads it from the parameter space.
* mbarriers (64-bit, in shared memory): ``mbar_init`` (arrival count),
  ``mbar_arrive_expect_tx`` (one arrival that also announces the bytes the copy engine
  will deliver; the phase completes when every arrival and every byte are in),
  ``mbar_arrive`` and ``mbar_wait`` (spin on ``try_wait.parity`` until the phase of the
  given parity has completed; a fresh barrier counts its phase of parity 1 as complete, so
  a producer's first wait on an "empty" barrier passes at once).
* ``tma_load_3d``: ``cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes``,
  one box of the tensor map at the given coordinates (innermost first) into shared memory,
  completing on an mbarrier.
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


def emit_mbarrier() -> str:
    """mbarrier init / arrive / arrive.expect_tx / parity wait, and the init fence."""
    return block(
        """
        __device__ __forceinline__ void mbar_init(u32 bar, u32 arrivals) {
            asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\\n" :: "r"(bar), "r"(arrivals) : "memory");
        }

        // Make the initialised barriers visible to the other threads and to the async proxy.
        __device__ __forceinline__ void fence_barrier_init() {
            asm volatile("fence.mbarrier_init.release.cluster;\\n" ::: "memory");
        }

        // One arrival that also expects `bytes` more bytes from the copy engine in this phase.
        __device__ __forceinline__ void mbar_arrive_expect_tx(u32 bar, u32 bytes) {
            asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\\n" :: "r"(bar), "r"(bytes) : "memory");
        }

        __device__ __forceinline__ void mbar_arrive(u32 bar) {
            asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\\n" :: "r"(bar) : "memory");
        }

        // Spin until the barrier's phase of parity `parity` has completed.
        __device__ __forceinline__ void mbar_wait(u32 bar, u32 parity) {
            asm volatile(
                "{\\n"
                ".reg .pred done;\\n"
                "WAIT:\\n"
                "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\\n"
                "@!done bra WAIT;\\n"
                "}\\n"
                :: "r"(bar), "r"(parity) : "memory");
        }
        """
    )


def emit_tma_load(rank: int = 3) -> str:
    """``tma_load_{rank}d(dst, map, bar, c0, ...)``: one box into shared memory, completing on ``bar``."""
    if not 1 <= rank <= 5:
        raise CodegenError(f"TMA tensor rank {rank} (valid: 1..5)")
    coords = ", ".join(f"int c{i}" for i in range(rank))
    braces = ", ".join(f"%{3 + i}" for i in range(rank))
    inputs = ", ".join(f'"r"(c{i})' for i in range(rank))
    return block(
        f"""
        // Copy one box of `map` at coordinates (c0 innermost, ...) to shared memory at `dst`;
        // the bytes are counted on mbarrier `bar`.
        __device__ __forceinline__ void tma_load_{rank}d(u32 dst, const TensorMap* map, u32 bar, {coords}) {{
            asm volatile(
                "cp.async.bulk.tensor.{rank}d.shared::cluster.global.mbarrier::complete_tx::bytes "
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
