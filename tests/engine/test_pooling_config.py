"""What a pooling engine computes, read from the checkpoint's files (engine/pooling_config.py): the task under
--convert, sentence-transformers' layouts old (boolean pooling keys, sentence_transformers.models.*) and new,
activations from config.json, prompts, and --pooler-config over all of it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from engine.models.checkpoint_meta import ModelLoadError
from engine.pooling_config import (
    check_pooler_overrides,
    classify_activation,
    labels,
    pooling_info,
    resolve_task,
    score_activation,
)

LEGACY_MODULES = [
    {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
    {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
]
LEGACY_POOLING = {
    "word_embedding_dimension": 64,
    "pooling_mode_cls_token": False,
    "pooling_mode_mean_tokens": False,
    "pooling_mode_max_tokens": False,
    "pooling_mode_mean_sqrt_len_tokens": False,
    "pooling_mode_lasttoken": False,
}


def folder(
    tmp_path: Path,
    modules: list[dict[str, Any]] | None = None,
    pooling: dict[str, Any] | None = None,
    prompts: dict[str, Any] | None = None,
) -> Path:
    if modules is not None:
        (tmp_path / "modules.json").write_text(json.dumps(modules))
    if pooling is not None:
        (tmp_path / "1_Pooling").mkdir()
        (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    if prompts is not None:
        (tmp_path / "config_sentence_transformers.json").write_text(json.dumps(prompts))
    return tmp_path


EMBED_CFG = {"architectures": ["Qwen2ForCausalLM"]}


@pytest.mark.parametrize(
    "key, kind",
    [("pooling_mode_cls_token", "CLS"), ("pooling_mode_mean_tokens", "MEAN"), ("pooling_mode_lasttoken", "LAST")],
)
@pytest.mark.parametrize("normalize", [False, True])
def test_legacy_sentence_transformers_layout(tmp_path: Path, key: str, kind: str, normalize: bool) -> None:
    modules = LEGACY_MODULES + (
        [{"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]
        if normalize
        else []
    )
    info = pooling_info(folder(tmp_path, modules, {**LEGACY_POOLING, key: True}), EMBED_CFG, "auto", {}, 64)
    assert (info.task, info.pooling_type, info.normalize) == ("embed", kind, normalize)


def test_new_layout_prompts_and_overrides(tmp_path: Path) -> None:
    modules = [{"path": "1_Pooling", "type": "sentence_transformers.sentence_transformer.modules.pooling.Pooling"}]
    f = folder(
        tmp_path,
        modules,
        {"pooling_mode": "cls", "include_prompt": True},
        {"prompts": {"query": "q: ", "document": ""}, "default_prompt_name": "query"},
    )
    info = pooling_info(f, {**EMBED_CFG, "is_matryoshka": True}, "auto", {}, 64)
    assert (info.pooling_type, info.normalize, info.is_matryoshka) == ("CLS", False, True)
    assert info.prompts == {"query": "q: ", "document": ""} and info.default_prompt_name == "query"
    over = pooling_info(
        f, EMBED_CFG, "auto", {"pooling_type": "MEAN", "normalize": True, "matryoshka_dimensions": [8]}, 64
    )
    assert (over.pooling_type, over.normalize, over.matryoshka_dimensions) == ("MEAN", True, [8])
    plain = pooling_info(tmp_path / "1_Pooling", EMBED_CFG, "auto", {}, 64)  # no sentence-transformers files
    assert (plain.pooling_type, plain.normalize, plain.prompts) == ("LAST", True, {})


@pytest.mark.parametrize(
    "pooling, why",
    [
        ({"pooling_mode": "max"}, "not supported"),
        ({**LEGACY_POOLING, "pooling_mode_mean_tokens": True, "pooling_mode_max_tokens": True}, "not supported"),
        ({"pooling_mode": "mean", "include_prompt": False}, "include_prompt"),
    ],
)
def test_unsupported_layouts_fail_the_load_unless_overridden(tmp_path: Path, pooling: dict[str, Any], why: str) -> None:
    f = folder(tmp_path, LEGACY_MODULES, pooling)
    with pytest.raises(ModelLoadError, match=why):
        pooling_info(f, EMBED_CFG, "auto", {}, 64)
    assert pooling_info(f, EMBED_CFG, "auto", {"pooling_type": "MEAN"}, 64).pooling_type == "MEAN"


def test_prompts_must_name_their_default(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="default_prompt_name"):
        pooling_info(
            folder(tmp_path, prompts={"prompts": {"a": "x"}, "default_prompt_name": "b"}), EMBED_CFG, "auto", {}, 64
        )


def test_task_and_activations() -> None:
    cls = {"architectures": ["LlamaForSequenceClassification"]}
    assert resolve_task(cls, "auto") == "classify" and resolve_task(cls, "embed") == "embed"
    assert resolve_task({"architectures": ["Qwen2Model"]}, "auto") == "embed"
    with pytest.raises(ModelLoadError, match="--convert classify"):
        resolve_task(EMBED_CFG, "classify")
    assert classify_activation({}, 3) == "softmax" and classify_activation({}, 1) == "sigmoid"
    assert classify_activation({"problem_type": "regression"}, 3) == "identity"
    assert classify_activation({"problem_type": "multi_label_classification"}, 3) == "sigmoid"
    assert score_activation({}) == "sigmoid"
    assert (
        score_activation({"sentence_transformers": {"activation_fn": "torch.nn.modules.linear.Identity"}}) == "identity"
    )
    assert score_activation({"sbert_ce_default_activation_function": "torch.nn.modules.activation.Tanh"}) == "tanh"
    with pytest.raises(ModelLoadError, match="not supported"):
        score_activation({"sentence_transformers": {"activation_fn": "my.Custom"}})
    assert labels({"id2label": {"0": "neg", "1": "pos"}}) == ["neg", "pos"]
    assert labels({"num_labels": 3, "id2label": {"1": "x"}}) == ["LABEL_0", "x", "LABEL_2"]


@pytest.mark.parametrize(
    "bad, why",
    [
        ({"pooling_type": "MAX"}, "pooling_type"),
        ({"normalize": 1}, "normalize"),
        ({"colour": 1}, "unknown keys"),
        ({"step_tag_id": 3}, "STEP only"),
        ({"pooling_type": "STEP", "step_tag_id": -1}, "token id"),
        ({"pooling_type": "STEP", "returned_token_ids": []}, "non-empty"),
        ({"matryoshka_dimensions": [0]}, ">= 1"),
        ({"use_activation": "yes"}, "use_activation"),
    ],
)
def test_pooler_overrides_are_checked(bad: dict[str, Any], why: str) -> None:
    with pytest.raises(ValueError, match=why):
        check_pooler_overrides(bad)
