"""docs/serving.md's flag list and SPINDLE_* names against the CLI parser and ServerConfig: fails when either drifts."""

from __future__ import annotations

import argparse
import dataclasses
import re
from pathlib import Path

import pytest

from engine.config import EngineEnv
from server.cli import build_parser, config_from_args
from server.config import _NOT_CONFIG, ENV_PREFIX, SETTINGS, ServerConfig, ServerEnv

SERVING = Path(__file__).resolve().parents[2] / "docs" / "serving.md"
_FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")
_ENV = re.compile(ENV_PREFIX + r"[A-Z0-9_]+")


def readme_flags() -> set[str]:
    """The long flags in docs/serving.md's first paragraph under "## Flags and environment" (`--help` names the
    command)."""
    section = SERVING.read_text().split("\n## Flags and environment\n", 1)[1]
    paragraph = section.strip().split("\n\n", 1)[0]
    return set(_FLAG.findall(paragraph)) - {"--help"}


def parser_actions() -> list[argparse.Action]:
    """The options `--help` shows, -h/--help itself left out."""
    return [
        a for a in build_parser()._actions if a.help != argparse.SUPPRESS and not isinstance(a, argparse._HelpAction)
    ]


def parser_flags() -> set[str]:
    return {o for a in parser_actions() for o in a.option_strings if o.startswith("--")}


def test_readme_lists_every_flag_of_the_parser() -> None:
    missing = parser_flags() - readme_flags()
    assert not missing, f"python -m server --help has flags docs/serving.md does not list: {sorted(missing)}"


def test_readme_lists_no_flag_the_parser_lacks() -> None:
    extra = readme_flags() - parser_flags()
    assert not extra, f"docs/serving.md lists flags python -m server --help does not have: {sorted(extra)}"


def test_every_flag_sets_a_server_config_field() -> None:
    """So "every flag has a SPINDLE_* variable" holds: the variable is the field's name."""
    fields = set(SETTINGS)
    assert {a.dest for a in parser_actions()} <= fields


def test_readme_spindle_variables_exist() -> None:
    names = {m[len(ENV_PREFIX) :].lower() for m in _ENV.findall(SERVING.read_text())}
    fields = set(SETTINGS)
    unknown = names - fields - _NOT_CONFIG
    assert not unknown, f"docs/serving.md names SPINDLE_* variables nothing reads: {sorted(unknown)}"


def test_settings_without_a_flag_are_in_the_readme() -> None:
    """A setting only a variable can change must at least be written down."""
    flagged = {a.dest for a in parser_actions()}
    env_only = set(SETTINGS) - flagged
    named = set(_ENV.findall(SERVING.read_text()))
    undocumented = sorted(n for n in env_only if f"{ENV_PREFIX}{n.upper()}" not in named)
    assert not undocumented, f"settings with no flag and no mention in docs/serving.md: {undocumented}"


def test_size_settings_read_sizes_as_flags_and_variables() -> None:
    """--max-request-body and SPINDLE_MAX_REQUEST_BODY take "32MiB" as docs/serving.md writes it, or bytes."""
    assert config_from_args(["--max-request-body", "1MiB"]).http.max_request_body == 1 << 20
    assert config_from_args(["--max-request-body", "4096"]).http.max_request_body == 4096
    assert ServerConfig.from_env({"SPINDLE_MAX_REQUEST_BODY": "32MiB"}).http.max_request_body == 32 << 20


def test_env_only_knobs_are_in_the_readme_and_not_settings() -> None:
    """ServerEnv's and EngineEnv's variables are written down and never mistaken for unknown settings."""
    named = set(_ENV.findall(SERVING.read_text()))
    for env_class in (ServerEnv, EngineEnv):
        for f in dataclasses.fields(env_class):
            assert f"{ENV_PREFIX}{f.name.upper()}" in named, f"docs/serving.md does not list {f.name.upper()}"
            assert f.name in _NOT_CONFIG or f.name in SETTINGS, f"{f.name}: neither a setting nor in _NOT_CONFIG"


def test_server_env_reads_its_variables() -> None:
    assert ServerEnv.read({}) == ServerEnv()
    env = ServerEnv.read({"SPINDLE_OUTPUT_CHUNK": "64", "SPINDLE_DIRECT_WRITE": "off"})
    assert (env.output_chunk, env.direct_write) == (64, False)
    with pytest.raises(ValueError, match="SPINDLE_OUTPUT_CHUNK"):
        ServerEnv.read({"SPINDLE_OUTPUT_CHUNK": "x"})
