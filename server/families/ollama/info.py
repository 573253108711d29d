"""Ollama's model routes: GET /api/tags (the models), GET /api/ps (the loaded ones), POST /api/show (one model's
details, template and capabilities), GET and /api/version."""

from __future__ import annotations

import hashlib
import json
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import anyio
import msgspec

from server.app_state import AppState
from server.families.ollama import API_VERSION, FAMILY
from server.families.ollama.keep_alive import expires_at
from server.families.ollama.protocol import encoder, show_decoder
from server.families.ollama.translate import decode_error
from server.http.asgi import ClientGone, Receive, Scope, Send, read_body, send_json
from server.http.errors import APIError
from server.multimodal.images import image_support
from server.render.renderer import load_chat_template
from server.request.fim import fim_tokens

_enc = encoder.encode


def _folder_facts(folder: str) -> dict[str, Any]:
    """What Ollama lists per model, from the served folder: its size, time, architecture and weights' format."""
    path = Path(folder)
    files = [f for f in path.iterdir() if f.is_file()] if path.is_dir() else []
    config: dict[str, Any] = {}
    if (path / "config.json").is_file():
        config = json.loads((path / "config.json").read_text())
    modified = max((f.stat().st_mtime for f in files), default=0.0)
    family = str(config.get("model_type", "unknown"))
    return {
        "size": sum(f.stat().st_size for f in files if f.suffix in (".safetensors", ".gguf", ".bin")),
        "modified_at": datetime.fromtimestamp(modified, UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ"),
        "details": {
            "parent_model": "",
            "format": "gguf" if any(f.suffix == ".gguf" for f in files) else "safetensors",
            "family": family,
            "families": [family],
            "parameter_size": "",
            "quantization_level": str(config.get("torch_dtype", "")).upper(),
        },
        "max_len": int(config.get("max_position_embeddings", 0)),
    }


async def listed(name: str, folder: str) -> dict[str, Any]:
    """One model as /api/tags lists it (/api/ps adds what a loaded model has: `running`)."""
    facts = await anyio.to_thread.run_sync(_folder_facts, folder)
    return {
        "name": name,
        "model": name,
        "modified_at": facts["modified_at"],
        "size": facts["size"],
        "digest": hashlib.sha256(folder.encode()).hexdigest(),
        "details": facts["details"],
    }


def running(entry: dict[str, Any], context_length: int, until: float | None) -> dict[str, Any]:
    """A listed model as /api/ps shows a loaded one, `expires_at` the wall-clock time `until` (None: never)."""
    out = {k: v for k, v in entry.items() if k != "modified_at"}
    return {**out, "expires_at": expires_at(until), "size_vram": 0, "context_length": context_length}


async def model_entry(state: AppState) -> dict[str, Any]:
    return await listed(state.model_name, state.config.model.model_path)


class TagsRoute:
    def __init__(self, state: AppState) -> None:
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send_json(send, 200, _enc({"models": [await model_entry(self.state)]}))


class PsRoute:
    """The loaded model: this server's one, once it serves (a single model never unloads: `expires_at` says what
    the last request's keep_alive asked for)."""

    def __init__(self, state: AppState) -> None:
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        limits = self.state.limits
        if limits is None:
            await send_json(send, 200, b'{"models":[]}')
            return
        entry = running(await model_entry(self.state), limits.max_model_len, self.state.keep_until)
        await send_json(send, 200, _enc({"models": [entry]}))


def capabilities(state: AppState, template: str | None) -> list[str]:
    """What Ollama's clients look for to offer a feature (tools, images, infilling, thinking, embeddings)."""
    config = state.config
    if config.model.runner == "pooling":
        return ["embedding"]
    found = ["completion"]
    if template is not None and "tools" in template:
        found.append("tools")
    renderer = state.renderer
    if renderer is not None and fim_tokens(renderer.tokenizer) is not None:
        found.append("insert")
    if image_support(config.model.model_path) is not None:
        found.append("vision")
    if config.outputs.reasoning_parser is not None:
        found.append("thinking")
    return found


class ShowRoute:
    def __init__(self, state: AppState) -> None:
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            body = await read_body(receive, self.state.config.http.max_request_body)
            req = show_decoder.decode(body or b"{}")
            _, limits = self.state.require_renderer()
            self.state.check_model(req.model or req.name)
        except ClientGone:
            return
        except msgspec.DecodeError as e:
            await FAMILY.errors.send(send, decode_error(e))
            return
        except APIError as e:
            await FAMILY.errors.send(send, e)
            return
        model = self.state.config.model
        template = await anyio.to_thread.run_sync(load_chat_template, model.chat_template, Path(model.tokenizer_path))
        entry = await model_entry(self.state)
        family = entry["details"]["family"]
        answer = {
            "modelfile": f"FROM {model.model_path}\n",
            "parameters": "",
            "template": template or "",
            "details": entry["details"],
            "model_info": {"general.architecture": family, f"{family}.context_length": limits.max_model_len},
            "capabilities": capabilities(self.state, template),
            "modified_at": entry["modified_at"],
        }
        await send_json(send, 200, _enc(answer))


class OllamaVersionRoute:
    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send_json(send, 200, _enc({"version": API_VERSION}))
