"""The 8-bit ``mma.sync`` flash-attention kernel (e4m3, sm_89 … sm_120): one plan → one kernel.

``o = g · softmax(c·f · q kᵀ [causal]) v`` for e4m3 q, k, v (``f``, ``g``: the problem's score
and output factors, read once a block). One block per ``BLOCK_Q`` query rows of one query
head, 16 rows a warp; the key tiles of its K/V head stream through a ``STAGES``-deep
cp.async ring. Per key tile:

* ``S = Q Kᵀ`` with ``mma.m16n8k32.e4m3``: its A operand (a row's 4 consecutive bytes along
  the head dim a register) and B operand (a key's 4 consecutive bytes) are what ``ldmatrix``
  (b16) hands out when a tile row is 8-bit values — Q and K load as 16-bit tiles would,
  the head dim counted in byte pairs. Q's fragments stay in registers.
* The online softmax in fp32 (log2 units); ``P·2⁸`` rounded to e4m3 (``cvt.satfinite``:
  the factor keeps probabilities down to 2⁻¹⁴ normal; it cancels against the row sum).
* ``O += P V``: the score accumulators give a thread keys ``{2t, 2t+1}`` of each 8-key tile,
  the A operand wants 4 consecutive k slots. Instead of shuffling P, the keys are permuted:
  slot ``4t+i`` of each 16-key half holds key ``{2t, 2t+1, 8+2t, 9+2t}[i]``, and V is
  transposed in shared memory (d-major, keys contiguous — ``ldmatrix.trans`` has no 8-bit
  form) into that order by the block's threads (byte permutes of 4×4-byte blocks).

Shared-memory rows are padded by 16 bytes (``PAD``) so that the 8 rows of an ldmatrix phase
fall in 8 different bank groups. Causal blocks take the longest query tiles first.

Launch (:class:`cherenkov.codegen.launch.FlashAttentionKernel`): grid ``(ceil(Sq / BLOCK_Q),
H, B)``, ``32·BLOCK_Q/16`` threads; arguments ``(q, k, v, o, factors...)`` (pointers; the
score factors, then the output factors, fp32).
"""

from __future__ import annotations

from cherenkov.codegen.cuda.text import block, bool_literal, comment_lines, float_literal, identifier, indent, section
from cherenkov.codegen.errors import CodegenError
from cherenkov.rewrites.plan import KernelPlan
from cherenkov.rewrites.plan_fp8 import FP8_PAD, fp8_schedule_problems, fp8_smem_bytes

LOG2E = 1.4426950408889634
P_EXPONENT_SHIFT = 8.0
"""Probabilities enter the PV product as ``P·2⁸`` (at most 256 < 448, e4m3's largest value)."""

OUT_TYPES = {"bf16": "__nv_bfloat16", "fp16": "__half", "fp32": "float"}


def kernel_name(plan: KernelPlan) -> str:
    """The ``extern "C"`` name, e.g. ``ck_flash_attention_e4m3_q128_kv64_s2``."""
    return identifier(f"ck_flash_attention_{plan.schedule.key()}")


def fp8_dynamic_smem(plan: KernelPlan) -> int:
    return fp8_smem_bytes(plan.schedule, plan.problem.head_dim)


def fp8_grid(plan: KernelPlan) -> tuple[tuple[int, int, int], int]:
    """The launch grid and the threads of a block."""
    p, s = plan.problem, plan.schedule
    return ((p.seq_q + s.block_q - 1) // s.block_q, p.heads, p.batch), s.threads


def flash_attention_fp8_source(plan: KernelPlan) -> str:
    """Deterministic CUDA C++ of one 8-bit flash-attention plan (same plan → same bytes)."""
    reasons = fp8_schedule_problems(plan.schedule, plan.problem, plan.target)
    if reasons:
        raise CodegenError(f"{plan.name}: " + "; ".join(reasons))
    block_scaled = plan.problem.q_block_scales is not None
    parts = [
        _header(plan),
        section("types and helpers", _HELPERS, PACK_E4M3X4, *([_BLOCK_SCALED_MMA] if block_scaled else [])),
        section("problem and schedule constants", _constants(plan)),
        section("tile copies", _COPIES),
        section("one key tile", _TRANSPOSE_V, _scores(block_scaled), _SOFTMAX, _VALUES),
        section("kernel", _kernel(plan)),
    ]
    return "\n\n".join(parts) + "\n"


def _header(plan: KernelPlan) -> str:
    p, s = plan.problem, plan.schedule
    return comment_lines([
        f"cherenkov 8-bit flash attention, plan {plan.name}, target {plan.target.name}.",
        f"Problem: B={p.batch} H={p.heads} Hkv={p.kv_heads} Sq={p.seq_q} Skv={p.seq_kv} D={p.head_dim} {p.dtype} "
        f"-> {p.output_dtype}{' causal' if p.causal else ''} scale={p.scale or p.head_dim ** -0.5:.9g}, "
        f"{len(p.score_factors)} score factor(s), {len(p.out_factors)} output factor(s).",
        f"Schedule: {s.block_q} query rows ({s.warps} warps of 16), {s.block_kv} keys a step, {s.stages} stages.",
    ])  # fmt: skip


_HELPERS = block(r"""
    #include <cuda_bf16.h>
    #include <cuda_fp16.h>
    #include <cstdint>

    __device__ __forceinline__ unsigned smem_address(const void* p) {
        return static_cast<unsigned>(__cvta_generic_to_shared(p));
    }

    // 16 bytes global -> shared; zero-filled when the row is out of range
    __device__ __forceinline__ void cp_async_16(unsigned dst, const void* src, bool in_range) {
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n"
                     :: "r"(dst), "l"(src), "r"(in_range ? 16 : 0));
    }
    __device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n"); }
    template <int N>
    __device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" :: "n"(N)); }

    // four 8x8 b16 matrices (here: 8 rows of 16 bytes each); lane l gives the address of row l % 8 of matrix l / 8
    __device__ __forceinline__ void ldmatrix_x4(unsigned (&r)[4], unsigned address) {
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                     : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(address));
    }

    // d += a·b, m16n8k32, e4m3 operands, fp32 accumulators
    __device__ __forceinline__ void mma_e4m3_16832(float (&d)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
        asm volatile("mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 "
                     "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
                     : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    }

    __device__ __forceinline__ float fast_exp2(float x) {
        float y;
        asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
        return y;
    }

    template <class T> __device__ __forceinline__ T from_float(float x);
    template <> __device__ __forceinline__ float from_float<float>(float x) { return x; }
    template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }
    template <> __device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }
""")


def factor_arguments(problem, batch: str, head: str) -> tuple[str, str, str, str]:
    """The kernel parameters of the problem's factors (fp32 pointers, named after their tensors),
    the arguments passing them on, and the C expressions of the score and output factors of the
    batch and query head held by the C expressions ``batch`` and ``head`` (both 8-bit families)."""
    names = [f"factor{i}_{identifier(f.tensor)}" for i, f in enumerate(problem.factors)]

    def product(pairs: list) -> str:
        reads = [f"__ldg({name} + {f.offset} + {batch} * {f.batch} + ({head} / {f.group}) * {f.head})"
                 for name, f in pairs]  # fmt: skip
        return " * ".join(reads) if reads else "1.0f"

    pairs = list(zip(names, problem.factors))
    split = len(problem.score_factors)
    params = "".join(f", const float* __restrict__ {name}" for name in names)
    return params, "".join(f", {name}" for name in names), product(pairs[:split]), product(pairs[split:])


def _constants(plan: KernelPlan) -> str:
    p, s = plan.problem, plan.schedule
    scale = p.scale or p.head_dim**-0.5
    if scale <= 0:
        raise CodegenError(f"softmax scale {p.scale} must be positive (or 0 for head_dim ** -0.5)")
    q, k, v, o = (p.layout(role) for role in ("q", "k", "v", "o"))
    row = p.head_dim + FP8_PAD
    return block(f"""
        typedef {OUT_TYPES[p.output_dtype]} out_t;
        constexpr int SEQ_Q = {p.seq_q}, SEQ_KV = {p.seq_kv}, HEAD_DIM = {p.head_dim}, GROUP = {p.group_size};
        constexpr bool CAUSAL = {bool_literal(p.causal)};
        constexpr float SCALE_LOG2 = {float_literal(scale * LOG2E)};  // softmax scale in log2 units
        constexpr float P_SHIFT = {float_literal(P_EXPONENT_SHIFT)};  // P·2^8 enters the PV product
        constexpr int BLOCK_Q = {s.block_q}, BLOCK_KV = {s.block_kv}, STAGES = {s.stages}, THREADS = {s.threads};
        constexpr int Q_TILES = (SEQ_Q + BLOCK_Q - 1) / BLOCK_Q, KV_TILES = (SEQ_KV + BLOCK_KV - 1) / BLOCK_KV;
        // element strides (bytes for the 8-bit operands) and offsets of the stored tensors
        constexpr long long Q_BATCH = {q.batch}, Q_HEAD = {q.head}, Q_SEQ = {q.seq}, Q_OFFSET = {q.offset};
        constexpr long long K_BATCH = {k.batch}, K_HEAD = {k.head}, K_SEQ = {k.seq}, K_OFFSET = {k.offset};
        constexpr long long V_BATCH = {v.batch}, V_HEAD = {v.head}, V_SEQ = {v.seq}, V_OFFSET = {v.offset};
        constexpr long long O_BATCH = {o.batch}, O_HEAD = {o.head}, O_SEQ = {o.seq}, O_OFFSET = {o.offset};
        // shared memory: [Q tile][stage s: K tile, V tile]...[V transposed: HEAD_DIM rows of BLOCK_KV key slots]
        constexpr int ROW = {row}, VT_ROW = BLOCK_KV + {FP8_PAD};
        constexpr int Q_BYTES = BLOCK_Q * ROW, KV_BYTES = BLOCK_KV * ROW;
        constexpr int VT_OFFSET = Q_BYTES + STAGES * 2 * KV_BYTES;
        constexpr int CHUNKS = HEAD_DIM / 16;  // 16-byte copies a row
        constexpr int D_STEPS = HEAD_DIM / 32, KV_STEPS = BLOCK_KV / 32;  // k32 steps of QK^T and PV
        constexpr int KV_NTILES = BLOCK_KV / 8, D_NTILES = HEAD_DIM / 8;
    """) + _block_scale_constants(p)


def _block_scale_constants(p) -> str:
    """Strides of q's and k's MX scales (one byte per 32 head-dim elements), when the problem has them."""
    if p.q_block_scales is None:
        return ""
    lines = ["", "// MX scales (e8m0) of q and k: element strides of batch, head, row and 32-element block"]
    for prefix, scales in (("QS", p.q_block_scales), ("KS", p.k_block_scales)):
        lines.append(f"constexpr long long {prefix}_BATCH = {scales.batch}, {prefix}_HEAD = {scales.head}, "
                     f"{prefix}_ROW = {scales.row}, {prefix}_BLOCK = {scales.block}, {prefix}_OFFSET = {scales.offset};")
    return "\n".join(lines)


_COPIES = block(r"""
    // rows [first, first + rows) of a [seq][HEAD_DIM] operand at row stride `stride` into a padded tile;
    // rows at or past `limit` are zero-filled
    __device__ __forceinline__ void load_rows(unsigned char* tile, const uint8_t* base, long long stride, int first,
                                              int rows, int limit) {
        for (int c = threadIdx.x; c < rows * CHUNKS; c += THREADS) {
            const int r = c / CHUNKS, chunk = c % CHUNKS;
            const bool in_range = first + r < limit;
            const uint8_t* src = base + (in_range ? (first + r) * stride : 0) + chunk * 16;
            cp_async_16(smem_address(tile + r * ROW + chunk * 16), src, in_range);
        }
    }
""")

_TRANSPOSE_V = block(r"""
    // V tile [key][d] -> VT [d][slot]: slot 4t + i of each 16-key half holds key {2t, 2t+1, 8+2t, 9+2t}[i], the
    // order in which the score accumulators hand a thread its probabilities. A unit is 4 keys x 4 head-dim bytes.
    __device__ __forceinline__ void transpose_values(const unsigned char* v_tile, unsigned char* vt) {
        constexpr int UNITS = BLOCK_KV / 16 * 4 * (HEAD_DIM / 4);
        for (int u = threadIdx.x; u < UNITS; u += THREADS) {
            const int t = u % 4, half = (u / 4) % (BLOCK_KV / 16), d4 = u / (BLOCK_KV / 4);
            const int key = 16 * half + 2 * t;
            const unsigned w0 = *reinterpret_cast<const unsigned*>(v_tile + key * ROW + 4 * d4);
            const unsigned w1 = *reinterpret_cast<const unsigned*>(v_tile + (key + 1) * ROW + 4 * d4);
            const unsigned w2 = *reinterpret_cast<const unsigned*>(v_tile + (key + 8) * ROW + 4 * d4);
            const unsigned w3 = *reinterpret_cast<const unsigned*>(v_tile + (key + 9) * ROW + 4 * d4);
            const unsigned x01 = __byte_perm(w0, w1, 0x5140), x23 = __byte_perm(w2, w3, 0x5140);
            const unsigned y01 = __byte_perm(w0, w1, 0x7362), y23 = __byte_perm(w2, w3, 0x7362);
            unsigned char* out = vt + 4 * d4 * VT_ROW + 16 * half + 4 * t;
            *reinterpret_cast<unsigned*>(out) = __byte_perm(x01, x23, 0x5410);
            *reinterpret_cast<unsigned*>(out + VT_ROW) = __byte_perm(x01, x23, 0x7632);
            *reinterpret_cast<unsigned*>(out + 2 * VT_ROW) = __byte_perm(y01, y23, 0x5410);
            *reinterpret_cast<unsigned*>(out + 3 * VT_ROW) = __byte_perm(y01, y23, 0x7632);
        }
    }
""")

def _scores(block_scaled: bool) -> str:
    """``tile_scores``: S = Q Kᵀ for the warp's 16 rows and the tile's keys; with MX scales the mma
    applies them (``qs[kk]``: this lane's row scale for the 32-byte step ``kk``, lanes 4g and 4g + 1;
    ``k_scales``: the K/V head's key rows)."""
    if block_scaled:
        params = ", const unsigned (&qs)[D_STEPS],\n" + " " * 52 + "const unsigned char* k_scales, int key0"
        mmas = """
                const int key = key0 + 8 * n + (lane >> 2);
                const bool gives = (lane & 3) == 0;
                const unsigned sb0 = gives && key < SEQ_KV ? __ldg(k_scales + key * KS_ROW + kk * KS_BLOCK) : 127u;
                const unsigned sb1 = gives && key + 8 < SEQ_KV ? __ldg(k_scales + (key + 8) * KS_ROW + kk * KS_BLOCK) : 127u;
                mma_mx_e4m3_16832(s[n], qf[kk], b[0], b[1], qs[kk], sb0);
                mma_mx_e4m3_16832(s[n + 1], qf[kk], b[2], b[3], qs[kk], sb1);"""
    else:
        params = ""
        mmas = """
                mma_e4m3_16832(s[n], qf[kk], b[0], b[1]);
                mma_e4m3_16832(s[n + 1], qf[kk], b[2], b[3]);"""
    what = "(Q·2^sq) (K·2^sk)^T, the MX scales applied by the mma" if block_scaled else "Q K^T (raw dot products)"
    return block(f"""
        // S = {what}, for the warp's 16 rows and the tile's keys
        __device__ __forceinline__ void tile_scores(float (&s)[KV_NTILES][4], const unsigned (&qf)[D_STEPS][4],
                                                    const unsigned char* k_tile, int lane{params}) {{
            #pragma unroll
            for (int n = 0; n < KV_NTILES; ++n) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.f;
            #pragma unroll
            for (int kk = 0; kk < D_STEPS; ++kk) {{
                #pragma unroll
                for (int n = 0; n < KV_NTILES; n += 2) {{
                    unsigned b[4];
                    const int row = 8 * n + (lane & 7) + 8 * (lane >> 4);
                    ldmatrix_x4(b, smem_address(k_tile + row * ROW + 32 * kk + 16 * ((lane >> 3) & 1)));@MMAS@
                }}
            }}
        }}
    """).replace("@MMAS@", "\n" + indent(block(mmas), 3))


PACK_E4M3X4 = block(r"""
    // four floats rounded to e4m3 (saturating), the first in the lowest byte (both 8-bit families)
    __device__ __forceinline__ unsigned pack_e4m3x4(float x0, float x1, float x2, float x3) {
        unsigned short lo, hi;
        asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;\n" : "=h"(lo) : "f"(x1), "f"(x0));
        asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;\n" : "=h"(hi) : "f"(x3), "f"(x2));
        return unsigned(lo) | (unsigned(hi) << 16);
    }
""")

_BLOCK_SCALED_MMA = block(r"""
    // d += (a·2^(sa - 127))·(b·2^(sb - 127)), m16n8k32 e4m3 with one MX scale (ue8m0) per row of A and column of
    // B for the 32 k values: thread-id-a 0 (lanes 4g and 4g + 1 give rows g and g + 8), thread-id-b 0 (lane 4g
    // gives column g), byte-id 0 (each scale in its register's lowest byte)
    __device__ __forceinline__ void mma_mx_e4m3_16832(float (&d)[4], const unsigned (&a)[4], unsigned b0, unsigned b1,
                                                      unsigned sa, unsigned sb) {
        asm volatile("mma.sync.aligned.m16n8k32.row.col.kind::mxf8f6f4.block_scale.scale_vec::1X.f32.e4m3.e4m3.f32.ue8m0 "
                     "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3}, %10, {0, 0}, %11, {0, 0};\n"
                     : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1), "r"(sa), "r"(sb));
    }
""")

_SOFTMAX = block(r"""
    // the online softmax of a tile: masks, the new row maxima (log2 units), O and l rescaled, s -> P·2^8
    __device__ __forceinline__ void tile_softmax(float (&s)[KV_NTILES][4], float (&o)[D_NTILES][4], float (&m)[2],
                                                 float (&l)[2], float scale_log2, int key0, int row0, int lane) {
        const bool masked = key0 + BLOCK_KV > SEQ_KV || (CAUSAL && key0 + BLOCK_KV - 1 > row0);
        float tile_max[2] = {-INFINITY, -INFINITY};
        #pragma unroll
        for (int n = 0; n < KV_NTILES; ++n) {
            #pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int key = key0 + 8 * n + 2 * (lane & 3) + (e & 1), row = row0 + (lane >> 2) + 8 * (e >> 1);
                float x = s[n][e] * scale_log2;
                if (masked && (key >= SEQ_KV || (CAUSAL && key > row))) x = -INFINITY;
                s[n][e] = x;
                tile_max[e >> 1] = fmaxf(tile_max[e >> 1], x);
            }
        }
        #pragma unroll
        for (int r = 0; r < 2; ++r) {
            tile_max[r] = fmaxf(tile_max[r], __shfl_xor_sync(0xffffffffu, tile_max[r], 1));
            tile_max[r] = fmaxf(tile_max[r], __shfl_xor_sync(0xffffffffu, tile_max[r], 2));
            const float m_new = fmaxf(m[r], tile_max[r]);
            const float alpha = m_new == -INFINITY ? 1.f : fast_exp2(m[r] - m_new);
            m[r] = m_new;
            l[r] *= alpha;
            #pragma unroll
            for (int n = 0; n < D_NTILES; ++n) { o[n][2 * r] *= alpha; o[n][2 * r + 1] *= alpha; }
        }
        #pragma unroll
        for (int n = 0; n < KV_NTILES; ++n) {
            #pragma unroll
            for (int e = 0; e < 4; ++e) {
                const float shift = (m[e >> 1] == -INFINITY ? 0.f : m[e >> 1]) - P_SHIFT;
                const float p = fast_exp2(s[n][e] - shift);
                s[n][e] = p;
                l[e >> 1] += p;
            }
        }
    }
""")

_VALUES = block(r"""
    // O += P V: P (e4m3) as A operands in the permuted key order, V^T fragments from the transposed tile
    __device__ __forceinline__ void tile_values(float (&o)[D_NTILES][4], const float (&p)[KV_NTILES][4],
                                                const unsigned char* vt, int lane) {
        #pragma unroll
        for (int ks = 0; ks < KV_STEPS; ++ks) {
            const int n = 4 * ks;
            const unsigned a[4] = {
                pack_e4m3x4(p[n][0], p[n][1], p[n + 1][0], p[n + 1][1]),
                pack_e4m3x4(p[n][2], p[n][3], p[n + 1][2], p[n + 1][3]),
                pack_e4m3x4(p[n + 2][0], p[n + 2][1], p[n + 3][0], p[n + 3][1]),
                pack_e4m3x4(p[n + 2][2], p[n + 2][3], p[n + 3][2], p[n + 3][3]),
            };
            #pragma unroll
            for (int d = 0; d < D_NTILES; d += 2) {
                unsigned b[4];
                const int row = 8 * d + (lane & 7) + 8 * (lane >> 4);
                ldmatrix_x4(b, smem_address(vt + row * VT_ROW + 32 * ks + 16 * ((lane >> 3) & 1)));
                mma_e4m3_16832(o[d], a, b[0], b[1]);
                mma_e4m3_16832(o[d + 1], a, b[2], b[3]);
            }
        }
    }
""")


def _kernel(plan: KernelPlan) -> str:
    p = plan.problem
    arguments, _, score, out = factor_arguments(p, "batch", "head")
    block_scaled = p.q_block_scales is not None
    scale_params = (", const unsigned char* __restrict__ q_scales, const unsigned char* __restrict__ k_scales"
                    if block_scaled else "")  # fmt: skip
    row_scales = block("""
        // this lane's MX scales of Q for each 32-byte step: lane 4g gives row g, lane 4g + 1 row g + 8
        unsigned qs[D_STEPS];
        {
            const int row = row0 + (lane >> 2) + 8 * (lane & 1);
            const unsigned char* row_scales = q_scales + QS_OFFSET + batch * QS_BATCH + head * QS_HEAD + row * QS_ROW;
            #pragma unroll
            for (int kk = 0; kk < D_STEPS; ++kk) qs[kk] = (lane & 3) < 2 && row < SEQ_Q ? __ldg(row_scales + kk * QS_BLOCK) : 127u;
        }
        const unsigned char* k_row_scales = k_scales + KS_OFFSET + batch * KS_BATCH + kv_head * KS_HEAD;
    """) if block_scaled else ""
    scores = ("tile_scores(s, qf, k_tile, lane, qs, k_row_scales, j * BLOCK_KV);" if block_scaled
              else "tile_scores(s, qf, k_tile, lane);")  # fmt: skip
    return block(f"""
        extern "C" __global__ void __launch_bounds__(THREADS)
        {kernel_name(plan)}(const uint8_t* __restrict__ q, const uint8_t* __restrict__ k,
                {' ' * len(kernel_name(plan))}const uint8_t* __restrict__ v, out_t* __restrict__ o{scale_params}{arguments}) {{
            extern __shared__ __align__(16) unsigned char smem[];
            unsigned char* q_tile = smem;
            unsigned char* vt = smem + VT_OFFSET;
            const int tile = CAUSAL ? Q_TILES - 1 - int(blockIdx.x) : int(blockIdx.x);  // causal: longest first
            const int head = blockIdx.y, batch = blockIdx.z, kv_head = head / GROUP;
            const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
            const int q0 = tile * BLOCK_Q, row0 = q0 + 16 * warp;
            const float scale_log2 = SCALE_LOG2 * ({score});
            const uint8_t* q_base = q + Q_OFFSET + batch * Q_BATCH + head * Q_HEAD;
            const uint8_t* k_base = k + K_OFFSET + batch * K_BATCH + kv_head * K_HEAD;
            const uint8_t* v_base = v + V_OFFSET + batch * V_BATCH + kv_head * V_HEAD;
            // causal: keys past the block's last row are never seen
            const int tiles = CAUSAL ? min(KV_TILES, (min(q0 + BLOCK_Q, SEQ_Q) + BLOCK_KV - 1) / BLOCK_KV) : KV_TILES;
            @ROW_SCALES@

            // prologue: Q and the first STAGES - 1 key tiles
            load_rows(q_tile, q_base, Q_SEQ, q0, BLOCK_Q, SEQ_Q);
            #pragma unroll
            for (int s = 0; s < STAGES - 1; ++s) {{
                if (s < tiles) {{
                    unsigned char* stage = smem + Q_BYTES + s * 2 * KV_BYTES;
                    load_rows(stage, k_base, K_SEQ, s * BLOCK_KV, BLOCK_KV, SEQ_KV);
                    load_rows(stage + KV_BYTES, v_base, V_SEQ, s * BLOCK_KV, BLOCK_KV, SEQ_KV);
                }}
                cp_async_commit();
            }}

            unsigned qf[D_STEPS][4];
            float o_acc[D_NTILES][4];
            #pragma unroll
            for (int n = 0; n < D_NTILES; ++n) o_acc[n][0] = o_acc[n][1] = o_acc[n][2] = o_acc[n][3] = 0.f;
            float m[2] = {{-INFINITY, -INFINITY}}, l[2] = {{0.f, 0.f}};

            for (int j = 0; j < tiles; ++j) {{
                cp_async_wait<STAGES - 2>();
                __syncthreads();  // tile j landed everywhere; every warp is done with tile j - 1
                if (j == 0) {{
                    #pragma unroll
                    for (int kk = 0; kk < D_STEPS; ++kk) {{
                        const int row = 16 * warp + (lane & 7) + 8 * ((lane >> 3) & 1);
                        ldmatrix_x4(qf[kk], smem_address(q_tile + row * ROW + 32 * kk + 16 * (lane >> 4)));
                    }}
                }}
                {{  // refill the stage tile j - 1 used with tile j + STAGES - 1
                    const int next = j + STAGES - 1;
                    if (next < tiles) {{
                        unsigned char* stage = smem + Q_BYTES + (next % STAGES) * 2 * KV_BYTES;
                        load_rows(stage, k_base, K_SEQ, next * BLOCK_KV, BLOCK_KV, SEQ_KV);
                        load_rows(stage + KV_BYTES, v_base, V_SEQ, next * BLOCK_KV, BLOCK_KV, SEQ_KV);
                    }}
                    cp_async_commit();
                }}
                const unsigned char* k_tile = smem + Q_BYTES + (j % STAGES) * 2 * KV_BYTES;
                transpose_values(k_tile + KV_BYTES, vt);
                float s[KV_NTILES][4];
                @SCORES@
                tile_softmax(s, o_acc, m, l, scale_log2, j * BLOCK_KV, row0, lane);
                __syncthreads();  // the transposed V tile is complete
                tile_values(o_acc, s, vt, lane);
            }}

            // epilogue: the row sums over the quad, O / l times the output factor, paired stores
            const float out_factor = {out};
            #pragma unroll
            for (int r = 0; r < 2; ++r) {{
                float sum = l[r];
                sum += __shfl_xor_sync(0xffffffffu, sum, 1);
                sum += __shfl_xor_sync(0xffffffffu, sum, 2);
                const int row = row0 + (lane >> 2) + 8 * r;
                if (row >= SEQ_Q) continue;
                const float factor = sum > 0.f ? out_factor / sum : 0.f;
                out_t* out_row = o + O_OFFSET + batch * O_BATCH + head * O_HEAD + row * O_SEQ;
                #pragma unroll
                for (int n = 0; n < D_NTILES; ++n) {{
                    const int col = 8 * n + 2 * (lane & 3);
                    out_row[col] = from_float<out_t>(o_acc[n][2 * r] * factor);
                    out_row[col + 1] = from_float<out_t>(o_acc[n][2 * r + 1] * factor);
                }}
            }}
        }}
    """).replace("@ROW_SCALES@", indent(row_scales, 3).lstrip() if row_scales else "// (no MX scales)").replace(
        "@SCORES@", scores)
