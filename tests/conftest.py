"""Session-wide test setup: a private cherenkov cache (kernels, tuning database, runs),
and the ``gpu`` fixture of the GPU tests.

Tests never touch the user's real cache; kernels compiled by one test module (all seed
plans, in the codegen tests) are reused by later ones (the search tests).
"""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session", autouse=True)
def private_cache(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("cherenkov-cache")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("CHERENKOV_CACHE_DIR", str(root))
        yield root


@pytest.fixture
def gpu():
    """torch, when a CUDA GPU and cupy are present; the test is skipped otherwise."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("cupy")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    return torch
