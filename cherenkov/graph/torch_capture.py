"""Capture a PyTorch function or module as a cherenkov graph: ``ck.from_torch``.

``from_torch(fn, *example_tensors)`` runs ``torch.export.export`` on ``fn`` (an
``nn.Module``, or a plain function wrapped in one) and lowers every ATen op of the
exported graph to primitives through the builder (``Tensor`` methods, ``ck.nn``,
``ck.where``, ``ck.arange``, ``ck.cat``). No op outside :data:`PRIMITIVES` is ever made;
an ATen op without a lowering raises :class:`GraphError` naming it, its source line and
the ops that are supported (:func:`supported_ops`).

Inputs, in order: the function's tensor arguments (named from its signature), then the
parameters, buffers and lifted constant tensors the computation reads (dotted names with
``.`` turned into ``_``: ``attn.c_attn.weight`` -> ``attn_c_attn_weight``). Every name is
made a valid identifier (``x.1`` -> ``x_1``, ``0.weight`` -> ``_0_weight``) and unique.
Input dtypes map ``bfloat16 -> bf16``, ``float16 -> fp16``, ``float32 -> fp32``; any other
dtype of a tensor the graph reads is a ``GraphError``. ``g.example_inputs()`` returns the
example arguments and the current parameter and buffer values, so
``ck.evaluate(g, g.example_inputs())`` reproduces the module's output.

Outputs are named ``out`` (one tensor) or ``out0, out1, ...`` (several, in the flattened
order of what the function returns).

**Constant-buffer specialisation.** A buffer (or lifted constant tensor, never a
parameter) whose values are *exactly* a lower-triangular band of ones and zeros at
capture time - ``torch.tril(torch.ones(T, T))`` viewed as ``(1, 1, T, T)`` in nanoGPT, or
any ``tril``/``triu`` with a diagonal offset, as float, int or bool - is not made an
input. It becomes a symbolic band ``value[..., a, b] = inside if b - a <= offset else
outside`` that follows slices, views and transposes exactly, so that
``bias[:, :, :T, :T] == 0`` lowers to the iota comparison ``q_idx + offset < k_idx``
(``ck.arange``), the same causal mask ``ck.nn.attention(causal=True)`` builds; ``ck.derive``
then finds causal flash attention. Any other use of the band materialises the same
values from iotas. ``torch.tril``/``torch.triu`` of a constant fill (``torch.ones``)
built inside ``forward`` becomes the same band. The buffer's *value* is baked into the
graph: changing the buffer after capture does not change the graph (capture again).

Semantics kept exactly (checked per node against the shapes and dtypes that
``torch.export`` records): dtype promotion is reconciled by an explicit ``cast`` wherever
the builder's dtype differs from torch's; dropout is the identity only when not training.
"""

from __future__ import annotations

import hashlib
import inspect
import math
import operator
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from cherenkov.graph import nn as cknn
from cherenkov.graph.autodiff import vjp
from cherenkov.graph import shape as sh
from cherenkov.graph.errors import GraphError
from cherenkov.graph.tensor import Graph, Tensor, cat, matmul, where

__all__ = ["from_torch", "lowers", "sanitize_name", "supported_ops"]

_NAME_CHARS = re.compile(r"[^A-Za-z0-9_]")
_THIS_FILE = "cherenkov/graph/torch_capture.py"

# ----------------------------------------------------------------------------- names


def sanitize_name(name: object, taken: set[str] | None = None) -> str:
    """``name`` as a unique identifier: every character outside ``[A-Za-z0-9_]`` becomes
    ``_``, a leading digit gets a ``_`` prefix, long names are shortened with a hash, and
    a name in ``taken`` gets a ``_2``, ``_3``, ... suffix (the result is added to ``taken``)."""
    text = _NAME_CHARS.sub("_", str(name)) or "_"
    if text[0].isdigit():
        text = "_" + text
    if len(text) > sh.MAX_NAME_LENGTH:
        digest = hashlib.sha1(str(name).encode()).hexdigest()[:8]
        text = f"{text[: sh.MAX_NAME_LENGTH - 9]}_{digest}"
    if taken is not None:
        base, n = text, 2
        while text in taken:
            suffix = f"_{n}"
            text = base[: sh.MAX_NAME_LENGTH - len(suffix)] + suffix
            n += 1
        taken.add(text)
    return sh.check_identifier("from_torch", text)


# ----------------------------------------------------------------------------- dtypes

_INPUT_DTYPES = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16", "float8_e4m3fn": "fp8_e4m3",
                 "float8_e5m2": "fp8_e5m2", "float8_e8m0fnu": "e8m0"}
_VALUE_DTYPES = {
    **_INPUT_DTYPES,
    "bool": "bool",
    "int64": "int32",
    "int32": "int32",
    "int16": "int32",
    "int8": "int32",
    "uint8": "int32",
}


def _dtype_name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


def _input_dtype(dtype: Any, what: str) -> str:
    name = _dtype_name(dtype)
    if name not in _INPUT_DTYPES:
        raise GraphError(
            f"from_torch: {what} has dtype torch.{name}; graph inputs must be torch.float32 (fp32), "
            "torch.float16 (fp16), torch.bfloat16 (bf16), torch.float8_e4m3fn (fp8_e4m3) or torch.float8_e5m2 "
            "(fp8_e5m2) - convert the tensor or module with .float(), .half() or .bfloat16() before capturing"
            + ("; a whole model that takes token ids or masks runs through torch.compile(model, "
               "backend=\"cherenkov\"), which keeps integer ops outside its regions" if not name.startswith("float") else "")
        )
    return _INPUT_DTYPES[name]


def takes_as_input(value: Any) -> bool:
    """Whether a tensor can be a captured graph's input: a dtype :func:`_input_dtype` accepts
    and no empty dimension."""
    return _dtype_name(value.dtype) in _INPUT_DTYPES and value.numel() > 0


def _value_dtype(dtype: Any, where_: str) -> str:
    name = _dtype_name(dtype)
    if name not in _VALUE_DTYPES:
        raise GraphError(
            f"from_torch: {where_} produces dtype torch.{name}; supported dtypes: float32, float16, bfloat16, float8_e4m3fn, float8_e5m2 "
            "(and bool or integer masks and indices)"
        )
    return _VALUE_DTYPES[name]


def _to_numpy(tensor: Any) -> np.ndarray:
    """An independent NumPy copy (bf16 widened to float32, exactly)."""
    import torch

    value = tensor.detach().cpu()
    if value.dtype in (torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2):
        value = value.float()
    return value.numpy().copy()


# ----------------------------------------------------------------------------- symbolic values


def _python_value(value: Any, dtype: str) -> bool | int | float:
    """``value`` as the Python number a graph constant of ``dtype`` holds (bool, int or float)."""
    return {"bool": bool, "int32": int}.get(dtype, float)(value)


@dataclass(frozen=True)
class _Band:
    """A constant mask ``value[..., a, b] = inside if lower < b - a <= offset else outside``
    (``lower`` None: no lower edge).

    What a ``tril``-of-ones buffer is (and a sliding window's, ``tril(0) − tril(−w)``: a lower
    edge ``−w``): kept symbolic so that comparisons of it lower to iota comparisons
    (``q_idx + offset < k_idx``, and ``k_idx < q_idx + lower + 1``) the e-graph reads as a
    causal mask and a window's edge.
    """

    shape: tuple[int, ...]
    offset: int
    inside: bool | int | float
    outside: bool | int | float
    dtype: str
    lower: int | None = None

    def shifted(self, shape: tuple[int, ...], by: int) -> _Band:
        """The band of ``shape`` whose edges both move by ``by`` (a slice of the rows or keys)."""
        return replace(self, shape=shape, offset=self.offset + by, lower=None if self.lower is None else self.lower + by)

    def map(self, fn: Callable[[Any], Any], dtype: str) -> _Band:
        return replace(self, inside=fn(self.inside), outside=fn(self.outside), dtype=dtype)

    def cast(self, dtype: str) -> _Band:
        return self.map(lambda v: _python_value(v, dtype), dtype)


@dataclass(frozen=True)
class _Param:
    """A parameter, buffer or constant tensor: declared as an input when first read."""

    name: str
    tensor: Any
    what: str


@dataclass(frozen=True)
class _Unsupported:
    """A result the graph cannot represent (argmax indices, dropout masks); an error if used."""

    reason: str


# ----------------------------------------------------------------------------- op table

Handler = Callable[["_Capture", dict[str, Any]], Any]
_HANDLERS: dict[str, Handler] = {}
_NO_OPS = frozenset(
    {
        "_assert_tensor_metadata",
        "_assert_scalar",
        "_assert_async",
        "sym_constrain_range",
        "sym_constrain_range_for_size",
        "_functional_sym_constrain_range",
        "_functional_sym_constrain_range_for_size",
    }
)


def _op(*names: str) -> Callable[[Handler], Handler]:
    """Register a lowering for ATen ops (``"add"`` for every overload, ``"pow.Scalar"`` for one)."""

    def register(fn: Handler) -> Handler:
        for name in names:
            _HANDLERS[name] = fn
        return fn

    return register


def supported_ops() -> list[str]:
    """The ATen ops ``from_torch`` lowers (``aten.<name>``: every overload, unless named)."""
    return sorted(f"aten.{name}" for name in _HANDLERS)


def lowers(target: Any) -> bool:
    """Whether ``from_torch`` lowers an ATen op (an ``OpOverload``, as in ATen-level FX graphs)."""
    if target is operator.getitem:
        return True
    schema = getattr(target, "_schema", None)
    if schema is None or not schema.name.startswith("aten::"):
        return False
    base = schema.name.removeprefix("aten::")
    return base in _NO_OPS or f"{base}.{target._overloadname}" in _HANDLERS or base in _HANDLERS


def lowers_node(node: Any) -> bool:
    """Whether ``from_torch`` lowers this node of an ATen-level FX graph: a call of an op it
    :func:`lowers`, where a ``getitem`` of an SDPA kernel takes its attention output or its
    log-sum-exp (a training graph's forward keeps it for the backward) where that has the rows'
    shape, and the kernel has no other output read; dropout only where it is the identity."""
    if node.op != "call_function" or not lowers(node.target):
        return False
    if node.target is operator.getitem:
        return not is_sdpa_kernel(node.args[0]) or node.args[1] == 0 or (
            node.args[1] == 1 and _lowered_statistics(node.args[0]))
    if is_sdpa_kernel(node):  # its attention and log-sum-exp (a backward reads it), without dropout
        lowered = (0, 1) if _lowered_statistics(node) else (0,)
        return not _schema_arguments(node).get("dropout_p") and all(
            user.target is operator.getitem and (user.args[1] in lowered or not user.users) for user in node.users)
    base = node.target._schema.name.removeprefix("aten::")
    if base in SDPA_BACKWARD_KERNELS:
        return _plain_sdpa_backward(node)
    if base in ("dropout", "native_dropout"):  # random in training: torch's (its mask a bool the backward reads)
        arguments = _schema_arguments(node)
        return not (arguments.get("train") and arguments.get("p"))
    if base == "slice_scatter":
        return (_schema_arguments(node).get("step") or 1) == 1
    if base == "scatter":
        arguments = _schema_arguments(node)
        shape, index = (getattr(arguments[name], "meta", {}).get("val") for name in ("self", "index"))
        return shape is not None and index is not None and arguments.get("reduce") is None and _one_index_a_slice(
            tuple(shape.shape), tuple(index.shape), arguments["dim"] % shape.dim())
    return True


def sdpa_backward_mask(node: Any) -> Any:
    """The mask argument (``attn_mask`` or ``attn_bias``) of an SDPA backward kernel's call, or None
    (also for any other node)."""
    schema = getattr(getattr(node, "target", None), "_schema", None)
    if schema is None or schema.name.removeprefix("aten::") not in SDPA_BACKWARD_KERNELS:
        return None
    return _sdpa_mask(_schema_arguments(node))


def _sdpa_mask(arguments: dict[str, Any]) -> Any:
    """An SDPA kernel's mask among its ``arguments``: ``attn_mask``, or ``attn_bias`` (the efficient
    kernel's name for it), or None."""
    return arguments.get("attn_mask") if arguments.get("attn_mask") is not None else arguments.get("attn_bias")


def _plain_sdpa_backward(node: Any) -> bool:
    """Whether an SDPA backward kernel's call has no dropout and no packed sequences."""
    arguments = _schema_arguments(node)
    return not arguments.get("dropout_p") and not _packed(arguments.get("cum_seq_q"))


def _packed(cumulative: Any) -> bool:
    """Whether an SDPA kernel's ``cum_seq_q`` argument holds packed sequence offsets (a dense
    attention's is None, or an empty tensor the forward returned)."""
    value = cumulative.meta.get("val") if hasattr(cumulative, "meta") else cumulative
    return value is not None and (not hasattr(value, "numel") or value.numel() > 0)


def _schema_arguments(node: Any) -> dict[str, Any]:
    """A call node's arguments by their schema names (FX nodes and constants as they are)."""
    arguments = {}
    for i, spec in enumerate(node.target._schema.arguments):
        if i < len(node.args) and not spec.kwarg_only:
            arguments[spec.name] = node.args[i]
        elif spec.name in node.kwargs:
            arguments[spec.name] = node.kwargs[spec.name]
    return arguments


def is_sdpa_kernel(node: Any) -> bool:
    """Whether an FX node calls one of the kernels SDPA dispatches to (:data:`SDPA_KERNELS`)."""
    schema = getattr(getattr(node, "target", None), "_schema", None)
    return schema is not None and schema.name.removeprefix("aten::") in SDPA_KERNELS


SDPA_RNG_STATE = frozenset({"rng_state", "unused", "philox_seed", "philox_offset"})
"""The names SDPA's kernels give the random-number state their dropout drew from (outputs of
the forward kernels, arguments of their backward kernels)."""


def unused_sdpa_rng_state(node: Any) -> tuple[list[Any], list[Any]]:
    """For an SDPA kernel or its backward called without dropout, the random-number state it
    passes on but never draws from: the forward's ``getitem`` nodes of those outputs that are
    read, and the backward's arguments holding them (FX nodes); else two empty lists."""
    schema = getattr(getattr(node, "target", None), "_schema", None)
    if schema is None or _schema_arguments(node).get("dropout_p"):
        return [], []
    if is_sdpa_kernel(node):
        names = [r.name for r in schema.returns]
        reads = [user for user in node.users if user.target is operator.getitem and user.users
                 and names[user.args[1]] in SDPA_RNG_STATE]  # fmt: skip
        return reads, []
    if schema.name.removeprefix("aten::") in SDPA_BACKWARD_KERNELS:
        arguments = _schema_arguments(node)
        return [], [arguments[name] for name in SDPA_RNG_STATE if hasattr(arguments.get(name), "meta")]
    return [], []


def _source_location(node: Any, function: Callable[..., Any] | None = None) -> str:
    """`` at file:line in function (code)`` from the node's stack trace. torch.export keeps
    only ``forward`` frames, so for a plain function (called from our wrapper's
    ``forward``) the function's own definition is named instead."""
    trace = (node.meta.get("stack_trace") if node is not None else None) or ""
    frames = re.findall(r'File "([^"]+)", line (\d+), in ([^\n]+)\n\s*([^\n]*)', trace)
    if frames and not frames[-1][0].endswith(_THIS_FILE):
        path, line, name, code = frames[-1]
        return f" at {path}:{line} in {name.strip()} ({code.strip()})"
    code_object = getattr(function, "__code__", None)
    if code_object is not None:
        name = getattr(function, "__qualname__", code_object.co_name)
        return f" in {name} (defined at {code_object.co_filename}:{code_object.co_firstlineno})"
    return ""


# ----------------------------------------------------------------------------- capture


class _Capture:
    """One walk over an exported graph, building ``graph``."""

    def __init__(
        self, graph: Graph, params: dict[str, _Param], declared: dict[str, Tensor], function: Callable[..., Any] | None
    ) -> None:
        self.g = graph
        self.function = function  # the captured plain function (None for a module)
        self.params = params
        self.declared = declared  # parameter input name -> its input tensor
        self.read: list[str] = []  # parameter names read, in order of first read
        self.user_outputs: list[int] = []  # positions of the user outputs among the graph's outputs
        self.softmax_scores: dict[int, Tensor] = {}  # a softmax along the last axis (by tensor id) -> its input
        self.node: Any = None
        self.base = ""  # the ATen op being lowered, without "aten::" and the overload

    # ------------------------------------------------------------------ conversions

    def where_(self) -> str:
        return f"{self.node.target}" if self.node is not None else "from_torch"

    def at(self, node: Any = None) -> str:
        """Where ``node`` (default: the node being lowered) comes from in the user's source."""
        return _source_location(node if node is not None else self.node, self.function)

    def declare(self, param: _Param) -> Tensor:
        if param.name not in self.declared:
            dtype = _input_dtype(param.tensor.dtype, f"{param.what} {param.name!r}")
            self.declared[param.name] = self.g.input(param.name, tuple(param.tensor.shape), dtype)
        if param.name not in self.read:
            self.read.append(param.name)
        return self.declared[param.name]

    def t(self, value: Any) -> Tensor:
        """``value`` as a graph tensor (bands and parameters materialised, scalars as constants)."""
        if isinstance(value, Tensor):
            return value
        if isinstance(value, _Param):
            return self.declare(value)
        if isinstance(value, _Band):
            return self.band_tensor(value)
        if isinstance(value, _Unsupported):
            raise GraphError(f"from_torch: {self.where_()} uses {value.reason}, which cherenkov cannot compute")
        if isinstance(value, bool):
            return self.g.constant(value, "bool")
        if isinstance(value, int):
            return self.g.constant(value, "int32")
        if isinstance(value, float):
            return self.g.constant(value, "fp32")
        raise GraphError(f"from_torch: {self.where_()} expected a tensor, got {type(value).__name__} {value!r}")

    def operand(self, value: Any) -> Tensor | int | float | bool:
        """A tensor, or a Python scalar left for the builder to coerce to its partner's dtype."""
        if isinstance(value, (bool, int, float)):
            return value
        return self.t(value)

    def band_tensor(self, band: _Band) -> Tensor:
        """The band's values from iotas: ``q_idx + offset < k_idx`` is the upper part, and (a
        window) ``k_idx < q_idx + lower + 1`` the lower one."""
        *lead, rows, cols = band.shape
        if band.inside == band.outside:
            fill = self.g.constant(band.inside, band.dtype)
            return fill.broadcast_to(band.shape) if band.shape else fill
        query, keys = self.g.arange(rows).unsqueeze(-1), self.g.arange(cols)
        above = (query + band.offset if band.offset else query) < keys
        if band.dtype == "bool" and band.lower is None:
            mask = above if band.outside else where(above, False, True)
        elif band.dtype == "bool":
            mask = where(above, band.outside, where(keys < query + (band.lower + 1), band.outside, band.inside))
        else:
            outside = self.g.constant(band.outside, band.dtype)
            inside = self.g.constant(band.inside, band.dtype)
            if band.lower is not None:
                inside = where(keys < query + (band.lower + 1), outside, inside)
            mask = where(above, outside, inside)
        return mask.reshape(*([1] * len(lead)), rows, cols).broadcast_to(band.shape)

    # ------------------------------------------------------------------ the walk

    def run(self, ep: Any, user_inputs: dict[str, Tensor], placeholders: dict[str, Any]) -> list[Any]:
        env: dict[Any, Any] = {}
        outputs: list[Any] = []
        for node in ep.graph.nodes:
            self.node = node
            if node.op == "placeholder":
                env[node] = user_inputs[node.name] if node.name in user_inputs else placeholders[node.name]
            elif node.op == "call_function":
                env[node] = self.call(node, env)
            elif node.op == "output":
                outputs = [self.value(node.args[0][i], env) for i in self.user_outputs]
            else:
                raise GraphError(
                    f"from_torch: exported graph node {node.name!r} is a {node.op!r} node{self.at(node)}; "
                    "only ATen call_function nodes are supported (no control flow or submodule calls)"
                )
        self.node = None
        return outputs

    def value(self, arg: Any, env: dict[Any, Any]) -> Any:
        import torch.fx

        if isinstance(arg, torch.fx.Node):
            return env[arg]
        if isinstance(arg, (list, tuple)):
            return type(arg)(self.value(a, env) for a in arg)
        return arg

    def call(self, node: Any, env: dict[Any, Any]) -> Any:
        target = node.target
        if target is operator.getitem:
            sequence, index = (self.value(a, env) for a in node.args)
            return sequence[index]
        schema = getattr(target, "_schema", None)
        if schema is None or not schema.name.startswith("aten::"):
            self.unsupported(node)
        base = schema.name.removeprefix("aten::")
        overload = target._overloadname
        self.base = base
        if base in _NO_OPS:
            return None
        handler = _HANDLERS.get(f"{base}.{overload}") or _HANDLERS.get(base)
        if handler is None:
            self.unsupported(node)
        args: dict[str, Any] = {}
        for i, spec in enumerate(schema.arguments):
            if i < len(node.args) and not spec.kwarg_only:
                raw = node.args[i]
            elif spec.name in node.kwargs:
                raw = node.kwargs[spec.name]
            elif spec.has_default_value():
                raw = spec.default_value
            else:
                raw = None
            args[spec.name] = self.value(raw, env)
        try:
            result = handler(self, args)
        except GraphError as error:
            detail = str(error).removeprefix("from_torch: ")
            raise GraphError(f"from_torch: lowering {target}{self.at(node)}: {detail}") from error
        except (TypeError, ValueError, KeyError, IndexError, AttributeError) as error:
            raise GraphError(
                f"from_torch: cannot lower {target}{self.at(node)} with these arguments "
                f"({type(error).__name__}: {error})"
            ) from error
        return self.reconcile(result, node.meta.get("val"))

    def unsupported(self, node: Any) -> None:
        name = str(node.target) if hasattr(node.target, "_schema") else getattr(node.target, "__name__", node.target)
        raise GraphError(
            f"from_torch: unsupported op {name}{self.at(node)}; cherenkov lowers these ATen ops: "
            f"{', '.join(supported_ops())}"
        )

    def reconcile(self, result: Any, meta: Any) -> Any:
        """Check a lowered value's shape against torch's and cast it to torch's dtype."""
        if isinstance(meta, (list, tuple)) and isinstance(result, (list, tuple)):
            return type(result)(self.reconcile(r, m) for r, m in zip(result, meta))
        if not isinstance(result, (Tensor, _Band)) or not hasattr(meta, "dtype") or not hasattr(meta, "shape"):
            return result
        expected = tuple(int(d) for d in meta.shape)
        if tuple(result.shape) != expected:
            raise GraphError(
                f"from_torch: lowering {self.where_()}{self.at()} gave shape {result.shape}, "
                f"torch gives {expected} (a bug in the capture; please report it)"
            )
        dtype = _value_dtype(meta.dtype, f"{self.where_()}{self.at()}")
        if result.dtype == dtype:
            return result
        return result.cast(dtype)


# ----------------------------------------------------------------------------- helpers


def _shape(value: Any) -> tuple[int, ...]:
    return tuple((value.tensor if isinstance(value, _Param) else value).shape)


def _axes(dim: Any, ndim: int) -> tuple[int, ...] | None:
    """A reduction's axes: ``None`` or ``[]`` mean every axis."""
    if dim is None or (isinstance(dim, (list, tuple)) and len(dim) == 0):
        return None
    dims = dim if isinstance(dim, (list, tuple)) else [dim]
    return tuple(d % ndim if ndim else d for d in dims)


def _fill_value(tensor: Tensor) -> Any:
    """The value of a constant fill (``constant`` or an ``expand`` of one), else None."""
    node = tensor.node
    if node.op == "expand":
        node = tensor.graph.node(node.inputs[0])
    return node.attrs[0] if node.op == "constant" else None


def _cast_to(c: _Capture, x: Tensor, dtype: Any) -> Tensor:
    return x if dtype is None else x.cast(_value_dtype(dtype, c.where_()))


def _truthy(x: Tensor) -> Tensor:
    return x if x.dtype == "bool" else _ne(x, 0)


def _not(x: Tensor) -> Tensor:
    """Logical not of a bool tensor; ``not(not c)`` is ``c`` again."""
    node, graph = x.node, x.graph
    if node.op == "where":
        branches = [graph.node(i) for i in node.inputs[1:]]
        if all(n.op == "constant" and n.dtype == "bool" for n in branches):
            if [n.attrs[0] for n in branches] == [False, True]:
                return Tensor(graph, node.inputs[0])
    return where(x, False, True)


def _eq(a: Any, b: Any) -> Tensor:
    return where(a < b, False, _not(b < a))


def _ne(a: Any, b: Any) -> Tensor:
    return where(a < b, True, b < a)


_COMPARE: dict[str, Callable[[Any, Any], Any]] = {
    "lt": operator.lt,
    "gt": operator.gt,
    "le": operator.le,
    "ge": operator.ge,
    "eq": operator.eq,
    "ne": operator.ne,
}


# ----------------------------------------------------------------------------- arithmetic


def _scaled(value: Any, alpha: Any) -> Any:
    return value if alpha in (None, 1) else value * alpha


def _binary_operands(c: _Capture, a: dict[str, Any]) -> tuple[Any, Any]:
    x, y = c.operand(a["self"]), c.operand(a["other"])
    if not isinstance(x, Tensor) and not isinstance(y, Tensor):
        x = c.t(x)
    return x, y


@_op("add")
def _add(c: _Capture, a: dict[str, Any]) -> Any:
    kept = _beside_zero_mask(c, a["self"], a["other"])
    if kept is not None:
        return kept
    x, y = _binary_operands(c, a)
    return x + _scaled(y, a.get("alpha"))


def _beside_zero_mask(c: _Capture, x: Any, y: Any) -> Tensor | None:
    """``x`` (or ``y``) where the other addend is a folded additive mask that hides nothing (one
    band value, zero: the mask transformers 5.17 builds for a bidirectional layer without
    padding) and the sum is that tensor as it is, in shape and dtype; else None."""
    meta = c.node.meta.get("val")
    for kept, other in ((x, y), (y, x)):
        if not (isinstance(other, _Band) and other.dtype != "bool" and other.inside == other.outside == 0):
            continue
        if isinstance(kept, _Band):  # a sum of two bands: the plain path builds it (nothing built here unread)
            continue
        tensor = c.operand(kept)
        if (isinstance(tensor, Tensor) and meta is not None and tuple(tensor.shape) == tuple(meta.shape)
                and tensor.dtype == _VALUE_DTYPES.get(_dtype_name(meta.dtype))):  # fmt: skip
            return tensor
    return None


@_op("sub")
def _sub(c: _Capture, a: dict[str, Any]) -> Any:
    x, y = _binary_operands(c, a)
    return x - _scaled(y, a.get("alpha"))


@_op("rsub")
def _rsub(c: _Capture, a: dict[str, Any]) -> Any:
    x, y = _binary_operands(c, a)
    return y - _scaled(x, a.get("alpha"))


@_op("mul")
def _mul(c: _Capture, a: dict[str, Any]) -> Any:
    x, y = _binary_operands(c, a)
    return x * y


@_op("div", "floor_divide")
def _div(c: _Capture, a: dict[str, Any]) -> Any:
    """True division; ``rounding_mode="floor"`` (``floor_divide``, ``//``): ``(x − x mod y) / y``, the
    remainder taking the divisor's sign (an integral quotient, cast back where torch's is an integer)."""
    mode = "floor" if c.base == "floor_divide" else a.get("rounding_mode")
    if mode not in (None, "floor"):
        raise GraphError(f"div with rounding_mode={mode!r} is not supported; valid: None (true division), 'floor'")
    x, y = _binary_operands(c, a)
    if mode == "floor":
        return (x - x % y) / y
    if isinstance(x, Tensor) and x.dtype in ("int32", "bool") and not isinstance(y, Tensor):
        x = x.cast("fp32")
    return x / y


@_op("remainder")
def _remainder(c: _Capture, a: dict[str, Any]) -> Any:
    x, y = _binary_operands(c, a)
    return x % y


@_op("neg")
def _neg(c: _Capture, a: dict[str, Any]) -> Any:
    return -c.t(a["self"])


def _unary(method: Callable[[Tensor], Tensor]) -> Handler:
    return lambda c, a: method(c.t(a["self"]))


for _name, _fn in {
    "exp": Tensor.exp,
    "exp2": Tensor.exp2,
    "log": Tensor.log,
    "log2": Tensor.log2,
    "sqrt": Tensor.sqrt,
    "rsqrt": Tensor.rsqrt,
    "reciprocal": Tensor.recip,
    "sin": Tensor.sin,
    "cos": Tensor.cos,
    "abs": Tensor.abs,
    "square": lambda x: x * x,
    "sigmoid": cknn.sigmoid,
    "tanh": cknn.tanh,
    "silu": cknn.silu,
    "erf": cknn.erf,
    "relu": lambda x: x.maximum(0),
    "relu6": lambda x: x.maximum(0).minimum(6),
    "expm1": cknn.expm1,
    "log1p": cknn.log1p,
    "mish": cknn.mish,
    "hardsigmoid": cknn.hardsigmoid,
    "hardswish": lambda x: x * cknn.hardsigmoid(x),
    "log_sigmoid": lambda x: -cknn.softplus(-x),
}.items():
    _op(_name)(_unary(_fn))


# SELU's constants (Klambauer et al. 2017), as PyTorch defines them
_SELU_ALPHA, _SELU_SCALE = 1.6732632423543772848170429916717, 1.0507009873554804934193349852946


@_op("softplus")
def _softplus(c: _Capture, a: dict[str, Any]) -> Any:
    return cknn.softplus(c.t(a["self"]), float(a.get("beta", 1.0)), float(a.get("threshold", 20.0)))


@_op("elu", "selu", "celu")
def _elu(c: _Capture, a: dict[str, Any]) -> Any:
    x = c.t(a["self"])
    if c.base == "selu":
        return cknn.elu(x, _SELU_ALPHA, _SELU_SCALE)
    alpha = float(a.get("alpha", 1.0))
    if c.base == "celu":
        if alpha == 0:
            raise GraphError("celu: alpha=0 is not valid (it divides by alpha)")
        return cknn.elu(x, alpha, input_scale=1.0 / alpha)
    return cknn.elu(x, alpha, float(a.get("scale", 1.0)), float(a.get("input_scale", 1.0)))


@_op("pow.Tensor_Scalar")
def _pow(c: _Capture, a: dict[str, Any]) -> Any:
    exponent = a["exponent"]
    if not isinstance(exponent, (int, float)) or isinstance(exponent, bool):
        raise GraphError(f"pow: exponent {exponent!r} must be a Python number")
    return c.t(a["self"]) ** exponent


@_op("pow.Scalar")
def _pow_scalar_base(c: _Capture, a: dict[str, Any]) -> Any:
    base, exponent = a["self"], c.t(a["exponent"])
    if not isinstance(base, (int, float)) or isinstance(base, bool) or base <= 0:
        raise GraphError(f"pow: a scalar base {base!r} must be a positive number (base ** x = exp2(x * log2 base))")
    return (exponent * math.log2(base)).exp2()


@_op("maximum", "max.other")
def _maximum(c: _Capture, a: dict[str, Any]) -> Any:
    return c.t(a["self"]).maximum(c.t(a["other"]))


@_op("minimum", "min.other")
def _minimum(c: _Capture, a: dict[str, Any]) -> Any:
    return c.t(a["self"]).minimum(c.t(a["other"]))


@_op("clamp", "clamp_min", "clamp_max", "hardtanh")
def _clamp(c: _Capture, a: dict[str, Any]) -> Any:
    x = c.t(a["self"])
    if c.base == "hardtanh":
        low, high = a["min_val"], a["max_val"]
    else:
        low, high = a.get("min"), a.get("max")
    if low is not None:
        x = x.maximum(c.operand(low))
    if high is not None:
        x = x.minimum(c.operand(high))
    return x


@_op("leaky_relu")
def _leaky_relu(c: _Capture, a: dict[str, Any]) -> Any:
    x = c.t(a["self"])
    return where(x > 0, x, x * a["negative_slope"])


@_op("gelu")
def _gelu(c: _Capture, a: dict[str, Any]) -> Any:
    return cknn.gelu(c.t(a["self"]), approximate=a["approximate"])


# ------------------------------------------------------------------ activations' gradients (a training backward)


@_op("tanh_backward")
def _tanh_backward(c: _Capture, a: dict[str, Any]) -> Any:
    """``g·(1 − y²)`` from tanh's output ``y``."""
    y = c.t(a["output"])
    return c.t(a["grad_output"]) * (1.0 - y * y)


@_op("sigmoid_backward")
def _sigmoid_backward(c: _Capture, a: dict[str, Any]) -> Any:
    """``g·y·(1 − y)`` from the sigmoid's output ``y``."""
    y = c.t(a["output"])
    return c.t(a["grad_output"]) * (y * (1.0 - y))


@_op("threshold_backward")
def _threshold_backward(c: _Capture, a: dict[str, Any]) -> Any:
    """``g`` where the input is above the threshold, else 0 (ReLU's gradient)."""
    return where(c.t(a["self"]) <= c.operand(a["threshold"]), 0.0, c.t(a["grad_output"]))


@_op("gelu_backward")
def _gelu_backward(c: _Capture, a: dict[str, Any]) -> Any:
    """GELU's vector-Jacobian product (``ck.grad``'s, of the same approximation) at its input."""
    approximate = a.get("approximate", "none")
    (gradient,) = vjp(lambda x: cknn.gelu(x, approximate=approximate), (c.t(a["self"]),), c.t(a["grad_output"]))
    return gradient


@_op("silu_backward")
def _silu_backward(c: _Capture, a: dict[str, Any]) -> Any:
    """SiLU's vector-Jacobian product (``ck.grad``'s) at its input."""
    (gradient,) = vjp(cknn.silu, (c.t(a["self"]),), c.t(a["grad_output"]))
    return gradient


@_op("dropout", "native_dropout")
def _dropout(c: _Capture, a: dict[str, Any]) -> Any:
    if a.get("train") and a.get("p"):
        raise GraphError(
            f"dropout with p={a['p']} in training mode is random; call module.eval() (dropout is then the identity)"
        )
    x = c.t(a["input"])
    return (x, _Unsupported("the mask of native_dropout")) if c.base == "native_dropout" else x


# ----------------------------------------------------------------------------- comparisons and selection


def _compare(name: str) -> Handler:
    def handler(c: _Capture, a: dict[str, Any]) -> Any:
        x, y = a["self"], a["other"]
        if isinstance(x, _Band) and isinstance(y, (bool, int, float)):
            return x.map(lambda v: bool(_COMPARE[name](v, y)), "bool")
        x, y = _binary_operands(c, a)
        if name == "eq":
            return _eq(x, y)
        if name == "ne":
            return _ne(x, y)
        return _COMPARE[name](x, y)

    return handler


for _name in _COMPARE:
    _op(_name)(_compare(_name))


@_op("logical_not", "bitwise_not")
def _logical_not(c: _Capture, a: dict[str, Any]) -> Any:
    x = a["self"]
    if isinstance(x, _Band) and (x.dtype == "bool" or c.base == "logical_not"):
        return x.map(lambda v: not v, "bool")
    x = c.t(x)
    if c.base == "bitwise_not" and x.dtype != "bool":
        raise GraphError(f"bitwise_not of a {x.dtype} tensor is not supported; only of bool masks")
    return _not(_truthy(x))


def _logical_operands(c: _Capture, a: dict[str, Any]) -> tuple[Tensor, Tensor]:
    x, y = c.t(a["self"]), c.t(a["other"])
    if not c.base.startswith("logical") and (x.dtype, y.dtype) != ("bool", "bool"):
        raise GraphError(f"{c.base} of {x.dtype} and {y.dtype} tensors is not supported; only of bool masks")
    return _truthy(x), _truthy(y)


@_op("logical_and", "bitwise_and", "__and__")
def _logical_and(c: _Capture, a: dict[str, Any]) -> Any:
    x, y = _logical_operands(c, a)
    return where(x, y, False)


@_op("logical_or", "bitwise_or", "__or__")
def _logical_or(c: _Capture, a: dict[str, Any]) -> Any:
    x, y = _logical_operands(c, a)
    return where(x, True, y)


@_op("where")
def _where(c: _Capture, a: dict[str, Any]) -> Any:
    condition = _truthy(c.t(a["condition"]))
    return where(condition, c.operand(a["self"]), c.operand(a["other"]))


@_op("masked_fill")
def _masked_fill(c: _Capture, a: dict[str, Any]) -> Any:
    x = c.t(a["self"])
    return where(_truthy(c.t(a["mask"])), c.operand(a["value"]), x)


# ----------------------------------------------------------------------------- linear algebra


@_op("linear")
def _linear(c: _Capture, a: dict[str, Any]) -> Any:
    bias = a.get("bias")
    return cknn.linear(c.t(a["input"]), c.t(a["weight"]), None if bias is None else c.t(bias))


@_op("matmul", "mm", "bmm")
def _matmul(c: _Capture, a: dict[str, Any]) -> Any:
    other = a.get("other", a.get("mat2"))
    probabilities = c.t(a["self"])
    out = _unmerged_batch_matmul(probabilities, c.t(other))
    while probabilities.node.op == "cast":
        probabilities = Tensor(c.g, probabilities.node.inputs[0])
    if probabilities.id in c.softmax_scores:  # softmax(scores) @ v, spelled out: an attention
        c.g.note_attention(out, c.softmax_scores[probabilities.id])
    return out


def _unmerged_batch_matmul(x: Tensor, y: Tensor) -> Tensor:
    """``x @ y``; where both are reshapes merging the same leading axes of their sources into one
    batch axis (what an ATen-level trace makes of a 4-D matmul: ``bmm`` over batch·heads; either
    transposed after), the product of the sources reshaped the same way — a batched product
    commutes with merging its batch axes, and a reader that views the result back (the scores, per
    head) then reads the product itself."""
    a, b = _merged_batch_source(x), _merged_batch_source(y)
    if a is not None and b is not None and a.shape[:-2] == b.shape[:-2]:
        product = matmul(a, b)
        return product.reshape(x.shape[0], *product.shape[-2:])
    return matmul(x, y)


def _merged_batch_source(x: Tensor) -> Tensor | None:
    """The tensor whose leading axes ``x`` (3-D) merges into its first, the last two kept (with
    ``x``'s last two axes swapped after the merge, the source's swapped too; swapped twice, as a
    backward's ``bmm`` reads a transposed operand's transpose, not); None for another ``x``."""
    swapped, merged = False, x
    while merged.node.op == "permute" and merged.node.attrs[0] == (0, 2, 1):
        swapped, merged = not swapped, Tensor(x.graph, merged.node.inputs[0])
    if x.ndim != 3 or merged.node.op != "reshape":
        return None
    source = Tensor(x.graph, merged.node.inputs[0])
    if source.ndim <= 3 or source.shape[-2:] != merged.shape[-2:]:
        return None
    return source.mT if swapped else source


@_op("addmm", "baddbmm")
def _addmm(c: _Capture, a: dict[str, Any]) -> Any:
    first, second = (a.get("mat1", a.get("batch1")), a.get("mat2", a.get("batch2")))
    product = matmul(c.t(first), c.t(second))
    product = _scaled(product, a.get("alpha"))
    beta = a.get("beta")
    if beta == 0:
        return product
    return _scaled(c.t(a["self"]), beta) + product


# ----------------------------------------------------------------------------- softmax and attention


@_op("softmax", "_softmax")
def _softmax(c: _Capture, a: dict[str, Any]) -> Any:
    x = c.t(a["self"])
    if a.get("half_to_float"):
        x = x.cast("fp32")
    x = _cast_to(c, x, a.get("dtype"))
    return _noted_softmax(c, x, cknn.softmax(x, axis=a["dim"]), a["dim"])


@_op("_safe_softmax")
def _safe_softmax(c: _Capture, a: dict[str, Any]) -> Any:
    x = _cast_to(c, c.t(a["self"]), a.get("dtype"))
    row_max = x.max(axis=a["dim"], keepdim=True)
    return _noted_softmax(c, x, where(row_max > -math.inf, cknn.softmax(x, axis=a["dim"]), 0.0), a["dim"])


def _noted_softmax(c: _Capture, scores: Tensor, probabilities: Tensor, dim: int) -> Tensor:
    """``probabilities``, remembered as the softmax of ``scores`` where it runs along the last axis:
    a product of them with values (:func:`_matmul`) is then noted an attention, whose log-sum-exp a
    training forward saves (nanoGPT's and transformers' eager attention spell it so)."""
    if dim in (-1, scores.ndim - 1):
        c.softmax_scores[probabilities.id] = scores
    return probabilities


@_op("_softmax_backward_data")
def _softmax_backward_data(c: _Capture, a: dict[str, Any]) -> Any:
    """A softmax's vector-Jacobian product ``P∘(g − rowsum(g∘P))`` from its output ``P`` (what a
    training graph's backward, AOTAutograd's, calls for a written-out softmax). The graph is marked a
    gradient graph: the derivation then looks through its intermediates (``P`` recomputed there)."""
    c.g.is_gradient = True
    grad, probabilities, dim = c.t(a["grad_output"]), c.t(a["output"]), a["dim"]
    result = probabilities * (grad - (grad * probabilities).sum(axis=dim, keepdim=True))
    return _cast_to(c, result, a.get("input_dtype"))


@_op("log_softmax", "_log_softmax")
def _log_softmax(c: _Capture, a: dict[str, Any]) -> Any:
    x = c.t(a["self"])
    if a.get("half_to_float"):
        x = x.cast("fp32")
    x = _cast_to(c, x, a.get("dtype"))
    dim = a["dim"]
    shifted = x - x.max(axis=dim, keepdim=True)
    return shifted - shifted.exp().sum(axis=dim, keepdim=True).log()


@_op("scaled_dot_product_attention")
def _sdpa(c: _Capture, a: dict[str, Any]) -> Any:
    if a.get("dropout_p"):
        raise GraphError(
            f"scaled_dot_product_attention with dropout_p={a['dropout_p']} is random (SDPA applies dropout "
            "even in eval mode); pass dropout_p=0.0 when not training"
        )
    q, k, v = c.t(a["query"]), c.t(a["key"]), c.t(a["value"])
    return _sdpa_of(c, q, k, v, a.get("attn_mask"), bool(a.get("is_causal")), a.get("scale"))


def _sdpa_of(c: _Capture, q: Tensor, k: Tensor, v: Tensor, raw_mask: Any, causal: bool | str, scale: float | None,
             return_lse: bool = False) -> Tensor | tuple[Tensor, Tensor]:  # fmt: skip
    """SDPA's attention of ``q``, ``k``, ``v`` under ``raw_mask`` (None, a band, a bool or an additive
    tensor) or ``causal``; ``return_lse``: with its rows' log-sum-exp of the scaled, masked scores
    (fp32, ``(..., heads, seq_q)``), the statistic SDPA's kernels save for their backward."""
    if raw_mask is None:
        return cknn.attention(q, k, v, causal=causal, scale=scale, return_lse=return_lse)
    if causal:
        raise GraphError("scaled_dot_product_attention: attn_mask and is_causal=True together are invalid in torch too")
    every_row = isinstance(raw_mask, _Band) and _attends_in_every_row(raw_mask)
    return _masked_attention(q, k, v, c.t(raw_mask), scale, every_row, return_lse)


def _masked_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, scale: float | None, every_row: bool,
                      return_lse: bool = False) -> Tensor | tuple[Tensor, Tensor]:  # fmt: skip
    """SDPA's attention under a bool or additive ``mask`` tensor (see :func:`_sdpa_of`); a row the
    mask hides entirely gives zeros, as torch's safe softmax does, unless ``every_row`` attends."""
    if q.ndim >= 3 and k.ndim >= 3 and q.shape[-3] != k.shape[-3]:
        groups = q.shape[-3] // k.shape[-3]
        k, v = cknn.repeat_kv_heads(k, groups), cknn.repeat_kv_heads(v, groups)
    scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(q.shape[-1]) if scale is None else scale)
    scores = where(mask, scores, -math.inf) if mask.dtype == "bool" else scores + mask
    attended = cknn.softmax(scores, axis=-1)
    if not every_row:
        attended = where(scores.max(axis=-1, keepdim=True) > -math.inf, attended, 0.0)
    out = attended @ v
    return (out, cknn.logsumexp(scores, axis=-1).cast("fp32")) if return_lse else out


SDPA_KERNELS = frozenset({
    "_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
})  # fmt: skip
"""The kernels SDPA dispatches to, which an ATen-level trace (``make_fx``) records instead of
``scaled_dot_product_attention``: their attention output is lowered, and their log-sum-exp where
it has the rows' shape (a training graph's forward saves it for the backward)."""


CAUSAL_FROM_THE_LAST_KEY = frozenset({"_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_backward"})
"""SDPA kernels whose ``is_causal`` aligns the mask to the last key (FlashAttention-2's CUDA kernel: query ``i``
sees keys ``j ≤ i + S_kv − S_q``; the others, as SDPA itself, align it to the first key). SDPA's dispatcher gives
them square problems only, but PyTorch's ``causal_lower_right`` calls them for a chunk after cached keys, and so
does code that calls them directly."""


def _kernel_causal(c: _Capture, a: dict[str, Any]) -> bool | str:
    """The causal mask an SDPA kernel's ``is_causal`` stands for: ``ck.nn.attention``'s ``causal`` argument."""
    if not a.get("is_causal"):
        return False
    return cknn.LOWER_RIGHT if c.base in CAUSAL_FROM_THE_LAST_KEY else True


@_op(*SDPA_KERNELS)
def _sdpa_kernel(c: _Capture, a: dict[str, Any]) -> Any:
    """An SDPA backend kernel: its attention output, lowered as ``scaled_dot_product_attention``
    with the kernel's mask (``attn_mask`` or ``attn_bias``), and its log-sum-exp where it is read;
    its other outputs (RNG state, debug mask) are ``None``, and :func:`lowers_node` keeps them out
    of captures."""
    if a.get("dropout_p"):
        raise GraphError(f"{c.base}: dropout_p={a['dropout_p']} is random; cherenkov lowers SDPA without dropout")
    mask = _sdpa_mask(a)
    q, k, v = c.t(a["query"]), c.t(a["key"]), c.t(a["value"])
    outputs = len(c.node.meta["val"])
    causal = _kernel_causal(c, a)
    if not _reads_sdpa_statistics(c.node):
        return (_sdpa_of(c, q, k, v, mask, causal, a.get("scale")),) + (None,) * (outputs - 1)
    attention, lse = _sdpa_of(c, q, k, v, mask, causal, a.get("scale"), return_lse=True)
    return (attention, lse.reshape(*c.node.meta["val"][1].shape)) + (None,) * (outputs - 2)


def _reads_sdpa_statistics(node: Any) -> bool:
    """Whether a graph reads an SDPA kernel's second output, its log-sum-exp."""
    return any(user.target is operator.getitem and user.args[1] == 1 and user.users for user in node.users)


def _lowered_statistics(node: Any) -> bool:
    """Whether an SDPA kernel's log-sum-exp is what :func:`_sdpa_of` computes: fp32, one a row of
    the attention (FlashAttention-2's and the CPU kernel's ``(B, H, S)``, cuDNN's ``(B, H, S, 1)``;
    the efficient kernel pads its rows to a multiple of 32)."""
    import torch

    out, lse = node.meta["val"][:2]
    return lse is not None and lse.dtype == torch.float32 and _statistics_shape(tuple(lse.shape), tuple(out.shape[:-1]))


def _statistics_shape(shape: tuple[int, ...], rows: tuple[int, ...]) -> bool:
    """Whether a log-sum-exp of ``shape`` holds one value a row of an attention with ``rows``."""
    return shape in (rows, (*rows, 1))


SDPA_BACKWARD_KERNELS = frozenset({
    "_scaled_dot_product_flash_attention_backward", "_scaled_dot_product_flash_attention_for_cpu_backward",
    "_scaled_dot_product_efficient_attention_backward", "_scaled_dot_product_cudnn_attention_backward",
})  # fmt: skip
"""The backward kernels of :data:`SDPA_KERNELS`, which a training graph's backward (AOTAutograd)
records: lowered without dropout or packed sequences (:func:`lowers_node`)."""


@_op(*SDPA_BACKWARD_KERNELS)
def _sdpa_backward_kernel(c: _Capture, a: dict[str, Any]) -> Any:
    """An SDPA backend kernel's backward: the gradients of q, k and v as ``ck.grad`` writes them
    (the attention's vector-Jacobian product, recomputed from q, k and v, under the kernel's mask),
    so the derivation fuses them into a flash backward. The forward's output and log-sum-exp, where
    the graph reads them as inputs of the attention's own shapes (fp32 rows, as FlashAttention-2's
    and the CPU kernel's, or cuDNN's with a unit axis more), are declared saved inputs holding those
    values: the backward may read them instead of running the forward again. The graph is marked a
    gradient graph (the derivation then looks through its intermediates)."""
    if not _plain_sdpa_backward(c.node):
        raise GraphError("an SDPA backward is lowered without dropout or packed sequences only")
    grad_out = c.t(a["grad_out"] if "grad_out" in a else a["grad_out_"])
    q, k, v = (c.t(a[name]) for name in ("query", "key", "value"))
    mask = _sdpa_mask(a)
    causal, scale = _kernel_causal(c, a), a.get("scale")
    if mask is None:
        gradients = vjp(lambda q, k, v: cknn.attention(q, k, v, causal=causal, scale=scale), (q, k, v), grad_out)
    else:  # the mask read as it is, not differentiated
        every_row = isinstance(mask, _Band) and _attends_in_every_row(mask)
        gradients = vjp(lambda q, k, v, m: _masked_attention(q, k, v, m, scale, every_row), (q, k, v), grad_out,
                        constants=(c.t(mask),))  # fmt: skip
    c.g.is_gradient = True
    _declare_saved_statistics(c, a, q, k, v, mask, causal, scale)
    return (*gradients, *(None,) * (len(c.node.meta["val"]) - 3))


def _declare_saved_statistics(c: _Capture, a: dict[str, Any], q: Tensor, k: Tensor, v: Tensor, mask: Any,
                              causal: bool | str, scale: float | None) -> None:  # fmt: skip
    """Mark an SDPA backward's ``out`` and ``logsumexp`` arguments saved inputs holding the attention's
    output and log-sum-exp, where both are graph inputs of exactly those shapes and dtypes."""
    out, lse = a.get("out"), a.get("logsumexp")
    if not isinstance(out, Tensor) or not isinstance(lse, Tensor) or out.node.op != "input" or lse.node.op != "input":
        return
    if any(x.node.attrs[0] in c.g.saved for x in (out, lse)):
        return
    o_value, lse_value = _sdpa_of(c, q, k, v, mask, causal, scale, return_lse=True)
    if (out.shape, out.dtype, lse.dtype) == (o_value.shape, o_value.dtype, lse_value.dtype) \
            and _statistics_shape(lse.shape, lse_value.shape):  # fmt: skip
        c.g.mark_saved(out, o_value)
        c.g.mark_saved(lse, lse_value.reshape(*lse.shape))


def _attends_in_every_row(mask: _Band) -> bool:
    """Whether every row of an attention mask band lets at least one key through (a bool
    mask attends where True, an additive one where finite)."""
    *_, rows, cols = mask.shape

    def attends(value: Any) -> bool:
        return bool(value) if mask.dtype == "bool" else value > -math.inf

    def attends_in_row(a: int) -> bool:
        # row a holds the inside value at keys a+lower+1 .. a+offset and the outside value elsewhere
        first, last = 0 if mask.lower is None else max(a + mask.lower + 1, 0), min(a + mask.offset, cols - 1)
        inside, outside = last - first + 1, cols - max(last - first + 1, 0)
        return (attends(mask.inside) and inside > 0) or (attends(mask.outside) and outside > 0)

    return all(attends_in_row(a) for a in range(rows))


# ----------------------------------------------------------------------------- normalisation


def _norm_axes(x: Tensor, normalized_shape: Sequence[int]) -> tuple[int, ...]:
    count = len(normalized_shape)
    if tuple(x.shape[x.ndim - count :]) != tuple(normalized_shape):
        raise GraphError(f"normalized_shape {tuple(normalized_shape)} does not end the shape {x.shape}")
    return tuple(range(x.ndim - count, x.ndim))


def _layer_norm_parts(
    x: Tensor, normalized_shape: Sequence[int], weight: Tensor | None, bias: Tensor | None, eps: float
) -> tuple[Tensor, Tensor, Tensor]:
    axes = _norm_axes(x, normalized_shape)
    mean = x.mean(axis=axes, keepdim=True)
    centred = x - mean
    rstd = ((centred * centred).mean(axis=axes, keepdim=True) + eps).rsqrt()
    if len(axes) == 1:
        out = cknn.layer_norm(x, weight, bias, eps=eps)
    else:
        out = centred * rstd
        out = out if weight is None else out * weight
        out = out if bias is None else out + bias
    return out, mean, rstd


@_op("layer_norm")
def _layer_norm(c: _Capture, a: dict[str, Any]) -> Any:
    weight, bias = (None if a[n] is None else c.t(a[n]) for n in ("weight", "bias"))
    return _layer_norm_parts(c.t(a["input"]), a["normalized_shape"], weight, bias, a["eps"])[0]


@_op("native_layer_norm")
def _native_layer_norm(c: _Capture, a: dict[str, Any]) -> Any:
    weight, bias = (None if a[n] is None else c.t(a[n]) for n in ("weight", "bias"))
    out, mean, rstd = _layer_norm_parts(c.t(a["input"]), a["normalized_shape"], weight, bias, a["eps"])
    return (out, mean, rstd)


@_op("native_layer_norm_backward")
def _native_layer_norm_backward(c: _Capture, a: dict[str, Any]) -> Any:
    """A layer norm's gradients from the forward's saved row mean and reciprocal deviation: the
    input's ``r·(ĝ − mean(ĝ) − x̂·mean(ĝ∘x̂))`` (``x̂ = (x − μ)·r``, ``ĝ = g∘w``), the weight's
    ``Σ g∘x̂`` and the bias's ``Σ g`` over the rows; an output ``output_mask`` leaves out is None."""
    grad, x = c.t(a["grad_out"]), c.t(a["input"])
    mean, rstd = c.t(a["mean"]), c.t(a["rstd"])
    weight = None if a.get("weight") is None else c.t(a["weight"])
    axes = _norm_axes(x, a["normalized_shape"])
    rows = tuple(range(x.ndim - len(axes)))
    normalised = (x - mean) * rstd
    scaled = grad if weight is None else grad * weight
    wanted = list(a.get("output_mask") or (True, True, True))
    grad_input = rstd * (scaled - scaled.mean(axis=axes, keepdim=True)
                         - normalised * (scaled * normalised).mean(axis=axes, keepdim=True))  # fmt: skip
    grad_weight = None if weight is None else (grad * normalised).sum(axis=rows) if rows else grad * normalised
    grad_bias = None if a.get("bias") is None else grad.sum(axis=rows) if rows else grad
    return (grad_input if wanted[0] else None, grad_weight if wanted[1] else None, grad_bias if wanted[2] else None)


@_op("rms_norm")
def _rms_norm(c: _Capture, a: dict[str, Any]) -> Any:
    import torch

    x = c.t(a["input"])
    weight = None if a.get("weight") is None else c.t(a["weight"])
    eps = a.get("eps")
    if eps is None:
        eps = torch.finfo(getattr(c.node.args[0].meta.get("val"), "dtype", torch.float32)).eps
    axes = _norm_axes(x, a["normalized_shape"])
    if len(axes) == 1:
        return cknn.rms_norm(x, weight, eps=eps)
    out = x * ((x * x).mean(axis=axes, keepdim=True) + eps).rsqrt()
    return out if weight is None else out * weight


# ----------------------------------------------------------------------------- reductions


def _reduction(method: str) -> Handler:
    def handler(c: _Capture, a: dict[str, Any]) -> Any:
        x = _cast_to(c, c.t(a["self"]), a.get("dtype"))
        if x.dtype == "bool":
            x = x.cast("int32")
        if method == "mean" and x.dtype == "int32":
            raise GraphError("mean of an integer tensor is not defined in torch either; cast it first")
        return getattr(x, method)(axis=_axes(a.get("dim"), x.ndim), keepdim=bool(a.get("keepdim")))

    return handler


_op("sum")(_reduction("sum"))
_op("mean")(_reduction("mean"))
_op("amax", "max.default")(_reduction("max"))
_op("amin", "min.default")(_reduction("min"))


@_op("cumsum")
def _cumsum(c: _Capture, a: dict[str, Any]) -> Any:
    """Running sums along ``dim``: ``y_j = Σ_k where(k ≤ j, x_k, 0)``, a sum over a new key axis (n² terms:
    a mask's or an index's running count, as transformers numbers packed sequences)."""
    x = _cast_to(c, c.t(a["self"]), a.get("dtype"))
    if x.dtype == "bool":
        x = x.cast("int32")
    dim = a["dim"] % x.ndim
    size = x.shape[dim]
    moved = x.transpose(dim, -1) if dim != x.ndim - 1 else x
    earlier = c.g.arange(size).unsqueeze(-1) >= c.g.arange(size)  # (j, k): k <= j
    sums = where(earlier, moved.unsqueeze(-2), 0).sum(axis=-1)
    return sums.transpose(dim, -1) if dim != x.ndim - 1 else sums


def _positions(size: int, dim: int, ndim: int, g: Any) -> Tensor:
    """``0, 1, …, size − 1`` along axis ``dim`` of ``ndim`` axes (unit extent along the others after it)."""
    return g.arange(size).reshape(size, *([1] * (ndim - 1 - dim)))


@_op("max.dim", "min.dim")
def _max_dim(c: _Capture, a: dict[str, Any]) -> Any:
    """The max (min) along ``dim`` and its index: the first position attaining it, as torch's (the least
    position whose entry is not below the max; a row holding a NaN gets the row's length)."""
    x = c.t(a["self"])
    dim, keepdim = a["dim"] % x.ndim, bool(a.get("keepdim"))
    method = "max" if c.base == "max" else "min"
    kept = getattr(x, method)(axis=dim, keepdim=True)
    attains = x >= kept if method == "max" else x <= kept
    size = x.shape[dim]
    first = where(attains, _positions(size, dim, x.ndim, c.g), size).min(axis=dim, keepdim=keepdim)
    return (kept if keepdim else kept.squeeze(dim)), first


@_op("scatter.src", "scatter.value")
def _scatter(c: _Capture, a: dict[str, Any]) -> Any:
    """``self`` with ``src`` written at ``index`` along ``dim``, for one index a slice (extent 1 along ``dim``,
    ``self``'s along the others: a keepdim argmax, what max.dim's gradient scatters by):
    ``where(j == index, src, self)``; :func:`lowers_node` keeps any other scatter torch's."""
    x, index = c.t(a["self"]), c.t(a["index"])
    dim = a["dim"] % x.ndim
    if not _one_index_a_slice(tuple(x.shape), tuple(index.shape), dim):
        raise GraphError(f"scatter into {tuple(x.shape)} along axis {dim} with an index of shape "
                         f"{tuple(index.shape)}: valid is one index a slice (extent 1 along the axis, "
                         f"{tuple(x.shape)}'s along the others)")
    src = c.operand(a["src"]) if "src" in a else a["value"]
    if isinstance(src, Tensor) and tuple(src.shape) != tuple(index.shape):
        raise GraphError(f"scatter of a source of shape {tuple(src.shape)} by an index of shape "
                         f"{tuple(index.shape)}: valid is a source of the index's shape")
    hit = _eq(_positions(x.shape[dim], dim, x.ndim, c.g), index)
    return where(hit, src.cast(x.dtype) if isinstance(src, Tensor) else src, x)


def _one_index_a_slice(shape: tuple[int, ...], index: tuple[int, ...], dim: int) -> bool:
    """Whether a scatter into ``shape`` along ``dim`` by an index of shape ``index`` writes one entry a slice."""
    return len(index) == len(shape) and index[dim] == 1 and all(
        n == m for axis, (n, m) in enumerate(zip(index, shape)) if axis != dim)


@_op("any", "all")
def _any(c: _Capture, a: dict[str, Any]) -> Any:
    x = _truthy(c.t(a["self"])).cast("int32")
    method = "max" if c.base == "any" else "min"
    return getattr(x, method)(axis=_axes(a.get("dim"), x.ndim), keepdim=bool(a.get("keepdim"))) > 0


@_op("linalg_vector_norm")
def _vector_norm(c: _Capture, a: dict[str, Any]) -> Any:
    """``‖x‖_p`` over ``dim``: ``(Σ|x|^p)^{1/p}``; 2 as ``√Σx²`` (F.normalize's), ±∞ as the max or min of ``|x|``."""
    x = _cast_to(c, c.t(a["self"]), a.get("dtype"))
    order = a.get("ord", 2)
    if x.dtype not in sh.FLOAT_DTYPES:
        raise GraphError(f"linalg_vector_norm: a {x.dtype} tensor of shape {x.shape}; norms take floating-point "
                         f"tensors ({', '.join(sorted(sh.FLOAT_DTYPES))})")  # fmt: skip
    if isinstance(order, bool) or not isinstance(order, (int, float)) or not (order > 0 or order == -math.inf):
        raise GraphError(f"linalg_vector_norm: ord={order!r} on shape {x.shape}; lowered orders are positive numbers "
                         "and ±inf (ord 0 counts non-zeros and negative orders are not norms)")  # fmt: skip
    axes, keepdim = _axes(a.get("dim"), x.ndim), bool(a.get("keepdim"))
    if order == 2:
        return (x * x).sum(axis=axes, keepdim=keepdim).sqrt()
    if math.isinf(order):
        return getattr(x.abs(), "max" if order > 0 else "min")(axis=axes, keepdim=keepdim)
    if order == 1:
        return x.abs().sum(axis=axes, keepdim=keepdim)
    return (x.abs() ** float(order)).sum(axis=axes, keepdim=keepdim) ** (1.0 / order)


@_op("var", "std")
def _var(c: _Capture, a: dict[str, Any]) -> Any:
    x = c.t(a["self"])
    axes = _axes(a.get("dim"), x.ndim) or tuple(range(x.ndim))
    if "correction" in a:
        correction = 1 if a["correction"] is None else a["correction"]
    else:
        correction = 1 if a.get("unbiased", True) else 0
    count = math.prod(x.shape[i] for i in axes)
    if count - correction <= 0:
        raise GraphError(f"var: {count} elements with correction {correction} divide by zero")
    centred = x - x.mean(axis=axes, keepdim=True)
    result = (centred * centred).sum(axis=axes, keepdim=bool(a.get("keepdim"))) * (1.0 / (count - correction))
    return result.sqrt() if c.base == "std" else result


# ----------------------------------------------------------------------------- views


def _band_view(band: _Band, shape: tuple[int, ...]) -> _Band | None:
    """A reshape that keeps the last two axes only reshapes the (identical) leading slices."""
    if len(shape) >= 2 and shape[-2:] == band.shape[-2:]:
        return replace(band, shape=shape)
    return None


def _view_like(op: Callable[[Tensor, dict[str, Any]], Tensor]) -> Handler:
    def handler(c: _Capture, a: dict[str, Any]) -> Any:
        x = a["self"]
        if isinstance(x, _Band):
            view = _band_view(x, tuple(int(d) for d in c.node.meta["val"].shape))
            if view is not None:
                return view
        return op(c.t(x), a)

    return handler


def _reshape(x: Tensor, a: dict[str, Any]) -> Tensor:
    return x.reshape(*a.get("size", a.get("shape")))


_op("view", "reshape", "_unsafe_view")(_view_like(_reshape))
_op("expand")(_view_like(lambda x, a: x.expand(*a["size"])))
_op("unsqueeze")(_view_like(lambda x, a: x.unsqueeze(a["dim"])))


@_op("expand_as")
def _expand_as(c: _Capture, a: dict[str, Any]) -> Any:
    """``x.expand_as(other)``: ``x`` expanded to the shape the trace recorded for the result (``other``'s)."""
    return c.t(a["self"]).expand(*(int(d) for d in c.node.meta["val"].shape))


def _squeeze(x: Tensor, a: dict[str, Any]) -> Tensor:
    dim = a.get("dim")
    if dim is None:
        return x.squeeze()
    for d in sorted({d % x.ndim for d in (dim if isinstance(dim, (list, tuple)) else [dim])}, reverse=True):
        x = x.squeeze(d)
    return x


_op("squeeze")(_view_like(_squeeze))


def _flatten(x: Tensor, a: dict[str, Any]) -> Tensor:
    if x.ndim == 0:
        return x.reshape(1)
    start, end = a["start_dim"] % x.ndim, a["end_dim"] % x.ndim
    return x.reshape(*x.shape[:start], -1, *x.shape[end + 1 :])


_op("flatten")(_view_like(_flatten))


def _unflatten(x: Tensor, a: dict[str, Any]) -> Tensor:
    dim = a["dim"] % x.ndim
    return x.reshape(*x.shape[:dim], *a["sizes"], *x.shape[dim + 1 :])


_op("unflatten")(_view_like(_unflatten))


@_op("contiguous")
def _contiguous(c: _Capture, a: dict[str, Any]) -> Any:
    x = a["self"]
    return x if isinstance(x, _Band) else c.t(x).contiguous()


@_op("clone", "alias", "detach", "detach_", "lift_fresh_copy", "_to_copy", "to", "type_as")
def _identity(c: _Capture, a: dict[str, Any]) -> Any:
    """Value-preserving ops; a dtype change is made by the reconciliation cast after each op."""
    x = a["self"]
    return x if isinstance(x, _Band) else c.t(x)


def _permuted(c: _Capture, x: Any, perm: Sequence[int]) -> Any:
    ndim = len(_shape(x))
    perm = tuple(p % ndim for p in perm)
    if isinstance(x, _Band) and ndim >= 2:
        shape = tuple(x.shape[p] for p in perm)
        if perm[-2:] == (ndim - 2, ndim - 1):
            return replace(x, shape=shape)
        if perm[-2:] == (ndim - 1, ndim - 2) and x.lower is None:
            # value'[a, b] = value[b, a]: inside when a - b <= offset, i.e. unless b - a <= -offset - 1
            return replace(x, shape=shape, offset=-x.offset - 1, inside=x.outside, outside=x.inside)
        if perm[-2:] == (ndim - 1, ndim - 2):
            # inside when lower < a - b <= offset, i.e. when -offset - 1 < b - a <= -lower - 1
            return replace(x, shape=shape, offset=-x.lower - 1, lower=-x.offset - 1)
    return c.t(x).permute(perm)


@_op("permute")
def _permute(c: _Capture, a: dict[str, Any]) -> Any:
    return _permuted(c, a["self"], a["dims"])


@_op("transpose", "swapaxes", "swapdims")
def _transpose(c: _Capture, a: dict[str, Any]) -> Any:
    x = a["self"]
    ndim = len(_shape(x))
    first, second = (a["axis0"], a["axis1"]) if c.base == "swapaxes" else (a["dim0"], a["dim1"])
    perm = list(range(ndim))
    perm[first % ndim], perm[second % ndim] = perm[second % ndim], perm[first % ndim]
    return _permuted(c, x, perm)


@_op("t")
def _t(c: _Capture, a: dict[str, Any]) -> Any:
    x = a["self"]
    ndim = len(_shape(x))
    return x if ndim < 2 else _permuted(c, x, list(range(ndim))[::-1])


def _sliced(c: _Capture, x: Any, dim: int, start: int, stop: int) -> Any:
    ndim = len(_shape(x))
    dim %= ndim
    if isinstance(x, _Band):
        shape = list(x.shape)
        shape[dim] = stop - start
        if dim == ndim - 2:
            return x.shifted(tuple(shape), start)
        if dim == ndim - 1:
            return x.shifted(tuple(shape), -start)
        return replace(x, shape=tuple(shape))
    x = c.t(x)
    starts, stops = [0] * ndim, list(x.shape)
    starts[dim], stops[dim] = start, stop
    return x.slice(starts, stops)


def _strided(x: Tensor, dim: int, start: int, step: int, count: int) -> Tensor:
    """``x[start::step]`` along ``dim``, ``count`` long: the unit slice of ``step * count`` elements
    from ``start`` (zero-padded past the end), viewed as ``(count, step)``, first column kept."""
    shape, end = list(x.shape), start + step * count
    if end > shape[dim]:
        pairs = [(0, 0)] * x.ndim
        pairs[dim] = (0, end - shape[dim])
        x = x.pad(pairs)
    starts, stops = [0] * x.ndim, list(x.shape)
    starts[dim], stops[dim] = start, end
    rows = [*shape[:dim], count, step, *shape[dim + 1 :]]
    x = x.slice(starts, stops).reshape(rows)
    stops = list(rows)
    stops[dim + 1] = 1
    return x.slice([0] * len(rows), stops).reshape([*shape[:dim], count, *shape[dim + 1 :]])


@_op("slice")
def _slice(c: _Capture, a: dict[str, Any]) -> Any:
    """``x[start:end:step]`` along ``dim``; a stepped slice of a band materialises it."""
    x, dim = a["self"], a["dim"]
    size = _shape(x)[dim]
    start, stop, step = slice(a.get("start"), a.get("end"), a.get("step") or 1).indices(size)
    if stop <= start:
        raise GraphError(f"slice [{start}:{stop}] of axis {dim} (size {size}) is empty")
    if step != 1:
        return _strided(c.t(x), dim % len(_shape(x)), start, step, len(range(start, stop, step)))
    return _sliced(c, x, dim, start, stop)


def _spread(grad: Tensor, dim: int, start: int, step: int, size: int) -> Tensor:
    """Zeros ``size`` long on ``dim`` holding ``grad``'s ``i``-th element at ``start + step * i``:
    ``grad`` viewed as ``(count, 1)``, zero-padded to ``(count, step)``, flattened, then shifted
    by ``start`` zeros and cut or padded to ``size``."""
    shape = list(grad.shape)
    count = shape[dim]
    if step != 1:
        columns = [(0, 0)] * (grad.ndim + 1)
        columns[dim + 1] = (0, step - 1)
        grad = grad.reshape([*shape[:dim], count, 1, *shape[dim + 1 :]]).pad(columns)
        grad = grad.reshape([*shape[:dim], count * step, *shape[dim + 1 :]])
    end = start + count * step
    pairs = [(0, 0)] * grad.ndim
    pairs[dim] = (start, max(size - end, 0))
    grad = grad.pad(pairs)
    stops = list(grad.shape)
    stops[dim] = size
    return grad.slice([0] * grad.ndim, stops)


@_op("slice_scatter")
def _slice_scatter(c: _Capture, a: dict[str, Any]) -> Any:
    """``self`` with its slice ``[start:end]`` along ``dim`` replaced by ``src`` (a write into a
    slice, functionalised): ``self``'s parts around the slice and ``src``, concatenated. Only a
    contiguous slice (:func:`lowers_node`)."""
    x = c.t(a["self"])
    dim = a.get("dim", 0) % x.ndim
    size = x.shape[dim]
    start, stop, step = slice(a.get("start"), a.get("end"), a.get("step") or 1).indices(size)
    if step != 1:
        raise GraphError(f"slice_scatter with step {step} into axis {dim} of {x.shape}: only a step of 1 lowers")
    pieces = [_sliced(c, x, dim, 0, start)] if start > 0 else []
    pieces.append(c.t(a["src"]).cast(x.dtype))
    pieces += [_sliced(c, x, dim, stop, size)] if stop < size else []
    return cat(pieces, axis=dim) if len(pieces) > 1 else pieces[0]


@_op("copy")
def _copy(c: _Capture, a: dict[str, Any]) -> Any:
    """``src`` written over all of ``self`` (``self.copy_(src)``, functionalised): ``src`` broadcast to
    ``self``'s shape; the dtype is the reconciliation cast's after each op."""
    shape, src = tuple(_shape(a["self"])), c.t(a["src"])
    return src if tuple(src.shape) == shape else src.broadcast_to(shape)


@_op("slice_backward")
def _slice_backward(c: _Capture, a: dict[str, Any]) -> Any:
    """A slice's gradient (a training graph's backward): its output's gradient placed at the slice
    in zeros of the sliced tensor's shape."""
    grad, sizes, dim = c.t(a["grad_output"]), list(a["input_sizes"]), a["dim"]
    dim = dim % len(sizes)
    start, _, step = slice(a.get("start"), a.get("end"), a.get("step") or 1).indices(sizes[dim])
    return _spread(grad, dim, start, step, sizes[dim])


@_op("diff")
def _diff(c: _Capture, a: dict[str, Any]) -> Any:
    """``x[1:] − x[:-1]`` along ``dim`` (first differences, ``n = 1``), of ``x`` between ``prepend``
    and ``append`` where given (transformers finds packed sequences in position ids so)."""
    if a.get("n", 1) != 1:
        raise GraphError(f"diff with n={a['n']} is not supported; valid: n=1 (apply it again for more)")
    x = c.t(a["self"])
    dim = a.get("dim", -1) % x.ndim
    pieces = [c.t(p).cast(x.dtype) for p in (a.get("prepend"), x, a.get("append")) if p is not None]
    x = cat(pieces, axis=dim) if len(pieces) > 1 else x
    size = x.shape[dim]
    if size < 2:
        raise GraphError(f"diff along axis {dim} of size {size}: valid for 2 or more elements")
    return _sliced(c, x, dim, 1, size) - _sliced(c, x, dim, 0, size - 1)


@_op("narrow")
def _narrow(c: _Capture, a: dict[str, Any]) -> Any:
    x, dim = a["self"], a["dim"]
    start = a["start"] % _shape(x)[dim]
    return _sliced(c, x, dim, start, start + a["length"])


def _select(c: _Capture, x: Any, dim: int, index: int) -> Any:
    shape = _shape(x)
    dim %= len(shape)
    index %= shape[dim]
    if isinstance(x, _Band) and dim < len(shape) - 2:
        return replace(x, shape=shape[:dim] + shape[dim + 1 :])
    piece = c.t(_sliced(c, x, dim, index, index + 1))
    return piece.reshape(*shape[:dim], *shape[dim + 1 :])


@_op("select")
def _select_op(c: _Capture, a: dict[str, Any]) -> Any:
    return _select(c, a["self"], a["dim"], a["index"])


@_op("unbind")
def _unbind(c: _Capture, a: dict[str, Any]) -> Any:
    x, dim = a["self"], a["dim"]
    return [_select(c, x, dim, i) for i in range(_shape(x)[dim])]


def _split_by_sizes(c: _Capture, x: Any, sizes: Sequence[int], dim: int) -> list[Any]:
    pieces, offset = [], 0
    for size in sizes:
        pieces.append(_sliced(c, x, dim, offset, offset + size))
        offset += size
    return pieces


@_op("split.Tensor")
def _split(c: _Capture, a: dict[str, Any]) -> Any:
    x, dim, step = a["self"], a["dim"], a["split_size"]
    total = _shape(x)[dim]
    return _split_by_sizes(c, x, [min(step, total - s) for s in range(0, total, step)], dim)


@_op("split_with_sizes")
def _split_sizes(c: _Capture, a: dict[str, Any]) -> Any:
    return _split_by_sizes(c, a["self"], a["split_sizes"], a["dim"])


@_op("chunk")
def _chunk(c: _Capture, a: dict[str, Any]) -> Any:
    x, dim = a["self"], a["dim"]
    total = _shape(x)[dim]
    step = -(-total // a["chunks"])
    return _split_by_sizes(c, x, [min(step, total - s) for s in range(0, total, step)], dim)


@_op("cat", "concat", "concatenate")
def _cat(c: _Capture, a: dict[str, Any]) -> Any:
    dtype = _value_dtype(c.node.meta["val"].dtype, c.where_())
    pieces = [c.t(t).cast(dtype) for t in a["tensors"]]
    return cat(pieces, axis=a["dim"]) if len(pieces) > 1 else pieces[0]


@_op("roll")
def _roll(c: _Capture, a: dict[str, Any]) -> Any:
    """``torch.roll``: along each dim, the last ``shift`` entries moved to the front (the two slices concatenated);
    with no dims, the flattened tensor rolled and its shape restored."""
    x = c.t(a["self"])
    shifts, dims = list(a["shifts"]), list(a.get("dims") or ())
    if not dims:
        if len(shifts) != 1:
            raise GraphError(f"roll: {len(shifts)} shifts {tuple(shifts)} without dims on shape {x.shape}; "
                             "valid: one shift, or one dim per shift")  # fmt: skip
        return _rolled(x.reshape(-1), shifts, [0]).reshape(*x.shape)
    if len(shifts) != len(dims):
        raise GraphError(f"roll: shifts {tuple(shifts)} and dims {tuple(dims)} on shape {x.shape}; "
                         "valid: one dim a shift")  # fmt: skip
    return _rolled(x, shifts, [d % x.ndim for d in dims])


def _rolled(x: Tensor, shifts: Sequence[int], dims: Sequence[int]) -> Tensor:
    """``x`` rolled by each shift along its dim: the slice from ``n − shift mod n`` concatenated before the rest."""
    for shift, dim in zip(shifts, dims):
        n = x.shape[dim]
        cut = n - int(shift) % n if n else 0
        if 0 < cut < n:
            starts, stops = [0] * x.ndim, list(x.shape)
            head = x.slice(starts[:dim] + [cut] + starts[dim + 1:], stops)
            tail = x.slice(starts, stops[:dim] + [cut] + stops[dim + 1:])
            x = cat([head, tail], axis=dim)
    return x


@_op("stack")
def _stack(c: _Capture, a: dict[str, Any]) -> Any:
    pieces = [c.t(t) for t in a["tensors"]]
    dim = a["dim"] % (pieces[0].ndim + 1)
    dtype = _value_dtype(c.node.meta["val"].dtype, c.where_())
    pieces = [p.cast(dtype).unsqueeze(dim) for p in pieces]
    return cat(pieces, axis=dim) if len(pieces) > 1 else pieces[0]


@_op("repeat_interleave.self_int")
def _repeat_interleave(c: _Capture, a: dict[str, Any]) -> Any:
    x, repeats, dim = c.t(a["self"]), a["repeats"], a.get("dim")
    if dim is None:
        x, dim = x.reshape(-1), 0
    dim %= x.ndim
    grown = x.unsqueeze(dim + 1)
    target = list(grown.shape)
    target[dim + 1] = repeats
    merged = list(x.shape)
    merged[dim] *= repeats
    return grown.expand(*target).reshape(*merged)


@_op("repeat")
def _repeat(c: _Capture, a: dict[str, Any]) -> Any:
    x, repeats = c.t(a["self"]), list(a["repeats"])
    x = x.reshape(*([1] * (len(repeats) - x.ndim)), *x.shape)
    for axis, count in enumerate(repeats):
        if count != 1:
            grown = x.unsqueeze(axis)
            target = list(grown.shape)
            target[axis] = count
            shape = list(x.shape)
            shape[axis] *= count
            x = grown.expand(*target).reshape(*shape)
    return x


@_op("constant_pad_nd", "pad")
def _pad(c: _Capture, a: dict[str, Any]) -> Any:
    if a.get("mode", "constant") != "constant":
        raise GraphError(f"pad mode {a['mode']!r} is not supported; only 'constant'")
    x, flat = c.t(a["self"]), list(a["pad"])
    value = a.get("value") or 0.0
    pairs = [(0, 0)] * x.ndim
    for i in range(len(flat) // 2):
        pairs[x.ndim - 1 - i] = (flat[2 * i], flat[2 * i + 1])
    starts = [max(-lo, 0) for lo, _ in pairs]
    stops = [size - max(-hi, 0) for size, (_, hi) in zip(x.shape, pairs)]
    x = x.slice(starts, stops)  # negative padding crops
    grow = [(max(lo, 0), max(hi, 0)) for lo, hi in pairs]
    return x.pad(grow, float(value)) if any(lo or hi for lo, hi in grow) else x


@_op("tril", "triu")
def _tril(c: _Capture, a: dict[str, Any]) -> Any:
    lower = c.base == "tril"
    x, diagonal = a["self"], a.get("diagonal") or 0
    # tril keeps b - a <= diagonal; triu keeps b - a >= diagonal, i.e. drops b - a <= diagonal - 1
    offset = diagonal if lower else diagonal - 1
    if isinstance(x, Tensor) and x.ndim >= 2 and _fill_value(x) is not None:
        value, zero = _fill_value(x), {"bool": False, "int32": 0}.get(x.dtype, 0.0)
        inside, outside = (value, zero) if lower else (zero, value)
        return _Band(x.shape, offset, inside, outside, x.dtype)
    x = c.t(x)
    query = c.g.arange(x.shape[-2]).unsqueeze(-1)
    above = (query + offset if offset else query) < c.g.arange(x.shape[-1])
    zero = {"bool": False, "int32": 0}.get(x.dtype, 0.0)
    return where(above, zero, x) if lower else where(above, x, zero)


# ----------------------------------------------------------------------------- constants


def _full(c: _Capture, value: Any, shape: Sequence[int]) -> Any:
    meta = c.node.meta["val"]
    dtype = _value_dtype(meta.dtype, c.where_())
    fill = c.g.constant(value, dtype)
    shape = tuple(int(d) for d in shape)
    return fill.broadcast_to(shape) if shape else fill


@_op("full", "new_full")
def _full_op(c: _Capture, a: dict[str, Any]) -> Any:
    return _full(c, a["fill_value"], a["size"])


@_op("ones", "new_ones")
def _ones(c: _Capture, a: dict[str, Any]) -> Any:
    return _full(c, 1, a["size"])


@_op("zeros", "new_zeros")
def _zeros(c: _Capture, a: dict[str, Any]) -> Any:
    return _full(c, 0, a["size"])


@_op("empty", "new_empty", "empty_like", "empty_strided", "new_empty_strided")
def _empty(c: _Capture, a: dict[str, Any]) -> Any:
    """A tensor of unspecified values, the destination a copy or a scatter then writes (a query
    assembled in place): zeros."""
    return _full(c, 0, a["size"] if "size" in a else _shape(a["self"]))


@_op("full_like")
def _full_like(c: _Capture, a: dict[str, Any]) -> Any:
    return _full(c, a["fill_value"], _shape(a["self"]))


@_op("ones_like")
def _ones_like(c: _Capture, a: dict[str, Any]) -> Any:
    return _full(c, 1, _shape(a["self"]))


@_op("zeros_like")
def _zeros_like(c: _Capture, a: dict[str, Any]) -> Any:
    return _full(c, 0, _shape(a["self"]))


@_op("scalar_tensor")
def _scalar_tensor(c: _Capture, a: dict[str, Any]) -> Any:
    return _full(c, a["s"], ())


@_op("arange")
def _arange(c: _Capture, a: dict[str, Any]) -> Any:
    meta = c.node.meta["val"]
    (count,) = (int(d) for d in meta.shape)
    start, step = a.get("start") or 0, a.get("step") or 1
    dtype = _value_dtype(meta.dtype, c.where_())
    values = c.g.arange(count)
    if dtype != "int32":
        values = values.cast(dtype)
    if step != 1:
        values = values * step
    return values + start if start else values


# ----------------------------------------------------------------------------- detection


BAKED_BUFFER_PREFIX = "ck_band_"
"""The names of the buffers holding the constants the Dynamo backend folded and bakes into a
region (their values are the graph's at every call: one value everywhere is a band too, where a
module's own buffer of one value, a zeroed KV cache, may change)."""


def is_band(tensor: Any, uniform: bool = False) -> bool:
    """Whether ``tensor``'s values are a band (:func:`_detect_band`): a tril/triu mask, or a
    sliding window's (``uniform``: or one value everywhere)."""
    return _detect_band(tensor, uniform) is not None


@dataclass(frozen=True)
class _ScalarConstant:
    """A one-element tensor the program holds as a constant (a lifted ``torch.tensor(x)``: GPT-Neo's mask
    value, ``finfo(float32).min``; or a baked buffer): a constant of the graph, not an input, so that the
    rules see its value (a mask's minimum must be at most −2¹³ for the flash forms)."""

    value: bool | int | float
    dtype: str
    shape: tuple[int, ...]

    def tensor(self, graph: Graph) -> Tensor:
        constant = graph.constant(self.value, self.dtype)
        return constant.broadcast_to(self.shape) if self.shape else constant


def _scalar_constant(tensor: Any) -> _ScalarConstant | None:
    """``tensor`` as a :class:`_ScalarConstant` if it has one element of a dtype a graph constant takes
    (not NaN), else None."""
    dtype = _VALUE_DTYPES.get(_dtype_name(tensor.dtype))
    if tensor.numel() != 1 or dtype is None or tensor.is_complex():
        return None
    value = tensor.detach().cpu().reshape(()).item()
    if isinstance(value, float) and math.isnan(value):
        return None
    return _ScalarConstant(_python_value(value, dtype), dtype, tuple(tensor.shape))


def _detect_band(tensor: Any, uniform: bool = False) -> _Band | None:
    """A band if ``tensor``'s values are exactly ``tril``/``triu`` of two values (ones and
    zeros, or an additive mask's zeros and −∞; any diagonal, identical over the leading
    axes), or a sliding window of them (``tril(offset) − tril(lower)``: the inside value
    between two diagonals), or (``uniform``) one value everywhere (the mask transformers 5.17
    builds for a bidirectional layer without padding: all true, or all zeros), else None."""
    import torch

    if tensor.ndim < 2 or tensor.numel() == 0 or tensor.is_complex():
        return None
    name = _dtype_name(tensor.dtype)
    if name not in _VALUE_DTYPES:
        return None
    values = tensor.detach().cpu()
    at_first = values == values.reshape(-1)[0]
    others = values[~at_first]
    rows, cols = values.shape[-2:]
    dtype = _VALUE_DTYPES[name]
    first = _python_value(values.reshape(-1)[0].item(), dtype)
    if others.numel() == 0:  # one value everywhere (a mask that hides nothing): the band without edges
        return _Band(tuple(values.shape), cols - 1, first, first, dtype) if uniform else None
    if not bool((others == others[0]).all()):
        return None  # not two values, each somewhere
    second = _python_value(others[0].item(), dtype)
    ones = torch.ones(rows, cols, dtype=torch.bool)
    for kept, inside, outside in ((at_first, first, second), (~at_first, second, first)):
        counts = kept.reshape(-1, rows, cols)[0].sum(-1)
        partial = [r for r in range(rows) if 0 < int(counts[r]) < cols]
        if not partial:
            continue
        offset = int(counts[partial[0]]) - 1 - partial[0]
        if torch.equal(kept, ones.tril(offset).expand(kept.shape)):
            return _Band(tuple(values.shape), offset, inside, outside, dtype)
        window = _window_edges(kept.reshape(-1, rows, cols)[0])
        if window is None:
            continue
        offset, lower = window
        if torch.equal(kept, (ones.tril(offset) & ~ones.tril(lower)).expand(kept.shape)):
            return _Band(tuple(values.shape), offset, inside, outside, dtype, lower)
    return None


def _window_edges(kept: Any) -> tuple[int, int] | None:
    """``(offset, lower)`` of a window that ``kept`` (rows × keys, bool) may be, ``lower < b − a <= offset``:
    the last key a row keeps short of the last column, and the first it keeps past column 0; None
    where no row keeps a run of keys that starts past column 0."""
    rows, cols = kept.shape
    highs = [int(row.nonzero().max()) - r for r, row in enumerate(kept) if row.any() and not row[-1]]
    lows = [int(row.nonzero().min()) - r - 1 for r, row in enumerate(kept) if row.any() and not row[0]]
    if not lows:
        return None
    return (highs[0] if highs else cols - 1, lows[0])


# ----------------------------------------------------------------------------- entry point


def _mutates(node: Any) -> bool:
    schema = getattr(node.target, "_schema", None)
    return node.op == "call_function" and schema is not None and schema.is_mutable


def _wrap(fn: Callable[..., Any]) -> Any:
    import torch

    class FunctionModule(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fn = fn

        def forward(self, *args: Any) -> Any:
            return self.fn(*args)

    return FunctionModule()


def _argument_names(fn: Callable[..., Any], count: int) -> list[str]:
    """Names for ``count`` positional arguments from ``fn``'s signature (``arg{i}`` fallback)."""
    target = fn.forward if hasattr(fn, "forward") and not inspect.isfunction(fn) else fn
    try:
        parameters = list(inspect.signature(target).parameters.values())
    except (TypeError, ValueError):
        return [f"arg{i}" for i in range(count)]
    names: list[str] = []
    for p in parameters:
        if len(names) == count:
            break
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
            names.append(p.name)
        elif p.kind == p.VAR_POSITIONAL:
            names.extend(f"{p.name}_{i}" for i in range(count - len(names)))
    names.extend(f"arg{i}" for i in range(len(names), count))
    return names


def _graph_name(fn: Any, name: str | None) -> str:
    if name is not None:
        return name
    import torch

    text = type(fn).__name__ if isinstance(fn, torch.nn.Module) else getattr(fn, "__name__", "torch")
    text = str(text)
    return text if text.isprintable() and 0 < len(text) <= 200 else "torch"


def from_torch(fn: Callable[..., Any], *example_tensors: Any, name: str | None = None) -> Graph:
    """Capture ``fn`` (an ``nn.Module`` or a function of tensors) called on ``example_tensors``
    as a :class:`Graph` of primitives, with ``torch.export``; see the module docstring for
    the naming, dtype and constant-buffer rules. ``name`` names the graph (default: the
    module's class or the function's name)."""
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is an optional dependency
        raise GraphError("from_torch: PyTorch is not installed; pip install 'cherenkov[torch]'") from None

    if not callable(fn):
        raise GraphError(f"from_torch: expected an nn.Module or a function, got {type(fn).__name__}")
    for i, example in enumerate(example_tensors):
        if not isinstance(example, torch.Tensor):
            raise GraphError(
                f"from_torch: example argument {i} is a {type(example).__name__}; pass tensors only "
                "(bind other arguments with functools.partial or a lambda)"
            )
    module = fn if isinstance(fn, torch.nn.Module) else _wrap(fn)
    try:
        exported = torch.export.export(module, tuple(example_tensors), strict=False)
        if any(_mutates(node) for node in exported.graph.nodes):
            exported = exported.run_decompositions({})  # functionalise in-place ops, decompose nothing
    except Exception as error:  # noqa: BLE001 - torch raises many kinds; report them as one
        raise GraphError(f"from_torch: torch.export.export failed: {type(error).__name__}: {error}") from error

    signature = exported.graph_signature
    from torch.export.graph_signature import InputKind, OutputKind, TensorArgument

    mutated = {**signature.buffers_to_mutate, **signature.user_inputs_to_mutate}
    if mutated:
        raise GraphError(
            f"from_torch: the function mutates {sorted(mutated.values())} in place; cherenkov graphs are pure, "
            "return new tensors instead"
        )

    user_outputs = [i for i, spec in enumerate(signature.output_specs) if spec.kind == OutputKind.USER_OUTPUT]
    taken: set[str] = set()
    names = _argument_names(fn, len(example_tensors))
    user: list[tuple[str, str, Any]] = []  # (placeholder, input name, example)
    params: dict[str, _Param] = {}  # placeholder -> lazily declared input
    bands: dict[str, _Band] = {}
    scalars: dict[str, _ScalarConstant] = {}  # placeholder -> a constant of the graph
    order: list[str] = []  # parameter input names, in the module's order
    examples = iter(example_tensors)
    user_specs = [s for s in signature.input_specs if s.kind == InputKind.USER_INPUT]
    if len(user_specs) != len(example_tensors):
        raise GraphError(
            f"from_torch: the exported program has {len(user_specs)} tensor inputs for "
            f"{len(example_tensors)} example tensors"
        )
    for spec, arg_name in zip(user_specs, names):
        user.append((spec.arg.name, sanitize_name(arg_name, taken), next(examples)))
    for spec in signature.input_specs:
        if spec.kind == InputKind.USER_INPUT:
            continue
        if spec.kind not in (InputKind.PARAMETER, InputKind.BUFFER, InputKind.CONSTANT_TENSOR) or not isinstance(
            spec.arg, TensorArgument
        ):
            raise GraphError(f"from_torch: exported input {spec.arg} of kind {spec.kind.name} is not supported")
        value = exported.state_dict.get(spec.target)
        if value is None:
            value = exported.constants[spec.target]
        if spec.kind != InputKind.PARAMETER:
            baked = spec.target.rsplit(".", 1)[-1].startswith(BAKED_BUFFER_PREFIX)
            scalar = _scalar_constant(value) if baked or spec.kind == InputKind.CONSTANT_TENSOR else None
            if scalar is not None:
                scalars[spec.arg.name] = scalar
                continue
            band = _detect_band(value, uniform=baked)
            if band is not None:
                bands[spec.arg.name] = band
                continue
        what = {InputKind.PARAMETER: "parameter", InputKind.BUFFER: "buffer"}.get(spec.kind, "constant tensor")
        param = _Param(sanitize_name(spec.target.replace(".", "_"), taken), value, what)
        params[spec.arg.name] = param
        order.append(param.name)

    def build(keep: list[str] | None) -> tuple[Graph, _Capture]:
        graph = Graph(_graph_name(fn, name))
        inputs: dict[str, Tensor] = {}
        for placeholder, input_name, example in user:
            dtype = _input_dtype(example.dtype, f"argument {input_name!r}")
            inputs[placeholder] = graph.input(input_name, tuple(example.shape), dtype)
        declared: dict[str, Tensor] = {}
        capture = _Capture(graph, params, declared, None if isinstance(fn, torch.nn.Module) else fn)
        capture.user_outputs = user_outputs
        by_name = {p.name: p for p in params.values()}
        for param_name in keep or ():
            capture.declare(by_name[param_name])
        constants = {placeholder: scalar.tensor(graph) for placeholder, scalar in scalars.items()}
        outputs = capture.run(exported, inputs, {**params, **bands, **constants})
        for i, value in enumerate(outputs):
            if not isinstance(value, (Tensor, _Param, _Band, _Unsupported)):
                raise GraphError(f"from_torch: output {i} is {value!r}, not a tensor; return tensors only")
            graph.output(capture.t(value), "out" if len(outputs) == 1 else f"out{i}")
        return graph, capture

    _, first = build(None)
    read = set(first.read)
    graph, _ = build([n for n in order if n in read])
    for position, (placeholder, input_name, example) in enumerate(user):
        graph._examples[input_name] = _to_numpy(example)
        graph._sources[input_name] = f"arg:{position}"
    targets = {spec.arg.name: spec.target for spec in signature.input_specs if spec.kind != InputKind.USER_INPUT}
    for placeholder, param in params.items():
        if param.name in graph.inputs:
            graph._examples[param.name] = _to_numpy(param.tensor)
            graph._sources[param.name] = targets[placeholder]
    return graph
