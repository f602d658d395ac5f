"""Environment detection says what cannot be done here and picks a sensible target."""

from __future__ import annotations

import pytest

import cherenkov as ck
from cherenkov.search import environment


def test_without_a_gpu_the_default_target_is_modelled(monkeypatch) -> None:
    monkeypatch.setattr(environment, "visible_gpus", lambda: [])
    caps = environment.detect("auto")
    assert caps.environment.target == "sm_120" and not caps.environment.measured
    assert any("no GPU" in note for note in caps.limitations)


def test_a_target_other_than_the_local_gpu_is_modelled(monkeypatch) -> None:
    monkeypatch.setattr(environment, "visible_gpus", lambda: [environment.Gpu(0, "NVIDIA H200", "9.0")])
    caps = environment.detect("sm_120")
    assert not caps.environment.measured and caps.environment.gpu is None
    assert any("not the local GPU" in note for note in caps.limitations)


def test_a_hopper_gpu_measures_the_portable_sm_90_family_too(monkeypatch) -> None:
    monkeypatch.setattr(environment, "visible_gpus", lambda: [environment.Gpu(0, "NVIDIA H200", "9.0")])
    monkeypatch.setattr(environment, "toolkit", lambda: "13.0")
    monkeypatch.setattr(environment, "cupy_version", lambda: "14.2")
    monkeypatch.setattr(environment, "_version", lambda name: "2.11")
    for target in ("sm_90", "sm_90a", "auto"):
        caps = environment.detect(target)
        assert caps.environment.measured and caps.environment.gpu == "NVIDIA H200", target
        assert caps.devices == (0,) and not caps.limitations, target
    assert environment.detect("auto").environment.target == "sm_90a"
    assert not environment.detect("sm_80").environment.measured, "an sm_80 cubin does not run on a 9.0 GPU"


def test_without_a_compiler_the_search_still_ranks(monkeypatch) -> None:
    monkeypatch.setattr(environment, "toolkit", lambda: "none")
    monkeypatch.setattr(environment, "visible_gpus", lambda: [])
    caps = environment.detect("sm_90")
    assert any("no CUDA compiler" in note for note in caps.limitations)


def test_unknown_targets_are_graph_errors() -> None:
    with pytest.raises(ck.GraphError, match="valid: auto"):
        environment.detect("sm_75")
