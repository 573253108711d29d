"""How many CPU threads the engine's intra-op work may use: the fewest of the CPUs this process may run on (its
affinity mask), its container's CPU quota (cgroup v2 `cpu.max`, v1 `cpu.cfs_quota_us / cpu.cfs_period_us`,
rounded up) and the physical cores among those CPUs; `--cpu-threads` overrides it, and so does OMP_NUM_THREADS
where set. The engine process applies it at start (engine/__main__.py); code that builds an engine in its own
process (benchmarks, tests) keeps the thread count it set.

torch's own default follows the affinity mask but not a quota: on a host of 64 cores with a quota of 4, every
parallel region of 64 threads ends at a barrier waiting for threads the quota has throttled. The quota is read from
the cgroup of this process (/proc/self/cgroup, located through /proc/self/mountinfo) and every ancestor up to the
mount's root, since a parent's quota caps its children too. Paths are joined under `root` so tests can point it at a
fake tree. Torch-free.
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("engine")
V1_MOUNT_FALLBACKS = ("sys/fs/cgroup/cpu", "sys/fs/cgroup/cpu,cpuacct")  # when mountinfo is unreadable
V2_MOUNT_FALLBACK = "sys/fs/cgroup"


@dataclass(frozen=True)
class Quota:
    cpus: float  # quota / period
    path: str  # the cgroup file that set it

    @property
    def threads(self) -> int:
        return max(1, math.ceil(self.cpus - 1e-9))  # 1.5 CPUs of quota still runs two threads half the time


@dataclass(frozen=True)
class ThreadChoice:
    threads: int
    source: str  # what decided it, for the start-up log
    detail: str  # every bound that was read, for the start-up log

    def describe(self) -> str:
        return f"CPU threads: {self.threads} (from {self.source}; {self.detail})"


def affinity_cpus() -> list[int]:
    """The CPUs this process may run on (taskset, cpuset): every one the OS has where affinity is unknown."""
    try:
        return sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return list(range(os.cpu_count() or 1))


def physical_cores(cpus: list[int], root: Path = Path("/")) -> int:
    """The distinct physical cores (package, core id) among `cpus`; len(cpus) where topology is unreadable."""
    cores: set[tuple[str, str]] = set()
    for cpu in cpus:
        topo = root / f"sys/devices/system/cpu/cpu{cpu}/topology"
        try:
            cores.add(((topo / "physical_package_id").read_text().strip(), (topo / "core_id").read_text().strip()))
        except OSError:
            return len(cpus)
    return len(cores) or len(cpus)


def _mounts(root: Path) -> list[tuple[str, str, str, set[str]]]:
    """(mount root, mount point, fs type, super options) of each cgroup mount in /proc/self/mountinfo."""
    try:
        lines = (root / "proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        head, sep, tail = line.partition(" - ")
        fields, rest = head.split(), tail.split()
        if sep and len(fields) >= 5 and len(rest) >= 3 and rest[0] in ("cgroup", "cgroup2"):
            out.append((fields[3], fields[4], rest[0], set(rest[2].split(","))))
    return out


def _cgroup_dirs(root: Path, mount_point: str, mount_root: str, path: str) -> list[Path]:
    """The directory of cgroup `path` under a mount of `mount_root` at `mount_point`, then each parent up to the
    mount point (a cgroup's quota is capped by its parents')."""
    rel = path
    if mount_root != "/" and (path == mount_root or path.startswith(mount_root.rstrip("/") + "/")):
        rel = path[len(mount_root.rstrip("/")) :]
    base = root / mount_point.lstrip("/")
    parts = [p for p in rel.split("/") if p and p != ".."]
    return [base.joinpath(*parts[:n]) for n in range(len(parts), -1, -1)]


def _v2_quota(directory: Path) -> Quota | None:
    try:
        quota, period = (directory / "cpu.max").read_text().split()[:2]
        if quota == "max" or int(period) <= 0:
            return None
        return Quota(int(quota) / int(period), str(directory / "cpu.max"))
    except (OSError, ValueError):
        return None


def _v1_quota(directory: Path) -> Quota | None:
    try:
        quota = int((directory / "cpu.cfs_quota_us").read_text())
        period = int((directory / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return Quota(quota / period, str(directory / "cpu.cfs_quota_us")) if quota > 0 and period > 0 else None


def cgroup_quota(root: Path = Path("/")) -> Quota | None:
    """The tightest CPU quota on this process's cgroups (v2 and v1 both read: a hybrid host has both), or None."""
    try:
        lines = (root / "proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    mounts = _mounts(root)
    found: list[Quota] = []
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        if controllers == "":  # cgroup v2's unified hierarchy
            points = [(r, p) for r, p, fs, _ in mounts if fs == "cgroup2"] or [("/", V2_MOUNT_FALLBACK)]
            read = _v2_quota
        elif "cpu" in controllers.split(","):
            points = [(r, p) for r, p, fs, opts in mounts if fs == "cgroup" and "cpu" in opts]
            points = points or [("/", p) for p in V1_MOUNT_FALLBACKS]
            read = _v1_quota
        else:
            continue
        for mount_root, point in points:
            found += [q for d in _cgroup_dirs(root, point, mount_root, path) if (q := read(d)) is not None]
    return min(found, key=lambda q: q.cpus) if found else None


def choose_threads(
    requested: int | None = None, cpus: list[int] | None = None, root: Path = Path("/"), omp: str | None = None
) -> ThreadChoice:
    """`requested` (--cpu-threads) when given, else `omp` (OMP_NUM_THREADS's text) when a positive count, else the
    fewest of affinity (`cpus`: this process's mask when None), quota and physical cores."""
    cpus = affinity_cpus() if cpus is None else cpus
    quota = cgroup_quota(root)
    cores = physical_cores(cpus, root)
    bounds = [f"{len(cpus)} CPUs in the affinity mask", f"{cores} physical cores"]
    bounds.append(f"CPU quota {quota.cpus:g} at {quota.path}" if quota is not None else "no CPU quota")
    detail = ", ".join(bounds)
    if requested is not None:
        return ThreadChoice(requested, "--cpu-threads", detail)
    if omp is not None and omp.strip().isdigit() and int(omp) > 0:
        return ThreadChoice(int(omp), "OMP_NUM_THREADS", detail)
    options = [(len(cpus), "the affinity mask"), (cores, "the physical cores")]
    if quota is not None:
        options.append((quota.threads, "the cgroup CPU quota"))
    threads, source = min(options, key=lambda o: o[0])  # ties: the first (affinity, then cores)
    return ThreadChoice(max(1, threads), source, detail)


def fit_cpu_threads(requested: int | None) -> ThreadChoice:
    """Set torch's intra-op threads (the C++ kernels' teams follow them: engine/layers/parallel.py) to
    choose_threads' count, and log it with its source."""
    import torch  # why late: the rest of this module is read without torch (tests, tools)

    choice = choose_threads(requested, omp=os.environ.get("OMP_NUM_THREADS"))
    torch.set_num_threads(choice.threads)
    log.info("%s", choice.describe())
    return choice
