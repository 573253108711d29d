"""Headless Chromium for the browser tests: the distribution's package (.ci/run installs `chromium` with apt), driven by
Playwright without its own browser download (`playwright install` needs a host these machines cannot reach)."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest

CANDIDATES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")


def chromium_path() -> str:
    """SPINDLE_CHROMIUM, else the first Chromium on PATH; a missing browser fails the test with what to install."""
    path = os.environ.get("SPINDLE_CHROMIUM") or next(filter(None, map(shutil.which, CANDIDATES)), None)
    if path is None:
        pytest.fail(
            "no Chromium for the browser tests: `apt-get install chromium` (.ci/run does), "
            "or point SPINDLE_CHROMIUM at one"
        )
    return path


@contextmanager
def launch() -> Iterator[Any]:
    """A headless Chromium browser (Playwright's sync API); closed on exit."""
    from playwright.sync_api import sync_playwright  # why here: only the browser tests load Playwright

    with sync_playwright() as pw:
        # --no-sandbox: CI runs as root, where Chromium refuses its sandbox
        browser = pw.chromium.launch(
            executable_path=chromium_path(), headless=True, args=["--no-sandbox", "--disable-dev-shm-usage"]
        )
        try:
            yield browser
        finally:
            browser.close()
