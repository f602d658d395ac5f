"""Compiling generated CUDA to cubins (plus PTX for inspection), cached on disk.

Plans are flash-attention :class:`KernelPlan` s or generic :class:`TermKernelPlan` s (any
other fused kernel); both compile the same way, each through its own generator.

Two compilers, one interface: :class:`Nvcc` (``nvcc -cubin -arch=sm_XX -O3 -Xptxas -v
--keep``: the PTX is the intermediate that went into the cubin) and, where no nvcc is
installed, :class:`Nvrtc` through cupy (one pass for the cubin, one for the PTX). No
``--use_fast_math``: the kernels call the approximate instructions they want explicitly
(``ex2.approx``), everything else stays IEEE. A compiler failure raises
:class:`CompileError` with the compiler's log. Results go through :class:`KernelCache`;
:func:`compile_plans` compiles many plans at once with concurrent compiler processes.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Protocol

from cherenkov.codegen.cache import KernelCache, cache_key, sha256_hex
from cherenkov.codegen.cuda import term_kernels
from cherenkov.codegen.cuda import flash_attention_backward, flash_attention_fp8
from cherenkov.codegen.cuda.flash_attention import flash_attention_source, kernel_name
from cherenkov.codegen.cuda.flash_attention_sm90a import emit_flash_attention_sm90a
from cherenkov.codegen.cuda.flash_attention_sm90a import kernel_name as hopper_kernel_name
from cherenkov.codegen.errors import CompileError
from cherenkov.codegen.plan import CompiledKernel, FlashLayout, KernelPlan
from cherenkov.codegen.report import parse_ptxas_report
from cherenkov.codegen.term_plan import TermKernelPlan
from cherenkov.rewrites.plan_backward import BackwardPlan
from cherenkov.rewrites.plan_fp8 import Fp8FlashSchedule
from cherenkov.rewrites.plan_sm90a import HopperFlashSchedule

AnyPlan = KernelPlan | TermKernelPlan | BackwardPlan

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CompilerOutput:
    """What one compiler run produced: the cubin, its PTX and the log (with the ptxas report)."""

    cubin: bytes
    ptx: str
    log: str


class Compiler(Protocol):
    """Turns one CUDA source into a cubin for one architecture."""

    name: str
    flags: tuple[str, ...]

    @property
    def version(self) -> str: ...

    def compile(self, source: str, arch: str) -> CompilerOutput: ...


class Nvcc:
    """The nvcc driver: cubin and its PTX from one invocation."""

    name = "nvcc"
    flags = ("-O3", "-std=c++17")

    def __init__(self, executable: str):
        self.executable = executable

    @cached_property
    def version(self) -> str:
        result = subprocess.run([self.executable, "--version"], capture_output=True, text=True, check=True)
        return f"nvcc {result.stdout.strip().splitlines()[-1]}"

    def compile(self, source: str, arch: str) -> CompilerOutput:
        with tempfile.TemporaryDirectory(prefix="cherenkov-nvcc-") as tmp:
            work = Path(tmp)
            (work / "kernel.cu").write_text(source)
            command = [
                self.executable, "-cubin", f"-arch={arch}", *self.flags, "-Xptxas", "-v",
                "--keep", "--keep-dir", str(work), "-o", str(work / "kernel.cubin"), str(work / "kernel.cu"),
            ]  # fmt: skip
            result = subprocess.run(command, capture_output=True, text=True, cwd=work)
            output = result.stdout + result.stderr
            if result.returncode != 0:
                raise CompileError(f"nvcc failed for {arch} (exit {result.returncode})", log=output, arch=arch)
            return CompilerOutput((work / "kernel.cubin").read_bytes(), (work / "kernel.ptx").read_text(), output)


class Nvrtc:
    """NVRTC through cupy: the cubin for ``sm_XX``, then the PTX for ``compute_XX``."""

    name = "nvrtc"
    flags = ("-std=c++17",)  # NVRTC optimises fully by default and has no -O3

    @cached_property
    def version(self) -> str:
        from cupy_backends.cuda.libs import nvrtc

        major, minor = nvrtc.getVersion()
        return f"nvrtc {major}.{minor}"

    def compile(self, source: str, arch: str) -> CompilerOutput:
        cubin, report = self._run(source, [f"--gpu-architecture={arch}", "--ptxas-options=-v"], arch, cubin=True)
        ptx, _ = self._run(source, [f"--gpu-architecture={arch.replace('sm_', 'compute_')}"], arch, cubin=False)
        return CompilerOutput(cubin, ptx.decode(), report)

    def _run(self, source: str, options: list[str], arch: str, cubin: bool) -> tuple[bytes, str]:
        from cupy_backends.cuda.libs import nvrtc

        program = nvrtc.createProgram(source, "kernel.cu", [], [])
        try:
            try:
                nvrtc.compileProgram(program, [*self.flags, *options])
            except nvrtc.NVRTCError as err:
                raise CompileError(f"NVRTC failed for {arch}: {err}", log=nvrtc.getProgramLog(program), arch=arch)
            binary = nvrtc.getCUBIN(program) if cubin else nvrtc.getPTX(program)
            return binary, nvrtc.getProgramLog(program)
        finally:
            nvrtc.destroyProgram(program)


def find_compiler() -> Compiler:
    """nvcc from PATH (or ``$CUDA_HOME/bin``), else NVRTC through cupy, else CompileError."""
    cuda_home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    executable = shutil.which("nvcc") or (cuda_home and shutil.which("nvcc", path=str(Path(cuda_home) / "bin")))
    if executable:
        return Nvcc(executable)
    try:
        from cupy_backends.cuda.libs import nvrtc  # noqa: F401
    except ImportError:
        raise CompileError("no CUDA compiler: nvcc is not on PATH and cupy (NVRTC) is not installed") from None
    return Nvrtc()


def _is_hopper(plan: AnyPlan) -> bool:
    return isinstance(plan, KernelPlan) and isinstance(plan.schedule, HopperFlashSchedule)


def _is_fp8(plan: AnyPlan) -> bool:
    return isinstance(plan, KernelPlan) and isinstance(plan.schedule, Fp8FlashSchedule)


def plan_source(plan: AnyPlan) -> str:
    """The generated CUDA source of a flash-attention (``mma.sync`` 16- or 8-bit, or sm_90a), backward or term plan."""
    if isinstance(plan, BackwardPlan):
        return flash_attention_backward.flash_attention_backward_source(plan)
    if isinstance(plan, TermKernelPlan):
        return term_kernels.term_kernel_source(plan)
    if _is_hopper(plan):
        return emit_flash_attention_sm90a(plan.problem, plan.schedule)
    if _is_fp8(plan):
        return flash_attention_fp8.flash_attention_fp8_source(plan)
    return flash_attention_source(plan)


def plan_kernel_name(plan: AnyPlan) -> str:
    """The ``extern "C"`` name of a plan's kernel (of a backward plan: its main pass)."""
    if isinstance(plan, BackwardPlan):
        return flash_attention_backward.kernel_name(plan)
    if isinstance(plan, TermKernelPlan):
        return term_kernels.kernel_name(plan)
    if _is_hopper(plan):
        return hopper_kernel_name(plan.schedule)
    if _is_fp8(plan):
        return flash_attention_fp8.kernel_name(plan)
    return kernel_name(plan)


def plan_dynamic_smem(plan: AnyPlan) -> int:
    """Dynamic shared memory of a plan's launch (of a backward plan: its main pass)."""
    if isinstance(plan, BackwardPlan):
        return flash_attention_backward.grids(plan)["main"][2]
    if isinstance(plan, TermKernelPlan):
        return term_kernels.term_dynamic_smem(plan)
    if _is_hopper(plan):
        return plan.schedule.problem_smem_bytes(plan.problem)
    if _is_fp8(plan):
        return flash_attention_fp8.fp8_dynamic_smem(plan)
    return FlashLayout.from_plan(plan).total_bytes


def compile_plan(
    plan: AnyPlan,
    *,
    arch: str | None = None,
    compiler: Compiler | None = None,
    cache_dir: Path | str | None = None,
    source: str | None = None,
) -> CompiledKernel:
    """Compile one plan for ``arch`` (default: its target), through the on-disk cache.

    ``source`` replaces the plan's generated source (the search injects faults this way
    in its tests); the cache key covers the source actually compiled."""
    arch = arch or plan.target.arch_flag
    compiler = compiler or find_compiler()
    cache = KernelCache(cache_dir)
    source = plan_source(plan) if source is None else source
    name = plan_kernel_name(plan)
    key = cache_key(source, arch, compiler.version, compiler.flags)
    entry = cache.load(key)
    cache_hit = entry is not None
    if entry is None:
        start = time.perf_counter()
        try:
            output = compiler.compile(source, arch)
        except CompileError as err:
            raise CompileError(f"{plan.name} did not compile for {arch}", log=err.log, arch=arch, kernel_name=name)
        seconds = time.perf_counter() - start
        report = parse_ptxas_report(output.log, name, plan_dynamic_smem(plan))
        if report.wgmma_serialized:
            log.warning("ptxas serialised the wgmma instructions of %s for %s (correct, but each waits for the "
                        "last)", name, arch)
        elif report.wgmma_fenced:
            log.warning("ptxas injected wgmma fences into %s for %s (correct, but they wait where the source "
                        "did not)", name, arch)
        entry = cache.store(key, output.cubin, output.ptx, name, report, seconds)
        log.debug("compiled %s for %s in %.2f s: %s", name, arch, seconds, report)
    return CompiledKernel(
        plan=plan,
        arch=arch,
        kernel_name=entry.kernel_name,
        cubin_path=entry.cubin_path,
        ptx_path=entry.ptx_path,
        report=entry.report,
        compile_seconds=entry.compile_seconds,
        source_hash=sha256_hex(source.encode()),
        compiler=compiler.version,
        cache_hit=cache_hit,
    )


def compile_plans(
    plans: list[AnyPlan],
    *,
    jobs: int | None = None,
    compiler: Compiler | None = None,
    cache_dir: Path | str | None = None,
    sources: list[str | None] | None = None,
) -> list[CompiledKernel | CompileError]:
    """Compile many plans (each for its own target) with ``jobs`` concurrent compiler
    processes (default: one per CPU). Returns, in order, a kernel or the error per plan.
    ``sources`` optionally replaces plans' generated sources (None: generate)."""
    compiler = compiler or find_compiler()
    workers = jobs or os.cpu_count() or 1

    def one(plan: AnyPlan, source: str | None) -> CompiledKernel | CompileError:
        try:
            return compile_plan(plan, compiler=compiler, cache_dir=cache_dir, source=source)
        except CompileError as err:
            log.warning("%s", str(err).splitlines()[0])
            return err

    with ThreadPoolExecutor(max_workers=workers) as pool:
        return list(pool.map(one, plans, sources or [None] * len(plans)))
