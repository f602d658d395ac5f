"""Fixtures of the codegen tests: the seed problem, a compiler, a private kernel cache, a GPU."""

from __future__ import annotations

import pytest

from cherenkov.codegen import CompileError, find_compiler
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
