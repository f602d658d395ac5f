"""8-bit floats: rounding a float64 array to ``fp8_e4m3`` or ``fp8_e5m2`` and back.

The reference for what a cast to an 8-bit float keeps, as PyTorch's casts to
``torch.float8_e4m3fn`` and ``torch.float8_e5m2`` do: round to nearest, ties to even,
subnormals kept; e4m3 has no infinities and saturates at ±448 (±∞ included), e5m2 rounds
past ±57344's halfway point to ±∞.
"""

from __future__ import annotations

import numpy as np

# (mantissa bits, smallest normal exponent, largest finite value, saturating)
FP8_FORMATS = {"fp8_e4m3": (3, -6, 448.0, True), "fp8_e5m2": (2, -14, 57344.0, False)}


def round_to_e8m0(values: np.ndarray) -> np.ndarray:
    """``values`` as MX scales hold them, as PyTorch's cast to ``float8_e8m0fnu`` rounds: to the
    power of two below or above, whichever is nearer (a mantissa of 1.5 rounds up), within
    ``[2^-127, 2^127]``; NaN for values that are not positive and finite (E8M0 has no zero,
    sign or ∞)."""
    values = np.asarray(values, dtype=np.float64)
    valid = np.isfinite(values) & (values > 0)
    with np.errstate(divide="ignore", invalid="ignore"):
        below = np.floor(np.log2(np.where(valid, values, 1.0)))
        exponent = np.clip(below + (np.where(valid, values, 1.0) / np.exp2(below) >= 1.5), -127, 127)
    return np.where(valid, np.exp2(exponent), np.nan)


def round_to_fp8(values: np.ndarray, dtype: str) -> np.ndarray:
    """``values`` rounded to the 8-bit float ``dtype`` (a key of ``FP8_FORMATS``), as float64."""
    mantissa, min_exponent, largest, saturating = FP8_FORMATS[dtype]
    values = np.asarray(values, dtype=np.float64)
    magnitude = np.abs(values)
    with np.errstate(divide="ignore", invalid="ignore"):
        exponent = np.maximum(np.floor(np.log2(np.where(magnitude > 0, magnitude, 1.0))), min_exponent)
        quantum = np.exp2(exponent - mantissa)
        rounded = np.where(np.isinf(magnitude), np.inf, np.round(magnitude / quantum) * quantum)  # half to even
    if saturating:
        rounded = np.minimum(rounded, largest)
    else:
        rounded = np.where(rounded > largest, np.inf, rounded)
    return np.where(np.isnan(values), np.nan, np.copysign(rounded, values))
