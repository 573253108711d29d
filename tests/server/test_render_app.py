"""The render-only server's import graph stays torch-free (tests/e2e/test_render_only.py checks the processes)."""

from __future__ import annotations

import subprocess
import sys


def test_render_server_modules_import_no_torch() -> None:
    code = ("import sys, server.cli, server.app, server.render_app, server.render.worker, server.metrics_compat, "
            "server.deploy; bad = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'triton')); "
            "assert not bad, bad")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
