"""The emulator's deadlock detection: a block whose threads wait on barriers that can never
complete ends the emulated program at once with a report of what each thread waits on, while a
block whose threads wait long on one slow warp runs to the end."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import numpy as np
import pytest

from .emulator import PRELUDE, EmulatedDeadlock, host_binary, launch_blocks, run_emulated

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="no g++ to emulate kernels with")

THREADS = 128
SHUFFLES = 2000
"""The shuffles warp 0 of ``slow_warp`` makes while warps 1 and 2 wait at ``__syncthreads``."""

KERNELS = r"""
// Warp 3 returns at once. In block 0 the others exchange through a shuffle, then meet at __syncthreads;
// in block 1 lane 0 of each warp waits at __syncthreads while its warp's other lanes wait at the
// shuffle: neither barrier can complete.
__global__ void split_waits(float* out) {
    if (threadIdx.x >= 96) return;
    if (blockIdx.x == 1 && (threadIdx.x & 31) == 0) __syncthreads();
    else out[blockIdx.x * 128 + threadIdx.x] = __shfl_xor_sync(0xffffffffu, float(threadIdx.x), 1);
    __syncthreads();
}

// Warp 3 returns at once; warp 0 permutes its lanes' values through SHUFFLES shuffles while warps 1
// and 2 wait at __syncthreads, then every thread reads the value thread 95 - t stored before it.
__global__ void slow_warp(float* out) {
    if (threadIdx.x >= 96) return;
    __shared__ float stored[96];
    float v = float(threadIdx.x);
    if (threadIdx.x < 32)
        for (int i = 0; i < SHUFFLES; ++i) v = __shfl_xor_sync(0xffffffffu, v, 1 + i % 31);
    stored[threadIdx.x] = v;
    __syncthreads();
    out[blockIdx.x * 128 + threadIdx.x] = stored[95 - threadIdx.x];
}
"""


def _program() -> str:
    """A host program running the kernel its first argument names over two blocks, then printing
    the output buffer (a value a line)."""
    branches = " else ".join(
        f'if (std::strcmp(argv[1], "{name}") == 0) {{ {launch_blocks(name, (2, 1, 1), THREADS, "out.data()")} }}'
        for name in ("split_waits", "slow_warp")
    )
    main = f"""
int main(int argc, char** argv) {{
    std::vector<float> out({2 * THREADS}, -1.0f);
    {branches}
    for (float v : out) std::printf("%g\\n", v);
    return 0;
}}
"""
    return f"#define CK_EMU_MMA_FP16 0\n#define SHUFFLES {SHUFFLES}\n" + PRELUDE + KERNELS + main


@pytest.fixture(scope="module")
def binary(tmp_path_factory) -> Path:
    """The host program of both kernels, compiled once."""
    return host_binary(_program(), "deadlock", "the deadlock test's kernels", tmp_path_factory.mktemp("emulator"))


def test_a_deadlocked_block_fails_at_once_naming_what_each_thread_waits_on(binary: Path) -> None:
    start = time.monotonic()
    with pytest.raises(EmulatedDeadlock) as failure:
        run_emulated(binary, ["split_waits"], "split_waits", timeout=120)
    assert time.monotonic() - start < 5, "the deadlock is found in the round after the last arrival"
    warp = "the barrier (__syncwarp, shuffles, votes, ldmatrix, mma) of warp"
    assert str(failure.value).splitlines()[1:] == [
        "emulator: deadlock in split_waits, block (1, 0, 0) of grid (2, 1, 1): 96 of its 128 threads wait, and a "
        "round of resumes changed nothing they wait on",
        "  threads 0, 32, 64 wait on the block barrier (__syncthreads), phase 0: 3 of 96 arrived",
        f"  threads 1-31 wait on {warp} 0, phase 0: 31 of 32 arrived",
        f"  threads 33-63 wait on {warp} 1, phase 0: 31 of 32 arrived",
        f"  threads 65-95 wait on {warp} 2, phase 0: 31 of 32 arrived",
        "  threads 96-127 returned",
    ]


def test_threads_waiting_long_on_a_progressing_warp_run_to_the_end(binary: Path) -> None:
    run = run_emulated(binary, ["slow_warp"], "slow_warp", timeout=120)
    lanes = np.arange(32.0)
    for i in range(SHUFFLES):
        lanes = lanes[np.arange(32) ^ (1 + i % 31)]
    stored = np.concatenate([lanes, np.arange(32.0, 96.0)])
    expected = np.concatenate([stored[::-1], np.full(32, -1.0)])  # warp 3 returned: its elements stay -1
    np.testing.assert_array_equal(np.array(run.stdout.split(), dtype=float), np.tile(expected, 2))
