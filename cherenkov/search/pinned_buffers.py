"""Module buffers a Dynamo graph reads as constants, and the check that each call still passes them.

Dynamo lifts a module's buffers as graph inputs (``L['self']._modules[…]._buffers['bias']``): a
GPT-Neo or nanoGPT layer's causal mask is such a buffer, ``tril(ones(n, n))`` sliced to the
sequence each call. As an input, its values are unknown to the backend, so the band the slice
forms cannot be folded into the flash kernels' causal mask. The backend reads those buffers as
constants while it folds the graph's bands (:func:`pin_buffers`, then :func:`unpin_unfolded`,
which gives back every buffer no band was folded from); the compiled graph is then right only
while each call passes the same buffer, unchanged. :class:`PinnedBuffers` checks exactly that
before every call (the tensor's storage and its version counter, which every in-place write
bumps); a call that fails it runs, from then on, a graph compiled again without pinning. In a
training step the same buffers are pinned in AOTAutograd's forward and backward graphs, whose
inputs ``primals_<n>`` are Dynamo's n-th (``dynamo._aot_buffers``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger(__name__)

PINNED_BUFFER_PREFIX = "ck_pinned_"
BUFFER_SOURCE = "._buffers["
"""What the name of a Dynamo input's source holds when the input is a module's buffer."""


def module_buffers(gm: Any, example_inputs: Sequence[Any]) -> dict[int, Any]:
    """The positions of ``gm``'s inputs that Dynamo lifted from a module's buffers and that need no
    gradient, with their tensors (a graph AOTAutograd made has no such record: none)."""
    import torch

    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    found = {}
    for i, (node, value) in enumerate(zip(placeholders, example_inputs)):
        source = getattr(node.meta.get("grapharg"), "source", None)
        name = getattr(source, "name", "")
        name = name() if callable(name) else name
        if isinstance(value, torch.Tensor) and not value.requires_grad and BUFFER_SOURCE in str(name):
            found[i] = value
    return found


@dataclass(frozen=True)
class Pin:
    """A buffer read as a constant: the node reading it, and the nodes that depended on it before folding."""

    attribute: Any
    reach: frozenset[Any]


def _reach(node: Any) -> frozenset[Any]:
    """The nodes that read ``node``, directly or through others."""
    seen: set[Any] = set()
    stack = list(node.users)
    while stack:
        user = stack.pop()
        if user not in seen:
            seen.add(user)
            stack.extend(user.users)
    return frozenset(seen)


def pin_buffers(aten: Any, buffers: Mapping[int, Any]) -> dict[int, Pin]:
    """Every read of ``aten``'s input at a position of ``buffers`` made a read of that tensor,
    registered as a buffer of ``aten``; returns the reading nodes by position."""
    placeholders = [n for n in aten.graph.nodes if n.op == "placeholder"]
    first_op = next(n for n in aten.graph.nodes if n.op != "placeholder")
    pins = {}
    for i, tensor in buffers.items():
        node = placeholders[i]
        if not node.users:
            continue
        name = f"{PINNED_BUFFER_PREFIX}{i}"
        aten.register_buffer(name, tensor)
        with aten.graph.inserting_before(first_op):
            attribute = aten.graph.get_attr(name)
        attribute.meta["val"] = node.meta.get("val")
        node.replace_all_uses_with(attribute)
        pins[i] = Pin(attribute, _reach(attribute))
    return pins


def unpin_unfolded(aten: Any, pins: Mapping[int, Pin], buffers: Mapping[int, Any]) -> PinnedBuffers | None:
    """The reads of :func:`pin_buffers` that folding left in ``aten`` read its inputs again, and their
    buffers are dropped; the buffers a fold used (a node that depended on one no longer does: it reads
    a folded constant now) are the compiled graph's :class:`PinnedBuffers` (None: none)."""
    placeholders = [n for n in aten.graph.nodes if n.op == "placeholder"]
    alive = set(aten.graph.nodes)
    pinned = {}
    for i, pin in pins.items():
        reach = _reach(pin.attribute) if pin.attribute in alive else frozenset()
        if any(node in alive and node not in reach for node in pin.reach):
            pinned[i] = buffers[i]
        if pin.attribute in alive:
            pin.attribute.replace_all_uses_with(placeholders[i])
            aten.graph.erase_node(pin.attribute)
        delattr(aten, pin.attribute.target)
    aten.recompile()
    return PinnedBuffers(pinned) if pinned else None


@dataclass
class PinnedBuffers:
    """The inputs (by position) a compiled graph folded as constants: each call must pass the same
    tensor (storage, shape and strides; a reference is held, so no other tensor can take its
    storage) at the version it had then."""

    tensors: dict[int, Any]
    versions: dict[int, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.versions = {i: t._version for i, t in self.tensors.items()}

    def hold(self, args: Sequence[Any]) -> bool:
        """Whether ``args`` pass every pinned buffer as it was."""
        for i, tensor in self.tensors.items():
            x = args[i]
            same = x is tensor or (x.data_ptr() == tensor.data_ptr() and x.shape == tensor.shape
                                   and x.stride() == tensor.stride())  # fmt: skip
            if not same or x._version != self.versions[i]:
                return False
        return True

    def guard(self, run: Callable[..., Any],
              recompile: Callable[[Sequence[Any]], Callable[..., Any]]) -> Callable[..., Any]:  # fmt: skip
        """``run``, called while :meth:`hold` holds; on the first call it does not, ``recompile``'s
        graph (compiled on that call's inputs, without pinning) instead, from then on."""
        replacement: list[Callable[..., Any]] = []

        def guarded(*args: Any) -> Any:
            if not replacement and self.hold(args):
                return run(*args)
            if not replacement:
                log.warning("cherenkov backend: a module buffer the graph read as a constant (input %s) changed or "
                            "was replaced; the graph is compiled again with it as an input",
                            ", ".join(map(str, self.tensors)))  # fmt: skip
                replacement.append(recompile(args))
            return replacement[0](*args)

        return guarded
