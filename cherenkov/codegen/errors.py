"""Errors of code generation and compilation."""

from __future__ import annotations


class CodegenError(ValueError):
    """A plan the CUDA generator cannot emit (wrong kind, invalid schedule, bad identifier)."""


class CompileError(RuntimeError):
    """The CUDA compiler rejected a source; ``log`` holds the compiler's full output."""

    def __init__(self, message: str, log: str = "", arch: str = "", kernel_name: str = ""):
        super().__init__(f"{message}\n{log}".rstrip())
        self.log = log
        self.arch = arch
        self.kernel_name = kernel_name
