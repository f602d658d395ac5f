"""Index-notation terms to CUDA C++ expressions: fp32 arithmetic with reference.py's semantics.

:class:`TermEmitter` turns a term (``cherenkov.rewrites.terms``) evaluated at one point of
its free axes into CUDA statements and a C expression of type ``float``. Every constructor
of the ``Expr`` sort of ``cherenkov.rewrites.language`` is covered, with exactly the
semantics of ``cherenkov.rewrites.reference`` (float64 there, fp32 here):

* elementwise constructors map to IEEE functions (``exp2f``, ``expf``, ``log2f``, ``sinf``,
  ``sqrtf``, ``__frcp_rn``; a fast-math emitter uses approximations of ``Exp`` and
  ``Recip`` for values rounded to 16 bits afterwards);
  ``Mod`` is a floor modulo (sign of the divisor, like
  ``np.mod``); ``Maximum`` propagates NaN (like ``np.maximum``); ``Lt`` and ``Flag`` are
  ``1.0f`` / ``0.0f`` and ``Where`` selects on ``!= 0`` (a select, never a blend, so
  ``-inf`` in the unselected branch is harmless); ``Cast`` rounds to bf16 / fp16 / fp32 /
  the 8-bit floats (nearest even; e4m3 saturating) or truncates to int32 like ``round_to_dtype``;
* a ``Tensor`` read clamps each index into the tensor's extent where interval analysis
  cannot prove it in range (the reference clips), and converts the element to fp32;
* binders (``Sum``, ``Max``, ``Contract``, the softmax folds, ``OnlineSoftmaxContract``,
  ``FlashAttention``) become serial loops over their axis; the row forms (``SoftmaxRow``,
  ``RmsNormRow``, ``LayerNormRow``) compute their row statistics in one loop (online max
  and sum; Welford for the mean and variance) and then the element at the current index.

Statements are placed by *depth*: the emitter keeps a stack of open code blocks (the
kernel body, loops the caller or the emitter opened) and each subterm is emitted into the
innermost block that binds one of its free axes, so loop-invariant work is hoisted out of
loops automatically. Subterms are computed once per block (memoised by the C variables
their free axes are bound to). Kernel families override subterms with their own values
(``overrides``): the mma GEMM's accumulator for a ``Contract``, a row kernel's statistics.

Only validated identifiers reach the source: tensor names pass
:func:`~cherenkov.codegen.cuda.text.identifier` and become parameters ``t_<name>``; every
generated local is ``v<n>``, ``k<n>`` or ``s<n>``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np

from cherenkov.codegen.cuda.text import block, identifier
from cherenkov.codegen.errors import CodegenError
from cherenkov.rewrites import terms as t
from cherenkov.rewrites.terms import Term

INDEX_HEADS = frozenset({"Ax", "IxLit", "IxAdd", "IxDiv", "IxMod", "IxLin"})
INT32_LIMIT = 2**31 - 1

# C element type of a stored tensor of each dtype, and its size in bytes
C_TYPES = {"bf16": "unsigned short", "fp16": "unsigned short", "fp32": "float", "int32": "int", "bool": "unsigned char",
           "fp8_e4m3": "unsigned char", "fp8_e5m2": "unsigned char", "e8m0": "unsigned char"}  # fmt: skip
DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4, "int32": 4, "bool": 1, "fp8_e4m3": 1, "fp8_e5m2": 1, "e8m0": 1}
UNARY_FUNCTIONS = {
    "Exp2": "exp2f",
    "Exp": "expf",
    "Log2": "log2f",
    "Sin": "sinf",
    "Sqrt": "sqrtf",
    "Recip": "__frcp_rn",
}
# Approximations (the special-function unit's 2^x and 1/x, a few ulp of fp32) a fast-math
# emitter uses instead: for kernels whose output is rounded to 16 bits, where a few fp32 ulp
# vanish in the rounding (GEMM epilogues: bias + GELU costs a third of the GEMM otherwise).
FAST_UNARY_FUNCTIONS = {**UNARY_FUNCTIONS, "Exp": "ck_exp_fast", "Recip": "ck_rcp_fast"}


@dataclass(frozen=True)
class TensorInfo:
    """A stored tensor a kernel reads or writes: row-major contiguous, of ``shape`` and ``dtype``."""

    name: str
    shape: tuple[int, ...]
    dtype: str

    def __post_init__(self) -> None:
        identifier(self.name)
        if self.dtype not in C_TYPES:
            raise CodegenError(f"tensor {self.name}: dtype {self.dtype!r} has no CUDA type (valid: {sorted(C_TYPES)})")

    @property
    def param(self) -> str:
        """The kernel parameter holding this tensor's device pointer (prefixed: user names
        such as ``int`` or ``float`` never collide with CUDA keywords or our locals)."""
        return f"t_{identifier(self.name)}"

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def strides(self) -> tuple[int, ...]:
        strides, running = [], 1
        for size in reversed(self.shape):
            strides.append(running)
            running *= size
        return tuple(reversed(strides))

    @property
    def c_type(self) -> str:
        return C_TYPES[self.dtype]


@dataclass(frozen=True)
class Binding:
    """An axis bound to a C integer expression at a block depth, with its value range."""

    expr: str
    depth: int
    lo: int
    hi: int


Env = Mapping[str, Binding]


def axis_binding(axis: str, expr: str, depth: int) -> Binding:
    """The usual binding of an axis: values ``0 .. extent - 1``."""
    return Binding(expr, depth, 0, t.extent(axis) - 1)


def float_constant(value: float) -> str:
    """An fp32 literal for a term's float64 constant (rounded to fp32 first; ±inf kept)."""
    single = float(np.float32(value)) if math.isfinite(value) and abs(value) < 3.5e38 else value
    if math.isnan(single):
        raise CodegenError("NaN constant in a term")
    if math.isinf(single) or abs(value) >= 3.5e38:
        return "CK_INF" if value > 0 else "(-CK_INF)"
    if single == 0.0:
        return "0.0f" if math.copysign(1.0, single) > 0 else "(-0.0f)"
    text = f"{single:.9e}f"
    return f"({text})" if single < 0 else text


def emit_prelude() -> str:
    """Types, constants and device helpers every term kernel uses (no headers needed: the
    conversions are PTX ``cvt`` instructions, so NVRTC compiles it as nvcc does)."""
    return block("""
        typedef unsigned int u32;
        typedef unsigned short u16;
        #define CK_INF __int_as_float(0x7f800000)

        // Stored element -> fp32.
        __device__ __forceinline__ float ck_from_bf16(u16 bits) { return __uint_as_float(u32(bits) << 16); }
        __device__ __forceinline__ float ck_from_fp16(u16 bits) {
            float r;
            asm("cvt.f32.f16 %0, %1;" : "=f"(r) : "h"(bits));
            return r;
        }
        __device__ __forceinline__ float ck_from_fp32(float x) { return x; }
        __device__ __forceinline__ float ck_from_int32(int x) { return float(x); }
        __device__ __forceinline__ float ck_from_bool(unsigned char x) { return x ? 1.0f : 0.0f; }

        // Fast-math e^x and 1/x (a few ulp of fp32, for values rounded to 16 bits afterwards): one
        // 2^x and one approximate reciprocal on the special-function unit; e^(-inf) = 0, 1/inf = 0.
        __device__ __forceinline__ float ck_exp_fast(float x) { return exp2f(x * 1.442695041f); }
        __device__ __forceinline__ float ck_rcp_fast(float x) { return __fdividef(1.0f, x); }

        // fp32 -> stored element (round to nearest even; int32 truncates; bool is x != 0).
        __device__ __forceinline__ u16 ck_to_bf16(float x) {
            u16 r;
            asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r) : "f"(x));
            return r;
        }
        __device__ __forceinline__ u16 ck_to_fp16(float x) {
            u16 r;
            asm("cvt.rn.f16.f32 %0, %1;" : "=h"(r) : "f"(x));
            return r;
        }
        __device__ __forceinline__ float ck_to_fp32(float x) { return x; }
        __device__ __forceinline__ int ck_to_int32(float x) { return int(truncf(x)); }
        __device__ __forceinline__ unsigned char ck_to_bool(float x) { return x != 0.0f ? 1 : 0; }

        // 8-bit floats (OCP FP8) in software, any target: (bits, mantissa, exponent bias).
        // e4m3 has no infinities (S.1111.111 is NaN) and saturates at +-448; e5m2 is IEEE-like.
        __device__ __forceinline__ float ck_from_fp8(unsigned char b, int mbits, int bias, bool ieee) {
            const int e = (b & 0x7f) >> mbits, m = b & ((1 << mbits) - 1), top = (1 << (7 - mbits)) - 1;
            float v;
            if (ieee && e == top) v = m ? __int_as_float(0x7fc00000) : CK_INF;
            else if (!ieee && e == top && m == (1 << mbits) - 1) v = __int_as_float(0x7fc00000);
            else if (e == 0) v = ldexpf(float(m), 1 - bias - mbits);
            else v = ldexpf(float((1 << mbits) + m), e - bias - mbits);
            return (b & 0x80) ? -v : v;
        }
        __device__ __forceinline__ unsigned char ck_to_fp8(float x, int mbits, int bias, float largest, bool ieee) {
            const unsigned char sign = (__float_as_uint(x) >> 31) ? 0x80 : 0;
            const float a = fabsf(x);
            if (a != a) return sign | 0x7f;
            if (!ieee && a >= largest) return sign | (0x7f - 1);  // saturate, infinities too
            if (ieee && a == CK_INF) return sign | (0x7f - ((1 << mbits) - 1));
            int e;
            frexpf(a, &e);  // a = f * 2^e, f in [0.5, 1)
            const int exponent = e - 1 > 1 - bias ? e - 1 : 1 - bias;  // subnormals: the smallest normal quantum
            const float quantum = ldexpf(1.0f, exponent - mbits);
            const float r = rintf(a / quantum) * quantum;  // nearest, ties to even
            if (r > largest) return ieee ? sign | (0x7f - ((1 << mbits) - 1)) : sign | (0x7f - 1);
            if (r < ldexpf(1.0f, 1 - bias)) return sign | (unsigned char)(r / ldexpf(1.0f, 1 - bias - mbits));
            frexpf(r, &e);
            const int m = int(ldexpf(r, mbits - (e - 1))) - (1 << mbits);
            return sign | (unsigned char)(((e - 1 + bias) << mbits) | m);
        }
        __device__ __forceinline__ float ck_from_fp8_e4m3(unsigned char b) { return ck_from_fp8(b, 3, 7, false); }
        __device__ __forceinline__ float ck_from_fp8_e5m2(unsigned char b) { return ck_from_fp8(b, 2, 15, true); }
        // an MX scale (E8M0): 2^(b - 127); 0 is 2^-127 (a subnormal float), 255 NaN
        __device__ __forceinline__ float ck_from_e8m0(unsigned char b) {
            return b == 255 ? __uint_as_float(0x7fc00000u) : b ? __uint_as_float(u32(b) << 23) : __uint_as_float(0x00400000u);
        }
        __device__ __forceinline__ unsigned char ck_to_fp8_e4m3(float x) { return ck_to_fp8(x, 3, 7, 448.0f, false); }
        __device__ __forceinline__ unsigned char ck_to_fp8_e5m2(float x) { return ck_to_fp8(x, 2, 15, 57344.0f, true); }

        // Cast: round an fp32 value to a dtype and back.
        __device__ __forceinline__ float ck_round_bf16(float x) { return ck_from_bf16(ck_to_bf16(x)); }
        __device__ __forceinline__ float ck_round_fp16(float x) { return ck_from_fp16(ck_to_fp16(x)); }
        __device__ __forceinline__ float ck_round_fp8_e4m3(float x) { return ck_from_fp8_e4m3(ck_to_fp8_e4m3(x)); }
        __device__ __forceinline__ float ck_round_fp8_e5m2(float x) { return ck_from_fp8_e5m2(ck_to_fp8_e5m2(x)); }

        // np.maximum: NaN in either operand gives NaN (fmaxf would drop it).
        __device__ __forceinline__ float ck_max(float a, float b) {
            return (a != a || b != b) ? a + b : fmaxf(a, b);
        }

        // np.mod: floor modulo, the result takes the divisor's sign.
        __device__ __forceinline__ float ck_mod(float a, float b) {
            float r = fmodf(a, b);
            if (r != 0.0f && ((r < 0.0f) != (b < 0.0f))) r += b;
            return r;
        }

        // Index arithmetic of possibly negative indices: floor division and modulo.
        __device__ __forceinline__ long long ck_floordiv(long long a, long long b) {
            long long q = a / b;
            return (a % b != 0 && ((a < 0) != (b < 0))) ? q - 1 : q;
        }
        __device__ __forceinline__ long long ck_floormod(long long a, long long b) {
            long long r = a % b;
            return (r != 0 && ((r < 0) != (b < 0))) ? r + b : r;
        }
        __device__ __forceinline__ long long ck_clamp(long long x, long long lo, long long hi) {
            return x < lo ? lo : (x > hi ? hi : x);
        }

        // Online softmax state (m, l) += one score x: m = max, l = sum of exp(x - m); a row
        // whose max is -inf has l = 0 (reference.softmax_fold's live mask).
        __device__ __forceinline__ float ck_live_exp(float d, float m) { return m == -CK_INF ? 0.0f : expf(d); }
        __device__ __forceinline__ void ck_softmax_add(float& m, float& l, float x) {
            const float m_new = ck_max(m, x);
            l = l * ck_live_exp(m - m_new, m_new) + ck_live_exp(x - m_new, m_new);
            m = m_new;
        }
        __device__ __forceinline__ void ck_softmax_merge(float& m, float& l, float m2, float l2) {
            const float m_new = ck_max(m, m2);
            l = l * ck_live_exp(m - m_new, m_new) + l2 * ck_live_exp(m2 - m_new, m_new);
            m = m_new;
        }
        // The same with an accumulator acc = sum of exp(x - m) * v.
        __device__ __forceinline__ void ck_softmax_acc_add(float& m, float& l, float& acc, float x, float v) {
            const float m_new = ck_max(m, x);
            const float rescale = ck_live_exp(m - m_new, m_new);
            const float p = ck_live_exp(x - m_new, m_new);
            l = l * rescale + p;
            acc = acc * rescale + p * v;
            m = m_new;
        }
        __device__ __forceinline__ void ck_softmax_acc_merge(float& m, float& l, float& acc, float m2, float l2, float acc2) {
            const float m_new = ck_max(m, m2);
            const float r1 = ck_live_exp(m - m_new, m_new);
            const float r2 = ck_live_exp(m2 - m_new, m_new);
            l = l * r1 + l2 * r2;
            acc = acc * r1 + acc2 * r2;
            m = m_new;
        }

        // Welford: (count, mean, m2) += x, and Chan et al.'s merge of two partial states.
        __device__ __forceinline__ void ck_welford_add(float& n, float& mean, float& m2, float x) {
            n += 1.0f;
            const float delta = x - mean;
            mean += __fdividef(delta, n);  // 2 ulp, without the full-precision division's cost
            m2 += delta * (x - mean);
        }
        __device__ __forceinline__ void ck_welford_merge(float& n, float& mean, float& m2, float n2, float mean2, float m22) {
            const float total = n + n2;
            if (total == 0.0f) return;
            const float delta = mean2 - mean;
            const float w = n2 / total;
            mean += delta * w;
            m2 += m22 + delta * delta * n * w;
            n = total;
        }
        """)


class _Block:
    """One open code block: its statements and the subterms computed in it."""

    def __init__(self, indent: int) -> None:
        self.lines: list[str] = []
        self.memo: dict[tuple, str] = {}
        self.indent = indent


class TermEmitter:
    """Emits fp32 CUDA code for terms; see the module docstring.

    ``tensors`` maps every tensor name a term reads to its :class:`TensorInfo`;
    ``index_type`` is the C type of element offsets (``int``, or ``long long`` when a
    tensor has 2³¹ elements or more); ``fast_math``: ``Exp`` and ``Recip`` use the
    approximations of ``FAST_UNARY_FUNCTIONS`` (for values rounded to 16 bits afterwards;
    fp32 results keep the IEEE functions).
    """

    def __init__(self, tensors: Mapping[str, TensorInfo], index_type: str = "int", fast_math: bool = False) -> None:
        self.tensors = dict(tensors)
        self.index_type = index_type
        self.unary_functions = FAST_UNARY_FUNCTIONS if fast_math else UNARY_FUNCTIONS
        self.blocks: list[_Block] = []
        self.overrides: dict[Term, Callable[[Env], str]] = {}
        self._counter = 0
        self._free: dict[Term, frozenset[str]] = {}

    # ------------------------------------------------------------------ blocks

    @property
    def depth(self) -> int:
        """Depth of the innermost open block."""
        return len(self.blocks) - 1

    def push(self) -> int:
        """Open a block (the body of a loop); returns its depth."""
        self.blocks.append(_Block(len(self.blocks)))
        return self.depth

    def pop(self) -> list[str]:
        """Close the innermost block; returns its statements."""
        return self.blocks.pop().lines

    def line(self, depth: int, text: str) -> None:
        self.blocks[depth].lines.append(text)

    def fresh(self, prefix: str = "v") -> str:
        self._counter += 1
        return f"{prefix}{self._counter}"

    def free_axes(self, term: Term) -> frozenset[str]:
        return t.free_axes(term, self._free)

    def depth_of(self, term: Term, env: Env) -> int:
        """The innermost depth binding one of ``term``'s free axes (0 when it has none)."""
        depths = [0]
        for axis in self.free_axes(term):
            if axis not in env:
                raise CodegenError(f"axis {axis} of {t.show(term)[:200]} is not bound")
            depths.append(env[axis].depth)
        return max(depths)

    def _key(self, term: Term, env: Env) -> tuple:
        return (term, tuple((a, env[a].expr) for a in sorted(self.free_axes(term))))

    def _lookup(self, key: tuple) -> str | None:
        for b in reversed(self.blocks):
            if key in b.memo:
                return b.memo[key]
        return None

    def _define(self, term: Term, env: Env, expr: str) -> str:
        """``const float vN = expr;`` at the term's depth, memoised there."""
        depth = self.depth_of(term, env)
        name = self.fresh()
        self.line(depth, f"const float {name} = {expr};")
        self.blocks[depth].memo[self._key(term, env)] = name
        return name

    # ------------------------------------------------------------------ indices

    def interval(self, ix: Term, env: Env) -> tuple[int, int]:
        """The range of values an index term takes."""
        head = ix[0]
        if head == "Ax":
            return env[ix[1]].lo, env[ix[1]].hi
        if head == "IxLit":
            return ix[1], ix[1]
        if head == "IxAdd":
            lo, hi = self.interval(ix[1], env)
            return lo + ix[2], hi + ix[2]
        if head == "IxDiv":
            lo, hi = self.interval(ix[1], env)
            return lo // ix[2], hi // ix[2]
        if head == "IxMod":
            lo, hi = self.interval(ix[1], env)
            if lo >= 0 and hi < ix[2]:
                return lo, hi
            return 0, ix[2] - 1
        if head == "IxLin":
            (olo, ohi), (ilo, ihi) = self.interval(ix[1], env), self.interval(ix[3], env)
            return olo * ix[2] + ilo, ohi * ix[2] + ihi
        raise CodegenError(f"not an index term: {ix}")

    def index(self, ix: Term, env: Env) -> str:
        """A C integer expression for an index term (floor semantics where it can be negative)."""
        head = ix[0]
        if head == "Ax":
            if ix[1] not in env:
                raise CodegenError(f"axis {ix[1]} is not bound")
            return env[ix[1]].expr
        if head == "IxLit":
            return str(ix[1])
        inner = self.index(ix[1], env)
        if head == "IxAdd":
            return f"({inner} + {ix[2]})" if ix[2] >= 0 else f"({inner} - {-ix[2]})"
        negative = self.interval(ix[1], env)[0] < 0
        if head == "IxDiv":
            return f"int(ck_floordiv({inner}, {ix[2]}))" if negative else f"({inner} / {ix[2]})"
        if head == "IxMod":
            return f"int(ck_floormod({inner}, {ix[2]}))" if negative else f"({inner} % {ix[2]})"
        if head == "IxLin":
            return f"({inner} * {ix[2]} + {self.index(ix[3], env)})"
        raise CodegenError(f"not an index term: {ix}")

    def offset(self, read: Term, env: Env, vector: int = 1) -> str:
        """The element offset of a ``Tensor`` read in its row-major buffer; indices are
        clamped into the tensor's extents where they might leave them (as the reference clips);
        ``vector``: the offset starts an access of that many elements, so the innermost index
        stays ``vector`` short of the end."""
        name, items = read[1], t.ix_items(read[2])
        info = self.tensors.get(name)
        if info is None:
            raise CodegenError(f"tensor {name!r} is read but not among the kernel's tensors")
        if len(items) != len(info.shape):
            raise CodegenError(f"{name} has {len(info.shape)} axes but is indexed with {len(items)}")
        parts = []
        for position, (ix, size, stride) in enumerate(zip(items, info.shape, info.strides)):
            if size == 1:
                continue
            expr = self.index(ix, env)
            lo, hi = self.interval(ix, env)
            last = size - (vector if position == len(items) - 1 else 1)
            if lo < 0 or hi > last:
                expr = f"int(ck_clamp({expr}, 0, {last}))"
            if self.index_type != "int":
                expr = f"({self.index_type})({expr})"
            parts.append(expr if stride == 1 else f"{expr} * {stride}")
        return " + ".join(parts) if parts else "0"

    def load(self, read: Term, env: Env) -> str:
        """The fp32 C expression of one element read."""
        info = self.tensors[read[1]]
        return f"ck_from_{info.dtype}({info.param}[{self.offset(read, env)}])"

    # ------------------------------------------------------------------ values

    def value(self, term: Term, env: Env) -> str:
        """A C expression (a literal or a ``const float`` variable) for ``term`` at ``env``."""
        head = term[0]
        if head == "Num":
            return float_constant(term[1])
        if head == "Flag":
            return "1.0f" if term[1] else "0.0f"
        if head == "Scheduled":
            return self.value(term[1], env)
        if head == "Shifted" and term not in self.overrides:  # the body one step on (a GEMM overrides it)
            return self.value(t.shifted(term[3], term[1], term[2]), env)
        key = self._key(term, env)
        known = self._lookup(key)
        if known is not None:
            return known
        if term in self.overrides:
            return self._define(term, env, self.overrides[term](env))
        return self._emit(term, env)

    def _emit(self, term: Term, env: Env) -> str:
        head, args = term[0], term[1:]
        v = self.value
        if head == "Tensor":
            return self._define(term, env, self.load(term, env))
        if head == "Iota":
            return self._define(term, env, f"float({self.index(args[0], env)})")
        if head == "Cast":
            x = v(args[1], env)
            dtype = args[0]
            expr = {
                "bf16": f"ck_round_bf16({x})", "fp16": f"ck_round_fp16({x})", "fp32": x,
                "fp8_e4m3": f"ck_round_fp8_e4m3({x})", "fp8_e5m2": f"ck_round_fp8_e5m2({x})",
                "int32": f"truncf({x})", "bool": f"({x} != 0.0f ? 1.0f : 0.0f)",
            }.get(dtype)  # fmt: skip
            if expr is None:
                raise CodegenError(f"Cast to unknown dtype {dtype!r}")
            return self._define(term, env, expr)
        if head in self.unary_functions:
            return self._define(term, env, f"{self.unary_functions[head]}({v(args[0], env)})")
        if head == "Neg":
            return self._define(term, env, f"-{v(args[0], env)}")
        if head in ("Add", "Mul", "Mod", "Lt", "Maximum"):
            a, b = v(args[0], env), v(args[1], env)
            expr = {
                "Add": f"{a} + {b}", "Mul": f"{a} * {b}", "Mod": f"ck_mod({a}, {b})",
                "Lt": f"({a} < {b}) ? 1.0f : 0.0f", "Maximum": f"ck_max({a}, {b})",
            }[head]  # fmt: skip
            return self._define(term, env, expr)
        if head == "Where":
            c, a, b = (v(x, env) for x in args)
            return self._define(term, env, f"({c} != 0.0f) ? {a} : {b}")
        if head == "PadAxis":
            ix, lo, size, fill, body = args
            position = self.index(ix, env)
            inside = v(body, env)
            return self._define(
                term, env, f"({position} >= {lo} && {position} < {lo + size}) ? {inside} : {float_constant(fill)}"
            )
        if head in ("Sum", "Max", "Contract"):
            return self._reduce(term, env)
        if head in ("SoftmaxFoldL", "SoftmaxFoldAcc", "OnlineSoftmaxContract"):
            return self._fold(term, env)
        if head in ("SoftmaxRow", "RmsNormRow", "LayerNormRow"):
            return self._row(term, env)
        if head == "FlashAttention":
            return self._flash(term, env)
        raise CodegenError(f"no CUDA semantics for term constructor {head}")

    # ------------------------------------------------------------------ loops

    def loop(self, axis: str, env: Env) -> tuple[dict[str, Binding], str, int]:
        """Open a loop block over ``axis``: the inner environment, the loop variable, its depth."""
        var = self.fresh("k")
        depth = self.push()
        return {**env, axis: axis_binding(axis, var, depth)}, var, depth

    def close_loop(self, depth: int, var: str, extent: int, header: str = "") -> None:
        """Close the loop block opened by :meth:`loop` and place the loop at ``depth``."""
        body = self.pop()
        comment = f"  // {header}" if header else ""
        self.line(depth, f"for (int {var} = 0; {var} < {extent}; ++{var}) {{{comment}")
        self.blocks[depth].lines.extend("    " + b for b in body)
        self.line(depth, "}")

    def _reduce(self, term: Term, env: Env) -> str:
        head, axis, extent = term[0], term[1], term[2]
        depth = self.depth_of(term, env)
        acc = self.fresh("s")
        self.line(depth, f"float {acc} = {'-CK_INF' if head == 'Max' else '0.0f'};")
        inner, var, _ = self.loop(axis, env)
        if head == "Contract":
            a, b = self.value(term[3], inner), self.value(term[4], inner)
            self.line(self.depth, f"{acc} += {a} * {b};")
        elif head == "Sum":
            self.line(self.depth, f"{acc} += {self.value(term[3], inner)};")
        else:
            self.line(self.depth, f"{acc} = ck_max({acc}, {self.value(term[3], inner)});")
        self.close_loop(depth, var, extent, f"{head.lower()} over {_safe_axis(axis)}")
        self.blocks[depth].memo[self._key(term, env)] = acc
        return acc

    def _fold(self, term: Term, env: Env) -> str:
        head, axis, extent = term[0], term[1], term[2]
        depth = self.depth_of(term, env)
        m, l, acc = self.fresh("s"), self.fresh("s"), self.fresh("s")
        self.line(depth, f"float {m} = -CK_INF, {l} = 0.0f, {acc} = 0.0f;")
        inner, var, _ = self.loop(axis, env)
        score = self.value(term[3], inner)
        if head == "SoftmaxFoldL":
            self.line(self.depth, f"ck_softmax_add({m}, {l}, {score});")
        else:
            self.line(self.depth, f"ck_softmax_acc_add({m}, {l}, {acc}, {score}, {self.value(term[4], inner)});")
        self.close_loop(depth, var, extent, f"online softmax over {_safe_axis(axis)}")
        result = {"SoftmaxFoldL": l, "SoftmaxFoldAcc": acc}.get(head)
        if result is None:
            result = self.fresh()
            self.line(depth, _normalised(result, acc, l))
        self.blocks[depth].memo[self._key(term, env)] = result
        return result

    def row_statistics(self, core: Term, env: Env) -> tuple[str, ...]:
        """The statistics of a row form over its row axis, computed serially once per row:
        softmax ``(m, l)``, RMSNorm ``(1 / sqrt(mean(x²) + eps),)``, LayerNorm ``(mean,
        1 / sqrt(var + eps))``. ``env`` need not bind the row axis."""
        head, axis, extent, body = core[0], core[1], core[2], core[3]
        key = (("RowStats", core), tuple((a, env[a].expr) for a in sorted(self.free_axes(core) - {axis})))
        known = self._lookup(key)
        if known is not None:
            return tuple(known.split(","))
        outer = {a: b for a, b in env.items() if a != axis}
        depth = max([0] + [outer[a].depth for a in self.free_axes(core) - {axis}])
        inner, var, _ = self.loop(axis, outer)
        x = self.value(body, inner)
        if head == "SoftmaxRow":
            m, l = self.fresh("s"), self.fresh("s")
            self.line(depth, f"float {m} = -CK_INF, {l} = 0.0f;")
            self.line(self.depth, f"ck_softmax_add({m}, {l}, {x});")
            self.close_loop(depth, var, extent, f"softmax statistics over {_safe_axis(axis)}")
            stats: tuple[str, ...] = (m, l)
        elif head == "RmsNormRow":
            ss = self.fresh("s")
            self.line(depth, f"float {ss} = 0.0f;")
            self.line(self.depth, f"{ss} += {x} * {x};")
            self.close_loop(depth, var, extent, f"sum of squares over {_safe_axis(axis)}")
            scale = self.fresh()
            self.line(
                depth, f"const float {scale} = 1.0f / sqrtf({ss} / {float(extent)!r}f + {float_constant(core[4])});"
            )
            stats = (scale,)
        else:
            n, mean, m2 = self.fresh("s"), self.fresh("s"), self.fresh("s")
            self.line(depth, f"float {n} = 0.0f, {mean} = 0.0f, {m2} = 0.0f;")
            self.line(self.depth, f"ck_welford_add({n}, {mean}, {m2}, {x});")
            self.close_loop(depth, var, extent, f"Welford mean and variance over {_safe_axis(axis)}")
            scale = self.fresh()
            self.line(depth, f"const float {scale} = 1.0f / sqrtf({m2} / {n} + {float_constant(core[4])});")
            stats = (mean, scale)
        self.blocks[depth].memo[key] = ",".join(stats)
        return stats

    def row_element(self, core: Term, env: Env, stats: tuple[str, ...]) -> str:
        """The row form's value at ``env`` (which binds the row axis) given its statistics."""
        x = self.value(core[3], env)
        if core[0] == "SoftmaxRow":
            m, l = stats
            return f"expf({x} - {m}) / {l}"
        if core[0] == "RmsNormRow":
            return f"{x} * {stats[0]}"
        mean, scale = stats
        return f"({x} - {mean}) * {scale}"

    def _row(self, term: Term, env: Env) -> str:
        stats = self.row_statistics(term, env)
        return self._define(term, env, self.row_element(term, env, stats))

    def _flash(self, term: Term, env: Env) -> str:
        """Flash attention, serially: for each key, the score ``scale · Σ_d q·k`` (soft-capped,
        then masked causally, or plus a bias), folded into an online softmax of ``v``; a row without a
        live score gives 0."""
        key, n_keys, dim, n_dim, q, k, v, scale, mask = term[1:]
        depth = self.depth_of(term, env)
        m, l, acc = self.fresh("s"), self.fresh("s"), self.fresh("s")
        self.line(depth, f"float {m} = -CK_INF, {l} = 0.0f, {acc} = 0.0f;")
        over_keys, key_var, _ = self.loop(key, env)
        dot = self.fresh("s")
        key_depth = self.depth
        self.line(key_depth, f"float {dot} = 0.0f;")
        over_both, dim_var, _ = self.loop(dim, over_keys)
        self.line(self.depth, f"{dot} += {self.value(q, over_both)} * {self.value(k, over_both)};")
        self.close_loop(key_depth, dim_var, n_dim, f"q . k over {_safe_axis(dim)}")
        score = self.fresh()
        cap, mask = t.soft_capped(mask)
        scaled = f"{float_constant(scale)} * {dot}"
        if cap:
            scaled = f"{float_constant(cap)} * tanhf({scaled} * {float_constant(1.0 / cap)})"
        bias, causal = t.mask_bias(mask), t.mask_causal_axis(mask)
        if bias is not None:
            scaled = f"{scaled} + {self.value(bias, over_keys)}"
        if causal is not None:
            query = self.index(causal, over_keys)
            self.line(key_depth, f"const float {score} = ({query} < {key_var}) ? -CK_INF : {scaled};")
        else:
            self.line(key_depth, f"const float {score} = {scaled};")
        self.line(key_depth, f"ck_softmax_acc_add({m}, {l}, {acc}, {score}, {self.value(v, over_keys)});")
        self.close_loop(depth, key_var, n_keys, f"keys {_safe_axis(key)}, online softmax")
        result = self.fresh()
        self.line(depth, _normalised(result, acc, l))
        self.blocks[depth].memo[self._key(term, env)] = result
        return result


def _normalised(result: str, acc: str, l: str) -> str:
    """``result = acc / l``, 0 for a row without a live score (``l = 0``): the streaming forms' safe softmax."""
    return f"const float {result} = {l} > 0.0f ? {acc} / {l} : 0.0f;  // 0 without a live score"


def _safe_axis(axis: str) -> str:
    """An axis name for a comment: its letters and digits, the extent after an ``x``."""
    return "".join(c if c.isalnum() or c == "_" else "x" for c in axis)


def reads(term: Term) -> list[Term]:
    """The distinct ``Tensor`` subterms of a term, in a deterministic order."""
    return sorted((s for s in t.subterms(term) if s[0] == "Tensor"), key=repr)


def vector_reads(term: Term, axis: str, infos: Mapping[str, TensorInfo], vector: int | None = None) -> list[Term]:
    """The reads of ``term`` that one aligned vector access can load along ``axis``: their
    innermost index is exactly that axis, over the tensor's whole innermost extent, the axis
    used nowhere else in the index, and the tensor holds floats. With ``vector`` (the
    access's width), also reads whose innermost index steps through the axis one element at
    a time from a multiple of ``vector`` (:func:`contiguous_index`: heads split off a
    projection's columns, ``h·D + d``, or RoPE's partner ``h·D + d + D/2``) in a tensor whose
    innermost extent is a multiple of ``vector``."""
    result = []
    for read in reads(term):
        info = infos[read[1]]
        items = t.ix_items(read[2])
        if not items or info.dtype not in ("bf16", "fp16", "fp32") or any(axis in t.ix_names(ix) for ix in items[:-1]):
            continue
        if items[-1] == t.ax(axis) and info.shape[-1] == t.extent(axis):
            result.append(read)
        elif vector and t.extent(axis) % vector == 0 and info.shape[-1] % vector == 0 and contiguous_index(
                items[-1], axis, vector):  # fmt: skip
            result.append(read)
    return result


def contiguous_index(ix: Term, axis: str, vector: int) -> bool:
    """Whether index ``ix`` is ``axis`` plus terms that do not vary along it and are
    multiples of ``vector`` (``vector`` consecutive values of the axis from a multiple of
    ``vector`` read ``vector`` consecutive, aligned elements)."""
    if ix == t.ax(axis):
        return True
    if ix[0] == "IxAdd":
        return ix[2] % vector == 0 and contiguous_index(ix[1], axis, vector)
    if ix[0] == "IxLin":
        return ix[2] % vector == 0 and axis not in t.ix_names(ix[1]) and contiguous_index(ix[3], axis, vector)
    return False


def index_type(tensors: Mapping[str, TensorInfo]) -> str:
    """``int`` when every tensor's offsets fit in 31 bits, else ``long long``."""
    return "int" if all(info.numel <= INT32_LIMIT for info in tensors.values()) else "long long"


def store(info: TensorInfo, offset: str, value: str) -> str:
    """The statement storing an fp32 value into a tensor element."""
    return f"{info.param}[{offset}] = ck_to_{info.dtype}({value});"
