"""The search report: report.json round trip, escaped self-contained HTML (checked in
headless Chromium where it is installed), and the CSV table."""

from __future__ import annotations

import csv
import dataclasses
import json
import math
import os
import re
import signal
import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path

import pytest

from cherenkov.search.records import CandidateResult, Environment, Timing
from cherenkov.search.report import (
    KernelSummary,
    ReportError,
    SearchSummary,
    read_json,
    render_html,
    write_csv,
    write_html,
    write_json,
)

HOSTILE_NAME = "<script>alert(1)</script>"
HOSTILE_REASON = 'ptxas: bad "asm", line 3</pre><script>alert(2)</script>'
HOSTILE_INPUT = 'q"><img src=x onerror=alert(3)>'
FLOPS = 4.0 * 1 * 8 * 4096 * 8192 * 128  # the seed attention problem
PEAK = 641.0
CHROMIUM = "/usr/bin/chromium"


def _ok(cid: str, median_ms: float, block_q: int) -> CandidateResult:
    return CandidateResult(
        id=cid,
        kernel="attn",
        kind="flash_attention",
        params={  # nested, as the search records plans
            "kind": "flash_attention",
            "schedule": {"block_q": block_q, "block_kv": 64, "warps": 4, "stages": 2, "swizzle": True},
            "target": "sm_90",
        },
        source_hash=f"h{cid}",
        status="ok",
        registers=168,
        smem_bytes=49152,
        spill_bytes=0,
        compile_seconds=2.5,
        rel_error=3.1e-3,
        timing=Timing(min_ms=median_ms * 0.98, median_ms=median_ms, max_ms=median_ms * 1.1, samples=50),
        predicted_ms=median_ms * 1.2,
        flops=FLOPS,
        peak_tflops=PEAK,
    )


def _failed(cid: str, status: str, reason: str, **extra) -> CandidateResult:
    return CandidateResult(
        id=cid,
        kernel="attn",
        kind="flash_attention",
        params={"block_q": 256, "block_kv": 128, "warps": 8, "stages": 3, "swizzle": False},
        source_hash=f"h{cid}",
        status=status,
        reason=reason,
        flops=FLOPS,
        peak_tflops=PEAK,
        **extra,
    )


def _modelled(cid: str, predicted_ms: float) -> CandidateResult:
    return CandidateResult(
        id=cid,
        kernel="attn",
        kind="flash_attention",
        params={"block_q": 64, "block_kv": 32, "warps": 4, "stages": 2, "swizzle": True},
        source_hash=f"h{cid}",
        status="modelled",
        registers=128,
        smem_bytes=24576,
        spill_bytes=0,
        compile_seconds=1.0,
        predicted_ms=predicted_ms,
        flops=FLOPS,
        peak_tflops=PEAK,
    )


CANDIDATES = (
    _ok("c1", 0.55, 64),
    _failed("c2", "compile_error", HOSTILE_REASON + "\nerror: too many resources, sorry", compile_seconds=0.4),
    _ok("c3", 0.30, 128),
    _failed("c4", "wrong", "=HYPERLINK(\"x\"), rel error nan", rel_error=math.nan, timing=Timing(0.2, 0.21, 0.3, 10)),
    _failed("c5", "crash", "@illegal memory access, code 700"),
    _failed("c6", "timeout", "-hung for 10 s"),
    _ok("c7", 0.40, 128),
    dataclasses.replace(_ok("c8", 0.90, 64), status="stopped_early"),
    dataclasses.replace(_ok("c9", 1.0, 64), status="unmeasured", timing=None, predicted_ms=None),
)
MODELLED = (_modelled("m1", 0.5), _modelled("m2", 0.35), _modelled("m3", 0.8))
SOURCE = (
    '#include <cuda_bf16.h>\n// a < b && c > d\nextern "C" __global__ void attn(const bf16* q) {}\n'
    "</code></pre><script>x()</script>"
)


def make_summary(**overrides) -> SearchSummary:
    values = dict(
        graph_name=HOSTILE_NAME,
        graph_hash="ab12" * 16,
        environment=Environment(
            target="sm_90", gpu="NVIDIA H200", compute_capability="9.0", toolkit="12.8", cherenkov="0.1.0",
            measured=True,
        ),
        kernels=(KernelSummary("attn", "flash_attention"),),
        trace=("exp_to_exp2", "div_to_recip", "sum_mul_to_contract", "factor_out_of_sum", "online_softmax", "flash"),
        stats={"eclasses": 412, "enodes": 1290, "iterations": 7, "seconds": 0.081, "saturated": True},
        candidates=CANDIDATES,
        winners={"attn": "c3"},
        sources={"attn": SOURCE},
        references={"sdpa_flash": 350.1, "sdpa_cudnn": 620.0, "sdpa_efficient": 168.0},
        wall_seconds=42.5,
        unmeasured=0,
        notes=("2 candidates pruned by the shared-memory budget",),
        inputs={HOSTILE_INPUT: "bf16[1,8,4096,128]", "k": "bf16[1,8,8192,128]"},
    )
    values.update(overrides)
    return SearchSummary(**values)


def modelled_summary() -> SearchSummary:
    return make_summary(
        environment=Environment(target="sm_120", measured=False),
        candidates=MODELLED + CANDIDATES[1:2],
        winners={"attn": "m2"},
        references={},
        notes=("ranked by the cost model, not measured: no GPU",),
    )


class _Dom(HTMLParser):
    """Element ids, tags, and the src/href attributes of an HTML document."""

    def __init__(self, text: str) -> None:
        super().__init__()
        self.tags: list[str] = []
        self.ids: dict[str, str] = {}
        self.links: list[str] = []
        self.rows_in: dict[str, int] = {}
        self._table: str | None = None
        self._in_tbody = False
        self.feed(text)

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        self.tags.append(tag)
        if "id" in attrs:
            self.ids[attrs["id"]] = tag
        self.links += [value or "" for name, value in attrs.items() if name in ("src", "href", "xlink:href")]
        if tag == "table":
            self._table = attrs.get("id")
        elif tag == "tbody":
            self._in_tbody = True
        elif tag == "tr" and self._in_tbody and self._table:
            self.rows_in[self._table] = self.rows_in.get(self._table, 0) + 1

    def handle_endtag(self, tag):
        if tag == "tbody":
            self._in_tbody = False
        elif tag == "table":
            self._table = None


# ---------------------------------------------------------------------------- JSON


def test_json_round_trip(tmp_path):
    summary = make_summary()
    path = write_json(summary, tmp_path / "report.json")
    data = read_json(path)
    back = SearchSummary.from_json(data)
    assert back == summary  # the NaN reads back as math.nan, the same object as in CANDIDATES
    assert math.isnan(back.candidates[3].rel_error)
    assert write_json(back, tmp_path / "again.json").read_bytes() == path.read_bytes()


def test_json_schema_fields(tmp_path):
    data = json.loads(write_json(make_summary(), tmp_path / "report.json").read_text())
    assert list(data)[:2] == ["schema", "version"]
    assert data["schema"] == "cherenkov.report" and data["version"] == 1
    assert data["graph"]["name"] == HOSTILE_NAME
    assert data["environment"]["gpu"] == "NVIDIA H200" and data["environment"]["measured"] is True
    assert data["derivation"]["trace"][0] == "exp_to_exp2"
    assert data["derivation"]["stats"]["enodes"] == 1290
    assert data["derivation"]["kernels"] == [{"name": "attn", "kind": "flash_attention", "shape": []}]
    assert data["winners"] == {"attn": "c3"} and data["sources"]["attn"] == SOURCE
    assert data["references"]["sdpa_cudnn"] == 620.0
    assert data["wall_seconds"] == 42.5 and data["unmeasured"] == 0 and data["notes"]
    assert len(data["candidates"]) == len(CANDIDATES)
    first = data["candidates"][0]
    for key in ("params", "registers", "smem_bytes", "spill_bytes", "compile_seconds", "status", "reason",
                "rel_error", "timing", "tflops", "percent_of_peak", "predicted_ms"):  # fmt: skip
        assert key in first
    assert first["timing"]["median_ms"] == 0.55
    assert first["tflops"] == pytest.approx(FLOPS / 0.55e9)
    assert data["candidates"][3]["rel_error"] == "NaN"  # strict JSON: no bare NaN


def test_summary_accepts_plain_lists_and_dicts(tmp_path):
    """As optimize.py builds it: lists, and kernels as dicts with their shape."""
    plain = make_summary(
        kernels=[{"name": "attn", "kind": "flash_attention", "shape": [1, 8, 4096, 128]}],
        trace=list(make_summary().trace),
        candidates=list(CANDIDATES),
        notes=list(make_summary().notes),
    )
    assert plain.kernels == (KernelSummary("attn", "flash_attention", (1, 8, 4096, 128)),)
    assert plain.candidates == CANDIDATES
    assert SearchSummary.from_json(read_json(write_json(plain, tmp_path / "report.json"))) == plain
    assert "flash_attention, 1×8×4096×128" in render_html(plain)


def test_json_deterministic(tmp_path):
    a = write_json(make_summary(), tmp_path / "a.json").read_bytes()
    shuffled = make_summary(references={"sdpa_efficient": 168.0, "sdpa_cudnn": 620.0, "sdpa_flash": 350.1})
    assert write_json(shuffled, tmp_path / "b.json").read_bytes() == a


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[]", "JSON object"),
        ('{"schema": "other", "version": 1}', "not a cherenkov report"),
        ('{"schema": "cherenkov.report", "version": 2}', "version 2"),
        ('{"schema": "cherenkov.report", "version": 1}', "missing"),
        ("{not json", "not JSON"),
    ],
)
def test_read_json_rejects(tmp_path, text, message):
    path = tmp_path / "report.json"
    path.write_text(text)
    with pytest.raises(ReportError, match=message):
        read_json(path)


# ---------------------------------------------------------------------------- HTML


def test_html_contents(tmp_path):
    page = write_html(make_summary(), tmp_path / "report.html").read_text()
    dom = _Dom(page)
    assert dom.ids["tflops-chart"] == "svg"
    assert dom.ids["candidates"] == "table" and dom.rows_in["candidates"] == len(CANDIDATES)
    assert dom.ids["source"] == "pre" and dom.ids["derivation"] == "ol"
    assert "extern &quot;C&quot; __global__ void attn" in page
    for name in ("sdpa_flash 350.1", "sdpa_cudnn 620.0", "sdpa_efficient 168.0"):
        assert name in page  # labelled reference lines
    assert 'class="winner" data-candidate="c3"' in page and 'class="bar-winner"' in page
    assert page.count('class="mark-fail"') == 4  # compile_error, wrong, crash, timeout
    assert "Modelled, not measured" not in page and "NVIDIA H200" in page
    assert "<span>block_q=128</span>" in page and "target=" not in page  # the schedule, not the plan


def test_html_derivation_in_order():
    page = render_html(make_summary())
    positions = [page.index(f"<li><code>{rule}</code></li>") for rule in make_summary().trace]
    assert positions == sorted(positions)


def test_html_escapes_everything():
    page = render_html(make_summary())
    assert "<script" not in page.lower()
    assert "<img" not in page.lower()
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page  # graph name, shown escaped
    assert "&lt;/pre&gt;&lt;script&gt;alert(2)" in page  # the reason
    assert "&lt;/code&gt;&lt;/pre&gt;&lt;script&gt;x()" in page  # the source
    assert "q&quot;&gt;&lt;img src=x" in page  # the input name


def test_html_needs_no_network():
    page = render_html(make_summary())
    assert "http://" not in page and "https://" not in page
    dom = _Dom(page)
    assert all(link.startswith("#") for link in dom.links), dom.links
    assert not {"script", "link", "img", "iframe", "object", "embed"} & set(dom.tags)
    assert "@import" not in page and "url(http" not in page


def test_html_says_modelled():
    page = render_html(modelled_summary())
    assert "Modelled, not measured." in page
    assert "predictions of the cost model" in page
    assert "TFLOP/s (modelled)" in page
    assert "≈0.350" in page  # predicted time, marked
    assert 'class="bar-winner"' in page and 'class="bar-modelled"' in page


def test_html_attributes_quoted():
    page = render_html(make_summary())
    for tag in re.findall(r"<[a-zA-Z][^>]*>", page):
        bare = re.sub(r'="[^"]*"', '=""', tag)  # every value double-quoted: only name="" pairs remain
        assert re.fullmatch(r'<[\w-]+(\s+[\w:-]+(="")?)*\s*/?>', bare), tag


def test_html_independent_of_mapping_order():
    shuffled = make_summary(
        references=dict(reversed(make_summary().references.items())),
        stats=dict(reversed(make_summary().stats.items())),
    )
    assert shuffled == make_summary() and render_html(shuffled) == render_html(make_summary())


def test_html_rerenders_from_json(tmp_path):
    summary = make_summary()
    data = read_json(write_json(summary, tmp_path / "report.json"))
    assert render_html(data) == render_html(summary)


def test_html_without_winner():
    page = render_html(make_summary(candidates=CANDIDATES[1:2], winners={"attn": None}, sources={}, references={}))
    assert "no candidate passed verification" in page
    assert 'id="tflops-chart"' in page and 'id="candidates"' in page


def _dump_dom(html_path: Path, profile: Path, timeout_s: float = 60.0) -> str:
    """The DOM Chromium builds from ``html_path``; Chromium and its helpers are killed if it
    hangs (an executing ``alert()`` would block ``--dump-dom`` for good)."""
    command = [
        CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync",
        f"--user-data-dir={profile}", "--dump-dom", html_path.resolve().as_uri(),
    ]  # fmt: skip
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # chromium and the helpers it started
        proc.communicate()
        pytest.fail(f"chromium did not dump {html_path.name} within {timeout_s:.0f} s")
    assert proc.returncode == 0, err[-2000:]
    return out


@pytest.mark.skipif(
    shutil.which(CHROMIUM) is None,
    reason=f"{CHROMIUM} not installed (Debian: apt-get install -y chromium)",
)
def test_html_in_headless_chromium(tmp_path):
    path = write_html(make_summary(), tmp_path / "report.html")
    dom = _Dom(_dump_dom(path, tmp_path / "profile"))
    assert dom.ids.get("tflops-chart") == "svg"
    assert dom.ids.get("candidates") == "table"
    assert dom.rows_in.get("candidates") == len(CANDIDATES)
    assert dom.ids.get("source") == "pre"
    assert dom.ids.get("derivation") == "ol"
    assert "script" not in dom.tags and "img" not in dom.tags


# ---------------------------------------------------------------------------- CSV


def _read_csv(path: Path) -> list[dict[str, str]]:
    with path.open(newline="", encoding="utf-8") as f:
        return list(csv.DictReader(f))


def test_csv_sorted_failures_last(tmp_path):
    rows = _read_csv(write_csv(make_summary(), tmp_path / "report.csv"))
    assert [r["id"] for r in rows[:5]] == ["c3", "c7", "c1", "c8", "c9"]  # 0.30, 0.40, 0.55, 0.90 ms, untimed
    assert {r["status"] for r in rows[5:]} == {"compile_error", "wrong", "crash", "timeout"}
    assert len(rows) == len(CANDIDATES)
    assert rows[0]["winner"] == "True" and rows[0]["param.schedule.block_q"] == "128"
    assert rows[-1]["param.block_q"] == "256" and rows[-1]["param.schedule.block_q"] == ""
    assert float(rows[0]["median_ms"]) == 0.30


def test_csv_escapes_and_guards_formulas(tmp_path):
    rows = {r["id"]: r for r in _read_csv(write_csv(make_summary(), tmp_path / "report.csv"))}
    assert rows["c2"]["reason"].startswith('ptxas: bad "asm", line 3</pre>')  # commas, quotes, newline kept
    assert "\n" in rows["c2"]["reason"]
    assert rows["c4"]["reason"] == "'=HYPERLINK(\"x\"), rel error nan"
    assert rows["c5"]["reason"].startswith("'@")
    assert rows["c6"]["reason"].startswith("'-")
    assert rows["c4"]["rel_error"] == "nan"


def test_csv_from_report_json(tmp_path):
    summary = make_summary()
    data = read_json(write_json(summary, tmp_path / "report.json"))
    from_summary = write_csv(summary, tmp_path / "a.csv").read_bytes()
    assert write_csv(data, tmp_path / "b.csv").read_bytes() == from_summary


def test_csv_modelled_ranked_by_prediction(tmp_path):
    rows = _read_csv(write_csv(modelled_summary(), tmp_path / "report.csv"))
    assert [r["id"] for r in rows] == ["m2", "m1", "m3", "c2"]
