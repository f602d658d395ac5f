"""Fixtures of the codegen tests: the seed problem, a compiler (any, or nvcc itself), SASS
disassembly, a private kernel cache, a GPU."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

from cherenkov.codegen import CompileError, find_compiler
from cherenkov.codegen.compile import Nvcc
from cherenkov.rewrites.plan import AttentionProblem

# the scale the derivation finds for the seed graph, so search tests reuse these kernels
SEED_PROBLEM = AttentionProblem(batch=1, heads=8, kv_heads=8, seq_q=4096, seq_kv=8192, head_dim=128, scale=128**-0.5)


@pytest.fixture(scope="session")
def seed_problem() -> AttentionProblem:
    return SEED_PROBLEM


@pytest.fixture(scope="session")
def compiler():
    """nvcc (or NVRTC); the test is skipped where there is no CUDA compiler at all."""
    try:
        return find_compiler()
    except CompileError as err:
        pytest.skip(str(err))


@pytest.fixture
def kernel_cache(tmp_path):
    """A kernel cache folder of this test alone."""
    return tmp_path / "kernels"


@pytest.fixture(scope="session")
def cuda_device():
    """torch's CUDA device 0; skips without torch, cupy or a GPU."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("cupy")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    return torch.device("cuda", 0)


@pytest.fixture(scope="session")
def nvcc() -> Nvcc:
    """nvcc itself (the sm_90a tests read its ptxas log); skipped where it is not installed."""
    executable = shutil.which("nvcc") or shutil.which("nvcc", path="/usr/local/cuda/bin")
    if not executable:
        pytest.skip("nvcc is not installed")
    return Nvcc(executable)


def _find_cuobjdump() -> str | None:
    cuda_home = os.environ.get("CUDA_HOME") or "/usr/local/cuda"
    found = shutil.which("cuobjdump") or shutil.which("cuobjdump", path=str(Path(cuda_home) / "bin"))
    if found:
        return found
    try:  # triton ships one with its NVIDIA backend
        import triton
    except ImportError:
        return None
    bundled = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    return str(bundled) if bundled.exists() else None


@pytest.fixture(scope="session")
def sass() -> Callable[[Path], str] | None:
    """``sass(cubin_path)``: the cubin's SASS from cuobjdump; None where cuobjdump is missing."""
    tool = _find_cuobjdump()
    if tool is None:
        return None
    return lambda cubin: subprocess.run([tool, "-sass", str(cubin)], capture_output=True, text=True, check=True).stdout
