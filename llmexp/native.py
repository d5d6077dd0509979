"""Build a C file that ships with llmexp into a shared library once, and load it with ctypes.

Used for the CPU kernel of 8-bit AdamW (`adam8bit.c`). A plain C file and ctypes, not a torch
C++ extension: it compiles in under a second (no torch headers) and needs only a C compiler.
The library is cached under $LLMEXP_CACHE/kernels (default ~/.cache/llmexp/kernels), keyed by
the source, the flags, the compiler and this CPU's feature flags: `-march=native` code built on
one node of a cluster must not be loaded on a node with an older CPU that shares the home dir.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fno-math-errno", "-fPIC", "-shared", "-pthread")
"""-ffp-contract=off: no fused multiply-adds, so the kernel rounds as the torch reference does;
-fno-math-errno: sqrtf without an errno check, so loops with it vectorise (the results are the same)."""


def c_compiler() -> str | None:
    """$CC, else cc, gcc or clang, whichever is on PATH."""
    for name in (os.environ.get("CC", ""), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor() or platform.machine()


def uses_gnu_openmp() -> bool:
    """True when this process has loaded the GNU OpenMP runtime (torch's libgomp).

    A library built with -fopenmp needs `libgomp.so.1`; the dynamic linker hands it the copy
    already loaded, so its parallel loops run on torch's own thread pool. With another runtime
    (Intel's libiomp5, LLVM's libomp) or none, the kernel uses threads of its own instead.
    """
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return False
    return any("/libgomp" in line for line in maps.splitlines())


def cache_dir() -> Path:
    return Path(os.environ.get("LLMEXP_CACHE", Path.home() / ".cache" / "llmexp")) / "kernels"


def load(source_name: str) -> ctypes.CDLL:
    """The compiled library of `llmexp/<source_name>`; builds it on first use. Raises OSError without a compiler."""
    source = Path(__file__).with_name(source_name)
    compiler = c_compiler()
    if compiler is None:
        raise OSError("no C compiler (set CC, or install gcc)")
    flags = [*FLAGS, "-fopenmp"] if uses_gnu_openmp() else list(FLAGS)
    key = hashlib.sha256("\0".join([source.read_text(), *flags, compiler, _cpu_flags()]).encode()).hexdigest()[:16]
    target = cache_dir() / f"{source.stem}-{key}.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:  # other ranks may build at the same time
            built = Path(tmp) / target.name
            done = subprocess.run([compiler, *flags, str(source), "-o", str(built), "-lm"],
                                  capture_output=True, text=True, check=False)
            if done.returncode != 0:
                raise OSError(f"{compiler} failed on {source.name}:\n{done.stderr[-2000:]}")
            os.replace(built, target)  # atomic: a reader sees no library or the whole one
    return ctypes.CDLL(str(target))
