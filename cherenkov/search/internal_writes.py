"""In-place writes into a graph's own tensors, made functional before the backend partitions it.

transformers' DeepSeek attention assembles its query and key heads in place:
``q = k_pass.new_empty(...); q[..., :n] = q_pass; q[..., n:] = q_rot``. Traced to ATen ops that is
``copy_(slice(new_empty), src)``, and nothing but program order says the later reads of ``q`` come
after the writes: a partition that fuses the writes' sources with those reads (or hands a region
the slice to write into: a region's outputs are new tensors) computes from the unwritten buffer.
:func:`functionalise_internal_writes` replaces each such ``copy_`` through ``slice``/``select``
views of a tensor the graph creates by the scatter that computes the written tensor
(``slice_scatter(q, src, ...)``), and every later read of the tensor by a read of that result, so
data edges carry the order. A write into a graph input (a static KV cache's ``index_copy_``) is
left alone: its readers read the input itself, as is a write into a tensor no region can hold
(integer token ids being shifted). :func:`unordered_writes` names what is left of the first kind,
which the backend then does not partition.
"""

from __future__ import annotations

from typing import Any

from cherenkov.graph.torch_capture import takes_as_input


def _ops() -> tuple[Any, dict[Any, Any]]:
    import torch

    aten = torch.ops.aten
    return aten, {aten.slice.Tensor: aten.slice_scatter.default, aten.select.int: aten.select_scatter.default}


def is_view(node: Any) -> bool:
    """Whether ``node`` calls an ATen op whose result aliases its first argument (a view)."""
    import torch

    target = node.target
    if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
        return False
    returns = target._schema.returns
    return bool(returns) and returns[0].alias_info is not None and not returns[0].alias_info.is_write


def written_arguments(node: Any) -> list[Any]:
    """The nodes an ATen call ``node`` writes in place (its arguments marked ``Tensor(a!)``)."""
    import torch

    if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
        return []
    return [value for argument, value in zip(node.target._schema.arguments, node.args)
            if argument.alias_info is not None and argument.alias_info.is_write
            and isinstance(value, torch.fx.Node)]  # fmt: skip


def _base(node: Any) -> Any:
    """The tensor a chain of views starts from."""
    while is_view(node):
        node = node.args[0]
    return node


def _internal(node: Any) -> bool:
    """Whether ``node`` is a tensor the graph creates (not an input, attribute or view)."""
    return node.op == "call_function" and not is_view(node)


def functionalise_internal_writes(module: Any) -> int:
    """Rewrite ``module``'s ``copy_`` calls into ``slice``/``select`` views of tensors it creates as
    scatters (see the module docstring); returns how many it rewrote. A write it cannot rewrite
    (another view or op, a view read again after the write) stays, for :func:`unordered_writes`."""
    aten, scatters = _ops()
    graph = module.graph
    position = {node: i for i, node in enumerate(graph.nodes)}
    latest: dict[Any, Any] = {}  # a written base -> the node holding its current value
    rewritten = 0
    for write in list(graph.nodes):
        if write.target is not aten.copy_.default or write.users:
            continue
        target, source = write.args[0], write.args[1]
        chain = []
        while target.op == "call_function" and target.target in scatters:
            chain.append(target)
            target = target.args[0]
        base = target
        if not chain or not _internal(base) or _read_after(chain, write, position):
            continue
        with graph.inserting_before(write.next):
            value = _as_written(graph, source, chain[0], aten)
            views = [latest.get(base, base)]
            for view in reversed(chain[1:]):  # the written view's parents, on the base's current value
                views.append(_call(graph, view.target, (views[-1], *view.args[1:]), view.meta["val"]))
            for view, parent in zip(chain, reversed(views)):
                value = _call(graph, scatters[view.target], (parent, value, *view.args[1:]), parent.meta["val"])
        current = latest.get(base, base)
        for reader in list(current.users):  # the reads after the write (the nodes just inserted have no position)
            if position.get(reader, -1) > position[write]:
                reader.replace_input_with(current, value)
        graph.erase_node(write)
        for view in chain:  # the views written through, now read by nothing
            if not view.users:
                graph.erase_node(view)
        latest[base] = value
        rewritten += 1
    if rewritten:
        graph.lint()
        module.recompile()
    return rewritten


def _read_after(chain: list[Any], write: Any, position: dict[Any, int]) -> bool:
    """Whether a view of the chain (taken before the write) is read after it: that read would need
    the view recomputed on the written value, which the rewrite does not do."""
    return any(position[user] > position[write] for view in chain for user in view.users if user is not write
               and user not in chain)  # fmt: skip


def _as_written(graph: Any, source: Any, target: Any, aten: Any) -> Any:
    """``source`` as ``copy_`` writes it into ``target``: broadcast to its shape, cast to its dtype."""
    value, have, wanted = source, source.meta["val"], target.meta["val"]
    if tuple(have.shape) != tuple(wanted.shape):
        have = have.expand(wanted.shape)
        value = _call(graph, aten.expand.default, (value, list(wanted.shape)), have)
    if have.dtype != wanted.dtype:
        value = _call(graph, aten._to_copy.default, (value,), have.to(wanted.dtype), {"dtype": wanted.dtype})
    return value


def _call(graph: Any, target: Any, args: tuple, value: Any, kwargs: dict | None = None) -> Any:
    """A new call of ``target`` (inserted where the graph inserts now) whose traced value is ``value``
    (a fake tensor of its shape, dtype and device)."""
    node = graph.call_function(target, args, kwargs or {})
    node.meta["val"] = value
    return node


def unordered_writes(graph: Any) -> list[Any]:
    """The in-place calls of ``graph`` whose write no data edge orders before a later read: a write
    into a tensor the graph creates (through views or not) whose base, or a view of it, is read
    after the write other than through the write's own result (which a trace records the later
    reads of the written tensor as)."""
    position = {node: i for i, node in enumerate(graph.nodes)}

    def unordered(write: Any, written: Any) -> bool:
        value, base = written.meta.get("val"), _base(written)
        if not _internal(base) or value is None or not takes_as_input(value):
            return False  # an input's write, or a tensor no region holds (token ids, masks being built)
        aliases, pending = set(), [base]
        while pending:
            node = pending.pop()
            if node not in aliases:
                aliases.add(node)
                pending += [user for user in node.users if is_view(user)]
        readers = {user for node in aliases for user in node.users if user is not write and not is_view(user)}
        return any(position[reader] > position[write] for reader in readers)

    return [node for node in graph.nodes if any(unordered(node, value) for value in written_arguments(node))]
