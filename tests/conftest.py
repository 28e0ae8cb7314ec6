"""Test-wide setup: Triton runs in its CPU interpreter when there is no GPU.

This must happen before anything imports triton.
"""

import os

from engine_core.openmp_env import limit_openmp_spinning

limit_openmp_spinning()  # before torch loads: the suite's engine subprocesses share the cores with it

import torch  # noqa: E402

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
