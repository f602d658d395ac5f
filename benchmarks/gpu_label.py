"""The GPU's short name in a results file's name: ``h200`` for "NVIDIA H200", ``h100`` for "NVIDIA H100
80GB HBM3" (its last word, ``hbm3``, named the memory, not the card), ``5090`` for "NVIDIA GeForce RTX 5090"."""

from __future__ import annotations

import re


def gpu_label(device_name: str) -> str:
    """The first word of ``device_name`` that holds a digit, lower-cased (``gpu`` when none does)."""
    words = [w for w in re.findall(r"[a-z0-9]+", device_name.lower()) if any(c.isdigit() for c in w)]
    return words[0] if words else "gpu"
