"""The family checkpoints (tests/engine/models/families.py) as a session fixture."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.engine.models.families import build_family


@pytest.fixture(scope="session")
def family_ckpt(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Parametrize with indirect=True over FAMILIES' names; built once per session."""
    cache: dict[str, Path] = request.config.__dict__.setdefault("_family_ckpts", {})
    arch = str(request.param)
    if arch not in cache:
        cache[arch] = build_family(tmp_path_factory.mktemp("families"), arch)
    return cache[arch]
