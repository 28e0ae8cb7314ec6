"""OpenMP's idle threads must not spin for milliseconds; set before torch loads (torch-free module).

torch's CPU ops run on GNU OpenMP (libgomp) in the pip wheels. Between two parallel regions
libgomp's worker threads spin-wait GOMP_SPINCOUNT times before they sleep: 300,000 by default
(when OMP_WAIT_POLICY is unset), several milliseconds. Alone on a machine that costs nothing, but
an engine is rarely alone: its own gRPC thread, a co-located frontend or client, another engine or
any other torch process needs a core between the engine's parallel regions and finds it held by
a spinning worker, while that process's own workers spin for the engine's cores in turn. Beside
another torch process the default made a decode step many times slower, and alone 3,000 spins are as
fast as the default (docs/cpu-tuning.md#cpu-threads; scripts/bench_openmp_spin.py measures both).
"""

from __future__ import annotations

import logging
import os
import sys

logger = logging.getLogger(__name__)

DEFAULT_SPIN_COUNT = 3000


def limit_openmp_spinning(spin_count: int = DEFAULT_SPIN_COUNT) -> bool:
    """Set GOMP_SPINCOUNT unless the user chose it or a wait policy. libgomp reads it once, when
    torch loads it, so call this before the first `import torch`; True when it was set."""
    if "GOMP_SPINCOUNT" in os.environ or "OMP_WAIT_POLICY" in os.environ:
        return False
    if "torch" in sys.modules:
        logger.debug("torch is already imported: OpenMP keeps its spin count")
        return False
    os.environ["GOMP_SPINCOUNT"] = str(spin_count)
    return True
