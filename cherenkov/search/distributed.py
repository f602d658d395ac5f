"""Spreading a search over a Dask cluster: compilation on any worker, measurement on
workers that hold a GPU.

``cluster`` is a scheduler address (``tcp://host:8786``), a ``distributed.Client``, or
``"local-gpus"``: a local cluster with one worker per visible GPU (each pinned to its GPU
with ``CUDA_VISIBLE_DEVICES`` and a ``GPU=1`` resource) plus one CPU worker for the
compiler. GPU workers of an external cluster must be started the same way (one per GPU,
``--resources GPU=1``, ``CUDA_VISIBLE_DEVICES`` set) and non-daemonic
(``DASK_DISTRIBUTED__WORKER__DAEMON=False``), because each measures in a child process
that may crash. Compiled binaries travel back as bytes, so workers need no shared disk;
results come back to the searching process, which owns the database and the report.
Dask is an optional extra: ``pip install cherenkov[distributed]``.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from cherenkov.codegen import CompileError, compile_plan
from cherenkov.codegen.plan import CompiledKernel
from cherenkov.graph import GraphError
from cherenkov.rewrites.plan import KernelPlan
from cherenkov.search.environment import visible_gpus
from cherenkov.search.measure import Measurement, MeasurementPool, MeasureTask

log = logging.getLogger(__name__)

GPU_RESOURCE = {"GPU": 1}


def local_gpu_cluster() -> Any:
    """One worker per visible GPU (pinned, ``GPU=1``) and one CPU worker for compiling."""
    import dask
    from distributed import Nanny, Scheduler, SpecCluster

    gpus = visible_gpus()
    if not gpus:
        raise GraphError("--local-gpus: no GPU is visible (nvidia-smi lists none)")
    workers = {
        f"gpu-{g.index}": {
            "cls": Nanny,
            "options": {"nthreads": 1, "resources": dict(GPU_RESOURCE), "env": {"CUDA_VISIBLE_DEVICES": str(g.index)}},
        }
        for g in gpus
    }
    workers["cpu"] = {"cls": Nanny, "options": {"nthreads": os.cpu_count() or 1}}
    with dask.config.set({"distributed.worker.daemon": False}):
        return SpecCluster(workers=workers, scheduler={"cls": Scheduler, "options": {"dashboard_address": None}})


def _client(cluster: Any) -> tuple[Any, bool]:
    """A ``distributed.Client`` for an address, an existing client, or ``local-gpus``;
    and whether this search owns it (and must close it)."""
    try:
        from distributed import Client
    except ImportError as error:
        raise GraphError(
            f"cluster: dask.distributed cannot be imported ({error}); pip install 'cherenkov[distributed]'"
        ) from None
    if isinstance(cluster, Client):
        return cluster, False
    if cluster == "local-gpus":
        return Client(local_gpu_cluster()), True
    if isinstance(cluster, str) and cluster.startswith(("tcp://", "tls://", "ucx://", "inproc://")):
        return Client(cluster), True
    raise GraphError(f"cluster: {cluster!r} is not a scheduler address (tcp://host:port), a Client or 'local-gpus'")


# ------------------------------------------------------------------ on the workers


def compile_remote(plan: KernelPlan, source: str | None) -> tuple[CompiledKernel | None, bytes, str | None]:
    """Compile on a worker; return the kernel record, its cubin bytes, or the error text."""
    try:
        compiled = compile_plan(plan, source=source)
    except CompileError as error:
        return None, b"", f"{error}: {(error.log or '').strip()[:600]}"
    return compiled, compiled.cubin_path.read_bytes(), None


def measure_remote(tasks: list[tuple[MeasureTask, bytes]], timeout_s: float) -> list[Measurement]:
    """Measure a batch on this worker's GPU (device 0 under its CUDA_VISIBLE_DEVICES),
    each candidate in a child process, from cubins shipped as bytes."""
    directory = Path(tempfile.mkdtemp(prefix="cherenkov-cubins-"))
    results = []
    with MeasurementPool((0,), timeout_s) as pool:
        for task, cubin in tasks:
            path = directory / f"{task.candidate}.cubin"
            path.write_bytes(cubin)
            local = dataclasses.replace(task.compiled, cubin_path=path)
            results.append(pool.measure(dataclasses.replace(task, compiled=local)))
    return results


# ------------------------------------------------------------------ in the search


class DaskExecutor:
    """Compiles and measures candidates on a Dask cluster."""

    def __init__(self, cluster: Any) -> None:
        self.client, self._owned = _client(cluster)
        self._cubins: dict[str, bytes] = {}

    def gpu_workers(self) -> list[str]:
        info = self.client.scheduler_info()["workers"]
        return [address for address, w in info.items() if w.get("resources", {}).get("GPU", 0) >= 1]

    def compile(self, plans: Sequence[KernelPlan], sources: Sequence[str | None]) -> list[CompiledKernel | CompileError]:
        futures = self.client.map(compile_remote, list(plans), list(sources), pure=False)
        results: list[CompiledKernel | CompileError] = []
        for plan, (compiled, cubin, error) in zip(plans, self.client.gather(futures)):
            if compiled is None:
                results.append(CompileError(error or f"{plan.name} did not compile"))
                continue
            self._cubins[compiled.source_hash + compiled.arch] = cubin
            results.append(compiled)
        return results

    def measure(self, tasks: Sequence[MeasureTask], timeout_s: float) -> dict[str, Measurement]:
        """Split the tasks over the GPU workers (round robin) and measure every batch."""
        workers = self.gpu_workers()
        if not workers:
            raise GraphError("cluster: no worker offers a GPU resource (start GPU workers with --resources GPU=1)")
        batches: list[list[tuple[MeasureTask, bytes]]] = [[] for _ in workers]
        for index, task in enumerate(tasks):
            cubin = self._cubins.get(task.compiled.source_hash + task.compiled.arch) or task.compiled.cubin_path.read_bytes()
            batches[index % len(workers)].append((task, cubin))
        futures = [
            self.client.submit(measure_remote, batch, timeout_s, workers=[worker], resources=GPU_RESOURCE, pure=False)
            for worker, batch in zip(workers, batches)
            if batch
        ]
        return {m.candidate: m for batch in self.client.gather(futures) for m in batch}

    def close(self) -> None:
        """Close the client and cluster this search created (never a caller's client)."""
        if not self._owned:
            return
        cluster = getattr(self.client, "cluster", None)
        self.client.close()
        if cluster is not None:
            cluster.close()
