"""What this machine can do: its GPU, its CUDA compiler, and the target to build for.

Detection never creates a CUDA context in the calling process (``nvidia-smi`` names the
GPUs; ``importlib`` checks that torch and cupy are installed without importing them),
so a search process stays free of CUDA state and its workers own the GPUs.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import logging
import os
import shutil
import subprocess
from dataclasses import dataclass

import cherenkov
from cherenkov.codegen import CompileError, find_compiler
from cherenkov.graph import GraphError
from cherenkov.rewrites.plan import TARGETS
from cherenkov.search.records import Environment

log = logging.getLogger(__name__)

DEFAULT_TARGET = "sm_120"
_TARGET_OF_CAPABILITY = {"8.0": "sm_80", "8.6": "sm_86", "8.7": "sm_86", "8.9": "sm_89", "9.0": "sm_90a",
                         "12.0": "sm_120", "12.1": "sm_120"}  # fmt: skip
# Other targets whose code a GPU of that capability runs (an sm_90a GPU runs plain sm_90 code:
# asking for the portable mma.sync family on a Hopper GPU still measures it there).
_ALSO_RUNS = {"9.0": ("sm_90",)}


@dataclass(frozen=True)
class Gpu:
    index: int
    name: str
    compute_capability: str


def visible_gpus() -> list[Gpu]:
    """GPUs ``nvidia-smi`` lists (empty without a driver), restricted to
    ``CUDA_VISIBLE_DEVICES`` when it names device indices. ``Gpu.index`` is the
    physical index (what ``CUDA_VISIBLE_DEVICES`` takes); CUDA numbers the visible ones
    0, 1, ... in the same order."""
    if shutil.which("nvidia-smi") is None:
        return []
    try:
        listing = subprocess.run(
            ["nvidia-smi", "--query-gpu=index,name,compute_cap", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=30, check=True,
        ).stdout
    except (subprocess.SubprocessError, OSError) as error:
        log.info("nvidia-smi failed: %s", error)
        return []
    gpus = []
    for line in listing.strip().splitlines():
        index, name, capability = (part.strip() for part in line.split(","))
        gpus.append(Gpu(int(index), name, capability))
    mask = os.environ.get("CUDA_VISIBLE_DEVICES")
    if mask is not None and all(part.strip().isdigit() for part in mask.split(",") if part.strip()):
        by_index = {g.index: g for g in gpus}
        gpus = [by_index[int(part)] for part in mask.split(",") if part.strip() and int(part) in by_index]
    return gpus


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def cupy_version() -> str | None:
    """The installed cupy's version (any of its CUDA-specific distributions), or None."""
    if importlib.util.find_spec("cupy") is None:
        return None
    return next((v for p in ("cupy-cuda13x", "cupy-cuda12x", "cupy") if (v := _version(p))), "unknown")


def toolkit() -> str:
    """The CUDA compiler that will build kernels, or ``none``."""
    try:
        return find_compiler().version
    except CompileError:
        return "none"


@dataclass(frozen=True)
class Capabilities:
    """The environment a search records, plus why it cannot measure (if it cannot)."""

    environment: Environment
    devices: tuple[int, ...]
    limitations: tuple[str, ...]


def detect(target: str = "auto") -> Capabilities:
    """Choose the target and say whether candidates can be measured here."""
    if target != "auto" and target not in TARGETS:
        raise GraphError(f"optimize: unknown target {target!r}; valid: auto, {', '.join(TARGETS)}")
    gpus = visible_gpus()
    local_target = _TARGET_OF_CAPABILITY.get(gpus[0].compute_capability) if gpus else None
    chosen = target if target != "auto" else (local_target or DEFAULT_TARGET)
    runnable = {local_target, *_ALSO_RUNS.get(gpus[0].compute_capability, ())} if gpus else set()
    limitations = []
    compiler = toolkit()
    if compiler == "none":
        limitations.append("no CUDA compiler (nvcc or cupy's NVRTC): kernels are generated but not compiled")
    if not gpus:
        limitations.append("no GPU: candidates are ranked by the cost model, not measured")
    elif chosen not in runnable:
        limitations.append(
            f"target {chosen} is not the local GPU ({gpus[0].name}, {local_target or 'unsupported'}): "
            "candidates are ranked by the cost model, not measured"
        )
    torch_version, cupy = _version("torch"), cupy_version()
    if gpus and (torch_version is None or cupy is None):
        missing = " and ".join(name for name, v in (("torch", torch_version), ("cupy", cupy)) if v is None)
        limitations.append(f"{missing} not installed: candidates are ranked by the cost model, not measured")
    measured = chosen in runnable and compiler != "none" and torch_version and cupy
    environment = Environment(
        target=chosen,
        gpu=gpus[0].name if measured else None,
        compute_capability=gpus[0].compute_capability if measured else None,
        toolkit=compiler,
        cherenkov=cherenkov.__version__,
        torch=torch_version,
        cupy=cupy,
        measured=bool(measured),
    )
    # CUDA ordinals of the visible GPUs that share the first one's architecture
    devices = tuple(i for i, g in enumerate(gpus) if g.compute_capability == gpus[0].compute_capability) if measured else ()
    return Capabilities(environment, devices, tuple(limitations))
