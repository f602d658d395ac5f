"""The flash-attention backward under a sliding window (causal, about the query, or a causal mask aligned to the
last key): each main pass
bounds a key tile's query tiles by the window and the statistics pass runs the forward from the
window's first key. The ``mma.sync`` passes run emulated on the CPU against ``ck.grad``'s float64
gradients; on the GPU every backward plan matches float32 autograd through the band. (The forward's
tests, and the windows' graph, are in ``test_window_flash``.)"""

from __future__ import annotations

import shutil

import pytest

import cherenkov as ck

from .backward_emulator import emulate_backward
from .test_flash_backward import _check_against_autograd, assert_gradients_match
from .test_window_flash import (FULL_SLIDING_CACHE, GPU_IDS, GPU_WINDOWS, KEYS_AHEAD, WINDOW_IDS, WINDOWS, _inputs,
                                window_graph)

needs_gxx = pytest.mark.skipif(shutil.which("g++") is None, reason="no g++ to emulate kernels with")

BACKWARD_CASES = (0, 1, 3, 4)  # every window but the one wider than the sequence
GPU_BACKWARD_CASES = (*BACKWARD_CASES, 5, 6)  # and a causal mask aligned to the last key, a full sliding cache


@needs_gxx
@pytest.mark.parametrize(("sizes", "window", "softcap", "ahead"),
                         [WINDOWS[i] for i in BACKWARD_CASES] + [KEYS_AHEAD, FULL_SLIDING_CACHE],
                         ids=[WINDOW_IDS[i] for i in BACKWARD_CASES] + ["keys_ahead", "full_sliding_cache"])  # fmt: skip
def test_emulated_backward_matches_the_gradient_graph(sizes, window, softcap, ahead) -> None:
    """Two ``mma.sync`` main passes (16-key warps, and warp pairs where they fit), the statistics pass
    running the forward from the window's first key, every gradient within 1e-2 of ``ck.grad``'s; the
    first window's first plan also as a device of 5 multiprocessors launches it (the causal grid's
    chunks of slabs)."""
    gg = window_graph(*sizes, window, softcap, gradients=True, ahead=ahead)
    inputs = _inputs(gg)
    expected = ck.evaluate(gg, inputs)
    passes = list({(p.schedule.warp_pairs, p.schedule.block_q): p for p in ck.derive(gg).plans("sm_80")}.values())
    few_sms = sizes == WINDOWS[0][0]
    for plan, launches in zip(passes[:1] + passes[1:][-1:], ((None, 5) if few_sms else (None,), (None,))):
        for sms in launches:
            got = emulate_backward(plan, inputs["q"], inputs["k"], inputs["v"], inputs["d_o"], sms=sms)
            assert_gradients_match(got, expected, ("q", "k", "v"), f"{plan.schedule.key()} ({sms} SMs)")


# ------------------------------------------------------------------------------ GPU


@pytest.mark.gpu
@pytest.mark.parametrize(("sizes", "window", "softcap", "ahead"), [GPU_WINDOWS[i] for i in GPU_BACKWARD_CASES],
                         ids=[GPU_IDS[i] for i in GPU_BACKWARD_CASES])  # fmt: skip
def test_gpu_window_backward_matches_float32_autograd(sizes, window, softcap, ahead, cuda_device,
                                                      kernel_cache) -> None:  # fmt: skip
    """Every backward plan on sm_90a (16-key warps, warp pairs at D 64, the wgmma passes), every gradient
    against float32 autograd through the band, launched twice."""
    plans = ck.derive(window_graph(*sizes, window, softcap, gradients=True, ahead=ahead)).plans("sm_90a")
    _check_against_autograd(plans, "bf16", cuda_device, kernel_cache)
