"""``torch.compile(model, backend="cherenkov")``: a Dynamo backend.

Dynamo hands the backend an FX graph and example inputs per guarded specialisation (a new
shape or dtype is a new call; a shape seen before reuses Dynamo's compiled code, so no new
search). The backend traces the graph to ATen ops (``make_fx``), partitions it into the
largest regions whose every op :func:`~cherenkov.graph.torch_capture.lowers_node` (``torch.fx``'s
capability partitioner), and replaces each region by a call of a :class:`~cherenkov.search.
compiled.CompiledFunction`'s custom op (``cherenkov::region_fused_<n>_<k>``) — a ``ck.Graph``
searched for the GPU at hand. The split graph then goes to the fallback
(``options={"fallback": "inductor"}``, the default, compiles the ops outside the regions and
calls the regions' ops as opaque kernels; ``"eager"`` runs those ops as the ATen ops they
are). Without a GPU (or with CPU inputs) the whole graph runs the fallback way and the
backend says so once. Registered through the ``torch_dynamo_backends`` entry point; other
``options`` go to every search (``budget_s``, ``target``, ``database``, ``cuda_graphs``).
"""

from __future__ import annotations

import logging
import operator
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from cherenkov.graph.errors import GraphError
from cherenkov.graph.torch_capture import (
    BAKED_BUFFER_PREFIX,
    is_band,
    is_sdpa_kernel,
    lowers_node,
    sdpa_backward_mask,
    takes_as_input,
    unused_sdpa_rng_state,
)
from cherenkov.search.compiled import CompiledFunction, example_tensor
from cherenkov.search.internal_writes import functionalise_internal_writes, unordered_writes
from cherenkov.search.pinned_buffers import PINNED_BUFFER_PREFIX, PinnedBuffers, module_buffers, unpin_unfolded
from cherenkov.search.pinned_buffers import pin_buffers as pin_module_buffers

log = logging.getLogger(__name__)

FALLBACKS = ("inductor", "eager")
_said: set[str] = set()


def _say_once(message: str) -> None:
    if message not in _said:
        _said.add(message)
        log.warning("%s", message)


@dataclass(frozen=True)
class SplitGraph:
    """An ATen graph whose supported regions are :class:`CompiledFunction` submodules
    (``module``), with those regions' functions in order (``compiled``)."""

    module: Any
    compiled: tuple[CompiledFunction, ...]
    pinned: PinnedBuffers | None = None
    """Module buffers ``module`` read as constants (a causal mask's band folded from them): it is right
    only for calls that pass them unchanged (:meth:`PinnedBuffers.guard`)."""


def split_supported(gm: Any, example_inputs: Sequence[Any], cuda_graphs: bool = True,
                    buffers: Mapping[int, Any] | None = None, **optimize_kwargs: Any) -> SplitGraph:  # fmt: skip
    """``gm`` traced to ATen ops, each maximal region of ops cherenkov lowers made a
    :class:`CompiledFunction` (prepared for the region's example inputs, ``cuda_graphs`` as in
    ``ck.compile``) and called through its custom op; the other ops stay ATen nodes of the
    returned module, as does a region whose capture or search fails (the log names it and
    the error). A bool mask the graph computes is inside the region that reads it, unless it
    would cross a region's border: then the ops writing and reading it stay ATen. Module buffers
    (``buffers``: the inputs by position, with their tensors; None: those Dynamo lifted as ``gm``'s
    inputs) are read as constants where a band folds from them (GPT-Neo's causal mask), recorded in
    the result's ``pinned``."""
    from torch.fx.passes.infra.partitioner import CapabilityBasedPartitioner
    from torch.fx.passes.operator_support import OperatorSupport

    kept_out: set[Any] = set()

    class Lowerable(OperatorSupport):
        def is_node_supported(self, submodules: Any, node: Any) -> bool:
            # an SDPA backward under a mask other than a folded band (a padding mask: a bias) stays
            # torch's fused kernel: lowered, a padded BERT's training step failed on an H100 in Dynamo's
            # guard building (2026-12-05, cause not found)
            mask = sdpa_backward_mask(node)
            banded = mask is None or getattr(mask, "target", None) in bands
            return node not in kept_out and lowers_node(node) and _graph_holds(node, baked) and banded

    aten = _drop_empty_concatenations(_aten_graph(gm, example_inputs))
    functionalise_internal_writes(aten)
    unordered = unordered_writes(aten.graph)
    if unordered:
        log.warning("cherenkov backend: %d in-place write(s) into the graph's own tensors that no data edge orders "
                    "before their later reads (first: %s); the graph runs as ATen ops", len(unordered),
                    unordered[0].format_node())  # fmt: skip
        return SplitGraph(aten, ())
    buffers = module_buffers(gm, example_inputs) if buffers is None else buffers
    mutated = _mutated_placeholders(gm)  # a buffer the graph updates (a running statistic) stays an input
    written = {i for i, n in enumerate(n for n in gm.graph.nodes if n.op == "placeholder") if n in mutated}
    buffers = {i: tensor for i, tensor in buffers.items() if i not in written}
    pins = pin_module_buffers(aten, buffers)
    bands = _folded_constants(aten)
    pinned = unpin_unfolded(aten, pins, buffers)
    baked = bands | _constant_rng_state(aten)
    partitioner = CapabilityBasedPartitioner(aten, Lowerable(), allows_single_node_partition=False)
    partitions = partitioner.propose_partitions()
    # their ops stay ATen (a getitem's producer with it: the partitioner puts them together), and the regions
    # are proposed again; every round keeps out more nodes, so the rounds end
    while crossing := {_producer(n) for n in _masks_crossing(partitions, baked)} - kept_out:
        kept_out.update(crossing)
        partitions = partitioner.propose_partitions()
    fused = partitioner.fuse_partitions(partitions)
    region_inputs = _region_inputs(fused)
    compiled, traced_strides = [], {}
    for node in list(fused.graph.nodes):
        if not _is_region(node):
            continue
        region = getattr(fused, node.target)
        constants = {i: _attribute(fused, a.target) for i, a in enumerate(node.args)
                     if getattr(a, "target", None) in baked}  # fmt: skip
        kept = [i for i in range(len(node.args)) if i not in constants]
        if not kept:  # constants only: nothing to search, the fallback folds it
            log.info("cherenkov backend: region %s reads no tensor; it stays ATen ops", node.target)
            continue
        name = f"region_{node.target}"
        function = CompiledFunction(_positional(region, name, constants), dict(optimize_kwargs), name=name,
                                    cuda_graphs=cuda_graphs, traced_dtypes=True)  # fmt: skip
        try:
            function.prepare([region_inputs[node.name][i] for i in kept])
        except Exception as error:  # noqa: BLE001 - any failure leaves the region to ATen, said in the log
            log.warning("cherenkov backend: region %s (%d ops) runs as ATen ops: %s: %s", node.target,
                        sum(n.op == "call_function" for n in region.graph.nodes), type(error).__name__, error)  # fmt: skip
            continue
        node.args = tuple(node.args[i] for i in kept)
        strides = _restrided_outputs(region.graph)
        values = _call_op(fused, node, function.op, returns_tuple=_returns_tuple(region))
        traced_strides.update((value, strides[index]) for index, value in values.items())
        compiled.append(function)
    ops = {function.op for function in compiled}
    calls = {n for n in fused.graph.nodes if n.op == "call_function" and n.target in ops}
    for value, stride in traced_strides.items():
        _keep_traced_strides(fused, value, stride, calls)
    fused.graph.eliminate_dead_code()
    fused.delete_all_unused_submodules()
    fused.recompile()
    return SplitGraph(fused, tuple(compiled), pinned if compiled else None)


def _positional(region: Any, name: str, baked: dict[int, Any] | None = None) -> Any:
    """``region`` as a module class ``name`` whose inputs are named by position (``in0``,
    ``in1``, ...): the same layer repeated gives the same ``ck.Graph`` (structure and input
    names; the graph's name is not part of it), whose search the tuning database then
    answers once for every repetition. The inputs at the positions of ``baked`` become the
    module's constant buffers holding those tensors (a folded band mask: the capture reads
    its values, and a causal mask becomes iota comparisons; SDPA's unused random-number state,
    which the capture never reads)."""
    import torch

    baked = baked or {}
    graph = torch.fx.Graph()
    placeholders = [n for n in region.graph.nodes if n.op == "placeholder"]
    values, kept = {}, 0
    for i, n in enumerate(placeholders):
        if i in baked:
            region.register_buffer(f"{BAKED_BUFFER_PREFIX}{i}", baked[i])
            values[n] = graph.get_attr(f"{BAKED_BUFFER_PREFIX}{i}")
        else:
            values[n] = graph.placeholder(f"in{kept}")
            kept += 1
    graph.output(graph.graph_copy(region.graph, values))
    return torch.fx.GraphModule(region, graph, class_name=name)


def _folded_constants(aten: Any) -> set[str]:
    """Values ``aten`` computes from constants alone (no input reaches them) whose values form
    a band (:func:`~cherenkov.graph.torch_capture.is_band`: the causal mask transformers
    builds from position aranges, as 0/1 or 0/−∞, or a mask of one value that hides nothing)
    or are one floating-point or bool number (a mask's fill value; not an index), evaluated once
    and stored as buffers of ``aten`` that its nodes read instead; returns their attribute names,
    with those of such one-number tensor constants ``aten`` already holds (GPT-Neo's
    ``torch.tensor(finfo.min)``).
    The shapes they depend on are static in a Dynamo specialisation, so the values are too.
    Regions bake these in, so the rules see their values."""
    import torch

    values: dict[Any, Any] = {}
    for node in _constant_nodes(aten.graph):
        if node.op == "get_attr":
            values[node] = _attribute(aten, node.target)
        else:
            args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), lambda n: values[n])
            values[node] = node.target(*args, **kwargs)
    folded = set()
    for node, value in values.items():
        # the nodes computed per call that read it (a value the graph returns stays computed)
        feeds = [user for user in node.users if user not in values and user.op != "output"]
        if not feeds or not isinstance(value, torch.Tensor):
            continue
        number = value.numel() == 1 and (value.is_floating_point() or value.dtype == torch.bool)  # not an index
        if node.op == "get_attr":
            if number and not node.target.startswith(PINNED_BUFFER_PREFIX):  # a buffer stays checked
                folded.add(node.target)
            continue
        if node.op != "call_function" or not (number or is_band(value, uniform=True)):
            continue
        name = f"ck_folded_{len(folded)}"
        attribute = _buffer_node(aten, name, value.contiguous(), node.meta.get("val"), node)
        for user in feeds:
            user.replace_input_with(node, attribute)
        folded.add(name)
    if folded:
        aten.graph.eliminate_dead_code()
        aten.recompile()
    return folded


def _constant_rng_state(aten: Any) -> set[str]:
    """The random-number state SDPA's kernels pass from forward to backward without dropout
    (:func:`~cherenkov.graph.torch_capture.unused_sdpa_rng_state`: cuDNN's philox seed and offset,
    integer scalars no region can take) read as constant zeros instead, buffers of ``aten`` that
    regions bake in: the kernels and their backward then lower, and a forward graph still returns
    a tensor there. Returns the buffers' names."""
    import torch

    names: set[str] = set()

    def constant_for(value: Any, before: Any) -> Any:
        name = f"ck_rng_state_{len(names)}"
        names.add(name)
        return _buffer_node(aten, name, torch.zeros(value.shape, dtype=value.dtype, device=value.device), value,
                            before)  # fmt: skip

    for node in list(aten.graph.nodes):
        reads, arguments = unused_sdpa_rng_state(node)
        for read in reads:
            read.replace_all_uses_with(constant_for(read.meta["val"], node))
        for argument in arguments:
            node.replace_input_with(argument, constant_for(argument.meta["val"], node))
    if names:
        aten.graph.eliminate_dead_code()
        aten.recompile()
    return names


def _buffer_node(aten: Any, name: str, tensor: Any, val: Any, before: Any) -> Any:
    """``tensor`` registered as buffer ``name`` of ``aten``, and a node reading it inserted
    before node ``before`` (its trace value ``val``)."""
    aten.register_buffer(name, tensor)
    with aten.graph.inserting_before(before):
        attribute = aten.graph.get_attr(name)
    attribute.meta["val"] = val
    return attribute


def _constant_nodes(graph: Any) -> list[Any]:
    """The nodes of ``graph`` no input reaches, in order: its attributes, and the calls of
    :func:`_foldable` ops that read only such nodes (the same value each call)."""
    constant: dict[Any, None] = {}
    for node in graph.nodes:  # in order: a node's inputs first
        if node.op == "get_attr" or (node.op == "call_function" and _foldable(node)
                                     and all(n in constant for n in node.all_input_nodes)):  # fmt: skip
            constant[node] = None
    return list(constant)


def _foldable(node: Any) -> bool:
    """An ATen op that computes the same value from the same arguments (no randomness, no
    in-place write) and takes no symbolic size."""
    import torch

    target = node.target
    if not isinstance(target, torch._ops.OpOverload) or target._schema.is_mutable:
        return False
    if torch.Tag.nondeterministic_seeded in target.tags:
        return False
    symbolic: list[Any] = []
    torch.fx.node.map_aggregate((node.args, node.kwargs),
                                lambda a: symbolic.append(a) if isinstance(a, (torch.SymInt, torch.SymFloat)) else a)  # fmt: skip
    return not symbolic


def _attribute(module: Any, target: str) -> Any:
    for part in target.split("."):
        module = getattr(module, part)
    return module


def _returns_tuple(region: Any) -> bool:
    """Whether a fused region returns a tuple of values (its callers index it) or one value."""
    (output,) = [n for n in region.graph.nodes if n.op == "output"]
    return isinstance(output.args[0], (tuple, list))


def _call_op(fused: Any, node: Any, op: Any, returns_tuple: bool) -> dict[int, Any]:
    """Replace the region call ``node`` by a call of its custom op (which takes the region's
    tensors as one list and returns its outputs as a list); returns the nodes that read its
    outputs, by output index."""
    import operator

    with fused.graph.inserting_before(node):
        call = fused.graph.call_function(op, (list(node.args),))
        value = call if returns_tuple else fused.graph.call_function(operator.getitem, (call, 0))
    node.replace_all_uses_with(value)
    fused.graph.erase_node(node)
    if not returns_tuple:
        return {0: value}
    return {user.args[1]: user for user in call.users if user.target is operator.getitem}


def _restrided_outputs(graph: Any) -> list[tuple[int, ...] | None]:
    """For each output of ``graph``, the strides the trace gave it where they lay it out densely
    but not contiguously (a transposed weight); None for any other (contiguous, broadcast: a
    stride of 0, or not a tensor)."""
    import torch

    (output,) = [n for n in graph.nodes if n.op == "output"]
    values = output.args[0] if isinstance(output.args[0], (tuple, list)) else (output.args[0],)
    strides = []
    for value in values:
        traced = getattr(value, "meta", {}).get("val")
        dense = isinstance(traced, torch.Tensor) and not traced.is_contiguous() and 0 not in traced.stride()
        strides.append(tuple(traced.stride()) if dense else None)
    return strides


STRIDE_SENSITIVE_ATEN_OPS = frozenset({"_grouped_mm", "grouped_mm", "_scaled_grouped_mm", "as_strided"})
"""ATen ops whose result (or whether they run) depends on their operands' strides, not only their values: the CUDA
grouped GEMMs check a group's alignment for a row-major operand only (GPT-OSS's MoE backward asserted on a
transposed activation made row-major), ``as_strided`` reads storage."""


def _reads_strides(node: Any) -> bool:
    """Whether ``node`` may act on its operands' strides: the graph's output (AOTAutograd compiles the backward apart
    on the traced strides, and inductor checks them), an op of :data:`STRIDE_SENSITIVE_ATEN_OPS`, or an op from
    outside ATen and prims (a library's custom op, opaque)."""
    if node.op == "output":
        return True
    name = getattr(node.target, "name", None)
    if node.op != "call_function" or not callable(name):
        return False
    namespace, _, op = name().partition("::")
    return namespace not in ("aten", "prims") or op.split(".")[0] in STRIDE_SENSITIVE_ATEN_OPS


def _keep_traced_strides(fused: Any, value: Any, stride: tuple[int, ...] | None, calls: set[Any]) -> None:
    """A region's output ``value`` copied to the strides the trace gave it (``stride``, where those are dense but
    not contiguous: :func:`_restrided_outputs`) for the readers that act on strides (:func:`_reads_strides`). A
    region returns contiguous tensors; ATen's other ops compute the same values at any strides, and the regions'
    calls (``calls``) read any strides, so they keep the contiguous tensor (a decode step's cache writes gain no
    copy)."""
    import torch

    readers = [user for user in value.users if user not in calls and _reads_strides(user)]
    if stride is None or not readers:
        return
    with fused.graph.inserting_after(value):
        copy = fused.graph.call_function(torch.ops.prims.copy_strided.default, (value, list(stride)))
    for reader in readers:
        reader.replace_input_with(value, copy)


def _aten_graph(gm: Any, example_inputs: Sequence[Any]) -> Any:
    """``gm`` traced to ATen ops (``make_fx``, which runs it) on the example inputs, with each
    input the graph updates in place (a static KV cache) cloned first: tracing leaves the
    caller's tensors as they were."""
    import torch
    from torch.fx.experimental.proxy_tensor import make_fx

    mutated = _mutated_placeholders(gm)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    inputs = [x.clone() if isinstance(x, torch.Tensor) and node in mutated else x
              for node, x in zip(placeholders, example_inputs)]  # fmt: skip
    return make_fx(gm)(*inputs)


def _mutated_placeholders(gm: Any) -> set[Any]:
    """The placeholders of ``gm`` that an in-place op (``index_copy_``, ``add_``, ...) writes,
    directly or through the views and attribute reads its first argument passes through."""
    mutated = set()
    for node in gm.graph.nodes:
        name = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", "")
        if node.op not in ("call_method", "call_function") or not name.endswith("_") or name.startswith("_"):
            continue
        written = node.args[0] if node.args else None
        while hasattr(written, "op") and written.op in ("call_method", "call_function") and written.args:
            written = written.args[0]
        if hasattr(written, "op") and written.op == "placeholder":
            mutated.add(written)
    return mutated


def _drop_empty_concatenations(aten: Any) -> Any:
    """``aten`` with the empty operands of every ``cat`` removed (a ``cat`` left with one operand
    is that operand, or its contiguous clone where the operand is laid out otherwise: a ``view``
    after the ``cat`` was traced on the ``cat``'s contiguous result): an empty key/value cache's
    first concatenation is then no op, and the attention it fed joins a region."""
    import torch

    for node in list(aten.graph.nodes):
        if node.op != "call_function" or node.target is not torch.ops.aten.cat.default:
            continue
        pieces = [p for p in node.args[0] if not _is_empty(p)]
        if not pieces or len(pieces) == len(node.args[0]):
            continue
        piece, value = pieces[0], node.meta["val"]
        if len(pieces) == 1 and tuple(piece.meta["val"].shape) == tuple(value.shape):
            if piece.meta["val"].stride() != value.stride():
                with aten.graph.inserting_before(node):
                    piece = aten.graph.call_function(torch.ops.aten.clone.default, (piece,),
                                                     {"memory_format": torch.contiguous_format})  # fmt: skip
                piece.meta["val"] = value
            node.replace_all_uses_with(piece)
        else:
            node.args = (pieces, *node.args[1:])
    aten.graph.eliminate_dead_code()
    aten.recompile()
    return aten


def _is_empty(node: Any) -> bool:
    value = node.meta.get("val") if hasattr(node, "meta") else None
    return value is not None and value.numel() == 0


def _graph_holds(node: Any, baked: set[str]) -> bool:
    """Whether every tensor ``node`` reads and writes is one a ``ck.Graph`` input can be
    (integer index tensors, bool inputs and empty constants stay outside the regions), a bool
    mask an op computes (a region keeps it inside: :func:`_masks_crossing`), or a constant a
    region bakes in (``baked``): a folded band (a causal mask, bool ones included: MPT's
    ``masked_fill`` of its scores), or SDPA's unused random-number state."""
    import torch

    return all(takes_as_input(v) or _computed_mask(n) for n in (node, *_unbaked_reads(node, baked))
               if isinstance(v := n.meta.get("val"), torch.Tensor))  # fmt: skip


def _unbaked_reads(node: Any, baked: set[str]) -> list[Any]:
    """The nodes ``node`` reads but the constants a region bakes in (``baked``)."""
    return [a for a in node.all_input_nodes if not (a.op == "get_attr" and a.target in baked)]


def _computed_mask(node: Any) -> bool:
    """Whether ``node`` is an op's bool result (a comparison's mask: the VJP of ``maximum`` selects
    its gradient by two) or the index of a row's max (``max.dim``'s, what its gradient scatters by:
    GPT-OSS's sinks), not a graph input or a constant."""
    import torch

    value = node.meta.get("val")
    if node.op != "call_function" or not isinstance(value, torch.Tensor):
        return False
    return value.dtype == torch.bool or _max_index(node)


def _max_index(node: Any) -> bool:
    """Whether ``node`` takes the index output of ``max.dim`` or ``min.dim``."""
    if node.target is not operator.getitem or node.args[1] != 1:
        return False
    producer = node.args[0]
    schema = getattr(getattr(producer, "target", None), "_schema", None)
    return schema is not None and schema.name in ("aten::max", "aten::min") and schema.overload_name == "dim"


def _masks_crossing(partitions: Sequence[Any], baked: set[str]) -> set[Any]:
    """The nodes of the proposed regions ``partitions`` that would read or write a computed bool
    mask across their region's border (no ``ck.Graph`` input or output is a bool mask)."""
    crossing = set()
    for partition in partitions:
        inside = partition.nodes
        for node in inside:
            reads = [a for a in _unbaked_reads(node, baked) if a not in inside]
            if any(map(_computed_mask, reads)) or (_computed_mask(node) and any(u not in inside for u in node.users)):
                crossing.add(node)
    return crossing


def _producer(node: Any) -> Any:
    """The op a ``getitem`` takes an output of; any other node itself."""
    return node.args[0] if node.op == "call_function" and node.target is operator.getitem else node


def _is_region(node: Any) -> bool:
    """Whether ``node`` calls a region the partitioner fused (a ``fused_*`` submodule)."""
    return node.op == "call_module" and str(node.target).startswith("fused_")


def _region_inputs(fused: Any) -> dict[str, list[Any]]:
    """Tensors to prepare each fused region (``call_module`` node ``fused_*``) on: the shapes,
    dtypes and devices the trace recorded for its arguments, random values (running the
    graph again for real values would repeat its side effects, a KV cache's update)."""
    return {node.name: [example_tensor(a.meta["val"].shape, a.meta["val"].dtype, a.meta["val"].device,
                                       a.meta["val"].stride()) for a in node.args]
            for node in fused.graph.nodes if _is_region(node)}  # fmt: skip


def _fallback(gm: Any, example_inputs: Sequence[Any], fallback: str) -> Callable[..., Any]:
    if fallback == "eager":
        return gm.forward
    from torch._inductor.compile_fx import compile_fx

    return compile_fx(gm, list(example_inputs))


def cherenkov_backend(gm: Any, example_inputs: Sequence[Any], **kwargs: Any) -> Callable[..., Any]:
    """The Dynamo backend: ``torch.compile(model, backend="cherenkov", options={...})``."""
    import torch

    options = dict(kwargs.get("options") or {})
    fallback = options.pop("fallback", "inductor")
    if fallback not in FALLBACKS:
        raise GraphError(f"cherenkov backend: fallback {fallback!r} (valid: {', '.join(FALLBACKS)})")
    tensors = [x for x in example_inputs if isinstance(x, torch.Tensor)]
    if not torch.cuda.is_available() or not tensors or not all(t.is_cuda for t in tensors):
        _say_once(f"cherenkov backend: no CUDA inputs; the graph runs through {fallback} instead")
        return _fallback(gm, example_inputs, fallback)
    return compile_regions(gm, example_inputs, fallback, **options)


def compile_regions(gm: Any, example_inputs: Sequence[Any], fallback: str = "inductor",
                    buffers: Mapping[int, Any] | None = None, **options: Any) -> Callable[..., Any]:  # fmt: skip
    """The backend's work on inputs of any device: ``gm`` split (:func:`split_supported`) and
    the split graph compiled by ``fallback``; a graph with no lowered region, or one whose
    tracing fails (the log says why), is compiled by ``fallback`` as it is. Where gradients are
    wanted (grad mode on and an input, or a parameter Dynamo lifted, requiring them),
    AOTAutograd first splits ``gm`` into its forward and backward ATen graphs, and each is
    compiled this way: a training step's backward runs on cherenkov's kernels too. A graph that
    read module buffers as constants (``buffers``, as :func:`split_supported`) checks them each
    call, and is compiled again without them the first time one changed."""
    import torch

    if torch.is_grad_enabled() and any(isinstance(x, torch.Tensor) and x.requires_grad for x in example_inputs):
        return _compile_joint(gm, example_inputs, fallback, **options)
    try:
        split = split_supported(gm, example_inputs, buffers=buffers, **options)
    except Exception as error:  # noqa: BLE001 - tracing a graph the backend cannot split leaves it to the fallback
        log.warning("cherenkov backend: the graph could not be traced and split (%s: %s); it runs through %s",
                    type(error).__name__, str(error).splitlines()[0] if str(error) else "", fallback)  # fmt: skip
        return _fallback(gm, example_inputs, fallback)
    if not split.compiled:
        _say_once(f"cherenkov backend: no op of this graph lowers to cherenkov; it runs through {fallback}")
        return _fallback(gm, example_inputs, fallback)
    run = _fallback(split.module, example_inputs, fallback)
    if split.pinned is None:
        return run
    return split.pinned.guard(run, lambda args: compile_regions(gm, args, fallback, buffers={}, **options))


def _compile_joint(gm: Any, example_inputs: Sequence[Any], fallback: str, **options: Any) -> Callable[..., Any]:
    """``gm`` through AOTAutograd, its forward and backward graphs each split and compiled by
    :func:`compile_regions` (they hold no autograd of their own); a written-out attention's scores
    and probabilities are recomputed by the backward (:func:`partition_recomputing_attention`). The
    module buffers Dynamo lifted are pinned in both graphs (:func:`_aot_buffers`)."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd
    from torch._subclasses.fake_tensor import is_fake, unset_fake_temporarily

    buffers = module_buffers(gm, example_inputs)

    def compile_one(graph: Any, inputs: Sequence[Any]) -> Callable[..., Any]:
        # AOTAutograd compiles under its fake mode, with fake inputs: tracing, capture and the
        # search need real tensors of their kind
        with unset_fake_temporarily():
            # at their strides: a saved activation may be a transposed view that the graph views again
            real = [example_tensor(x.shape, x.dtype, x.device, x.stride()) if is_fake(x) else x for x in inputs]
            return make_boxed_func(compile_regions(graph, _given_integers(real, example_inputs), fallback,
                                                   buffers=_aot_buffers(graph, buffers), **options))  # fmt: skip

    return aot_autograd(fw_compiler=compile_one, bw_compiler=compile_one,
                        partition_fn=partition_recomputing_attention)(gm, example_inputs)  # fmt: skip


def _aot_buffers(graph: Any, buffers: Mapping[int, Any]) -> dict[int, Any]:
    """The inputs of an AOTAutograd forward or backward ``graph`` that are module buffers (``buffers``: by
    position among Dynamo's inputs), by position, with their tensors: AOTAutograd names a graph's input
    ``primals_<n>`` after Dynamo's n-th input, in the backward too where the forward saved that input
    itself (nanoGPT's mask buffer, which the backward's recomputed scores read)."""
    placeholders = [n for n in graph.graph.nodes if n.op == "placeholder"]
    found = {}
    for i, node in enumerate(placeholders):
        prefix, _, number = str(node.target).rpartition("_")
        if prefix == "primals" and number.isdigit() and int(number) - 1 in buffers:
            found[i] = buffers[int(number) - 1]
    return found


def _given_integers(inputs: Sequence[Any], given: Sequence[Any]) -> list[Any]:
    """``inputs`` (stand-ins for a joint graph's forward or backward), their integer tensors the ones
    Dynamo was given where the two line up one for one in shape and dtype (the forward's): tracing runs
    the graph, and a token id read as an index (MBart's last non-pad token, ``ne(pad).sum(1) - 1``)
    must hold a real value, where zeros, all padding, indexed out of bounds."""
    lined_up = len(inputs) == len(given) and all(
        getattr(x, "shape", None) == getattr(y, "shape", None) and getattr(x, "dtype", None) == getattr(y, "dtype", None)
        for x, y in zip(inputs, given))  # fmt: skip
    if not lined_up:
        return list(inputs)
    from torch._subclasses.fake_tensor import is_fake

    def integral(x: Any) -> bool:
        return hasattr(x, "dtype") and not (x.dtype.is_floating_point or x.dtype.is_complex)

    return [y if integral(x) and not is_fake(y) else x for x, y in zip(inputs, given)]


SCORE_PRODUCTS = {"bmm": 0, "matmul": 0, "baddbmm": 1}
"""ATen ops (by name) that form a written-out attention's scores from q and k, and the position of
their first factor (``baddbmm(b, q, kᵀ)`` adds a bias ``b``, Bloom's ALiBi, to the product)."""
DATA_MOVES = frozenset({"view", "_unsafe_view", "reshape", "expand", "clone", "contiguous", "transpose", "t", "permute",
                        "unsqueeze", "squeeze", "alias", "detach", "_to_copy", "slice", "select"})  # fmt: skip
"""ATen ops (by name) that only move, view or recast their operand."""


def partition_recomputing_attention(joint: Any, joint_inputs: Sequence[Any], **kwargs: Any) -> Any:
    """AOTAutograd's default partition of a training graph, except that a written-out attention's
    scores and probabilities are recomputed by the backward instead of saved: they are B·H·T·T
    tensors, and saving the softmax's output (which ``_softmax_backward_data`` reads) would make the
    forward write them, so that its attention could not be a flash kernel. Recomputed, they leave
    the backward the whole attention gradient from q, k and v, which derives a flash backward. An
    SDPA kernel's q, k and v layouts are recomputed as well (saved, GQA's K/V heads repeated per query
    head would reach the backward as K/V of as many heads as q). What they, or an SDPA kernel, read
    that no input reaches (a causal mask built from position aranges) is recomputed too: the backward
    folds it to a band as the forward does, where saved it would be a tensor of unknown values
    there, a bias no flash backward reads."""
    from torch._functorch.partitioners import default_partition
    from torch.utils.checkpoint import CheckpointPolicy

    recomputed = recomputed_attention_nodes(joint.graph)
    kernels = [node for node in joint.graph.nodes if is_sdpa_kernel(node)]
    for node in [*recomputed, *_computed_from_constants(joint.graph, [*recomputed, *kernels])]:
        node.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
    return default_partition(joint, joint_inputs, **kwargs)


def _computed_from_constants(graph: Any, nodes: Sequence[Any]) -> list[Any]:
    """The nodes of ``graph`` that ``nodes`` read (directly or through others) and no graph input
    reaches (:func:`_constant_nodes`): a causal mask built from position aranges, and the tensor
    constants it reads (on CUDA, transformers' ``torch.tensor(0.0)`` a mask keeps is an attribute:
    saved, the backward would read it as an input, a value it cannot fold into a band)."""
    constant = set(_constant_nodes(graph))
    found: dict[Any, None] = {}
    stack = [n for node in nodes for n in node.all_input_nodes]
    while stack:
        node = stack.pop()
        if node not in found and node.op in ("call_function", "get_attr") and node in constant:
            found[node] = None
            stack.extend(node.all_input_nodes)
    return list(found)


def score_product_args(node: Any) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
    """A :data:`SCORE_PRODUCTS` node's added operands (``baddbmm``'s bias; none for a product) and its
    two factors."""
    first = SCORE_PRODUCTS[node.target._overloadpacket.__name__]
    return tuple(node.args[:first]), tuple(node.args[first:first + 2])


ROW_OPS = frozenset({"cat", "max", "amax"})
"""ATen ops (by name) that, along the last axis, append to a row of scores or reduce it to its max."""


def _along_the_row(node: Any) -> bool:
    """Whether ``node`` concatenates its operands along their last axis (a column appended to a row of scores)
    or takes their max along it (``amax``, or ``max.dim``'s values through their ``getitem``)."""
    if node.op != "call_function":
        return False
    if node.target is operator.getitem:
        return node.args[1] == 0 and _along_the_row(node.args[0])
    op = getattr(getattr(node.target, "_overloadpacket", None), "__name__", "")
    if op not in ROW_OPS or len(node.args) < 2:
        return False
    first, axis = node.args[0], node.args[1]
    if op == "cat":
        first = first[0]
    axis = axis[0] if isinstance(axis, (list, tuple)) and len(axis) == 1 else axis
    rank = first.meta["val"].dim() if hasattr(first, "meta") and "val" in first.meta else None
    return isinstance(axis, int) and rank is not None and axis in (-1, rank - 1)


def recomputed_attention_nodes(graph: Any) -> list[Any]:
    """Per softmax along the last axis of a training graph's forward (AOTAutograd's joint graph, whose
    backward reads the outputs' gradients, ``tangents_*``): the nodes from the product of q and k that
    makes its scores (with the pointwise work between, a scale or a mask) to its probabilities and
    their views, up to the product with v, and the data moves that lay q, k and v out for the two
    products (an ATen trace's copies of them with batch and heads merged); per SDPA kernel, the data
    moves that lay its q, k and v out (GQA's K/V heads repeated for each query head)."""
    import torch

    def name(node: Any) -> str:
        return getattr(getattr(node.target, "_overloadpacket", None), "__name__", "")

    backward: set[Any] = set()  # what reads an output's gradient: the walks stay in the forward
    for node in graph.nodes:
        if (node.op == "placeholder" and node.name.startswith("tangents")) or backward & set(node.all_input_nodes):
            backward.add(node)

    def computed(node: Any) -> bool:
        return isinstance(node, torch.fx.Node) and node.op == "call_function" and node not in backward

    found: dict[Any, None] = {}

    def laid_out(operands: list[Any]) -> None:  # q, k and v laid out for the products
        while operands:
            node = operands.pop()
            if computed(node) and name(node) in DATA_MOVES and node not in found:
                found[node] = None
                operands.extend(node.all_input_nodes)

    for softmax in graph.nodes:
        if not computed(softmax) or name(softmax) not in ("_softmax", "_safe_softmax"):
            continue
        if softmax.args[1] not in (-1, softmax.args[0].meta["val"].dim() - 1):
            continue
        found[softmax] = None
        scores, operands = [softmax.args[0]], []
        while scores:  # back from the softmax through pointwise work to the product of q and k
            node = scores.pop()
            if not computed(node) or node in found:
                continue
            if name(node) in SCORE_PRODUCTS:
                bias, factors = score_product_args(node)
                operands.extend(factors)
                scores.extend(bias)  # an added bias is part of the scores
            elif _along_the_row(node):  # a column appended to the row (GPT-OSS's sinks), the row's max
                scores.extend(node.all_input_nodes)
                # max.dim's indices (what its gradient scatters by) with it: saved, the forward would compute them
                found.update(dict.fromkeys(user for user in node.users if user.target is operator.getitem))
            elif not (torch.Tag.pointwise in getattr(node.target, "tags", ()) or name(node) in DATA_MOVES):
                continue
            else:
                scores.extend(node.all_input_nodes)
            found[node] = None
            copies = [user for user in node.users if name(user) in ("detach", "alias")]
            while copies:  # what an activation's gradient reads of it (tanh_backward: a soft cap's detached output)
                copy = copies.pop()
                if computed(copy) and copy not in found:
                    found[copy] = None
                    copies.extend(user for user in copy.users if name(user) in ("detach", "alias"))
        readers = list(softmax.users)
        while readers:  # the probabilities' views and casts, up to the product with v
            node = readers.pop()
            if computed(node) and name(node) in SCORE_PRODUCTS:
                operands.extend(score_product_args(node)[1])
            elif computed(node) and name(node) in DATA_MOVES and node not in found:
                found[node] = None
                readers.extend(node.users)
        laid_out(operands)
    for kernel in graph.nodes:
        if computed(kernel) and is_sdpa_kernel(kernel):
            laid_out(list(kernel.args[:3]))
    return list(found)

