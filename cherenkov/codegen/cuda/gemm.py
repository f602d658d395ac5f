"""The tiled ``mma.sync`` GEMM family (sm_80 … sm_120) for contraction kernels.

A contraction kernel computes ``epilogue(Σ_k a[m, k] · b[k, n])`` where ``a`` and ``b`` are
elementwise terms of 16-bit tensor reads (see :class:`~cherenkov.codegen.term_plan.GemmLayout`:
M, N and the batch flatten several axes each). One block computes a ``BM × BN`` output
tile of one batch entry; its warps own ``WM × WN`` sub-tiles of m16n8k16 tensor-core tiles
with fp32 accumulators. K advances ``BK`` at a time.

Tiles are stored the way their operand is laid out in memory, so global reads coalesce:
``[row][k]`` when the operand's innermost index follows k (A and B fragments then come
from ``ldmatrix``), ``[k][row]`` when it follows the operand's rows (``ldmatrix.trans``).
Rows are padded by 16 bytes, which makes every ldmatrix phase conflict-free. A plain read
of the mma dtype whose innermost extent is a multiple of 8 is copied with 16-byte
``cp.async`` (zero-filled past the end); anything else — prologues (a norm's weight, a
bias and GELU), other layouts (reshaped or transposed reads) — is evaluated element by
element through the term emitter and rounded to the mma dtype on the way into shared
memory. Past the end of K every element is zero; rows past M or N are clamped and their
results never stored. An absorbed RMSNorm (:mod:`.norm_prologue`) works on the A
fragments after ``ldmatrix``: their squares into row sums, then times the weight. The
tiles live in a ring of ``stages`` buffers in dynamic shared memory: while step ``kt``
multiplies, the tiles of steps up to ``kt + stages - 1`` load, and one block barrier a
step both publishes the landed tile and frees the oldest buffer.
The epilogue evaluates the kernel's term around the contraction for each accumulator
element (bias, activation, residual) and stores it, two adjacent columns as one 4-byte
word where the output's layout allows (:func:`paired_columns`); its transcendental
functions use the hardware approximations (the output is 16-bit: a few fp32 ulp vanish in
its rounding).

Launch: grid ``(ceil(N / BN), ceil(M / BM), BATCH)``, ``32 · warps`` threads,
:func:`~cherenkov.codegen.term_plan.gemm_smem_bytes` of dynamic shared memory.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from cherenkov.codegen.cuda.term_common import (
    decompose,
    indent_lines,
    kernel_name,
    output_offset,
    safe_axis,
    tensor_infos,
    term_source,
    vector_helpers,
)
from cherenkov.codegen.cuda.term_expr import Binding, TermEmitter, index_type, store
from cherenkov.codegen.cuda.mma import emit_mma
from cherenkov.codegen.cuda.norm_prologue import emit_norm_helpers, fragment_prologue, norm_constants, row_scales
from cherenkov.codegen.cuda.text import block
from cherenkov.codegen.errors import CodegenError
from cherenkov.codegen.term_plan import GEMM_SMEM_PAD, GemmLayout, gemm_layout, gemm_smem_bytes, mma_problems
from cherenkov.rewrites import terms as t
from cherenkov.rewrites.terms import Term

def grid(plan) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
    layout = gemm_layout(plan.kernel, tensor_infos(plan))
    s = plan.schedule
    return (math.ceil(layout.n / s.block_n), math.ceil(layout.m / s.block_m), layout.batch_size), (s.threads, 1, 1)


def dynamic_smem(plan) -> int:
    """Bytes of dynamic shared memory a GEMM plan's launch needs."""
    return gemm_smem_bytes(plan.schedule)


def _helpers(dtype: str, stages: int) -> str:
    """The tensor-core mma (shared with flash attention), ldmatrix and cp.async helpers."""
    return emit_mma(dtype) + "\n" + block("""
        // Four 8x8 b16 matrices from shared memory (row addresses from lanes 0-7, 8-15, 16-23, 24-31).
        __device__ __forceinline__ void ck_ldsm_x4(u32 (&r)[4], const void* p) {
            const u32 addr = static_cast<u32>(__cvta_generic_to_shared(p));
            asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\\n"
                         : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
        }

        // The same, each matrix transposed.
        __device__ __forceinline__ void ck_ldsm_x4_t(u32 (&r)[4], const void* p) {
            const u32 addr = static_cast<u32>(__cvta_generic_to_shared(p));
            asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\\n"
                         : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
        }
        """) + "\n" + cp_async_helpers(stages - 2, "the oldest tile has landed")


def cp_async_helpers(pending: int, meaning: str) -> str:
    """``ck_cp_async_16`` (zero-filling), ``ck_cp_async_commit`` and ``ck_cp_async_wait_oldest``
    (wait until at most ``pending`` of this thread's copy groups are in flight: ``meaning``)."""
    return block(f"""
        // 16 bytes global -> shared without blocking; in_range = false writes 16 zero bytes.
        __device__ __forceinline__ void ck_cp_async_16(void* smem, const void* gmem, bool in_range) {{
            const u32 addr = static_cast<u32>(__cvta_generic_to_shared(smem));
            asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\\n"
                         :: "r"(addr), "l"(gmem), "r"(in_range ? 16 : 0) : "memory");
        }}
        __device__ __forceinline__ void ck_cp_async_commit() {{ asm volatile("cp.async.commit_group;\\n" ::: "memory"); }}
        // Wait until at most {pending} of this thread's copy groups are in flight: {meaning}.
        __device__ __forceinline__ void ck_cp_async_wait_oldest() {{
            asm volatile("cp.async.wait_group {pending};\\n" ::: "memory");
        }}
        """)


class TileOperand:
    """One operand's tile: which smem array, its layout, its rows (M or N side)."""

    def __init__(self, role: str, term, rows: tuple[str, ...], kmajor: bool, fast: bool, tile_rows: str, extent: str,
                 origin: str) -> None:  # fmt: skip
        self.role, self.term, self.rows, self.kmajor, self.fast = role, term, rows, kmajor, fast
        self.tile_rows, self.extent, self.origin = tile_rows, extent, origin
        self.smem = f"s{role}"

    def declaration(self, offset: str) -> str:
        """``s{role}[stage][..][..]``: this operand's ring of tiles at byte ``offset`` of the
        dynamic shared memory."""
        shape = f"[{self.tile_rows}][BK + PAD]" if self.kmajor else f"[BK][{self.tile_rows} + PAD]"
        order = "[row][k]" if self.kmajor else "[k][row]"
        return f"u16 (*{self.smem}){shape} = reinterpret_cast<u16 (*){shape}>(ck_smem + {offset});  // {order}"

    def element(self, stage: str, row: str, k: str) -> str:
        return f"{self.smem}[{stage}][{row}][{k}]" if self.kmajor else f"{self.smem}[{stage}][{k}][{row}]"


def copy_tile(em: TermEmitter, op: TileOperand, layout: GemmLayout, batch_env: dict[str, Binding],
              destination: str) -> list[str]:  # fmt: skip
    """Statements (run with ``k0`` defined) that copy one ``BK``-deep tile of a fast operand
    with 16-byte ``cp.async``: chunk ``c`` of 8 elements is ``(row, kk)``, 8 consecutive k
    of one row when the operand is K-major, 8 consecutive rows of one k otherwise (so
    consecutive threads read consecutive 16 bytes); ``destination`` is the shared-memory
    pointer of that chunk (an expression of ``row`` and ``kk``). Chunks past M/N or K are
    zero-filled, their source clamped to element 0."""
    rows_total = op.tile_rows
    depth = em.push()
    chunks = f"{rows_total} * BK / 8"
    lines = [
        "#pragma unroll",
        f"for (int i = 0; i < ({chunks} + THREADS - 1) / THREADS; ++i) {{  // a constant trip count: unrolled",
        "    const int c = threadIdx.x + i * THREADS;",
        f"    if (({chunks}) % THREADS != 0 && c >= {chunks}) break;",
        (
            "    const int row = c / (BK / 8), kk = (c % (BK / 8)) * 8;"
            if op.kmajor
            else f"    const int kk = c / ({rows_total} / 8), row = (c % ({rows_total} / 8)) * 8;"
        ),
        f"    const int g = {op.origin} + row, k = k0 + kk;",
        f"    const bool in_range = g < {op.extent} && k < K;",
        "    const int gc = in_range ? g : 0, kc = in_range ? k : 0;",
    ]
    dec, env = decompose("gc", op.rows, depth, f"{op.role.lower()}x")
    env = {**batch_env, **env, layout.k_axis: Binding("kc", depth, 0, layout.k - 1)}
    offset = em.offset(op.term, env)
    info = em.tensors[op.term[1]]
    inner = em.pop()
    lines += indent_lines(dec, 1) + indent_lines(inner, 1)
    lines += [f"    ck_cp_async_16({destination}, {info.param} + {offset}, in_range);", "}"]
    return lines


def _loader(em: TermEmitter, op: TileOperand, layout: GemmLayout, batch_env: dict[str, Binding], dtype: str) -> list[str]:
    """Statements (run with ``k0`` and ``stage`` defined) that fill one stage of a tile."""
    if op.fast:
        return copy_tile(em, op, layout, batch_env, f"&{op.element('stage', 'row', 'kk')}")
    rows_total = op.tile_rows
    depth = em.push()
    if op.kmajor:
        lines = [
            "#pragma unroll 4",
            f"for (int e = threadIdx.x; e < {rows_total} * BK; e += THREADS) {{",
            "    const int row = e / BK, kk = e % BK;",
        ]
    else:
        lines = [
            "#pragma unroll 4",
            f"for (int e = threadIdx.x; e < {rows_total} * BK; e += THREADS) {{",
            f"    const int kk = e / {rows_total}, row = e % {rows_total};",
        ]
    lines += [
        f"    const int g = min({op.origin} + row, {op.extent} - 1), k = k0 + kk;",
        "    const int kc = min(k, K - 1);",
    ]
    dec, env = decompose("g", op.rows, depth, f"{op.role.lower()}x")
    env = {**batch_env, **env, layout.k_axis: Binding("kc", depth, 0, layout.k - 1)}
    value = em.value(op.term, env)
    inner = em.pop()
    lines += indent_lines(dec, 1) + indent_lines(inner, 1)
    lines += [f"    {op.element('stage', 'row', 'kk')} = k < K ? ck_to_{dtype}({value}) : u16(0);", "}"]
    return lines


def _fragments(op: TileOperand, count: str, origin: str, step: int) -> list[str]:
    """ldmatrix.x4 loads of one k16 step: A's m16 tiles, or pairs of B's n8 tiles."""
    if op.role == "A":
        regs, what = "a[i]", "A: m16 tile i"
        row, k_off = (
            (f"{origin} + 16 * i + (lane & 15)", "kk * 16 + (lane >> 4) * 8")
            if op.kmajor
            else (f"{origin} + 16 * i + 8 * (q & 1)", "kk * 16 + r + 8 * (q >> 1)")
        )
    else:
        regs, what = "b[i]", "B: n8 tiles 2i and 2i + 1"
        row, k_off = (
            (f"{origin} + 16 * i + r + 8 * (q >> 1)", "kk * 16 + 8 * (q & 1)")
            if op.kmajor
            else (f"{origin} + 16 * i + 8 * (q >> 1)", "kk * 16 + r + 8 * (q & 1)")
        )
    load = "ck_ldsm_x4" if op.kmajor else "ck_ldsm_x4_t"
    return [
        f"// {what} ({'ldmatrix' if op.kmajor else 'ldmatrix.trans'})",
        "#pragma unroll",
        f"for (int i = 0; i < {count}; ++i) {{",
        f"    {load}({regs}, &{op.element('stage', row, k_off)});",
        "}",
    ]


def _norm_prologue(norm, plan) -> list[str]:
    """The absorbed RMSNorm on this k16 step's A fragments (see :mod:`.norm_prologue`)."""
    weights = None
    lines = ["// the absorbed RMSNorm: squares of x into the row sums, then x times the weight"]
    if norm.weight is not None:
        weight = plan.tensor_map[norm.weight[1]].param
        lines += [
            "const int kw = kt * BK + kk * 16 + 2 * (lane & 3);  // this lane's k pairs: kw and kw + 8",
            f"const u32 w_lo = weight_pair({weight}, kw, K - 1), w_hi = weight_pair({weight}, kw + 8, K - 1);",
        ]
        weights = ("w_lo", "w_hi")
    return [
        *lines,
        "#pragma unroll",
        "for (int i = 0; i < MT; ++i) {",
        *indent_lines(fragment_prologue("a[i]", "row_ss[i]", weights), 1),
        "}",
    ]


def epilogue_loops(tiles: tuple[str, str], columns: tuple[str, str], row: str, column: str,
                   epilogue: list[str], paired: bool = False) -> list[str]:  # fmt: skip
    """The loops over a thread's accumulators — ``tiles`` and ``columns`` as (variable,
    bound), then the 4 elements ``e`` of an m16n8 fragment — binding the output row ``m``
    and column ``n`` and running ``epilogue`` (from :func:`epilogue_store`) where both
    are in range. ``paired``: ``e`` steps by 2 and ``epilogue`` (from
    :func:`epilogue_pair_store`) stores elements ``e`` and ``e + 1``, columns ``n`` and
    ``n + 1`` (``n`` even, N even)."""
    return [
        "#pragma unroll",
        f"for (int {tiles[0]} = 0; {tiles[0]} < {tiles[1]}; ++{tiles[0]}) {{",
        "    #pragma unroll",
        f"    for (int {columns[0]} = 0; {columns[0]} < {columns[1]}; ++{columns[0]}) {{",
        "        #pragma unroll",
        f"        for (int e = 0; e < 4; {'e += 2' if paired else '++e'}) {{",
        f"            const int m = {row};",
        f"            const int n = {column};",
        "            if (m < M && n < N) {",
        *indent_lines(epilogue, 4),
        "            }",
        "        }",
        "    }",
        "}",
    ]


def accumulator_epilogue(em: TermEmitter, plan, layout: GemmLayout, batch_env: dict[str, Binding],
                         element: str, next_element: str, known: Mapping[Term, tuple[str, str]] | None = None,
                         ) -> tuple[bool, list[str]]:  # fmt: skip
    """``(paired, statements)``: the epilogue of accumulator ``element`` — with the next
    column's ``next_element`` in one paired store where :func:`paired_columns` holds (and
    the subterms of ``known`` by their two values, which needs the pairs) — for
    :func:`epilogue_loops`."""
    if paired_columns(plan, layout):
        return True, epilogue_pair_store(em, plan, layout, batch_env, (element, next_element), known)
    if known:
        raise CodegenError(f"kernel {plan.kernel.output}: given epilogue values need paired columns")
    return False, epilogue_store(em, plan, layout, batch_env, element)


def epilogue_store(em: TermEmitter, plan, layout: GemmLayout, batch_env: dict[str, Binding],
                   accumulator: str) -> list[str]:  # fmt: skip
    """Statements (run with an in-range output row ``m`` and column ``n`` defined) that
    evaluate the kernel's term at that element — its contraction replaced by the fp32
    ``accumulator`` expression (bias, activation, residual around it) — and store it."""
    em.overrides[layout.core] = lambda _env: accumulator
    depth = em.push()
    m_lines, m_env = decompose("m", layout.m_axes, depth, "em")
    n_lines, n_env = decompose("n", layout.n_axes, depth, "en")
    env = {**batch_env, **m_env, **n_env}
    value = em.value(plan.kernel.term, env)
    lines = [*m_lines, *n_lines, *em.pop()]
    return [*lines, store(plan.output, output_offset(plan.kernel.axes, env, em.index_type), value)]


def paired_columns(plan, layout: GemmLayout) -> bool:
    """Whether output columns ``n`` and ``n + 1`` (``n`` even) are adjacent 16-bit elements
    of one 4-byte word: the output's innermost axis is the last N axis, of even extent."""
    innermost = next((x for x in reversed(plan.kernel.axes) if t.extent(x) > 1), None)
    return (
        plan.output.dtype in ("bf16", "fp16")
        and bool(layout.n_axes)
        and innermost == layout.n_axes[-1]
        and t.extent(innermost) % 2 == 0
    )


def epilogue_pair_store(em: TermEmitter, plan, layout: GemmLayout, batch_env: dict[str, Binding],
                        accumulators: tuple[str, str], known: Mapping[Term, tuple[str, str]] | None = None,
                        ) -> list[str]:  # fmt: skip
    """Like :func:`epilogue_store` for columns ``n`` and ``n + 1`` (``n`` even, in range;
    :func:`paired_columns` holds), with ``accumulators`` theirs: both values are stored
    as one 4-byte word."""
    lines, values, env = epilogue_pair_values(em, plan, layout, batch_env, accumulators, known)
    offset = output_offset(plan.kernel.axes, env, em.index_type)
    info = plan.output
    return [*lines, f"ck_store_{info.dtype}x2({info.param} + {offset}, {{{values[0]}, {values[1]}}});"]


def epilogue_pair_values(em: TermEmitter, plan, layout: GemmLayout, batch_env: dict[str, Binding],
                         accumulators: tuple[str, str], known: Mapping[Term, tuple[str, str]] | None = None,
                         next_column: str = "(n + 1)") -> tuple[list[str], list[str], dict[str, Binding]]:
    """``(statements, values, env)``: the kernel's term at output columns ``n`` and ``n + 1``
    of row ``m`` (both in range), with ``accumulators`` in place of its contraction and each
    subterm of ``known`` by its two given fp32 values (a staged source's pair, the
    accumulators a shifted contraction finds a few columns on) — the statements that bind
    them, the two fp32 value expressions and column ``n``'s index bindings — for an
    epilogue that stores the pair itself. ``next_column`` is where the second value's reads
    index (``min(n + 1, N - 1)`` where column ``n + 1`` may lie past an odd N: a value no
    store keeps, read from inside the tensors)."""
    depth = em.push()
    m_lines, m_env = decompose("m", layout.m_axes, depth, "em")
    values, envs, lines = [], [], list(m_lines)
    for half, (accumulator, column, prefix) in enumerate(zip(accumulators, ("n", next_column), ("en", "eo"),
                                                             strict=True)):  # fmt: skip
        em.overrides[layout.core] = lambda _env, accumulator=accumulator: accumulator
        for subterm, pair in (known or {}).items():
            em.overrides[subterm] = lambda _env, value=pair[half]: value
        n_lines, n_env = decompose(column, layout.n_axes, depth, prefix)
        env = {**batch_env, **m_env, **n_env}
        lines += n_lines
        values.append(em.value(plan.kernel.term, env))
        envs.append(env)
    lines += em.pop()
    return lines, values, envs[0]


def shape_constants(layout: GemmLayout, schedule, indent: str, batch: bool = True) -> str:
    """The ``constexpr`` problem and tile sizes every GEMM kernel starts with (M, N, K and
    their axes, BATCH unless ``batch`` is False, BM, BN, BK, STAGES), one a line; lines
    after the first carry ``indent`` so the text fits an indented ``block``."""
    s = layout
    lines = [
        f"constexpr int M = {s.m};  // rows: {', '.join(safe_axis(x) for x in s.m_axes) or 'none'}",
        f"constexpr int N = {s.n};  // columns: {', '.join(safe_axis(x) for x in s.n_axes) or 'none'}",
        f"constexpr int K = {s.k};  // contracted: {safe_axis(s.k_axis)}",
        f"constexpr int BATCH = {s.batch_size};  // {', '.join(safe_axis(x) for x in s.batch) or 'none'}",
        f"constexpr int BM = {schedule.block_m}, BN = {schedule.block_n}, BK = {schedule.block_k}, "
        f"STAGES = {schedule.stages};",
    ]
    if not batch:
        del lines[3]
    return ("\n" + indent).join(lines)


def gemm_source(plan) -> str:
    s = plan.schedule
    kernel = plan.kernel
    infos = tensor_infos(plan)
    problems = mma_problems(kernel, infos, plan.output)
    if problems:
        raise CodegenError(f"kernel {kernel.output}: no mma GEMM: {'; '.join(problems)}")
    layout = gemm_layout(kernel, infos)
    dtype = layout.dtype
    itype = index_type(infos)
    em = TermEmitter(infos, itype, fast_math=True)  # 16-bit operands and output (mma_problems)
    name = kernel_name(plan)
    (gx, gy, gz), _ = grid(plan)

    norm = layout.norm
    a = TileOperand("A", layout.a, layout.m_axes, layout.a_kmajor, layout.a_fast, "BM", "M", "m0")
    b = TileOperand("B", layout.b, layout.n_axes, layout.b_kmajor, layout.b_fast, "BN", "N", "n0")

    constants = block(f"""
        {shape_constants(layout, s, "        ")}
        constexpr int PAD = {GEMM_SMEM_PAD};  // elements a tile row is padded by (16 bytes: conflict-free ldmatrix)
        constexpr int WARPS_M = {s.warps_m}, WARPS_N = {s.warps_n}, THREADS = {s.threads};
        constexpr int WM = BM / WARPS_M, WN = BN / WARPS_N;  // one warp's tile
        constexpr int MT = WM / 16, NT = WN / 8;              // its m16 and n8 mma tiles
        constexpr int KT = (K + BK - 1) / BK;                 // k steps
        static_assert(WM % 16 == 0 && WN % 16 == 0 && BK % 16 == 0, "warp tiles split into m16n8k16 tiles");
        static_assert(BATCH >= 1 && M >= 1 && N >= 1 && K >= 1, "grid (ceil(N / BN), ceil(M / BM), BATCH)");
        {norm_constants(norm.eps) if norm else ""}
        """)

    body: list[str] = [
        "const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;",
        "const int wm = warp / WARPS_N, wn = warp % WARPS_N;",
        "const int q = lane >> 3, r = lane & 7;  // ldmatrix: which matrix this lane addresses, and its row",
        "const int n0 = blockIdx.x * BN, m0 = blockIdx.y * BM;",
        f"// shared memory: a ring of STAGES A tiles, then STAGES B tiles ({gemm_smem_bytes(s)} bytes)",
        "extern __shared__ __align__(16) unsigned char ck_smem[];",
        a.declaration("0"),
        b.declaration(f"STAGES * sizeof({a.smem}[0])"),
    ]
    em.push()
    batch_lines, batch_env = decompose("blockIdx.z", layout.batch, 0, "bz")
    body += batch_lines
    load_a = _loader(em, a, layout, batch_env, dtype)
    load_b = _loader(em, b, layout, batch_env, dtype)

    scale = " * row_scale[mi][e >> 1]" if norm else ""  # columns e, e + 1 share a row
    paired, epilogue = accumulator_epilogue(em, plan, layout, batch_env, f"acc[mi][ni][e]{scale}",
                                            f"acc[mi][ni][e + 1]{scale}")
    top = em.pop()
    body += ["// values the whole block shares (batch-only parts of the terms)", *top]
    body += [
        "float acc[MT][NT][4];",
        "#pragma unroll",
        "for (int mi = 0; mi < MT; ++mi)",
        "    #pragma unroll",
        "    for (int ni = 0; ni < NT; ++ni)",
        "        #pragma unroll",
        "        for (int e = 0; e < 4; ++e) acc[mi][ni][e] = 0.0f;",
        *(["float row_ss[MT][2][2] = {};  // sums of x^2 over k, two chains: rows g and g + 8 of each m16 tile"]
          if norm else []),
        "",
        "// start loading k step `next` into ring buffer next % STAGES (one copy group, empty past K)",
        "auto load_tiles = [&](int next) {",
        "    if (next < KT) {",
        "        const int k0 = next * BK, stage = next % STAGES;",
        f"        // A tile: {'16-byte cp.async copies' if a.fast else 'evaluated element by element'}",
        *indent_lines(load_a, 2),
        f"        // B tile: {'16-byte cp.async copies' if b.fast else 'evaluated element by element'}",
        *indent_lines(load_b, 2),
        "    }",
        "    ck_cp_async_commit();",
        "};",
        "#pragma unroll",
        "for (int next = 0; next < STAGES - 1; ++next) load_tiles(next);",
        "",
        "// main loop: step kt multiplies buffer kt % STAGES while the next STAGES - 1 steps load",
        "for (int kt = 0; kt < KT; ++kt) {",
        "    ck_cp_async_wait_oldest();",
        "    __syncthreads();  // step kt's tiles are visible; nobody reads buffer (kt - 1) % STAGES any more",
        "    load_tiles(kt + STAGES - 1);",
        "    const int stage = kt % STAGES;",
        "    #pragma unroll",
        "    for (int kk = 0; kk < BK / 16; ++kk) {",
        "        u32 a[MT][4], b[NT / 2][4];",
        *indent_lines(_fragments(a, "MT", "wm * WM", 0), 2),
        *indent_lines(_norm_prologue(norm, plan) if norm else [], 2),
        *indent_lines(_fragments(b, "NT / 2", "wn * WN", 0), 2),
        "        #pragma unroll",
        "        for (int mi = 0; mi < MT; ++mi)",
        "            #pragma unroll",
        "            for (int ni = 0; ni < NT; ++ni)",
        "                mma_16816(acc[mi][ni], a[mi], b[ni >> 1][2 * (ni & 1)], b[ni >> 1][2 * (ni & 1) + 1]);",
        "    }",
        "}",
        "",
        *(row_scales("MT") if norm else []),
        "// epilogue: accumulator element e of tile (mi, ni) is row g (+8 for e >= 2), column 2t + (e & 1)",
        *epilogue_loops(
            ("mi", "MT"), ("ni", "NT"),
            "m0 + wm * WM + 16 * mi + (lane >> 2) + 8 * (e >> 1)", "n0 + wn * WN + 8 * ni + 2 * (lane & 3) + (e & 1)",
            epilogue, paired,
        ),
    ]  # fmt: skip
    summary = (
        f"GEMM: mma.sync m16n8k16 {dtype}, fp32 accumulators; M={layout.m} N={layout.n} K={layout.k} "
        f"batch={layout.batch_size}; tile {s.block_m}x{s.block_n}x{s.block_k}, {s.warps_m}x{s.warps_n} warps, "
        f"{s.stages} stages; "
        f"A {'[row][k]' if a.kmajor else '[k][row]'} {'cp.async' if a.fast else 'evaluated'}, "
        f"B {'[row][k]' if b.kmajor else '[k][row]'} {'cp.async' if b.fast else 'evaluated'}."
        + (" A is an absorbed RMSNorm of x: row sums of x^2 from the fragments, x * w, row scales in the epilogue."
           if norm else "")
    )
    launch = f"grid ({gx}, {gy}, {gz}), {s.threads} threads, {gemm_smem_bytes(s)} bytes of dynamic shared memory"
    helpers = _helpers(dtype, s.stages)
    if norm:
        helpers += "\n\n" + emit_norm_helpers(dtype)
    if paired:
        helpers += "\n\n" + vector_helpers([(plan.output.dtype, 2)])
    return term_source(plan, name, s.threads, body, summary, launch, helpers, constants)
