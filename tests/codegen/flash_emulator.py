"""Running a 16-bit ``mma.sync`` flash-attention plan's kernel on the CPU: a test helper.

The generated source is compiled as host C++20 with :mod:`.emulator`'s prelude (CUDA threads
as fibers, warp collectives and ``mma.sync`` exchanged through per-warp buffers); its
inline-PTX helpers are replaced by host emulations: ``ldmatrix`` (plain and transposed), the
bf16/fp16 packing, ``cp.async`` (a copy, zero-filled out of range), the 32-bit shared-memory
loads and stores, and ``ex2.approx``. The kernel keeps shared addresses in 32 bits, so its
dynamic shared memory is a buffer mapped below 4 GB. Plans on the cp.async ring only (no
mbarrier ring, TMA or key splits): the fragment layouts, masks, online softmax and epilogue
— the output and the rows' log-sum-exp — run as written.
"""

from __future__ import annotations

import subprocess
import tempfile
from pathlib import Path

import numpy as np

from cherenkov.codegen import cuda_source
from cherenkov.codegen.cuda.flash_attention import kernel_name
from cherenkov.codegen.plan import FlashLayout, FlashTiling

from .emulator import PRELUDE, READ_FILE, _strip_functions, emulator_root, from_bits, host_binary, launch_blocks, to_bits

REPLACED = ("st_shared_b32", "ld_shared_v4", "cp_async_16", "cp_async_commit", "cp_async_wait", "ldmatrix_x4",
            "ldmatrix_x4_trans", "ldmatrix_x2", "ldmatrix_x2_trans", "mma_16816", "mma_16816_zero", "pack2",
            "fast_exp2")  # fmt: skip

HOST_HELPERS = r"""
#include <sys/mman.h>
#undef __launch_bounds__
#define __launch_bounds__(...)
typedef unsigned u32;
static unsigned char* emu_shared_memory(std::size_t bytes) {  // below 4 GB: the kernel's shared addresses are 32-bit
    static unsigned char* base = static_cast<unsigned char*>(
        mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_32BIT, -1, 0));
    return base;
}
static inline std::uintptr_t __cvta_generic_to_shared(const void* p) { return reinterpret_cast<std::uintptr_t>(p); }
static inline void* emu_shared(u32 address) { return reinterpret_cast<void*>(std::uintptr_t(address)); }
static inline void st_shared_b32(u32 address, u32 value) { std::memcpy(emu_shared(address), &value, 4); }
static inline uint4 ld_shared_v4(u32 address) { uint4 r; std::memcpy(&r, emu_shared(address), 16); return r; }
static inline void cp_async_16(u32 smem, const void* gmem, bool in_range) {
    ck_cp_async_16(emu_shared(smem), gmem, in_range);
}
static inline void cp_async_commit() {}
template <int N> static inline void cp_async_wait() {}
static inline void ldmatrix_x4(u32 (&r)[4], u32 address) { ck_ldsm_x4(r, emu_shared(address)); }
static inline void ldmatrix_x4_trans(u32 (&r)[4], u32 address) { ck_ldsm_x4_t(r, emu_shared(address)); }
static inline void mma_16816_zero(float (&d)[4], const u32 (&a)[4], u32 b0, u32 b1) {
    d[0] = d[1] = d[2] = d[3] = 0.0f;
    mma_16816(d, a, b0, b1);
}
static inline u32 pack2(float lo, float hi) {
#if CK_BF16_PACK
    return u32(ck_to_bf16(lo)) | (u32(ck_to_bf16(hi)) << 16);
#else
    return u32(ck_to_fp16(lo)) | (u32(ck_to_fp16(hi)) << 16);
#endif
}
static inline float fast_exp2(float x) { return std::exp2(x); }
static inline void __syncwarp() { emu_warp().bar.arrive_and_wait(); }
static inline int __any_sync(unsigned, int predicate) {  // a vote through the warp's buffer
    EmuWarp& w = emu_warp();
    w.words[emu_lane()][7] = predicate != 0;
    w.bar.arrive_and_wait();
    int any = 0;
    for (int lane = 0; lane < 32; ++lane) any |= int(w.words[lane][7]);
    w.bar.arrive_and_wait();
    return any;
}
"""


def supported(plan) -> bool:
    """Whether the emulator runs ``plan``: the cp.async ring with ldmatrix x4, one key split."""
    s = plan.schedule
    return not (s.mbarrier_ring or s.tma_kv or s.kv_splits > 1 or s.warp_keys) and s.ldmatrix_x == 4


def knob_family_plans(plans) -> list:
    """One plan the emulator runs of each ``mma.sync`` knob family (pingpong, overlap, lazy rescale,
    rows a warp, head-major), in the order ``plans`` come."""
    picked: dict[tuple, object] = {}
    for plan in plans:
        if supported(plan):
            s = plan.schedule
            picked.setdefault((s.pingpong, s.overlap, s.lazy_rescale, s.rows_per_warp, s.head_major), plan)
    return list(picked.values())


def assert_emulated_output_and_lse(plan, inputs: dict[str, np.ndarray], expected: dict[str, np.ndarray]) -> None:
    """The emulated plan's ``o`` within 1e-2 (relative) of ``expected["o"]``, its rows' log-sum-exp
    within 1e-5 of ``expected["lse"]`` (a bias tensor, where the problem reads one, from ``inputs``)."""
    bias = plan.problem.bias
    got = emulate_flash(plan, inputs["q"], inputs["k"], inputs["v"], None if bias is None else inputs[bias.tensor])
    error = np.linalg.norm(got["o"] - expected["o"]) / np.linalg.norm(expected["o"])
    assert error <= 1e-2, f"{plan.schedule.key()}: o differs by {error:.3g}"
    assert np.abs(got["lse"] - expected["lse"]).max() <= 1e-5, plan.schedule.key()


def host_source(plan) -> str:
    """The plan's source as host C++ (helpers emulated, shared memory mapped below 4 GB)."""
    source = cuda_source(plan).replace("template <int N>\n__device__ __forceinline__ void cp_async_wait()",
                                       "__device__ __forceinline__ void cp_async_wait()")  # fmt: skip
    bf16 = plan.problem.dtype == "bf16"
    body = _strip_functions(source, REPLACED)
    size = FlashLayout.from_plan(plan).total_bytes + 256
    body = body.replace("extern __shared__ __align__(128) unsigned char smem_raw[];",
                        f"unsigned char* smem_raw = emu_shared_memory({size});")  # fmt: skip
    return f"#define CK_EMU_MMA_FP16 {int(not bf16)}\n#define CK_BF16_PACK {int(bf16)}\n" + PRELUDE + HOST_HELPERS + body


def _main(plan) -> str:
    p = plan.problem
    bias = ["bias"] if p.bias is not None else []
    files = ["q", "k", "v", *bias, "o", *(["lse"] if p.lse is not None else [])]
    reads = "\n".join(f"    auto buf_{f} = read_file(argv[{i + 1}]);" for i, f in enumerate(files))
    e = "unsigned short*"
    args = ", ".join([*(f"reinterpret_cast<{e}>(buf_{f}.data())" for f in ("q", "k", "v", "o")),
                      *(["reinterpret_cast<const bias_t*>(buf_bias.data())"] if bias else []),
                      *(["reinterpret_cast<float*>(buf_lse.data())"] if p.lse is not None else [])])  # fmt: skip
    written = files[3 + len(bias):]
    writes = "\n".join(
        f'    {{ FILE* f = std::fopen(argv[{len(files) + 1 + i}], "wb"); '
        f"std::fwrite(buf_{name}.data(), 1, buf_{name}.size() - 64, f); std::fclose(f); }}"
        for i, name in enumerate(written)
    )
    tiling = FlashTiling.from_plan(plan)
    return f"""
{READ_FILE}

int main(int argc, char** argv) {{
{reads}
{launch_blocks(kernel_name(plan), tiling.grid, plan.schedule.threads, args)}
{writes}
    return 0;
}}
"""


def emulate_flash(plan, q: np.ndarray, k: np.ndarray, v: np.ndarray,
                  bias: np.ndarray | None = None) -> dict[str, np.ndarray]:  # fmt: skip
    """The plan's output ``o`` (and ``lse`` where its problem writes one; float64, NaN where never
    written) for contiguous BHSD q, k, v and the bias tensor its problem reads (stored whole, in its dtype);
    o and the log-sum-exp laid out as the problem says."""
    if not supported(plan):
        raise ValueError(f"{plan.name}: the emulator runs cp.async-ring plans with ldmatrix x4 and no key splits")
    p = plan.problem
    binary = host_binary(host_source(plan) + _main(plan), "flash", plan.name)
    root = emulator_root()
    o_shape = p.layout("o").shape
    with tempfile.TemporaryDirectory(dir=root) as tmp:
        paths = []
        operands = [("q", q, p.dtype), ("k", k, p.dtype), ("v", v, p.dtype)]
        if p.bias is not None:
            if bias is None:
                raise ValueError(f"{plan.name} reads the bias tensor {p.bias.tensor}: pass it")
            operands.append(("bias", bias, p.bias.dtype))
        for label, values, dtype in operands:
            path = Path(tmp) / f"{label}.bin"
            to_bits(values, dtype).tofile(path)
            paths.append(str(path))
        poisoned = {"o": np.full(2 * int(np.prod(o_shape)), 0xFF, dtype=np.uint8)}  # NaN
        if p.lse is not None:
            poisoned["lse"] = np.full(int(np.prod(p.lse.layout.shape)), np.nan, dtype=np.float32)
        for label, values in poisoned.items():
            path = Path(tmp) / f"{label}.bin"
            values.tofile(path)
            paths.append(str(path))
        outputs = [str(Path(tmp) / f"out_{label}.bin") for label in poisoned]
        run = subprocess.run([str(binary), *paths, *outputs], capture_output=True, text=True, timeout=900)
        if run.returncode:
            raise RuntimeError(f"emulated {plan.name} failed (exit {run.returncode}): {run.stderr[:2000]}")
        bits = np.fromfile(outputs[0], dtype=np.uint16)
        o = bits.view(np.float16).astype(np.float64) if p.dtype == "fp16" else from_bits(bits, p.dtype)
        result = {"o": o.reshape(o_shape)}
        if p.lse is not None:
            result["lse"] = np.fromfile(outputs[1], dtype=np.float32).astype(np.float64).reshape(p.lse.layout.shape)
        return result
