"""server/http/deploy.py and the deployment flags: values as vLLM writes them, and clear errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from server.cli import config_from_args
from server.config import ServerConfig
from server.http.root_path import route_path


def test_cors_lists_read_as_json_from_flags_and_env() -> None:
    c = config_from_args(["--allowed-origins", '["https://a.example", "https://b.example"]', "--allow-credentials"])
    assert c.http.allowed_origins == ("https://a.example", "https://b.example") and c.http.allow_credentials
    assert c.http.allowed_methods == ("*",) and c.http.allowed_headers == ("*",)
    env = ServerConfig.from_env({"SPINDLE_ALLOWED_METHODS": '["GET", "POST"]'})
    assert env.http.allowed_methods == ("GET", "POST") and env.http.allowed_origins == ()
    with pytest.raises(ValueError, match="--allowed-origins"):
        config_from_args(["--allowed-origins", "https://a.example"])
    with pytest.raises(ValueError, match="list of strings"):
        config_from_args(["--allowed-headers", '{"a": 1}'])


def test_tls_files_go_together_and_must_exist(tmp_path: Path) -> None:
    key = tmp_path / "key.pem"
    key.write_text("x")
    with pytest.raises(ValueError, match="give both"):
        config_from_args(["--ssl-keyfile", str(key)])
    with pytest.raises(ValueError, match="no such file"):
        config_from_args(["--ssl-keyfile", str(key), "--ssl-certfile", str(tmp_path / "missing.pem")])


@pytest.mark.parametrize("bad", ["llm", "/llm/"])
def test_root_path_shape(bad: str) -> None:
    with pytest.raises(ValueError, match="--root-path"):
        config_from_args(["--root-path", bad])


def test_route_path() -> None:
    assert route_path({"path": "/llm/health", "root_path": "/llm"}) == "/health"
    assert route_path({"path": "/health", "root_path": "/llm"}) == "/health"  # the proxy stripped it
    assert route_path({"path": "/llmx/health", "root_path": "/llm"}) == "/llmx/health"
    assert route_path({"path": "/health"}) == "/health"


def test_metrics_compat_and_render_subcommand() -> None:
    assert config_from_args(["--metrics-compat", "vllm"]).outputs.metrics_compat == "vllm"
    with pytest.raises(ValueError, match="--metrics-compat"):
        config_from_args(["--metrics-compat", "sglang"])
    from server.cli import main

    assert main(["render"]) == 2  # needs --model
