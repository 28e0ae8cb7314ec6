"""Test-wide setup: Triton runs in its CPU interpreter when there is no GPU (before anything imports triton),
and every test, with the servers it starts, uses a fresh cache folder instead of the user's ~/.cache/tandem
(scripts/fresh_cache.py): no plan timed outside this run decides a kernel in it.
"""

import os

from engine_core.openmp_env import limit_openmp_spinning
from scripts.fresh_cache import CACHE_ENV, share_compiled_kernels, use_fresh_cache

use_fresh_cache()

limit_openmp_spinning()  # before torch loads: the suite's engine subprocesses share the cores with it

import pytest  # noqa: E402
import torch  # noqa: E402

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture
def private_cache(tmp_path, monkeypatch):
    """An empty cache folder of the test's own (plans, dtype answers), sharing the run's compiled kernels."""
    monkeypatch.setenv(CACHE_ENV, str(share_compiled_kernels(tmp_path)))
    monkeypatch.delenv("TANDEM_REMEASURE", raising=False)
    return tmp_path
