"""The measurement pool's workers, on the CPU with a stand-in for :func:`worker_main`: a worker that
reports a poisoned CUDA context ("fatal") and closes its end is waited for and replaced, so the next
request runs on a fresh worker instead of reaching the leaving one and being recorded as a crash of
its candidate (a 16k benchmark row once left every candidate of the next search "worker
unreachable"); a script without a ``__main__`` guard starts its workers."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from multiprocessing.connection import Connection
from pathlib import Path

from cherenkov.search.measure import Measurement, MeasurementPool, MeasureTask

MARKER = "CK_TEST_WORKER_MARKER"


def poisoned_once_worker(conn: Connection, device: int) -> None:
    """Its first life answers one request with a CUDA error, closes its end and lingers before it
    exits, as :func:`~cherenkov.search.measure.worker_main` does after a poisoned context; later
    lives time every candidate at 1 ms."""
    marker = Path(os.environ[MARKER])
    conn.send(("ready", f"stand-in GPU {device}"))
    first_life = not marker.exists()
    marker.touch()
    while True:
        kind, task = conn.recv()
        if kind == "stop":
            return
        if first_life:
            conn.send(("fatal", "AcceleratorError: CUDA error: an illegal memory access was encountered"))
            conn.close()
            time.sleep(1.0)  # on its way out: still alive when the next request is sent
            os._exit(70)
        conn.send(("measure", Measurement(task.candidate, "ok", times_ms=(1.0, 1.0, 1.0))))


def test_a_worker_with_a_poisoned_context_is_replaced_before_the_next_request(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv(MARKER, str(tmp_path / "first-life-over"))
    with MeasurementPool(timeout_s=20.0, worker=poisoned_once_worker) as pool:
        first = pool.measure(MeasureTask("a", compiled=None))
        assert (first.status, first.reason) == ("crash", "AcceleratorError: CUDA error: an illegal memory access was "
                                                         "encountered")  # fmt: skip
        second = pool.measure(MeasureTask("b", compiled=None))
        assert (second.candidate, second.status, second.times_ms) == ("b", "ok", (1.0, 1.0, 1.0)), second
        assert pool.best_ms[""] == 1.0


UNGUARDED_SCRIPT = """\
import os, sys
sys.path[:0] = [{repo!r}, {here!r}]
from cherenkov.search.measure import MeasurementPool, MeasureTask
from test_measurement_pool import MARKER, poisoned_once_worker
open(os.environ[MARKER], "w").close()  # the stand-in's later lives: every request answered
print("top level of", __name__)
with MeasurementPool(timeout_s=20.0, worker=poisoned_once_worker) as pool:
    print(pool.measure(MeasureTask("a", compiled=None)).status)
"""


def test_a_script_without_a_main_guard_starts_its_workers(tmp_path) -> None:
    """A spawned worker does not run the user's script again (it would start a worker of its own there, and
    multiprocessing refuses that during a child's bootstrapping)."""
    here = Path(__file__).resolve().parent
    script = tmp_path / "user_script.py"
    script.write_text(UNGUARDED_SCRIPT.format(repo=str(here.parents[1]), here=str(here)))
    env = {**os.environ, MARKER: str(tmp_path / "first-life-over")}
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split("\n")[:2] == ["top level of __main__", "ok"], done.stdout
