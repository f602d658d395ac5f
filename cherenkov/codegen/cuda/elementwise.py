"""The pointwise kernel family: one thread per output element (or per ``vector`` of them).

Thread ``i`` of the grid splits its linear output index over the kernel's axes, evaluates
the kernel's term there (:class:`~cherenkov.codegen.cuda.term_expr.TermEmitter`: binders
become serial loops, so this family runs any term — it is the fallback of reductions,
contractions and flash attention) and stores the element. The vectorised variant gives
each thread ``vector`` consecutive elements of the innermost axis: reads whose innermost
index is that axis are loaded with one vector access, the results stored with one. A
kernel whose buffer is laid out for its consumer (``FusedKernel.buffer``) stores each
element at the buffer's strides (one element a thread).

Launch: grid ``ceil(numel / (block · vector))``, ``block`` threads, no shared memory.
"""

from __future__ import annotations

import math
from dataclasses import replace

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
from cherenkov.codegen.cuda.term_expr import TermEmitter, index_type, store, vector_reads
from cherenkov.rewrites import terms as t


def grid(plan) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
    s = plan.schedule
    blocks = max(1, math.ceil(plan.output.numel / (s.block * s.vector)))
    return (blocks, 1, 1), (s.block, 1, 1)


def pointwise_source(plan) -> str:
    s = plan.schedule
    kernel = plan.kernel
    infos = tensor_infos(plan)
    itype = index_type(infos)
    em = TermEmitter(infos, itype)
    name = kernel_name(plan)
    numel = plan.output.numel
    vec = s.vector
    axes = kernel.axes
    (blocks, _, _), _ = grid(plan)

    body: list[str] = [
        f"const {itype} first = ({itype}(blockIdx.x) * {s.block} + {itype}(threadIdx.x)) * {vec};",
        f"if (first >= {numel}) return;",
    ]
    em.push()
    lines, env = decompose("first", axes, 0, "a")
    body += lines
    helpers: list[tuple[str, int]] = []
    if vec == 1:
        value = em.value(kernel.term, env)
        top = em.pop()
        offset = "first" if kernel.buffer is None else output_offset(axes, env, itype, kernel.buffer.strides)
        body += ["// the element", *top, store(plan.output, offset, value)]
    else:
        inner = axes[-1]
        base = env[inner]
        # vector loads of the reads along the innermost axis (at the vector's first element,
        # a multiple of the vector: the axis ranges over starts up to extent - vec)
        loads = []
        start = {**env, inner: replace(base, hi=t.extent(inner) - vec)}
        for read in vector_reads(kernel.term, inner, infos, vec):
            info = infos[read[1]]
            var = em.fresh("r")
            helpers.append((info.dtype, vec))
            loads.append(f"float {var}[{vec}];")
            loads.append(f"ck_load_{info.dtype}x{vec}({info.param} + {em.offset(read, start, vec)}, {var});")
            em.overrides[read] = lambda _env, var=var: f"{var}[u]"
        em.push()
        inner_env = {**env, inner: type(base)(f"{base.expr}_u", 1, 0, t.extent(inner) - 1)}
        value = em.value(kernel.term, inner_env)
        per_element = em.pop()
        top = em.pop()
        helpers.append((plan.output.dtype, vec))
        body += [
            f"// {vec} consecutive elements along {safe_axis(inner)}: vector loads, then each element",
            *loads,
            *top,
            f"float out[{vec}];",
            "#pragma unroll",
            f"for (int u = 0; u < {vec}; ++u) {{",
            f"    const int {base.expr}_u = {base.expr} + u;",
            *indent_lines(per_element, 1),
            f"    out[u] = {value};",
            "}",
            f"ck_store_{plan.output.dtype}x{vec}({plan.output.param} + first, out);",
        ]
    launch = f"grid ({blocks}), {s.block} threads, no shared memory"
    summary = (
        f"Pointwise: one thread per {vec} consecutive output element{'s' if vec > 1 else ''} "
        f"({numel} elements), binders as serial loops."
    )
    return term_source(plan, name, s.block, body, summary, launch, vector_helpers(helpers) if helpers else "")
