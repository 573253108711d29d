"""The API side's adapter registry: names checked against the base, and the set shared by two API processes
(two registries over one folder, as under --api-server-count) staying equal through loads and unloads."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.lora.config import LoRAModule
from engine.lora.peft_files import AdapterError
from server.lora.adapters import LoRARegistry
from server.lora.shared import SharedAdapters
from tests.helpers.lora import write_adapter


@pytest.fixture(scope="module")
def adapter(qwen2_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_adapter(qwen2_ckpt, tmp_path_factory.mktemp("reg") / "a", r=8, targets=["q_proj"], seed=1)


def test_static_adapters_and_names(qwen2_ckpt: Path, adapter: Path) -> None:
    reg = LoRARegistry.from_files(str(qwen2_ckpt), 16, "tiny", (LoRAModule("a", str(adapter), "m"),))
    a = reg.get("a")
    assert a is not None and a.parent == "m" and a.rank == 8 and a.request.path == str(adapter)
    assert reg.get("tiny") is None and reg.get(None) is None
    with pytest.raises(AdapterError, match="base model's"):
        reg.check("tiny", str(adapter))
    with pytest.raises(AdapterError, match="already loaded"):
        reg.add(reg.check("a", str(adapter)))
    reg.add(reg.check("a", str(adapter)), replace=True)
    with pytest.raises(ValueError, match="--lora-modules b=/nope: no adapter folder"):
        LoRARegistry.from_files(str(qwen2_ckpt), 16, "tiny", (LoRAModule("b", "/nope"),))


def test_two_processes_share_one_set(qwen2_ckpt: Path, adapter: Path, tmp_path: Path) -> None:
    one, two = (
        LoRARegistry.from_files(str(qwen2_ckpt), 16, "tiny", (LoRAModule("a", str(adapter)),)) for _ in range(2)
    )
    one.shared, two.shared = SharedAdapters(str(tmp_path)), SharedAdapters(str(tmp_path))
    one.add(one.check("x", str(adapter)))
    assert set(two.adapters) == {"a", "x"}
    with pytest.raises(AdapterError, match="already loaded"):
        two.add(two.check("x", str(adapter)))
    assert two.remove("a") and not two.remove("a")
    assert set(one.adapters) == {"x"} and one.get("a") is None
