"""Building intqat's C / C++ kernels on first use: the compiler call, the flags, the cache (intqat.ops.cpu_kernels
builds the fused C library with it, intqat.ops.cpp_step the C++ training ops).

    build_library(srcs, compiler=, flag_sets=, prefix=, link=)   the .so in the cache dir (built once per key)
    kernel_sources(names)       the paths of kernels/cpu/<name> (installed as intqat.kernels)
    c_flag_sets()               the C library's flags: tuned for this CPU (-march, see kernel_march), then portable
    kernel_march()              the -march the C kernels are compiled for ($INTQAT_KERNEL_MARCH)
    cache_dir()                 $INTQAT_CACHE_DIR, default ~/.cache/intqat
    OffSwitch                   a nestable off switch (`disabled()` blocks of the kernel modules)

A library is keyed by a hash of its sources (and the headers beside them), the flags, the compiler, the link
arguments, the CPU (-march=native code runs only where it was built) and the torch version, and written
atomically (tmp + os.replace: several processes may build at once; a reader sees no library or a whole one).
Imports nothing of intqat but cpu_features.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from intqat.ops.cpu_features import cpu_info, emulating_no_int8_dot

__all__ = ["OffSwitch", "build_library", "kernel_sources", "c_flag_sets", "kernel_march", "cache_dir", "cpu_id"]


def kernel_sources(names) -> list[Path]:
    """kernels/cpu/<name> for each name. kernels/ installs as intqat.kernels; find_spec locates it without importing
    it (and triton)."""
    spec = importlib.util.find_spec("intqat.kernels")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("package intqat.kernels not found")
    root = Path(next(iter(spec.submodule_search_locations))) / "cpu"
    return [root / name for name in names]


def cpu_id() -> str:
    # -march=native code is only valid on the CPU it was built for: key the cache on it.
    model, flags = cpu_info()
    return model + " " + " ".join(sorted(flags))


def kernel_march() -> str:
    """The -march the kernels are compiled for: $INTQAT_KERNEL_MARCH, else "native" (this CPU); under
    INTQAT_EMULATE_NO_INT8_DOT=1 on x86 "x86-64-v3" (AVX2 + FMA, no AVX-512, no VNNI), so the emulation
    also runs the elementwise passes as an AVX2-only CPU's build compiles them."""
    march = os.environ.get("INTQAT_KERNEL_MARCH", "").strip()
    if march:
        return march
    x86 = platform.machine() in ("x86_64", "AMD64")
    return "x86-64-v3" if (x86 and emulating_no_int8_dot()) else "native"


def c_flag_sets() -> list[list[str]]:
    """The fused C library's flag sets, in the order tried: tuned for this CPU, then portable."""
    base = ["-O3", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC"]
    march = kernel_march()
    tuned = [f"-march={march}"] + (
        ["-mprefer-vector-width=512"] if march == "native" and platform.machine() in ("x86_64", "AMD64") else [])
    return [base + tuned, base]  # the portable set if the tuned one does not compile


def cache_dir() -> Path:
    root = os.environ.get("INTQAT_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "intqat")
    return Path(root)


def build_library(srcs: list[Path], *, compiler: str, flag_sets: list[list[str]], prefix: str,
                  link: list[str] = (), announce: str | None = None) -> Path:
    """Compile `srcs` into a shared library in the cache dir and return its path: the first flag set
    that compiles. Keyed by a hash of the sources (and the headers beside them), flags, compiler, link
    arguments, CPU and torch version, so each combination is built once; written atomically (several
    processes may build at once: a reader sees no library or a whole one). `announce`: printed to stderr
    when a build actually starts (a first step that pauses for seconds says why)."""
    headers = sorted(srcs[0].parent.glob("*.h"))  # included by the sources: part of the cache key
    code = b"\0".join(path.read_bytes() for path in [*srcs, *headers])
    errors = []
    for flags in flag_sets:
        key = hashlib.sha256(b"\0".join([code, " ".join([*flags, *link]).encode(), compiler.encode(),
                                         cpu_id().encode(), torch.__version__.encode()])).hexdigest()[:16]
        out = cache_dir() / f"{prefix}-{key}.so"
        if out.exists():
            return out
        out.parent.mkdir(parents=True, exist_ok=True)
        if announce:
            print(announce, file=sys.stderr, flush=True)
            announce = None  # once, whichever flag set compiles
        fd, tmp = tempfile.mkstemp(prefix=f".{prefix}-", suffix=".so", dir=out.parent)
        os.close(fd)
        try:
            proc = subprocess.run([compiler, *flags, "-o", tmp, *map(str, srcs), *link], capture_output=True,
                                  text=True)
            if proc.returncode == 0:
                os.replace(tmp, out)  # atomic
                return out
            errors.append(f"{compiler} {' '.join(flags)}: {proc.stderr.strip()[-500:]}")
        except OSError as e:  # no such compiler
            errors.append(f"{compiler}: {e}")
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    raise RuntimeError("\n".join(errors))


class OffSwitch:
    """A nestable off switch: inside `with switch.off():` blocks (any depth) `switch.depth` > 0."""

    __slots__ = ("depth",)

    def __init__(self):
        self.depth = 0

    @contextlib.contextmanager
    def off(self):
        self.depth += 1
        try:
            yield
        finally:
            self.depth -= 1
