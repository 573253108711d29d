"""Engine tests compute on one CPU thread: transformers' reference outputs and the core's agree bit for bit."""

from __future__ import annotations

import pytest
import torch

torch.set_num_threads(1)  # at collection too: module-scoped fixtures build models before any test runs


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    torch.set_num_threads(1)  # again per test: a test that changes it cannot leak its count into the next
