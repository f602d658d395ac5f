"""Running generated term kernels on the CPU: a test helper, not part of cherenkov.

The generated source is compiled as host C++20 unchanged, except for its device helpers
that are inline PTX (``cvt`` to/from 16-bit floats, ``mma.sync``, ``ldmatrix``,
``cp.async``, the packed ``fma`` of an absorbed norm), which are replaced by host
emulations. Every CUDA thread of a block is a fiber (``ucontext``) on one host thread, run until
it waits at a barrier; ``__syncthreads`` is a block barrier, and the warp collectives
(``__shfl_xor_sync``, ``ldmatrix``, ``mma``) exchange their lanes' operands through a
per-warp buffer between two warp barriers, so the fragment layouts, index arithmetic,
tails, shared-memory stages and epilogues of the generated kernels run as written. Blocks
run one after another (``__shared__`` becomes ``static``, and so does the dynamic
shared memory, sized for the plan). A block whose threads deadlock (a round of resumes in which
nothing any waiting thread could observe changed) ends the program at once with
``DEADLOCK_EXIT`` and a report of what each thread waits on; :func:`run_emulated` raises it as
:class:`EmulatedDeadlock`.
"""

from __future__ import annotations

import hashlib
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import numpy as np

from cherenkov.codegen import cuda_source
from cherenkov.codegen.cuda.term_expr import C_TYPES
from cherenkov.codegen.cuda.term_kernels import kernel_name, term_dynamic_smem, term_grid
from cherenkov.graph.evaluate import round_to_dtype

EMULATED = (
    "ck_from_fp16", "ck_to_bf16", "ck_to_fp16", "mma_16816", "mma_16816_zero", "ck_ldsm_x4", "ck_ldsm_x4_t",
    "ck_cp_async_16", "ck_cp_async_commit", "ck_cp_async_wait_oldest", "scale_pair",
)  # fmt: skip

DEADLOCK_EXIT = 3
"""The exit status of an emulated program one of whose blocks deadlocked (its report on stderr)."""

PRELUDE = f"#define EMU_DEADLOCK_EXIT {DEADLOCK_EXIT}\n" + r"""
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <vector>
#include <sys/mman.h>
#include <ucontext.h>

struct ck_dim3 { unsigned x = 0, y = 0, z = 0; };
ck_dim3 threadIdx, blockIdx, gridDim;
struct uint4 { unsigned x, y, z, w; };
struct uint2 { unsigned x, y; };

#define __global__
#define __device__
#define __forceinline__ inline
#define __restrict__ __restrict
#define __launch_bounds__(x)
#define __shared__ static
#define __align__(n) __attribute__((aligned(n)))

// What a waiting fiber waits on, for a deadlock report: describe(object, awaited, out, size) writes
// the object's kind, id and state and the phase the fiber awaits.
struct EmuWait {
    void (*describe)(const void* object, unsigned awaited, char* out, size_t size) = nullptr;
    const void* object = nullptr;
    unsigned awaited = 0;
};

// A block's CUDA threads are fibers taking turns on the host thread: each runs until it waits, and
// the scheduler resumes the next one (threadIdx set to its own), round after round.
//
// Deadlocks: a fiber waits by testing a condition and yielding while it does not hold (emu_wait), and
// the condition reads only the state of waiting primitives. Whatever changes such state (an arrival
// at a barrier, a phase completing, a thread leaving its barriers as it returns) counts progress
// (emu_progress); a test counts nothing, and neither would a spinning wait (a loop around a try-wait
// that yields when it fails): what it polls counts its own changes. A round that resumes every live
// fiber and counts none leaves that state as it found it: every fiber found its condition false,
// none can change, and the next round would repeat it forever. The scheduler then reports the block
// and exits with EMU_DEADLOCK_EXIT. A slow program never trips it: one change anywhere in a round,
// which some fiber's next test may see, makes the round count.
struct EmuFiber {
    ucontext_t context;
    bool done = false;
    EmuWait wait;  // what it last yielded waiting on (current while it is not done)
};
struct EmuScheduler {
    ucontext_t host;
    EmuFiber* fibers = nullptr;
    unsigned current = 0;
    std::function<void()>* body = nullptr;
    unsigned long long progress = 0;
};
static EmuScheduler emu_scheduler;

static inline void emu_progress() { ++emu_scheduler.progress; }

// Wait until ready() holds: resumed each round, the fiber tests it again (a test changes nothing).
template <class Ready> static inline void emu_wait(const EmuWait& what, Ready ready) {
    EmuFiber& self = emu_scheduler.fibers[emu_scheduler.current];
    while (!ready()) {
        self.wait = what;
        swapcontext(&self.context, &emu_scheduler.host);
    }
}

// std::barrier's contract for fibers: a phase completes when its last member arrives (that one
// runs on); arrive_and_drop arrives and leaves the later phases. Arrivals and drops count progress.
struct EmuBarrier {
    EmuBarrier(int members, const char* kind, int id = -1) : expected(members), kind(kind), id(id) {}
    int expected, arrived = 0;
    unsigned phase = 0;
    const char* kind;  // for a deadlock report, with the id where it is not -1
    int id;
    void arrive_and_wait() {
        emu_progress();
        if (++arrived == expected) {
            arrived = 0;
            ++phase;
            return;
        }
        const unsigned mine = phase;
        emu_wait({describe, this, mine}, [&] { return phase != mine; });
    }
    void arrive_and_drop() {
        emu_progress();
        if (--expected > 0 && arrived == expected) {
            arrived = 0;
            ++phase;
        }
    }
    static void describe(const void* object, unsigned awaited, char* out, size_t size) {
        const EmuBarrier& b = *static_cast<const EmuBarrier*>(object);
        char id[16] = "";
        if (b.id >= 0) std::snprintf(id, sizeof id, " %d", b.id);
        std::snprintf(out, size, "%s%s, phase %u: %d of %d arrived", b.kind, id, awaited, b.arrived, b.expected);
    }
};

struct EmuWarp {
    EmuBarrier bar{32, "barrier (__syncwarp, shuffles, votes, ldmatrix, mma) of warp"};
    unsigned words[32][8];
    float floats[32][4];
    const void* addr[32];
};
struct EmuBlock {
    EmuBarrier* bar;
    EmuWarp* warps;
};
static EmuBlock* emu_block;

static void emu_fiber_entry() {
    (*emu_scheduler.body)();
    emu_block->warps[threadIdx.x >> 5].bar.arrive_and_drop();
    emu_block->bar->arrive_and_drop();
    emu_scheduler.fibers[emu_scheduler.current].done = true;
}  // returns to the host context (uc_link)

// A deadlocked block: its index and, a line per distinct wait (in the order of its first thread), the
// threads waiting on it, then those that returned; the program exits with EMU_DEADLOCK_EXIT.
[[noreturn]] static void emu_deadlock(const char* kernel, const EmuFiber* fibers, unsigned threads) {
    std::vector<std::string> what(threads);  // a thread's wait, empty where it returned
    unsigned waiting = 0;
    for (unsigned t = 0; t < threads; ++t) {
        if (fibers[t].done) continue;
        char line[256];
        fibers[t].wait.describe(fibers[t].wait.object, fibers[t].wait.awaited, line, sizeof line);
        what[t] = line;
        ++waiting;
    }
    const auto threads_of = [&](const std::string& wait) {  // as ranges: "0-30, 32"
        std::string ranges;
        for (unsigned first = 0; first < threads; ++first) {
            if (what[first] != wait) continue;
            unsigned last = first;
            while (last + 1 < threads && what[last + 1] == wait) ++last;
            ranges += (ranges.empty() ? "" : ", ") + std::to_string(first);
            if (last > first) ranges += "-" + std::to_string(last);
            first = last;
        }
        return ranges;
    };
    std::fprintf(stderr, "emulator: deadlock in %s, block (%u, %u, %u) of grid (%u, %u, %u): %u of its %u threads "
                 "wait, and a round of resumes changed nothing they wait on\n", kernel, blockIdx.x, blockIdx.y,
                 blockIdx.z, gridDim.x, gridDim.y, gridDim.z, waiting, threads);
    for (unsigned t = 0; t < threads; ++t)
        if (!what[t].empty() && std::find(what.begin(), what.begin() + t, what[t]) == what.begin() + t)
            std::fprintf(stderr, "  threads %s wait on the %s\n", threads_of(what[t]).c_str(), what[t].c_str());
    if (waiting < threads) std::fprintf(stderr, "  threads %s returned\n", threads_of("").c_str());
    std::exit(EMU_DEADLOCK_EXIT);
}

// Run body as `threads` CUDA threads of the current block: each fiber on its own stack, a guard page
// below it, resumed in turn until every one has returned, or a round made no progress.
static void emu_run_threads(const char* kernel, unsigned threads, std::function<void()> body) {
    constexpr size_t STACK = size_t(1) << 21, GUARD = 4096;
    char* stacks = static_cast<char*>(mmap(nullptr, STACK * threads, PROT_READ | PROT_WRITE,
                                           MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0));
    if (stacks == MAP_FAILED) std::abort();
    std::vector<EmuFiber> fibers(threads);
    emu_scheduler.fibers = fibers.data();
    emu_scheduler.body = &body;
    for (unsigned t = 0; t < threads; ++t) {
        mprotect(stacks + t * STACK, GUARD, PROT_NONE);
        getcontext(&fibers[t].context);
        fibers[t].context.uc_stack.ss_sp = stacks + t * STACK + GUARD;
        fibers[t].context.uc_stack.ss_size = STACK - GUARD;
        fibers[t].context.uc_link = &emu_scheduler.host;
        makecontext(&fibers[t].context, emu_fiber_entry, 0);
    }
    for (unsigned live = threads; live;) {
        const unsigned long long before = emu_scheduler.progress;
        for (unsigned t = 0; t < threads; ++t) {
            if (fibers[t].done) continue;
            emu_scheduler.current = t;
            threadIdx.x = t;
            swapcontext(&emu_scheduler.host, &fibers[t].context);
            live -= fibers[t].done;
        }
        if (live && emu_scheduler.progress == before) emu_deadlock(kernel, fibers.data(), threads);
    }
    munmap(stacks, STACK * threads);
}

// Run one block of `kernel` (blockIdx set): its barrier, and a barrier and exchange buffers a warp.
static void emu_run_block(const char* kernel, unsigned threads, std::function<void()> body) {
    EmuBarrier bar(threads, "block barrier (__syncthreads)");
    std::vector<EmuWarp> warps((threads + 31) / 32);
    for (size_t w = 0; w < warps.size(); ++w) warps[w].bar.id = int(w);
    EmuBlock block{&bar, warps.data()};
    emu_block = &block;
    emu_run_threads(kernel, threads, std::move(body));
}

static inline int emu_lane() { return int(threadIdx.x) & 31; }
static inline EmuWarp& emu_warp() { return emu_block->warps[threadIdx.x >> 5]; }
static inline void __syncthreads() { emu_block->bar->arrive_and_wait(); }
static inline float __int_as_float(int x) { float f; std::memcpy(&f, &x, 4); return f; }
static inline float __uint_as_float(unsigned x) { float f; std::memcpy(&f, &x, 4); return f; }
static inline unsigned __float_as_uint(float x) { unsigned u; std::memcpy(&u, &x, 4); return u; }
static inline float __frcp_rn(float x) { return 1.0f / x; }
static inline int min(int a, int b) { return a < b ? a : b; }
static inline int max(int a, int b) { return a > b ? a : b; }

static inline float __shfl_xor_sync(unsigned, float v, int offset) {
    EmuWarp& w = emu_warp();
    const int lane = emu_lane();
    w.floats[lane][0] = v;
    w.bar.arrive_and_wait();
    const float r = w.floats[lane ^ offset][0];
    w.bar.arrive_and_wait();
    return r;
}

typedef unsigned short emu_u16;
static inline float ck_from_fp16(emu_u16 bits) { _Float16 h; std::memcpy(&h, &bits, 2); return float(h); }
static inline emu_u16 ck_to_bf16(float x) {
    unsigned b; std::memcpy(&b, &x, 4);
    if ((b & 0x7fffffffu) > 0x7f800000u) return emu_u16((b >> 16) | 0x40u);
    b += 0x7fffu + ((b >> 16) & 1u);
    return emu_u16(b >> 16);
}
static inline emu_u16 ck_to_fp16(float x) { _Float16 h = _Float16(x); emu_u16 r; std::memcpy(&r, &h, 2); return r; }
static inline float emu_operand(emu_u16 bits) {
#if CK_EMU_MMA_FP16
    return ck_from_fp16(bits);
#else
    unsigned u = unsigned(bits) << 16; float f; std::memcpy(&f, &u, 4); return f;
#endif
}
static inline emu_u16 emu_half(unsigned word, int high) { return emu_u16(high ? word >> 16 : word & 0xffffu); }

// m16n8k16: lane l (g = l / 4, t = l % 4) holds a[0] A[g][2t..], a[1] A[g+8][2t..], a[2] A[g][2t+8..],
// a[3] A[g+8][2t+8..]; b0 B[2t..][g], b1 B[2t+8..][g]; d[0..1] C[g][2t, 2t+1], d[2..3] C[g+8][...].
static inline void mma_16816(float (&d)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
    EmuWarp& w = emu_warp();
    const int lane = emu_lane();
    for (int i = 0; i < 4; ++i) w.words[lane][i] = a[i];
    w.words[lane][4] = b0; w.words[lane][5] = b1;
    w.bar.arrive_and_wait();
    const int g = lane / 4, t = lane % 4;
    for (int e = 0; e < 4; ++e) {
        const int row = g + 8 * (e >> 1), col = 2 * t + (e & 1);
        float sum = d[e];
        for (int k = 0; k < 16; ++k) {
            const int a_lane = (row % 8) * 4 + (k % 8) / 2, a_reg = (row >= 8) + 2 * (k >= 8);
            const int b_lane = col * 4 + (k % 8) / 2, b_reg = 4 + (k >= 8);
            sum += emu_operand(emu_half(w.words[a_lane][a_reg], k & 1)) * emu_operand(emu_half(w.words[b_lane][b_reg], k & 1));
        }
        d[e] = sum;
    }
    w.bar.arrive_and_wait();
}

static inline void ck_ldsm_x4(unsigned (&r)[4], const void* p) {
    EmuWarp& w = emu_warp();
    const int lane = emu_lane();
    w.addr[lane] = p;
    w.bar.arrive_and_wait();
    for (int i = 0; i < 4; ++i) {
        const emu_u16* row = static_cast<const emu_u16*>(w.addr[8 * i + lane / 4]);
        r[i] = unsigned(row[2 * (lane % 4)]) | (unsigned(row[2 * (lane % 4) + 1]) << 16);
    }
    w.bar.arrive_and_wait();
}

static inline void ck_ldsm_x4_t(unsigned (&r)[4], const void* p) {
    EmuWarp& w = emu_warp();
    const int lane = emu_lane();
    w.addr[lane] = p;
    w.bar.arrive_and_wait();
    for (int i = 0; i < 4; ++i) {
        const emu_u16* r0 = static_cast<const emu_u16*>(w.addr[8 * i + 2 * (lane % 4)]);
        const emu_u16* r1 = static_cast<const emu_u16*>(w.addr[8 * i + 2 * (lane % 4) + 1]);
        r[i] = unsigned(r0[lane / 4]) | (unsigned(r1[lane / 4]) << 16);
    }
    w.bar.arrive_and_wait();
}

static inline void ck_cp_async_16(void* smem, const void* gmem, bool in_range) {
    if (in_range) std::memcpy(smem, gmem, 16); else std::memset(smem, 0, 16);
}
static inline float __fdividef(float a, float b) { return a / b; }
static inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }
template <class T> static inline T __ldg(const T* p) { return *p; }

// An absorbed norm's packed 16-bit product (one rounding of the exact product).
static inline unsigned scale_pair(unsigned v, unsigned w) {
    unsigned r = 0;
    for (int h = 0; h < 2; ++h) {
        const float p = emu_operand(emu_half(v, h)) * emu_operand(emu_half(w, h));
        r |= unsigned(CK_EMU_MMA_FP16 ? ck_to_fp16(p) : ck_to_bf16(p)) << (16 * h);
    }
    return r;
}
static inline void ck_cp_async_commit() {}
static inline void ck_cp_async_wait_oldest() {}
"""


def _strip_functions(text: str, names: tuple[str, ...]) -> str:
    """``text`` without the top-level function definitions of ``names`` (brace matching)."""
    out, i = [], 0
    pattern = re.compile(r"__device__ __forceinline__ [^\n;{]*?\b(" + "|".join(names) + r")\(")
    while True:
        match = pattern.search(text, i)
        if match is None:
            out.append(text[i:])
            return "".join(out)
        start = text.rfind("\n", 0, match.start()) + 1
        out.append(text[i:start])
        depth, j = 0, text.index("{", match.end())
        while True:
            if text[j] == "{":
                depth += 1
            elif text[j] == "}":
                depth -= 1
                if depth == 0:
                    break
            j += 1
        i = j + 1


def host_source(plan) -> str:
    """The plan's generated source, made host C++ with the emulated helpers."""
    source = cuda_source(plan)
    fp16 = "f32.f16.f16.f32" in source
    body = _strip_functions(source, EMULATED).replace(
        "extern __shared__ __align__(16) unsigned char ck_smem[];",
        f"alignas(16) static unsigned char ck_smem[{max(term_dynamic_smem(plan), 16)}];",
    )
    return f"#define CK_EMU_MMA_FP16 {int(fp16)}\n" + PRELUDE + "\n" + body


NP_TYPES = {"bf16": np.uint16, "fp16": np.float16, "fp32": np.float32, "int32": np.int32, "bool": np.uint8,
            "fp8_e4m3": np.uint8, "fp8_e5m2": np.uint8, "e8m0": np.uint8}
TORCH_FP8 = {"fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2", "e8m0": "float8_e8m0fnu"}  # the bits, as PyTorch's casts encode them


READ_FILE = r"""
static std::vector<unsigned char> read_file(const char* path) {
    FILE* f = std::fopen(path, "rb");
    std::fseek(f, 0, SEEK_END); long n = std::ftell(f); std::fseek(f, 0, SEEK_SET);
    std::vector<unsigned char> data(n + 64);
    if (n && std::fread(data.data(), 1, n, f) != size_t(n)) return {};
    std::fclose(f);
    return data;
}
"""


def launch_blocks(function: str, grid: tuple[int, int, int], threads: int, args: str) -> str:
    """Host C++ running ``function(args)`` over ``grid``: the blocks one after another, each
    block's ``threads`` CUDA threads as fibers sharing its barriers."""
    gx, gy, gz = grid
    return f"""
    gridDim.x = {gx}; gridDim.y = {gy}; gridDim.z = {gz};
    for (unsigned bz = 0; bz < {gz}; ++bz)
    for (unsigned by = 0; by < {gy}; ++by)
    for (unsigned bxi = 0; bxi < {gx}; ++bxi) {{
        blockIdx.x = bxi; blockIdx.y = by; blockIdx.z = bz;
        emu_run_block("{function}", {threads}, [&] {{ {function}({args}); }});
    }}
"""


def _main(plan) -> str:
    (gx, gy, gz), (bx, _, _) = term_grid(plan)
    tensors = plan.tensors
    reads = "\n".join(f"    bufs[{i}] = read_file(argv[{i + 1}]);" for i in range(len(tensors)))
    args = ", ".join(
        f"reinterpret_cast<{'const ' if i < len(tensors) - 1 else ''}{C_TYPES[info.dtype]}*>(bufs[{i}].data())"
        for i, info in enumerate(tensors)
    )
    last = len(tensors) - 1
    return f"""
{READ_FILE}

int main(int argc, char** argv) {{
    std::vector<std::vector<unsigned char>> bufs({len(tensors)});
{reads}
{launch_blocks(kernel_name(plan), (gx, gy, gz), bx, args)}
    FILE* f = std::fopen(argv[{last + 2}], "wb");
    std::fwrite(bufs[{last}].data(), 1, bufs[{last}].size() - 64, f);
    std::fclose(f);
    return 0;
}}
"""


def to_bits(values: np.ndarray, dtype: str) -> np.ndarray:
    """float64 values as the stored elements of ``dtype`` (rounded to nearest even)."""
    values = np.asarray(values, dtype=np.float64)
    if dtype == "bf16":
        rounded = round_to_dtype(values, "bf16").astype(np.float32)
        return (rounded.view(np.uint32) >> 16).astype(np.uint16)
    if dtype == "bool":
        return (values != 0).astype(np.uint8)
    if dtype in TORCH_FP8:
        import torch

        fp8 = getattr(torch, TORCH_FP8[dtype])
        return torch.from_numpy(values.astype(np.float32)).to(fp8).view(torch.uint8).numpy()
    if dtype == "int32":
        return np.trunc(values).astype(np.int32)
    return values.astype(NP_TYPES[dtype])


def from_bits(data: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "bf16":
        return (data.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    if dtype in TORCH_FP8:
        import torch

        fp8 = getattr(torch, TORCH_FP8[dtype])
        return torch.from_numpy(np.ascontiguousarray(data, dtype=np.uint8)).view(fp8).double().numpy()
    return data.astype(np.float64)


def emulate(plan, inputs: dict[str, np.ndarray], work: Path | None = None) -> np.ndarray:
    """Run a term plan's kernel on the CPU; ``inputs`` by name (float64, rounded to each
    tensor's dtype here); returns the output as float64 (NaN where never written)."""
    binary = host_binary(host_source(plan) + _main(plan), "term", plan.name, work)
    root = emulator_root(work)
    with tempfile.TemporaryDirectory(dir=root) as tmp:
        paths = []
        for info in plan.inputs:
            path = Path(tmp) / f"in_{info.name}.bin"
            to_bits(np.broadcast_to(inputs[info.name], info.shape), info.dtype).tofile(path)
            paths.append(str(path))
        out = plan.output
        poison = Path(tmp) / "out.bin"
        np.full(out.numel * np.dtype(NP_TYPES[out.dtype]).itemsize, 0xFF, dtype=np.uint8).tofile(poison)
        result_path = Path(tmp) / "result.bin"
        run_emulated(binary, [*paths, str(poison), str(result_path)], plan.name, timeout=600)
        data = np.fromfile(result_path, dtype=NP_TYPES[out.dtype]).reshape(out.shape)
    return from_bits(data, out.dtype)


class EmulatedDeadlock(RuntimeError):
    """An emulated block deadlocked; the message holds the program's report (the block, and what
    each thread waits on)."""


def run_emulated(binary: Path, args: list[str], plan_name: str, timeout: float) -> subprocess.CompletedProcess[str]:
    """Run an emulated program with ``args`` (its output captured): an :class:`EmulatedDeadlock`
    when one of its blocks deadlocked, a ``RuntimeError`` naming ``plan_name`` when it failed
    otherwise."""
    run = subprocess.run([str(binary), *args], capture_output=True, text=True, timeout=timeout)
    if run.returncode == DEADLOCK_EXIT:
        raise EmulatedDeadlock(f"emulated {plan_name} deadlocked (exit {DEADLOCK_EXIT}):\n{run.stderr[:4000]}")
    if run.returncode:
        raise RuntimeError(f"emulated {plan_name} failed (exit {run.returncode}): {run.stderr[:2000]}")
    return run


def host_binary(source: str, label: str, plan_name: str, work: Path | None = None) -> Path:
    """``source`` compiled as a host program (cached by its digest under the emulator's work
    directory, ``label``-named); a ``RuntimeError`` naming ``plan_name`` when it does not compile."""
    compiler = shutil.which("g++")
    if compiler is None:
        raise RuntimeError("no g++ to emulate kernels with")
    digest = hashlib.sha256(source.encode()).hexdigest()[:16]
    root = emulator_root(work)
    binary = root / f"{label}-{digest}.bin"
    if not binary.exists():
        (root / f"{label}-{digest}.cpp").write_text(source)
        result = subprocess.run([compiler, "-std=c++20", "-O1", "-pthread", "-w", "-o", str(binary),
                                 str(root / f"{label}-{digest}.cpp")], capture_output=True, text=True)  # fmt: skip
        if result.returncode:
            raise RuntimeError(f"host compile of {plan_name} failed:\n{result.stderr[:4000]}")
    return binary


def emulator_root(work: Path | None = None) -> Path:
    """The directory emulated programs and their buffers live in."""
    root = Path(work or tempfile.gettempdir()) / "cherenkov-emulator"
    root.mkdir(parents=True, exist_ok=True)
    return root


def rounded(values: np.ndarray, dtype: str) -> np.ndarray:
    """Values as the kernel sees them after storing in ``dtype``."""
    return from_bits(to_bits(values, dtype), dtype)
