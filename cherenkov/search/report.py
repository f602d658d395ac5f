"""The search report: ``report.json``, a self-contained ``report.html`` and a CSV table.

A search ends in a :class:`SearchSummary` — plain data: the graph, the environment, the
derivation (kernels, rule trace, e-graph statistics), every :class:`CandidateResult`, the
winner and its CUDA source per kernel, reference TFLOP/s measured in the same run, and
notes. ``write_json`` stores it; ``SearchSummary.from_json`` (or ``read_json``) reads it
back, so the HTML and CSV can be re-rendered from ``report.json`` alone.

The HTML page needs no network and runs no script: inline CSS, inline SVG, and a content
security policy that forbids everything else. Every piece of text on it — graph, input and
kernel names, reasons, CUDA source — is HTML-escaped. The CSV escapes with the ``csv``
module and guards text cells against spreadsheet formula injection.
"""

from __future__ import annotations

import csv
import html
import io
import json
import logging
import math
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cherenkov.search.records import FINAL_FAILURES, CandidateResult, Environment

log = logging.getLogger(__name__)

SCHEMA = "cherenkov.report"
VERSION = 1
_TOP_LEVEL = (
    "schema", "version", "graph", "environment", "derivation", "candidates", "winners",
    "sources", "references", "wall_seconds", "unmeasured", "notes",
)  # fmt: skip

# Non-finite floats (a NaN relative error of a wrong kernel) are not JSON: they are
# written as these strings and read back as floats.
_NON_FINITE = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}
_FLOAT_FIELDS = ("rel_error", "predicted_ms", "compile_seconds", "flops", "peak_tflops")

# Leading characters that make a spreadsheet read a text cell as a formula.
_FORMULA_PREFIXES = ("=", "+", "-", "@", "\t", "\r")


class ReportError(ValueError):
    """A report file that is not a cherenkov report of a version this code reads."""


# ---------------------------------------------------------------------------- the data


@dataclass(frozen=True)
class KernelSummary:
    """One fused kernel the derivation chose to cover the graph."""

    name: str
    kind: str
    shape: tuple[int, ...] = ()

    @classmethod
    def of(cls, kernel: KernelSummary | Mapping[str, Any]) -> KernelSummary:
        """A KernelSummary from itself or from its JSON form ``{"name", "kind", "shape"?}``."""
        if isinstance(kernel, KernelSummary):
            return kernel
        return cls(kernel["name"], kernel["kind"], tuple(kernel.get("shape", ())))


@dataclass(frozen=True)
class SearchSummary:
    """Everything a report shows, as plain data.

    ``winners`` maps each kernel to its winning candidate id (None when no candidate was
    correct); ``sources`` maps each kernel to the winner's CUDA source. ``references`` are
    TFLOP/s of other implementations measured in the same run (e.g. PyTorch SDPA
    backends). ``inputs`` maps input names to a description such as ``bf16[1,8,4096,128]``.
    ``budget_s`` is the search's time budget (None: unbounded); a search the budget stopped
    before every candidate was measured (``unmeasured`` > 0) is :attr:`partial`.
    Sequences may be passed as lists and kernels as ``{"name", "kind", "shape"}`` dicts:
    they are stored as tuples and KernelSummary.
    """

    graph_name: str
    graph_hash: str
    environment: Environment
    kernels: Sequence[KernelSummary | Mapping[str, Any]] = ()
    trace: Sequence[str] = ()
    stats: Mapping[str, Any] = field(default_factory=dict)
    candidates: Sequence[CandidateResult] = ()
    winners: Mapping[str, str | None] = field(default_factory=dict)
    sources: Mapping[str, str] = field(default_factory=dict)
    references: Mapping[str, float] = field(default_factory=dict)
    wall_seconds: float = 0.0
    unmeasured: int = 0
    notes: Sequence[str] = ()
    inputs: Mapping[str, str] = field(default_factory=dict)
    budget_s: float | None = None

    def __post_init__(self) -> None:
        normal = {
            "kernels": tuple(KernelSummary.of(k) for k in self.kernels),
            "trace": tuple(self.trace),
            "candidates": tuple(self.candidates),
            "notes": tuple(self.notes),
            **{name: dict(getattr(self, name)) for name in ("stats", "winners", "sources", "references", "inputs")},
        }
        for name, value in normal.items():
            object.__setattr__(self, name, value)

    def to_json(self) -> dict[str, Any]:
        """The ``report.json`` document: strict-JSON-ready (non-finite floats as ``"NaN"``,
        ``"Infinity"``, ``"-Infinity"``), fixed key order."""
        return _json_safe({
            "schema": SCHEMA,
            "version": VERSION,
            "graph": {"name": self.graph_name, "hash": self.graph_hash, "inputs": dict(self.inputs)},
            "environment": self.environment.to_json(),
            "derivation": {
                "kernels": [{"name": k.name, "kind": k.kind, "shape": list(k.shape)} for k in self.kernels],
                "trace": list(self.trace),
                "stats": _sorted(self.stats),
            },
            "candidates": [c.to_json() for c in self.candidates],
            "winners": _sorted(self.winners),
            "sources": _sorted(self.sources),
            "references": _sorted(self.references),
            "wall_seconds": self.wall_seconds,
            "unmeasured": self.unmeasured,
            "budget_s": self.budget_s,
            "partial": {"measured": self.measured, "of": len(self.candidates)} if self.partial else None,
            "notes": list(self.notes),
        })

    @property
    def measured(self) -> int:
        """Candidates with a result (verified, timed, modelled or failed): all but the unmeasured."""
        return len(self.candidates) - self.unmeasured

    @property
    def partial(self) -> bool:
        """Whether the budget ran out before every candidate had a result."""
        return self.unmeasured > 0

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> SearchSummary:
        """The summary behind a ``report.json`` document (as written by ``to_json``)."""
        check_schema(data)
        derivation = data["derivation"]
        return cls(
            graph_name=data["graph"]["name"],
            graph_hash=data["graph"]["hash"],
            inputs=data["graph"].get("inputs", {}),
            environment=Environment.from_json(data["environment"]),
            kernels=derivation["kernels"],
            trace=derivation["trace"],
            stats=derivation["stats"],
            candidates=tuple(CandidateResult.from_json(_restore_floats(c)) for c in data["candidates"]),
            winners=data["winners"],
            sources=data["sources"],
            references={name: float(value) for name, value in data["references"].items()},
            wall_seconds=float(data["wall_seconds"]),
            unmeasured=int(data["unmeasured"]),
            notes=data["notes"],
            budget_s=None if data.get("budget_s") is None else float(data["budget_s"]),
        )

    def winner_ids(self) -> frozenset[str]:
        return frozenset(w for w in self.winners.values() if w is not None)

    def by_kernel(self, mapping: Mapping[str, Any]) -> list[tuple[str, Any]]:
        """``mapping``'s items, kernels in derivation order first, any others sorted."""
        order = {k.name: i for i, k in enumerate(self.kernels)}
        return sorted(mapping.items(), key=lambda item: (order.get(item[0], len(order)), item[0]))

    def references_ranked(self) -> list[tuple[str, float]]:
        """Finite references, fastest first."""
        finite = [(name, value) for name, value in self.references.items() if math.isfinite(value)]
        return sorted(finite, key=lambda item: (-item[1], item[0]))


def _sorted(mapping: Mapping[str, Any]) -> dict[str, Any]:
    """A copy with keys in sorted order, so equal summaries give equal bytes."""
    return {key: mapping[key] for key in sorted(mapping)}


def _restore_floats(candidate: Mapping[str, Any]) -> dict[str, Any]:
    """A candidate dict with the non-finite floats of ``_json_safe`` turned back into floats."""
    data = {name: _NON_FINITE.get(v, v) if name in _FLOAT_FIELDS else v for name, v in candidate.items()}
    if isinstance(data.get("timing"), Mapping):
        data["timing"] = {name: _NON_FINITE.get(v, v) for name, v in data["timing"].items()}
    return data


def _as_summary(summary: SearchSummary | Mapping[str, Any]) -> SearchSummary:
    return summary if isinstance(summary, SearchSummary) else SearchSummary.from_json(summary)


# ---------------------------------------------------------------------------- JSON


def check_schema(data: Any) -> None:
    """Raise ReportError unless ``data`` is a report document of this schema and version."""
    if not isinstance(data, Mapping):
        raise ReportError(f"a report is a JSON object, not {type(data).__name__}")
    if data.get("schema") != SCHEMA:
        raise ReportError(f"not a cherenkov report: schema is {data.get('schema')!r}, expected {SCHEMA!r}")
    if data.get("version") != VERSION:
        raise ReportError(f"report version {data.get('version')!r} is not supported (this cherenkov reads {VERSION})")
    missing = [key for key in _TOP_LEVEL if key not in data]
    if missing:
        raise ReportError(f"report is missing {', '.join(missing)}")


def _json_safe(value: Any) -> Any:
    """``value`` with non-finite floats replaced by ``"NaN"``, ``"Infinity"``, ``"-Infinity"``."""
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    if isinstance(value, Mapping):
        return {key: _json_safe(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_json_safe(item) for item in value]
    return value


def dumps(summary: SearchSummary) -> str:
    """The text of ``report.json``: strict JSON, deterministic for equal summaries."""
    return json.dumps(summary.to_json(), indent=2, ensure_ascii=False, allow_nan=False) + "\n"


def write_json(summary: SearchSummary, path: str | os.PathLike[str]) -> Path:
    """Write ``report.json``; returns its path."""
    return _write_text(path, dumps(summary))


def read_json(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Load and validate a ``report.json`` (raises ReportError on a foreign or newer file)."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise ReportError(f"{path} is not JSON: {err}") from err
    check_schema(data)
    return data


def _write_text(path: str | os.PathLike[str], text: str) -> Path:
    """Write ``text`` atomically (a reader never sees half a report)."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(text, encoding="utf-8", newline="")
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    log.info("wrote %s", target)
    return target


# ---------------------------------------------------------------------------- ordering


def is_failure(candidate: CandidateResult) -> bool:
    return candidate.status in FINAL_FAILURES


def ranked(candidates: Iterable[CandidateResult]) -> list[CandidateResult]:
    """Fastest first (measured median, else predicted time); untimed next; failures last."""

    def key(c: CandidateResult) -> tuple[int, float, str]:
        time_ms = c.time_ms
        group = 2 if is_failure(c) else (0 if time_ms is not None else 1)
        return group, time_ms if time_ms is not None else math.inf, c.id

    return sorted(candidates, key=key)


# ---------------------------------------------------------------------------- CSV

_CSV_COLUMNS = (
    "rank", "id", "kernel", "kind", "status", "winner", "reason", "time_ms", "min_ms",
    "median_ms", "max_ms", "samples", "predicted_ms", "tflops", "percent_of_peak", "rel_error",
    "registers", "smem_bytes", "spill_bytes", "compile_seconds", "source_hash",
)  # fmt: skip


def write_csv(summary: SearchSummary | Mapping[str, Any], path: str | os.PathLike[str]) -> Path:
    """The candidates table, fastest first and failures last, one row per candidate.

    Plan parameters get one ``param.<name>`` column each (nested ones dotted, e.g.
    ``param.schedule.block_q``). Text cells that a spreadsheet would read as a formula are
    prefixed with ``'``.
    """
    summary = _as_summary(summary)
    params = _param_names(summary.candidates)
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow([*_CSV_COLUMNS, *(f"param.{name}" for name in params)])
    winners = summary.winner_ids()
    for rank, candidate in enumerate(ranked(summary.candidates), start=1):
        flat = _flatten(candidate.params)
        row = [*_csv_fields(rank, candidate, candidate.id in winners), *(flat.get(p) for p in params)]
        writer.writerow([_csv_cell(value) for value in row])
    return _write_text(path, buffer.getvalue())


def _param_names(candidates: Iterable[CandidateResult]) -> list[str]:
    """Every (flattened) plan parameter name, in order of first appearance."""
    return list(dict.fromkeys(name for c in candidates for name in _flatten(c.params)))


def _flatten(params: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested mappings as dotted keys: ``{"schedule": {"warps": 4}}`` -> ``{"schedule.warps": 4}``."""
    flat: dict[str, Any] = {}
    for name, value in params.items():
        if isinstance(value, Mapping):
            flat.update(_flatten(value, f"{prefix}{name}."))
        else:
            flat[f"{prefix}{name}"] = value
    return flat


def _csv_fields(rank: int, c: CandidateResult, winner: bool) -> list[Any]:
    timing = c.timing
    return [
        rank, c.id, c.kernel, c.kind, c.status, winner, c.reason, c.time_ms,
        timing and timing.min_ms, timing and timing.median_ms, timing and timing.max_ms,
        timing and timing.samples, c.predicted_ms, c.tflops, c.percent_of_peak, c.rel_error,
        c.registers, c.smem_bytes, c.spill_bytes, c.compile_seconds, c.source_hash,
    ]  # fmt: skip


def _csv_cell(value: Any) -> Any:
    """Empty for None; text that starts like a formula gets a leading ``'``."""
    if value is None:
        return ""
    if isinstance(value, bool | int | float):
        return value
    text = json.dumps(value) if isinstance(value, Mapping | list | tuple) else str(value)
    return "'" + text if text.startswith(_FORMULA_PREFIXES) else text


# ---------------------------------------------------------------------------- formatting


def _e(value: Any) -> str:
    """HTML-escaped text, safe in element content and in double-quoted attributes."""
    return html.escape(str(value), quote=True)


def _num(value: float | int | None, digits: int) -> str:
    if value is None:
        return "—"
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return f"{value:,.{digits}f}"


def _sci(value: float | None) -> str:
    return "—" if value is None else f"{value:.1e}"


def _knobs(params: Mapping[str, Any]) -> str:
    """The schedule as escaped ``name=value`` chips (HTML): ``params["schedule"]`` where the
    plan has one (the problem and target are the same for every candidate), else all params."""
    schedule = params.get("schedule")
    knobs = _flatten(schedule if isinstance(schedule, Mapping) else params)
    return " ".join(f"<span>{_e(name)}={_e(_knob_value(value))}</span>" for name, value in knobs.items())


def _knob_value(value: Any) -> str:
    if isinstance(value, bool):
        return "on" if value else "off"
    return str(value)


def _ms(candidate: CandidateResult) -> str:
    """The measured median, or the cost model's prediction marked with ``≈``."""
    if candidate.timing is not None:
        return _num(candidate.timing.median_ms, 3)
    return "≈" + _num(candidate.predicted_ms, 3) if candidate.predicted_ms is not None else "—"


def _status_class(candidate: CandidateResult) -> str:
    return "fail" if is_failure(candidate) else candidate.status.replace("_", "-")


# ---------------------------------------------------------------------------- the chart

_CHART_W, _CHART_H = 960, 340
_LEFT, _RIGHT, _TOP, _BOTTOM = 56, 170, 18, 34
_LABEL_GAP = 13  # minimum vertical distance between reference labels, px
_MAX_SLOT = 48  # px per candidate at most: a handful of candidates still look like bars
_Scale = Callable[[float], float]  # TFLOP/s -> SVG y


def _nice_step(top: float, ticks: int = 5) -> float:
    """A 1-2-5 step that divides ``[0, top]`` into about ``ticks`` intervals."""
    raw = top / ticks
    magnitude = 10 ** math.floor(math.log10(raw))
    return next(m * magnitude for m in (1, 2, 5, 10) if m * magnitude >= raw)


def _chart_scale(summary: SearchSummary) -> tuple[float, float]:
    """(axis top, tick step) covering every plotted TFLOP/s and every reference."""
    values = [c.tflops or 0.0 for c in summary.candidates if not is_failure(c)]
    values += [value for _, value in summary.references_ranked()]
    step = _nice_step(max([v for v in values if v > 0], default=1.0) * 1.05)
    top = max(step, math.ceil(max(values, default=0.0) * 1.05 / step) * step)
    return top, step


def _spread(positions: Sequence[float], gap: float) -> list[float]:
    """Label y positions (sorted ascending) pushed apart so that none are closer than ``gap``."""
    placed: list[float] = []
    for y in positions:
        placed.append(max(y, placed[-1] + gap) if placed else y)
    return placed


def _chart(summary: SearchSummary) -> str:
    """Inline SVG: every candidate's TFLOP/s, sorted, with reference lines."""
    plot_w, plot_h = _CHART_W - _LEFT - _RIGHT, _CHART_H - _TOP - _BOTTOM
    top, step = _chart_scale(summary)

    def y(value: float) -> float:
        return _TOP + plot_h * (1 - min(max(value, 0.0), top) / top)

    plotted = [c for c in summary.candidates if not is_failure(c)]
    plotted.sort(key=lambda c: (-(c.tflops or 0.0), c.id))
    order = plotted + [c for c in ranked(summary.candidates) if is_failure(c)]
    modelled = "" if summary.environment.measured else " (modelled)"
    parts = [
        f'<svg id="tflops-chart" viewBox="0 0 {_CHART_W} {_CHART_H}" role="img" '
        f'aria-label="TFLOP/s of every candidate{modelled}">',
        '<defs><pattern id="hatch" width="6" height="6" patternUnits="userSpaceOnUse" '
        'patternTransform="rotate(45)"><rect width="6" height="6" class="bar-modelled-bg"/>'
        '<line x1="0" y1="0" x2="0" y2="6" class="hatch-line"/></pattern></defs>',
        *_axes(top, step, y, plot_w, order, modelled),
        *_bars(order, summary.winner_ids(), y, plot_w),
        *_reference_lines(summary.references_ranked(), y, plot_w),
        "</svg>",
    ]
    return "\n".join(parts)


def _axes(
    top: float, step: float, y: _Scale, plot_w: float, order: Sequence[CandidateResult], modelled: str
) -> list[str]:
    parts = []
    for i in range(round(top / step) + 1):
        value = i * step
        parts.append(
            f'<line class="grid" x1="{_LEFT}" x2="{_LEFT + plot_w}" y1="{y(value):.1f}" y2="{y(value):.1f}"/>'
            f'<text class="tick" x="{_LEFT - 6}" y="{y(value) + 4:.1f}" text-anchor="end">{_e(f"{value:g}")}</text>'
        )
    middle = y(top / 2)
    parts.append(
        f'<text class="axis-label" x="14" y="{middle:.1f}" text-anchor="middle" '
        f'transform="rotate(-90 14 {middle:.1f})">TFLOP/s{_e(modelled)}</text>'
        f'<text class="axis-label" x="{_LEFT + plot_w / 2:.1f}" y="{_CHART_H - 8}" text-anchor="middle">'
        f"{len(order)} candidates, fastest first{'; failures (×) last' if any(map(is_failure, order)) else ''}</text>"
    )
    return parts


def _bars(order: Sequence[CandidateResult], winners: frozenset[str], y: _Scale, plot_w: float) -> list[str]:
    slot = min(plot_w / max(len(order), 1), _MAX_SLOT)
    width = max(slot * 0.78, 1.0)
    base = y(0.0)
    parts = []
    for i, c in enumerate(order):
        x = _LEFT + i * slot + (slot - width) / 2
        tip = f"{c.id} · {c.kernel} · {c.status} · {_num(c.tflops, 1)} TFLOP/s"
        if is_failure(c):
            cx, size = x + width / 2, min(max(width / 2, 2.0), 5.0)
            parts.append(
                f'<g class="mark-fail"><title>{_e(tip + (": " + c.reason if c.reason else ""))}</title>'
                f'<path d="M{cx - size:.1f} {base - 2 * size:.1f}l{2 * size:.1f} {2 * size:.1f}'
                f'm0 {-2 * size:.1f}l{-2 * size:.1f} {2 * size:.1f}"/></g>'
            )
            continue
        cls = "bar-winner" if c.id in winners else f"bar-{_status_class(c)}"
        top = y(c.tflops or 0.0)
        parts.append(
            f'<rect class="{_e(cls)}" x="{x:.2f}" y="{top:.1f}" width="{width:.2f}" '
            f'height="{max(base - top, 0.5):.1f}"><title>{_e(tip)}</title></rect>'
        )
        if c.id in winners:
            parts.append(
                f'<text class="winner-label" x="{x + width / 2:.1f}" y="{top - 5:.1f}" text-anchor="start">'
                f"{_e(f'▼ winner {_num(c.tflops, 1)}')}</text>"
            )
    return parts


def _reference_lines(references: Sequence[tuple[str, float]], y: _Scale, plot_w: float) -> list[str]:
    labels = _spread([y(value) + 4 for _, value in references], _LABEL_GAP)
    parts = []
    for (name, value), label_y in zip(references, labels, strict=True):
        parts.append(
            f'<g class="reference"><title>{_e(f"{name}: {value:.1f} TFLOP/s, measured in this run")}</title>'
            f'<line x1="{_LEFT}" x2="{_LEFT + plot_w}" y1="{y(value):.1f}" y2="{y(value):.1f}"/>'
            f'<text x="{_LEFT + plot_w + 6}" y="{label_y:.1f}">{_e(f"{name} {value:.1f}")}</text></g>'
        )
    return parts


# ---------------------------------------------------------------------------- the page

_CSS = """
:root{--fg:#1d2430;--muted:#5d6778;--line:#e3e7ee;--bg:#fff;--panel:#f6f8fb;--accent:#2563eb;
--ok:#3b82f6;--modelled:#93b4e8;--slow:#a8b5c8;--fail:#d43c3c;--win:#e8890c;--ref:#6b7280;
--warn-bg:#fff4e0;--warn-line:#f0b54a;--code-bg:#f6f8fb}
@media (prefers-color-scheme:dark){:root{--fg:#e6e9ef;--muted:#9aa4b5;--line:#2c3340;--bg:#12161d;
--panel:#1a2029;--ok:#5b97f7;--modelled:#4d6a96;--slow:#56627a;--warn-bg:#3a2c12;--warn-line:#a87a26;
--code-bg:#1a2029}}
*{box-sizing:border-box}
body{margin:0;background:var(--bg);color:var(--fg);
font:15px/1.5 system-ui,-apple-system,"Segoe UI",Roboto,"Helvetica Neue",Arial,sans-serif}
main{max-width:1360px;margin:0 auto;padding:28px 24px 64px}
h1{font-size:26px;margin:0 0 4px;word-break:break-word}
h2{font-size:18px;margin:36px 0 10px;padding-bottom:4px;border-bottom:1px solid var(--line)}
h3{font-size:15px;margin:18px 0 6px}
code,pre,.mono{font-family:ui-monospace,SFMono-Regular,Menlo,Consolas,"DejaVu Sans Mono",monospace;font-size:13px}
.meta{color:var(--muted);margin:0}
.facts span+span:before{content:" · "}
.badge{display:inline-block;padding:1px 8px;border-radius:10px;font-size:12px;font-weight:600;
letter-spacing:.02em;vertical-align:middle}
.badge.measured{background:#dcfce7;color:#14532d}.badge.modelled{background:#fde68a;color:#713f12}
.callout{margin:16px 0;padding:10px 14px;border-left:4px solid var(--warn-line);background:var(--warn-bg)}
.cards{display:flex;flex-wrap:wrap;gap:12px;margin:16px 0}
.card{background:var(--panel);border:1px solid var(--line);border-radius:8px;padding:10px 14px;min-width:180px}
.card .k{color:var(--muted);font-size:12px;text-transform:uppercase;letter-spacing:.05em}
.card .v{font-size:20px;font-weight:600;font-variant-numeric:tabular-nums}
.card .s{color:var(--muted);font-size:13px}
nav a{color:var(--accent);text-decoration:none;margin-right:14px;font-size:14px}
ul.notes{margin:8px 0;padding-left:20px;color:var(--muted)}
svg{width:100%;height:auto;display:block}
svg text{font:12px system-ui,-apple-system,"Segoe UI",Roboto,Arial,sans-serif;fill:var(--fg)}
svg .tick,svg .axis-label{fill:var(--muted)}
svg .grid{stroke:var(--line);stroke-width:1}
.bar-ok{fill:var(--ok)}.bar-modelled{fill:url(#hatch)}.bar-modelled-bg{fill:var(--modelled)}
.hatch-line{stroke:var(--ok);stroke-width:2}
.bar-stopped-early,.bar-unmeasured{fill:var(--slow)}.bar-winner{fill:var(--win)}
.winner-label{fill:var(--win)!important;font-weight:600}
.mark-fail path{stroke:var(--fail);stroke-width:2;fill:none}
.reference line{stroke:var(--ref);stroke-width:1.5;stroke-dasharray:6 4}
.reference text{fill:var(--ref);font-weight:600}
.legend{display:flex;flex-wrap:wrap;gap:6px 18px;margin:8px 0 0;padding:0;list-style:none;
font-size:13px;color:var(--muted)}
.legend i{display:inline-block;width:12px;height:12px;border-radius:2px;margin-right:6px;vertical-align:-1px}
.legend .sw-win{background:var(--win)}.legend .sw-ok{background:var(--ok)}
.legend .sw-modelled{background:repeating-linear-gradient(45deg,var(--ok) 0 2px,var(--modelled) 2px 5px)}
.legend .sw-slow{background:var(--slow)}
.legend .sw-fail{background:none;color:var(--fail);font-style:normal;font-weight:700;width:auto}
.legend .sw-ref{background:none;border-top:2px dashed var(--ref);height:0;width:18px;border-radius:0;
vertical-align:3px}
ol#derivation{columns:3 220px;column-gap:28px;margin:8px 0;padding-left:28px}
ol#derivation li{break-inside:avoid;padding:1px 0}
dl.stats{display:grid;grid-template-columns:max-content 1fr;gap:2px 16px;margin:8px 0;font-size:14px}
dl.stats dt{color:var(--muted)}dl.stats dd{margin:0;font-variant-numeric:tabular-nums}
.table-wrap{overflow-x:auto;border:1px solid var(--line);border-radius:8px}
table{border-collapse:collapse;width:100%;font-size:13px}
th,td{padding:5px 8px;border-bottom:1px solid var(--line);text-align:left;vertical-align:top}
th{position:sticky;top:0;background:var(--panel);font-weight:600;white-space:nowrap}
td.num,th.num{text-align:right;font-variant-numeric:tabular-nums;white-space:nowrap}
tbody tr:nth-child(even){background:var(--panel)}
tr.winner td{background:rgba(232,137,12,.14);font-weight:600}
td.reason{min-width:160px;overflow-wrap:anywhere;color:var(--muted)}
td.reason pre{white-space:pre-wrap;margin:4px 0 0}
td.id{max-width:260px;overflow-wrap:break-word}td.knobs{min-width:200px;max-width:420px}
td.knobs span{white-space:nowrap;margin-right:6px}
.st{font-size:12px;font-weight:600;padding:0 6px;border-radius:8px;white-space:nowrap}
.st-ok{background:#dbeafe;color:#1e3a8a}.st-modelled{background:#e0e7ff;color:#3730a3}
.st-fail{background:#fee2e2;color:#991b1b}.st-stopped-early,.st-unmeasured{background:#e5e7eb;color:#374151}
pre.source{background:var(--code-bg);border:1px solid var(--line);border-radius:8px;padding:12px 14px;
overflow:auto;max-height:640px;line-height:1.45;tab-size:4}
.empty{color:var(--muted);font-style:italic}
"""

_CSP = "default-src 'none'; style-src 'unsafe-inline'; base-uri 'none'; form-action 'none'"


def render_html(summary: SearchSummary | Mapping[str, Any]) -> str:
    """The report page: one self-contained HTML document, no scripts, no network."""
    summary = _as_summary(summary)
    title = f"cherenkov · {summary.graph_name}"
    return "\n".join(
        [
            "<!DOCTYPE html>",
            '<html lang="en"><head><meta charset="utf-8">',
            f'<meta http-equiv="Content-Security-Policy" content="{_e(_CSP)}">',
            '<meta name="viewport" content="width=device-width, initial-scale=1">',
            f"<title>{_e(title)}</title><style>{_CSS}</style></head><body><main>",
            _header(summary),
            _chart_section(summary),
            _derivation_section(summary),
            _candidates_section(summary),
            _source_section(summary),
            "</main></body></html>",
            "",
        ]
    )


def write_html(summary: SearchSummary | Mapping[str, Any], path: str | os.PathLike[str]) -> Path:
    """Write ``report.html`` (from a summary or a loaded ``report.json``); returns its path."""
    return _write_text(path, render_html(summary))


def _header(s: SearchSummary) -> str:
    env = s.environment
    badge = (
        '<span class="badge measured">measured</span>'
        if env.measured
        else '<span class="badge modelled">modelled</span>'
    )
    meta = [
        f"target <b>{_e(env.target)}</b>",
        f"GPU <b>{_e(env.gpu or 'none')}</b>"
        + (f" (sm {_e(env.compute_capability)})" if env.compute_capability else ""),
        f"CUDA {_e(env.toolkit)}",
        f"cherenkov {_e(env.cherenkov)}" if env.cherenkov else "",
        f"graph <span class=\"mono\">{_e(s.graph_hash[:16])}</span>",
    ]
    inputs = ", ".join(f"<span class=\"mono\">{_e(name)}</span> {_e(desc)}" for name, desc in s.inputs.items())
    parts = [
        "<header>",
        f"<h1>{_e(s.graph_name)} {badge}</h1>",
        '<p class="meta facts">' + "".join(f"<span>{m}</span>" for m in meta if m) + "</p>",
        f'<p class="meta">inputs: {inputs}</p>' if inputs else "",
        _ranking_callout(env),
        _cards(s),
        _notes(s.notes),
        '<nav><a href="#chart">Chart</a><a href="#derivation-section">Derivation</a>'
        '<a href="#candidates-section">Candidates</a><a href="#source-section">Source</a></nav>',
        "</header>",
    ]
    return "\n".join(p for p in parts if p)


def _ranking_callout(env: Environment) -> str:
    if env.measured:
        return (
            f'<p class="meta">Measured on {_e(env.gpu or "this GPU")}: every ranked candidate was verified '
            "against a reference and timed with CUDA events (median of many runs).</p>"
        )
    return (
        '<p class="callout"><b>Modelled, not measured.</b> No candidate was timed on a GPU: the ranking '
        "and every time and TFLOP/s figure in this report are predictions of the cost model "
        "(marked ≈ in the table).</p>"
    )


def _cards(s: SearchSummary) -> str:
    by_id = {c.id: c for c in s.candidates}
    failed = sum(is_failure(c) for c in s.candidates)
    cards = [_card("candidates", str(len(s.candidates)), f"{failed} failed · {s.unmeasured} unmeasured")]
    if s.partial:
        budget = f"the {_num(s.budget_s, 1)} s budget" if s.budget_s is not None else "the budget"
        cards.append(_card("partial", f"measured {s.measured} of {len(s.candidates)}",
                           f"{budget} ran out first; resume=True (--resume) measures the rest"))
    cards.append(_card("wall time", f"{_num(s.wall_seconds, 1)} s", "search, compile and measure"))
    for kernel, winner in s.by_kernel(s.winners):
        candidate = by_id.get(winner) if winner else None
        if candidate is None:
            cards.append(_card(f"winner · {kernel}", "none", "no candidate passed verification"))
            continue
        detail = f"{candidate.id} · {_ms(candidate)} ms · {_num(candidate.percent_of_peak, 1)}% of peak"
        if len(s.winners) == 1 and candidate.tflops:
            ratios = (f" · {candidate.tflops / ref:.2f}× {name}" for name, ref in s.references_ranked() if ref)
            detail += "".join(ratios)
        cards.append(_card(f"winner · {kernel}", f"{_num(candidate.tflops, 1)} TFLOP/s", detail))
    return '<div class="cards">' + "".join(cards) + "</div>"


def _card(key: str, value: str, detail: str) -> str:
    return (
        f'<div class="card"><div class="k">{_e(key)}</div><div class="v">{_e(value)}</div>'
        f'<div class="s">{_e(detail)}</div></div>'
    )


def _notes(notes: Sequence[str]) -> str:
    if not notes:
        return ""
    return '<ul class="notes">' + "".join(f"<li>{_e(note)}</li>" for note in notes) + "</ul>"


_LEGEND = (  # (status classes shown, swatch, label)
    ({"winner"}, '<i class="sw-win"></i>', "winner"),
    ({"ok"}, '<i class="sw-ok"></i>', "verified, measured"),
    ({"modelled"}, '<i class="sw-modelled"></i>', "modelled (cost model)"),
    ({"stopped-early", "unmeasured"}, '<i class="sw-slow"></i>', "stopped early / unmeasured"),
    ({"fail"}, '<i class="sw-fail">×</i>', "failed (compile error, wrong, crash, timeout)"),
    ({"reference"}, '<i class="sw-ref"></i>', "reference, measured in this run"),
)


def _legend(s: SearchSummary) -> str:
    """Legend entries for what the chart actually shows."""
    shown = {_status_class(c) for c in s.candidates}
    shown |= {"winner"} if s.winner_ids() else set()
    shown |= {"reference"} if s.references_ranked() else set()
    items = "".join(f"<li>{swatch}{_e(label)}</li>" for classes, swatch, label in _LEGEND if classes & shown)
    return f'<ul class="legend">{items}</ul>'


def _chart_section(s: SearchSummary) -> str:
    return (
        '<section id="chart"><h2>TFLOP/s of every candidate</h2>\n'
        + _chart(s)
        + "\n"
        + _legend(s)
        + "</section>"
    )


def _derivation_section(s: SearchSummary) -> str:
    trace = "".join(f"<li><code>{_e(rule)}</code></li>" for rule in s.trace)
    kernels = ", ".join(_kernel_label(k) for k in s.kernels) or "—"
    stats = "".join(f"<dt>{_e(name)}</dt><dd>{_e(_stat(s.stats[name]))}</dd>" for name in sorted(s.stats))
    return "\n".join(
        [
            '<section id="derivation-section"><h2>Derivation</h2>',
            f"<p>Kernels: {kernels}</p>",
            f"<h3>Rewrite chain ({len(s.trace)} rules, in order)</h3>",
            f'<ol id="derivation">{trace}</ol>' + ("" if trace else '<p class="empty">No rewrites.</p>'),
            f'<h3>E-graph</h3><dl class="stats">{stats}</dl>' if stats else "",
            "</section>",
        ]
    )


def _kernel_label(kernel: KernelSummary) -> str:
    shape = ", " + "×".join(str(n) for n in kernel.shape) if kernel.shape else ""
    return f"<code>{_e(kernel.name)}</code> ({_e(kernel.kind + shape)})"


def _stat(value: Any) -> str:
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:.3f}"
    if isinstance(value, Mapping):
        return ", ".join(f"{k} {value[k]}" for k in sorted(value))
    return str(value)


_TABLE_HEAD = (
    ("#", True), ("id", False), ("kernel", False), ("schedule", False), ("status", False),
    ("median ms", True), ("TFLOP/s", True), ("% peak", True), ("rel. error", True), ("regs", True),
    ("smem KiB", True), ("spills B", True), ("compile s", True), ("reason", False),
)  # fmt: skip


def _candidates_section(s: SearchSummary) -> str:
    head = "".join(f'<th{' class="num"' if num else ""} scope="col">{_e(name)}</th>' for name, num in _TABLE_HEAD)
    winners = s.winner_ids()
    rows = "\n".join(_row(rank, c, c.id in winners) for rank, c in enumerate(ranked(s.candidates), start=1))
    return (
        '<section id="candidates-section"><h2>Candidates</h2>'
        '<p class="meta">Fastest first; failures last. ≈ marks a time predicted by the cost model.</p>'
        f'<div class="table-wrap"><table id="candidates"><thead><tr>{head}</tr></thead>\n'
        f"<tbody>\n{rows}\n</tbody></table></div></section>"
    )


def _row(rank: int, c: CandidateResult, winner: bool) -> str:
    smem = c.smem_bytes / 1024 if c.smem_bytes is not None else None
    cells = [
        _td(str(rank), num=True),
        f'<td class="id mono">{_breakable(c.id)}</td>',

        _td(c.kernel),
        f'<td class="knobs mono">{_knobs(c.params)}</td>',
        f'<td><span class="st st-{_e(_status_class(c))}">{_e(c.status)}</span></td>',
        _td(_ms(c), num=True),
        _td(_num(c.tflops, 1), num=True),
        _td(_num(c.percent_of_peak, 1), num=True),
        _td(_sci(c.rel_error), num=True),
        _td(_num(c.registers, 0), num=True),
        _td(_num(smem, 1), num=True),
        _td(_num(c.spill_bytes, 0), num=True),
        _td(_num(c.compile_seconds, 2), num=True),
        f'<td class="reason">{_reason(c.reason)}</td>',
    ]
    cls = ' class="winner"' if winner else ""
    return f'<tr{cls} data-candidate="{_e(c.id)}">' + "".join(cells) + "</tr>"


def _breakable(text: str) -> str:
    """Escaped text that may wrap after each underscore (long candidate ids)."""
    return _e(text).replace("_", "_<wbr>")


def _td(text: str, num: bool = False, cls: str = "") -> str:
    classes = " ".join(filter(None, ["num" if num else "", cls]))
    return f'<td class="{_e(classes)}">{_e(text)}</td>' if classes else f"<td>{_e(text)}</td>"


def _reason(reason: str | None) -> str:
    """Short reasons inline; long ones (compiler logs) folded under their first line."""
    if not reason:
        return ""
    first, _, rest = reason.partition("\n")
    if not rest and len(first) <= 140:
        return _e(reason)
    return f"<details><summary>{_e(first[:140])}</summary><pre>{_e(reason)}</pre></details>"


def _source_section(s: SearchSummary) -> str:
    if not s.sources:
        return (
            '<section id="source-section"><h2>Winning source</h2>'
            '<p class="empty">No kernel passed verification: there is no winning source.</p></section>'
        )
    blocks = []
    for i, (kernel, source) in enumerate(s.by_kernel(s.sources)):
        element_id = "source" if i == 0 else f"source-{i + 1}"
        winner = s.winners.get(kernel) or "—"
        blocks.append(
            f"<h3>{_e(kernel)} <span class=\"meta mono\">{_e(winner)}</span></h3>"
            f'<pre id="{element_id}" class="source" data-kernel="{_e(kernel)}"><code>{_e(source)}</code></pre>'
        )
    return '<section id="source-section"><h2>Winning source</h2>' + "\n".join(blocks) + "</section>"
