"""Shapes and dtypes: validation, NumPy-style broadcasting and promotion, view shapes.

Every rule a user can break raises :class:`GraphError` naming the op, the shapes or
dtypes involved and what would be valid.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence

from cherenkov.graph.errors import GraphError

Shape = tuple[int, ...]

FLOAT_DTYPES = ("bf16", "fp16", "fp32")
FP8_DTYPES = ("fp8_e4m3", "fp8_e5m2")
"""8-bit floats (OCP FP8: e4m3 without infinities, saturating; e5m2 with them): storage only.
A graph reads them as inputs, casts to them (quantise) and from them (dequantise); no
arithmetic op takes them."""
SCALE_DTYPES = ("e8m0",)
"""MX block scales (OCP E8M0: an 8-bit exponent, the value ``2^(e − 127)``): storage only, an
input that is cast to a float (``ck.nn.dequantize`` with ``block=32``); never a cast target."""
STORAGE_DTYPES = (*FP8_DTYPES, *SCALE_DTYPES)
DTYPES = (*FLOAT_DTYPES, *STORAGE_DTYPES, "int32", "bool")
INPUT_DTYPES = (*FLOAT_DTYPES, *STORAGE_DTYPES)
DTYPE_ALIASES = {
    "float8_e4m3fn": "fp8_e4m3",
    "float8_e5m2": "fp8_e5m2",
    "float8_e8m0fnu": "e8m0",
    "bfloat16": "bf16",
    "float16": "fp16",
    "half": "fp16",
    "float32": "fp32",
    "float": "fp32",
    "int": "int32",
}
# Largest element count a kernel with 32-bit indexing can address.
MAX_ELEMENTS = 2**31 - 1

_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
MAX_NAME_LENGTH = 64


def check_identifier(kind: str, name: object) -> str:
    """Return ``name`` if it is an identifier ``[A-Za-z_][A-Za-z0-9_]*`` of at most 64 chars."""
    if not isinstance(name, str) or not _IDENTIFIER.fullmatch(name) or len(name) > MAX_NAME_LENGTH:
        raise GraphError(
            f"{kind}: name {name!r} is not valid; names must match [A-Za-z_][A-Za-z0-9_]* "
            f"and have at most {MAX_NAME_LENGTH} characters"
        )
    return name


def normalize_dtype(op: str, dtype: object, allowed: Sequence[str] = DTYPES) -> str:
    """Canonical dtype name (``bf16``, ``fp16``, ``fp32``, ``fp8_e4m3``, ``fp8_e5m2``, ``int32``,
    ``bool``)."""
    name = str(dtype).removeprefix("torch.") if dtype is not None else ""
    name = DTYPE_ALIASES.get(name, name)
    if name not in allowed:
        raise GraphError(f"{op}: unknown dtype {dtype!r}; valid dtypes: {', '.join(allowed)}")
    return name


def check_shape(op: str, shape: object) -> Shape:
    """A tuple of positive ints (views may be larger than anything a kernel stores)."""
    try:
        dims = tuple(shape)  # type: ignore[arg-type]
    except TypeError:
        raise GraphError(f"{op}: shape {shape!r} is not a sequence of positive ints") from None
    if not all(isinstance(d, int) and not isinstance(d, bool) for d in dims):
        raise GraphError(f"{op}: shape {shape!r} must contain only ints")
    if any(d <= 0 for d in dims):
        raise GraphError(f"{op}: shape {dims} has a zero or negative dimension; every dimension must be >= 1")
    return dims


def check_stored_shape(op: str, shape: object) -> Shape:
    """A shape of a tensor kept in memory: at most ``MAX_ELEMENTS`` elements."""
    dims = check_shape(op, shape)
    if math.prod(dims) > MAX_ELEMENTS:
        raise GraphError(
            f"{op}: shape {dims} has {math.prod(dims)} elements; at most {MAX_ELEMENTS} (2^31 - 1) "
            "are supported because kernels index with 32-bit integers"
        )
    return dims


def promote(op: str, *dtypes: str) -> str:
    """Result dtype of an arithmetic op: bool < int32 < floats; mixed half types give fp32;
    8-bit floats are storage only (a GraphError says to cast them first)."""
    stored = sorted({d for d in dtypes if d in STORAGE_DTYPES})
    if stored:
        raise GraphError(f"{op}: operands of dtype {', '.join(stored)} are storage only; cast them to bf16, fp16 or "
                         "fp32 first (ck.nn.dequantize multiplies by their scale too)")  # fmt: skip
    floats = {d for d in dtypes if d in FLOAT_DTYPES}
    if len(floats) > 1:
        return "fp32"
    if floats:
        return floats.pop()
    if "int32" in dtypes:
        return "int32"
    return "bool"


def broadcast_shapes(op: str, *shapes: Shape) -> Shape:
    """NumPy broadcasting of several shapes, or a GraphError naming them all."""
    rank = max(len(s) for s in shapes)
    result = []
    for axis in range(rank):
        sizes = {s[axis - rank + len(s)] for s in shapes if axis - rank + len(s) >= 0}
        sizes.discard(1)
        if len(sizes) > 1:
            listed = ", ".join(str(s) for s in shapes)
            raise GraphError(
                f"{op}: shapes {listed} do not broadcast (axis {axis - rank} has sizes "
                f"{sorted(sizes)}); sizes must match or be 1"
            )
        result.append(sizes.pop() if sizes else 1)
    return tuple(result)


def normalize_axis(op: str, axis: object, rank: int, shape: Shape) -> int:
    """Axis in ``[-rank, rank)`` as a non-negative int."""
    if not isinstance(axis, int) or isinstance(axis, bool) or not -rank <= axis < rank:
        valid = f"{-rank}..{rank - 1}" if rank else "none (the tensor is a scalar)"
        raise GraphError(f"{op}: axis {axis!r} is out of range for shape {shape}; valid axes: {valid}")
    return axis % rank


def permute_shape(op: str, shape: Shape, perm: Sequence[int]) -> tuple[Shape, tuple[int, ...]]:
    """Shape after a permutation (validated; negative axes allowed)."""
    rank = len(shape)
    axes = tuple(normalize_axis(op, a, rank, shape) for a in perm)
    if sorted(axes) != list(range(rank)):
        raise GraphError(f"{op}: {tuple(perm)} is not a permutation of the {rank} axes of shape {shape}")
    return tuple(shape[a] for a in axes), axes


def expand_shape(op: str, shape: Shape, target: Shape) -> Shape:
    """Broadcast ``shape`` to ``target`` (new leading axes, or size-1 axes stretched)."""
    if len(target) < len(shape):
        raise GraphError(f"{op}: cannot expand shape {shape} to {target}, which has fewer axes")
    lead = len(target) - len(shape)
    for i, size in enumerate(shape):
        if size != 1 and size != target[lead + i]:
            raise GraphError(
                f"{op}: cannot expand shape {shape} to {target}: axis {i} has size {size}; "
                "only size-1 axes can be expanded"
            )
    return target


def reshape_shape(op: str, shape: Shape, target: Sequence[int]) -> Shape:
    """Resolve one ``-1`` in ``target`` and check the element count is unchanged."""
    target = tuple(target)
    if not all(isinstance(d, int) and not isinstance(d, bool) for d in target):
        raise GraphError(f"{op}: new shape {target} must contain only ints")
    count = math.prod(shape)
    if target.count(-1) > 1:
        raise GraphError(f"{op}: new shape {target} has more than one -1")
    if -1 in target:
        known = math.prod(d for d in target if d != -1)
        if known <= 0 or count % known:
            raise GraphError(f"{op}: cannot reshape {shape} ({count} elements) to {target}")
        target = tuple(count // known if d == -1 else d for d in target)
    target = check_shape(op, target)
    if math.prod(target) != count:
        raise GraphError(
            f"{op}: cannot reshape {shape} ({count} elements) to {target} ({math.prod(target)} elements); "
            "the element count must stay the same"
        )
    return target


def slice_shape(op: str, shape: Shape, starts: Sequence[int], stops: Sequence[int]) -> Shape:
    """Shape of ``x[starts[0]:stops[0], ...]`` with 0 <= start < stop <= size on every axis."""
    if len(starts) != len(shape) or len(stops) != len(shape):
        raise GraphError(f"{op}: needs one start and one stop per axis of shape {shape}")
    for axis, (lo, hi, size) in enumerate(zip(starts, stops, shape)):
        if not 0 <= lo < hi <= size:
            raise GraphError(
                f"{op}: axis {axis} range [{lo}, {hi}) is empty or outside [0, {size}) for shape {shape}"
            )
    return tuple(hi - lo for lo, hi in zip(starts, stops))


def pad_shape(op: str, shape: Shape, pads: Sequence[tuple[int, int]]) -> Shape:
    """Shape after padding ``(before, after)`` elements on each axis."""
    if len(pads) != len(shape) or any(len(p) != 2 for p in pads):
        raise GraphError(f"{op}: needs one (before, after) pair per axis of shape {shape}, got {pads}")
    if any(not isinstance(v, int) or v < 0 for p in pads for v in p):
        raise GraphError(f"{op}: pad amounts {pads} must be non-negative ints")
    return tuple(size + lo + hi for size, (lo, hi) in zip(shape, pads))
