"""Parsing the ptxas resource report (``-Xptxas -v`` / NVRTC ``--ptxas-options=-v``)."""

from __future__ import annotations

import re

from cherenkov.codegen.errors import CompileError
from cherenkov.codegen.plan import ResourceReport

_ENTRY = re.compile(r"Compiling entry function '(?P<name>[^']+)'")
_FRAME = re.compile(
    r"(?P<stack>\d+) bytes stack frame, (?P<stores>\d+) bytes spill stores, (?P<loads>\d+) bytes spill loads"
)
_REGISTERS = re.compile(r"Used (?P<registers>\d+) registers")
_SMEM = re.compile(r"(?P<smem>\d+) bytes smem")
_SERIALIZED = re.compile(r"wgmma\.mma_async instructions are serialized .*? function '(?P<name>[^']+)'")
_FENCED = re.compile(r"warpgroup\.(?:arrive|wait) is injected .*? function '(?P<name>[^']+)'")


def parse_ptxas_report(log: str, kernel_name: str, smem_dynamic: int = 0) -> ResourceReport:
    """The resources ptxas reported for ``kernel_name`` (the entry's own section of the log), and
    whether it serialised the wgmma pipeline of that kernel or of the module's kernels named after
    it (``<name>_statistics``, ``<name>_dq``), or injected wgmma fences into them."""
    section = _entry_section(log, kernel_name)
    frame = _FRAME.search(section)
    registers = _REGISTERS.search(section)
    if frame is None or registers is None:
        raise CompileError(f"no ptxas resource report for {kernel_name}", log=log, kernel_name=kernel_name)
    smem = _SMEM.search(section)
    return ResourceReport(
        registers=int(registers["registers"]),
        smem_static=int(smem["smem"]) if smem else 0,
        smem_dynamic=smem_dynamic,
        spill_stores=int(frame["stores"]),
        spill_loads=int(frame["loads"]),
        stack_frame=int(frame["stack"]),
        wgmma_serialized=any(m["name"].startswith(kernel_name) for m in _SERIALIZED.finditer(log)),
        wgmma_fenced=any(m["name"].startswith(kernel_name) for m in _FENCED.finditer(log)),
    )


def _entry_section(log: str, kernel_name: str) -> str:
    """Lines from ``Compiling entry function 'kernel_name'`` up to the next entry."""
    entries = list(_ENTRY.finditer(log))
    for i, entry in enumerate(entries):
        if entry["name"] == kernel_name:
            end = entries[i + 1].start() if i + 1 < len(entries) else len(log)
            return log[entry.start() : end]
    raise CompileError(f"ptxas report does not mention {kernel_name}", log=log, kernel_name=kernel_name)
