"""`python -m server` as a user types it: every configuration error is one line on stderr and exit status 2 (a
path that is not there, a name that is not known with the closest one suggested, a mistyped flag with the closest
flag, a port in use with its address), and --help fits a screen, grouped by concern, --help=all and --help=GROUP
listing the rest."""

from __future__ import annotations

import socket
import subprocess
import sys
from collections.abc import Iterator

import pytest

from server.cli import build_parser
from server.cli_help import COMMON, GROUP_OF, GROUPS


def spindle(*args: str) -> subprocess.CompletedProcess[str]:
    env_free = {"COLUMNS": "100"}
    import os

    return subprocess.run(
        [sys.executable, "-m", "server", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **env_free},
    )


def one_line_error(*args: str) -> str:
    out = spindle(*args)
    assert out.returncode == 2, (out.returncode, out.stderr[-2000:])
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr
    assert "Running on" not in out.stderr + out.stdout
    return lines[0]


def test_a_model_path_that_is_not_there() -> None:
    assert one_line_error("--model", "/nonexistent") == "spindle: no such file or folder: /nonexistent"


def test_an_unknown_model_name_lists_the_known_ones_and_suggests_the_closest() -> None:
    line = one_line_error("--model", "smolm2")
    assert "not a known model name" in line and "smollm2" in line and "demo" in line, line
    assert line.endswith("did you mean smollm2?"), line


def test_a_mistyped_flag_names_the_closest_flag() -> None:
    line = one_line_error("--modle", "x")
    assert "--modle" in line and "did you mean --model?" in line, line


@pytest.fixture
def taken_port() -> Iterator[int]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


def test_a_port_in_use_names_the_address(taken_port: int) -> None:
    line = one_line_error("--model", "demo", "--port", str(taken_port))
    assert f"127.0.0.1:{taken_port}" in line and "in use" in line, line


def test_short_help_fits_a_screen_grouped_by_concern() -> None:
    out = spindle("--help")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert len(lines) <= 60, out.stdout
    for title in ("model:", "serving:", "scheduling:", "parallel:", "logging and metrics:"):
        assert any(line.startswith(title) for line in lines), (title, out.stdout)
    assert "smollm2" in out.stdout and ".gguf" in out.stdout  # --model says what it takes
    assert "--help=all" in out.stdout and "--help=GROUP" in out.stdout
    assert "--max-stop-strings" not in out.stdout  # the rest is one --help=... away


def test_help_all_lists_every_flag_and_a_group_only_its_own() -> None:
    flags = {
        o for a in build_parser()._actions for o in a.option_strings if o.startswith("--") and a.help != "==SUPPRESS=="
    }
    every = spindle("--help=all").stdout
    assert {f for f in flags if f not in every} == set()
    lora = spindle("--help=lora").stdout
    assert "--max-lora-rank" in lora and "--max-num-seqs" not in lora
    assert one_line_error("--help=nope").startswith("spindle: --help takes all or one of model, serving")


def test_every_flag_has_a_group_and_the_short_form_names_real_flags() -> None:
    flags = {o for a in build_parser()._actions for o in a.option_strings if o.startswith("--") and o != "--help"}
    hidden = {"--enable-prefix-caching"}
    assert flags - hidden <= set(GROUP_OF), sorted(flags - hidden - set(GROUP_OF))
    assert set(GROUP_OF.values()) <= set(GROUPS) and COMMON <= flags
