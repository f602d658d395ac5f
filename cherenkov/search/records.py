"""What a search records: the environment it ran in and one result per candidate.

These are plain data, shared by the measurement workers, the tuning database and the
reports. ``to_json()`` gives the JSON-ready dict written to ``report.json`` and the
database; ``from_json()`` reads it back.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any, Literal

Status = Literal["ok", "modelled", "compile_error", "wrong", "crash", "timeout", "unmeasured", "stopped_early"]

# Statuses after which a candidate is never retried on the same GPU and toolkit.
FINAL_FAILURES = frozenset({"compile_error", "wrong", "crash", "timeout"})


@dataclass(frozen=True)
class Environment:
    """Where a search ran: what answers from the tuning database must match."""

    target: str
    gpu: str | None = None
    compute_capability: str | None = None
    toolkit: str = "none"
    cherenkov: str = ""
    torch: str | None = None
    cupy: str | None = None
    measured: bool = False  # True when candidates were timed on this GPU, False when model-ranked

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Environment:
        return cls(**{f.name: data[f.name] for f in fields(cls) if f.name in data})


@dataclass(frozen=True)
class Timing:
    """Kernel time in milliseconds over ``samples`` CUDA-event measurements."""

    min_ms: float
    median_ms: float
    max_ms: float
    samples: int


@dataclass(frozen=True)
class CandidateResult:
    """One candidate kernel: its plan, how it compiled, whether it was right, how fast.

    ``status`` is ``ok`` (verified and timed), ``modelled`` (compiled and ranked by the
    cost model, no GPU), ``stopped_early`` (verified, but clearly slower than the best
    after its first samples), ``unmeasured`` (the budget ran out) or a failure:
    ``compile_error``, ``wrong``, ``crash``, ``timeout`` — with ``reason`` saying why.
    """

    id: str
    kernel: str
    kind: str
    params: dict[str, Any]
    source_hash: str
    status: Status
    reason: str | None = None
    registers: int | None = None
    smem_bytes: int | None = None
    spill_bytes: int | None = None
    compile_seconds: float | None = None
    rel_error: float | None = None
    timing: Timing | None = None
    predicted_ms: float | None = None
    flops: float = 0.0
    peak_tflops: float | None = None
    from_database: bool = field(default=False, compare=False)

    @property
    def time_ms(self) -> float | None:
        """Measured median where there is one, else the model's prediction."""
        if self.timing is not None:
            return self.timing.median_ms
        return self.predicted_ms

    @property
    def tflops(self) -> float | None:
        time_ms = self.time_ms
        return self.flops / (time_ms * 1e9) if time_ms else None

    @property
    def percent_of_peak(self) -> float | None:
        tflops = self.tflops
        return 100.0 * tflops / self.peak_tflops if tflops and self.peak_tflops else None

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data.update(time_ms=self.time_ms, tflops=self.tflops, percent_of_peak=self.percent_of_peak)
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> CandidateResult:
        values = {f.name: data[f.name] for f in fields(cls) if f.name in data}
        if values.get("timing") is not None:
            values["timing"] = Timing(**values["timing"])
        return cls(**values)
