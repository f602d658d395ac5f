"""Running a flash-attention backward plan's three kernels on the CPU: a test helper.

The generated source is compiled as host C++20 with :mod:`.emulator`'s prelude (CUDA threads
as fibers, warp collectives and ``mma.sync`` exchanged through per-warp buffers),
its inline-PTX helpers replaced by host emulations (``ldmatrix`` plain and transposed, the
16-bit packing, ``cp.async``, shared addresses as host pointers) and ``atomicAdd`` (and the
four-float reduction of sm_90 and later) as atomics on the host. The three launches run in order on the same buffers, exactly as
:class:`cherenkov.codegen.launch.FlashBackwardKernel` issues them.
"""

from __future__ import annotations

import re
import subprocess
import tempfile
from pathlib import Path

import numpy as np

from cherenkov.codegen import cuda_source
from cherenkov.codegen.cuda.flash_attention_backward import grids, kernel_name, workspace_floats

from .emulator import (
    NP_TYPES,
    PRELUDE,
    READ_FILE,
    _strip_functions,
    emulator_root,
    from_bits,
    host_binary,
    launch_blocks,
    to_bits,
)

REPLACED = ("mma_16816", "mma_16816_zero", "pack2", "ldmatrix_x4", "ldmatrix_x4_trans", "ldmatrix_x2",
            "ldmatrix_x2_trans", "cp_async_16", "cp_async_commit", "cp_async_wait", "smem_address", "to_float",
            "fast_exp2", "reduce_add_v4_f32", "half_bits_to_float")  # fmt: skip

HOST_HELPERS = r"""
#include <atomic>
#include <cstdint>
struct float2 { float x, y; };
struct float4 { float x, y, z, w; };
static inline float4 make_float4(float x, float y, float z, float w) { return {x, y, z, w}; }
static inline float atomicAdd(float* p, float v) { return std::atomic_ref<float>(*p).fetch_add(v); }
static inline void reduce_add_v4_f32(float* p, float a, float b, float c, float d) {
    atomicAdd(p, a);
    atomicAdd(p + 1, b);
    atomicAdd(p + 2, c);
    atomicAdd(p + 3, d);
}
static inline std::uintptr_t smem_address(const void* p) { return reinterpret_cast<std::uintptr_t>(p); }
static inline float to_float(unsigned short x) {
#if CK_BF16
    return __uint_as_float(unsigned(x) << 16);
#else
    return ck_from_fp16(x);
#endif
}
static inline unsigned pack2(float lo, float hi) {
#if CK_BF16
    return unsigned(ck_to_bf16(lo)) | (unsigned(ck_to_bf16(hi)) << 16);
#else
    return unsigned(ck_to_fp16(lo)) | (unsigned(ck_to_fp16(hi)) << 16);
#endif
}
static inline void ldmatrix_x4(unsigned (&r)[4], std::uintptr_t addr) { ck_ldsm_x4(r, reinterpret_cast<const void*>(addr)); }
static inline void ldmatrix_x4_trans(unsigned (&r)[4], std::uintptr_t addr) {
    ck_ldsm_x4_t(r, reinterpret_cast<const void*>(addr));
}
static inline void cp_async_16(std::uintptr_t smem, const void* gmem, bool in_range) {
    ck_cp_async_16(reinterpret_cast<void*>(smem), gmem, in_range);
}
static inline void cp_async_commit() {}
template <int N> static inline void cp_async_wait() {}
static inline float fast_exp2(float x) { return std::exp2(x); }
static inline float half_bits_to_float(unsigned short x) { return ck_from_fp16(x); }
"""


def host_source(plan, sms: int | None = None) -> str:
    """The plan's source as host C++ (helpers emulated, shared memory a static buffer per kernel)."""
    source = cuda_source(plan)
    source = source.replace("template <int N>\n__device__ __forceinline__ void cp_async_wait()",
                            "__device__ __forceinline__ void cp_async_wait()")  # fmt: skip
    body = _strip_functions(source, REPLACED)
    launches = grids(plan, sms)
    size = max(m for _, _, m in launches.values()) + 16
    body = body.replace("extern __shared__ __align__(16) unsigned char smem[];",
                        f"alignas(16) static unsigned char smem[{size}];")  # fmt: skip
    bf16 = re.search(r"#define CK_BF16 (\d)", body)[1]
    body = re.sub(r"#define CK_BF16 \d\n", "", body)
    return f"#define CK_EMU_MMA_FP16 {1 - int(bf16)}\n#define CK_BF16 {bf16}\n" + PRELUDE + HOST_HELPERS + body


FILES = ("q", "k", "v", "do", "dq", "dk", "dv", "ws", "o", "lse", "bias")
"""The buffers the host program reads, in its arguments' order (o and lse: the saved statistics; bias: the
problem's bias tensor)."""


def _main(plan, sms: int | None = None) -> str:
    name = kernel_name(plan)
    launches = grids(plan, sms)
    reads = "\n".join(f"    auto buf_{f} = read_file(argv[{i + 1}]);" for i, f in enumerate(FILES))
    e = "unsigned short*"
    pointers = {f: f"reinterpret_cast<{e}>(buf_{f}.data())" for f in ("q", "k", "v", "do", "dq", "dk", "dv", "o")}
    ws = "reinterpret_cast<float*>(buf_ws.data())"
    bias = [] if plan.problem.attention.bias is None else ["reinterpret_cast<const bias_t*>(buf_bias.data())"]
    main_args = ", ".join([*(pointers[f] for f in ("q", "k", "v", "do", "dk", "dv")), ws, *bias])
    stat_args = (", ".join([pointers["o"], "reinterpret_cast<float*>(buf_lse.data())", pointers["do"], ws])
                 if plan.schedule.saved_statistics else ", ".join([*(pointers[f] for f in ("q", "k", "v", "do")), ws, *bias]))
    writes = "\n".join(
        f'    {{ FILE* f = std::fopen(argv[{len(FILES) + 1 + i}], "wb"); std::fwrite(buf_{g}.data(), 1, buf_{g}.size() - 64, f); std::fclose(f); }}'
        for i, g in enumerate(("dq", "dk", "dv"))
    )
    return f"""
{READ_FILE}

int main(int argc, char** argv) {{
{reads}
{launch_blocks(name + "_statistics", launches["statistics"][0], launches["statistics"][1], stat_args)}
{launch_blocks(name, launches["main"][0], launches["main"][1], main_args)}
{launch_blocks(name + "_dq", launches["dq"][0], launches["dq"][1], ws + ", " + pointers["dq"]) if "dq" in plan.problem.roles else ""}
{writes}
    return 0;
}}
"""


def emulate_backward(plan, q: np.ndarray, k: np.ndarray, v: np.ndarray, do: np.ndarray, o: np.ndarray | None = None,
                     lse: np.ndarray | None = None, sms: int | None = None,
                     bias: np.ndarray | None = None) -> dict[str, np.ndarray]:  # fmt: skip
    """The plan's gradients (float64; NaN where never written) for contiguous BHSD operands; the
    gradients' buffers are laid out as the plan's layouts say (contiguous ones here). A plan that
    reads saved statistics takes the forward's ``o`` and ``lse`` (contiguous) too; a problem with a
    bias tensor its values (stored as the problem's bias says); ``sms``: the launches'
    multiprocessor count (:func:`~cherenkov.codegen.cuda.flash_attention_backward.grids`)."""
    problem = plan.problem
    dtype = problem.attention.dtype
    binary = host_binary(host_source(plan, sms) + _main(plan, sms), "backward", plan.name)
    root = emulator_root()
    shapes = {g.role: g.layout.shape for g in problem.gradients}
    with tempfile.TemporaryDirectory(dir=root) as tmp:
        paths = []
        for label, values in (("q", q), ("k", k), ("v", v), ("do", do)):
            path = Path(tmp) / f"{label}.bin"
            to_bits(values, dtype).tofile(path)
            paths.append(str(path))
        for role in ("dq", "dk", "dv"):
            path = Path(tmp) / f"{role}.bin"
            count = int(np.prod(shapes[role])) if role in shapes else 1
            np.full(2 * count, 0xFF, dtype=np.uint8).tofile(path)  # NaN poison
            paths.append(str(path))
        workspace = Path(tmp) / "ws.bin"
        np.full(workspace_floats(plan), np.nan, dtype=np.float32).tofile(workspace)  # every pass writes its part
        paths.append(str(workspace))
        for label, values in (("o", o), ("lse", lse), ("bias", bias)):
            path = Path(tmp) / f"{label}.bin"
            if values is None:
                np.zeros(16, dtype=np.uint8).tofile(path)
            elif label == "o":
                to_bits(values, dtype).tofile(path)
            elif label == "bias":
                to_bits(values, problem.attention.bias.dtype).tofile(path)
            else:
                np.asarray(values, dtype=np.float32).tofile(path)
            paths.append(str(path))
        outputs = [str(Path(tmp) / f"out_{role}.bin") for role in ("dq", "dk", "dv")]
        run = subprocess.run([str(binary), *paths, *outputs], capture_output=True, text=True, timeout=900)
        if run.returncode:
            raise RuntimeError(f"emulated {plan.name} failed (exit {run.returncode}): {run.stderr[:2000]}")
        return {role: from_bits(np.fromfile(out, dtype=NP_TYPES[dtype]), dtype).reshape(shapes[role])
                for role, out in zip(("dq", "dk", "dv"), outputs) if role in shapes}  # fmt: skip
