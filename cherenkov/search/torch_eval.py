"""Index-notation terms evaluated with torch on the GPU: the reference measured kernels are
checked against.

A port of :mod:`cherenkov.rewrites.reference` (the float64 NumPy ground truth): every value
is a tensor with one dimension per axis name of the term (size 1 where it does not vary),
so broadcasting does the index bookkeeping. ``Contract`` goes through ``torch.einsum`` over
the operands' varying axes, so a matmul never materialises ``M·N·K`` products; the other
binders reduce a broadcast body. The fused forms are evaluated by their definitions (the
reference's blocked streaming is the same arithmetic up to rounding): softmax folds as
``m = max s``, ``l = Σ e^{s−m}`` (0 where ``m`` is infinite), ``acc = Σ e^{s−m}·v``;
LayerNorm rows by the mean and the biased variance. ``dtype`` is the working precision
(``torch.float32`` by default; ``torch.float64`` for checking fp32 kernels tightly).
torch is imported on first use.
"""

from __future__ import annotations

import string
from collections.abc import Mapping
from typing import Any

from cherenkov.rewrites import terms as t
from cherenkov.rewrites.reference import axis_names
from cherenkov.rewrites.terms import Term

Env = frozenset


class _TorchEvaluator:
    def __init__(self, inputs: Mapping[str, Any], names: list[str], dtype: Any, device: Any) -> None:
        import torch

        self.torch = torch
        self.inputs = inputs
        self.position = {name: i for i, name in enumerate(names)}
        self.rank = len(names)
        self.dtype = dtype
        self.device = device
        self.memo: dict[tuple[Term, Env], Any] = {}

    def scalar(self, value: float) -> Any:
        return self.torch.full((1,) * self.rank, float(value), dtype=self.dtype, device=self.device)

    def index(self, ix: Term, env: Mapping[str, int]) -> Any:
        torch = self.torch
        head = ix[0]
        if head == "Ax":
            shape = [1] * self.rank
            shape[self.position[ix[1]]] = env[ix[1]]
            return torch.arange(env[ix[1]], device=self.device).reshape(shape)
        if head == "IxLit":
            return torch.full((1,) * self.rank, ix[1], dtype=torch.int64, device=self.device)
        if head == "IxAdd":
            return self.index(ix[1], env) + ix[2]
        if head == "IxDiv":
            return torch.div(self.index(ix[1], env), ix[2], rounding_mode="floor")
        if head == "IxMod":
            return torch.remainder(self.index(ix[1], env), ix[2])
        if head == "IxLin":
            return self.index(ix[1], env) * ix[2] + self.index(ix[3], env)
        raise ValueError(f"not an index term: {ix}")

    def along(self, value: Any, axis: str, extent: int) -> Any:
        shape = list(value.shape)
        shape[self.position[axis]] = extent
        return value.expand(shape)

    def value(self, term: Term, env: Mapping[str, int]) -> Any:
        key = (term, Env(env.items()))
        if key not in self.memo:
            self.memo[key] = self._value(term, env)
        return self.memo[key]

    def _value(self, term: Term, env: Mapping[str, int]) -> Any:
        torch = self.torch
        head, args = term[0], term[1:]
        v = self.value
        match head:
            case "Tensor":
                array = self.inputs[args[0]]
                items = t.ix_items(args[1])
                if len(items) != array.ndim:
                    raise ValueError(f"{args[0]} has {array.ndim} axes but is indexed with {len(items)}")
                if not items:
                    return array.reshape((1,) * self.rank).to(self.dtype)
                index = tuple(self.index(ix, env).clamp(0, size - 1) for ix, size in zip(items, array.shape))
                return array[index].to(self.dtype)
            case "Num" | "Flag":
                return self.scalar(float(args[0]))
            case "Iota":
                return self.index(args[0], env).to(self.dtype)
            case "Cast":
                x = v(args[1], env)
                dtype = args[0]
                if dtype in ("bf16", "fp16", "fp32"):
                    target = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dtype]
                    return x.to(target).to(self.dtype)
                if dtype == "int32":
                    return torch.trunc(x)
                return (x != 0).to(self.dtype)
            case "Exp2":
                return torch.exp2(v(args[0], env))
            case "Exp":
                return torch.exp(v(args[0], env))
            case "Log2":
                return torch.log2(v(args[0], env))
            case "Sin":
                return torch.sin(v(args[0], env))
            case "Sqrt":
                return torch.sqrt(v(args[0], env))
            case "Recip":
                return 1.0 / v(args[0], env)
            case "Neg":
                return -v(args[0], env)
            case "Add":
                return v(args[0], env) + v(args[1], env)
            case "Mul":
                return v(args[0], env) * v(args[1], env)
            case "Mod":
                return torch.remainder(v(args[0], env), v(args[1], env))
            case "Lt":
                return (v(args[0], env) < v(args[1], env)).to(self.dtype)
            case "Maximum":
                return torch.maximum(v(args[0], env), v(args[1], env))
            case "Where":
                return torch.where(v(args[0], env) != 0, v(args[1], env), v(args[2], env))
            case "PadAxis":
                ix, lo, size, fill, body = args
                position = self.index(ix, env)
                inside = (position >= lo) & (position < lo + size)
                return torch.where(inside, v(body, env), self.scalar(fill))
            case "Sum" | "Max":
                axis, extent = args[0], args[1]
                body = self.along(v(args[2], {**env, axis: extent}), axis, extent)
                if head == "Sum":
                    return body.sum(dim=self.position[axis], keepdim=True)
                return body.amax(dim=self.position[axis], keepdim=True)
            case "Contract":
                axis, extent = args[0], args[1]
                inner = {**env, axis: extent}
                return self.contract(v(args[2], inner), v(args[3], inner), self.position[axis], extent)
            case "SoftmaxFoldL" | "SoftmaxFoldAcc" | "OnlineSoftmaxContract":
                axis, extent = args[0], args[1]
                inner = {**env, axis: extent}
                scores = self.along(v(args[2], inner), axis, extent)
                values = v(args[3], inner) if head != "SoftmaxFoldL" else None
                l, acc = self.fold(scores, values, self.position[axis])
                return {"SoftmaxFoldL": l, "SoftmaxFoldAcc": acc}.get(head, acc / l if acc is not None else l)
            case "SoftmaxRow":
                axis, extent, scores = args
                s = self.along(v(scores, {**env, axis: extent}), axis, extent)
                dim = self.position[axis]
                m = s.amax(dim=dim, keepdim=True)
                l, _ = self.fold(s, None, dim)
                return torch.exp(s - m) / l
            case "RmsNormRow":
                axis, extent, x, eps = args
                xv = self.along(v(x, {**env, axis: extent}), axis, extent)
                return xv / torch.sqrt((xv * xv).mean(dim=self.position[axis], keepdim=True) + eps)
            case "LayerNormRow":
                axis, extent, x, eps = args
                xv = self.along(v(x, {**env, axis: extent}), axis, extent)
                dim = self.position[axis]
                mean = xv.mean(dim=dim, keepdim=True)
                variance = ((xv - mean) ** 2).mean(dim=dim, keepdim=True)
                return (xv - mean) / torch.sqrt(variance + eps)
            case "FlashAttention":
                return self._flash(args, env)
            case "Scheduled":
                return v(args[0], env)
        raise ValueError(f"no torch semantics for {head}")

    def fold(self, s: Any, values: Any, dim: int) -> tuple[Any, Any]:
        """``(l, acc)`` of the online-softmax fold over ``dim`` (acc None without values)."""
        torch = self.torch
        m = s.amax(dim=dim, keepdim=True)
        live = torch.isfinite(m)
        p = torch.where(live, torch.exp(s - torch.where(live, m, torch.zeros_like(m))), torch.zeros_like(s))
        l = p.sum(dim=dim, keepdim=True)
        if values is None:
            return l, None
        return l, self.contract(p, values, dim, s.shape[dim])

    def contract(self, a: Any, b: Any, dim: int, extent: int) -> Any:
        """``Σ_dim a·b`` without materialising the broadcast product (einsum over the
        dimensions each operand varies along)."""
        torch = self.torch
        letters = string.ascii_letters
        if a.shape[dim] == 1 and b.shape[dim] == 1:
            return a * b * extent
        a_dims = [i for i, size in enumerate(a.shape) if size > 1]
        b_dims = [i for i, size in enumerate(b.shape) if size > 1]
        out_dims = sorted((set(a_dims) | set(b_dims)) - {dim})
        spec = (
            "".join(letters[i] for i in a_dims) + ","
            + "".join(letters[i] for i in b_dims) + "->"
            + "".join(letters[i] for i in out_dims)
        )  # fmt: skip
        result = torch.einsum(spec, a.reshape([a.shape[i] for i in a_dims]), b.reshape([b.shape[i] for i in b_dims]))
        shape = [1] * self.rank
        for i in out_dims:
            shape[i] = max(a.shape[i], b.shape[i])
        return result.reshape(shape)

    def _flash(self, args: tuple, env: Mapping[str, int]) -> Any:
        torch = self.torch
        key, n_keys, dim, n_dim, q, k, v, scale, mask = args
        over_keys = {**env, key: n_keys}
        over_both = {**over_keys, dim: n_dim}
        product = self.contract(self.value(q, over_both), self.value(k, over_both), self.position[dim], n_dim)
        scores = self.along(scale * product, key, n_keys)
        if mask[0] == "CausalMask":
            query_index = self.index(mask[1], over_keys)
            key_index = self.index(t.ax(key), over_keys)
            scores = torch.where(query_index < key_index, self.scalar(-float("inf")), scores)
        l, acc = self.fold(scores, self.value(v, over_keys), self.position[key])
        return acc / l


def evaluate_term_torch(term: Term, inputs: Mapping[str, Any], axes: tuple[str, ...], dtype: Any = None) -> Any:
    """The value of ``term`` as a tensor over ``axes`` (in that order, shaped by their
    extents), computed in ``dtype`` (default float32) on the inputs' device."""
    import torch

    dtype = dtype or torch.float32
    device = next((x.device for x in inputs.values()), torch.device("cuda"))
    names = sorted(axis_names(term) | set(axes))
    extents = {a: t.extent(a) for a in axes}
    evaluator = _TorchEvaluator(inputs, names, dtype, device)
    value = evaluator.value(term, extents)
    stray = [n for n in names if n not in axes and value.shape[evaluator.position[n]] != 1]
    if stray:
        raise ValueError(f"term varies along axes {stray} that are not among the requested {axes}")
    target = [extents[n] if n in axes else 1 for n in names]
    full = value.expand(target)
    order = [evaluator.position[a] for a in axes] + [evaluator.position[n] for n in names if n not in axes]
    return full.permute(order).reshape([extents[a] for a in axes]).contiguous()
