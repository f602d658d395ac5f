"""Running an 8-bit flash-attention plan's kernel on the CPU: a test helper.

The generated source is compiled as host C++20 with :mod:`.emulator`'s prelude (CUDA threads as
fibers, warp collectives exchanged through per-warp buffers); its inline-PTX helpers
are replaced by host emulations: ``ldmatrix`` (b16), the ``m16n8k32`` e4m3 mma (each byte
decoded as PyTorch's ``float8_e4m3fn``), the saturating e4m3 rounding of the probabilities,
``cp.async`` (a copy, zero-filled out of range), ``ex2.approx`` and the output conversions.
So the fragment layouts, the permuted key order of the transposed V tile, the masks and the
epilogue run as written.
"""

from __future__ import annotations

import subprocess
import tempfile
from pathlib import Path

import numpy as np

from cherenkov.codegen import cuda_source
from cherenkov.codegen.cuda.flash_attention_fp8 import fp8_dynamic_smem, fp8_grid, kernel_name

from .emulator import PRELUDE, READ_FILE, _strip_functions, emulator_root, host_binary, launch_blocks, to_bits

REPLACED = ("smem_address", "cp_async_16", "cp_async_commit", "cp_async_wait", "ldmatrix_x4", "mma_e4m3_16832",
            "mma_mx_e4m3_16832", "pack_e4m3x4", "fast_exp2")  # fmt: skip

HOST_HELPERS = r"""
#include <cstdint>
typedef unsigned short __nv_bfloat16;
struct __half { unsigned short bits; };
static inline unsigned __byte_perm(unsigned x, unsigned y, unsigned s) {
    const unsigned long long v = (static_cast<unsigned long long>(y) << 32) | x;
    unsigned r = 0;
    for (int i = 0; i < 4; ++i) r |= unsigned((v >> (8 * ((s >> (4 * i)) & 7))) & 0xffu) << (8 * i);
    return r;
}
static inline std::uintptr_t smem_address(const void* p) { return reinterpret_cast<std::uintptr_t>(p); }
static inline void cp_async_16(std::uintptr_t dst, const void* src, bool in_range) {
    ck_cp_async_16(reinterpret_cast<void*>(dst), src, in_range);
}
static inline void cp_async_commit() {}
template <int N> static inline void cp_async_wait() {}
static inline void ldmatrix_x4(unsigned (&r)[4], std::uintptr_t address) {
    ck_ldsm_x4(r, reinterpret_cast<const void*>(address));
}
static inline float fast_exp2(float x) { return std::exp2(x); }

// e4m3 (float8_e4m3fn): 1 sign, 4 exponent (bias 7), 3 mantissa bits; no infinities, 0x7f / 0xff NaN
static inline float emu_e4m3(unsigned byte) {
    const unsigned e = (byte >> 3) & 15u, m = byte & 7u;
    float x = (e == 15 && m == 7) ? NAN : e ? std::ldexp(1.0f + m / 8.0f, int(e) - 7) : std::ldexp(m / 8.0f, -6);
    return (byte & 0x80u) ? -x : x;
}
// round to nearest even e4m3, saturating at +-448 (cvt.rn.satfinite)
static inline unsigned emu_to_e4m3(float x) {
    unsigned best = 0; float best_error = INFINITY;
    for (unsigned b = 0; b < 256; ++b) {
        if ((b & 0x7fu) == 0x7fu) continue;
        const float error = std::fabs(emu_e4m3(b) - std::fmin(std::fmax(x, -448.0f), 448.0f));
        if (error < best_error || (error == best_error && (b & 1u) == 0)) { best = b; best_error = error; }
    }
    return best;
}
static inline unsigned pack_e4m3x4(float x0, float x1, float x2, float x3) {
    return emu_to_e4m3(x0) | (emu_to_e4m3(x1) << 8) | (emu_to_e4m3(x2) << 16) | (emu_to_e4m3(x3) << 24);
}

// m16n8k32 e4m3: lane l (g = l / 4, t = l % 4) holds a[0] A[g][4t..4t+3], a[1] A[g+8][4t..], a[2] A[g][16+4t..],
// a[3] A[g+8][16+4t..]; b0 B[4t..4t+3][g], b1 B[16+4t..][g]; d as for m16n8k16
static inline void mma_e4m3_16832(float (&d)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
    EmuWarp& w = emu_warp();
    const int lane = emu_lane();
    for (int i = 0; i < 4; ++i) w.words[lane][i] = a[i];
    w.words[lane][4] = b0; w.words[lane][5] = b1;
    w.bar.arrive_and_wait();
    const int g = lane / 4, t = lane % 4;
    for (int e = 0; e < 4; ++e) {
        const int row = g + 8 * (e >> 1), col = 2 * t + (e & 1);
        float sum = d[e];
        for (int k = 0; k < 32; ++k) {
            const int a_lane = (row % 8) * 4 + (k % 16) / 4, a_reg = (row >= 8) + 2 * (k >= 16);
            const int b_lane = col * 4 + (k % 16) / 4, b_reg = 4 + (k >= 16);
            sum += emu_e4m3((w.words[a_lane][a_reg] >> (8 * (k % 4))) & 0xffu)
                 * emu_e4m3((w.words[b_lane][b_reg] >> (8 * (k % 4))) & 0xffu);
        }
        d[e] = sum;
    }
    w.bar.arrive_and_wait();
}
"""

BLOCK_SCALED_MMA = r"""
// the block-scaled m16n8k32 (scale_vec::1X, thread-id 0, byte-id 0): row r of A is scaled by byte 0 of lane
// (r % 8) * 4 + (r >= 8)'s sa, column c of B by byte 0 of lane 4c's sb, each 2^(byte - 127)
static inline void mma_mx_e4m3_16832(float (&d)[4], const unsigned (&a)[4], unsigned b0, unsigned b1, unsigned sa,
                                     unsigned sb) {
    EmuWarp& w = emu_warp();
    const int lane = emu_lane();
    w.words[lane][6] = sa; w.words[lane][7] = sb;
    w.bar.arrive_and_wait();
    const int g = lane / 4, t = lane % 4;
    float scaled[4];
    for (int e = 0; e < 4; ++e) {
        const int row = g + 8 * (e >> 1), col = 2 * t + (e & 1);
        scaled[e] = std::ldexp(1.0f, int(w.words[(row % 8) * 4 + (row >= 8)][6] & 0xffu) - 127)
                  * std::ldexp(1.0f, int(w.words[col * 4][7] & 0xffu) - 127);
    }
    w.bar.arrive_and_wait();
    float product[4] = {0.f, 0.f, 0.f, 0.f};
    mma_e4m3_16832(product, a, b0, b1);
    for (int e = 0; e < 4; ++e) d[e] += scaled[e] * product[e];
}
"""

OUT_CONVERSIONS = r"""
template <> inline __nv_bfloat16 from_float<__nv_bfloat16>(float x) { return ck_to_bf16(x); }
template <> inline __half from_float<__half>(float x) { return __half{ck_to_fp16(x)}; }
"""


def host_source(plan) -> str:
    """The plan's source as host C++ (helpers emulated, shared memory a static buffer)."""
    source = cuda_source(plan)
    for line in ("#include <cuda_bf16.h>\n", "#include <cuda_fp16.h>\n"):
        source = source.replace(line, "")
    source = source.replace("template <int N>\n__device__ __forceinline__ void cp_async_wait()",
                            "__device__ __forceinline__ void cp_async_wait()")  # fmt: skip
    body = _strip_functions(source, REPLACED)
    # the device specialisations of from_float for 16-bit outputs call CUDA intrinsics
    body = "\n".join(line for line in body.splitlines() if "__float2bfloat16_rn" not in line and "__float2half_rn" not in line)
    body = body.replace("template <class T> __device__ __forceinline__ T from_float(float x);",
                        "template <class T> __device__ __forceinline__ T from_float(float x);" + OUT_CONVERSIONS)
    body = body.replace("extern __shared__ __align__(16) unsigned char smem[];",
                        f"alignas(16) static unsigned char smem[{fp8_dynamic_smem(plan) + 16}];")  # fmt: skip
    return "#define CK_EMU_MMA_FP16 0\n" + PRELUDE + HOST_HELPERS + BLOCK_SCALED_MMA + body


def _main(plan) -> str:
    grid, threads = fp8_grid(plan)
    problem = plan.problem
    scales = ["qs", "ks"] if problem.q_block_scales is not None else []
    files = ["q", "k", "v", "o", *scales, *(f"f{i}" for i in range(len(problem.factors)))]
    reads = "\n".join(f"    auto buf_{f} = read_file(argv[{i + 1}]);" for i, f in enumerate(files))
    out_type = {"bf16": "__nv_bfloat16", "fp16": "__half", "fp32": "float"}[problem.output_dtype]
    args = ", ".join([*(f"reinterpret_cast<const uint8_t*>(buf_{f}.data())" for f in "qkv"),
                      f"reinterpret_cast<{out_type}*>(buf_o.data())",
                      *(f"reinterpret_cast<const unsigned char*>(buf_{s}.data())" for s in scales),
                      *(f"reinterpret_cast<const float*>(buf_f{i}.data())" for i in range(len(problem.factors)))])  # fmt: skip
    return f"""
{READ_FILE}

int main(int argc, char** argv) {{
{reads}
{launch_blocks(kernel_name(plan), grid, threads, args)}
    FILE* f = std::fopen(argv[{len(files) + 1}], "wb");
    std::fwrite(buf_o.data(), 1, buf_o.size() - 64, f);
    std::fclose(f);
    return 0;
}}
"""


def emulate_fp8_flash(plan, stored: dict[str, np.ndarray]) -> np.ndarray:
    """The plan's output (float64; NaN where never written) for stored tensors by name: q, k, v as
    float64 values of e4m3 numbers, the factors as float64 arrays."""
    problem = plan.problem
    binary = host_binary(host_source(plan) + _main(plan), "fp8-flash", plan.name)
    root = emulator_root()
    out_shape = problem.layout("o").shape
    with tempfile.TemporaryDirectory(dir=root) as tmp:
        paths = []
        for role in "qkv":
            path = Path(tmp) / f"{role}.bin"
            to_bits(stored[problem.name(role)], problem.dtype).tofile(path)
            paths.append(str(path))
        poison = Path(tmp) / "o.bin"
        width = {"bf16": 2, "fp16": 2, "fp32": 4}[problem.output_dtype]
        np.full(int(np.prod(out_shape)) * width, 0xFF, dtype=np.uint8).tofile(poison)
        paths.append(str(poison))
        for label, scales in (("qs", problem.q_block_scales), ("ks", problem.k_block_scales)):
            if scales is not None:
                path = Path(tmp) / f"{label}.bin"
                to_bits(stored[scales.tensor], "e8m0").tofile(path)
                paths.append(str(path))
        for i, factor in enumerate(problem.factors):
            path = Path(tmp) / f"f{i}.bin"
            np.asarray(stored[factor.tensor], dtype=np.float32).tofile(path)
            paths.append(str(path))
        result_path = Path(tmp) / "result.bin"
        run = subprocess.run([str(binary), *paths, str(result_path)], capture_output=True, text=True, timeout=900)
        if run.returncode:
            raise RuntimeError(f"emulated {plan.name} failed (exit {run.returncode}): {run.stderr[:2000]}")
        raw = np.fromfile(result_path, dtype={"bf16": np.uint16, "fp16": np.float16, "fp32": np.float32}[problem.output_dtype])
        if problem.output_dtype == "bf16":
            values = (raw.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
        else:
            values = raw.astype(np.float64)
    return values.reshape(out_shape)
