"""The tensors the lowering stores: decided a round of nodes at a time, they are the ones its
definition gives — lower the whole graph, store the last node that needs a tensor of its own,
again until none does — on forward and gradient graphs (attention spellings, a stack of
transformer blocks with views between them), whatever their size."""

from __future__ import annotations

import pytest

import cherenkov as ck
from cherenkov.rewrites.lower import _Lowering, lower, root_axes, root_indices

from tests.rewrites.test_derive import SPELLINGS, attention_graph


def stored_one_at_a_time(graph: ck.Graph) -> dict[str, int]:
    """The definition of what the lowering stores (each root's name -> its node): the outputs, then
    the last node that needs a tensor of its own in a lowering of the whole graph, again."""
    split: dict[int, str] = {}
    for name, tensor in graph.outputs.items():
        split.setdefault(tensor.id, name)
    taken = set(graph.inputs) | set(graph.outputs)
    while True:
        lowering = _Lowering(graph, split)
        for index in sorted(split):
            lowering.define(index, root_indices(root_axes(graph.node(index).shape)))
        extra = lowering.needs_own_tensor()
        if extra is None:
            return {name: index for index, name in split.items()}
        split[extra] = next(f"t{k}" for k in range(len(taken) + 1) if f"t{k}" not in taken)
        taken.add(split[extra])


def blocks(layers: int, causal: bool = True) -> ck.Graph:
    """``layers`` pre-norm transformer blocks (fused QKV projection sliced and viewed into heads,
    attention, output projection, GELU MLP, residuals) over a (2, 16, 32) input."""
    g = ck.Graph("blocks")
    x = g.input("x", (2, 16, 32), "fp32")
    for layer in range(layers):
        w_qkv, w_out = g.input(f"w_qkv{layer}", (96, 32), "fp32"), g.input(f"w_out{layer}", (32, 32), "fp32")
        w_up, w_down = g.input(f"w_up{layer}", (64, 32), "fp32"), g.input(f"w_down{layer}", (32, 64), "fp32")
        qkv = ck.nn.linear(ck.nn.layer_norm(x), w_qkv)
        q, k, v = (qkv[:, :, 32 * i : 32 * (i + 1)].reshape((2, 16, 4, 8)).transpose(1, 2) for i in range(3))
        y = ck.nn.attention(q, k, v, causal=causal).transpose(1, 2).reshape((2, 16, 32))
        x = x + ck.nn.linear(y, w_out)
        x = x + ck.nn.linear(ck.nn.gelu(ck.nn.linear(ck.nn.layer_norm(x), w_up)), w_down)
    g.output(x, "y")
    return g


def graphs() -> dict[str, ck.Graph]:
    spellings = {name: attention_graph(SPELLINGS[name][0], SPELLINGS[name][1])
                 for name in ("textbook", "causal_where", "gqa_expand", "exp2_folded")}  # fmt: skip
    made = {**spellings, **{f"grad {name}": ck.grad(g, wrt=("q", "k", "v")) for name, g in spellings.items()}}
    made["grad causal_where q v"] = ck.grad(spellings["causal_where"], wrt=("q", "v"))
    for layers in (1, 2):
        stack = blocks(layers)
        made[f"{layers} blocks"] = stack
        made[f"grad {layers} blocks"] = ck.grad(stack, wrt=tuple(stack.inputs))
    return made


@pytest.mark.parametrize("name", sorted(graphs()))
def test_the_stored_tensors_are_those_of_storing_one_at_a_time(name: str) -> None:
    graph = graphs()[name]
    lowered = lower(graph)
    assert lowered.nodes == stored_one_at_a_time(graph)


def test_a_gradient_of_stacked_blocks_derives_a_flash_forward_and_backward_per_layer() -> None:
    """Each attention of a two-block gradient graph (over 700 nodes) recomputes its probabilities:
    two flash forwards (the output projections' weight gradients read their outputs) and two flash
    backwards."""
    stack = blocks(2)
    gradient = ck.grad(stack, wrt=tuple(stack.inputs))
    assert len(gradient.nodes) > 700
    kinds = [k.kind for k in ck.derive(gradient).kernels]
    assert kinds.count("flash_attention") == 2 and kinds.count("flash_attention_backward") == 2, kinds
