"""The CUDA-event timer the benchmark scripts share.

Samples of all launchers are interleaved round-robin (clock drift and thermal state hit
all alike), L2 is flushed before every sample, and the median is reported.

The flush is the search's own (:class:`~cherenkov.search.measure.L2Flush`, which says why
it reads a buffer twice the L2's size instead of zeroing it).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from cherenkov.search.measure import FLUSHES, SPIN_CYCLES, L2Flush  # noqa: F401 - the scripts' flush, from here

WARMUP = 3


def time_interleaved(
    torch: Any, launches: dict[str, Callable[[], Any]], flush: L2Flush, samples: int, spin: bool = False
) -> dict[str, float]:
    """Median ms of each launch: warm-up, then ``samples`` rounds of one sample each, L2
    flushed before every sample. ``spin`` queues a ~0.2 ms GPU spin after the flush, so the
    host has enqueued the launch before the start event fires: host-side launch work,
    which differs between launchers, then stays out of the time (device time only)."""
    for launch in launches.values():
        for _ in range(WARMUP):
            launch()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times: dict[str, list[float]] = {name: [] for name in launches}
    for _ in range(samples):
        for name, launch in launches.items():
            flush()
            if spin:
                torch.cuda._sleep(SPIN_CYCLES)
            start.record()
            launch()
            end.record()
            end.synchronize()
            times[name].append(start.elapsed_time(end))
    return {name: sorted(t)[len(t) // 2] for name, t in times.items()}
