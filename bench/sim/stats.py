"""Spread across seeds: Student-t confidence intervals of a mean, and of a mean paired difference."""

from __future__ import annotations

import math
from typing import Sequence

from scipy import stats


def t_interval(values: Sequence[float], confidence: float = 0.95) -> dict[str, float]:
    """Mean of `values` (one per seed) with its two-sided Student-t confidence interval.

    mean +- t(1 - (1 - confidence) / 2, n - 1) x sd / sqrt(n), sd with n - 1 in the denominator.

    Raises:
        ValueError: fewer than two values, or a confidence outside (0, 1).
    """
    n = len(values)
    if n < 2:
        raise ValueError(f"t_interval needs at least two values (seeds), got {n}")
    if not 0 < confidence < 1:
        raise ValueError(f"confidence={confidence} must be in (0, 1)")
    mean = math.fsum(values) / n
    sd = math.sqrt(math.fsum((v - mean) ** 2 for v in values) / (n - 1))
    half = float(stats.t.ppf(0.5 + confidence / 2, n - 1)) * sd / math.sqrt(n)
    return {"n": n, "mean": mean, "sd": sd, "ci_low": mean - half, "ci_high": mean + half, "confidence": confidence}


def paired_difference(a: Sequence[float], b: Sequence[float], confidence: float = 0.95) -> dict[str, float]:
    """`t_interval` of a[i] - b[i]: two policies on the same seeds (traces), so the trace's own variation cancels."""
    if len(a) != len(b):
        raise ValueError(f"paired_difference needs as many values on each side, got {len(a)} and {len(b)}")
    return t_interval([x - y for x, y in zip(a, b)], confidence)
