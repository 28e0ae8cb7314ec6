"""The suite's own Tandem cache folders: no test reads or writes the user's plan cache (issue 49).

`tests/conftest.py` points TANDEM_CACHE_DIR at a fresh folder for the whole session (its engines'
subprocesses inherit it), so every plan a test loads is measured in that session; tests that look
at the cache itself take a folder of their own (`private_cache_root`). Each folder links
`torch_extensions` to the C++ kernels already built in the user's folder: a build takes tens of
seconds, and ninja rebuilds nothing through the link (the build files hold the sources' paths, not
the folder's).
"""

from __future__ import annotations

import os
from pathlib import Path

from kernels import cpu_extension

BUILT_KERNELS = cpu_extension.cache_dir()  # read before the suite moves TANDEM_CACHE_DIR


def private_cache_root(folder: Path) -> Path:
    """`folder` as a Tandem cache root with no plans in it and the user's built kernels linked in."""
    folder.mkdir(parents=True, exist_ok=True)
    BUILT_KERNELS.mkdir(parents=True, exist_ok=True)
    link = folder / "torch_extensions"
    if not link.exists():
        os.symlink(BUILT_KERNELS, link, target_is_directory=True)
    return folder
