"""Graph structure: structural hashing, the primitive-only contract (``g.ops() ⊆ PRIMITIVES``)
for every ``ck.nn`` function, DESIGN.md's lowerings, liveness, FLOPs and summaries."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable

import numpy as np
import pytest

import cherenkov as ck


def test_primitives_are_the_design_set() -> None:
    assert ck.PRIMITIVES == frozenset(
        {
            *("exp2", "log2", "sin", "sqrt", "recip", "neg"),
            *("add", "mul", "mod", "less_than", "maximum"),
            "where",
            *("sum_reduce", "max_reduce"),
            *("input", "constant", "iota", "cast"),
            *("permute", "expand", "reshape", "slice", "pad"),
            "contiguous",
        }
    )


# ------------------------------------------------------------------ structural hashing


def test_same_subexpression_twice_is_the_same_node() -> None:
    g = ck.Graph("cse")
    x, y = g.input("x", (3, 4)), g.input("y", (4,))
    first = ((x * y).exp() @ x.mT).sum(axis=-1)
    count = len(g.nodes)
    second = ((x * y).exp() @ x.mT).sum(axis=-1)
    assert second.id == first.id
    assert len(g.nodes) == count


def test_same_constant_twice_is_the_same_node() -> None:
    g = ck.Graph("cse")
    assert g.constant(0.5).id == g.constant(0.5).id
    assert g.constant(0.5).id != g.constant(0.5, "bf16").id
    assert g.constant(1, "int32").id != g.constant(1.0).id


def test_negative_zero_constant_is_not_merged_with_positive_zero() -> None:
    """0.0 == -0.0 in Python, but they are different constants (1 / -0.0 = -inf)."""
    g = ck.Graph("zeros")
    x = g.input("x", (2,))
    g.output(x * 0.0, "plus")
    g.output((x * -0.0).recip(), "minus")
    zeros = [n.attrs[0] for n in g.nodes if n.op == "constant"]
    assert sorted(math.copysign(1.0, z) for z in zeros) == [-1.0, 1.0]
    out = ck.evaluate(g, {"x": np.ones(2)})
    np.testing.assert_array_equal(out["minus"], [-np.inf, -np.inf])


def test_different_expressions_are_different_nodes() -> None:
    g = ck.Graph("cse")
    x = g.input("x", (3, 4))
    assert len({x.sum(axis=0).id, x.sum(axis=1).id, x.max(axis=0).id, (x + 1.0).id, (x + 2.0).id}) == 5


def test_identical_graphs_have_identical_hashes_and_nodes() -> None:
    def build(name: str) -> ck.Graph:
        g = ck.Graph(name)
        q, k, v = (g.input(n, (1, 2, 5, 4)) for n in "qkv")
        g.output(ck.nn.attention(q, k, v, causal=True), "o")
        return g

    a, b = build("one"), build("two")
    assert a.nodes == b.nodes
    assert a.structural_hash() == b.structural_hash()


def test_structural_hash_depends_on_input_and_output_names() -> None:
    def build(input_name: str, output_name: str) -> ck.Graph:
        g = ck.Graph("g")
        g.output(g.input(input_name, (2,)).exp(), output_name)
        return g

    hashes = {build("x", "y").structural_hash(), build("z", "y").structural_hash(), build("x", "w").structural_hash()}
    assert len(hashes) == 3


# ------------------------------------------------------------------ primitive-only contract


def _x(g: ck.Graph) -> ck.Tensor:
    return g.input("x", (2, 3, 8))


def _w(g: ck.Graph) -> ck.Tensor:
    return g.input("w", (8,))


def _tensor_methods(g: ck.Graph) -> ck.Tensor:
    x, w = _x(g), _w(g)
    reduced = x.abs().cos().log().rsqrt().minimum(2.0).mean(axis=(0, 1)) ** 1.5
    return reduced + ck.cat([w[:3], w[3:]]).min() + (x % 2.0 >= 1.0).cast("fp32").sum(axis=(0, 2))[0]


def _attention(causal: bool) -> Callable[[ck.Graph], ck.Tensor]:
    def build(g: ck.Graph) -> ck.Tensor:
        q, k, v = g.input("q", (1, 4, 3, 8)), g.input("k", (1, 2, 5, 8)), g.input("v", (1, 2, 5, 8))
        return ck.nn.attention(q, k, v, causal=causal)

    return build


NN_BUILDERS: dict[str, Callable[[ck.Graph], ck.Tensor]] = {
    "softmax": lambda g: ck.nn.softmax(_x(g), axis=1),
    "rms_norm": lambda g: ck.nn.rms_norm(_x(g), _w(g)),
    "layer_norm": lambda g: ck.nn.layer_norm(_x(g), _w(g), g.input("b", (8,))),
    "gelu_tanh": lambda g: ck.nn.gelu(_x(g)),
    "gelu_none": lambda g: ck.nn.gelu(_x(g), approximate="none"),
    "silu": lambda g: ck.nn.silu(_x(g)),
    "sigmoid": lambda g: ck.nn.sigmoid(_x(g)),
    "tanh": lambda g: ck.nn.tanh(_x(g)),
    "erf": lambda g: ck.nn.erf(_x(g)),
    "linear": lambda g: ck.nn.linear(_x(g), g.input("lw", (5, 8)), g.input("lb", (5,))),
    "repeat_kv_heads": lambda g: ck.nn.repeat_kv_heads(g.input("k", (1, 2, 5, 4)), 3),
    "attention_gqa": _attention(False),
    "attention_gqa_causal": _attention(True),
    "tensor_methods": _tensor_methods,
}


@pytest.mark.parametrize("name", sorted(NN_BUILDERS))
def test_nn_function_uses_only_primitives(name: str) -> None:
    g = ck.Graph(name)
    g.output(NN_BUILDERS[name](g))
    ops = g.ops()
    assert isinstance(ops, Counter)
    assert set(ops) <= ck.PRIMITIVES
    assert all(count > 0 for count in ops.values())


def test_matmul_lowers_to_sum_of_expanded_product() -> None:
    """DESIGN.md: ``x @ y`` is ``sum_reduce(expand(x) * expand(y))``."""
    g = ck.Graph("matmul")
    out = g.input("a", (3, 4)) @ g.input("b", (4, 5))
    assert out.node.op == "sum_reduce"
    product = g.node(out.node.inputs[0])
    assert product.op == "mul" and product.shape == (3, 5, 4)
    assert all(g.node(i).op == "expand" for i in product.inputs)


def test_exp_lowers_to_exp2_of_scaled_input() -> None:
    g = ck.Graph("exp")
    x = g.input("x", (2,))
    out = x.exp()
    assert out.node.op == "exp2"
    scaled = g.node(out.node.inputs[0])
    assert scaled.op == "mul"
    constants = [g.node(i).attrs[0] for i in scaled.inputs if g.node(i).op == "constant"]
    constants += [g.node(g.node(i).inputs[0]).attrs[0] for i in scaled.inputs if g.node(i).op == "expand"]
    assert constants == [math.log2(math.e)]


def test_division_lowers_to_multiplication_by_reciprocal() -> None:
    g = ck.Graph("div")
    a, b = g.input("a", (2,)), g.input("b", (2,))
    out = a / b
    assert out.node.op == "mul"
    assert sorted(g.node(i).op for i in out.node.inputs) == ["input", "recip"]


def test_ops_counts_only_nodes_the_outputs_depend_on() -> None:
    g = ck.Graph("dead")
    x = g.input("x", (2,))
    x.sin()
    g.output(x.sqrt())
    assert g.ops() == Counter({"input": 1, "sqrt": 1})
    assert len(g.nodes) == 3


def test_matmul_flops_are_two_m_n_k() -> None:
    g = ck.Graph("flops")
    g.output(g.input("a", (3, 4)) @ g.input("b", (4, 5)))
    assert g.flops() == 2 * 3 * 4 * 5


def test_summary_lists_inputs_outputs_ops_and_flops() -> None:
    g = ck.Graph("summary")
    x = g.input("x", (2, 3), "bf16")
    g.output(x.exp().sum(axis=-1), "s")
    summary = g.summary()
    assert summary["name"] == "summary"
    assert summary["inputs"] == {"x": {"shape": [2, 3], "dtype": "bf16"}}
    assert summary["outputs"] == {"s": {"shape": [2], "dtype": "bf16"}}
    assert summary["ops"] == dict(sorted(g.ops().items()))
    assert summary["flops"] == g.flops() > 0


def test_example_inputs_are_deterministic_random_normals() -> None:
    g = ck.Graph("examples")
    g.input("a", (3, 4))
    g.input("b", (5,))
    first, second = g.example_inputs(), g.example_inputs()
    assert {k: v.shape for k, v in first.items()} == {"a": (3, 4), "b": (5,)}
    for name in first:
        np.testing.assert_array_equal(first[name], second[name])
    assert np.std(first["a"]) > 0.1


# ------------------------------------------------------------------ large shapes (symbolic only)


def test_design_api_sketch_builds_at_the_seed_shape() -> None:
    """DESIGN.md's sketch: q (1, 8, 4096, 128) @ kᵀ over 8192 keys. Its broadcast product
    (1, 8, 4096, 8192, 128) is a view that is never materialised, so it must not be held to
    the 2^31-element limit of real buffers."""
    g = ck.Graph("attention")
    q = g.input("q", (1, 8, 4096, 128), dtype="bf16")
    k = g.input("k", (1, 8, 8192, 128), dtype="bf16")
    v = g.input("v", (1, 8, 8192, 128), dtype="bf16")
    s = (q @ k.transpose(-2, -1)) * 128**-0.5
    p = (s - s.max(axis=-1, keepdim=True)).exp()
    o = (p / p.sum(axis=-1, keepdim=True)) @ v
    g.output(o, "o")
    assert o.shape == (1, 8, 4096, 128)
    assert g.flops() >= 4 * 8 * 4096 * 8192 * 128


def test_large_matmul_builds() -> None:
    g = ck.Graph("big")
    out = g.input("a", (4096, 4096), "bf16") @ g.input("b", (4096, 4096), "bf16")
    assert out.shape == (4096, 4096)
