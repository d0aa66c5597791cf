"""Triton kernels (layer 1): each module imports Triton, so the engine imports one only where `triton_runs()`."""

import importlib.util

import torch


def triton_runs() -> bool:
    """Whether the Triton kernels can run here: a CUDA device and Triton installed."""
    return torch.cuda.is_available() and importlib.util.find_spec("triton") is not None
