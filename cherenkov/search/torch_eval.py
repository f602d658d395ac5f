"""Index-notation terms evaluated with torch on the GPU: the reference measured kernels are
checked against.

The evaluator is :mod:`cherenkov.rewrites.reference`'s (one definition of every
constructor) on the torch :class:`TorchArrays` backend, with the fused forms in one block
(their definitions: ``m = max s``, ``l = Σ e^{s−m}``, ``acc = Σ e^{s−m}·v``; LayerNorm by
the mean and the biased variance). ``dtype`` is the working precision (``torch.float32`` by
default; ``torch.float64`` for checking fp32 kernels tightly). torch is imported on first use.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from cherenkov.rewrites import terms as t
from cherenkov.rewrites.reference import Arrays, evaluate_with

TORCH_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


class TorchArrays(Arrays):
    """torch tensors of one float dtype on one device."""

    def __init__(self, dtype: Any, device: Any) -> None:
        import torch

        self.xp = torch
        self.dtype = dtype
        self.device = device

    def full(self, shape: tuple[int, ...], value: float) -> Any:
        return self.xp.full(shape, float(value), dtype=self.dtype, device=self.device)

    def full_index(self, shape: tuple[int, ...], value: int) -> Any:
        return self.xp.full(shape, value, dtype=self.xp.int64, device=self.device)

    def arange(self, n: int) -> Any:
        return self.xp.arange(n, device=self.device)

    def to_float(self, x: Any) -> Any:
        return x.to(self.dtype)

    def cast(self, x: Any, dtype: str) -> Any:
        if dtype in TORCH_DTYPES:
            return x.to(getattr(self.xp, TORCH_DTYPES[dtype])).to(self.dtype)
        if dtype == "int32":
            return self.xp.trunc(x)
        return (x != 0).to(self.dtype)

    def reduce(self, x: Any, dim: int, how: str) -> Any:
        return x.amax(dim=dim, keepdim=True) if how == "max" else x.sum(dim=dim, keepdim=True)

    def expand(self, x: Any, shape: list[int]) -> Any:
        return x.expand(shape)

    def arrange(self, x: Any, shape: list[int], order: list[int], final: list[int]) -> Any:
        return x.expand(shape).permute(order).reshape(final).contiguous()


def evaluate_term_torch(term: t.Term, inputs: Mapping[str, Any], axes: tuple[str, ...], dtype: Any = None) -> Any:
    """The value of ``term`` as a tensor over ``axes`` (in that order, shaped by their
    extents), computed in ``dtype`` (default float32) on the inputs' device."""
    import torch

    device = next((x.device for x in inputs.values()), torch.device("cuda"))
    arrays = TorchArrays(dtype or torch.float32, device)
    return evaluate_with(arrays, term, inputs, axes, {a: t.extent(a) for a in axes}, fold_block=None)


def evaluate_kernel_torch(kernel: Any, inputs: Mapping[str, Any], dtype: Any = None) -> Any:
    """A fused kernel's output buffer: its term over its axes, laid out as its ``buffer``
    says where that is not row-major (a flash output laid out for its consumer)."""
    import torch

    values = evaluate_term_torch(kernel.term, inputs, kernel.axes, dtype)
    if kernel.buffer is None:
        return values
    stored = torch.zeros(kernel.buffer.shape, dtype=values.dtype, device=values.device)
    torch.as_strided(stored, kernel.shape, kernel.buffer.strides).copy_(values)
    return stored
