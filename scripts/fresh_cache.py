"""A fresh Tandem cache folder for one test or benchmark run, never the user's ~/.cache/tandem.

Linear plans and the dtype race are measured anew in it, so a plan an earlier run timed (perhaps on a busy
machine) decides nothing in this one, and nothing this run times is left behind for the user's server. The
compiled C++ kernels are kept between runs in build/test-cache beside the tree: building them takes a minute,
and their build name already names the CPU, the flags and the sources (kernels/cpu/extension.py).
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from pathlib import Path

CACHE_ENV = "TANDEM_CACHE_DIR"  # read by kernels/cpu/extension.py's cache_root()
COMPILED_KERNELS = Path(__file__).resolve().parents[1] / "build" / "test-cache" / "torch_extensions"


def share_compiled_kernels(folder: Path) -> Path:
    """Make `folder` a cache folder whose compiled kernels are the shared ones. One library loaded from two
    paths would register its torch ops twice, which aborts the process."""
    COMPILED_KERNELS.mkdir(parents=True, exist_ok=True)
    (folder / "torch_extensions").symlink_to(COMPILED_KERNELS, target_is_directory=True)
    return folder


def use_fresh_cache() -> Path:
    """Point TANDEM_CACHE_DIR (for this process and every process it starts) at a new folder, removed at exit."""
    folder = share_compiled_kernels(Path(tempfile.mkdtemp(prefix="tandem-cache-")))
    os.environ[CACHE_ENV] = str(folder)
    atexit.register(shutil.rmtree, folder, ignore_errors=True)  # the link goes, the kernels stay
    return folder
