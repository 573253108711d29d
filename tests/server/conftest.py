"""Server unit tests run on Trio (the default worker) unless a test says otherwise."""

import pytest


@pytest.fixture
def anyio_backend() -> str:
    return "trio"
