"""Writing CUDA C++ text safely and readably: identifiers, literals, sections, indentation.

Nothing from outside the code generator is spliced into source unless it passed
:func:`identifier` (or is a number formatted here); free text only goes into comments
through :func:`comment_text`, which rejects anything that could end a comment.
"""

from __future__ import annotations

import functools
import math
import re
import textwrap

from cherenkov.codegen.errors import CodegenError

_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
_COMMENT_SAFE = re.compile(r"[A-Za-z0-9_ .,:;=()\[\]<>+\-*/^%'\"#!?]*\Z")


def identifier(name: str) -> str:
    """``name`` if it is a C identifier, else :class:`CodegenError`."""
    if not isinstance(name, str) or not _IDENTIFIER.match(name):
        raise CodegenError(f"{name!r} is not an identifier ([A-Za-z_][A-Za-z0-9_]*)")
    return name


def comment_text(text: str) -> str:
    """``text`` if it can sit inside a ``//`` comment without ending or escaping it."""
    if not _COMMENT_SAFE.match(text) or "*/" in text or "/*" in text or "//" in text:
        raise CodegenError(f"{text!r} cannot be placed in a comment")
    return text


def comment_lines(lines: list[str]) -> str:
    """A generated source's header: each line a ``//`` comment (see :func:`comment_text`)."""
    return "\n".join(f"// {comment_text(line)}" for line in lines)


def float_literal(value: float) -> str:
    """A float literal with enough digits to round-trip a float32 (``1.250000000e-01f``)."""
    if not math.isfinite(value):
        raise CodegenError(f"{value!r} is not a finite float")
    return f"{value:.9e}f"


def bool_literal(value: bool) -> str:
    return "true" if value else "false"


@functools.lru_cache(maxsize=8192)
def block(text: str) -> str:
    """A dedented, stripped block of code (emitters write indented triple-quoted strings)."""
    return textwrap.dedent(text).strip("\n")


def indent(text: str, levels: int = 1) -> str:
    """Indent every non-empty line by ``levels`` × four spaces."""
    return textwrap.indent(text, "    " * levels)


def section(title: str, *parts: str) -> str:
    """A titled section: a banner comment, then the parts separated by blank lines."""
    banner = f"// {'-' * 4} {comment_text(title)} {'-' * max(4, 84 - len(title))}"
    return "\n\n".join([banner, *[p for p in parts if p]])


def fill_line(text: str, key: str, value: str) -> str:
    """``text`` with the line holding only ``@key@`` replaced by ``value`` at that line's indentation
    (removed where ``value`` is empty)."""
    line = next(line for line in text.split("\n") if line.strip() == f"@{key}@")
    margin = line[: len(line) - len(line.lstrip())]
    replacement = "\n".join(margin + row if row else row for row in value.split("\n")) if value else None
    return text.replace(line + "\n", "" if replacement is None else replacement + "\n")
