"""JSON round trips are exact (structure, hash, constants bit for bit, evaluation); malformed
or tampered documents raise ``ck.GraphError`` naming what is wrong."""

from __future__ import annotations

import json
import math
import struct

import numpy as np
import pytest

import cherenkov as ck

TRICKY_CONSTANTS = [1 / 3, -math.inf, math.inf, math.pi, 5e-324, -(2.0**-1074), 1.7976931348623157e308, 0.1, -0.0]


def _rich_graph() -> ck.Graph:
    """A graph touching every primitive, with awkward constants."""
    g = ck.Graph("rich graph (display name)")
    x = g.input("x", (3, 4), "bf16")
    y = g.input("y", (4,), "fp16")
    s = (x @ x.mT) * (1 / 3)
    i = ck.arange(3, graph=g)
    s = ck.where(i[None, :] <= i[:, None], s, -math.inf)
    p = (s - s.max(axis=-1, keepdim=True)).exp()
    o = (p / p.sum(axis=-1, keepdim=True)) @ x
    z = (o + y).maximum(0.1).sqrt().log2().sin() % 0.7
    padded = z.permute(1, 0).pad([(1, 0), (0, 2)], -math.inf).contiguous()
    g.output(padded[1:, :3].cast("fp32"), "out")
    g.output(ck.cat([z, (o * math.pi).cast("bf16")], axis=0), "cat")
    g.output(x.cast("int32") * 2 + 5, "ints")
    g.constant(5e-324)
    g.constant(-0.0)
    return g


def _inputs(g: ck.Graph) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(7)
    return {name: np.abs(rng.standard_normal(t.shape)) + 0.5 for name, t in g.inputs.items()}


def _bits(value: float) -> bytes:
    return struct.pack("<d", value)


def test_rich_graph_uses_every_primitive() -> None:
    g = _rich_graph()
    assert set(g.ops()) == set(ck.PRIMITIVES)


def test_round_trip_keeps_structure_hash_and_name() -> None:
    g = _rich_graph()
    loaded = ck.Graph.from_json(g.to_json())
    assert loaded.structural_hash() == g.structural_hash()
    assert loaded.nodes == g.nodes
    assert loaded.name == g.name
    assert list(loaded.inputs) == list(g.inputs) and list(loaded.outputs) == list(g.outputs)
    assert loaded.to_json() == g.to_json()


def test_round_trip_evaluates_identically() -> None:
    g = _rich_graph()
    loaded = ck.Graph.from_json(g.to_json())
    inputs = _inputs(g)
    before, after = ck.evaluate(g, inputs), ck.evaluate(loaded, inputs)
    assert before.keys() == after.keys()
    for name in before:
        np.testing.assert_array_equal(after[name], before[name])


@pytest.mark.parametrize("value", TRICKY_CONSTANTS, ids=repr)
def test_float_constants_survive_bit_exactly(value: float) -> None:
    g = ck.Graph("constant")
    x = g.input("x", (2,))
    g.output(x * 2.0 + value, "c")
    g.output(x.pad([(1, 1)], value), "p")
    loaded = ck.Graph.from_json(g.to_json())
    constants = {_bits(n.attrs[0]) for n in loaded.nodes if n.op == "constant"}
    assert constants == {_bits(2.0), _bits(value)}
    assert [_bits(n.attrs[1]) for n in loaded.nodes if n.op == "pad"] == [_bits(value)]
    out = ck.evaluate(loaded, {"x": np.ones(2)})
    assert _bits(out["p"][0]) == _bits(value)


def test_one_third_is_not_rounded_through_decimal_text() -> None:
    g = ck.Graph("third")
    g.output(g.input("x", (1,)) * (1 / 3))
    text = g.to_json()
    loaded = ck.Graph.from_json(text)
    (third,) = [n.attrs[0] for n in loaded.nodes if n.op == "constant"]
    assert third.hex() == (1 / 3).hex()
    assert json.loads(text)["format"] == "cherenkov.graph" and json.loads(text)["version"] == 1


def test_structural_hash_ignores_the_graph_name_but_not_constants() -> None:
    def build(name: str, c: float) -> ck.Graph:
        g = ck.Graph(name)
        g.output(g.input("x", (2,)) * c)
        return g

    assert build("a", 2.0).structural_hash() == build("b", 2.0).structural_hash()
    assert build("a", 2.0).structural_hash() != build("a", 2.5).structural_hash()
    assert build("a", 1 / 3).structural_hash() != build("a", 0.3333333333333333 + 2**-54).structural_hash()


# ------------------------------------------------------------------ malformed documents


def _document_graph() -> ck.Graph:
    g = ck.Graph("doc")
    x = g.input("x", (2, 3))
    g.output((x + 1.0).sum(axis=1), "y")
    return g


def _document() -> dict:
    return json.loads(_document_graph().to_json())


def _load(document: object) -> ck.Graph:
    return ck.Graph.from_json(json.dumps(document))


def _op_index(document: dict, op: str) -> int:
    return next(i for i, n in enumerate(document["nodes"]) if n["op"] == op)


def test_untampered_document_loads() -> None:
    assert _load(_document()).structural_hash() == _document_graph().structural_hash()


def test_text_that_is_not_json() -> None:
    with pytest.raises(ck.GraphError, match="from_json: not valid JSON"):
        ck.Graph.from_json("{nodes: ")


@pytest.mark.parametrize("document", [[], "graph", {"format": "onnx", "version": 1}, {"version": 1}], ids=repr)
def test_wrong_format(document: object) -> None:
    with pytest.raises(ck.GraphError, match="from_json: not a cherenkov.graph document"):
        _load(document)


@pytest.mark.parametrize("version", [2, 0, "1", None])
def test_wrong_version(version: object) -> None:
    document = _document()
    document["version"] = version
    with pytest.raises(ck.GraphError, match=rf"from_json: version {version!r} is not supported.*reads 1"):
        _load(document)


def test_tampered_node_shape() -> None:
    document = _document()
    index = _op_index(document, "add")
    document["nodes"][index]["shape"] = [2, 4]
    with pytest.raises(
        ck.GraphError, match=rf"from_json: node {index} \(add\) records shape \(2, 4\) fp32.*\(2, 3\) fp32"
    ):
        _load(document)


def test_tampered_input_shape_is_caught_downstream() -> None:
    document = _document()
    document["nodes"][0]["shape"] = [2, 5]
    with pytest.raises(ck.GraphError, match=r"\(2, 5\).*\(2, 3\)"):
        _load(document)


def test_tampered_node_dtype() -> None:
    document = _document()
    index = _op_index(document, "sum_reduce")
    document["nodes"][index]["dtype"] = "bf16"
    with pytest.raises(ck.GraphError, match=rf"node {index} \(sum_reduce\) records shape \(2,\) bf16.*\(2,\) fp32"):
        _load(document)


def test_tampered_attribute_is_revalidated() -> None:
    document = _document()
    index = _op_index(document, "sum_reduce")
    document["nodes"][index]["attrs"] = [5]
    with pytest.raises(ck.GraphError, match=r"sum_reduce: axis 5 .*\(2, 3\)"):
        _load(document)


def test_unknown_op() -> None:
    document = _document()
    document["nodes"][1]["op"] = "tanh"
    with pytest.raises(ck.GraphError, match="from_json: node 1 has unknown op 'tanh'"):
        _load(document)


def test_node_referring_to_a_later_node() -> None:
    document = _document()
    document["nodes"][1]["inputs"] = [1]
    with pytest.raises(ck.GraphError, match=r"from_json: node 1 .* not earlier nodes"):
        _load(document)


def test_wrong_operand_count() -> None:
    document = _document()
    index = _op_index(document, "add")
    document["nodes"][index]["inputs"] = document["nodes"][index]["inputs"][:1]
    with pytest.raises(ck.GraphError, match="add: takes 2 operands, got 1"):
        _load(document)


def test_output_referring_to_a_missing_node() -> None:
    document = _document()
    document["outputs"]["y"] = 99
    with pytest.raises(ck.GraphError, match="from_json: output 'y' refers to missing node 99"):
        _load(document)


def test_input_map_that_does_not_name_an_input_node() -> None:
    document = _document()
    document["inputs"]["x"] = 1
    with pytest.raises(ck.GraphError, match="from_json: input 'x' does not name an input node"):
        _load(document)


def test_bad_input_name_in_document() -> None:
    document = _document()
    document["nodes"][0]["attrs"] = ["x; drop table"]
    with pytest.raises(ck.GraphError, match=r"input: name 'x; drop table' is not valid"):
        _load(document)


def test_bad_hexadecimal_float() -> None:
    document = _document()
    index = _op_index(document, "constant")
    document["nodes"][index]["attrs"] = [{"f": "0xZZ"}]
    with pytest.raises(ck.GraphError, match="from_json: '0xZZ' is not a hexadecimal float"):
        _load(document)
    document["nodes"][index]["attrs"] = [{"f": "0x1p0", "g": 1}]
    with pytest.raises(ck.GraphError, match="from_json: unexpected attribute object"):
        _load(document)


def test_nan_constant_smuggled_in_as_hex() -> None:
    document = _document()
    index = _op_index(document, "constant")
    document["nodes"][index]["attrs"] = [{"f": "nan"}]
    with pytest.raises(ck.GraphError, match="constant: NaN"):
        _load(document)


def test_nan_pad_value_smuggled_in_as_hex() -> None:
    """``Tensor.pad`` rejects a NaN fill; the loader must too."""
    g = ck.Graph("pad")
    g.output(g.input("x", (2,)).pad([(1, 0)], -1.0))
    document = json.loads(g.to_json())
    index = _op_index(document, "pad")
    document["nodes"][index]["attrs"][1] = {"f": "nan"}
    with pytest.raises(ck.GraphError, match="pad"):
        _load(document)


@pytest.mark.parametrize("record", [5, [1, 2]], ids=repr)
def test_node_record_that_is_not_an_object(record: object) -> None:
    document = _document()
    document["nodes"][1] = record
    with pytest.raises(ck.GraphError, match="from_json: node 1"):
        _load(document)


def test_node_with_wrong_number_of_attributes() -> None:
    document = _document()
    index = _op_index(document, "sum_reduce")
    document["nodes"][index]["attrs"] = [1, 2]
    with pytest.raises(ck.GraphError, match="sum_reduce"):
        _load(document)


def test_input_node_without_a_name() -> None:
    document = _document()
    document["nodes"][0]["attrs"] = []
    with pytest.raises(ck.GraphError, match="input"):
        _load(document)
