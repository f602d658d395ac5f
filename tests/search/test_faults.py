"""Fault injection (tests only) puts each fault inside the kernel, or breaks the build."""

from __future__ import annotations

import pytest

from cherenkov.search.faults import FAULTS, inject_fault

SOURCE = "// header\n__global__ void __launch_bounds__(128) k(const int* q, int* o) {\n  o[0] = q[0];\n}\n"


@pytest.mark.parametrize("kind", sorted(FAULTS))
def test_runtime_faults_go_first_in_the_kernel_body(kind: str) -> None:
    faulty = inject_fault(SOURCE, kind)
    body = faulty.split("{", 1)[1]
    assert body.lstrip().startswith(f"/* injected fault: {kind} */ {FAULTS[kind]}")
    assert faulty.endswith("o[0] = q[0];\n}\n")


def test_compile_error_fault_breaks_the_build() -> None:
    assert "#error" in inject_fault(SOURCE, "compile_error")


def test_unknown_faults_and_sources_without_kernels_are_refused() -> None:
    with pytest.raises(ValueError, match="unknown fault"):
        inject_fault(SOURCE, "melt")
    with pytest.raises(ValueError, match="__global__"):
        inject_fault("int main() {}", "crash")
