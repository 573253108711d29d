"""Compile this package's C++ kernels once per machine into one library and load it; `kernel(name, ...)` is
one of its functions.

The library is cached under the spindle cache by a digest of its sources, flags and compiler, and written
beside its final name then renamed, so engines starting at once never load a half-written file. torch is
imported first: the kernels use OpenMP, and the loader then binds them to torch's own libgomp (one
thread pool, not two).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch  # noqa: F401  # why: loaded before any kernel, so the kernel's libgomp is torch's

from engine.cache_root import cache_root
from engine.config import EngineEnv

log = logging.getLogger(__name__)

SOURCES = Path(__file__).parent
COMPILE_TIMEOUT_S = 900  # a first start on a busy machine: the objects build in parallel, once per change
# every kernel here is AVX-512 with bf16 dot products (x86-64-v4 plus AVX512-BF16)
FLAGS = ("-O3", "-std=c++17", "-march=x86-64-v4", "-mavx512bf16", "-fopenmp")
NEEDS = frozenset({"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl", "avx512_bf16"})


def enabled() -> bool:
    """SPINDLE_CPU_KERNELS=0 keeps torch's path everywhere (for comparisons)."""
    return EngineEnv.read().cpu_kernels


@functools.cache
def cpu_flags() -> frozenset[str]:
    """This CPU's feature flags as Linux lists them (empty where /proc/cpuinfo is not)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def compiler() -> str | None:
    """$CXX, else g++ or c++ on PATH."""
    found = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    return found if found and shutil.which(found) else None


def sources() -> list[Path]:
    """Every kernel of the package: its .cpp files, built together into one library (they call each other)."""
    return sorted(SOURCES.glob("*.cpp"))


@functools.cache
def load(flags: tuple[str, ...], needs: frozenset[str]) -> ctypes.CDLL | None:
    """The library of every kernel here, built with `flags`, or None (with one warning saying why) when this
    machine lacks a CPU flag in `needs`, a compiler, or the build fails."""
    if not enabled():
        return None
    if platform.machine() not in ("x86_64", "AMD64") or not needs <= cpu_flags():
        missing = sorted(needs - cpu_flags()) or [platform.machine()]
        log.info("CPU kernels off: this CPU lacks %s", ", ".join(missing))
        return None
    cxx = compiler()
    if cxx is None:
        log.warning("CPU kernels off: no C++ compiler (install g++ or set CXX); torch's path is slower")
        return None
    files = sources()
    target = cache_root() / "cpu_kernels" / f"spindle-{_digest(cxx, flags)}.so"
    if not target.exists():
        log.info("building the CPU kernels into %s (once per change of their sources)", target.name)
        try:
            _compile(cxx, files, flags, target)
        except (OSError, subprocess.SubprocessError) as e:
            log.warning("CPU kernels off: their build failed (%s); torch's path is slower", e)
            return None
    try:
        return ctypes.CDLL(str(target))
    except OSError as e:
        log.warning("CPU kernels off: %s", e)
        return None


@functools.cache
def _digest(cxx: str, flags: tuple[str, ...]) -> str:
    """The library's name: a digest of its sources, headers, flags and compiler version."""
    version = subprocess.run([cxx, "--version"], check=False, capture_output=True, timeout=30).stdout
    parts = [p.read_bytes() for p in sources() + sorted(SOURCES.glob("*.h"))] + [" ".join(flags).encode(), version]
    return hashlib.sha256(b"\0".join(parts)).hexdigest()[:16]


def library_digest() -> str | None:
    """The digest of the library the kernels run from, or None where they are off (engine/cpu_kernels/chooser.py
    keys its cached choices on it: a rebuilt kernel is timed again)."""
    cxx = compiler()
    return _digest(cxx, FLAGS) if load(FLAGS, NEEDS) is not None and cxx is not None else None


def kernel(
    name: str,
    abi: int,
    argtypes: list[Any],
    symbol: str | None = None,
    check: Callable[[Any], str | None] | None = None,
    restype: Any = None,
) -> Any:
    """The C function `symbol` (default spindle_<name>) of <name>.cpp, built with FLAGS where the CPU has NEEDS
    and typed with `argtypes` and `restype`, or None (with a warning saying why) when it cannot run here,
    <name>.cpp answers another ABI than `abi`, or `check(fn)` (a self-check against torch: a broken build must not
    reach a model) names a fault."""
    lib = load(FLAGS, NEEDS)
    if lib is None:
        return None
    got = getattr(lib, f"spindle_{name}_abi")()
    if got != abi:
        log.warning("CPU kernel %s off: its library answers ABI %s, not %s", name, got, abi)
        return None
    fn = getattr(lib, symbol or f"spindle_{name}")
    fn.argtypes, fn.restype = argtypes, restype
    if check is not None and (why := check(fn)) is not None:
        log.warning("CPU kernel %s off: %s", name, why)
        return None
    return fn


def _compile(cxx: str, files: list[Path], flags: tuple[str, ...], target: Path) -> None:
    """Each source to an object, as many at once as this process has CPUs, then one link; a temporary name renamed
    into place, so a reader never loads half a library."""
    target.parent.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + COMPILE_TIMEOUT_S
    with tempfile.TemporaryDirectory(prefix=f".{target.stem}.", dir=target.parent) as work:
        objects = [Path(work) / f"{f.stem}.o" for f in files]
        jobs = [[cxx, *flags, "-fPIC", "-c", "-o", str(o), str(f)] for f, o in zip(files, objects)]
        _run_all(jobs, max(1, len(os.sched_getaffinity(0))), deadline)
        tmp = Path(work) / target.name
        _run_all([[cxx, *flags, "-shared", "-fPIC", "-o", str(tmp), *map(str, objects)]], 1, deadline)
        os.replace(tmp, target)


def _run_all(commands: list[list[str]], at_once: int, deadline: float) -> None:
    """Run the commands, `at_once` at a time; the first failure (or the deadline) stops the rest and raises."""
    waiting, running = list(commands), list[subprocess.Popen[str]]()
    try:
        while waiting or running:
            while waiting and len(running) < at_once:
                cmd = waiting.pop(0)
                running.append(subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True))
            _, err = running[0].communicate(timeout=max(0.0, deadline - time.monotonic()))
            code = running.pop(0).returncode
            if code != 0:
                lines = err.strip().splitlines()
                raise subprocess.SubprocessError(next((x for x in lines if "error" in x), lines[-1] if lines else code))
    except subprocess.TimeoutExpired as e:
        raise subprocess.SubprocessError(f"the build took over {COMPILE_TIMEOUT_S} s") from e
    finally:
        for proc in running:
            proc.kill()
            proc.wait()
