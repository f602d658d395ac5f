"""The row kernel family: softmax / RMSNorm / LayerNorm rows and reductions over one axis.

A *row* is one value of the kernel's other axes; its lanes (one thread, the 32 lanes of a
warp, or every thread of a block) stride over the row axis and fold what they read into
one-pass statistics: online ``(max, sum of exp)`` for softmax and the softmax folds (with
an accumulator for ``SoftmaxFoldAcc`` / ``OnlineSoftmaxContract``), a sum of squares for
RMSNorm, Welford's ``(count, mean, M2)`` for LayerNorm, a sum or a max for plain
reductions. Lanes combine their states with ``__shfl_xor_sync`` butterflies; warps of a
block through shared memory (every thread then merges the warps' states in the same
order, so all hold identical statistics). The elementwise prologue is part of what the
row reads (the emitter evaluates the core's operand at each element); the epilogue is the
kernel's term around the core: row forms write every element of the row in a second pass
(re-reading the row, or — ``cached`` schedules — from the values each lane kept in
registers during the first), reductions write one element per row. A kept softmax row
takes its max first and then its exponentials (kept in place of the values) and their sum,
one exponential an element instead of the online fold's rescaling. Cached schedules with
a ``vector`` move runs of that many consecutive row elements a lane with 16-byte loads and
stores (:func:`~cherenkov.codegen.term_plan.row_vector_problems` says where they apply).

Launch: grid ``ceil(rows / rows_per_block)``, ``threads`` threads, static shared memory
only in the one-block-a-row mode.
"""

from __future__ import annotations

import math
import re

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
from cherenkov.codegen.cuda.term_expr import TermEmitter, axis_binding, float_constant, index_type, store
from cherenkov.codegen.errors import CodegenError
from cherenkov.codegen.term_plan import row_layout, row_vector_reads
from cherenkov.rewrites import terms as t

# state variables of each core, their initial values, and how states add and merge
STATES = {
    "SoftmaxRow": (("m", "-CK_INF"), ("l", "0.0f")),
    "SoftmaxFoldL": (("m", "-CK_INF"), ("l", "0.0f")),
    "SoftmaxFoldAcc": (("m", "-CK_INF"), ("l", "0.0f"), ("acc", "0.0f")),
    "OnlineSoftmaxContract": (("m", "-CK_INF"), ("l", "0.0f"), ("acc", "0.0f")),
    "RmsNormRow": (("ss", "0.0f"),),
    "LayerNormRow": (("n", "0.0f"), ("mean", "0.0f"), ("m2", "0.0f")),
    "Sum": (("s", "0.0f"),),
    "Max": (("s", "-CK_INF"),),
}


def grid(plan) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
    layout = row_layout(plan.kernel)
    rows = math.prod(int(a.rsplit(":", 1)[1]) for a in layout.outer)
    s = plan.schedule
    return (max(1, math.ceil(rows / s.rows_per_block)), 1, 1), (s.threads, 1, 1)


def _add(head: str, st: dict[str, str], values: list[str]) -> str:
    if head in ("SoftmaxRow", "SoftmaxFoldL"):
        return f"ck_softmax_add({st['m']}, {st['l']}, {values[0]});"
    if head in ("SoftmaxFoldAcc", "OnlineSoftmaxContract"):
        return f"ck_softmax_acc_add({st['m']}, {st['l']}, {st['acc']}, {values[0]}, {values[1]});"
    if head == "RmsNormRow":
        return f"{st['ss']} += {values[0]} * {values[0]};"
    if head == "LayerNormRow":
        return f"ck_welford_add({st['n']}, {st['mean']}, {st['m2']}, {values[0]});"
    if head == "Sum":
        return f"{st['s']} += {values[0]};"
    return f"{st['s']} = ck_max({st['s']}, {values[0]});"


def _merge(head: str, st: dict[str, str], other: dict[str, str]) -> str:
    if head in ("SoftmaxRow", "SoftmaxFoldL"):
        return f"ck_softmax_merge({st['m']}, {st['l']}, {other['m']}, {other['l']});"
    if head in ("SoftmaxFoldAcc", "OnlineSoftmaxContract"):
        return f"ck_softmax_acc_merge({st['m']}, {st['l']}, {st['acc']}, {other['m']}, {other['l']}, {other['acc']});"
    if head == "LayerNormRow":
        return f"ck_welford_merge({st['n']}, {st['mean']}, {st['m2']}, {other['n']}, {other['mean']}, {other['m2']});"
    if head == "Max":
        return f"{st['s']} = ck_max({st['s']}, {other['s']});"
    key = "ss" if head == "RmsNormRow" else "s"
    return f"{st[key]} += {other[key]};"


def _combine(head: str, st: dict[str, str], lanes: int, mode: str, warps: int) -> list[str]:
    """Merge the states ``st`` of a row's lanes: warp butterflies, then (one block a row) the
    warps' states through shared memory, which every thread merges in the same order."""
    lines = []
    if lanes > 1:
        other = {var: f"o_{var}" for var in st}
        lines += [
            "// combine the 32 lanes' states (butterfly: every lane ends with the warp's state)",
            "#pragma unroll",
            "for (int offset = 16; offset > 0; offset >>= 1) {",
            *(f"    const float o_{var} = __shfl_xor_sync(0xffffffffu, {st[var]}, offset);" for var in st),
            f"    {_merge(head, st, other)}",
            "}",
        ]
    if mode == "block":
        smem = {var: f"red_{st[var]}" for var in st}
        other = {var: f"{smem[var]}[w]" for var in st}
        lines += [
            "// combine the warps' states through shared memory; every thread merges them in order",
            *(f"__shared__ float {smem[var]}[{warps}];" for var in st),
            "if ((threadIdx.x & 31) == 0) {",
            *(f"    {smem[var]}[threadIdx.x >> 5] = {st[var]};" for var in st),
            "}",
            "__syncthreads();",
            *(f"{st[var]} = {smem[var]}[0];" for var in st),
            f"for (int w = 1; w < {warps}; ++w) {{",
            f"    {_merge(head, st, other)}",
            "}",
        ]
    return lines


def _cached_loop(items: int, lanes: int, n: int, statements: list[str]) -> list[str]:
    """A fully unrolled loop over this lane's ``items`` values of the row (``u``: which one,
    ``j``: its index), so that ``row_values[u]`` stays in registers."""
    guarded = items * lanes != n
    inner = indent_lines(statements, 2 if guarded else 1)
    return [
        "#pragma unroll",
        f"for (int u = 0; u < {items}; ++u) {{",
        f"    const int j = lane + u * {lanes};",
        *([f"    if (j < {n}) {{", *inner, "    }"] if guarded else inner),
        "}",
    ]


def _vector_loop(chunks: int, lanes: int, n: int, vec: int, before: list[str], statements: list[str],
                 after: list[str]) -> list[str]:  # fmt: skip
    """A fully unrolled loop over this lane's ``chunks`` runs of ``vec`` consecutive row
    elements (``j0``: a run's first index; ``u``: an element's place among the lane's kept
    values, ``j``: its index): ``before`` and ``after`` once a run (its vector loads and
    store), ``statements`` once an element."""
    guarded = chunks * lanes * vec != n
    run = [
        *before,
        "#pragma unroll",
        f"for (int e = 0; e < {vec}; ++e) {{",
        f"    const int u = c * {vec} + e;",
        *(["    const int j = j0 + e;"] if any(re.search(r"\bj\b", line) for line in statements) else []),
        *indent_lines(statements, 1),
        "}",
        *after,
    ]
    uses_start = guarded or any(re.search(r"\bj0?\b", line) for line in (*before, *statements, *after))
    return [
        "#pragma unroll",
        f"for (int c = 0; c < {chunks}; ++c) {{",
        *([f"    const int j0 = (lane + c * {lanes}) * {vec};"] if uses_start else []),
        *([f"    if (j0 < {n}) {{", *indent_lines(run, 2), "    }"] if guarded else indent_lines(run, 1)),
        "}",
    ]


def _vector_loads(em: TermEmitter, row_reads: list, env: dict, vec: int) -> tuple[list[str], list[tuple[str, int]]]:
    """One ``vec``-wide load a run for each read (at the run's first element, ``env``); the
    emitter then reads element ``e`` of the loaded array. Returns the loads and the
    (dtype, width) vector helpers they use."""
    lines, helpers = [], []
    for read in row_reads:
        info = em.tensors[read[1]]
        var = em.fresh("r")
        lines += [f"float {var}[{vec}];", f"ck_load_{info.dtype}x{vec}({info.param} + {em.offset(read, env)}, {var});"]
        em.overrides[read] = lambda _env, var=var: f"{var}[e]"
        helpers.append((info.dtype, vec))
    return lines, helpers


def row_source(plan) -> str:
    s = plan.schedule
    kernel = plan.kernel
    layout = row_layout(kernel)
    if layout is None:
        raise CodegenError(f"kernel {kernel.output} ({kernel.kind}) has no row form or reduction core")
    core, head = layout.core, layout.core[0]
    infos = tensor_infos(plan)
    itype = index_type(infos)
    em = TermEmitter(infos, itype)
    name = kernel_name(plan)
    rows = math.prod(int(a.rsplit(":", 1)[1]) for a in layout.outer)
    lanes, n, vec = s.lanes, layout.extent, s.vector
    chunks = math.ceil(n / (lanes * vec))  # runs of vec consecutive row elements a lane handles
    items = chunks * vec  # row values a lane handles
    row_reads = row_vector_reads(plan, layout) if vec > 1 else []
    run_start = {layout.axis: axis_binding(layout.axis, "j0", 1)}
    helpers: list[tuple[str, int]] = []
    (blocks, _, _), _ = grid(plan)
    warps = s.threads // 32

    body: list[str] = []
    if s.mode == "thread":
        body += [f"const {itype} row = {itype}(blockIdx.x) * {s.threads} + threadIdx.x;", "const int lane = 0;"]
    elif s.mode == "warp":
        body += [
            f"const {itype} row = {itype}(blockIdx.x) * {warps} + (threadIdx.x >> 5);",
            "const int lane = threadIdx.x & 31;",
        ]
    else:
        body += [f"const {itype} row = blockIdx.x;", "const int lane = threadIdx.x;"]
    if s.mode != "block":
        body.append(f"if (row >= {rows}) return;  // whole warps leave together")
    em.push()
    lines, env = decompose("row", layout.outer, 0, "a")
    body += lines

    # ---- pass 1: the row's statistics
    st = {var: em.fresh("st_") for var, _ in STATES[head]}
    init = [f"float {st[var]} = {value};" for var, value in STATES[head]]
    in_operand = set(t.subterms(layout.operands[0]))
    operand_reads = [r for r in row_reads if r in in_operand]
    loads, used = _vector_loads(em, operand_reads, {**env, **run_start}, vec)
    helpers += used
    em.push()
    inner = {**env, layout.axis: axis_binding(layout.axis, "j", 1)}
    values = [em.value(op, inner) for op in layout.operands]
    stats_body = em.pop()
    stats_top = em.pop()
    for read in operand_reads:
        del em.overrides[read]
    body += [*stats_top, f"// pass 1: statistics over {safe_axis(layout.axis)} ({n}), {lanes} lane(s) a row", *init]
    # A kept softmax row takes its max first, then its exponentials (kept in place of the
    # values) and their sum without rescaling — unless the epilogue reads the values too.
    outside = set(t.subterms(t.replace(kernel.term, core, ("Num", 0.0))))
    two_pass = s.cached and head == "SoftmaxRow" and layout.operands[0] not in outside

    def over_kept(statements: list[str], before: list[str]) -> list[str]:
        if vec > 1:
            return _vector_loop(chunks, lanes, n, vec, before, statements, [])
        return _cached_loop(items, lanes, n, statements)

    if s.cached:
        fold = _add("Max", {"s": st["m"]}, ["row_values[u]"]) if two_pass else _add(head, st, ["row_values[u]"])
        body += [
            f"float row_values[{items}];  // this lane's values of the row, kept in registers for pass 2",
            *over_kept([*stats_body, f"row_values[u] = {values[0]};", fold], loads),
        ]
    else:
        body += [
            "#pragma unroll 4",
            f"for (int j = lane; j < {n}; j += {lanes}) {{",
            *indent_lines(stats_body, 1),
            f"    {_add(head, st, values)}",
            "}",
        ]
    if two_pass:
        body += [
            *_combine("Max", {"s": st["m"]}, lanes, s.mode, warps),
            "// the row's exponentials against its final max (kept in place of the values) and their sum",
            *over_kept([f"row_values[u] = ck_live_exp(row_values[u] - {st['m']}, {st['m']});",
                        f"{st['l']} += row_values[u];"], []),  # fmt: skip
            *_combine("Sum", {"s": st["l"]}, lanes, s.mode, warps),
        ]
    else:
        body += _combine(head, st, lanes, s.mode, warps)
    # final statistics
    stats: tuple[str, ...]
    if head == "SoftmaxRow":
        stats = (st["m"], st["l"])
    elif head == "RmsNormRow":
        body.append(f"const float row_scale = 1.0f / sqrtf({st['ss']} / {float(n)!r}f + {float_constant(core[4])});")
        stats = ("row_scale",)
    elif head == "LayerNormRow":
        body.append(f"const float row_scale = 1.0f / sqrtf({st['m2']} / {st['n']} + {float_constant(core[4])});")
        stats = (st["mean"], "row_scale")
    else:
        result = {"Sum": "s", "Max": "s", "SoftmaxFoldL": "l", "SoftmaxFoldAcc": "acc"}.get(head)
        body.append(f"const float row_result = {st[result] if result else st['acc'] + ' / ' + st['l']};")
        stats = ("row_result",)

    # ---- pass 2: the epilogue
    em.push()
    if layout.writes_row:
        if two_pass:  # a kept softmax row holds its exponentials already
            em.overrides[core] = lambda e: f"row_values[u] / {st['l']}"
        else:
            em.overrides[core] = lambda e: em.row_element(core, e, stats)
        if s.cached:  # the core's operand at element j is this lane's kept value
            em.overrides[layout.operands[0]] = lambda e: "row_values[u]"
        again = [r for r in row_reads if r in outside and r != layout.operands[0]]  # the operand is kept
        loads, used = _vector_loads(em, again, {**env, **run_start}, vec)
        helpers += used
        em.push()
        inner = {**env, layout.axis: axis_binding(layout.axis, "j", 1)}
        value = em.value(kernel.term, inner)
        out_body = em.pop()
        out_top = em.pop()
        write = [*out_body, store(plan.output, output_offset(kernel.axes, inner, itype), value)]
        body += [
            f"// pass 2: the row's elements through the fused epilogue, {lanes} lane(s) a row"
            + (" (from the kept values)" if s.cached else ""),
            *out_top,
        ]
        if vec > 1:
            helpers.append((plan.output.dtype, vec))
            start = output_offset(kernel.axes, {**env, **run_start}, itype)
            body += _vector_loop(
                chunks, lanes, n, vec, [*loads, f"float out[{vec}];"], [*out_body, f"out[e] = {value};"],
                [f"ck_store_{plan.output.dtype}x{vec}({plan.output.param} + {start}, out);"],
            )  # fmt: skip
        elif s.cached:
            body += _cached_loop(items, lanes, n, write)
        else:
            body += ["#pragma unroll 4", f"for (int j = lane; j < {n}; j += {lanes}) {{", *indent_lines(write, 1), "}"]
    else:
        em.overrides[core] = lambda e: stats[0]
        value = em.value(kernel.term, env)
        out_top = em.pop()
        body += [
            "// the row's one output element through the fused epilogue",
            "if (lane == 0) {",
            *indent_lines(out_top, 1),
            f"    {store(plan.output, output_offset(kernel.axes, env, itype), value)}",
            "}",
        ]
    what = {"thread": "one thread", "warp": "one warp", "block": f"one block of {s.threads} threads"}[s.mode]
    second = "one element a row"
    if layout.writes_row:
        second = f"a second pass writes the row{f' from {items} values a lane kept in registers' if s.cached else ''}"
    if vec > 1:
        second += f"; each lane moves runs of {vec} consecutive elements with vector loads and stores"
    summary = (
        f"Rows: {head} over {safe_axis(layout.axis)} ({n}), {rows} rows, {what} a row; "
        f"one pass for the statistics, {second}."
    )
    launch = (
        f"grid ({blocks}), {s.threads} threads, {'static shared memory' if s.mode == 'block' else 'no shared memory'}"
    )
    return term_source(plan, name, s.threads, body, summary, launch, vector_helpers(helpers) if helpers else "")
