"""Hostile or unlucky input: clear GraphErrors, user text never spliced into source,
output confined to --out, and a useful answer without a GPU or a compiler."""

from __future__ import annotations

import math
import re

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import cherenkov as ck
from cherenkov import cli
from cherenkov.search import environment

IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def attention(names: tuple[str, str, str, str], graph_name: str = "attention") -> ck.Graph:
    g = ck.Graph(graph_name)
    q, k, v = (g.input(n, (1, 2, 64, 64), "bf16") for n in names[:3])
    g.output(ck.nn.attention(q, k, v), names[3])
    return g


@given(st.text(min_size=1, max_size=20).filter(lambda s: not IDENTIFIER.fullmatch(s) or len(s) > 64))
def test_names_that_are_not_identifiers_are_refused(name: str) -> None:
    with pytest.raises(ck.GraphError, match="is not valid"):
        ck.Graph("g").input(name, (2, 2))


@given(st.lists(st.integers(min_value=-5, max_value=0), min_size=1, max_size=4))
def test_zero_or_negative_dimensions_are_refused(dims: list[int]) -> None:
    with pytest.raises(ck.GraphError, match="zero or negative dimension"):
        ck.Graph("g").input("x", (3, *dims))


@given(st.integers(min_value=2**31, max_value=2**40))
def test_stored_tensors_past_32_bit_indexing_are_refused(count: int) -> None:
    with pytest.raises(ck.GraphError, match=r"2\^31 - 1"):
        ck.Graph("g").input("x", (count,))


@pytest.mark.parametrize("dtype", ["fp64", "float64", "int8", "fp8", "complex64", None])
def test_dtypes_no_target_can_run_are_refused(dtype) -> None:
    with pytest.raises(ck.GraphError, match="valid dtypes: bf16, fp16, fp32"):
        ck.Graph("g").input("x", (2, 2), dtype)


def test_nan_constants_are_refused_but_infinite_mask_values_are_allowed() -> None:
    g = ck.Graph("g")
    x = g.input("x", (4,))
    with pytest.raises(ck.GraphError, match="NaN"):
        g.constant(math.nan)
    with pytest.raises(ck.GraphError, match="NaN"):
        x.pad(((1, 1),), value=math.nan)
    masked = ck.where(x < 0.0, -math.inf, x)  # masks need ±inf
    assert masked.dtype == "fp32"


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.lists(st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,11}", fullmatch=True), min_size=4, max_size=4, unique=True),
    st.text(min_size=1, max_size=40).filter(str.isprintable),
)
def test_generated_source_holds_user_text_only_as_validated_identifiers(names: list[str], graph_name: str) -> None:
    marked = tuple(f"usr_{n}" for n in names)
    g = attention(marked, f"<script>{graph_name}")
    plan = ck.derive(g).plans("sm_90")[0]
    source = ck.codegen.cuda_source(plan)
    assert "<script>" not in source
    for match in re.finditer(r"usr_", source):
        word = IDENTIFIER.match(source, match.start())
        assert word is not None and word.group() in marked


def test_without_gpu_or_compiler_the_search_still_derives_ranks_and_emits_source(monkeypatch, tmp_path) -> None:
    monkeypatch.setattr(environment, "visible_gpus", lambda: [])
    monkeypatch.setattr(environment, "toolkit", lambda: "none")
    result = ck.optimize(attention(("q", "k", "v", "o")), target="sm_120", out=tmp_path, force=True)
    assert any("no CUDA compiler" in note for note in result.summary.notes)
    assert any("no GPU" in note for note in result.summary.notes)
    assert result.candidates and all(c.status == "modelled" for c in result.candidates)
    assert "mma.sync" in result.best.source
    assert "modelled" in result.report_html.read_text()


def test_cli_output_stays_inside_out_and_the_cache(monkeypatch, tmp_path, capsys) -> None:
    monkeypatch.setenv("CHERENKOV_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(environment, "visible_gpus", lambda: [])
    monkeypatch.setattr(environment, "toolkit", lambda: "none")  # no compile: this test is about paths
    monkeypatch.chdir(tmp_path)
    before = set(tmp_path.rglob("*"))
    code = cli.main(["optimize", "--example", "attention", "--shape", "1,2,64,64,64", "--out", "run/here", "--target", "sm_90"])
    assert code == 0
    printed = capsys.readouterr().out
    assert "modelled" in printed and "no GPU" in printed
    created = set(tmp_path.rglob("*")) - before
    outside = [p for p in created if not (p.is_relative_to(tmp_path / "run" / "here") or p.is_relative_to(tmp_path / "cache"))]
    assert outside == [tmp_path / "run"], outside
    assert (tmp_path / "run" / "here" / "report.html").is_file()
