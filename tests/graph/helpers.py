"""Shared helpers for the graph tests: error measures, example loading, NumPy references.

The NumPy references here are written independently of cherenkov (plain formulas on
float64 arrays) so that ``ck.evaluate`` is checked against something it does not share
code with.
"""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path
from types import ModuleType

import numpy as np

import cherenkov as ck

EXAMPLES_DIR = Path(__file__).resolve().parents[2] / "examples"
EXAMPLE_NAMES: tuple[str, ...] = (
    "attention",
    "rms_norm",
    "mlp",
    "swiglu",
    "softmax",
    "layer_norm",
    "transformer_block",
)


def rel_err(out: np.ndarray, ref: np.ndarray) -> float:
    """``‖out − ref‖ / ‖ref‖`` (Frobenius); shapes must match exactly."""
    out, ref = np.asarray(out, dtype=np.float64), np.asarray(ref, dtype=np.float64)
    assert out.shape == ref.shape, f"shape {out.shape} != reference shape {ref.shape}"
    assert np.all(np.isfinite(ref)), "the reference itself is not finite"
    assert np.all(np.isfinite(out)), "output has NaN or inf where the reference is finite"
    norm = np.linalg.norm(ref)
    assert norm > 0, "the reference is all zeros; pick inputs that make the check meaningful"
    return float(np.linalg.norm(out - ref) / norm)


def assert_rel(out: np.ndarray, ref: np.ndarray, tol: float = 1e-12) -> None:
    """Relative Frobenius error at most ``tol``."""
    err = rel_err(out, ref)
    assert err <= tol, f"relative error {err:.3e} > {tol:.0e}"


def evaluate_one(graph: ck.Graph, **inputs: np.ndarray) -> np.ndarray:
    """The single output of ``graph`` evaluated on ``inputs``."""
    outputs = ck.evaluate(graph, inputs)
    assert len(outputs) == 1, f"expected one output, got {sorted(outputs)}"
    (value,) = outputs.values()
    return value


def load_example(name: str) -> ModuleType:
    """Import ``examples/<name>.py`` by file path (examples are not a package)."""
    path = EXAMPLES_DIR / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"cherenkov_example_{name}", path)
    assert spec is not None and spec.loader is not None, f"cannot load {path}"
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ------------------------------------------------------------------ NumPy references


def np_softmax(x: np.ndarray, axis: int = -1) -> np.ndarray:
    e = np.exp(x - x.max(axis=axis, keepdims=True))
    return e / e.sum(axis=axis, keepdims=True)


def np_attention(
    q: np.ndarray, k: np.ndarray, v: np.ndarray, causal: bool = False, scale: float | None = None
) -> np.ndarray:
    """SDPA on ``(B, H, S, D)`` arrays; K/V with fewer heads are shared by consecutive query
    heads (``repeat_interleave``); causal is top-left aligned (query ``i`` sees ``j <= i``)."""
    heads, kv_heads = q.shape[-3], k.shape[-3]
    if kv_heads != heads:
        k = np.repeat(k, heads // kv_heads, axis=-3)
        v = np.repeat(v, heads // kv_heads, axis=-3)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    scores = np.einsum("...qd,...kd->...qk", q, k) * scale
    if causal:
        seq_q, seq_kv = q.shape[-2], k.shape[-2]
        visible = np.arange(seq_kv)[None, :] <= np.arange(seq_q)[:, None]
        scores = np.where(visible, scores, -np.inf)
    return np.einsum("...qk,...kd->...qd", np_softmax(scores), v)


def np_rms_norm(x: np.ndarray, weight: np.ndarray | None = None, eps: float = 1e-6) -> np.ndarray:
    out = x / np.sqrt(np.mean(x**2, axis=-1, keepdims=True) + eps)
    return out if weight is None else out * weight


def np_layer_norm(
    x: np.ndarray, weight: np.ndarray | None = None, bias: np.ndarray | None = None, eps: float = 1e-5
) -> np.ndarray:
    mean = x.mean(axis=-1, keepdims=True)
    var = ((x - mean) ** 2).mean(axis=-1, keepdims=True)
    out = (x - mean) / np.sqrt(var + eps)
    if weight is not None:
        out = out * weight
    return out if bias is None else out + bias


def np_gelu_tanh(x: np.ndarray) -> np.ndarray:
    return 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3)))


def np_erf(x: np.ndarray) -> np.ndarray:
    """Exact erf (to double precision) elementwise via ``math.erf``."""
    return np.vectorize(math.erf, otypes=[np.float64])(x)


def np_gelu_erf(x: np.ndarray) -> np.ndarray:
    return 0.5 * x * (1.0 + np_erf(x / math.sqrt(2.0)))


def np_silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))
