"""The command line: help, version, graph summaries, and reading a finished search."""

from __future__ import annotations

import csv

import pytest

import cherenkov as ck
from cherenkov import cli
from cherenkov.search import environment
from cherenkov.search.report import read_json


def run(capsys, *argv: str) -> tuple[int, str]:
    code = cli.main(list(argv))
    return code, capsys.readouterr().out


def test_version_and_help(capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--version"])
    assert exit_info.value.code == 0 and ck.__version__ in capsys.readouterr().out
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    help_text = capsys.readouterr().out
    for command in ("graph", "optimize", "dump", "report", "db"):
        assert command in help_text


def test_graph_summary_of_the_attention_example(capsys) -> None:
    code, out = run(capsys, "graph", "--example", "attention", "--shape", "1,2,64,96,64", "--causal")
    assert code == 0
    assert "GFLOP" in out and "sum_reduce" in out and "bf16" in out and "1x2x64x64" in out


def test_graph_from_a_file_and_function(capsys, tmp_path) -> None:
    source = tmp_path / "model.py"
    source.write_text(
        "import cherenkov as ck\n"
        "def build(shape=(4, 8)):\n"
        "    g = ck.Graph('tiny')\n"
        "    g.output(ck.nn.softmax(g.input('x', shape)), 'y')\n"
        "    return g\n"
    )
    code, out = run(capsys, "graph", f"{source}:build", "--shape", "3,5")
    assert code == 0 and "3x5" in out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["graph", "--example", "nope"], "not a built-in example"),
        (["graph", "missing.py:build"], "no such file"),
        (["graph", "file_without_function"], "path/to/file.py:function"),
        (["dump", "/nonexistent-run"], "no report.json"),
    ],
)
def test_user_errors_are_reported_not_raised(capsys, argv, message) -> None:
    code, out = run(capsys, *argv)
    assert code == 2 and message in out


def test_dump_and_report_read_a_finished_search(capsys, tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(environment, "visible_gpus", lambda: [])
    monkeypatch.setattr(environment, "toolkit", lambda: "none")
    out_dir = tmp_path / "run"
    code, _ = run(capsys, "optimize", "--example", "attention", "--shape", "1,2,64,64,64", "--out", str(out_dir))
    assert code == 0
    code, out = run(capsys, "dump", str(out_dir))
    assert code == 0 and "mma.sync.aligned.m16n8k16" in out
    code, out = run(capsys, "report", str(out_dir), "--csv")
    assert code == 0 and str((out_dir / "report.html").resolve()) in out
    with open(out_dir / "candidates.csv", newline="") as handle:
        rows = list(csv.DictReader(handle))
    times = [float(r["time_ms"]) for r in rows]
    assert rows and times == sorted(times)


def test_the_result_table_shows_whole_candidate_keys_and_partial_answers(capsys, tmp_path, monkeypatch) -> None:
    """An 80-column console folds the keys over lines instead of cutting them; a repeated
    budgeted search says it was answered from the database."""
    monkeypatch.setattr(environment, "visible_gpus", lambda: [])
    monkeypatch.setattr(environment, "toolkit", lambda: "none")
    argv = ("optimize", "--example", "attention", "--shape", "1,2,64,96,64", "--out", str(tmp_path), "--budget", "30")
    code, out = run(capsys, *argv)
    assert code == 0
    last_cells = [line.split("│")[-2].strip() for line in out.splitlines() if line.count("│") >= 3]
    folded = "".join(last_cells)
    ranked = sorted(read_json(tmp_path / "report.json")["candidates"], key=lambda c: (c["time_ms"], c["id"]))
    assert all(c["id"] in folded for c in ranked[:10]), folded
    code, out = run(capsys, *argv)
    assert code == 0 and "answered from the tuning database" in out
    code, out = run(capsys, *argv, "--resume")
    assert code == 0 and "answered from the tuning database" in out, "a complete search answers a resume too"
