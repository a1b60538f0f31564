"""Floating-point dtype tables shared by the layers and the mixed-precision wrappers above them."""

from __future__ import annotations

import torch

HALF_DTYPES = (torch.float16, torch.bfloat16)
"""The 16-bit float dtypes: a model in one of them runs through `Float16Module` and keeps fp32 main
params in the optimizer wrapper; attention picks its softmax path by them."""
