"""engine/hugepages.py: the glibc tunable added once, an explicit setting kept, and a real re-exec whose big
allocations land on huge pages (where the kernel and glibc allow it)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from engine.hugepages import TUNABLE, _glibc_has_tunable, huge_pages_env

needs_glibc = pytest.mark.skipif(not _glibc_has_tunable(), reason="needs glibc >= 2.35 on Linux")


@needs_glibc
def test_adds_the_tunable() -> None:
    assert huge_pages_env({"A": "1"}) == {"A": "1", "GLIBC_TUNABLES": f"{TUNABLE}=1"}


@needs_glibc
def test_keeps_other_tunables() -> None:
    env = huge_pages_env({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"})
    assert env is not None and env["GLIBC_TUNABLES"] == f"glibc.malloc.arena_max=2:{TUNABLE}=1"


@pytest.mark.parametrize("tunables", [f"{TUNABLE}=0", f"glibc.malloc.arena_max=2:{TUNABLE}=0", f"{TUNABLE}=1"])
def test_an_explicit_setting_is_kept(tunables: str) -> None:
    assert huge_pages_env({"GLIBC_TUNABLES": tunables}) is None


def test_a_similar_name_is_not_the_tunable() -> None:
    env = huge_pages_env({"GLIBC_TUNABLES": f"{TUNABLE}x=0"})
    assert env is None if not _glibc_has_tunable() else env is not None


_CHILD = """
import json, os, sys
from engine.hugepages import reexec_with_huge_pages
print("start", os.getpid(), flush=True)
reexec_with_huge_pages()
import torch
t = torch.ones(64 << 18)  # 64 MiB
huge = [int(line.split()[1]) for line in open("/proc/self/smaps_rollup") if line.startswith("AnonHugePages:")]
print(json.dumps({"pid": os.getpid(), "argv": sys.argv[1:], "tunables": os.environ.get("GLIBC_TUNABLES"),
                  "huge_kb": huge[0] if huge else 0}))
"""


def _thp_mode() -> str:
    path = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    text = path.read_text() if path.exists() else ""
    return text.split("[", 1)[1].split("]", 1)[0] if "[" in text else "never"


@needs_glibc
def test_reexec_keeps_pid_and_arguments_and_maps_huge_pages() -> None:
    env = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
    out = subprocess.run(
        [sys.executable, "-c", _CHILD, "x", "--flag"], env=env, capture_output=True, text=True, check=True, timeout=120
    ).stdout.splitlines()
    report = json.loads(out[-1])
    assert out[:2] == [f"start {report['pid']}"] * 2  # the script ran twice, in one process: before and after
    assert report["argv"] == ["x", "--flag"] and report["tunables"] == f"{TUNABLE}=1"
    if _thp_mode() != "never":
        assert report["huge_kb"] >= 2048


@needs_glibc
def test_opting_out_maps_no_huge_pages() -> None:
    env = {**os.environ, "GLIBC_TUNABLES": f"{TUNABLE}=0"}
    out = subprocess.run(
        [sys.executable, "-c", _CHILD], env=env, capture_output=True, text=True, check=True, timeout=120
    ).stdout.splitlines()
    report = json.loads(out[-1])
    assert out[:2] == [f"start {report['pid']}", out[-1]]  # no re-exec
    if _thp_mode() == "madvise":  # "always" gives huge pages without asking
        assert report["huge_kb"] == 0


def test_only_a_checkpoint_big_enough_is_worth_the_reexec(tmp_path: Path) -> None:
    from engine.hugepages import MIN_WEIGHT_BYTES, checkpoint_bytes, engine_model

    (tmp_path / "model.safetensors").write_bytes(b"\0" * 1000)
    (tmp_path / "config.json").write_text("{}")
    assert checkpoint_bytes(str(tmp_path)) == 1000 < MIN_WEIGHT_BYTES  # the config does not count
    with open(tmp_path / "model-2.safetensors", "wb") as f:  # sparse: no disk written
        f.truncate(MIN_WEIGHT_BYTES)
    assert checkpoint_bytes(str(tmp_path)) == MIN_WEIGHT_BYTES + 1000
    assert checkpoint_bytes(None) == 0 and checkpoint_bytes(str(tmp_path / "missing")) == 0
    config = json.dumps({"model": str(tmp_path), "dtype": "auto"})
    assert engine_model(["--config", config, "--channels", "3,4"]) == str(tmp_path)
    assert engine_model(["--channels", "3"]) is None and engine_model(["--config", "not json"]) is None


@pytest.mark.parametrize("marker", ["tensor_bytes", "none", "not a count", "damaged"])
def test_a_folder_derived_from_a_gguf_file_counts_the_files_tensor_bytes(tmp_path: Path, marker: str) -> None:
    """A GGUF model's folder holds no weight files: its size is the tensor bytes gguf.json records."""
    from engine.gguf.folder import MARKER
    from engine.hugepages import GGUF_MARKER, MIN_WEIGHT_BYTES, checkpoint_bytes

    assert GGUF_MARKER == MARKER
    body = {
        "tensor_bytes": json.dumps({"files": ["/x.gguf"], "tensor_bytes": MIN_WEIGHT_BYTES}),
        "none": json.dumps({"files": ["/x.gguf"]}),
        "not a count": json.dumps({"tensor_bytes": "many"}),
        "damaged": "{",
    }[marker]
    (tmp_path / MARKER).write_text(body)
    assert checkpoint_bytes(str(tmp_path)) == (MIN_WEIGHT_BYTES if marker == "tensor_bytes" else 0)


@needs_glibc
@pytest.mark.parametrize("big", [False, True])
def test_the_engine_entry_reexecs_only_for_a_big_checkpoint(tmp_path: Path, big: bool) -> None:
    from engine.hugepages import MIN_WEIGHT_BYTES

    with open(tmp_path / "model.safetensors", "wb") as f:
        f.truncate(MIN_WEIGHT_BYTES if big else MIN_WEIGHT_BYTES - 1)
    child = (
        "import os, sys\nfrom engine.hugepages import reexec_for_model\nprint('start', flush=True)\n"
        "reexec_for_model(sys.argv[1:])\nprint(os.environ.get('GLIBC_TUNABLES'))"
    )
    env = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
    out = subprocess.run(
        [sys.executable, "-c", child, "--config", json.dumps({"model": str(tmp_path)})],
        env=env,
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    ).stdout.splitlines()
    assert out == (["start", "start", f"{TUNABLE}=1"] if big else ["start", "None"])
