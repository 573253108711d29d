"""server/fleet/catalog.py and routing.py: what a models folder serves and under which names, models.yaml's
settings (checked at start-up), the flags --models-dir refuses, and the model a request body names."""

from __future__ import annotations

from pathlib import Path

import pytest

from server.config import ServerConfig
from server.fleet.catalog import scan
from server.fleet.routing import routing_of
from server.http.errors import APIError


def folder(tmp_path: Path) -> Path:
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text("{}")
    (tmp_path / "not-a-model").mkdir()  # no config.json
    (tmp_path / "small.gguf").write_bytes(b"")
    (tmp_path / "notes.txt").write_text("")
    (tmp_path / "linked").symlink_to(tmp_path / "hf")
    return tmp_path


def test_folders_gguf_files_and_symlinks_are_served_by_name(tmp_path: Path) -> None:
    found = scan(folder(tmp_path))
    assert sorted(found) == ["hf", "linked", "small"]
    assert found["linked"].path == tmp_path / "linked"


def test_models_yaml_settings_become_that_models_config(tmp_path: Path) -> None:
    (folder(tmp_path) / "models.yaml").write_text(
        "hf:\n  max-model-len: 128\n  kv_cache_memory: 8MiB\n  dtype: float32\n  tool-call-parser: hermes\n"
    )
    base = ServerConfig.from_settings(models_dir=str(tmp_path), max_model_len=512)
    entries = scan(tmp_path)
    hf = entries["hf"].config(base)
    assert (hf.model.max_model_len, hf.engine.kv_cache_memory, hf.model.dtype) == (128, 8 << 20, "float32")
    assert hf.outputs.tool_call_parser == "hermes" and hf.model.model_name == "hf"
    assert hf.models.models_dir is None and hf.http.disable_ui
    (tmp_path / "models.yaml").write_text(
        "hf:\n  enable-lora: true\n  lora-modules:\n    - sql=/adapters/sql\n    - {name: chat, path: /adapters/chat}\n"
    )
    modules = scan(tmp_path)["hf"].config(base).lora.lora_modules
    assert [(m.name, m.path) for m in modules] == [("sql", "/adapters/sql"), ("chat", "/adapters/chat")]
    linked = entries["linked"].config(base)  # the server-wide flags for a model models.yaml does not name
    assert (linked.model.max_model_len, linked.model.dtype, linked.model.model_name) == (512, "auto", "linked")


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ("hf:\n  port: 9000\n", "'port' is not a per-model setting"),
        ("hf:\n  max-model-lenn: 9\n", "'max-model-lenn' is not a per-model setting"),
        ("absent:\n  dtype: float32\n", "settings for models it does not hold: absent"),
        ("- hf\n", "expected a mapping"),
    ],
)
def test_bad_models_yaml_stops_start_up(tmp_path: Path, text: str, error: str) -> None:
    (folder(tmp_path) / "models.yaml").write_text(text)
    with pytest.raises(ValueError, match=error):
        scan(tmp_path)


@pytest.mark.parametrize(
    "settings", [{"api_server_count": 2, "data_parallel_size": 2}, {"model": "/x"}, {"tensor_parallel_size": 2}]
)
def test_models_dir_refuses_what_it_does_not_combine_with(settings: dict[str, object]) -> None:
    with pytest.raises(ValueError, match="--models-dir"):
        ServerConfig.from_settings(models_dir="/tmp", **settings)


def test_the_model_a_body_names() -> None:
    json_scope = {"headers": [(b"content-type", b"application/json")]}
    assert routing_of(json_scope, b'{"model": "a", "stream": true, "messages": []}') == ("a", True)
    assert routing_of(json_scope, b'{"prompt": "x"}') == (None, False)
    with pytest.raises(APIError):
        routing_of(json_scope, b'{"model": 3}')
    form = (
        b'--b\r\nContent-Disposition: form-data; name="file"; filename="a.wav"\r\n\r\nRIFF\r\n'
        b'--b\r\nContent-Disposition: form-data; name="model"\r\n\r\nwhisper\r\n--b--\r\n'
    )
    form_scope = {"headers": [(b"content-type", b"multipart/form-data; boundary=b")]}
    assert routing_of(form_scope, form) == ("whisper", False)
