"""``ck.grad`` against ``torch.autograd`` in float64: every differentiable primitive, the
``ck.nn`` functions and the seed attention; the gradient graph is an ordinary graph (it
evaluates, serialises and derives), and bad ``wrt`` names are ``GraphError``s."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest

import cherenkov as ck

torch = pytest.importorskip("torch")

RNG = np.random.default_rng(0)


def check_gradients(build: Callable[..., ck.Tensor], reference: Callable[..., object], shapes: dict[str, tuple],
                    positive: bool = False, rtol: float = 1e-9) -> None:  # fmt: skip
    """Build ``out = build(*inputs)``; ``ck.grad`` of it against ``torch.autograd.grad`` of
    ``reference(*inputs)`` on random float64 inputs and a random cotangent."""
    g = ck.Graph("f")
    tensors = [g.input(name, shape, "fp32") for name, shape in shapes.items()]
    out = build(*tensors)
    g.output(out, "y")
    values = {n: RNG.standard_normal(s) for n, s in shapes.items()}
    if positive:
        values = {n: np.abs(v) + 0.5 for n, v in values.items()}
    cotangent = RNG.standard_normal(out.shape)
    gg = ck.grad(g, wrt=tuple(shapes))
    assert set(gg.outputs) == {f"d_{n}" for n in shapes} and "d_y" in gg.inputs
    got = ck.evaluate(gg, {**values, "d_y": cotangent})
    leaves = [torch.tensor(values[n], dtype=torch.float64, requires_grad=True) for n in shapes]
    result = reference(*leaves)
    expected = torch.autograd.grad(result, leaves, torch.tensor(cotangent, dtype=torch.float64), allow_unused=True)
    for name, want in zip(shapes, expected):
        want = np.zeros(shapes[name]) if want is None else want.numpy()
        np.testing.assert_allclose(got[f"d_{name}"], want, rtol=rtol, atol=rtol * max(1.0, np.abs(want).max()))


def apply(op: str, *attrs):
    """A primitive applied to its operands (through the builder's checked ``_apply``)."""
    return lambda *xs: xs[0].graph._apply(op, xs, attrs)


LN2 = float(np.log(2.0))
PRIMITIVES = {
    "exp2": (apply("exp2"), lambda x: torch.exp2(x), {"x": (3, 4)}, False),
    "log2": (apply("log2"), lambda x: torch.log2(x), {"x": (3, 4)}, True),
    "sin": (apply("sin"), torch.sin, {"x": (3, 4)}, False),
    "sqrt": (apply("sqrt"), torch.sqrt, {"x": (3, 4)}, True),
    "recip": (apply("recip"), torch.reciprocal, {"x": (3, 4)}, True),
    "neg": (apply("neg"), torch.neg, {"x": (3, 4)}, False),
    "add": (apply("add"), torch.add, {"a": (3, 4), "b": (3, 4)}, False),
    "mul": (apply("mul"), torch.mul, {"a": (3, 4), "b": (3, 4)}, False),
    "mod": (apply("mod"), torch.remainder, {"a": (3, 4), "b": (3, 4)}, True),
    "maximum": (apply("maximum"), torch.maximum, {"a": (3, 4), "b": (3, 4)}, False),
    "where": (lambda a, b: ck.where(a < b, a, b), lambda a, b: torch.where(a < b, a, b), {"a": (3, 4), "b": (3, 4)},
              False),  # fmt: skip
    "sum_reduce": (apply("sum_reduce", 1), lambda x: x.sum(1), {"x": (3, 4, 5)}, False),
    "max_reduce": (apply("max_reduce", 2), lambda x: x.amax(2), {"x": (3, 4, 5)}, False),
    "contiguous": (apply("contiguous"), lambda x: x.clone(), {"x": (3, 4)}, False),
    "permute": (apply("permute", (2, 0, 1)), lambda x: x.permute(2, 0, 1), {"x": (3, 4, 5)}, False),
    "expand": (apply("expand", (2, 3, 4, 5)), lambda x: x.expand(2, 3, 4, 5), {"x": (3, 1, 5)}, False),
    "reshape": (apply("reshape", (4, 15)), lambda x: x.reshape(4, 15), {"x": (3, 4, 5)}, False),
    "slice": (apply("slice", (1, 0), (3, 3)), lambda x: x[1:3, 0:3], {"x": (4, 5)}, False),
    "pad": (apply("pad", ((1, 2), (0, 3)), 0.5), lambda x: torch.nn.functional.pad(x, (0, 3, 1, 2), value=0.5),
            {"x": (3, 4)}, False),  # fmt: skip
}


def test_every_differentiable_primitive_has_a_vjp() -> None:
    from cherenkov.graph.autodiff import VJPS

    assert set(VJPS) | {"input", "constant", "iota"} == set(ck.PRIMITIVES)
    assert set(PRIMITIVES) | {"less_than", "cast"} == set(VJPS), "each VJP has a case below"


@pytest.mark.parametrize("op", sorted(PRIMITIVES))
def test_the_vjp_of_each_primitive_matches_torch(op: str) -> None:
    build, reference, shapes, positive = PRIMITIVES[op]
    check_gradients(build, reference, shapes, positive)


def test_a_cast_passes_the_gradient_back_in_the_operand_dtype() -> None:
    g = ck.Graph("cast")
    x = g.input("x", (3, 4), "fp32")
    g.output(x.cast("bf16"), "y")
    gg = ck.grad(g, wrt=("x",))
    cotangent = RNG.integers(-8, 8, (3, 4)) / 4.0  # exact in bf16 and fp32
    assert gg.inputs["d_y"].dtype == "bf16" and gg.outputs["d_x"].dtype == "fp32"
    np.testing.assert_array_equal(ck.evaluate(gg, {"x": RNG.standard_normal((3, 4)), "d_y": cotangent})["d_x"], cotangent)


def test_less_than_passes_no_gradient_and_an_unused_input_gets_zeros() -> None:
    g = ck.Graph("mask")
    x, y = g.input("x", (3,), "fp32"), g.input("y", (3,), "fp32")
    g.output(ck.where(x < 0.0, x * 3.0, x), "out")
    got = ck.evaluate(ck.grad(g, wrt=("x", "y")), {"x": np.array([-1.0, 2.0, -3.0]), "y": np.zeros(3),
                                                   "d_out": np.ones(3)})  # fmt: skip
    np.testing.assert_array_equal(got["d_x"], [3.0, 1.0, 3.0])
    np.testing.assert_array_equal(got["d_y"], np.zeros(3))


def test_ties_share_the_gradient_of_a_maximum_equally() -> None:
    g = ck.Graph("ties")
    x = g.input("x", (2, 3), "fp32")
    g.output(x.max(axis=1), "y")
    got = ck.evaluate(ck.grad(g, wrt=("x",)), {"x": np.array([[1.0, 3.0, 3.0], [2.0, 0.0, 1.0]]),
                                              "d_y": np.array([1.0, 1.0])})  # fmt: skip
    x_t = torch.tensor([[1.0, 3.0, 3.0], [2.0, 0.0, 1.0]], dtype=torch.float64, requires_grad=True)
    (expected,) = torch.autograd.grad(x_t.amax(1), x_t, torch.ones(2, dtype=torch.float64))
    np.testing.assert_allclose(got["d_x"], expected.numpy())


def erf_as_ck_spells_it(x):
    """``ck.nn.erf``'s approximation (Abramowitz & Stegun 7.1.26, to 1.5e-7) in torch: its
    gradient, not the exact erf's, is what ``ck.grad`` must reproduce to 1e-9."""
    from cherenkov.graph.nn import _ERF_A, _ERF_P

    magnitude = x.abs()
    t = 1.0 / (magnitude * _ERF_P + 1.0)
    poly = t * _ERF_A[4]
    for coefficient in reversed(_ERF_A[:4]):
        poly = (poly + coefficient) * t
    positive = 1.0 - poly * torch.exp(-(magnitude * magnitude))
    return torch.where(x < 0.0, -positive, positive)


NN = {
    "softmax": (lambda x: ck.nn.softmax(x, axis=-1), lambda x: torch.softmax(x, -1), {"x": (3, 7)}),
    "rms_norm": (lambda x, w: ck.nn.rms_norm(x, w, eps=1e-6), lambda x, w: x * torch.rsqrt(
        (x * x).mean(-1, keepdim=True) + 1e-6) * w, {"x": (3, 8), "w": (8,)}),  # fmt: skip
    "layer_norm": (lambda x, w, b: ck.nn.layer_norm(x, w, b, eps=1e-5), lambda x, w, b: torch.nn.functional.layer_norm(
        x, (8,), w, b, eps=1e-5), {"x": (3, 8), "w": (8,), "b": (8,)}),  # fmt: skip
    "gelu_tanh": (lambda x: ck.nn.gelu(x), lambda x: torch.nn.functional.gelu(x, approximate="tanh"), {"x": (3, 8)}),
    "gelu_erf": (lambda x: ck.nn.gelu(x, approximate="none"), lambda x: x * 0.5 * (erf_as_ck_spells_it(x / 2**0.5) + 1),
                 {"x": (3, 8)}),  # fmt: skip
    "silu": (lambda x: ck.nn.silu(x), torch.nn.functional.silu, {"x": (3, 8)}),
    "tanh": (lambda x: ck.nn.tanh(x), torch.tanh, {"x": (3, 8)}),
    "sigmoid": (lambda x: ck.nn.sigmoid(x), torch.sigmoid, {"x": (3, 8)}),
    "erf": (lambda x: ck.nn.erf(x), erf_as_ck_spells_it, {"x": (3, 8)}),
    "expm1": (lambda x: ck.nn.expm1(x), torch.expm1, {"x": (3, 8)}),
    "log1p": (lambda x: ck.nn.log1p(x.abs()), lambda x: torch.log1p(x.abs()), {"x": (3, 8)}),
    "softplus": (lambda x: ck.nn.softplus(x * 6, beta=2.0, threshold=5.0),
                 lambda x: torch.nn.functional.softplus(x * 6, beta=2.0, threshold=5.0), {"x": (3, 8)}),  # fmt: skip
    "elu": (lambda x: ck.nn.elu(x, 0.5, 1.5, 2.0), lambda x: torch.where(x > 0, 1.5 * x, 0.75 * torch.expm1(2.0 * x)),
            {"x": (3, 8)}),  # fmt: skip
    # torch's own hardsigmoid backward multiplies by an fp32 1/6 (3e-8 off): spelled out instead
    "hardsigmoid": (lambda x: ck.nn.hardsigmoid(x * 4), lambda x: torch.clamp(x * 4 / 6 + 0.5, 0.0, 1.0),
                    {"x": (3, 8)}),  # fmt: skip
    "mish": (lambda x: ck.nn.mish(x * 3), lambda x: torch.nn.functional.mish(x * 3), {"x": (3, 8)}),
    "repeat_kv_heads": (lambda x: ck.nn.repeat_kv_heads(x, 3), lambda x: x.repeat_interleave(3, dim=1),
                        {"x": (1, 2, 4, 8)}),  # fmt: skip
    "attention_gqa_scaled": (lambda q, k, v: ck.nn.attention(q, k, v, causal=True, scale=0.3),
                             lambda q, k, v: torch.nn.functional.scaled_dot_product_attention(
                                 q, k, v, is_causal=True, scale=0.3, enable_gqa=True),
                             {"q": (1, 4, 6, 8), "k": (1, 2, 6, 8), "v": (1, 2, 6, 8)}),  # fmt: skip
    "attention_lower_right": (lambda q, k, v: ck.nn.attention(q, k, v, causal="lower_right"),
                              lambda q, k, v: torch.nn.functional.scaled_dot_product_attention(
                                  q, k, v, attn_mask=torch.ones(3, 7, dtype=torch.bool).tril(4), enable_gqa=True),
                              {"q": (1, 4, 3, 8), "k": (1, 2, 7, 8), "v": (1, 2, 7, 8)}),  # fmt: skip
    "linear": (lambda x, w, b: ck.nn.linear(x, w, b), torch.nn.functional.linear, {"x": (3, 8), "w": (5, 8),
                                                                                   "b": (5,)}),  # fmt: skip
}


@pytest.mark.parametrize("name", sorted(NN))
def test_the_gradient_of_each_nn_function_matches_torch(name: str) -> None:
    build, reference, shapes = NN[name]
    check_gradients(build, reference, shapes)


@pytest.mark.parametrize("causal", [False, True])
def test_the_gradient_of_the_seed_attention_matches_torch(causal: bool) -> None:
    shapes = {"q": (1, 2, 5, 8), "k": (1, 2, 7, 8), "v": (1, 2, 7, 8)}

    def reference(q, k, v):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)

    check_gradients(lambda q, k, v: ck.nn.attention(q, k, v, causal=causal), reference, shapes)


def test_the_gradient_graph_is_an_ordinary_graph() -> None:
    g = ck.Graph("mlp")
    x, w = g.input("x", (4, 8), "bf16"), g.input("w", (8, 8), "bf16")
    g.output(ck.nn.silu(x @ w), "y")
    gg = ck.grad(g, wrt=("w",))
    assert ck.Graph.from_json(gg.to_json()).structural_hash() == gg.structural_hash()
    assert gg.outputs["d_w"].dtype == "bf16" and gg.outputs["d_w"].shape == (8, 8)
    assert ck.derive(gg).kernels, "the gradient graph derives kernels like any graph"


def test_bad_wrt_is_a_graph_error() -> None:
    g = ck.Graph("f")
    x = g.input("x", (2,), "fp32")
    g.output(x * 2.0, "y")
    with pytest.raises(ck.GraphError, match="not an input"):
        ck.grad(g, wrt=("z",))
    with pytest.raises(ck.GraphError, match="wrt names no input"):
        ck.grad(g, wrt=())
    with pytest.raises(ck.GraphError, match="expected a ck.Graph"):
        ck.grad("graph", wrt=("x",))


@pytest.mark.parametrize("causal", [False, True])
def test_a_saved_output_and_log_sum_exp_become_saved_inputs(causal: bool) -> None:
    """``saved=`` makes the forward's outputs inputs of the gradient graph that hold their values,
    ``outputs=`` leaves the log-sum-exp undifferentiated: the gradients are unchanged, the saved
    inputs are filled from their values when not given, and the graph serialises with them."""
    g = ck.Graph("attention")
    q = g.input("q", (1, 2, 5, 8), "fp32")
    k, v = (g.input(n, (1, 2, 7, 8), "fp32") for n in "kv")
    o, lse = ck.nn.attention(q, k, v, causal=causal, return_lse=True)
    g.output(o, "o")
    g.output(lse, "lse")
    gg = ck.grad(g, wrt=("q", "k", "v"), saved=("o", "lse"), outputs=("o",))
    assert list(gg.inputs) == ["q", "k", "v", "o", "lse", "d_o"] and set(gg.saved) == {"o", "lse"}
    assert gg.inputs["lse"].shape == (1, 2, 5) and gg.inputs["lse"].dtype == "fp32"
    values = {n: RNG.standard_normal(x.shape) for n, x in g.inputs.items()}
    cotangent = RNG.standard_normal(o.shape)
    got = ck.evaluate(gg, {**values, "d_o": cotangent})
    leaves = [torch.tensor(values[n], requires_grad=True) for n in "qkv"]
    out = torch.nn.functional.scaled_dot_product_attention(*leaves, is_causal=causal)
    for name, want in zip("qkv", torch.autograd.grad(out, leaves, torch.tensor(cotangent))):
        np.testing.assert_allclose(got[f"d_{name}"], want.numpy(), rtol=1e-9, atol=1e-9)
    forward = ck.evaluate(g, values)
    examples = gg.example_inputs()
    filled = ck.evaluate(g, {n: examples[n] for n in "qkv"})
    np.testing.assert_allclose(examples["o"], filled["o"])
    np.testing.assert_allclose(examples["lse"], filled["lse"])
    assert np.isfinite(forward["lse"]).all()
    loaded = ck.Graph.from_json(gg.to_json())
    assert loaded.structural_hash() == gg.structural_hash() and set(loaded.saved) == {"o", "lse"}
    assert loaded.saved["o"].shape == o.shape


def test_ops_after_a_saved_output_read_its_saved_input() -> None:
    """An op after a saved output (an output projection after the attention) reads the saved input
    rather than the value recomputed: the gradients match torch's in float64 with the input filled
    from its value, and a different saved value changes the weight gradient that reads it (so the
    gradient graph recomputes no attention output for it)."""
    g = ck.Graph("projected attention")
    q, k, v = (g.input(n, (1, 2, 5, 4), "fp32") for n in "qkv")
    w = g.input("w", (4, 3), "fp32")
    o = ck.nn.attention(q, k, v, causal=True)
    g.output(o, "o")
    g.output(o @ w, "y")
    gg = ck.grad(g, wrt=("q", "k", "v", "w"), saved=("o",), outputs=("y",))
    values = {n: RNG.standard_normal(x.shape) for n, x in g.inputs.items()}
    cotangent = RNG.standard_normal((1, 2, 5, 3))
    got = ck.evaluate(gg, {**values, "d_y": cotangent})
    leaves = {n: torch.tensor(x, requires_grad=True) for n, x in values.items()}
    y = torch.nn.functional.scaled_dot_product_attention(*(leaves[n] for n in "qkv"), is_causal=True) @ leaves["w"]
    for name, want in zip(leaves, torch.autograd.grad(y, list(leaves.values()), torch.tensor(cotangent))):
        np.testing.assert_allclose(got[f"d_{name}"], want.numpy(), rtol=1e-9, atol=1e-9)
    other = RNG.standard_normal(o.shape)
    moved = ck.evaluate(gg, {**values, "o": other, "d_y": cotangent})
    expected = np.einsum("bhsd,bhse->de", other, cotangent)
    np.testing.assert_allclose(moved["d_w"], expected, rtol=1e-9, atol=1e-12)


def test_log_sum_exp_matches_torch() -> None:
    g = ck.Graph("lse")
    x = g.input("x", (3, 2, 9), "fp32")
    g.output(ck.nn.logsumexp(x, axis=1), "a")
    g.output(ck.nn.logsumexp(x), "b")
    values = {"x": RNG.standard_normal((3, 2, 9)) * 4}
    got = ck.evaluate(g, values)
    np.testing.assert_allclose(got["a"], torch.logsumexp(torch.tensor(values["x"]), 1).numpy(), rtol=1e-12)
    np.testing.assert_allclose(got["b"], torch.logsumexp(torch.tensor(values["x"]), -1).numpy(), rtol=1e-12)


def test_bad_saved_and_outputs_are_graph_errors() -> None:
    g = ck.Graph("f")
    x = g.input("x", (2,), "fp32")
    g.output(x * 2.0, "y")
    g.output(x < 1.0, "mask")
    with pytest.raises(ck.GraphError, match="saved names 'z', which is not an output"):
        ck.grad(g, wrt=("x",), saved=("z",))
    with pytest.raises(ck.GraphError, match="outputs names 'x', which is not an output"):
        ck.grad(g, wrt=("x",), outputs=("x",))
    with pytest.raises(ck.GraphError, match="only floating-point outputs take a cotangent"):
        ck.grad(g, wrt=("x",), outputs=("mask",))
    with pytest.raises(ck.GraphError, match="no output of 'f' to differentiate"):
        ck.grad(g, wrt=("x",), outputs=())
    with pytest.raises(ck.GraphError, match="saved values are floating-point"):
        ck.grad(g, wrt=("x",), saved=("mask",))
    h = ck.Graph("h")
    a = h.input("a", (2,), "fp32")
    b = h.input("b", (3,), "fp32")
    with pytest.raises(ck.GraphError, match="is \\(3,\\) fp32, the value it holds \\(2,\\) fp32"):
        h.mark_saved(b, a * 2.0)
    with pytest.raises(ck.GraphError, match="computed from 'a' itself"):
        h.mark_saved(a, a * 2.0)
    with pytest.raises(ck.GraphError, match="expected an input tensor"):
        h.mark_saved(a * 2.0, a)
    h.saved_input("c", a * 2.0)
    with pytest.raises(ck.GraphError, match="already declared"):
        h.mark_saved(h.inputs["c"], a * 3.0)
