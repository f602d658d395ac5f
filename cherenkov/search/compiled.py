"""``ck.compile``: a PyTorch module or function as a callable that runs cherenkov's kernels.

``compile(fn, *example_tensors, dynamic=(), **optimize_kwargs)`` returns a
:class:`CompiledFunction` with ``fn``'s positional signature: tensors in, ``fn``'s result
(one tensor or a tuple) out. A call on inputs of a shape, dtype and device it has not seen
captures ``fn`` there (:func:`~cherenkov.from_torch`) and, for CUDA tensors, searches its
kernels (:func:`~cherenkov.optimize`, with ``optimize_kwargs``: a repeated shape is a
tuning-database hit); every later call with that signature goes straight to the kernels.
``dynamic`` lists more signatures (tuples of input shapes) to prepare at once.

Parameters and buffers are bound, not copied: each call reads the module's tensors by
their dotted names (``Graph.captured_sources``), so in-place updates (an optimiser step,
``load_state_dict``) reach the next call. Lifted constants keep their captured values.
Without a GPU (CPU tensors) a call evaluates the captured graph with the float64
reference and says so once in the log: slow, for checking bindings and semantics.

Each compiled function is one ``torch.library`` custom op (:mod:`cherenkov.search.torch_ops`):
a call dispatches ``cherenkov::<name>``, so it is one named op in ``torch.profiler``, and
``torch.compile(..., fullgraph=True)`` traces through it (its fake implementation knows
the outputs' shapes). On CUDA, a signature's second call records its kernels as one CUDA
graph (:meth:`~cherenkov.OptimizeResult.capture_fresh`) and each later call replays it.
Inputs that kept their address (parameters, a static cache) are read in place; the others
(activations allocated anew by the caller) are copied into the recording's own buffers
first (:class:`PreparedCall`). The last few kernels, those writing the outputs, run after the
replay into new tensors, so the outputs are the call's own without a copy (a longer tail is
replayed too, and its outputs copied). A call whose parameters moved, or one inside someone
else's CUDA-graph capture, launches the kernels one by one.
``cuda_graphs=False`` always launches them one by one.

A call on tensors that need a gradient (an argument with ``requires_grad``, or the module's
parameters) is recorded for autograd: its backward runs ``ck.grad`` of the captured graph,
prepared and searched once per signature like the forward
(:mod:`cherenkov.search.compiled_autograd`), so ``loss.backward()`` and an optimiser step train
the module through cherenkov's kernels.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from cherenkov.codegen.launch import TORCH_DTYPES
from cherenkov.graph import GraphError, evaluate, from_torch
from cherenkov.graph.tensor import Graph

log = logging.getLogger(__name__)

Signature = tuple[tuple[tuple[int, ...], str, str], ...]
"""One prepared call: (shape, torch dtype name, device type) of each positional input."""


def signature_of(tensors: Sequence[Any]) -> Signature:
    """The signature a call's tensors prepare or look up (computed once a call: a backend
    region of a whole model takes ~150 tensors, and a call's host work delays its kernels)."""
    return tuple((tuple(t.shape), _dtype_name(t.dtype), "cuda" if t.is_cuda else t.device.type) for t in tensors)


def _specialised(size: Any) -> Any:
    """A tensor size as an int: a symbolic size with a value (a backed ``SymInt``) specialised to it
    (a guard of the trace it belongs to), one without a value (data-dependent) left symbolic."""
    if isinstance(size, int):
        return size
    try:
        return int(size)
    except Exception:  # noqa: BLE001 - torch raises its own (version-specific) error for data-dependent sizes
        return size


@functools.cache
def _dtype_name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


GROWING_SHAPE_CALLS = 4
"""Signatures of one compiled function after which a new one is taken for a shape that changes every call."""
GROWING_SHAPE_HINT = (" (a shape that changes every call, a growing KV cache for one, is captured and searched anew each "
                      "time: a static cache, generate(..., cache_implementation='static') in transformers, or the shapes "
                      "prepared ahead with ck.compile's dynamic=, avoids that)")


def signature_change(before: Signature, after: Signature) -> str:
    """What differs between two signatures, input by input (``input 5 (1, 2, 22, 32) bfloat16, was (1, 2, 21, 32)
    bfloat16``), or their input counts."""
    if len(before) != len(after):
        return f"{len(after)} inputs, was {len(before)}"
    return ", ".join(f"input {i} {new[0]} {new[1]}, was {old[0]} {old[1]}"
                     for i, (old, new) in enumerate(zip(before, after)) if old != new)  # fmt: skip


MAX_RECORDINGS = 3
"""CUDA graphs one signature records at most: a caller whose parameters or caches keep moving
gains nothing from recording again, and each recording costs tens of milliseconds."""


@dataclass
class PreparedCall:
    """One signature's captured graph, (on CUDA) its searched kernels, and the lifted
    constants and CUDA-graph replay its calls reuse.

    The replay is recorded on the second call. Inputs at the same address in both calls
    (parameters, a static cache: ``stable``) are read in place by the recording; the others
    (activations a caller allocates anew) are recorded on private buffers that each replay
    first fills with the call's values. A stable input that moves while holding at most a
    quarter of the inputs' bytes (an activation that happened to keep its address) is copied in
    from then on, recorded again at once; a call whose larger stable inputs moved (parameters)
    launches the kernels one by one, and the same move seen twice records again (at most
    ``MAX_RECORDINGS`` recordings in all)."""

    graph: Graph
    result: Any | None  # OptimizeResult on CUDA, None on the CPU
    constants: dict[str, Any] = field(default_factory=dict)
    replay: Any | None = None  # CapturedRun recorded on the stable inputs and private copies of the rest
    stable: tuple[str, ...] = ()  # inputs the replay reads in place (at ``replay_addresses``)
    replay_addresses: tuple[int, ...] = ()
    last_addresses: dict[str, int] = field(default_factory=dict)
    recordings: int = 0
    said_moving: bool = False
    backward: dict[tuple[str, ...], PreparedCall] = field(default_factory=dict)  # gradient graphs, by wrt
    training: Any = None  # compiled_autograd.TrainingForward once prepared; False: the graph has no attention
    bindings: tuple[tuple[str, str, Any], ...] | None = None  # where each graph input comes from (CompiledFunction)
    copied: tuple[str, ...] = ()  # the inputs each replay copies in: those not in ``stable``

    def launch(self, inputs: dict[str, Any], cuda_graphs: bool) -> dict[str, Any]:
        """The kernels run on ``inputs``: a replay of the recorded CUDA graph where the stable
        inputs are where it read them, else one launch per kernel."""
        import torch

        capturing = torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
        if not cuda_graphs or capturing:
            return self.result.run(**inputs)
        addresses = {name: value.data_ptr() for name, value in inputs.items()}
        moved = () if self.replay is None else tuple(
            n for n, address in zip(self.stable, self.replay_addresses) if addresses[n] != address)  # fmt: skip
        if moved and self.recordings < MAX_RECORDINGS and 4 * _bytes(inputs, moved) <= _bytes(inputs, inputs):
            # a small input that happened to keep its address over the first two calls (an
            # activation from the caller's allocator) is copied in from now on
            self._record(inputs, stable=tuple(n for n in self.stable if n not in moved))
        elif self.replay is None or moved:
            previous, self.last_addresses = self.last_addresses, addresses
            if not previous or self.recordings >= MAX_RECORDINGS:
                if self.recordings >= MAX_RECORDINGS and not self.said_moving:
                    self.said_moving = True
                    log.warning("ck.compile: %s's large inputs (parameters) keep moving after %d CUDA-graph "
                                "recordings; its kernels are launched one by one from now on (host work per "
                                "kernel)", self.graph.name, MAX_RECORDINGS)  # fmt: skip
                return self.result.run(**inputs)
            self._record(inputs, stable=tuple(n for n in inputs if previous.get(n) == addresses[n]))
        for name in self.copied:
            self.replay.inputs[name].copy_(inputs[name])
        outputs = self.replay()
        return {name: value if name in self.replay.fresh else value.clone() for name, value in outputs.items()}

    def _record(self, inputs: dict[str, Any], stable: tuple[str, ...]) -> None:
        """Record the replay reading ``stable`` in place and private copies of the other inputs."""
        private = {name: value if name in stable else value.clone() for name, value in inputs.items()}
        self.replay, self.stable = self.result.capture_fresh(**private), stable
        self.copied = tuple(name for name in inputs if name not in stable)
        self.replay_addresses = tuple(inputs[n].data_ptr() for n in stable)
        self.recordings, self.last_addresses = self.recordings + 1, {}  # a later move is judged from its own calls
        copied = ", ".join(self.copied[:8]) + (" ..." if len(self.copied) > 8 else "")
        log.info("ck.compile: %s recorded as a CUDA graph (%d of %d inputs copied in per call: %s)", self.graph.name,
                 len(self.copied), len(inputs), copied)  # fmt: skip


def _bytes(inputs: dict[str, Any], names: Any) -> int:
    return sum(inputs[n].numel() * inputs[n].element_size() for n in names)


@dataclass
class CompiledFunction:
    """``fn`` compiled by :func:`compile`; call it like ``fn``. ``prepared`` maps each
    signature seen (or listed in ``dynamic``) to its :class:`PreparedCall`; ``searches``
    counts the captures (one per new signature); ``op`` is the custom op a call dispatches
    (named after ``name``, default ``fn``'s). With ``traced_dtypes`` (a backend region) the
    dtypes the trace recorded are the region's: a float input arriving in another float
    dtype at a prepared shape is cast to the prepared one instead of being searched anew
    (inductor can hand a region a float32 value across the cast to bf16 its trace holds).
    ``saved_statistics``: a call that needs gradients runs a training forward that saves each
    attention's output and log-sum-exp for the backward
    (:mod:`~cherenkov.search.compiled_autograd`)."""

    fn: Callable[..., Any]
    optimize_kwargs: dict[str, Any] = field(default_factory=dict)
    name: str = ""
    cuda_graphs: bool = True
    saved_statistics: bool = False
    prepared: dict[Signature, PreparedCall] = field(default_factory=dict)
    searches: int = 0
    traced_dtypes: bool = False
    op: Any = field(init=False, repr=False)
    _casts_said: set[Signature] = field(default_factory=set, repr=False)
    _warned_cpu: bool = False

    def __post_init__(self) -> None:
        from cherenkov.search.torch_ops import register_op

        self.name = self.name or getattr(self.fn, "__name__", type(self.fn).__name__)
        self.op = register_op(self, self.name)

    def __call__(self, *tensors: Any) -> Any:
        from cherenkov.search import compiled_autograd

        _check_tensors(tensors)
        if compiled_autograd.needs_gradient(self, tensors):  # the backward: ck.grad of the captured graph
            values = compiled_autograd.apply(self, tensors)
        else:
            values = self.op(list(tensors))
        return values[0] if len(values) == 1 else tuple(values)

    def outputs_of(self, tensors: Sequence[Any]) -> list[Any]:
        """The op's kernel: ``fn``'s outputs on ``tensors`` (in the graph's output order)."""
        key = signature_of(tensors)
        if self.traced_dtypes and key not in self.prepared:
            tensors, key = self._as_traced(tensors, key)
        call = self.prepared.get(key) or self.prepare(tensors)
        inputs = self._bind(call, tensors)
        if call.result is None:
            outputs = self._evaluate_on_cpu(call.graph, inputs)
        else:
            outputs = call.launch(inputs, self.cuda_graphs)
        # contiguous, as the op's fake outputs are (what a trace around the op assumes)
        return [outputs[name].contiguous() for name in call.graph.outputs]

    def output_specs(self, tensors: Sequence[Any]) -> list[tuple[tuple[int, ...], Any]]:
        """The op's fake implementation: (shape, torch dtype) of each output for tensors of
        these shapes, dtypes and device (real or fake), from the signature's prepared graph.
        A trace (``torch.compile``) cannot capture and search a new signature inside itself:
        it must be prepared first (a call, or ``dynamic``). A symbolic size the trace knows
        the value of is specialised to it (the trace then guards on it: the kernels serve one
        shape), as a trace that marked a size dynamic (a recompilation, a joint graph) hands it."""
        import torch

        shapes = [tuple(_specialised(d) for d in t.shape) for t in tensors]
        if not all(isinstance(d, int) for shape in shapes for d in shape):
            raise GraphError(f"ck.compile: {self.name} is traced with sizes that have no value {shapes}; its "
                             "kernels are specialised to static shapes: use torch.compile(..., dynamic=False)")  # fmt: skip
        key = tuple((shape, *rest) for shape, (_, *rest) in zip(shapes, signature_of(tensors)))
        if key not in self.prepared:
            prepared = [[s for s, _, _ in k] for k in self.prepared]
            raise GraphError(f"ck.compile: {self.name} is traced for inputs {shapes} it has not prepared (prepared: "
                             f"{prepared}); call it once on such inputs or list their shapes in dynamic=, and trace "
                             "with torch.compile(..., dynamic=False): its kernels are specialised to static shapes")  # fmt: skip
        graph = self.prepared[key].graph
        return [(spec.shape, getattr(torch, TORCH_DTYPES[spec.dtype])) for spec in graph.outputs.values()]

    def prepare(self, tensors: Sequence[Any]) -> PreparedCall:
        """The prepared call of these tensors' signature: captured (and searched) on first use
        (tensors on one device only: a backend region reading a CPU scalar stays ATen ops)."""
        key = signature_of(tensors)
        if key not in self.prepared:
            _check_tensors(tensors)
            if self.prepared:
                log.warning("ck.compile: %s called on a new signature (%s; %d prepared); capturing and searching it%s",
                            self.name, signature_change(next(reversed(self.prepared)), key), len(self.prepared),
                            GROWING_SHAPE_HINT if len(self.prepared) + 1 == GROWING_SHAPE_CALLS else "")  # fmt: skip
            graph = from_torch(self.fn, *tensors)
            result = None
            if all(t.device.type == "cuda" for t in tensors):
                from cherenkov.search.optimize import optimize

                result = optimize(graph, **self.optimize_kwargs)
            self.prepared[key] = PreparedCall(graph, result)
            self.searches += 1
            log.info("ck.compile: prepared %s for %s", graph.name, key)
        return self.prepared[key]

    def _as_traced(self, tensors: Sequence[Any], key: Signature) -> tuple[Sequence[Any], Signature]:
        """``tensors`` (of signature ``key``, not prepared) cast to the float dtypes of the one
        prepared signature that differs from theirs only there (in the same shapes and
        devices), with that signature; as they are otherwise."""
        import torch

        def float_only(a: tuple, b: tuple) -> bool:
            same_place = a[0] == b[0] and a[2] == b[2]
            return same_place and (a[1] == b[1] or (getattr(torch, a[1]).is_floating_point and
                                                    getattr(torch, b[1]).is_floating_point))  # fmt: skip

        matches = [k for k in self.prepared if len(k) == len(key) and all(map(float_only, k, key))]
        if len(matches) != 1:
            return tensors, key
        (traced,) = matches
        if key not in self._casts_said:
            self._casts_said.add(key)
            changed = [f"input {i}: {b[1]} -> {a[1]}" for i, (a, b) in enumerate(zip(traced, key)) if a[1] != b[1]]
            log.info("ck.compile: %s casts its inputs to the traced dtypes (%s)", self.name, ", ".join(changed))
        return [t.to(getattr(torch, spec[1])) for t, spec in zip(tensors, traced)], traced

    def _bind(self, call: PreparedCall, tensors: Sequence[Any]) -> dict[str, Any]:
        """Every graph input: a positional argument, the module's live parameter or buffer of
        that dotted name, or (a lifted constant) its captured value, kept on the device."""
        import torch

        if call.bindings is None:
            call.bindings = self._bindings(call.graph)
        inputs: dict[str, Any] = {}
        device = tensors[0].device if tensors else torch.device("cpu")
        for name, kind, where in call.bindings:
            if kind == "arg":
                value = tensors[where]
            elif kind == "state":
                value = self._state_tensor(where)
                if value is None:
                    raise GraphError(f"ck.compile: {self.name} was captured reading {where!r}, which the module "
                                     "no longer has")  # fmt: skip
                value = value.to(device)
            else:  # a lifted constant: the value it was captured with
                if name not in call.constants:
                    spec = call.graph.inputs[name]
                    example = call.graph.example_inputs()[name]
                    dtype = getattr(torch, TORCH_DTYPES[spec.dtype])
                    call.constants[name] = torch.from_numpy(np.asarray(example)).to(device, dtype).contiguous()
                value = call.constants[name]
            inputs[name] = value if value.is_contiguous() else value.contiguous()
        return inputs

    def _bindings(self, graph: Graph) -> tuple[tuple[str, str, Any], ...]:
        """Where each graph input comes from, worked out once a signature: ``("arg", position)``,
        ``("state", dotted name)`` (a parameter or buffer, looked up each call: a replaced
        parameter is seen) or ``("constant", None)`` (a lifted constant)."""
        sources = graph.captured_sources
        bindings = []
        for name in graph.inputs:
            source = sources.get(name)
            if source is None:
                raise GraphError(f"ck.compile: input {name!r} of {graph.name!r} has no recorded source")
            if source.startswith("arg:"):
                bindings.append((name, "arg", int(source[4:])))
            elif self._state_tensor(source) is not None:
                bindings.append((name, "state", source))
            else:
                bindings.append((name, "constant", None))
        return tuple(bindings)

    def _state_tensor(self, dotted: str) -> Any | None:
        """The module's parameter or buffer named ``dotted`` (None for a lifted constant)."""
        import torch

        if not isinstance(self.fn, torch.nn.Module):
            return None
        for getter in (self.fn.get_parameter, self.fn.get_buffer):
            try:
                return getter(dotted).detach()
            except AttributeError:
                continue
        return None

    def _evaluate_on_cpu(self, graph: Graph, inputs: dict[str, Any]) -> dict[str, Any]:
        import torch

        if not self._warned_cpu:
            log.warning("ck.compile: no CUDA tensors; %s runs as the captured graph's float64 reference on the CPU "
                        "(for checking: slow)", graph.name)  # fmt: skip
            self._warned_cpu = True
        values = evaluate(graph, {n: v.detach().double().cpu().numpy() for n, v in inputs.items()})
        outputs = {}
        for name, value in values.items():
            dtype = getattr(torch, TORCH_DTYPES.get(graph.outputs[name].dtype, "float32"))
            # contiguous, as the kernels' outputs are (ATen kernels after a region may need a unit inner stride)
            outputs[name] = torch.from_numpy(np.ascontiguousarray(value)).reshape(np.shape(value)).to(dtype)  # 0-d stays 0-d
        return outputs


def example_tensor(shape: Sequence[int], dtype: Any, device: Any, strides: Sequence[int] | None = None) -> Any:
    """A tensor to prepare a signature on (a capture reads shapes, not values): Gaussian
    floats, zeros of other dtypes; laid out at ``strides`` where given (a traced ``view`` of a
    transposed tensor is valid only at its strides; a broadcast one, a stride of 0, is a view of
    a smaller storage, as the caller's expanded tensor is, and the graph compiled on it expects
    that layout)."""
    import torch

    def values(size: Sequence[int]) -> Any:
        if dtype.is_floating_point:  # 8-bit floats have no random generator of their own
            return torch.randn(size, dtype=torch.float32 if dtype.itemsize == 1 else dtype, device=device).to(dtype)
        return torch.zeros(size, dtype=dtype, device=device)

    value = values(shape)
    if strides is None or tuple(strides) == value.stride():
        return value
    if 0 in strides and 0 not in shape:  # a broadcast view of the storage its strides reach
        storage = values((1 + sum((n - 1) * s for n, s in zip(shape, strides)),))
        return storage.as_strided(tuple(shape), tuple(strides))
    return torch.empty_strided(tuple(shape), tuple(strides), dtype=dtype, device=device).copy_(value)


def _check_tensors(tensors: Sequence[Any]) -> None:
    import torch

    for i, value in enumerate(tensors):
        if not isinstance(value, torch.Tensor):
            raise GraphError(f"ck.compile: argument {i} is a {type(value).__name__}; the compiled function takes "
                             "tensors only (bind other arguments with functools.partial)")  # fmt: skip
    devices = {t.device for t in tensors}
    if len(devices) > 1:
        raise GraphError(f"ck.compile: the arguments are on {sorted(map(str, devices))}; put them on one device")


def compile(  # noqa: A001 - the public name, as torch.compile
    fn: Callable[..., Any], *example_tensors: Any, dynamic: Iterable[Sequence[Sequence[int]]] = (),
    cuda_graphs: bool = True, saved_statistics: bool = False, **optimize_kwargs: Any,
) -> CompiledFunction:
    """``fn`` (an ``nn.Module`` or a function of tensors) as a :class:`CompiledFunction`,
    prepared for ``example_tensors`` and for each shape tuple in ``dynamic`` (the examples'
    dtypes and device); ``cuda_graphs`` replays repeated calls on the same tensors as one CUDA
    graph; ``saved_statistics`` makes a call that needs gradients save each attention's output
    and log-sum-exp for its backward (checked on the CPU path; off by default until measured on a
    GPU); ``optimize_kwargs`` go to every search (``target``, ``budget_s``, ``database``, ...)."""
    if not callable(fn):
        raise GraphError(f"ck.compile: expected an nn.Module or a function, got {type(fn).__name__}")
    _check_tensors(example_tensors)
    compiled = CompiledFunction(fn, dict(optimize_kwargs), cuda_graphs=cuda_graphs, saved_statistics=saved_statistics)
    if example_tensors:
        compiled.prepare(example_tensors)
    for shapes in dynamic:
        shapes = [tuple(s) for s in shapes]
        if len(shapes) != len(example_tensors):
            raise GraphError(f"ck.compile: dynamic signature {shapes} has {len(shapes)} shapes for "
                             f"{len(example_tensors)} example tensors")  # fmt: skip
        compiled.prepare([example_tensor(s, t.dtype, t.device) for s, t in zip(shapes, example_tensors)])
    return compiled
