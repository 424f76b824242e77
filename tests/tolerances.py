"""Tolerances that fit the values compared, so results do not depend on the CPU.

fp32 results computed in a different order (another CPU's BLAS, another batch shape) differ by a
few units in the last place of the *largest* values involved, not of each element: a logit of 12
carries an absolute error of ~1e-6 whatever the size of its neighbours. So the allowed absolute
difference is a fraction `rel` of the largest |expected| value, and nothing is allowed per element.
A real mistake (a wrong expert, a dropped tensor) moves values by 1e-2 of that size or more.
"""

from __future__ import annotations

import torch

FP32_REL = 1e-5  # fraction of max |expected|; measured summation-order differences are ~1e-6 of it


def assert_close_rel(actual: torch.Tensor, expected: torch.Tensor, rel: float = FP32_REL) -> None:
    """`actual` equals `expected` up to `rel` x max|expected| per element (shapes and dtypes must match)."""
    scale = float(expected.detach().abs().max()) if expected.numel() else 0.0
    torch.testing.assert_close(actual, expected, atol=rel * max(scale, 1e-30), rtol=0)
