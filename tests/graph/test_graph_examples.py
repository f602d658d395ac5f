"""The examples in ``examples/``: their ``build`` contract, primitive-only graphs, exact JSON
round trips, and ``ck.evaluate`` against independent NumPy formulas at small shapes."""

from __future__ import annotations

import ast
import inspect
from collections.abc import Callable

import numpy as np
import pytest

import cherenkov as ck

from .helpers import (
    EXAMPLE_NAMES,
    EXAMPLES_DIR,
    assert_rel,
    load_example,
    np_attention,
    np_gelu_tanh,
    np_layer_norm,
    np_rms_norm,
    np_silu,
    np_softmax,
)

Arrays = dict[str, np.ndarray]


def _np_transformer_block(a: Arrays, heads: int, causal: bool) -> np.ndarray:
    x = a["x"]
    batch, seq, width = x.shape

    def split(t: np.ndarray) -> np.ndarray:
        return t.reshape(batch, seq, heads, width // heads).transpose(0, 2, 1, 3)

    normed = np_rms_norm(x, a["norm1"])
    q, k, v = (split(normed @ a[w]) for w in ("wq", "wk", "wv"))
    attended = np_attention(q, k, v, causal=causal).transpose(0, 2, 1, 3).reshape(batch, seq, width)
    h = x + attended @ a["wo"]
    return h + np_gelu_tanh(np_rms_norm(h, a["norm2"]) @ a["w1"] + a["b1"]) @ a["w2"]


# name: (small shapes to evaluate at, NumPy reference of the single output given inputs, shape, causal)
Reference = Callable[[Arrays, tuple[int, ...], bool], np.ndarray]
SMALL: dict[str, tuple[list[tuple[int, ...]], Reference]] = {
    "attention": (
        [(1, 2, 7, 13, 16), (2, 3, 13, 7, 5), (1, 4, 2, 7, 13, 8), (1, 6, 1, 33, 7, 3)],
        lambda a, s, c: np_attention(a["q"], a["k"], a["v"], causal=c),
    ),
    "rms_norm": ([(5, 8, 3), (7, 13, 1)], lambda a, s, c: np_rms_norm(a["x"], a["weight"], 1e-6) @ a["w"]),
    "mlp": ([(5, 8, 12), (1, 3, 7)], lambda a, s, c: np_gelu_tanh(a["x"] @ a["w1"] + a["b1"]) @ a["w2"]),
    "swiglu": (
        [(5, 8, 12), (3, 1, 7)],
        lambda a, s, c: (np_silu(a["x"] @ a["w_gate"]) * (a["x"] @ a["w_up"])) @ a["w_down"],
    ),
    "softmax": ([(5, 9), (1, 33)], lambda a, s, c: np_softmax(a["x"])),
    "layer_norm": ([(5, 8), (3, 13)], lambda a, s, c: np_layer_norm(a["x"], a["weight"], a["bias"], 1e-5)),
    "transformer_block": (
        [(2, 7, 2, 4, 12), (1, 5, 3, 2, 7)],
        lambda a, s, c: _np_transformer_block(a, heads=s[2], causal=c),
    ),
}

# The main input's shape at each example's default shape.
DEFAULT_MAIN_INPUT: dict[str, tuple[str, tuple[int, ...]]] = {
    "attention": ("q", (1, 8, 4096, 128)),
    "rms_norm": ("x", (4096, 4096)),
    "mlp": ("x", (4096, 1024)),
    "swiglu": ("x", (4096, 1024)),
    "softmax": ("x", (4096, 8192)),
    "layer_norm": ("x", (4096, 4096)),
    "transformer_block": ("x", (1, 1024, 1024)),
}

CASES = [
    pytest.param(name, shape, causal, id=f"{name}-{'x'.join(map(str, shape))}-{'causal' if causal else 'full'}")
    for name in EXAMPLE_NAMES
    for shape in SMALL[name][0]
    for causal in (False, True)
]


def _random_inputs(g: ck.Graph, seed: int) -> Arrays:
    rng = np.random.default_rng(seed)
    return {name: rng.standard_normal(t.shape) for name, t in g.inputs.items()}


def test_every_example_file_is_covered() -> None:
    files = {p.stem for p in EXAMPLES_DIR.glob("*.py")}
    assert files == set(EXAMPLE_NAMES) == set(SMALL)
    assert (EXAMPLES_DIR / "README.md").is_file()


@pytest.mark.parametrize("name", EXAMPLE_NAMES)
def test_example_module_has_the_build_contract(name: str) -> None:
    module = load_example(name)
    assert module.__doc__ and module.__doc__.strip()
    signature = inspect.signature(module.build)
    assert list(signature.parameters) == ["shape", "causal", "dtype"]
    assert [p.default for p in signature.parameters.values()] == [None, False, "bf16"]
    doc = inspect.getdoc(module.build) or ""
    assert "shape" in doc and "default" in doc


@pytest.mark.parametrize("name", EXAMPLE_NAMES)
def test_example_imports_no_other_example(name: str) -> None:
    tree = ast.parse((EXAMPLES_DIR / f"{name}.py").read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            assert node.level == 0, "relative import"
            modules = [node.module or ""]
        elif isinstance(node, ast.Import):
            modules = [alias.name for alias in node.names]
        else:
            continue
        for module in modules:
            assert module.split(".")[0] not in {*EXAMPLE_NAMES, "examples"}, f"{name} imports {module}"


@pytest.mark.parametrize("name", EXAMPLE_NAMES)
def test_example_builds_at_its_default_shape(name: str) -> None:
    g = load_example(name).build()
    assert isinstance(g, ck.Graph)
    main, shape = DEFAULT_MAIN_INPUT[name]
    assert g.inputs[main].shape == shape
    assert {t.dtype for t in g.inputs.values()} == {"bf16"}
    assert set(g.ops()) <= ck.PRIMITIVES
    assert len(g.outputs) == 1


@pytest.mark.parametrize("name,shape,causal", CASES)
def test_example_matches_numpy(name: str, shape: tuple[int, ...], causal: bool) -> None:
    g = load_example(name).build(shape, causal=causal)
    inputs = _random_inputs(g, seed=len(shape) * 31 + causal)
    (out,) = ck.evaluate(g, inputs).values()
    assert_rel(out, SMALL[name][1](inputs, shape, causal))


@pytest.mark.parametrize("name,shape,causal", CASES)
def test_example_uses_only_primitives(name: str, shape: tuple[int, ...], causal: bool) -> None:
    assert set(load_example(name).build(shape, causal=causal).ops()) <= ck.PRIMITIVES


@pytest.mark.parametrize("name,shape,causal", CASES)
def test_example_json_round_trip_is_exact(name: str, shape: tuple[int, ...], causal: bool) -> None:
    g = load_example(name).build(shape, causal=causal)
    loaded = ck.Graph.from_json(g.to_json())
    assert loaded.structural_hash() == g.structural_hash()
    assert loaded.nodes == g.nodes
    inputs = _random_inputs(g, seed=3)
    before, after = ck.evaluate(g, inputs), ck.evaluate(loaded, inputs)
    assert before.keys() == after.keys()
    for key in before:
        np.testing.assert_array_equal(after[key], before[key])


@pytest.mark.parametrize("name", EXAMPLE_NAMES)
def test_example_dtype_parameter(name: str) -> None:
    module = load_example(name)
    shape = SMALL[name][0][0]
    assert {t.dtype for t in module.build(shape, dtype="fp16").inputs.values()} == {"fp16"}
    with pytest.raises(ck.GraphError, match="unknown dtype 'fp64'"):
        module.build(shape, dtype="fp64")


@pytest.mark.parametrize("name", EXAMPLE_NAMES)
def test_example_rejects_a_shape_of_the_wrong_length(name: str) -> None:
    module = load_example(name)
    with pytest.raises(ck.GraphError, match=rf"{name} example: shape \(2, 2, 2, 2, 2, 2, 2\) must be \("):
        module.build((2,) * 7)
    with pytest.raises(ck.GraphError, match=f"{name} example"):
        module.build(tuple(0 for _ in SMALL[name][0][0]))


def test_attention_example_masks_with_where_only_when_causal() -> None:
    module = load_example("attention")
    full, causal = module.build((1, 2, 7, 13, 8)), module.build((1, 2, 7, 13, 8), causal=True)
    assert full.ops()["where"] == 0 and full.ops()["iota"] == 0
    assert causal.ops()["where"] >= 1 and causal.ops()["iota"] == 2
    assert set(full.inputs) == {"q", "k", "v"} and set(full.outputs) == {"o"}


def test_attention_example_gqa_shapes_and_errors() -> None:
    module = load_example("attention")
    g = module.build((2, 6, 2, 7, 13, 8))
    assert g.inputs["q"].shape == (2, 6, 7, 8)
    assert g.inputs["k"].shape == g.inputs["v"].shape == (2, 2, 13, 8)
    assert g.outputs["o"].shape == (2, 6, 7, 8)
    assert g.ops()["expand"] > module.build((2, 6, 7, 13, 8)).ops()["expand"]
    with pytest.raises(ck.GraphError, match="H=6 .* H_KV=4 .* multiple"):
        module.build((1, 6, 4, 7, 13, 8))


def test_attention_example_is_not_built_by_nn_attention() -> None:
    """The example is the textbook spelling (max-subtracted exp, then divide); ``ck.nn.attention``
    spells the mask differently, so their causal graphs differ while their values agree."""
    module = load_example("attention")
    example = module.build((1, 2, 7, 13, 8), causal=True)
    g = ck.Graph("attention")
    q, k, v = (example.inputs[n] for n in "qkv")
    q, k, v = g.input("q", q.shape, "bf16"), g.input("k", k.shape, "bf16"), g.input("v", v.shape, "bf16")
    g.output(ck.nn.attention(q, k, v, causal=True), "o")
    assert g.structural_hash() != example.structural_hash()
    inputs = _random_inputs(g, seed=5)
    assert_rel(ck.evaluate(example, inputs)["o"], ck.evaluate(g, inputs)["o"])
