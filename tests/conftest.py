"""Session-wide test setup: a private cherenkov cache (kernels, tuning database, runs),
and the ``gpu`` fixture of the GPU tests.

Tests never touch the user's real cache; kernels compiled by one test module (all seed
plans, in the codegen tests) are reused by later ones (the search tests), in any worker of a
``pytest -n`` run (``make test`` runs one a core, a test file a worker at a time).
"""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session", autouse=True)
def private_cache(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest):
    """One cache folder for the run: under pytest-xdist, the workers' common temporary folder (the
    kernel cache writes atomically, so a kernel one worker compiled is another's too)."""
    if not hasattr(request.config, "workerinput"):  # no xdist worker: this process's own folder
        root = tmp_path_factory.mktemp("cherenkov-cache")
    else:
        root = tmp_path_factory.getbasetemp().parent / "cherenkov-cache"
        root.mkdir(exist_ok=True)
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
