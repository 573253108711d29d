"""How a setting's text becomes its value, and the checks several sub-configs share; errors name the flag.

The same parsing serves flags (server/cli.py) and SPINDLE_* variables (server/config/server.py).
"""

from __future__ import annotations

import json
from typing import Any, get_args

from engine.config import parse_bytes
from engine.lora.config import parse_lora_modules

# Byte sizes: written "2GiB", "512MiB", "1.5G" or plain bytes, as env vars and as flags.
SIZE_FIELDS = (
    "kv_cache_memory",
    "max_request_body",
    "max_structured_output_size",
    "responses_store_max_bytes",
    "batch_max_file_bytes",
    "state_snapshot_memory",
)
# JSON objects: written as JSON text, as env vars and as flags.
JSON_FIELDS = ("default_chat_template_kwargs", "pooler_config", "limit_mm_per_prompt", "speculative_config")
# Lists of strings: written as a JSON list ('["https://a.example"]', vLLM's format), as env vars and as flags.
JSON_LIST_FIELDS = ("allowed_origins", "allowed_methods", "allowed_headers", "allowed_media_domains")


def flag(name: str) -> str:
    """A setting's flag: its field name, dashed."""
    return "--" + name.replace("_", "-")


def check_at_least_one(config: object, names: tuple[str, ...]) -> None:
    for name in names:
        if getattr(config, name) < 1:
            raise ValueError(f"{flag(name)} must be at least 1, got {getattr(config, name)}")


def check_unset_or_at_least_one(config: object, names: tuple[str, ...]) -> None:
    for name in names:
        value = getattr(config, name)
        if value is not None and value < 1:
            raise ValueError(f"{flag(name)} must be at least 1 (or unset for no limit), got {value}")


def check_positive(config: object, names: tuple[str, ...]) -> None:
    for name in names:
        if getattr(config, name) <= 0:
            raise ValueError(f"{flag(name)} must be positive, got {getattr(config, name)}")


def parse_json_object(name: str, text: str | dict[str, Any]) -> dict[str, Any]:
    """A JSON-object setting's value; the error names the flag."""
    if isinstance(text, dict):
        return text
    try:
        value = json.loads(text)
    except ValueError as e:
        raise ValueError(f"{flag(name)}: not JSON: {e}") from None
    if not isinstance(value, dict):
        raise ValueError(f'{flag(name)}: expected a JSON object, e.g. \'{{"pooling_type": "MEAN"}}\'')
    return value


def parse_json_list(name: str, text: str | list[str] | tuple[str, ...]) -> tuple[str, ...]:
    """A JSON-list-of-strings setting's value (vLLM's format: '["*"]'); the error names the flag."""
    if isinstance(text, (list, tuple)):
        value: Any = list(text)
    else:
        try:
            value = json.loads(text)
        except ValueError as e:
            raise ValueError(
                f"{flag(name)}: not JSON: {e}; expected a list, e.g. '[\"https://app.example\"]'"
            ) from None
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ValueError(f"{flag(name)}: expected a JSON list of strings, e.g. '[\"https://app.example\"]'")
    return tuple(value)


def parse_size(name: str, text: str | int) -> int:
    """A size setting's value in bytes; the error names the flag."""
    try:
        return parse_bytes(text)
    except ValueError as e:
        raise ValueError(f"{flag(name)}: {e}") from None


def parse_setting(name: str, hint: Any, raw: str, key: str) -> Any:
    """One SPINDLE_* variable's text as the field `name` (type `hint`) holds it; the error names `key`."""
    text = raw.strip()
    try:
        if name in SIZE_FIELDS:  # an optional size (state_snapshot_memory) is unset by "none", as other settings
            return None if type(None) in get_args(hint) and text.lower() in ("", "none", "null") else parse_bytes(text)
        if name == "api_keys":
            return tuple(k.strip() for k in text.split(",") if k.strip())
        if name in JSON_FIELDS:
            return parse_json_object(name, text)
        if name in JSON_LIST_FIELDS:
            return parse_json_list(name, text)
        if name == "lora_modules":
            return parse_lora_modules(text)
        return _parse_scalar(hint, text)
    except ValueError as e:
        raise ValueError(f"{key}={raw!r}: {e}") from None


def _parse_scalar(hint: Any, text: str) -> Any:
    args = set(get_args(hint))
    optional = type(None) in args
    if optional and text.lower() in ("", "none", "null"):
        return None
    base = next((a for a in args if a is not type(None)), hint) if args else hint
    if base is bool or hint is bool:
        if text.lower() in ("1", "true", "yes", "on"):
            return True
        if text.lower() in ("0", "false", "no", "off"):
            return False
        raise ValueError("expected true or false")
    if base is int or hint is int:
        return int(text)
    if base is float or hint is float:
        return float(text)
    return text
