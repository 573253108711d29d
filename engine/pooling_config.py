"""What a `--runner pooling` engine computes, read without torch (the API server's config checks import it too).

The task: `--convert auto` takes "classify" for a `*ForSequenceClassification` checkpoint (its `score` head) and
"embed" for every other decoder. The pooler, lowest precedence first: the task's defaults (LAST; embeddings
L2-normalized; classifiers' softmax, or sigmoid for one label), a sentence-transformers layout (`modules.json`
naming a Pooling module whose `config.json` gives the mode, and a Normalize module or not), then `--pooler-config`.
`config_sentence_transformers.json` gives the prompts an input type may put before a text (Cohere's /v2/embed).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from engine.messages import PoolingInfo
from engine.models.checkpoint_meta import ModelLoadError, read_json

POOLING_TYPES = ("LAST", "CLS", "MEAN", "ALL", "STEP")
CONVERTS = ("auto", "embed", "classify")
SEQ_CLS_SUFFIX = "ForSequenceClassification"
# --pooler-config keys (vLLM's spelling); the Matryoshka ones declare which `dimensions` the embeddings accept
POOLER_KEYS = (
    "pooling_type",
    "normalize",
    "use_activation",
    "step_tag_id",
    "returned_token_ids",
    "is_matryoshka",
    "matryoshka_dimensions",
)
# sentence-transformers' pooling modes -> ours (the legacy boolean keys name them pooling_mode_<mode>)
_ST_MODES = {"cls": "CLS", "cls_token": "CLS", "mean": "MEAN", "mean_tokens": "MEAN", "lasttoken": "LAST"}
# a cross-encoder's activation as sentence-transformers stores it (config.json "sentence_transformers")
_ST_ACTIVATIONS = {"Sigmoid": "sigmoid", "Identity": "identity", "Tanh": "tanh"}


def check_pooler_overrides(cfg: dict[str, Any]) -> None:
    """--pooler-config's keys and types (ValueError naming the flag)."""
    unknown = sorted(set(cfg) - set(POOLER_KEYS))
    if unknown:
        raise ValueError(f"--pooler-config: unknown keys {unknown}; known: {', '.join(POOLER_KEYS)}")
    kind = cfg.get("pooling_type", "LAST")
    if not isinstance(kind, str) or kind.upper() not in POOLING_TYPES:
        raise ValueError(f"--pooler-config: pooling_type must be one of {', '.join(POOLING_TYPES)}, got {kind!r}")
    for key in ("normalize", "use_activation", "is_matryoshka"):
        if key in cfg and not isinstance(cfg[key], bool):
            raise ValueError(f"--pooler-config: {key} must be true or false, got {cfg[key]!r}")
    for key in ("step_tag_id", "returned_token_ids"):
        if key in cfg and str(kind).upper() != "STEP":
            raise ValueError(f"--pooler-config: {key} applies to pooling_type STEP only")
    step = cfg.get("step_tag_id")
    if step is not None and (type(step) is not int or step < 0):
        raise ValueError(f"--pooler-config: step_tag_id must be a token id (an integer >= 0), got {step!r}")
    for key in ("matryoshka_dimensions", "returned_token_ids"):
        ids = cfg.get(key)
        low = 1 if key == "matryoshka_dimensions" else 0
        if ids is not None and (
            not isinstance(ids, list) or not ids or not all(type(d) is int and d >= low for d in ids)
        ):
            raise ValueError(f"--pooler-config: {key} must be a non-empty list of integers >= {low}, got {ids!r}")


def resolve_task(cfg: dict[str, Any], convert: str) -> str:
    """embed or classify: --convert, or (auto) the architecture's."""
    archs = [str(a) for a in cfg.get("architectures") or []]
    seq_cls = any(a.endswith(SEQ_CLS_SUFFIX) for a in archs)
    if convert == "classify" and not seq_cls:
        raise ModelLoadError(
            f"--convert classify needs a *{SEQ_CLS_SUFFIX} checkpoint (one with a `score` head); "
            f"this one is {archs or 'of unknown architecture'}. Use --convert embed"
        )
    if convert == "auto":
        return "classify" if seq_cls else "embed"
    return convert


def _st_pooling_mode(conf: dict[str, Any]) -> list[str]:
    """The modes a sentence-transformers Pooling config turns on (v5+: "pooling_mode"; before: booleans)."""
    mode = conf.get("pooling_mode")
    if mode is not None:
        return [mode] if isinstance(mode, str) else [str(m) for m in mode]
    return [k.removeprefix("pooling_mode_") for k, v in conf.items() if k.startswith("pooling_mode_") and v is True]


def sentence_transformers_pooler(folder: Path, with_mode: bool = True) -> dict[str, Any]:
    """pooling_type and normalize from modules.json (+ its Pooling module's config.json); {} without them.

    with_mode False (--pooler-config names the pooling type): normalize only; the mode is not read."""
    path = folder / "modules.json"
    if not path.exists():
        return {}
    try:
        modules = json.loads(path.read_text())
    except ValueError as e:
        raise ModelLoadError(f"{path} is not valid JSON: {e}") from e
    if not isinstance(modules, list):
        raise ModelLoadError(f"{path} should hold a JSON list of modules")
    kinds = {str(m.get("type", "")).rsplit(".", 1)[-1]: m for m in modules if isinstance(m, dict)}
    found: dict[str, Any] = {"normalize": "Normalize" in kinds}
    pooling = kinds.get("Pooling")
    if pooling is None or not with_mode:
        return found
    conf_path = folder / str(pooling.get("path", "")) / "config.json"
    conf = read_json(conf_path) if conf_path.exists() else {}
    modes = _st_pooling_mode(conf) or ["mean"]  # sentence-transformers' own default
    if len(modes) != 1 or modes[0] not in _ST_MODES:
        raise ModelLoadError(
            f"{conf_path}: pooling mode {modes} is not supported; supported: cls, mean, lasttoken "
            "(or set --pooler-config '{\"pooling_type\": ...}')"
        )
    found["pooling_type"] = _ST_MODES[modes[0]]
    if conf.get("include_prompt") is False and found["pooling_type"] != "LAST":
        raise ModelLoadError(
            f"{conf_path}: include_prompt false (prompt tokens left out of the pooling) is not "
            "supported; set --pooler-config '{\"pooling_type\": ...}' to pool every token"
        )
    return found


def sentence_transformers_prompts(folder: Path) -> tuple[dict[str, str], str | None]:
    """config_sentence_transformers.json's prompts and default prompt name."""
    path = folder / "config_sentence_transformers.json"
    if not path.exists():
        return {}, None
    conf = read_json(path)
    prompts = conf.get("prompts") or {}
    if not isinstance(prompts, dict) or not all(isinstance(v, str) for v in prompts.values()):
        raise ModelLoadError(f"{path}: prompts must map names to texts")
    default = conf.get("default_prompt_name")
    if default is not None and default not in prompts:
        raise ModelLoadError(f"{path}: default_prompt_name {default!r} is not among the prompts {sorted(prompts)}")
    return {str(k): v for k, v in prompts.items()}, default


def classify_activation(cfg: dict[str, Any], num_labels: int) -> str:
    """As transformers' loss for the problem type (and vLLM): regression none, multi-label sigmoid, else softmax
    (sigmoid for one label)."""
    problem = cfg.get("problem_type")
    if problem == "regression":
        return "identity"
    if problem == "multi_label_classification" or num_labels < 2:
        return "sigmoid"
    return "softmax"


def score_activation(cfg: dict[str, Any]) -> str:
    """A cross-encoder's score activation: sentence-transformers' saved activation_fn, else sigmoid."""
    path = (cfg.get("sentence_transformers") or {}).get("activation_fn") or cfg.get(
        "sbert_ce_default_activation_function"
    )
    if path is None:
        return "sigmoid"
    name = str(path).rsplit(".", 1)[-1]
    if name not in _ST_ACTIVATIONS:
        raise ModelLoadError(
            f"config.json: the cross-encoder activation {path!r} is not supported; supported: "
            f"{', '.join(_ST_ACTIVATIONS)}"
        )
    return _ST_ACTIVATIONS[name]


def labels(cfg: dict[str, Any]) -> list[str]:
    """id2label in label order (num_labels, else id2label's size; LABEL_i where unnamed)."""
    id2label = {int(k): str(v) for k, v in (cfg.get("id2label") or {}).items()}
    n = int(cfg.get("num_labels") or len(id2label) or 2)
    return [id2label.get(i, f"LABEL_{i}") for i in range(n)]


def pooling_info(
    folder: Path, cfg: dict[str, Any], convert: str, overrides: dict[str, Any], hidden_size: int
) -> PoolingInfo:
    """The task and pooler this engine runs (what Ready reports)."""
    check_pooler_overrides(overrides)
    task = resolve_task(cfg, convert)
    settings: dict[str, Any] = {"pooling_type": "LAST", "normalize": True}
    settings.update(sentence_transformers_pooler(folder, "pooling_type" not in overrides))
    settings.update({k: v for k, v in overrides.items() if k in ("pooling_type", "normalize")})
    prompts, default_prompt = sentence_transformers_prompts(folder)
    dims = overrides.get("matryoshka_dimensions", cfg.get("matryoshka_dimensions"))
    names = labels(cfg) if task == "classify" else []
    return PoolingInfo(
        task=task,
        pooling_type=str(settings["pooling_type"]).upper(),
        hidden_size=hidden_size,
        normalize=bool(settings["normalize"]),
        use_activation=bool(overrides.get("use_activation", True)),
        activation=classify_activation(cfg, len(names)) if names else "softmax",
        score_activation=score_activation(cfg) if names else "sigmoid",
        labels=names,
        prompts=prompts,
        default_prompt_name=default_prompt,
        is_matryoshka=bool(overrides.get("is_matryoshka", cfg.get("is_matryoshka", False))),
        matryoshka_dimensions=[int(d) for d in dims] if isinstance(dims, list) else None,
    )
