"""Tandem's C++ CPU kernels (kernels/cpu/csrc/*.cpp), built on first use with torch's extension tooling.

`load()` compiles the sources once per (sources, flags, torch version, CPU) and checkout into
`~/.cache/tandem/torch_extensions/` (`TANDEM_CACHE_DIR` moves it) and registers their ops
under `torch.ops.tandem`; later loads reuse the built library in well under a second. A cold
build takes tens of seconds and is logged before it starts. The library is built for the CPU
it runs on (`-march=native`, or `TANDEM_CPU_ARCH`), which is why the CPU's feature flags are
part of the cache key.

Nothing requires it: `load()` returns False and logs why when there is no C++ compiler or the
build fails, and callers keep the pure-torch path (kernels/reference/).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
import shutil
import sysconfig
import time
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

SOURCE_DIR = Path(__file__).resolve().parent / "csrc"
SOURCES = ("paged_attention.cpp", "fused_ops.cpp", "argmax.cpp", "int8_rows.cpp", "int8_gemv.cpp", "int4_gemv.cpp",
           "int8_vnni.cpp", "int8_grouped.cpp", "int8_blockwise.cpp",
           "bf16_packed.cpp", "lora.cpp", "decode_layer.cpp")
CFLAGS = (
    "-O3",
    "-ffp-contract=fast",  # fused multiply-adds (C++ standard modes turn them off)
    "-fopenmp-simd", "-fno-math-errno",  # `#pragma omp simd` loops, no errno from sqrt
    "-fno-finite-loops",  # else GCC deletes the prefetch-only loops as side-effect free
    "-DTORCH_TARGET_VERSION=0x020a000000000000",  # the stable ABI of torch >= 2.10
)


def cflags() -> list[str]:
    """CFLAGS plus the target: this CPU's vector units (`-march=native`, hence the CPU in the
    cache key), or the `TANDEM_CPU_ARCH` one (e.g. x86-64-v3 for an image built elsewhere)."""
    return [*CFLAGS, f"-march={os.environ.get('TANDEM_CPU_ARCH') or 'native'}"]


def compiler() -> str | None:
    """The C++ compiler torch's tooling would use ($CXX, else c++), or None when absent."""
    return shutil.which(os.environ.get("CXX", "c++"))


def _put_ninja_on_path() -> bool:
    """torch's tooling runs `ninja` from PATH; the pip `ninja` package (a dependency) installs
    it beside the interpreter, which is not on PATH when a venv is used without activating it."""
    if shutil.which("ninja") is not None:
        return True
    try:
        import ninja
    except ImportError:
        return False
    os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
    return shutil.which("ninja") is not None


def cache_root() -> Path:
    """Where Tandem keeps what it builds or measures per machine (`TANDEM_CACHE_DIR` moves it)."""
    return Path(os.environ.get("TANDEM_CACHE_DIR") or Path.home() / ".cache" / "tandem")


def cache_dir() -> Path:
    """Where the library is built; a link is followed, so a folder reached by two paths is one build folder
    (torch writes the path into build.ninja, and a changed path rebuilds and reloads the library)."""
    return (cache_root() / "torch_extensions").resolve()


@functools.cache
def cpu_signature() -> str:
    """What -march=native (and any kernel timing) depends on: this CPU's model name and feature flags."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor() or platform.machine()
    wanted = [line for line in lines if line.startswith(("model name", "flags"))][:2]
    return "\n".join(wanted)


def build_name() -> str:
    """The library's name: a digest of the sources, flags, torch version and CPU it is built for."""
    digest = hashlib.sha256()
    for path in sorted(SOURCE_DIR.iterdir()):  # sources and headers
        digest.update(path.name.encode() + path.read_bytes())
    digest.update(" ".join(cflags()).encode())
    digest.update(torch.__version__.encode())
    digest.update(cpu_signature().encode())
    return f"tandem_cpu_kernels_{digest.hexdigest()[:16]}"


def build_location() -> str:
    """The absolute paths torch's tooling writes into build.ninja: the sources' folder, torch's
    headers and libraries, Python's headers. ninja rebuilds every object when they change, so two
    checkouts (each with its own venv) sharing a build folder rebuilt it whenever the other had
    used it last; each location gets its own folder instead."""
    return "\n".join((str(SOURCE_DIR), str(Path(torch.__file__).resolve().parent), sysconfig.get_paths()["include"]))


def build_dir() -> Path:
    """One folder per library and location: `<build_name()>_<digest of build_location()>`."""
    location = hashlib.sha256(build_location().encode()).hexdigest()[:8]
    return cache_dir() / f"{build_name()}_{location}"


@functools.cache
def load() -> bool:
    """Build (first time) and load the kernels; True when `torch.ops.tandem` is ready."""
    if compiler() is None:
        logger.info("no C++ compiler found ($CXX or c++): CPU kernels fall back to pure torch")
        return False
    if not _put_ninja_on_path():
        logger.warning("ninja not found (pip install ninja): CPU kernels fall back to pure torch")
        return False
    from torch.utils import cpp_extension

    name, folder = build_name(), build_dir()
    building = not (folder / f"{name}.so").exists()
    if building:  # the first load for these sources in this checkout: say why the start is slow
        logger.info("building the C++ CPU kernels into %s (once per checkout and source change; "
                    "takes tens of seconds)", folder)
    started = time.perf_counter()
    try:
        folder.mkdir(parents=True, exist_ok=True)
        cpp_extension.load(
            name=name, sources=[str(SOURCE_DIR / s) for s in SOURCES], extra_cflags=cflags(),
            build_directory=str(folder), is_python_module=False, verbose=False,
        )
    except Exception as error:  # a broken toolchain must never stop the engine
        logger.warning("building the C++ CPU kernels failed, falling back to pure torch: %s", error)
        return False
    built = f", built in {time.perf_counter() - started:.0f} s" if building else ""
    logger.info("C++ CPU kernels ready (%s%s)", folder, built)
    return True
