"""In-place writes into a traced graph's own tensors become scatters before the backend partitions
it (transformers' DeepSeek assembles its query heads as ``q[..., :n] = q_pass``): the rewritten
graph computes what the traced one does, reads after a write read the scatter's result, and a
write the rewrite cannot make functional is named, so the backend leaves the graph to ATen."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from torch.fx.experimental.proxy_tensor import make_fx  # noqa: E402

from cherenkov.search.internal_writes import functionalise_internal_writes, unordered_writes  # noqa: E402


def assembled(x, y):
    """Writes through slices and nested selects of a new tensor, one broadcast and cast, reads between them."""
    b = x.new_zeros(2, 3, 5)
    b[:, :, :2].copy_(x)
    between = b.transpose(1, 2) * 2  # reads the first write only
    b[:, :, 2:].copy_(y)  # broadcast over the middle axis
    b[0, 1].copy_(torch.ones(5, dtype=torch.float64))  # cast
    b.add_(1.0)  # a direct write: its readers read its result
    return b * 3, between.sum(0)


def test_writes_through_views_of_a_new_tensor_become_scatters() -> None:
    x, y = torch.randn(2, 3, 2), torch.randn(2, 1, 3)
    traced = make_fx(assembled)(x, y)
    assert functionalise_internal_writes(traced) == 3
    targets = [node.target for node in traced.graph.nodes]
    assert torch.ops.aten.copy_.default not in targets
    assert targets.count(torch.ops.aten.slice_scatter.default) == 2
    assert targets.count(torch.ops.aten.select_scatter.default) == 2
    assert not unordered_writes(traced.graph)
    for got, expected in zip(traced(x, y), assembled(x, y)):
        assert torch.equal(got, expected)


def test_writes_into_graph_inputs_stay_and_are_ordered() -> None:
    """A static cache's update writes an input: its readers read the input itself."""

    def update(cache, x):
        cache[:, 2:4].copy_(x)
        return cache.sum(1)

    cache, x = torch.zeros(3, 6), torch.randn(3, 2)
    traced = make_fx(update)(cache.clone(), x)
    assert functionalise_internal_writes(traced) == 0 and not unordered_writes(traced.graph)
    assert torch.ops.aten.copy_.default in [node.target for node in traced.graph.nodes]


def test_a_write_through_another_view_is_named() -> None:
    """``view`` has no scatter: the write stays and is reported, and the backend runs the graph as ATen ops."""

    def flat(x):
        b = x.new_zeros(4, 4)
        b.view(-1)[3:7].copy_(x)
        return b * 2

    x = torch.randn(4)
    traced = make_fx(flat)(x)
    assert functionalise_internal_writes(traced) == 0
    (write,) = unordered_writes(traced.graph)
    assert write.target is torch.ops.aten.copy_.default
    assert torch.equal(traced(x), flat(x))
