"""The engine's CPU thread count: quota arithmetic on fake cgroup trees (tests/e2e/test_cpu_quota.py: a real one)."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.config import EngineConfig
from engine.cpu_threads import cgroup_quota, choose_threads, physical_cores

V2_MOUNTINFO = "30 23 0:26 / /sys/fs/cgroup rw,nosuid - cgroup2 cgroup2 rw,nsdelegate\n"
V1_MOUNTINFO = (
    "31 23 0:28 / /sys/fs/cgroup rw - tmpfs tmpfs rw,mode=755\n"
    "32 31 0:29 {root} /sys/fs/cgroup/cpu,cpuacct rw,relatime - cgroup cgroup rw,cpu,cpuacct\n"
    "33 31 0:30 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory\n"
)


def _write(root: Path, rel: str, text: str) -> None:
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def _v2_tree(root: Path, cgroup: str, cpu_max: dict[str, str]) -> None:
    """A v2 host: the process in `cgroup`, each listed directory (relative to the mount) with its cpu.max."""
    _write(root, "proc/self/cgroup", f"0::{cgroup}\n")
    _write(root, "proc/self/mountinfo", V2_MOUNTINFO)
    for directory, text in cpu_max.items():
        _write(root, f"sys/fs/cgroup/{directory}/cpu.max".replace("//", "/"), text)


def _topology(root: Path, cores: dict[int, tuple[int, int]]) -> None:
    for cpu, (package, core) in cores.items():
        _write(root, f"sys/devices/system/cpu/cpu{cpu}/topology/physical_package_id", f"{package}\n")
        _write(root, f"sys/devices/system/cpu/cpu{cpu}/topology/core_id", f"{core}\n")


def test_a_v2_quota_of_3_5_cpus_gives_4_threads_of_64(tmp_path: Path) -> None:
    _v2_tree(tmp_path, "/app.slice/box.scope", {"app.slice/box.scope": "350000 100000\n", "app.slice": "max 100000\n"})
    choice = choose_threads(cpus=list(range(64)), root=tmp_path)
    assert (choice.threads, choice.source) == (4, "the cgroup CPU quota")
    assert "CPU quota 3.5" in choice.describe() and "64 CPUs in the affinity mask" in choice.describe()


def test_a_parent_quota_caps_a_child_without_one(tmp_path: Path) -> None:
    _v2_tree(tmp_path, "/kubepods/pod1/ctr", {"kubepods/pod1/ctr": "max 100000\n", "kubepods/pod1": "200000 100000\n"})
    quota = cgroup_quota(tmp_path)
    assert quota is not None and quota.cpus == 2.0 and quota.path.endswith("kubepods/pod1/cpu.max")


def test_the_quota_of_a_namespaced_container_is_at_the_mount_root(tmp_path: Path) -> None:
    _v2_tree(tmp_path, "/", {"": "150000 100000\n"})
    assert choose_threads(cpus=list(range(8)), root=tmp_path).threads == 2  # 1.5 CPUs rounded up


def test_no_quota_leaves_the_affinity_mask(tmp_path: Path) -> None:
    _v2_tree(tmp_path, "/user.slice", {"user.slice": "max 100000\n", "": "max 100000\n"})
    choice = choose_threads(cpus=[2, 3, 4], root=tmp_path)
    assert (choice.threads, choice.source) == (3, "the affinity mask")
    assert "no CPU quota" in choice.detail


def test_a_v1_quota_under_a_container_mount_root(tmp_path: Path) -> None:
    """Without a cgroup namespace the cpu mount's root is the container's own path, and /proc/self/cgroup names it."""
    _write(tmp_path, "proc/self/cgroup", "4:memory:/docker/abc\n3:cpu,cpuacct:/docker/abc\n0::/\n")
    _write(tmp_path, "proc/self/mountinfo", V1_MOUNTINFO.format(root="/docker/abc"))
    _write(tmp_path, "sys/fs/cgroup/cpu,cpuacct/cpu.cfs_quota_us", "50000\n")
    _write(tmp_path, "sys/fs/cgroup/cpu,cpuacct/cpu.cfs_period_us", "100000\n")
    quota = cgroup_quota(tmp_path)
    assert quota is not None and quota.cpus == 0.5 and quota.threads == 1


def test_a_v1_quota_of_minus_one_is_none_and_the_parent_counts(tmp_path: Path) -> None:
    _write(tmp_path, "proc/self/cgroup", "3:cpu,cpuacct:/batch/job7\n")
    _write(tmp_path, "proc/self/mountinfo", V1_MOUNTINFO.format(root="/"))
    for directory, quota in (("batch/job7", "-1"), ("batch", "600000"), ("", "-1")):
        _write(tmp_path, f"sys/fs/cgroup/cpu,cpuacct/{directory}/cpu.cfs_quota_us".replace("//", "/"), quota)
        _write(tmp_path, f"sys/fs/cgroup/cpu,cpuacct/{directory}/cpu.cfs_period_us".replace("//", "/"), "200000")
    choice = choose_threads(cpus=list(range(16)), root=tmp_path)
    assert (choice.threads, choice.source) == (3, "the cgroup CPU quota")


def test_a_hybrid_host_takes_the_tighter_of_v1_and_v2(tmp_path: Path) -> None:
    _write(tmp_path, "proc/self/cgroup", "1:cpu:/slow\n0::/fast\n")
    _write(tmp_path, "proc/self/mountinfo", V2_MOUNTINFO + V1_MOUNTINFO.format(root="/"))
    _write(tmp_path, "sys/fs/cgroup/fast/cpu.max", "800000 100000\n")
    _write(tmp_path, "sys/fs/cgroup/cpu,cpuacct/slow/cpu.cfs_quota_us", "200000\n")
    _write(tmp_path, "sys/fs/cgroup/cpu,cpuacct/slow/cpu.cfs_period_us", "100000\n")
    quota = cgroup_quota(tmp_path)
    assert quota is not None and quota.cpus == 2.0


def test_unreadable_or_damaged_files_mean_no_quota(tmp_path: Path) -> None:
    assert cgroup_quota(tmp_path) is None  # no /proc at all
    _v2_tree(tmp_path, "/x", {"x": "lots 100000\n"})
    assert cgroup_quota(tmp_path) is None


def test_hyperthreads_count_once(tmp_path: Path) -> None:
    _topology(tmp_path, {0: (0, 0), 1: (0, 1), 2: (0, 0), 3: (0, 1), 4: (1, 0)})
    assert physical_cores([0, 1, 2, 3, 4], tmp_path) == 3
    _v2_tree(tmp_path, "/", {})
    choice = choose_threads(cpus=[0, 1, 2, 3], root=tmp_path)
    assert (choice.threads, choice.source) == (2, "the physical cores")


def test_the_flag_wins_and_must_be_positive(tmp_path: Path) -> None:
    _v2_tree(tmp_path, "/", {"": "100000 100000\n"})
    choice = choose_threads(6, cpus=list(range(64)), root=tmp_path)
    assert (choice.threads, choice.source) == (6, "--cpu-threads")
    with pytest.raises(ValueError, match="--cpu-threads must be at least 1"):
        EngineConfig(model="m", cpu_threads=0)


def test_omp_num_threads_counts_as_the_users_choice(tmp_path: Path) -> None:
    _v2_tree(tmp_path, "/", {"": "100000 100000\n"})
    choice = choose_threads(cpus=list(range(8)), root=tmp_path, omp="3")
    assert (choice.threads, choice.source) == (3, "OMP_NUM_THREADS")
    assert choose_threads(5, cpus=list(range(8)), root=tmp_path, omp="3").threads == 5  # the flag first
    for unusable in ("", "0", "4,2", "many"):  # not one positive count: the fitted one
        assert choose_threads(cpus=list(range(8)), root=tmp_path, omp=unusable).threads == 1
