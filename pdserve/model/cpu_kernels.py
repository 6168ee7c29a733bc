"""pdserve's CPU kernels (`csrc/`), compiled on first use with the machine's C++ compiler and
cached under the user cache directory (one build per source version, torch version and CPU
flags), so that later processes only load the library.

Compilation takes about a minute once per machine; several processes starting together wait for
one build (torch's build lock). When there is no compiler, or the build fails, `paged_ops`
returns None (logged once) and attention falls back to the reference backend.
"""

import functools
import hashlib
import logging
import os
from pathlib import Path
from types import ModuleType

import torch
from platformdirs import user_cache_dir

logger = logging.getLogger(__name__)

SOURCES = (Path(__file__).parent / "csrc" / "paged_attention.cpp",)
FLAGS = ["-O3", "-march=native", "-fopenmp", "-std=c++17", "-ffp-contract=off"]  # FMAs: explicit


def _cpu_flags() -> str:
    """This CPU's instruction-set flags (-march=native builds for exactly these: a cache shared
    by unlike hosts, a home directory on NFS, must not hand one host another's build)."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            return next((line for line in cpuinfo if line.startswith("flags")), "")
    except OSError:
        return ""


def _build_directory() -> Path:
    digest = hashlib.sha256()
    for source in SOURCES:
        digest.update(source.read_bytes())
    digest.update(" ".join([torch.__version__, *FLAGS, os.uname().machine]).encode())
    digest.update(_cpu_flags().encode())
    root = Path(os.environ.get("PDSERVE_KERNEL_CACHE", user_cache_dir("pdserve")))
    path = root / "kernels" / digest.hexdigest()[:16]
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    return path


@functools.cache
def paged_ops() -> ModuleType | None:
    """The compiled module (`paged_decode`), or None when it cannot be built here."""
    from torch.utils.cpp_extension import load

    try:
        module: ModuleType = load(
            name="pdserve_paged_attention",
            sources=[str(s) for s in SOURCES],
            extra_cflags=FLAGS,
            extra_ldflags=["-fopenmp"],
            build_directory=str(_build_directory()),
            verbose=False,
        )
    except (OSError, RuntimeError, ImportError) as e:
        logger.warning(
            "pdserve's CPU attention kernel cannot be built (%s): using the reference", e
        )
        return None
    return module
