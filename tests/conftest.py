"""Test-wide setup: Triton runs in its CPU interpreter when there is no GPU.

This must happen before anything imports triton.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
