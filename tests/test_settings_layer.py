"""Settings only through the config layer: no module of server/ or engine/ outside it reads a SPINDLE_* variable
(os.environ[...], os.environ.get(...), os.getenv(...), os.environ.pop(...)). Writes for child processes are fine."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PREFIX = "SPINDLE_"
# The config layers: the server's ServerConfig and ServerEnv, the engine's EngineEnv, and the cache folder the
# server, the engine and the demo builders share.
ALLOWED = ("server/config/", "engine/config.py", "engine/cache_root.py")
_READERS = frozenset({"get", "getenv", "pop", "setdefault"})


def _is_environ(node: ast.expr) -> bool:
    """`os.environ` or a bare `environ` (from os import environ)."""
    if isinstance(node, ast.Attribute):
        return node.attr == "environ"
    return isinstance(node, ast.Name) and node.id == "environ"


def _spindle_literal(node: ast.expr | None) -> bool:
    """A SPINDLE_ string literal, or an f-string starting with one."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value.startswith(PREFIX)
    if isinstance(node, ast.JoinedStr) and node.values:
        return _spindle_literal(node.values[0])
    return False


def _reads(tree: ast.AST) -> list[int]:
    """The lines reading a SPINDLE_ variable: environ[...] loaded, environ.get/pop/setdefault(...), getenv(...)."""
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load) and _is_environ(node.value):
            if _spindle_literal(node.slice):
                lines.append(node.lineno)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.args:
            func = node.func
            on_environ = func.attr in _READERS and _is_environ(func.value)
            getenv = func.attr == "getenv"
            if (on_environ or getenv) and _spindle_literal(node.args[0]):
                lines.append(node.lineno)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getenv" and node.args:
            if _spindle_literal(node.args[0]):
                lines.append(node.lineno)
    return lines


def spindle_reads_outside_config() -> list[str]:
    found = []
    for package in ("server", "engine"):
        for path in sorted((ROOT / package).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if rel.startswith(ALLOWED):
                continue
            found += [f"{rel}:{line}" for line in _reads(ast.parse(path.read_text(), rel))]
    return found


def test_no_spindle_variable_is_read_outside_the_config_layer() -> None:
    found = spindle_reads_outside_config()
    assert not found, (
        "SPINDLE_* variables read outside server/config/ and engine/config.py (add a field to ServerEnv or "
        f"EngineEnv and read it there): {found}"
    )


def test_the_scan_sees_every_way_of_reading() -> None:
    """The scan must be able to fail: each form of read is found, writes are not."""
    source = "\n".join(
        [
            'a = os.environ["SPINDLE_A"]',
            'b = os.environ.get("SPINDLE_B", "1")',
            'c = os.getenv("SPINDLE_C")',
            'd = environ.pop("SPINDLE_D")',
            'e = os.environ.get(f"SPINDLE_{x}")',
            'os.environ["SPINDLE_LOG_LEVEL"] = level',
            'f = os.environ.get("HOME")',
        ]
    )
    assert _reads(ast.parse(source)) == [1, 2, 3, 4, 5]
