"""Test-wide setup: Triton runs in its CPU interpreter when there is no GPU.

This must happen before anything imports triton.
"""

import os

from engine_core.openmp_env import limit_openmp_spinning

limit_openmp_spinning()  # before torch loads: the suite's engine subprocesses share the cores with it

import torch  # noqa: E402

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import shutil  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402

from tests.tandem_cache import private_cache_root  # noqa: E402

_SESSION_CACHE = private_cache_root(Path(tempfile.mkdtemp(prefix="tandem-test-cache-")))
os.environ["TANDEM_CACHE_DIR"] = str(_SESSION_CACHE)  # see tests/tandem_cache.py


def pytest_unconfigure(config):
    shutil.rmtree(_SESSION_CACHE, ignore_errors=True)  # the link goes, the kernels it points at stay
