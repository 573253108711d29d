"""Adapter folders refused with the reason named (rank, DoRA, bias, targets, missing / truncated weights, shapes),
and PEFT's rank / alpha patterns read as peft reads them; limits at, under and over --max-lora-rank."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest

from engine.lora.config import check_lora_settings, parse_lora_modules
from engine.lora.peft_files import AdapterError, BaseDims, digest, read_adapter
from engine.models.checkpoint_meta import read_config
from tests.helpers.lora import write_adapter


@pytest.fixture(scope="module")
def base(qwen2_ckpt: Path) -> BaseDims:
    return BaseDims.from_config(read_config(qwen2_ckpt))


@pytest.fixture(scope="module")
def good(qwen2_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_adapter(
        qwen2_ckpt,
        tmp_path_factory.mktemp("a") / "good",
        r=16,
        alpha=8,
        seed=1,
        use_rslora=True,
        targets=["q_proj", "v_proj", "down_proj"],
        rank_pattern={"v_proj": 8},
        alpha_pattern={"down_proj": 32},
    )


def copy(good: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(good, tmp_path / "copy"))


def edit_config(folder: Path, **changes: object) -> None:
    cfg = json.loads((folder / "adapter_config.json").read_text())
    (folder / "adapter_config.json").write_text(json.dumps(cfg | changes))


def test_reads_ranks_and_scalings_as_peft(good: Path, base: BaseDims) -> None:
    spec = read_adapter(str(good), base, 16)
    by = {(m.layer, m.name): m for m in spec.modules}
    assert set(by) == {(i, n) for i in range(2) for n in ("q_proj", "v_proj", "down_proj")}
    assert by[0, "q_proj"].rank == 16 and by[0, "q_proj"].scaling == 8 / math.sqrt(16)
    assert by[1, "v_proj"].rank == 8 and by[1, "v_proj"].scaling == 8 / math.sqrt(8)
    assert by[0, "down_proj"].scaling == 32 / math.sqrt(16)
    assert spec.rank == 16 and spec.digest == digest(good)


@pytest.mark.parametrize("max_rank, ok", [(8, False), (16, True), (32, True)])
def test_rank_limit(good: Path, base: BaseDims, max_rank: int, ok: bool) -> None:
    if ok:
        read_adapter(str(good), base, max_rank)
    else:
        with pytest.raises(AdapterError, match="rank 16 .* is above --max-lora-rank 8"):
            read_adapter(str(good), base, max_rank)


@pytest.mark.parametrize(
    "changes, why",
    [
        ({"use_dora": True}, "DoRA adapters"),
        ({"bias": "all"}, "bias 'all' is not supported"),
        ({"target_modules": ["q_proj", "lm_head"]}, r"unknown target modules \['lm_head'\]"),
        ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
        ({"peft_type": "IA3"}, "is not LoRA"),
        ({"r": 0}, "r must be a positive integer"),
    ],
)
def test_unsupported_configs_are_refused(
    good: Path, base: BaseDims, tmp_path: Path, changes: dict[str, object], why: str
) -> None:
    folder = copy(good, tmp_path)
    edit_config(folder, **changes)
    with pytest.raises(AdapterError, match=why):
        read_adapter(str(folder), base, 16)


def test_missing_and_truncated_files(good: Path, base: BaseDims, tmp_path: Path) -> None:
    with pytest.raises(AdapterError, match="no adapter folder"):
        read_adapter(str(tmp_path / "nothing"), base, 16)
    folder = copy(good, tmp_path)
    weights = folder / "adapter_model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[:-1])
    with pytest.raises(AdapterError, match="truncated"):
        read_adapter(str(folder), base, 16)
    weights.write_bytes(data[:5])
    with pytest.raises(AdapterError, match="truncated"):
        read_adapter(str(folder), base, 16)
    weights.unlink()
    with pytest.raises(AdapterError, match="has no adapter_model.safetensors"):
        read_adapter(str(folder), base, 16)


def test_missing_half_and_unknown_keys_and_bad_shapes(
    qwen2_ckpt: Path, good: Path, base: BaseDims, tmp_path: Path
) -> None:
    from safetensors.torch import load_file, save_file

    tensors = load_file(good / "adapter_model.safetensors")
    a_key = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    cases = [
        ({k: v for k, v in tensors.items() if k != a_key}, "missing weights: model.layers.0.self_attn.q_proj"),
        (tensors | {"base_model.model.lm_head.lora_A.weight": tensors[a_key].clone()}, "unknown target module"),
        (tensors | {a_key: tensors[a_key][:, :-1].contiguous()}, "do not fit the base"),
        ({k.replace("layers.1.", "layers.7."): v for k, v in tensors.items()}, "has only 2 layers"),
    ]
    for i, (t, why) in enumerate(cases):
        folder = Path(shutil.copytree(good, tmp_path / f"c{i}"))
        save_file(t, folder / "adapter_model.safetensors")
        with pytest.raises(AdapterError, match=why):
            read_adapter(str(folder), base, 16)


def test_moe_bases_take_attention_adapters_only(good: Path) -> None:
    moe = BaseDims.of(2, 64, 64, 32, None)
    with pytest.raises(AdapterError, match="no down_proj to adapt"):
        read_adapter(str(good), moe, 16)


def test_flag_checks_and_lora_modules() -> None:
    check_lora_settings(1, 16, 1, "auto")
    for args, why in [
        ((0, 16, None, "auto"), "--max-loras"),
        ((1, 12, None, "auto"), "--max-lora-rank"),
        ((2, 16, 1, "auto"), "--max-cpu-loras"),
        ((1, 16, None, "int8"), "--lora-dtype"),
    ]:
        with pytest.raises(ValueError, match=why):
            check_lora_settings(*args)  # type: ignore[arg-type]
    mods = parse_lora_modules(["a=/x", '{"name": "b", "path": "/y", "base_model_name": "m"}'])
    assert [(m.name, m.path, m.base_model_name) for m in mods] == [("a", "/x", None), ("b", "/y", "m")]
    assert parse_lora_modules('[{"name": "c", "path": "/z"}]')[0].path == "/z"
    for bad in ("a", "=x", '{"name": "b"}'):
        with pytest.raises(ValueError, match="--lora-modules"):
            parse_lora_modules([bad])
