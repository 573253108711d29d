"""Transparent huge pages for a process's heap, through glibc's malloc tunable `glibc.malloc.hugetlb=1`.

A CPU decode step streams every weight once; on 4 KiB pages that is a TLB miss every 4 KiB (about 250,000
per step on Qwen2.5-0.5B's 1 GB). With the kernel's THP mode "madvise" (the common default) memory gets
2 MiB pages only where asked for, and torch / oneDNN never ask; glibc does for every block it maps when
the tunable is set. Measured (bench/README.md, "Huge pages"): oneDNN's bf16 GEMV 30 -> 37 GB/s, its
16-row GEMM +13%, the read-bandwidth reduction 35 -> 41 GB/s. Results are bitwise the same.

glibc reads tunables only when a process starts, so an engine process re-executes itself once, before
it loads torch, with the tunable added to GLIBC_TUNABLES. A GLIBC_TUNABLES that already names
`glibc.malloc.hugetlb` is left as it is: `GLIBC_TUNABLES=glibc.malloc.hugetlb=0` turns this off.
"""

from __future__ import annotations

import os
import platform
import sys
from collections.abc import Mapping

TUNABLE = "glibc.malloc.hugetlb"
MIN_GLIBC = (2, 35)  # the first glibc with the tunable


def _glibc_has_tunable() -> bool:
    name, version = platform.libc_ver()
    if sys.platform != "linux" or name != "glibc":
        return False
    try:
        return tuple(int(p) for p in version.split(".")[:2]) >= MIN_GLIBC
    except ValueError:
        return False


def huge_pages_env(env: Mapping[str, str]) -> dict[str, str] | None:
    """`env` with the tunable added to GLIBC_TUNABLES, or None when there is nothing to add (already named
    there, or not a glibc that knows it)."""
    tunables = env.get("GLIBC_TUNABLES", "")
    if any(t.split("=", 1)[0] == TUNABLE for t in tunables.split(":")) or not _glibc_has_tunable():
        return None
    return {**env, "GLIBC_TUNABLES": f"{tunables}:{TUNABLE}=1" if tunables else f"{TUNABLE}=1"}


def reexec_with_huge_pages() -> None:
    """Replace this process by the same command line with the tunable set (same pid, same open descriptors);
    returns when it is set already or does not apply. Call it first thing, before heavy imports."""
    env = huge_pages_env(os.environ)
    if env is None:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)
